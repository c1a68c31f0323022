// Paged attention for the CPU plugin: writes new K/V into the paged cache and runs decode
// attention straight from the cache blocks (no gathered copy of the context).
// Cache layout: [kv_heads, num_blocks, block_size, head_dim], as CpuAttentionBackend makes it.
// An fp8 cache (--kv-cache-dtype fp8) holds x / scale (one float scale per kv head, saturated,
// rounded to nearest even: paged.model.kv_quant.quantize); K's scale folds into the query's,
// V's into the output.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>


namespace {

// x[i] = exp(x[i] - shift) for x[i] <= shift, returning the sum; a loop that vectorizes.
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = exp_approx(x[i] - shift);
    total += x[i];
  }
  return total;
}

// Element i of a cache row as float, written so that loops over i vectorize.
inline float f32(const float* p, int64_t i) { return p[i]; }
inline float f32(const double* p, int64_t i) { return static_cast<float>(p[i]); }
inline float f32(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline float f32(const at::BFloat16* p, int64_t i) { return bf16_to_float(p[i]); }

// Every fp8 byte's value, for the cache's reads.
template <typename F>
std::array<float, 256> fp8_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(F(static_cast<uint8_t>(b), F::from_bits()));
  return t;
}
const std::array<float, 256> kE4M3 = fp8_table<c10::Float8_e4m3fn>();
const std::array<float, 256> kE5M2 = fp8_table<c10::Float8_e5m2>();
inline const float* fp8_lut(const c10::Float8_e4m3fn*) { return kE4M3.data(); }
inline const float* fp8_lut(const c10::Float8_e5m2*) { return kE5M2.data(); }
inline float f32(const c10::Float8_e4m3fn* p, int64_t i) { return kE4M3[p[i].x]; }
inline float f32(const c10::Float8_e5m2* p, int64_t i) { return kE5M2[p[i].x]; }

// Row of token t (of kv head h) in a [kv_heads, blocks, block_size, d] cache, via the table.
template <typename T>
inline const T* cache_row(const T* cache, int64_t h, int64_t num_blocks, int64_t block_size,
                          int64_t d, const int32_t* table, int64_t t) {
  return cache + ((h * num_blocks + table[t / block_size]) * block_size + t % block_size) * d;
}

#if defined(__AVX512F__)
// 16 elements as floats in one register.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) { return load_bf16x16(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename F, typename = std::enable_if_t<std::is_same_v<F, c10::Float8_e4m3fn> ||
                                                  std::is_same_v<F, c10::Float8_e5m2>>>
inline __m512 load16(const F* p) {  // 16 bytes through the value table
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_i32gather_ps(idx, fp8_lut(p), 4);
}

// One (request, kv head) of decode attention with head_dim D and G query heads per kv head,
// the query and the running sums in registers.
template <typename T, typename CT, int D, int G>
void decode_task_avx512(const T* q, const CT* k_cache, const CT* v_cache, T* out,
                        const int32_t* table, int64_t len, int64_t h, int64_t num_blocks,
                        int64_t block_size, float scale, float v_mult,
                        std::vector<float>& scores) {
  constexpr int C = D / 16;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      qv[g][c] = _mm512_mul_ps(load16(q + g * D + c * 16), _mm512_set1_ps(scale));
  scores.resize(G * len);
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = -3.0e38f;
  for (int64_t t = 0; t < len; ++t) {
    const CT* kp = cache_row(k_cache, h, num_blocks, block_size, D, table, t);
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load16(kp + c * 16);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
      const float s = _mm512_reduce_add_ps(a);
      scores[g * len + t] = s;
      top[g] = std::max(top[g], s);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g)
    inv[g] = v_mult / exp_shifted_sum(scores.data() + g * len, len, top[g]);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const CT* vp = cache_row(v_cache, h, num_blocks, block_size, D, table, t);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vp + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * len + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  float row[D];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(row + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
    for (int i = 0; i < D; ++i) out[g * D + i] = static_cast<T>(row[i]);
  }
}

// The register kernel for the common shapes; false: use the generic loop.
template <typename T, typename CT>
bool decode_task_fast(int64_t d, int64_t group, const T* q, const CT* k_cache,
                      const CT* v_cache, T* out, const int32_t* table, int64_t len, int64_t h,
                      int64_t num_blocks, int64_t block_size, float scale, float v_mult,
                      std::vector<float>& scores) {
#define PAGED_CASE(DD, GG)                                                                 \
  if (d == DD && group == GG) {                                                            \
    decode_task_avx512<T, CT, DD, GG>(q, k_cache, v_cache, out, table, len, h, num_blocks, \
                                      block_size, scale, v_mult, scores);                  \
    return true;                                                                           \
  }
  PAGED_CASE(64, 1) PAGED_CASE(64, 2) PAGED_CASE(64, 3) PAGED_CASE(64, 4)
  PAGED_CASE(128, 1) PAGED_CASE(128, 2)
#undef PAGED_CASE
  return false;
}
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += q[i + j] * f32(k, i + j);
  float sum = 0.f;
  for (; i < d; ++i) sum += q[i] * f32(k, i);
  for (int j = 0; j < 16; ++j) sum += acc[j];
  return sum;
}

template <typename T>
void write_cache(const T* k, const T* v, T* k_cache, T* v_cache, const int64_t* slots,
                 int64_t tokens, int64_t heads, int64_t slots_per_head, int64_t d) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t src = (t * heads + h) * d, dst = (h * slots_per_head + slot) * d;
        std::copy(k + src, k + src + d, k_cache + dst);
        std::copy(v + src, v + src + d, v_cache + dst);
      }
    }
  });
}

// fp8(clamp(x / scale)) per kv head, as torch's x.float() / scale, clamp, .to(fp8) rounds.
template <typename T, typename CT>
void write_cache_fp8(const T* k, const T* v, CT* k_cache, CT* v_cache, const int64_t* slots,
                     int64_t tokens, int64_t heads, int64_t slots_per_head, int64_t d,
                     const float* k_scale, const float* v_scale) {
  const float top = static_cast<float>(std::numeric_limits<CT>::max());
  auto put = [&](const T* x, CT* y, float s) {
    for (int64_t i = 0; i < d; ++i) y[i] = CT(std::clamp(static_cast<float>(x[i]) / s, -top, top));
  };
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t src = (t * heads + h) * d, dst = (h * slots_per_head + slot) * d;
        put(k + src, k_cache + dst, k_scale[h]);
        put(v + src, v_cache + dst, v_scale[h]);
      }
    }
  });
}

// k_scale / v_scale: per kv head for an fp8 cache (K's folds into the score scale, V's into
// the output), null for a model-dtype cache.
template <typename T, typename CT>
void decode(const T* q, const CT* k_cache, const CT* v_cache, T* out, const int32_t* tables,
            const int32_t* seq_lens, int64_t reqs, int64_t q_heads, int64_t kv_heads,
            int64_t num_blocks, int64_t block_size, int64_t d, int64_t table_width,
            float scale_all, const float* k_scale = nullptr, const float* v_scale = nullptr) {
  const int64_t group = q_heads / kv_heads;
  int64_t tokens = 0;
  for (int64_t r = 0; r < reqs; ++r) tokens += seq_lens[r];
  // Tasks per thread chunk: enough work (~256K multiply-adds) to pay for waking a thread.
  const int64_t work = std::max<int64_t>(1, tokens / reqs * group * d * 2);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / work);
  at::parallel_for(0, reqs * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads, len = seq_lens[r];
      const int32_t* table = tables + r * table_width;
      const float scale = k_scale ? scale_all * k_scale[h] : scale_all;
      const float v_mult = v_scale ? v_scale[h] : 1.f;
#if defined(__AVX512F__)
      if constexpr (!std::is_same_v<T, double>) {
        const int64_t at = (r * q_heads + h * group) * d;
        if (decode_task_fast<T, CT>(d, group, q + at, k_cache, v_cache, out + at, table, len,
                                    h, num_blocks, block_size, scale, v_mult, scores))
          continue;
      }
#endif
      for (int64_t i = 0; i < group * d; ++i)
        qf[i] = static_cast<float>(q[(r * q_heads + h * group) * d + i]);
      scores.assign(group * len, 0.f);
      std::vector<float> top(group, -3.0e38f);
      for (int64_t t = 0; t < len; ++t) {  // scores over K, read in place from its block
        const CT* kp = cache_row(k_cache, h, num_blocks, block_size, d, table, t);
        for (int64_t g = 0; g < group; ++g) {
          const float s = dot(qf.data() + g * d, kp, d) * scale;
          scores[g * len + t] = s;
          top[g] = std::max(top[g], s);
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax, then the weighted sum of V
        float* sg = scores.data() + g * len;
        const float inv = v_mult / exp_shifted_sum(sg, len, top[g]);
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const CT* vp = cache_row(v_cache, h, num_blocks, block_size, d, table, t);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * d;
          for (int64_t i = 0; i < d; ++i) ag[i] += p * f32(vp, i);
        }
      }
      for (int64_t i = 0; i < group * d; ++i)
        out[(r * q_heads + h * group) * d + i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// k/v [T, kv_heads, d] go to `slots` of the caches; then requests [0, reqs) of the batch (one
// query token each, q [>= reqs, q_heads, d]) attend over their blocks into out[:reqs].
void paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                  torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_tables,
                  torch::Tensor seq_lens, torch::Tensor out, int64_t reqs, double scale) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
              out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt32 &&
              seq_lens.scalar_type() == torch::kInt32);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1),
                block_size = k_cache.size(2), d = k_cache.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    write_cache<scalar_t>(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                          k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          slots.data_ptr<int64_t>(), k.size(0), kv_heads,
                          num_blocks * block_size, d);
    if (reqs > 0)
      decode<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                       v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), reqs, q.size(1),
                       kv_heads, num_blocks, block_size, d, tables.size(1),
                       static_cast<float>(scale));
  });
}

// paged_decode over an fp8 cache: k/v quantized with the per-kv-head float32 scales as they are
// written; decode reads the bytes through a value table.
void paged_decode_fp8(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_tables,
                      torch::Tensor seq_lens, torch::Tensor out, int64_t reqs, double scale,
                      torch::Tensor k_scale, torch::Tensor v_scale) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
              out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt32 &&
              seq_lens.scalar_type() == torch::kInt32);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1),
                block_size = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(k_scale.scalar_type() == torch::kFloat && v_scale.scalar_type() == torch::kFloat &&
              k_scale.numel() == kv_heads && v_scale.numel() == kv_heads);
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache_type &&
              (cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2));
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto ks = k_scale.contiguous(), vs = v_scale.contiguous();
  auto run = [&](auto cache_tag) {
    using CT = decltype(cache_tag);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_fp8",
                                    [&] {
      auto* kc = reinterpret_cast<CT*>(k_cache.data_ptr());
      auto* vc = reinterpret_cast<CT*>(v_cache.data_ptr());
      write_cache_fp8<scalar_t, CT>(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), kc, vc,
                                    slots.data_ptr<int64_t>(), k.size(0), kv_heads,
                                    num_blocks * block_size, d, ks.data_ptr<float>(),
                                    vs.data_ptr<float>());
      if (reqs > 0)
        decode<scalar_t, CT>(q.data_ptr<scalar_t>(), kc, vc, out.data_ptr<scalar_t>(),
                             tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), reqs,
                             q.size(1), kv_heads, num_blocks, block_size, d, tables.size(1),
                             static_cast<float>(scale), ks.data_ptr<float>(),
                             vs.data_ptr<float>());
    });
  };
  if (cache_type == at::kFloat8_e4m3fn)
    run(c10::Float8_e4m3fn());
  else
    run(c10::Float8_e5m2());
}
