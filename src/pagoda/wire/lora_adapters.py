"""The bodies of vLLM's runtime adapter routes, POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

from pydantic import Field

from pagoda.wire.base import WireModel

# An adapter's name is a `model` a request may give, and a label of vllm:lora_requests_info.
AdapterName = str


class LoadLoRAAdapterRequest(WireModel):
    lora_name: AdapterName = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # vLLM's: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(WireModel):
    lora_name: AdapterName = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's signature carries it; the name is what identifies the adapter
