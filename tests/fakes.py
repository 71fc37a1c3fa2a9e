"""Stand-ins for torch CUDA tensors, for tests of facodegen's Python path without a GPU."""

from __future__ import annotations


class FakeDevice:
    def __init__(self, index):
        self.index = index
        self.type = "cuda"

    def __str__(self):
        return f"cuda:{self.index}"


class FakeTensor:
    """Just enough of a torch CUDA tensor for api's fast path and its checked path."""
    _next = 1 << 30

    def __init__(self, shape, dtype="bfloat16", strides=None, device=0, ptr=None):
        self.shape = tuple(shape)
        self.dtype = f"torch.{dtype}"
        if strides is None:
            strides, acc = [], 1
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self._strides = tuple(strides)
        self.is_cuda = True
        self.requires_grad = False
        self.device = FakeDevice(device)
        if ptr is None:
            ptr = FakeTensor._next
            FakeTensor._next += 1 << 28
        self._ptr = ptr

    def data_ptr(self):
        return self._ptr

    def stride(self):
        return self._strides

    def get_device(self):
        return self.device.index

    def offset(self, nbytes):
        """The same tensor seen from ``nbytes`` further on (a view with a storage offset)."""
        return FakeTensor(self.shape, self.dtype.removeprefix("torch."), self._strides, self.device.index,
                          self._ptr + nbytes)

    def as_strided(self, shape, strides):
        return FakeTensor(shape, self.dtype.removeprefix("torch."), strides, self.device.index, self._ptr)

    def new_empty(self, shape, dtype=None):
        """A new contiguous tensor on this one's device (torch's Tensor.new_empty)."""
        return FakeTensor(tuple(shape), (dtype or self.dtype).removeprefix("torch."), device=self.device.index)


class FakeLauncher:
    """driver.Launcher's interface (a call, ``bare`` and ``error``, as plan.LaunchPlan.launch_plain and
    backward.BackwardPlan.launch_plain use it) over a recording ``launch(stream, kernel_params)``."""
    error = ()      # (a fake launch raises nothing that is a launch error)

    def __init__(self, launch):
        self._launch = launch

    def __call__(self, stream, kernel_params):
        self._launch(stream, kernel_params)

    def bare(self, stream, kernel_params, extra):
        self._launch(stream, kernel_params)


def param_field(param_bytes: bytes, spec, name: str):
    """The value of FlashParams field ``name`` in a launch's argument bytes, laid out for ``spec``."""
    import struct

    from facodegen.runtime import params
    placed, _, _ = params.spec_layout(spec)
    f, off = next((f, off) for f, off in placed if f.name == name)
    return struct.unpack_from({"f32": "<f", "i32": "<i", "ptr": "<Q", "i64": "<q"}[f.kind], param_bytes, off)[0]
