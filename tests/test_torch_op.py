"""facodegen's torch operators on the CPU: tracing with meta tensors goes through the fake
implementations, so torch.compile(fullgraph=True) and torch.export can be checked without a GPU
(tests/gpu/test_host_path.py runs the same on CUDA tensors)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import facodegen  # noqa: E402
from facodegen import torch_op  # noqa: E402


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


def test_requires_grad_records_the_backward():
    q = meta(1, 16, 2, 64).requires_grad_(True)
    out = facodegen.attention(q, q.detach(), q.detach())
    assert out.requires_grad and out.grad_fn is not None   # tests/test_backward.py: the rest of autograd


def test_a_meta_tensor_in_eager_is_refused_by_name():
    with pytest.raises(TypeError, match="q is a torch tensor on meta"):
        facodegen.attention(meta(1, 16, 2, 64), meta(1, 16, 2, 64), meta(1, 16, 2, 64))


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
