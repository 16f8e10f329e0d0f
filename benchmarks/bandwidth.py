"""The machine's streaming-read bandwidth, the floor that every batch-1 decode figure is measured against:
a native AVX-512 reader at several run counts where the CPU has it, and torch's reductions everywhere."""

from __future__ import annotations

import functools
import statistics
import time

import torch
from common import log

# A plain streaming read (AVX-512 loads and adds over all threads): torch's reductions reach only 0.5-0.8
# of what a GEMV kernel streams on this machine, so they alone would put the "floor" above the limit.
# Each thread reads its half of the buffer as `streams` runs side by side: on this host one sequential
# run per core reaches only 0.65-1.0 of what 8 concurrent runs do (the memory system rewards more
# streams in flight), and the batch-1 GEMV walks 4 runs with a software prefetch (which can beat plain
# runs), so the floor takes the best of those patterns.
_STREAM_READ_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
template <int S, bool kPrefetch>
float read_runs(const float* p, int64_t n) {
  const int64_t run = n / S / 16 * 16;
  __m512 acc[S];
  for (int s = 0; s < S; ++s) acc[s] = _mm512_setzero_ps();
  for (int64_t i = 0; i < run; i += 16) {
    if (kPrefetch)
      for (int s = 0; s < S; ++s) _mm_prefetch(reinterpret_cast<const char*>(p + s * run + i + 512), _MM_HINT_T1);
    for (int s = 0; s < S; ++s) acc[s] = _mm512_add_ps(acc[s], _mm512_load_ps(p + s * run + i));
  }
  for (int s = 1; s < S; ++s) acc[0] = _mm512_add_ps(acc[0], acc[s]);
  return _mm512_reduce_add_ps(acc[0]);
}
double stream_read(const torch::Tensor& data, int64_t streams) {
  TORCH_CHECK(data.is_contiguous() && data.scalar_type() == at::kFloat, "contiguous float32");
  const float* p = data.data_ptr<float>();
  const int64_t chunk = 1 << 18, chunks = data.numel() / chunk;
  std::vector<float> sums(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    const float* q = p + begin * chunk;
    const int64_t n = (end - begin) * chunk;
    switch (streams) {
      case 1: sums[begin] = read_runs<1, false>(q, n); break;
      case 4: sums[begin] = read_runs<4, false>(q, n); break;
      case -4: sums[begin] = read_runs<4, true>(q, n); break;
      case 8: sums[begin] = read_runs<8, false>(q, n); break;
      default: sums[begin] = read_runs<16, false>(q, n); break;
    }
  });
  double total = 0;
  for (float s : sums) total += s;
  return total;
}
"""
_STREAM_COUNTS = (1, 4, 8, 16, -4)  # -4: 4 runs each prefetched 2 KB ahead, as the batch-1 GEMV reads


@functools.cache
def _native_reader():
    """The compiled streaming reader, or None where it cannot be built or run (then torch's readers alone)."""
    from pagoda.kernels import cpu_flags

    if "avx512f" not in cpu_flags():  # it would build, then die of an illegal instruction
        log("native streaming reader needs AVX-512; torch readers only")
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(name="pagoda_bench_stream_read_runs_prefetch", cpp_sources=_STREAM_READ_SOURCE,
                             functions=["stream_read"], extra_cflags=["-O3", "-mavx512f", "-fopenmp"],
                             extra_ldflags=["-lgomp"])
        return module.stream_read
    except Exception as error:  # no compiler or no AVX-512
        log(f"native streaming reader unavailable ({error}); torch readers only")
        return None


class StreamingReader:
    """A buffer of num_bytes and the readers that stream it: the native AVX-512 read at 1, 4, 8 and 16
    runs a thread and at 4 prefetched runs, torch's fp32 sum and bf16 amax. Every pass reads the whole
    buffer once; a reader's rate counts as the machine's when it is the best of them."""

    def __init__(self, num_bytes: int) -> None:
        chunk = 1 << 18  # floats: the native reader's unit of work (the buffer is 64-byte aligned by torch)
        self.data = torch.ones(max(num_bytes // 4 // chunk, 4) * chunk, dtype=torch.float32)
        self.readers = [torch.Tensor.sum, lambda t: t.view(torch.bfloat16).amax()]
        if (native := _native_reader()) is not None:
            self.readers += [lambda t, count=count: native(t, count) for count in _STREAM_COUNTS]
        for reader in self.readers:
            reader(self.data)  # touch the pages

    def rate(self, reader) -> float:
        started = time.perf_counter()
        reader(self.data)
        return self.data.numel() * 4 / (time.perf_counter() - started)

    def best_rate(self) -> float:
        """One pass of each reader, the fastest: the bandwidth at this moment."""
        return max(self.rate(reader) for reader in self.readers)


def read_bandwidth(num_bytes: int, repeats: int) -> list[float]:
    """Streaming-read bandwidth (bytes/s) over a buffer of num_bytes: the samples of the reader whose
    median of `repeats` passes is the best."""
    reader = StreamingReader(num_bytes)
    by_reader = [[reader.rate(r) for _ in range(repeats)] for r in reader.readers]
    return max(by_reader, key=statistics.median)
