"""facodegen CLI (click.testing.CliRunner): emit, inspect, check, bench; spec errors; help."""

from __future__ import annotations

import shlex

import pytest
from click.testing import CliRunner

import facodegen
from facodegen import cli
from facodegen.runtime import compiler as fc
from facodegen.codegen.render import emit_command

SMALL = ["--arch", "sm80", "--head-dim", "64"]


@pytest.fixture
def runner():
    return CliRunner()


def invoke(runner, *args):
    return runner.invoke(cli.main, list(args), catch_exceptions=False)


# ---- emit ------------------------------------------------------------------------------------

def test_emit_stdout(runner):
    spec = facodegen.KernelSpec(arch="sm90", head_dim=128, causal=True)
    result = invoke(runner, "emit", "--arch", "sm90", "--head-dim", "128", "--causal")
    assert result.exit_code == 0
    assert result.stdout == facodegen.emit(spec)
    assert result.stdout.startswith("// ====") and spec.variant in result.stdout


def test_emit_file_and_dir(runner, tmp_path):
    spec = facodegen.KernelSpec(arch="sm80", head_dim=64)
    out = tmp_path / "sub" / "k.cu"
    assert invoke(runner, "emit", *SMALL, "-o", str(out)).exit_code == 0
    assert out.read_text() == facodegen.emit(spec)
    assert invoke(runner, "emit", *SMALL, "--out-dir", str(tmp_path / "d")).exit_code == 0
    assert (tmp_path / "d" / f"{spec.variant}.cu").read_text() == facodegen.emit(spec)


def test_emit_all(runner, tmp_path):
    stale = tmp_path / "flash_fwd_sm80_old_variant.cu"
    stale.write_text("old")
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    result = invoke(runner, "emit", "--all", "--out-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    specs = facodegen.default_specs()
    written = sorted(p.name for p in tmp_path.glob("*.cu"))
    assert written == sorted(f"{s.variant}.cu" for s in specs)
    assert len(written) == len(specs)
    assert not stale.exists() and keep.exists()
    for spec in specs[:3] + specs[-3:]:
        assert (tmp_path / f"{spec.variant}.cu").read_text() == facodegen.emit(spec)


def test_emit_all_rejects_spec_flags_and_missing_dir(runner, tmp_path):
    result = invoke(runner, "emit", "--all", "--arch", "sm90", "--out-dir", str(tmp_path))
    assert result.exit_code == 2 and "--all" in result.output
    assert invoke(runner, "emit", "--all").exit_code == 2


# Non-default knobs, built inside the test so a budget-model change fails one case, not collection.
CUSTOM_SPECS = [
    dict(arch="sm80", head_dim=64, q_in_regs=True, block_n=64),
    dict(arch="sm80", head_dim=64, dtype="fp16", stages=1, causal=True),
    dict(arch="sm90", head_dim=128, persistent=False),
    dict(arch="sm90", head_dim=64, consumer_warpgroups=2, pingpong=False, intra_wg_overlap=False),
    dict(arch="sm90", head_dim=128, block_m=64, producer_regs=56, consumer_regs=256),
    dict(arch="sm90", dtype="fp8", head_dim=256, defer_o_store=False),      # off where its default is on
    dict(arch="sm90", dtype="fp8", head_dim=128, defer_o_store=True),
    dict(arch="sm90", dtype="fp8", head_dim=256, varlen=True),             # (stream-K and defer_o_store off)
    dict(arch="sm90", head_dim=128, causal=True, varlen=True, varlen_lpt=True),
    dict(arch="sm90", head_dim=128, causal=True, varlen=True, local=True, softcap=True, sinks=True),
]


def _variant_or_repr(fields: dict) -> str:
    try:
        return facodegen.KernelSpec(**fields).variant
    except facodegen.SpecError:
        return repr(fields)


@pytest.mark.parametrize("fields", [s.as_dict() for s in facodegen.default_specs()] + CUSTOM_SPECS,
                         ids=lambda f: _variant_or_repr(f))
def test_emit_command_reproduces_the_source(runner, fields):
    spec = facodegen.KernelSpec(**fields)
    command = shlex.split(emit_command(spec))
    assert command[:2] == ["facodegen", "emit"]
    result = invoke(runner, *command[1:])
    assert result.exit_code == 0, result.output
    assert result.stdout == facodegen.emit(spec)


# ---- spec errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("args, field", [
    (["--head-dim", "100"], "head_dim"),
    (["--arch", "sm80", "--block-m", "100"], "block_m"),
    (["--arch", "sm80", "--pingpong"], "pingpong"),
    (["--arch", "sm90", "--regs", "24/250"], "consumer_regs"),
    (["--arch", "sm90", "--consumer-warpgroups", "4"], "consumer_warpgroups"),
    (["--arch", "sm80", "--head-dim", "256", "--stages", "4"], "stages"),
])
@pytest.mark.parametrize("command", ["emit", "inspect", "check", "bench"])
def test_bad_spec_is_one_line_exit_2(runner, command, args, field):
    result = runner.invoke(cli.main, [command, *args])
    assert result.exit_code == 2, result.output
    assert field in result.output
    assert result.output.strip().count("\n") == 0 and "Traceback" not in result.output


def test_bad_regs_format(runner):
    result = runner.invoke(cli.main, ["emit", "--arch", "sm90", "--regs", "24"])
    assert result.exit_code == 2 and "--regs" in result.output


# ---- inspect ---------------------------------------------------------------------------------

def test_inspect_resources(runner):
    spec = facodegen.KernelSpec(arch="sm80", head_dim=64)
    result = invoke(runner, "inspect", *SMALL)
    assert result.exit_code == 0, result.output
    kernel = fc.compile(spec)
    out = result.stdout
    assert spec.variant in out and "sm_80" in out
    assert f"registers      {kernel.resources.registers} per thread" in out
    assert f"{spec.smem_bytes} B dynamic" in out
    for word in ("stack", "spills", "barriers", "warnings"):
        assert word in out
    assert invoke(runner, "inspect", *SMALL, "--resources").stdout == out


def test_inspect_ptx(runner):
    result = invoke(runner, "inspect", *SMALL, "--ptx")
    assert result.exit_code == 0
    assert ".target sm_80" in result.stdout
    assert f".entry {facodegen.KernelSpec(arch='sm80', head_dim=64).variant}" in result.stdout


def test_inspect_sass(runner):
    try:
        fc.cuobjdump_path()
    except fc.ToolNotFoundError:
        result = runner.invoke(cli.main, ["inspect", *SMALL, "--sass"])
        assert result.exit_code == 1 and "nvidia-cuda-cuobjdump" in result.output
        return
    result = invoke(runner, "inspect", *SMALL, "--sass")
    assert result.exit_code == 0
    assert "code for sm_80" in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("key instructions: HMMA ")
    for name in fc.KEY_INSTRUCTIONS:
        assert f" {name} " in last + " "


# ---- check / bench without a GPU ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["check", "bench"])
def test_gpu_commands_exit_2_without_gpu(runner, monkeypatch, command):
    monkeypatch.setattr(fc, "gpu_available", lambda: (False, "no CUDA GPU (test)"))
    result = runner.invoke(cli.main, [command, *SMALL])
    assert result.exit_code == 2
    assert result.output.strip() == f"Error: `facodegen {command}` needs a CUDA GPU: no CUDA GPU (test)"


def test_check_calls_api_check_spec(runner, monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("facodegen.ops.api")
    fake.check_spec = lambda spec, **kw: calls.append((spec, kw)) or {"max_error": 0.001, "passed": False}
    monkeypatch.setitem(sys.modules, "facodegen.ops.api", fake)
    monkeypatch.setattr(facodegen.ops, "api", fake)
    monkeypatch.setattr(fc, "gpu_available", lambda: (True, "fake GPU"))
    result = runner.invoke(cli.main, ["check", *SMALL, "--seqlen-q", "128", "--heads", "4"])
    assert result.exit_code == 1  # passed False
    assert "max_error" in result.output
    spec, kw = calls[0]
    assert spec == facodegen.KernelSpec(arch="sm80", head_dim=64)
    assert kw == dict(batch=2, seqlen_q=128, seqlen_k=128, heads=4, heads_kv=4, seed=0)


def test_bench_calls_run_cli_bench(runner, monkeypatch):
    from facodegen.bench import runner as bench_runner

    monkeypatch.setattr(bench_runner, "run_cli_bench",
                        lambda spec, seqlen, batch, heads, **kw: f"{spec.variant} {seqlen} {batch} {heads} {kw}")
    monkeypatch.setattr(fc, "gpu_available", lambda: (True, "fake GPU"))
    variant = facodegen.KernelSpec(arch="sm80", head_dim=64).variant
    result = runner.invoke(cli.main, ["bench", *SMALL, "--seqlen", "512"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"{variant} 512 4 16 {{}}"
    result = runner.invoke(cli.main, ["bench", *SMALL, "--heads-kv", "2", "--peers", "fa2, cudnn"])
    assert result.output.strip() == f"{variant} 4096 4 16 {{'heads_kv': 2, 'peers': ('fa2', 'cudnn')}}"


@pytest.mark.parametrize("flags", [["--softcap", "50"], ["--softcap"], ["--window-left", "256"]])
def test_bench_refuses_variant_flags_of_the_one_cell_bench(runner, monkeypatch, flags):
    # (it once passed softcap=True as the softcap value and failed on the GPU, 2026-12-05)
    from facodegen.bench import runner as bench_runner

    monkeypatch.setattr(bench_runner, "run_cli_bench", lambda *a, **kw: pytest.fail("ran"))
    monkeypatch.setattr(fc, "gpu_available", lambda: (True, "fake GPU"))
    result = runner.invoke(cli.main, ["bench", "--arch", "sm90", "--head-dim", "128", *flags])
    assert result.exit_code == 2, result.output
    assert "--suite variants" in result.output and flags[0].split("-")[2] in result.output


def test_bench_matches_the_real_run_cli_bench_signature():
    import inspect

    from facodegen.bench import runner as bench_runner

    params = inspect.signature(bench_runner.run_cli_bench).parameters
    for name in ("seqlen", "batch", "heads", "seqlen_k", "heads_kv", "peers"):
        assert name in params


# ---- help ------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [[], ["emit"], ["inspect"], ["check"], ["bench"]])
def test_help_has_example(runner, command):
    result = invoke(runner, *command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output
    if command:
        for flag in ("--arch", "--head-dim", "--dtype", "--block-m", "--block-n", "--warps", "--stages",
                     "--causal", "--gpu", "--q-in-regs", "--pingpong", "--overlap", "--regs",
                     "--persistent", "--consumer-warpgroups"):
            assert flag in result.output


@pytest.mark.parametrize("broken", [False, True])
def test_check_falls_back_to_api_attention_and_reference(runner, monkeypatch, broken):
    """Without api.check_spec, check runs api.attention and compares with the float64 reference."""
    import sys
    import types

    import numpy as np

    from facodegen.verify import reference

    real_random = reference.random_qkv
    monkeypatch.setattr(reference, "random_qkv", lambda *a, xp=None, **kw: real_random(*a, xp=np, **kw))

    def fake_attention(q, k, v, causal, return_lse, **knobs):
        assert return_lse and knobs["arch"] == "sm80" and knobs["block_m"] == 128
        o, lse = reference.attention_reference(q, k, v, causal)
        return (np.zeros_like(o) if broken else o).astype(np.float16), lse.astype(np.float32)

    fake = types.ModuleType("facodegen.ops.api")
    fake.attention = fake_attention
    monkeypatch.setitem(sys.modules, "facodegen.ops.api", fake)
    monkeypatch.setattr(facodegen.ops, "api", fake)
    monkeypatch.setattr(fc, "gpu_available", lambda: (True, "fake GPU"))
    result = runner.invoke(cli.main, ["check", *SMALL, "--dtype", "fp16", "--causal", "--seqlen-q", "64",
                                      "--seqlen-k", "80", "--heads", "2", "--batch", "1"])
    assert result.exit_code == (1 if broken else 0), result.output
    assert ("FAIL" in result.output) == broken and "rel_fro" in result.output
