"""Launch plans: what one attention call needs that stays fixed while its shapes, strides, dtypes,
device and options stay fixed, resolved once and reused by every later call with the same key.

A plan holds the spec, the loaded kernel, the grid and an image of the kernel's one argument
(FlashParams). A launch writes the call's pointers into the image, points the TMA maps at the
call's tensors where they moved (cuTensorMapReplaceAddress: the shape, strides and box stay),
and launches: a few microseconds of host time, against ~0.4 ms to resolve a call from scratch.
``launch_plain`` is that launch for the common plan (no fp8 descales, sinks or varlen, no context
switch): it writes only the fields that changed since the image's last launch.

Scratch memory the kernel needs besides the caller's tensors (the tile scheduler's counter, an
LSE nobody asked for, fa1's and stream_k's fp32 workspace) lives per (plan, stream): launches on
one stream run in order, so they can share it; launches on two streams never do. The counter is
zeroed once when the scratch is made; every launch leaves it at zero again.

``PlanCache`` maps call keys (api.py builds them) to plans: bounded, oldest out first, safe to
use from several threads (reads are dict lookups; inserts and each plan's image take a lock).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from typing import Callable

from . import driver
from . import params as params_mod

MAX_PLANS = 1024
MAX_STREAMS_PER_PLAN = 16
MAX_IMAGES_PER_PLAN = 64
_ALIGN = 16

# FlashParams' pointer fields that change per call sit together at the start of the struct
# (params.COMMON_FIELDS); the fp8 descales together after the maps. Checked at import.
_CALL_POINTERS = ("q", "k", "v", "o", "lse", "tile_counter", "workspace")
_DESCALES = ("q_descale", "k_descale", "v_descale")
_PACK_CALL = struct.Struct("<7Q")
_PACK_OPERANDS = struct.Struct("<4Q")
_PACK_DESCALES = struct.Struct("<3Q")
_PACK_SINKS = struct.Struct("<Q")
_PACK_VARLEN = struct.Struct("<2Q2i")    # cu_seqlens_q, cu_seqlens_k, total_q, total_k (params.VARLEN_FIELDS, adjacent)
_OPERANDS = ("q", "k", "v", "o")


def _offsets(arch: str, dtype: str, variants: bool = False, varlen: bool = False) -> dict[str, int]:
    placed, _, _ = params_mod.layout(arch, dtype, variants, varlen)
    return {f.name: off for f, off in placed}


def _check_layout() -> None:
    for arch, dtype in (("sm80", "bf16"), ("sm90", "bf16"), ("sm90", "fp8")):
        off = _offsets(arch, dtype)
        assert [off[n] for n in _CALL_POINTERS] == [8 * i for i in range(7)], "FlashParams pointer order changed"
        if dtype == "fp8":
            first = off[_DESCALES[0]]
            assert [off[n] for n in _DESCALES] == [first, first + 8, first + 16], "descale order changed"
    off = _offsets("sm80", "bf16", varlen=True)
    assert (off["cu_seqlens_k"], off["total_q"], off["total_k"]) == tuple(off["cu_seqlens_q"] + i for i in (8, 16, 20)), \
        "VARLEN_FIELDS order changed"


_check_layout()


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Scratch:
    """One stream's scratch: ``stream`` (as a launch argument, driver.stream_arg), ``holder`` (the
    device buffer, the caller's library's array, kept alive here) and one device address per
    region, by the region's name (0 for a region of no bytes)."""
    def __init__(self, stream, holder, regions: dict[str, int]):
        self.stream, self.holder = stream, holder
        self.__dict__.update(regions)


class StreamScratch:
    """A plan's scratch memory per CUDA stream: one allocation per stream, cut into named regions of
    fixed byte sizes (each 16-byte aligned), made on a stream's first launch (then ``on_new(scratch,
    stream)``, e.g. to zero a counter) and kept for at most MAX_STREAMS_PER_PLAN streams, the oldest
    dropped first. Launches on one stream run in order, so they can share a scratch; launches on two
    streams never do. Safe to use from several threads."""

    def __init__(self, regions: dict[str, int], allocate: Callable[[int], tuple[object, int]], on_new=None):
        self.regions = {name: _round_up(size) for name, size in regions.items()}
        self._allocate = allocate
        self._on_new = on_new
        self._streams: dict[int, Scratch] = {}
        self._lock = threading.Lock()

    def offset(self, name: str) -> int:
        """Byte offset of region ``name`` inside a stream's buffer."""
        names = list(self.regions)
        return sum(self.regions[n] for n in names[:names.index(name)])

    def get(self, stream: int) -> Scratch:
        found = self._streams.get(stream)
        return found if found is not None else self._make(stream)

    def _make(self, stream: int) -> Scratch:
        holder, ptr = self._allocate(sum(self.regions.values()))
        regions, at = {}, ptr
        for name, size in self.regions.items():
            regions[name] = at if size else 0
            at += size
        scratch = Scratch(driver.stream_arg(stream), holder, regions)
        if self._on_new is not None:
            self._on_new(scratch, stream)
        with self._lock:
            if len(self._streams) >= MAX_STREAMS_PER_PLAN:
                self._streams.pop(next(iter(self._streams)))
            self._streams[stream] = scratch
        return scratch


class _Image:
    """One FlashParams image, 64-byte aligned (cuTensorMapReplaceAddress needs its maps aligned),
    and the kernel-argument array that points at it."""

    def __init__(self, data: bytes):
        self.storage = bytearray(len(data) + params_mod.TENSOR_MAP_ALIGN)
        self._view = (ctypes.c_char * len(self.storage)).from_buffer(self.storage)
        start = ctypes.addressof(self._view)
        self.base = (-start) % params_mod.TENSOR_MAP_ALIGN
        self.address = start + self.base
        self.storage[self.base:self.base + len(data)] = data
        self.size = len(data)
        self._argument = (ctypes.c_void_p * 1)(self.address)
        self.kernel_params = ctypes.addressof(self._argument)     # (driver.Launcher takes ints)
        # pack_call(q, k, v, o, lse, tile_counter, workspace): a call's pointers into this image;
        # pack_operands(q, k, v, o): the first four alone
        self.pack_call = functools.partial(_PACK_CALL.pack_into, self.storage, self.base)
        self.pack_operands = functools.partial(_PACK_OPERANDS.pack_into, self.storage, self.base)
        # the tile counter address of the scratch whose lse, counter and workspace the image holds (None:
        # not known, or a caller's lse); a plan's scratch regions are laid out alike, so it tells all three
        self.tail_of = None

    def data(self) -> bytes:
        return bytes(self.storage[self.base:self.base + self.size])


def add_image(images: dict, key, last: _Image, maps: list[tuple[int, int]],
              encoded: list[tuple[int, bytes]] = ()) -> _Image:
    """A copy of ``last`` whose TMA maps, ``maps`` = (offset in the image, device address) each, point
    at those addresses (and whose maps ``encoded`` = (offset, 128 bytes) each are replaced whole),
    filed in ``images`` under ``key``; the oldest image goes first once a plan holds
    MAX_IMAGES_PER_PLAN (LaunchPlan's and backward.BackwardPlan's, their lock held)."""
    image = _Image(last.data())
    for offset, ptr in maps:
        driver.replace_tensor_map_address(image.address + offset, ptr)
    for offset, data in encoded:
        image.storage[image.base + offset:image.base + offset + len(data)] = data
    while len(images) >= MAX_IMAGES_PER_PLAN:
        images.pop(next(iter(images)))
    images[key] = image
    return image


class LaunchPlan:
    """One resolved call. ``launch`` takes the call's device pointers and its stream.

    ``allocate(nbytes) -> (holder, ptr)`` makes device memory on the plan's device in the
    caller's library (torch or CuPy), for the per-stream scratch. ``tensor_maps`` maps each
    FlashParams TMA field to the operand ("q", "k", "v" or "o") whose address it holds.

    sm90 keeps one image per (q, k, v, o) addresses seen (up to MAX_IMAGES_PER_PLAN): a model's
    layers reuse the same activation addresses from step to step (the caching allocators hand them
    out again), so their launches find images whose maps already point there, and only a new
    address costs cuTensorMapReplaceAddress calls (about 1 µs each).

    ``encode_maps`` (sm90 varlen, whose maps span the packed tokens): an image is keyed by the
    operands' addresses and ``launch``'s ``extents`` (total_q, total_k), and a new one gets its maps
    from ``encode_maps(q, k, v, o, *extents)`` ({FlashParams field: 128 bytes}), encoded whole."""

    def __init__(self, spec, function: driver.LoadedFunction, grid: tuple[int, int, int], param_bytes: bytes,
                 *, tensor_maps: dict[str, str], lse_floats: int, workspace_floats: int,
                 stream_k_flags: tuple[int, int], switch_context: bool,
                 allocate: Callable[[int], tuple[object, int]], outputs=None,
                 encode_maps: Callable[..., dict[str, bytes]] | None = None, extents: tuple = ()):
        self.spec = spec
        self.outputs = outputs      # what the caller needs to allocate a hit's results (api._Outputs)
        self.function = function
        self.grid = grid
        self._switch_context = switch_context
        # the tile scheduler's int32 counter, an LSE nobody asked for, fa1's and stream_k's fp32 workspace
        self._scratch = StreamScratch({"counter": _ALIGN, "lse": 4 * lse_floats, "workspace": 4 * workspace_floats},
                                      allocate, self._zero_counters)
        self._workspace_bytes = 4 * workspace_floats     # (its region is rounded up to 16 bytes)
        self._stream_k_flags = stream_k_flags
        self._lock = threading.Lock()
        self._launcher = driver.Launcher(function, grid, spec.threads, spec.smem_bytes) \
            if function is not None else None
        # launch_plain calls the binding itself (driver.Launcher.bare), saving the Launcher's frame
        self._bare, self._bare_error = (self._launcher.bare, self._launcher.error) if self._launcher else (None, ())
        offsets = _offsets(spec.arch, spec.dtype, params_mod.has_variants(spec), spec.varlen)
        self._descale_offset = offsets[_DESCALES[0]] if spec.dtype == "fp8" else None
        self._sinks_offset = offsets["sinks"] if spec.sinks else None
        self._varlen_offset = offsets["cu_seqlens_q"] if spec.varlen else None
        self._maps = [(offsets[name], _OPERANDS.index(operand)) for name, operand in tensor_maps.items()]
        self._encode_maps = encode_maps
        self._map_offsets = {name: offsets[name] for name in tensor_maps}
        first = _Image(param_bytes)
        self._images = {_PACK_CALL.unpack_from(param_bytes, 0)[:4] + tuple(extents) if self._maps else None: first}
        self._last = first
        # launch_plain serves this plan: nothing to patch but the call's pointers, no context to switch
        self.plain = (self._descale_offset is None and self._sinks_offset is None and self._varlen_offset is None
                      and not switch_context)
        # launch_plain with descales serves this plan: an fp8 one with nothing else to patch than the
        # call's pointers and its three descales' addresses
        self.descaled = (self._descale_offset is not None and self._sinks_offset is None
                         and self._varlen_offset is None and not switch_context)
        # launch_plain with varlen serves this plan: a varlen one with no descales or sinks to patch
        self.varlen_plain = (self._varlen_offset is not None and self._descale_offset is None
                             and self._sinks_offset is None and not switch_context)

    def workspace_range(self) -> tuple[int, int]:
        """(byte offset, bytes) of the fp32 workspace inside a stream's scratch buffer."""
        return self._scratch.offset("workspace"), self._workspace_bytes

    def scratch(self, stream: int) -> Scratch:
        """This plan's scratch on ``stream`` (counter, lse, workspace), made on first use."""
        return self._scratch.get(stream)

    def _zero_counters(self, scratch: Scratch, stream: int) -> None:
        """The dynamic scheduler's counter starts at zero (each launch leaves it so: sm90/scheduler),
        and so do stream_k's flags (the kernel lowers each one it reads)."""
        driver.memset_d32_async(scratch.counter, 0, 1, stream)
        first, count = self._stream_k_flags
        if count:
            driver.memset_d32_async(scratch.workspace + 4 * first, 0, count, stream)

    def _image(self, operands: tuple) -> _Image:
        """The image whose TMA maps point at ``operands`` (made from the last one; lock held);
        with encode_maps, ``operands`` ends with the extents and the maps are encoded whole."""
        if self._encode_maps is not None:
            return add_image(self._images, operands, self._last, [],
                             [(self._map_offsets[name], data) for name, data in self._encode_maps(*operands).items()])
        return add_image(self._images, operands, self._last,
                         [(offset, operands[which]) for offset, which in self._maps])

    def launch(self, stream: int, q: int, k: int, v: int, o: int, lse: int = 0,
               descales: tuple[int, int, int] | None = None, sinks: int = 0,
               varlen: tuple[int, int, int, int] = (0, 0, 0, 0), extents: tuple = ()) -> None:
        """Launch on ``stream`` with these device addresses; ``lse`` 0 writes the LSE to scratch;
        ``sinks``: the fp32 sinks' address of a spec with sinks; ``varlen``: a varlen spec's int32
        cu_seqlens_q and cu_seqlens_k addresses and its total_q (the LSE's head stride) and total_k, patched in;
        ``extents``: with encode_maps, what else the maps depend on (varlen: total_q, total_k)."""
        scratch = self._scratch.get(stream)
        operands = (q, k, v, o) + extents if self._maps else None
        with self._lock:
            image = self._images.get(operands) or self._image(operands)
            image.pack_call(q, k, v, o, lse or scratch.lse, scratch.counter, scratch.workspace)
            image.tail_of = None if lse else scratch.counter
            if descales is not None:
                _PACK_DESCALES.pack_into(image.storage, image.base + self._descale_offset, *descales)
            if self._sinks_offset is not None:
                _PACK_SINKS.pack_into(image.storage, image.base + self._sinks_offset, sinks)
            if self._varlen_offset is not None:
                _PACK_VARLEN.pack_into(image.storage, image.base + self._varlen_offset, *varlen)
            self._last = image
            if self._switch_context:
                with driver.on_device(self.function.device):
                    self._launcher(scratch.stream, image.kernel_params)
            else:
                self._launcher(scratch.stream, image.kernel_params)

    def launch_plain(self, stream: int, q: int, k: int, v: int, o: int, lse: int = 0,
                     descales: tuple[int, int, int] | None = None, varlen: tuple[int, int, int, int] | None = None,
                     extents: tuple = ()) -> None:
        """``launch`` of a ``plain`` plan (no fp8 descales, sinks or varlen to patch, no context to
        switch), of a ``descaled`` one with its q, k, v ``descales``' addresses, or of a ``varlen_plain``
        one with its ``varlen`` (cu_seqlens_q, cu_seqlens_k, total_q, total_k) and ``extents`` (launch's), with
        less to do: the hit paths of attention() and attention_varlen. It writes only what may have
        changed: an sm90 image found by its (q, k, v, o) (and extents) holds those already (every launch
        writes its image's own), and an image's lse, tile counter and workspace stay while its scratch
        does (``tail_of``)."""
        found = self._scratch._streams.get(stream)
        scratch = found if found is not None else self._scratch.get(stream)
        maps = self._maps
        lock = self._lock
        lock.acquire()      # (cheaper than `with`)
        try:
            if maps:
                operands = (q, k, v, o) + extents if extents else (q, k, v, o)
                image = self._images.get(operands) or self._image(operands)
            else:
                image = self._last      # (the one image of a plan without maps)
            if lse or image.tail_of != scratch.counter:
                image.pack_call(q, k, v, o, lse or scratch.lse, scratch.counter, scratch.workspace)
                image.tail_of = None if lse else scratch.counter
            elif not maps:
                image.pack_operands(q, k, v, o)
            if descales is not None:
                _PACK_DESCALES.pack_into(image.storage, image.base + self._descale_offset, *descales)
            if varlen is not None:
                _PACK_VARLEN.pack_into(image.storage, image.base + self._varlen_offset, *varlen)
            self._last = image
            try:
                self._bare(scratch.stream, image.kernel_params, 0)
            except self._bare_error as err:
                self._launcher.failed(err, scratch.stream, image.kernel_params)
        finally:
            lock.release()

    def param_bytes(self) -> bytes:
        """The FlashParams image as the last launch (or the build) left it."""
        return self._last.data()


class PlanCache:
    """Call key -> LaunchPlan, at most ``max_plans`` (the oldest goes first)."""

    def __init__(self, max_plans: int = MAX_PLANS):
        self.max_plans = max_plans
        self._plans: dict = {}
        self._lock = threading.Lock()
        self.misses = 0     # plans built: a call that found none (hits are not counted: hot path)

    def get(self, key):
        return self._plans.get(key)

    def put(self, key, plan: LaunchPlan) -> None:
        with self._lock:
            while len(self._plans) >= self.max_plans:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
            self.misses += 1

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
