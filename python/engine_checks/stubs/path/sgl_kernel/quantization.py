"""Stub of sgl_kernel.quantization (see __init__.py): the names
sglang/srt/layers/quantization/gguf.py imports at module level on CUDA;
each raises when called."""

from _engine_stub import define

define(globals(), "sgl_kernel.quantization", ["ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8"])
