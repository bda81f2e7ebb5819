// The compiled CPU kernels of flexgen_h2o/kernels (build.py builds them, dispatch.py calls them); bindings.cpp
// exposes them to Python.
#pragma once

#include <ATen/ATen.h>

#include <vector>

// H2O's prompt attention: the output and every key's attention mass from the queries at or after score_from,
// in one pass (scored_attention.cpp).
std::vector<at::Tensor> scored_prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& token_valid, double scale, int64_t q_block,
                                                int64_t score_from);

// One decode step's attention over the fp16 cache, read in place, with each key's mass (decode_attention.cpp).
std::vector<at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& valid, const at::Tensor& slot, const at::Tensor& k_new,
                                         const at::Tensor& v_new, double scale, bool want_mass, bool mean_pool);
// ... and over a row pool of heads of different lengths: column (b, g) starts at row col_start[b, g] (kv/ragged.py)
std::vector<at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& valid, const at::Tensor& slot, const at::Tensor& k_new,
                                         const at::Tensor& v_new, double scale, bool want_mass, bool mean_pool,
                                         const at::Tensor& col_start);
// The same over a group-wise quantized cache: k, v (b, g, s, row_bytes) uint8 in quant.py's row form.
std::vector<at::Tensor> decode_attention_quant(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& valid, const at::Tensor& slot,
                                               const at::Tensor& k_new, const at::Tensor& v_new, double scale,
                                               bool want_mass, bool mean_pool, int64_t bits, int64_t group_size);
std::vector<at::Tensor> decode_attention_quant(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& valid, const at::Tensor& slot,
                                               const at::Tensor& k_new, const at::Tensor& v_new, double scale,
                                               bool want_mass, bool mean_pool, int64_t bits, int64_t group_size,
                                               const at::Tensor& col_start);

// One decode step's commit into a CPU-homed cache: K/V row, position, scores, H2O's victim (commit_step.cpp).
at::Tensor commit_step(const at::Tensor& k, const at::Tensor& v, const at::Tensor& score, const at::Tensor& pos,
                       const at::Tensor& slot, const at::Tensor& k_new, const at::Tensor& v_new,
                       const at::Tensor& new_pos, const at::Tensor& mass, int64_t s, int64_t rule, int64_t sink,
                       const at::Tensor& recent, const at::Tensor& budget);
// ... into a row pool of heads of different lengths: k, v (b, T, d), score, pos (b, T); column (b, g) holds rows
// [col_start, col_start + col_cap) and budget is (b, g), one per column (kv/ragged.py)
at::Tensor commit_step(const at::Tensor& k, const at::Tensor& v, const at::Tensor& score, const at::Tensor& pos,
                       const at::Tensor& slot, const at::Tensor& k_new, const at::Tensor& v_new,
                       const at::Tensor& new_pos, const at::Tensor& mass, int64_t s, int64_t rule, int64_t sink,
                       const at::Tensor& recent, const at::Tensor& budget, const at::Tensor& col_start,
                       const at::Tensor& col_cap);

// x (m, k) fp32 @ w.T for an fp16 weight (n, k), converting the weight in L1 (half_linear.cpp).
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& w);

// x (m, k) fp32 @ dequant(w).T for a 4- or 8-bit weight in quant.py's row form (n, row_bytes) (quant_linear.cpp).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t k, int64_t bits, int64_t group_size);

// A decode step's element-wise layer math on the calling thread (layer_math.cpp): RMSNorm of fp32 rows with an
// fp16 or fp32 weight; silu(gate) * up into gate; RoPE of (b, h, t, d) rows by per-(sequence, token) cos and sin.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul_(at::Tensor& gate, const at::Tensor& up);
at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
