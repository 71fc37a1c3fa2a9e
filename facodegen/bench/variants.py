"""facodegen as it is timed: a variant (``arch:field=value,...``) read into spec overrides, and
for one input set the callable of its public call (``facodegen.attention`` every time) and of a
launcher prepared once (``facodegen.prepare``), the two columns of one facodegen implementation."""

from __future__ import annotations

import contextlib

from .inputs import InputSet, quantized
from .tables import facodegen_name, prepared_name
from .timing import _torch

def parse_variant(text: str) -> tuple[str, dict]:
    """``arch:field=value,...`` -> (arch, spec fields typed by their knobs); an empty field list
    means that arch's defaults (e.g. ``sm90:pingpong=0,block_n=128``)."""
    from ..spec.knobs import KNOBS
    by_name = {k.name: k for k in KNOBS}
    arch, _, rest = text.partition(":")
    fields: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in by_name:
            raise ValueError(f"variant {text!r}: {key!r} is not a KernelSpec field")
        fields[key] = by_name[key].parse(value)
    return arch, fields


def knob_values(text: str, by_name: dict, owner: str) -> dict:
    """'name=value,...' -> {name: value}, each value typed by its knob in ``by_name`` (name -> Knob);
    ValueError on an item without '=' or a name that is not one of ``owner``'s knobs. The backward's
    and the decode's ``--variant`` take their knobs this way."""
    knobs = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"{item!r}: expected knob=value")
        if name not in by_name:
            raise ValueError(f"{name!r} is not a knob of {owner} ({', '.join(by_name)})")
        knobs[name] = by_name[name].parse(value)
    return knobs


def variant_label(knobs: dict) -> str:
    """A ``--variant``'s column name: facodegen[name=value,...], names sorted."""
    return "facodegen[" + ",".join(f"{k}={v}" for k, v in sorted(knobs.items())) + "]"


def _split_overrides(spec_overrides, arch: str) -> dict:
    """A flat dict applies to every arch; {"sm80": {...}, "sm90": {...}} per arch."""
    if not spec_overrides:
        return {}
    if any(key in ("sm80", "sm90") for key in spec_overrides):
        return dict(spec_overrides.get(arch, {}))
    return dict(spec_overrides)


def _facodegen_operands(overrides: dict, s: InputSet):
    """(overrides without dtype, input set to check against, q, k, v) of a facodegen variant: a
    ``dtype=fp8`` variant on a bf16/fp16 cell quantises the inputs once (per tensor) and is checked
    against their dequantised values; a ``v_layout=transposed`` variant gets V^T made before timing
    (api.transpose_v), as a caller who keeps V^T across calls would have it."""
    from ..ops import api
    overrides = dict(overrides)
    if overrides.pop("dtype", None) == "fp8" and not s.fp8:
        s = quantized(s)
    v = api.transpose_v(s.v) if overrides.get("v_layout") == "transposed" else s.v
    return overrides, s, s.q, s.k, v


def _facodegen_fn(arch: str, overrides: dict, s: InputSet, causal: bool):
    """The prepared path: a zero-argument launcher through ``facodegen.ops.api.prepare`` (argument
    checks, spec resolution and parameter packing done once, out and lse allocated once), so its
    time is the kernel's with the least host work. Returns (fn, context, variant, the input set
    to check against); tune and the scripts time kernels through it too."""
    torch = _torch()
    from ..ops import api
    overrides, s, q, k, v = _facodegen_operands(overrides, s)
    out = torch.empty(q.shape, dtype=torch.bfloat16 if s.fp8 else q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    launcher = api.prepare(q, k, v, causal=causal, arch=arch, out=out, lse_out=lse, **s.descales, **overrides)

    def fn(_operands=(q, k, v)):     # the launcher points into these (v may be a V^T made here)
        launcher()
        return out
    fn.prepared = launcher          # (scripts/lab.py patch-ab reaches the plan's scratch through it)
    return fn, contextlib.nullcontext, launcher.spec.variant, s


def _facodegen_call_fn(arch: str, overrides: dict, s: InputSet, causal: bool):
    """The public call, as users make it: ``facodegen.attention(q, k, v, causal=..., **overrides)``
    every time, its argument checks, kernel lookup and out allocation included. Returns (fn,
    context, variant, the input set to check against) like _facodegen_fn. The variant is read
    off one ``facodegen.prepare`` of the same arguments, which also makes a refused variant fail
    here, before anything is timed."""
    import facodegen
    overrides, s, q, k, v = _facodegen_operands(overrides, s)
    kwargs = dict(causal=causal, arch=arch, **s.descales, **overrides)
    variant = getattr(getattr(facodegen.prepare(q, k, v, **kwargs), "spec", None), "variant", None)

    def fn():
        return facodegen.attention(q, k, v, **kwargs)
    return fn, contextlib.nullcontext, variant, s


def _facodegen_makers(name: str, arch: str, overrides: dict, causal: bool, prepared: bool = True) -> list:
    """[(name, make: InputSet -> (fn, context, variant, checked set))] of one facodegen column:
    the public call under ``name`` and, unless ``prepared`` is False, the prepared launcher beside
    it under prepared_name(name). Both run over the same rotated input sets and take turns with the
    peers, so the two differ only by the host work of the public call."""
    makers = [(name, lambda s: _facodegen_call_fn(arch, overrides, s, causal))]
    if prepared:
        makers.append((prepared_name(name), lambda s: _facodegen_fn(arch, overrides, s, causal)))
    return makers


def _facodegen_names(archs, variants: dict | None, prepared: bool) -> list[str]:
    """The facodegen result names of a cell (for rows of cells that never ran)."""
    names = list(variants or [facodegen_name(a) for a in archs])
    return [x for n in names for x in ([n, prepared_name(n)] if prepared else [n])]
