// Paged decode attention on the CPU: one query token per sequence, keys and values read in place
// from the paged cache through each sequence's slot list, without gathering them into a batch.
//
// q: [B, H, D]; k_cache, v_cache: [num_slots, KVH, D] (fp32 or bf16); slots: [B, L] int64 (padded);
// seq_lens: [B] int64; window: 0 for none, else keys at positions >= seq_len - window.
// Work is split over (sequence, kv head); each task handles the H / KVH query heads sharing that kv head,
// so every key and value row is read once. Scores and the softmax are in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
float dot(const float* q, const T* k, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  return _mm512_reduce_add_ps(acc);
}

template <typename T>
void axpy(float a, const T* v, float* out, int64_t D) {
  __m512 av = _mm512_set1_ps(a);
  for (int64_t d = 0; d < D; d += 16) {
    _mm512_storeu_ps(out + d, _mm512_fmadd_ps(av, load16(v + d), _mm512_loadu_ps(out + d)));
  }
}

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, const int64_t* seq_lens,
            T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t L, int64_t window, float scale) {
  const int64_t group = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * D), acc(group * D), scores(group * L);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      const int64_t len = seq_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) query[g * D + d] = static_cast<float>(q[(b * H + kvh * group + g) * D + d]);
      std::vector<float> max_score(group, -std::numeric_limits<float>::infinity());
      for (int64_t p = first; p < len; ++p) {
        const T* key = k_cache + (slots[b * L + p] * KVH + kvh) * D;
        for (int64_t g = 0; g < group; ++g) {
          float s = dot(query.data() + g * D, key, D) * scale;
          scores[g * L + p] = s;
          max_score[g] = std::max(max_score[g], s);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::vector<float> total(group, 0.0f);
      for (int64_t p = first; p < len; ++p) {
        const T* value = v_cache + (slots[b * L + p] * KVH + kvh) * D;
        for (int64_t g = 0; g < group; ++g) {
          float weight = std::exp(scores[g * L + p] - max_score[g]);
          total[g] += weight;
          axpy(weight, value, acc.data() + g * D, D);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + kvh * group + g) * D + d] = static_cast<T>(acc[g * D + d] / total[g]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& slots,
                                     const torch::Tensor& seq_lens, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [B,H,D], caches [S,KVH,D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 slots and lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && D % 16 == 0 && k_cache.size(2) == D, "head shapes");
  TORCH_CHECK(slots.size(0) == B && seq_lens.size(0) == B, "one slot row and length per sequence");
  auto qc = q.contiguous();
  auto slot_rows = slots.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(qc);
  const int64_t L = slot_rows.size(1);
  if (q.scalar_type() == at::kFloat) {
    attend<float>(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  slot_rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, L,
                  window, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "fp32 or bf16 only");
    attend<at::BFloat16>(qc.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                         v_cache.data_ptr<at::BFloat16>(), slot_rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                         out.data_ptr<at::BFloat16>(), B, H, KVH, D, L, window, static_cast<float>(scale));
  }
  return out;
}
