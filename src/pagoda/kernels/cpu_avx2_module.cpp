// The Python module of the AVX2 target, for CPUs without the AVX-512 set the full kernels need: the decode
// path (the simd_*.cpp bindings of the simd_*.h cores over cpu_simd.h, the integer matmuls, the native decode stack). Prefill
// attention has no AVX2 form: prefills attend through torch's SDPA.
#include "cpu_bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("target") = "avx2";
  define_shared_ops(m);
  m.attr("prefill_attention_amx") = false;
}
