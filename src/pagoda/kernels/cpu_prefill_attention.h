// What the two forms of paged prefill attention share (cpu_prefill_attention.cpp: vdpbf16ps or FMAs;
// cpu_prefill_attention_amx.cpp: AMX tiles, bf16): the sequence's shape, the driver that packs each kv
// head's keys and values and hands out the tasks, and the exp2 of the online softmax.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace pagoda::prefill {

using bf16 = at::BFloat16;

constexpr int64_t kKeys = 64;  // keys per block: 4 vectors of scores per row
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
struct Sequence {
  const T* q;
  T* out;
  int64_t q_stride, out_stride;  // elements between consecutive query positions
  int64_t queries, first_pos;    // query i sits at position first_pos + i; keys are positions 0..
  int64_t H, G, window;          // window: 0 for none, else keys at positions > pos - window
  float scale;
};

// Packs each kv head's keys and values once (Worker::pack: padded * D elements each), then runs tasks of
// one kv head and a block of `block` query positions, largest first (later positions see more keys) to
// whichever thread is free. Each thread makes one Worker(seq, block) (its scratch) and calls
// worker(keys, values, first query, count, kv head).
template <typename T, typename Worker>
void run_tasks(const Sequence<T>& seq, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t KVH,
               int64_t D, int64_t block) {
  const int64_t len = seq.first_pos + seq.queries, padded = (len + kKeys - 1) / kKeys * kKeys;
  const int64_t head_words = padded * D * sizeof(T) / sizeof(uint32_t);  // one kv head's keys (or values)
  std::vector<uint32_t> keys(KVH * head_words), values(KVH * head_words);
  at::parallel_for(0, KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kvh = begin; kvh < end; ++kvh)
      Worker::pack(k_cache, v_cache, slots, len, padded, KVH, kvh, D, keys.data() + kvh * head_words,
                   values.data() + kvh * head_words);
  });
  const int64_t blocks = (seq.queries + block - 1) / block, tasks = blocks * KVH;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Worker worker(seq, block);
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t b = blocks - 1 - task / KVH, kvh = task % KVH;
      const int64_t first = b * block, count = std::min(block, seq.queries - first);
      worker(keys.data() + kvh * head_words, values.data() + kvh * head_words, first, count, kvh);
    }
  });
}

// 2^x for x <= 0: 2^n * p(r) with n = round(x), |r| <= 1/2, p a degree-5 polynomial fitted to 2^r
// (relative error 2e-7 in fp32); x below -125 (-inf included) gives 0. Never a denormal: a vscalefps
// whose result underflows takes a microcode assist, ~30 times the instruction, and a masked key is one.
inline __m512 exp2_16(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-125.0f);  // 2^-125 p(r) >= 2^-125.5: still a normal float
  const __mmask16 normal = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.32187e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.67171e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550893e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022238f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.69314686f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// Whether this process may use AMX tiles: the CPU has AMX-BF16 and the kernel granted the tile state.
bool amx_granted();

// The AMX form, bf16 only, for head_dim D (32..128, a multiple of 32).
void attend_amx(const Sequence<bf16>& seq, const bf16* k_cache, const bf16* v_cache, const int64_t* slots,
                int64_t KVH, int64_t D);

}  // namespace pagoda::prefill
