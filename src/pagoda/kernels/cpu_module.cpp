// The Python module of the AVX-512 target: every operation in cpu_ops.h, and the native decode stack.
#include "cpu_bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("target") = "avx512";
  define_shared_ops(m);
  m.def("paged_prefill_attention_", &paged_prefill_attention_,
        "one sequence's queries attending causally to its keys in the paged KV cache, into out (use_amx: bf16 "
        "on AMX tiles where the CPU grants them)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("key_slots"),
        pybind11::arg("window"), pybind11::arg("scale"), pybind11::arg("out"), pybind11::arg("use_amx") = true);
  m.attr("prefill_attention_amx") = prefill_attention_amx_available();
}
