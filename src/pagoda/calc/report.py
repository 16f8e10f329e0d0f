"""Build the report: one section per question the issue asks, from a Deployment's per-GPU figures.

Optional sections (cost, utilization, speculation, prefix cache, chunked prefill) appear only when their
inputs are given. A configuration that does not fit is flagged, and every figure is still computed as
if it did: the point of napkin math is to see by how much.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pagoda.calc import formulas as f
from pagoda.calc.deployment import CalcInputs, Deployment, decode_point, derive, prefill_seconds, table_batches
from pagoda.calc.disagg import disagg_section
from pagoda.calc.experts import experts_section
from pagoda.calc.render import Column, Report, Section, Table

WEIGHT_DTYPES = ("fp32", "bf16", "fp8", "int4")


def _setup(d: Deployment) -> Section:
    inputs, model, gpu = d.inputs, d.inputs.model, d.inputs.gpu
    s = Section("setup", "Setup")
    s.add("model", "model", model.name)
    s.add(
        "num_params",
        "parameters",
        model.num_params,
        note="counted from the config" if model.architecture is not None else "as given",
    )
    if (arch := model.architecture) is not None:
        s.add("architecture", "architecture", f"{arch.num_layers} layers, hidden {arch.hidden_size}, "
                                              f"{arch.num_heads} q / {arch.num_kv_heads} kv heads x {arch.head_dim}")
    s.add("gpu", "GPU", gpu.name, note=gpu.source)
    s.add("peak_flop_per_s", "peak compute (dense)", gpu.peak_flops, "flop/s")
    s.add("bandwidth_bytes_per_s", "memory bandwidth", gpu.bandwidth, "B/s")
    s.add("gpu_memory_bytes", "memory per GPU", gpu.memory_bytes, "bytes")
    s.add("num_gpus", "GPUs (tensor parallel)", inputs.num_gpus)
    s.add("dtype", "weight dtype", inputs.dtype)
    s.add("kv_dtype", "KV cache dtype", inputs.cache_dtype)
    return s


def _memory(d: Deployment) -> Section:
    inputs = d.inputs
    s = Section("memory", "Memory")
    for dtype in WEIGHT_DTYPES:
        s.add(
            f"weight_bytes_{dtype}",
            f"weights if {dtype}",
            f.weight_bytes(inputs.model.num_params, dtype),
            "bytes",
        )
    s.add("weight_bytes", f"weights ({inputs.dtype})", d.weight_bytes, "bytes")
    s.add("weight_bytes_per_gpu", "weights per GPU", d.weight_bytes_per_gpu, "bytes")
    s.add(
        "usable_bytes_per_gpu",
        "usable per GPU",
        d.capacity_per_gpu,
        "bytes",
        f"{inputs.mem_util:g} of capacity",
    )
    s.add("free_for_kv_bytes_per_gpu", "left for KV per GPU", d.free_per_gpu, "bytes")
    s.add("weights_fit", "weights fit", d.weights_fit)
    if d.kv_bytes_per_token is None:
        return s
    s.add(
        "kv_bytes_per_token",
        "KV per token",
        d.kv_bytes_per_token,
        "bytes",
        "2 (K,V) x layers x kv heads x head dim x dtype",
    )
    s.add("kv_bytes_per_token_per_gpu", "KV per token per GPU", d.kv_bytes_per_token_per_gpu, "bytes")
    windows = () if inputs.model.architecture is None else inputs.model.architecture.sliding_windows
    s.add(
        "kv_bytes_per_sequence",
        f"KV per sequence ({inputs.seq_len:,} tok)",
        d.kv_bytes_per_sequence,
        "bytes",
        f"sliding-window layers keep their window: {d.kv_tokens_per_sequence:,.0f} tok a layer" if windows else "",
    )
    s.add("max_sequences", f"sequences of {inputs.seq_len:,} tok that fit", d.max_sequences)
    s.add("batch_fits", f"batch {inputs.batch} fits", decode_point(d, inputs.batch).fits)
    return s


def _roofline(d: Deployment) -> Section:
    gpu, point = d.inputs.gpu, decode_point(d, d.inputs.batch)
    ridge = f.ridge_point(gpu.peak_flops, gpu.bandwidth)
    s = Section("roofline", f"Roofline (decode, batch {point.batch})")
    s.add("ridge_flop_per_byte", "ridge point", ridge, "flop/byte", "peak flop/s / bandwidth")
    s.add("intensity_flop_per_byte", "decode intensity", point.intensity, "flop/byte")
    attainable = f.attainable_flops(point.intensity, gpu.peak_flops, gpu.bandwidth)
    s.add("attainable_flop_per_s", "attainable compute", attainable, "flop/s")
    s.add("fraction_of_peak", "fraction of peak", attainable / gpu.peak_flops, "%")
    s.add("bound", "bound by", point.bound)
    kv_per_seq = d.kv_bytes_per_sequence_per_gpu
    crossover = f.compute_bound_batch(
        d.flops_per_token / d.inputs.num_gpus, d.weights_read_per_gpu, kv_per_seq, ridge
    )
    s.add(
        "compute_bound_batch",
        "compute-bound from batch",
        None if crossover is None else math.ceil(crossover),
        note="never: KV reads grow as fast as flops" if crossover is None else "",
    )
    return s


def _decode(d: Deployment) -> Section:
    point = decode_point(d, d.inputs.batch)
    s = Section("decode", f"Decode floor (batch {point.batch}, {d.inputs.seq_len:,} tok context)")
    s.add("bytes_read_per_gpu", "bytes read per step per GPU", point.bytes_read, "bytes")
    s.add("memory_s", "memory time", point.memory_s, "s", "bytes / bandwidth")
    s.add("compute_s", "compute time", point.compute_s, "s", "flops / peak")
    if d.inputs.num_gpus > 1:
        s.add("comm_s", "TP all-reduce time", point.comm_s, "s", "latency + bandwidth terms")
    s.add("step_s", "step floor", point.step_s, "s")
    s.add("steps_per_s", "steps/s ceiling", 1 / point.step_s)
    s.add("tokens_per_s_per_user", "tok/s per user", 1 / point.step_s)
    s.add("tokens_per_s_per_gpu", "tok/s per GPU", point.batch / point.step_s / d.inputs.num_gpus)
    s.add("tokens_per_s_total", "tok/s total", point.batch / point.step_s)
    return s


def _decode_table(d: Deployment) -> Table:
    columns = [
        Column("batch", "batch"),
        Column("step_s", "step floor", "s"),
        Column("tokens_per_s_per_user", "tok/s/user"),
        Column("tokens_per_s_per_gpu", "tok/s/GPU"),
        Column("intensity_flop_per_byte", "flop/byte"),
        Column("bound", "bound"),
        Column("fits", "fits"),
    ]
    table = Table("decode_by_batch", "Decode ceiling by batch", columns)
    for batch in table_batches(d):
        point = decode_point(d, batch)
        table.records.append(
            {
                "batch": batch,
                "step_s": point.step_s,
                "tokens_per_s_per_user": 1 / point.step_s,
                "tokens_per_s_per_gpu": batch / point.step_s / d.inputs.num_gpus,
                "intensity_flop_per_byte": point.intensity,
                "bound": point.bound,
                "fits": point.fits,
            }
        )
    return table


def _prefill(d: Deployment) -> Section:
    inputs, model = d.inputs, d.inputs.model
    prompt = inputs.prompt_len
    if (arch := model.architecture) is not None:
        flops = f.prefill_flops(model.matmul_params, arch.num_layers, arch.q_dim, prompt)
    else:
        flops = f.prefill_flops(model.matmul_params, 0, 0, prompt)
    achieved = inputs.achieved_flops * inputs.num_gpus
    # Prefill also reads every weight once; for short prompts that, not the flops, is the floor.
    seconds = prefill_seconds(d, prompt)
    note = "given" if inputs.achieved_tflops is not None else "assumed: 50% of peak"
    s = Section("prefill", f"Prefill ({prompt:,} tok prompt)")
    s.add("flops", "flops", flops, "flop", "2 x params x tokens + causal attention")
    s.add("achieved_flop_per_s", "achieved compute (all GPUs)", achieved, "flop/s", note)
    s.add("prefill_s", "prefill time (~TTFT)", seconds, "s")
    s.add("prefill_tokens_per_s", "prefill tok/s", prompt / seconds)
    return s


def _tensor_parallel(d: Deployment) -> Section:
    inputs, gpu = d.inputs, d.inputs.gpu
    s = Section("tensor_parallel", f"Tensor-parallel communication ({inputs.num_gpus} GPUs, ring all-reduce)")
    payload = d.allreduce_wire_bytes_per_token / (2 * (inputs.num_gpus - 1) / inputs.num_gpus)
    s.add(
        "allreduce_payload_bytes_per_token",
        "all-reduced per token",
        payload,
        "bytes",
        "2 per layer x hidden x activation bytes",
    )
    s.add("wire_bytes_per_token_per_gpu", "sent per token per GPU", d.allreduce_wire_bytes_per_token, "bytes")
    link = gpu.interconnect_gbps
    s.add("interconnect_bytes_per_s", "link bandwidth (one way)", None if link is None else link * 1e9, "B/s")
    s.add("allreduces_per_step", "all-reduces per step", d.allreduces_per_step, note="2 per layer")
    hop = gpu.interconnect_latency_us
    s.add("hop_latency_s", "latency per ring hop", None if hop is None else hop * 1e-6, "s",
          "assumed" if gpu.source == "datasheet" else gpu.source)
    s.add("allreduce_latency_s", "latency per all-reduce",
          f.ring_allreduce_latency_s(inputs.num_gpus, gpu.interconnect_latency_s), "s", "2 (T - 1) hops")
    point = decode_point(d, inputs.batch)
    s.add("comm_latency_s_per_step", "latency per decode step", point.comm_latency_s, "s", "all-reduces x latency")
    s.add("comm_bandwidth_s_per_step", f"bandwidth per decode step (batch {inputs.batch})",
          point.comm_bandwidth_s if link else None, "s", "batch x bytes sent / link")
    s.add("comm_fraction_of_step", "share of the step floor", point.comm_s / point.step_s, "%")
    return s


# Tensor-parallel degrees the scaling table always shows; --num-gpus is added to them.
STANDARD_TP = (1, 2, 4, 8)


def _tp_table(d: Deployment) -> Table:
    """The same model, GPU and batch at each TP degree: when splitting pays, and what it costs per GPU."""
    inputs = d.inputs
    columns = [
        Column("num_gpus", "GPUs"),
        Column("weight_bytes_per_gpu", "weights/GPU", "bytes"),
        Column("max_sequences", "seqs fit"),
        Column("step_s", "step floor", "s"),
        Column("comm_fraction_of_step", "all-reduce", "%"),
        Column("tokens_per_s_per_user", "tok/s/user"),
        Column("tokens_per_s_per_gpu", "tok/s/GPU"),
        Column("fits", "fits"),
    ]
    table = Table("tp_scaling", f"By tensor-parallel degree (batch {inputs.batch})", columns)
    for tp in sorted({*STANDARD_TP, inputs.num_gpus}):
        split = derive(replace(inputs, num_gpus=tp))
        point = decode_point(split, inputs.batch)
        table.records.append(
            {
                "num_gpus": tp,
                "weight_bytes_per_gpu": split.weight_bytes_per_gpu,
                "max_sequences": split.max_sequences,
                "step_s": point.step_s,
                "comm_fraction_of_step": point.comm_s / point.step_s,
                "tokens_per_s_per_user": 1 / point.step_s,
                "tokens_per_s_per_gpu": inputs.batch / point.step_s / tp,
                "fits": split.weights_fit and point.fits is not False,
            }
        )
    return table


def _throughput(d: Deployment) -> tuple[float, str]:
    """Tokens/s of the whole deployment: as observed if given, else the decode ceiling at --batch."""
    if d.inputs.tokens_per_s is not None:
        return d.inputs.tokens_per_s, "given"
    point = decode_point(d, d.inputs.batch)
    return point.batch / point.step_s, f"decode ceiling at batch {point.batch}"


def _cost(d: Deployment, price_per_gpu_hour: float) -> Section:
    inputs = d.inputs
    tokens_per_s, source = _throughput(d)
    price = price_per_gpu_hour * inputs.num_gpus
    s = Section("cost", "Cost")
    s.add("price_per_gpu_hour", "$ per GPU-hour", price_per_gpu_hour, "$")
    s.add("price_per_hour", f"$ per hour ({inputs.num_gpus} GPUs)", price, "$")
    s.add("tokens_per_s", "throughput (tok/s)", tokens_per_s, note=source)
    s.add("dollars_per_million_tokens", "$ per M tokens", f.cost_per_million_tokens(price, tokens_per_s), "$")
    return s


def _utilization(d: Deployment, tokens_per_s: float) -> Section:
    inputs, gpu = d.inputs, d.inputs.gpu
    point = decode_point(d, inputs.batch)
    ceiling = point.batch / point.step_s
    steps_per_s = tokens_per_s / inputs.batch
    s = Section("utilization", f"Utilization (observed {tokens_per_s:,g} tok/s at batch {inputs.batch})")
    s.add("tokens_per_s_per_gpu", "tok/s per GPU", tokens_per_s / inputs.num_gpus)
    above = tokens_per_s > ceiling * 1.001
    s.add(
        "fraction_of_ceiling",
        "of the decode ceiling",
        tokens_per_s / ceiling,
        "%",
        "above the floor: check --batch and --seq-len" if above else "",
    )
    mfu = f.model_flops_utilization(tokens_per_s, d.flops_per_token, gpu.peak_flops * inputs.num_gpus)
    s.add("mfu", "MFU", mfu, "%", "flops done / peak")
    s.add("mbu", "MBU", steps_per_s * point.bytes_read / gpu.bandwidth, "%", "bytes read / bandwidth")
    return s


def _speculative(d: Deployment, alpha: float) -> Section:
    inputs = d.inputs
    k, cost = inputs.spec_k, inputs.spec_draft_cost
    speedup = f.spec_speedup(alpha, k, cost)
    per_user = 1 / decode_point(d, inputs.batch).step_s
    s = Section("speculative", f"Speculative decoding (alpha {alpha:g}, k {k}, draft cost {cost:g})")
    s.add(
        "expected_tokens_per_step",
        "expected tokens per step",
        f.spec_expected_tokens(alpha, k),
        note="(1 - alpha^(k+1)) / (1 - alpha)",
    )
    s.add("step_cost", "step cost (target steps)", 1 + k * cost, note="1 + k x draft cost")
    s.add("speedup", "speed-up", speedup, "x")
    s.add("tokens_per_s_per_user", "tok/s per user", per_user * speedup)
    best = f.best_spec_k(alpha, cost)
    s.add("best_k", "best k", best, note=f"speed-up {f.spec_speedup(alpha, best, cost):.3f}x")
    return s


def _prefix_cache(d: Deployment, prefix: int) -> Section:
    inputs = d.inputs
    prompt, block = inputs.prompt_len, inputs.block_size
    reused = f.prefix_reusable_tokens(prompt, prefix, block)
    s = Section("prefix_cache", f"Prefix cache ({prompt:,} tok prompt, {prefix:,} shared, blocks of {block})")
    s.add("reusable_tokens", "reusable tokens", reused, note="whole blocks; the last token is recomputed")
    s.add("reused_blocks", "reused blocks", reused // block)
    s.add("computed_tokens", "tokens still computed", prompt - reused)
    s.add("reused_fraction", "prefill saved", reused / prompt, "%")
    return s


def _chunked_prefill(d: Deployment, budget: int) -> Section:
    inputs = d.inputs
    decodes, prompt = inputs.running_decodes, inputs.prompt_len
    s = Section("chunked_prefill", f"Chunked prefill (budget {budget:,}, {decodes} running decodes)")
    s.add("chunk_tokens", "prompt tokens per step", max(0, budget - decodes), note="budget - decodes")
    s.add(
        "steps",
        f"steps for {prompt:,} tok prompt",
        f.chunked_prefill_steps(prompt, budget, decodes),
        note="n/a: decodes use the whole budget" if budget <= decodes else "",
    )
    return s


def _warnings(d: Deployment) -> list[str]:
    inputs, gpu = d.inputs, d.inputs.gpu
    warnings = []
    if not d.weights_fit:
        warnings.append(
            f"DOES NOT FIT: weights need {d.weight_bytes_per_gpu / 1e9:,.1f} GB per GPU but "
            f"{inputs.num_gpus} x {gpu.name} leaves {d.capacity_per_gpu / 1e9:,.1f} GB usable each "
            f"({gpu.memory_gb:g} GB x {inputs.mem_util:g}); figures below assume it did"
        )
    elif d.max_sequences is not None and not decode_point(d, inputs.batch).fits:
        warnings.append(
            f"batch {inputs.batch} at {inputs.seq_len:,} tokens does not fit: at most {d.max_sequences} "
            "sequences; figures below assume it did"
        )
    if not inputs.model.architecture is not None:
        warnings.append(
            "parameter count only: KV cache, attention and TP figures need a preset or config.json"
        )
    return warnings


def build_report(inputs: CalcInputs) -> Report:
    inputs.validate()
    d = derive(inputs)
    parts: list[Section | Table] = [
        _setup(d),
        *([] if inputs.model.experts is None else [experts_section(d, inputs.model.experts)]),
        _memory(d),
        _roofline(d),
        _decode(d),
        _decode_table(d),
        _prefill(d),
    ]
    if inputs.model.architecture is not None:
        if inputs.num_gpus > 1:
            parts.append(_tensor_parallel(d))
        parts.append(_tp_table(d))
    if inputs.price_per_hour is not None:
        parts.append(_cost(d, inputs.price_per_hour))
    if inputs.tokens_per_s is not None:
        parts.append(_utilization(d, inputs.tokens_per_s))
    if inputs.spec_alpha is not None:
        parts.append(_speculative(d, inputs.spec_alpha))
    if inputs.prefix_len is not None:
        parts.append(_prefix_cache(d, inputs.prefix_len))
    if inputs.token_budget is not None:
        parts.append(_chunked_prefill(d, inputs.token_budget))
    if inputs.disagg:
        if d.kv_bytes_per_token is None:
            raise ValueError("--disagg needs the model's KV shape: a preset or a config.json, not a bare count")
        parts.append(disagg_section(d, inputs.kv_link_gbps, inputs.output_len, inputs.request_rate))
    fits = d.weights_fit and decode_point(d, inputs.batch).fits is not False
    return Report(parts=parts, warnings=_warnings(d), fits=fits)
