"""LoRA adapters as callers name them: vLLM's `LoRARequest`, and the server's `--lora-modules` entries.

Neutral ground (no torch, no engine): the offline API, the CLI and the server all read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter, as vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: a PEFT directory
    (adapter_config.json + adapter_model.safetensors). The name is the adapter's identity: the same name with
    other weights (another path, or the files rewritten) is loaded again, and never shares cached KV blocks
    with what it held before. lora_int_id is kept for vLLM's signature and must be positive, as there."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest: lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("LoRARequest: lora_path must name the adapter's directory")

    # vLLM's accessors
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


def parse_lora_module(text: str, index: int = 1) -> LoRARequest:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`.
    index: the entry's place on the command line, its lora_int_id."""
    text = text.strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({error.msg})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"--lora-modules: {text!r} must be a JSON object")
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules: unknown key(s) {', '.join(unknown)}; "
                             "takes name, path and base_model_name")
        name, path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
        if not isinstance(name, str) or not isinstance(path, str) or not (base is None or isinstance(base, str)):
            raise ValueError(f"--lora-modules: {text!r} needs string \"name\" and \"path\"")
        return LoRARequest(name, index, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} is neither name=path nor a JSON object")
    return LoRARequest(name, index, path)
