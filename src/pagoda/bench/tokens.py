"""Token counts on the client side: a local tokenizer directory, and the server's `/tokenize` when it has one.

The local tokenizer makes random prompts of an exact length (token ids) and cross-checks the server's
`usage`; `/tokenize` counts what only the server can render exactly (a chat template around messages).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx


class ClientTokenizer:
    """A Hugging Face `tokenizer.json` loaded with the `tokenizers` library (no torch, no transformers)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no tokenizer.json (give --tokenizer a model directory)")
        self.path = str(file)
        self._tokenizer = Tokenizer.from_file(str(file))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        special = {token_id for token_id, added in self._tokenizer.get_added_tokens_decoder().items() if added.special}
        special |= self._config_special_ids(file.parent)
        self.special_ids = frozenset(special)
        # Random prompts draw from ordinary tokens only: a special token mid-prompt (</s>, <|im_end|>) changes
        # what the model does, and a server may refuse or strip it.
        self._ordinary = [i for i in range(self.vocab_size) if i not in self.special_ids]

    def _config_special_ids(self, directory: Path) -> set[int]:
        config = directory / "tokenizer_config.json"
        if not config.is_file():
            return set()
        decoder = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        return {int(token_id) for token_id, entry in decoder.items() if entry.get("special")}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def count(self, text: str, add_special_tokens: bool = False) -> int:
        return len(self.encode(text, add_special_tokens=add_special_tokens))

    def random_ids(self, rng: random.Random, length: int) -> list[int]:
        return [self._ordinary[rng.randrange(len(self._ordinary))] for _ in range(length)]


class ServerTokenizer:
    """vLLM-style `POST /tokenize` on the server's root: {"prompt"} or {"messages"} -> {"count", "tokens"}."""

    def __init__(self, http: httpx.AsyncClient, root_url: str, model: str | None, headers: dict[str, str]) -> None:
        self.http, self.url, self.model, self.headers = http, f"{root_url}/tokenize", model, headers
        self.available: bool | None = None  # unknown until probed

    async def probe(self) -> bool:
        try:
            response = await self.http.post(self.url, json={"model": self.model, "prompt": "hello"},
                                            headers=self.headers)
            self.available = response.status_code == 200 and "count" in response.json()
        except (httpx.HTTPError, ValueError):
            self.available = False
        return self.available

    async def count(self, prompt: str | list[dict[str, Any]]) -> int | None:
        """Tokens the server makes of a text prompt (with its special tokens) or of chat messages (templated)."""
        if not self.available:
            return None
        body: dict[str, Any] = {"model": self.model}
        body.update({"messages": prompt, "add_generation_prompt": True} if isinstance(prompt, list)
                    else {"prompt": prompt})
        try:
            response = await self.http.post(self.url, json=body, headers=self.headers)
        except httpx.HTTPError:
            return None
        return response.json().get("count") if response.status_code == 200 else None
