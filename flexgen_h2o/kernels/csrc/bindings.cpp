#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released: the engine's copy lanes are Python threads that must run while these compute
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("scored_prompt_attention", &scored_prompt_attention, release);
  // each with and without a head-adaptive cache's column starts (the shorter form: a plain (b, g, s) window)
  using Decode = std::vector<at::Tensor> (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, double, bool, bool);
  using DecodeAt = std::vector<at::Tensor> (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, double, bool, bool, const at::Tensor&);
  using Quant = std::vector<at::Tensor> (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, double, bool, bool, int64_t, int64_t);
  using QuantAt = std::vector<at::Tensor> (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, double, bool, bool, int64_t, int64_t,
                                              const at::Tensor&);
  using Commit = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, int64_t, int64_t, int64_t, const at::Tensor&, const at::Tensor&);
  using CommitAt = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, int64_t, int64_t, int64_t, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&);
  m.def("decode_attention", static_cast<Decode>(&decode_attention), release);
  m.def("decode_attention", static_cast<DecodeAt>(&decode_attention), release);
  m.def("decode_attention_quant", static_cast<Quant>(&decode_attention_quant), release);
  m.def("decode_attention_quant", static_cast<QuantAt>(&decode_attention_quant), release);
  m.def("commit_step", static_cast<Commit>(&commit_step), release);
  m.def("commit_step", static_cast<CommitAt>(&commit_step), release);
  m.def("half_linear", &half_linear, release);
  m.def("quant_linear", &quant_linear, release);
  m.def("rms_norm_rows", &rms_norm_rows, release);
  m.def("silu_mul_", &silu_mul_, release);
  m.def("rope_rows", &rope_rows, release);
  m.attr("rope_rows_takes_prompts") = true;   // t > 1 (older builds: one token; benchmarks/studies/ab.py)
  m.attr("commit_takes_row_budgets") = true;
  m.attr("takes_column_starts") = true;       // the head-adaptive forms above (older builds: kv/ragged.py's torch path)  // (b,) recent and budget (older builds: ints; benchmarks/studies/ab.py)
}
