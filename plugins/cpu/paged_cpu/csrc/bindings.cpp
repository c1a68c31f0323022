#include "ops.h"

#include <pybind11/stl.h>  // std::optional arguments
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from Python

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "write K/V to the paged cache, decode attention");
  m.def("paged_decode_fp8", &paged_decode_fp8,
        "paged_decode over an fp8 cache (K/V quantized per kv head as they are written)");
  m.def("q8_linear_native", &q8_linear_native, "q8_linear has its AVX-512 VNNI path");
  m.def("q8_linear", &q8_linear, "x @ W^T (+ bias), W as GGUF blocks, x quantized to 8 bits");
  m.def("rms_norm_bf16", &rms_norm_bf16, "(residual += x), RMS norm, bfloat16");
  m.def("rotary_bf16", &rotary_bf16, "rotary embedding of q and k, bfloat16");
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16, "silu(gate) * up, bfloat16");
}
