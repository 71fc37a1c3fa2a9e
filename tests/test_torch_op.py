"""facodegen's torch operators on the CPU: tracing with meta tensors goes through the fake
implementations, so torch.compile(fullgraph=True) and torch.export can be checked without a GPU
(tests/gpu/test_host_path.py runs the same on CUDA tensors)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import facodegen  # noqa: E402
from facodegen.ops import torch_op  # noqa: E402


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def recording_backend(graphs: list):
    """A torch.compile backend that keeps each graph's text and runs it as traced."""
    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward
    return backend


def test_compile_fullgraph_traces_the_op_with_no_warning():
    q, k = meta(2, 100, 8, 128), meta(2, 77, 2, 128)
    seen = []

    def layer(q, k, v):
        out, lse = facodegen.attention(q, k, v, causal=True, return_lse=True, block_n=64)
        return out * 2, lse

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = torch.compile(layer, fullgraph=True, backend=recording_backend(seen))(q, k, k)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
    assert len(seen) == 1 and "facodegen.attention" in seen[0] and "block_n=64" in seen[0]


def test_compile_with_out_uses_the_mutating_op():
    q, k = meta(1, 64, 4, 64), meta(1, 200, 4, 64)
    seen = []

    def f(q, k, v):
        out = torch.empty_like(q)
        facodegen.attention(q, k, v, causal=True, causal_alignment="top_left", out=out)
        return out

    assert torch.compile(f, fullgraph=True, backend=recording_backend(seen))(q, k, k).shape == q.shape
    assert "facodegen.attention_out" in seen[0]


def test_export_records_the_op():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return facodegen.attention(q, k, v, causal=True)

    q, k = meta(1, 128, 8, 128), meta(1, 128, 2, 128)
    program = torch.export.export(Attention(), (q, k, k))
    assert "torch.ops.facodegen.attention.default" in str(program.graph)


@pytest.mark.parametrize("knob, want", [({}, torch.bfloat16), ({"out_dtype": "fp16"}, torch.float16)])
def test_fp8_fake_output_dtype(knob, want):
    q = meta(1, 64, 2, 128, dtype=torch.float8_e4m3fn)
    d = torch.empty((), dtype=torch.float32, device="meta")

    def f(q, k, v):
        return facodegen.attention(q, k, v, q_descale=d, k_descale=d, v_descale=d, **knob)

    assert torch.compile(f, fullgraph=True, backend="eager")(q, q, q).dtype == want


def test_knobs_round_trip_and_refuse_what_a_schema_cannot_carry():
    fields = {"block_n": 64, "pingpong": False, "v_layout": "row", "softmax_chains": 2}
    assert torch_op.decode_knobs(torch_op.encode_knobs(fields)) == fields
    with pytest.raises(TypeError, match="block_n="):
        torch_op.encode_knobs({"block_n": [64]})


def test_requires_grad_records_the_backward_while_tracing():
    q = meta(1, 16, 2, 64).requires_grad_(True)
    out, lse = torch.compile(lambda q: facodegen.attention(q, q.detach(), q.detach(), return_lse=True),
                             fullgraph=True, backend="aot_eager")(q)
    assert out.requires_grad and out.grad_fn is not None   # tests/test_backward.py: the rest of autograd
    assert not lse.requires_grad


@pytest.mark.parametrize("grad", [False, True])
def test_a_meta_tensor_in_eager_is_refused_by_name(grad):
    """Eager calls launch (with a gradient recorded or not): a meta tensor is refused as a CPU one is."""
    q = meta(1, 16, 2, 64).requires_grad_(grad)
    with pytest.raises(TypeError, match="q is a torch tensor on meta"):
        facodegen.attention(q, meta(1, 16, 2, 64), meta(1, 16, 2, 64))


def test_compile_and_export_carry_the_variants():
    """window_size, softcap and sinks reach the op as arguments (and the sinks tensor as an input)
    under torch.compile(fullgraph=True) and torch.export; the fake shapes are the plain call's."""
    q, k = meta(2, 100, 8, 128), meta(2, 77, 2, 128)
    sinks = meta(8, dtype=torch.float32)
    seen = []

    def layer(q, k, v, sinks):
        return facodegen.attention(q, k, v, causal=True, window_size=(64, 0), softcap=30.0, sinks=sinks,
                                   return_lse=True)

    out, lse = torch.compile(layer, fullgraph=True, backend=recording_backend(seen))(q, k, k, sinks)
    assert out.shape == q.shape and lse.shape == (2, 8, 100)
    assert "facodegen.attention" in seen[0] and "[64, 0]" in seen[0] and "30.0" in seen[0]

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, sinks):
            return facodegen.attention(q, k, v, window_size=(16, 16), sinks=sinks, causal_alignment="top_left")

    program = torch.export.export(Attention(), (q, k, k, sinks))
    text = str(program.graph)
    assert "torch.ops.facodegen.attention.default" in text and "[16, 16]" in text and "top_left" in text


def test_compile_carries_fp8_with_the_variants_and_descales():
    """e4m3 q, k, v with their descales and a window, softcap and sinks (the fp8 kernel takes them since
    session 44): one op in the graph, the descales and the sinks as its inputs, O in bf16."""
    q, k = meta(2, 100, 8, 128, dtype=torch.float8_e4m3fn), meta(2, 77, 2, 128, dtype=torch.float8_e4m3fn)
    d, sinks = torch.empty((), dtype=torch.float32, device="meta"), meta(8, dtype=torch.float32)
    seen = []

    def layer(q, k, v, d, sinks):
        return facodegen.attention(q, k, v, causal=True, window_size=(64, 0), softcap=30.0, sinks=sinks,
                                   q_descale=d, k_descale=d, v_descale=d)

    out = torch.compile(layer, fullgraph=True, backend=recording_backend(seen))(q, k, k, d, sinks)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert seen[0].count("facodegen.attention") == 1 and "[64, 0]" in seen[0] and "30.0" in seen[0]


# ------------------------------------------------------------------ attention_with_kvcache

def kv_case(*, paged=False, new=0, batch=2, seqlen_q=1, heads_q=8, heads_kv=2, d=128, capacity=256, page=64):
    """(q, k_cache, v_cache, cache_seqlens, keyword arguments) of a decode step on meta tensors."""
    if paged:
        pages = batch * capacity // page
        kc, vc = meta(pages, page, heads_kv, d), meta(pages, page, heads_kv, d)
        kw = {"page_table": meta(batch, capacity // page, dtype=torch.int32)}
    else:
        kc, vc = meta(batch, capacity, heads_kv, d), meta(batch, capacity, heads_kv, d)
        kw = {}
    if new:
        kw.update(k=meta(batch, new, heads_kv, d), v=meta(batch, new, heads_kv, d))
    return meta(batch, seqlen_q, heads_q, d), kc, vc, meta(batch, dtype=torch.int32), kw


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("new", [0, 1, 4])
@pytest.mark.parametrize("return_lse", [False, True])
def test_kvcache_compile_fullgraph_traces_the_op(paged, new, return_lse):
    """One graph, the op in it (fullgraph: no graph break), O like q and the float32 LSE from the fake."""
    torch._dynamo.reset()       # (one code object per parametrization: no recompile limit)
    q, kc, vc, lengths, kw = kv_case(paged=paged, new=new, seqlen_q=new or 1)
    seen = []

    def step(q, kc, vc, lengths, kw):
        return facodegen.attention_with_kvcache(q, kc, vc, lengths, **kw, return_lse=return_lse, num_splits=2,
                                                block_n=64)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.compile(step, fullgraph=True, backend=recording_backend(seen))(q, kc, vc, lengths, kw)
    out, lse = got if return_lse else (got, None)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "meta"
    if return_lse:
        assert lse.shape == (2, 8, q.shape[1]) and lse.dtype == torch.float32
    assert len(seen) == 1 and "facodegen.attention_with_kvcache" in seen[0] and "block_n=64" in seen[0]


def test_kvcache_explain_counts_no_graph_break():
    q, kc, vc, lengths, kw = kv_case(paged=True, new=1)

    def step(q, kc, vc, lengths, kw):
        out = facodegen.attention_with_kvcache(q, kc, vc, lengths, **kw)
        return facodegen.attention(out, out, out)       # the layer goes on after the decode

    explained = torch._dynamo.explain(step)(q, kc, vc, lengths, kw)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_kvcache_fake_impl_shapes_under_fake_tensor_mode():
    """The op itself (and its _out form) on FakeTensorMode CUDA-device tensors: shapes from shapes only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        def t(*shape, dtype=torch.float16):     # (a fake CUDA tensor: no GPU needed)
            return torch.empty(*shape, dtype=dtype, device="cuda")
        q, kc, vc = t(3, 4, 16, 64), t(40, 16, 4, 64), t(40, 16, 4, 64)
        lengths, table = t(3, dtype=torch.int32), t(3, 8, dtype=torch.int32)
        out, lse = torch.ops.facodegen.attention_with_kvcache(q, kc, vc, lengths, table, t(3, 4, 4, 64),
                                                              t(3, 4, 4, 64), True, 0.1, 0, None, "")
        assert out.shape == q.shape and out.dtype == torch.float16 and out.device.type == "cuda"
        assert lse.shape == (3, 16, 4) and lse.dtype == torch.float32
        o2, l2 = t(3, 4, 16, 64), t(3, 16, 4, dtype=torch.float32)
        assert torch.ops.facodegen.attention_with_kvcache_out(q, kc, vc, lengths, table, None, None, o2, l2, True,
                                                              None, 1, "sm90", "") is None


def test_kvcache_schema_marks_the_caches_mutated():
    for name in ("attention_with_kvcache", "attention_with_kvcache_out"):
        schema = getattr(torch.ops.facodegen, name).default._schema
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == ({"k_cache", "v_cache"} if name == "attention_with_kvcache" else
                           {"k_cache", "v_cache", "out", "lse"})
    returns = torch.ops.facodegen.attention_with_kvcache.default._schema.returns
    assert len(returns) == 2 and all(r.alias_info is None for r in returns)   # fresh O and LSE


@pytest.mark.parametrize("with_out", [False, True])
def test_kvcache_opcheck_on_meta(with_out):
    """torch.library.opcheck's schema, fake-tensor, autograd-registration and AOT checks (on meta
    tensors: the mutation check sees no data here; tests/gpu/test_decode_gpu.py runs the kernels)."""
    q, kc, vc, lengths, kw = kv_case(paged=True, new=1)
    extra = (meta(*q.shape), meta(2, 8, 1, dtype=torch.float32)) if with_out else ()
    op = torch.ops.facodegen.attention_with_kvcache_out if with_out else torch.ops.facodegen.attention_with_kvcache
    torch.library.opcheck(op.default, (q, kc, vc, lengths, kw["page_table"], kw["k"], kw["v"], *extra, True, None, 0,
                                       None, "block_n=64"))


def test_kvcache_compile_with_out_uses_the_mutating_op():
    q, kc, vc, lengths, kw = kv_case(new=1)
    seen = []

    def step(q, kc, vc, lengths, kw):
        out = torch.empty_like(q)
        o, lse = facodegen.attention_with_kvcache(q, kc, vc, lengths, **kw, out=out, return_lse=True)
        return o, lse

    out, lse = torch.compile(step, fullgraph=True, backend=recording_backend(seen))(q, kc, vc, lengths, kw)
    assert out.shape == q.shape and lse.shape == (2, 8, 1) and lse.dtype == torch.float32
    assert "facodegen.attention_with_kvcache_out" in seen[0]


def test_kvcache_flash_attn_signature_compiles_too():
    q, kc, vc, lengths, kw = kv_case(paged=True, new=1)

    def step(q, kc, vc, lengths, table, k, v):
        return facodegen.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, block_table=table,
                                                 causal=True, return_softmax_lse=True)

    out, lse = torch.compile(step, fullgraph=True, backend="eager")(q, kc, vc, lengths, kw["page_table"], kw["k"],
                                                                      kw["v"])
    assert out.shape == q.shape and lse.shape == (2, 8, 1)


def test_kvcache_export_records_the_cache_mutation():
    class Decode(torch.nn.Module):
        def forward(self, q, kc, vc, lengths, k, v):
            return facodegen.attention_with_kvcache(q, kc, vc, lengths, k=k, v=v)

    q, kc, vc, lengths, kw = kv_case(new=1)
    program = torch.export.export(Decode(), (q, kc, vc, lengths, kw["k"], kw["v"]))
    assert "torch.ops.facodegen.attention_with_kvcache.default" in str(program.graph)
    # the functional form (run_decompositions) writes the caches back: the op's (a!)/(b!) at work
    functional = program.run_decompositions()
    mutated = {spec.target for spec in functional.graph_signature.output_specs
               if spec.kind.name == "USER_INPUT_MUTATION"}
    assert mutated == {"kc", "vc"} and "auto_functionalized" in str(functional.graph)


def _trace(fn, *args):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")(*args)


@pytest.mark.parametrize("change, match", [
    ({"q": (2, 1, 8, 84)}, r"head_dim \(q.shape\[3\]\) 84 is not supported"),
    ({"k_cache": (3, 256, 2, 128)}, "k_cache has batch 3 but q has batch 2"),
    ({"q": (2, 1, 7, 128)}, "heads_kv=2 .* must divide heads_q=7"),
    ({"cache_seqlens": (2, 1)}, "cache_seqlens has shape"),
    ({"q": (2, 17, 8, 128)}, "seqlen_q=17"),
])
def test_kvcache_bad_shapes_give_the_eager_errors_under_compile(change, match):
    """The fake implementation runs the eager path's shape checks: the same message while tracing."""
    q, kc, vc, lengths, kw = kv_case()
    shapes = {"q": q.shape, "k_cache": kc.shape, "cache_seqlens": lengths.shape, **change}
    args = (meta(*shapes["q"]), meta(*shapes["k_cache"]), meta(*shapes["k_cache"]),
            meta(*shapes["cache_seqlens"], dtype=torch.int32))
    with pytest.raises(Exception, match=match):
        _trace(lambda q, kc, vc, lengths: facodegen.attention_with_kvcache(q, kc, vc, lengths), *args)
    if shapes["q"][1] <= 16:    # eager says the same on CUDA tensors; on meta it stops at the device first
        with pytest.raises(TypeError, match="q is a torch tensor on meta"):
            facodegen.attention_with_kvcache(*args)


@pytest.mark.parametrize("kw, error, match", [
    ({"causal": "yes"}, TypeError, "causal must be True or False"),
    ({"num_splits": -1}, ValueError, "num_splits=-1"),
    ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be a finite number"),
    ({"block_q": 64}, TypeError, "unknown argument.*block_q"),
    ({"k": "new"}, ValueError, "k and v .* must be given together"),
])
def test_kvcache_bad_options_are_named(kw, error, match):
    q, kc, vc, lengths, _ = kv_case()
    if "k" in kw:
        kw = {"k": meta(2, 1, 2, 128)}
    with pytest.raises(Exception, match=match):
        _trace(lambda q, kc, vc, lengths: facodegen.attention_with_kvcache(q, kc, vc, lengths, **kw), q, kc, vc,
               lengths)
    from facodegen.ops import kvcache
    if "k" not in kw:
        with pytest.raises(error, match=match):
            kvcache.check_options(lengths, **{"causal": True, "softmax_scale": None, "num_splits": 0, "knobs": {},
                                              **{n: x for n, x in kw.items() if n != "block_q"},
                                              **({"knobs": {"block_q": 64}} if "block_q" in kw else {})})


def test_kvcache_int_lengths_are_refused_under_compile():
    q, kc, vc, _, _ = kv_case()
    with pytest.raises(Exception, match="cache_seqlens must be a .batch,. int32 device tensor"):
        _trace(lambda q, kc, vc: facodegen.attention_with_kvcache(q, kc, vc, 5), q, kc, vc)


def test_kvcache_has_no_backward():
    q, kc, vc, lengths, kw = kv_case(new=1)
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="attention_with_kvcache has no backward.*torch.no_grad"):
        facodegen.attention_with_kvcache(q, kc, vc, lengths, **kw)
    with pytest.raises(NotImplementedError, match="no backward"):      # the op itself, called directly
        torch.ops.facodegen.attention_with_kvcache(q, kc, vc, lengths, None, kw["k"], kw["v"], True, None, 0, None,
                                                   "")
    with torch.no_grad():   # no gradient recorded: the eager path (which refuses meta tensors by name)
        with pytest.raises(TypeError, match="q is a torch tensor on meta"):
            facodegen.attention_with_kvcache(q, kc, vc, lengths, **kw)
        out = torch.ops.facodegen.attention_with_kvcache(q, kc, vc, lengths, None, kw["k"], kw["v"], True, None, 0,
                                                         None, "")[0]
        assert out.shape == q.shape and not out.requires_grad


def test_kvcache_dynamic_shapes_through_aot_autograd():
    """dynamic=True (batch and page count symbolic: the fake's shape checks take SymInts) and the
    aot_eager backend, which functionalizes the cache mutation as inductor does."""
    torch._dynamo.reset()

    def step(q, kc, vc, lengths, table, k, v):
        return facodegen.attention_with_kvcache(q, kc, vc, lengths, page_table=table, k=k, v=v, return_lse=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for batch in (2, 3, 5):
        q, kc, vc, lengths, kw = kv_case(paged=True, new=1, batch=batch)
        out, lse = compiled(q, kc, vc, lengths, kw["page_table"], kw["k"], kw["v"])
        assert out.shape == q.shape and lse.shape == (batch, 8, 1)
