"""`facodegen precompile` and the compile cache's spec index, on the CPU."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from facodegen.runtime import compiler
from facodegen.cli import main, model_shapes
from facodegen.spec import KernelSpec

LLAMA_8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}


def test_model_shapes_read_heads_kv_heads_and_head_dim():
    shapes, dtype = model_shapes(LLAMA_8B, [512, 4096], batch=2)
    assert shapes == [(2, 512, 512, 32, 8, 128), (2, 4096, 4096, 32, 8, 128)] and dtype == "bf16"
    gemma = {"text_config": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                             "hidden_size": 2560, "torch_dtype": "float16"}}
    assert model_shapes(gemma, [100], 1) == ([(1, 100, 100, 8, 4, 256)], "fp16")
    with pytest.raises(click.BadParameter, match="num_attention_heads"):
        model_shapes({"hidden_size": 10}, [1], 1)


def test_precompile_compiles_once_then_finds_the_cache(fresh_cache, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}))
    args = ["precompile", "--config", str(config), "--seqlens", "256,300", "--arch", "sm80", "--no-causal"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "1 kernels for 2 shapes: 1 compiled, 0 already in the cache" in first.output
    compiler.clear_memo()
    second = CliRunner().invoke(main, args)
    assert "0 compiled, 1 already in the cache" in second.output, second.output


@pytest.mark.parametrize("args, words", [
    (["precompile"], "nothing to compile"),
    (["precompile", "--shape", "1,2,3"], "six positive integers"),
    (["precompile", "--shape", "1,128,128,8,8,84"], "multiple of 8"),
])
def test_precompile_bad_input_is_one_clear_line(args, words):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and words in result.output, result.output


def test_the_spec_index_finds_a_kernel_without_rendering(fresh_cache, monkeypatch):
    """A new process (an empty memo) finds a compiled spec's cubin through the index: render.emit
    is never called, and the kernel is the same cubin."""
    spec = KernelSpec(arch="sm80", head_dim=64, dtype="fp16")
    first = compiler.compile(spec, verbose=False)
    compiler.clear_memo()
    from facodegen.codegen import render

    def no_render(*args, **kwargs):
        raise AssertionError("rendered")

    monkeypatch.setattr(render, "emit", no_render)
    again = compiler.compile(spec, verbose=False)
    assert again.from_cache and again.cubin == first.cubin and again.source == first.source
    # another spec, or the same spec with other templates, is not found by the index
    monkeypatch.setattr(compiler, "_templates_digest", "other templates")
    compiler.clear_memo()
    with pytest.raises(AssertionError, match="rendered"):
        compiler.compile(spec, verbose=False)


def test_a_patched_rendering_with_the_spec_index_off_is_compiled_and_not_indexed(fresh_cache, monkeypatch):
    """scripts/lab's patch_ab, trace_steps and count_events replace render.emit with a patched
    rendering and turn compiler.spec_index off: compile() then builds the patched source although
    the plain spec is in the index, and writes nothing there, so the plain kernel is still what a
    later compile finds."""
    from facodegen.codegen import render
    spec = KernelSpec(arch="sm80", head_dim=64, dtype="fp16")
    plain = compiler.compile(spec, verbose=False)
    plain_emit = render.emit
    compiler.clear_memo()
    monkeypatch.setattr(render, "emit", lambda s: plain_emit(s) + "\n// patched\n")
    monkeypatch.setattr(compiler, "spec_index", False)
    patched = compiler.compile(spec, verbose=False)
    assert patched.source == plain.source + "\n// patched\n"
    monkeypatch.setattr(render, "emit", plain_emit)
    monkeypatch.setattr(compiler, "spec_index", True)
    compiler.clear_memo()
    again = compiler.compile(spec, verbose=False)
    assert again.from_cache and again.source == plain.source


def test_nvrtc_identity_needs_no_nvrtc_load_with_the_pip_package():
    ident = compiler.nvrtc_identity()
    package = compiler._pip_nvrtc_version()
    if package is None:
        pytest.skip("NVRTC is not the pip package here")
    assert ident == f"{'.'.join(package.split('.')[:2])} (nvidia-cuda-nvrtc {package})"


def test_the_spec_index_key_follows_the_rendering_code(monkeypatch, tmp_path):
    """A change to the Python that renders (not only the templates) is a new index key: a stale
    entry can never hand out a kernel the current code would not emit."""
    from facodegen.runtime import compiler as c
    spec = KernelSpec(arch="sm80", head_dim=64)
    options = c.NVRTC_OPTIONS("sm80")
    before = c._spec_index_key(spec, options)
    fake = tmp_path / "pkg"
    fake.mkdir()
    for name in c._RENDERING_MODULES:
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_bytes((c._PACKAGE_DIR / name).read_bytes())
    render = fake / "codegen" / "render.py"
    render.write_bytes(render.read_bytes() + b"\n# changed\n")
    monkeypatch.setattr(c, "_PACKAGE_DIR", fake)
    monkeypatch.setattr(c, "_templates_digest", None)
    assert c._spec_index_key(spec, options) != before
