"""The calculator's inputs, and the per-GPU quantities every report section is built from."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.calc import formulas as f
from pagoda.calc.shapes import GpuSpec, ModelShape
from pagoda.kv_groups import kv_tokens_per_layer

# Batches the decode table always shows; --batch and the largest batch that fits are added to them.
STANDARD_BATCHES = (1, 8, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class CalcInputs:
    model: ModelShape
    gpu: GpuSpec
    num_gpus: int = 1  # tensor-parallel degree: weights and KV heads are split across them
    dtype: str = "bf16"
    kv_dtype: str | None = None  # None: same as dtype
    seq_len: int = 4096  # context length of every sequence in a decode batch (worst case)
    batch: int = 1
    prompt_len: int = 2048
    achieved_tflops: float | None = None  # None: half the GPU's peak (50% MFU)
    mem_util: float = 0.9  # fraction of GPU memory for weights + KV, as vLLM's gpu_memory_utilization
    price_per_hour: float | None = None  # $ per GPU-hour
    tokens_per_s: float | None = None  # observed throughput of the whole deployment, if known
    spec_alpha: float | None = None
    spec_k: int = 5
    spec_draft_cost: float = 0.05  # one draft step, in target steps
    prefix_len: int | None = None
    block_size: int = 16
    token_budget: int | None = None
    running_decodes: int = 0
    disagg: bool = False  # the prefill/decode split's section
    kv_link_gbps: float = 50.0  # GB/s between a prefill and a decode replica, one direction
    output_len: int = 128  # answer tokens per request
    request_rate: float = 1.0  # requests/s

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def achieved_flops(self) -> float:
        if self.achieved_tflops is not None:
            return self.achieved_tflops * 1e12
        return 0.5 * self.gpu.peak_flops

    def validate(self) -> None:
        f.dtype_bytes(self.dtype)
        f.dtype_bytes(self.cache_dtype)
        at_least_one: dict[str, float | None] = {
            "num_gpus": self.num_gpus,
            "seq_len": self.seq_len,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "block_size": self.block_size,
            "spec_k": self.spec_k,
            "token_budget": self.token_budget,
            "output_len": self.output_len,
        }
        non_negative: dict[str, float | None] = {
            "prefix_len": self.prefix_len,
            "running_decodes": self.running_decodes,
            "spec_draft_cost": self.spec_draft_cost,
            "price_per_hour": self.price_per_hour,
        }
        for name, value in at_least_one.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        for name, value in non_negative.items():
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
        for name, value in {
            "tokens_per_s": self.tokens_per_s,
            "achieved_tflops": self.achieved_tflops,
            "kv_link_gbps": self.kv_link_gbps,
            "request_rate": self.request_rate,
        }.items():
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 < self.mem_util <= 1:
            raise ValueError(f"mem_util must be in (0, 1], got {self.mem_util}")
        if self.spec_alpha is not None and not 0 <= self.spec_alpha <= 1:
            raise ValueError(f"spec_alpha is a probability, got {self.spec_alpha}")
        if self.gpu.peak_flops <= 0 or self.gpu.bandwidth <= 0:
            raise ValueError("the GPU needs positive TFLOP/s and TB/s")


@dataclass(frozen=True)
class Deployment:
    """Per-GPU figures, derived once. KV fields are None when the model has no architecture."""

    inputs: CalcInputs
    weight_bytes: float  # the whole model in --dtype
    weight_bytes_per_gpu: float
    weights_read_per_gpu: float  # bytes of weights one decode step of one sequence reads on each GPU
    kv_bytes_per_token: float | None  # the whole model
    kv_bytes_per_token_per_gpu: float | None
    capacity_per_gpu: float  # memory for weights + KV: capacity x mem_util
    flops_per_token: float  # decode, at --seq-len of context
    allreduce_wire_bytes_per_token: float  # each GPU sends this much per token under TP
    allreduces_per_step: int  # 0 without TP, or without the model's layer count

    @property
    def free_per_gpu(self) -> float:
        return self.capacity_per_gpu - self.weight_bytes_per_gpu

    @property
    def weights_fit(self) -> bool:
        return self.free_per_gpu > 0

    @property
    def kv_tokens_per_sequence(self) -> float:
        """Tokens of KV one --seq-len sequence keeps per layer: sliding-window layers keep only their window."""
        arch = self.inputs.model.architecture
        return kv_tokens_per_layer(() if arch is None else arch.sliding_windows, self.inputs.seq_len)

    @property
    def kv_bytes_per_sequence(self) -> float:
        return (self.kv_bytes_per_token or 0.0) * self.kv_tokens_per_sequence

    @property
    def kv_bytes_per_sequence_per_gpu(self) -> float:
        return (self.kv_bytes_per_token_per_gpu or 0.0) * self.kv_tokens_per_sequence

    def weights_read_at(self, batch: int) -> float:
        """Bytes of weights a step of `batch` tokens reads on each GPU: a mixture of experts' grow with the
        experts the batch hits; a dense model's are the same at any batch."""
        return f.weight_bytes(self.inputs.model.weights_read_params(batch), self.inputs.dtype) / self.inputs.num_gpus

    @property
    def max_sequences(self) -> int | None:
        if self.kv_bytes_per_token_per_gpu is None:
            return None
        return f.sequences_that_fit(self.free_per_gpu, self.kv_bytes_per_sequence_per_gpu)


def derive(inputs: CalcInputs) -> Deployment:
    model, tp = inputs.model, inputs.num_gpus
    kv_total = kv_per_gpu = None
    attention_flops = 0.0
    wire_bytes = 0.0
    allreduces = 0
    if (arch := model.architecture) is not None:
        kv_total = f.kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, inputs.cache_dtype)
        heads_per_gpu = f.kv_heads_per_gpu(arch.num_kv_heads, tp)
        kv_per_gpu = f.kv_bytes_per_token(arch.num_layers, heads_per_gpu, arch.head_dim, inputs.cache_dtype)
        attention_flops = f.decode_flops_per_token(0, arch.num_layers, arch.q_dim, inputs.seq_len)
        # Activations stay 16-bit when weights are quantized; fp32 models move fp32 activations.
        activation_bytes = max(2.0, f.dtype_bytes(inputs.dtype))
        payload = f.tp_allreduce_bytes_per_token(arch.num_layers, arch.hidden_size, activation_bytes)
        wire_bytes = f.ring_allreduce_wire_bytes(payload, tp)
        allreduces = f.tp_allreduces_per_step(arch.num_layers) if tp > 1 else 0
    weights = f.weight_bytes(model.num_params, inputs.dtype)
    return Deployment(
        inputs=inputs,
        weight_bytes=weights,
        weight_bytes_per_gpu=weights / tp,
        weights_read_per_gpu=f.weight_bytes(model.matmul_params, inputs.dtype) / tp,
        kv_bytes_per_token=kv_total,
        kv_bytes_per_token_per_gpu=kv_per_gpu,
        capacity_per_gpu=inputs.gpu.memory_bytes * inputs.mem_util,
        flops_per_token=2 * model.matmul_params + attention_flops,
        allreduce_wire_bytes_per_token=wire_bytes,
        allreduces_per_step=allreduces,
    )


def prefill_seconds(d: Deployment, tokens: int, include_weight_reads: bool = True) -> float:
    """Time to compute a prompt of `tokens` on all the GPUs: its flops at the achieved rate, or, for short prompts,
    reading every weight once (include_weight_reads), whichever is slower."""
    inputs, model = d.inputs, d.inputs.model
    arch = model.architecture
    flops = f.prefill_flops(model.matmul_params, arch.num_layers if arch else 0, arch.q_dim if arch else 0, tokens)
    seconds = flops / (inputs.achieved_flops * inputs.num_gpus)
    if include_weight_reads:
        seconds = max(seconds, d.weights_read_at(tokens) / inputs.gpu.bandwidth)
    return seconds


@dataclass(frozen=True)
class DecodePoint:
    """One decode step of `batch` sequences, each with --seq-len tokens of context, on each GPU."""

    batch: int
    bytes_read: float
    flops: float
    memory_s: float
    compute_s: float
    comm_latency_s: float  # the all-reduces' fixed cost: as large at batch 1 as at any batch
    comm_bandwidth_s: float  # the all-reduced bytes over the link: grows with the batch
    fits: bool | None  # None: KV size unknown (parameter count only)

    @property
    def comm_s(self) -> float:
        return self.comm_latency_s + self.comm_bandwidth_s

    @property
    def step_s(self) -> float:
        # Reads and flops overlap (the slower one is the floor); TP all-reduces sit between layers.
        return max(self.memory_s, self.compute_s) + self.comm_s

    @property
    def intensity(self) -> float:
        return f.arithmetic_intensity(self.flops, self.bytes_read)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"


def _fits(d: Deployment, kv_bytes: float) -> bool | None:
    if not d.weights_fit:
        return False
    if d.kv_bytes_per_token is None:
        return None
    return d.weight_bytes_per_gpu + kv_bytes <= d.capacity_per_gpu


def decode_point(d: Deployment, batch: int) -> DecodePoint:
    inputs, gpu = d.inputs, d.inputs.gpu
    kv_read = batch * d.kv_bytes_per_sequence_per_gpu
    bytes_read = d.weights_read_at(batch) + kv_read
    flops = batch * d.flops_per_token / inputs.num_gpus
    comm_bandwidth_s = 0.0
    if d.allreduce_wire_bytes_per_token and gpu.interconnect_gbps:
        comm_bandwidth_s = batch * d.allreduce_wire_bytes_per_token / (gpu.interconnect_gbps * 1e9)
    comm_latency_s = d.allreduces_per_step * f.ring_allreduce_latency_s(inputs.num_gpus, gpu.interconnect_latency_s)
    return DecodePoint(
        batch=batch,
        bytes_read=bytes_read,
        flops=flops,
        memory_s=bytes_read / gpu.bandwidth,
        compute_s=flops / gpu.peak_flops,
        comm_latency_s=comm_latency_s,
        comm_bandwidth_s=comm_bandwidth_s,
        fits=_fits(d, kv_read),
    )


def table_batches(d: Deployment) -> list[int]:
    batches = {*STANDARD_BATCHES, d.inputs.batch}
    if d.max_sequences:
        batches.add(d.max_sequences)
    return sorted(batches)
