"""NVRTC -> cubin for the exact target (sm_80, sm_90a), an on-disk cache, and a resource report.

``compile(spec)`` renders the spec and hands the source to ``compile_source``, which

1. looks in an in-process memo, then in the disk cache, for an entry keyed by
   sha256(source, NVRTC options, NVRTC version, facodegen version);
2. otherwise compiles with NVRTC (through CuPy's binding; the cubin itself is read with
   ``nvrtcGetCUBINSize``/``nvrtcGetCUBIN`` through ctypes on the same libnvrtc, because
   CuPy's ``getCUBIN`` returns it one byte short) and stores the entry atomically.

Everything here works on a machine without a GPU except ``CompiledKernel.function()``.
``sass()`` runs ``cuobjdump -sass``, which needs nvdisasm: pip packages nvidia-cuda-cuobjdump
and nvidia-cuda-nvdisasm (found in ``<site-packages>/nvidia/cu13/bin``, $CUDA_HOME/bin or PATH).

Cache layout: ``<root>/<name>-<hash16>.cubin`` plus a ``.json`` sidecar (log, resources,
versions, sha256 of the cubin). ``root`` is ``$FACODEGEN_CACHE_DIR``, else
``$XDG_CACHE_HOME/facodegen``, else ``~/.cache/facodegen``. Both files are written to a
temporary file in the same folder and moved into place with ``os.replace``, so a reader sees
an old entry or a whole new one; a sidecar whose cubin hash does not match (a torn pair from
two writers, a truncated file) is treated as a miss and rebuilt. Processes that miss the same
entry at once compile it once: each takes ``<root>/.locks/<entry>.lock`` (filelock, released by
the OS if its holder dies) and looks again before compiling.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .. import __version__
from .files import atomic_write

# ---------------------------------------------------------------------------------------------
# Targets and options
# ---------------------------------------------------------------------------------------------

# spec arch -> (real target for the cubin, virtual target for PTX). sm_90a, not sm_90: wgmma and
# setmaxnreg exist only on the arch-specific target.
_TARGETS = {"sm80": ("sm_80", "compute_80"), "sm90": ("sm_90a", "compute_90a")}
_ARCH_ALIASES = {"sm80": "sm80", "sm_80": "sm80", "sm90": "sm90", "sm_90": "sm90",
                 "sm90a": "sm90", "sm_90a": "sm90"}

# cuobjdump's SHARED of an sm_90a kernel with static shared memory is ptxas's figure + 1 KB.
SM90_RESERVED_SMEM = 1024

# Instructions whose counts `facodegen inspect --sass` summarises (and SASS tests assert on).
KEY_INSTRUCTIONS = ("HMMA", "HGMMA", "QGMMA", "LDSM", "STSM", "SHFL", "LDGSTS", "UTMALDG", "UTMASTG",
                    "USETMAXREG", "LDL", "STL")


def normalize_arch(arch: str) -> str:
    """'sm80' / 'sm_80' -> 'sm80'; 'sm90' / 'sm_90' / 'sm_90a' -> 'sm90'."""
    try:
        return _ARCH_ALIASES[arch]
    except KeyError:
        raise ValueError(f"arch: {arch!r} is not supported; choose one of sm80, sm90") from None


def target(arch: str, sm: str | None = None) -> str:
    """The real GPU target NVRTC compiles for: sm_80 or sm_90a by default.

    ``sm`` runs sm80 code on a newer GPU: a cubin's machine code only loads on its own major
    version, so the mma.sync kernel is compiled for the GPU at hand (e.g. ``sm_90`` on an H200)."""
    arch = normalize_arch(arch)
    if sm is None or sm == _TARGETS[arch][0]:
        return _TARGETS[arch][0]
    if arch == "sm90" or not sm.startswith("sm_") or not sm[3:].isdigit() or int(sm[3:]) < 80:
        raise ValueError(f"target sm={sm!r} cannot run arch={arch} code; sm90 code needs sm_90a, "
                         f"sm80 code needs sm_80 or newer (e.g. sm_86, sm_90)")
    return sm


def NVRTC_OPTIONS(arch: str, sm: str | None = None) -> tuple[str, ...]:  # noqa: N802 (a constant-like table)
    """NVRTC options of a kernel for ``arch`` (sm80 -> sm_80, sm90 -> sm_90a; ``sm`` overrides)."""
    return (f"--gpu-architecture={target(arch, sm)}", "-std=c++17", "-Xptxas=-v", "--use_fast_math",
            "-DNDEBUG", "-lineinfo")


def _ptx_options(arch: str, options: Sequence[str]) -> tuple[str, ...]:
    virtual = _TARGETS[normalize_arch(arch)][1]
    return tuple(f"--gpu-architecture={virtual}" if o.startswith("--gpu-architecture=") else o
                 for o in options if o != "-Xptxas=-v")


# ---------------------------------------------------------------------------------------------
# Errors and results
# ---------------------------------------------------------------------------------------------

class CompileError(RuntimeError):
    """NVRTC rejected the source. The message is the NVRTC log with the generated source lines
    around every ``<name>.cu(N): error`` line, and how to get the whole file."""

    def __init__(self, name: str, arch: str, log: str, source: str, hint: str | None = None):
        self.name, self.arch, self.log, self.source = name, arch, log, source
        if hint is None:
            hint = (f"run `facodegen emit <the same flags> -o {name}.cu` to see the whole generated "
                    f"file (line numbers above are lines of that file)")
        super().__init__(annotate_log(log, source, f"{name}.cu") + "\n" + hint)


@dataclass(frozen=True)
class Resources:
    """Per-kernel resources from ptxas's ``-v`` report (bytes unless said otherwise)."""
    registers: int = 0          # 32-bit registers per thread
    shared_bytes: int = 0       # static shared memory (dynamic comes from spec.smem_bytes)
    stack_bytes: int = 0        # stack frame (local memory per thread)
    spill_stores: int = 0
    spill_loads: int = 0
    barriers: int = 0           # named barriers used

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, eq=False)
class CompiledKernel:
    """One compiled kernel: the cubin, NVRTC's log and what ptxas reported about it.

    ``sass()``, ``ptx()`` and ``function()`` are computed on first use and kept."""
    name: str
    arch: str                   # "sm80" | "sm90"
    source: str
    cubin: bytes
    log: str
    resources: Resources
    warnings: list[str]
    options: tuple[str, ...] = ()
    key: str = ""
    from_cache: bool = False
    _lazy: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def target(self) -> str:
        for option in self.options:
            if option.startswith("--gpu-architecture="):
                return option.split("=", 1)[1]
        return target(self.arch)

    def sass(self) -> str:
        """The SASS, from ``cuobjdump -sass`` (works without a GPU)."""
        if "sass" not in self._lazy:
            self._lazy["sass"] = _cuobjdump(self.cubin, "-sass", self.name)
        return self._lazy["sass"]

    def sass_counts(self) -> dict[str, int]:
        """How many of each of KEY_INSTRUCTIONS the SASS has (see ``count_instructions``)."""
        return count_instructions(self.sass())

    def cuobjdump_resources(self) -> dict[str, int]:
        """REG / STACK / SHARED / LOCAL of this kernel from ``cuobjdump --dump-resource-usage``."""
        if "cuobjdump_resources" not in self._lazy:
            text = _cuobjdump(self.cubin, "--dump-resource-usage", self.name)
            self._lazy["cuobjdump_resources"] = parse_resource_usage(text).get(self.name, {})
        return self._lazy["cuobjdump_resources"]

    def cross_check(self) -> list[str]:
        """Where ptxas's log and ``cuobjdump --dump-resource-usage`` disagree ([] = they agree).

        On sm_90a the cubin's SHARED includes the 1 KB per CTA the system reserves whenever the
        kernel uses shared memory: static (ptxas counts it) or only dynamic (ptxas says 0, as for the
        decode kernel), so a kernel with no static shared memory may show 0 or that 1 KB."""
        usage = self.cuobjdump_resources()
        r = self.resources
        shared = {r.shared_bytes}
        if self.arch == "sm90":
            shared = {r.shared_bytes + SM90_RESERVED_SMEM} | ({0} if r.shared_bytes == 0 else set())
        found = [f"{k}: cuobjdump {usage.get(k)}, ptxas {v}"
                 for k, v in (("REG", r.registers), ("STACK", r.stack_bytes)) if usage.get(k) != v]
        if usage.get("SHARED") not in shared:
            found.append(f"SHARED: cuobjdump {usage.get('SHARED')}, ptxas {r.shared_bytes}")
        return found

    def ptx(self) -> str:
        """The PTX (NVRTC again for compute_80 / compute_90a with the same options)."""
        if "ptx" not in self._lazy:
            self._lazy["ptx"] = _nvrtc_compile(self.source, self.name,
                                               _ptx_options(self.arch, self.options), want="ptx")[0]
        return self._lazy["ptx"]

    def function(self):
        """The ``cupy.cuda.Function`` of this kernel in the current device's context (GPU only)."""
        import cupy

        device = cupy.cuda.Device().id
        cached = self._lazy.get(("function", device))
        if cached is None:
            module = cupy.cuda.Module()
            module.load(self.cubin)
            cached = (module, module.get_function(self.name))
            self._lazy[("function", device)] = cached
        return cached[1]


# ---------------------------------------------------------------------------------------------
# Log parsing
# ---------------------------------------------------------------------------------------------

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, Resources]:
    """Resources of every entry function in a ``-Xptxas=-v`` log, by function name."""
    found: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = _ENTRY.search(line) or _PROPS.search(line)
        if m:
            current = found.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        if m := _STACK.search(line):
            current.update(stack_bytes=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        if m := _USED.search(line):
            current["registers"] = int(m[1])
            for pattern, key in ((_BARRIERS, "barriers"), (_SMEM, "shared_bytes")):
                if m := pattern.search(line):
                    current[key] = int(m[1])
    return {name: Resources(**values) for name, values in found.items()}


def ptxas_warnings(log: str) -> list[str]:
    """ptxas's warning lines (e.g. C7508/C7509/C7510/C7511/C7515 wgmma/setmaxnreg notes), and its
    "Potential Performance Loss" notes, which it prints as info (C7514: wgmma serialized)."""
    return [line.strip() for line in log.splitlines()
            if line.lstrip().startswith("ptxas warning") or "Potential Performance Loss" in line]


def annotate_log(log: str, source: str, filename: str, context: int = 3) -> str:
    """The log with the source lines around each ``filename(N): error`` line, numbered."""
    lines = source.splitlines()
    pattern = re.compile(re.escape(filename) + r"\((\d+)\): (?:catastrophic )?error")
    out = []
    for line in log.rstrip("\x00").rstrip().splitlines():
        out.append(line)
        m = pattern.match(line.strip())
        if m:
            n = int(m[1])
            lo, hi = max(n - context, 1), min(n + context, len(lines))
            for i in range(lo, hi + 1):
                out.append(f"    {'>' if i == n else ' '}{i:6d} | {lines[i - 1]}")
    return "\n".join(out)


_RESOURCE_FN = re.compile(r"^\s*Function (\S+):\s*$")
_RESOURCE_KV = re.compile(r"([A-Z_\[\]0-9]+):(\d+)")


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``cuobjdump --dump-resource-usage`` output -> {function: {"REG": .., "STACK": .., ...}}."""
    result, current = {}, None
    for line in text.splitlines():
        if m := _RESOURCE_FN.match(line):
            current = result.setdefault(m[1], {})
        elif current is not None and "REG:" in line:
            current.update({k: int(v) for k, v in _RESOURCE_KV.findall(line)})
    return result


_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def count_instructions(sass: str, names: Sequence[str] = KEY_INSTRUCTIONS) -> dict[str, int]:
    """Count SASS instructions by opcode (the part before the first '.'), for ``names``."""
    counts = dict.fromkeys(names, 0)
    for m in _SASS_OP.finditer(sass):
        if m[1] in counts:
            counts[m[1]] += 1
    return counts


# ---------------------------------------------------------------------------------------------
# NVRTC
# ---------------------------------------------------------------------------------------------

_libnvrtc = None


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc  # light: no CUDA driver, no cupy import

    return nvrtc


def _ctypes_nvrtc():
    """The libnvrtc CuPy has loaded, opened again through ctypes (RTLD_NOLOAD: the same copy)."""
    global _libnvrtc
    if _libnvrtc is None:
        _nvrtc().getVersion()  # make sure CuPy has loaded it
        lib = None
        for soname in _loaded_nvrtc_names():
            try:
                lib = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
                break
            except OSError:
                continue
        if lib is None:
            raise RuntimeError("facodegen: cannot find the libnvrtc CuPy loaded (needed for nvrtcGetCUBIN)")
        lib.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetCUBIN.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        _libnvrtc = lib
    return _libnvrtc


def _loaded_nvrtc_names() -> list[str]:
    names = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "libnvrtc." in os.path.basename(path) and "builtins" not in path and path not in names:
                    names.append(path)
    except OSError:
        pass
    major = nvrtc_version()[0]
    return names + [f"libnvrtc.so.{major}", "libnvrtc.so"]


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


_nvrtc_id = None


def nvrtc_identity() -> str:
    """NVRTC's version for the cache key: the library's major.minor, plus the pip package's
    full version where NVRTC comes from pip (13.0.48 and 13.0.88 may emit different code).
    With the pip package, read from its dist-info folder alone: loading libnvrtc to ask it
    takes ~0.15 s, which a process that only reads the compile cache should not pay."""
    global _nvrtc_id
    if _nvrtc_id is None:
        package = _pip_nvrtc_version()
        if package is not None:
            major, minor = package.split(".")[:2]
            _nvrtc_id = f"{major}.{minor} (nvidia-cuda-nvrtc {package})"
        else:
            major, minor = nvrtc_version()
            _nvrtc_id = f"{major}.{minor}"
    return _nvrtc_id


def _pip_nvrtc_version() -> str | None:
    """The version of the first nvidia-cuda-nvrtc dist-info on sys.path (importlib.metadata's
    answer, without importing it), or None."""
    prefix = "nvidia_cuda_nvrtc-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith(prefix) and name.endswith(".dist-info"):
                return name[len(prefix):-len(".dist-info")]
    return None


def _nvrtc_compile(source: str, name: str, options: Sequence[str], want: str = "cubin") -> tuple:
    """(cubin or PTX, log). Raises CompileError with the annotated log on failure."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, f"{name}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, tuple(options))
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            arch = next((o.split("=", 1)[1] for o in options if o.startswith("--gpu-architecture=")), "?")
            raise CompileError(name, arch, log, source) from None
        log = nvrtc.getProgramLog(prog).rstrip("\x00")
        if want == "ptx":
            ptx = nvrtc.getPTX(prog)
            if isinstance(ptx, bytes):
                ptx = ptx.decode()
            return ptx.rstrip("\x00"), log
        lib = _ctypes_nvrtc()
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return buf.raw, log
    finally:
        nvrtc.destroyProgram(prog)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with NVRTC status {status}")


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------

_PACKAGE_DIR = Path(__file__).resolve().parents[1]     # facodegen/


def cache_dir() -> Path:
    """``$FACODEGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/facodegen``, else ``~/.cache/facodegen``."""
    root = os.environ.get("FACODEGEN_CACHE_DIR")
    if root:
        path = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "facodegen"
    resolved = path.resolve()
    if resolved == _PACKAGE_DIR or _PACKAGE_DIR in resolved.parents:
        raise RuntimeError(f"facodegen: the cache dir {resolved} is inside the package; set FACODEGEN_CACHE_DIR")
    return path


def cache_key(source: str, options: Sequence[str]) -> str:
    """sha256 of exactly what determines the cubin: source, options, NVRTC, facodegen."""
    h = hashlib.sha256()
    for part in (source, "\0".join(options), nvrtc_identity(), __version__):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _entry_paths(root: Path, name: str, key: str) -> tuple[Path, Path]:
    stem = f"{name}-{key[:16]}"
    return root / f"{stem}.cubin", root / f"{stem}.json"


def _load_entry(root: Path, name: str, arch: str, source: str, options: tuple, key: str):
    cubin_path, meta_path = _entry_paths(root, name, key)
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
        if (meta.get("key") != key or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest()
                or meta.get("cubin_size") != len(cubin)):
            return None
        return CompiledKernel(name=name, arch=arch, source=source, cubin=cubin, log=meta["log"],
                              resources=Resources(**meta["resources"]), warnings=list(meta["warnings"]),
                              options=options, key=key, from_cache=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, truncated or foreign: rebuild


def _remove_stale_temporaries(root: Path, age_s: float = 3600.0) -> None:
    """Temporary files a crashed writer left behind (an hour old: no live writer is that slow)."""
    import time

    now = time.time()
    for tmp in root.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > age_s:
                tmp.unlink()
        except OSError:
            pass


def _store_entry(root: Path, kernel: CompiledKernel) -> None:
    cubin_path, meta_path = _entry_paths(root, kernel.name, kernel.key)
    meta = {
        "name": kernel.name, "arch": kernel.arch, "key": kernel.key, "options": list(kernel.options),
        "nvrtc": nvrtc_identity(), "facodegen": __version__,
        "cubin_size": len(kernel.cubin), "cubin_sha256": hashlib.sha256(kernel.cubin).hexdigest(),
        "resources": kernel.resources.as_dict(), "warnings": kernel.warnings, "log": kernel.log,
    }
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)
        atomic_write(cubin_path, kernel.cubin)
        atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    except OSError as err:  # a read-only or full cache costs a recompile next time, nothing else
        _say(f"facodegen: warning: cannot write the compile cache in {root}: {err}")


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

_memo: dict[tuple[str, str], CompiledKernel] = {}   # (name, key) -> kernel
_spec_memo: dict = {}
# compile()'s spec index maps a spec to the cubin of its plain rendering. Code that compiles a spec
# from other source (scripts/lab's patch_ab, trace_steps and count_events replace render.emit with
# a patched rendering) sets this False, so a patched kernel is neither taken from the index (it
# would be the plain one) nor written into it (a later plain compile would load the patched one).
spec_index = True


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet() -> bool:
    return os.environ.get("FACODEGEN_QUIET", "") not in ("", "0")


def compile_source(source: str, arch: str, name: str, *, extra_options: Sequence[str] = (),
                   cache: bool = True, verbose: bool | None = None, sm: str | None = None) -> CompiledKernel:
    """Compile CUDA ``source`` whose ``extern "C"`` kernel is ``name`` for ``arch`` to a cubin.

    Memoised in-process and cached on disk (see the module docstring); ``cache=False`` skips
    both. ``verbose`` (default: unless ``FACODEGEN_QUIET=1``) prints one line before a cold
    compile. Raises CompileError with the annotated NVRTC log."""
    arch = normalize_arch(arch)
    options = NVRTC_OPTIONS(arch, sm) + tuple(extra_options)
    key = cache_key(source, options)
    if not cache:
        return _compile_now(source, arch, name, options, key, verbose, sm)
    hit = _memo.get((name, key))
    if hit is not None:
        return hit
    root = cache_dir()
    hit = _load_entry(root, name, arch, source, options, key)
    if hit is None:
        # One compile per entry across processes: the others wait, then read what it stored.
        with _entry_lock(root, name, key):
            hit = _load_entry(root, name, arch, source, options, key)
            if hit is None:
                hit = _compile_now(source, arch, name, options, key, verbose, sm)
                _store_entry(root, hit)
    _memo[(name, key)] = hit
    return hit


def _entry_lock(root: Path, name: str, key: str):
    """An exclusive lock on one cache entry, held while it is compiled (filelock: flock(2), which
    the OS releases when its holder dies, so a killed compile leaves no lock behind). Without a
    writable cache there is nothing to share: no lock."""
    import contextlib

    import filelock

    locks = root / ".locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError:
        return contextlib.nullcontext()
    return filelock.FileLock(str(locks / f"{name}-{key[:16]}.lock"))


def _compile_now(source: str, arch: str, name: str, options: tuple, key: str, verbose: bool | None,
                 sm: str | None) -> CompiledKernel:
    """NVRTC, now (no cache)."""
    if verbose if verbose is not None else not _quiet():
        _say(f"facodegen: compiling {name} for {target(arch, sm)} ...")
    cubin, log = _nvrtc_compile(source, name, options)
    per_function = parse_ptxas_log(log)
    resources = per_function.get(name) or next(iter(per_function.values()), Resources())
    return CompiledKernel(name=name, arch=arch, source=source, cubin=cubin, log=log,
                          resources=resources, warnings=ptxas_warnings(log), options=options, key=key)


def compile(spec, *, verbose: bool | None = None, sm: str | None = None) -> CompiledKernel:  # noqa: A001
    """Render ``spec`` (facodegen.codegen.render.emit) and compile it; the kernel symbol is spec.variant.
    ``sm`` picks another real target for sm80 code (see :func:`target`).

    A spec compiled before (by any process) is found through the spec index without rendering
    it: ``<cache>/index/<variant>-<hash>.json`` names the cubin entry, the hash being of the spec's
    fields, the NVRTC options, the bytes of the templates and of the modules that render them,
    NVRTC's and facodegen's versions. With the module's ``spec_index`` False it renders (through
    whatever render.emit is then) and leaves the index alone."""
    hit = _spec_memo.get((spec, sm))
    if hit is not None:
        return hit
    from ..codegen.render import emit, emit_command

    options = NVRTC_OPTIONS(spec.arch, sm)
    index = cache_dir() / "index" / f"{spec.variant}-{_spec_index_key(spec, options)[:16]}.json"
    kernel = _from_index(index, spec, options) if spec_index else None
    if kernel is None:
        try:
            kernel = compile_source(emit(spec), spec.arch, spec.variant, verbose=verbose, sm=sm)
        except CompileError as err:
            hint = (f"the whole generated file: `{emit_command(spec)} -o {spec.variant}.cu` "
                    f"(line numbers above are lines of that file)")
            raise CompileError(err.name, err.arch, err.log, err.source, hint=hint) from None
        try:
            if spec_index:
                index.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(index, json.dumps({"name": kernel.name, "key": kernel.key, "source": kernel.source}).encode())
        except OSError:
            pass    # a read-only or full cache: the next process renders again, nothing else
    _spec_memo[(spec, sm)] = kernel
    return kernel


def _from_index(index: Path, spec, options: tuple) -> CompiledKernel | None:
    try:
        entry = json.loads(index.read_text())
        name, key, source = entry["name"], entry["key"], entry["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    hit = _memo.get((name, key)) or _load_entry(cache_dir(), name, spec.arch, source, options, key)
    if hit is not None:
        _memo[(name, key)] = hit
    return hit


_templates_digest = None
# The Python that turns a spec into source (with the templates): a change to any of them may
# change a kernel without touching a template, so the spec index keys on their bytes too.
_RENDERING_MODULES = ("codegen/render.py", "runtime/params.py", "spec/__init__.py", "spec/knobs.py")


def _spec_index_key(spec, options: Sequence[str]) -> str:
    """sha256 of what decides a spec's rendered source and its cubin, short of rendering it: the
    spec, the options, the templates and the rendering modules' bytes, NVRTC's and facodegen's
    versions."""
    global _templates_digest
    if _templates_digest is None:
        from ..codegen.render import template_dir
        h = hashlib.sha256()
        root = template_dir()
        files = [(str(p.relative_to(root)), p) for p in sorted(root.rglob("*.j2"))]
        files += [(name, _PACKAGE_DIR / name) for name in _RENDERING_MODULES]
        for name, path in files:
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
        _templates_digest = h.hexdigest()
    h = hashlib.sha256()
    for part in (json.dumps(spec.as_dict(), sort_keys=True), "\0".join(options), _templates_digest,
                 nvrtc_identity(), __version__):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def clear_memo() -> None:
    """Forget in-process results (the disk cache stays); tests use it to measure disk hits."""
    _memo.clear()
    _spec_memo.clear()


# ---------------------------------------------------------------------------------------------
# cuobjdump (SASS and resource usage of a cubin, on the CPU)
# ---------------------------------------------------------------------------------------------

class ToolNotFoundError(RuntimeError):
    """A CUDA binary tool (cuobjdump, nvdisasm) is not installed."""


def _tool_candidates(tool: str) -> list[Path]:
    """Where a CUDA binary tool may be: $FACODEGEN_<TOOL>, the pip wheels' nvidia/*/bin
    (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm), $CUDA_HOME/bin, /usr/local/cuda/bin, PATH."""
    candidates = []
    env = os.environ.get(f"FACODEGEN_{tool.upper()}")
    if env:
        candidates.append(Path(env))
    roots = []
    try:
        import nvidia  # namespace package of the pip CUDA wheels

        roots += [Path(p) for p in getattr(nvidia, "__path__", [])]
    except ImportError:
        pass
    roots += [Path(p) / "nvidia" for p in sys.path if p]
    for root in roots:
        candidates += [root / "cu13" / "bin" / tool, root / f"cuda_{tool}" / "bin" / tool]
        if root.is_dir():
            candidates += sorted(root.glob(f"*/bin/{tool}"))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(Path(home) / "bin" / tool)
    which = shutil.which(tool)
    if which:
        candidates.append(Path(which))
    return candidates


def _find_tool(tool: str, package: str) -> str:
    for c in _tool_candidates(tool):
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise ToolNotFoundError(
        f"{tool} not found: install it with `pip install '{package}>=13.0,<14'` (or set FACODEGEN_{tool.upper()})")


def cuobjdump_path() -> str:
    return _find_tool("cuobjdump", "nvidia-cuda-cuobjdump")


def _cuobjdump(cubin: bytes, flag: str, name: str) -> str:
    exe = cuobjdump_path()
    env = dict(os.environ)
    if flag == "-sass" and "NVDISASM_PATH" not in env:
        # cuobjdump -sass runs nvdisasm; point it at the pip copy (nvidia-cuda-nvdisasm).
        env["NVDISASM_PATH"] = str(Path(_find_tool("nvdisasm", "nvidia-cuda-nvdisasm")).parent)
    with tempfile.TemporaryDirectory(prefix="facodegen-") as tmp:
        path = Path(tmp) / f"{name}.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([exe, flag, str(path)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump {flag} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


# ---------------------------------------------------------------------------------------------
# GPU detection
# ---------------------------------------------------------------------------------------------

def gpu_available() -> tuple[bool, str]:
    """(True, "<device name>") where CuPy sees a CUDA GPU, else (False, why not). Never raises."""
    try:
        import cupy
    except Exception as err:  # noqa: BLE001 (any import failure means no GPU for us)
        return False, f"cupy cannot be imported: {err}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # noqa: BLE001
        return False, f"no CUDA GPU ({type(err).__name__}: {err})"
    if count < 1:
        return False, "no CUDA GPU (the CUDA runtime reports 0 devices)"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return True, f"{name} (sm_{props['major']}{props['minor']})"
    except Exception as err:  # noqa: BLE001
        return True, f"{count} CUDA device(s) ({err})"
