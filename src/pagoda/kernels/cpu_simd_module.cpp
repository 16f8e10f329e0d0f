// The Python module of the portable targets: AVX-512F and AVX2 (x86 CPUs without the AVX-512 set the full kernels
// need) and NEON (aarch64). The decode path: the simd_*.cpp bindings of the simd_*.h cores over cpu_simd.h, the
// integer matmuls over simd_int.h, the native decode stack. Prefill attention has no portable form: prefills attend
// through SDPA.
#include "cpu_bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(__aarch64__)
  m.attr("target") = "neon";
#elif defined(__AVX512F__)
  m.attr("target") = "avx512f";
#else
  m.attr("target") = "avx2";
#endif
  define_shared_ops(m);
  m.attr("prefill_attention_amx") = false;
}
