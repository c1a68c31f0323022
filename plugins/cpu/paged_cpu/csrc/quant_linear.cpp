// Linear layers on GGUF block weights with 8-bit activations, as llama.cpp computes them.
//
// A weight is stored as its file's blocks of 32 along K: an unsigned code c per element and,
// per (output column, block), a scale d and an offset m, so w = d * c + m (Q4_0, Q4_1, and
// Q8_0 with c = q + 128, m = -128 d). Each row of x is quantized per block of 32 to int8 q
// with a scale s (x ~ s * q, as llama.cpp's Q8_1), so one block contributes
//     d * s * sum(c * q) + m * s * sum(q)
// and sum(c * q) is an exact integer dot product: AVX-512 VNNI's u8 x s8 vpdpbusd.
//
// Packed weight layout (pack_blocks in linear.py): [N / 16, K / 32, G, 16, 4] uint8. With
// G = 8 (8-bit codes) one 64-byte load holds 4 consecutive k of 16 output columns; with G = 4
// (4-bit codes, Q4_0/Q4_1) a byte holds two codes, group g in its low nibble and group g + 4
// in its high one, so a decode step reads half the bytes, as llama.cpp's Q4 blocks. Scales
// [N / 16, K / 32, 2, 16] (d, then m), float16 where that is exact (GGUF's own scales are
// float16), else float32.
//
// Groups of 16 (Q6_K's sub-blocks, or a stack with such a piece): each block of 32 has two
// (d, m) pairs, one for k 0-15 (k-groups 0-3; with G = 4 the low nibbles) and one for k 16-31
// (k-groups 4-7; the high nibbles): scales [N / 16, K / 32, 4, 16] (d_lo, d_hi, m_lo, m_hi).
// x keeps one scale s per block of 32 and has s * sum(q) per half, so a block contributes
//     s * (d_lo * sum_lo(c * q) + d_hi * sum_hi(c * q)) + m_lo * s sum_lo(q) + m_hi * s sum_hi(q).
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>


namespace {

constexpr int64_t QB = 32;  // block length along K
constexpr int64_t NT = 16;  // output columns per tile: one register of floats

// One row of x (K elements) -> int8 codes, and per block: s and s * sum(q) (H: per half of
// 16, two a block).
template <bool H>
void quantize_row(const at::BFloat16* x, int64_t K, int8_t* q, float* s, float* sq) {
  for (int64_t b = 0; b < K / QB; ++b) {
    const at::BFloat16* xb = x + b * QB;
#if defined(__AVX512F__)
    const __m512 lo = load_bf16x16(xb), hi = load_bf16x16(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // round to nearest even
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QB), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QB + 16), _mm512_cvtepi32_epi8(qhi));
    int32_t total, high = 0;  // H: total is the first half's
    if constexpr (H) {
      total = _mm512_reduce_add_epi32(qlo);
      high = _mm512_reduce_add_epi32(qhi);
    } else {
      total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
#else
    float v[QB];
    float amax = 0.f;
    for (int64_t i = 0; i < QB; ++i) {
      v[i] = bf16_to_float(xb[i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t total = 0, high = 0;  // H: total is the first half's
    for (int64_t i = 0; i < QB; ++i) {
      const int32_t c = static_cast<int32_t>(std::nearbyint(v[i] * inv));
      q[b * QB + i] = static_cast<int8_t>(c);
      (H && i >= QB / 2 ? high : total) += c;
    }
#endif
    s[b] = amax / 127.f;
    if constexpr (H) {
      sq[2 * b] = s[b] * static_cast<float>(total);
      sq[2 * b + 1] = s[b] * static_cast<float>(high);
    } else {
      sq[b] = s[b] * static_cast<float>(total);
    }
  }
}

// Scale j of a tile's 16-column row of scales, float16 or float32.
template <typename S>
inline float scale_at(const S* p, int64_t j) {
  if constexpr (std::is_same_v<S, at::Half>) return static_cast<float>(p[j]);
  else return p[j];
}

#if defined(__AVX512F__)
template <typename S>
inline __m512 load_scales(const S* p) {
  if constexpr (std::is_same_v<S, at::Half>)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else return _mm512_loadu_ps(p);
}
#endif

// Output rows [m0, m0 + R) x columns of tiles [t0, t0 + T); G = 8 (a byte per code) or 4
// (two 4-bit codes per byte); H: groups of 16 (a (d, m) pair per half block); S the scales'
// type.
template <int R, int T, int G, bool H, typename S>
void gemm_tile(const int8_t* q, const float* s, const float* sq, int64_t K, const uint8_t* w,
               const S* dm, const float* bias, at::BFloat16* y, int64_t N, int64_t t0) {
  const int64_t nb = K / QB;
  constexpr int HN = H ? 2 : 1;  // (d, m) pairs a block, each over QB / HN consecutive k
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  constexpr int GH = H ? 4 : G;  // packed k-groups a pair's dots read
  __m512 acc[R][T];
  for (int t = 0; t < T; ++t) {
    const __m512 bv = bias ? _mm512_loadu_ps(bias + (t0 + t) * NT) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][t] = bv;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    for (int h = 0; h < HN; ++h) {
      __m512i dot[R][T];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) dot[r][t] = _mm512_setzero_si512();
      for (int g = 0; g < GH; ++g) {
        // k-group h * 4 + g: G = 8, its own 64 bytes; G = 4, nibble h of group g's (H) or both
        const int gw = G == 8 ? h * 4 + g : g;
        __m512i wv[T], wh[T];
        for (int t = 0; t < T; ++t) {
          const __m512i v = _mm512_loadu_si512(w + (((t0 + t) * nb + b) * G + gw) * NT * 4);
          if constexpr (G == 8) {
            wv[t] = v;
          } else if constexpr (H) {
            wv[t] = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, low4);
          } else {
            wv[t] = _mm512_and_si512(v, low4);
            wh[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          }
        }
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, q + r * K + b * QB + (h * 4 + g) * 4, sizeof four);
          const __m512i xv = _mm512_set1_epi32(four);
          for (int t = 0; t < T; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], wv[t], xv);
          if constexpr (G == 4 && !H) {
            std::memcpy(&four, q + r * K + b * QB + (g + 4) * 4, sizeof four);
            const __m512i xh = _mm512_set1_epi32(four);
            for (int t = 0; t < T; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], wh[t], xh);
          }
        }
      }
      for (int t = 0; t < T; ++t) {
        const S* dmb = dm + ((t0 + t) * nb + b) * 2 * HN * NT;
        const __m512 d = load_scales(dmb + h * NT), m = load_scales(dmb + (HN + h) * NT);
        for (int r = 0; r < R; ++r) {
          const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(s[r * nb + b]));
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), ds, acc[r][t]);
          acc[r][t] =
              _mm512_fmadd_ps(m, _mm512_set1_ps(sq[(r * nb + b) * HN + h]), acc[r][t]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t n = (t0 + t) * NT;
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(acc[r][t]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + n), (__m256i)out);
    }
  }
#else
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      for (int64_t j = 0; j < NT; ++j) {
        const int64_t n = (t0 + t) * NT + j;
        float acc = bias ? bias[n] : 0.f;
        for (int64_t b = 0; b < nb; ++b)
          for (int h = 0; h < HN; ++h) {
            int32_t dot = 0;
            for (int64_t k = h * QB / HN; k < (h + 1) * QB / HN; ++k) {
              const int64_t g = k / 4;  // the code of (column j, k) in the packed block
              const uint8_t byte =
                  w[((((t0 + t) * nb + b) * G + g % G) * NT + j) * 4 + k % 4];
              const uint8_t c = G == 8 ? byte : (g < 4 ? byte & 0x0F : byte >> 4);
              dot += static_cast<int32_t>(c) * q[r * K + b * QB + k];
            }
            const S* dmb = dm + ((t0 + t) * nb + b) * 2 * HN * NT;
            acc += scale_at(dmb, h * NT + j) * s[r * nb + b] * static_cast<float>(dot) +
                   scale_at(dmb, (HN + h) * NT + j) * sq[(r * nb + b) * HN + h];
          }
        y[r * N + n] = static_cast<at::BFloat16>(acc);
      }
#endif
}

constexpr int RMAX = 4, TMAX = 2;  // rows x column tiles per register block

template <typename S>
using TileKernel = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*,
                            const S*, const float*, at::BFloat16*, int64_t, int64_t);

template <int G, bool H, typename S, int... I>
constexpr std::array<TileKernel<S>, sizeof...(I)> make_table(std::integer_sequence<int, I...>) {
  return {gemm_tile<I / TMAX + 1, I % TMAX + 1, G, H, S>...};
}

// The kernel for R rows (1..RMAX) by T column tiles (1..TMAX).
template <int G, bool H, typename S>
TileKernel<S> tile_kernel(int R, int T) {
  static constexpr auto table =
      make_table<G, H, S>(std::make_integer_sequence<int, RMAX * TMAX>{});
  return table[(R - 1) * TMAX + (T - 1)];
}

// The row chunks x column-tile runs of y = x W^T, each on its kernels.
template <int G, bool H, typename S>
void gemm(const int8_t* qp, const float* sp, const float* sqp, int64_t M, int64_t K,
          int64_t tiles, const uint8_t* wp, const S* dmp, const float* bp, at::BFloat16* yp) {
  // Work items: (a chunk of up to 64 rows, TMAX column tiles); the rows reuse the tiles'
  // weights from cache.
  constexpr int64_t RC = 64;
  const int64_t N = tiles * NT, nb = K / QB;
  const int64_t row_chunks = (M + RC - 1) / RC, tile_runs = (tiles + TMAX - 1) / TMAX;
  at::parallel_for(0, row_chunks * tile_runs, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r0 = (i / tile_runs) * RC, r1 = std::min(M, r0 + RC);
      const int64_t t = (i % tile_runs) * TMAX;
      const int T = static_cast<int>(std::min<int64_t>(TMAX, tiles - t));
      for (int64_t m = r0; m < r1; m += RMAX) {
        const int R = static_cast<int>(std::min<int64_t>(RMAX, r1 - m));
        tile_kernel<G, H, S>(R, T)(qp + m * K, sp + m * nb, sqp + m * nb * (H ? 2 : 1), K,
                                   wp, dmp, bp, yp + m * N, N, t);
      }
    }
  });
}

}  // namespace

bool q8_linear_native() {
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                        std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x: [M, K] bfloat16");
  TORCH_CHECK(codes.dim() == 5 && codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() &&
                  (codes.size(2) == 8 || codes.size(2) == 4),
              "codes: [N/16, K/32, 8 or 4, 16, 4] uint8");
  TORCH_CHECK((scales.scalar_type() == torch::kFloat || scales.scalar_type() == torch::kHalf) &&
                  scales.is_contiguous() && scales.dim() == 4 &&
                  (scales.size(2) == 2 || scales.size(2) == 4),
              "scales: [N/16, K/32, 2 or 4, 16] float32 or float16");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), tiles = codes.size(0), N = tiles * NT,
                nb = K / QB;
  TORCH_CHECK(K % QB == 0 && codes.size(1) == nb, "x: K does not match the weight");
  TORCH_CHECK(scales.size(0) == tiles && scales.size(1) == nb, "scales: not the codes' blocks");
  const bool halves = scales.size(2) == 4;  // groups of 16: a (d, m) pair per half block
  std::optional<torch::Tensor> b32;
  if (bias) b32 = bias->to(torch::kFloat).contiguous();

  auto q = torch::empty({M, K}, torch::kInt8);
  auto s = torch::empty({M, nb}, torch::kFloat);
  auto sq = torch::empty({M, nb * (halves ? 2 : 1)}, torch::kFloat);
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = xc.data_ptr<at::BFloat16>();
  auto* qp = q.data_ptr<int8_t>();
  auto* sp = s.data_ptr<float>();
  auto* sqp = sq.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (halves) quantize_row<true>(xp + m * K, K, qp + m * K, sp + m * nb, sqp + m * nb * 2);
      else quantize_row<false>(xp + m * K, K, qp + m * K, sp + m * nb, sqp + m * nb);
    }
  });

  const auto* wp = codes.data_ptr<uint8_t>();
  const float* bp = b32 ? b32->data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  const auto run = [&](auto g, auto h) {  // G and H as types: std::integral_constant
    constexpr int G = decltype(g)::value;
    constexpr bool H = decltype(h)::value;
    if (scales.scalar_type() == torch::kHalf)
      gemm<G, H>(qp, sp, sqp, M, K, tiles, wp, scales.data_ptr<at::Half>(), bp, yp);
    else gemm<G, H>(qp, sp, sqp, M, K, tiles, wp, scales.data_ptr<float>(), bp, yp);
  };
  using G4 = std::integral_constant<int, 4>;
  using G8 = std::integral_constant<int, 8>;
  if (codes.size(2) == 4) {
    if (halves) run(G4{}, std::true_type{});
    else run(G4{}, std::false_type{});
  } else {
    if (halves) run(G8{}, std::true_type{});
    else run(G8{}, std::false_type{});
  }
  return y;
}
