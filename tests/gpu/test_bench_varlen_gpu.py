"""The varlen suite's GPU part (facodegen.bench.varlen_suite.measure) on a small cell: every
implementation's output passes its float64 check and is timed, or is reported with the reason
(FlashAttention-3 where flash_attn_interface is missing, cuDNN where SDPA refuses). The pure parts
and the CLI are tested on the CPU (tests/test_bench_varlen.py, tests/test_bench_suites_cli.py)."""

from __future__ import annotations

import pytest

from facodegen.bench import varlen_suite as vl

torch = pytest.importorskip("torch")
HAVE_GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU (torch.cuda)")]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_measure_a_small_cell(head_dim, causal):
    c = vl.cell([100, 333, 1000, 17], head_dim, causal, "small")
    row = vl.measure(c, quick=True)
    res = row["results"]
    assert row["sets"] == vl.input_sets(c) > 1
    for name in (vl.FACODEGEN_VARLEN, vl.PADDED_SM80):
        assert res[name].get("tflops"), (name, res[name])
        assert res[name]["err"] < 1e-2
    if vl.FACODEGEN_VARLEN_SM80 in res:         # on sm90 GPUs: the sm80 varlen kernel beside the sm90 one
        assert res[vl.FACODEGEN_VARLEN_SM80].get("tflops") and res[vl.FACODEGEN_VARLEN_SM80]["err"] < 1e-2
    for name in (vl.FA3_VARLEN, vl.CUDNN_PADDED, vl.PADDED_SM90):
        r = res.get(name)
        assert r is None or r.get("tflops") or r.get("note"), (name, r)
    if vl.FA3_VARLEN not in res:
        assert any("FA3 varlen skipped" in n for n in row["notes"])
    assert vl.format_table([row]).splitlines()[2].startswith("| small |")
