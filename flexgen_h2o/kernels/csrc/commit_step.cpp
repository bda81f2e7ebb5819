// One decode step committed into a CPU-homed KV cache, for the rules that need no random numbers: the new token's
// K/V row and position go into its slot, this step's attention mass is added to the scores, and H2O chooses one
// victim per (sequence, KV head) column and frees its slot.
//
// The decisions are kv/h2o.py's (the exact rule, h2o-avg's ranking, the port's), which stays the reference and
// runs everywhere else (GPU caches, the random and window rules). As torch ops they are ~40 passes over the whole
// (b, g, s) window per layer; here each column is one pass over its own slots, while they are in cache
// (docs/architecture.md "How a token flows" compares the two).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// kLayerStep: TOVA (kv/tova.py): a slot's score is this step's mass only, and one victim per sequence leaves every
// KV head, chosen by the exact rule on the mass summed over the KV heads (whose columns hold the same tokens slot
// by slot)
enum Rule : int64_t { kKeepAll = 0, kExact = 1, kAverage = 2, kPort = 3, kLayerStep = 4 };

void store_row(at::Half* dst, const float* src, int64_t d) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= d; i += 8)      // round to nearest even, as torch's float -> half conversion
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < d; ++i) dst[i] = static_cast<at::Half>(src[i]);
}

void store_row(float* dst, const float* src, int64_t d) { std::copy(src, src + d, dst); }

// a quantized cache's row arrives packed (quant.py's row form, packed by the caller): its bytes are copied
void store_row(uint8_t* dst, const uint8_t* src, int64_t d) { std::copy(src, src + d, dst); }

struct Budget {
  int64_t sink, recent, budget;
};

// kv/h2o.py's choose_victim for one column of s slots (positions -1 = free, unique among the valid ones):
// candidates are the valid slots that are neither sinks nor among the `recent` newest; the victim is the
// lowest-ranked candidate, ties to the smallest position. -1 when the column is within its budget.
int64_t choose_victim(const int32_t* pos, const float* score, int64_t s, Rule rule, const Budget& b,
                      std::vector<int32_t>& newest_first) {
  int64_t n_valid = 0;
  int32_t newest = -1;
  for (int64_t i = 0; i < s; ++i)
    if (pos[i] >= 0) {
      ++n_valid;
      newest = std::max(newest, pos[i]);
    }
  if (rule == kKeepAll || n_valid <= b.budget) return -1;
  // the window is every valid position >= first_recent. A cache's `recent` newest positions are consecutive,
  // so newest - recent + 1 finds it; where that count is off (a gap), the exact recent-th largest position
  int64_t first_recent = std::numeric_limits<int64_t>::max();
  if (b.recent >= n_valid) {
    first_recent = -1;
  } else if (b.recent > 0) {
    first_recent = static_cast<int64_t>(newest) - b.recent + 1;
    int64_t in_window = 0;
    for (int64_t i = 0; i < s; ++i) in_window += pos[i] >= first_recent;
    if (in_window != b.recent) {
      newest_first.clear();
      for (int64_t i = 0; i < s; ++i)
        if (pos[i] >= 0) newest_first.push_back(pos[i]);
      std::nth_element(newest_first.begin(), newest_first.begin() + (b.recent - 1), newest_first.end(),
                       std::greater<int32_t>());
      first_recent = newest_first[b.recent - 1];
    }
  }
  auto candidate = [&](int64_t i) { return pos[i] >= 0 && pos[i] >= b.sink && pos[i] < first_recent; };
  auto rank = [&](int64_t i) {
    if (rule != kAverage) return score[i];
    // h2o-avg: the mass per query that has seen the key, from its own position to the newest
    return score[i] / static_cast<float>(std::max<int64_t>(1, static_cast<int64_t>(newest) + 1 - pos[i]));
  };
  int64_t leaving = -1;             // the port: the newest candidate is admitted, unless it is the only one
  if (rule == kPort)
    for (int64_t i = 0; i < s; ++i)
      if (candidate(i) && (leaving < 0 || pos[i] > pos[leaving])) leaving = i;
  int64_t victim = -1;
  float best = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < s; ++i) {
    if (!candidate(i) || i == leaving) continue;
    const float r = rank(i);
    if (victim < 0 || r < best || (r == best && pos[i] < pos[victim])) {
      victim = i;
      best = r;
    }
  }
  return victim < 0 ? leaving : victim;
}

// kLayerStep, one sequence at a time: its G columns written, their scores replaced by this step's mass, one
// victim chosen on the summed mass and freed in every column
template <typename T, typename S>
void commit_sequences(T* k_data, T* v_data, float* score, int32_t* pos, const int64_t* slot, const S* k_new,
                      const S* v_new, const int64_t* new_pos, const float* mass, int64_t b, int64_t g, int64_t cap,
                      int64_t d, int64_t s, int64_t sink, const int64_t* recent, const int64_t* budget,
                      int64_t* victims) {
  TORCH_CHECK(mass != nullptr, "the layer-step rule ranks by this step's attention: pass its mass");
  at::parallel_for(0, b, 4, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> scratch;
    std::vector<float> summed(s);
    for (int64_t seq = begin; seq < end; ++seq) {
      for (int64_t h = 0; h < g; ++h) {
        const int64_t col = seq * g + h;
        const int64_t row = col * cap + slot[col];
        store_row(k_data + row * d, k_new + col * d, d);
        store_row(v_data + row * d, v_new + col * d, d);
        pos[col * cap + slot[col]] = static_cast<int32_t>(new_pos[seq]);
        std::copy(mass + col * s, mass + (col + 1) * s, score + col * cap);
      }
      const int32_t* first = pos + seq * g * cap;
      for (int64_t h = 1; h < g; ++h)
        TORCH_CHECK(std::equal(first, first + s, pos + (seq * g + h) * cap),
                    "the layer-step rule needs every KV head of a sequence to hold the same tokens slot by slot");
      for (int64_t i = 0; i < s; ++i) {      // summed over the KV heads in order, as torch's sum over dim 1
        float total = score[seq * g * cap + i];
        for (int64_t h = 1; h < g; ++h) total += score[(seq * g + h) * cap + i];
        summed[i] = total;
      }
      const Budget limits{sink, recent[seq], budget[seq]};
      const int64_t victim = choose_victim(first, summed.data(), s, kExact, limits, scratch);
      for (int64_t h = 0; h < g; ++h) {
        const int64_t col = seq * g + h;
        victims[col] = victim;
        if (victim >= 0) {
          pos[col * cap + victim] = -1;
          score[col * cap + victim] = 0.0f;
        }
      }
    }
  });
}

// Where each (sequence, KV head) column's slots are: block (bi, gi) of a (b, g, cap) cache, or rows [start, start +
// cap) of sequence bi's T rows in a head-adaptive cache's pool (kv/ragged.py)
struct Columns {
  int64_t g, rows, cap;         // rows: slots per sequence (g * cap for a plain cache)
  const int64_t* start;         // (b, g) or null
  const int64_t* caps;          // (b, g) or null
  int64_t base(int64_t col) const { return (col / g) * rows + (start != nullptr ? start[col] : (col % g) * cap); }
  int64_t extent(int64_t col, int64_t s) const { return std::min(s, caps != nullptr ? caps[col] : cap); }
};

template <typename T, typename S>
void commit_columns(const at::Tensor& k, const at::Tensor& v, float* score, int32_t* pos, const int64_t* slot,
                    const S* k_new, const S* v_new, const int64_t* new_pos, const float* mass, int64_t b,
                    const Columns& cols, int64_t d, int64_t s, Rule rule, int64_t sink, const int64_t* recent,
                    const int64_t* budget, bool budget_per_column, int64_t* victims) {
  T* k_data = k.data_ptr<T>();
  T* v_data = v.data_ptr<T>();
  const int64_t g = cols.g;
  if (rule == kLayerStep) {
    commit_sequences(k_data, v_data, score, pos, slot, k_new, v_new, new_pos, mass, b, g, cols.cap, d, s, sink,
                     recent, budget, victims);
    return;
  }
  at::parallel_for(0, b * g, 16, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> scratch;
    for (int64_t col = begin; col < end; ++col) {
      const int64_t base = cols.base(col), n = cols.extent(col, s);
      const int64_t row = base + slot[col];
      store_row(k_data + row * d, k_new + col * d, d);
      store_row(v_data + row * d, v_new + col * d, d);
      int32_t* p = pos + base;
      float* sc = score + base;
      p[slot[col]] = static_cast<int32_t>(new_pos[col / g]);
      if (mass != nullptr)              // free slots got no mass; the new slot starts from its own
        for (int64_t i = 0; i < n; ++i) sc[i] += mass[col * s + i];
      // each sequence's own budget, or each column's (head-adaptive)
      const Budget limits{sink, recent[col / g], budget[budget_per_column ? col : col / g]};
      const int64_t victim = choose_victim(p, sc, n, rule, limits, scratch);
      victims[col] = victim;
      if (victim >= 0) {
        p[victim] = -1;
        sc[victim] = 0.0f;
      }
    }
  });
}

}  // namespace

// k, v (b, g, cap, d) fp16 or fp32, or uint8 rows of d bytes (a quantized cache), score (b, g, cap) fp32, pos
// (b, g, cap) int32: a cache's own tensors, contiguous, written in place. slot (b, g) int64 < s; k_new, v_new
// (b, g, 1, d) fp32 (uint8 rows already packed, for a quantized cache); new_pos (b,) int64;
// mass (b, g, s) fp32 or an empty tensor. s: the window the step attended. recent, budget (b,) int64: each
// sequence's recent window and budget (kv/budget.py's RowBudgets). Returns the victim slots (b, g), -1 where a
// column kept everything.
// With col_start and col_cap (b, g) int64 (a head-adaptive cache, kv/ragged.py): k, v (b, T, d), score and pos
// (b, T) are row pools, column (b, g) owns rows [col_start, col_start + col_cap) and reads min(s, col_cap) of
// them, and budget may be (b, g), one per column.
at::Tensor commit_step(const at::Tensor& k, const at::Tensor& v, const at::Tensor& score, const at::Tensor& pos,
                       const at::Tensor& slot, const at::Tensor& k_new, const at::Tensor& v_new,
                       const at::Tensor& new_pos, const at::Tensor& mass, int64_t s, int64_t rule, int64_t sink,
                       const at::Tensor& recent, const at::Tensor& budget, const at::Tensor& col_start,
                       const at::Tensor& col_cap) {
  const bool pooled = col_start.defined() && col_start.numel() > 0;
  TORCH_CHECK(k.dim() == (pooled ? 3 : 4) && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
              (k.scalar_type() == at::kHalf || k.scalar_type() == at::kFloat || k.scalar_type() == at::kByte) &&
              k.is_contiguous() && v.is_contiguous(),
              pooled ? "k and v must be contiguous (b, T, d) row pools of float16, float32 or uint8"
                     : "k and v must be contiguous (b, g, cap, d) float16, float32 or uint8 (packed rows) caches");
  TORCH_CHECK(slot.dim() == 2, "slot must be (b, g)");
  const int64_t b = k.size(0), g = slot.size(1), d = k.size(k.dim() - 1);
  const int64_t rows = pooled ? k.size(1) : g * k.size(2), cap = pooled ? rows : k.size(2);
  TORCH_CHECK(pooled || k.size(1) == g, "slot must be (b, g)");
  const std::vector<int64_t> slot_shape = pooled ? std::vector<int64_t>{b, rows} : std::vector<int64_t>{b, g, cap};
  TORCH_CHECK(score.scalar_type() == at::kFloat && pos.scalar_type() == at::kInt && score.is_contiguous() &&
              pos.is_contiguous() && score.sizes() == at::IntArrayRef(slot_shape) && pos.sizes() == score.sizes(),
              "score (float32) and pos (int32) must be contiguous, shaped as k's slots");
  TORCH_CHECK(0 < s && (pooled || s <= cap), "the window must lie inside the cache");
  TORCH_CHECK(rule >= kKeepAll && rule <= kLayerStep, "unknown rule ", rule);
  TORCH_CHECK(!(pooled && rule == kLayerStep), "the layer-step rule needs every head to hold the same slots");
  const at::Tensor slot_c = slot.to(at::kLong).contiguous(), new_pos_c = new_pos.to(at::kLong).contiguous();
  TORCH_CHECK(slot_c.sizes() == at::IntArrayRef({b, g}) && new_pos_c.sizes() == at::IntArrayRef({b}),
              "slot must be (b, g) and new_pos (b,)");
  const int64_t* slots = slot_c.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(slots, slots + b * g, [s](int64_t i) { return 0 <= i && i < s; }),
              "every write slot must lie inside the window");
  at::Tensor start_c, cap_c;
  if (pooled) {
    start_c = col_start.to(at::kLong).contiguous();
    cap_c = col_cap.to(at::kLong).contiguous();
    TORCH_CHECK(start_c.sizes() == at::IntArrayRef({b, g}) && cap_c.sizes() == start_c.sizes(),
                "col_start and col_cap must be (b, g)");
    const int64_t *starts = start_c.data_ptr<int64_t>(), *caps = cap_c.data_ptr<int64_t>();
    for (int64_t col = 0; col < b * g; ++col)
      TORCH_CHECK(starts[col] >= 0 && slots[col] < caps[col] && starts[col] + caps[col] <= rows,
                  "a column's rows must lie inside the pool and its write slot inside its rows");
  }
  const Columns cols{g, rows, cap, pooled ? start_c.data_ptr<int64_t>() : nullptr,
                     pooled ? cap_c.data_ptr<int64_t>() : nullptr};
  const bool packed = k.scalar_type() == at::kByte;
  TORCH_CHECK(!packed || (k_new.scalar_type() == at::kByte && v_new.scalar_type() == at::kByte),
              "a uint8 cache takes its new rows packed (uint8)");
  const auto row_type = packed ? at::kByte : at::kFloat;
  const at::Tensor k_new_c = k_new.to(row_type).contiguous(), v_new_c = v_new.to(row_type).contiguous();
  TORCH_CHECK(k_new_c.sizes() == at::IntArrayRef({b, g, 1, d}) && v_new_c.sizes() == k_new_c.sizes(),
              "k_new and v_new must be (b, g, 1, d)");
  at::Tensor mass_c;
  if (mass.numel() > 0) {
    mass_c = mass.to(at::kFloat).contiguous();
    TORCH_CHECK(mass_c.sizes() == at::IntArrayRef({b, g, s}), "mass must be (b, g, s)");
  }
  const at::Tensor recent_c = recent.to(at::kLong).contiguous(), budget_c = budget.to(at::kLong).contiguous();
  const bool budget_per_column = budget_c.sizes() == at::IntArrayRef({b, g});
  TORCH_CHECK(recent_c.sizes() == at::IntArrayRef({b}) &&
              (budget_c.sizes() == at::IntArrayRef({b}) || (pooled && budget_per_column)),
              "recent and budget must be (b,): one per sequence (budget (b, g) for a row pool)");
  at::Tensor victims = at::empty({b, g}, slot_c.options());
  const float* mass_ptr = mass.numel() > 0 ? mass_c.data_ptr<float>() : nullptr;
  auto run = [&](auto tag, auto row_tag) {
    using T = decltype(tag);
    using S = decltype(row_tag);
    commit_columns<T, S>(k, v, score.data_ptr<float>(), pos.data_ptr<int32_t>(), slots, k_new_c.data_ptr<S>(),
                         v_new_c.data_ptr<S>(), new_pos_c.data_ptr<int64_t>(), mass_ptr, b, cols, d, s,
                         static_cast<Rule>(rule), sink, recent_c.data_ptr<int64_t>(), budget_c.data_ptr<int64_t>(),
                         budget_per_column && pooled, victims.data_ptr<int64_t>());
  };
  if (k.scalar_type() == at::kHalf)
    run(at::Half(), float());
  else if (packed)
    run(uint8_t(), uint8_t());
  else
    run(float(), float());
  return victims;
}

at::Tensor commit_step(const at::Tensor& k, const at::Tensor& v, const at::Tensor& score, const at::Tensor& pos,
                       const at::Tensor& slot, const at::Tensor& k_new, const at::Tensor& v_new,
                       const at::Tensor& new_pos, const at::Tensor& mass, int64_t s, int64_t rule, int64_t sink,
                       const at::Tensor& recent, const at::Tensor& budget) {
  return commit_step(k, v, score, pos, slot, k_new, v_new, new_pos, mass, s, rule, sink, recent, budget, at::Tensor(),
                     at::Tensor());
}
