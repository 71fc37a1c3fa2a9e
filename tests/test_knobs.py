"""The knob registry is the one list of knobs: it covers KernelSpec exactly, and the CLI flags, the
type checks, the tuner's space and docs/knobs.md all come from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path


from facodegen import cli, knobs, tune
from facodegen.spec import KernelSpec

ROOT = Path(__file__).resolve().parents[1]


def test_the_registry_covers_kernelspec_exactly():
    fields = [f.name for f in dataclasses.fields(KernelSpec)]
    assert sorted(knobs.BY_NAME) == sorted(fields) and len(knobs.KNOBS) == len(fields)
    for knob in knobs.KNOBS:
        assert knob.kind in ("bool", "int", "text") and knob.doc.strip() and set(knob.archs) <= set(knobs.ARCHS)
        assert knob.kind != "text" or knob.choices


def test_docs_table_is_the_registry():
    text = (ROOT / "docs" / "knobs.md").read_text()
    assert knobs.markdown_table() in text, "regenerate docs/knobs.md: python -m facodegen.knobs"


def test_every_flagged_knob_is_a_flag_of_emit_with_its_domain():
    params = {p.name: p for p in cli.emit.params}
    for knob in knobs.KNOBS:
        if not knob.flag:
            continue
        param = params[knob.name]
        assert knob.flag.split("/")[0] in param.opts
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

