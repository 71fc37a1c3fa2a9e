"""The peers facodegen is timed against: torch SDPA's FLASH_ATTENTION (FlashAttention-2),
CUDNN_ATTENTION and EFFICIENT_ATTENTION backends (through (b, h, s, d) transposed views of
(b, s, h, d) tensors), FlashAttention-3 (``flash_attn_interface.flash_attn_func``, (b, s, h, d))
and FlexAttention (torch.compile'd): whether each is importable here, and its callable for one
input set, each timed through its public call."""

from __future__ import annotations

import contextlib
import importlib

from .inputs import InputSet
from .tables import PEER_TITLES
from .timing import _torch

DEFAULT_PEERS = ("fa3", "cudnn", "fa2")
_SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "fa2": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def _fa3_module():
    errors = []
    for name in ("flash_attn_interface", "flash_attn_3.flash_attn_interface"):
        try:
            import importlib
            return importlib.import_module(name), None
        except Exception as err:  # noqa: BLE001
            errors.append(f"{name}: {type(err).__name__}: {err}")
    return None, "; ".join(errors)


def peer_available(name: str) -> tuple[bool, str]:
    """(available, note) without running anything."""
    if name not in PEER_TITLES:
        return False, f"unknown peer {name!r} (known: {', '.join(PEER_TITLES)})"
    try:
        torch = _torch()
    except Exception as err:  # noqa: BLE001
        return False, f"torch cannot be imported: {err}"
    if name == "fa3":
        mod, err = _fa3_module()
        if mod is None:
            return False, f"flash_attn_interface not importable ({err})"
        return True, getattr(mod, "__file__", "") or "flash_attn_interface"
    if name == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except Exception as err:  # noqa: BLE001
            return False, f"torch {torch.__version__} has no FlexAttention: {err}"
        return True, f"torch {torch.__version__} (torch.compile'd)"
    try:
        from torch.nn.attention import SDPBackend  # noqa: F401
        getattr(SDPBackend, _SDPA_BACKENDS[name])
    except Exception as err:  # noqa: BLE001
        return False, f"torch {torch.__version__} has no SDPA backend {_SDPA_BACKENDS[name]}: {err}"
    return True, f"torch {torch.__version__}"


def _peer_fn(name: str, s: InputSet, causal: bool):
    q, k, v = s.q, s.k, s.v
    if name == "fa3":
        mod, err = _fa3_module()
        if mod is None:
            raise RuntimeError(f"unavailable: {err}")
        # FlashAttention-3 takes fp8 descales per (batch, kv head)
        descales = {n: t.reshape(1, 1).expand(k.shape[0], k.shape[2]).contiguous() for n, t in s.descales.items()}

        def fn():
            r = mod.flash_attn_func(q, k, v, causal=causal, **descales)
            return r[0] if isinstance(r, (tuple, list)) else r
        return fn, contextlib.nullcontext
    if s.fp8:
        raise RuntimeError(f"skipped: {PEER_TITLES[name]} has no e4m3 path")
    if name == "flex":
        return _flex_fn(q, k, v, causal), contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    if causal and q.shape[1] != k.shape[1]:
        raise RuntimeError("skipped: SDPA's is_causal is top-left aligned, facodegen's bottom-right")
    backend = getattr(SDPBackend, _SDPA_BACKENDS[name])
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    extra = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}

    def fn():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **extra).transpose(1, 2)
    return fn, lambda: sdpa_kernel(backend)


_FLEX_COMPILED = {}


def _flex_fn(q, k, v, causal: bool):
    """FlexAttention (torch.compile'd once per process) on (b, h, s, d) views, with facodegen's
    bottom-right causal alignment expressed as a block mask."""
    torch = _torch()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _FLEX_COMPILED:
        _FLEX_COMPILED["fn"] = torch.compile(flex_attention, dynamic=False)
    compiled = _FLEX_COMPILED["fn"]
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    offset = seqlen_k - seqlen_q
    block_mask = None
    if causal:
        def bottom_right(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset
        block_mask = create_block_mask(bottom_right, None, None, seqlen_q, seqlen_k, device=q.device)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]

    def fn():
        return compiled(qt, kt, vt, block_mask=block_mask, enable_gqa=gqa).transpose(1, 2)
    return fn
