"""/v1/embeddings' request (OpenAI's), and the answer's vectors in either encoding."""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import field_validator, model_validator

from pagoda.wire.base import Prompt, WireModel, too_long
from pagoda.wire.limits import wire_limits


class EmbeddingRequest(WireModel):
    NULL_IS_DEFAULT = frozenset({"encoding_format"})

    model: str | None = None
    # A string, a list of strings, one list of token ids, or a list of token-id lists: one embedding each.
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka truncation, where the model's config.json allows it
    user: str | None = None  # OpenAI's end-user id: accepted, not used

    @field_validator("input", mode="before")
    @classmethod
    def _few_inputs(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not isinstance(value[0], int):  # a list of inputs
            too_long(value, wire_limits().max_prompts, "inputs")
        return value

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError("dimensions must be at least 1")
        return self

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding asked for; raises ValueError (naming `input`) for an empty one."""
        value = self.input
        if isinstance(value, str):
            inputs: list[str | list[int]] = [value]
        elif value and all(isinstance(item, int) for item in value):
            inputs = [[item for item in value if isinstance(item, int)]]
        else:
            inputs = [item for item in value if not isinstance(item, int)]
        if not inputs:
            raise ValueError("input must not be an empty list")
        for index, item in enumerate(inputs):
            if not item:
                where = "input" if len(inputs) == 1 else f"input[{index}]"
                raise ValueError(f"{where} must not be empty")
        return inputs


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as the answer carries it: a list of floats, or base64 of its little-endian float32 bytes
    (what OpenAI's client asks for by default and decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
