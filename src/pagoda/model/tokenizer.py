"""The model directory's own tokenizer (tokenizer.json + tokenizer_config.json with its chat template)."""

from __future__ import annotations

from pathlib import Path

from pagoda.model.loader import ModelLoadError


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"{model_dir / 'tokenizer.json'}: file not found (pagoda needs the model's tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as error:  # transformers raises many types; the message must name the directory
        raise ModelLoadError(f"{model_dir}: cannot load tokenizer ({error})") from error
