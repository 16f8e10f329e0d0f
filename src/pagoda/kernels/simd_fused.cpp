// The small steps between a decoder layer's matmuls, fused (residual add + RMSNorm, rotary + KV-cache write,
// the SiLU-gated product), written once over cpu_simd.h's vector: the AVX2 module's form of cpu_fused.cpp's
// operations, with the same numerics contract. Every intermediate that torch rounds to the model dtype is
// rounded here too (round_as<T>), and nothing is contracted into an FMA that torch computes as a separate
// multiply and add (the build passes -ffp-contract=off); what can differ from torch is the order of the RMS
// sum and the last bit of exp, as between any two fp32 reductions.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <optional>

#include "cpu_ops.h"
#include "cpu_simd.h"

namespace {

using pagoda::simd::kLanes;
using pagoda::simd::load_at;
using pagoda::simd::round_as;
using pagoda::simd::store_at;
using pagoda::simd::Vec;

// Rows per parallel task, so that a task has ~32K elements: decode-sized inputs run inline, with no
// thread wake-up (which costs more than the work).
int64_t grain_for(int64_t row_elements) { return std::max<int64_t>(1, (int64_t{1} << 15) / row_elements); }

// x[r] += delta[r] (rounded to T, as torch's add), then out[r] = weight * T(x[r] / rms(x[r])).
template <typename T>
void add_rms_norm_rows(T* x, const T* delta, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = x + r * n;
      Vec squares = Vec::zero();
      for (int64_t i = 0; i < n; i += kLanes) {
        Vec v = load_at(row, i, n);
        if (delta != nullptr) {
          v = round_as<T>(v + load_at(delta + r * n, i, n));
          store_at(row, i, n, v);
        }
        squares = fmadd(v, v, squares);
      }
      const Vec inv_rms = Vec::broadcast(1.0f / std::sqrt(squares.reduce_add() / n + eps));
      for (int64_t i = 0; i < n; i += kLanes) {
        const Vec normed = round_as<T>(load_at(row, i, n) * inv_rms);
        store_at(out + r * n, i, n, load_at(weight, i, n) * normed);
      }
    }
  });
}

// One head, rotated in place: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (halves, as HF's
// rotate_half), each product and the sum rounded to T as torch's mul, mul, add would.
template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    const Vec x1 = load_at(x, i, half), x2 = load_at(x + half, i, half);
    const Vec first = round_as<T>(x1 * load_at(cos, i, half)) - round_as<T>(x2 * load_at(sin, i, half));
    const Vec second = round_as<T>(x2 * load_at(cos + half, i, half)) + round_as<T>(x1 * load_at(sin + half, i, half));
    store_at(x, i, half, first);
    store_at(x + half, i, half, second);
  }
}

// qkv rows [tokens, H + 2 KVH, D]: q and k heads rotated in place, then k and v copied to their slots.
template <typename T>
void rotary_write_kv_rows(T* qkv, const T* cos, const T* sin, T* k_cache, T* v_cache, const int64_t* slots,
                          int64_t tokens, int64_t H, int64_t KVH, int64_t D) {
  const int64_t row_elements = (H + 2 * KVH) * D, kv_elements = KVH * D;
  at::parallel_for(0, tokens, grain_for(row_elements), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * row_elements;
      for (int64_t h = 0; h < H + KVH; ++h) rotate_head(row + h * D, cos + t * D, sin + t * D, D / 2);
      std::memcpy(k_cache + slots[t] * kv_elements, row + H * D, kv_elements * sizeof(T));
      std::memcpy(v_cache + slots[t] * kv_elements, row + (H + KVH) * D, kv_elements * sizeof(T));
    }
  });
}

// out[r] = T(silu(gate)) * up, with gate_up[r] = [gate | up] (each I wide). silu(g) = g * sigmoid(g),
// from e = exp(-|g|) <= 1 so that nothing overflows.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, grain_for(2 * I), [&](int64_t begin, int64_t end) {
    const Vec one = Vec::broadcast(1.0f);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * I;
      for (int64_t i = 0; i < I; i += kLanes) {
        const Vec g = load_at(gate, i, I);
        const Vec e = pagoda::simd::exp_nonpositive(Vec::zero() - abs(g));
        const Vec numerator = where_negative(g, g * e, g);  // g >= 0: g; g < 0: g e
        const Vec silu = round_as<T>(numerator / (one + e));
        store_at(out + r * I, i, I, silu * load_at(gate + I, i, I));
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

// qkv [tokens, H + 2 KVH, D]; cos, sin [tokens, ..., D] in qkv's dtype; caches [slots, KVH, D].
void rotary_write_kv_(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                      torch::Tensor& v_cache, const torch::Tensor& slot_mapping, int64_t num_heads) {
  const std::initializer_list<const torch::Tensor*> tensors = {&qkv, &cos, &sin, &k_cache, &v_cache};
  for (const auto* t : tensors) check_float_types(*t, "qkv, cos, sin and caches");
  TORCH_CHECK(qkv.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "qkv [T,heads,D], caches [S,KVH,D]");
  const int64_t tokens = qkv.size(0), KVH = k_cache.size(1), D = qkv.size(2);
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * KVH && k_cache.size(2) == D && D % 2 == 0, "qkv's heads and D");
  TORCH_CHECK(cos.numel() == tokens * D && sin.numel() == tokens * D, "one cos/sin row per token");
  for (const auto* t : tensors)
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "qkv, cos, sin and caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens && slot_mapping.is_contiguous(),
              "slot_mapping: int64 [tokens]");
  dispatch_float_types(qkv.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    rotary_write_kv_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                                   k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                   slot_mapping.data_ptr<int64_t>(), tokens, num_heads, KVH, D);
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
