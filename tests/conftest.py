"""Shared test setup.

* Every test session gets its own compile cache (``FACODEGEN_CACHE_DIR`` in a temp dir), so
  tests never read or write the user's cache and kernels compiled by one test are disk hits
  for the next (plus the in-process memo). Under pytest-xdist (``-n auto``) the workers share
  the controller's one: a kernel that tests on two workers compile is compiled once (the
  compiler's per-entry lock makes the second worker wait for the first's entry).
* ``cuobjdump`` output (SASS, resource usage) is a function of the cubin's bytes: the session
  keeps it by the cubin's sha256 in ``<cache>/.test-cuobjdump`` and every worker reuses it, also
  across ``clear_memo()`` (which drops the CompiledKernel objects that held it) and in tests
  whose ``fresh_cache`` compiles a kernel again. A hit still looks for cuobjdump first, so a
  missing tool raises as before.
* ``@pytest.mark.gpu`` tests are skipped, with the reason from
  ``facodegen.runtime.compiler.gpu_available()``, where no CUDA GPU is found. ``requires_gpu`` is the
  same marker under a readable name: ``from conftest import requires_gpu`` is not needed,
  just use ``@pytest.mark.gpu``.
"""

from __future__ import annotations

import os

import pytest

requires_gpu = pytest.mark.gpu


_SESSION_CACHE = "_FACODEGEN_TEST_SESSION_CACHE"   # the controller's cache dir, for xdist workers


def pytest_configure(config):
    shared = os.environ.get(_SESSION_CACHE)
    if os.environ.get("PYTEST_XDIST_WORKER") and shared and os.environ.get("FACODEGEN_CACHE_DIR") == shared:
        pass    # an xdist worker: the controller made the session's cache (and removes it)
    elif "FACODEGEN_CACHE_DIR" not in os.environ or not os.environ.get("FACODEGEN_KEEP_TEST_CACHE"):
        # set before any test module imports facodegen.runtime.compiler and compiles
        import tempfile

        root = tempfile.mkdtemp(prefix="facodegen-test-cache-")
        config._facodegen_cache = root
        os.environ["FACODEGEN_CACHE_DIR"] = root
        os.environ[_SESSION_CACHE] = root       # inherited by the xdist workers started after this
    _share_cuobjdump(os.environ["FACODEGEN_CACHE_DIR"])


def _share_cuobjdump(root: str) -> None:
    """Wrap facodegen.runtime.compiler._cuobjdump with a disk cache keyed by the cubin's sha256 and the flag
    (a file read: holding every kernel's SASS in memory too would double what the memo holds)."""
    import hashlib
    from pathlib import Path

    from facodegen.runtime import compiler as fc
    from facodegen.runtime.files import atomic_write

    run = fc._cuobjdump
    folder = Path(root) / ".test-cuobjdump"

    def cached(cubin: bytes, flag: str, name: str) -> str:
        fc.cuobjdump_path()     # a missing tool raises ToolNotFoundError, cached or not
        path = folder / f"{hashlib.sha256(cubin).hexdigest()}{flag}-{name}.txt"
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            pass
        text = run(cubin, flag, name)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(path, text.encode("utf-8"))
        except OSError:
            pass    # a read-only cache: the next call runs cuobjdump again
        return text

    fc._cuobjdump = cached


def pytest_unconfigure(config):
    root = getattr(config, "_facodegen_cache", None)
    if root:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    from facodegen.runtime.compiler import gpu_available

    ok, reason = gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_root() -> str:
    """The session's compile cache folder."""
    return os.environ["FACODEGEN_CACHE_DIR"]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache dir and an empty in-process memo for one test."""
    from facodegen.runtime import compiler as fc

    root = tmp_path / "cache"
    monkeypatch.setenv("FACODEGEN_CACHE_DIR", str(root))
    fc.clear_memo()
    yield root
    fc.clear_memo()
