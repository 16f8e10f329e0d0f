"""pagoda: an LLM inference engine and OpenAI-compatible serving stack."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.lora_request import LoRARequest
from pagoda.sampling import SamplingParams
from pagoda.version import __version__

if TYPE_CHECKING:
    from pagoda.entrypoints import LLM

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str) -> type[LLM]:
    # LLM pulls in torch and the model code; keep `import pagoda` cheap for the CLI and calc.
    if name == "LLM":
        from pagoda.entrypoints import LLM

        return LLM
    raise AttributeError(name)
