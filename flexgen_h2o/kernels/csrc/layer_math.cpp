// The element-wise layer math, one pass each: RMSNorm, SwiGLU's gate and RoPE. As torch ops they are 2-6 passes
// each, and every pass over a decode step's ~100k floats is a parallel region; with OMP_WAIT_POLICY=PASSIVE each
// region wakes the sleeping OpenMP threads (docs/architecture.md "How a token flows"). So a decode step's tensors
// (up to SERIAL_FLOATS) run on the calling thread; a prompt's are split across torch's threads, where one pass
// instead of several still saves memory traffic.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t SERIAL_FLOATS = 1 << 20;   // 4 MB: below this one thread does it (no parallel region)

// grain of rows (or elements, with m = 1) for at::parallel_for: ranges below SERIAL_FLOATS run inline
int64_t grain(int64_t m) { return std::max<int64_t>(1, SERIAL_FLOATS / std::max<int64_t>(1, m)); }

// sum of x[i]^2 over n floats
float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef FLEXGEN_H2O_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  sum = horizontal_sum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// silu(g) * u for one value: g * sigmoid(g), sigmoid from e^-|g| so that exp never overflows
inline float silu_times(float g, float u) {
  const float e = std::exp(-std::fabs(g));
  const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return g * sigmoid * u;
}

std::vector<float> as_float(const at::Tensor& t) {
  std::vector<float> out(t.numel());
  if (t.scalar_type() == at::kHalf)
    half_to_float(t.data_ptr<at::Half>(), out.data(), t.numel());
  else
    std::copy(t.data_ptr<float>(), t.data_ptr<float>() + t.numel(), out.begin());
  return out;
}

}  // namespace

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "rms_norm_rows: x must be contiguous fp32");
  const int64_t m = x.size(-1), n = x.numel() / m;
  TORCH_CHECK(weight.numel() == m && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kFloat),
              "rms_norm_rows: weight must be (m,) fp16 or fp32");
  const std::vector<float> w = as_float(weight);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(m), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = xp + r * m;
      float* dst = op + r * m;
      const float inv = 1.0f / std::sqrt(sum_squares(row, m) / static_cast<float>(m) + static_cast<float>(eps));
      int64_t i = 0;
#ifdef FLEXGEN_H2O_AVX2
      const __m256 invb = _mm256_set1_ps(inv);
      for (; i + 8 <= m; i += 8)       // (x * inv) * w, the torch ops' order
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + i), invb),
                                                _mm256_loadu_ps(w.data() + i)));
#endif
      for (; i < m; ++i) dst[i] = (row[i] * inv) * w[i];
    }
  });
  return out;
}

at::Tensor silu_mul_(at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.is_contiguous() &&
                  up.is_contiguous() && gate.sizes() == up.sizes(),
              "silu_mul_: gate and up must be contiguous fp32 of one shape");
  float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  const int64_t blocks = (gate.numel() + 7) / 8;                            // 8 floats: one vector
  at::parallel_for(0, blocks, grain(8), [&](int64_t lo, int64_t hi) {
    int64_t i = lo * 8;
    const int64_t end = std::min(hi * 8, gate.numel());
#ifdef FLEXGEN_H2O_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= end; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));               // e^-|x|
      const __m256 num = _mm256_blendv_ps(one, e, x);                        // sign bit set (x < 0): e
      const __m256 sigmoid = _mm256_div_ps(num, _mm256_add_ps(one, e));
      _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < end; ++i) g[i] = silu_times(g[i], u[i]);
  });
  return gate;
}

namespace {

// A product kept in a register as it is, rounded. With -mfma GCC fuses `a * b + c` into one FMA (its default
// -ffp-contract=fast; a build without this moved 25 % of RoPE's values in their last bit), where the torch ops round both
// products and then add. The empty asm hides the value from that fusion and emits no instruction. The portable
// build on x86 has no FMA to fuse into; on another ISA with FMA a build may fuse (an ulp from the torch ops).
template <typename T>
inline T rounded(T x) {
#ifdef FLEXGEN_H2O_AVX2
  asm("" : "+x"(x));
#endif
  return x;
}

// out = x * cos + rotate_half(x) * sin for one row of d, rotate_half(x) = (-x[half:], x[:half]): each product
// rounded, then added, as the torch ops do, so the values are theirs bit for bit
void rope_row(const float* row, const float* c, const float* sn, float* dst, int64_t d) {
  const int64_t half = d / 2;
  int64_t i = 0;
#ifdef FLEXGEN_H2O_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= half; i += 8) {
    const __m256 lo = _mm256_loadu_ps(row + i), hi = _mm256_loadu_ps(row + half + i);
    const __m256 a = rounded(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)));
    const __m256 r = rounded(_mm256_mul_ps(_mm256_xor_ps(hi, sign), _mm256_loadu_ps(sn + i)));
    _mm256_storeu_ps(dst + i, _mm256_add_ps(a, r));
    const __m256 a2 = rounded(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i)));
    const __m256 r2 = rounded(_mm256_mul_ps(lo, _mm256_loadu_ps(sn + half + i)));
    _mm256_storeu_ps(dst + half + i, _mm256_add_ps(a2, r2));
  }
#endif
  for (; i < half; ++i) {
    const float a = rounded(row[i] * c[i]), r = rounded((-row[i + half]) * sn[i]);
    dst[i] = a + r;
    const float a2 = rounded(row[i + half] * c[i + half]), r2 = rounded(row[i] * sn[i + half]);
    dst[i + half] = a2 + r2;
  }
}

}  // namespace

at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "rope_rows: x must be fp32 (b, h, t, d) with contiguous rows of even d");
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == b * t * d && sin.numel() == b * t * d,
              "rope_rows: cos and sin must be contiguous fp32 with one (d,) row per sequence and token");
  at::Tensor out = at::empty({b, h, t, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // one task a (sequence, token): its angles are read once for all heads; a decode step's run inline
  at::parallel_for(0, b * t, grain(h * d), [&](int64_t lo, int64_t hi) {
    for (int64_t st = lo; st < hi; ++st) {
      const int64_t s = st / t, tok = st % t;
      for (int64_t head = 0; head < h; ++head)
        rope_row(xp + s * x.stride(0) + head * x.stride(1) + tok * x.stride(2), cp + st * d, sp + st * d,
                 op + ((s * h + head) * t + tok) * d, d);
    }
  });
  return out;
}
