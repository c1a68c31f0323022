// Fused bfloat16 elementwise ops of the Llama block: one pass over each row instead of the
// 5-10 torch ops (and temporaries) that paged.model.ops spells them with. Each rounds to
// bfloat16 where HF's torch ops do, so results match those ops up to the order of the float
// sums in the norm's mean.
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = at::BFloat16;

inline float f32(bf16 v) { return bf16_to_float(v); }
inline float round_bf16(float v) { return f32(static_cast<bf16>(v)); }

constexpr int64_t GRAIN = 16;  // rows per thread chunk: small batches stay on one thread

#if defined(__AVX512BF16__)
#define PAGED_VEC 16  // floats per vector
inline __m512 load(const bf16* p) { return load_bf16x16(p); }
inline void store(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 round_bf16(__m512 v) {  // to the nearest bfloat16, as a float
  return widen_bf16x16((__m256i)_mm512_cvtneps_pbh(v));
}
// exp_approx (ops.h) on 16 lanes.
inline __m512 exp_approx(__m512 v) {
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 fk = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(fk, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(fk, _mm512_set1_ps(0.693359375f), v));
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(fk), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}
#else
#define PAGED_VEC 0
#endif

}  // namespace

// residual += x (bf16), then out = weight * bf16(r * rsqrt(mean(r^2) + eps)), r = residual.
// Without a residual: out = rms_norm(x). Rows of x and residual may be strided.
torch::Tensor rms_norm_bf16(torch::Tensor x, std::optional<torch::Tensor> residual,
                            torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1);
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous());
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty({T, H}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* rp = nullptr;
  int64_t rstride = 0;
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == torch::kBFloat16 && residual->stride(1) == 1);
    rp = residual->data_ptr<bf16>();
    rstride = residual->stride(0);
  }
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    std::vector<float> h(H);
    for (int64_t t = t0; t < t1; ++t) {
      const bf16* xr = xp + t * x.stride(0);
      float sum = 0.f;
      int64_t i0 = 0;  // elements [0, i0) done in vectors
#if PAGED_VEC
      {
        bf16* rr = rp ? rp + t * rstride : nullptr;
        __m512 acc = _mm512_setzero_ps();
        for (; i0 + PAGED_VEC <= H; i0 += PAGED_VEC) {
          __m512 v = load(xr + i0);
          if (rr) {
            v = round_bf16(_mm512_add_ps(load(rr + i0), v));
            store(rr + i0, v);
          }
          _mm512_storeu_ps(h.data() + i0, v);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        sum = _mm512_reduce_add_ps(acc);
      }
#endif
      if (rp) {
        bf16* rr = rp + t * rstride;
        for (int64_t i = i0; i < H; ++i) {
          const bf16 r = static_cast<bf16>(f32(rr[i]) + f32(xr[i]));
          rr[i] = r;
          h[i] = f32(r);
          sum += h[i] * h[i];
        }
      } else {
        for (int64_t i = i0; i < H; ++i) {
          h[i] = f32(xr[i]);
          sum += h[i] * h[i];
        }
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + e);
      bf16* o = op + t * H;
      int64_t i = 0;
#if PAGED_VEC
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; i + PAGED_VEC <= H; i += PAGED_VEC)
        store(o + i, _mm512_mul_ps(load(wp + i),
                                   round_bf16(_mm512_mul_ps(_mm512_loadu_ps(h.data() + i), vinv))));
#endif
      for (; i < H; ++i) o[i] = static_cast<bf16>(f32(wp[i]) * round_bf16(h[i] * inv));
    }
  });
  return out;
}

// q [T, Hq, D] and k [T, Hk, D] (token rows may be strided) rotated by the cos/sin of each
// token's position (cos_sin [max_len, D]: cos in the first half, sin in the second, float)
// into new contiguous tensors, as HF's x * cos + rotate_half(x) * sin in bfloat16.
std::vector<torch::Tensor> rotary_bf16(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                                       torch::Tensor cos_sin) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
              k.stride(1) == k.size(2));
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat && cos_sin.is_contiguous());
  auto pos = positions.to(torch::kLong).contiguous();
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  auto qo = torch::empty(q.sizes(), q.options());
  auto ko = torch::empty(k.sizes(), k.options());
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  // HF casts cos/sin to the model dtype, then each product and the sum round to bfloat16.
  auto rotate = [&](const bf16* in, bf16* out, int64_t heads, const float* cosv,
                    const float* sinv) {
    for (int64_t h = 0; h < heads; ++h) {
      const bf16* x = in + h * D;
      bf16* y = out + h * D;
      for (int64_t i = 0; i < half; ++i)
        y[i] = static_cast<bf16>(round_bf16(f32(x[i]) * cosv[i]) +
                                 round_bf16(-f32(x[i + half]) * sinv[i]));
      for (int64_t i = 0; i < half; ++i)
        y[half + i] = static_cast<bf16>(round_bf16(f32(x[half + i]) * cosv[i]) +
                                        round_bf16(f32(x[i]) * sinv[i]));
    }
  };
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    std::vector<float> cosv(half), sinv(half);
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cs + pp[t] * D;
      for (int64_t i = 0; i < half; ++i) {
        cosv[i] = round_bf16(c[i]);
        sinv[i] = round_bf16(c[half + i]);
      }
      rotate(q.data_ptr<bf16>() + t * q.stride(0), qo.data_ptr<bf16>() + t * q.size(1) * D,
             q.size(1), cosv.data(), sinv.data());
      rotate(k.data_ptr<bf16>() + t * k.stride(0), ko.data_ptr<bf16>() + t * k.size(1) * D,
             k.size(1), cosv.data(), sinv.data());
    }
  });
  return {qo, ko};
}

// x [T, 2I] (gate, then up) -> silu(gate) * up [T, I], rounding like HF's two torch ops.
torch::Tensor silu_and_mul_bf16(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1);
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const bf16* g = xp + t * x.stride(0);
      const bf16* u = g + I;
      bf16* o = op + t * I;
      int64_t i = 0;
#if PAGED_VEC
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + PAGED_VEC <= I; i += PAGED_VEC) {
        const __m512 gv = load(g + i);
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp_approx(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        store(o + i, _mm512_mul_ps(round_bf16(silu), load(u + i)));
      }
#endif
      for (; i < I; ++i) {
        const float gv = f32(g[i]);
        o[i] = static_cast<bf16>(round_bf16(gv / (1.f + exp_approx(-gv))) * f32(u[i]));
      }
    }
  });
  return out;
}
