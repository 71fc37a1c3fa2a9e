"""Seeded random problems for ``facodegen check --fuzz N``: each a call of ``facodegen.attention``
checked against a float64 reference with FlashAttention-3's criterion.

A case is plain data (:class:`Case`): the problem (arch, dtype, shape, causal, scale), how the
tensors are laid out (contiguous, a strided view of a wider buffer, a view at a 16-byte storage
offset), the input magnitude and which outputs are asked for (``return_lse``, ``out=``). Shapes
vary freely while the kernels stay a bounded set (arch x dtype x head_dim x causal, and the
sequence-length rules' variants), so many thousands of cases share a few dozen compiled kernels.

The criterion (FlashAttention-3's tests/test_flash_attn.py): the largest error of O against the
float64 reference is at most twice the largest error of a same-precision computation (scores,
probabilities and P V rounded to the input dtype) plus a noise floor, twice the dtype's rounding
of the reference; the LSE within 1e-3 + 1e-4 |lse|. Each element's error first loses the bound of
the rounding FlashAttention adds to standard attention's (facodegen.verify.flash_rounding: P
rounded before it is normalised; in the backward also D from that O, and dP - D's float32 noise
where a row sees one key), which matters where a row is one-hot: standard attention is then exact,
and no FlashAttention (FA2, FA3, these kernels) is (the H200 fuzz of 2026-12-03 found 12 such fp16
cases in 10,000, all with logits in the thousands). fp8 (e4m3 inputs, P rounded to e4m3) is held to
a relative Frobenius error of O against the float64 reference on the dequantised inputs of 3e-2 (the
GPU tests' bound) or twice a bf16 computation's on the same inputs, whichever is larger, and its LSE within 1e-2 + 1e-3 |lse| + 2^-12 scale max_k sum_i |q_i k_i|
(the fp8 wgmma accumulator's precision, ~14 bits, on the row's scores). A failing case prints the one command that reruns it.

Families: ``forward``; ``variants`` (problems with a sliding window whose sides are drawn
from 0, 1, a few keys, the sequence length and beyond, -1 = unbounded, causal or not and either
alignment, softcap values, sinks; 16-bit, and on sm90 e4m3 with descales where the seed is 6 mod 7); ``backward`` (dQ, dK, dV of attention() under autograd against
float64 autograd, FlashAttention-3's criterion per gradient; a quarter of them deterministic, run
twice and compared bit for bit; a quarter of the sm80 ones, seeds 1 mod 4, once more with one of its tuning
knobs away from its default: stages, the old warp grids, poly_exp2_tiles, frag_prefetch); ``kvcache`` (attention_with_kvcache:
1-16 query tokens, contiguous or paged caches with shuffled pages, random lengths from 0, appends,
split counts, half of them (odd seeds) with fused_combine, and on sm90 at head_dim 64/128/256 half with
producer_warps set, seeds 2, 5 mod 12 one, 8, 11 mod 12 two and 3, 6 mod 12 none, the rest the default); ``varlen`` (attention_varlen on packed sequences: per-sequence lengths drawn from the
case's seed, 0 and 1 among them, under the case's seqlen_q / seqlen_k as max_seqlen; the case's arch:
sm80's kernel, which an H100 runs compiled for sm_90, or sm90's own, persistent by default and with
persistent=False for a third of its cases, seeds 1 mod 3; a quarter of the 16-bit ones without variants,
seeds 3 mod 4, also take attention_varlen_backward's gradients per sequence on the case's arch, seeds 7 mod 8 deterministic;
sm90 cases whose seed is 6 mod 7 are e4m3 with descales, variants and all). The families are appended in this order, so adding one leaves
the draws of a single family's run unchanged for a seed (``all`` draws among them all).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

from .flash_rounding import attention_backward_flash_rounding, backward_floor, forward_floor, visible_keys
from ..spec import HEAD_DIMS

FAMILIES = ("forward", "variants", "backward", "kvcache", "varlen", "head_dims")
# The head_dims family: the forward at head dims outside HEAD_DIMS (16-bit; fp8 below), each on the next one's tile
# with the columns past it zero-filled in the kernel (issue 40); a fixed few, so the kernels stay few.
PADDED_HEAD_DIMS = (8, 40, 80, 112, 160, 200, 248)
# The backward family's cases whose seed is 5 mod this run at PADDED_HEAD_DIMS[seed // it % 7] instead of
# their drawn head_dim (0: none); the kvcache family's whose seed is 7 mod KVCACHE_PADDED_EVERY likewise.
BACKWARD_PADDED_EVERY = 9
# The backward family's cases whose seed is 6 mod this (so 2 mod 4, never deterministic: the varlen cases'
# turns take windows, seeds 7 mod 8) run with a sliding window and/or a softcap drawn from their seed.
BACKWARD_VARIANT_EVERY = 8
KVCACHE_PADDED_EVERY = 11
# ... and a V narrower than Q and K (head_dim_v): a head_dims case whose seed is 3 mod 4 takes
# (head_dim, head_dim_v) = SPLIT_V_PAIRS[seed // 4 % 2] instead of its padded head_dim (read off the
# seed, so the family's other draws are what they were).
SPLIT_V_PAIRS = ((192, 128), (128, 64))
# An sm90 head_dims case whose seed is 6 mod 7 (and not 3 mod 4) runs e4m3 with descales at
# FP8_PADDED_HEAD_DIMS[seed // 7 % 8] instead: rows of whole 16-byte chunks (a contiguous e4m3 tensor's head
# stride is head_dim bytes), each on the next tile.
FP8_PADDED_HEAD_DIMS = (16, 48, 80, 112, 144, 176, 208, 240)
KVCACHE_PAGE_SIZES = (0, 0, 16, 64, 256)   # 0: contiguous
LAYOUTS = ("contiguous", "strided", "offset")
VARLEN_REPRESENTATIVE_SEED = 11
MAX_SCORES = 1 << 26        # batch x heads x seqlen_q x seqlen_k at most (the float64 reference's size)


@dataclass(frozen=True)
class Case:
    family: str
    arch: str
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    softmax_scale: float | None
    layout: str
    magnitude: float
    return_lse: bool
    use_out: bool
    seed: int
    # the variants family (facodegen.attention's window_size, softcap, sinks, causal_alignment)
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    sinks: bool = False
    top_left: bool = False
    # the kvcache family (facodegen.attention_with_kvcache): seqlen_k is the cache's capacity, each
    # sequence's length drawn from the case's seed; page_size 0 = a contiguous cache
    page_size: int = 0
    seqlen_new: int = 0
    num_splits: int = 0
    # the head_dims family: v's head_dim where it differs from q's and k's (0: the same)
    head_dim_v: int = 0

    @property
    def deterministic(self) -> bool:
        """A backward case whose seed is a multiple of 4 runs autograd under
        torch.use_deterministic_algorithms(True) (dQ in key-block order), twice, bit-identical. Read
        off the seed, so the draws and the case's JSON are what they were before it existed."""
        return self.family == "backward" and self.seed % 4 == 0

    @property
    def lpt_flipped(self) -> bool:
        """An sm90 causal backward case whose seed is 2 mod 4 also runs attention_backward(..., lpt=False) on
        the forward's O and LSE (each (kv head, batch)'s key blocks in turn, the order before lpt became the
        causal default; the launch-only sweep launches that one instead), checked like autograd's. Read off
        the seed, as ``deterministic``."""
        return self.family == "backward" and self.arch == "sm90" and self.causal and self.seed % 4 == 2

    @property
    def shallow_rings(self) -> bool:
        """An sm90 backward case whose seed is 3 mod 8 also runs attention_backward with the rings away from
        their defaults (shallow_ring_knobs: a 1-deep dO ring, the dQ tile in twice the pieces) on the
        forward's O and LSE, checked like autograd's (the launch-only sweep launches that one instead).
        Read off the seed, as ``deterministic``."""
        return self.family == "backward" and self.arch == "sm90" and self.seed % 8 == 3

    @property
    def dq_lag_flipped(self) -> bool:
        """An sm90 head_dim 128 backward case whose seed is 1 mod 4 also runs attention_backward(...,
        dq_lag=causal) on the forward's O and LSE: the dQ hand-over the default does not take (its default is
        on without a causal mask: dQ a step late, the warpgroups' dS^T handed over by mbarriers; off with one:
        both warpgroups meet at a named barrier each step); the launch-only sweep launches that one instead.
        Read off the seed, as ``deterministic``."""
        return self.family == "backward" and self.arch == "sm90" and self.head_dim == 128 and self.seed % 4 == 1

    @property
    def sm80_knobs_flipped(self) -> bool:
        """An sm80 backward case whose seed is 1 mod 4 also runs attention_backward on the forward's O and LSE
        with one of the sm80 backward's tuning knobs away from its tile's default (sm80_flipped_knobs: the
        stages, the warp grid one warp a slab with looped GEMMs, poly_exp2_tiles, frag_prefetch, in turn by
        seed), checked like autograd's (the launch-only sweep launches that one instead). Read off the seed,
        as ``deterministic``."""
        return self.family == "backward" and self.arch == "sm80" and self.seed % 4 == 1

    @property
    def one_cta_per_tile(self) -> bool:
        """An sm90 varlen case whose seed is 1 mod 3 calls attention_varlen(..., persistent=False) (one CTA
        per tile, the grid sized by max_seqlen_q); the others the default persistent kernel, whose CTAs
        number the tiles over the sequences themselves (so do representative_cases()' sm90 varlen cases,
        seed 11, which the sanitizer runs). Read off the seed, as ``deterministic``."""
        return self.family == "varlen" and self.arch == "sm90" and self.seed % 3 == 1

    @property
    def has_variant(self) -> bool:
        """A window with a bounded side, a softcap or sinks (the variants family's cases all have one; a
        fifth of the varlen family's, seed 4 mod 5)."""
        return (self.window_left, self.window_right) != (-1, -1) or self.softcap > 0 or self.sinks

    @property
    def varlen_lpt(self) -> bool:
        """An sm90 causal varlen case whose seed is 2 mod 6 (so persistent: not 1 mod 3) calls
        attention_varlen(..., varlen_lpt=True) (each sequence's tiles longest first over L2-sized groups
        of its heads); the others the default order. Read off the seed, as ``deterministic``."""
        return self.family == "varlen" and self.arch == "sm90" and self.causal and self.seed % 6 == 2

    @property
    def varlen_backward(self) -> bool:
        """A 16-bit varlen case whose seed is 3 mod 4 (where float64 autograd of its longest sequence stays
        within the backward family's size) also runs attention_varlen_backward on its O and LSE (with its window,
        softcap and sinks: the sm80 LOCAL, SOFTCAP and SINKS kernels), each sequence's dQ, dK, dV (and the sinks'
        summed gradient) against
        float64 autograd by the backward family's criterion, and with seed 7 mod 8 deterministic=True, twice,
        bit-identical (the launch-only sweep launches it too). Read off the seed, as ``deterministic``."""
        return (self.family == "varlen" and self.dtype != "fp8" and self.seed % 4 == 3
                and self.head_dim in HEAD_DIMS and self.heads_q * self.seqlen_q * self.seqlen_k <= MAX_SCORES // 8)

    @property
    def fused_combine(self) -> bool:
        """A kvcache case with an odd seed calls attention_with_kvcache(..., fused_combine=True) (the
        default: where the keys are split, the decode kernel's last split CTA of each work item merges
        them), an even seed fused_combine=False (the combine kernel). Read off the seed, as
        ``deterministic``: the draws and JSON stay as before."""
        return self.family == "kvcache" and self.seed % 2 == 1

    @property
    def producer_warps(self) -> int | None:
        """A kvcache case on sm90 at head_dim 64, 128 or 256 (the decode's producer_warps knob) whose seed is
        2 or 5 mod 12 calls attention_with_kvcache(..., producer_warps=1), 8 or 11 mod 12 producer_warps=2,
        3 or 6 mod 12 producer_warps=0 (the kernel without them, which the default no longer runs at head_dim
        256), each with the combine kernel and with fused_combine; None otherwise: the call's default
        (decode.default_producer_warps). Read off the seed, as ``fused_combine``."""
        if self.family != "kvcache" or self.arch != "sm90" or self.head_dim not in (64, 128, 256):
            return None
        return {2: 1, 5: 1, 8: 2, 11: 2, 3: 0, 6: 0}.get(self.seed % 12)

    def to_json(self) -> str:
        fields = asdict(self)
        if not fields["head_dim_v"]:    # (V as wide as Q: the JSON, and its digests, as before head_dim_v)
            del fields["head_dim_v"]
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Case":
        return cls(**json.loads(text))

    def repro(self) -> str:
        """The command that reruns this case alone."""
        return f"facodegen check --fuzz-case '{self.to_json()}'"


def _length(rng: random.Random) -> int:
    """Mostly short (where tiles are partial and masks bite), some long, odd values throughout."""
    band = rng.random()
    if band < 0.4:
        return rng.randint(1, 128)
    if band < 0.8:
        return rng.randint(129, 1024)
    if band < 0.95:
        return rng.randint(1025, 4096)
    return rng.randint(4097, 8192)


def _window_side(rng: random.Random, seqlen: int) -> int:
    """A window side: unbounded, 0, 1, a few keys, about the sequence, or past it."""
    return rng.choice((-1, -1, 0, 1, rng.randint(2, 64), rng.randint(1, max(1, seqlen)), seqlen + rng.randint(0, 300)))


def _variant_fields(rng: random.Random, seqlen_q: int, seqlen_k: int) -> dict:
    """window_size, softcap, sinks and alignment of a variants case (at least one variant on)."""
    while True:
        fields = dict(window_left=_window_side(rng, seqlen_k) if rng.random() < 0.7 else -1,
                      window_right=_window_side(rng, seqlen_k) if rng.random() < 0.5 else -1,
                      softcap=rng.choice((0.0, 0.0, 5.0, 30.0, 50.0)),
                      sinks=rng.random() < 0.4, top_left=rng.random() < 0.25)
        if fields["sinks"] or fields["softcap"] or (fields["window_left"], fields["window_right"]) != (-1, -1):
            return fields


def generate(n: int, seed: int = 0, family: str = "forward", archs=("sm80", "sm90")) -> list[Case]:
    """``n`` cases from ``seed`` (the same list every time for the same arguments); family "all"
    takes the families in turn, so each gets n / len(FAMILIES) cases (a draw a family refuses, e.g.
    a backward too large for float64 autograd, is drawn again for the same family)."""
    if family not in FAMILIES + ("all",):
        raise ValueError(f"family: {family!r} is not one of {', '.join(FAMILIES + ('all',))}")
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        this_family = FAMILIES[len(cases) % len(FAMILIES)] if family == "all" else family
        arch = rng.choice(archs)
        variants = this_family == "variants"
        dtype = rng.choice(("bf16", "fp16", "fp8") if arch == "sm90" and not variants else ("bf16", "fp16"))
        head_dim = rng.choice(HEAD_DIMS)
        seqlen_q = _length(rng)
        seqlen_k = seqlen_q if rng.random() < 0.5 else _length(rng)
        heads_kv = rng.randint(1, 4)
        heads_q = heads_kv * rng.choice((1, 1, 2, 4, 8))
        batch = rng.randint(1, 4)
        while batch > 1 and batch * heads_q * seqlen_q * seqlen_k > MAX_SCORES:
            batch -= 1
        if batch * heads_q * seqlen_q * seqlen_k > MAX_SCORES:
            continue
        extra = _variant_fields(rng, seqlen_q, seqlen_k) if variants else {}
        if this_family == "backward":
            # float64 autograd keeps scores, probabilities and their gradients: an 8th of the forward's size
            if batch * heads_q * seqlen_q * seqlen_k > MAX_SCORES // 8:
                continue
            dtype = rng.choice(("bf16", "fp16"))
        elif this_family == "kvcache":
            dtype = rng.choice(("bf16", "fp16"))
            page_size = rng.choice(KVCACHE_PAGE_SIZES)
            seqlen_q = rng.randint(1, 16)
            seqlen_k = (rng.randint(1, 32) * page_size) if page_size else rng.randint(1, 4096)
            extra = dict(page_size=page_size, seqlen_new=rng.choice((0, 0, 1, 3)),
                         num_splits=rng.choice((0, 0, 1, rng.randint(2, 8))))
            if seqlen_k < extra["seqlen_new"] or batch * heads_q * seqlen_q * seqlen_k > MAX_SCORES:
                continue
        elif this_family == "varlen":
            # seqlen_q / seqlen_k are the calls' max_seqlen; the sequences' own lengths come from the seed
            dtype = rng.choice(("bf16", "fp16"))      # (the arch as drawn: sm80 or sm90's varlen kernel)
        elif this_family == "head_dims":
            dtype, head_dim = rng.choice(("bf16", "fp16")), rng.choice(PADDED_HEAD_DIMS)
        case_fields = dict(
            family=this_family, arch=arch, dtype=dtype, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, causal=rng.random() < 0.5,
            softmax_scale=None if rng.random() < 0.6 else round(rng.uniform(0.02, 1.0), 4),
            layout="contiguous" if this_family == "kvcache" else rng.choice(LAYOUTS), magnitude=1.0 if rng.random() < 0.8 else rng.choice((4.0, 16.0)),
            return_lse=rng.random() < 0.5, use_out=this_family != "backward" and rng.random() < 0.3,
            seed=rng.randrange(1 << 31), **extra)
        if this_family == "backward" and BACKWARD_PADDED_EVERY and case_fields["seed"] % BACKWARD_PADDED_EVERY == 5:
            # a ninth of the backward draws at a head_dim between the tiles (either arch's kernel of the next tile),
            # read off the seed so the cases drawn after it stay as they were
            case_fields["head_dim"] = PADDED_HEAD_DIMS[case_fields["seed"] // BACKWARD_PADDED_EVERY
                                                       % len(PADDED_HEAD_DIMS)]
        if this_family == "backward" and case_fields["seed"] % BACKWARD_VARIANT_EVERY == 6:
            # an eighth of the backward draws with a sliding window, a softcap and/or sinks (the LOCAL and SOFTCAP
            # kernels, the sm80 backward's on either arch; SINKS on either), drawn from the case's seed as the varlen
            # variants below
            case_fields.update(_variant_fields(random.Random(case_fields["seed"]), seqlen_q, seqlen_k))
        if this_family == "kvcache" and KVCACHE_PADDED_EVERY and case_fields["seed"] % KVCACHE_PADDED_EVERY == 7:
            case_fields["head_dim"] = PADDED_HEAD_DIMS[case_fields["seed"] // KVCACHE_PADDED_EVERY
                                                       % len(PADDED_HEAD_DIMS)]      # (the decode's next tile)
        if this_family == "head_dims" and case_fields["seed"] % 4 == 3:
            case_fields["head_dim"], case_fields["head_dim_v"] = SPLIT_V_PAIRS[case_fields["seed"] // 4 % 2]
        elif this_family == "head_dims" and arch == "sm90" and case_fields["seed"] % 7 == 6:
            case_fields["dtype"], case_fields["head_dim"] = "fp8", FP8_PADDED_HEAD_DIMS[case_fields["seed"] // 7 % 8]
        if this_family == "kvcache" and case_fields["seed"] % 5 == 3:
            # a fifth of the kvcache cases with a window or softcap (no sinks: flash_attn_with_kvcache has none),
            # drawn from the case's seed as varlen's below (a draw of sinks alone takes softcap 30 instead)
            drawn = _variant_fields(random.Random(case_fields["seed"]), seqlen_q, seqlen_k)
            if not drawn["softcap"] and (drawn["window_left"], drawn["window_right"]) == (-1, -1):
                drawn["softcap"] = 30.0
            case_fields.update(drawn, sinks=False, top_left=False)
        if this_family in ("varlen", "variants") and arch == "sm90" and case_fields["seed"] % 7 == 6:
            case_fields["dtype"] = "fp8"     # (a seventh of the sm90 varlen and variants draws: e4m3 with descales)
        if this_family == "varlen" and case_fields["seed"] % 5 == 4:
            # a fifth of the varlen cases with attention variants (each sequence's own diagonal; varlen has no
            # top-left alignment), drawn from the case's seed so the cases drawn after it stay as they were
            case_fields.update(_variant_fields(random.Random(case_fields["seed"]), seqlen_q, seqlen_k), top_left=False)
        cases.append(Case(**case_fields))
    return cases


# ------------------------------------------------------------------ references (torch, on the GPU)

def attention_torch(q, k, v, causal: bool, softmax_scale: float, upcast: bool, *, window_size=(-1, -1),
                    softcap: float = 0.0, sinks=None, top_left: bool = False):
    """O and the natural-log LSE of (batch, seqlen, heads, head_dim) q, k, v; bottom-right causal,
    GQA by repetition. ``upcast``: in float64; else FlashAttention-3's same-precision reference
    (scores and P V in the inputs' dtype, softmax in float32). The variants as facodegen.attention
    takes them (window_size, softcap, sinks (heads_q,) whose logits join the denominator and the
    LSE, top_left alignment); see facodegen.verify.reference.attention_reference."""
    import torch
    v = v.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    probs, lse = attention_probabilities(q, k, causal, softmax_scale, upcast, window_size=window_size,
                                         softcap=softcap, sinks=sinks, top_left=top_left)
    out = torch.einsum("bhqk,bkhd->bqhd", probs if upcast else probs.to(v.dtype), v.double() if upcast else v)
    return out, lse


def attention_probabilities(q, k, causal: bool, softmax_scale: float, upcast: bool, *, window_size=(-1, -1),
                            softcap: float = 0.0, sinks=None, top_left: bool = False):
    """attention_torch's (batch, heads_q, seqlen_q, seqlen_k) softmax P (0 where a row sees no key)
    and its LSE: float64 if ``upcast``, else float32 from scores in the inputs' dtype."""
    import torch
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    if upcast:
        q, k = q.double(), k.double()
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
    scores = (scores if upcast else scores.float()) * softmax_scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal or window_size != (-1, -1):
        scores = scores.masked_fill(~visible_keys(q.shape[1], k.shape[1], causal, window_size, top_left, q.device),
                                    float("-inf"))
    if sinks is not None:     # the sink as one more logit with no value
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0), lse      # rows with no visible key: 0


def _layout(x, layout: str):
    """``x`` as the case's layout says: itself, a view of every other head of a wider buffer, or a
    view 16 bytes into a larger allocation (a storage offset, still aligned)."""
    import torch
    if layout == "strided":
        view = torch.empty((*x.shape[:2], 2 * x.shape[2], x.shape[3]), dtype=x.dtype, device=x.device)[:, :, ::2]
    elif layout == "offset":
        pad = 16 // x.element_size()
        view = torch.empty(x.numel() + pad, dtype=x.dtype, device=x.device)[pad:].view(x.shape)
    else:
        return x
    # byte copies for e4m3 (elementwise kernels for float8 vary between torch versions)
    (view.view(torch.uint8) if x.element_size() == 1 else view).copy_(x.view(torch.uint8) if x.element_size() == 1 else x)
    return view


def run_case(case: Case, launch_only: bool = False) -> tuple[bool, str]:
    """(passed, message) of one case on the GPU. ``launch_only``: make the inputs and run facodegen's
    call, check only that the outputs are finite, and skip the references (the sanitizer sweep's
    mode: compute-sanitizer is there for memory and races, and the float64 and same-precision
    references are most of a case's kernels, all of them instrumented by initcheck)."""
    if case.family == "backward":
        return _run_backward(case, launch_only)
    if case.family == "kvcache":
        return _run_kvcache(case, launch_only)
    if case.family == "varlen":
        return _run_varlen(case, launch_only)
    import torch

    import facodegen
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    dt = torch.bfloat16 if case.dtype in ("bf16", "fp8") else torch.float16
    head_dim_v = case.head_dim_v or case.head_dim
    shapes = ((case.batch, case.seqlen_q, case.heads_q, case.head_dim),
              (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
              (case.batch, case.seqlen_k, case.heads_kv, head_dim_v))
    q, k, v = (torch.randn(s, generator=gen, device="cuda", dtype=torch.float32).mul_(case.magnitude).to(dt)
               for s in shapes)
    scale = case.softmax_scale if case.softmax_scale is not None else case.head_dim ** -0.5
    kwargs = dict(causal=case.causal, softmax_scale=case.softmax_scale, return_lse=True, arch=case.arch)
    if case.dtype == "fp8":
        (q8, qd), (k8, kd), (v8, vd) = (facodegen.quantize_e4m3(x) for x in (q, k, v))
        q, k, v = (x8.to(torch.float32) * d for x8, d in ((q8, qd), (k8, kd), (v8, vd)))   # what the kernel sees
        args = [_layout(x, case.layout) for x in (q8, k8, v8)]
        kwargs.update(q_descale=qd, k_descale=kd, v_descale=vd)
        out_dtype = torch.bfloat16
    else:
        args = [_layout(x, case.layout) for x in (q, k, v)]
        out_dtype = dt
    if case.use_out:
        kwargs["out"] = torch.full((*shapes[0][:3], head_dim_v), float("nan"), dtype=out_dtype, device="cuda")
        kwargs["lse_out"] = torch.full((case.batch, case.heads_q, case.seqlen_q), float("nan"), device="cuda")
    variants = {}
    if case.family == "variants":
        sinks = (torch.randn(case.heads_q, generator=gen, device="cuda") * 2.0) if case.sinks else None
        variants = dict(window_size=(case.window_left, case.window_right), softcap=case.softcap, sinks=sinks)
        kwargs.update(variants, causal_alignment="top_left" if case.top_left else "bottom_right")
        variants["top_left"] = case.top_left
    out, lse = facodegen.attention(*args, **kwargs)
    if launch_only:
        return _launched(out, lse)
    ref, ref_lse = attention_torch(q, k, v, case.causal, scale, upcast=True, **variants)
    err = (out.double() - ref).abs().max().item()
    if case.dtype == "fp8":
        why = fp8_failure(out, ref, q, k, v, case.causal, scale, **variants)
        ok_o, what = why is None, why or f"max err {err:.2e} ok"
    else:
        why = fa3_failure(out, ref.nan_to_num(0.0), _standard_low(q, k, v, case.causal, scale, **variants),
                          forward_floor(q, k, v, case.causal, scale, **variants))
        ok_o, what = why is None, why or f"max err {err:.2e} ok"
    finite = torch.isfinite(ref_lse)
    atol, rtol = (1e-2, 1e-3) if case.dtype == "fp8" else (1e-3, 1e-4)
    lse_err = (lse.double() - ref_lse).abs().where(finite, torch.zeros_like(ref_lse))
    lse_bound = atol + rtol * ref_lse.abs().where(finite, torch.zeros_like(ref_lse))
    if case.dtype == "fp8":
        lse_bound = lse_bound + fp8_lse_slack(q, k, scale)
    worst = (lse_err - lse_bound).argmax()
    lse_ok = bool(torch.equal(torch.isneginf(lse), ~finite)) and bool((lse_err <= lse_bound).all())
    lse_what = "ok" if lse_ok else (
        f"FAIL (err {lse_err.flatten()[worst].item():.3g} > bound {lse_bound.flatten()[worst].item():.3g} at "
        f"(batch, head, row) {tuple(int(i) for i in torch.unravel_index(worst, lse_err.shape))}; -inf rows "
        f"{'agree' if torch.equal(torch.isneginf(lse), ~finite) else 'DIFFER'})")
    return ok_o and lse_ok and bool(torch.isfinite(out).all()), f"O {what}; LSE {lse_what}"


def fp8_failure(out, ref, q, k, v, causal: bool, scale: float, **variants) -> str | None:
    """FlashAttention-3's criterion on its fp8 terms for an e4m3 call's O against the float64 ``ref`` of the
    dequantised q, k, v (what the kernel sees): a relative Frobenius error at most twice a same-precision
    (bf16) computation's, or 3e-2; None if it holds. Where huge logits make the softmax one-hot, a near tie
    between two keys is decided by the last bits of the scores: the bf16 computation flips such rows too,
    and its error says so. A row that sees no key is 0 in both (ref's NaN taken as 0)."""
    import torch
    ref = ref.nan_to_num(0.0)
    low, _ = attention_torch(*(x.to(torch.bfloat16) for x in (q, k, v)), causal, scale, upcast=False, **variants)
    norm = ref.norm().clamp_min(1e-30)
    rel = ((out.double() - ref).norm() / norm).item()
    rel_low = ((low.double().nan_to_num(0.0) - ref).norm() / norm).item()
    bound = max(3e-2, 2 * rel_low)
    if rel <= bound and bool(torch.isfinite(out).all()):
        return None
    return f"rel_fro {rel:.2e} (bound {bound:.2e}: 3e-2 or 2x bf16's {rel_low:.2e})"


def fp8_lse_slack(q, k, scale: float):
    """What an e4m3 call's LSE (batch, heads_q, seqlen_q) may err beyond 16-bit tolerances: Hopper's fp8
    wgmma accumulates in fewer bits than fp32 (DeepSeek-V3's paper: ~14), so a score is exact only to ~2^-13
    of its sum of |products|; the LSE inherits that of its largest score: 2^-12 scale max_k sum_i |q_i k_i|."""
    import torch
    group = q.shape[2] // k.shape[2]
    products = torch.einsum("bqhd,bkhd->bhqk", q.double().abs(), k.double().abs().repeat_interleave(group, dim=2))
    return 2.0 ** -12 * scale * products.amax(dim=-1)


def _standard_low(q, k, v, causal, scale, **variants):
    """Standard attention in the inputs' dtype (a row that sees no key: 0), the criterion's
    same-precision computation."""
    low, _ = attention_torch(q, k, v, causal, scale, upcast=False, **variants)
    return low.nan_to_num(0.0)


def fa3_bound(ref, lows, dtype) -> float:
    """FlashAttention-3's bound on the largest error of a result against the float64 ``ref``: twice
    the largest error of the same-precision computations ``lows`` (one tensor or several: standard
    attention in the dtype; for gradients also flash_rounding's model of FlashAttention's backward)
    plus twice the rounding of ``ref`` to ``dtype`` (the noise floor)."""
    floor = ((ref.to(dtype) + 0.3 - 0.3).double() - ref).abs().max().item()
    lows = (lows,) if hasattr(lows, "shape") else lows
    return 2 * max((low.double() - ref).abs().max().item() for low in lows) + 2 * floor


def fa3_failure(got, ref, lows, floor=None) -> str | None:
    """FlashAttention-3's criterion for one result (a gradient, a sequence's O), with 1e-6 of slack
    for all-zero results; None if it holds, else what failed. ``floor``: per element, the bound of
    the rounding FlashAttention adds to standard attention's (flash_rounding.forward_floor,
    backward_floor), taken off each element's error first."""
    import torch
    if not bool(torch.isfinite(got).all()):
        return "non-finite values"
    diff = (got.double() - ref).abs()
    excess = diff if floor is None else (diff - floor).clamp_min(0.0)
    err = excess.max().item()
    bound = fa3_bound(ref, lows, got.dtype) + 1e-6
    if err <= bound:
        return None
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    lows = (lows,) if hasattr(lows, "shape") else lows
    return (f"max err {err:.3e} > bound {bound:.3e} (at {worst}: got {got[worst].item():.6g}, float64 "
            f"{ref[worst].item():.6g}, same-precision {', '.join(f'{low[worst].item():.6g}' for low in lows)}"
            + ("" if floor is None else f", floor {floor[worst].item():.3g}") + ")")


def grad_output(gen, shape, dt):
    """dO of a backward case: unit normal, whatever the case's input magnitude. (dO at magnitude 16 beside
    Q, K, V at 16 made fp16 gradients the float64 reference puts past 65504: a varlen case of 2026-12-05,
    |dQ| up to 1.2e5, came back inf, as any fp16 kernel's would.)"""
    import torch
    return torch.randn(shape, generator=gen, device="cuda").to(dt)


def backward_inputs(case: Case) -> tuple:
    """(q, k, v, do, softmax_scale) of a backward case on the GPU, contiguous, from its seed."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
    shapes = ((case.batch, case.seqlen_q, case.heads_q, case.head_dim),
              (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
              (case.batch, case.seqlen_k, case.heads_kv, case.head_dim))
    q, k, v = (torch.randn(s, generator=gen, device="cuda").mul_(case.magnitude).to(dt) for s in shapes)
    do = grad_output(gen, shapes[0], dt)
    scale = case.softmax_scale if case.softmax_scale is not None else case.head_dim ** -0.5
    return q, k, v, do, scale


def _run_backward(case: Case, launch_only: bool = False) -> tuple[bool, str]:
    """dQ, dK, dV of attention() under autograd (the generated backward) against float64 autograd
    of the reference, FlashAttention-3's criterion for each."""
    import torch

    import facodegen
    q, k, v, do, scale = backward_inputs(case)
    if launch_only:
        return _launched(*_backward_launches(case, q, k, v, do))
    leaves = [_layout(x, case.layout).requires_grad_(True) for x in (q, k, v)]
    variant = _backward_variant(case)
    sinks = variant.get("sinks")
    if sinks is not None:     # (a leaf of its own: autograd gives it the SINKS postprocess's gradient)
        leaves.append(sinks.requires_grad_(True))
    out = facodegen.attention(*leaves[:3], causal=case.causal, softmax_scale=case.softmax_scale, arch=case.arch,
                              **variant)
    if case.deterministic:      # only around facodegen's backward: torch's own ops may refuse the mode
        torch.use_deterministic_algorithms(True)
        try:
            got = torch.autograd.grad(out, leaves, do, retain_graph=True)
            again = torch.autograd.grad(out, leaves, do)
        finally:
            torch.use_deterministic_algorithms(False)
    else:
        got = torch.autograd.grad(out, leaves, do)
    if case.deterministic and not all(torch.equal(a, b) for a, b in zip(got, again)):
        return False, "deterministic: two backward runs differ"

    reference_variant = _reference_variant(case)
    if sinks is not None:
        variant["sinks"] = reference_variant["sinks"] = sinks.detach()
    failures = backward_failures(q, k, v, do, case.causal, scale, got[:3], **reference_variant)
    if sinks is not None:
        failures += sinks_gradient_failures([(q, k, v, do)], case.causal, scale, got[3], **reference_variant)
    second = _second_call_knobs(case)
    if second:
        out, lse = facodegen.attention(*(x.detach() for x in leaves[:3]), causal=case.causal,
                                       softmax_scale=case.softmax_scale, arch=case.arch, return_lse=True, **variant)
        again = facodegen.attention_backward(do, *(x.detach() for x in leaves[:3]), out, lse, causal=case.causal,
                                             softmax_scale=case.softmax_scale, arch=_backward_arch(case), **variant,
                                             **second)
        label = ", ".join(f"{name}={value}" for name, value in second.items())
        failures += [f"{label}: {f}" for f in backward_failures(q, k, v, do, case.causal, scale, again[:3],
                                                                 **reference_variant)]
        return not failures, "; ".join(failures) or f"dq, dk, dv ok (autograd; {label})"
    return not failures, "; ".join(failures) or "dq, dk, dv ok"


def _backward_launches(case: Case, q, k, v, do) -> tuple:
    """The sanitizer sweep's backward (launch_only): the forward into a NaN-poisoned O and LSE, then
    attention_backward on them, the kernels autograd runs. Not through autograd, whose O is
    torch.empty_like's: compute-sanitizer's initcheck does not count the sm90 forward's TMA (bulk
    tensor) stores as writes, so every later read of an O that only they wrote is flagged (H200,
    2026-12-03: 115,612 reports in the sm90 backward's first kernel, which reads O and dO; and a
    torch copy kernel reading such an O, whose values are all there, is flagged the same way; the
    sm80 backward after the sm80 forward, whose O is written by plain stores, was clean); the forward
    cases poison their out= for the same reason."""
    import torch

    import facodegen
    q, k, v = (_layout(x, case.layout) for x in (q, k, v))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device, dtype=torch.float32)
    variant = _backward_variant(case)
    facodegen.attention(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale, arch=case.arch, out=out,
                        lse_out=lse, **variant)
    return facodegen.attention_backward(do, q, k, v, out, lse, causal=case.causal, softmax_scale=case.softmax_scale,
                                        arch=_backward_arch(case), **variant, **_backward_knobs(case))


def has_backward_variant(case: Case) -> bool:
    """A case whose attention() and attention_backward calls take a window, top-left alignment, a softcap or
    sinks (_backward_variant's, without making the sinks)."""
    return case.has_variant or case.top_left


def _backward_variant(case: Case, sinks: bool = True) -> dict:
    """A backward case's sliding window, softcap and (``sinks``) its sinks, a new CUDA tensor drawn from its seed,
    as attention() and attention_backward take them ({}: none)."""
    variant = {}
    if (case.window_left, case.window_right) != (-1, -1) or case.top_left:
        variant.update(window_size=(case.window_left, case.window_right),
                       causal_alignment="top_left" if case.top_left else "bottom_right")
    if case.softcap:
        variant["softcap"] = case.softcap
    if case.sinks and sinks:
        import torch
        gen = torch.Generator(device="cuda").manual_seed(case.seed + 1)
        variant["sinks"] = torch.randn(case.heads_q, generator=gen, device="cuda") * 2.0
    return variant


def _reference_variant(case: Case) -> dict:
    """The same variant as the torch references take it (attention_torch's window_size, top_left, softcap; the
    sinks, a tensor, the caller adds)."""
    variant = _backward_variant(case, sinks=False)
    if "window_size" in variant:
        variant["top_left"] = variant.pop("causal_alignment") == "top_left"
    return variant


def _backward_arch(case: Case) -> str | None:
    """The arch a backward case's attention_backward calls ask for: autograd's for the case's forward (sm80
    for an sm80 case, else the default: the sm90 backward where it covers the call), so those calls run the
    kernels autograd runs."""
    from ..ops import backward
    return backward.autograd_arch(case.arch)


def _backward_knobs(case: Case) -> dict:
    """The knobs the launch-only sweep gives attention_backward for ``case`` (deterministic, the second call's)."""
    return {**({"deterministic": True} if case.deterministic else {}), **_second_call_knobs(case)}


def _second_call_knobs(case: Case) -> dict:
    """The knobs of a backward case's second call, attention_backward on the forward's O and LSE ({}: none):
    lpt off (case.lpt_flipped), the rings away from their defaults (case.shallow_rings), dq_lag away from its
    default (case.dq_lag_flipped) or an sm80 tuning knob away from its default (case.sm80_knobs_flipped)."""
    if case.sm80_knobs_flipped:
        return sm80_flipped_knobs(case.head_dim, case.seed)
    if case.lpt_flipped:
        return {"lpt": False}
    if case.shallow_rings:
        return shallow_ring_knobs(case.head_dim, case.dtype, case.causal)
    if case.dq_lag_flipped:
        return {"dq_lag": case.causal}
    return {}


def sm80_flipped_knobs(head_dim: int, seed: int) -> dict:
    """sm80 backward knobs away from the default tile's at ``head_dim`` (an H100/H200's, where the fuzz runs),
    one set by seed // 4 % 4: the other stage count (two only up to head_dim 192, whose ring fits an A100
    too); the tile's defaults before SM80_MEASURED_DEFAULTS (one warp per 16-row slab in every warp grid, two
    k16 steps a loop, one stage); poly_exp2_tiles from 1 to the warp's S_TILES (by seed // 16); frag_prefetch
    (with looped GEMMs, which it pairs up). Each compiles for sm_90 without spills but the old grid at head_dim
    64 (8 bytes, NVRTC 13), which the fuzz runs for its answers, not its speed."""
    from ..spec.backward import BackwardSpec, sm80_dq_row_warps_default, sm80_key_warps_default, sm80_s_tiles
    default = BackwardSpec(arch="sm80", head_dim=head_dim, gpu="h100")
    turn = seed // 4 % 4
    if turn == 0:
        return {"stages": 1} if default.stages == 2 else {"stages": 2} if head_dim <= 192 else {"stages": 1}
    if turn == 1:
        return {"key_warps": sm80_key_warps_default(default.block_n, default.num_warps),
                "dq_row_warps": sm80_dq_row_warps_default(default.block_m, default.num_warps), "k_unroll": 2,
                "stages": 1}
    if turn == 2:
        return {"poly_exp2_tiles": 1 + seed // 16 % sm80_s_tiles(default)}
    return {"frag_prefetch": True, "k_unroll": 2}


def shallow_ring_knobs(head_dim: int, dtype: str, causal: bool) -> dict:
    """sm90 backward knobs away from the rings' defaults: a 1-deep dO ring (dp_lookahead off where it is on:
    its next dP^T would read the one buffer early) and the dQ tile staged in twice its default pieces (at
    most 4): the paths the defaults take at no head_dim or only at 256."""
    from ..spec.backward import SM90_DQ_PIECES_CHOICES, BackwardSpec
    default = BackwardSpec(arch="sm90", head_dim=head_dim, dtype=dtype, causal=causal)
    knobs = {"do_stages": 1, "dq_pieces": min(SM90_DQ_PIECES_CHOICES[-1], 2 * default.dq_pieces)}
    if default.dp_lookahead:
        knobs["dp_lookahead"] = False
    return knobs


def backward_failures(q, k, v, do, causal: bool, scale: float, grads, **variant) -> list[str]:
    """FlashAttention-3's criterion for (dQ, dK, dV) ``grads`` of contiguous q, k, v, do against
    float64 autograd: "dq max err ..." per gradient that fails. ``variant``: window_size, top_left and softcap
    (attention_torch's)."""
    import torch

    def reference(upcast: bool):
        inputs = [(x.double() if upcast else x).detach().requires_grad_(True) for x in (q, k, v)]
        ref_out, _ = attention_torch(*inputs, causal, scale, upcast=upcast, **variant)
        return torch.autograd.grad(ref_out, inputs, do.double() if upcast else do)
    flash_low = attention_backward_flash_rounding(q, k, v, do, causal, scale, **variant)
    floors = (*backward_floor(q, k, v, do, causal, scale, **variant), None)
    return [f"{name} {why}" for name, g, r, lo, flash, floor in zip(("dq", "dk", "dv"), grads, reference(True),
                                                                    reference(False), flash_low, floors)
            if (why := fa3_failure(g, r, (lo, flash), floor))]


def _run_kvcache(case: Case, launch_only: bool = False) -> tuple[bool, str]:
    """attention_with_kvcache (the generated decode/combine/append kernels) on a cache of capacity
    seqlen_k, contiguous or paged with shuffled pages, each sequence's length random (0 included),
    seqlen_new tokens appended first, against facodegen.verify.reference.kvcache_reference: O per sequence
    by FlashAttention-3's criterion, the LSE, -inf rows, the caches after the append."""
    import numpy as np
    import torch

    import facodegen

    from .reference import kvcache_reference
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    cpu = torch.Generator().manual_seed(case.seed)
    dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
    b, hq, hkv, d, cap = case.batch, case.heads_q, case.heads_kv, case.head_dim, case.seqlen_k

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").mul_(case.magnitude).to(dt)
    q = randn(b, case.seqlen_q, hq, d)
    k_full, v_full = randn(b, cap, hkv, d), randn(b, cap, hkv, d)
    table = None
    if case.page_size:
        per_seq = cap // case.page_size
        table = torch.randperm(b * per_seq, generator=cpu).to("cuda").view(b, per_seq).to(torch.int32)
        k_cache = torch.empty(b * per_seq, case.page_size, hkv, d, dtype=dt, device="cuda")
        v_cache = torch.empty_like(k_cache)
        k_cache[table.view(-1).long()] = k_full.view(-1, case.page_size, hkv, d)
        v_cache[table.view(-1).long()] = v_full.view(-1, case.page_size, hkv, d)
    else:
        k_cache, v_cache = k_full, v_full
    lengths = torch.randint(0, cap - case.seqlen_new + 1, (b,), generator=cpu).to(torch.int32).cuda()
    kn = vn = None
    if case.seqlen_new:
        kn, vn = randn(b, case.seqlen_new, hkv, d), randn(b, case.seqlen_new, hkv, d)
    scale = case.softmax_scale if case.softmax_scale is not None else d ** -0.5
    variants = dict(window_size=(case.window_left, case.window_right), softcap=case.softcap)

    def host(x):
        return None if x is None else x.detach().cpu().double().numpy() if x.is_floating_point() else x.cpu().numpy()
    if not launch_only:     # before the call: an append changes the caches in place
        ref_o, ref_lse, ref_kc, ref_vc = kvcache_reference(    # (it copies the tensors to float64 NumPy)
            q, k_cache, v_cache, lengths, page_table=table, k=kn, v=vn,
            causal=case.causal, softmax_scale=scale, **variants)
    out = torch.full_like(q, float("nan"))
    _, lse = facodegen.attention_with_kvcache(q, k_cache, v_cache, lengths, page_table=table, k=kn, v=vn,
                                              causal=case.causal, softmax_scale=case.softmax_scale,
                                              num_splits=case.num_splits, return_lse=True, out=out, arch=case.arch,
                                              **_kvcache_knobs(case), **variants)
    if launch_only:
        return _launched(out, lse)
    o, lse = host(out), host(lse)
    problems = []
    if not np.isfinite(o).all():
        problems.append("O has NaN/inf (an element never written?)")
    if not (np.array_equal(host(k_cache), ref_kc) and np.array_equal(host(v_cache), ref_vc)):
        problems.append("the caches after the append differ")
    empty = np.isneginf(ref_lse)
    if not np.array_equal(np.isneginf(lse), empty):
        problems.append("LSE -inf rows differ")
    elif np.abs(lse[~empty] - ref_lse[~empty]).max(initial=0) > 1e-3 + 1e-4 * np.abs(ref_lse[~empty]).max(initial=0):
        problems.append(f"LSE max err {np.abs(lse[~empty] - ref_lse[~empty]).max():.3e}")
    for seq in range(b):    # O: a same-precision reference over this sequence's own keys
        seqlen_k = min(int(lengths[seq]) + case.seqlen_new, cap)
        if seqlen_k == 0 or not np.isfinite(o[seq]).all():
            continue
        if table is None:
            keys, values = ref_kc[seq, :seqlen_k], ref_vc[seq, :seqlen_k]
        else:
            pos = np.arange(seqlen_k)
            pages = host(table)[seq, pos // case.page_size]
            keys, values = ref_kc[pages, pos % case.page_size], ref_vc[pages, pos % case.page_size]
        one = (q[seq:seq + 1], torch.from_numpy(keys).to("cuda", dt)[None], torch.from_numpy(values).to("cuda", dt)[None])
        ref = torch.from_numpy(ref_o[seq:seq + 1]).to("cuda")
        why = fa3_failure(torch.from_numpy(o[seq:seq + 1]).to("cuda", dt), ref,
                          _standard_low(*one, case.causal, scale, **variants),
                          forward_floor(*one, case.causal, scale, **variants))
        if why:
            problems.append(f"O of sequence {seq} ({seqlen_k} keys): {why}")
    return not problems, "; ".join(problems) or "O, LSE and the caches ok"


def varlen_lengths(case: Case) -> tuple[list[int], list[int]]:
    """Each sequence's query and key lengths in a varlen case, drawn from its seed: 0, 1, the case's
    maximum or any length up to it; one sequence has the maximum query length (so the grid's bound
    max_seqlen_q = case.seqlen_q is met and no call packs zero tokens)."""
    rng = random.Random(case.seed)

    def length(limit: int) -> int:
        return rng.choice((0, 1, limit, rng.randint(1, limit), rng.randint(1, limit)))
    lengths_q = [length(case.seqlen_q) for _ in range(case.batch)]
    lengths_k = [length(case.seqlen_k) for _ in range(case.batch)]
    longest = rng.randrange(case.batch)
    lengths_q[longest] = case.seqlen_q
    lengths_k[longest] = max(lengths_k[longest], 1)     # (and some key, so total_k >= 1)
    return lengths_q, lengths_k


def _varlen_knobs(case: Case) -> dict:
    """The spec fields a varlen case's attention_varlen call passes (one_cta_per_tile, varlen_lpt)."""
    return {"persistent": False} if case.one_cta_per_tile else {"varlen_lpt": True} if case.varlen_lpt else {}


def _run_varlen(case: Case, launch_only: bool = False) -> tuple[bool, str]:
    """attention_varlen on packed sequences of varlen_lengths(case) (the case's layout applied to the
    packed tensors, O poisoned with NaN where the case passes out=), each sequence's O against a
    float64 computation of that sequence alone by FlashAttention-3's criterion, the LSE (heads_q,
    total_q) within 1e-3 + 1e-4 |lse| and -inf exactly where the reference has it. fp8: e4m3 inputs
    with per-tensor descales, the references on the dequantised values, O by the forward fp8 cases'
    criterion (rel_fro within 3e-2 or twice a bf16 computation's) and the LSE within 1e-2 + 1e-3 |lse|."""
    import itertools

    import torch

    import facodegen
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    fp8 = case.dtype == "fp8"
    dt = torch.float16 if case.dtype == "fp16" else torch.bfloat16
    lengths_q, lengths_k = varlen_lengths(case)
    cu_q, cu_k = ([0, *itertools.accumulate(lengths)] for lengths in (lengths_q, lengths_k))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").mul_(case.magnitude).to(dt)
    q = randn(cu_q[-1], case.heads_q, case.head_dim)
    k, v = randn(cu_k[-1], case.heads_kv, case.head_dim), randn(cu_k[-1], case.heads_kv, case.head_dim)
    descales = {}
    if fp8:
        (q8, qd), (k8, kd), (v8, vd) = (facodegen.quantize_e4m3(x) for x in (q, k, v))
        q, k, v = (x8.to(torch.float32) * d for x8, d in ((q8, qd), (k8, kd), (v8, vd)))   # what the kernel sees
        descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        args = [_layout(x[None], case.layout)[0] for x in (q8, k8, v8)]
    else:
        args = [_layout(x[None], case.layout)[0] for x in (q, k, v)]
    out = torch.full(q.shape, float("nan"), dtype=dt, device="cuda") if case.use_out else None
    sinks = (torch.randn(case.heads_q, generator=gen, device="cuda") * 2.0) if case.sinks else None
    variants = dict(window_size=(case.window_left, case.window_right), softcap=case.softcap, sinks=sinks)
    boundaries = [torch.tensor(cu, dtype=torch.int32, device="cuda") for cu in (cu_q, cu_k)]
    out, lse = facodegen.attention_varlen(*args, *boundaries, case.seqlen_q, case.seqlen_k, causal=case.causal,
                                          softmax_scale=case.softmax_scale, return_lse=True, out=out, arch=case.arch,
                                          **variants, **descales, **_varlen_knobs(case))
    grads = None
    if case.varlen_backward:
        do = grad_output(gen, (cu_q[-1], case.heads_q, case.head_dim), dt)
        runs = [facodegen.attention_varlen_backward(do, *args, out, lse, *boundaries, case.seqlen_q, case.seqlen_k,
                                                    causal=case.causal, softmax_scale=case.softmax_scale,
                                                    window_size=variants["window_size"], softcap=case.softcap,
                                                    sinks=sinks, **_varlen_backward_knobs(case))
                for _ in range(2 if case.seed % 8 == 7 and not launch_only else 1)]
        grads = runs[0]
    if launch_only:
        return _launched(out, lse, *(grads or ()))
    scale = case.softmax_scale if case.softmax_scale is not None else case.head_dim ** -0.5
    problems = []
    if grads is not None:
        if len(runs) > 1 and not all(torch.equal(a, b) for a, b in zip(*runs)):
            problems.append("deterministic: two varlen backward runs differ")
        problems += _varlen_gradient_failures(q, k, v, do, cu_q, cu_k, case.causal, scale, grads,
                                              window_size=variants["window_size"], softcap=case.softcap, sinks=sinks)
    for seq, (q0, q1, k0, k1) in enumerate(zip(cu_q, cu_q[1:], cu_k, cu_k[1:])):
        if q0 == q1:
            continue
        one = [x[None, a:b] for x, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        ref, ref_lse = attention_torch(*one, case.causal, scale, upcast=True, **variants)
        lse_bound = 1e-3 + 1e-4 * ref_lse[0].abs()
        if fp8:     # the forward fp8 cases' criterion (run_case's), on this sequence
            why = fp8_failure(out[None, q0:q1], ref, *one, case.causal, scale, **variants)
            lse_bound = 1e-2 + 1e-3 * ref_lse[0].abs()
            if k1 > k0:
                lse_bound = lse_bound + fp8_lse_slack(one[0], one[1], scale)[0]
        else:
            why = fa3_failure(out[None, q0:q1], ref.nan_to_num(0.0),
                              _standard_low(*one, case.causal, scale, **variants),
                              forward_floor(*one, case.causal, scale, **variants))
        got_lse, ref_lse = lse[:, q0:q1].double(), ref_lse[0]
        seen = torch.isfinite(ref_lse)
        if not torch.equal(torch.isneginf(got_lse), ~seen):
            why = (why + "; " if why else "") + "LSE -inf rows differ"
        elif bool(((got_lse - ref_lse).abs() > lse_bound)[seen].any()):
            why = (why + "; " if why else "") + f"LSE max err {(got_lse - ref_lse)[seen].abs().max().item():.3e}"
        if why:
            problems.append(f"sequence {seq} ({q1 - q0} queries, {k1 - k0} keys): {why}")
    return not problems, "; ".join(problems) or f"O and LSE ok ({case.batch} sequences, {cu_q[-1]} query tokens)"


def _varlen_backward_knobs(case: Case) -> dict:
    """attention_varlen_backward's arch and knobs in a varlen_backward case: the case's arch (sm90: its varlen
    backward; sm80: the sm80 kernels; with a window, softcap or sinks the sm80 kernels on either, the only ones
    with them), deterministic for seeds 7 mod 8."""
    variant = (case.window_left, case.window_right) != (-1, -1) or case.softcap or case.sinks
    return {"arch": "sm80" if variant else case.arch, "deterministic": case.seed % 8 == 7}


def _varlen_gradient_failures(q, k, v, do, cu_q, cu_k, causal: bool, scale: float, grads, **variant) -> list[str]:
    """backward_failures per sequence of packed gradients (``variant``: window_size, softcap and sinks, on each
    sequence's diagonal; grads then ends with the sinks' gradient, summed over the sequences); a sequence with no
    query or no key must have zero gradients."""
    problems = []
    sinks = variant.get("sinks")
    if sinks is not None:
        sequences = [tuple(x[None, a:b].contiguous() for x, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1), (do, q0, q1)))
                     for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]) if q1 > q0 and k1 > k0]
        problems += sinks_gradient_failures(sequences, causal, scale, grads[3], **variant)
        grads = grads[:3]
    for seq, (q0, q1, k0, k1) in enumerate(zip(cu_q, cu_q[1:], cu_k, cu_k[1:])):
        got = [g[None, a:b] for g, a, b in zip(grads, (q0, k0, k0), (q1, k1, k1))]
        if q0 == q1 or k0 == k1:
            if any(bool(g.any()) for g in got):
                problems.append(f"gradients of sequence {seq} ({q1 - q0} queries, {k1 - k0} keys) are not zero")
            continue
        one = [x[None, a:b].contiguous() for x, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1), (do, q0, q1))]
        problems += [f"sequence {seq} ({q1 - q0} queries, {k1 - k0} keys): {why}"
                     for why in backward_failures(*one, causal, scale, got, **variant)]
    return problems


def sinks_gradient_failures(problems, causal: bool, scale: float, dsinks, sinks, **variant) -> list[str]:
    """The sinks' gradient ``dsinks`` against float64 autograd of attention_torch with the sinks, summed over
    ``problems`` ((q, k, v, do) each: a batch, or each sequence of a varlen call): its max error at most twice the
    same-precision reference's (through scores and P V in the inputs' dtype) + 1e-3 of its largest value;
    ["dsinks ..."] where it fails."""
    import torch

    def reference(q, k, v, do, upcast: bool):
        inputs = [(x.double() if upcast else x).detach().requires_grad_(True) for x in (q, k, v)]
        s = sinks.detach().double().requires_grad_(True) if upcast else sinks.detach().clone().requires_grad_(True)
        out, _ = attention_torch(*inputs, causal, scale, upcast=upcast, sinks=s, **variant)
        return torch.autograd.grad(out, s, do.double() if upcast else do)[0].double()
    ref = sum(reference(*problem, True) for problem in problems)
    low = sum(reference(*problem, False) for problem in problems)
    if not torch.isfinite(dsinks).all():
        return ["dsinks has non-finite values"]
    err, base = (dsinks.double() - ref).abs().max().item(), (low - ref).abs().max().item()
    bound = 2 * base + 1e-3 * ref.abs().max().item() + 1e-6
    return [] if err <= bound else [f"dsinks max err {err:.3e} > bound {bound:.3e}"]


def _kvcache_knobs(case: Case) -> dict:
    """attention_with_kvcache's knobs in a kvcache case: fused_combine, and producer_warps where it has them."""
    knobs = {"fused_combine": case.fused_combine}
    if case.producer_warps is not None:
        knobs["producer_warps"] = case.producer_warps
    return knobs


def case_specs(case: Case, device: int = 0) -> list:
    """Every kernel spec ``case`` launches on ``device``, as the calls resolve them: the forward's
    (backward cases: and the backward's), or the decode family's decode, combine and append."""
    from ..ops import api
    if case.family == "kvcache":
        from ..ops import kvcache
        paged = case.page_size > 0
        problem = kvcache._Problem(case.batch, case.seqlen_q, case.heads_q, case.heads_kv, case.head_dim, case.dtype,
                                   paged, case.page_size, case.batch * case.seqlen_k // case.page_size if paged else 0,
                                   case.seqlen_k, case.seqlen_new)
        window = kvcache.decode_window((case.window_left, case.window_right), case.softcap, case.causal, problem)
        return kvcache.device_plan_specs(problem, device, case.num_splits, _kvcache_knobs(case), case.arch, window)
    forward = case_spec(case, device)
    if case.family == "backward":
        from ..ops import backward
        info, arch = api.device_info(device), backward.autograd_arch(case.arch)
        causal, knobs = _backward_variant_knobs(case, case.seqlen_q, case.seqlen_k,
                                                {"deterministic": True} if case.deterministic else {})
        specs = [forward, backward.choose(case.head_dim, case.dtype, causal, info, knobs, arch)]
        if _second_call_knobs(case):        # (its own attention_backward call: lpt, shallow_rings, dq_lag, sm80 knobs)
            _, knobs = _backward_variant_knobs(case, case.seqlen_q, case.seqlen_k, _backward_knobs(case))
            specs.append(backward.choose(case.head_dim, case.dtype, causal, info, knobs, arch))
        return specs
    if case.varlen_backward:
        from ..ops import backward
        from ..ops.varlen import plan_bound
        knobs = dict(_varlen_backward_knobs(case), varlen=True)
        arch = knobs.pop("arch")
        causal, knobs = _backward_variant_knobs(case, plan_bound(case.seqlen_q), plan_bound(case.seqlen_k), knobs)
        return [forward, backward.choose(case.head_dim, case.dtype, causal, api.device_info(device), knobs, arch)]
    return [forward]


def _backward_variant_knobs(case: Case, seqlen_q: int, seqlen_k: int, knobs: dict) -> tuple[bool, dict]:
    """(the backward spec's causal flag, ``knobs`` with local / softcap / sinks) of a backward case's window,
    softcap and sinks (backward.variant_knobs, for sequences of ``seqlen_q`` queries and ``seqlen_k`` keys)."""
    from ..ops import backward
    causal, knobs, _ = backward.variant_knobs((case.window_left, case.window_right),
                                              "top_left" if case.top_left else "bottom_right", case.softcap,
                                              case.sinks, case.causal, seqlen_q, seqlen_k, 1.0, knobs)
    return causal, knobs


def case_spec(case: Case, device: int = 0):
    """The forward spec ``facodegen.attention`` picks for ``case`` on ``device`` (its tuning database
    and sequence-length rules included), as the call would resolve it."""
    from ..ops import api
    if case.family == "kvcache":
        raise ValueError("a kvcache case launches no forward kernel (case_specs lists its kernels)")
    fields = {"out_dtype": "bf16", "v_layout": "row"} if case.dtype == "fp8" else {}
    causal = case.causal
    seqlen_q, seqlen_k = case.seqlen_q, case.seqlen_k
    if case.family == "varlen":     # as varlen.attention_varlen resolves it: max_seqlen's plan_bound in the shape
        from ..ops.varlen import plan_bound
        fields.update(varlen=True, **_varlen_knobs(case))
        seqlen_q, seqlen_k = plan_bound(seqlen_q), plan_bound(seqlen_k)
    if case.family in ("variants", "backward") and (case.has_variant or case.top_left) or \
            case.family == "varlen" and case.has_variant:
        # the switches api._variants derives from the call's arguments (varlen: against the plan's bounds)
        local, causal, _, _ = api.window_params(case.window_left, case.window_right, case.causal, seqlen_q,
                                                seqlen_k, case.top_left)
        fields.update(local=local, softcap=case.softcap > 0, sinks=case.sinks)
    if case.head_dim_v and case.head_dim_v != case.head_dim:   # (attention() reads it off v.shape[3])
        fields["head_dim_v"] = case.head_dim_v
    return api.resolve_spec(case.head_dim, case.dtype, causal, device, case.arch,
                            shape=(case.batch, seqlen_q, seqlen_k, case.heads_q), **fields)


def _compile_one(spec):
    """Compile any family's spec for device 0 (its module's compile_for_device); its spilled bytes."""
    from ..ops import api, backward, kvcache
    from ..spec.backward import BackwardSpec
    from ..spec import KernelSpec
    if isinstance(spec, KernelSpec):
        kernel = api.compile_for_device(spec)
    elif isinstance(spec, BackwardSpec):
        kernel = backward.compile_for_device(spec)
    else:   # the decode family's DecodeSpec, CombineSpec, AppendSpec
        kernel = kvcache.compile_for_device(spec)
    return kernel.resources.spill_stores


def precompile(cases: list[Case], workers: int | None = None, log=print) -> int:
    """Compile the distinct kernels of ``cases`` into the compile cache (compile_specs), so the run
    that follows only loads them. Returns the number of kernels."""
    specs = sorted({s for c in cases for s in case_specs(c)}, key=lambda s: (type(s).__name__, s.variant))
    compile_specs(specs, workers, log)
    return len(specs)


def compile_specs(specs, workers: int | None = None, log=print) -> None:
    """Compile ``specs`` for the GPU at hand into the compile cache in ``workers`` processes (NVRTC
    is CPU-bound: a few dozen kernels take minutes one after another)."""
    import concurrent.futures
    import multiprocessing
    import os
    import time
    specs = list(specs)
    workers = workers or min(len(specs), os.cpu_count() or 1) or 1
    start = time.monotonic()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        spilled = [s.variant for s, spills in zip(specs, pool.map(_compile_one, specs)) if spills]
    log(f"{len(specs)} kernels compiled or found in the cache in {time.monotonic() - start:.1f} s "
        f"({workers} processes){'; spilling: ' + ', '.join(spilled) if spilled else ''}")


def _launched(*outputs) -> tuple[bool, str]:
    """launch_only's check: the outputs (NaN-poisoned where the case asks) hold no NaN or +inf
    (-inf is a valid LSE)."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    bad = [i for i, x in enumerate(outputs) if x is not None and bool((x.isnan() | (x == float("inf"))).any())]
    return not bad, f"launched; output(s) {bad} hold NaN or +inf" if bad else "launched"


CASE_SECONDS = 60.0     # a case still running after this long is taken for a hung kernel
SLOW_CASE_SECONDS = 5.0     # a case that took longer is logged (most take milliseconds)


def _watchdog(current: list, limit: float, log, done, exit=None) -> None:
    """Ends the process when the case in ``current`` ([index, case, start] or None) has run more than
    ``limit`` seconds: a hung kernel never returns to Python (a synchronize waits on it, so neither
    Ctrl-C nor SIGTERM gets through), and the case that hung is what the run must report. The main
    thread waits on the GPU without the GIL (torch, ctypes), so this thread runs."""
    import os
    import time
    exit = exit or os._exit
    while not done.wait(min(1.0, limit / 4)):
        running = current[0]
        if running is not None and time.monotonic() - running[2] > limit:
            index, case, start = running
            log(f"HUNG: case {index} still running after {time.monotonic() - start:.0f} s (a kernel that never "
                f"finishes?); the run stops here\n  {case.repro()}")
            exit(3)
            return


def run(cases: list[Case], log=print, fail_fast: bool = False, launch_only: bool = False,
        case_seconds: float | None = CASE_SECONDS) -> dict:
    """Run ``cases``; returns {"cases": n, "failures": [(case, message)], "by": {(family, arch, dtype): [n, failed]},
    "interrupted": bool}. A KeyboardInterrupt (Ctrl-C, or SIGTERM under `check --fuzz`: a time limit)
    ends the run early with the cases run so far counted. A case that runs longer than ``case_seconds``
    (None: no limit) ends the process with exit status 3 after logging its reproducer (_watchdog)."""
    import threading
    current, done = [None], threading.Event()
    if case_seconds:
        threading.Thread(target=_watchdog, args=(current, case_seconds, log, done), daemon=True).start()
    try:
        return _run(cases, log, fail_fast, launch_only, current)
    finally:
        done.set()


def _run(cases, log, fail_fast, launch_only, current) -> dict:
    import time
    failures, by = [], {}
    start = time.monotonic()
    interrupted = False
    for i, case in enumerate(cases, 1):
        began = time.monotonic()
        current[0] = (i, case, began)
        try:
            ok, message = run_case(case, launch_only)
        except KeyboardInterrupt:
            interrupted = True
            log(f"interrupted after {i - 1} of {len(cases)} cases ({time.monotonic() - start:.0f} s)")
            break
        except Exception as err:  # noqa: BLE001 (a refused or crashing case is a failure to report)
            ok, message = False, f"{type(err).__name__}: {err}"
        tally = by.setdefault((case.family, case.arch, case.dtype), [0, 0])
        tally[0] += 1
        if not ok:
            tally[1] += 1
            failures.append((case, message))
            log(f"FAIL {message}\n  {case.repro()}")
            if fail_fast:
                break
        if time.monotonic() - began > SLOW_CASE_SECONDS:     # where a run's time goes, if not to a hang
            log(f"slow: case {i} took {time.monotonic() - began:.1f} s\n  {case.repro()}")
        if i % 250 == 0:
            log(f"{i} cases, {len(failures)} failed, {time.monotonic() - start:.0f} s")
    return {"cases": sum(n for n, _ in by.values()), "failures": failures, "by": by, "interrupted": interrupted}


def summary(result: dict) -> str:
    rows = ["| family | arch | dtype | cases | failed |", "|---|---|---|---|---|"]
    for (family, arch, dtype), (n, failed) in sorted(result["by"].items()):
        rows.append(f"| {family} | {arch} | {dtype} | {n} | {failed} |")
    rows.append(f"| all{' (interrupted)' if result.get('interrupted') else ''} | | | {result['cases']} | "
                f"{len(result['failures'])} |")
    return "\n".join(rows)


def representative_cases() -> list[Case]:
    """One small case per arch, dtype and causal (odd lengths, GQA, a strided layout, the LSE and
    out= asked for), and per arch and causal a bf16 variants case (a window that skips and masks
    blocks, softcap and sinks at once), per arch two padded head dims (80, 8) and head_dim 192 with V of
    128 (head_dim_v), the backward per arch (and at the padded head dim 80, cases 57 and 58; the decode there,
    case 59),
    dtype and causal (sm80 fp16's deterministic; sm90 fp16 once more, deterministic; sm90 bf16 at
    head_dim 256; sm90 with more tiles than SMs, and with lpt; last, sm90 with the rings away from their
    defaults and with dq_lag; sm80 with one warp a slab and looped GEMMs), two
    decode-family cases (paged with an append and a split, contiguous MQA-like packing), and fp8 with
    the variants, alone and varlen, and padded, and the sliding-window and softcap backward (cases 60-62, 62
    varlen): what the sanitizer sweep (scripts/sanitize.py) runs under each tool."""
    def packed(arch: str, dtype: str, head_dim: int, causal: bool, seed: int, seqlen_k: int = 257, **variant) -> Case:
        """A varlen case: six packed sequences drawn from ``seed`` under 300 queries and ``seqlen_k`` keys, GQA
        4/2, a strided token axis, the LSE asked for and O poisoned."""
        return Case("varlen", arch, dtype, batch=6, seqlen_q=300, seqlen_k=seqlen_k, heads_q=4, heads_kv=2,
                    head_dim=head_dim, causal=causal, softmax_scale=None, layout="strided", magnitude=1.0,
                    return_lse=True, use_out=True, seed=seed, **variant)

    cases = []
    for arch, dtypes in (("sm80", ("bf16", "fp16")), ("sm90", ("bf16", "fp16", "fp8"))):
        for dtype in dtypes:
            for causal in (False, True):
                cases.append(Case("forward", arch, dtype, batch=2, seqlen_q=77 if causal else 200, seqlen_k=200,
                                  heads_q=4, heads_kv=2, head_dim=128, causal=causal, softmax_scale=None,
                                  layout="strided", magnitude=1.0, return_lse=True, use_out=True, seed=7))
        for causal in (False, True):
            cases.append(Case("variants", arch, "bf16", batch=2, seqlen_q=77 if causal else 300, seqlen_k=300,
                              heads_q=4, heads_kv=2, head_dim=128, causal=causal, softmax_scale=None,
                              layout="strided", magnitude=1.0, return_lse=True, use_out=True, seed=7,
                              window_left=64 if causal else 33, window_right=-1 if causal else 17, softcap=30.0,
                              sinks=True))
        # padded head dims: 80 on the 96 tile (causal, GQA) and 8 on the 64 tile (one query block
        # over odd keys), O poisoned: a read or write past head_dim shows under memcheck
        for dtype, head_dim, causal in (("bf16", 80, True), ("fp16", 8, False)):
            cases.append(Case("head_dims", arch, dtype, batch=2, seqlen_q=77 if causal else 45, seqlen_k=203,
                              heads_q=4, heads_kv=2, head_dim=head_dim, causal=causal, softmax_scale=None,
                              layout="strided", magnitude=1.0, return_lse=True, use_out=True, seed=7))
        # V narrower than Q and K (DeepSeek MLA prefill's 192 / 128), causal, O poisoned: an O store past
        # head_dim_v, or a V read past it, shows under memcheck
        cases.append(Case("head_dims", arch, "bf16", batch=2, seqlen_q=77, seqlen_k=203, heads_q=4, heads_kv=2,
                          head_dim=192, causal=True, softmax_scale=None, layout="strided", magnitude=1.0,
                          return_lse=True, use_out=True, seed=7, head_dim_v=128))
    # The backward once per dtype and causal (odd lengths, GQA, strided): after an sm80 forward the
    # sm80 backward; after an sm90 one the sm90 backward (head_dim 128: dQ split by columns between
    # the consumer warpgroups; 64: by keys, both adding into the same dQ rows); then the decode family
    # (paged with an append and a split; contiguous with GQA packing).
    # seeds 8 and 12: deterministic (sm90's at head_dim 64, where its warpgroups take turns inside the CTA too)
    for arch, seeds, head_dims in (("sm80", (7, 8), (128, 128)), ("sm90", (7, 9, 12), (128, 64, 64))):
        for dtype, seed, head_dim in zip(("bf16", "fp16", "fp16"), seeds, head_dims):
            for causal in (False, True):
                cases.append(Case("backward", arch, dtype, batch=2, seqlen_q=113, seqlen_k=203, heads_q=4, heads_kv=2,
                                  head_dim=head_dim, causal=causal, softmax_scale=None, layout="strided",
                                  magnitude=1.0, return_lse=False, use_out=False, seed=seed))
    # the sm90 backward at head_dim 256 (both warpgroups on the same 64 keys, P^T and dS^T through
    # shared memory, each warpgroup half of head_dim): once per causal
    for causal in (False, True):
        cases.append(Case("backward", "sm90", "bf16", batch=2, seqlen_q=113, seqlen_k=203, heads_q=4, heads_kv=2,
                          head_dim=256, causal=causal, softmax_scale=None, layout="strided", magnitude=1.0,
                          return_lse=False, use_out=False, seed=7))
    # the sm90 backward with more key blocks than SMs (64 x 2 kv heads x batch 2 = 256 tiles: persistent CTAs
    # take several, the producer loading one's K, V while the consumers write the last one's dK, dV), causal
    # with seqlen_q < seqlen_k (most blocks see no query: no K, V load, zeros)
    cases.append(Case("backward", "sm90", "fp16", batch=2, seqlen_q=113, seqlen_k=8192, heads_q=4, heads_kv=2,
                      head_dim=128, causal=True, softmax_scale=None, layout="strided", magnitude=1.0,
                      return_lse=False, use_out=False, seed=7))
    # with lpt (the causal default), and without (seed 10: case.lpt_flipped): 64 key blocks x 6 (kv head, batch)
    # pairs, one L2 group (their Q and dO take 0.9 MB), run key block first across the pairs; GQA; 3 query
    # blocks (block_m 128), the last partial
    cases.append(Case("backward", "sm90", "bf16", batch=3, seqlen_q=300, seqlen_k=8192, heads_q=4, heads_kv=2,
                      head_dim=64, causal=True, softmax_scale=None, layout="strided", magnitude=1.0,
                      return_lse=False, use_out=False, seed=10))
    # (the rings away from their defaults, dq_lag, varlen_lpt, varlen's variants, the decode's and fp8 varlen:
    # cases 44-50, appended last so the numbers above stay)
    cases.append(Case("kvcache", "sm90", "bf16", batch=3, seqlen_q=4, seqlen_k=1024, heads_q=8, heads_kv=2,
                      head_dim=128, causal=True, softmax_scale=None, layout="contiguous", magnitude=1.0,
                      return_lse=True, use_out=False, seed=7, page_size=64, seqlen_new=3, num_splits=4))
    cases.append(Case("kvcache", "sm90", "fp16", batch=2, seqlen_q=1, seqlen_k=777, heads_q=32, heads_kv=4,
                      head_dim=64, causal=True, softmax_scale=None, layout="contiguous", magnitude=1.0,
                      return_lse=True, use_out=False, seed=7))
    # Varlen per arch, dtype and causal: six packed sequences (seed 11: queries with no key, keys with
    # no query, one query against 257 keys, odd lengths), GQA, a strided token axis, O poisoned; sm90
    # (its own varlen kernel: TMA over the packed tokens, O by TMA where 64 rows lie inside the sequence,
    # else row by row) at head_dims 128 and 64.
    for arch in ("sm80", "sm90"):
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                cases.append(packed(arch, dtype, 64 if arch == "sm90" and dtype == "fp16" else 128, causal,
                                    VARLEN_REPRESENTATIVE_SEED))
    # the sm90 backward with its rings away from their defaults (seeds 3 mod 8: case.shallow_rings): head_dim
    # 128 causal (a 1-deep dO ring, dp_lookahead off, the dQ tile in 2 pieces) and 256 (4 pieces, 2 buffers)
    for head_dim, causal, seed in ((128, True, 11), (256, False, 19)):
        cases.append(Case("backward", "sm90", "bf16", batch=2, seqlen_q=113, seqlen_k=203, heads_q=4, heads_kv=2,
                          head_dim=head_dim, causal=causal, softmax_scale=None, layout="strided", magnitude=1.0,
                          return_lse=False, use_out=False, seed=seed))
    # and with dq_lag (seed 13: case.dq_lag_flipped), causal over 300 queries: tiles of one to five steps, two query
    # heads a kv head (the lagged dQ's head changes within a tile): case 46
    cases.append(Case("backward", "sm90", "bf16", batch=2, seqlen_q=300, seqlen_k=300, heads_q=4, heads_kv=2,
                      head_dim=128, causal=True, softmax_scale=None, layout="strided", magnitude=1.0,
                      return_lse=False, use_out=False, seed=13))
    # and varlen_lpt (seed 14: case.varlen_lpt), causal: sequences of 20,000 keys put 3 of the 4 heads in
    # an L2 section (the last section one head), one has no key: case 47
    cases.append(packed("sm90", "bf16", 128, True, 14, seqlen_k=20000))
    # and the attention variants with varlen (window on each sequence's diagonal, softcap, sinks): case 48
    cases.append(packed("sm90", "bf16", 128, False, VARLEN_REPRESENTATIVE_SEED, window_left=40, window_right=7,
                        softcap=30.0, sinks=True))
    # and the decode's window and softcap over a paged cache, split, with an append: case 49
    cases.append(Case("kvcache", "sm90", "bf16", batch=3, seqlen_q=4, seqlen_k=1024, heads_q=8, heads_kv=2,
                      head_dim=128, causal=True, softmax_scale=None, layout="contiguous", magnitude=1.0,
                      return_lse=True, use_out=False, seed=7, page_size=16, seqlen_new=3, num_splits=4,
                      window_left=200, window_right=-1, softcap=30.0))
    # and fp8 varlen (e4m3 q, k, v with per-tensor descales, O in bf16), causal, GQA: case 50
    cases.append(packed("sm90", "fp8", 128, True, VARLEN_REPRESENTATIVE_SEED))
    # (the varlen cases of seed 11 above, 3 mod 4, run attention_varlen_backward on their O and LSE too:
    # case.varlen_backward) and the varlen backward's deterministic turns (seed 15, 7 mod 8: queries that
    # see no key, sequences of one query and one key), causal, head_dim 64: case 51
    cases.append(packed("sm80", "fp16", 64, True, 15))
    # and the sm90 varlen backward's deterministic turns (at each sequence's padded blocks), head_dim 128: case 52
    cases.append(packed("sm90", "bf16", 128, True, 15))
    # the sm80 backward with one warp a slab and looped GEMMs (seed 5: case.sm80_knobs_flipped, its turn 1), causal
    # over 239 queries, GQA: four query blocks a head: case 53
    cases.append(Case("backward", "sm80", "bf16", batch=2, seqlen_q=239, seqlen_k=203, heads_q=4, heads_kv=2,
                      head_dim=128, causal=True, softmax_scale=None, layout="strided", magnitude=1.0,
                      return_lse=False, use_out=False, seed=5))
    # fp8 with the attention variants (e4m3 with descales): a two-sided window over 1000 keys (blocks masked at
    # both edges and unmasked between: the mask-free loop's third, left-edge loop), softcap and sinks: case 54;
    # and fp8 varlen with them (each sequence's own diagonal): case 55
    cases.append(Case("variants", "sm90", "fp8", batch=2, seqlen_q=1000, seqlen_k=1000, heads_q=4, heads_kv=2,
                      head_dim=128, causal=False, softmax_scale=None, layout="strided", magnitude=1.0,
                      return_lse=True, use_out=True, seed=7, window_left=300, window_right=17, softcap=30.0,
                      sinks=True))
    cases.append(packed("sm90", "fp8", 128, False, VARLEN_REPRESENTATIVE_SEED, window_left=40, window_right=7,
                        softcap=30.0, sinks=True))
    # and an fp8 padded head dim, 80 on the 96 tile (causal, GQA), O poisoned: case 56
    cases.append(Case("head_dims", "sm90", "fp8", batch=2, seqlen_q=77, seqlen_k=203, heads_q=4, heads_kv=2,
                      head_dim=80, causal=True, softmax_scale=None, layout="strided", magnitude=1.0,
                      return_lse=True, use_out=True, seed=7))
    # and the backward at a padded head dim, 80 on the 96 tile, per arch: causal, GQA, sm90's with lpt off too
    # (seed 6, 2 mod 4: case.lpt_flipped), sm80's deterministic (seed 8, 0 mod 4): cases 57, 58
    for arch, seed in (("sm90", 6), ("sm80", 8)):
        cases.append(Case("backward", arch, "bf16", batch=2, seqlen_q=239, seqlen_k=203, heads_q=4, heads_kv=2,
                          head_dim=80, causal=True, softmax_scale=None, layout="strided", magnitude=1.0,
                          return_lse=True, use_out=False, seed=seed))
    # and the decode at a padded head dim, 80 on the 96 tile: a paged cache, split (d-wide partials), an
    # append of d-wide rows: case 59
    cases.append(Case("kvcache", "sm90", "bf16", batch=3, seqlen_q=2, seqlen_k=1024, heads_q=8, heads_kv=2,
                      head_dim=80, causal=True, softmax_scale=None, layout="contiguous", magnitude=1.0,
                      return_lse=True, use_out=False, seed=7, page_size=64, seqlen_new=3, num_splits=4))
    # and the sliding-window backward (the sm80 LOCAL kernels, after either arch's forward): causal with 50 keys
    # to the left over 239 x 203 (rows that see no key, blocks skipped above the window), GQA, with sinks (the
    # SINKS postprocess's gradient): case 60; and a
    # two-sided window of (33, 17) with softcap 30 (the SOFTCAP kernels), fp16, head_dim 64, after the sm90
    # forward: case 61
    cases.append(Case("backward", "sm80", "bf16", batch=2, seqlen_q=239, seqlen_k=203, heads_q=4, heads_kv=2,
                      head_dim=128, causal=True, softmax_scale=None, layout="strided", magnitude=1.0,
                      return_lse=True, use_out=False, seed=14, window_left=50, window_right=-1, sinks=True))
    cases.append(Case("backward", "sm90", "fp16", batch=2, seqlen_q=300, seqlen_k=300, heads_q=4, heads_kv=2,
                      head_dim=64, causal=False, softmax_scale=None, layout="strided", magnitude=1.0,
                      return_lse=True, use_out=False, seed=22, window_left=33, window_right=17, softcap=30.0))
    # and the varlen backward with a window and softcap on each sequence's diagonal (seed 11, 3 mod 8: its
    # varlen_backward, on the sm80 LOCAL and SOFTCAP kernels) after the sm90 varlen forward: case 62
    cases.append(packed("sm90", "bf16", 128, True, VARLEN_REPRESENTATIVE_SEED, window_left=40, window_right=-1,
                        softcap=30.0))
    return cases


if __name__ == "__main__":  # python -m facodegen.verify.fuzz [--launch-only] CASE_JSON ... (the sanitizer sweep's child)
    import sys

    launch_only = "--launch-only" in sys.argv[1:]
    given = [Case.from_json(arg) for arg in sys.argv[1:] if arg != "--launch-only"]
    if len(given) > 1:      # in parallel first (the sweep's warm-up run): one by one it takes minutes
        precompile(given)
    # Under a sanitizer (--launch-only) a case runs many times slower: the sweep times its children itself.
    outcome = run(given, launch_only=launch_only, case_seconds=None if launch_only else CASE_SECONDS)
    print(summary(outcome))
    sys.exit(1 if outcome["failures"] else 0)
