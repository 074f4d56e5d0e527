"""Stub of sgl_kernel (SGLang's compiled CUDA kernels; not installed in the
engine harness). Only the names the checked path imports at module level
on CUDA (found by the dry run: ``run_checks --dry-run`` imports every
module of sglang-seeds.txt with CUDA stood in); each raises when called.
No ``sgl_kernel.allreduce``: SGLang's own custom allreduce then reports
itself unavailable (``IS_CUSTOM_AR_AVAILABLE = False``); no
``sgl_kernel.scalar_type``: SGLang uses its own fallback then."""

from _engine_stub import define

define(
    globals(),
    "sgl_kernel",
    [
        # sglang/srt/layers/layernorm.py
        "fused_add_rmsnorm",
        "gemma_fused_add_rmsnorm",
        "gemma_rmsnorm",
        "rmsnorm",
        # quantization/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py, w8a8_int8.py
        "int8_scaled_mm",
        # quantization/gguf.py, moe/moe_runner/triton_utils/fused_moe.py
        "moe_sum",
        "moe_sum_reduce",
        # kernels/ops/sampling/renorm.py
        "top_k_renorm_prob",
        "top_p_renorm_prob",
    ],
)
