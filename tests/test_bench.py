"""CPU tests of facodegen.bench: FLOP counting, grids, ratios and the table (no GPU, no torch)."""

import subprocess
import sys
from pathlib import Path

import pytest

from facodegen import bench
from facodegen.bench import overhead, results, runner, timing, variants
from facodegen.bench import (attention_flops, best_peer, fa3_paper_grid, format_notes, format_table,
                             input_bytes, input_sets_needed, make_grid, quick_grid, ratio_to_best_peer,
                             sm80_grid, tflops)

ROOT = Path(__file__).resolve().parents[1]


def test_attention_flops():
    # 4 * b * h * sq * sk * d
    assert attention_flops(1, 1, 1, 1, 1, False) == 4
    assert attention_flops(2, 16, 4096, 4096, 128, False) == 4 * 2 * 16 * 4096 * 4096 * 128
    assert attention_flops(2, 16, 4096, 4096, 128, True) == 2 * 2 * 16 * 4096 * 4096 * 128
    assert attention_flops(1, 2, 100, 300, 64, False) == 4 * 2 * 100 * 300 * 64
    # FA3 grid: every cell has the same non-causal FLOPs per seqlen-squared... and 16k tokens
    flops = attention_flops(4, 16, 4096, 4096, 128, False)
    assert tflops(flops, 1.0) == pytest.approx(flops / 1e-3 / 1e12)
    assert tflops(1e12, 1000.0) == pytest.approx(1.0)


def test_fa3_paper_grid():
    grid = fa3_paper_grid("bf16")
    assert len(grid) == 36
    assert len({(c["head_dim"], c["causal"], c["seqlen_q"]) for c in grid}) == 36
    for c in grid:
        assert c["batch"] * c["seqlen_q"] == 16384
        assert c["heads_q"] * c["head_dim"] == 2048
        assert c["heads_kv"] == c["heads_q"] and c["seqlen_k"] == c["seqlen_q"]
        assert c["dtype"] == "bf16"
        # Q alone is 64 MB: larger than the H200's 60 MB L2, so one input set suffices.
        assert input_bytes(c) == 4 * 16384 * 2048 * 2
        assert input_sets_needed(input_bytes(c), 60 * 2 ** 20) == 1
    cells = {(c["head_dim"], c["seqlen_q"]): c for c in grid if not c["causal"]}
    assert (cells[(64, 512)]["batch"], cells[(64, 512)]["heads_q"]) == (32, 32)
    assert (cells[(128, 16384)]["batch"], cells[(128, 16384)]["heads_q"]) == (1, 16)
    assert (cells[(256, 2048)]["batch"], cells[(256, 2048)]["heads_q"]) == (8, 8)
    assert {c["seqlen_q"] for c in grid} == {512, 1024, 2048, 4096, 8192, 16384}
    assert fa3_paper_grid("fp16")[0]["dtype"] == "fp16"


def test_other_grids():
    fa3 = {(c["head_dim"], c["causal"], c["seqlen_q"]) for c in fa3_paper_grid()}
    quick = quick_grid()
    assert 3 <= len(quick) <= 8
    assert all((c["head_dim"], c["causal"], c["seqlen_q"]) in fa3 for c in quick)
    assert {c["head_dim"] for c in quick} == {64, 128, 256} and {c["causal"] for c in quick} == {False, True}
    s80 = sm80_grid()
    assert {c["head_dim"] for c in s80} == {64, 96, 128, 192, 256} and len(s80) == 20
    assert make_grid("fa3") == fa3_paper_grid()
    with pytest.raises(ValueError, match="grid"):
        make_grid("nope")


def test_input_sets_needed():
    assert input_sets_needed(10 * 2 ** 20, 60 * 2 ** 20) == 8      # capped
    assert input_sets_needed(40 * 2 ** 20, 60 * 2 ** 20) == 3      # 120 MB >= 2 x L2
    assert input_sets_needed(200 * 2 ** 20, 60 * 2 ** 20) == 1


def _row(results, **cell):
    base = bench.cell(128, False, 4096, 4, 16, "bf16")
    base.update(cell)
    base["results"] = results
    return base


def test_best_peer_and_ratio():
    row = _row({
        "facodegen-sm90": {"tflops": 600.0},
        "fa3": {"tflops": 650.0},
        "cudnn": {"tflops": 590.0},
        "fa2": {"tflops": None, "note": "check failed: rel_fro=1"},
    })
    assert best_peer(row) == ("fa3", 650.0)
    assert ratio_to_best_peer(row, "facodegen-sm90") == pytest.approx(600 / 650)
    no_peer = _row({"facodegen-sm90": {"tflops": 600.0}, "fa3": {"tflops": None, "note": "unavailable: x"}})
    assert best_peer(no_peer) == (None, None)
    assert ratio_to_best_peer(no_peer, "facodegen-sm90") is None
    failed = _row({"facodegen-sm90": {"tflops": None, "note": "failed"}, "fa3": {"tflops": 650.0}})
    assert ratio_to_best_peer(failed, "facodegen-sm90") is None


def test_format_table():
    rows = [
        _row({"facodegen-sm90": {"tflops": 612.34}, "facodegen-sm80": {"tflops": 300.0},
              "fa3": {"tflops": 650.0}, "cudnn": {"tflops": 590.0},
              "fa2": {"tflops": None, "note": "check failed: rel_fro=1.0"}}),
        _row({"facodegen-sm90": {"tflops": None, "note": "failed: RuntimeError: boom"},
              "facodegen-sm80": {"tflops": 280.0},
              "fa3": {"tflops": None, "note": "unavailable: no module"}, "cudnn": {"tflops": 400.0},
              "fa2": {"tflops": 300.0}}, causal=True, seqlen_q=8192, seqlen_k=8192, batch=2),
        _row({"facodegen-sm90": {"tflops": None, "note": "skipped: time budget spent"}},
             head_dim=64, seqlen_q=100, seqlen_k=300, heads_kv=4),
    ]
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    assert header[:6] == ["dtype", "head_dim", "causal", "seqlen", "batch", "heads"]
    assert header[6:8] == ["facodegen-sm90", "facodegen-sm80"]           # ours first
    assert "FlashAttention-3" in header and "cuDNN (SDPA)" in header
    assert header[-3:] == ["best peer", "sm90/best", "sm80/best"]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    assert first[:6] == ["bf16", "128", "no", "4096", "4", "16"]
    assert first[6] == "612.3" and first[7] == "300.0"
    assert first[header.index("FlashAttention-2 (SDPA)")] == "fail"
    assert first[-3] == "FlashAttention-3"
    assert first[-2] == f"{612.34 / 650:.2f}" and first[-1] == f"{300 / 650:.2f}"
    second = [c.strip() for c in lines[3].strip("|").split("|")]
    assert second[2] == "yes" and second[6] == "fail"
    assert second[header.index("FlashAttention-3")] == "–"                 # unavailable, not a failure
    assert second[-3] == "cuDNN (SDPA)" and second[-2] == "–" and second[-1] == f"{280 / 400:.2f}"
    third = [c.strip() for c in lines[4].strip("|").split("|")]
    assert third[3] == "100/300" and third[5] == "16/4" and third[6] == "–"
    notes = format_notes(rows)
    assert "boom" in notes and "unavailable: no module" in notes and "time budget" in notes


def test_run_cli_bench_accepts_spec_or_dict(monkeypatch):
    """run_cli_bench turns a KernelSpec into arch/shape + overrides and formats one row."""
    from facodegen.spec import KernelSpec
    seen = {}

    def fake_run_cell(c, archs, peers, overrides, *a, **k):
        seen.update(cell=c, archs=archs, peers=peers, overrides=overrides)
        return dict(c, flops=0, results={f"facodegen-{archs[0]}": {"tflops": 500.0}, "fa3": {"tflops": 600.0}})

    monkeypatch.setattr(runner, "run_cell", fake_run_cell)
    spec = KernelSpec(arch="sm90", head_dim=128, dtype="bf16", causal=True, block_n=128)
    text = bench.run_cli_bench(spec, seqlen=8192, batch=2, heads=16)
    assert seen["archs"] == ("sm90",) and seen["cell"]["causal"] is True and seen["cell"]["seqlen_q"] == 8192
    assert seen["overrides"]["block_n"] == 128 and "arch" not in seen["overrides"]
    assert "500.0" in text and "0.83" in text
    bench.run_cli_bench({"stages": 1}, arch="sm80", head_dim=64, dtype="fp16", causal=False, seqlen=1024,
                        batch=1, heads=4)
    assert seen["archs"] == ("sm80",) and seen["overrides"] == {"stages": 1} and seen["cell"]["dtype"] == "fp16"


def test_split_overrides():
    assert variants._split_overrides(None, "sm90") == {}
    assert variants._split_overrides({"stages": 1}, "sm80") == {"stages": 1}
    per_arch = {"sm80": {"block_n": 32}, "sm90": {"pingpong": False}}
    assert variants._split_overrides(per_arch, "sm90") == {"pingpong": False}


def test_device_run_script_plans_without_a_gpu():
    """scripts/device_run.py parses its options and prints its plan with --dry-run (no torch)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_run.py"), "--dry-run",
                           "--suite", "full", "--out", "/tmp/facodegen-dry-run"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pytest" in done.stdout and "fa3" in done.stdout


def test_peer_names_are_known_and_flex_is_opt_in():
    from facodegen import bench
    assert "flex" in bench.PEER_TITLES and "flex" not in bench.DEFAULT_PEERS
    assert "flex" not in bench.SUITE_PEERS
    ok, note = bench.peer_available("nosuch")
    assert not ok and "unknown peer" in note


def test_parse_variant_types_each_field():
    from facodegen import bench
    assert bench.parse_variant("sm90:") == ("sm90", {})
    arch, fields = bench.parse_variant("sm80:schedule=fa1,loop_order=q_outer,block_n=64,q_in_regs=1")
    assert arch == "sm80"
    assert fields == {"schedule": "fa1", "loop_order": "q_outer", "block_n": 64, "q_in_regs": True}
    assert bench.parse_variant("sm90:pingpong=0")[1] == {"pingpong": False}
    assert bench.parse_variant("sm90:dtype=fp8,v_layout=transposed,out_dtype=fp16")[1] == \
        {"dtype": "fp8", "v_layout": "transposed", "out_dtype": "fp16"}
    with pytest.raises(ValueError, match="'blockm' is not a KernelSpec field"):
        bench.parse_variant("sm90:blockm=64")


def test_evolution_suite_has_one_column_per_switch_and_gemm_fractions():
    from facodegen import bench
    cells = bench.evolution_grid()
    assert {c["family"] for c in cells} == {"16k tokens per batch", "batch 1"} and len(cells) == 12
    names = list(bench.EVOLUTION_VARIANTS)
    assert all(bench.is_facodegen(n) for n in names) and len(names) == 8
    assert bench.parse_variant(bench.EVOLUTION_VARIANTS[names[-1]]) == ("sm90", {"dtype": "fp8"})
    row = dict(cells[0], gemm_tflops=800.0,
               results={names[0]: {"tflops": 40.0}, names[-1]: {"tflops": 600.0}, "fa3": {"tflops": 640.0}})
    table = bench.format_table([row])
    assert "40.0 (5%)" in table and "600.0 (75%)" in table and "0.94" in table


def test_fp8_grid_is_issue_6s_and_counts_one_byte_inputs():
    from facodegen import bench
    cells = bench.suite_cells("fp8")
    assert len(cells) == 18 and {c["dtype"] for c in cells} == {"fp8"}
    assert {(c["head_dim"], c["seqlen_q"]) for c in cells} == {(d, s) for d in (64, 128, 256) for s in (2048, 8192, 16384)}
    assert all(c["batch"] * c["seqlen_q"] == 16384 and c["heads_q"] * c["head_dim"] == 2048 for c in cells)
    bf16 = bench.cell(128, False, 4096, 4, 16, "bf16")
    fp8 = bench.cell(128, False, 4096, 4, 16, "fp8")
    elems = 4 * 4096 * 16 * 128
    assert bench.input_bytes(bf16) == 4 * 2 * elems             # q, k, v, o in 2 bytes
    assert bench.input_bytes(fp8) == 3 * elems + 2 * elems      # q, k, v in 1 byte, o in bf16
    assert bench.suite_cells("fa3-paper", "fp8")[0]["dtype"] == "fp8"


def _script(name: str):
    """scripts/lab/<name>.py (a lab probe) or scripts/<name>.py as a module (neither is a package)."""
    import importlib.util
    path = ROOT / "scripts" / "lab" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path if path.exists() else ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ncu_compare_summarizes_two_kernels_side_by_side():
    """scripts/lab.py ncu-compare's table: per kernel (launch order) the key metrics and stall ratios of
    an ncu text report, whatever the unit column holds."""
    ncu = _script("ncu_compare")
    report = """==PROF== Connected
  flash_fwd_sm90_bf16_hd128 (132, 1, 1)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         ms         1.57
    Executed Instructions          inst  514,748,164
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio        0.94
  void cutlass::device_kernel<flash::X<(int)1>>(T1::Params) (132, 1, 1)x(384, 1, 1), Context 1, Stream 7
    Duration                         ms         1.48
    Executed Instructions          inst  470,777,099
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio        0.55
"""
    table = ncu.summarize(report).splitlines()
    assert table[0].startswith("| metric | flash_fwd_sm90_bf16_hd128 | void cutlass::device_kernel")
    assert "| Duration | 1.57 ms | 1.48 ms |" in table
    assert "| Executed Instructions | 514,748,164 inst | 470,777,099 inst |" in table
    assert any(row.startswith("| smsp__average_warps_issue_stalled_barrier") and "0.94" in row for row in table)
    assert ncu.summarize(report.split("  void")[0]) == "fewer than two kernels in the report"


def test_ncu_compare_backward_compares_the_two_longest_kernels():
    """--backward: each side launches several kernels (ours: preprocess, main, dQ conversion), so the
    table takes the two longest, in launch order, whatever unit ncu gave each Duration."""
    ncu = _script("ncu_compare")
    kernel = "  {} (10, 1, 1)x(384, 1, 1), Context 1, Stream 7\n    Duration    {}    {}\n"
    report = "".join(kernel.format(*k) for k in [("flash_bwd_dot_do_o", "us", "21.50"), ("flash_bwd_main", "ms", "1.20"),
                                                  ("flash_bwd_convert_dq", "us", "30.00"),
                                                  ("cudnn_bprop_main", "usecond", "1,010.00"),
                                                  ("cudnn_convert", "ns", "9,000")])
    table = ncu.summarize(report, longest=True).splitlines()
    assert table[0] == "| metric | flash_bwd_main | cudnn_bprop_main |"
    assert "| Duration | 1.20 ms | 1,010.00 usecond |" in table
    assert ncu.summarize(report).splitlines()[0] == "| metric | flash_bwd_dot_do_o | cudnn_convert |"


def test_ncu_source_summarizes_stalls_and_bank_conflicts():
    """scripts/lab.py ncu-source: samples per stall reason, the instructions with the most samples and
    their main reason, and the instructions with more shared-memory wavefronts than ideal."""
    ncu = _script("ncu_source")
    head = ('"Address","Source","# Samples","Instructions Executed","L1 Wavefronts Shared",'
            '"L1 Wavefronts Shared Ideal","stall_barrier","stall_wait","stall_barrier (Not Issued)"')
    report = "\n".join([
        '==PROF== Connected to process 1', '"Kernel Name","flash_fwd_sm90_fp8_hd256",', head,
        '"0x7f0000000000","      LDC R1, c[0x0][0x28]","2","132","0","0","0","2","0"',
        '"0x7f0000000010","      WARPGROUP.DEPBAR.LE gsb0, 0x1","90","1000","0","0","80","10","80"',
        '"0x7f0000000020","      STSM.16.M88.4 [R28], R8","8","500","1,000","500","0","8","0"'])
    text = ncu.summarize(report, top=2)
    lines = text.splitlines()
    assert lines[0] == "flash_fwd_sm90_fp8_hd256: 100 samples over 3 instructions"
    assert "| barrier | 80 | 80.0% |" in lines and "| wait | 20 | 20.0% |" in lines
    assert "| 0x0010 | 90 | 1000 | barrier | `WARPGROUP.DEPBAR.LE gsb0, 0x1` |" in lines
    assert not any("LDC" in line for line in lines)                      # only the top 2
    assert "shared-memory wavefronts: 1000 (ideal 500, excess 500)" in lines
    assert lines[-1] == "  0x0020 1000 vs ideal 500: `STSM.16.M88.4 [R28], R8`"


class _FakeEvent:
    """torch.cuda.Event on a fake clock: each fake kernel advances _FakeEvent.clock by its ms."""
    clock = 0.0

    def __init__(self, enable_timing):
        self.t = None

    def record(self):
        self.t = _FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t


def _fake_torch_with_events(monkeypatch):
    import types
    _FakeEvent.clock = 0.0
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=_FakeEvent, synchronize=lambda: None))
    for module in (timing, runner):           # the events are timing's, the synchronize after a cell runner's
        monkeypatch.setattr(module, "_torch", lambda: fake)


def test_time_cuda_interleaved_takes_turns_and_records_spans(monkeypatch):
    """Groups run A B A B (after each callable's warm-up), and spans receive every group of each
    callable as (wall start, wall end, ms per call) with the ms the medians are taken over."""
    order = []

    def make(name, ms):
        def fn():
            order.append(name)
            _FakeEvent.clock += ms
        return fn
    _fake_torch_with_events(monkeypatch)
    spans = [[], []]
    out = bench.time_cuda_interleaved([make("a", 1.0), make("b", 2.0)], warmup=1, groups=3, calls=2, spans=spans)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert [r["ms"] for r in out] == [1.0, 2.0]
    assert [len(s) for s in spans] == [3, 3] and all(ms == 2.0 and t1 >= t0 for t0, t1, ms in spans[1])


def test_run_cell_checks_everyone_then_times_peers_in_turns_inside_their_context(monkeypatch):
    """facodegen and the peers are built and checked first, then take turns group by group; an
    SDPA peer's calls (check, warm-up, every group) run inside its backend context and nobody
    else's do; an unavailable peer keeps its place in the row with the reason."""
    import contextlib
    trace = []
    inside = {"cudnn": False}

    def impl(name, ms):
        def fn():
            trace.append((name, inside["cudnn"]))
            _FakeEvent.clock += ms
        return fn

    @contextlib.contextmanager
    def cudnn_backend():
        inside["cudnn"] = True
        yield
        inside["cudnn"] = False

    _fake_torch_with_events(monkeypatch)
    monkeypatch.setattr(runner, "_make_inputs", lambda c, n: [object()])
    monkeypatch.setattr(runner, "l2_bytes", lambda: bench.L2_BYTES_DEFAULT)
    monkeypatch.setattr(runner, "_slice_check", lambda o, s, causal, dtype: (True, "", 1e-3))
    monkeypatch.setattr(runner, "peer_available", lambda name: (name != "fa2", "no such backend here"))
    monkeypatch.setattr(variants, "_facodegen_call_fn",
                        lambda arch, o, s, causal: (impl("ours", 1.0), contextlib.nullcontext, "v", s))
    monkeypatch.setattr(variants, "_facodegen_fn",
                        lambda arch, o, s, causal: (impl("prepared", 0.5), contextlib.nullcontext, "v", s))
    monkeypatch.setattr(runner, "_peer_fn", lambda name, s, causal:
                        (impl(name, {"fa3": 2.0, "cudnn": 4.0}[name]),
                         cudnn_backend if name == "cudnn" else contextlib.nullcontext))
    c = bench.cell(64, False, 1024, 1, 2, "bf16")
    row = bench.run_cell(c, peers=("cudnn", "fa2", "fa3"), timing={"warmup": 1, "groups": 2, "calls": 2},
                         log=lambda m: None)
    ours = bench.facodegen_name("sm90")
    assert list(row["results"]) == [ours, bench.prepared_name(ours), "cudnn", "fa2", "fa3"]
    assert [r["ms"] for n, r in row["results"].items() if n != "fa2"] == [1.0, 0.5, 4.0, 2.0]
    assert row["results"]["fa2"]["note"].startswith("unavailable") and row["results"]["fa2"]["tflops"] is None
    checks, warmups, groups = trace[:4], trace[4:8], trace[8:]
    assert [n for n, _ in checks] == [n for n, _ in warmups] == ["ours", "prepared", "cudnn", "fa3"]
    assert [n for n, _ in groups] == ["ours", "ours", "prepared", "prepared", "cudnn", "cudnn", "fa3", "fa3"] * 2
    assert all(in_ctx == (n == "cudnn") for n, in_ctx in trace)
    # the ratio is the public call's; the prepared launcher stands beside it without one
    table = bench.format_table([row]).splitlines()
    assert table[0].endswith("| best peer | sm90/best |") and "facodegen-sm90 (prepared)" in table[0]
    assert table[2].endswith(f"| FlashAttention-3 | {row['results'][ours]['tflops'] / row['results']['fa3']['tflops']:.2f} |")
    one_by_one = []
    monkeypatch.setattr(runner, "time_cuda", lambda fn, **kw: (one_by_one.append(fn), fn(),
                                                            {"ms": 3.0, "min_ms": 3.0, "max_ms": 3.0,
                                                             "host_ms": 0.1})[-1])
    row = bench.run_cell(c, peers=("fa3",), timing={"interleave": False}, log=lambda m: None)
    assert len(one_by_one) == 3 and row["results"]["fa3"]["ms"] == 3.0
    one_by_one.clear()
    row = bench.run_cell(c, peers=("fa3",), timing={"interleave": False}, log=lambda m: None, prepared=False)
    assert len(one_by_one) == 2 and list(row["results"]) == [ours, "fa3"]


def test_clock_probe_reads_nvidia_smi_and_groups_times_by_clock(tmp_path):
    """scripts/lab.py clock-probe: nvidia-smi's csv lines as (time, MHz, W, reasons), and each group's time
    filed under the SM clock sampled while it ran, with the quartiles over all groups."""
    probe = _script("clock_probe")
    smi = tmp_path / "smi.csv"
    smi.write_text("2026/12/01 08:52:03.100, 1980 MHz, 612.34 W, 0x0000000000000000\n"
                   "2026/12/01 08:52:03.300, 1755 MHz, 700.00 W, 0x0000000000000004\n"
                   "[N/A], [N/A], [N/A], [N/A]\n")
    samples = probe.smi_samples(str(smi))
    assert [(mhz, w, r) for _, mhz, w, r in samples] == [(1980, 612.34, "0x0000000000000000"),
                                                         (1755, 700.0, "0x0000000000000004")]
    t0 = samples[0][0]
    groups = {"facodegen": [(t0 - 0.05, t0 + 0.05, 1.0), (t0 + 0.15, t0 + 0.25, 1.2), (t0 + 0.16, t0 + 0.26, 1.1)],
              "fa3": [(t0 + 0.5, t0 + 0.6, 0.9)] * 3}
    text = probe.summarize("128,8192,1 bf16", groups, samples, flops=1e12)
    lines = text.splitlines()
    assert lines[0] == "cell 128,8192,1 bf16: 2 nvidia-smi samples, SM clock 1755-1980 MHz, power 612-700 W"
    ours = next(line for line in lines if line.startswith("| facodegen |"))
    assert "| 3 | 1.000 |" in ours and "1755: 2, 1.150; 1980: 1, 1.000" in ours and "| 909.1 |" in ours
    assert next(line for line in lines if line.startswith("| fa3 |")).endswith("| - |")   # no sample in its span
    assert lines[-1] == "throttle reasons seen: 0x0000000000000000, 0x0000000000000004"


@pytest.fixture
def recorded_backend(monkeypatch):
    """A single-use context manager like SDPA's backend choice that records its entries and exits in
    `events` (returned with it), and a torch whose synchronize does nothing."""
    import contextlib
    import types

    events = []

    @contextlib.contextmanager
    def backend():
        events.append("enter")
        yield
        events.append("exit")

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(runner, "_torch", lambda: fake_torch)
    return events, backend


def test_run_impl_enters_a_single_use_context_once(monkeypatch, recorded_backend):
    """SDPA's backend choice (torch.nn.attention.sdpa_kernel) is a single-use context manager: the
    check and the timing of one implementation run inside one entry of it."""
    events, backend = recorded_backend
    monkeypatch.setattr(runner, "_slice_check", lambda o, s, causal, dtype: (True, "", 1e-3))
    calls = []
    monkeypatch.setattr(runner, "time_cuda", lambda fn, **kw: (fn(), fn(), calls.append(events[:]),
                                                            {"ms": 1.0, "min_ms": 0.9, "max_ms": 1.1,
                                                             "host_ms": 0.1})[-1])
    c = bench.cell(64, False, 1024, 1, 2, "bf16")
    result = runner._run_impl("cudnn", lambda s: (lambda: events.append("call"), backend), [object()], c,
                             True, {}, print)
    assert result["tflops"] and result["err"] == 1e-3 and result["note"] is None
    assert calls == [["enter", "call", "call", "call"]] and events[-1] == "exit" and events.count("enter") == 1


def test_build_and_check_hands_out_only_checked_implementations(monkeypatch, recorded_backend):
    """run_cell's in-turn mode: the check runs in one entry of the implementation's context, and only
    an implementation that passed it comes back (with its rotation and context) to take turns."""
    events, backend = recorded_backend
    verdict = {"ok": True}
    monkeypatch.setattr(runner, "_slice_check", lambda o, s, causal, dtype: (verdict["ok"], "off by 2x", 0.5))
    c = bench.cell(64, False, 1024, 1, 2, "bf16")
    make = lambda s: (lambda: events.append("call"), backend)  # noqa: E731
    result, rotate, context = runner._build_and_check("cudnn", make, [object(), object()], c, True, print)
    assert events == ["enter", "call", "exit"] and result["err"] == 0.5 and context is backend
    rotate()
    assert events[-1] == "call"
    verdict["ok"] = False
    result, rotate, context = runner._build_and_check("cudnn", make, [object()], c, True, print)
    assert rotate is None and context is None and result["note"] == "check failed: off by 2x"


def test_time_in_turns_falls_back_to_each_alone_inside_its_context(monkeypatch):
    """Should taking turns raise, every implementation is timed alone inside its own context; one
    that fails then gets a note and the others still get their number."""
    import contextlib

    entered = []

    def context_of(name):
        @contextlib.contextmanager
        def context():
            entered.append(name)
            yield
        return context

    def interleaved(fns, contexts=None, **kw):
        raise RuntimeError("one of them hung")

    def alone(rotate, **kw):
        rotate()
        return {"ms": 2.0, "min_ms": 1.9, "max_ms": 2.1, "host_ms": 0.1}

    monkeypatch.setattr(runner, "time_cuda_interleaved", interleaved)
    monkeypatch.setattr(runner, "time_cuda", alone)
    c = bench.cell(64, False, 1024, 1, 2, "bf16")
    row = {"results": {"ours": {"note": None}, "cudnn": {"note": None}}}

    def broken():
        raise ValueError("bad launch")
    prepared = [("ours", lambda: None, context_of("ours")), ("cudnn", broken, context_of("cudnn"))]
    runner._time_in_turns(prepared, row, c, {}, lambda msg: None)
    assert entered == ["ours", "cudnn"]
    assert row["results"]["ours"]["ms"] == 2.0 and row["results"]["ours"]["tflops"] > 0
    assert "tflops" not in row["results"]["cudnn"] and "bad launch" in row["results"]["cudnn"]["note"]


def test_trace_steps_traces_a_copy_of_the_fp8_kernel_and_reads_its_phases():
    """scripts/lab.py trace-steps: the traced copy of the head_dim 256 fp8 kernels has a clock read at
    each consumer stage, at each V tile's four events and at each K load's issue, still compiles for
    sm_90a (without spills for the row-V kernel), and the medians come out of a synthetic timeline
    as laid in."""
    import numpy as np

    from facodegen.runtime import compiler
    from facodegen.codegen.render import emit
    from facodegen.spec import KernelSpec

    trace = _script("trace_steps")
    for layout in ("row", "transposed"):      # (the transposed kernel renders the transposer, unused)
        spec = KernelSpec(arch="sm90", head_dim=256, dtype="fp8", v_layout=layout)
        source = trace.traced(emit(spec))
        assert source.count("FCG_TRACE(fcg_idx, ") == 2 * len(trace.EVENTS)    # both steady loops
        assert source.count("FCG_TRACE_V(kv_iter, ") == len(trace.V_EVENTS)     # (the K issue as well)
        assert source.count("FCG_TRACE_TILE(") == len(trace.TILE_EVENTS) + 1      # each tile event, the macro
        kernel = compiler.compile_source(source, "sm90", spec.variant, cache=False, verbose=False)
        assert "CS2R.32" in kernel.sass()
        # the row-V kernel keeps its registers; the caller's-V^T one without uniform_wg spills a little
        assert kernel.resources.spill_stores == 0 or layout == "transposed"
    with pytest.raises(SystemExit, match="patch text"):
        trace.apply_patch("int x;\n", "int y;\n===\nint z;\n")
    assert trace.apply_patch("a();\nb();\n", "a();\n===\nc();\n%%%\n") == "c();\nb();\n"
    # two warpgroups half a 3000-cycle period apart; per step: K after 50, V^T + issue 400, S 300,
    # P V 700, softmax the rest (1550); V tiles issued 3000 before they land, transposed in 2500;
    # K issued 1200 before warpgroup 0's K wait ends
    ctas, steps = 2, 40
    ev = np.zeros((ctas, 2, trace.TRACE_STEPS, len(trace.EVENTS)), dtype=np.uint32)
    vt = np.zeros((len(trace.V_EVENTS), ctas, trace.TRACE_STEPS), dtype=np.uint32)
    for cta in range(ctas):
        for wg in range(2):
            for j in range(steps):
                start = 10_000 + 3000 * j + 1500 * wg
                ev[cta, wg, j] = [start, start + 50, start + 450, start + 750, start + 1450]
        for j in range(steps):
            vt[:, cta, j] = [4000 + 3000 * j, 7000 + 3000 * j, 7100 + 3000 * j, 9600 + 3000 * j, 8850 + 3000 * j]
    got = trace.analyse(ev, vt, steps)
    assert (got["period"], got["k_wait"], got["vt_wait"], got["qk_to_s"], got["s_to_pv"], got["softmax"]) == \
        (3000, 50, 400, 300, 700, 1550)
    assert (got["wg_offset"], got["v_tma"], got["v_to_transpose"], got["transpose"]) == (1500, 3000, 100, 2500)
    assert got["k_issue_to_use"] == 1200
    # tiles of 10 blocks at that period plus 4000 cycles: Q seen 300 after the fetch, S 1000 later,
    # tail done 31000 after the fetch, epilogue 2500, next fetch 1200 later
    tiles = np.zeros((ctas, 2, trace.TRACE_TILES, len(trace.TILE_EVENTS) + 1), dtype=np.uint32)
    for cta in range(ctas):
        for wg in range(2):
            for i in range(5):
                fetch = 1000 + 34_000 * i + 100 * wg
                tiles[cta, wg, i] = [fetch, fetch + 300, fetch + 1300, fetch + 30_300, fetch + 32_800, 10]
    got = trace.analyse_tiles(tiles, 3000)
    assert (got["q_wait"], got["first_qk"], got["epilogue"], got["to_next_fetch"], got["tile_extra"]) == \
        (300, 1000, 2500, 1200, 4000)
    assert got["tiles"] == 2 * 2 * 4 and abs(got["extra_share"] - 4000 / 34_000) < 1e-9


def test_patch_ab_reads_the_patches_as_trace_steps_does(monkeypatch, capsys):
    """scripts/lab.py patch-ab (GPU): imports without a GPU, documents its arguments, and applies source
    patches with trace_steps' apply_patch, whose leading comment block (no separator) is skipped."""
    ab = _script("patch_ab")
    monkeypatch.setattr(sys, "argv", ["patch_ab.py", "--help"])
    with pytest.raises(SystemExit) as done:
        ab.main()
    assert done.value.code == 0 and "--patch" in capsys.readouterr().out
    trace = _script("trace_steps")
    assert trace.apply_patch("a();\nb();\n", "what this is\n%%%\na();\n===\nc();\n") == "c();\nb();\n"


def test_patch_ab_times_another_copy_of_the_templates(tmp_path):
    """scripts/lab.py patch-ab --templates: render.emit renders from another copy of templates/, the same
    text from an identical copy and the other text from an edited one."""
    import shutil

    from facodegen.codegen import render
    from facodegen.spec import KernelSpec
    spec = KernelSpec(arch="sm90", head_dim=128, dtype="fp8")
    copy = tmp_path / "templates"
    shutil.copytree(render.template_dir(), copy)
    assert render.emit(spec, templates=str(copy)) == render.emit(spec)
    kernel = copy / "sm90" / "flash_fwd_fp8.cu.j2"
    kernel.write_text(kernel.read_text().replace("// ================================ setup", "// (edited) setup"))
    edited = render.emit(spec, templates=str(copy))
    assert "(edited) setup" in edited and "(edited) setup" not in render.emit(spec)


def test_precompile_compiles_the_cells_kernels_into_the_cache(monkeypatch, tmp_path, capsys):
    """scripts/precompile.py: the kernel of a cell and variant, as the device would pick it (stream_k
    off by the rule at head_dim 256 below 8k keys), compiled into FACODEGEN_CACHE_DIR, and a
    source patch's kernel beside it; registers and spills printed for each."""
    from facodegen.runtime import compiler
    monkeypatch.setenv("FACODEGEN_CACHE_DIR", str(tmp_path))
    compiler.clear_memo()
    patch = tmp_path / "tag.patch"
    patch.write_text("// ================================ setup\n===\n// (tagged) setup\n")
    monkeypatch.setattr(sys, "argv", ["precompile.py", "--dtype", "fp8", "--cell", "256,4096,0",
                                      "--variant", "sm90:", "--patch", str(patch)])
    assert _script("precompile").main() == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("_sk_" not in line and "spills 0/0" in line for line in out), out
    assert out[1].split()[2] == "tag.patch:"
    assert len(list(tmp_path.rglob("*.cubin"))) == 2


def test_overlap_probe_kernels_keep_their_wgmmas_in_flight():
    """scripts/lab.py overlap-probe: the probe's kernels compile for sm_90a without spills or ptxas's
    wgmma serialisation, with one group of wgmmas in flight while the next is issued, and the side
    warpgroup's loop runs its op (MUFU.EX2 for ex2) and no wgmma."""
    from facodegen.runtime import compiler

    probe = _script("overlap_probe")
    kernels = probe.compile_all([(2, "rs", 256, "none"), (2, "rs32", 256, "none"), (2, "rs", 256, "ex2"), (0, "ss", 256, "ex2")])
    for variant, (cubin, resources) in kernels.items():
        r = next(iter(resources.values()))
        assert r.spill_stores == 0 and "C751" not in probe.log_of[variant], probe.name(variant)
        sass = compiler._cuobjdump(cubin, "-sass", "probe")
        gemm = variant[0] > 0
        assert ("DEPBAR.LE gsb0, 0x1" in sass) == gemm and (sass.count("QGMMA") >= probe.GROUP) == gemm
        assert ("MUFU.EX2" in sass) == (variant[3] == "ex2")


# ---- the public call and the prepared launcher ------------------------------------------------

def _fake_facodegen(monkeypatch):
    """facodegen.attention / facodegen.prepare (and api.prepare, which the prepared path uses) that
    record their calls, and a torch whose empty() hands out labelled buffers. Returns the record."""
    import types

    import facodegen
    from facodegen.ops import api

    calls = []

    class Prepared:
        spec = types.SimpleNamespace(variant="flash_fwd_sm90_test")

        def __init__(self, kw):
            self.kw = kw

        def __call__(self):
            calls.append(("run", self.kw))
            return self.kw.get("out")

    def prepare(q, k, v, **kw):
        calls.append(("prepare", kw))
        return Prepared(kw)

    def attention(q, k, v, **kw):
        calls.append(("attention", kw))
        return "fresh out"

    monkeypatch.setattr(facodegen, "prepare", prepare)
    monkeypatch.setattr(facodegen, "attention", attention)
    monkeypatch.setattr(api, "prepare", prepare)
    fake_torch = types.SimpleNamespace(empty=lambda *shape, dtype=None, device=None: ("buffer", shape, dtype),
                                       bfloat16="bf16", float32="f32")
    monkeypatch.setattr(variants, "_torch", lambda: fake_torch)
    return calls


def test_facodegen_makers_time_the_public_call_and_the_prepared_launcher_beside_it(monkeypatch):
    """One facodegen column makes two implementations on the same input set: the public call
    (facodegen.attention every time, out allocated by the call) under the column's name, and the
    launcher prepared once (out and lse allocated once) under the prepared name."""
    import types

    calls = _fake_facodegen(monkeypatch)
    q = types.SimpleNamespace(shape=(1, 128, 8, 64), dtype="fp16", device="cuda:0")
    s = bench.InputSet(q, q, q)
    makers = variants._facodegen_makers("facodegen-sm90", "sm90", {"block_n": 64}, True)
    assert [name for name, _ in makers] == ["facodegen-sm90", "facodegen-sm90 (prepared)"]
    public, prepared = (make(s) for _, make in makers)
    assert public[2] == prepared[2] == "flash_fwd_sm90_test" and public[3] is s and prepared[3] is s

    calls.clear()
    assert public[0]() == "fresh out" and public[0]() == "fresh out"
    assert calls == [("attention", {"causal": True, "arch": "sm90", "block_n": 64})] * 2    # no out=: per call
    calls.clear()
    out = prepared[0]()
    prepared[0]()
    assert [what for what, _ in calls] == ["run", "run"]                          # nothing prepared again
    assert calls[0][1]["out"] is out and out[0] == "buffer" and calls[0][1]["lse_out"][0] == "buffer"

    assert [n for n, _ in variants._facodegen_makers("facodegen x", "sm80", {}, False, prepared=False)] == ["facodegen x"]
    assert variants._facodegen_names(("sm90", "sm80"), None, True) == [
        "facodegen-sm90", "facodegen-sm90 (prepared)", "facodegen-sm80", "facodegen-sm80 (prepared)"]
    assert variants._facodegen_names(("sm90",), {"facodegen a": "sm90:"}, False) == ["facodegen a"]


def test_prepared_columns_have_no_ratio_of_their_own():
    """The table and CSV give the ratio to the best peer for the public call only; the prepared
    launcher's TFLOP/s stand in the column beside it."""
    import csv
    import io

    ours = bench.facodegen_name("sm90")
    assert bench.is_prepared(bench.prepared_name(ours)) and not bench.is_prepared(ours)
    assert bench.has_ratio(ours) and not bench.has_ratio(bench.prepared_name(ours)) and not bench.has_ratio("fa3")
    row = _row({ours: {"tflops": 600.0}, bench.prepared_name(ours): {"tflops": 640.0}, "fa3": {"tflops": 650.0}})
    lines = format_table([row]).splitlines()
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    assert header[6:9] == [ours, "facodegen-sm90 (prepared)", "FlashAttention-3"]
    assert header[-2:] == ["best peer", "sm90/best"]
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    assert first[7] == "640.0" and first[-1] == f"{600 / 650:.2f}"
    records = {r["impl"]: r for r in csv.DictReader(io.StringIO(bench.to_csv([row])))}
    assert float(records[ours]["ratio_to_best_peer"]) == pytest.approx(600 / 650)
    assert records["facodegen-sm90 (prepared)"]["ratio_to_best_peer"] == ""


def test_run_cli_bench_passes_no_prepared(monkeypatch):
    seen = {}

    def fake_run_cell(c, archs, peers, overrides, *a, prepared=True, **k):
        seen["prepared"] = prepared
        return dict(c, flops=0, results={"facodegen-sm90": {"tflops": 1.0}})

    monkeypatch.setattr(runner, "run_cell", fake_run_cell)
    bench.run_cli_bench({}, arch="sm90", head_dim=128, dtype="bf16", causal=False, seqlen=512, batch=1, heads=2)
    assert seen["prepared"] is True
    bench.run_cli_bench({}, arch="sm90", head_dim=128, dtype="bf16", causal=False, seqlen=512, batch=1, heads=2,
                        prepared=False)
    assert seen["prepared"] is False


# ---- the overhead suite -------------------------------------------------------------------------

def test_overhead_is_a_suite_of_the_cli_and_not_a_grid():
    from facodegen import cli
    assert "overhead" in bench.suite_names() and set(cli.SUITE_NAMES) == set(bench.suite_names())
    with pytest.raises(ValueError, match="host microseconds"):
        bench.suite_cells("overhead")
    assert bench.OVERHEAD_SHAPE == (1, 128, 8, 128)
    assert {d for d, _ in bench.OVERHEAD_CASES} == {"bf16", "fp16", "fp8"}
    assert set(bench.OVERHEAD_OPTIONS) == {"plain", "return_lse", "out="}


def test_time_host_per_call_keeps_the_gpu_off_the_host_figure(monkeypatch):
    """On a fake clock (2 us of host per call, 1000 us for each synchronize to drain the GPU): the
    back-to-back loop with one synchronize after it reads 2 + 1000/calls us, the chunked host
    figure 2 us, since no chunk's synchronize is on the clock."""
    clock = {"us": 0.0, "calls": 0, "syncs": 0}

    def fn():
        clock["us"] += 2.0
        clock["calls"] += 1

    def synchronize():
        clock["us"] += 1000.0
        clock["syncs"] += 1

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["us"] * 1e-6)
    t = bench.time_host_per_call(fn, synchronize, warmup=3, calls=10, repeats=2, chunk=5)
    assert t["host_us"] == pytest.approx(2.0) and t["loop_us"] == pytest.approx(2.0 + 1000.0 / 10)
    assert clock["calls"] == 3 + 2 * 10 + 2 * 10
    assert clock["syncs"] == 1 + 2 + 2 * 2 + 1


def _synthetic_overhead(monkeypatch, host_us: dict):
    """run_overhead on fakes: no GPU, builders that refuse as the real ones do (SDPA takes neither
    return_lse nor out= nor e4m3; CuPy only fp16; FlashAttention-3 not importable) and a timer that
    reads host_us[impl] (the loop figure: the same, except 3x for the prepared call)."""
    import types

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(overhead, "_torch", lambda: fake_torch)
    monkeypatch.setattr(overhead, "_overhead_inputs",
                        lambda dtype, causal: bench.InputSet(f"{dtype} q", "k", "v", {"q_descale": 1.0} if dtype == "fp8" else None))
    seen = []

    def builder(impl, refuse=lambda s, options: None):
        def build(s, causal, options, kwargs):
            reason = refuse(s, options)
            if reason:
                raise RuntimeError(reason)
            seen.append((impl, options, kwargs))
            return lambda: impl
        return build

    def no_sdpa(s, options):
        return "skipped: SDPA has no e4m3 path" if s.fp8 else None if options == "plain" else "skipped: SDPA has no LSE"

    def no_fa3(s, options):
        return "unavailable: flash_attn_interface not importable"

    def cupy_fp16_only(s, options):
        return None if s.q == "fp16 q" else "skipped: CuPy has no bfloat16 dtype"

    for impl in bench.OVERHEAD_IMPLS:
        refuse = {bench.OVERHEAD_SDPA: no_sdpa, bench.OVERHEAD_FA3: no_fa3,
                  "facodegen.attention (CuPy)": cupy_fp16_only}.get(impl, lambda s, options: None)
        monkeypatch.setitem(overhead.OVERHEAD_BUILDERS, impl, builder(impl, refuse))

    def timer(fn, synchronize, **timing):
        impl = fn()
        return {"host_us": host_us[impl], "loop_us": host_us[impl] * (3 if impl == "facodegen.prepare()()" else 1)}

    rows = bench.run_overhead(arch="sm90", overrides={"block_n": 64}, timer=timer, log=lambda m: None)
    return rows, seen


def test_overhead_rows_ratios_and_table_from_synthetic_timings(monkeypatch, tmp_path):
    host_us = {"facodegen.attention": 10.0, "facodegen.attention (CuPy)": 12.0, "facodegen.prepare()()": 4.0,
               bench.OVERHEAD_SDPA: 20.0, bench.OVERHEAD_FA3: 15.0}
    rows, seen = _synthetic_overhead(monkeypatch, host_us)
    assert len(rows) == len(bench.OVERHEAD_CASES) * len(bench.OVERHEAD_OPTIONS) * len(bench.OVERHEAD_IMPLS)
    assert all(kwargs == {"arch": "sm90", "block_n": 64} for _, _, kwargs in seen)

    def find(impl, dtype, options):
        return next(r for r in rows if (r["impl"], r["dtype"], r["options"]) == (impl, dtype, options))

    plain = find("facodegen.attention", "bf16", "plain")
    assert plain["causal"] is True and plain["host_us"] == 10.0 and plain["ratio_to_sdpa"] == pytest.approx(0.5)
    assert find("facodegen.attention", "fp16", "out=")["ratio_to_sdpa"] == pytest.approx(0.5)   # vs SDPA's plain
    assert find("facodegen.attention", "fp8", "return_lse")["ratio_to_sdpa"] == pytest.approx(0.5)  # vs SDPA bf16
    assert find(bench.OVERHEAD_SDPA, "fp16", "plain")["ratio_to_sdpa"] == pytest.approx(1.0)
    sdpa_lse = find(bench.OVERHEAD_SDPA, "bf16", "return_lse")
    assert sdpa_lse["host_us"] is None and sdpa_lse["note"].startswith("skipped")
    fa3 = find(bench.OVERHEAD_FA3, "bf16", "plain")
    assert fa3["host_us"] is None and fa3["note"].startswith("unavailable")
    assert find("facodegen.attention (CuPy)", "fp16", "plain")["ratio_to_sdpa"] == pytest.approx(0.6)
    assert find("facodegen.attention (CuPy)", "bf16", "plain")["note"].startswith("skipped: CuPy")
    prepared = find("facodegen.prepare()()", "fp16", "plain")
    assert prepared["loop_us"] == 12.0 and "GPU-bound" in prepared["note"]

    table = bench.format_overhead_table(rows).splitlines()
    assert table[0] == "| implementation | dtype | causal | options | host µs/call | loop µs/call | ratio to SDPA |"
    ran = [r for r in rows if r["host_us"] is not None]
    assert len(ran) == 3 * 3 * 2 + 3 + 2 and len(table) == 2 + len(ran)   # skipped/unavailable: notes only
    assert all(line.count("|") == 8 for line in table)
    assert "| facodegen.attention | bf16 | yes | plain | 10.0 | 10.0 | 0.50 |" in table
    assert "| facodegen.attention (CuPy) | fp16 | no | out= | 12.0 | 12.0 | 0.60 |" in table
    assert not any(bench.OVERHEAD_FA3 in line for line in table)
    notes = bench.format_overhead_notes(rows)
    assert f"- {bench.OVERHEAD_FA3} (9 rows): unavailable: flash_attn_interface not importable" in notes.splitlines()
    assert f"- {bench.OVERHEAD_SDPA} (fp8 causal plain, fp8 causal return_lse, fp8 causal out=): " \
        "skipped: SDPA has no e4m3 path" in notes.splitlines()

    paths = bench.write_overhead_results(rows, tmp_path / "out", "bench-overhead", env={"gpu": "fake"})
    records = paths["csv"].read_text().splitlines()
    assert records[0] == ",".join(bench.OVERHEAD_CSV_FIELDS) and len(records) == 1 + len(rows)
    assert "facodegen.attention,bf16,True,plain,10,10,0.5," in records
    assert paths["md"].read_text().startswith(table[0]) and "Notes:" in paths["md"].read_text()
    import json
    data = json.loads(paths["json"].read_text())
    assert data["env"] == {"gpu": "fake"} and data["shape"] == [1, 128, 8, 128] and len(data["rows"]) == len(rows)


def test_overhead_leaves_fa3_out_when_not_asked_for_and_a_failing_case_is_noted(monkeypatch):
    import types

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(overhead, "_torch", lambda: fake_torch)

    def inputs(dtype, causal):
        if dtype == "fp8":
            raise TypeError("no float8_e4m3fn in this torch")
        return bench.InputSet("q", "k", "v")

    def broken(s, causal, options, kwargs):
        raise ValueError("block_n=7 is not a multiple of 16")

    monkeypatch.setattr(overhead, "_overhead_inputs", inputs)
    for impl in bench.OVERHEAD_IMPLS:
        monkeypatch.setitem(overhead.OVERHEAD_BUILDERS, impl, broken)
    rows = bench.run_overhead(peers=(), timer=None, log=lambda m: None)
    assert {r["impl"] for r in rows} == set(bench.OVERHEAD_IMPLS) - {bench.OVERHEAD_FA3}
    assert all(r["host_us"] is None for r in rows)
    assert all(r["note"].startswith("skipped: inputs failed: TypeError") for r in rows if r["dtype"] == "fp8")
    assert all(r["note"] == "failed: ValueError: block_n=7 is not a multiple of 16" for r in rows if r["dtype"] != "fp8")
    table = bench.format_overhead_table(rows).splitlines()
    assert len(table) == 2 + 3 * 4 * 2 and "| facodegen.attention | bf16 | yes | plain | fail | – | – |" in table


# ---- the CLI ------------------------------------------------------------------------------------

def test_cli_bench_suite_overhead_help_and_dispatch(monkeypatch, tmp_path):
    """`bench --suite overhead --help` parses; `bench --suite overhead` hands --arch, the tile flags
    and --peers to run_overhead, writes its files and prints the table last."""
    from click.testing import CliRunner

    from facodegen import cli
    from facodegen.runtime import compiler as fc

    runner = CliRunner()
    result = runner.invoke(cli.main, ["bench", "--suite", "overhead", "--help"])
    assert result.exit_code == 0, result.output
    assert "overhead" in result.output and "--no-prepared" in result.output

    seen = {}

    def fake_run_overhead(arch=None, overrides=None, peers=(), log=print, **kw):
        seen.update(arch=arch, overrides=overrides, peers=peers)
        return bench.with_sdpa_ratios([bench.overhead_row("facodegen.attention", "bf16", True, "plain", 10.0, 11.0),
                                       bench.overhead_row(bench.OVERHEAD_SDPA, "bf16", True, "plain", 20.0, 21.0)])

    monkeypatch.setattr(fc, "gpu_available", lambda: (True, "fake GPU"))
    monkeypatch.setattr(overhead, "run_overhead", fake_run_overhead)
    monkeypatch.setattr(results, "environment", lambda: {"gpu": "fake GPU", "facodegen": "0"})
    result = runner.invoke(cli.main, ["bench", "--suite", "overhead", "--arch", "sm90", "--block-n", "64",
                                      "--peers", "", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen == {"arch": "sm90", "overrides": {"block_n": 64}, "peers": ()}
    assert result.output.rstrip().splitlines()[-1] == f"| {bench.OVERHEAD_SDPA} | bf16 | yes | plain | 20.0 | 21.0 | 1.00 |"
    assert (tmp_path / "bench-overhead.csv").exists() and (tmp_path / "bench-overhead.json").exists()


def test_plot_draws_the_prepared_bar_in_its_public_calls_colour_hatched(tmp_path):
    from facodegen.bench import plot
    impls = ["fa3", "facodegen FA1", "facodegen-sm90", "facodegen-sm90 (prepared)", "facodegen FA1 (prepared)"]
    colors = plot._colors(impls)
    assert colors["facodegen-sm90 (prepared)"] == colors["facodegen-sm90"] == plot.COLORS["facodegen-sm90"]
    assert colors["facodegen FA1 (prepared)"] == colors["facodegen FA1"] == plot._FALLBACK[0]
    assert plot._hatch("facodegen-sm90 (prepared)")["hatch"] and plot._hatch("facodegen-sm90") == {}
    pytest.importorskip("matplotlib")
    rows = [_row({"facodegen-sm90": {"tflops": 600.0}, "facodegen-sm90 (prepared)": {"tflops": 640.0},
                  "fa3": {"tflops": 650.0}})]
    assert plot.plot_rows(rows, tmp_path / "one.png").stat().st_size > 0


def test_overhead_rows_take_turns_and_keep_the_median(monkeypatch):
    """Each round times every row of a case once (full warm-up first, a tenth after), and a row's
    figures are the medians over its rounds: a slow spell hits every implementation alike."""
    import types
    monkeypatch.setattr(overhead, "_torch", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=None)))
    calls = []
    slow = {("b", 1)}       # row b's second round ran during a slow spell

    def timer(fn, synchronize, **timing):
        name = fn()
        calls.append((name, timing["warmup"], timing["repeats"]))
        rounds = sum(1 for c in calls if c[0] == name) - 1
        us = 50.0 if (name, rounds) in slow else {"a": 10.0, "b": 20.0}[name] + rounds
        return {"host_us": us, "loop_us": us}
    built = [(bench.overhead_row(n, "bf16", True, "plain"), (lambda n=n: n)) for n in ("a", "b")]
    built.append((bench.overhead_row("c", "bf16", True, "plain", note="skipped: no"), None))
    overhead._time_overhead_rows(built, {"warmup": 200, "calls": 10, "repeats": 3, "chunk": 5}, timer, lambda m: None)
    assert calls == [("a", 200, 1), ("b", 200, 1), ("a", 20, 1), ("b", 20, 1), ("a", 20, 1), ("b", 20, 1)]
    a, b, c = (row for row, _ in built)
    assert a["host_us"] == 11.0 and b["host_us"] == 22.0    # medians of (10, 11, 12) and (20, 50, 22)
    assert c["host_us"] is None and c["note"] == "skipped: no"


def test_bench_softcap_arms_type_their_knobs_and_refuse_unknown_ones():
    """scripts/bench_softcap.py: the arms are no softcap, softcap, softcap with each poly_exp2_tiles count, and
    softcap with each --arm's knobs typed by the registry (pingpong=1 -> True); a name that is no forward knob is
    a ValueError naming it, before any GPU work."""
    script = _script("bench_softcap")
    arms = script.arms((6,), ("pingpong=1,block_n=112",))
    assert [label for label, _ in arms] == ["no softcap", "softcap 50", "softcap 50 px6",
                                            "softcap 50 pingpong=1,block_n=112"]
    assert arms[0][1] == {} and arms[2][1] == {"softcap": 50.0, "poly_exp2_tiles": 6}
    assert arms[3][1] == {"softcap": 50.0, "pingpong": True, "block_n": 112}
    with pytest.raises(ValueError, match="frobnicate"):
        script.arms((), ("frobnicate=1",))
    args = script.parse_args(["--head-dims", "128,256", "--arm", "pingpong=1", "--arm", "block_n=96"])
    assert args.head_dims == "128,256" and args.arm == ["pingpong=1", "block_n=96"]
