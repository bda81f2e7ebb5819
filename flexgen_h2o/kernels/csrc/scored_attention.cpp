// H2O's prompt attention on a CPU: the attention output and, in the same pass, the attention mass each key
// received (column sums of the probabilities over the valid queries, summed over a KV group's query heads).
//
// Torch's fused SDPA kernel cannot return the column sums, and the same math written as torch ops materialises
// blocks of logits too large for L2, so every pass over them (the QK product's write, softmax, the PV product
// and the column sum) goes to L3 or DRAM. Here each thread owns one (sequence, KV group, query block) at a
// time, and the block's logits stay in its caches from the QK product to the column sum. Products are ATen GEMMs,
// single-threaded inside the parallel region, so the FLOPs run at the BLAS's rate. The softmax is this file's:
// each row over only the keys its query sees, and its last pass also adds the row into the key mass, where
// torch's softmax over the whole block width and a separate column-sum product read the block twice more.
//
// Masking follows models/ops.causal_pad_mask: query i sees key j iff j <= i and key j is valid, and always
// sees itself. Pad queries add nothing to the column sums, nor do the queries before score_from (a score window:
// only the prompt's last queries rank its keys, docs/cli.md "KV cache (H2O)").
#include "kernels.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

// rows of one block are (head j of the group, query i); a pair of blocks (p, last - p) is one task, so every
// task has the same causal work and a static split over threads is balanced
struct Shape {
  int64_t b, h, t, d, g, r, q_block, blocks, pairs;
};

// One row of logits to probabilities in place: softmax over line[0, n), the keys its query sees (masked ones
// already -inf), zeros over [n, width) for the PV product; mass (when the query counts) gets the row added.
void softmax_row(float* line, int64_t n, int64_t width, float* mass) {
  const float inv = 1.0f / softmax_numerators(line, n);
  int64_t j = 0;
#ifdef FLEXGEN_H2O_AVX2
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (; j + 8 <= n; j += 8) {
    const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(line + j), inv8);
    _mm256_storeu_ps(line + j, p);
    if (mass != nullptr) _mm256_storeu_ps(mass + j, _mm256_add_ps(_mm256_loadu_ps(mass + j), p));
  }
#endif
  for (; j < n; ++j) {
    line[j] *= inv;
    if (mass != nullptr) mass[j] += line[j];
  }
  std::fill(line + n, line + width, 0.0f);
}

void attend_block(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                  const std::vector<std::vector<int64_t>>& pads, const bool* valid, double scale, int64_t score_from,
                  int64_t bi, int64_t gi, int64_t block, at::Tensor& qbuf, at::Tensor& logits, float* mass) {
  const int64_t start = block * s.q_block, stop = std::min(s.t, start + s.q_block);
  const int64_t tq = stop - start, rows = s.r * tq;
  for (int64_t j = 0; j < s.r; ++j) {
    at::Tensor dst = qbuf.narrow(0, j * tq, tq);
    at::mul_out(dst, q[bi][gi * s.r + j].narrow(0, start, tq), scale);
  }
  at::Tensor block_logits = logits.narrow(0, 0, rows * stop).view({rows, stop});
  at::mm_out(block_logits, qbuf.narrow(0, 0, rows), k[bi][gi].narrow(0, 0, stop).t());
  float* data = block_logits.data_ptr<float>();
  const float hidden = -std::numeric_limits<float>::infinity();
  const std::vector<int64_t>& seq_pads = pads[bi];
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = start + row % tq;
    float* line = data + row * stop;
    for (int64_t p : seq_pads) {                              // pad keys before the query (pads are few)
      if (p >= i) break;
      line[p] = hidden;
    }
    // keys [0, i] only; a pad query's row is still computed (its output is unused) but adds no mass, and so
    // does a query before the score window
    const bool counts = i >= score_from && (valid == nullptr || valid[bi * s.t + i]);
    softmax_row(line, i + 1, stop, counts ? mass : nullptr);
  }
  for (int64_t j = 0; j < s.r; ++j) {
    at::Tensor dst = out[bi][gi * s.r + j].narrow(0, start, tq);
    at::mm_out(dst, block_logits.narrow(0, j * tq, tq), v[bi][gi].narrow(0, 0, stop));
  }
}

// While alive, the calling thread's GEMMs run alone: left at the team's size, MKL wakes a nested team on every
// call, and under OMP_WAIT_POLICY=PASSIVE those wake-ups made the kernel slower in the engine than the torch ops
// it replaces. parallel_for runs a single task on the caller itself, so the caller's setting is put back, also
// when an ATen op throws (left at 1, every later torch op of the process would run on one core).
struct OneThreadGemms {
  const int team = omp_get_max_threads();
  OneThreadGemms() { omp_set_num_threads(1); }
  ~OneThreadGemms() { omp_set_num_threads(team); }
  OneThreadGemms(const OneThreadGemms&) = delete;
  OneThreadGemms& operator=(const OneThreadGemms&) = delete;
};

}  // namespace

// q (b, h, t, d) fp32, any strides; k, v (b, g, t, d) fp32 contiguous; token_valid (b, t) bool, or an empty
// tensor for a prompt without pads; score_from: the first query row whose probabilities count (0: every valid
// one). Returns out (b, h, t, d) and mass (b, g, t) fp32.
std::vector<at::Tensor> scored_prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& token_valid, double scale, int64_t q_block,
                                                int64_t score_from) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-d");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "q, k, v must be float32");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "k and v must be contiguous");
  TORCH_CHECK(q.size(2) == k.size(2) && k.sizes() == v.sizes(), "a prompt attends to its own keys");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q_block >= 1, "q_block must be >= 1");
  TORCH_CHECK(score_from >= 0, "score_from must be >= 0");
  Shape s;
  s.b = q.size(0); s.h = q.size(1); s.t = q.size(2); s.d = q.size(3); s.g = k.size(1); s.r = s.h / s.g;
  s.q_block = q_block; s.blocks = (s.t + q_block - 1) / q_block; s.pairs = (s.blocks + 1) / 2;

  at::Tensor valid_c;
  const bool* valid = nullptr;
  std::vector<std::vector<int64_t>> pads(s.b);
  if (token_valid.numel() > 0) {
    TORCH_CHECK(token_valid.scalar_type() == at::kBool && token_valid.dim() == 2 && token_valid.size(0) == s.b &&
                token_valid.size(1) == s.t, "token_valid must be a (b, t) bool tensor");
    valid_c = token_valid.contiguous();
    valid = valid_c.data_ptr<bool>();
    for (int64_t bi = 0; bi < s.b; ++bi)
      for (int64_t i = 0; i < s.t; ++i)
        if (!valid[bi * s.t + i]) pads[bi].push_back(i);
  }
  at::Tensor out = at::empty({s.b, s.h, s.t, s.d}, q.options());
  const int threads = at::get_num_threads();
  at::Tensor partial = at::zeros({threads, s.b, s.g, s.t}, q.options());   // one column-sum row set per thread
  const int64_t tasks = s.b * s.g * s.pairs;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    OneThreadGemms alone;
    at::Tensor qbuf = at::empty({s.r * s.q_block, s.d}, q.options());
    at::Tensor logits = at::empty({s.r * s.q_block * s.t}, q.options());
    float* mine = partial[at::get_thread_num()].data_ptr<float>();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / s.pairs, pair = task % s.pairs;
      const int64_t bi = bg / s.g, gi = bg % s.g;
      attend_block(s, q, k, v, out, pads, valid, scale, score_from, bi, gi, pair, qbuf, logits, mine + bg * s.t);
      const int64_t mirror = s.blocks - 1 - pair;
      if (mirror != pair)
        attend_block(s, q, k, v, out, pads, valid, scale, score_from, bi, gi, mirror, qbuf, logits, mine + bg * s.t);
    }
  });
  return {out, partial.sum(0)};
}
