"""``facodegen`` command line: emit, inspect, check, bench, tune, precompile.

Every command takes the same spec flags, one per KernelSpec knob (only the flags given are
passed; the rest take the spec's defaults), so the ``facodegen emit ...`` line in a generated
file's header (render.emit_command) reproduces that file byte for byte. The flags come from the
knob registry (facodegen/spec/knobs.py).
"""

from __future__ import annotations

import functools
from inspect import signature as _signature
import signal
import sys
from pathlib import Path

import click

from . import __version__
from .verify.fuzz import FAMILIES as FUZZ_FAMILIES
from .spec.knobs import KNOBS, Knob
from .spec import ARCHS, DTYPES, GPUS, HEAD_DIMS, KernelSpec, SpecError, default_specs

# Kernel families `emit` and `inspect` take (--kernel); forward stays the default.
# The backward's own flags (_kernel_options), as emit/inspect receive them: None where not given.
BACKWARD_FLAGS = ("deterministic", "k_unroll", "frag_prefetch", "do_stages", "dq_tma_reduce", "dq_pieces", "s_lookahead",
                  "dp_lookahead", "lpt", "dq_lag", "key_warps", "dq_row_warps")


def build_backward_spec(fields: dict, flags: dict):
    """A BackwardSpec from the spec flags given (only those the backward has) and the backward's own
    (``flags``: BACKWARD_FLAGS' values, None where not given)."""
    from .spec.backward import BACKWARD_BY_NAME, BackwardSpec

    extra = sorted(set(fields) - set(BACKWARD_BY_NAME))
    if extra:
        raise UsageFailure(f"--kernel backward does not take {', '.join(extra)} (its knobs: "
                           f"{', '.join(k for k in BACKWARD_BY_NAME)})")
    fields = {**fields, **{name: value for name, value in _backward_flags(flags).items() if value is not None}}
    try:
        return BackwardSpec(**fields)
    except SpecError as err:
        raise UsageFailure(f"invalid backward spec: {err}") from None


def _backward_flags(flags: dict) -> dict:
    """``flags`` as BACKWARD_FLAGS names them (a command passing anything else is a bug here)."""
    unknown = set(flags) - set(BACKWARD_FLAGS)
    if unknown:
        raise TypeError(f"not backward flags: {', '.join(sorted(unknown))}")
    return {name: flags.get(name) for name in BACKWARD_FLAGS}


def _refuse_backward_flags(flags: dict) -> None:
    """emit/inspect of a kernel other than the backward: any backward flag given is a usage error."""
    given = [name for name, value in _backward_flags(flags).items() if value is not None]
    if given:
        raise UsageFailure(f"{', '.join('--' + name.replace('_', '-') for name in given)}: --kernel backward "
                           f"flags ({', '.join('--' + name.replace('_', '-') for name in BACKWARD_FLAGS)})")


class UsageFailure(click.ClickException):
    """A one-line error with exit status 2 (bad spec, no GPU): no usage block, no traceback."""
    exit_code = 2


# What `--kernel` picks for emit/inspect: the forward (KernelSpec, the registry's flags) or one of
# the decode family's kernels (facodegen/spec/decode.py: DecodeSpec, CombineSpec, AppendSpec).
# Kernel families of `facodegen emit/inspect --kernel`: the forward (default), the backward (dQ, dK,
# dV: sm80 code, which also runs on sm90 GPUs, or the sm90 code), and the decode family (decode,
# combine, append).
KERNELS = ("forward", "backward", "decode", "combine", "append")
# Forward spec flags the decode family reads (the rest belong to the forward only).
_DECODE_SHARED_FLAGS = {
    "decode": ("arch", "dtype", "head_dim", "block_m", "block_n", "num_warps", "stages", "local", "softcap"),
    "combine": ("arch", "dtype", "head_dim", "num_warps"),
    "append": ("arch", "dtype", "head_dim"),
}


def _kernel_options(command):
    """--kernel, the backward's flags (--k-unroll, --deterministic) and the decode family's (--page-size,
    --paged, --split-kv, --pack-gqa, --fused-combine, --producer-warps)."""
    options = [
        click.option("--kernel", type=click.Choice(KERNELS), default="forward", show_default=True,
                     help="Which kernel: the forward; the backward (--arch sm80: FlashAttention-2's, which also "
                          "runs on sm90 GPUs; --arch sm90: FlashAttention-3's, head_dim 64, 96, 128); the decode "
                          "family's decode, combine or append."),
        click.option("--k-unroll", "k_unroll", type=click.Choice(["0", "1", "2", "4"]), callback=_int_choice,
                     help="--kernel backward: k16 steps of each warp GEMM unrolled together."),
        click.option("--frag-prefetch/--no-frag-prefetch", "frag_prefetch", default=None,
                     help="--kernel backward --arch sm80: each warp GEMM loads the next k16 step's fragments before "
                          "this step's mma.sync."),
        click.option("--key-warps", "key_warps", type=click.Choice(["1", "2", "4", "8"]), callback=_int_choice,
                     help="--kernel backward --arch sm80: warps along the keys of the S^T, dP^T, dK, dV warp grids."),
        click.option("--dq-row-warps", "dq_row_warps", type=click.Choice(["1", "2", "4", "8"]), callback=_int_choice,
                     help="--kernel backward --arch sm80: warps along the query rows of the dQ warp grid."),
        click.option("--deterministic/--no-deterministic", "deterministic", default=None,
                     help="--kernel backward: bit-identical gradients (dQ added in key-block order)."),
        click.option("--do-stages", "do_stages", type=click.Choice(["1", "2"]), callback=_int_choice,
                     help="--kernel backward --arch sm90: the dO ring's depth, at most --stages (below it the room "
                          "goes to the dQ tiles of --dq-tma-reduce)."),
        click.option("--dq-tma-reduce/--no-dq-tma-reduce", "dq_tma_reduce", default=None,
                     help="--kernel backward --arch sm90: dQ added into its fp32 accumulator by a TMA bulk "
                          "reduce-add of a shared-memory tile per warpgroup."),
        click.option("--dq-pieces", "dq_pieces", type=click.Choice(["1", "2", "4"]), callback=_int_choice,
                     help="--kernel backward --arch sm90 --dq-tma-reduce: pieces each warpgroup stages and adds "
                          "its dQ tile in per step (default: the fewest that fit)."),
        click.option("--s-lookahead/--no-s-lookahead", "s_lookahead", default=None,
                     help="--kernel backward --arch sm90 (head_dim 64, 96, 128): each consumer warpgroup issues the "
                          "next step's S^T wgmma before the wait that retires this step's dK."),
        click.option("--dp-lookahead/--no-dp-lookahead", "dp_lookahead", default=None,
                     help="--kernel backward --arch sm90 --s-lookahead: the next step's dP^T wgmma issued right "
                          "after its S^T."),
        click.option("--lpt/--no-lpt", "lpt", default=None,
                     help="--kernel backward --arch sm90 --causal: tiles longest first within L2-sized groups of "
                          "(kv head, batch)."),
        click.option("--dq-lag/--no-dq-lag", "dq_lag", default=None,
                     help="--kernel backward --arch sm90 --head-dim 128: each step computes the previous step's dQ, "
                          "the consumer warpgroups handing dS^T over through mbarriers instead of meeting every step."),
        click.option("--page-size", type=int, default=None,
                     help="decode/append: a paged KV cache (the page size is a runtime value; any power of two)."),
        click.option("--paged/--contiguous", "paged", default=None, help="decode/append: paged or contiguous cache."),
        click.option("--split-kv/--no-split-kv", "split_kv", default=None,
                     help="decode: keys split across CTAs (fp32 partials for the combine kernel)."),
        click.option("--pack-gqa/--no-pack-gqa", "pack_gqa", default=None,
                     help="decode: the query heads of one KV head share the M tile."),
        click.option("--fused-combine/--no-fused-combine", "fused_combine", default=None,
                     help="decode --split-kv: the last split CTA of each work item merges the splits (no combine "
                          "kernel)."),
        click.option("--producer-warps", "producer_warps", type=click.Choice(["0", "1", "2", "4"]),
                     callback=_int_choice,
                     help="decode --arch sm90 (head_dim 64, 128, 256): warps that only copy Q and the K/V stages, "
                          "over a ring of mbarriers (0: every warp copies between its steps; default 4 at head_dim 256, 2 at "
                          "128 without --split-kv, else 0)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def decode_family_spec(kernel: str, spec_fields: dict, page_size=None, paged=None, split_kv=None, pack_gqa=None,
                       fused_combine=None, producer_warps=None):
    """The DecodeSpec/CombineSpec/AppendSpec of `--kernel decode|combine|append` and its flags."""
    from .spec import decode as dec

    extra = sorted(set(spec_fields) - set(_DECODE_SHARED_FLAGS[kernel]))
    if extra:
        raise UsageFailure(f"--kernel {kernel} does not take --{extra[0].replace('_', '-')} "
                           f"(its flags: {', '.join('--' + f.replace('_', '-') for f in _DECODE_SHARED_FLAGS[kernel])})")
    fields = dict(spec_fields)
    if page_size is not None:
        if page_size < 1 or page_size & (page_size - 1):
            raise UsageFailure(f"--page-size {page_size}: a power of two")
        paged = True if paged is None else paged
    try:
        if kernel == "decode":
            arch = fields.pop("arch", "sm90")
            dtype = fields.pop("dtype", "bf16")
            head_dim = fields.pop("head_dim", 128)
            options = {k: v for k, v in (("pack_gqa", pack_gqa), ("fused_combine", fused_combine),
                                         ("producer_warps", producer_warps)) if v is not None}
            return dec.default_decode_spec(arch, dtype, head_dim, group=4, paged=bool(paged), split=bool(split_kv),
                                           **options, **fields)
        for flag, value in (("--fused-combine", fused_combine), ("--producer-warps", producer_warps)):
            if value is not None:
                raise UsageFailure(f"{flag} is a --kernel decode flag, not --kernel {kernel}'s")
        if kernel == "combine":
            return dec.CombineSpec(**fields)
        return dec.AppendSpec(paged=bool(paged), **fields)
    except SpecError as err:
        raise UsageFailure(f"invalid {kernel} spec: {err}") from None


def _parse_regs(ctx, param, value):
    if value is None:
        return None
    try:
        producer, consumer = (int(x) for x in value.split("/"))
    except ValueError:
        raise click.BadParameter(f"expected PRODUCER/CONSUMER registers, e.g. 24/240; got {value!r}") from None
    return producer, consumer


def _int_choice(ctx, param, value):
    return None if value is None else int(value)


def _softcap_value(ctx, param, value):
    """--softcap [C]: C > 0 sets the softcap switch and is shown in the emitted header; bare --softcap
    is the switch alone; 0 is off."""
    if value is None or value == "on":
        return value
    try:
        number = float(value)
    except ValueError:
        raise click.BadParameter(f"expected a softcap value C >= 0 (0: off), got {value!r}") from None
    if not number >= 0 or number == float("inf"):
        raise click.BadParameter(f"softcap must be a finite number >= 0 (0: off), got {value!r}")
    return number


# Run-time values the command line may give for the variant switches (the kernel takes any; the
# emitted header shows them): --window-left/--window-right set `local`, --softcap C sets `softcap`.
RUNTIME_FLAGS = ("window_left", "window_right")


def _knob_option(knob: Knob, arch_choices):
    """The click option of one knob, from the registry (facodegen/spec/knobs.py)."""
    if knob.name == "softcap":
        return click.option("--softcap", "softcap", is_flag=False, flag_value="on", default=None,
                            callback=_softcap_value, metavar="[C]",
                            help=knob.doc + " --softcap alone: the kernel; --softcap 0: off.")
    if knob.kind == "bool":
        return click.option(knob.flag, knob.name, default=None, help=knob.doc)
    if knob.kind == "text":
        choices, doc = knob.choices, knob.doc
        if knob.name == "arch":
            choices = arch_choices
            if "both" in arch_choices:
                doc = doc.removesuffix(".") + " or both (--suite)."
        return click.option(knob.flag, knob.name, type=click.Choice(choices), help=doc)
    if knob.choices and knob.flag_offers_choices:
        return click.option(knob.flag, knob.name, type=click.Choice([str(c) for c in knob.choices]),
                            callback=_int_choice, help=knob.doc)
    return click.option(knob.flag, knob.name, type=int, help=knob.doc)


def spec_options(command, arch_choices=ARCHS):
    """The spec flags shared by every command: one per knob of the registry, in its order
    (producer_regs and consumer_regs together as --regs P/C)."""
    options = []
    for knob in KNOBS:
        if knob.flag:
            options.append(_knob_option(knob, arch_choices))
        elif knob.name == "producer_regs":
            options.append(click.option("--regs", metavar="P/C", callback=_parse_regs,
                                        help="sm90: setmaxnreg producer/consumer, e.g. 24/240."))
        if knob.name == "softcap":      # (--softcap [C] above takes a value, so the off switch is its own)
            options.append(click.option("--no-softcap", "no_softcap", is_flag=True, default=None,
                                        help="No softcap (the default)."))
        if knob.name == "local":
            for side in ("left", "right"):
                options.append(click.option(f"--window-{side}", f"window_{side}", type=click.IntRange(min=-1),
                                            help=f"Sliding window: keys a row sees {'before' if side == 'left' else 'after'} "
                                                 f"its diagonal key (-1: unbounded); sets --local, the value is "
                                                 f"run-time (shown in the header)."))
    for option in reversed(options):
        command = option(command)
    return command


def _given_spec_fields(kwargs: dict, runtime: dict | None = None) -> dict:
    """KernelSpec keyword arguments of the spec flags given on the command line (popped). The
    run-time values of the variant switches (--window-left/--window-right, --softcap C) set their
    switch and go into ``runtime``."""
    fields = {}
    runtime = {} if runtime is None else runtime
    for knob in KNOBS:
        value = kwargs.pop(knob.name, None) if knob.flag else None
        if value is not None:
            fields[knob.name] = value
    regs = kwargs.pop("regs", None)
    if regs is not None:
        fields["producer_regs"], fields["consumer_regs"] = regs
    window = [kwargs.pop(name, None) for name in RUNTIME_FLAGS]
    if window != [None, None]:
        fields["local"] = True
        runtime["window_left"], runtime["window_right"] = (-1 if w is None else w for w in window)
    if isinstance(fields.get("softcap"), float):
        runtime["softcap"] = fields["softcap"]
        fields["softcap"] = fields["softcap"] > 0
        if not fields["softcap"]:
            del runtime["softcap"]
    elif fields.get("softcap") == "on":
        fields["softcap"] = True
    if kwargs.pop("no_softcap", None):
        fields["softcap"] = False
    return fields


def build_spec(fields: dict) -> KernelSpec:
    try:
        return KernelSpec(**fields)
    except SpecError as err:
        raise UsageFailure(f"invalid spec: {err}") from None


def with_spec(command=None, *, arch_choices=ARCHS):
    """Decorate a command taking ``spec`` with the spec flags; bad specs exit 2 in one line.
    ``@with_spec(arch_choices=...)`` widens --arch (bench --suite takes 'both')."""
    if command is None:
        return functools.partial(with_spec, arch_choices=arch_choices)

    @functools.wraps(command)
    def wrapper(**kwargs):
        runtime = {}
        fields = _given_spec_fields(kwargs, runtime)
        if "runtime" in _signature(command).parameters:
            kwargs["runtime"] = runtime
        return command(spec_fields=fields, **kwargs)
    return spec_options(wrapper, arch_choices)


def _require_gpu(command: str) -> None:
    from .runtime.compiler import gpu_available

    ok, reason = gpu_available()
    if not ok:
        raise UsageFailure(f"`facodegen {command}` needs a CUDA GPU: {reason}")


def _compile(spec: KernelSpec):
    from .runtime.compiler import CompileError, compile as compile_spec
    from .codegen.render import TemplateRenderError

    try:
        return compile_spec(spec)
    except (CompileError, TemplateRenderError) as err:
        raise click.ClickException(str(err)) from None


# ---------------------------------------------------------------------------------------------

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="facodegen")
def main():
    """Generate, compile and inspect FlashAttention forward kernels.

    \b
    Example:
      facodegen emit --arch sm90 --head-dim 128 --causal -o kernel.cu
      facodegen inspect --arch sm80 --head-dim 64 --sass
    """


@main.command()
@with_spec
@_kernel_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the source to this file.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), help="Write <variant>.cu into this folder.")
@click.option("--all", "all_specs", is_flag=True,
              help="Write every default spec as <variant>.cu into --out-dir (stale flash_fwd_*.cu there are removed).")
def emit(spec_fields, output, out_dir, all_specs, kernel="forward", page_size=None, paged=None, split_kv=None,
         pack_gqa=None, runtime=None, fused_combine=None, producer_warps=None, **backward_flags):
    """Print (or write) the CUDA source of one kernel.

    \b
    Example:
      facodegen emit --arch sm90 --head-dim 128 --dtype bf16 --causal
      facodegen emit --arch sm80 --head-dim 64 -o fwd.cu
      facodegen emit --arch sm90 --window-left 256 --window-right 0 --softcap 50 --sinks
      facodegen emit --all --out-dir generated      # regenerates generated/
    """
    from .codegen.render import TemplateRenderError, emit as render

    if kernel == "backward":
        from .ops.backward import emit as render_backward
        if all_specs:
            raise UsageFailure("--all writes the forward's default specs; drop --kernel backward")
        spec = build_backward_spec(spec_fields, backward_flags)
        _write(render_backward(spec), spec, output, out_dir)
        return
    _refuse_backward_flags(backward_flags)
    try:
        if kernel != "forward":
            if all_specs:
                raise UsageFailure("--all writes the forward's default specs; drop --kernel")
            from .spec.decode import render
            spec = decode_family_spec(kernel, spec_fields, page_size, paged, split_kv, pack_gqa, fused_combine,
                                      producer_warps)
        elif any(x is not None for x in (page_size, paged, split_kv, pack_gqa, fused_combine, producer_warps)):
            raise UsageFailure("--page-size, --paged, --split-kv, --pack-gqa, --fused-combine and --producer-warps "
                               "belong to --kernel decode/append")
        if all_specs:
            if spec_fields:
                raise UsageFailure("--all writes the default specs; drop the spec flags "
                                   f"({', '.join(sorted(spec_fields))})")
            if out_dir is None or output is not None:
                raise UsageFailure("--all needs --out-dir DIR (and no -o)")
            _emit_all(out_dir, render)
            return
        if kernel == "forward":
            spec = build_spec(spec_fields)
            source = render(spec, runtime=runtime)
        else:
            source = render(spec)
    except TemplateRenderError as err:
        raise click.ClickException(str(err)) from None
    _write(source, spec, output, out_dir)


def _write(source: str, spec, output, out_dir) -> None:
    if output is not None and out_dir is not None:
        raise UsageFailure("give -o FILE or --out-dir DIR, not both")
    if out_dir is not None:
        output = out_dir / f"{spec.variant}.cu"
    if output is None:
        click.echo(source, nl=False)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(source)
    click.echo(f"wrote {output}", err=True)


def _emit_all(out_dir: Path, render) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for spec in default_specs():
        path = out_dir / f"{spec.variant}.cu"
        wanted.add(path.name)
        source = render(spec)
        if not path.exists() or path.read_text() != source:
            path.write_text(source)
    removed = [p for p in sorted(out_dir.glob("flash_fwd_*.cu")) if p.name not in wanted]
    for p in removed:
        p.unlink()
    click.echo(f"wrote {len(wanted)} kernels to {out_dir}" + (f", removed {len(removed)} stale" if removed else ""),
               err=True)


@main.command()
@with_spec
@click.option("--resources", "what", flag_value="resources", default=True,
              help="Registers, shared memory, stack, spills, ptxas warnings (default).")
@click.option("--ptx", "what", flag_value="ptx", help="Print the PTX.")
@click.option("--sass", "what", flag_value="sass",
              help="Print the SASS (cuobjdump) and a count of key instructions.")
@_kernel_options
def inspect(spec_fields, what, kernel="forward", page_size=None, paged=None, split_kv=None, pack_gqa=None,
            fused_combine=None, producer_warps=None, **backward_flags):
    """Compile a kernel (no GPU needed) and report what the compiler made of it.

    \b
    Example:
      facodegen inspect --arch sm90 --head-dim 128            # resources
      facodegen inspect --arch sm80 --head-dim 64 --sass | tail -12
    """
    from .runtime.compiler import ToolNotFoundError

    if kernel == "backward":
        _inspect_backward(build_backward_spec(spec_fields, backward_flags), what)
        return
    _refuse_backward_flags(backward_flags)
    if kernel != "forward":
        from .runtime.compiler import CompileError
        from .spec.decode import compile_spec
        from .codegen.render import TemplateRenderError

        spec = decode_family_spec(kernel, spec_fields, page_size, paged, split_kv, pack_gqa, fused_combine,
                                  producer_warps)
        try:
            kernel = compile_spec(spec)
        except (CompileError, TemplateRenderError) as err:
            raise click.ClickException(str(err)) from None
    else:
        spec = build_spec(spec_fields)
        kernel = _compile(spec)
    try:
        if not _echo_listing(kernel, what):
            click.echo(format_resources(spec, kernel))
    except ToolNotFoundError as err:
        raise click.ClickException(str(err)) from None


def _echo_listing(kernel, what) -> bool:
    """inspect --ptx / --sass of a compiled kernel (any family); False for --resources, whose report
    is each family's own."""
    if what == "ptx":
        click.echo(kernel.ptx())
    elif what == "sass":
        click.echo(kernel.sass())
        counts = kernel.sass_counts()
        click.echo("key instructions: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    else:
        return False
    return True


def _inspect_backward(spec, what) -> None:
    """inspect --kernel backward: the three kernels of one generated file."""
    from .ops import backward
    from .runtime.compiler import CompileError, ToolNotFoundError
    from .codegen.render import TemplateRenderError

    try:
        compiled = backward.compile(spec)
    except (CompileError, TemplateRenderError) as err:
        raise click.ClickException(str(err)) from None
    try:
        if not _echo_listing(compiled, what):
            resources = backward.resources_of(compiled)
            click.echo(f"{'kernels':<14} {', '.join(spec.kernel_names)} (launch order)")
            click.echo(f"{'target':<14} {compiled.target}")
            click.echo(f"{'threads':<14} {spec.threads} ({spec.num_warps} warps)")
            click.echo(f"{'shared memory':<14} {spec.smem_bytes} B dynamic (main kernel)")
            for name in spec.kernel_names:
                r = resources.get(name)
                if r is not None:
                    click.echo(f"{name}: {r.registers} registers, stack {r.stack_bytes} B, spills "
                               f"{r.spill_stores} B stores / {r.spill_loads} B loads")
            if spec.arch == "sm90":
                # ptxas reports the count at entry (64K / threads); setmaxnreg then moves registers
                # from the producer warpgroup to the consumers, whose code uses up to the highest one named
                import re
                from .spec.backward import SM90_CONSUMER_REGS, SM90_PRODUCER_REGS
                highest = max((int(x) for x in re.findall(r"\bR(\d+)\b", compiled.sass())), default=0)
                click.echo(f"{'setmaxnreg':<14} producer {SM90_PRODUCER_REGS}, consumers {SM90_CONSUMER_REGS} per "
                           f"thread; highest register in the SASS: R{highest}")
            click.echo(f"{'warnings':<14} {len(compiled.warnings) or 'none'}")
            for w in compiled.warnings:
                click.echo(f"  {w}")
    except ToolNotFoundError as err:
        raise click.ClickException(str(err)) from None


def format_resources(spec: KernelSpec, kernel) -> str:
    r = kernel.resources
    rows = [
        ("kernel", spec.variant),
        ("target", kernel.target),
        ("threads", f"{spec.threads} ({spec.threads // 32} warps)"),
        ("registers", f"{r.registers} per thread"),
        ("shared memory", f"{r.shared_bytes} B static + {spec.smem_bytes} B dynamic = "
                          f"{r.shared_bytes + spec.smem_bytes} B"),
        ("stack", f"{r.stack_bytes} B"),
        ("spills", f"{r.spill_stores} B stores, {r.spill_loads} B loads"),
        ("barriers", str(r.barriers)),
        ("cubin", f"{len(kernel.cubin)} B"),
    ]
    lines = [f"{k:<14} {v}" for k, v in rows]
    check = _cross_check(kernel)
    if check:
        lines.append(f"{'cuobjdump':<14} {check}")
    lines.append(f"{'warnings':<14} {len(kernel.warnings) or 'none'}")
    lines += [f"  {w}" for w in kernel.warnings]
    return "\n".join(lines)


def _cross_check(kernel) -> str:
    """'agrees with ptxas' / what differs from cuobjdump; '' where cuobjdump is absent."""
    from .runtime.compiler import ToolNotFoundError

    try:
        diff = kernel.cross_check()
    except (ToolNotFoundError, RuntimeError):
        return ""
    return "agrees with ptxas" if not diff else "DIFFERS: " + "; ".join(diff)


@main.command()
@with_spec
@click.option("--batch", default=2, show_default=True)
@click.option("--seqlen-q", default=1024, show_default=True)
@click.option("--seqlen-k", type=int, help="Default: seqlen-q.")
@click.option("--heads", default=8, show_default=True, help="Query heads.")
@click.option("--heads-kv", type=int, help="Key/value heads (divides --heads). Default: --heads.")
@click.option("--seed", default=0, show_default=True)
@click.option("--fuzz", type=click.IntRange(min=1), help="Run this many seeded random problems (facodegen.verify.fuzz) "
              "through attention() instead, each against the float64 reference; --seed picks the list.")
@click.option("--family", type=click.Choice((*FUZZ_FAMILIES, "all")), default="all", show_default=True,
              help="--fuzz: which kernel family's problems.")
@click.option("--fuzz-case", help="Rerun one fuzz case (the JSON a failing case prints).")
def check(spec_fields, batch, seqlen_q, seqlen_k, heads, heads_kv, seed, fuzz, family, fuzz_case):
    """Run a kernel on random inputs and compare with the float64 reference (GPU).

    \b
    Example:
      facodegen check --arch sm90 --head-dim 128 --causal --seqlen-q 2048
      facodegen check --fuzz 10000 --seed 1        # seeded random problems through attention()
    """
    if fuzz or fuzz_case:
        _require_gpu("check --fuzz")
        _check_fuzz(fuzz, family, seed, fuzz_case, spec_fields.get("arch"))
        return
    spec = build_spec(spec_fields)
    _require_gpu("check")
    seqlen_k = seqlen_k or seqlen_q
    heads_kv = heads_kv or heads
    try:
        from .ops import api
    except ImportError as err:
        raise click.ClickException(f"facodegen.ops.api is not available: {err}") from None
    check_spec = getattr(api, "check_spec", None)
    if check_spec is not None:
        result = check_spec(spec, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                            heads=heads, heads_kv=heads_kv, seed=seed)
    else:
        result = _check_with_reference(api, spec, batch, seqlen_q, seqlen_k, heads, heads_kv, seed)
    passed = _echo_result(result)
    if passed is False:
        sys.exit(1)


def _check_fuzz(n, family, seed, case_json, arch) -> None:
    from .ops import api
    from .verify import fuzz

    if case_json:
        try:
            cases = [fuzz.Case.from_json(case_json)]
        except (ValueError, TypeError) as err:
            raise UsageFailure(f"--fuzz-case: not a case: {err}") from None
    else:
        native = api.default_arch(api.device_info(0))
        archs = (arch,) if arch else (("sm80", "sm90") if native == "sm90" else ("sm80",))
        cases = fuzz.generate(n, seed, family, archs)
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    if len(cases) > 1:
        fuzz.precompile(cases, log=say)
    # A time limit (timeout's SIGTERM) ends the run like Ctrl-C: with the table of what ran.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = fuzz.run(cases, log=say)
    click.echo(fuzz.summary(result))
    if result["failures"] or result["interrupted"]:
        sys.exit(1)


def _check_with_reference(api, spec, batch, seqlen_q, seqlen_k, heads, heads_kv, seed) -> dict:
    """Random inputs through facodegen.ops.api.attention, O and LSE against the float64 reference."""
    from .verify.reference import attention_reference, check_lse, random_qkv
    from .verify.reference import check as check_o

    if spec.dtype == "fp8":
        return _check_fp8(api, spec, batch, seqlen_q, seqlen_k, heads, heads_kv, seed)
    if spec.dtype == "bf16":  # CuPy has no bfloat16
        try:
            import torch as xp
        except ImportError:
            raise click.ClickException("bf16 inputs need torch (CuPy has no bfloat16); try --dtype fp16") from None
    else:
        import cupy as xp
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, spec.head_dim_real, spec.dtype, seed=seed, xp=xp,
                         head_dim_v=spec.head_dim_v if spec.split_v else None)
    knobs = spec.launch_fields()
    o, lse = api.attention(q, k, v, causal=spec.causal, return_lse=True, **knobs)
    ref_o, ref_lse = attention_reference(q, k, v, spec.causal)
    ok_o, msg_o = check_o(o, ref_o, spec.dtype)
    ok_l, msg_l = check_lse(lse, ref_lse)
    return {"kernel": spec.variant,
            "shape": f"batch={batch} seqlen_q={seqlen_q} seqlen_k={seqlen_k} heads={heads} heads_kv={heads_kv}",
            "O": msg_o, "LSE": msg_l, "passed": ok_o and ok_l}


def _check_fp8(api, spec, batch, seqlen_q, seqlen_k, heads, heads_kv, seed) -> dict:
    """fp8: randn bf16 quantised to e4m3 per tensor (torch), against the float64 reference of the same
    dequantised inputs (reference.FP8_TOLERANCE)."""
    from .ops.quantize import quantize_e4m3
    from .verify.reference import attention_reference_fp8, check, check_lse, random_qkv
    try:
        import torch
    except ImportError:
        raise click.ClickException("fp8 inputs need torch (torch.float8_e4m3fn)") from None
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, spec.head_dim, "bf16", seed=seed, xp=torch)
    (q8, qd), (k8, kd), (v8, vd) = quantize_e4m3(q), quantize_e4m3(k), quantize_e4m3(v)
    v_arg = api.transpose_v(v8) if spec.v_layout == "transposed" else v8
    knobs = spec.launch_fields()
    o, lse = api.attention(q8, k8, v_arg, causal=spec.causal, return_lse=True, q_descale=qd, k_descale=kd,
                           v_descale=vd, **knobs)
    ref_o, ref_lse = attention_reference_fp8(q8, k8, v8, qd, kd, vd, causal=spec.causal)
    ok_o, msg_o = check(o, ref_o, "fp8")
    ok_l, msg_l = check_lse(lse, ref_lse, atol=1e-2, rtol=1e-3)
    return {"kernel": spec.variant,
            "shape": f"batch={batch} seqlen_q={seqlen_q} seqlen_k={seqlen_k} heads={heads} heads_kv={heads_kv}",
            "O": msg_o, "LSE": msg_l, "passed": ok_o and ok_l}


SUITE_NAMES = ("fa3-paper", "quick", "sm80", "evolution", "fp8", "overhead", "decode",
               "variants", "varlen")   # facodegen.bench.suites.suite_names() (kept import-light here)


@main.command()
@with_spec(arch_choices=ARCHS + ("both",))
@click.option("--seqlen", default=4096, show_default=True, help="Query (and key) sequence length.")
@click.option("--seqlen-k", type=int, help="Key/value sequence length. Default: --seqlen.")
@click.option("--batch", default=4, show_default=True)
@click.option("--heads", default=16, show_default=True, help="Query heads.")
@click.option("--heads-kv", type=int, help="Key/value heads (divides --heads). Default: --heads.")
@click.option("--peers", help="Comma-separated peers to time alongside, e.g. fa3,cudnn,fa2 ('' for none). "
                             "Default: fa3,cudnn,fa2 (with --suite also efficient); flex (FlexAttention, "
                             "torch.compile'd) when asked.")
@click.option("--suite", type=click.Choice(SUITE_NAMES),
              help="Time a whole grid: fa3-paper (the FlashAttention-3 paper's: head_dim 64/128/256, causal "
                   "and not, seqlen 512-16k, 16k tokens, hidden 2048; with --backward or --fwd-bwd the "
                   "backward), quick (6 of its cells), sm80, evolution or fp8; overhead: host microseconds per "
                   "call on a tiny shape (1, 128, 8, 128) of facodegen.attention (torch, CuPy), "
                   "facodegen.prepare()(), torch SDPA and FlashAttention-3; decode: TB/s of "
                   "facodegen.attention_with_kvcache beside FlashAttention-3's flash_attn_with_kvcache and SDPA; "
                   "variants: window, softcap and sinks (time ratios); varlen: facodegen.attention_varlen on "
                   "mixed lengths beside FlashAttention-3's flash_attn_varlen_func and the padded way "
                   "(facodegen.attention, SDPA's cuDNN).")
@click.option("--no-prepared", is_flag=True,
              help="Time only facodegen's public call (facodegen.attention), not also the launcher prepared "
                   "once (facodegen.prepare) beside it.")
@click.option("--backward", is_flag=True,
              help="--suite fa3-paper: time the backward (torch.autograd.grad through facodegen.attention) "
                   "beside torch SDPA's cuDNN and flash backends' backward; TFLOP/s with backward FLOPs = "
                   "2.5 x forward (bf16 or fp16). --suite varlen: the varlen backward (attention_varlen's "
                   "autograd, attention_varlen_backward per arch) beside FA2's varlen backward (SDPA flash on "
                   "nested jagged tensors) and the padded backward (bf16).")
@click.option("--fwd-bwd", is_flag=True,
              help="--suite fa3-paper: time forward + backward together (FLOPs = 3.5 x forward), same peers.")
@click.option("--variant", "bwd_variants", multiple=True, metavar="KNOB=VALUE[,...]",
              help="--backward: also time facodegen.attention_backward(..., **knobs) on the forward's O and LSE "
                   "as a column of its own, e.g. k_unroll=1,block_n=64 (repeatable); --suite decode: "
                   "facodegen.attention_with_kvcache(..., **knobs) beside the default call, e.g. fused_combine=1.")
@click.option("--quick", is_flag=True,
              help="A short run: --backward/--fwd-bwd seqlen 2k and 8k only; --suite decode its quick subset "
                   "(GQA 32/8, d128, contiguous and paged 64, context 8k and 256k); --suite variants fewer "
                   "groups and calls; --suite varlen head_dim 128 only, fewer groups and calls.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="--suite: folder for bench-<suite>-<dtype>.{md,csv,json,png} "
              "(bench-fa3-paper-backward-<dtype>.*, bench-decode.*, bench-variants.*, bench-varlen.*).")
@click.option("--budget-s", type=float, help="--suite: stop timing new cells after this many seconds.")
@click.option("--no-plot", is_flag=True, help="--suite: skip the PNG.")
@click.option("--replot", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Redraw the table, CSV and PNG of a --suite JSON into --out (no GPU; e.g. where the GPU "
                   "machine had no matplotlib).")
def bench(spec_fields, seqlen, seqlen_k, batch, heads, heads_kv, peers, suite, no_prepared, backward, fwd_bwd,
          bwd_variants, quick, out_dir, budget_s, no_plot, replot):
    """Time a kernel (CUDA events) against its peers and print a table (GPU).

    facodegen is timed as users call it, facodegen.attention(q, k, v, ...) with out allocated per
    call (the column with the ratio to the best peer), and, in the column beside it, through a
    launcher prepared once (facodegen.prepare, then run()); --no-prepared drops the second.

    With --suite, time facodegen and every importable peer (FlashAttention-3 from
    flash_attn_interface, torch SDPA's flash / cuDNN / mem-efficient backends) over a grid, each
    output checked against the float64 reference on a slice first; print the table with
    facodegen's ratio to the best peer and write it as markdown, CSV, JSON and a PNG plot
    (matplotlib: pip install 'facodegen[plot]'). --head-dim / --causal pick part of the grid; other
    spec flags override facodegen's tiles on every cell.

    --suite fa3-paper --backward (or --fwd-bwd) times the backward (or forward + backward) over the
    same grid beside torch SDPA's cuDNN and flash backends; --suite decode times
    facodegen.attention_with_kvcache's effective bandwidth (K+V bytes / time) beside FlashAttention-3's
    flash_attn_with_kvcache and SDPA; --suite variants times windows, softcap and sinks; --suite varlen
    times facodegen.attention_varlen on mixed lengths beside FlashAttention-3's flash_attn_varlen_func
    and the same sequences padded to the longest (facodegen.attention, SDPA's cuDNN backend).

    \b
    Example:
      facodegen bench --arch sm90 --head-dim 128 --seqlen 8192 --batch 2 --heads 16
      facodegen bench --arch sm80 --head-dim 64 --causal --peers fa2
      facodegen bench --suite fa3-paper --dtype bf16 --arch both --out results/
      facodegen bench --suite quick
      facodegen bench --suite overhead --out results/
      facodegen bench --suite fa3-paper --backward --head-dim 128 --quick --out results/
      facodegen bench --suite fa3-paper --fwd-bwd --out results/
      facodegen bench --suite decode --quick --out results/
      facodegen bench --suite decode --quick --variant fused_combine=1 --out results/
      facodegen bench --suite variants --out results/
      facodegen bench --suite varlen --quick --out results/
    """
    if replot is not None:
        _bench_replot(replot, out_dir)
        return
    mode = "fwd-bwd" if fwd_bwd else "backward" if backward else None
    _check_suite_options(suite, spec_fields, peers, backward, fwd_bwd, bwd_variants, quick, no_prepared, budget_s)
    if suite is not None:
        _require_gpu("bench")
        if mode is not None and suite == "varlen":
            _bench_varlen_backward(spec_fields, out_dir, quick)
        elif mode is not None:
            _bench_backward(spec_fields, peers, out_dir, no_plot, mode, bwd_variants, quick)
        elif suite == "decode":
            _bench_decode(spec_fields, peers, out_dir, quick, bwd_variants)
        elif suite == "variants":
            _bench_variants(out_dir, quick)
        elif suite == "varlen":
            _bench_varlen(spec_fields, peers, out_dir, quick)
        else:
            _bench_suite(spec_fields, suite, peers, out_dir, budget_s, no_plot, prepared=not no_prepared)
        return
    if spec_fields.get("arch") == "both":
        raise UsageFailure("--arch both is for --suite; give sm80 or sm90")
    variant_flags = [flag for field, flag in (("softcap", "--softcap"), ("local", "--window-left/--window-right"),
                                              ("sinks", "--sinks")) if spec_fields.get(field)]
    if variant_flags:   # (its peers and reference check are plain attention's)
        raise UsageFailure(f"{', '.join(variant_flags)}: the one-cell bench times plain attention beside its "
                           "peers; time the variants with --suite variants (or scripts/bench_softcap.py)")
    spec = build_spec(spec_fields)
    _require_gpu("bench")
    try:
        from .bench import runner
    except ImportError as err:
        raise click.ClickException(f"facodegen.bench is not available: {err}") from None
    run = runner.run_cli_bench
    extra = {}
    if seqlen_k is not None:
        extra["seqlen_k"] = seqlen_k
    if heads_kv is not None:
        extra["heads_kv"] = heads_kv
    if peers is not None:
        extra["peers"] = tuple(p.strip() for p in peers.split(",") if p.strip())
    if no_prepared:
        extra["prepared"] = False
    _echo_result(run(spec, seqlen=seqlen, batch=batch, heads=heads, **extra))


def _flag_of(field: str) -> str:
    """The command-line spelling of a spec field (--block-n, --causal, --regs)."""
    if field in ("producer_regs", "consumer_regs"):
        return "--regs"
    for knob in KNOBS:
        if knob.name == field and knob.flag:
            return knob.flag.split("/")[0]
    return "--" + field.replace("_", "-")


def _check_suite_options(suite, spec_fields: dict, peers, backward: bool, fwd_bwd: bool, variants, quick: bool,
                         no_prepared: bool, budget_s) -> None:
    """Usage errors (exit 2, naming the option) for options the chosen suite does not take: --backward
    and --fwd-bwd only with --suite fa3-paper and a dtype with a backward, --variant only with
    --backward, --quick only where a suite has a short form, and no spec flag the decode, variants or
    backward suites cannot honour."""
    timed = "--fwd-bwd" if fwd_bwd else "--backward" if backward else None
    if backward and fwd_bwd:
        raise UsageFailure("--backward and --fwd-bwd: give one (--fwd-bwd times forward + backward together)")
    if timed and suite != "fa3-paper" and not (backward and suite == "varlen"):
        raise UsageFailure(f"{timed} is for --suite fa3-paper (and --backward for --suite varlen; got "
                           f"{'no --suite' if suite is None else '--suite ' + suite})")
    if backward and suite == "varlen" and peers is not None:
        raise UsageFailure("--peers is not for --suite varlen --backward (FA2's varlen backward through SDPA on "
                           "nested jagged tensors is timed where torch has it)")
    if variants and not (backward or suite == "decode"):
        raise UsageFailure("--variant is for --suite fa3-paper --backward (backward knobs) and --suite decode "
                           "(attention_with_kvcache knobs)")
    if quick and not (timed or suite in ("decode", "variants", "varlen")):
        raise UsageFailure("--quick is for --suite fa3-paper --backward/--fwd-bwd, --suite decode, --suite variants and "
                           "--suite varlen (--suite quick is the forward's short grid)")
    own = timed or (f"--suite {suite}" if suite in ("decode", "variants", "varlen") else None)
    if own is None:
        return
    if no_prepared:
        raise UsageFailure(f"--no-prepared is for the forward suites, not {own}")
    if budget_s is not None:
        raise UsageFailure(f"--budget-s is for the forward suites, not {own}")
    if timed and suite == "varlen":
        allowed = ("dtype", "head_dim", "causal")
        if spec_fields.get("dtype", "bf16") != "bf16":
            raise UsageFailure(f"--dtype {spec_fields['dtype']}: --suite varlen --backward is bf16 only")
    elif timed:
        allowed = ("dtype", "head_dim", "causal")
        if spec_fields.get("dtype", "bf16") not in ("bf16", "fp16"):
            raise UsageFailure(f"--dtype {spec_fields['dtype']}: {spec_fields['dtype']} has no backward; "
                               f"{timed} takes bf16 or fp16")
    elif suite == "decode":
        allowed = ("dtype", "head_dim")
        if spec_fields.get("dtype", "bf16") != "bf16":
            raise UsageFailure(f"--dtype {spec_fields['dtype']}: --suite decode is bf16 only")
    elif suite == "varlen":
        allowed = ("dtype", "head_dim", "causal")
        if spec_fields.get("dtype", "bf16") != "bf16":
            raise UsageFailure(f"--dtype {spec_fields['dtype']}: --suite varlen is bf16 only")
    else:
        allowed = ()
        if peers is not None:
            raise UsageFailure("--peers is not for --suite variants (FlashAttention-3 is timed where importable)")
    extra = [f for f in spec_fields if f not in allowed]
    if extra:
        hint = " (time backward knobs with --variant knob=value)" if timed == "--backward" else ""
        raise UsageFailure(f"{', '.join(dict.fromkeys(_flag_of(f) for f in extra))}: not for {own}{hint}")


def _peer_list(peers) -> tuple[str, ...] | None:
    return None if peers is None else tuple(p.strip() for p in peers.split(",") if p.strip())


def _written(paths: dict) -> str:
    return "wrote " + ", ".join(str(paths[k]) for k in ("md", "csv", "json", "png") if paths.get(k))


def _bench_backward(spec_fields: dict, peers, out_dir: Path, no_plot: bool, mode: str, variants, quick: bool) -> None:
    """`bench --suite fa3-paper --backward|--fwd-bwd`: bench.backward.run_backward over the FA3-paper
    cells (--head-dim / --causal pick part; --head-dim 96 or 192: those shapes at that d; --quick seqlen 2k
    and 8k), beside SDPA's cuDNN and flash
    backends (--peers cudnn,fa2; flash = fa2), --variant knobs as extra columns. The table prints last."""
    from .bench import backward as bw
    from .bench import results

    dtype = spec_fields.get("dtype", "bf16")
    head_dim, causal = spec_fields.get("head_dim"), spec_fields.get("causal")
    if head_dim is not None and head_dim not in bw.HEAD_DIMS + bw.OTHER_HEAD_DIMS:
        raise UsageFailure(f"--head-dim {head_dim}: no cell of suite fa3-paper has it "
                           f"({', '.join(map(str, bw.HEAD_DIMS))}; {' and '.join(map(str, bw.OTHER_HEAD_DIMS))} "
                           f"with --backward / --fwd-bwd alone)")
    try:
        peer_names = bw.BACKWARD_PEERS if peers is None else bw.peer_names(_peer_list(peers))
    except ValueError as err:
        raise UsageFailure(f"--peers: {err}") from None
    try:
        knobs = [bw.parse_knobs(text) for text in variants]
    except ValueError as err:
        raise UsageFailure(f"--variant: {err}") from None
    cells = bw.backward_cells((head_dim,) if head_dim else bw.HEAD_DIMS, bw.QUICK_SEQLENS if quick else bw.SEQLENS,
                              (False, True) if causal is None else (causal,), dtype)
    env = results.environment()
    click.echo(f"bench --suite fa3-paper --{mode}: {len(cells)} cells, {dtype}, peers {', '.join(peer_names) or 'none'}"
               + (f", variants {', '.join(bw.variant_label(k) for k in knobs)}" if knobs else ""), err=True)
    rows = bw.run_backward(cells, peer_names, variants=knobs, mode=mode, log=lambda m: click.echo(m, err=True))
    paths = bw.write_backward_results(rows, out_dir, bw.result_stem(mode, dtype), env=env, plot=not no_plot,
                                      peers=peer_names, variants=knobs)
    notes = [f"- {r['head_dim']} {'causal' if r['causal'] else 'full'} s{r['seqlen_q']} {n}: {x['note']}"
             for r in rows for n, x in r["results"].items() if x.get("note")]
    if notes:
        click.echo("\nNotes:\n" + "\n".join(notes))
    click.echo("\n" + _written(paths))
    if paths.get("plot_error"):
        click.echo(f"plot skipped: {paths['plot_error']}", err=True)
    click.echo(f"\nTFLOP/s ({'backward' if mode == 'backward' else 'forward + backward'}, FLOPs = {bw.MODES[mode]} x "
               f"forward; {dtype}, {env.get('gpu', '?')}, facodegen {env.get('facodegen')}"
               f"{', commit ' + env['commit'] if env.get('commit') else ''}):")
    click.echo(bw.full_table(rows, peer_names, knobs))


def _bench_decode(spec_fields: dict, peers, out_dir: Path, quick: bool, variants=()) -> None:
    """`bench --suite decode`: bench.decode.run_decode over the decode cells (--quick: the quick subset,
    --head-dim: one d), beside FlashAttention-3 and SDPA (--peers fa3,sdpa), --variant knobs as columns
    of their own (e.g. fused_combine=1). The table prints last."""
    from .bench import decode as dec
    from .bench import results

    try:
        knobs = [dec.parse_knobs(text) for text in variants]
    except ValueError as err:
        raise UsageFailure(f"--variant: {err}") from None

    head_dim = spec_fields.get("head_dim")
    peer_names = dec.DECODE_PEERS if peers is None else _peer_list(peers)
    unknown = [p for p in peer_names if p not in dec.DECODE_PEERS]
    if unknown:
        raise UsageFailure(f"--peers: unknown {', '.join(unknown)} for --suite decode (known: "
                           f"{', '.join(dec.DECODE_PEERS)})")
    cells = dec.suite_cells(quick, head_dim)
    if not cells:
        raise UsageFailure(f"--head-dim {head_dim}: no cell of suite decode has it "
                           f"({', '.join(map(str, dec.HEAD_DIMS))})")
    env = results.environment()
    click.echo(f"bench --suite decode: {len(cells)} cells, bf16, peers {', '.join(peer_names) or 'none'}"
               + (f", variants {', '.join(dec.variant_label(k) for k in knobs)}" if knobs else ""), err=True)
    rows = dec.run_decode(cells, peer_names, log=lambda m: click.echo(m, err=True), variants=knobs)
    grid = dict(dec.QUICK if quick else dec.FULL)
    paths = dec.write_decode_results(rows, out_dir, "bench-decode", env=env, grid=grid)
    click.echo("\n" + _written(paths))
    click.echo(f"\nEffective TB/s (K+V bytes / time; {env.get('gpu', '?')}, facodegen {env.get('facodegen')}"
               f"{', commit ' + env['commit'] if env.get('commit') else ''}):")
    click.echo(dec.summary(rows))


def _bench_variants(out_dir: Path, quick: bool) -> None:
    """`bench --suite variants`: bench.variants_suite.run_variants (window, softcap, sinks; time ratios)."""
    from .bench import results
    from .bench import variants_suite as vs

    cells = vs.cells() + vs.fp8_cells() + vs.head_dim_cells(vs.HEAD_DIM_SEQLENS[1:2] if quick else vs.HEAD_DIM_SEQLENS)
    env = results.environment()
    click.echo(f"bench --suite variants: {len(cells)} cells, bf16 (and fp8 at {vs.FP8_SEQLENS}) causal d{vs.HEAD_DIM}, "
               f"then head dims "
               f"{', '.join(f'{d}/{dv}' for d, dv in vs.HEAD_DIMS)}"
               + (f", timing {vs.QUICK_TIMING}" if quick else ""), err=True)
    rows = vs.run_variants(cells, quick, log=lambda m: click.echo(m, err=True))
    paths = vs.write_variants_results(rows, out_dir, "bench-variants", env=env)
    click.echo("\n" + _written(paths))
    click.echo(f"\nms ({env.get('gpu', '?')}, facodegen {env.get('facodegen')}"
               f"{', commit ' + env['commit'] if env.get('commit') else ''}):")
    click.echo(vs.format_table(rows))


def _bench_varlen(spec_fields: dict, peers, out_dir: Path, quick: bool) -> None:
    """`bench --suite varlen`: bench.varlen_suite.run_varlen over the varlen cells (--quick: head_dim 128
    and fewer groups; --head-dim / --causal pick part), beside FA3 varlen and cuDNN padded (--peers
    fa3,cudnn; facodegen's padded kernels are always timed). The table prints last."""
    from .bench import results
    from .bench import varlen_suite as vl

    head_dim, causal = spec_fields.get("head_dim"), spec_fields.get("causal")
    peer_names = vl.VARLEN_PEERS if peers is None else _peer_list(peers)
    unknown = [p for p in peer_names if p not in vl.VARLEN_PEERS]
    if unknown:
        raise UsageFailure(f"--peers: unknown {', '.join(unknown)} for --suite varlen (known: "
                           f"{', '.join(vl.VARLEN_PEERS)})")
    cells = vl.cells(quick, head_dim, causal)
    if not cells:
        raise UsageFailure(f"--head-dim {head_dim}: no cell of suite varlen{' --quick' if quick else ''} has it "
                           f"({', '.join(map(str, vl.QUICK_HEAD_DIMS if quick else vl.HEAD_DIMS))})")
    env = results.environment()
    click.echo(f"bench --suite varlen: {len(cells)} cells, bf16, ~{vl.TOTAL_TOKENS} tokens each, peers "
               f"{', '.join(peer_names) or 'none'}" + (f", timing {vl.QUICK_TIMING}" if quick else ""), err=True)
    rows = vl.run_varlen(cells, peer_names, quick, log=lambda m: click.echo(m, err=True))
    paths = vl.write_varlen_results(rows, out_dir, "bench-varlen", env=env)
    click.echo("\n" + _written(paths))
    click.echo(f"\nTFLOP/s of the real tokens ({env.get('gpu', '?')}, facodegen {env.get('facodegen')}"
               f"{', commit ' + env['commit'] if env.get('commit') else ''}):")
    click.echo(vl.summary(rows))


def _bench_varlen_backward(spec_fields: dict, out_dir: Path, quick: bool) -> None:
    """`bench --suite varlen --backward`: bench.varlen_backward_suite.run over the varlen cells (--quick: head_dim
    128 and fewer groups; --head-dim / --causal pick part): the varlen backward beside FA2's and the padded one.
    The table prints last."""
    from .bench import varlen_backward_suite as vb
    from .bench import varlen_suite as vl

    head_dim, causal = spec_fields.get("head_dim"), spec_fields.get("causal")
    cells = vl.cells(quick, head_dim, causal)
    if not cells:
        raise UsageFailure(f"--head-dim {head_dim}: no cell of suite varlen{' --quick' if quick else ''} has it "
                           f"({', '.join(map(str, vl.QUICK_HEAD_DIMS if quick else vl.HEAD_DIMS))})")
    click.echo(f"bench --suite varlen --backward: {len(cells)} cells, bf16, ~{vl.TOTAL_TOKENS} tokens each", err=True)
    rows = vb.run(cells, quick, log=lambda m: click.echo(m, err=True))
    paths = vb.write_results(rows, out_dir)
    click.echo("\n" + _written(paths))
    click.echo("\nBackward TFLOP/s of the real tokens (2.5 x the forward's FLOPs):")
    click.echo(vb.format_table(rows))


def _bench_replot(path: Path, out_dir: Path) -> None:
    import json

    from .bench import results, tables

    try:
        data = json.loads(path.read_text())
        rows, env = data["rows"], data.get("env", {})
    except (ValueError, KeyError, TypeError) as err:
        raise UsageFailure(f"--replot: {path} is not a `bench --suite` JSON file ({err})") from None
    dtype = rows[0]["dtype"] if rows else "bf16"
    stem = path.stem if path.parent.resolve() != out_dir.resolve() else path.stem + "-replot"
    paths = results.write_results(rows, out_dir, stem, env=env,
                                  title=f"Attention forward speed, {dtype} ({env.get('gpu', 'GPU')})")
    click.echo(tables.format_table(rows))
    click.echo("\nwrote " + ", ".join(str(paths[k]) for k in ("md", "csv", "json", "png") if paths.get(k)))
    if paths.get("plot_error"):
        raise click.ClickException(f"plot: {paths['plot_error']}")


def _bench_overhead(spec_fields: dict, peers, out_dir: Path) -> None:
    """`bench --suite overhead`: host µs per call of facodegen's calls and the peers' on the tiny
    shape (bench.overhead.run_overhead); --arch and tile flags go to facodegen's calls, --peers ''
    drops FlashAttention-3 (SDPA is always timed: it is the ratio's reference). The table prints last."""
    from .bench import overhead, results

    fields = dict(spec_fields)
    arch = fields.pop("arch", None)
    if arch == "both":
        raise UsageFailure("--arch both is for the TFLOP/s suites; give sm80 or sm90 (or none) for overhead")
    for name in ("dtype", "head_dim", "causal"):     # the suite's cases fix these
        fields.pop(name, None)
    peer_names = overhead.OVERHEAD_PEERS if peers is None else tuple(p.strip() for p in peers.split(",") if p.strip())
    env = results.environment()
    click.echo(f"bench --suite overhead: (batch, seqlen, heads, head_dim) {overhead.OVERHEAD_SHAPE}, "
               f"timing {overhead.OVERHEAD_TIMING}", err=True)
    rows = overhead.run_overhead(arch=arch, overrides=fields or None, peers=peer_names,
                                 log=lambda m: click.echo(m, err=True))
    paths = overhead.write_overhead_results(rows, out_dir, "bench-overhead", env=env)
    notes = overhead.format_overhead_notes(rows)
    if notes:
        click.echo("\nNotes:\n" + notes)
    click.echo(f"\nwrote {paths['md']}, {paths['csv']}, {paths['json']}")
    click.echo(f"\nHost µs per call ({env.get('gpu', '?')}, facodegen {env.get('facodegen')}"
               f"{', commit ' + env['commit'] if env.get('commit') else ''}):")
    click.echo(overhead.format_overhead_table(rows))


def _bench_suite(spec_fields: dict, suite: str, peers, out_dir: Path, budget_s, no_plot: bool,
                 prepared: bool = True) -> None:
    from .ops import api
    from .bench import results, runner, suites, tables, timing

    if suite == suites.OVERHEAD_SUITE:   # host µs per call on a tiny shape: no grid, no TFLOP/s
        _bench_overhead(spec_fields, peers, out_dir)
        return
    fields = dict(spec_fields)
    dtype = "fp8" if suite == "fp8" else fields.pop("dtype", "bf16")
    fields.pop("dtype", None)
    arch = fields.pop("arch", None)
    head_dim = fields.pop("head_dim", None)
    causal = fields.pop("causal", None)
    info = api.device_info(0)
    if arch in (None, "both"):
        native = api.default_arch(info)
        archs = ("sm90", "sm80") if arch == "both" and native == "sm90" else (native,)
    else:
        try:
            api._check_arch(arch, info)
        except ValueError as err:
            raise UsageFailure(str(err)) from None
        archs = (arch,)
    cells = suites.suite_cells(suite, dtype, head_dim, causal)
    if not cells:
        raise UsageFailure(f"no cell of suite {suite} has head_dim={head_dim} and causal={causal}")
    peer_names = suites.SUITE_PEERS if peers is None else tuple(p.strip() for p in peers.split(",") if p.strip())
    env = results.environment()
    click.echo(f"bench --suite {suite}: {len(cells)} cells, {dtype}, facodegen {', '.join(archs)}, peers "
               + ", ".join(f"{p} ({'ok' if env['peers'].get(p, [False])[0] else 'unavailable'})" for p in peer_names)
               + (f", spec overrides {fields}" if fields else ""), err=True)
    variants, grid_timing = None, None
    if suite == "evolution":   # one column per FA1 -> FA2 switch, beside the sm80 and sm90 kernels
        variants, grid_timing = suites.EVOLUTION_VARIANTS, suites.EVOLUTION_TIMING
        env["gemm_tflops"] = timing.gemm_ceiling()
        click.echo(f"bf16 GEMM (torch.mm 8192^3): {env['gemm_tflops']:.1f} TFLOP/s", err=True)
        cells = [dict(c, gemm_tflops=env["gemm_tflops"]) for c in cells]
    if dtype == "fp8":   # issue 6's ceiling: an e4m3 8192^3 GEMM on this GPU
        env["fp8_gemm_tflops"] = timing.fp8_gemm_ceiling()
        click.echo(f"fp8 GEMM (torch._scaled_mm 8192^3): {env['fp8_gemm_tflops']:.1f} TFLOP/s", err=True)
        cells = [dict(c, gemm_tflops=env["fp8_gemm_tflops"]) for c in cells]
    rows = runner.run_grid(cells, archs=archs, peers=peer_names, spec_overrides=fields or None, budget_s=budget_s,
                           log=lambda m: click.echo(m, err=True), variants=variants, timing=grid_timing,
                           prepared=prepared)
    stem = f"bench-{suite}-{dtype}"
    title = f"Attention forward speed, {dtype} ({env.get('gpu', 'GPU')})"
    paths = results.write_results(rows, out_dir, stem, env=env, plot=not no_plot, title=title)
    notes = tables.format_notes(rows)
    if notes:
        click.echo("\nNotes:\n" + notes)
    click.echo(f"\nTFLOP/s ({dtype}, {env.get('gpu', '?')}, facodegen {env.get('facodegen')}"
               f"{', commit ' + env['commit'] if env.get('commit') else ''}):")
    click.echo(tables.format_table(rows))
    written = [str(paths[k]) for k in ("md", "csv", "json", "png") if paths.get(k)]
    click.echo("\nwrote " + ", ".join(written))
    if paths.get("plot_error"):
        click.echo(f"plot skipped: {paths['plot_error']}", err=True)


@main.command()
@click.option("--arch", type=click.Choice(ARCHS), help="Target. Default: the GPU's (sm90 for --dry-run without one).")
@click.option("--head-dim", type=click.Choice([str(d) for d in HEAD_DIMS]), default="128", show_default=True,
              help="Head dimension d.")
@click.option("--dtype", type=click.Choice(DTYPES), default="bf16", show_default=True)
@click.option("--causal/--no-causal", default=False, show_default=True)
@click.option("--seqlen", default=4096, show_default=True, help="Query (and key) sequence length timed.")
@click.option("--seqlen-k", type=int, help="Key/value sequence length. Default: --seqlen.")
@click.option("--batch", default=4, show_default=True)
@click.option("--heads", default=16, show_default=True, help="Query heads.")
@click.option("--heads-kv", type=int, help="Key/value heads. Default: --heads.")
@click.option("--gpu", type=click.Choice(tuple(GPUS)),
              help="Budget-model limits. Default: the GPU's (--dry-run: the arch's default).")
@click.option("--max-candidates", default=48, show_default=True,
              help="Keep this many candidates nearest the default (after the budget model).")
@click.option("-j", "--jobs", type=int, help="Compile processes. Default: the CPU count.")
@click.option("--dry-run", is_flag=True, help="List the candidates and why the others were dropped; no GPU.")
@click.option("--compile", "do_compile", is_flag=True, help="--dry-run: also compile and drop spills/C75xx warnings.")
@click.option("--verbose", is_flag=True, help="--dry-run: list every pruned candidate with its reason.")
@click.option("--top", default=10, show_default=True, help="Rows of the final table.")
@click.option("--min-gain", default=0.01, show_default=True,
              help="A candidate replaces the default only when this much faster (same run).")
@click.option("--no-store", is_flag=True, help="Do not write the winner to the database.")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path),
              help="Write every candidate, with its drop reason or times, as JSON.")
@click.option("--db", type=click.Path(dir_okay=False, path_type=Path),
              help="Tuning database file. Default: $FACODEGEN_TUNE_DB or <cache dir>/tuned.json.")
@click.option("--show", is_flag=True, help="Print the tuning database and exit.")
@click.option("--export", "export_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the database's entries to FILE and exit.")
@click.option("--import", "import_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Merge FILE's entries into the database (per key the newer wins) and exit.")
def tune(arch, head_dim, dtype, causal, seqlen, seqlen_k, batch, heads, heads_kv, gpu, max_candidates, jobs,
         dry_run, do_compile, verbose, top, min_gain, no_store, report, db, show, export_file, import_file):
    """Search the template space of one problem and store the fastest spec (GPU).

    Candidates (tile sizes, stages, warps/warpgroups, pingpong, overlap, ...) are pruned by the
    budget model, compiled in parallel (spills and ptxas C75xx warnings are dropped), checked
    against the float64 reference and timed with the default spec in the same run. The winner
    goes into the tuning database, which facodegen.attention() reads for calls of that shape
    bucket on this GPU (seqlen and batch*heads rounded to powers of two).

    \b
    Example:
      facodegen tune --arch sm90 --head-dim 128 --dtype bf16 --causal --seqlen 4096 --batch 4 --heads 16
      facodegen tune --arch sm80 --head-dim 64 --dry-run
      facodegen tune --show
      facodegen tune --export team.json      # and on another machine: --import team.json
    """
    from .tuning import tunedb

    head_dim = int(head_dim)
    if show or export_file or import_file:
        path = tunedb.resolve_path(db)
        if path is None:
            raise UsageFailure(f"the tuning database is turned off by ${tunedb.ENV}; pass --db PATH")
        if import_file:
            try:
                counts = tunedb.import_file(import_file, path)
            except (ValueError, OSError) as err:
                raise UsageFailure(f"--import: {err}") from None
            click.echo(f"imported {import_file} into {path}: {counts['added']} added, {counts['replaced']} replaced, "
                       f"{counts['kept']} kept (newer already there), {counts['refused']} refused (invalid)")
        if export_file:
            n = tunedb.export(export_file, path)
            click.echo(f"exported {n} entries from {path} to {export_file}")
        if show:
            entries = tunedb.read(path)
            click.echo(f"tuning database {path}: {len(entries)} entries")
            click.echo(tunedb.format_entries(entries))
        return
    if dry_run:
        _tune_dry_run(arch or "sm90", head_dim, dtype, causal, gpu, max_candidates, jobs, do_compile, report,
                      (seqlen, seqlen_k or seqlen), verbose)
        return
    from .runtime.compiler import gpu_available

    ok, reason = gpu_available()
    if not ok:
        raise UsageFailure(f"`facodegen tune` needs a CUDA GPU: {reason} (--dry-run lists the candidates without one)")
    _tune_gpu(arch, head_dim, dtype, causal, seqlen, seqlen_k or seqlen, batch, heads, heads_kv or heads, gpu,
              max_candidates, jobs, top, min_gain, no_store, report, db)


def _tune_counts(cands, space: int | None = None) -> str:
    from .tuning.tune import summary_counts

    counts = summary_counts(cands)
    dropped = ", ".join(f"{v} {k}" for k, v in counts.items() if k not in ("enumerated", "live"))
    within = f"{space} points in the space, " if space is not None else ""
    return (f"{within}{counts['enumerated']} enumerated nearest the default, {counts['live']} left"
            + (f" (dropped: {dropped})" if dropped else ""))


def _compile_with_bar(cands, jobs, sm) -> None:
    import os

    from .tuning.tune import compile_candidates

    live = [c for c in cands if c.alive]
    n_jobs = max(1, min(jobs or os.cpu_count() or 1, len(live) or 1))
    with click.progressbar(length=len(live), label=f"compiling {len(live)} candidates ({n_jobs} processes)",
                           file=sys.stderr) as bar:
        compile_candidates(cands, n_jobs, sm, on_done=lambda c: bar.update(1))


def _write_report(report, cands, **extra) -> None:
    import json

    from .tuning.tune import report as rows

    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({**extra, "candidates": rows(cands)}, indent=1, default=str) + "\n")
        click.echo(f"wrote {report}", err=True)


def _tune_dry_run(arch, head_dim, dtype, causal, gpu, max_candidates, jobs, do_compile, report, seqlen,
                  verbose: bool = False) -> None:
    from .tuning.tune import enumerate_candidates, format_candidates, search_space, space_size

    gpu = gpu or __import__("facodegen.spec", fromlist=["DEFAULT_GPU"]).DEFAULT_GPU[arch]
    cands = enumerate_candidates(arch, head_dim, dtype, causal, gpu, max_candidates, seqlen=seqlen)
    if do_compile:
        _compile_with_bar(cands, jobs, None)
    click.echo(f"tune {arch} hd{head_dim} {dtype} {'causal' if causal else 'full'} on {gpu} limits: "
               f"{_tune_counts(cands, space_size(search_space(arch, dtype)))}")
    click.echo(format_candidates(cands, verbose=verbose))
    _write_report(report, cands, arch=arch, head_dim=head_dim, dtype=dtype, causal=causal, gpu=gpu)


def _tune_gpu(arch, head_dim, dtype, causal, seqlen, seqlen_k, batch, heads, heads_kv, gpu, max_candidates, jobs,
              top, min_gain, no_store, report, db) -> None:
    import time

    from .ops import api
    from .tuning import tunedb
    from .tuning import tune as T
    from .bench.grids import attention_flops, cell

    t0 = time.monotonic()
    info = api.device_info(0)
    arch = arch or api.default_arch(info)
    try:
        api._check_arch(arch, info)
    except ValueError as err:
        raise UsageFailure(str(err)) from None
    gpu = gpu or info.budget_gpu
    c = cell(head_dim, causal, seqlen, batch, heads, dtype, seqlen_k, heads_kv)
    cands = T.enumerate_candidates(arch, head_dim, dtype, causal, gpu, max_candidates, seqlen=(seqlen, seqlen_k))
    click.echo(f"tune {arch} hd{head_dim} {dtype} {'causal' if causal else 'full'} on {info.name} "
               f"(batch {batch}, seqlen {seqlen}x{seqlen_k}, heads {heads}/{heads_kv}): {_tune_counts(cands)}",
               err=True)
    sm = api.device_target(arch, info)
    _compile_with_bar(cands, jobs, sm)
    t_compile = time.monotonic() - t0
    click.echo(f"compiled in {t_compile:.0f} s: {_tune_counts(cands)}", err=True)
    live = [x for x in cands if x.alive]
    with click.progressbar(length=len(live), label=f"timing {len(live)} candidates", file=sys.stderr) as bar:
        T.time_candidates(cands, c, arch, on_done=lambda x: bar.update(1),
                          log=lambda m: click.echo(m, err=True))
    winner, default = T.pick_winner(cands, min_gain)
    flops = attention_flops(batch, heads, seqlen, seqlen_k, head_dim, causal)
    seconds = time.monotonic() - t0
    dropped = [x for x in cands if x.dropped in ("compile", "spill", "ptxas", "check", "launch")]
    if dropped:
        click.echo(f"\ndropped after the budget model ({len(dropped)}):")
        for x in dropped:
            click.echo(f"  {x.dropped:<8} {x.label}: {x.reason}")
    click.echo(f"\n{_tune_counts(cands)}; {seconds:.0f} s ({t_compile:.0f} s compiling)")
    click.echo(T.format_results(cands, flops, top, winner))
    key = T.device_key(info, arch, head_dim, dtype, causal, c)
    extra = dict(key=key.as_dict(), cell=c, seconds=seconds, compile_seconds=t_compile)
    if winner is None:
        _write_report(report, cands, **extra)
        raise click.ClickException("no candidate passed its check and ran; nothing stored")
    entry = T.make_db_entry(key, winner, default, flops, c, cands)
    if default is not None:
        verdict = ("the default is the best (kept)" if winner.is_default else
                   f"{winner.spec.variant}: {default.ms / winner.ms:.3f}x the default {default.spec.variant}")
    else:
        verdict = f"{winner.spec.variant} (the default did not run: {next(x.reason for x in cands if x.is_default)})"
    click.echo(f"\nwinner: {verdict}")
    if no_store:
        click.echo("not stored (--no-store)")
    else:
        path = tunedb.resolve_path(db)
        if path is None:
            click.echo(f"not stored: the tuning database is turned off by ${tunedb.ENV}")
        else:
            tunedb.put(entry, path)
            click.echo(f"stored in {path} under {key}")
    _write_report(report, cands, entry=entry, **extra)


_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "bf16": "bf16", "fp16": "fp16"}


def _parse_shape(text: str) -> tuple[int, int, int, int, int, int]:
    """'batch,seqlen_q,seqlen_k,heads_q,heads_kv,head_dim' -> six ints."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 6 or min(values) < 1:
        raise click.BadParameter(f"{text!r}: expected six positive integers "
                                 f"batch,seqlen_q,seqlen_k,heads_q,heads_kv,head_dim", param_hint="--shape")
    return values


def model_shapes(config: dict, seqlens, batch: int) -> tuple[list[tuple], str | None]:
    """The attention shapes of a Hugging Face model config (config.json's dict) at each seqlen
    (prefill: seqlen_q = seqlen_k), and its dtype name ('bf16'/'fp16', None if it names none)."""
    config = config.get("text_config", config)
    try:
        heads = int(config["num_attention_heads"])
        heads_kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as err:
        raise click.BadParameter(f"the model config has no usable {err} (needs num_attention_heads and "
                                 f"head_dim or hidden_size)", param_hint="--config") from None
    dtype = _DTYPE_NAMES.get(str(config.get("torch_dtype") or config.get("dtype") or ""))
    return [(batch, s, s, heads, heads_kv, head_dim) for s in seqlens], dtype


@main.command()
@click.option("--shape", "shapes", multiple=True, callback=lambda c, p, v: [_parse_shape(x) for x in v],
              help="batch,seqlen_q,seqlen_k,heads_q,heads_kv,head_dim (repeatable).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="A Hugging Face config.json: its heads, KV heads, head_dim and dtype, at each --seqlens.")
@click.option("--seqlens", default="512,1024,2048,4096,8192", show_default=True,
              help="With --config: prefill lengths (comma-separated).")
@click.option("--batch", default=1, show_default=True, help="With --config: batch size.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), help="Default: the config's, else bf16.")
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--arch", type=click.Choice(ARCHS), help="Default: the GPU's (sm90 without one).")
@click.option("--gpu", type=click.Choice(sorted(GPUS)), default="h200", show_default=True,
              help="Without a GPU: the budget model's GPU the kernels are picked for.")
def precompile(shapes, config_path, seqlens, batch, dtype, causal, arch, gpu):
    """Compile ahead of time the kernels attention() will pick for these shapes, into the
    compile cache, so the first call of each shape only loads its kernel.

    \b
    Example:
      facodegen precompile --config path/to/config.json --seqlens 1024,4096
      facodegen precompile --shape 1,4096,4096,32,8,128 --no-causal --arch sm80
    """
    import json

    from .ops import api
    from .runtime import compiler

    problems = list(shapes)
    if config_path is not None:
        try:
            lengths = [int(x) for x in seqlens.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"{seqlens!r} is not a comma-separated list of integers",
                                     param_hint="--seqlens") from None
        found, config_dtype = model_shapes(json.loads(config_path.read_text()), lengths, batch)
        problems += found
        dtype = dtype or config_dtype
    if not problems:
        raise UsageFailure("give --shape and/or --config: nothing to compile")
    dtype = dtype or "bf16"
    ok, _ = compiler.gpu_available()
    seen = {}
    for b, sq, sk, hq, hkv, d in problems:
        shape = (b, sq, sk, hq)
        try:
            if ok:
                spec = api.resolve_spec(d, dtype, causal, 0, arch, shape=shape)
            else:
                spec = api.spec_for_shape(arch or "sm90", d, dtype, causal, shape, gpu=gpu)
        except (SpecError, ValueError) as err:
            raise UsageFailure(f"--shape {b},{sq},{sk},{hq},{hkv},{d}: {err}") from None
        if spec in seen:
            continue
        cached = _compile_for(spec, ok, api, compiler)
        seen[spec] = cached
        r = cached.resources
        click.echo(f"{'cached  ' if cached.from_cache else 'compiled'} {spec.variant}  "
                   f"(shape {b},{sq},{sk},{hq},{hkv},{d}; {r.registers} registers, {r.spill_stores} bytes spilled)")
    fresh = sum(not k.from_cache for k in seen.values())
    click.echo(f"{len(seen)} kernels for {len(problems)} shapes: {fresh} compiled, {len(seen) - fresh} already "
               f"in the cache ({compiler.cache_dir()})")


def _compile_for(spec: KernelSpec, on_gpu: bool, api, compiler):
    """The kernel as attention() compiles it: for the GPU at hand when there is one."""
    try:
        if on_gpu:
            return api.compile_for_device(spec)
        return compiler.compile(spec)
    except compiler.CompileError as err:
        raise click.ClickException(str(err)) from None


def _echo_result(result):
    """Print what check/bench returned (text, a dict or an object); return its 'passed' if any."""
    if result is None:
        return None
    if isinstance(result, str):
        click.echo(result)
        return None
    items = result if isinstance(result, dict) else getattr(result, "__dict__", None)
    if items is None:
        click.echo(str(result))
        return None
    for key, value in items.items():
        click.echo(f"{key:<16} {value}")
    passed = items.get("passed")
    return bool(passed) if passed is not None else None


if __name__ == "__main__":  # pragma: no cover
    main()
