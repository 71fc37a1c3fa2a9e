"""The knob registry is the one list of knobs: it covers KernelSpec exactly, and the CLI flags, the
type checks, the tuner's space and docs/knobs.md all come from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path


from facodegen import cli
from facodegen.spec import knobs
from facodegen.tuning import tune
from facodegen.spec import KernelSpec

ROOT = Path(__file__).resolve().parents[1]


def test_the_registry_covers_kernelspec_exactly():
    fields = [f.name for f in dataclasses.fields(KernelSpec)]
    assert sorted(knobs.BY_NAME) == sorted(fields) and len(knobs.KNOBS) == len(fields)
    for knob in knobs.KNOBS:
        assert knob.kind in ("bool", "int", "text") and knob.doc.strip() and set(knob.archs) <= set(knobs.ARCHS)
        assert knob.kind != "text" or knob.choices


def test_docs_tables_are_the_registries():
    """docs/knobs.md is document(): a table per kernel family (forward, backward, decode, combine, append),
    each row a knob of that family's registry."""
    from facodegen.spec.backward import BACKWARD_KNOBS
    from facodegen.spec.decode import APPEND_KNOBS, COMBINE_KNOBS, DECODE_KNOBS
    text = (ROOT / "docs" / "knobs.md").read_text()
    assert text == knobs.document(), "regenerate docs/knobs.md: python -m facodegen.spec.knobs > docs/knobs.md"
    for registry in (knobs.KNOBS, BACKWARD_KNOBS, DECODE_KNOBS, COMBINE_KNOBS, APPEND_KNOBS):
        table = knobs.markdown_table(registry)
        assert table in text and len(table.splitlines()) == 2 + len(registry)
    assert "| `lpt` | `--lpt/--no-lpt` | bool |" in text and "| `fused_combine` |" in text


def test_every_flagged_knob_is_a_flag_of_emit_with_its_domain():
    params = {p.name: p for p in cli.emit.params}
    for knob in knobs.KNOBS:
        if not knob.flag:
            continue
        param = params[knob.name]
        assert knob.flag.split("/")[0] in param.opts
        if knob.name == "softcap":      # --softcap [C] takes the run-time value too; --no-softcap is its own flag
            assert not param.is_flag and params["no_softcap"].opts == ["--no-softcap"]
            continue
        if knob.kind == "bool":
            assert param.secondary_opts == [knob.flag.split("/")[1]]
        elif knob.kind == "text":
            assert tuple(param.type.choices) == knob.choices
        elif knob.choices and knob.flag_offers_choices:
            assert [int(c) for c in param.type.choices] == list(knob.choices)
    assert "regs" in params    # producer_regs / consumer_regs


def test_tuner_space_is_the_registrys():
    for arch in knobs.ARCHS:
        assert tune.SEARCH_SPACE[arch] == {k.name: k.search[arch] for k in knobs.KNOBS
                                           if k.search and arch in k.search}



def test_emit_lines_reproduce_the_specs_around_every_default():
    """render.emit_command (derived from the registry) gives a line that builds the same spec, for
    a seeded sample of the tuner's candidates around every default: arch, dtype, head_dim, causal."""
    import random
    import shlex

    from facodegen.codegen.render import emit_command
    from facodegen.spec import HEAD_DIMS
    rng = random.Random(0)
    specs = []
    for arch, dtypes in (("sm80", ("bf16",)), ("sm90", ("bf16", "fp8"))):
        for dtype in dtypes:
            for head_dim in HEAD_DIMS:
                for causal in (False, True):
                    cands = [c.spec for c in tune.enumerate_candidates(arch, head_dim, dtype, causal, None)
                             if c.spec is not None]
                    specs += rng.sample(cands, min(4, len(cands)))
    for spec in specs:
        ctx = cli.emit.make_context("emit", shlex.split(emit_command(spec))[2:])
        assert KernelSpec(**cli._given_spec_fields(dict(ctx.params))) == spec, spec.variant


def test_the_variant_is_the_registrys_tokens_in_order():
    spec = KernelSpec(arch="sm90", head_dim=128, causal=True)
    tokens = [k.token(spec, getattr(spec, k.name)) for k in knobs.KNOBS if k.token and spec.arch in k.archs]
    assert spec.variant == "_".join(t for t in tokens if t)
    assert spec.variant.startswith("flash_fwd_sm90_bf16_hd128_") and spec.variant.endswith("_causal")
