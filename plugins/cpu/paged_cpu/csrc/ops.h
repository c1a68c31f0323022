// The CPU plugin's C++ entry points (bound to Python in bindings.cpp).
#pragma once

// torch/types.h, not torch/extension.h: a quarter of its compile time (11 s against 41 s a
// file); only bindings.cpp needs Python.
#include <torch/types.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// A bfloat16 as a float: its bits are the float's upper half.
inline float bf16_to_float(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t&>(v)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512F__)
// 16 bfloat16 values (raw bits) as floats in one register.
inline __m512 widen_bf16x16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load_bf16x16(const at::BFloat16* p) {
  return widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// exp(v) in a form the compiler vectorizes (libm's expf does not): Cephes' expf polynomial,
// about 1 ulp, for v in [-87, 88].
inline float exp_approx(float v) {
  v = v < -87.f ? -87.f : (v > 88.f ? 88.f : v);
  const float t = v * 1.44269504088896341f;
  const int32_t k = static_cast<int32_t>(t < 0.f ? t - 0.5f : t + 0.5f);  // nearest
  const float fk = static_cast<float>(k);
  const float r = v - fk * 0.693359375f + fk * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.f;
  const int32_t bits = (k + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

void paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_tables,
                  torch::Tensor seq_lens, torch::Tensor out, int64_t reqs, double scale);
void paged_decode_fp8(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_tables,
                      torch::Tensor seq_lens, torch::Tensor out, int64_t reqs, double scale,
                      torch::Tensor k_scale, torch::Tensor v_scale);

bool q8_linear_native();
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                        std::optional<torch::Tensor> bias);

torch::Tensor rms_norm_bf16(torch::Tensor x, std::optional<torch::Tensor> residual,
                            torch::Tensor weight, double eps);
std::vector<torch::Tensor> rotary_bf16(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                                       torch::Tensor cos_sin);
torch::Tensor silu_and_mul_bf16(torch::Tensor x);
