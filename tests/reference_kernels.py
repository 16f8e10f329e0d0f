"""A torch stand-in for pagoda's compiled CPU kernels (kernels/cpu_module.cpp), for hosts that cannot run them.

Each op computes what the torch path computes for it, and every call from Python is logged, so the
kernel wiring (which module calls which kernel with which tensors, the native decode stack's layout)
runs and is checked on any CPU. `DecodeStack` follows kernels/cpu_decode.cpp step for step, calling the
same ops unlogged, as the C++ stack calls them without going through Python.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagoda.model.kv_cache import LayerKV

LinearSpec = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
KVSpec = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype))


def _gemv_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, qweight.to(x.dtype) * scale[:, None].to(x.dtype))


def int8_codes_dequantized(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the integer matmuls see it: quantized per `group` columns to int8 (scale max|x| / 127, round to
    nearest) and back, in fp32."""
    groups = x.float().view(x.shape[0], -1, group)
    x_scale = groups.abs().amax(-1, keepdim=True) / 127
    return torch.where(x_scale > 0, torch.round(groups / x_scale).clamp(-127, 127) * x_scale, 0.0).view(x.shape)


def reference_matmul_int4(x: torch.Tensor, packed: torch.Tensor, group: int,
                          scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """What kernels/cpu_int4.cpp computes: W dequantized from pagoda's int4 layout times x's int8 codes."""
    from pagoda.model.int4 import unpack_int4

    rows, cols = packed.shape[0], packed.shape[1] * 2
    # the pairs block-major, [rows / 32, groups, 32, 2]: pair (row, g) at [row // 32, g, row % 32]
    scale, offset = scales_and_zeros.float().permute(0, 2, 1, 3).reshape(rows, -1, 2).unbind(-1)  # [rows, groups]
    codes = unpack_int4(packed, rows, cols).float().view(rows, -1, group)
    weight = ((codes - 8) * scale[..., None] + offset[..., None]).view(rows, cols)
    return (int8_codes_dequantized(x, group) @ weight.t()).to(x.dtype)


def reference_matmul_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What kernels/cpu_int8.cpp computes: x's int8 codes per 32 columns times the int8 weights, times each
    channel's scale."""
    return ((int8_codes_dequantized(x, 32) @ qweight.float().t()) * scale).to(x.dtype)


def _add_rms_norm_(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if delta is not None:
        x.add_(delta)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def _rotary_write_kv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    rotated_heads = num_heads + k_cache.shape[1]
    x = qkv[:, :rotated_heads]
    half = x.shape[-1] // 2
    qkv[:, :rotated_heads] = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    kv = LayerKV(k_cache, v_cache, k_scale, v_scale)
    kv.write(slot_mapping, qkv[:, num_heads:rotated_heads], qkv[:, rotated_heads:])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float, softcap: float = 0.0) -> torch.Tensor:
    """q [B, heads, Q, D] against keys/values [B, L, kv_heads, D] under mask [B, 1, Q, L], in fp32; scores capped
    at softcap (0: not)."""
    batch, heads, queries, head_dim = q.shape
    kv_heads = keys.shape[2]
    query = q.float().reshape(batch, kv_heads, heads // kv_heads * queries, head_dim)
    scores = torch.matmul(query, keys.float().permute(0, 2, 3, 1)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(batch, heads, queries, -1).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).reshape(batch, kv_heads, heads // kv_heads * queries, -1)
    return torch.matmul(probs, values.float().transpose(1, 2)).reshape(batch, heads, queries, head_dim).to(q.dtype)


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    mask = key_pos <= query_pos
    return mask & (query_pos - key_pos < window) if window else mask


def _paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_slots: torch.Tensor,
                            seq_lens: torch.Tensor, window: int, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    mask = _window_mask(seq_lens[:, None] - 1, torch.arange(key_slots.shape[1])[None], window)
    keys, values = LayerKV(k_cache, v_cache, k_scale, v_scale).gather(key_slots, q.dtype)
    attended = _attend(q[:, :, None], keys, values, mask[:, None, None], scale, softcap)
    return attended[:, :, 0]


def _paged_prefill_attention_(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              key_slots: torch.Tensor, window: int, scale: float, out: torch.Tensor) -> None:
    seq_len = key_slots.numel()
    key_pos = torch.arange(seq_len)
    mask = _window_mask(key_pos[seq_len - q.shape[0] :, None], key_pos[None], window)
    attended = _attend(q.transpose(0, 1)[None], k_cache[key_slots][None], v_cache[key_slots][None],
                       mask[None, None], scale)
    out.copy_(attended[0].transpose(0, 1))


class _Linear:
    """As cpu_decode.cpp's Linear: the kernel the weight's dtype (and scale) call for, then the bias."""

    def __init__(self, spec: LinearSpec) -> None:
        self.weight, self.scale, self.bias = spec

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.uint8:
            assert self.scale is not None
            y = reference_matmul_int4(x, self.weight, self.weight.shape[1] * 2 // self.scale.shape[1], self.scale)
        else:
            y = _gemv(x, self.weight) if self.scale is None else _gemv_int8(x, self.weight, self.scale)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class ReferenceDecodeStack:
    """kernels/cpu_decode.cpp's DecodeStack, op for op."""

    def __init__(self, log: list[tuple[str, tuple[Any, ...]]], heads: int, kv_heads: int, head_dim: int, eps: float,
                 scale: float, softcap: float, final_norm: torch.Tensor, placement: str, unit_offset: bool,
                 gelu: bool) -> None:
        self.log = log
        self.heads, self.kv_heads, self.head_dim, self.eps, self.scale = heads, kv_heads, head_dim, eps, scale
        self.softcap = softcap
        self.final_norm, self.placement, self.gelu = final_norm, placement, gelu
        assert placement in ("pre", "post", "sandwich")
        self.norm_scale = "in_fp32" if unit_offset or placement == "post" else "fused"
        self.layers: list[tuple[Any, ...]] = []

    def add_layer(self, input_norm: torch.Tensor | None, post_norm: torch.Tensor, pre_ff_norm: torch.Tensor | None,
                  post_ff_norm: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  qkv: LinearSpec, o: LinearSpec, gate_up: LinearSpec, down: LinearSpec, window: int,
                  sliding_rope: bool) -> None:
        self.log.append(("DecodeStack.add_layer", (input_norm, post_norm, pre_ff_norm, post_ff_norm, q_norm, k_norm,
                                                   qkv, o, gate_up, down, window, sliding_rope)))
        pre, post = self.placement == "pre", self.placement == "post"
        assert (input_norm is None) == post and (pre_ff_norm is not None) == (self.placement == "sandwich")
        assert (post_ff_norm is None) == pre and (q_norm is None) == (k_norm is None)
        assert not post or q_norm is not None
        self.layers.append((input_norm, post_norm, pre_ff_norm, post_ff_norm, q_norm, k_norm,
                            *map(_Linear, (qkv, o, gate_up, down)), window, int(sliding_rope)))

    def _norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        if self.norm_scale == "fused" or x.dtype == torch.float32:
            return _add_rms_norm_(x, delta, weight, self.eps)
        if delta is not None:
            x.add_(delta)
        return (weight * F.rms_norm(x.float(), weight.shape, eps=self.eps)).to(x.dtype)

    def _norm_heads_(self, heads: torch.Tensor, weight: torch.Tensor) -> None:
        fused = self.norm_scale == "fused"
        if heads.is_contiguous() and (fused or heads.dtype == torch.float32):
            normed = _add_rms_norm_(heads, None, weight, self.eps)
        elif fused:
            normed = weight * F.rms_norm(heads.float(), weight.shape, eps=self.eps).to(heads.dtype)
        else:
            normed = (weight * F.rms_norm(heads.float(), weight.shape, eps=self.eps)).to(heads.dtype)
        heads.copy_(normed)

    def _mlp(self, gate_up_proj: _Linear, down_proj: _Linear, x: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.split(gate_up.shape[1] // 2, 1)
            return down_proj(F.gelu(gate, approximate="tanh") * up)
        return down_proj(_silu_mul(gate_up))

    def forward(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]], kv_caches: list[KVSpec],
                groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], layer_groups: list[int]) -> torch.Tensor:
        self.log.append(("DecodeStack.forward", (x, ropes, kv_caches, groups, layer_groups)))
        assert len(kv_caches) == len(self.layers) == len(layer_groups), "one KV cache and group per layer"
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        post = self.placement == "post"
        delta = None
        for (input_norm, post_norm, pre_ff_norm, post_ff_norm, q_norm, k_norm, qkv_proj, o_proj, gate_up_proj,
             down_proj, window, rope), (k_cache, v_cache, k_scale, v_scale), group in zip(
                self.layers, kv_caches, layer_groups):
            slot_mapping, key_slots, seq_lens = groups[group]
            cos, sin = ropes[rope]
            if post:
                if delta is not None:
                    x.add_(delta)
                qkv = qkv_proj(x)
                q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
                qkv[:, :q_end] = self._norm(qkv[:, :q_end].contiguous(), None, q_norm)
                qkv[:, q_end:k_end] = self._norm(qkv[:, q_end:k_end].contiguous(), None, k_norm)
                qkv = qkv.view(-1, heads + 2 * kv_heads, head_dim)
            else:
                qkv = qkv_proj(self._norm(x, delta, input_norm)).view(-1, heads + 2 * kv_heads, head_dim)
                if q_norm is not None:
                    self._norm_heads_(qkv[:, :heads], q_norm)
                    self._norm_heads_(qkv[:, heads : heads + kv_heads], k_norm)
            _rotary_write_kv_(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, k_scale, v_scale)
            attended = _paged_decode_attention(qkv[:, :heads], k_cache, v_cache, key_slots, seq_lens, window,
                                               self.scale, k_scale, v_scale, self.softcap)
            attended = o_proj(attended.reshape(-1, heads * head_dim))
            if self.placement == "pre":
                delta = self._mlp(gate_up_proj, down_proj, self._norm(x, attended, post_norm))
            elif post:
                x.add_(self._norm(attended, None, post_norm))
                delta = self._norm(self._mlp(gate_up_proj, down_proj, x), None, post_ff_norm)
            else:
                mlp_in = self._norm(x, self._norm(attended, None, post_norm), pre_ff_norm)
                delta = self._norm(self._mlp(gate_up_proj, down_proj, mlp_in), None, post_ff_norm)
        return self._norm(x, delta, self.final_norm)


class ReferenceKernels:
    """Stands in for the compiled module: the same op names and arguments, each call appended to `log`."""

    matmul_int4_max_rows = 512  # the AVX2 module's, which it stands in for where the engine runs without AVX-512
    gemv_max_rows = 64  # the full set's, as `target`
    prefill_attention_amx = False
    target = "avx512"  # the full set's interface, prefill attention included

    def __init__(self) -> None:
        self.log: list[tuple[str, tuple[Any, ...]]] = []

    def _logged(self, name: str, args: tuple[Any, ...]) -> None:
        self.log.append((name, args))

    def called(self, name: str) -> int:
        return sum(entry[0] == name for entry in self.log)

    def gemv_fp32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self._logged("gemv_fp32", (x, weight))
        return _gemv(x, weight)

    def gemv_bf16(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self._logged("gemv_bf16", (x, weight))
        return _gemv(x, weight)

    def gemv_int8(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self._logged("gemv_int8", (x, qweight, scale))
        return _gemv_int8(x, qweight, scale)

    def matmul_int8(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self._logged("matmul_int8", (x, qweight, scale))
        return reference_matmul_int8(x, qweight, scale)

    def matmul_int4(self, x: torch.Tensor, packed: torch.Tensor, group: int,
                  scales_and_zeros: torch.Tensor) -> torch.Tensor:
        self._logged("matmul_int4", (x, packed, group, scales_and_zeros))
        return reference_matmul_int4(x, packed, group, scales_and_zeros)

    def add_rms_norm_(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        self._logged("add_rms_norm_", (x, delta, weight, eps))
        return _add_rms_norm_(x, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        self._logged("silu_mul", (gate_up,))
        return _silu_mul(gate_up)

    def rotary_write_kv_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        self._logged("rotary_write_kv_", (qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, k_scale,
                                          v_scale))
        _rotary_write_kv_(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, k_scale, v_scale)

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               key_slots: torch.Tensor, seq_lens: torch.Tensor, window: int, scale: float,
                               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                               softcap: float = 0.0) -> torch.Tensor:
        self._logged("paged_decode_attention", (q, k_cache, v_cache, key_slots, seq_lens, window, scale, k_scale,
                                                v_scale, softcap))
        return _paged_decode_attention(q, k_cache, v_cache, key_slots, seq_lens, window, scale, k_scale, v_scale,
                                       softcap)

    def paged_prefill_attention_(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 key_slots: torch.Tensor, window: int, scale: float, out: torch.Tensor,
                                 use_amx: bool = True) -> None:
        self._logged("paged_prefill_attention_", (q, k_cache, v_cache, key_slots, window, scale, out))
        _paged_prefill_attention_(q, k_cache, v_cache, key_slots, window, scale, out)

    def DecodeStack(self, heads: int, kv_heads: int, head_dim: int, eps: float, scale: float, softcap: float,
                    final_norm: torch.Tensor, placement: str, unit_offset: bool, gelu: bool) -> ReferenceDecodeStack:
        self._logged("DecodeStack", (heads, kv_heads, head_dim, eps, scale, softcap, final_norm, placement,
                                     unit_offset, gelu))
        return ReferenceDecodeStack(self.log, heads, kv_heads, head_dim, eps, scale, softcap, final_norm, placement,
                                    unit_offset, gelu)
