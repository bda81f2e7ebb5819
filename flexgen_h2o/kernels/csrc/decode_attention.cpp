// One decode step's attention over the fp16 KV cache on a CPU, with the attention mass each key received (the
// column H2O adds to its scores).
//
// The torch-op path (ops.narrow_decode_attention) upcasts the window to fp32 a block of sequences at a time with
// copy_ and multiplies it with batched GEMMs of r query rows. At SmolLM2's batch 120 x 3 KV heads x 409 slots that
// is ~565 M elements converted per step, and GEMMs of 3 rows run far below the machine's peak (docs/architecture.md
// "How a token flows"). Here each thread takes one (sequence, KV head) at a time and reads its window once, as
// fp16: each key or value vector is converted in a register and used there by up to three query heads of the
// group at once. (Converting rows into an fp32 scratch first would store the converted rows and load them back.)
//
// Built with -mavx2 -mfma -mf16c where the CPU has them (kernels/build.py decides); elsewhere the same loops run
// as plain C++, which the compiler vectorises as it can.
//
// decode_attention_quant reads a group-wise quantized cache (quant.py's row form) with the same loops: they take
// their rows from a reader, HalfRows or QuantRows, which dequantizes 8 values in registers where HalfRows converts
// 8 halves.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t MIN_SLOTS_PER_THREAD = 2 << 10;   // batch 4 x 3 heads x 101 slots on one thread, 16 x 3 on two
constexpr int64_t PREFETCH_ROWS = 32;  // how far ahead of the rows in use their lines are requested
constexpr int64_t HEADS_AT_ONCE = 3;   // query heads per pass over the window: their sums fill 12 of 16 registers

// The fp16 window's rows (s rows of d halves) as the loops below read them; group_size is QuantRows' alone
struct HalfRows {
  const at::Half* rows;
  int64_t d;
  HalfRows(const void* block, int64_t d, int64_t /*group_size*/)
      : rows(static_cast<const at::Half*>(block)), d(d) {}
  bool wide() const { return d % 8 == 0; }
  float at(int64_t i, int64_t c) const { return static_cast<float>(rows[i * d + c]); }
#ifdef FLEXGEN_H2O_AVX2
  __m256 load8(int64_t i, int64_t c) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + i * d + c)));
  }
  // ask for rows [i, i + n) ahead of their use: a column's window comes from DRAM (a long prompt's batch holds a
  // cache many times the L3), and the loops below are short enough to wait on every line
  void prefetch(int64_t i, int64_t n, int64_t s) const {
    const int64_t end = std::min(i + n, s) * d;
    for (int64_t e = i * d; e < end; e += 32) __builtin_prefetch(rows + e);   // 32 halves: one 64-byte line
  }
#endif
};

// An fp32 window (a staged copy: a cache split over tiers, rolled keys, fp32 KV), read as HalfRows reads fp16 rows
struct FloatRows {
  const float* rows;
  int64_t d;
  FloatRows(const void* block, int64_t d, int64_t /*group_size*/) : rows(static_cast<const float*>(block)), d(d) {}
  bool wide() const { return d % 8 == 0; }
  float at(int64_t i, int64_t c) const { return rows[i * d + c]; }
#ifdef FLEXGEN_H2O_AVX2
  __m256 load8(int64_t i, int64_t c) const { return _mm256_loadu_ps(rows + i * d + c); }
  void prefetch(int64_t i, int64_t n, int64_t s) const {
    const int64_t end = std::min(i + n, s) * d;
    for (int64_t e = i * d; e < end; e += 16) __builtin_prefetch(rows + e);   // 16 floats: one 64-byte line
  }
#endif
};

inline int64_t quant_row_bytes(int64_t d, int64_t group_size, int64_t bits) {
  const int64_t groups = (d + group_size - 1) / group_size;
  return groups * group_size * bits / 8 + 4 * groups;
}

inline uint16_t load_u16(const uint8_t* p) {   // the row's fp16 parameters need not be 2-byte aligned
  uint16_t x;
  std::memcpy(&x, p, 2);
  return x;
}

// A window of quant.py's row form, read as HalfRows reads fp16 rows: s rows of [packed values: G * group_size *
// BITS / 8 bytes | fp16 minimum x G | fp16 step x G], G groups of group_size values (the last one padded), value =
// minimum + q * step; at 4 bits the even value is the low nibble
template <int BITS>
struct QuantRows {
  const uint8_t* rows;
  int64_t row_bytes, group_size, minima, steps;   // minima, steps: where a row's fp16 parameters start
  int shift = -1;       // log2(group_size) where load8 can take the window, else -1 (the plain loops)

  QuantRows(const void* block, int64_t d, int64_t group_size)
      : rows(static_cast<const uint8_t*>(block)), row_bytes(quant_row_bytes(d, group_size, BITS)),
        group_size(group_size) {
    const int64_t groups = (d + group_size - 1) / group_size;
    minima = groups * group_size * BITS / 8;
    steps = minima + 2 * groups;
    // 8 values never straddle a group, and the group of column c is c >> shift rather than a division
    if (d % 8 == 0 && group_size % 8 == 0 && (group_size & (group_size - 1)) == 0)
      shift = __builtin_ctzll(static_cast<uint64_t>(group_size));
  }
  bool wide() const { return shift >= 0; }

  float at(int64_t i, int64_t c) const {
    const uint8_t* row = rows + i * row_bytes;
    const int64_t group = shift >= 0 ? c >> shift : c / group_size;   // no division on a wide window's tail rows
    const int q = BITS == 8 ? row[c] : (row[c >> 1] >> (4 * (c & 1))) & 0xF;
    const at::Half minimum(load_u16(row + minima + 2 * group), at::Half::from_bits());
    const at::Half step(load_u16(row + steps + 2 * group), at::Half::from_bits());
    return static_cast<float>(q) * static_cast<float>(step) + static_cast<float>(minimum);
  }

#ifdef FLEXGEN_H2O_AVX2
  // values [c, c + 8) of row i (c % 8 == 0) as fp32, dequantized in registers
  __m256 load8(int64_t i, int64_t c) const {
    const uint8_t* row = rows + i * row_bytes;
    __m256i q;
    if (BITS == 8) {
      q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
    } else {   // the 4 bytes in every lane, lane u shifted right by 4 u: nibble u at the bottom
      uint32_t packed;
      std::memcpy(&packed, row + c / 2, 4);
      q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(packed)),
                                             _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                           _mm256_set1_epi32(0xF));
    }
    const int64_t p = 2 * (c >> shift);
    const __m256 minimum = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16(row + minima + p))));
    const __m256 step = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16(row + steps + p))));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), step, minimum);
  }

  void prefetch(int64_t i, int64_t n, int64_t s) const {   // as HalfRows::prefetch, over row_bytes a row
    const int64_t end = std::min(i + n, s) * row_bytes;
    for (int64_t e = i * row_bytes; e < end; e += 64) __builtin_prefetch(rows + e);
  }
#endif
};

// logits[j * ld + i] = q_j . key_i for the R heads q (R x d) over keys [i0, s): the plain loops
template <class Rows>
void logits_plain(const float* q, int64_t R, const Rows& keys, int64_t i0, int64_t s, int64_t d, int64_t ld,
                  float* logits) {
  for (int64_t i = i0; i < s; ++i)
    for (int64_t j = 0; j < R; ++j) {
      float sum = 0.0f;
      for (int64_t c = 0; c < d; ++c) sum += q[j * d + c] * keys.at(i, c);
      logits[j * ld + i] = sum;
    }
}

#ifdef FLEXGEN_H2O_AVX2
// the eight lanes of x[u] summed, into lane u of the result
inline __m256 sum_each8(const __m256* x) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// the eight lanes of x[u] summed, into lane u of the result, for four vectors
inline __m128 sum_each4(const __m256* x) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// logits_plain for a wide() reader: ROWS keys at a time, each 8-wide piece converted once and multiplied by all R
// heads; a horizontal sum per (head, block of ROWS keys) rather than per logit
template <int R, int ROWS, class Rows>
void logits_avx2(const float* q, const Rows& keys, int64_t s, int64_t d, int64_t ld, float* logits) {
  int64_t i = 0;
  for (; i + ROWS <= s; i += ROWS) {
    keys.prefetch(i + PREFETCH_ROWS, ROWS, s);
    __m256 acc[R][ROWS];
    for (int j = 0; j < R; ++j)
      for (int u = 0; u < ROWS; ++u) acc[j][u] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8)
#pragma GCC unroll 8
      for (int u = 0; u < ROWS; ++u) {
        const __m256 k = keys.load8(i + u, c);
#pragma GCC unroll 3
        for (int j = 0; j < R; ++j) acc[j][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + c), k, acc[j][u]);
      }
    for (int j = 0; j < R; ++j) {
      if (ROWS == 8) _mm256_storeu_ps(logits + j * ld + i, sum_each8(acc[j]));
      else _mm_storeu_ps(logits + j * ld + i, sum_each4(acc[j]));
    }
  }
  logits_plain(q, R, keys, i, s, d, ld, logits);
}

// out_j[c0, c0 + 8 NC) += sum_i w_j[i] value_i[c0, ...) for R heads (weights w_j at w + j * ld); rows whose R
// weights are all 0 are skipped (masked slots: their rows may hold anything), and so is row `skip`
template <int R, int NC, class Rows>
void values_avx2(const float* w, int64_t ld, const Rows& values, int64_t s, int64_t d, int64_t c0, int64_t skip,
                 float* out) {
  __m256 acc[R][NC];
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c] = _mm256_loadu_ps(out + j * d + c0 + 8 * c);
  for (int64_t i = 0; i < s; ++i) {
    bool any = false;
    for (int j = 0; j < R; ++j) any |= w[j * ld + i] != 0.0f;
    if (c0 == 0) values.prefetch(i + PREFETCH_ROWS, 1, s);
    if (!any || i == skip) continue;
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      const __m256 v = values.load8(i, c0 + 8 * c);
#pragma GCC unroll 3
      for (int j = 0; j < R; ++j) acc[j][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[j * ld + i]), v, acc[j][c]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + j * d + c0 + 8 * c, acc[j][c]);
}

template <int R, class Rows>
void values_blocks(const float* w, int64_t ld, const Rows& values, int64_t s, int64_t d, int64_t skip, float* out) {
  for (int64_t c0 = 0; c0 < d; c0 += 32)            // four vectors of d per pass: 4 R sums in registers
    switch ((d - c0) / 8) {
      case 1: values_avx2<R, 1>(w, ld, values, s, d, c0, skip, out); break;
      case 2: values_avx2<R, 2>(w, ld, values, s, d, c0, skip, out); break;
      case 3: values_avx2<R, 3>(w, ld, values, s, d, c0, skip, out); break;
      default: values_avx2<R, 4>(w, ld, values, s, d, c0, skip, out); break;
    }
}
#endif

// logits of R <= HEADS_AT_ONCE heads over s keys
template <class Rows>
void head_logits(const float* q, int64_t R, const Rows& keys, int64_t s, int64_t d, int64_t ld, float* logits) {
#ifdef FLEXGEN_H2O_AVX2
  if (keys.wide()) {
    switch (R) {
      case 1: return logits_avx2<1, 8>(q, keys, s, d, ld, logits);
      case 2: return logits_avx2<2, 4>(q, keys, s, d, ld, logits);
      default: return logits_avx2<3, 4>(q, keys, s, d, ld, logits);
    }
  }
#endif
  logits_plain(q, R, keys, 0, s, d, ld, logits);
}

// out (R x d) += the weighted sum of s value rows for R <= HEADS_AT_ONCE heads, as values_avx2 says
template <class Rows>
void head_values(const float* w, int64_t R, int64_t ld, const Rows& values, int64_t s, int64_t d, int64_t skip,
                 float* out) {
#ifdef FLEXGEN_H2O_AVX2
  if (values.wide()) {
    switch (R) {
      case 1: return values_blocks<1>(w, ld, values, s, d, skip, out);
      case 2: return values_blocks<2>(w, ld, values, s, d, skip, out);
      default: return values_blocks<3>(w, ld, values, s, d, skip, out);
    }
  }
#endif
  for (int64_t i = 0; i < s; ++i) {
    if (i == skip) continue;
    for (int64_t j = 0; j < R; ++j) {
      const float wi = w[j * ld + i];
      if (wi == 0.0f) continue;
      for (int64_t c = 0; c < d; ++c) out[j * d + c] += wi * values.at(i, c);
    }
  }
}

// A softmax over n logits in place; masked entries hold -inf and come out exactly 0. At least one is finite.
void softmax(float* line, int64_t n) {
  const float inv = 1.0f / softmax_numerators(line, n);
  for (int64_t i = 0; i < n; ++i) line[i] *= inv;
}

struct Problem {
  int64_t b, g, r, s, d, group_size;
  const float* q;                 // (b, g * r, d), contiguous
  const uint8_t* k;               // window blocks, in bytes: k + bi * kb + gi * kg holds s rows
  const uint8_t* v;
  int64_t kb, kg, vb, vg;
  const int64_t* start;           // (b, g) or null: a row pool, column (bi, gi) at k + bi * kb + start * kg
  const bool* valid;              // (b, g, s)
  const int64_t* slot;            // (b, g): where the new token sits in the window
  const float* k_new;             // (b, g, d): its key and value, unrounded
  const float* v_new;
  float scale, pool;              // pool: 1 to sum the group's heads into a key's mass, 1 / r for their mean
  float* out;                     // (b, g * r, d), or null: the mass alone (no values were given)
  float* mass;                    // (b, g, s), or null
};

// the (sequence bi, KV head gi) column: r query heads over its slots, up to HEADS_AT_ONCE heads per pass over the
// window. The new token's key and value are the unrounded fp32 rows (k_new, v_new), not its slot's stored copy.
// Only the column's own extent is read (up to its last valid slot or the new one): in a window sized for the
// batch's longest row, or a refilled row packed from slot 0 again, the slots past it are masked, and skipping them
// keeps a row's arithmetic independent of its batch-mates' lengths
template <class Rows>
void attend_column(const Problem& p, int64_t bi, int64_t gi, float* qs, float* probs) {
  const int64_t bg = bi * p.g + gi, s = p.s, d = p.d, r = p.r;
  const bool* valid = p.valid + bg * s;
  const int64_t new_slot = p.slot[bg];
  int64_t e = s;
  while (e > new_slot + 1 && !valid[e - 1]) --e;
  const float* q = p.q + bg * r * d;
  const float* k_new = p.k_new + bg * d;
  const float* v_new = p.v_new + bg * d;
  for (int64_t i = 0; i < r * d; ++i) qs[i] = q[i] * p.scale;
  const int64_t block = p.start != nullptr ? p.start[bg] : gi;
  const Rows keys(p.k + bi * p.kb + block * p.kg, d, p.group_size);
  for (int64_t j0 = 0; j0 < r; j0 += HEADS_AT_ONCE)
    head_logits(qs + j0 * d, std::min(HEADS_AT_ONCE, r - j0), keys, e, d, s, probs + j0 * s);
  constexpr float masked = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < r; ++j) {
    float* line = probs + j * s;
    for (int64_t i = 0; i < e; ++i)         // a masked slot's row may hold anything: its logit is overwritten
      if (!valid[i]) line[i] = masked;
    float sum = 0.0f;
    for (int64_t c = 0; c < d; ++c) sum += qs[j * d + c] * k_new[c];
    line[new_slot] = sum;
    softmax(line, e);                       // the new token is always valid: no line is all masked
  }
  if (p.out != nullptr) {
    float* out = p.out + bg * r * d;
    std::fill(out, out + r * d, 0.0f);
    const Rows values(p.v + bi * p.vb + block * p.vg, d, p.group_size);
    for (int64_t j0 = 0; j0 < r; j0 += HEADS_AT_ONCE)
      head_values(probs + j0 * s, std::min(HEADS_AT_ONCE, r - j0), s, values, e, d, new_slot, out + j0 * d);
    for (int64_t j = 0; j < r; ++j)
      for (int64_t c = 0; c < d; ++c) out[j * d + c] += probs[j * s + new_slot] * v_new[c];
  }
  if (p.mass != nullptr) {
    float* mass = p.mass + bg * s;
    std::copy(probs, probs + e, mass);
    std::fill(mass + e, mass + s, 0.0f);
    for (int64_t j = 1; j < r; ++j)
      for (int64_t i = 0; i < e; ++i) mass[i] += probs[j * s + i];
    if (p.pool != 1.0f)
      for (int64_t i = 0; i < e; ++i) mass[i] *= p.pool;
  }
}

void check_window(const at::Tensor& w, const at::Tensor& like, const char* name, at::ScalarType dtype,
                  const char* dtype_name) {
  const int64_t n = w.dim();
  TORCH_CHECK(w.scalar_type() == dtype && (n == 4 || n == 3), name, " must be a 4-d ", dtype_name,
              " window (or a 3-d row pool)");
  TORCH_CHECK(w.sizes() == like.sizes(), name, " must have the key window's shape");
  TORCH_CHECK(w.stride(n - 1) == 1 && w.stride(n - 2) == w.size(n - 1), name, "'s slots must be contiguous rows");
}

// a window's last read slot + 1 per column, as attend_column finds it: its last valid slot or its new one
int64_t column_end(const bool* valid, int64_t s, int64_t new_slot) {
  int64_t e = s;
  while (e > new_slot + 1 && !valid[e - 1]) --e;
  return e;
}

// Both entry points past their windows' checks: k and v (b, g, s, row) hold d values a row, read through Rows;
// or, with col_start (b, g) given, (b, T, row) pools whose column (bi, gi) starts at row col_start[bi, gi]
template <class Rows>
std::vector<at::Tensor> decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& valid, const at::Tensor& slot, const at::Tensor& k_new,
                               const at::Tensor& v_new, double scale, bool want_mass, bool mean_pool, int64_t d,
                               int64_t group_size, const at::Tensor& col_start) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.scalar_type() == at::kFloat, "q must be (b, h, 1, d) float32");
  const bool pooled = col_start.defined() && col_start.numel() > 0;
  TORCH_CHECK(k.dim() == (pooled ? 3 : 4), pooled ? "with col_start, k and v must be (b, T, row) row pools"
                                                  : "k and v must be (b, g, s, row) windows");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 3, "valid must be (b, g, s) bool");
  const int64_t b = k.size(0), g = valid.size(1), s = valid.size(2), h = q.size(1);
  TORCH_CHECK(pooled || (k.size(1) == g && k.size(2) == s), "valid must be (b, g, s) for the (b, g, s, row) window");
  TORCH_CHECK(valid.size(0) == b, "valid must be (b, g, s) bool");
  TORCH_CHECK(q.size(0) == b && q.size(3) == d && h % g == 0, "q must match the window: (b, h, 1, d), h % g == 0");
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.sizes() == at::IntArrayRef({b, g}), "slot must be (b, g) int64");
  for (const at::Tensor* t : {&k_new, &v_new})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->sizes() == at::IntArrayRef({b, g, 1, d}),
                "k_new and v_new must be (b, g, 1, d) float32");
  const at::Tensor qc = q.contiguous(), valid_c = valid.contiguous(), slot_c = slot.contiguous();
  const at::Tensor k_new_c = k_new.contiguous(), v_new_c = v_new.contiguous();
  const int64_t* slots = slot_c.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(slots, slots + b * g, [s](int64_t i) { return 0 <= i && i < s; }),
              "every write slot must lie inside the window");
  at::Tensor start_c;
  if (pooled) {
    start_c = col_start.contiguous();
    TORCH_CHECK(start_c.scalar_type() == at::kLong && start_c.sizes() == at::IntArrayRef({b, g}),
                "col_start must be (b, g) int64");
    const int64_t* starts = start_c.data_ptr<int64_t>();
    const bool* flags = valid_c.data_ptr<bool>();
    for (int64_t col = 0; col < b * g; ++col)     // a column reads rows [start, start + its end) of the pool
      TORCH_CHECK(starts[col] >= 0 && starts[col] + column_end(flags + col * s, s, slots[col]) <= k.size(1),
                  "a column's slots must lie inside the row pool");
  }
  const bool values = v.numel() > 0;          // none given: the keys' mass alone (want_mass), no output
  TORCH_CHECK(values || want_mass, "without values only the mass can be computed: pass want_mass");
  at::Tensor out = values ? at::empty({b, h, 1, d}, q.options()) : at::empty({0}, q.options());
  at::Tensor mass = want_mass ? at::empty({b, g, s}, q.options()) : at::empty({0}, q.options());
  const int64_t r = h / g, kz = k.element_size(), vz = v.element_size();
  Problem p{b, g, r, s, d, group_size, qc.data_ptr<float>(), static_cast<const uint8_t*>(k.data_ptr()),
            static_cast<const uint8_t*>(v.data_ptr()), k.stride(0) * kz, k.stride(1) * kz,
            values ? v.stride(0) * vz : 0, values ? v.stride(1) * vz : 0,   // dim 1: a window's head blocks, a pool's rows
            pooled ? start_c.data_ptr<int64_t>() : nullptr, valid_c.data_ptr<bool>(), slot_c.data_ptr<int64_t>(),
            k_new_c.data_ptr<float>(), v_new_c.data_ptr<float>(), static_cast<float>(scale),
            mean_pool ? 1.0f / static_cast<float>(r) : 1.0f, values ? out.data_ptr<float>() : nullptr,
            want_mass ? mass.data_ptr<float>() : nullptr};
  // a thread takes at least MIN_SLOTS_PER_THREAD (sequence, KV head, slot) rows: waking the sleeping OpenMP thread
  // (OMP_WAIT_POLICY=PASSIVE) costs more than a small step's whole attention (docs/architecture.md "How a token
  // flows")
  const int64_t grain = std::max<int64_t>(1, MIN_SLOTS_PER_THREAD / std::max<int64_t>(1, s));
  at::parallel_for(0, b * g, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(r * d), probs(r * s);
    for (int64_t col = begin; col < end; ++col) attend_column<Rows>(p, col / g, col % g, qs.data(), probs.data());
  });
  return {out, mass};
}

}  // namespace

// q (b, h, 1, d) fp32; k, v (b, g, s, d) fp16 (or fp32) windows whose (sequence, head) blocks are contiguous rows (views of
// a larger cache are fine); valid (b, g, s) bool with the new token's slot set; slot (b, g) int64; k_new,
// v_new (b, g, 1, d) fp32. Returns out (b, h, 1, d) and, if want_mass, the mass (b, g, s) each key received,
// pooled over its group's query heads (sum, or mean when mean_pool), else an empty tensor.
// col_start (b, g) int64, or an empty tensor: k and v are then (b, T, d) row pools and column (bi, gi)'s slots
// are rows col_start[bi, gi] onwards (a head-adaptive cache, kv/ragged.py).
std::vector<at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& valid, const at::Tensor& slot, const at::Tensor& k_new,
                                         const at::Tensor& v_new, double scale, bool want_mass, bool mean_pool,
                                         const at::Tensor& col_start) {
  const int64_t d = k.size(k.dim() - 1);
  if (k.scalar_type() == at::kFloat) {
    check_window(k, k, "k", at::kFloat, "float32");
    check_window(v, k, "v", at::kFloat, "float32");
    return decode<FloatRows>(q, k, v, valid, slot, k_new, v_new, scale, want_mass, mean_pool, d, 0, col_start);
  }
  check_window(k, k, "k", at::kHalf, "float16");
  check_window(v, k, "v", at::kHalf, "float16");
  return decode<HalfRows>(q, k, v, valid, slot, k_new, v_new, scale, want_mass, mean_pool, d, 0, col_start);
}

std::vector<at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& valid, const at::Tensor& slot, const at::Tensor& k_new,
                                         const at::Tensor& v_new, double scale, bool want_mass, bool mean_pool) {
  return decode_attention(q, k, v, valid, slot, k_new, v_new, scale, want_mass, mean_pool, at::Tensor());
}

// decode_attention over a quantized cache: k, v (b, g, s, row_bytes) uint8 windows of quant.py's row form, d =
// q.size(3) values a row in groups of group_size (even), bits 4 or 8. A masked slot's bytes are never used.
// v empty (numel 0) with want_mass: the keys' mass alone, and an empty out (page selection's int4 key copy scores
// its pages so, kv/pages.py: half the reads, none of the value sums).
std::vector<at::Tensor> decode_attention_quant(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& valid, const at::Tensor& slot,
                                               const at::Tensor& k_new, const at::Tensor& v_new, double scale,
                                               bool want_mass, bool mean_pool, int64_t bits, int64_t group_size,
                                               const at::Tensor& col_start) {
  check_window(k, k, "k", at::kByte, "uint8");
  if (v.numel() > 0) check_window(v, k, "v", at::kByte, "uint8");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0, "group_size must be even");
  TORCH_CHECK(q.dim() == 4 && q.size(3) > 0, "q must be (b, h, 1, d) float32");
  const int64_t d = q.size(3);
  const int64_t row = k.size(k.dim() - 1);
  TORCH_CHECK(row == quant_row_bytes(d, group_size, bits), "k and v rows must be quant.py's row form of d = ",
              d, " values: ", quant_row_bytes(d, group_size, bits), " bytes, not ", row);
  if (bits == 4)
    return decode<QuantRows<4>>(q, k, v, valid, slot, k_new, v_new, scale, want_mass, mean_pool, d, group_size,
                                col_start);
  return decode<QuantRows<8>>(q, k, v, valid, slot, k_new, v_new, scale, want_mass, mean_pool, d, group_size,
                              col_start);
}

std::vector<at::Tensor> decode_attention_quant(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& valid, const at::Tensor& slot,
                                               const at::Tensor& k_new, const at::Tensor& v_new, double scale,
                                               bool want_mass, bool mean_pool, int64_t bits, int64_t group_size) {
  return decode_attention_quant(q, k, v, valid, slot, k_new, v_new, scale, want_mass, mean_pool, bits, group_size,
                                at::Tensor());
}
