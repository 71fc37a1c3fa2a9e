"""Argument checks of facodegen.attention that need no GPU (the GPU tests repeat them end to end)."""

import numpy as np
import pytest

from facodegen.ops import api


def view(name="q", shape=(2, 64, 8, 128), strides=None, dtype="bfloat16", device=0, kind="torch", ptr=1 << 20):
    if strides is None:
        strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
    return api._View(name, kind, ptr, tuple(shape), tuple(strides), dtype, device)


def qkv(**changes):
    q = view("q")
    k = view("k", shape=(2, 64, 2, 128))
    v = view("v", shape=(2, 64, 2, 128))
    views = {"q": q, "k": k, "v": v}
    for name, fields in changes.items():
        views[name] = view(name, **{**dict(shape=views[name].shape), **fields})
    return views["q"], views["k"], views["v"]


def test_valid_gqa_inputs_pass():
    api._check_inputs(*qkv())


@pytest.mark.parametrize("changes, error, words", [
    (dict(k=dict(dtype="float16")), TypeError, "k has dtype float16"),
    (dict(q=dict(dtype="float32"), k=dict(dtype="float32"), v=dict(dtype="float32")), TypeError, "q has dtype float32"),
    (dict(v=dict(shape=(2, 63, 2, 128))), ValueError, "same shape"),
    (dict(k=dict(shape=(3, 64, 2, 128)), v=dict(shape=(3, 64, 2, 128))), ValueError, "batch"),
    (dict(q=dict(shape=(2, 64, 8, 80)), k=dict(shape=(2, 64, 2, 80)), v=dict(shape=(2, 64, 2, 80))), ValueError,
     "head_dim=80"),
    (dict(k=dict(shape=(2, 64, 3, 128)), v=dict(shape=(2, 64, 3, 128))), ValueError, "heads_kv=3"),
    (dict(q=dict(shape=(2, 0, 8, 128))), ValueError, "seqlen_q"),
    (dict(k=dict(shape=(2, 0, 2, 128)), v=dict(shape=(2, 0, 2, 128))), ValueError, "seqlen_k"),
    (dict(q=dict(strides=(64 * 8 * 256, 8 * 256, 256, 2))), ValueError, "contiguous"),
    (dict(k=dict(device=1)), ValueError, "cuda:1"),
    (dict(v=dict(kind="cupy")), TypeError, "v is a cupy array"),
    (dict(q=dict(ptr=(1 << 20) + 2)), ValueError, "16-byte aligned"),
    (dict(q=dict(strides=(64 * 8 * 132, 8 * 132, 132, 1))), ValueError, "multiple of 8 elements"),
    (dict(q=dict(shape=(2, 64, 128), strides=(8192, 128, 1))), ValueError, "4-D"),
])
def test_bad_input_names_the_argument(changes, error, words):
    with pytest.raises(error) as err:
        api._check_inputs(*qkv(**changes))
    assert words in str(err.value)


def test_host_numpy_array_is_rejected_before_anything_runs():
    with pytest.raises(TypeError, match="q is a NumPy array in host memory"):
        api._view("q", np.zeros((1, 1, 1, 64), np.float16))
    with pytest.raises(TypeError, match="k must be a CuPy array or a torch CUDA tensor"):
        api._view("k", [1, 2, 3])


def test_sm90_on_another_gpu_names_it_and_suggests_sm80():
    a100 = api.DeviceInfo(0, "NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912)
    with pytest.raises(ValueError) as err:
        api._check_arch("sm90", a100)
    assert "NVIDIA A100-SXM4-80GB" in str(err.value) and "--arch sm80" in str(err.value)
    api._check_arch("sm80", a100)
    assert api.default_arch(a100) == "sm80"
    h200 = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    assert api.default_arch(h200) == "sm90" and h200.budget_gpu == "h200"
    with pytest.raises(ValueError, match="older than sm80"):
        api.default_arch(api.DeviceInfo(0, "Tesla V100", (7, 0), 80, 98304))


def test_out_and_lse_buffers_are_checked():
    q = view("q")
    with pytest.raises(ValueError, match="out has shape"):
        api._check_out(view("out", shape=(2, 64, 8, 64)), q)
    with pytest.raises(TypeError, match="out must be"):
        api._check_out(view("out", dtype="float16"), q)
    with pytest.raises(TypeError, match="lse_out must be a float32"):
        api._check_lse(view("lse_out", shape=(2, 8, 64), strides=(512, 64, 1)), q)
    with pytest.raises(ValueError, match="contiguous"):
        api._check_lse(view("lse_out", shape=(2, 8, 64), strides=(1024, 128, 1), dtype="float32"), q)
    api._check_lse(view("lse_out", shape=(2, 8, 64), strides=(512, 64, 1), dtype="float32"), q)


def test_spec_for_shape_picks_what_resolve_spec_would_without_a_device():
    """api.spec_for_shape (resolve_spec's device-free half, used by scripts/precompile.py): the
    sequence-length rule for the shape unless the caller sets one of its fields, a tuned entry over
    the rule, the caller's fields over both, and defaults where tuned fields do not fit them."""
    from facodegen.ops import api
    from facodegen.spec import KernelSpec
    short = api.spec_for_shape("sm90", 256, "fp8", False, (4, 4096, 4096, 8), gpu="h200")
    assert short == KernelSpec(arch="sm90", head_dim=256, dtype="fp8", gpu="h200", stream_k=False,
                               defer_o_store=False)
    long = api.spec_for_shape("sm90", 256, "fp8", False, (1, 16384, 16384, 8), gpu="h200")
    assert long.stream_k and long == KernelSpec(arch="sm90", head_dim=256, dtype="fp8", gpu="h200")
    # a rule field set by the caller: no rule at all (stream_k back to its default)
    assert api.spec_for_shape("sm90", 256, "fp8", False, (4, 4096, 4096, 8), gpu="h200", block_n=128).stream_k
    tuned = api.spec_for_shape("sm90", 256, "fp8", False, (4, 4096, 4096, 8), {"stages": 1}, gpu="h200")
    assert tuned.stages == 1 and tuned.stream_k
    clash = api.spec_for_shape("sm90", 128, "bf16", False, None, {"block_m": 192}, gpu="h200", consumer_warpgroups=2)
    assert clash == KernelSpec(arch="sm90", head_dim=128, dtype="bf16", gpu="h200", consumer_warpgroups=2)
