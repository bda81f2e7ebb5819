// x @ w.T for fp32 activations against a group-wise quantized weight (quant.py's row form), on a CPU: the linear
// layers of a 4-bit or 8-bit model, reading 0.28x or 0.53x the bytes of an fp16 weight (groups of 64).
//
// Each weight row is one uint8 row, [packed values | fp16 minimum x G | fp16 step x G] with G = ceil(k /
// group_size), and a value is minimum + q * step (4-bit: two a byte, the even element in the low nibble). The plan
// is half_linear.cpp's: with few rows of x (decoding) each weight value is dequantized in a register at each use
// and never stored; with more rows NR weight rows at a time are dequantized into an fp32 buffer in L1 and
// multiplied by the shared register tile (gemm_tile.h).
//
// Both paths dequantize a value as fma(q, step, minimum) and sum each dot product in the same order (eight lanes
// along k, reduced by sum_four, then the tail of k), so a row's outputs do not depend on how many rows came with
// it. That needs whole vectors inside one group: a group_size that is not a multiple of 8 always takes the
// buffered path.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm_tile.h"
#include "simd.h"

namespace {

// A weight row: packed values in [0, data_bytes), then `groups` fp16 minima, then `groups` fp16 steps.
struct Layout {
  int64_t k, group_size, groups, data_bytes, row_bytes;
};

// An fp16 at any byte offset: with an odd data_bytes (4-bit, odd group_size / 2 and groups) it is unaligned.
inline float half_at(const uint8_t* p) {
  uint16_t raw;
  std::memcpy(&raw, p, 2);
  return static_cast<float>(c10::Half(raw, c10::Half::from_bits()));
}

inline float minimum_of(const uint8_t* row, const Layout& l, int64_t g) { return half_at(row + l.data_bytes + 2 * g); }
inline float step_of(const uint8_t* row, const Layout& l, int64_t g) {
  return half_at(row + l.data_bytes + 2 * (l.groups + g));
}

template <int64_t BITS>
inline float quant_at(const uint8_t* row, int64_t c) {
  return static_cast<float>(BITS == 8 ? row[c] : (row[c >> 1] >> ((c & 1) * 4)) & 0xF);
}

#ifdef FLEXGEN_H2O_AVX2
// q of the eight values from c (even), as floats: 8 bytes widened, or 4 bytes whose nibbles each lane shifts out
template <int64_t BITS>
inline __m256 quant8(const uint8_t* row, int64_t c) {
  if (BITS == 8)
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c))));
  int32_t word;
  std::memcpy(&word, row + (c >> 1), 4);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  return _mm256_cvtepi32_ps(
      _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(0xF)));
}
#endif

// nr weight rows' k values as fp32 into dst (rows of k), rounded as direct_tile's registers round them. Out of
// line: inlined beside tile, its constants took registers that tile's rows of x need, and the loop is load-bound.
template <int64_t BITS>
__attribute__((noinline)) void dequant_rows(const uint8_t* w, int64_t nr, const Layout& l, float* dst) {
  for (int64_t j = 0; j < nr; ++j) {
    const uint8_t* row = w + j * l.row_bytes;
    float* out = dst + j * l.k;
    for (int64_t g = 0; g < l.groups; ++g) {
      const float lo = minimum_of(row, l, g), step = step_of(row, l, g);
      int64_t c = g * l.group_size;
      const int64_t end = std::min(l.k, c + l.group_size);     // the last group's padding is never read
#ifdef FLEXGEN_H2O_AVX2
      const __m256 lov = _mm256_set1_ps(lo), stepv = _mm256_set1_ps(step);
      for (; c + 8 <= end; c += 8) _mm256_storeu_ps(out + c, _mm256_fmadd_ps(quant8<BITS>(row, c), stepv, lov));
#endif
      for (; c < end; ++c) out[c] = madd(quant_at<BITS>(row, c), step, lo);
    }
  }
}

// Few rows: R rows of x (all of them) against C weight rows dequantized in registers, a group's minimum and step
// broadcast once per group. Past the last weight row (nc < C) the last row is read again, its sums never stored.
template <int64_t R, int64_t C, int64_t BITS>
void direct_tile(const float* x, const uint8_t* w, const Layout& l, float* out, int64_t ldo, int64_t nc) {
  const int64_t k = l.k;
  const uint8_t* wr[C];
  for (int64_t j = 0; j < C; ++j) wr[j] = w + std::min(j, nc - 1) * l.row_bytes;
  float sums[R][C] = {};
  int64_t c = 0;
#ifdef FLEXGEN_H2O_AVX2
  __m256 acc[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t vec_end = k / 8 * 8;
  for (int64_t g = 0; c < vec_end; ++g) {      // group_size % 8 == 0: a vector never straddles two groups
    const int64_t end = std::min(vec_end, (g + 1) * l.group_size);
    __m256 lo[C], step[C];
    for (int64_t j = 0; j < C; ++j) {
      lo[j] = _mm256_set1_ps(minimum_of(wr[j], l, g));
      step[j] = _mm256_set1_ps(step_of(wr[j], l, g));
    }
    for (; c < end; c += 8) {
      __m256 xv[R];
      for (int64_t i = 0; i < R; ++i) xv[i] = _mm256_loadu_ps(x + i * k + c);
      for (int64_t j = 0; j < C; ++j) {
        const __m256 wv = _mm256_fmadd_ps(quant8<BITS>(wr[j], c), step[j], lo[j]);
        for (int64_t i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
      }
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; j += 4) {
      __m256 part[4];
      for (int64_t q = 0; q < 4; ++q) part[q] = j + q < C ? acc[i][j + q] : _mm256_setzero_ps();   // C < 4: zeros
      float four[4];
      sum_four(part[0], part[1], part[2], part[3], four);
      for (int64_t q = j; q < std::min(C, j + 4); ++q) sums[i][q] = four[q - j];
    }
#endif
  while (c < k) {                               // the tail of k (all of it without AVX2), a group at a time
    const int64_t g = c / l.group_size, end = std::min(k, (g + 1) * l.group_size);
    float lo[C], step[C];
    for (int64_t j = 0; j < C; ++j) lo[j] = minimum_of(wr[j], l, g), step[j] = step_of(wr[j], l, g);
    for (; c < end; ++c)
      for (int64_t j = 0; j < C; ++j) {
        const float wv = madd(quant_at<BITS>(wr[j], c), step[j], lo[j]);
        for (int64_t i = 0; i < R; ++i) sums[i][j] = madd(x[i * k + c], wv, sums[i][j]);
      }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < nc; ++j) out[i * ldo + j] = sums[i][j];
}

// All R rows of x against C weight rows at a time; threads split by the quantized bytes they read.
template <int64_t R, int64_t C, int64_t BITS>
void direct(const float* x, const uint8_t* w, const Layout& l, int64_t n, float* out) {
  const int64_t tiles = (n + C - 1) / C;
  const int64_t grain = std::max<int64_t>(1, std::min(MIN_BYTES_PER_THREAD / (C * l.row_bytes),
                                                      MIN_FLOPS_PER_THREAD / (2 * C * l.k * R)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      direct_tile<R, C, BITS>(x, w + t * C * l.row_bytes, l, out + t * C, n, std::min(C, n - t * C));
  });
}

template <int64_t BITS>
void quant_linear_bits(const float* x, const uint8_t* w, const Layout& l, int64_t m, int64_t n, float* out) {
  if (l.group_size % 8 == 0) {
    switch (m) {  // R x C sums, R rows of x, C minima and steps: C as large as fits the 16 registers (measured)
      case 1: return direct<1, 4, BITS>(x, w, l, n, out);
      case 2: return direct<2, 2, BITS>(x, w, l, n, out);
      case 3: return direct<3, 2, BITS>(x, w, l, n, out);
      case 4: return direct<4, 2, BITS>(x, w, l, n, out);
      case 5: return direct<5, 2, BITS>(x, w, l, n, out);
      case DIRECT_MAX_ROWS: return direct<DIRECT_MAX_ROWS, 1, BITS>(x, w, l, n, out);
      default: break;
    }
  }
  const int64_t k = l.k;
  const int64_t x_rows = std::max<int64_t>(MR, X_BLOCK_BYTES / (k * 4) / MR * MR);
  const int64_t tiles = (n + NR - 1) / NR;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(NR * k, 0.0f);
    for (int64_t r0 = 0; r0 < m; r0 += x_rows) {
      const int64_t r1 = std::min(m, r0 + x_rows);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * NR, nr = std::min(NR, n - n0);
        dequant_rows<BITS>(w + n0 * l.row_bytes, nr, l, wbuf.data());   // rows past n: stale, never stored
        for (int64_t i = r0; i < r1; i += MR)
          tile(x + i * k, std::min(MR, r1 - i), wbuf.data(), k, out + i * n + n0, n, nr);
      }
    }
  });
}

}  // namespace

// x (m, k) fp32 contiguous, w (n, row_bytes) uint8 contiguous in quant.py's row form -> x @ dequant(w).T (m, n)
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t k, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0, "quant_linear: group_size must be even and >= 2, got ",
              group_size);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == k,
              "quant_linear: x must be contiguous (m, k) float32 with k = ", k);
  const int64_t groups = (k + group_size - 1) / group_size, data_bytes = groups * group_size * bits / 8;
  const Layout l{k, group_size, groups, data_bytes, data_bytes + 4 * groups};
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == l.row_bytes,
              "quant_linear: w must be contiguous (n, ", l.row_bytes, ") uint8 rows (the row form of k = ", k,
              " at ", bits, " bits, group_size ", group_size, "), got ", w.scalar_type(), " ", w.sizes());
  const int64_t m = x.size(0), n = w.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();               // an empty sum (and x_rows divides by k)
  const float* xd = x.data_ptr<float>();
  const uint8_t* wd = w.data_ptr<uint8_t>();
  float* od = out.data_ptr<float>();
  if (bits == 4)
    quant_linear_bits<4>(xd, wd, l, m, n, od);
  else
    quant_linear_bits<8>(xd, wd, l, m, n, od);
  return out;
}
