// The small steps between a decoder layer's matmuls, fused: residual add + RMSNorm, rotary + KV-cache
// write, and the SiLU-gated product. At batch-1 decode a layer's GEMVs take tens of microseconds and
// each eager torch op costs 5-15 us of dispatch; these turn the ~20 small ops of a layer into 5 calls.
//
// Numerics follow the torch reference (model/layers.py) op for op: every intermediate that torch rounds
// to the model dtype is rounded here too (round_as<T>), and nothing is contracted into an FMA that torch
// computes as a separate multiply and add (the build passes -ffp-contract=off). What can differ is the
// order of the RMS sum and the last bit of exp, as between any two fp32 reductions.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <optional>

#include "cpu_kv_cache.h"
#include "cpu_ops.h"
#include "cpu_vec.h"

namespace {

using pagoda::exp16;
using pagoda::first_lanes;
using pagoda::load16;
using pagoda::round_as;
using pagoda::store16;

// Rows per parallel task, so that a task has ~32K elements: decode-sized inputs run inline, with no
// thread wake-up (which costs more than the work).
int64_t grain_for(int64_t row_elements) { return std::max<int64_t>(1, (int64_t{1} << 15) / row_elements); }

// x[r] += delta[r] (rounded to T, as torch's add), then out[r] = weight * T(x[r] / rms(x[r])).
template <typename T>
void add_rms_norm_rows(T* x, const T* delta, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = x + r * n;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = first_lanes(n - i);
        __m512 v = load16(row + i, live);
        if (delta != nullptr) {
          v = round_as<T>(_mm512_add_ps(v, load16(delta + r * n + i, live)));
          store16(row + i, v, live);
        }
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const __m512 inv_rms = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / n + eps));
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = first_lanes(n - i);
        __m512 normed = round_as<T>(_mm512_mul_ps(load16(row + i, live), inv_rms));
        store16(out + r * n + i, _mm512_mul_ps(load16(weight + i, live), normed), live);
      }
    }
  });
}

// One head, rotated in place: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (halves, as HF's
// rotate_half), each product and the sum rounded to T as torch's mul, mul, add would.
template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 live = first_lanes(half - i);
    const __m512 x1 = load16(x + i, live), x2 = load16(x + half + i, live);
    const __m512 first = _mm512_sub_ps(round_as<T>(_mm512_mul_ps(x1, load16(cos + i, live))),
                                       round_as<T>(_mm512_mul_ps(x2, load16(sin + i, live))));
    const __m512 second = _mm512_add_ps(round_as<T>(_mm512_mul_ps(x2, load16(cos + half + i, live))),
                                        round_as<T>(_mm512_mul_ps(x1, load16(sin + half + i, live))));
    store16(x + i, first, live);
    store16(x + half + i, second, live);
  }
}

// qkv rows [tokens, H + 2 KVH, D]: q and k heads rotated in place, then k and v stored at their slots in the
// cache's format (kv_quant.h: copied, or quantized).
template <typename T>
void rotary_write_kv_rows(T* qkv, const T* cos, const T* sin, const pagoda::kv_quant::KVCacheView& cache,
                          const int64_t* slots, int64_t tokens, int64_t H, int64_t KVH, int64_t D) {
  const int64_t row_elements = (H + 2 * KVH) * D;
  at::parallel_for(0, tokens, grain_for(row_elements), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * row_elements;
      for (int64_t h = 0; h < H + KVH; ++h) rotate_head(row + h * D, cos + t * D, sin + t * D, D / 2);
      pagoda::kv_quant::write_token(cache, row + H * D, row + (H + KVH) * D, slots[t], KVH, D,
                                    [](T x) { return static_cast<float>(x); });
    }
  });
}

// out[r] = T(silu(gate)) * up, with gate_up[r] = [gate | up] (each I wide). silu(g) = g * sigmoid(g),
// from e = exp(-|g|) <= 1 so that nothing overflows.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, grain_for(2 * I), [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * I;
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 live = first_lanes(I - i);
        const __m512 g = load16(gate + i, live);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);  // g >= 0: g; g < 0: g e
        const __m512 silu = round_as<T>(_mm512_div_ps(numerator, _mm512_add_ps(one, e)));
        store16(out + r * I + i, _mm512_mul_ps(silu, load16(gate + I + i, live)), live);
      }
    }
  });
}

// Calls body(T{}) with T the C++ type of an fp32 or bf16 tensor.
template <typename Body>
void dispatch_float_types(at::ScalarType type, Body body) {
  if (type == at::kFloat) return body(float{});
  body(at::BFloat16{});
}

void check_float_types(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, " must be fp32 or bf16");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// x [rows, n] (updated in place to x + delta when delta is given); returns RMSNorm(x) * weight.
torch::Tensor add_rms_norm_(torch::Tensor& x, const std::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                            double eps) {
  check_float_types(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1), "weight: x's dtype, [n]");
  if (delta) {
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "delta must match x");
    check_float_types(*delta, "delta");
  }
  auto out = torch::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  dispatch_float_types(x.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta ? delta->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n,
                                static_cast<float>(eps));
  });
  return out;
}

// qkv [tokens, H + 2 KVH, D]; cos, sin [tokens, ..., D] in qkv's dtype; caches [slots, KVH, D] in qkv's dtype,
// or quantized with their scales (cpu_kv_cache.h).
void rotary_write_kv_(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                      torch::Tensor& v_cache, const torch::Tensor& slot_mapping, int64_t num_heads,
                      const std::optional<torch::Tensor>& k_scale, const std::optional<torch::Tensor>& v_scale) {
  const std::initializer_list<const torch::Tensor*> tensors = {&qkv, &cos, &sin};
  for (const auto* t : tensors) check_float_types(*t, "qkv, cos and sin");
  TORCH_CHECK(qkv.dim() == 3, "qkv [T,heads,D]");
  const auto cache = pagoda::kv_cache_view(k_cache, v_cache, k_scale, v_scale, qkv.scalar_type());
  const int64_t tokens = qkv.size(0), KVH = k_cache.size(1), D = qkv.size(2);
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * KVH && k_cache.size(2) == D && D % 2 == 0, "qkv's heads and D");
  TORCH_CHECK(cos.numel() == tokens * D && sin.numel() == tokens * D, "one cos/sin row per token");
  for (const auto* t : tensors)
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "qkv, cos and sin must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens && slot_mapping.is_contiguous(),
              "slot_mapping: int64 [tokens]");
  dispatch_float_types(qkv.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    rotary_write_kv_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                                   cache, slot_mapping.data_ptr<int64_t>(), tokens, num_heads, KVH, D);
  });
}

// gate_up [rows, 2 I] -> silu(gate) * up [rows, I].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_float_types(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate_up's last dim must be even");
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  dispatch_float_types(gate_up.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, I);
  });
  return out;
}
