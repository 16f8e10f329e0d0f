// The torch-level operations of pagoda's CPU kernels, as bound into Python (cpu_module.cpp) and as the
// native decode stack (cpu_decode.cpp) calls them: one definition each, whichever side calls it.
#pragma once

#include <torch/extension.h>

#include <optional>

// cpu_gemv.cpp (AVX-512) or simd_gemv.cpp (AVX2): y = x @ w.T for 1..gemv_max_rows() rows of x, in x's dtype
// (int8: times a per-output-channel scale).
int64_t gemv_max_rows();
torch::Tensor gemv_fp32(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale);
// cpu_int8.cpp (AVX2): y = (x @ w.T) * scale for int8 w and any number of rows of x, x quantized per 32
// columns to int8 (cpu_gemv.cpp's gemv_int8 is the AVX-512 kernels' int8 path).
torch::Tensor matmul_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale);
// cpu_int4.cpp (AVX2 and AVX-512 forms): y = x @ W.T for any number of rows of x, int4 W in pagoda's layout
// (32-row blocks) with bf16 (scale, offset) per group, block-major; x quantized per group to int8.
torch::Tensor matmul_int4(const torch::Tensor& x, const torch::Tensor& packed, int64_t group,
                        const torch::Tensor& scales_and_zeros);
// The most rows of x for which matmul_int4 beats dequantized tiles into a GEMM (the largest int64: no bound).
int64_t matmul_int4_max_rows();

// cpu_attention.cpp, cpu_prefill_attention*.cpp: paged attention reading the cache in place. The decode takes a
// cache in q's dtype (no scales), or quantized with its scales (cpu_kv_cache.h), and caps its scores where softcap
// > 0 (Gemma 2); the prefill q's dtype only.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& slots,
                                     const torch::Tensor& seq_lens, int64_t window, double scale,
                                     const std::optional<torch::Tensor>& k_scale,
                                     const std::optional<torch::Tensor>& v_scale, double softcap);
// use_amx: bf16 on AMX tiles where prefill_attention_amx_available() (cpu_prefill_attention_amx.cpp).
void paged_prefill_attention_(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& key_slots, int64_t window, double scale, torch::Tensor& out,
                              bool use_amx);
bool prefill_attention_amx_available();

// cpu_fused.cpp: the small steps between a layer's matmuls.
torch::Tensor add_rms_norm_(torch::Tensor& x, const std::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                            double eps);
// The cache in qkv's dtype, or quantized as it is written, with its scales (cpu_kv_cache.h).
void rotary_write_kv_(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                      torch::Tensor& v_cache, const torch::Tensor& slot_mapping, int64_t num_heads,
                      const std::optional<torch::Tensor>& k_scale, const std::optional<torch::Tensor>& v_scale);
torch::Tensor silu_mul(const torch::Tensor& gate_up);

// simd_lora.cpp: y += each row's LoRA delta, (scaling[m] * x[m] A[s]^T) Bt[s] with s = row_slots[m] (< 0: none);
// a [slots, rank, in], bt [slots, rank, out] (B transposed), y [rows, out] (rows may be strided: a column slice).
void lora_add_(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt,
               const torch::Tensor& row_slots, const torch::Tensor& row_scaling);

// cpu_decode.cpp: registers the DecodeStack class on the module.
void define_decode_stack(pybind11::module& m);
// cpu_shm_reduce.cpp: the shared-memory all-reduce between one machine's tensor-parallel ranks.
void define_shm_all_reduce(pybind11::module& m);
