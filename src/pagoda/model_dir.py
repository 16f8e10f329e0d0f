"""A model directory as pagoda takes one: what it must hold, and the error that says what is wrong with it.

Torch-free and importing nothing of pagoda's: the CLI checks --model here before anything heavy loads, and
every reader of a checkpoint's files (the loader, the GPTQ/AWQ readers, the tokenizer) raises ModelLoadError.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


class ModelLoadError(ValueError):
    pass


CHECKPOINT_NEEDS = (
    "pagoda loads a local Hugging Face checkpoint directory: config.json, *.safetensors weights and the "
    "tokenizer (tokenizer.json, tokenizer_config.json)"
)
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def check_model_dir(model: str | Path) -> Path:
    """The model directory, or a ModelLoadError that says what pagoda needs and how to get it: for a hub id,
    a GGUF file or a directory without config.json, before anything is loaded."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: no config.json; {CHECKPOINT_NEEDS}")
        return path
    if path.suffix.lower() == ".gguf":
        raise ModelLoadError(
            f"{model} is a GGUF file; {CHECKPOINT_NEEDS}, not GGUF.\n"
            "Download the original model's repository instead: hf download <org>/<model> --local-dir models/<model>"
        )
    if not path.exists() and HUB_ID.fullmatch(str(model)):
        local = f"models/{str(model).split('/')[1]}"
        raise ModelLoadError(
            f"{model} is not a local directory, and pagoda does not download models; {CHECKPOINT_NEEDS}.\n"
            f"Get this one with:  hf download {model} --local-dir {local}   then: --model {local}\n"
            "Seeded benchmark models (no download): python scripts/make_bench_models.py"
        )
    raise ModelLoadError(f"{model}: not a directory; {CHECKPOINT_NEEDS}")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from error
