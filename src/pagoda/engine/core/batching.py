"""When a step may admit waiting requests: continuous batching (the engine's), or static (teaching only).

Continuous batching admits whenever a slot (`max_num_seqs`) and the step's budget allow: a request that
finishes is replaced at the next step. Static batching is how servers batched before it, kept so that
`pagoda lab static-batching` can show the difference on the same engine: a batch forms while none of its
requests has produced a token, then the gate stays shut until every one of them has finished, so a slot
freed by a short answer idles until the batch's longest one ends. The scheduler asks the gate once per
step, before admitting anyone. Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagoda.config import SchedulerConfig
from pagoda.engine.core.request import Request


class AdmissionGate(Protocol):
    def admits(self, running: Sequence[Request]) -> bool:
        """Whether this step may admit waiting requests, given the requests running as it starts."""
        ...


class ContinuousBatching:
    def admits(self, running: Sequence[Request]) -> bool:
        return True


class StaticBatching:
    def admits(self, running: Sequence[Request]) -> bool:
        # A batch is still forming while none of its requests has sampled (its prompts may take several
        # steps); once one has, nobody joins until the whole batch is gone.
        return all(request.num_output_tokens == 0 for request in running)


def make_admission_gate(config: SchedulerConfig) -> AdmissionGate:
    return StaticBatching() if config.batching == "static" else ContinuousBatching()
