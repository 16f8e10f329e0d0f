"""`python -m pagoda.kernels`: build the native CPU kernels now (`make install` does this)."""

import logging

from pagoda.kernels import avx2_kernels, cpu_kernels

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
print("pagoda CPU kernels:", "ready" if cpu_kernels() is not None else "unavailable (torch fallback)")
# Where the full set runs, the AVX2 module is built too: the tests check both forms of the integer matmuls.
print("pagoda int8/int4 matmuls (AVX2):", "ready" if avx2_kernels() is not None else "unavailable (torch fallback)")
