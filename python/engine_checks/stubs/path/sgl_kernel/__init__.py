"""Stub of sgl_kernel (SGLang's compiled CUDA kernels; not installed in the
engine harness). Only the names the checked path imports; each raises when
called. No ``sgl_kernel.allreduce``: SGLang's own custom allreduce then
reports itself unavailable (``IS_CUSTOM_AR_AVAILABLE = False``)."""

from _engine_stub import define

# sglang/srt/layers/layernorm.py imports these at module level on CUDA.
define(globals(), "sgl_kernel", ["fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "rmsnorm"])
