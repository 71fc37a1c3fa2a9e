"""scripts/lab.py, the lab probes' entry point, on the CPU: `--help` lists every subcommand with
its description, and every subcommand's `--help` works without torch, CuPy or FlashAttention-3
(a probe imports those inside main, never at its top)."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "scripts" / "lab.py"

# Runs a script with torch, cupy and flash_attn_interface unimportable, as on a machine without them.
WITHOUT_GPU_PACKAGES = """
import importlib.abc, runpy, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "cupy", "flash_attn_interface"):
            raise ImportError(f"{name} is blocked: --help must not need it")
sys.meta_path.insert(0, Blocked())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _dispatcher():
    spec = importlib.util.spec_from_file_location("lab_dispatcher", LAB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUBCOMMANDS = _dispatcher().SUBCOMMANDS


def _lab(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, "-c", WITHOUT_GPU_PACKAGES, str(LAB), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def _words(text: str) -> str:
    return " ".join(text.split())


def test_help_lists_every_subcommand_with_its_description():
    done = _lab("--help")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name, (module, where, what) in SUBCOMMANDS.items():
        assert any(line.split()[:2] == [name, where] and _words(what) in _words(line) for line in lines if line.strip()), \
            name
        assert (ROOT / "scripts" / "lab" / f"{module}.py").is_file(), module
    # every module of scripts/lab/ is a subcommand
    modules = {module for module, _, _ in SUBCOMMANDS.values()}
    assert {p.stem for p in (ROOT / "scripts" / "lab").glob("*.py")} == modules


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_shows_its_help_without_gpu_packages(name):
    """`lab.py NAME --help`: exit 0, the usage line names the subcommand, and the probe's own
    description (its docstring's first line) is printed."""
    module = SUBCOMMANDS[name][0]
    doc = ast.get_docstring(ast.parse((ROOT / "scripts" / "lab" / f"{module}.py").read_text()))
    assert doc, f"scripts/lab/{module}.py has no docstring"
    done = _lab(name, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: lab.py {name} "), done.stdout[:200]
    assert _words(doc.splitlines()[0]) in _words(done.stdout)


def test_a_module_name_works_and_an_unknown_name_is_refused_with_a_suggestion():
    done = _lab("trace_steps", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: lab.py trace-steps "), done.stderr
    done = _lab("sweeep")
    assert done.returncode == 2 and "did you mean sweep?" in done.stderr
    assert _lab().returncode == 2


def test_ab_trees_runs_each_trees_own_sweep(tmp_path):
    """ab-trees runs scripts/lab/sweep.py from this tree, and scripts/sweep.py from an old tree that
    predates scripts/lab/."""
    spec = importlib.util.spec_from_file_location("ab_trees", ROOT / "scripts" / "lab" / "ab_trees.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    assert ab.sweep_script(ROOT) == ROOT / "scripts" / "lab" / "sweep.py"
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "sweep.py").write_text("")
    assert ab.sweep_script(tmp_path) == tmp_path / "scripts" / "sweep.py"
    with pytest.raises(SystemExit, match="neither"):
        ab.sweep_script(tmp_path / "nowhere")


def test_sass_ab_compares_instructions_not_addresses():
    """sass-ab's instruction list: the instruction text in order, the address comments dropped and the
    targets of branches replaced, so a kernel that moved but did not change compares equal, and one
    whose instruction changed does not."""
    sys.path.insert(0, str(ROOT / "scripts" / "lab"))
    try:
        from sass_ab import instructions
    finally:
        sys.path.remove(str(ROOT / "scripts" / "lab"))
    one = ("        /*0040*/                   FFMA R1, R2, R3, R4 ;      /* 0x000fe20000000004 */\n"
           "        /*0050*/               @P0 BRA 0x120 ;                /* 0x000fea0003800000 */\n")
    moved = one.replace("0040", "0840").replace("0050", "0850").replace("0x120", "0x920")
    changed = one.replace("FFMA R1, R2, R3, R4", "FADD R1, R2, R3")
    assert instructions(one) == ["FFMA R1, R2, R3, R4", "@P0 BRA X"]
    assert instructions(moved) == instructions(one)
    assert instructions(changed) != instructions(one)


@pytest.mark.parametrize("patch", sorted((ROOT / "scripts" / "lab" / "patches").glob("sm80_bwd_*.patch")),
                         ids=lambda p: p.stem)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_the_shipped_backward_patches_apply_to_the_rendered_kernels(patch, head_dim):
    """scripts/lab/patches/sm80_bwd_*.patch (bwd-patch-ab's experiments) still find their text in the sm80
    backward's default kernel at every head_dim and change it; a template edit that moves it fails here, not
    on the device."""
    sys.path.insert(0, str(ROOT / "scripts" / "lab"))
    try:
        from bwd_patch_ab import emitters
    finally:
        sys.path.remove(str(ROOT / "scripts" / "lab"))
    from facodegen.spec.backward import BackwardSpec
    found = emitters([str(patch)])
    spec = BackwardSpec(head_dim=head_dim, gpu="h100")
    plain, patched = found["plain"](spec), found[patch.name](spec)
    assert patched != plain and "patched" in patched
