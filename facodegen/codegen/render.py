"""Render a KernelSpec to CUDA source with Jinja2 (StrictUndefined, deterministic)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jinja2

from .. import __version__
from ..runtime.params import TENSOR_MAP_ALIGN, has_variants, spec_layout
from ..spec import KernelSpec
from ..spec.knobs import tile_head_dim

_PACKAGE_DIR = Path(__file__).resolve().parents[1]     # facodegen/


def template_dir() -> Path:
    """templates/ inside the installed wheel, else the checkout's top-level templates/."""
    for candidate in (_PACKAGE_DIR / "templates", _PACKAGE_DIR.parent / "templates"):
        if (candidate / "common").is_dir():
            return candidate
    raise FileNotFoundError(f"facodegen templates not found next to {_PACKAGE_DIR}")


class TemplateRenderError(RuntimeError):
    """A template failed to render; the message shows the failing line and its neighbours."""


@functools.lru_cache(maxsize=4)
def environment(templates: str | None = None) -> jinja2.Environment:
    """The Jinja environment over ``templates`` (default: template_dir())."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates or str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


# Always on the emit line (what the kernel computes and its tile), whatever the defaults.
_EMIT_ALWAYS = ("arch", "dtype", "head_dim", "block_m", "block_n", "num_warps", "stages", "gpu", "causal")


def emit_command(spec: KernelSpec, runtime: dict | None = None) -> str:
    """The `facodegen emit` command line that reproduces this spec: the problem and its tile, then
    every other knob whose value the shorter line would not give by itself (found by building the
    spec of the shorter line until it is this spec), as the knob registry spells them, in its order.
    ``runtime``: the run-time values the command line gave (window_left, window_right, softcap):
    they stand in for --local / --softcap, as --window-left L --window-right R / --softcap C."""
    runtime = runtime or {}
    from ..spec.knobs import KNOBS
    from ..spec import SpecError

    mine = [k for k in KNOBS if spec.arch in k.archs]
    given = {k.name: getattr(spec, k.name) for k in mine if k.name in _EMIT_ALWAYS or k.name == "schedule"}
    if spec.padded and tile_head_dim(spec.head_dim_real) == spec.head_dim:
        given["head_dim"] = spec.head_dim_real      # --head-dim 80 (the tile of 96 follows)
    if spec.split_v:
        given["head_dim_v"] = spec.head_dim_v       # part of the problem, as head_dim
    for _ in range(len(mine)):
        try:
            built = KernelSpec(**given)
            missing = [k.name for k in mine if getattr(built, k.name) != getattr(spec, k.name)]
        except SpecError as err:    # the shorter line makes no spec: name what it complains of, else all
            missing = [err.field] if err.field not in given else [k.name for k in mine if k.name not in given]
        if not missing:
            break
        given.update({name: getattr(spec, name) for name in missing})
    flags = []
    for knob in mine:
        if knob.name not in given or knob.name == "consumer_regs":
            continue
        if knob.name == "head_dim_real" and given["head_dim"] == spec.head_dim_real:
            continue                                # --head-dim gave it (the whole tile's d, or d of a padded one)
        if knob.name == "head_dim_v" and not spec.split_v:
            continue                                # (V as wide as Q and K: the default)
        if knob.name == "varlen_tma_store" and given[knob.name] == spec.varlen:
            continue                                # (--varlen brings it, no --varlen leaves it off: unsaid)
        value = given[knob.name]
        if knob.name == "producer_regs":            # --regs P/C sets both
            flags.append(f"--regs {spec.producer_regs}/{spec.consumer_regs}")
        elif knob.name == "local" and value and "window_left" in runtime:
            flags.append(f"--window-left {runtime['window_left']} --window-right {runtime['window_right']}")
        elif knob.name == "softcap" and value and "softcap" in runtime:
            flags.append(f"--softcap {runtime['softcap']!r}")
        else:
            flags.append(knob.command_text(value))
    return "facodegen emit " + " ".join(flags)


def _runtime_note(spec: KernelSpec, runtime: dict) -> str:
    """The header's line of run-time values the command line gave (empty if none)."""
    parts = []
    if spec.local and "window_left" in runtime:
        parts.append(f"window_size = ({runtime['window_left']}, {runtime['window_right']})")
    if spec.softcap and "softcap" in runtime:
        parts.append(f"softcap = {runtime['softcap']!r}")
    return ", ".join(parts)


def context(spec: KernelSpec, runtime: dict | None = None) -> dict:
    """Everything a template may read: the spec and constants derived from it once. ``runtime``:
    run-time values given on the command line (shown in the header, not compiled in)."""
    placed, size, align = spec_layout(spec)
    runtime = runtime or {}
    hidden = set() if spec.dtype == "fp8" else {"out_dtype", "v_layout", "vt_in_place", "defer_o_store"}
    if not has_variants(spec):
        hidden |= {"local", "softcap", "sinks"}
    if not spec.varlen:
        hidden |= {"varlen", "varlen_tma_store", "varlen_lpt"}
    if not spec.padded:
        hidden.add("head_dim_real")     # (the kernels of a whole tile show head_dim alone, as before)
    if not spec.split_v:
        hidden.add("head_dim_v")        # (likewise: V and O as wide as Q and K)
    return {
        "spec": spec,
        "arch": spec.arch,
        "kernel_name": spec.variant,
        "version": __version__,
        "emit_command": emit_command(spec, runtime),
        "runtime_note": _runtime_note(spec, runtime),
        # fp8's knobs (fixed for the 16-bit types) are left out of the header of bf16/fp16 kernels,
        # and the variant switches (and varlen) out of kernels that have none
        "spec_items": sorted((k, v) for k, v in spec.as_dict().items() if k not in hidden),
        "smem_bytes": spec.smem_bytes,
        "split_v": spec.split_v,        # head_dim_v != head_dim: V and O have their own width
        "threads": spec.threads,
        "log2e": repr(math.log2(math.e)),
        "placed": placed,
        "size": size,
        "align": align,
        "tmap_align": TENSOR_MAP_ALIGN,
    }


def emit(spec: KernelSpec, templates: str | None = None, runtime: dict | None = None) -> str:
    """The CUDA source of one kernel: byte-identical for equal specs. ``templates``: another copy
    of templates/ to render from (scripts/lab.py patch-ab times an older tree's kernel that way).
    ``runtime``: run-time values (window_left, window_right, softcap) to show in the header; the
    code is the same for any."""
    if spec.schedule == "fa1":
        name = f"{spec.arch}/flash_fwd_fa1.cu.j2"
    elif spec.dtype == "fp8":
        name = f"{spec.arch}/flash_fwd_fp8.cu.j2"
    else:
        name = f"{spec.arch}/flash_fwd.cu.j2"
    return render_template(name, context(spec, runtime), templates)


def render_template(name: str, values: dict, templates: str | None = None) -> str:
    """Template ``name`` rendered with ``values``, a template's syntax error or undefined variable
    raised as TemplateRenderError with the failing line and its neighbours: every kernel family
    renders through here."""
    try:
        return environment(templates).get_template(name).render(**values)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateRenderError(_describe(err.filename or name, err.lineno, str(err))) from err
    except jinja2.UndefinedError as err:
        raise TemplateRenderError(f"{name}: undefined template variable: {err}") from err


def _describe(filename: str, lineno: int, message: str) -> str:
    path = Path(filename)
    if not path.is_absolute():
        path = template_dir() / filename
    lines = path.read_text().splitlines() if path.exists() else []
    lo, hi = max(lineno - 3, 0), min(lineno + 2, len(lines))
    excerpt = "\n".join(f"{'>' if i + 1 == lineno else ' '}{i + 1:5d} | {lines[i]}" for i in range(lo, hi))
    return f"{filename}:{lineno}: {message}\n{excerpt}"
