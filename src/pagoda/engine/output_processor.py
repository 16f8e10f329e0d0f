"""Output processing: what the scheduler appended, turned into what users see.

Each sample's new tokens go through its detokenizer and stop strings one at a time, as decoding would see
them; the samples of a user request are then gathered into one RequestOutput (engine/parallel_sampling.py).

Stop strings are decided here, on the text, after the scheduler has appended the step's tokens (as vLLM's
detokenizer does): where one ends the output inside a speculative step's run, the output (its tokens,
logprobs and text) ends at that token, and the tokens after it, which the scheduler appended, are never
shown. The engine then finishes such requests in the scheduler, once (`Scheduler.finish_requests`). Every
other stop (eos, stop token ids, max_tokens, the context, the grammar's end) is the scheduler's, decided
before it appends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from pagoda.engine.api import CompletionOutput, RequestOutput
from pagoda.engine.core.request import FinishReason, Request
from pagoda.engine.core.scheduler import EngineCoreOutput
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.parallel_sampling import RequestGroup
from pagoda.structured.interface import GrammarStateError
from pagoda.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class SequenceText:
    """One sample as the user sees it: its tokens, logprobs and text so far, and how it ended."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Stop strings may straddle tokens: this many trailing characters are held back until it is
    # clear they do not begin a stop string.
    holdback: int = field(init=False)

    def __post_init__(self) -> None:
        stops = self.request.params.stop
        self.holdback = max((len(s) for s in stops), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_tokens(self, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> bool:
        """The step's new tokens (and their logprobs, when asked), one at a time. Returns True where a stop
        string ends the output at one of them: the output ends there (the stop string is the reason shown,
        also where the same token reached max_tokens) and the rest are dropped. Otherwise the sample ends
        as its request did in the scheduler, if it did."""
        for index, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            if logprobs is not None:
                self.logprobs.append(logprobs[index])
            stop = self.add_token(token_id)
            if stop is not None:
                self.finish_reason, self.stop_reason = FinishReason.STOP, stop
                return True
        if self.request.is_finished:
            self.finish_reason, self.stop_reason = self.request.finish_reason, self.request.stop_reason
        return False

    def add_token(self, token_id: int) -> str | None:
        """Appends the token's text; returns the stop string if one now appears in the text."""
        if token_id in self.request.eos_token_ids and not self.request.params.ignore_eos:
            return None  # eos ends the request but is not text (vLLM: excluded from output text)
        previous_length = len(self.text)
        self.text += self.detokenizer.add(token_id)
        stops = self.request.params.stop
        if not stops or len(self.text) == previous_length:
            return None
        search_from = max(0, previous_length - self.holdback)
        found = [(self.text.find(s, search_from), s) for s in stops]
        found = [(index, s) for index, s in found if index >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[:index]
        return stop

    def visible_text(self) -> str:
        if self.finished or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

    def completion(self) -> CompletionOutput:
        request = self.request
        logprobs = list(self.logprobs) if request.params.logprobs is not None else None
        cumulative = None
        if logprobs is not None:
            cumulative = sum(lp[t] for lp, t in zip(logprobs, self.token_ids))
        timeline = None
        if self.finished:  # its moments, with the output as shown
            timeline = replace(request.timeline(), num_output_tokens=len(self.token_ids))
        return CompletionOutput(
            index=request.sample_index,
            text=self.visible_text(),
            token_ids=list(self.token_ids),
            finish_reason=None if self.finish_reason is None else self.finish_reason.value,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
            timeline=timeline,
        )


@dataclass
class ProcessedOutputs:
    """One step's outputs, and what the engine must tell the scheduler."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[Request] = field(default_factory=list)  # ended here by a stop string: to finish
    failed: list[RequestGroup[SequenceText]] = field(default_factory=list)  # a sample failed: every sample to abort
    # Deferred samples whose first sample now has its prompt cached, in the order to queue them at the front
    to_schedule_first: list[Request] = field(default_factory=list)


class OutputProcessor:
    """Holds every user request's RequestGroup, from add_request until it finishes, is aborted or fails."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, RequestGroup[SequenceText]] = {}  # by user request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add_request(self, request_id: str, prompt: str | None, samples: list[Request]) -> RequestGroup[SequenceText]:
        """Starts the output of a user request's samples (in sample order)."""
        sequences = [SequenceText(request, IncrementalDetokenizer(self.tokenizer, request.params.skip_special_tokens))
                     for request in samples]
        group = self._groups[request_id] = RequestGroup(request_id, prompt, sequences)
        return group

    def pop(self, request_id: str) -> RequestGroup[SequenceText] | None:
        return self._groups.pop(request_id, None)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        groups: dict[str, RequestGroup[SequenceText]] = {}  # in order of first appearance
        result = ProcessedOutputs()
        for core_output in core_outputs:
            request = core_output.request
            group = groups.setdefault(request.group_id, self._groups[request.group_id])
            if core_output.error is not None:
                _log_failure(request.group_id, core_output.error)
                group.failure = core_output.error
                continue
            try:
                sequence = group.sequences[request.sample_index]
                if sequence.add_tokens(core_output.new_token_ids, core_output.new_logprobs):
                    result.stopped.append(request)
            except Exception as error:  # one request's fault must not take the others down
                _log_failure(request.group_id, error)
                group.failure = error
        for group in groups.values():
            if group.failure is not None:
                del self._groups[group.request_id]
                result.failed.append(group)
                continue
            result.to_schedule_first += reversed(group.deferred)
            group.deferred = []
            result.request_outputs.append(group.output())
            if group.finished:
                del self._groups[group.request_id]
        return result


def _log_failure(group_id: str, error: Exception) -> None:
    """A constraint breaking mid-generation is the client's input (a 400): one line; anything else, a traceback."""
    if isinstance(error, GrammarStateError):
        logger.info("request %s: its output constraint broke: %s", group_id, error)
    else:
        logger.error("request %s failed", group_id, exc_info=error)
