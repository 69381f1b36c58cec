// Python bindings of the CPU kernels (one extension module; see quant.py for how it is built).
#include "decoder_layer.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_matmul", &quant_matmul, "out[N, R] = x[N, K] @ dequant(W)[R, K]^T");
  m.def("quant_matmul_new", &quant_matmul_new, "x[N, K] @ dequant(W)[R, K]^T as a new [N, R] tensor");
  m.def("dequantize_rows", &dequantize_rows, "dequant(W)[rows] as float32");
  m.def("instruction_set", &instruction_set, "the SIMD path in use on this CPU");
  m.def("limit_instruction_set", &limit_instruction_set, "cap the SIMD path (for tests and comparisons)");
  m.def("set_amx_min_rows", &set_amx_min_rows, "fewest activation rows for the AMX path; returns the previous");
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta (if given), then weight * hidden / rms(hidden)");
  m.def("rotary_", &rotary_, "x = x * cos + rotate_half(x) * sin, in place");
  m.def("paged_decode_attention", &paged_decode_attention,
        "write k/v at slot_mapping, then each sequence's query attends its context -> [S, Hq, D]");
  m.def("argmax_rows", &argmax_rows, "x[N, V].argmax(dim=-1) as torch computes it, on the kernels' threads");
  py::class_<CpuDecoderLayer>(m, "CpuDecoderLayer", py::module_local(), "a Llama-family layer's decode step over packed weights")
      .def(py::init<const std::vector<LinearPartArgs>&, std::optional<torch::Tensor>, const std::vector<LinearPartArgs>&,
                    std::optional<torch::Tensor>, const std::vector<LinearPartArgs>&, const std::vector<LinearPartArgs>&,
                    torch::Tensor, torch::Tensor, double, int64_t, int64_t, int64_t, int64_t, double, bool>())
      .def("forward", &CpuDecoderLayer::forward, "hidden += layer(hidden), one query a row");
}
