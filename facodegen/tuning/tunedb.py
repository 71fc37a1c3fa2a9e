"""The tuning database: the best measured spec per (GPU, NVRTC, spec family, shape bucket).

One JSON file, ``{"format": "facodegen-tunedb", "version": 1, "entries": {key: entry}}``.
Where it lives: ``$FACODEGEN_TUNE_DB`` if set (``off``/``none``/``0`` turns tuned lookups off),
else ``<compile cache dir>/tuned.json`` (``$FACODEGEN_CACHE_DIR``, ``$XDG_CACHE_HOME/facodegen`` or
``~/.cache/facodegen``); ``facodegen tune --db PATH`` overrides both for one command.

Key (:class:`TuneKey`): GPU name, compute capability, NVRTC identity (the same string the compile
cache is keyed by), the spec family (arch, head_dim, dtype, causal) and a shape bucket: seqlen_q,
seqlen_k and batch*heads_q each rounded to the nearest power of two (log scale, so 3000 -> 4096,
2500 -> 2048). A tuned entry is used only for an exact key match; anything else runs the default.

Writes: read-merge-replace under an ``fcntl.flock`` on a side file ``<db>.lock`` (the kernel drops
the lock when its holder exits, so a crash leaves no stale lock), with the new file written to a
temporary file in the same folder and moved into place by ``os.replace``; readers never lock and
always see an old or a whole new file. Merging keeps, per key, the entry with the later
``tuned_at`` (ties: the incoming one), so concurrent writers and ``--import`` never lose entries.

A file that is not JSON, not this format or of another version is ignored with one warning; the
next write moves it aside to ``<db>.bad-<time>`` and starts a new file.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from ..runtime.files import atomic_write

FORMAT = "facodegen-tunedb"
VERSION = 1
ENV = "FACODEGEN_TUNE_DB"
_OFF = ("off", "none", "0", "false", "no")

# Spec fields that name the family (in the key) or the machine (filled from the device): an
# entry's ``spec`` holds only the other fields.
FAMILY_FIELDS = ("arch", "head_dim", "dtype", "causal")
NOT_STORED = FAMILY_FIELDS + ("gpu",)


class TuneDBWarning(UserWarning):
    """The tuning database could not be used (corrupt, foreign, unreadable); defaults apply."""


# ----------------------------------------------------------------------------------------------
# keys
# ----------------------------------------------------------------------------------------------

def pow2_bucket(n: int) -> int:
    """``n`` rounded to the nearest power of two on a log scale (1 for n <= 1)."""
    if n <= 1:
        return 1
    return 1 << round(math.log2(n))


def shape_bucket(seqlen_q: int, seqlen_k: int, batch: int, heads_q: int) -> str:
    return f"sq{pow2_bucket(seqlen_q)}-sk{pow2_bucket(seqlen_k)}-bh{pow2_bucket(batch * heads_q)}"


def family(arch: str, head_dim: int, dtype: str, causal: bool) -> str:
    return f"{arch}-hd{head_dim}-{dtype}-{'causal' if causal else 'full'}"


@dataclass(frozen=True)
class TuneKey:
    gpu: str            # device name, e.g. "NVIDIA H200"
    cc: str             # compute capability, "9.0"
    nvrtc: str          # compiler.nvrtc_identity()
    family: str         # family(arch, head_dim, dtype, causal)
    bucket: str         # shape_bucket(...)

    def __str__(self) -> str:
        return f"{self.gpu} | cc {self.cc} | nvrtc {self.nvrtc} | {self.family} | {self.bucket}"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TuneKey":
        return cls(**{k: str(d[k]) for k in ("gpu", "cc", "nvrtc", "family", "bucket")})


def make_key(gpu_name: str, compute_capability, nvrtc: str, arch: str, head_dim: int, dtype: str,
             causal: bool, seqlen_q: int, seqlen_k: int, batch: int, heads_q: int) -> TuneKey:
    cc = compute_capability if isinstance(compute_capability, str) else \
        f"{compute_capability[0]}.{compute_capability[1]}"
    return TuneKey(gpu_name, cc, nvrtc, family(arch, head_dim, dtype, causal),
                   shape_bucket(seqlen_q, seqlen_k, batch, heads_q))


# ----------------------------------------------------------------------------------------------
# location
# ----------------------------------------------------------------------------------------------

_path_memo: dict = {}


def default_path() -> Path | None:
    """The database file, or None where ``$FACODEGEN_TUNE_DB`` turns lookups off."""
    env = os.environ.get(ENV)
    state = (env, os.environ.get("FACODEGEN_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))
    if state in _path_memo:
        return _path_memo[state]
    if env is not None and env.strip():
        path = None if env.strip().lower() in _OFF else Path(env).expanduser()
    else:
        from ..runtime.compiler import cache_dir
        path = cache_dir() / "tuned.json"
    _path_memo[state] = path
    return path


def resolve_path(path=None) -> Path | None:
    return Path(path).expanduser() if path is not None else default_path()


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------

_warned: set = set()


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, TuneDBWarning, stacklevel=3)


def parse(text: str, origin: str = "tuning database") -> dict | None:
    """Entries ({key string: entry}) of a database file's text, or None (with a warning) when it
    is not a facodegen tuning database of this version."""
    try:
        data = json.loads(text)
    except ValueError as err:
        _warn(f"facodegen: ignoring {origin}: not valid JSON ({err}); defaults apply")
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        _warn(f"facodegen: ignoring {origin}: not a facodegen tuning database (format "
              f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}); defaults apply")
        return None
    if data.get("version") != VERSION:
        _warn(f"facodegen: ignoring {origin}: version {data.get('version')!r}, this facodegen reads "
              f"version {VERSION}; defaults apply")
        return None
    entries = data.get("entries")
    if not isinstance(entries, dict):
        _warn(f"facodegen: ignoring {origin}: 'entries' is not an object; defaults apply")
        return None
    good = {}
    for k, e in entries.items():
        try:
            key = TuneKey.from_dict(e["key"])
            if str(key) != k or not isinstance(e["spec"], dict):
                raise ValueError("key mismatch")
        except (KeyError, TypeError, ValueError):
            _warn(f"facodegen: {origin}: skipping a malformed entry {k!r}")
            continue
        problem = entry_problem(key, e["spec"])
        if problem:
            _warn(f"facodegen: {origin}: refusing the entry {k!r}: {problem}")
            continue
        good[k] = e
    return good


_FAMILY = re.compile(r"^(sm80|sm90)-hd(\d+)-(fp16|bf16|fp8)-(causal|full)$")


def entry_problem(key: TuneKey, spec_fields: dict) -> str | None:
    """Why an entry's spec fields cannot be used for its key (None if they can): a field that is
    not a tuning knob, a value of the wrong type or outside the budget model, named as
    KernelSpec names it."""
    from ..runtime.driver import DeviceInfo
    from ..spec.knobs import KNOBS
    from ..spec import KernelSpec, SpecError

    m = _FAMILY.match(key.family)
    if m is None:
        return f"family {key.family!r} is not arch-hdN-dtype-causal|full"
    knobs = {k.name for k in KNOBS if not k.problem} - set(NOT_STORED)
    unknown = sorted(set(spec_fields) - knobs)
    if unknown:
        return f"{', '.join(map(repr, unknown))} {'is not a knob' if len(unknown) == 1 else 'are not knobs'}"
    try:
        major, minor = (int(x) for x in key.cc.split("."))
        gpu = DeviceInfo(0, key.gpu, (major, minor), 0, 0).budget_gpu
    except ValueError:
        return f"compute capability {key.cc!r} is not N.N"
    try:
        KernelSpec(arch=m[1], head_dim=int(m[2]), dtype=m[3], causal=m[4] == "causal", gpu=gpu, **spec_fields)
    except SpecError as err:
        return str(err)
    return None


def read(path=None) -> dict:
    """All entries of the database ({} where it is missing, unreadable, corrupt or foreign)."""
    path = resolve_path(path)
    if path is None:
        return {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as err:
        _warn(f"facodegen: cannot read the tuning database {path}: {err}; defaults apply")
        return {}
    entries = parse(text, f"tuning database {path}")
    return entries or {}


# mtime-checked cache for the hot path: path -> ((mtime_ns, size, ino), entries)
_cache: dict = {}


def cached_entries(path: Path) -> dict:
    """``read(path)``, re-read only when the file's mtime, size or inode changed."""
    try:
        st = os.stat(path)
    except OSError:
        _cache.pop(path, None)
        return {}
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    hit = _cache.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    entries = read(path)
    _cache[path] = (stamp, entries)
    return entries


# The plan cache (api.py) keys every call on ``generation()``: a write from this process moves it
# at once (update()), another process's within RECHECK_S (one stat per interval, not per call).
RECHECK_S = 1.0
_generation = 0
_checked_at = float("-inf")
_seen_stamp = None


def _stamp(path: Path | None):
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def generation() -> int:
    """A number that changes whenever the database may have changed (see RECHECK_S)."""
    global _generation, _checked_at, _seen_stamp
    now = time.monotonic()
    if now - _checked_at >= RECHECK_S:
        _checked_at = now
        stamp = (default_path(), _stamp(default_path()))
        if stamp != _seen_stamp:
            _seen_stamp = stamp
            _generation += 1
    return _generation


def reload() -> None:
    """Forget what was read: the next lookup reads the file again and every launch plan resolved
    with the old entries is resolved anew."""
    global _generation, _checked_at
    _cache.clear()
    _generation += 1
    _checked_at = float("-inf")


def lookup(key: TuneKey, path=None) -> dict | None:
    """The entry for ``key`` or None. Cheap on the hot path (one stat while the file is unchanged)."""
    path = resolve_path(path)
    if path is None:
        return None
    return cached_entries(path).get(str(key))


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------

def make_entry(key: TuneKey, spec_fields: dict, **info) -> dict:
    """An entry: the key, the spec fields to apply (family and gpu fields left out), and what was
    measured (``info``: variant, tflops, ms, default_variant, default_tflops, shape, ...)."""
    from .. import __version__
    entry = {"key": key.as_dict(), "spec": {k: v for k, v in spec_fields.items() if k not in NOT_STORED}}
    entry.update(info)
    entry.setdefault("tuned_at", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    entry.setdefault("tuned_at_epoch", time.time())
    entry.setdefault("facodegen", __version__)
    return entry


def _newer(a: dict, b: dict) -> bool:
    """Is entry ``a`` at least as new as ``b``?"""
    return float(a.get("tuned_at_epoch", 0)) >= float(b.get("tuned_at_epoch", 0))


def merge(old: dict, new: dict) -> tuple[dict, dict]:
    """Merge ``new`` entries into ``old`` (per key, the later ``tuned_at`` wins; ties: new).
    Returns (merged, counts) with counts {"added", "replaced", "kept"}."""
    merged = dict(old)
    counts = {"added": 0, "replaced": 0, "kept": 0}
    for k, e in new.items():
        if k not in merged:
            merged[k] = e
            counts["added"] += 1
        elif _newer(e, merged[k]):
            merged[k] = e
            counts["replaced"] += 1
        else:
            counts["kept"] += 1
    return merged, counts


def dumps(entries: dict) -> str:
    return json.dumps({"format": FORMAT, "version": VERSION,
                       "entries": dict(sorted(entries.items()))}, indent=1, sort_keys=False) + "\n"


class _Lock:
    """An exclusive flock on ``<db>.lock`` (a no-op where fcntl is missing)."""

    def __init__(self, path: Path):
        self.path = path.with_name(path.name + ".lock")
        self.fd = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # pragma: no cover (Windows)
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def update(new_entries: dict, path=None) -> dict:
    """Merge ``new_entries`` ({key string: entry}) into the database under the lock; returns the
    merge counts. A corrupt or foreign file is moved aside to ``<db>.bad-<time>`` first."""
    path = resolve_path(path)
    if path is None:
        raise ValueError(f"the tuning database is turned off (${ENV}={os.environ.get(ENV)!r}); "
                         f"pass --db PATH or unset {ENV}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _Lock(path):
        old: dict = {}
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = None
        if text is not None:
            parsed = parse(text, f"tuning database {path}")
            if parsed is None:
                aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
                os.replace(path, aside)
                print(f"facodegen: moved the unreadable tuning database aside to {aside}", file=sys.stderr)
            else:
                old = parsed
        merged, counts = merge(old, new_entries)
        atomic_write(path, dumps(merged).encode())
    reload()
    return counts


def put(entry: dict, path=None) -> dict:
    """Store one entry (see :func:`make_entry`)."""
    key = TuneKey.from_dict(entry["key"])
    return update({str(key): entry}, path)


def export(dest, path=None) -> int:
    """Write the database's entries to ``dest`` (same format); returns how many."""
    entries = read(path)
    dest = Path(dest).expanduser()
    if dest.parent:
        dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dest, dumps(entries).encode())
    return len(entries)


def import_file(src, path=None) -> dict:
    """Merge a file written by :func:`export` (or another database) into the database. Entries
    that do not make a valid spec for their key are refused with a warning naming each, and
    counted as ``refused``."""
    src = Path(src).expanduser()
    text = src.read_text()
    entries = parse(text, str(src))
    if entries is None:
        raise ValueError(f"{src} is not a facodegen tuning database of version {VERSION}")
    counts = update(entries, path)
    counts["refused"] = len(json.loads(text)["entries"]) - len(entries)
    return counts


# ----------------------------------------------------------------------------------------------
# display
# ----------------------------------------------------------------------------------------------

def format_entries(entries: dict) -> str:
    """A table of the entries, one line each, grouped by GPU/NVRTC."""
    if not entries:
        return "(no tuned entries)"
    head = ["gpu", "cc", "nvrtc", "family", "bucket", "variant", "TFLOP/s", "vs default", "tuned at"]
    rows = []
    for k in sorted(entries):
        e = entries[k]
        key = e["key"]
        t, d = e.get("tflops"), e.get("default_tflops")
        rows.append([key["gpu"], key["cc"], key["nvrtc"], key["family"], key["bucket"],
                     e.get("variant", "?") + (" (default)" if e.get("is_default") else ""),
                     f"{t:.1f}" if isinstance(t, (int, float)) else "–",
                     f"{t / d:.3f}x" if isinstance(t, (int, float)) and isinstance(d, (int, float)) and d else "–",
                     str(e.get("tuned_at", "?"))])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
