"""GPTQ and AWQ checkpoints unpack into Int4Weights exactly as the formats' reference implementations read
them; every unsupported variant fails at config time, naming the field and value.

The fixtures in tests/data/int4_golden were packed and dequantized by AutoAWQ and AutoGPTQ themselves
(scripts/make_int4_golden.py), so the expected weights do not come from a packer written to mirror the
unpacker. Dequantization is fp32 from fp16 scales: (code - zero) * scale is exact there (a 5-bit integer
times an 11-bit significand), so results are compared for equality.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagoda.model.int4_weights import Int4Weights
from pagoda.model.prequantized import (
    AWQ_PACK_ORDER,
    AWQ_UNPACK_ORDER,
    PrequantizedFormat,
    iter_prequantized,
    read_prequantized_format,
    unpack_awq,
    unpack_gptq,
)
from pagoda.model_dir import ModelLoadError

GOLDEN = Path(__file__).parent / "data" / "int4_golden"
GOLDEN_FILES = sorted(GOLDEN.glob("*.safetensors"))
AWQ = PrequantizedFormat(method="awq", group_size=32, sym=False, awq_version="gemm")
GPTQ_V1 = PrequantizedFormat(method="gptq", group_size=32, checkpoint_format="gptq")
GPTQ_V2 = PrequantizedFormat(method="gptq", group_size=32, checkpoint_format="gptq_v2")


def load_golden(name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(GOLDEN / f"{name}.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 (safe_open is no dict)


def unpack_golden(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Int4Weights:
    group_size = int(meta["group_size"])
    if meta["method"] == "awq":
        fmt = PrequantizedFormat(method="awq", group_size=group_size, sym=False, awq_version="gemm")
        return unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], fmt)
    checkpoint_format = "gptq_v2" if meta["checkpoint_format"] == "gptq_v2" else "gptq"
    fmt = PrequantizedFormat(method="gptq", group_size=group_size, checkpoint_format=checkpoint_format)
    return unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], fmt)


# --------------------------------------------------------------------------------------------------
# Unpacking against the reference implementations' own packed layers and dequantized weights
# --------------------------------------------------------------------------------------------------


def test_golden_fixtures_are_present() -> None:
    names = {p.stem for p in GOLDEN_FILES}
    assert {"awq_in64_out32_g32", "gptq_v1_actorder_in64_out32_g16", "gptq_v1_zero0_in64_out32_g32"} <= names
    assert any(n.startswith("gptq_v2") for n in names)


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_unpacked_weights_equal_the_reference_dequantization(path: Path) -> None:
    tensors, meta = load_golden(path.stem)
    weights = unpack_golden(tensors, meta)
    out_features, in_features = tensors["expected"].shape
    assert weights.codes.dtype == torch.uint8 and weights.codes.shape == (out_features, in_features)
    assert weights.scales.dtype == torch.float32 and weights.zeros is not None
    assert weights.zeros.dtype == torch.float32 and weights.zeros.shape == weights.scales.shape
    assert torch.equal(weights.dequantize(), tensors["expected"])


@pytest.mark.parametrize("path", [p for p in GOLDEN_FILES if "zero0" not in p.stem], ids=lambda p: p.stem)
def test_unpacked_codes_are_the_codes_the_layer_was_built_from(path: Path) -> None:
    tensors, meta = load_golden(path.stem)
    assert torch.equal(unpack_golden(tensors, meta).codes, tensors["codes"])


def test_gptq_v1_zero_point_of_zero_reads_back_as_sixteen() -> None:
    """v1 stores zero - 1; a zero point of 0 is stored as 15 and every v1 reader adds 1 back without masking.
    AutoGPTQ's packer ORs the sign-extended -1 into the higher nibbles of the same word too (outputs 2..7)."""
    tensors, meta = load_golden("gptq_v1_zero0_in64_out32_g32")
    weights = unpack_golden(tensors, meta)
    assert weights.zeros is not None
    assert weights.zeros[2:8, 0].tolist() == [16.0] * 6
    assert torch.equal(weights.dequantize(), tensors["expected"])


def test_gptq_v2_differs_from_v1_only_by_the_zero_offset() -> None:
    v1_tensors, v1_meta = load_golden("gptq_v1_asym_in64_out32_g32")
    v2_tensors, _ = load_golden("gptq_v2_asym_in64_out32_g32")
    assert not torch.equal(v1_tensors["qzeros"], v2_tensors["qzeros"])
    v1 = unpack_golden(v1_tensors, v1_meta)
    v2 = unpack_gptq(v2_tensors["qweight"], v2_tensors["qzeros"], v2_tensors["scales"], v2_tensors["g_idx"], GPTQ_V2)
    assert v1.zeros is not None and v2.zeros is not None
    assert torch.equal(v1.zeros, v2.zeros)
    misread = unpack_gptq(v2_tensors["qweight"], v2_tensors["qzeros"], v2_tensors["scales"], None, GPTQ_V1)
    assert not torch.equal(misread.dequantize(), v2_tensors["expected"])


def test_act_order_keeps_the_checkpoint_g_idx() -> None:
    tensors, meta = load_golden("gptq_v1_actorder_in64_out32_g16")
    weights = unpack_golden(tensors, meta)
    assert weights.g_idx is not None and weights.g_idx.dtype == torch.int64
    assert torch.equal(weights.g_idx, tensors["g_idx"].long())
    assert weights.group_size == 16


def test_group_size_minus_one_is_one_group_per_row() -> None:
    tensors, meta = load_golden("gptq_v1_rowgroup_in64_out32")
    assert meta["group_size"] == "-1"
    weights = unpack_golden(tensors, meta)
    assert weights.group_size == 64 and weights.scales.shape == (32, 1) and weights.g_idx is None


def test_trivial_g_idx_becomes_none_and_an_absent_one_is_trivial() -> None:
    tensors, _ = load_golden("gptq_v1_asym_in64_out32_g32")
    assert torch.equal(tensors["g_idx"].long(), torch.arange(64) // 32)
    with_g_idx = unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], GPTQ_V1)
    without = unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, GPTQ_V1)
    assert with_g_idx.g_idx is None and without.g_idx is None
    assert torch.equal(with_g_idx.dequantize(), without.dequantize())


# --------------------------------------------------------------------------------------------------
# Hand-written words, from the formats' published descriptions
# --------------------------------------------------------------------------------------------------


def test_gptq_word_packs_eight_input_rows_low_nibble_first() -> None:
    # One word per output column: column 0 holds 0x76543210 (input row j = j), column 7 holds 0xFEDCBA98
    # (rows 8..15 in the top half of the codes: a negative int32).
    qweight = torch.zeros(1, 8, dtype=torch.int32)
    qweight[0, 0] = 0x76543210
    qweight[0, 7] = 0xFEDCBA98 - (1 << 32)
    qzeros = torch.tensor([[0x00000007]], dtype=torch.int32)  # v1: output 0's zero 7 + 1; the others 0 + 1
    scales = torch.ones(1, 8, dtype=torch.float16)
    fmt = PrequantizedFormat(method="gptq", group_size=-1, checkpoint_format="gptq")
    weights = unpack_gptq(qweight, qzeros, scales, None, fmt)
    assert weights.codes[0].tolist() == list(range(8))
    assert weights.codes[7].tolist() == list(range(8, 16))
    assert weights.zeros is not None and weights.zeros[:, 0].tolist() == [8.0] + [1.0] * 7
    assert weights.dequantize()[0].tolist() == [float(j - 8) for j in range(8)]


def test_awq_word_interleaves_its_eight_columns() -> None:
    # Nibble k (bits 4k..4k+3) holds column [0, 2, 4, 6, 1, 3, 5, 7][k] of the word's block: the word
    # 0x76543210 (nibble k = k) therefore reads 0, 4, 1, 5, 2, 6, 3, 7 across columns 0..7.
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32)
    qzeros = torch.tensor([[0x11111111 * 3]], dtype=torch.int32)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    fmt = PrequantizedFormat(method="awq", group_size=1, sym=False, awq_version="gemm")
    weights = unpack_awq(qweight, qzeros, scales, fmt)
    assert [AWQ_PACK_ORDER[k] for k in AWQ_UNPACK_ORDER] == list(range(8))
    assert weights.codes[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert weights.dequantize()[:, 0].tolist() == [(c - 3) * 0.5 for c in [0, 4, 1, 5, 2, 6, 3, 7]]


# --------------------------------------------------------------------------------------------------
# Malformed tensors
# --------------------------------------------------------------------------------------------------


def test_mismatched_shapes_and_dtypes_fail_clearly() -> None:
    tensors, _ = load_golden("gptq_v1_asym_in64_out32_g32")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    with pytest.raises(ModelLoadError, match=r"scales: shape \(2, 16\), expected \(2, 32\)"):
        unpack_gptq(qweight, qzeros, scales[:, :16], None, GPTQ_V1)
    with pytest.raises(ModelLoadError, match="qweight: expected int32"):
        unpack_gptq(qweight.to(torch.int64), qzeros, scales, None, GPTQ_V1)
    with pytest.raises(ModelLoadError, match=r"g_idx: shape \(32,\), expected \(64,\)"):
        unpack_gptq(qweight, qzeros, scales, tensors["g_idx"][:32], GPTQ_V1)
    with pytest.raises(ModelLoadError, match=r"g_idx: group indices outside 0\.\.1"):
        unpack_gptq(qweight, qzeros, scales, torch.arange(64) // 16, GPTQ_V1)
    wrong_group = PrequantizedFormat(method="gptq", group_size=16, checkpoint_format="gptq")
    with pytest.raises(ModelLoadError, match=r"scales: shape \(2, 32\), expected \(4, 32\)"):
        unpack_gptq(qweight, qzeros, scales, None, wrong_group)
    awq_tensors, _ = load_golden("awq_in64_out32_g32")
    with pytest.raises(ModelLoadError, match="qzeros"):
        unpack_awq(awq_tensors["qweight"], awq_tensors["qzeros"][:1], awq_tensors["scales"], AWQ)


# --------------------------------------------------------------------------------------------------
# read_prequantized_format
# --------------------------------------------------------------------------------------------------

OPTIMUM_GPTQ = {  # as transformers/optimum write it into config.json
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": True,
    "sym": True,
    "damp_percent": 0.01,
    "true_sequential": True,
    "use_exllama": True,
}
GPTQMODEL_V2 = {  # GPTQModel's fields: method and format beside quant_method and checkpoint_format
    "quant_method": "gptq",
    "method": "gptq",
    "bits": 4,
    "group_size": 32,
    "desc_act": False,
    "sym": False,
    "lm_head": True,
    "format": "gptq_v2",
    "checkpoint_format": "gptq_v2",
    "pack_dtype": "int32",
    "dynamic": None,
    "rotation": None,
    "meta": {"quantizer": ["gptqmodel:7.7.0"], "static_groups": False},
}
AUTOAWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def test_unquantized_checkpoint_has_no_format(tmp_path: Path) -> None:
    assert read_prequantized_format({"model_type": "llama"}, tmp_path) is None
    assert read_prequantized_format({"model_type": "llama"}) is None


def test_reads_gptq_as_optimum_writes_it() -> None:
    fmt = read_prequantized_format({"quantization_config": OPTIMUM_GPTQ})
    assert fmt == PrequantizedFormat(
        method="gptq", bits=4, group_size=128, sym=True, desc_act=True, checkpoint_format="gptq", lm_head=False
    )
    assert fmt.zero_offset == 1.0


def test_reads_gptqmodel_v2_with_quantized_lm_head() -> None:
    fmt = read_prequantized_format({"quantization_config": GPTQMODEL_V2})
    assert fmt is not None
    assert (fmt.checkpoint_format, fmt.lm_head, fmt.sym, fmt.group_size) == ("gptq_v2", True, False, 32)
    assert fmt.zero_offset == 0.0


def test_group_size_minus_one_resolves_per_layer() -> None:
    fmt = read_prequantized_format({"quantization_config": {**OPTIMUM_GPTQ, "group_size": -1}})
    assert fmt is not None and fmt.group_size == -1
    assert fmt.group_size_for(4096) == 4096 and GPTQ_V1.group_size_for(4096) == 32


def test_static_groups_are_read_like_any_act_order_checkpoint() -> None:
    """With static_groups the groups are fixed before act-order reorders the columns, and g_idx still names
    each column's group, so the layout is the ordinary one."""
    fmt = read_prequantized_format({"quantization_config": {**OPTIMUM_GPTQ, "static_groups": True}})
    assert fmt is not None and fmt.method == "gptq"


def test_reads_autoawq() -> None:
    fmt = read_prequantized_format({"quantization_config": AUTOAWQ})
    assert fmt == PrequantizedFormat(method="awq", bits=4, group_size=128, sym=False, awq_version="gemm")
    assert fmt.zero_offset == 0.0
    legacy_names = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"}
    legacy = read_prequantized_format({"quantization_config": legacy_names})
    assert legacy is not None and legacy.group_size == 64


@pytest.mark.parametrize("use_config_path", [False, True], ids=["directory", "config.json"])
def test_reads_legacy_quantize_config_json(tmp_path: Path, use_config_path: bool) -> None:
    legacy = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "static_groups": False}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "quantize_config.json").write_text(json.dumps(legacy))
    path = tmp_path / "config.json" if use_config_path else tmp_path
    fmt = read_prequantized_format({"model_type": "llama"}, path)
    assert fmt == PrequantizedFormat(method="gptq", group_size=128, checkpoint_format="gptq")


def test_config_json_wins_over_quantize_config_json(tmp_path: Path) -> None:
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 8}))
    fmt = read_prequantized_format({"quantization_config": AUTOAWQ}, tmp_path)
    assert fmt is not None and fmt.method == "awq"


def test_unreadable_quantize_config_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "quantize_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="quantize_config.json: not valid JSON"):
        read_prequantized_format({}, tmp_path)


UNSUPPORTED = {
    "bits 8": ({**OPTIMUM_GPTQ, "bits": 8}, "bits=8"),
    "bits 3 awq": ({**AUTOAWQ, "bits": 3}, "bits=3"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    "fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method='fp8'"),
    "compressed-tensors": ({"quant_method": "compressed-tensors"}, "quant_method='compressed-tensors'"),
    "no quant_method": ({"bits": 4, "group_size": 128}, "no quant_method"),
    "awq gemv": ({**AUTOAWQ, "version": "gemv"}, "version='gemv'"),
    "awq gemv_fast": ({**AUTOAWQ, "version": "gemv_fast"}, "version='gemv_fast'"),
    "awq exllama": ({**AUTOAWQ, "version": "exllama"}, "version='exllama'"),
    "awq marlin": ({**AUTOAWQ, "version": "marlin"}, "version='marlin'"),
    "awq without zero points": ({**AUTOAWQ, "zero_point": False}, "zero_point=False"),
    "gptq marlin": ({**OPTIMUM_GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    "gptq planar": ({**GPTQMODEL_V2, "format": "gptq_p", "checkpoint_format": "gptq_p"}, "checkpoint_format='gptq_p'"),
    "gptq is_marlin_format": ({**OPTIMUM_GPTQ, "is_marlin_format": True}, "is_marlin_format=True"),
    "gptq int16 words": ({**GPTQMODEL_V2, "pack_dtype": "int16"}, "pack_dtype='int16'"),
    "gptq dynamic": ({**GPTQMODEL_V2, "dynamic": {r"-:.*mlp.*": {}}}, "dynamic="),
    "gptq rotation": ({**GPTQMODEL_V2, "rotation": "hadamard"}, "rotation='hadamard'"),
    "group size 0": ({**OPTIMUM_GPTQ, "group_size": 0}, "group_size=0"),
    "group size text": ({**AUTOAWQ, "group_size": "128"}, "group_size='128'"),
}


@pytest.mark.parametrize(("config", "field"), UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_unsupported_variants_name_the_field_and_what_is_supported(config: dict[str, object], field: str) -> None:
    with pytest.raises(ModelLoadError) as raised:
        read_prequantized_format({"quantization_config": config})
    message = str(raised.value)
    assert field in message
    assert "config.json quantization_config" in message
    assert "gptq" in message.lower() and ("awq" in message.lower() or "gemm" in message.lower())


def test_quantization_config_must_be_an_object() -> None:
    with pytest.raises(ModelLoadError, match="expected an object"):
        read_prequantized_format({"quantization_config": "gptq"})


# --------------------------------------------------------------------------------------------------
# iter_prequantized: a checkpoint's tensor stream, quantized layers grouped
# --------------------------------------------------------------------------------------------------


def gptq_layer(prefix: str, name: str = "gptq_v1_actorder_in64_out32_g16") -> list[tuple[str, torch.Tensor]]:
    tensors, _ = load_golden(name)
    return [(f"{prefix}.{part}", tensors[part]) for part in ("qweight", "qzeros", "scales", "g_idx")]


def awq_layer(prefix: str) -> list[tuple[str, torch.Tensor]]:
    tensors, _ = load_golden("awq_in64_out32_g32")
    return [(f"{prefix}.{part}", tensors[part]) for part in ("qweight", "qzeros", "scales")]


ACT_ORDER = PrequantizedFormat(method="gptq", group_size=16, desc_act=True, checkpoint_format="gptq")


def test_groups_interleaved_layers_and_passes_everything_else_through() -> None:
    q = gptq_layer("model.layers.0.self_attn.q_proj")
    k = gptq_layer("model.layers.0.self_attn.k_proj")
    head = gptq_layer("lm_head")
    bias = torch.ones(32)
    norm = torch.ones(64)
    embed = torch.zeros(10, 64)
    # Shards interleave layers: k's parts arrive between q's, the lm_head's last part at the very end.
    stream = [
        ("model.embed_tokens.weight", embed),
        q[0],
        k[2],
        q[1],
        ("model.layers.0.self_attn.q_proj.bias", bias),
        k[0],
        head[0],
        head[1],
        head[2],
        k[1],
        q[3],
        k[3],
        ("model.norm.weight", norm),
        q[2],
        head[3],
    ]
    out = list(iter_prequantized(stream, ACT_ORDER))
    names = [name for name, _ in out]
    assert names == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
    ]
    plain = dict(out)
    assert plain["model.embed_tokens.weight"] is embed
    assert plain["model.layers.0.self_attn.q_proj.bias"] is bias
    assert plain["model.norm.weight"] is norm
    tensors, _ = load_golden("gptq_v1_actorder_in64_out32_g16")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        weights = plain[name]
        assert isinstance(weights, Int4Weights)
        assert torch.equal(weights.dequantize(), tensors["expected"])


def test_unquantized_lm_head_passes_through() -> None:
    head = torch.randn(10, 64)
    out = list(iter_prequantized([*awq_layer("model.layers.0.mlp.up_proj"), ("lm_head.weight", head)], AWQ))
    assert [name for name, _ in out] == ["model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    assert out[1][1] is head
    assert isinstance(out[0][1], Int4Weights)


def test_gptq_layers_without_g_idx_are_yielded_at_the_end() -> None:
    tensors, _ = load_golden("gptq_v1_asym_in64_out32_g32")
    stream = [(f"model.layers.0.mlp.down_proj.{p}", tensors[p]) for p in ("qweight", "qzeros", "scales")]
    stream.append(("model.norm.weight", torch.ones(64)))
    out = list(iter_prequantized(stream, GPTQ_V1))
    assert [name for name, _ in out] == ["model.norm.weight", "model.layers.0.mlp.down_proj.weight"]
    weights = out[1][1]
    assert isinstance(weights, Int4Weights) and weights.g_idx is None
    assert torch.equal(weights.dequantize(), tensors["expected"])


def test_a_layer_with_missing_parts_fails_at_the_end() -> None:
    stream = [*awq_layer("model.layers.0.mlp.up_proj"), *awq_layer("model.layers.1.mlp.up_proj")[:2]]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj: missing scales"):
        list(iter_prequantized(stream, AWQ))
    without_qweight = gptq_layer("model.layers.3.mlp.gate_proj")[1:]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.mlp\.gate_proj: missing qweight"):
        list(iter_prequantized(without_qweight, ACT_ORDER))


def test_a_part_seen_twice_fails() -> None:
    layer = awq_layer("model.layers.0.mlp.up_proj")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.qzeros: appears twice"):
        list(iter_prequantized([layer[1], layer[1], layer[0], layer[2]], AWQ))


def test_a_malformed_layer_is_named() -> None:
    layer = awq_layer("model.layers.5.self_attn.o_proj")
    broken = [layer[0], layer[1], (layer[2][0], layer[2][1][:, :8])]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.5\.self_attn\.o_proj: scales: shape"):
        list(iter_prequantized(broken, AWQ))
