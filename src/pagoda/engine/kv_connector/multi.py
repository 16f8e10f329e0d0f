"""MultiConnector (vLLM's name): several connectors as one. A request loads from the first connector that has
tokens for it; every connector saves. Each keeps its own state and metadata; the step's metadata is theirs, in
order."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pagoda.engine.api import KVTierStats
from pagoda.engine.core.kv_connector import KVConnectorScheduler, StepItem
from pagoda.engine.core.request import Request
from pagoda.engine.kv_connector.base import KVConnectorWorker


class MultiConnectorScheduler:
    def __init__(self, children: Sequence[KVConnectorScheduler]) -> None:
        self.children = list(children)
        self._chosen: dict[str, int] = {}  # request id -> the child that supplies its external tokens
        self._holders: dict[str, int] = {}  # request id -> children still holding its blocks, when several do

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self._chosen.pop(request.request_id, None)
        for index, child in enumerate(self.children):
            found = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if found:
                self._chosen[request.request_id] = index
                return found
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        for index, child in enumerate(self.children):
            child.update_state_after_alloc(request, block_ids, num_external_tokens if index == chosen else 0)

    def build_connector_meta(self, items: Sequence[StepItem]) -> tuple[object, ...]:
        return tuple(child.build_connector_meta(items) for child in self.children)

    def load_failed(self, request: Request, num_valid_tokens: int) -> None:
        for child in self.children:
            child.load_failed(request, num_valid_tokens)

    def request_finished(self, request: Request) -> int:
        """Every child hears it; the blocks held are the most any child holds (each releases on its own, so the
        request is released once all that held have said so)."""
        self._chosen.pop(request.request_id, None)
        held = [child.request_finished(request) for child in self.children]
        holders = sum(1 for count in held if count)
        if holders > 1:
            self._holders[request.request_id] = holders
        return max(held)

    def finished_sending(self) -> list[str]:
        released = []
        for child in self.children:
            for request_id in child.finished_sending():
                left = self._holders.get(request_id, 1) - 1
                if left > 0:
                    self._holders[request_id] = left
                else:
                    self._holders.pop(request_id, None)
                    released.append(request_id)
        return released


class MultiConnectorWorker:
    def __init__(self, children: Sequence[KVConnectorWorker]) -> None:
        self.children = list(children)

    def start_load_kv(self, metadata: object) -> dict[str, int]:
        assert isinstance(metadata, tuple) and len(metadata) == len(self.children)
        failures: dict[str, int] = {}
        for child, child_metadata in zip(self.children, metadata):
            for request_id, num_valid in child.start_load_kv(child_metadata).items():
                failures[request_id] = min(num_valid, failures.get(request_id, num_valid))
        return failures

    def save_kv(self, metadata: object, skip: Collection[str] = ()) -> None:
        assert isinstance(metadata, tuple) and len(metadata) == len(self.children)
        for child, child_metadata in zip(self.children, metadata):
            child.save_kv(child_metadata, skip)

    def wait_for_saves(self, timeout_s: float = 10.0) -> None:
        for child in self.children:
            child.wait_for_saves(timeout_s)

    def tier_stats(self) -> list[KVTierStats]:
        return [stats for child in self.children for stats in child.tier_stats()]

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()
