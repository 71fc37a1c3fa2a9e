"""What every forward kernel's CPU compile must show (tests/test_head_dims.py, test_head_dim_v.py):
no stack or spills, no ptxas C75xx note (serialised wgmma, setmaxnreg ignored), no local-memory
instructions, and the arch's own instructions."""

from __future__ import annotations

import re


def compiled_clean(spec):
    """(kernel, SASS instruction counts) of ``spec`` after those checks: sm80 within 255 registers with
    HMMA, ldmatrix and cp.async; sm90 with HGMMA (fp8: QGMMA), TMA loads and stores (fp8 stores O from
    registers) and the setmaxnreg pair."""
    from facodegen.runtime import compiler     # (the test files skip where NVRTC is missing: importorskip)
    kernel = compiler.compile(spec)
    r = kernel.resources
    assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), kernel.log
    assert not re.findall(r"C75\d\d", kernel.log), kernel.log
    counts = kernel.sass_counts()
    assert counts["LDL"] == 0 and counts["STL"] == 0, counts
    if spec.arch == "sm80":
        assert 0 < r.registers <= 255
        assert counts["HMMA"] > 0 and counts["LDSM"] > 0 and counts["LDGSTS"] > 0, counts
    else:
        for op in ("QGMMA", "UTMALDG") if spec.dtype == "fp8" else ("HGMMA", "UTMALDG", "UTMASTG"):
            assert counts[op] > 0, (op, counts)
        assert counts["USETMAXREG"] == 2
    return kernel, counts
