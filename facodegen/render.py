"""Render a KernelSpec to CUDA source with Jinja2 (StrictUndefined, deterministic)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jinja2

from . import __version__
from .params import TENSOR_MAP_ALIGN, layout
from .spec import KernelSpec

_PACKAGE_DIR = Path(__file__).resolve().parent


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


def emit_command(spec: KernelSpec) -> str:
    """The `facodegen emit` command line that reproduces this spec."""
    flags = [f"--arch {spec.arch}", f"--head-dim {spec.head_dim}", f"--dtype {spec.dtype}",
             f"--block-m {spec.block_m}", f"--block-n {spec.block_n}", f"--warps {spec.num_warps}",
             f"--stages {spec.stages}", f"--gpu {spec.gpu}"]
    if spec.causal:
        flags.append("--causal")
    if spec.dtype == "fp8":
        flags += [f"--out-dtype {spec.out_dtype}", f"--v-layout {spec.v_layout}"]
    if spec.arch == "sm80":
        flags.append("--q-in-regs" if spec.q_in_regs else "--q-in-smem")
        if spec.schedule != "fa2":
            flags += [f"--schedule {spec.schedule}", f"--loop-order {spec.loop_order}",
                      f"--warp-split {spec.warp_split}", f"--rescale {spec.rescale}"]
    else:
        flags += ["--pingpong" if spec.pingpong else "--no-pingpong",
                  "--overlap" if spec.intra_wg_overlap else "--no-overlap",
                  f"--regs {spec.producer_regs}/{spec.consumer_regs}",
                  "--persistent" if spec.persistent else "--no-persistent",
                  "--dynamic-scheduler" if spec.dynamic_scheduler else "--static-scheduler",
                  "--stream-k" if spec.stream_k else "--no-stream-k",
                  "--separate-o" if spec.separate_o else ("--o-in-v" if spec.o_in_v else "--o-aliases-q"),
                  "--l2-hints" if spec.l2_hints else "--no-l2-hints",
                  "--anchor-softmax" if spec.anchor_softmax else "--no-anchor-softmax",
                  "--uniform-wg" if spec.uniform_wg else "--no-uniform-wg",
                  f"--ctas-per-sm {spec.ctas_per_sm}", f"--cluster-m {spec.cluster_m}", f"--q-stages {spec.q_stages}",
                  f"--p-buffers {spec.p_buffers}",
                  "--rebuild-q-desc" if spec.rebuild_q_desc else "--keep-q-desc"]
        if spec.l2_prefetch:
            flags.append(f"--l2-prefetch {spec.l2_prefetch}")
        if spec.vt_in_place:
            flags.append("--vt-in-place")
        if spec.dtype == "fp8":             # its default depends on the shape of the spec: always named
            flags.append("--defer-o-store" if spec.defer_o_store else "--store-o-at-end")
        if spec.intra_wg_overlap:
            flags.append("--rescale-under-qk" if spec.rescale_under_qk else "--rescale-after-pv")
        flags.append("--optimistic-max" if spec.optimistic_max else "--exact-max")
    if spec.schedule == "fa2":
        flags.append("--lazy-rescale" if spec.lazy_rescale else "--exact-rescale")
    if spec.schedule == "fa2":
        flags += [f"--softmax-chains {spec.softmax_chains}", f"--poly-exp2-tiles {spec.poly_exp2_tiles}"]
    return "facodegen emit " + " ".join(flags)


def context(spec: KernelSpec) -> dict:
    """Everything a template may read: the spec and constants derived from it once."""
    placed, size, align = layout(spec.arch, spec.dtype)
    return {
        "spec": spec,
        "arch": spec.arch,
        "kernel_name": spec.variant,
        "version": __version__,
        "emit_command": emit_command(spec),
        # fp8's knobs (fixed for the 16-bit types) are left out of the header of bf16/fp16 kernels
        "spec_items": sorted((k, v) for k, v in spec.as_dict().items()
                             if spec.dtype == "fp8" or k not in ("out_dtype", "v_layout", "vt_in_place", "defer_o_store")),
        "smem_bytes": spec.smem_bytes,
        "threads": spec.threads,
        "log2e": repr(math.log2(math.e)),
        "placed": placed,
        "size": size,
        "align": align,
        "tmap_align": TENSOR_MAP_ALIGN,
    }


def emit(spec: KernelSpec, templates: str | None = None) -> str:
    """The CUDA source of one kernel: byte-identical for equal specs. ``templates``: another copy
    of templates/ to render from (scripts/patch_ab.py times an older tree's kernel that way)."""
    if spec.schedule == "fa1":
        name = f"{spec.arch}/flash_fwd_fa1.cu.j2"
    elif spec.dtype == "fp8":
        name = f"{spec.arch}/flash_fwd_fp8.cu.j2"
    else:
        name = f"{spec.arch}/flash_fwd.cu.j2"
    try:
        return environment(templates).get_template(name).render(**context(spec))
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
