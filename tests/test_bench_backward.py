"""scripts/bench_backward.py's pure parts on the CPU: the grid, the FLOP count, the table, the options."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_backward", ROOT / "scripts" / "bench_backward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)      # import-safe without torch's CUDA
    return module


def test_grid_is_the_fa3_papers(bench):
    cells = bench.grid()
    assert len(cells) == 3 * 2 * 6
    for c in cells:
        assert c["batch"] * c["seqlen"] == 16384 and c["heads"] * c["head_dim"] == 2048


def test_backward_flops(bench):
    assert bench.backward_flops(1, 1, 2, 2, 64, False) == 2.5 * 4 * 2 * 2 * 64
    assert bench.backward_flops(8, 16, 2048, 2048, 128, True) == bench.backward_flops(8, 16, 2048, 2048, 128, False) / 2
    cell = {"batch": 8, "heads": 16, "seqlen": 2048, "head_dim": 128, "causal": False}
    assert bench.tflops(cell, 1.0) == pytest.approx(2.5 * 4 * 8 * 16 * 2048 * 2048 * 128 / 1e-3 / 1e12)
    assert bench.tflops(cell, None) is None


def test_markdown_table_ratios_and_geomean(bench):
    rows = [dict(head_dim=128, causal=False, seqlen=2048, tflops={"facodegen": 300.0, "cudnn": 400.0, "flash": 200.0}),
            dict(head_dim=128, causal=True, seqlen=4096, tflops={"facodegen": 200.0, "cudnn": 100.0})]
    table = bench.markdown(rows)
    assert "| 128 | no | 2048 | 300.0 | 400.0 | 200.0 | 0.75x | 1.50x |" in table
    assert "| 128 | yes | 4096 | 200.0 | 100.0 | – | 2.00x | – |" in table
    assert table.splitlines()[-1] == "| geomean | | | | | | 1.22x | 1.50x |"


def test_options(bench):
    args = bench.parse_args(["--head-dims", "64,128", "--seqlens", "1024", "--causal", "yes", "--peers",
                             "facodegen,cudnn"])
    assert args.head_dims == (64, 128) and args.seqlens == (1024,) and args.causals == (True,)
    assert args.peers == ("facodegen", "cudnn")
    assert bench.parse_args(["--quick"]).seqlens == (2048, 8192)
    with pytest.raises(SystemExit):
        bench.parse_args(["--peers", "fa9"])


def test_variants(bench):
    args = bench.parse_args(["--variant", "k_unroll=1,block_n=64", "--variant", "k_unroll=2"])
    assert args.variant == [{"k_unroll": 1, "block_n": 64}, {"k_unroll": 2}]
    label = bench.variant_label(args.variant[0])
    assert label == "facodegen[block_n=64,k_unroll=1]"
    rows = [dict(head_dim=64, causal=True, seqlen=512, tflops={"facodegen": 100.0, label: 120.0})]
    assert "| 64 | yes | 512 | 100.0 | 120.0 |" in bench.variants_markdown(rows, [label])
    with pytest.raises(SystemExit):
        bench.parse_args(["--variant", "k_unroll"])
