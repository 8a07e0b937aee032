"""kvtier's stand-in for ``sgl_kernel.quantization``: the names sglang/srt/layers/quantization/gguf.py imports at
module level on CUDA (SGLang's device KV pool module imports that package); each raises a RuntimeError naming
itself if called. Nothing on the HiCache path calls them."""

from . import _not_in_standin

ggml_dequantize = _not_in_standin("sgl_kernel.quantization.ggml_dequantize")
ggml_moe_a8 = _not_in_standin("sgl_kernel.quantization.ggml_moe_a8")
ggml_mul_mat_a8 = _not_in_standin("sgl_kernel.quantization.ggml_mul_mat_a8")
ggml_mul_mat_vec_a8 = _not_in_standin("sgl_kernel.quantization.ggml_mul_mat_vec_a8")
