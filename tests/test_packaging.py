"""The built package ships its templates: install it (not editable) into a fresh venv and run
the console script from another folder.

The venv sees the running environment's dependencies (jinja2, click, cupy, setuptools) through
a .pth file, but not its (possibly editable) facodegen: a .pth's lines are only added to
sys.path, the editable finder in that site-packages is never imported. Offline: no build
isolation, no dependency downloads.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import facodegen

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _copy_repo(dest: Path) -> Path:
    """The files a build needs, outside the checkout (pip builds in-tree: build/, *.egg-info)."""
    src = dest / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "setup.py", "setup.cfg", "MANIFEST.in"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "facodegen", src / "facodegen", ignore=ignore)
    shutil.copytree(REPO / "templates", src / "templates", ignore=ignore)
    return src


def _can_build_offline(py: Path) -> bool:
    """setuptools can build a wheel without downloads: it has bdist_wheel (>= 70.1) or `wheel`."""
    probe = ("import setuptools, importlib.util as u; "
             "v = tuple(int(x) for x in setuptools.__version__.split('.')[:2]); "
             "raise SystemExit(0 if v >= (70, 1) or u.find_spec('wheel') else 1)")
    return subprocess.run([str(py), "-c", probe], capture_output=True).returncode == 0


def test_wheel_ships_templates_and_cli(tmp_path):
    src = _copy_repo(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / "bin"
    py = bin_dir / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    Path(purelib, "zz_facodegen_test_deps.pth").write_text("\n".join(deps) + "\n")

    if _can_build_offline(py):
        flags = ["--no-build-isolation", "--no-index"]
    else:  # setuptools < 70.1 without `wheel`: let pip fetch the build backend
        flags = []
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", *flags, str(src)],
                   check=True, cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = subprocess.run([str(py), "-c", "import facodegen, facodegen.codegen.render as r; "
                            "print(facodegen.__file__); print(r.template_dir())"],
                           check=True, capture_output=True, text=True, cwd=elsewhere, env=env).stdout.split()
    assert Path(where[0]).is_relative_to(venv), where   # the installed copy, not the checkout
    assert Path(where[1]) == Path(where[0]).parent / "templates"
    # the subpackages ship too (each must be listed under [tool.setuptools] packages)
    bench = subprocess.run([str(py), "-c", "import facodegen.bench.runner, facodegen.bench.plot as p; print(p.__file__)"],
                           check=True, capture_output=True, text=True, cwd=elsewhere, env=env).stdout.strip()
    assert Path(bench) == Path(where[0]).parent / "bench" / "plot.py"

    done = subprocess.run([str(bin_dir / "facodegen"), "emit", "--arch", "sm80"], capture_output=True,
                          text=True, cwd=elsewhere, env=env)
    assert done.returncode == 0, done.stderr
    spec = facodegen.KernelSpec(arch="sm80")
    assert done.stdout.startswith("// ====")
    assert spec.variant in done.stdout
    assert "__global__" in done.stdout and f"{spec.variant}(" in done.stdout


def test_a_plain_install_brings_what_inspect_sass_runs():
    """`pip install .` (no extras) installs cuobjdump and the nvdisasm it calls."""
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    assert {"nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"} <= names
