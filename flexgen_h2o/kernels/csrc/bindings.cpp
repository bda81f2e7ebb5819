#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released: the engine's copy lanes are Python threads that must run while these compute
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("scored_prompt_attention", &scored_prompt_attention, release);
  m.def("decode_attention", &decode_attention, release);
  m.def("decode_attention_quant", &decode_attention_quant, release);
  m.def("commit_step", &commit_step, release);
  m.def("half_linear", &half_linear, release);
  m.def("quant_linear", &quant_linear, release);
  m.def("rms_norm_rows", &rms_norm_rows, release);
  m.def("silu_mul_", &silu_mul_, release);
  m.def("rope_rows", &rope_rows, release);
  m.attr("rope_rows_takes_prompts") = true;   // t > 1 (older builds: one token; benchmarks/studies/ab.py)
  m.attr("commit_takes_row_budgets") = true;  // (b,) recent and budget (older builds: ints; benchmarks/studies/ab.py)
}
