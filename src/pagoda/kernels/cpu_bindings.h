// The operations every target's Python module binds (cpu_module.cpp: AVX-512; cpu_simd_module.cpp: AVX2, NEON), with
// one description each; a module adds what only its target has.
#pragma once

#include "cpu_ops.h"

inline void define_shared_ops(pybind11::module& m) {
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence attending to its keys in the paged KV cache (window 0: none; scales: a quantized "
        "cache's, int8 [slots, kv_heads] or fp8 [1] each; softcap > 0: scores s become softcap * tanh(s / softcap))",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("seq_lens"), py::arg("window"),
        py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("softcap") = 0.0);
  // The GEMVs take prefill-sized inputs too where gemv_max_rows allows: the event loop runs meanwhile.
  m.def("gemv_fp32", &gemv_fp32, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = x @ w.T for fp32 w and 1..gemv_max_rows rows of x (x's dtype out)");
  m.def("gemv_bf16", &gemv_bf16, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = x @ w.T for bf16 w and 1..gemv_max_rows rows of x (x's dtype out)");
  m.def("gemv_int8", &gemv_int8, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = (x @ w.T) * scale for int8 w and 1..gemv_max_rows rows of x (x's dtype out)");
  m.attr("gemv_max_rows") = gemv_max_rows();
  // The integer matmuls take tens of milliseconds at prefill sizes: the server's event loop runs meanwhile.
  m.def("matmul_int8", &matmul_int8, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = (x @ w.T) * scale for int8 w, x quantized per 32 columns to int8");
  m.def("matmul_int4", &matmul_int4, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = x @ W.T for W in pagoda's int4 layout, x quantized per group to int8 (x's dtype out)");
  m.attr("matmul_int4_max_rows") = matmul_int4_max_rows();
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta (if given) in place; returns RMSNorm(x) * weight");
  m.def("rotary_write_kv_", &rotary_write_kv_,
        "rotates qkv's q and k heads in place; writes k, v to the cache (quantized, where it is, with its scales)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("num_heads"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("silu_mul", &silu_mul, "[gate | up] -> silu(gate) * up");
  m.def("lora_add_", &lora_add_,
        "y += (row_scaling * x @ a[slot].T) @ bt[slot] per row, slot from row_slots (< 0: the base, nothing added)",
        py::arg("y"), py::arg("x"), py::arg("a"), py::arg("bt"), py::arg("row_slots"), py::arg("row_scaling"));
  define_decode_stack(m);
  define_shm_all_reduce(m);
}
