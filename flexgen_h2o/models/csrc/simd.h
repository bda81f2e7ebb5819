// What the decode kernels share below their math: the instruction-set switch, and fp16 rows to fp32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

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
