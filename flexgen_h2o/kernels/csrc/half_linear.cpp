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
// use: direct_tile converts in registers and never stores it (1.5x the batch-1 step's linear layers).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t MR = 3, NR = 4;             // 12 accumulators + 3 rows of x + 1 of w: the 16 AVX2 registers
constexpr int64_t X_BLOCK_BYTES = 288 << 10;  // rows of x per pass over a thread's weight rows: stays in L2

// the tail's multiply-add, fused where the build has FMA: every path rounds it the same way
inline float madd(float a, float b, float c) {
#ifdef FLEXGEN_H2O_AVX2
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

#ifdef FLEXGEN_H2O_AVX2
// four vectors of partial sums -> their four sums, each as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)):
// both tiles reduce through it, so a row's outputs do not depend on how many rows came with it
inline void sum_four(__m256 a, __m256 b, __m256 c, __m256 d, float* out) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

// out[i][j] (row stride ldo) = x_i . w_j for i < mr, j < NR; x rows have stride k, w rows (fp32, in L1) too
void tile(const float* x, int64_t mr, const float* w, int64_t k, float* out, int64_t ldo, int64_t nr) {
  const float* xr[MR];
  for (int64_t i = 0; i < MR; ++i) xr[i] = x + std::min(i, mr - 1) * k;    // past the edge: repeat a row
  float sums[MR][NR] = {};
  int64_t c = 0;
#ifdef FLEXGEN_H2O_AVX2
  __m256 acc[MR][NR];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (; c + 8 <= k; c += 8) {
    const __m256 x0 = _mm256_loadu_ps(xr[0] + c), x1 = _mm256_loadu_ps(xr[1] + c), x2 = _mm256_loadu_ps(xr[2] + c);
    for (int64_t j = 0; j < NR; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * k + c);
      acc[0][j] = _mm256_fmadd_ps(x0, wv, acc[0][j]);
      acc[1][j] = _mm256_fmadd_ps(x1, wv, acc[1][j]);
      acc[2][j] = _mm256_fmadd_ps(x2, wv, acc[2][j]);
    }
  }
  for (int64_t i = 0; i < MR; ++i) sum_four(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums[i]);
#endif
  for (; c < k; ++c)                            // the tail of k (all of it without AVX2)
    for (int64_t i = 0; i < MR; ++i)
      for (int64_t j = 0; j < NR; ++j) sums[i][j] = madd(xr[i][c], w[j * k + c], sums[i][j]);
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) out[i * ldo + j] = sums[i][j];
}

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

// Threads split the weight rows only where each gets enough work: below it, waking the sleeping OpenMP thread
// (OMP_WAIT_POLICY=PASSIVE) costs more than the thread saves. Few rows are bound by reading the weight (bytes),
// more rows by their multiply-adds (FLOPs). At one row on this project's 2-core VM the whole decode step took
// 1.17x as long with 1 MB a thread as with 4 MB, where only the 57 MB head is split (docs/suite.md).
constexpr int64_t MIN_BYTES_PER_THREAD = 4 << 20;
constexpr int64_t MIN_FLOPS_PER_THREAD = 8 << 20;
constexpr int64_t DIRECT_MAX_ROWS = 6;       // above it the buffered tiles were faster (8 and 16 rows measured)

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
