"""Pre-quantized 4-bit checkpoints (GPTQ and AWQ) unpacked into Int4Weights at load.

Both formats store a linear layer as int32 words of eight 4-bit codes plus per-group fp16 scales and packed
zero points; they differ in which dimension is packed and in what order:

- GPTQ (AutoGPTQ, GPTQModel, optimum): `qweight` [in // 8, out] packs eight consecutive INPUT rows per word,
  nibble j (bits 4j..4j+3) holding row 8r + j; `qzeros` [groups, out // 8] packs eight consecutive output
  columns the same way; `g_idx` [in] names each input column's group (act-order shuffles it). The classic
  format ("gptq", v1) stores every zero point minus one; "gptq_v2" stores it as is.
- AWQ GEMM (AutoAWQ): `qweight` [in, out // 8] and `qzeros` [groups, out // 8] both pack eight output columns
  per word, interleaved: nibble k of a word holds column AWQ_PACK_ORDER[k] of its eight-column block.

Either way W[o, i] = (code - zero) * scale, zero being the true zero point (v1: stored + 1).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from pagoda.model.int4_weights import Int4Weights
from pagoda.model_dir import ModelLoadError

SUPPORTED = "pagoda loads 4-bit GPTQ (checkpoint_format gptq or gptq_v2) and 4-bit AWQ GEMM checkpoints"
CODES_PER_WORD = 8
# AWQ GEMM: nibble k of a word holds column AWQ_PACK_ORDER[k] of its block, so column c is nibble AWQ_UNPACK_ORDER[c].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
GPTQ_PARTS = frozenset({"qweight", "qzeros", "scales", "g_idx"})
AWQ_PARTS = frozenset({"qweight", "qzeros", "scales"})
OPTIONAL_PARTS = frozenset({"g_idx"})  # older GPTQ checkpoints without act-order leave it out


@dataclass(frozen=True)
class PrequantizedFormat:
    """How a checkpoint's quantized layers are laid out; the same for every layer of the checkpoint."""

    method: Literal["gptq", "awq"]
    bits: int = 4
    group_size: int = 128  # -1 (GPTQ): one group spans the whole input; see group_size_for
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: Literal["gptq", "gptq_v2"] | None = None  # GPTQ only; None for AWQ
    awq_version: Literal["gemm"] | None = None  # AWQ only; None for GPTQ
    lm_head: bool = False  # whether the checkpoint says lm_head is quantized too

    def group_size_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    @property
    def zero_offset(self) -> float:
        """Added to every stored zero point: GPTQ v1 stored zero - 1 (and an asymmetric 0 wraps to 15 -> 16)."""
        return 1.0 if self.checkpoint_format == "gptq" else 0.0


def read_prequantized_format(hf_config: dict[str, Any], path: str | Path | None = None) -> PrequantizedFormat | None:
    """The checkpoint's PrequantizedFormat, or None when it is not pre-quantized.

    `hf_config` is config.json's content; `path` is the checkpoint directory (or its config.json), where older
    AutoGPTQ checkpoints keep the settings in quantize_config.json instead of config.json.
    """
    source = "config.json quantization_config"
    qc = hf_config.get("quantization_config")
    default_method: str | None = None
    if qc is None and path is not None:
        directory = Path(path).parent if Path(path).is_file() else Path(path)
        legacy = directory / "quantize_config.json"
        if legacy.is_file():
            source, default_method = str(legacy), "gptq"  # AutoGPTQ wrote no quant_method there
            try:
                qc = json.loads(legacy.read_text())
            except json.JSONDecodeError as exc:
                raise ModelLoadError(f"{legacy}: not valid JSON ({exc})") from exc
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{source}: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method", qc.get("method", default_method))
    if method is None:
        raise ModelLoadError(f"{source}: no quant_method; {SUPPORTED}")
    method = str(method).lower()
    if method == "gptq":
        return _gptq_format(qc, source)
    if method == "awq":
        return _awq_format(qc, source)
    raise _unsupported(source, "quant_method", method, "only 'gptq' and 'awq'")


def _bits_and_group_size(qc: dict[str, Any], source: str) -> tuple[int, int]:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _unsupported(source, "bits", bits, "only 4-bit weights")
    group_size = qc.get("group_size", qc.get("q_group_size", -1))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size > 0):
        raise _unsupported(source, "group_size", group_size, "a positive integer, or -1 for one group per row")
    return bits, group_size


def _unsupported(source: str, field: str, value: object, detail: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: {field}={value!r} is not supported ({detail}); {SUPPORTED}")


def _reject_if_set(qc: dict[str, Any], source: str, field: str, why: str) -> None:
    value = qc.get(field)
    if value:
        raise _unsupported(source, field, value, why)


def _gptq_format(qc: dict[str, Any], source: str) -> PrequantizedFormat:
    bits, group_size = _bits_and_group_size(qc, source)
    checkpoint_format = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise _unsupported(source, "checkpoint_format", checkpoint_format, "GPTQ must be 'gptq' or 'gptq_v2'")
    pack_dtype = qc.get("pack_dtype", "int32")
    if str(pack_dtype).removeprefix("torch.") != "int32":
        raise _unsupported(source, "pack_dtype", pack_dtype, "GPTQ words must be int32")
    # static_groups needs nothing special: the groups are fixed before act-order reorders the columns, and
    # g_idx still names each column's group.
    _reject_if_set(qc, source, "is_marlin_format", "a Marlin repack, not the GPTQ layout")
    _reject_if_set(qc, source, "dynamic", "per-module bits or group sizes")
    _reject_if_set(qc, source, "rotation", "weights stored in a rotated basis")
    return PrequantizedFormat(
        method="gptq",
        bits=bits,
        group_size=group_size,
        sym=bool(qc.get("sym", True)),
        desc_act=bool(qc.get("desc_act", False)),
        checkpoint_format="gptq_v2" if checkpoint_format == "gptq_v2" else "gptq",
        lm_head=bool(qc.get("lm_head", False)),
    )


def _awq_format(qc: dict[str, Any], source: str) -> PrequantizedFormat:
    bits, group_size = _bits_and_group_size(qc, source)
    version = str(qc.get("version", qc.get("format", "gemm"))).lower()
    if version != "gemm":
        raise _unsupported(source, "version", version, "AWQ must be 'gemm'")
    zero_point = qc.get("zero_point", not qc.get("sym", False))
    if not zero_point:
        raise _unsupported(source, "zero_point", zero_point, "AWQ GEMM checkpoints store zero points")
    return PrequantizedFormat(method="awq", bits=bits, group_size=group_size, sym=False, awq_version="gemm")


def _unpack_words(words: torch.Tensor, nibble_order: Sequence[int] = range(CODES_PER_WORD)) -> torch.Tensor:
    """int32 [rows, n] -> uint8 [rows, 8n] codes: code 8w + k is nibble nibble_order[k] (bits 4j..4j+3 for
    nibble j) of word w. One nibble at a time keeps the int32 temporaries the size of the packed words."""
    # The arithmetic shift drags the sign bit of a word whose top nibble is >= 8; the mask drops it again.
    nibbles = [((words >> (4 * j)) & 0xF).to(torch.uint8) for j in nibble_order]
    return torch.stack(nibbles, dim=-1).reshape(words.shape[0], -1)


def _check_int32(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.int32:
        raise ModelLoadError(f"{name}: expected int32 words of eight 4-bit codes, got {tensor.dtype}")


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ModelLoadError(f"{name}: shape {tuple(tensor.shape)}, expected {expected}")


def _trivial_or_none(g_idx: torch.Tensor | None, in_features: int, group_size: int) -> torch.Tensor | None:
    """g_idx as int64, or None when it is the plain i // group_size (so the fast contiguous-group path applies)."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    return None if torch.equal(g_idx, torch.arange(in_features) // group_size) else g_idx


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    fmt: PrequantizedFormat,
) -> Int4Weights:
    """One GPTQ linear layer's tensors -> Int4Weights (zeros always given: they are what the file says)."""
    _check_int32("qweight", qweight)
    _check_int32("qzeros", qzeros)
    in_features, out_features = qweight.shape[0] * CODES_PER_WORD, qweight.shape[1]
    if out_features % CODES_PER_WORD:
        raise ModelLoadError(f"qweight: {out_features} output features, not a multiple of {CODES_PER_WORD}")
    group_size = fmt.group_size_for(in_features)
    num_groups = -(-in_features // group_size)
    _check_shape("scales", scales, (num_groups, out_features))
    _check_shape("qzeros", qzeros, (num_groups, out_features // CODES_PER_WORD))
    if g_idx is not None:
        _check_shape("g_idx", g_idx, (in_features,))
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
            raise ModelLoadError(f"g_idx: group indices outside 0..{num_groups - 1}")

    zeros = _unpack_words(qzeros).float() + fmt.zero_offset  # float: a v1 zero point may read back as 16
    return Int4Weights(
        codes=_unpack_words(qweight.T),  # [out, in]: input row 8r + j is nibble j of word r
        scales=scales.float().T.contiguous(),
        zeros=zeros.T.contiguous(),
        group_size=group_size,
        g_idx=_trivial_or_none(g_idx, in_features, group_size),
    )


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, fmt: PrequantizedFormat
) -> Int4Weights:
    """One AWQ GEMM linear layer's tensors -> Int4Weights."""
    _check_int32("qweight", qweight)
    _check_int32("qzeros", qzeros)
    in_features, out_features = qweight.shape[0], qweight.shape[1] * CODES_PER_WORD
    group_size = fmt.group_size_for(in_features)
    num_groups = -(-in_features // group_size)
    _check_shape("scales", scales, (num_groups, out_features))
    _check_shape("qzeros", qzeros, (num_groups, out_features // CODES_PER_WORD))
    return Int4Weights(
        codes=_unpack_words(qweight, AWQ_UNPACK_ORDER).T.contiguous(),
        scales=scales.float().T.contiguous(),
        zeros=_unpack_words(qzeros, AWQ_UNPACK_ORDER).float().T.contiguous(),
        group_size=group_size,
    )


def _unpack_layer(prefix: str, parts: dict[str, torch.Tensor], fmt: PrequantizedFormat) -> Int4Weights:
    try:
        if fmt.method == "gptq":
            return unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), fmt)
        return unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"], fmt)
    except ValueError as exc:  # ModelLoadError is a ValueError: name the layer it came from
        raise ModelLoadError(f"{prefix}: {exc}") from exc


def iter_prequantized(
    weights: Iterable[tuple[str, torch.Tensor]], fmt: PrequantizedFormat
) -> Iterator[tuple[str, torch.Tensor | Int4Weights]]:
    """A checkpoint's (name, tensor) stream with each quantized layer's parts replaced by one
    (`<prefix>.weight`, Int4Weights), yielded as soon as all its parts have been seen (shards may interleave
    layers in any order). Everything else (norms, embeddings, biases, unquantized layers) passes through
    untouched. A GPTQ layer without g_idx is only known to be complete at the end of the stream.
    """
    expected = GPTQ_PARTS if fmt.method == "gptq" else AWQ_PARTS
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in expected:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        if part in parts:
            raise ModelLoadError(f"{name}: appears twice in the checkpoint")
        parts[part] = tensor
        if parts.keys() == expected:
            yield f"{prefix}.weight", _unpack_layer(prefix, pending.pop(prefix), fmt)
    incomplete = {p: sorted(expected - parts.keys()) for p, parts in pending.items()}
    incomplete = {p: missing for p, missing in incomplete.items() if not set(missing) <= OPTIONAL_PARTS}
    if incomplete:
        listed = "; ".join(f"{p}: missing {', '.join(m)}" for p, m in sorted(incomplete.items())[:5])
        more = f" (and {len(incomplete) - 5} more layers)" if len(incomplete) > 5 else ""
        raise ModelLoadError(f"quantized layers with missing tensors: {listed}{more}")
    for prefix, parts in pending.items():
        yield f"{prefix}.weight", _unpack_layer(prefix, parts, fmt)
