"""Pipeline parallelism: which layers one stage holds, and which checkpoint tensors it reads.

The decoder layers are split into `size` contiguous stages; the first stage also holds the embedding, the last the
final norm and the LM head. A stage's model is the architecture cut to its layers (`stage_config`: its layer count
and their sliding windows), its layers numbered from 0 inside it, so that its KV cache holds its layers only. With
tied embeddings and several stages, the last stage holds its own copy of the embedding as its LM head (the first
stage holds the embedding), as each has one of the two uses.

Between stages travels the residual stream as the layers leave it: `StageActivations`, the residual and the last
sublayer's output not yet added to it (the next layer's norm adds it, fused).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from pagoda.config import ModelConfig
from pagoda.model_dir import ModelLoadError

_LAYER_NAME = re.compile(r"((?:model\.)?layers\.)(\d+)(\..*)")
_EMBEDDING = ("model.embed_tokens.weight", "embed_tokens.weight")
_LAST_STAGE_ONLY = ("model.norm.weight", "norm.weight", "lm_head.weight")


class StageError(ModelLoadError):
    """The model cannot be split into this many pipeline stages."""


@dataclass(frozen=True)
class PipelineStage:
    """One stage of the pipeline: its index among `size` stages, and its layers [first_layer, end_layer) of the
    whole model."""

    index: int
    size: int
    first_layer: int
    end_layer: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer


@dataclass
class StageActivations:
    """What a stage hands the next: the residual stream, and the last sublayer's output still to be added to it."""

    residual: torch.Tensor
    delta: torch.Tensor


def stage_layer_counts(num_layers: int, size: int) -> list[int]:
    """Layers per stage: an even split, the remainder on the stages just before the last (which also runs the
    final norm and the LM head)."""
    if num_layers < size:
        raise StageError(f"pipeline_parallel_size {size} cannot split this model: num_hidden_layers {num_layers} "
                         f"is fewer than the stages")
    counts = [num_layers // size] * size
    for offset in range(num_layers % size):
        counts[max(0, size - 2 - offset)] += 1
    return counts


def pipeline_stage(num_layers: int, size: int, index: int) -> PipelineStage:
    """Stage `index` of `size` over a model of `num_layers` layers."""
    counts = stage_layer_counts(num_layers, size)
    first = sum(counts[:index])
    return PipelineStage(index, size, first, first + counts[index])


def stage_config(config: ModelConfig, stage: PipelineStage) -> ModelConfig:
    """The architecture of one stage: its layers (their sliding windows, which of them route to experts), and
    tied embeddings untied when the embedding and the LM head are on different stages. `config` may already be a
    tensor-parallel rank's share."""
    layers = slice(stage.first_layer, stage.end_layer)
    windows = config.sliding_windows[layers] if config.sliding_windows else ()
    moe = None if config.moe is None else replace(config.moe, sparse_layers=config.moe.sparse_layers[layers])
    tied = config.tie_word_embeddings and stage.size == 1
    return replace(config, num_layers=stage.num_layers, sliding_windows=windows, tie_word_embeddings=tied, moe=moe)


def stage_reads(hf_name: str, config: ModelConfig, stage: PipelineStage) -> bool:
    """Whether the stage reads checkpoint tensor `hf_name` (`config`: the whole model's)."""
    match = _LAYER_NAME.fullmatch(hf_name)
    if match is not None:
        return stage.first_layer <= int(match.group(2)) < stage.end_layer
    if hf_name in _EMBEDDING:
        return stage.is_first or (stage.is_last and config.tie_word_embeddings)
    if hf_name in _LAST_STAGE_ONLY:
        return stage.is_last
    return True  # anything else (rotary tables some checkpoints store) the model itself accepts or refuses


def stage_weights(weights: Iterator[tuple[str, torch.Tensor]], config: ModelConfig,
                  stage: PipelineStage) -> Iterator[tuple[str, torch.Tensor]]:
    """The stage's tensors under the names its model knows: layers numbered from the stage's first, and on a last
    stage without the embedding, a tied embedding as its LM head. `weights` holds the stage's tensors only."""
    for name, tensor in weights:
        match = _LAYER_NAME.fullmatch(name)
        if match is not None:
            yield f"{match.group(1)}{int(match.group(2)) - stage.first_layer}{match.group(3)}", tensor
        elif name in _EMBEDDING and not stage.is_first:
            yield "lm_head.weight", tensor
        else:
            yield name, tensor
