"""Embedding models (vLLM's pooling runner): how a model pools its final hidden states, and what one request asks.

Torch-free. `PoolingParams` is the caller's (vLLM's name): `dimensions` (Matryoshka truncation) and `normalize`.
`PoolingConfig` is the model's, read once from its directory the way sentence-transformers reads it:
`modules.json` lists the modules; its Pooling module's `config.json` names the mode (`pooling_mode_lasttoken`,
`pooling_mode_mean_tokens`, `pooling_mode_cls_token`), and a Normalize module means L2-normalized output.
Without `modules.json` (or without a Pooling module in it): last-token pooling, normalized, vLLM's default
for decoder embedding models (Qwen3-Embedding). Whether `dimensions` may be asked for is config.json's
`is_matryoshka` / `matryoshka_dimensions`, as vLLM reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.model_dir import ModelLoadError

POOLING_METHODS = ("last", "mean", "cls")
RUNNERS = ("generate", "pooling")
# sentence-transformers' Pooling config keys for the modes pagoda computes, by method.
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingParams:
    """What one embedding request asks for. dimensions: keep the first this many of the pooled vector's
    entries (Matryoshka models only), then normalize; normalize: None means the model's own choice."""

    dimensions: int | None = None
    normalize: bool | None = None


@dataclass(frozen=True)
class PoolingConfig:
    """How the model turns a prompt's final hidden states into one vector."""

    method: str = "last"  # one of POOLING_METHODS
    normalize: bool = True
    is_matryoshka: bool = False  # may a request ask for fewer dimensions
    matryoshka_dimensions: tuple[int, ...] | None = None  # if declared, the only sizes allowed
    hidden_size: int = 0

    @property
    def uses_prefix_hits(self) -> bool:
        """A prefix served from the cache has no hidden states: only last-token pooling, whose last token is
        always computed, can take prefix hits; mean and CLS pooling need every position computed."""
        return self.method == "last"

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raises ValueError (naming `dimensions`) for a size this model cannot give."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka truncation (its config.json "
                             "declares neither is_matryoshka nor matryoshka_dimensions)")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions: this model supports only {list(self.matryoshka_dimensions)}, "
                             f"got {dimensions}")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dimensions}")

    def resolve(self, params: PoolingParams) -> ResolvedPooling:
        self.check_dimensions(params.dimensions)
        normalize = self.normalize if params.normalize is None else params.normalize
        return ResolvedPooling(self.method, normalize, params.dimensions)


@dataclass(frozen=True)
class ResolvedPooling:
    """One request's pooling, the model's defaults applied: what the runner computes."""

    method: str
    normalize: bool
    dimensions: int | None


def load_pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The model's pooling, from its sentence-transformers files (see the module's docstring); ModelLoadError
    names the file and field it cannot follow."""
    path = Path(model_dir)
    config = _read_json(path / "config.json")
    hidden_size = int(config.get("hidden_size", 0))
    dims = config.get("matryoshka_dimensions")
    matryoshka = tuple(int(d) for d in dims) if isinstance(dims, list) else None
    is_matryoshka = bool(config.get("is_matryoshka", False)) or matryoshka is not None
    method, normalize = "last", True
    modules_path = path / "modules.json"
    if modules_path.is_file():
        modules = _read_json(modules_path)
        if not isinstance(modules, list):
            raise ModelLoadError(f"{modules_path}: expected a list of modules")
        types = [str(module.get("type", "")) for module in modules]
        normalize = any(t.endswith(".Normalize") for t in types)
        unsupported = [t for t in types if not t.endswith((".Transformer", ".Pooling", ".Normalize"))]
        if unsupported:
            raise ModelLoadError(f"{modules_path}: module {unsupported[0]!r} is not supported (pagoda pools with "
                                 "Transformer, Pooling and Normalize modules only)")
        pooling = [module for module in modules if str(module.get("type", "")).endswith(".Pooling")]
        if pooling:
            method = _pooling_method(path / str(pooling[0].get("path", "1_Pooling")) / "config.json")
    return PoolingConfig(method, normalize, is_matryoshka, matryoshka, hidden_size)


def _pooling_method(config_path: Path) -> str:
    config = _read_json(config_path)
    unsupported = [key for key in _UNSUPPORTED_MODES if config.get(key)]
    if unsupported:
        raise ModelLoadError(f"{config_path}: {unsupported[0]} is not supported (last-token, mean and CLS pooling are)")
    if config.get("include_prompt", True) is False:
        raise ModelLoadError(f"{config_path}: include_prompt false is not supported")
    methods = [method for key, method in _MODE_KEYS.items() if config.get(key)]
    if len(methods) != 1:
        raise ModelLoadError(f"{config_path}: exactly one of {', '.join(_MODE_KEYS)} must be true "
                             f"(concatenated poolings are not supported), got {len(methods)}")
    return methods[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: cannot read it: {error}") from error


def resolve_runner(runner: str = "auto", convert: str = "auto") -> str:
    """vLLM's --runner and --convert as one choice: "generate" or "pooling". `auto` is the generate runner
    (decoder checkpoints name a causal-LM architecture either way); `--convert embed` serves a generative
    checkpoint as an embedding model, so it means the pooling runner."""
    if runner not in ("auto", *RUNNERS):
        raise ValueError(f"runner must be one of auto, {', '.join(RUNNERS)}; got {runner!r}")
    if convert not in ("auto", "none", "embed"):
        raise ValueError(f"convert must be one of auto, none, embed; got {convert!r}")
    if convert == "embed":
        if runner == "generate":
            raise ValueError("convert embed makes an embedding model: it needs runner pooling (or auto)")
        return "pooling"
    return "generate" if runner == "auto" else runner
