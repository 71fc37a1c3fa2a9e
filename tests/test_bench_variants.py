"""The variants suite without a GPU (facodegen.bench.variants_suite: the cells, visible-pair counts,
ideal speed-up, ratios, the table, the files) and scripts/bench_variants.py, its thin wrapper, which
imports without torch."""

import subprocess
import sys
from pathlib import Path

import pytest

from facodegen.bench import variants_suite as b

ROOT = Path(__file__).resolve().parents[1]


def test_imports_without_torch_and_documents_its_arguments():
    code = ("import sys; sys.modules['torch'] = None; import importlib.util as u; "
            f"s = u.spec_from_file_location('b', r'{ROOT / 'scripts' / 'bench_variants.py'}'); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(len(m.vs.cells()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "6"
    helped = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_variants.py"), "--help"],
                            capture_output=True, text=True, check=False)
    assert helped.returncode == 0 and "--out" in helped.stdout and "--seqlens" in helped.stdout


def test_cells_are_16k_tokens_of_16_heads_at_head_dim_128():
    cells = b.cells()
    assert [(c["variant"], c["seqlen"], c["batch"]) for c in cells] == [
        ("window", 4096, 4), ("softcap", 4096, 4), ("sinks", 4096, 4),
        ("window", 16384, 1), ("softcap", 16384, 1), ("sinks", 16384, 1)]
    assert all(c["heads"] == 16 and c["head_dim"] == 128 for c in cells)
    assert cells[0]["window_size"] == (4096, 0) and cells[1]["softcap"] == 50.0
    assert b.QUICK_TIMING == {"warmup": 2, "groups": 3, "calls": 5}


def test_fp8_cells_are_the_same_rows_in_e4m3():
    cells = b.fp8_cells()
    assert [(c["variant"], c["seqlen"], c["dtype"]) for c in cells] == [
        ("window", 16384, "fp8"), ("softcap", 16384, "fp8"), ("sinks", 16384, "fp8")]
    assert [b.label(c) for c in cells] == ["fp8 window", "fp8 softcap", "fp8 sinks"]
    assert all("dtype" not in c for c in b.cells())


def test_visible_pairs_and_the_ideal_speedup():
    assert b.visible_pairs(4, 4) == 16
    assert b.visible_pairs(4, 4, causal=True) == 10
    assert b.visible_pairs(4, 4, (1, 0)) == 7            # 1 + 2 + 2 + 2
    assert b.visible_pairs(3, 5, (0, 0)) == 3
    assert b.visible_pairs(5, 2, (-1, 0)) == 3           # rows 0..2 see nothing (bottom-right)
    s = 16384
    full = s * (s + 1) // 2
    window = sum(min(i, 4096) + 1 for i in range(s))
    assert b.ideal_window_speedup(s) == pytest.approx(full / window)
    assert b.ideal_window_speedup(s) == pytest.approx(2.29, abs=0.01)    # issue 40's ideal
    assert b.ideal_window_speedup(4096) == pytest.approx(1.0)


def test_ratios_table_and_files(tmp_path):
    row = dict(variant="window", seqlen=16384, batch=1,
               ms={"facodegen_window": 1.0, "facodegen_full_causal": 2.1, "fa3_window": 1.05}, notes=[])
    r = b.ratios(row)
    assert r["vs_fa3_window"] == pytest.approx(1.05) and r["vs_own_full_causal"] == pytest.approx(2.1)
    cap = dict(variant="softcap", seqlen=4096, batch=4, ms={"facodegen_plain": 2.0, "facodegen_softcap": 2.08},
               notes=["FlashAttention-3 skipped: x"])
    assert b.ratios(cap) == {"cost": pytest.approx(1.04)}
    table = b.format_table([row, cap])
    assert table.splitlines()[0].startswith("| variant | seqlen")
    assert "vs_own_full_causal 2.10x" in table and "cost 1.040" in table and "FlashAttention-3 skipped" in table
    paths = b.write_variants_results([row, cap], tmp_path, env={"gpu": "fake"})
    assert paths["md"].read_text() == table + "\n" and '"gpu": "fake"' in paths["json"].read_text()


def test_run_variants_measures_each_cell(monkeypatch):
    seen = []
    monkeypatch.setattr(b, "measure", lambda cell, quick=False: seen.append((cell["variant"], quick)) or
                        dict(cell, ms={"facodegen_plain": 1.0}))
    rows = b.run_variants(b.cells((4096,)), quick=True, log=lambda m: None)
    assert seen == [("window", True), ("softcap", True), ("sinks", True)] and len(rows) == 3


def test_head_dim_cells_their_labels_and_ratio():
    cells = b.head_dim_cells()
    assert len(cells) == len(b.HEAD_DIMS) * 2 * len(b.HEAD_DIM_SEQLENS) == 24
    assert {(c["head_dim"], c["head_dim_v"]) for c in cells} == {(80, 80), (96, 96), (112, 112), (192, 128)}
    assert all(c["batch"] * c["seqlen"] == 16384 and c["heads"] == 2048 // c["head_dim"] for c in cells)
    assert b.label(cells[0]) == "d80 full" and b.label(cells[-1]) == "d192/128 causal"
    row = dict(cells[-1], ms={"facodegen_head_dim": 2.0, "fa3_head_dim": 2.2}, notes=[])
    assert b.ratios(row) == {"vs_fa3": pytest.approx(1.1)}
    assert b.ratios(dict(row, ms={"facodegen_head_dim": 2.0})) == {}      # FA3 missing: no ratio
    assert "| d192/128 causal | 16384 | 1 | 2.000 |" in b.format_table([row])
