// What the compiled kernels share below their math: the instruction-set switch, fp16 rows to fp32, and e^x.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FLEXGEN_H2O_AVX2 1
#endif

// n fp16 values to fp32: eight per F16C instruction where the build has it, one by one elsewhere.
inline void half_to_float(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef FLEXGEN_H2O_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#ifdef FLEXGEN_H2O_AVX2
inline float horizontal_sum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 to ~1 ulp: x = n ln2 + f with |f| <= ln2 / 2, e^f by its Taylor series to f^7, 2^n through the
// exponent bits. Below -87 (where e^x would be subnormal, and for masked keys at -inf) it gives exactly 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 in_range = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);           // ln 2 in two parts: exact n * hi
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), in_range);
}
#endif

// The numerators of a softmax over line[0, n) in place, e^(x - max), and their sum. Masked entries hold -inf and
// come out exactly 0; at least one entry must be finite. The caller scales by 1 / sum (the decode and prompt
// kernels each fold their own work into that pass).
inline float softmax_numerators(float* line, int64_t n) {
  float top = -std::numeric_limits<float>::infinity(), sum = 0.0f;
  int64_t i = 0;
#ifdef FLEXGEN_H2O_AVX2
  __m256 topv = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) topv = _mm256_max_ps(topv, _mm256_loadu_ps(line + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, topv);
  top = *std::max_element(lanes, lanes + 8);
#endif
  for (; i < n; ++i) top = std::max(top, line[i]);
  i = 0;
#ifdef FLEXGEN_H2O_AVX2
  const __m256 topb = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(line + i), topb));
    _mm256_storeu_ps(line + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = horizontal_sum(acc);
#endif
  for (; i < n; ++i) {
    line[i] = std::exp(line[i] - top);
    sum += line[i];
  }
  return sum;
}
