"""The varlen suite without a GPU (facodegen.bench.varlen_suite): the length draws (fixed by the seed,
within the bounds, summing to ~32k), cu_seqlens, the real-work FLOP count against a hand
computation, the cells, and the rows, table, notes and files with the inputs, the implementations
and the timing faked. The CLI wiring: tests/test_bench_suites_cli.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from facodegen.bench import varlen_suite as vl


# ------------------------------------------------------------------ lengths, cu_seqlens, FLOPs

def test_the_default_draw_is_fixed_by_the_seed():
    lengths = vl.draw_lengths()
    assert lengths == [7017, 3255, 6309, 7392, 3545, 431, 2221, 2598]
    assert lengths == vl.draw_lengths(32768, 100, 8192, 0)
    assert sum(lengths) == vl.TOTAL_TOKENS == 32768
    assert vl.draw_lengths(seed=1) != lengths


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("total, lo, hi", [(32768, 100, 8192), (1000, 100, 300), (5000, 100, 8192), (100, 100, 100)])
def test_draws_stay_in_bounds_and_sum_to_about_the_total(seed, total, lo, hi):
    lengths = vl.draw_lengths(total, lo, hi, seed)
    assert lengths and all(lo <= n <= hi for n in lengths)
    assert total - lo < sum(lengths) <= total
    assert vl.draw_lengths(total, lo, hi, seed) == lengths


def test_draw_refuses_impossible_bounds():
    for args in ((1000, 0, 10), (1000, 20, 10), (50, 100, 200)):
        with pytest.raises(ValueError, match="lengths"):
            vl.draw_lengths(*args)


def test_cu_seqlens_are_prefix_sums_from_zero():
    assert vl.cu_seqlens([3, 5, 0, 2]) == [0, 3, 8, 8, 10]
    lengths = vl.draw_lengths()
    cu = vl.cu_seqlens(lengths)
    assert cu[0] == 0 and cu[-1] == sum(lengths) and len(cu) == len(lengths) + 1
    assert [b - a for a, b in zip(cu, cu[1:])] == lengths
    with pytest.raises(ValueError):
        vl.cu_seqlens([3, -1])


def test_flops_count_only_the_real_work():
    # two sequences of 3 and 5 tokens, 2 heads, head_dim 4: 4 * h * d * (3*3 + 5*5)
    assert vl.varlen_flops([3, 5], [3, 5], 2, 4, False) == 4 * 2 * 4 * (9 + 25) == 1088
    assert vl.varlen_flops([3, 5], [3, 5], 2, 4, True) == 544
    assert vl.varlen_flops([2, 7], [6, 1], 1, 8, False) == 4 * 8 * (2 * 6 + 7 * 1)
    # padded: both sequences computed at 5 tokens
    assert vl.padded_flops([3, 5], 2, 4, False) == 4 * 2 * 2 * 25 * 4
    c = vl.cell(vl.draw_lengths(), 128, True, "mixed")
    assert c["heads"] == 16 and c["flops"] == 2 * 16 * 128 * sum(n * n for n in c["lengths"])
    assert c["padded_flops"] == 2 * 16 * 128 * 8 * 7392 ** 2
    assert vl.tflops(c["flops"], 1.0) == pytest.approx(c["flops"] / 1e9)


def test_cells_and_input_sets():
    full = vl.cells()
    assert len(full) == 8 and {(c["head_dim"], c["heads"]) for c in full} == {(64, 32), (128, 16)}
    assert [c["cell"] for c in full[:2]] == ["mixed", "equal 8x4096"]
    assert all(c["dtype"] == "bf16" for c in full)
    equal = full[1]
    assert equal["lengths"] == [4096] * 8 and equal["flops"] == equal["padded_flops"]
    assert full[0]["tokens"] == 32768 and full[0]["max_seqlen"] == 7392
    quick = vl.cells(quick=True)
    assert len(quick) == 4 and {c["head_dim"] for c in quick} == {128}
    assert [(c["head_dim"], c["causal"]) for c in vl.cells(head_dim=64, causal=True)] == [(64, True)] * 2
    assert vl.cells(quick=True, head_dim=64) == []
    # 32k tokens x 2048 hidden x 4 tensors x 2 bytes = 512 MiB: over twice the L2, one set
    assert vl.varlen_bytes(full[0]) == 512 << 20 and vl.input_sets(full[0]) == 1
    small = vl.cell([256, 256], 64, False, "small")
    assert vl.input_sets(small) == vl.input_sets_needed(vl.varlen_bytes(small)) == 8


def test_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; from facodegen.bench import varlen_suite as v; "
            "print(len(v.cells()), sum(v.draw_lengths()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["8", "32768"]


# ------------------------------------------------------------------ rows, table, files (faked GPU)

@pytest.fixture
def fake_gpu(monkeypatch):
    """_inputs, _impls and the timing faked: facodegen varlen 2.0 ms, FA3 varlen 1.9 ms, padded sm80
    2.05 ms (on the equal cell; 4 ms on the mixed one), padded sm90 1.5 ms, cuDNN padded raising,
    and a failing check where asked."""
    seen = {"timed": [], "contexts": []}
    ms = {vl.FACODEGEN_VARLEN: 2.0, vl.FA3_VARLEN: 1.9, vl.PADDED_SM80: 2.05, vl.PADDED_SM90: 1.5}

    def fake_impls(c, sets, peers=vl.VARLEN_PEERS):
        impls = {}
        for name in ms:
            if name == vl.FA3_VARLEN and "fa3" not in peers:
                continue
            fn = (lambda name=name: name)
            fn.ms = ms[name] * (2 if name == vl.PADDED_SM80 and c["cell"] == "mixed" else 1)
            bad = c.get("fail") == name
            impls[name] = vl.Impl(fn, lambda bad=bad: (not bad, "FAIL: rel_fro=1" if bad else "ok", 0.5 if bad else 2e-3))
        if "cudnn" in peers:
            def refuse():
                raise RuntimeError("No available kernel")
            impls[vl.CUDNN_PADDED] = vl.Impl(lambda: None, refuse)
        return impls, ([] if "fa3" in peers else ["FA3 varlen skipped: test"])

    def fake_time(fns, contexts=None, **kwargs):
        seen["timed"].append(([f() for f in fns], kwargs))
        seen["contexts"].append(contexts)
        return [{"ms": f.ms, "host_ms": 0.01, "min_ms": f.ms, "max_ms": f.ms} for f in fns]

    monkeypatch.setattr(vl, "_inputs", lambda c: [{}])
    monkeypatch.setattr(vl, "_impls", fake_impls)
    monkeypatch.setattr(vl, "time_cuda_interleaved", fake_time)
    monkeypatch.setattr(vl, "_synchronize", lambda: None)
    monkeypatch.setattr(vl, "_release", lambda: None)
    return seen


def test_measure_times_what_passed_and_reports_the_rest(fake_gpu):
    mixed, equal = vl.cells(quick=True, causal=True)
    row = vl.measure(dict(equal, fail=vl.PADDED_SM90), quick=True)
    names, kwargs = fake_gpu["timed"][0]
    assert names == [vl.FACODEGEN_VARLEN, vl.FA3_VARLEN, vl.PADDED_SM80] and kwargs == vl.QUICK_TIMING
    res = row["results"]
    assert res[vl.FACODEGEN_VARLEN]["tflops"] == pytest.approx(equal["flops"] / 2.0e-3 / 1e12)
    assert res[vl.FACODEGEN_VARLEN]["err"] == 2e-3 and res[vl.FACODEGEN_VARLEN]["host_ms"] == 0.01
    assert "tflops" not in res[vl.PADDED_SM90] and "failed its check" in res[vl.PADDED_SM90]["note"]
    assert res[vl.CUDNN_PADDED] == {"note": "RuntimeError: No available kernel"}
    assert row["sets"] == 1 and row["notes"] == []
    vl.measure(mixed)
    assert fake_gpu["timed"][1][1] == {}          # the full timing without --quick


def test_table_notes_and_the_equal_lengths_verdict(fake_gpu):
    rows = vl.run_varlen(vl.cells(quick=True), log=lambda m: None)
    table = vl.format_table(rows)
    lines = table.splitlines()
    assert lines[0] == ("| cell | d | causal | seqs | tokens | max | real/padded | facodegen varlen | FA3 varlen | "
                        "facodegen padded (sm80) | facodegen padded (sm90) | cuDNN padded (SDPA) | varlen/FA3 | "
                        "varlen/padded | varlen/cuDNN |")
    mixed, equal = lines[2], lines[3]
    assert mixed.startswith("| mixed | 128 | no | 8 | 32768 | 7392 | 0.41 |")
    assert mixed.endswith("| fail | 0.95x | 2.05x | – |")   # cuDNN raised: "fail", no ratio
    assert equal.startswith("| equal 8x4096 | 128 | no | 8 | 32768 | 4096 | 1.00 |")
    assert equal.endswith("| 1.02x | – |")                   # 2.05 ms / 2.0 ms: against the sm80 padded kernel
    notes = vl.format_notes(rows)
    assert "cuDNN backend has no packed varlen" in notes and "count only the real" in notes
    assert "mixed lengths (seed 0, uniform in [100, 8192]): 7017, 3255, 6309, 7392, 3545, 431, 2221, 2598" in notes
    assert "equal 8x4096 d128 full: varlen / facodegen padded (sm80) = 1.025 (within 5%)" in notes
    assert "cudnn-padded: RuntimeError: No available kernel" in notes
    assert vl.summary(rows) == table + "\n\nNotes:\n" + notes


def test_the_verdict_says_when_varlen_is_more_than_5_percent_slower():
    row = dict(vl.cells(quick=True)[1], results={vl.FACODEGEN_VARLEN: {"tflops": 90.0},
                                                  vl.PADDED_SM90: {"tflops": 100.0}})
    assert vl.equal_verdict(row).endswith("facodegen padded (sm90) = 0.900 (NOT within 5%)")
    assert vl.equal_verdict(dict(row, cell="mixed")) is None
    assert vl.equal_verdict(dict(row, results={vl.FACODEGEN_VARLEN: {"tflops": 90.0}})) is None


@pytest.mark.parametrize("cell, column, verdict, name, text", [
    (1, "FACODEGEN_VARLEN_NP", "persistent_verdict", "varlen (not persistent)",
     "equal 8x4096 d128 full: varlen (not persistent) / facodegen padded (sm90) = 0.900, varlen / varlen (not "
     "persistent) = 1.067"),
    (2, "FACODEGEN_VARLEN_LPT", "lpt_verdict", "varlen (lpt)",
     "mixed d128 causal: varlen (lpt) / varlen = 0.938, varlen (lpt) / facodegen padded (sm90) = 0.900"),
])
def test_a_variant_column_verdict_holds_the_default_to_it_and_it_to_the_padded_kernel(cell, column, verdict, name,
                                                                                       text):
    """The persistent verdict (the one-CTA-per-tile kernel, equal lengths only) and the lpt verdict (causal
    tiles longest first) read their column beside the default and the padded kernel, in the table and notes."""
    row = dict(vl.cells(quick=True)[cell], results={vl.FACODEGEN_VARLEN: {"tflops": 96.0},
                                                     getattr(vl, column): {"tflops": 90.0},
                                                     vl.PADDED_SM90: {"tflops": 100.0}})
    judge = getattr(vl, verdict)
    assert judge(row) == text
    assert judge(dict(row, results={vl.FACODEGEN_VARLEN: {"tflops": 90.0}})) is None
    assert f"facodegen {name}" in vl.format_table([row]).splitlines()[0]
    assert text in vl.format_notes([row])
    if verdict == "persistent_verdict":
        assert judge(dict(row, cell="mixed")) is None      # (equal lengths only)


def test_peers_left_out_and_a_cell_that_raises(fake_gpu, monkeypatch):
    rows = vl.run_varlen(vl.cells(quick=True)[:1], peers=(), log=lambda m: None)
    assert set(rows[0]["results"]) == {vl.FACODEGEN_VARLEN, vl.PADDED_SM80, vl.PADDED_SM90}
    assert rows[0]["notes"] == ["FA3 varlen skipped: test"]
    assert "FA3 varlen" not in vl.format_table(rows).splitlines()[0]

    def boom(c):
        raise MemoryError("out of memory")
    monkeypatch.setattr(vl, "_inputs", boom)
    logged = []
    rows = vl.run_varlen(vl.cells(quick=True)[:2], log=logged.append)
    assert [r["notes"] for r in rows] == [["ERROR MemoryError: out of memory"]] * 2 and len(logged) == 2
    assert vl.format_table(rows).splitlines()[2].endswith("| – | – | – |")


def test_files(fake_gpu, tmp_path):
    rows = vl.run_varlen(vl.cells(quick=True), log=lambda m: None)
    paths = vl.write_varlen_results(rows, tmp_path / "out", env={"gpu": "fake"})
    assert paths["md"].read_text() == vl.summary(rows) + "\n"
    records = paths["csv"].read_text().splitlines()
    assert records[0] == ",".join(vl.CSV_FIELDS) and len(records) == 1 + 4 * 5
    assert records[1].startswith("mixed,bf16,128,False,16,8,32768,7392,") and ",facodegen-varlen," in records[1]
    data = json.loads(paths["json"].read_text())
    assert data["env"] == {"gpu": "fake"} and len(data["rows"]) == 4
    assert data["rows"][0]["lengths"] == vl.draw_lengths()
