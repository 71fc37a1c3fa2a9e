"""attention()'s fast path on real torch tensors (the inline plan-cache hit of the common call and of
the fp8 call that gives its three descales), on the CPU: a subprocess installs
scripts/hit_path_cpu.py's fake GPU (CPU tensors seen as cuda:0 ones, no-op launches) and checks that
hits never reach the general path, write this call's addresses, and that what changes a launch misses.
The fake-torch tests of tests/test_plan_cache.py leave this path out (their torch is not torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import struct, sys
sys.path[:0] = [ROOT, ROOT + "/scripts"]
import hit_path_cpu
torch, api = hit_path_cpu.install_fake_gpu()
api._unit_descale = lambda device, kind: torch.ones((), dtype=torch.float32)    # (a CPU tensor for cuda:0's)
import facodegen
from facodegen.runtime import params

general = []
real_general = api._attention_torch
api._attention_torch = lambda *a, **kw: general.append(1) or real_general(*a, **kw)

def image(plan):
    return plan._last.data()

def pointers(plan, n=4):
    return struct.unpack_from(f"<{n}Q", image(plan), 0)

# -- the common call: miss, then hits in attention()'s own frame, each with its own addresses --
q, k, v = (torch.randn(1, 128, 8, 128).to(torch.bfloat16) for _ in range(3))
facodegen.attention(q, k, v, causal=True)
assert api._PLANS.misses == 1 and len(general) == 1
for _ in range(3):
    q2, k2, v2 = (torch.randn(1, 128, 8, 128).to(torch.bfloat16) for _ in range(3))
    out = facodegen.attention(q2, k2, v2, causal=True)
    plan = next(iter(api._PLANS._plans.values()))
    assert pointers(plan) == (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), out.data_ptr())
assert api._PLANS.misses == 1 and len(general) == 1, (api._PLANS.misses, general)
out, lse = facodegen.attention(q, k, v, causal=True, return_lse=True)          # another key: a miss
assert api._PLANS.misses == 2 and tuple(lse.shape) == (1, 8, 128) and lse.dtype == torch.float32
facodegen.attention(q, k, v, causal=True, return_lse=True)
assert api._PLANS.misses == 2
# what changes the launch misses: a strided view, GQA, the dtype, causal
wide = torch.randn(1, 128, 8, 256).to(torch.bfloat16)[..., :128]
for args, kw in (((wide, k, v), {}), ((q, k[:, :, :4], v[:, :, :4]), {}), ((q.half(), k.half(), v.half()), {}),
                 ((q, k, v), {"causal": False})):
    before = api._PLANS.misses
    facodegen.attention(*args, **({"causal": True} | kw))
    assert api._PLANS.misses == before + 1, (args[0].shape, kw)
# a view 8 bytes off its allocation: the checked path refuses it, never a hit
flat = torch.randn(1 * 128 * 8 * 128 + 4).to(torch.bfloat16)
shifted = flat[4:].view(1, 128, 8, 128)
try:
    facodegen.attention(shifted, k, v, causal=True)
    raise SystemExit("a misaligned q was launched")
except ValueError as err:
    assert "q" in str(err), err

# -- fp8 with its three descales: its own key, hits in attention()'s frame, descales written per call --
q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
descale_at = {f.name: off for f, off in params.layout("sm90", "fp8")[0]}["q_descale"]
scalar = lambda: torch.ones((), dtype=torch.float32)
facodegen.attention(q8, k8, v8, causal=True, q_descale=scalar(), k_descale=scalar(), v_descale=scalar())
misses, calls = api._PLANS.misses, len(general)
for _ in range(3):
    d = (scalar(), scalar(), scalar())
    facodegen.attention(q8, k8, v8, causal=True, q_descale=d[0], k_descale=d[1], v_descale=d[2])
    plan = next(p for p in api._PLANS._plans.values() if p.spec.dtype == "fp8")
    assert struct.unpack_from("<3Q", image(plan), descale_at) == tuple(x.data_ptr() for x in d)
assert (api._PLANS.misses, len(general)) == (misses, calls), (api._PLANS.misses, general)
per_head = torch.ones(1, 8, dtype=torch.float32)     # (batch, heads_kv): another layout, another plan
facodegen.attention(q8, k8, v8, causal=True, q_descale=d[0], k_descale=per_head, v_descale=d[2])
assert api._PLANS.misses == misses + 1
facodegen.attention(q8, k8, v8, causal=True, q_descale=d[0], k_descale=d[1], block_n=128)   # three knobs, not
assert len(general) > calls                                                                # the descales
print("ok")
"""


def test_fast_path_hits_write_their_addresses_and_changes_miss():
    done = subprocess.run([sys.executable, "-c", SCRIPT.replace("ROOT", repr(str(ROOT)), 2)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


DECODE_SCRIPT = r"""
import sys
sys.path[:0] = [ROOT, ROOT + "/scripts"]
import hit_path_cpu
torch, api = hit_path_cpu.install_fake_gpu()      # (kvcache's device, loads and allocations too)
from facodegen.ops import kvcache
eager = []
real_eager = kvcache._eager
kvcache._eager = lambda *a, **kw: eager.append(1) or real_eager(*a, **kw)
import facodegen

q = torch.randn(2, 1, 32, 128).to(torch.bfloat16)
kc, vc = (torch.randn(2, 4096, 8, 128).to(torch.bfloat16) for _ in range(2))
lengths = torch.full((2,), 1000, dtype=torch.int32)
step = facodegen.attention_with_kvcache
for window, softcap in (((-1, -1), 0.0), ((256, 0), 0.0), ((256, 0), 30.0)):
    step(q, kc, vc, lengths, window_size=window, softcap=softcap)          # the miss: _eager builds the plan
    calls = len(eager)
    for _ in range(3):                                                     # a server's steps: the fast path
        step(q, kc, vc, lengths, window_size=window, softcap=softcap)
    assert len(eager) == calls, (window, softcap, eager)
    plan = list(kvcache._PLANS._plans.values())[-1]
    assert plan.specs["decode"].local == (window != (-1, -1)) and plan.specs["decode"].softcap == (softcap > 0)
assert kvcache._PLANS.misses == 3
step(q, kc, vc, lengths, window_size=(128, 0))                            # another window: another plan
assert kvcache._PLANS.misses == 4
try:
    step(q, kc, vc, lengths, window_size=7)
    raise SystemExit("a bad window_size was launched")
except ValueError as err:
    assert "window_size" in str(err), err
print("ok")
"""


def test_decode_steps_with_a_window_or_softcap_take_the_fast_path():
    """attention_with_kvcache's fast path (a server's decode step: no new tokens, knob or out=) serves steps
    with a window or softcap too (their values key the plan): after the miss, no step reaches _eager; a
    new window is a new plan; a bad window_size is an error naming it, never a hit."""
    done = subprocess.run([sys.executable, "-c", DECODE_SCRIPT.replace("ROOT", repr(str(ROOT)), 2)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
