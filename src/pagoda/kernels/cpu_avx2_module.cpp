// The Python module for CPUs with AVX2 but not the AVX-512 set the full kernels need: the operations that
// do not need AVX-512 (the AVX-512 module binds them too).
#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The integer matmuls take tens of milliseconds at prefill sizes: the server's event loop runs meanwhile.
  m.def("matmul_int8", &matmul_int8, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = (x @ w.T) * scale for int8 w, x quantized per 32 columns to int8");
  m.def("matmul_int4", &matmul_int4, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = x @ W.T for W in pagoda's int4 layout, x quantized per group to int8 (x's dtype out)");
  m.attr("matmul_int4_max_rows") = matmul_int4_max_rows();
}
