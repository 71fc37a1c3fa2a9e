"""`facodegen bench --suite fa3-paper --backward/--fwd-bwd`, `--suite decode`, `--suite variants` and `--suite varlen`
without a GPU (click's CliRunner, the runners monkeypatched): each reaches its runner with the right
cells and options, writes its files under --out and prints its table last; options a suite cannot
honour are usage errors (exit 2) that name the option."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from facodegen import cli
from facodegen.runtime import compiler as fc
from facodegen.bench import backward as bw
from facodegen.bench import decode as dec
from facodegen.bench import results
from facodegen.bench import variants_suite as vs
from facodegen.bench import varlen_suite as vl


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(fc, "gpu_available", lambda: (True, "fake GPU"))
    monkeypatch.setattr(results, "environment", lambda: {"gpu": "fake GPU", "facodegen": "0"})


@pytest.fixture
def backward_calls(monkeypatch):
    seen = []

    def fake_run_backward(cells, peers=bw.BACKWARD_PEERS, facodegen=True, variants=(), mode="backward",
                          warmup=bw.WARMUP, iters=bw.ITERS, log=print):
        seen.append(dict(cells=cells, peers=tuple(peers), variants=list(variants), mode=mode, facodegen=facodegen))
        rows = []
        for c in cells:
            res = {"facodegen": {"tflops": 200.0}, **{p: {"tflops": 400.0} for p in peers}}
            res.update({bw.variant_label(k): {"tflops": 250.0} for k in variants})
            rows.append(dict(c, flops=bw.cell_flops(c, mode), mode=mode, results=res))
        return rows

    monkeypatch.setattr(bw, "run_backward", fake_run_backward)
    return seen


def invoke(*args):
    return CliRunner().invoke(cli.main, ["bench", *args])


def test_backward_reaches_run_backward_with_the_fa3_paper_cells(fake_gpu, backward_calls, tmp_path):
    result = invoke("--suite", "fa3-paper", "--backward", "--out", str(tmp_path), "--no-plot")
    assert result.exit_code == 0, result.output
    (call,) = backward_calls
    assert call["cells"] == bw.backward_cells() and len(call["cells"]) == 36
    assert call["peers"] == ("cudnn", "fa2") and call["mode"] == "backward" and call["variants"] == []
    assert result.output.rstrip().splitlines()[-1] == "| geomean | | | | | | 0.50x | 0.50x |"
    assert "backward, FLOPs = 2.5 x forward" in result.output
    for ext in ("md", "csv", "json"):
        assert (tmp_path / f"bench-fa3-paper-backward-bf16.{ext}").exists()


def test_backward_head_dim_causal_quick_peers_variants_dtype(fake_gpu, backward_calls, tmp_path):
    result = invoke("--suite", "fa3-paper", "--backward", "--head-dim", "128", "--causal", "--quick", "--dtype",
                    "fp16", "--peers", "flash", "--variant", "k_unroll=1,block_n=64", "--variant", "k_unroll=2",
                    "--out", str(tmp_path), "--no-plot")
    assert result.exit_code == 0, result.output
    (call,) = backward_calls
    assert call["cells"] == [bw.paper_cell(128, True, 2048, "fp16"), bw.paper_cell(128, True, 8192, "fp16")]
    assert call["peers"] == ("fa2",) and call["variants"] == [{"k_unroll": 1, "block_n": 64}, {"k_unroll": 2}]
    assert "facodegen[block_n=64,k_unroll=1]" in result.output
    assert (tmp_path / "bench-fa3-paper-backward-fp16.md").exists()


def test_fwd_bwd_is_forward_plus_backward(fake_gpu, backward_calls, tmp_path):
    result = invoke("--suite", "fa3-paper", "--fwd-bwd", "--no-causal", "--out", str(tmp_path), "--no-plot")
    assert result.exit_code == 0, result.output
    (call,) = backward_calls
    assert call["mode"] == "fwd-bwd" and len(call["cells"]) == 18 and not any(c["causal"] for c in call["cells"])
    assert "forward + backward, FLOPs = 3.5 x forward" in result.output
    assert (tmp_path / "bench-fa3-paper-fwd-bwd-bf16.json").exists()


def test_decode_reaches_run_decode(fake_gpu, monkeypatch, tmp_path):
    seen = []

    def fake_run_decode(todo, peers=dec.DECODE_PEERS, log=print, variants=()):
        seen.append((todo, tuple(peers)) + ((list(variants),) if variants else ()))
        labels = [dec.variant_label(k) for k in variants]
        return [{"cell": c.name, "kv_bytes": c.kv_bytes, "facodegen": 4.0, "fa3": 3.8,
                 **({"variants": labels} if labels else {}), **{v: 4.4 for v in labels}} for c in todo]

    monkeypatch.setattr(dec, "run_decode", fake_run_decode)
    result = invoke("--suite", "decode", "--quick", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert seen == [(dec.cells(**dec.QUICK), ("fa3", "sdpa"))]
    assert "geomean facodegen / fa3: 1.053x" in result.output.splitlines()
    assert result.output.rstrip().splitlines()[-1] == "bar >= 0.97x the best peer: 10 of 10 cells"   # (then the bars)
    assert all((tmp_path / f"bench-decode.{ext}").exists() for ext in ("md", "csv", "json"))
    seen.clear()
    result = invoke("--suite", "decode", "--head-dim", "64", "--peers", "sdpa", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert seen == [(dec.cells(d=(64,)), ("sdpa",))]
    # --variant: facodegen with attention_with_kvcache knobs, a column of its own beside the default call
    seen.clear()
    result = invoke("--suite", "decode", "--quick", "--variant", "fused_combine=1", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert seen == [(dec.cells(**dec.QUICK), ("fa3", "sdpa"), [{"fused_combine": True}])]
    assert "facodegen[fused_combine=True] TB/s" in result.output and "| 4.40 | 1.10x |" in result.output
    assert "facodegen[fused_combine=True]" in (tmp_path / "bench-decode.csv").read_text()
    result = invoke("--suite", "decode", "--variant", "k_unroll=1")
    assert result.exit_code == 2 and "not a knob of attention_with_kvcache" in result.output


def test_variants_reaches_run_variants(fake_gpu, monkeypatch, tmp_path):
    seen = []

    def fake_run_variants(todo, quick=False, log=print):
        seen.append((todo, quick))
        return [dict(c, ms={"facodegen_plain": 1.0, f"facodegen_{c['variant']}": 1.1}, notes=[]) for c in todo
                if c["variant"] != "window"]

    monkeypatch.setattr(vs, "run_variants", fake_run_variants)
    result = invoke("--suite", "variants", "--quick", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert seen == [(vs.cells() + vs.fp8_cells() + vs.head_dim_cells((4096,)), True)]     # --quick: head dims at 4k
    assert result.output.rstrip().splitlines()[-1].startswith("| d192/128 causal | 4096 | 4 |")
    assert (tmp_path / "bench-variants.json").exists() and (tmp_path / "bench-variants.md").exists()


def test_varlen_reaches_run_varlen(fake_gpu, monkeypatch, tmp_path):
    seen = []

    def fake_run_varlen(todo, peers=vl.VARLEN_PEERS, quick=False, log=print):
        seen.append((todo, tuple(peers), quick))
        return [dict(c, results={vl.FACODEGEN_VARLEN: {"tflops": 400.0}, vl.PADDED_SM80: {"tflops": 390.0},
                                 **({vl.FA3_VARLEN: {"tflops": 500.0}} if "fa3" in peers else {})}, notes=[])
                for c in todo]

    monkeypatch.setattr(vl, "run_varlen", fake_run_varlen)
    result = invoke("--suite", "varlen", "--quick", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert seen == [(vl.cells(quick=True), ("fa3", "cudnn"), True)]
    out = result.output
    assert "TFLOP/s of the real tokens" in out and "cuDNN backend has no packed varlen" in out
    table = out[out.index("| cell |"):out.index("\n\nNotes:")].splitlines()
    assert len(table) == 2 + 4 and table[2].endswith("| 400.0 | 500.0 | 390.0 | 0.80x | 1.03x | – |")
    assert out.rstrip().splitlines()[-1] == "- equal 8x4096 d128 causal: varlen / facodegen padded (sm80) = 1.026 (within 5%)"
    assert all((tmp_path / f"bench-varlen.{ext}").exists() for ext in ("md", "csv", "json"))
    seen.clear()
    result = invoke("--suite", "varlen", "--head-dim", "64", "--no-causal", "--peers", "cudnn", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert seen == [(vl.cells(head_dim=64, causal=False), ("cudnn",), False)] and len(seen[0][0]) == 2


def test_varlen_backward_reaches_its_suite(fake_gpu, monkeypatch, tmp_path):
    """`bench --suite varlen --backward` runs bench.varlen_backward_suite over the varlen cells (--quick, --head-dim,
    --causal as --suite varlen takes them), prints its table last and writes it."""
    from facodegen.bench import varlen_backward_suite as vb
    seen = []

    def fake_run(todo, quick=False, log=print):
        seen.append((todo, quick))
        return [dict(c, results={"facodegen autograd": {"ms": 2.0, "tflops": 300.0}, "FA2 varlen (NJT)": {
            "ms": 3.0, "tflops": 200.0}}) for c in todo]
    monkeypatch.setattr(vb, "run", fake_run)
    result = invoke("--suite", "varlen", "--backward", "--quick", "--causal", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert seen == [(vl.cells(quick=True, causal=True), True)]
    assert result.output.rstrip().splitlines()[-1].endswith("| autograd 1.50x |")
    assert (tmp_path / "bench-varlen-backward.md").exists() and (tmp_path / "bench-varlen-backward.json").exists()


@pytest.mark.parametrize("args, names", [
    (["--suite", "fa3-paper", "--backward", "--dtype", "fp8"], ["--dtype fp8", "no backward"]),
    (["--suite", "fa3-paper", "--fwd-bwd", "--dtype", "fp8"], ["--dtype fp8", "--fwd-bwd"]),
    (["--suite", "quick", "--backward"], ["--backward", "--suite fa3-paper"]),
    (["--backward"], ["--backward", "no --suite"]),
    (["--suite", "fa3-paper", "--backward", "--fwd-bwd"], ["--backward and --fwd-bwd"]),
    (["--suite", "fa3-paper", "--variant", "k_unroll=1"], ["--variant"]),
    (["--suite", "fa3-paper", "--fwd-bwd", "--variant", "k_unroll=1"], ["--variant"]),
    (["--suite", "fa3-paper", "--backward", "--variant", "k_unroll"], ["--variant", "knob=value"]),
    (["--suite", "fa3-paper", "--backward", "--block-n", "64"], ["--block-n", "--backward"]),
    (["--suite", "fa3-paper", "--backward", "--arch", "sm90"], ["--arch", "--backward"]),
    (["--suite", "fa3-paper", "--backward", "--head-dim", "80"], ["--head-dim 80", "96 and 192"]),
    (["--suite", "fa3-paper", "--backward", "--peers", "fa3"], ["--peers", "fa3"]),
    (["--suite", "fa3-paper", "--backward", "--budget-s", "10"], ["--budget-s"]),
    (["--suite", "fa3-paper", "--backward", "--no-prepared"], ["--no-prepared"]),
    (["--suite", "fa3-paper", "--quick"], ["--quick"]),
    (["--quick"], ["--quick"]),
    (["--suite", "decode", "--dtype", "fp16"], ["--dtype fp16", "decode"]),
    (["--suite", "decode", "--causal"], ["--causal", "--suite decode"]),
    (["--suite", "decode", "--peers", "fa2"], ["--peers", "fa2"]),
    (["--suite", "decode", "--head-dim", "192"], ["--head-dim 192", "64, 128, 256"]),
    (["--suite", "variants", "--arch", "sm90"], ["--arch", "--suite variants"]),
    (["--suite", "variants", "--peers", "fa3"], ["--peers"]),
    (["--suite", "varlen", "--dtype", "fp16"], ["--dtype fp16", "--suite varlen is bf16 only"]),
    (["--suite", "varlen", "--arch", "sm90"], ["--arch", "--suite varlen"]),
    (["--suite", "varlen", "--block-n", "64"], ["--block-n", "--suite varlen"]),
    (["--suite", "varlen", "--peers", "fa2"], ["--peers", "fa2", "fa3, cudnn"]),
    (["--suite", "varlen", "--head-dim", "256"], ["--head-dim 256", "64, 128"]),
    (["--suite", "varlen", "--quick", "--head-dim", "64"], ["--head-dim 64", "--quick"]),
    (["--suite", "varlen", "--budget-s", "10"], ["--budget-s", "--suite varlen"]),
    (["--suite", "varlen", "--no-prepared"], ["--no-prepared", "--suite varlen"]),
    (["--suite", "varlen", "--fwd-bwd"], ["--fwd-bwd", "--suite fa3-paper"]),
    (["--suite", "varlen", "--backward", "--dtype", "fp16"], ["--dtype fp16", "--suite varlen --backward is bf16"]),
    (["--suite", "varlen", "--backward", "--peers", "fa3"], ["--peers", "--suite varlen --backward"]),
    (["--suite", "varlen", "--backward", "--block-n", "64"], ["--block-n", "--backward"]),
])
def test_bad_combinations_are_usage_errors_naming_the_option(fake_gpu, backward_calls, monkeypatch, args, names):
    monkeypatch.setattr(dec, "run_decode", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr(vs, "run_variants", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr(vl, "run_varlen", lambda *a, **k: pytest.fail("ran"))
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1
    for name in names:
        assert name in result.output
    assert backward_calls == []


def test_usage_errors_come_before_the_gpu_check(monkeypatch):
    monkeypatch.setattr(fc, "gpu_available", lambda: (False, "no CUDA GPU (test)"))
    assert "fp8 has no backward" in invoke("--suite", "fa3-paper", "--backward", "--dtype", "fp8").output
    assert "needs a CUDA GPU" in invoke("--suite", "decode").output
    assert "--suite varlen is bf16 only" in invoke("--suite", "varlen", "--dtype", "fp16").output
    assert "needs a CUDA GPU" in invoke("--suite", "varlen").output


def test_suite_names_and_help():
    from facodegen import bench
    assert set(cli.SUITE_NAMES) == set(bench.suite_names()) >= {"decode", "variants", "varlen"}
    for suite in ("decode", "variants", "varlen"):
        with pytest.raises(ValueError, match="own cells and runner"):
            bench.suite_cells(suite)
    result = invoke("--help")
    assert result.exit_code == 0
    for text in ("--backward", "--fwd-bwd", "--variant", "--quick", "--suite decode --quick", "--suite variants",
                 "--suite varlen --quick", "flash_attn_varlen_func"):
        assert text in result.output
