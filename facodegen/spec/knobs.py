"""The knob registry: each KernelSpec field declared once, with its type, domain, archs, command-line
flag, tuner values, variant-name token and one line of doc.

Derived from it (nothing else lists knobs): the type check every KernelSpec runs first
(spec._check_types), the spec flags of `facodegen emit/inspect/check/bench` (cli.spec_options) and
the fields they give, the variant name (`variant`: each knob's token, in registry order), the
`facodegen emit` line of a generated file (render.emit_command: the problem and its tile, then the
knobs a shorter line would not reproduce, spelt by their flags), the tuner's search space
(tune.SEARCH_SPACE), the knobs a tuning-database entry may set, and the knob table of
docs/knobs.md (`python -m facodegen.spec.knobs`, kept equal to the registry by a test).

Adding a knob: one entry here (where its token belongs in the name), the KernelSpec field with its
default rule in spec.py, and the template that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Domains (spec.py re-exports them under its older names).
ARCHS = ("sm80", "sm90")
HEAD_DIMS = (64, 96, 128, 192, 256)
# Any head_dim that is a multiple of 8 in [8, 256] runs (16-bit forward, issue 40): on the tile of
# tile_head_dim(d), the smallest of HEAD_DIMS >= d, with the columns past d zero-filled on load and
# not stored (spec field head_dim_real).
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_STEP = 8, 256, 8


def head_dim_problem(head_dim) -> str | None:
    """Why ``head_dim`` is no head dimension any forward kernel takes (None if it is one): an integer,
    a multiple of 8 in [8, 256]."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        return f"must be an integer, got {head_dim!r}"
    if head_dim % HEAD_DIM_STEP or not HEAD_DIM_MIN <= head_dim <= HEAD_DIM_MAX:
        return (f"{head_dim} is not supported: it must be a multiple of {HEAD_DIM_STEP} in [{HEAD_DIM_MIN}, "
                f"{HEAD_DIM_MAX}] (rows of 16 bytes for the 16-byte loads and TMA)")
    return None


def tile_head_dim(head_dim: int) -> int:
    """The tile head_dim a head dimension runs on: the smallest of HEAD_DIMS >= head_dim."""
    return next(d for d in HEAD_DIMS if d >= head_dim)
# head_dim_v != head_dim (issue 40, part 2: V and O narrower than Q and K, e.g. DeepSeek MLA prefill,
# 192 / 128): both head dims whole 64-column slabs, so the V and O tiles have Q's and K's swizzle
# (sm80: 8-chunk rows; sm90: 128B slabs of 64 columns) and the kernels only count slabs differently.
HEAD_DIMS_V = (64, 128, 192, 256)


def head_dim_v_problem(head_dim_v, head_dim: int, head_dim_real: int) -> str | None:
    """Why ``head_dim_v`` (differing from the tile's ``head_dim``) is no V head dimension the forward
    kernels take with it (None if they take it)."""
    why = head_dim_problem(head_dim_v)
    if why is not None:
        return why
    if head_dim_real != head_dim:
        return (f"head_dim_v={head_dim_v} with a padded head_dim={head_dim_real} (on the {head_dim} tile) is not "
                f"supported: a head_dim_v of its own needs head_dim in {', '.join(map(str, HEAD_DIMS_V))}")
    if head_dim_v not in HEAD_DIMS_V or head_dim not in HEAD_DIMS_V:
        return (f"head_dim_v={head_dim_v} with head_dim={head_dim} is not supported: when they differ both must be "
                f"one of {', '.join(map(str, HEAD_DIMS_V))} (whole 64-column slabs, so V and O share Q's and K's "
                f"tile layout)")
    if head_dim_v > head_dim:
        return (f"head_dim_v={head_dim_v} exceeds head_dim={head_dim}: the O staging tile takes Q's place (or "
                f"the V ring's), which is block_m x head_dim: use head_dim_v <= head_dim")
    return None


DTYPES = ("fp16", "bf16", "fp8")
OUT_DTYPES = ("bf16", "fp16")
V_LAYOUTS = ("row", "transposed")
SCHEDULES = ("fa2", "fa1")
FA1_SWITCHES = {
    "loop_order": ("kv_outer", "q_outer"),
    "warp_split": ("kv", "q"),
    "rescale": ("every_step", "once"),
}
GPU_NAMES = ("a100", "h100", "h200", "sm86", "sm89")
BOTH = ("sm80", "sm90")
SM90 = ("sm90",)


FA1_CHOICES = {name: choices[0] for name, choices in FA1_SWITCHES.items()}
# Variant-name tokens of the fa1 switches flipped away from FA1's choice.
FA1_SWITCH_TOKENS = {"loop_order": "qouter", "warp_split": "splitq", "rescale": "once"}


# Variant-name tokens: token(spec, value of the knob) -> its part of the name, or None.
def _flag(token: str):
    return lambda spec, value: token if value else None


def _count(prefix: str):
    return lambda spec, value: f"{prefix}{value}" if value != 1 else None


def _fa1_switch(name: str):
    return lambda spec, value: FA1_SWITCH_TOKENS[name] if spec.schedule == "fa1" and value != FA1_CHOICES[name] else None


def _scheduler_token(spec, value):
    """dyn/stat where the persistent scheduler is not the one causal-ness picks by default."""
    if spec.persistent and value != spec.causal:
        return "dyn" if value else "stat"
    return None


@dataclass(frozen=True)
class Knob:
    """One KernelSpec field.

    kind: "text" (one of ``choices``), "int" (``choices``, where given, are the values the command
    line offers), "bool" (``flag`` is "--on/--off"). ``flag``: the command-line spelling; "" for
    fields set through another flag (producer_regs/consumer_regs: --regs P/C). ``search``: the
    tuner's values per arch ({} = not searched). ``problem``: a problem field (what is computed:
    arch, head_dim, dtype, causal), not a tuning knob."""
    name: str
    kind: str
    doc: str
    archs: tuple[str, ...] = BOTH
    choices: tuple = ()
    flag: str = ""
    search: dict | None = None
    problem: bool = False
    flag_offers_choices: bool = True    # False: the flag takes any integer and the spec names what is wrong
    token: Callable | None = None       # spec -> its part of the variant name, or None (no part)

    def command_text(self, value) -> str:
        """This knob at ``value`` on a `facodegen emit` line: the on or off flag of a bool, else the
        flag and the value."""
        if self.kind == "bool":
            on, off = self.flag.split("/")
            return on if value else off
        return f"{self.flag} {value}"

    def parse(self, text: str):
        """This knob's value from command-line text ('1', 'true', 'fa1'), typed as the spec wants it;
        ValueError naming the knob otherwise."""
        text = text.strip()
        if self.kind == "bool":
            spelled = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
            if text.lower() not in spelled:
                raise ValueError(f"{self.name}={text!r}: expected 1/0 or true/false")
            return spelled[text.lower()]
        if self.kind == "int":
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"{self.name}={text!r}: expected an integer") from None
        return text

    @property
    def dest(self) -> str:
        """The click parameter name of the flag (what the command function receives)."""
        first = self.flag.split("/")[0].removeprefix("--")
        return first.replace("-", "_")


KNOBS: tuple[Knob, ...] = (
    Knob("arch", "text", "Target: sm80 (FA2, mma.sync) or sm90 (FA3, TMA + wgmma).", choices=ARCHS, flag="--arch",
         problem=True,
         token=lambda s, v: f"flash_fwd_{s.arch}"),
    Knob("dtype", "text", "Element type of Q, K, V (and O): fp16, bf16, or fp8 = e4m3 (sm90; O in --out-dtype).",
         choices=DTYPES, flag="--dtype", problem=True,
         token=lambda s, v: s.dtype),
    Knob("head_dim", "int", f"Head dimension d of the kernel's tiles: {', '.join(map(str, HEAD_DIMS))}; any other "
         f"multiple of 8 (fp8: of 16) in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}] runs on the next one's tile (sets "
         f"--head-dim-real).",
         choices=HEAD_DIMS, flag="--head-dim", problem=True, flag_offers_choices=False,
         token=lambda s, v: f"hd{s.head_dim}"),
    Knob("head_dim_real", "int", "The problem's head dimension when below the tile's head_dim (default: head_dim): "
         "Q/K/V columns past it load as zeros, O's are not stored.", flag="--head-dim-real", problem=True,
         flag_offers_choices=False,
         token=lambda s, v: f"d{v}" if v != s.head_dim else None),
    Knob("head_dim_v", "int", "Head dimension of V and O when it differs from head_dim (default: head_dim): "
         f"{', '.join(map(str, HEAD_DIMS_V))}, at most head_dim, which must then be one of those too (16-bit "
         "forward; e.g. DeepSeek MLA prefill: --head-dim 192 --head-dim-v 128).", flag="--head-dim-v",
         problem=True, flag_offers_choices=False,
         token=lambda s, v: f"dv{v}" if v != s.head_dim else None),
    Knob("block_m", "int", "Query rows per CTA tile (BLOCK_M).", flag="--block-m",
         search={"sm80": (64, 128)},
         token=lambda s, v: f"bm{s.block_m}"),
    Knob("block_n", "int", "Key/value rows per tile (BLOCK_N).", flag="--block-n",
         # sm90: wgmma N and the TMA box, multiples of 16; below 64 the Q K^T GEMM is too thin to
         # pay for its barriers, and FA3's own table uses 80..192 for the forward pass.
         search={"sm90": (64, 80, 96, 112, 128, 144, 160, 176, 192, 224), "sm80": (32, 64, 128)},
         token=lambda s, v: f"bn{s.block_n}"),
    Knob("num_warps", "int", "Warps per CTA (num_warps).", flag="--warps", search={"sm80": (4, 8)},
         token=lambda s, v: f"w{s.num_warps}"),
    Knob("stages", "int", "Depth of the K/V shared-memory ring.", flag="--stages",
         # sm90: 2 = FA3's ring, 3 where the tiles leave room; sm80: 3 lose occupancy at d128 but
         # may win at d64 (perf notes).
         search={"sm90": (2, 3), "sm80": (1, 2, 3)},
         token=lambda s, v: f"st{s.stages}"),
    Knob("gpu", "text", "Whose limits the budget model applies (sm86: A10/A40/RTX 30, sm89: L4/L40/RTX 40, 99 KB "
         "of shared memory per block).", choices=GPU_NAMES, flag="--gpu"),
    Knob("consumer_warpgroups", "int", "sm90: consumer warpgroups (block_m = 64 x this).", SM90, (1, 2, 3),
         "--consumer-warpgroups", search={"sm90": (1, 2, 3)}, flag_offers_choices=False),
    Knob("producer_regs", "int", "sm90: setmaxnreg registers of the producer warpgroup (--regs P/C).", SM90,
         token=lambda s, v: f"r{s.producer_regs}x{s.consumer_regs}"),
    Knob("consumer_regs", "int", "sm90: setmaxnreg registers of each consumer warpgroup (--regs P/C).", SM90),
    Knob("pingpong", "bool", "sm90: ping-pong scheduling of consumer warpgroups.", SM90,
         flag="--pingpong/--no-pingpong", search={"sm90": (True, False)},
         token=_flag("pp")),
    Knob("intra_wg_overlap", "bool", "sm90: overlap the next QK^T with this softmax.", SM90,
         flag="--overlap/--no-overlap", search={"sm90": (True, False)},
         token=_flag("ov")),
    Knob("persistent", "bool", "sm90: one CTA per SM with a tile scheduler (varlen too: its tiles numbered "
         "densely over the sequences by a warp scan of cu_seqlens_q in the kernel; off: one CTA per tile).", SM90,
         flag="--persistent/--no-persistent",
         # the ablation (docs/perf-notes.md) has non-persistent within 2-5%: searched near the default
         search={"sm90": (True, False)},
         token=lambda s, v: None if s.persistent else "np"),
    Knob("separate_o", "bool", "sm90: O staging tile in its own shared-memory buffer (default: when it fits).",
         SM90, flag="--separate-o/--o-aliases-q",
         # own O buffer (next Q loads under the epilogue) vs O aliasing Q (more room for K/V)
         search={"sm90": (True, False)},
         token=_flag("so")),
    Knob("l2_hints", "bool", "sm90: L2 eviction hints on TMA loads.", SM90, flag="--l2-hints/--no-l2-hints",
         token=lambda s, v: None if s.l2_hints else "nol2"),
    Knob("anchor_softmax", "bool", "sm90: keep the softmax (fp8: its row max pass) ahead of the P V wgmma wait (a "
         "shared store ptxas cannot pass).", SM90, flag="--anchor-softmax/--no-anchor-softmax",
         search={"sm90": (True, False)},
         token=_flag("anc")),
    Knob("rescale_under_qk", "bool", "sm90 with --overlap: O's rescale between the next Q K^T and P V issues.", SM90,
         flag="--rescale-under-qk/--rescale-after-pv", search={"sm90": (True, False)},
         token=_flag("rsq")),
    Knob("uniform_wg", "bool", "sm90: consumer warpgroup index broadcast from lane 0 (descriptors in uniform "
         "registers).", SM90, flag="--uniform-wg/--no-uniform-wg", search={"sm90": (True, False)},
         token=_flag("uwg")),
    Knob("optimistic_max", "bool", "sm90: exp2s from the running row max; the row sums (fp8: the max) say when to "
         "redo a step.", SM90, flag="--optimistic-max/--exact-max", search={"sm90": (True, False)},
         token=_flag("opt")),
    Knob("q_in_regs", "bool", "sm80, sm90 fp8: keep Q fragments in registers (sm90: Q K^T reads A from registers).",
         flag="--q-in-regs/--q-in-smem", search={"sm80": (False, True)},
         token=_flag("qreg")),
    Knob("schedule", "text", "sm80: fa2 (default) or fa1 (FlashAttention-1's schedule, "
         "templates/sm80/flash_fwd_fa1.cu.j2).", ("sm80",), SCHEDULES, "--schedule",
         token=lambda s, v: None if s.schedule == "fa2" else s.schedule),
    Knob("loop_order", "text", "fa1: kv_outer (FA1: one CTA per batch x head, O/m/l in global memory) or q_outer "
         "(FA2).", ("sm80",), FA1_SWITCHES["loop_order"], "--loop-order",
         token=_fa1_switch("loop_order")),
    Knob("warp_split", "text", "fa1: kv (FA1: warps split the keys, exchange through shared memory) or q (FA2).",
         ("sm80",), FA1_SWITCHES["warp_split"], "--warp-split",
         token=_fa1_switch("warp_split")),
    Knob("rescale", "text", "fa1: every_step (FA1: O normalised every K/V block) or once (FA2).", ("sm80",),
         FA1_SWITCHES["rescale"], "--rescale",
         token=_fa1_switch("rescale")),
    Knob("ctas_per_sm", "int", "sm90: CTAs sharing one SM (2, 3: one consumer warpgroup each, short sequences).",
         SM90, (1, 2, 3), "--ctas-per-sm", search={"sm90": (1, 2, 3)},
         token=_count("c")),
    Knob("cluster_m", "int", "sm90 16-bit, non-causal: CTAs per cluster sharing each K/V tile (TMA multicast).",
         SM90, (1, 2), "--cluster-m",
         token=_count("cl")),
    Knob("o_in_v", "bool", "sm90 16-bit: the O staging tile aliases the V ring (next tile's Q K^T under the O "
         "store).", SM90, flag="--o-in-v/--o-not-in-v", search={"sm90": (True, False)},
         token=_flag("oinv")),
    Knob("q_stages", "int", "sm90: Q buffers (2: the next tile's Q loads while this tile runs).", SM90, (1, 2),
         "--q-stages",
         token=_count("q")),
    Knob("p_buffers", "int", "sm90 with --overlap --optimistic-max: P register buffers (2: a step's softmax runs "
         "under the P V before it).", SM90, (1, 2), "--p-buffers", search={"sm90": (1, 2)},
         token=_count("p")),
    Knob("rebuild_q_desc", "bool", "sm90, Q in shared memory: Q's wgmma descriptors derived at every Q K^T instead "
         "of held in registers.", SM90, flag="--rebuild-q-desc/--keep-q-desc", search={"sm90": (False, True)},
         token=_flag("rqd")),
    Knob("dynamic_scheduler", "bool", "sm90 persistent: tiles after each CTA's first from an atomic counter "
         "(default: causal, fp8 to head_dim 128).", SM90, flag="--dynamic-scheduler/--static-scheduler",
         token=_scheduler_token),
    Knob("stream_k", "bool", "sm90 fp8 non-causal, static scheduler: the last waves cut along the keys, one equal "
         "share per CTA.", SM90, flag="--stream-k/--no-stream-k",
         # fp8 non-causal only (a SpecError elsewhere: skipped)
         search={"sm90": (False, True)},
         token=_flag("sk")),
    Knob("l2_prefetch", "int", "sm90: K/V blocks ahead of its loads the loader prefetches into L2 (0: off).", SM90,
         (0, 1, 2, 3, 4), "--l2-prefetch",
         token=lambda s, v: f"pf{s.l2_prefetch}" if s.l2_prefetch else None),
    Knob("vt_in_place", "bool", "sm90 fp8, --v-layout row: V lands in its V^T slot and is transposed there (no "
         "row-V ring; three stages where they fit).", SM90, flag="--vt-in-place/--vt-ring",
         token=_flag("vip")),
    Knob("defer_o_store", "bool", "sm90 fp8 with --overlap: a tile's O is stored once the next tile's first Q K^T "
         "is issued.", SM90, flag="--defer-o-store/--store-o-at-end",
         token=_flag("dos")),
    Knob("out_dtype", "text", "fp8: the type of O (default bf16).", SM90, OUT_DTYPES, "--out-dtype",
         token=lambda s, v: f"o{s.out_dtype}" if s.dtype == "fp8" else None),
    Knob("v_layout", "text", "fp8: row (V as given, transposed in shared memory) or transposed (the caller passes "
         "V^T as (batch, heads_kv, head_dim, seqlen_k)).", SM90, V_LAYOUTS, "--v-layout",
         token=lambda s, v: "vt" if s.dtype == "fp8" and s.v_layout == "transposed" else None),
    Knob("lazy_rescale", "bool", "fa2/sm90: rescale O only when a row max grows by more than 2^8 (fp8: 2^0.75).",
         flag="--lazy-rescale/--exact-rescale", search={"sm80": (True, False)},
         token=_flag("lz")),
    Knob("softmax_chains", "int", "Independent max/sum chains per row in the softmax.", choices=(1, 2, 4, 8),
         flag="--softmax-chains", search={"sm90": (1, 2, 4), "sm80": (1, 4)},
         token=_count("ch")),
    Knob("poly_exp2_tiles", "int", "n8 key tiles per score fragment whose exp2 runs on the FMA pipe (polynomial).",
         flag="--poly-exp2-tiles", search={"sm90": (0, 2, 4, 6)},
         token=lambda s, v: f"px{s.poly_exp2_tiles}" if s.poly_exp2_tiles else None),
    Knob("causal", "bool", "Bottom-right aligned causal mask.", flag="--causal/--no-causal", problem=True,
         token=_flag("causal")),
    # Attention variants (issue 40): one kernel per feature; the window sizes and the softcap value
    # are run-time FlashParams fields, so the CLI's --window-left/--window-right and --softcap N
    # (cli.py) set these switches and show their values in the emitted header.
    Knob("local", "bool", "Sliding window: key j visible to query i iff i' - left <= j <= i' + right (i' on the "
         "causal diagonal); left/right are run-time (--window-left/--window-right).", flag="--local/--no-local",
         problem=True, token=_flag("local")),
    Knob("softcap", "bool", "Logit softcap c*tanh(s*scale/c) before the softmax; c is run-time (--softcap C).",
         flag="--softcap/--no-softcap", problem=True, token=_flag("softcap")),
    Knob("sinks", "bool", "Attention sinks: one learnable fp32 logit per query head joins the softmax "
         "denominator (gpt-oss).", flag="--sinks/--no-sinks", problem=True, token=_flag("sinks")),
    # Variable-length batches (issue 39): packed (total_tokens, heads, head_dim) tensors, each
    # sequence's start and length read from the cu_seqlens_q/cu_seqlens_k FlashParams fields.
    Knob("varlen", "bool", "sm80 fa2, sm90 16-bit: packed variable-length sequences (attention_varlen: each tile "
         "reads its sequence's start and length from cu_seqlens; sm90 persistent by default).", ("sm80", "sm90"), flag="--varlen/--no-varlen",
         problem=True,
         token=_flag("varlen")),
    Knob("varlen_tma_store", "bool", "sm90 varlen: a consumer warpgroup's 64 rows of O that lie inside their "
         "sequence leave by a TMA store over the packed tokens (a sequence's last partial rows, row by row; off: "
         "every row by row). Default: on.", SM90, flag="--varlen-tma-store/--varlen-row-store",
         token=lambda s, v: "rowo" if s.varlen and not v and s.dtype != "fp8" else None),   # (fp8: O from registers)
    Knob("varlen_lpt", "bool", "sm90 persistent causal varlen: each sequence's tiles longest first over L2-sized "
         "groups of its heads (the padded kernel's causal order, per sequence); off: head by head. Default: off.",
         SM90, flag="--varlen-lpt/--no-varlen-lpt", token=_flag("lpt")),
)
# The attention variants' switches: off in every default kernel (whose source they leave unchanged).
VARIANT_FEATURES = ("local", "softcap", "sinks")

BY_NAME = {k.name: k for k in KNOBS}


def variant(spec) -> str:
    """The spec's stable name (kernel symbol, emitted file, cache entry): each knob of its arch
    adds its token, in registry order."""
    return "_".join(t for k in KNOBS if k.token is not None and spec.arch in k.archs
                    and (t := k.token(spec, getattr(spec, k.name))))
TEXT_FIELDS = {k.name: k.choices for k in KNOBS if k.kind == "text"}
INT_FIELDS = tuple(k.name for k in KNOBS if k.kind == "int")
PROBLEM_FIELDS = tuple(k.name for k in KNOBS if k.problem)


def search_space(arch: str) -> dict:
    """{knob: values} the tuner searches for ``arch``, in registry order."""
    return {k.name: k.search[arch] for k in KNOBS if k.search and arch in k.search}


def markdown_table(registry: tuple[Knob, ...] = KNOBS) -> str:
    """The knob table of one kernel family in docs/knobs.md (default: the forward's, KernelSpec). The
    archs and tuned-on columns are the forward's only: the other families' specs name their arch
    limits in each knob's text and have no tuner space."""
    forward = registry is KNOBS
    head = "| knob | flag | type | archs | values | tuned on | what it does |" if forward else \
        "| knob | flag | type | values | what it does |"
    rows = [head, "|---" * head.count(" | ") + "|---|"]
    for k in registry:
        values = ", ".join(map(str, k.choices)) if k.choices else ("True, False" if k.kind == "bool" else "")
        flag = f"`{k.flag}`" if k.flag else "`--regs P/C`"
        name = f"`{k.name}`{' (problem)' if k.problem else ''}"
        doc = k.doc.replace("|", "/")
        if forward:
            tuned = ", ".join(sorted(k.search)) if k.search else ""
            rows.append(f"| {name} | {flag} | {k.kind} | {', '.join(k.archs)} | {values} | {tuned} | {doc} |")
        else:
            rows.append(f"| {name} | {flag} | {k.kind} | {values} | {doc} |")
    return "\n".join(rows) + "\n"


def document() -> str:
    """docs/knobs.md: every kernel family's registry, a table each (`python -m facodegen.spec.knobs`)."""
    from .backward import BACKWARD_KNOBS
    from .decode import APPEND_KNOBS, COMBINE_KNOBS, DECODE_KNOBS
    families = (
        ("Forward (`facodegen emit`, `--kernel forward`)", "KernelSpec", "facodegen/spec/knobs.py", KNOBS),
        ("Backward (`--kernel backward`)", "BackwardSpec", "facodegen/spec/backward.py", BACKWARD_KNOBS),
        ("Decode (`--kernel decode`)", "DecodeSpec", "facodegen/spec/decode.py", DECODE_KNOBS),
        ("Split-KV combine (`--kernel combine`)", "CombineSpec", "facodegen/spec/decode.py", COMBINE_KNOBS),
        ("KV-cache append (`--kernel append`)", "AppendSpec", "facodegen/spec/decode.py", APPEND_KNOBS))
    parts = ["# Knobs", "",
             "Every field of every kernel family's spec, as its registry declares it: the `facodegen emit` /",
             "`facodegen inspect` flag, its type and values, and what it does (for the forward also the archs it",
             "applies to and the archs whose tuner searches it). A knob marked (problem) says what is computed,",
             "not how. Regenerate with `python -m facodegen.spec.knobs > docs/knobs.md` (a test keeps this file",
             "equal to the registries).", ""]
    for title, spec, where, registry in families:
        parts += [f"## {title}", "", f"`{spec}`, declared in `{where}`.", "", markdown_table(registry)]
    return "\n".join(parts)


if __name__ == "__main__":  # pragma: no cover
    print(document(), end="")
