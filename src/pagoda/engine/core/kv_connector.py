"""The KV connector's scheduler side: what the scheduler asks of an external KV store (vLLM v1's
KVConnectorBase_V1, scheduler half). Pure Python; implementations live in engine/kv_connector/.

A connector is chosen at construction (EngineConfig.kv_transfer_config). For a request being admitted, the
scheduler first takes the local prefix-cache hit, then asks `get_num_new_matched_tokens` how many more prompt
tokens the external store can supply (whole blocks; never the last known token, whose logits are sampled).
Those tokens get blocks like any others, are counted as computed, and cost no step budget; the connector is told
where they go (`update_state_after_alloc`). At the end of `schedule()` it builds the step's metadata (which blocks
to load into which block ids, which newly full blocks to save), which rides on the SchedulerOutput to the worker
side (the runner). A load that fails is reported back in ModelRunnerOutput.kv_load_failures: the request did not
run that step, and `Scheduler.update` sets its computed tokens back to what did load (`load_failed`), so those
tokens are computed instead.

A connector may also keep a finished request's blocks (prefill/decode disaggregation: a prefill replica holds a
prompt's KV until a decode replica has pulled it): `request_finished` says how many of its leading blocks stay
held, and `finished_sending` later names the requests whose held blocks may go back to the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagoda.engine.core.request import Request


@dataclass(frozen=True)
class StepItem:
    """One request scheduled this step, as the connector sees it: its KV through `num_computed_tokens` is in its
    blocks when the step starts (loads included), and through `num_computed_tokens + num_known_tokens` after."""

    request: Request
    num_known_tokens: int


class KVConnectorScheduler(Protocol):
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens past `num_computed_tokens` (the local hit, whole blocks) the store can supply: a multiple
        of the block size, leaving at least the last known token to compute. 0 when it has none."""
        ...

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The request was admitted: `request.num_computed_tokens` counts the local hit and the `num_external_tokens`
        before it that the store supplies, and `block_ids` are its blocks. Called for every admission (0 external
        tokens included), after the last get_num_new_matched_tokens for that request."""
        ...

    def build_connector_meta(self, items: Sequence[StepItem]) -> object:
        """The step's work for the worker side, for the requests the step runs (in this order); it consumes what
        update_state_after_alloc recorded. Plain data (it may cross a process boundary)."""
        ...

    def load_failed(self, request: Request, num_valid_tokens: int) -> None:
        """The step's load for the request failed past `num_valid_tokens`: its KV is valid up to there only."""
        ...

    def request_finished(self, request: Request) -> int:
        """The request ended (finished, aborted or failed): its per-request state is dropped. Called before its
        blocks are freed. Returns how many of its leading blocks the connector keeps (0: none), held out of the
        pool until `finished_sending` names the request."""
        ...

    def finished_sending(self) -> list[str]:
        """Requests whose held blocks may now go back to the pool (pulled, or held past the connector's timeout).
        Polled by the engine thread each step, and while it idles."""
        ...
