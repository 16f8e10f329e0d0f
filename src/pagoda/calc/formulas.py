"""The napkin formulas, as pure functions over plain numbers.

Every figure `pagoda calc` prints comes from one of these. They take SI base units (bytes, seconds,
flop/s, bytes/s) and return them; turning 1.4e11 bytes into "140.0 GB = 130.4 GiB" is the renderer's
job. docs/calc.md states each formula with its assumptions.
"""

from __future__ import annotations

import math

from pagoda import kv_format
from pagoda.int4_format import bytes_per_weight

GB = 10**9
GiB = 2**30

# Bytes per element. int4 is pagoda's layout, group scales and offsets included (`int4_format`: 5 bits a weight
# at its default group of 32; "int4-g128": 4.25); fp4 ignores its block scales (~6% for MXFP4).
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "float32": 4.0,
    "bf16": 2.0,
    "bfloat16": 2.0,
    "fp16": 2.0,
    "float16": 2.0,
    "half": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "int8": 1.0,
    "int4": bytes_per_weight(),
    "int4-g64": bytes_per_weight(64),
    "int4-g128": bytes_per_weight(128),
    "fp4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


# --- memory -------------------------------------------------------------------------------------


def weight_bytes(num_params: float, dtype: str) -> float:
    return num_params * dtype_bytes(dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> float:
    """K and V for every layer. GQA-aware: only the KV heads are stored, not the query heads. The KV formats
    pagoda stores (int8, fp8) count as `kv_format` says, scales included: the engine sizes its pool with the same
    function."""
    if kv_dtype.lower() in kv_format.KV_CACHE_DTYPES[1:]:
        per_head = kv_format.kv_bytes_per_head(head_dim, kv_dtype, 0.0)
    else:
        per_head = head_dim * dtype_bytes(kv_dtype)
    return 2 * num_layers * num_kv_heads * per_head


def kv_heads_per_gpu(num_kv_heads: int, tensor_parallel: int) -> int:
    # With more GPUs than KV heads, each GPU keeps a replica of the head its query heads use.
    return math.ceil(num_kv_heads / tensor_parallel)


def sequences_that_fit(free_bytes: float, kv_bytes_per_sequence: float) -> int:
    if free_bytes <= 0 or kv_bytes_per_sequence <= 0:
        return 0
    return math.floor(free_bytes / kv_bytes_per_sequence)


# --- roofline -----------------------------------------------------------------------------------


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """Arithmetic intensity (flop/byte) above which a kernel is compute-bound rather than memory-bound."""
    return peak_flops / bandwidth


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    return flops / bytes_moved


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    return min(peak_flops, intensity * bandwidth)


def step_time_floor(bytes_moved: float, flops: float, bandwidth: float, peak_flops: float) -> float:
    """The slower of reading every byte once and doing every flop at peak: neither can be beaten."""
    return max(bytes_moved / bandwidth, flops / peak_flops)


def compute_bound_batch(
    flops_per_token: float, weight_bytes_read: float, kv_bytes_per_sequence: float, ridge: float
) -> float | None:
    """Smallest batch whose decode step reaches the ridge point, or None if none does.

    Intensity(B) = B*F / (W + B*K) rises towards F/K; if F/K is below the ridge (long contexts: the
    KV read grows with the batch as fast as the flops do) decode stays memory-bound at any batch.
    """
    headroom = flops_per_token - ridge * kv_bytes_per_sequence
    if headroom <= 0:
        return None
    return ridge * weight_bytes_read / headroom


# --- flops --------------------------------------------------------------------------------------


def decode_flops_per_token(matmul_params: float, num_layers: int, q_dim: int, context_len: int) -> float:
    """2 flop per weight (multiply + add), plus attention: QK^T and AV over the context, 2 flop each."""
    return 2 * matmul_params + 4 * num_layers * q_dim * context_len


def prefill_flops(matmul_params: float, num_layers: int, q_dim: int, prompt_len: int) -> float:
    """2 flop per weight per token, plus causal attention (half of the P x P score matrix, twice)."""
    return 2 * matmul_params * prompt_len + 2 * num_layers * q_dim * prompt_len**2


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_token / peak_flops


# --- tensor parallelism -------------------------------------------------------------------------


def tp_allreduce_bytes_per_token(num_layers: int, hidden_size: int, activation_bytes: float) -> float:
    """Megatron-style TP all-reduces the hidden state twice per layer (after attention, after MLP)."""
    return 2 * num_layers * hidden_size * activation_bytes


def tp_allreduces_per_step(num_layers: int) -> int:
    """All-reduces in one forward step under Megatron-style TP: two per layer, whatever the batch."""
    return 2 * num_layers


def ring_allreduce_latency_s(tensor_parallel: int, hop_latency_s: float) -> float:
    """The fixed cost of one ring all-reduce: 2 (n-1) dependent hops (reduce-scatter, then all-gather)."""
    return 2 * max(0, tensor_parallel - 1) * hop_latency_s


def ring_allreduce_wire_bytes(payload_bytes: float, tensor_parallel: int) -> float:
    """Bytes each GPU sends in a ring all-reduce: reduce-scatter plus all-gather, (n-1)/n each."""
    if tensor_parallel <= 1:
        return 0.0
    return 2 * (tensor_parallel - 1) / tensor_parallel * payload_bytes


# --- economics ----------------------------------------------------------------------------------


def cost_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    return price_per_hour / (tokens_per_s * 3600) * 1e6


# --- speculative decoding -----------------------------------------------------------------------


def spec_expected_tokens(alpha: float, k: int) -> float:
    """Tokens per target step with k drafts, each accepted with probability alpha (Leviathan et al.).

    A geometric series: 1 + alpha + ... + alpha^k, the +1 being the token the target samples itself.
    """
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def spec_speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Speed-up over plain decoding when a draft step costs `draft_cost` target steps.

    Assumes verifying k+1 tokens costs one target step (decode is memory-bound, so it nearly does).
    """
    return spec_expected_tokens(alpha, k) / (1 + k * draft_cost)


def best_spec_k(alpha: float, draft_cost: float, max_k: int = 16) -> int:
    return max(range(1, max_k + 1), key=lambda k: spec_speedup(alpha, k, draft_cost))


# --- scheduling -------------------------------------------------------------------------------


def prefix_reusable_tokens(prompt_len: int, prefix_len: int, block_size: int) -> int:
    """Only whole blocks are cached, and the last prompt token is always recomputed (to get logits)."""
    shared = min(prefix_len, prompt_len - 1)
    return (shared // block_size) * block_size


def handoff_blocks(prompt_len: int, block_size: int, decode_prefix_len: int = 0) -> int:
    """Blocks a prefill replica hands a decode replica for one prompt: every full block before the last prompt
    token's (the decode replica computes that one, to sample from), less those the decode replica's prefix cache
    already holds."""
    held = max(prompt_len - 1, 0) // block_size
    local = prefix_reusable_tokens(prompt_len, decode_prefix_len, block_size) // block_size
    return max(0, held - local)


def handoff_bytes(prompt_len: int, block_size: int, kv_bytes_per_token: float, decode_prefix_len: int = 0) -> float:
    """KV bytes one request's handoff moves: blocks x block size x KV bytes per token (no framing)."""
    return handoff_blocks(prompt_len, block_size, decode_prefix_len) * block_size * kv_bytes_per_token


def chunked_prefill_steps(prompt_len: int, token_budget: int, running_decodes: int) -> int | None:
    """Steps to prefill a prompt when running decodes take their 1 token each from the budget first.

    None when the decodes leave no room: the prompt would wait forever.
    """
    chunk = token_budget - running_decodes
    if chunk <= 0:
        return None
    return math.ceil(prompt_len / chunk)


def static_batching_steps(output_lens: list[int], slots: int) -> int:
    """Steps to serve requests (in order) when a batch of `slots` starts only after the previous one ended.

    A request of L output tokens is in L steps (its first token comes with its prompt), so each batch lasts
    as long as its longest answer: the sum of the batch maxima.
    """
    return sum(max(output_lens[start : start + slots]) for start in range(0, len(output_lens), slots))


def continuous_batching_steps(output_lens: list[int], slots: int) -> int:
    """Steps to serve requests (in order) when a freed slot takes the next request at the next step.

    Each request goes to the slot that frees first (list scheduling); the last slot to finish ends it.
    """
    free_at = [0] * slots  # the step at which each slot is next free
    for length in output_lens:
        slot = min(range(slots), key=free_at.__getitem__)
        free_at[slot] += length
    return max(free_at, default=0)


def expected_batch_max_uniform(max_len: int, batch: int) -> float:
    """E[max of `batch` output lengths drawn uniformly from 1..max_len]: a static batch's expected steps."""
    return sum(1 - ((k - 1) / max_len) ** batch for k in range(1, max_len + 1))


# --- queueing -----------------------------------------------------------------------------------


def mm1_mean_sojourn(arrival_rate: float, service_rate: float) -> float | None:
    """M/M/1: mean time in the system (waiting + service), 1 / (mu - lambda); None at or past saturation."""
    return 1 / (service_rate - arrival_rate) if arrival_rate < service_rate else None


def mm1_mean_queue(arrival_rate: float, service_rate: float) -> float | None:
    """M/M/1: mean number waiting (not in service), rho^2 / (1 - rho); None at or past saturation."""
    rho = arrival_rate / service_rate
    return rho * rho / (1 - rho) if rho < 1 else None


def mm1_within(arrival_rate: float, service_rate: float, slo: float) -> float:
    """M/M/1: the share of requests done within `slo` of arriving (time in system is exponential, mu - lambda)."""
    return 1 - math.exp(-(service_rate - arrival_rate) * slo) if arrival_rate < service_rate else 0.0


# --- expert parallelism -------------------------------------------------------------------------


def ep_all_to_all_bytes(batch: float, top_k: int, hidden_size: int, activation_bytes: float, num_gpus: int) -> float:
    """Bytes one GPU sends in one sparse layer's dispatch and combine under expert parallelism: its batch / N
    tokens' top_k rows go out to their experts and come back, and (N - 1) / N of them to another GPU (routing taken
    as uniform; a GPU's own experts' rows stay)."""
    if num_gpus <= 1:
        return 0.0
    return 2 * batch / num_gpus * top_k * (num_gpus - 1) / num_gpus * hidden_size * activation_bytes


def ep_all_gather_bytes(batch: int, hidden_size: int, activation_bytes: float, num_gpus: int) -> float:
    """Bytes one GPU sends when a sparse layer's output is gathered back to every GPU: its slice of the batch,
    ceil(batch / N) rows, to each of the N - 1 others."""
    return (num_gpus - 1) * math.ceil(batch / num_gpus) * hidden_size * activation_bytes
