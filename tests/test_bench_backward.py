"""The backward suite's pure parts on the CPU (facodegen.bench.backward: the grid, the FLOP count, the
tables, the runner with the timing faked) and scripts/bench_backward.py's options (a thin wrapper)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from facodegen.bench import backward as bw
from facodegen.bench import grids

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_backward", ROOT / "scripts" / "bench_backward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)      # import-safe without torch's CUDA
    return module


def test_grid_is_the_fa3_papers():
    cells = bw.backward_cells()
    assert len(cells) == 3 * 2 * 6
    for c in cells:
        assert c["batch"] * c["seqlen_q"] == 16384 and c["heads_q"] * c["head_dim"] == 2048
        assert c == grids.paper_cell(c["head_dim"], c["causal"], c["seqlen_q"])
    assert {c["dtype"] for c in bw.backward_cells(dtype="fp16")} == {"fp16"}


def test_backward_flops():
    assert bw.backward_flops(1, 1, 2, 2, 64, False) == 2.5 * 4 * 2 * 2 * 64
    assert bw.backward_flops(8, 16, 2048, 2048, 128, True) == bw.backward_flops(8, 16, 2048, 2048, 128, False) / 2
    assert bw.backward_flops(1, 1, 2, 2, 64, False, "fwd-bwd") == 3.5 * 4 * 2 * 2 * 64
    c = grids.cell(128, False, 2048, 8, 16)
    assert bw.cell_tflops(c, 1.0) == pytest.approx(2.5 * 4 * 8 * 16 * 2048 * 2048 * 128 / 1e-3 / 1e12)
    assert bw.cell_tflops(c, None) is None


def _row(d, causal, s, **tflops):
    return dict(grids.paper_cell(d, causal, s), results={k: {"tflops": v} for k, v in tflops.items()})


def test_markdown_table_ratios_and_geomean():
    rows = [_row(128, False, 2048, facodegen=300.0, cudnn=400.0, fa2=200.0), _row(128, True, 4096, facodegen=200.0,
                                                                                cudnn=100.0)]
    table = bw.backward_table(rows)
    assert table.splitlines()[0] == "| head_dim | causal | seqlen | facodegen | cuDNN | FA2 (SDPA flash) | vs cuDNN | vs FA2 |"
    assert "| 128 | no | 2048 | 300.0 | 400.0 | 200.0 | 0.75x | 1.50x |" in table
    assert "| 128 | yes | 4096 | 200.0 | 100.0 | – | 2.00x | – |" in table
    assert table.splitlines()[-1] == "| geomean | | | | | | 1.22x | 1.50x |"
    assert bw.backward_table(rows, ("cudnn",)).splitlines()[-1] == "| geomean | | | | | 1.22x |"


def test_variants_table_and_knobs():
    knobs = bw.parse_knobs("k_unroll=1,block_n=64")
    assert knobs == {"k_unroll": 1, "block_n": 64}
    label = bw.variant_label(knobs)
    assert label == "facodegen[block_n=64,k_unroll=1]"
    rows = [_row(64, True, 512, facodegen=100.0, **{label: 120.0})]
    assert "| 64 | yes | 512 | 100.0 | 120.0 |" in bw.variants_table(rows, [label])
    assert "facodegen (autograd)" in bw.full_table(rows, variants=[knobs])
    with pytest.raises(ValueError, match="knob=value"):
        bw.parse_knobs("k_unroll")
    # Each value typed by its knob: a bool knob given as text was passed on as the string 'True'.
    assert bw.parse_knobs("deterministic=True") == {"deterministic": True}
    assert bw.parse_knobs("deterministic=0") == {"deterministic": False}
    with pytest.raises(ValueError, match="deterministic='maybe'"):
        bw.parse_knobs("deterministic=maybe")
    with pytest.raises(ValueError, match="block_n='wide'"):
        bw.parse_knobs("block_n=wide")
    with pytest.raises(ValueError, match="'blockn' is not a knob of the backward"):
        bw.parse_knobs("blockn=64")
    assert bw.peer_names(["flash", "cudnn"]) == ("fa2", "cudnn")
    with pytest.raises(ValueError, match="fa9"):
        bw.peer_names(["fa9"])


def test_run_backward_times_each_one_after_the_other_and_notes_failures(monkeypatch, tmp_path):
    calls = []

    def fake_time_backward(name, c, warmup, iters, mode):
        calls.append((name, c["seqlen_q"], warmup, iters, mode))
        if name == "fa2":
            raise RuntimeError("no flash backward here")
        return {"ms": 2.0, "min_ms": 1.9, "max_ms": 2.1, "host_ms": 0.1}

    def fake_time_direct(c, knobs, warmup, iters):
        calls.append((bw.variant_label(knobs), c["seqlen_q"], warmup, iters, "direct"))
        return {"ms": 1.0, "min_ms": 1.0, "max_ms": 1.0, "host_ms": 0.1}

    monkeypatch.setattr(bw, "time_backward", fake_time_backward)
    monkeypatch.setattr(bw, "time_direct", fake_time_direct)
    cells = bw.backward_cells((128,), (2048,), (False,))
    rows = bw.run_backward(cells, variants=[{"k_unroll": 2}], log=lambda m: None)
    assert calls == [("facodegen", 2048, 3, 10, "backward"), ("cudnn", 2048, 3, 10, "backward"),
                     ("fa2", 2048, 3, 10, "backward"), ("facodegen[k_unroll=2]", 2048, 3, 10, "direct")]
    r = rows[0]["results"]
    assert r["facodegen"]["tflops"] == pytest.approx(bw.cell_tflops(cells[0], 2.0))
    assert r["fa2"]["tflops"] is None and r["fa2"]["note"] == "failed: RuntimeError: no flash backward here"
    assert rows[0]["flops"] == 2.5 * grids.attention_flops(8, 16, 2048, 2048, 128, False)
    with pytest.raises(ValueError, match="backward mode only"):
        bw.run_backward(cells, variants=[{"k_unroll": 2}], mode="fwd-bwd")
    calls.clear()
    rows = bw.run_backward(cells, ("cudnn",), facodegen=False, mode="fwd-bwd", warmup=1, iters=4, log=lambda m: None)
    assert calls == [("cudnn", 2048, 1, 4, "fwd-bwd")] and rows[0]["mode"] == "fwd-bwd"
    assert rows[0]["results"]["cudnn"]["tflops"] == pytest.approx(3.5 / 2.5 * bw.cell_tflops(cells[0], 2.0))
    paths = bw.write_backward_results(rows, tmp_path, bw.result_stem("fwd-bwd"), env={"gpu": "fake"}, plot=False,
                                      peers=("cudnn",))
    assert paths["md"].name == "bench-fa3-paper-fwd-bwd-bf16.md" and "FLOPs = 3.5 x" in paths["md"].read_text()
    assert json.loads(paths["json"].read_text())["rows"][0]["mode"] == "fwd-bwd"
    assert "cudnn" in paths["csv"].read_text()


def test_script_options(script):
    args = script.parse_args(["--head-dims", "64,128", "--seqlens", "1024", "--causal", "yes", "--peers",
                              "facodegen,cudnn"])
    assert args.head_dims == (64, 128) and args.seqlens == (1024,) and args.causals == (True,)
    assert args.peers == ("facodegen", "cudnn") and (args.warmup, args.iters) == (bw.WARMUP, bw.ITERS) == (3, 10)
    assert script.parse_args(["--quick"]).seqlens == (2048, 8192)
    with pytest.raises(SystemExit):
        script.parse_args(["--peers", "fa9"])
    args = script.parse_args(["--variant", "k_unroll=1,block_n=64", "--variant", "k_unroll=2"])
    assert args.variant == [{"k_unroll": 1, "block_n": 64}, {"k_unroll": 2}]
    with pytest.raises(SystemExit):
        script.parse_args(["--variant", "k_unroll"])
    with pytest.raises(SystemExit):
        script.parse_args(["--fwd-bwd", "--variant", "k_unroll=1"])


def test_script_hands_its_options_to_the_package(script, monkeypatch, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from facodegen.bench import results
    seen = {}

    def fake_run(cells, peers, facodegen=True, variants=(), mode="backward", warmup=3, iters=10, log=print):
        seen.update(cells=cells, peers=peers, facodegen=facodegen, variants=variants, mode=mode, warmup=warmup,
                    iters=iters)
        return [dict(c, flops=1.0, mode=mode, results={"cudnn": {"tflops": 1.0}}) for c in cells]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(results, "environment", lambda: {"gpu": "fake"})
    monkeypatch.setattr(bw, "run_backward", fake_run)
    assert script.main(["--quick", "--peers", "cudnn,flash", "--head-dims", "128", "--warmup", "2",
                        "--out", str(tmp_path), "--no-plot"]) == 0
    assert seen["peers"] == ("cudnn", "fa2") and seen["facodegen"] is False and (seen["warmup"], seen["iters"]) == (2, 10)
    assert [c["seqlen_q"] for c in seen["cells"]] == [2048, 8192, 2048, 8192]
    assert (tmp_path / "bench-fa3-paper-backward-bf16.json").exists()
    assert "| geomean |" in capsys.readouterr().out
