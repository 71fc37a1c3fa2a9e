"""The drop-in entry points on a GPU: facodegen.torch.scaled_dot_product_attention,
facodegen.flash_attn_func and attn_implementation="facodegen" in transformers.

Accuracy follows FlashAttention-3's test criterion: against float64 attention, facodegen's max
error must be at most twice torch SDPA's in the same precision, plus a 1e-3 floor. The
transformers test runs a small random Llama in bf16 with "sdpa" and with "facodegen" (same
weights) and holds their logits' difference to the eager-vs-sdpa difference.
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

import facodegen  # noqa: E402
import facodegen.torch as ftorch  # noqa: E402
from facodegen.verify.reference import check_lse  # noqa: E402

F = torch.nn.functional

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA GPU")]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

SHAPES = [   # batch, heads_q, heads_kv, seqlen_q, seqlen_k
    (2, 8, 8, 1, 1),
    (2, 8, 2, 17, 17),
    (2, 8, 8, 1000, 1000),
    (1, 8, 2, 1000, 1000),
    (2, 8, 8, 17, 1000),      # seqlen_q < seqlen_k: the two causal alignments differ
    (2, 8, 2, 1000, 17),      # seqlen_q > seqlen_k: bottom-right leaves rows with no key
    (3, 8, 1, 1, 1000),       # a decode step, MQA
]


def _mask(seqlen_q, seqlen_k, alignment, device):
    """True where a key is visible."""
    shift = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    rows = torch.arange(seqlen_q, device=device)[:, None]
    return torch.arange(seqlen_k, device=device)[None, :] <= rows + shift


def _reference(q, k, v, causal, alignment, scale=None):
    """(O, LSE) in float64, (batch, heads, seqlen, d) layout; rows with no visible key: O = 0, LSE = -inf."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = (qd @ kd.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = s.masked_fill(~_mask(q.shape[2], k.shape[2], alignment, q.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse[..., None]).nan_to_num(0.0) @ vd), lse


def _torch_same_precision(q, k, v, causal, alignment):
    """torch SDPA in the inputs' precision, (batch, heads, seqlen, d): the baseline error."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if causal and alignment == "bottom_right":
        mask = _mask(q.shape[2], k.shape[2], alignment, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.masked_fill(~mask.any(-1)[:, None], 0.0)   # SDPA leaves garbage on rows with no visible key
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _assert_fa3_criterion(out, ref, baseline, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = (out.double() - ref).abs().max().item()
    base = (baseline.double() - ref).abs().max().item()
    assert err <= 2 * base + 1e-3, f"{what}: max error {err:.3e} > 2 x torch's {base:.3e} + 1e-3"


def _inputs(shape, head_dim, dtype, seed):
    batch, hq, hkv, sq, sk = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, generator=g, device="cuda", dtype=DTYPES[dtype])
            for s in ((batch, hq, sq, head_dim), (batch, hkv, sk, head_dim), (batch, hkv, sk, head_dim))]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(dtype, head_dim, shape, causal):
    q, k, v = _inputs(shape, head_dim, dtype, seed=sum(shape) + head_dim)
    out = ftorch.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=shape[1] != shape[2])
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    ref, _ = _reference(q, k, v, causal, "top_left")
    _assert_fa3_criterion(out, ref, _torch_same_precision(q, k, v, causal, "top_left"), "sdpa")


@pytest.mark.parametrize("shape", [(2, 8, 2, 300, 1000), (2, 8, 8, 1000, 300), (1, 8, 2, 257, 257)], ids=str)
def test_sdpa_gradients(shape):
    """Inputs that require grad: the SDPA adapter records facodegen's backward (top-left causal where seqlen_q !=
    seqlen_k: the window kernels and the sm80 backward's LOCAL ones); dQ, dK, dV within twice torch SDPA's own
    bf16 error (against float64 autograd of the same attention) + 1e-3."""
    q, k, v = (x.requires_grad_(True) for x in _inputs(shape, 128, "bf16", seed=sum(shape)))
    gqa = shape[1] != shape[2]
    out = ftorch.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    assert out.grad_fn is not None and out.shape == q.shape
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref_out, _ = _reference(*leaves, True, "top_left")
    ref = torch.autograd.grad(ref_out, leaves, g.double())
    base = torch.autograd.grad(_torch_same_precision(q, k, v, True, "top_left"), (q, k, v), g)
    for name, x, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        _assert_fa3_criterion(x, r, b, f"sdpa {name}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func(dtype, head_dim, shape, causal):
    qh, kh, vh = _inputs(shape, head_dim, dtype, seed=sum(shape) + head_dim + 1)
    q, k, v = (x.transpose(1, 2).contiguous() for x in (qh, kh, vh))     # FlashAttention's layout
    out, lse, probs = facodegen.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert probs is None and out.shape == q.shape and out.dtype == q.dtype
    ref, ref_lse = _reference(qh, kh, vh, causal, "bottom_right")
    _assert_fa3_criterion(out.transpose(1, 2), ref, _torch_same_precision(qh, kh, vh, causal, "bottom_right"),
                          "flash_attn_func")
    ok, msg = check_lse(lse, ref_lse.cpu().numpy())
    assert ok, msg
    assert torch.equal(facodegen.flash_attn_func(q, k, v, causal=causal), out)


def test_views_reach_the_kernel(monkeypatch):
    """The adapters hand facodegen.attention views of the caller's tensors and the result's memory."""
    real, seen = facodegen.attention, []

    def spy(q, k, v, **kwargs):
        seen.append((q, k, v, kwargs.get("out")))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(facodegen, "attention", spy)
    q, k, v = _inputs((2, 8, 2, 300, 400), 128, "bf16", seed=7)
    out = ftorch.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (sq, sk, sv, sout), = seen
    assert (sq.data_ptr(), sk.data_ptr(), sv.data_ptr()) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert sout.data_ptr() == out.data_ptr() and sout.shape == (2, 300, 8, 128)
    ref, _ = _reference(q, k, v, True, "top_left")
    _assert_fa3_criterion(out, ref, _torch_same_precision(q, k, v, True, "top_left"), "sdpa views")


# ------------------------------------------------------------------------------------------------
# transformers: a small random Llama in bf16
# ------------------------------------------------------------------------------------------------

def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def _llama_config(**overrides):
    """transformers with facodegen registered, and a small Llama's config (GQA 8/2, head_dim 64)."""
    transformers = pytest.importorskip("transformers")
    from facodegen.integrations.transformers import register
    register()
    fields = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    return transformers, transformers.LlamaConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def llamas():
    transformers, config = _llama_config(initializer_range=0.1)    # peaky attention
    torch.manual_seed(0)
    models, state = {}, None
    for impl in ("sdpa", "eager", "facodegen"):
        # a config of its own each: from_config writes the implementation into the config it is given
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        assert model.config._attn_implementation == impl
        if state is None:
            state = model.state_dict()
        else:
            model.load_state_dict(state)
        models[impl] = model.to("cuda", torch.bfloat16).eval()
    return models


@torch.no_grad()
def test_transformers_logits(llamas, monkeypatch):
    real, calls = facodegen.attention, {}

    def spy(*args, **kwargs):
        calls[impl] = calls.get(impl, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(facodegen, "attention", spy)
    ids = torch.randint(3, 1024, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    logits = {}
    for impl, model in llamas.items():
        logits[impl] = model(ids).logits
    assert calls == {"facodegen": 4}, f"facodegen.attention calls per model: {calls}"
    floor = _rel(logits["eager"], logits["sdpa"])
    err = _rel(logits["facodegen"], logits["sdpa"])
    assert err <= 2 * floor + 2e-3, f"facodegen vs sdpa {err:.3e}, eager vs sdpa {floor:.3e}"


@torch.no_grad()
def test_transformers_generate(llamas):
    ids = torch.randint(3, 1024, (2, 40), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    floor = _rel(llamas["eager"](ids).logits, llamas["sdpa"](ids).logits)
    runs = {impl: llamas[impl].generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=True,
                                        output_scores=True, return_dict_in_generate=True)
            for impl in ("sdpa", "facodegen")}
    ours, theirs = runs["facodegen"], runs["sdpa"]
    if torch.equal(ours.sequences, theirs.sequences):
        return
    # greedy decoding may flip a near tie: up to the first step that differs, the scores must agree
    new = ours.sequences[:, ids.shape[1]:] != theirs.sequences[:, ids.shape[1]:]
    first = int(new.any(0).nonzero()[0])
    for step in range(first + 1):
        err = _rel(ours.scores[step], theirs.scores[step])
        assert err <= 2 * floor + 2e-3, f"step {step}: scores differ by {err:.3e} (floor {floor:.3e})"


@torch.no_grad()
def test_transformers_padded_batch_matches_sdpa(llamas, monkeypatch):
    """A left-padded batch runs on packed sequences (facodegen.attention_varlen, no padded attention call):
    at every real token its logits are SDPA's within twice eager's distance from SDPA + 2e-3."""
    calls = []
    real = facodegen.attention_varlen
    monkeypatch.setattr(facodegen, "attention_varlen", lambda *a, **k: calls.append(a[3].tolist()) or real(*a, **k))
    ids = torch.randint(3, 1024, (3, 200), generator=torch.Generator().manual_seed(3)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :37], mask[2, :199] = 0, 0
    real_tokens = mask.bool()
    logits = {impl: llamas[impl](ids, attention_mask=mask).logits[real_tokens] for impl in ("sdpa", "eager", "facodegen")}
    assert calls and all(c == [0, 163, 363, 364] for c in calls)
    floor = _rel(logits["eager"], logits["sdpa"])
    err = _rel(logits["facodegen"], logits["sdpa"])
    assert err <= 2 * floor + 2e-3, f"facodegen vs sdpa {err:.3e}, eager vs sdpa {floor:.3e}"


@torch.no_grad()
def test_transformers_packed_row_matches_each_sequence_alone(llamas):
    """Padding-free packing (one row, position_ids restarting at 0): each sequence's logits are those of
    the sequence alone through SDPA."""
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 1024, (1, n), generator=g).cuda() for n in (100, 1, 257)]
    ids = torch.cat(seqs, dim=1)
    positions = torch.cat([torch.arange(s.shape[1]) for s in seqs])[None].cuda()
    got = llamas["facodegen"](ids, position_ids=positions).logits
    start = 0
    for s in seqs:
        alone, eager = (llamas[impl](s).logits for impl in ("sdpa", "eager"))
        piece = got[:, start:start + s.shape[1]]
        assert _rel(piece, alone) <= 2 * _rel(eager, alone) + 2e-3, s.shape
        start += s.shape[1]


def _training_tracks_sdpa(batches) -> list[float]:
    """Train a small random-weight Llama (AdamW, the same initial weights and ``batches`` of (ids,
    attention_mask or None, labels)) with facodegen's attention in bf16, SDPA's in bf16 and in fp32; at every
    step facodegen's loss is within twice SDPA's own bf16-vs-fp32 gap + 1e-3 of SDPA's bf16 loss. Returns
    facodegen's losses."""
    transformers, config = _llama_config()
    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").state_dict()

    def train(impl: str, dtype) -> list[float]:
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        model.load_state_dict(state)
        model = model.to("cuda", dtype).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for ids, mask, labels in batches:
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    ours, sdpa, exact = train("facodegen", torch.bfloat16), train("sdpa", torch.bfloat16), train("sdpa", torch.float32)
    for step, (a, b, c) in enumerate(zip(ours, sdpa, exact)):
        assert abs(a - b) <= 2 * abs(b - c) + 1e-3, (f"step {step}: facodegen {a:.5f}, sdpa bf16 {b:.5f}, "
                                                      f"sdpa fp32 {c:.5f}\n{ours}\n{sdpa}\n{exact}")
    return ours


def test_ten_training_steps_on_padded_batches_track_sdpa():
    """Training on right-padded batches (labels -100 at the pads): the varlen forward and backward through the
    model track SDPA's bf16 run (_training_tracks_sdpa)."""
    gen = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(10):
        ids = torch.randint(3, 1024, (4, 256), generator=gen)
        lengths = torch.randint(17, 257, (4,), generator=gen)
        mask = (torch.arange(256)[None] < lengths[:, None]).long()
        batches.append((ids.cuda(), mask.cuda(), ids.masked_fill(mask == 0, -100).cuda()))
    _training_tracks_sdpa(batches)


def test_twenty_training_steps_of_a_llama_track_sdpa():
    """Issue #38's training check: a small random-weight Llama trained 20 steps (AdamW, the same
    initial weights and batches) with facodegen's attention (forward and generated backward, bf16)
    tracks SDPA's bf16 run at every step within twice SDPA's own bf16-vs-fp32 gap + 1e-3."""
    gen = torch.Generator().manual_seed(2)
    batches = [(ids, None, ids) for ids in (torch.randint(3, 1024, (4, 256), generator=gen).cuda() for _ in range(20))]
    ours = _training_tracks_sdpa(batches)
    assert len(set(ours)) > 1       # the weights moved (random tokens: the loss stays near log(1024))


# the attention variants in whole models (Mistral: sliding window; Gemma-2: softcap and sliding layers;
# gpt-oss: learned sinks and sliding layers), bf16 beside transformers' eager attention in bf16 and fp32

def _variant_models(family):
    """{"facodegen", "eager" (bf16), "eager32" (fp32)}: one tiny random model of ``family``, the same weights."""
    from test_adapters import variant_model_config
    transformers = pytest.importorskip("transformers")
    config = variant_model_config(family, 64, vocab_size=1024, hidden_size=256, intermediate_size=256,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                                  initializer_range=0.1)
    torch.manual_seed(0)
    models, state = {}, None
    for label, impl, dtype in (("eager32", "eager", torch.float32), ("eager", "eager", torch.bfloat16),
                               ("facodegen", "facodegen", torch.bfloat16)):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        if state is None:
            if family == "gpt_oss":     # learned sinks of either sign, not the initial zeros
                with torch.no_grad():
                    for layer in model.model.layers:
                        layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, layer.self_attn.sinks.numel()))
            state = model.state_dict()
        else:
            model.load_state_dict(state)
        models[label] = model.to("cuda", dtype).eval()
    return models


@torch.no_grad()
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "mistral"])
def test_transformers_variant_models(family, monkeypatch):
    """300 tokens through a window of 64 (Gemma-2: softcap 5; gpt-oss: sinks), an unpadded and a left-padded
    batch: facodegen's bf16 logits are as close to fp32 eager attention's as twice bf16 eager's + 2e-3; then
    generate() runs on both batches."""
    models = _variant_models(family)
    calls = []
    real = facodegen.attention
    monkeypatch.setattr(facodegen, "attention", lambda *a, **k: calls.append(k.get("window_size")) or real(*a, **k))
    ids = torch.randint(3, 1024, (2, 300), generator=torch.Generator().manual_seed(7)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :45] = 0
    for batch_mask in (None, mask):
        real_tokens = torch.ones_like(ids, dtype=torch.bool) if batch_mask is None else batch_mask.bool()
        logits = {label: model(ids, attention_mask=batch_mask).logits[real_tokens].float()
                  for label, model in models.items()}
        floor = _rel(logits["eager"], logits["eager32"])
        err = _rel(logits["facodegen"], logits["eager32"])
        assert err <= 2 * floor + 2e-3, f"{family}: facodegen {err:.3e} from fp32 eager, bf16 eager {floor:.3e}"
    assert (63, 63) in calls, "the sliding layers must reach facodegen.attention with their window"
    for batch_mask in (torch.ones_like(ids), mask):
        out = models["facodegen"].generate(ids, attention_mask=batch_mask, max_new_tokens=8, do_sample=False,
                                           use_cache=True)
        assert out.shape == (2, 308)
