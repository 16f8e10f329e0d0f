"""`python -m pagoda.kernels`: build the native CPU kernels now (`make install` does this), every target the
CPU runs: the tests check each one."""

import logging

from pagoda.kernels import available_targets, simd_target, target_kernels

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
for target in available_targets():
    print(f"pagoda CPU kernels ({target}):", "ready" if target_kernels(target) is not None else "unavailable")
chosen, why = simd_target()
print("pagoda runs:", f"{chosen} ({why})" if chosen else f"the torch path ({why})")
