"""facodegen: a code generator for FlashAttention kernels (sm80 and sm90): forward, backward, decode.

spec -> render -> compile -> launch, one module each:
``spec`` (KernelSpec, budget model), ``render`` (Jinja2 -> CUDA), ``compiler`` (NVRTC ->
cubin, cache, resource report), ``launch``/``api`` (argument checks, launch on CuPy or
torch tensors), ``reference`` (float64 NumPy attention and the FA1/FA2 tiled algorithms).
"""

__version__ = "0.1.0"

from .spec import KernelSpec, SpecError, default_spec, default_specs  # noqa: E402
from .render import emit  # noqa: E402
from .compiler import CompiledKernel, CompileError, compile  # noqa: E402
from .api import attention, prepare, transpose_v  # noqa: E402
from .quantize import quantize_e4m3  # noqa: E402
from .varlen import attention_varlen  # noqa: E402
from .adapters import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from .backward import attention_backward  # noqa: E402
from .backward_spec import BackwardSpec  # noqa: E402
from .kvcache import attention_with_kvcache, flash_attn_with_kvcache  # noqa: E402

__all__ = ["KernelSpec", "SpecError", "default_spec", "default_specs", "emit", "compile", "CompiledKernel",
           "CompileError", "attention", "transpose_v", "quantize_e4m3", "prepare", "flash_attn_func",
           "attention_varlen", "flash_attn_varlen_func",
           "attention_backward", "BackwardSpec", "attention_with_kvcache", "flash_attn_with_kvcache",
           "__version__"]
