"""Shared test setup.

* Every test session gets its own compile cache (``FACODEGEN_CACHE_DIR`` in a temp dir), so
  tests never read or write the user's cache and kernels compiled by one test are disk hits
  for the next (plus the in-process memo).
* ``@pytest.mark.gpu`` tests are skipped, with the reason from
  ``facodegen.compiler.gpu_available()``, where no CUDA GPU is found. ``requires_gpu`` is the
  same marker under a readable name: ``from conftest import requires_gpu`` is not needed,
  just use ``@pytest.mark.gpu``.
"""

from __future__ import annotations

import os

import pytest

requires_gpu = pytest.mark.gpu


def pytest_configure(config):
    if "FACODEGEN_CACHE_DIR" not in os.environ or not os.environ.get("FACODEGEN_KEEP_TEST_CACHE"):
        # set before any test module imports facodegen.compiler and compiles
        import tempfile

        root = tempfile.mkdtemp(prefix="facodegen-test-cache-")
        config._facodegen_cache = root
        os.environ["FACODEGEN_CACHE_DIR"] = root


def pytest_unconfigure(config):
    root = getattr(config, "_facodegen_cache", None)
    if root:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    from facodegen.compiler import gpu_available

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
    from facodegen import compiler as fc

    root = tmp_path / "cache"
    monkeypatch.setenv("FACODEGEN_CACHE_DIR", str(root))
    fc.clear_memo()
    yield root
    fc.clear_memo()
