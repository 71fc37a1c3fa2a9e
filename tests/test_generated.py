"""generated/ holds exactly the emitted source of every default spec.

Regenerate with the one command (from the repository root):

    facodegen emit --all --out-dir generated
"""

from __future__ import annotations

from pathlib import Path

import pytest

import facodegen

GENERATED = Path(__file__).resolve().parent.parent / "generated"
REGENERATE = "facodegen emit --all --out-dir generated"
NOT_KERNELS = {"README.md"}


@pytest.mark.parametrize("spec", facodegen.default_specs(), ids=lambda s: s.variant)
def test_generated_file_matches_emit(spec):
    path = GENERATED / f"{spec.variant}.cu"
    assert path.exists(), f"{path.name} is missing; run `{REGENERATE}`"
    assert path.read_text() == facodegen.emit(spec), f"{path.name} is stale; run `{REGENERATE}`"


def test_no_extra_files():
    expected = {f"{spec.variant}.cu" for spec in facodegen.default_specs()} | NOT_KERNELS
    present = {p.name for p in GENERATED.iterdir()}
    extra = sorted(present - expected)
    assert not extra, f"files in generated/ that no default spec emits: {extra}; run `{REGENERATE}`"
