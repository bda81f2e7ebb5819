// x @ w.T for fp32 activations of a few rows against an fp16 weight, on a CPU: a decode step's linear layers.
//
// The torch path (ops.linear) upcasts the weight a chunk of rows at a time into an fp32 scratch buffer with copy_
// and hands it to the BLAS: every step converts every resident weight (134 M elements for SmolLM2 with its head),
// and the converted chunk falls out of L2 before the GEMM reads it back. Here each thread converts NR weight rows
// at a time into L1 and multiplies them at once with every row of x (kept in L2 a block of rows at a time), so
// the fp16 weight is read once and the fp32 copy never leaves L1.
//
// The micro-kernel holds an MR x NR tile of dot products in registers, each one a vector of partial sums along
// k (both x and w have k contiguous), reduced once at the end of k.
//
// With at most DIRECT_MAX_ROWS rows of x (batch-1 decoding, a few streams) each weight element is used by so few
// rows that storing it converted into L1 and reading it back costs more than converting it in a register at each
// use: direct_tile converts in registers and never stores it.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "gemm_tile.h"
#include "simd.h"

namespace {

// Few rows: R rows of x (all of them) against C weight rows read as fp16 and converted in registers. Past the
// last weight row (nc < C) the last row is read again and its sums are never stored.
template <int64_t R, int64_t C>
void direct_tile(const float* x, const at::Half* w, int64_t k, float* out, int64_t ldo, int64_t nc) {
  const at::Half* wr[C];
  for (int64_t j = 0; j < C; ++j) wr[j] = w + std::min(j, nc - 1) * k;
  float sums[R][C] = {};
  int64_t c = 0;
#ifdef FLEXGEN_H2O_AVX2
  __m256 acc[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  for (; c + 8 <= k; c += 8) {
    __m256 xv[R];
    for (int64_t i = 0; i < R; ++i) xv[i] = _mm256_loadu_ps(x + i * k + c);
    for (int64_t j = 0; j < C; ++j) {
      const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[j] + c)));
      for (int64_t i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; j += 4) {        // C = 2: the missing pair reduced as zeros
      float four[4];
      const __m256 zero = _mm256_setzero_ps();
      sum_four(acc[i][j], acc[i][j + 1], j + 2 < C ? acc[i][j + 2] : zero, j + 3 < C ? acc[i][j + 3] : zero, four);
      for (int64_t q = j; q < std::min(C, j + 4); ++q) sums[i][q] = four[q - j];
    }
#endif
  for (; c < k; ++c)
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < C; ++j) sums[i][j] = madd(x[i * k + c], static_cast<float>(wr[j][c]), sums[i][j]);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < nc; ++j) out[i * ldo + j] = sums[i][j];
}

// All R rows of x against C weight rows at a time, the weight converted in registers.
template <int64_t R, int64_t C>
void direct(const float* x, const at::Half* w, int64_t k, int64_t n, float* out) {
  const int64_t tiles = (n + C - 1) / C;
  const int64_t grain = std::max<int64_t>(1, std::min(MIN_BYTES_PER_THREAD / (C * k * 2),
                                                      MIN_FLOPS_PER_THREAD / (2 * C * k * R)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      direct_tile<R, C>(x, w + t * C * k, k, out + t * C, n, std::min(C, n - t * C));
  });
}

}  // namespace

// x (m, k) fp32 contiguous, w (n, k) fp16 contiguous -> x @ w.T (m, n) fp32
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous (m, k) float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kHalf && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be contiguous (n, k) float16 with x's k");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();               // an empty sum (and x_rows below divides by k)
  const float* xd = x.data_ptr<float>();
  const at::Half* wd = w.data_ptr<at::Half>();
  float* od = out.data_ptr<float>();
  switch (m) {              // R x C accumulators + R rows of x + 1 of w, of the 16 AVX2 registers
    case 1: direct<1, 8>(xd, wd, k, n, od); return out;
    case 2: direct<2, 4>(xd, wd, k, n, od); return out;
    case 3: direct<3, 4>(xd, wd, k, n, od); return out;
    case 4: direct<4, 2>(xd, wd, k, n, od); return out;
    case 5: direct<5, 2>(xd, wd, k, n, od); return out;
    case DIRECT_MAX_ROWS: direct<DIRECT_MAX_ROWS, 2>(xd, wd, k, n, od); return out;
    default: break;
  }
  const int64_t x_rows = std::max<int64_t>(MR, X_BLOCK_BYTES / (k * 4) / MR * MR);
  const int64_t tiles = (n + NR - 1) / NR;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(NR * k, 0.0f);
    for (int64_t r0 = 0; r0 < m; r0 += x_rows) {
      const int64_t r1 = std::min(m, r0 + x_rows);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * NR, nr = std::min(NR, n - n0);
        half_to_float(wd + n0 * k, wbuf.data(), nr * k);   // at the edge the rows past n are stale: never stored
        for (int64_t i = r0; i < r1; i += MR)
          tile(xd + i * k, std::min(MR, r1 - i), wbuf.data(), k, od + i * n + n0, n, nr);
      }
    }
  });
  return out;
}
