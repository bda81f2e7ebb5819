// One decode step's attention over the fp16 KV cache on a CPU, with the attention mass each key received (the
// column H2O adds to its scores).
//
// The torch-op path (ops.narrow_decode_attention) upcasts the window to fp32 a block of sequences at a time with
// copy_ and multiplies it with batched GEMMs of r query rows. At SmolLM2's batch 120 x 3 KV heads x 409 slots that
// is ~565 M elements converted per step (~1.6 G elements/s through copy_ on this project's VM) and bmm at
// ~19 GFLOP/s. Here each thread takes one (sequence, KV head) at a time and converts each key or value row once,
// into a row in L1, where every query head of the group uses it: the window is read once, as fp16.
//
// Built with -mavx2 -mfma -mf16c where the CPU has them (models/fused.py decides); elsewhere the same loops run
// as plain C++, which the compiler vectorises as it can.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

float dot(const float* a, const float* b, int64_t d) {
  float sum = 0.0f;
  for (int64_t i = 0; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

#ifdef FLEXGEN_H2O_AVX2
// the eight lanes of x[u] summed, into lane u of the result
inline __m256 sum_each(const __m256* x) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// logits[i] = q . rows[i] for the n rows of d floats. Eight rows at a time share one reduction: a horizontal sum
// per row would cost more instructions than its FMAs (d = 64).
void dot_rows(const float* q, const float* rows, int64_t n, int64_t d, float* logits) {
  int64_t i = 0;
#ifdef FLEXGEN_H2O_AVX2
  if (d % 8 == 0) {
    for (; i + 8 <= n; i += 8) {
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + (i + u) * d + c), acc[u]);
      }
      _mm256_storeu_ps(logits + i, sum_each(acc));
    }
  }
#endif
  for (; i < n; ++i) logits[i] = dot(q, rows + i * d, d);
}

#ifdef FLEXGEN_H2O_AVX2
// out[c0, c0 + 8 NC) += sum_i w[i] rows[i][c0, c0 + 8 NC), the NC vectors of the sum held in registers
template <int NC>
void weighted_block(const float* w, const float* rows, int64_t n, int64_t d, int64_t c0, float* out) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(out + c0 + 8 * c);
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] == 0.0f) continue;                   // masked slots: nothing to add, and never read their rows
    const __m256 wv = _mm256_set1_ps(w[i]);
    const float* row = rows + i * d + c0;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row + 8 * c), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + c0 + 8 * c, acc[c]);
}
#endif

// out[0, d) += sum_i w[i] rows[i], skipping rows whose weight is 0
void weighted_rows(const float* w, const float* rows, int64_t n, int64_t d, float* out) {
#ifdef FLEXGEN_H2O_AVX2
  if (d % 8 == 0) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      switch (std::min<int64_t>(8, (d - c0) / 8)) {
        case 8: weighted_block<8>(w, rows, n, d, c0, out); break;
        case 7: weighted_block<7>(w, rows, n, d, c0, out); break;
        case 6: weighted_block<6>(w, rows, n, d, c0, out); break;
        case 5: weighted_block<5>(w, rows, n, d, c0, out); break;
        case 4: weighted_block<4>(w, rows, n, d, c0, out); break;
        case 3: weighted_block<3>(w, rows, n, d, c0, out); break;
        case 2: weighted_block<2>(w, rows, n, d, c0, out); break;
        default: weighted_block<1>(w, rows, n, d, c0, out); break;
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] == 0.0f) continue;
    for (int64_t c = 0; c < d; ++c) out[c] += w[i] * rows[i * d + c];
  }
}

// A softmax over n logits in place, each first offset by its mask's bias (0 or -inf). Masked entries come out
// exactly 0; at least one entry must be unmasked.
void masked_softmax(float* line, const float* bias, int64_t n) {
  int64_t i = 0;
  float top = -std::numeric_limits<float>::infinity(), sum = 0.0f;
#ifdef FLEXGEN_H2O_AVX2
  __m256 topv = _mm256_set1_ps(top);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_add_ps(_mm256_loadu_ps(line + i), _mm256_loadu_ps(bias + i));
    _mm256_storeu_ps(line + i, x);
    topv = _mm256_max_ps(topv, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, topv);
  top = *std::max_element(lanes, lanes + 8);
#endif
  for (; i < n; ++i) {
    line[i] += bias[i];
    top = std::max(top, line[i]);
  }
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
  const float inv = 1.0f / sum;
  for (i = 0; i < n; ++i) line[i] *= inv;
}

struct Problem {
  int64_t b, g, r, s, d;
  const float* q;                 // (b, g * r, d), contiguous
  const at::Half* k;              // window rows: k + bi * kb + gi * kg + slot * d
  const at::Half* v;
  int64_t kb, kg, vb, vg;
  const bool* valid;              // (b, g, s)
  const int64_t* slot;            // (b, g): where the new token sits in the window
  const float* k_new;             // (b, g, d): its key and value, unrounded
  const float* v_new;
  float scale, pool;              // pool: 1 to sum the group's heads into a key's mass, 1 / r for their mean
  float* out;                     // (b, g * r, d)
  float* mass;                    // (b, g, s), or null
};

// Every row of one (sequence, KV head) window in fp32, the new token's unrounded row at its slot, and the mask
// as a bias. Rows of invalid slots are zeroed: they are multiplied (by a 0 weight in the dot products), so they
// must be finite, whatever a freed slot of the cache holds.
void window_rows(const at::Half* src, const float* new_row, int64_t new_slot, const bool* valid, int64_t s,
                 int64_t d, float* rows, float* bias) {
  for (int64_t i = 0; i < s; ++i) {
    if (i == new_slot)
      std::copy(new_row, new_row + d, rows + i * d);
    else if (valid[i])
      half_to_float(src + i * d, rows + i * d, d);
    else
      std::fill(rows + i * d, rows + (i + 1) * d, 0.0f);
    if (bias != nullptr) bias[i] = valid[i] ? 0.0f : -std::numeric_limits<float>::infinity();
  }
}

// the (sequence bi, KV head gi) column: r query heads over s slots. rows: s x d floats of scratch (at most a
// few hundred KB: L2), so each key and value row is converted from fp16 once and read from cache by every head
void attend_column(const Problem& p, int64_t bi, int64_t gi, float* qs, float* probs, float* rows, float* bias) {
  const int64_t bg = bi * p.g + gi, s = p.s, d = p.d, r = p.r;
  const bool* valid = p.valid + bg * s;
  const int64_t new_slot = p.slot[bg];
  const float* q = p.q + bg * r * d;
  for (int64_t i = 0; i < r * d; ++i) qs[i] = q[i] * p.scale;
  window_rows(p.k + bi * p.kb + gi * p.kg, p.k_new + bg * d, new_slot, valid, s, d, rows, bias);
  for (int64_t j = 0; j < r; ++j) {               // the new token is always valid: no row is all masked
    dot_rows(qs + j * d, rows, s, d, probs + j * s);
    masked_softmax(probs + j * s, bias, s);
  }
  window_rows(p.v + bi * p.vb + gi * p.vg, p.v_new + bg * d, new_slot, valid, s, d, rows, nullptr);
  float* out = p.out + bg * r * d;
  std::fill(out, out + r * d, 0.0f);
  for (int64_t j = 0; j < r; ++j) weighted_rows(probs + j * s, rows, s, d, out + j * d);
  if (p.mass != nullptr) {
    float* mass = p.mass + bg * s;
    std::copy(probs, probs + s, mass);
    for (int64_t j = 1; j < r; ++j)
      for (int64_t i = 0; i < s; ++i) mass[i] += probs[j * s + i];
    if (p.pool != 1.0f)
      for (int64_t i = 0; i < s; ++i) mass[i] *= p.pool;
  }
}

void check_window(const at::Tensor& w, const at::Tensor& like, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kHalf && w.dim() == 4, name, " must be a 4-d float16 window");
  TORCH_CHECK(w.sizes() == like.sizes(), name, " must have the key window's shape");
  TORCH_CHECK(w.stride(3) == 1 && w.stride(2) == w.size(3), name, "'s slots must be contiguous rows");
}

}  // namespace

// q (b, h, 1, d) fp32; k, v (b, g, s, d) fp16 windows whose (sequence, head) blocks are contiguous rows (views of
// a larger cache are fine); valid (b, g, s) bool with the new token's slot set; slot (b, g) int64; k_new,
// v_new (b, g, 1, d) fp32. Returns out (b, h, 1, d) and, if want_mass, the mass (b, g, s) each key received,
// pooled over its group's query heads (sum, or mean when mean_pool), else an empty tensor.
std::vector<at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& valid, const at::Tensor& slot, const at::Tensor& k_new,
                                         const at::Tensor& v_new, double scale, bool want_mass, bool mean_pool) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.scalar_type() == at::kFloat, "q must be (b, h, 1, d) float32");
  check_window(k, k, "k");
  check_window(v, k, "v");
  const int64_t b = k.size(0), g = k.size(1), s = k.size(2), d = k.size(3), h = q.size(1);
  TORCH_CHECK(q.size(0) == b && q.size(3) == d && h % g == 0, "q must match the window: (b, h, 1, d), h % g == 0");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.sizes() == at::IntArrayRef({b, g, s}),
              "valid must be (b, g, s) bool");
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.sizes() == at::IntArrayRef({b, g}), "slot must be (b, g) int64");
  for (const at::Tensor* t : {&k_new, &v_new})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->sizes() == at::IntArrayRef({b, g, 1, d}),
                "k_new and v_new must be (b, g, 1, d) float32");
  const at::Tensor qc = q.contiguous(), valid_c = valid.contiguous(), slot_c = slot.contiguous();
  const at::Tensor k_new_c = k_new.contiguous(), v_new_c = v_new.contiguous();
  const int64_t* slots = slot_c.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(slots, slots + b * g, [s](int64_t i) { return 0 <= i && i < s; }),
              "every write slot must lie inside the window");
  at::Tensor out = at::empty({b, h, 1, d}, q.options());
  at::Tensor mass = want_mass ? at::empty({b, g, s}, q.options()) : at::empty({0}, q.options());
  const int64_t r = h / g;
  Problem p{b, g, r, s, d, qc.data_ptr<float>(), k.data_ptr<at::Half>(), v.data_ptr<at::Half>(),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), valid_c.data_ptr<bool>(), slot_c.data_ptr<int64_t>(),
            k_new_c.data_ptr<float>(), v_new_c.data_ptr<float>(), static_cast<float>(scale),
            mean_pool ? 1.0f / static_cast<float>(r) : 1.0f, out.data_ptr<float>(),
            want_mass ? mass.data_ptr<float>() : nullptr};
  // columns are small (r x s x d): a few per task keeps the scheduling cost below the work
  at::parallel_for(0, b * g, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(r * d), probs(r * s), rows(s * d), bias(s);
    for (int64_t col = begin; col < end; ++col)
      attend_column(p, col / g, col % g, qs.data(), probs.data(), rows.data(), bias.data());
  });
  return {out, mass};
}
