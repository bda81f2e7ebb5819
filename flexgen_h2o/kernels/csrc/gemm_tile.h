// What the compiled linears (half_linear.cpp, quant_linear.cpp) share: the MR x NR register tile that multiplies
// rows of x with NR weight rows converted to fp32 in L1, and the work sizes that decide their threads.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

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
inline void tile(const float* x, int64_t mr, const float* w, int64_t k, float* out, int64_t ldo, int64_t nr) {
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

// Threads split the weight rows only where each gets enough work: below it, waking the sleeping OpenMP thread
// (OMP_WAIT_POLICY=PASSIVE) costs more than the thread saves. Few rows are bound by reading the weight (bytes),
// more rows by their multiply-adds (FLOPs). At one row only the largest matrices (SmolLM2's LM head) are split:
// smaller shares a thread made the whole decode step slower (docs/architecture.md "How a token flows").
constexpr int64_t MIN_BYTES_PER_THREAD = 4 << 20;
constexpr int64_t MIN_FLOPS_PER_THREAD = 8 << 20;
constexpr int64_t DIRECT_MAX_ROWS = 6;       // above it a converted weight tile has enough rows to pay for its store
