"""The labs `pagoda lab` knows, by name. A lab's module imports the engine only inside its `run`."""

from __future__ import annotations

from types import ModuleType

from pagoda.labs import (
    interference,
    kv_capacity,
    prefix_cache,
    priority,
    quantization,
    queueing,
    roofline,
    router_policies,
    speculative,
    static_batching,
)

LABS: dict[str, ModuleType] = {
    lab.NAME: lab for lab in (kv_capacity, prefix_cache, priority, speculative, static_batching, interference,
                              router_policies, queueing, roofline, quantization)
}
