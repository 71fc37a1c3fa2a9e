"""facodegen: a code generator for FlashAttention kernels (sm80 and sm90): forward, backward, decode.

spec -> render -> compile -> launch, one package each:
``spec`` (KernelSpec and its knob registry, the backward's and decode family's specs, budget model,
default tiles), ``codegen`` (Jinja2 -> CUDA), ``runtime`` (NVRTC -> cubin and its cache, the CUDA
driver, TMA maps, argument structs, launch plans), ``ops`` (the calls: attention/prepare, the
backward, varlen, the KV-cache decode, torch operators, adapters), ``tuning`` (tuner and tuning
database), ``verify`` (float64 references, FlashAttention-rounding references, the fuzzer),
``bench`` (suites, peers, timing, plots); ``cli`` is the command line over them.
"""

__version__ = "0.1.0"

from .spec import KernelSpec, SpecError, default_spec, default_specs  # noqa: E402
from .codegen.render import emit  # noqa: E402
from .runtime.compiler import CompiledKernel, CompileError, compile  # noqa: E402
from .ops.api import attention, prepare, transpose_v  # noqa: E402
from .ops.quantize import quantize_e4m3  # noqa: E402
from .ops.varlen import attention_varlen  # noqa: E402
from .ops.adapters import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from .ops.backward import attention_backward  # noqa: E402
from .ops.varlen_backward import attention_varlen_backward  # noqa: E402
from .spec.backward import BackwardSpec  # noqa: E402
from .ops.kvcache import attention_with_kvcache, flash_attn_with_kvcache  # noqa: E402

__all__ = ["KernelSpec", "SpecError", "default_spec", "default_specs", "emit", "compile", "CompiledKernel",
           "CompileError", "attention", "transpose_v", "quantize_e4m3", "prepare", "flash_attn_func",
           "attention_varlen", "flash_attn_varlen_func",
           "attention_backward", "attention_varlen_backward", "BackwardSpec", "attention_with_kvcache", "flash_attn_with_kvcache",
           "__version__"]
