"""Plot, table, CSV and JSON output of `facodegen bench --suite`, on synthetic results (no GPU)."""

from __future__ import annotations

import csv
import io
import json
import random

import pytest

from facodegen import bench
from facodegen.bench import plot


def synthetic_rows(suite: str = "fa3-paper", seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for c in bench.suite_cells(suite, "bf16"):
        row = dict(c, results={})
        base = 300 + c["head_dim"] + (c["seqlen_q"] // 256)
        row["results"]["facodegen-sm90"] = {"tflops": base * rng.uniform(0.8, 1.0), "ms": 1.0, "err": 2e-3,
                                            "variant": "flash_fwd_sm90_x"}
        row["results"]["fa3"] = {"tflops": base * rng.uniform(0.9, 1.1), "ms": 1.0, "err": 2e-3}
        row["results"]["cudnn"] = {"tflops": base * rng.uniform(0.7, 1.0), "ms": 1.0}
        row["results"]["fa2"] = {"tflops": None, "note": "check failed: rel_fro 1.0"}
        row["results"]["efficient"] = {"tflops": None, "note": "unavailable: no backend"}
        rows.append(row)
    return rows


def test_suite_cells():
    assert len(bench.suite_cells("fa3-paper")) == 36
    assert len(bench.suite_cells("fa3-paper", head_dim=128, causal=True)) == 6
    assert bench.suite_cells("quick") == bench.quick_grid()
    with pytest.raises(ValueError):
        bench.suite_cells("nope")


def test_csv_rows_and_ratio():
    rows = synthetic_rows()
    text = bench.to_csv(rows)
    records = list(csv.DictReader(io.StringIO(text)))
    assert len(records) == 36 * 5
    assert list(records[0]) == list(bench.CSV_FIELDS)
    ours = [r for r in records if r["impl"] == "facodegen-sm90"]
    r0 = rows[0]
    expect = r0["results"]["facodegen-sm90"]["tflops"] / max(r0["results"]["fa3"]["tflops"],
                                                              r0["results"]["cudnn"]["tflops"])
    assert float(ours[0]["ratio_to_best_peer"]) == pytest.approx(expect, rel=1e-5)
    assert all(r["ratio_to_best_peer"] == "" for r in records if r["impl"] != "facodegen-sm90")


def test_write_results(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    rows = synthetic_rows()
    env = {"gpu": "NVIDIA H200", "date": "2026-11-30", "commit": "abc1234"}
    paths = bench.write_results(rows, tmp_path / "out", "bench-fa3-paper-bf16", env=env, title="Attention forward")
    assert paths["plot_error"] is None
    for k in ("md", "csv", "json", "png"):
        assert paths[k].exists() and paths[k].stat().st_size > 0
    data = json.loads(paths["json"].read_text())
    assert data["env"]["commit"] == "abc1234" and len(data["rows"]) == 36
    assert "| facodegen-sm90 |" in paths["md"].read_text().splitlines()[0].replace("|", "| ", 1) or \
        "facodegen-sm90" in paths["md"].read_text()
    img = imread(paths["png"])
    h, w = img.shape[:2]
    assert w > 1000 and h > 500          # 3 head dims x 2 masks of panels
    assert img.std() > 0.01              # not a blank image


def test_plot_single_panel_and_failed_bars(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    rows = synthetic_rows("quick")[:1]
    rows[0]["results"]["facodegen-sm80"] = {"tflops": None, "note": "failed: RuntimeError"}
    path = plot.plot_rows(rows, tmp_path / "one.png")
    img = imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 300
    assert plot.implementations(rows)[-2:] == ["facodegen-sm90", "facodegen-sm80"]
    with pytest.raises(ValueError):
        plot.plot_rows([], tmp_path / "none.png")


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(plot.PlotUnavailable, match=r"facodegen\[plot\]"):
        plot.plot_rows(synthetic_rows("quick"), tmp_path / "x.png")
    paths = bench.write_results(synthetic_rows("quick"), tmp_path, "q")
    assert paths["png"] is None and "facodegen[plot]" in paths["plot_error"] and paths["csv"].exists()


def test_cli_replot(tmp_path):
    pytest.importorskip("matplotlib")
    from click.testing import CliRunner

    from facodegen import cli

    src = tmp_path / "dev"
    bench.write_results(synthetic_rows("quick"), src, "bench-quick-bf16", env={"gpu": "H200"}, plot=False)
    out = tmp_path / "here"
    result = CliRunner().invoke(cli.main, ["bench", "--replot", str(src / "bench-quick-bf16.json"), "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (out / "bench-quick-bf16.png").stat().st_size > 0 and "facodegen-sm90" in result.output


def test_families_get_their_own_panels(tmp_path):
    pytest.importorskip("matplotlib")
    from facodegen import bench
    from facodegen.bench import plot
    rows = [dict(c, results={"facodegen FA1": {"tflops": 10.0 + i}, "fa2": {"tflops": 300.0}})
            for i, c in enumerate(bench.evolution_grid())]
    assert [k[2] for k in plot.panels(rows)] == ["16k tokens per batch", "batch 1"]
    path = plot.plot_rows(rows, tmp_path / "evo.png", title="evolution")
    assert path.stat().st_size > 10_000
