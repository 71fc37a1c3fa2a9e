"""Every KernelSpec field refuses a value of another type, and hostile text, with a SpecError naming
the field (a seeded fuzz over all fields); no text outside the listed values reaches the source."""

from __future__ import annotations

import dataclasses
import random
import zlib
import string

import pytest

from facodegen.codegen.render import emit
from facodegen.spec import INT_FIELDS, TEXT_FIELDS, KernelSpec, SpecError

FIELDS = [f.name for f in dataclasses.fields(KernelSpec)]
BASE = dict(arch="sm90", head_dim=128, dtype="bf16")
HOSTILE = ["no", "", "yes", "1", "x\n#error injected", "*/ #error", "h200\n", b"sm90", 1.5, float("nan"),
           [1], {"a": 1}, (1,), object()]


def _hostile(rng: random.Random, n: int) -> list:
    """Seeded text with control characters, comment closers and preprocessor lines."""
    pieces = ["\n", "\r", "*/", "/*", "#error", "#include", "\\", '"', "\x00", "`"]
    return ["".join(rng.choice(pieces + list(string.ascii_letters)) for _ in range(rng.randint(1, 12)))
            for _ in range(n)]


def _kind(name: str) -> str:
    return "text" if name in TEXT_FIELDS else "int" if name in INT_FIELDS else "bool"


@pytest.mark.parametrize("name", FIELDS, ids=lambda n: f"field-{n}")  # (a bare "gpu" id reads as the gpu mark)
def test_every_field_refuses_values_of_another_type(name):
    rng = random.Random(zlib.crc32(name.encode()))     # (not hash(): salted per process)
    values = HOSTILE + _hostile(rng, 20)
    if _kind(name) == "text":   # a random letter can be a valid value ("q" of warp_split): not hostile
        values = [x for x in values if x not in TEXT_FIELDS[name]]
    if _kind(name) == "int":
        values += [True, False, 2.0, "128"]
    if _kind(name) == "bool":
        values += [2, -1, 0.0, "True", "false"]
    if _kind(name) == "text":
        values += [1, True, TEXT_FIELDS[name][0].upper(), TEXT_FIELDS[name][0] + "\n"]
    for value in values:
        with pytest.raises(SpecError) as err:
            KernelSpec(**{**BASE, name: value})
        assert err.value.field == name, (name, value, str(err.value))
        assert name in str(err.value)


def test_problem_fields_cannot_be_left_unset():
    for name in ("arch", "head_dim", "dtype", "causal"):
        with pytest.raises(SpecError, match=name):
            KernelSpec(**{**BASE, name: None})


def test_accepted_spellings_become_their_type():
    import numpy as np
    spec = KernelSpec(**BASE, block_n=np.int64(96), pingpong=1, persistent=0)
    assert type(spec.block_n) is int and spec.block_n == 96
    assert spec.pingpong is True and spec.persistent is False


def test_no_text_outside_the_lists_reaches_the_source():
    spec = KernelSpec(arch="sm80", head_dim=64, dtype="fp16")
    source = emit(spec)
    for name, allowed in TEXT_FIELDS.items():
        value = getattr(spec, name)
        assert value is None or value in allowed
    assert "#error" not in source
