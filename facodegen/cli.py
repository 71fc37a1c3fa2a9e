"""``facodegen`` command line: emit, inspect, check, bench.

Every command takes the same spec flags, one per KernelSpec knob (only the flags given are
passed; the rest take the spec's defaults), so the ``facodegen emit ...`` line in a generated
file's header (render.emit_command) reproduces that file byte for byte.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from . import __version__
from .spec import ARCHS, DTYPES, GPUS, HEAD_DIMS, KernelSpec, SpecError, default_specs

# flag value -> KernelSpec field, for the flags that map one to one.
_SPEC_FLAGS = {
    "arch": "arch", "head_dim": "head_dim", "dtype": "dtype", "block_m": "block_m",
    "block_n": "block_n", "warps": "num_warps", "stages": "stages", "causal": "causal",
    "gpu": "gpu", "q_in_regs": "q_in_regs", "pingpong": "pingpong", "overlap": "intra_wg_overlap",
    "persistent": "persistent", "consumer_warpgroups": "consumer_warpgroups",
}


class UsageFailure(click.ClickException):
    """A one-line error with exit status 2 (bad spec, no GPU): no usage block, no traceback."""
    exit_code = 2


def _parse_regs(ctx, param, value):
    if value is None:
        return None
    try:
        producer, consumer = (int(x) for x in value.split("/"))
    except ValueError:
        raise click.BadParameter(f"expected PRODUCER/CONSUMER registers, e.g. 24/240; got {value!r}") from None
    return producer, consumer


def spec_options(command):
    """The spec flags shared by every command."""
    options = [
        click.option("--arch", type=click.Choice(ARCHS), help="Target: sm80 (FA2, mma.sync) or sm90 (FA3, TMA + wgmma)."),
        click.option("--head-dim", type=int, help=f"Head dimension d: {', '.join(map(str, HEAD_DIMS))}."),
        click.option("--dtype", type=click.Choice(DTYPES), help="Element type of Q, K, V and O."),
        click.option("--block-m", type=int, help="Query rows per CTA tile (BLOCK_M)."),
        click.option("--block-n", type=int, help="Key/value rows per tile (BLOCK_N)."),
        click.option("--warps", type=int, help="Warps per CTA (num_warps)."),
        click.option("--stages", type=int, help="Depth of the K/V shared-memory ring."),
        click.option("--causal/--no-causal", default=None, help="Bottom-right aligned causal mask."),
        click.option("--gpu", type=click.Choice(tuple(GPUS)), help="Whose limits the budget model applies."),
        click.option("--q-in-regs/--q-in-smem", "q_in_regs", default=None, help="sm80: keep Q fragments in registers."),
        click.option("--pingpong/--no-pingpong", default=None, help="sm90: ping-pong scheduling of consumer warpgroups."),
        click.option("--overlap/--no-overlap", default=None, help="sm90: overlap the next QK^T with this softmax."),
        click.option("--regs", metavar="P/C", callback=_parse_regs, help="sm90: setmaxnreg producer/consumer, e.g. 24/240."),
        click.option("--persistent/--no-persistent", default=None, help="sm90: one CTA per SM with a tile scheduler."),
        click.option("--consumer-warpgroups", type=int, help="sm90: consumer warpgroups (block_m = 64 x this)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _given_spec_fields(kwargs: dict) -> dict:
    """KernelSpec keyword arguments of the spec flags given on the command line (popped)."""
    fields = {}
    for flag, name in _SPEC_FLAGS.items():
        value = kwargs.pop(flag, None)
        if value is not None:
            fields[name] = value
    regs = kwargs.pop("regs", None)
    if regs is not None:
        fields["producer_regs"], fields["consumer_regs"] = regs
    return fields


def build_spec(fields: dict) -> KernelSpec:
    try:
        return KernelSpec(**fields)
    except SpecError as err:
        raise UsageFailure(f"invalid spec: {err}") from None


def with_spec(command):
    """Decorate a command taking ``spec`` with the spec flags; bad specs exit 2 in one line."""
    @spec_options
    @functools.wraps(command)
    def wrapper(**kwargs):
        fields = _given_spec_fields(kwargs)
        return command(spec_fields=fields, **kwargs)
    return wrapper


def _require_gpu(command: str) -> None:
    from .compiler import gpu_available

    ok, reason = gpu_available()
    if not ok:
        raise UsageFailure(f"`facodegen {command}` needs a CUDA GPU: {reason}")


def _compile(spec: KernelSpec):
    from .compiler import CompileError, compile as compile_spec
    from .render import TemplateRenderError

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
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the source to this file.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), help="Write <variant>.cu into this folder.")
@click.option("--all", "all_specs", is_flag=True,
              help="Write every default spec as <variant>.cu into --out-dir (stale flash_fwd_*.cu there are removed).")
def emit(spec_fields, output, out_dir, all_specs):
    """Print (or write) the CUDA source of one kernel.

    \b
    Example:
      facodegen emit --arch sm90 --head-dim 128 --dtype bf16 --causal
      facodegen emit --arch sm80 --head-dim 64 -o fwd.cu
      facodegen emit --all --out-dir generated      # regenerates generated/
    """
    from .render import TemplateRenderError, emit as render

    try:
        if all_specs:
            if spec_fields:
                raise UsageFailure("--all writes the default specs; drop the spec flags "
                                   f"({', '.join(sorted(spec_fields))})")
            if out_dir is None or output is not None:
                raise UsageFailure("--all needs --out-dir DIR (and no -o)")
            _emit_all(out_dir, render)
            return
        spec = build_spec(spec_fields)
        source = render(spec)
    except TemplateRenderError as err:
        raise click.ClickException(str(err)) from None
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
def inspect(spec_fields, what):
    """Compile a kernel (no GPU needed) and report what the compiler made of it.

    \b
    Example:
      facodegen inspect --arch sm90 --head-dim 128            # resources
      facodegen inspect --arch sm80 --head-dim 64 --sass | tail -12
    """
    from .compiler import ToolNotFoundError

    spec = build_spec(spec_fields)
    kernel = _compile(spec)
    try:
        if what == "ptx":
            click.echo(kernel.ptx())
        elif what == "sass":
            click.echo(kernel.sass())
            counts = kernel.sass_counts()
            click.echo("key instructions: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        else:
            click.echo(format_resources(spec, kernel))
    except ToolNotFoundError as err:
        raise click.ClickException(str(err)) from None


def format_resources(spec: KernelSpec, kernel) -> str:
    r = kernel.resources
    rows = [
        ("kernel", spec.variant),
        ("target", kernel.target),
        ("threads", f"{spec.threads} ({spec.num_warps} warps)"),
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
    from .compiler import ToolNotFoundError

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
def check(spec_fields, batch, seqlen_q, seqlen_k, heads, heads_kv, seed):
    """Run a kernel on random inputs and compare with the float64 reference (GPU).

    \b
    Example:
      facodegen check --arch sm90 --head-dim 128 --causal --seqlen-q 2048
    """
    spec = build_spec(spec_fields)
    _require_gpu("check")
    seqlen_k = seqlen_k or seqlen_q
    heads_kv = heads_kv or heads
    try:
        from . import api
    except ImportError as err:
        raise click.ClickException(f"facodegen.api is not available: {err}") from None
    check_spec = getattr(api, "check_spec", None)
    if check_spec is not None:
        result = check_spec(spec, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                            heads=heads, heads_kv=heads_kv, seed=seed)
    else:
        result = _check_with_reference(api, spec, batch, seqlen_q, seqlen_k, heads, heads_kv, seed)
    passed = _echo_result(result)
    if passed is False:
        sys.exit(1)


def _check_with_reference(api, spec, batch, seqlen_q, seqlen_k, heads, heads_kv, seed) -> dict:
    """Random inputs through facodegen.api.attention, O and LSE against the float64 reference."""
    from .reference import attention_reference, check_lse, random_qkv
    from .reference import check as check_o

    if spec.dtype == "bf16":  # CuPy has no bfloat16
        try:
            import torch as xp
        except ImportError:
            raise click.ClickException("bf16 inputs need torch (CuPy has no bfloat16); try --dtype fp16") from None
    else:
        import cupy as xp
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, spec.head_dim, spec.dtype, seed=seed, xp=xp)
    knobs = {k_: v_ for k_, v_ in spec.as_dict().items() if k_ not in ("head_dim", "dtype", "causal")}
    o, lse = api.attention(q, k, v, causal=spec.causal, return_lse=True, **knobs)
    ref_o, ref_lse = attention_reference(q, k, v, spec.causal)
    ok_o, msg_o = check_o(o, ref_o, spec.dtype)
    ok_l, msg_l = check_lse(lse, ref_lse)
    return {"kernel": spec.variant,
            "shape": f"batch={batch} seqlen_q={seqlen_q} seqlen_k={seqlen_k} heads={heads} heads_kv={heads_kv}",
            "O": msg_o, "LSE": msg_l, "passed": ok_o and ok_l}


@main.command()
@with_spec
@click.option("--seqlen", default=4096, show_default=True, help="Query (and key) sequence length.")
@click.option("--seqlen-k", type=int, help="Key/value sequence length. Default: --seqlen.")
@click.option("--batch", default=4, show_default=True)
@click.option("--heads", default=16, show_default=True, help="Query heads.")
@click.option("--heads-kv", type=int, help="Key/value heads (divides --heads). Default: --heads.")
@click.option("--peers", help="Comma-separated peers to time alongside, e.g. fa3,cudnn,fa2 ('' for none).")
def bench(spec_fields, seqlen, seqlen_k, batch, heads, heads_kv, peers):
    """Time a kernel (CUDA events) against its peers and print a table (GPU).

    \b
    Example:
      facodegen bench --arch sm90 --head-dim 128 --seqlen 8192 --batch 2 --heads 16
      facodegen bench --arch sm80 --head-dim 64 --causal --peers fa2
    """
    spec = build_spec(spec_fields)
    _require_gpu("bench")
    try:
        from . import bench as bench_module
    except ImportError as err:
        raise click.ClickException(f"facodegen.bench is not available: {err}") from None
    run = getattr(bench_module, "run_cli_bench", None)
    if run is None:
        raise click.ClickException("facodegen.bench.run_cli_bench is not available in this version")
    extra = {}
    if seqlen_k is not None:
        extra["seqlen_k"] = seqlen_k
    if heads_kv is not None:
        extra["heads_kv"] = heads_kv
    if peers is not None:
        extra["peers"] = tuple(p.strip() for p in peers.split(",") if p.strip())
    _echo_result(run(spec, seqlen=seqlen, batch=batch, heads=heads, **extra))


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
