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
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t MR = 3, NR = 4;             // 12 accumulators + 3 rows of x + 1 of w: the 16 AVX2 registers
constexpr int64_t X_BLOCK_BYTES = 288 << 10;  // rows of x per pass over a thread's weight rows: stays in L2

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
  for (int64_t i = 0; i < MR; ++i) {            // four vectors -> their four sums
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
    _mm_storeu_ps(sums[i], _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
#endif
  for (; c < k; ++c)                            // the tail of k (all of it without AVX2)
    for (int64_t i = 0; i < MR; ++i)
      for (int64_t j = 0; j < NR; ++j) sums[i][j] += xr[i][c] * w[j * k + c];
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) out[i * ldo + j] = sums[i][j];
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
