"""Embedding checkpoints for tests: a tiny seeded checkpoint with sentence-transformers' pooling files written
in, and transformers' pooled hidden states to compare with."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

MODE_KEYS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def embedding_model(base: Path, out_dir: Path, method: str | None, normalize: bool,
                    matryoshka: list[int] | bool | None = None) -> Path:
    """A copy of checkpoint `base` as a sentence-transformers model: modules.json with a Pooling module of
    `method` (None: no modules.json at all, the default applies) and a Normalize module when `normalize`.
    matryoshka: True writes is_matryoshka, a list writes matryoshka_dimensions into config.json."""
    shutil.copytree(base, out_dir)
    if method is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
            (out_dir / "2_Normalize").mkdir()
        (out_dir / "modules.json").write_text(json.dumps(modules), encoding="utf-8")
        (out_dir / "1_Pooling").mkdir()
        pooling = {"word_embedding_dimension": 64, **{key: key == MODE_KEYS[method] for key in MODE_KEYS.values()},
                   "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
                   "include_prompt": True}
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling), encoding="utf-8")
    if matryoshka is not None:
        config_path = out_dir / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if matryoshka is True:
            config["is_matryoshka"] = True
        else:
            config["matryoshka_dimensions"] = matryoshka
        config_path.write_text(json.dumps(config), encoding="utf-8")
    return out_dir


class HFEmbedder:
    """transformers' AutoModel in fp32: last_hidden_state (after the final norm), pooled one prompt at a time."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        transformers.logging.set_verbosity_error()
        self.model = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.no_grad()
    def embed(self, prompt_ids: Sequence[int], method: str, normalize: bool, dimensions: int | None = None
              ) -> torch.Tensor:
        hidden = self.model(torch.tensor([list(prompt_ids)])).last_hidden_state[0]
        vector = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(dim=0)}[method]
        if dimensions is not None:
            vector = vector[:dimensions]
        return F.normalize(vector, p=2, dim=-1) if normalize else vector
