"""ModelRunner: SchedulerOutput -> flat batch tensors -> model forward -> sampled tokens -> accepted tokens.

`execute_model` is the engine's one call into it, through the executor (engine/executor.py). The forward
itself is a `ModelStep` (engine/model_step.py) that the runner's `StepExecution` runs: on one process, or on
every rank of a model split across processes. Which
of a speculating request's drafts are kept is decided here, once (`accepted_rows`): the output carries
each request's accepted drafts and the target's token after them, which the scheduler only appends.

Logits are computed only for rows that sample: the last token of a
prefill chunk that reaches the end of the prompt, every decode, and a speculating request's last known
token and each of its drafts and alternatives. A speculating request's tokens attend as that many one-token
decodes, each seeing the keys up to its own position (an alternative: the keys before its position and its
own branch slot): every position is then computed exactly as decoding computes it (same path, same
rounding, in every dtype), and a decode-only step stays one for the native decode stack.

With a draft model (engine/draft_model.py), the draft runs over the tokens each step kept, after the target
sampled, so that its KV cache holds the same tokens at the same slots (and its logits give the next step's
first drafts); a sampled request's checked drafts carry the distributions the draft drew them from, for the
sampler's rejection rule.

One request's fault fails that request alone: a grammar that fails to fill its mask, or a row the sampler
cannot sample, is reported in `ModelRunnerOutput.failures` and the step goes on for the others. The same
step, not a rerun without it: every other row's mask and token are computed exactly as they would be
without the failed request (masks row by row, sampling is row-independent), and the forward's K/V for the
failed request lands only in its own blocks, which the engine frees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from pagoda.engine.core.runner_output import ModelRunnerOutput, PromptLogprobsChunk
from pagoda.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from pagoda.engine.core.speculative import accepted_rows
from pagoda.engine.grammar_masks import GrammarMasks, StructuredOutputs
from pagoda.engine.kv_connector.base import KVConnectorWorker
from pagoda.engine.lora_manager import LoRAManager
from pagoda.engine.model_step import ModelStep, StepExecution
from pagoda.engine.pooler import Pooler
from pagoda.engine.sampler import Proposal, SamplerOutput, SampleRow, build_sampling_metadata, sample, top_logprobs
from pagoda.engine.step_trace import StepTrace
from pagoda.model.attention import QueryLayout, slot_of
from pagoda.model.kv_cache import LayerKV


class DraftModel(Protocol):
    """A draft model beside the target (`draft_model.DraftModelProposer`)."""

    def follow(self, scheduled: Sequence[ScheduledRequest], kept: Mapping[str, Sequence[int]]) -> None:
        """Computes the draft's K/V of the tokens the step kept, at their slots (kept: by request id, the
        tokens the step accepted for each request that sampled)."""
        ...

    def proposal(self, request_id: str, index: int, token_id: int) -> Proposal | None:
        """The proposal behind a request's draft number `index`; None where there is no q (greedy)."""
        ...


class ModelRunner:
    def __init__(
        self, execution: StepExecution, structured: StructuredOutputs | None = None, draft: DraftModel | None = None,
        lora: LoRAManager | None = None, trace: StepTrace | None = None,
        kv_connector: KVConnectorWorker | None = None,
    ) -> None:
        """execution: runs each step's ModelStep on the model (on every rank, under tensor parallelism).
        lora: the LoRA adapters, placed in the model's slots before each forward (None: adapters are off).
        trace: the engine's step timeline, which the runner's parts of a step are recorded on.
        kv_connector: the KV connector's worker side, which loads blocks before the forward and saves after."""
        self.execution = execution
        self.trace = trace or StepTrace()
        self.kv_connector = kv_connector
        self.model = execution.model
        self.structured = structured
        self.draft = draft  # None: no draft model (no speculation, or n-gram)
        self.lora = lora
        self.pooler = Pooler()  # embedding requests' pooled states, carried across their prompt's chunks
        # Grammar masks are filled here while the forward runs: step t's mask depends only on tokens known
        # before step t (llguidance releases the GIL while it computes).
        self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar")

    @property
    def kv_caches(self) -> list[LayerKV]:
        return self.execution.kv_caches

    @property
    def block_size(self) -> int:
        return self.execution.block_size

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step: the connector's loads, the forward over the scheduled tokens, sampling, the acceptance of
        drafts, then the connector's saves. A request whose load failed is left out of the step (reported in
        kv_load_failures): the others run exactly as they would without it."""
        metadata = scheduler_output.kv_connector_metadata
        if self.kv_connector is None or metadata is None:
            return self._execute(scheduler_output.scheduled)
        with self.trace.span("kv load"):
            load_failures = self.kv_connector.start_load_kv(metadata)
        scheduled = [item for item in scheduler_output.scheduled if item.request.request_id not in load_failures]
        output = self._execute(scheduled) if scheduled else ModelRunnerOutput()
        with self.trace.span("kv save"):
            self.kv_connector.save_kv(metadata, skip=load_failures)
        output.kv_load_failures = load_failures
        return output

    def _execute(self, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
        with self.trace.span("prepare"):
            rows = self._sample_rows(scheduled)
            masks = self._start_grammar_masks(scheduled)
            prompt_rows = _prompt_logprob_rows(scheduled)
            logits_rows = [item_rows for _, item_rows in prompt_rows] + (
                [_sampling_indices(scheduled)] if rows else [])
            pooling = self.pooler.plan(scheduled)
            step = ModelStep([token_id for item in scheduled for token_id in item.input_token_ids()],
                             _attention_layout(scheduled, self.block_size), logits_rows, pooling.rows)
            if self.lora is not None:
                self.lora.begin_step(scheduled)
        with self.trace.span("forward"):
            all_logits = self.execution.run(step)
        pooled = self.pooler.pool(pooling, all_logits.pop() if pooling.rows else None) if pooling.chunks else {}
        prompt_logprobs = _prompt_logprobs([item for item, _ in prompt_rows], all_logits)
        if not rows:
            if self.draft is not None:
                self.draft.follow(scheduled, {})
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs, pooled=pooled)
        logits = all_logits[-1]
        failures: dict[str, Exception] = {}
        bitmask = None
        if masks is not None:
            future, constrained_ids = masks
            with self.trace.span("grammar masks"):  # computed during the forward: this is the wait left over
                grammar_masks: GrammarMasks = future.result()
            bitmask = grammar_masks.bitmask
            failures.update((constrained_ids[index], error) for index, error in grammar_masks.failures.items())
        with self.trace.span("sample"):
            result = _sample_isolating(logits, rows, bitmask, failures)
        sampled: dict[str, list[int]] = {}
        sampled_logprobs: dict[str, list[dict[int, float]]] = {}
        for row, token_id, row_logprobs in zip(rows, result.token_ids, result.logprobs):
            request_id = row.request.request_id
            sampled.setdefault(request_id, []).append(token_id)
            if row_logprobs is not None:
                sampled_logprobs.setdefault(request_id, []).append(row_logprobs)
        output = ModelRunnerOutput(prompt_logprobs=prompt_logprobs, failures=failures, pooled=pooled)
        for item in scheduled:
            request_id = item.request.request_id
            if request_id not in sampled or request_id in failures:
                continue
            kept_rows = accepted_rows(item.draft_token_ids, item.alternative_token_ids, sampled[request_id])
            output.sampled_token_ids[request_id] = [sampled[request_id][row] for row in kept_rows]
            if request_id in sampled_logprobs:
                output.logprobs[request_id] = [sampled_logprobs[request_id][row] for row in kept_rows]
            if item.alternative_token_ids:
                self._keep_branch(item, kept_rows)
        if self.draft is not None:
            self.draft.follow(scheduled, output.sampled_token_ids)
        return output

    def _keep_branch(self, item: ScheduledRequest, rows: list[int]) -> None:
        """Where an alternative is kept, its K/V moves from its branch's slot to its position's slot (over the
        rejected first draft's)."""
        if len(rows) < 2 or rows[1] == 1:
            return  # the chain's own run
        request, first = item.request, item.request.num_computed_tokens
        source = slot_of(request.block_ids, first + rows[1], self.block_size)
        target = slot_of(request.block_ids, first + 1, self.block_size)
        for kv in self.kv_caches:
            kv.copy_slot(source, target)

    def _sample_rows(self, scheduled: list[ScheduledRequest]) -> list[SampleRow]:
        """The step's rows to sample, in batch order: one per sampled position of each request, each with
        the model draft it checks, if any; then one after each alternative (its output so far: that token)."""
        rows = []
        for item in scheduled:
            if not item.samples:
                continue
            drafts = item.draft_token_ids
            rows += [SampleRow(item.request, drafts[:position], self._proposal(item, position))
                     for position in range(1 + len(drafts))]
            rows += [SampleRow(item.request, [token_id]) for token_id in item.alternative_token_ids]
        return rows

    def _proposal(self, item: ScheduledRequest, position: int) -> Proposal | None:
        drafts = item.draft_token_ids
        if self.draft is None or position >= len(drafts):
            return None
        return self.draft.proposal(item.request.request_id, position, drafts[position])

    def _start_grammar_masks(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[Future[GrammarMasks], list[str]] | None:
        """The constrained rows' masks, being filled on the mask thread, and the constrained requests' ids in
        order (None: nobody is constrained)."""
        constrained = [item for item in scheduled if item.samples and item.request.grammar is not None]
        if not constrained or self.structured is None:
            return None
        matchers = [item.request.grammar for item in constrained if item.request.grammar is not None]
        drafts = [item.draft_token_ids for item in constrained]
        future = self._mask_worker.submit(self.structured.fill_bitmask, matchers, drafts)
        return future, [item.request.request_id for item in constrained]


def _sample_isolating(
    logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None, failures: dict[str, Exception]
) -> SamplerOutput:
    """The batch sampled at once; if that raises, row by row (each row's draw depends on its own row alone,
    so the tokens are the same), and the rows that still fail fail their requests. When every row fails
    alone as well, the fault is not one request's: the batch's error is raised."""
    try:
        return sample(logits, build_sampling_metadata(rows, logits.shape[1], bitmask))
    except Exception as batch_error:
        token_ids: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        row_failures: dict[str, Exception] = {}
        mask_row = 0
        for index, row in enumerate(rows):
            row_mask = None
            if row.request.grammar is not None and bitmask is not None:
                row_mask, mask_row = bitmask[mask_row : mask_row + 1], mask_row + 1
            try:
                one = sample(logits[index : index + 1], build_sampling_metadata([row], logits.shape[1], row_mask))
            except Exception as error:
                row_failures.setdefault(row.request.request_id, error)
                one = SamplerOutput([0], [None])  # a placeholder: the request fails and its tokens are dropped
            token_ids += one.token_ids
            logprobs += one.logprobs
        if len(row_failures) == len({row.request.request_id for row in rows}):
            raise batch_error
        failures.update(row_failures)
        return SamplerOutput(token_ids, logprobs)


def _prompt_logprob_rows(scheduled: list[ScheduledRequest]) -> list[tuple[ScheduledRequest, list[int]]]:
    """The requests that asked for prompt logprobs and have prompt positions in this step, each with the rows of
    the flat batch at those positions (each followed by a prompt token)."""
    result = []
    row = 0
    for item in scheduled:
        request, start = item.request, item.request.num_computed_tokens
        end = min(start + item.num_tokens, request.num_prompt_tokens - 1)  # positions with a next prompt token
        if request.params.prompt_logprobs is not None and start < end:
            result.append((item, list(range(row, row + end - start))))
        row += item.num_tokens
    return result


def _prompt_logprobs(items: list[ScheduledRequest], logits: list[torch.Tensor]) -> dict[str, PromptLogprobsChunk]:
    """For requests that asked: logprobs of each prompt token given the ones before it (logits: each item's
    rows', in order)."""
    result: dict[str, PromptLogprobsChunk] = {}
    for item, item_logits in zip(items, logits):
        request, start, k = item.request, item.request.num_computed_tokens, item.request.params.prompt_logprobs
        assert k is not None
        end = start + item_logits.shape[0]
        targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], device=item_logits.device)
        result[request.request_id] = (start, top_logprobs(item_logits, targets, k))
    return result


def _attention_layout(scheduled: list[ScheduledRequest], block_size: int) -> QueryLayout:
    """The step's attention queries. A speculating request gives one one-token query per position; the
    backend writes the whole step's K/V before any query attends, so each sees the drafts before it. Its
    alternatives come after the drafts: each takes the slot past them that the scheduler allocated for it,
    stands at the first draft's position and sees the keys before that."""
    layout = QueryLayout()
    for item in scheduled:
        start, block_ids = item.request.num_computed_tokens, item.request.block_ids
        num_chain = item.num_tokens - len(item.alternative_token_ids)
        end = layout.add(start, [1] * num_chain if item.draft_token_ids else [num_chain], block_ids,
                         item.request.block_tables[1:])
        for index in range(len(item.alternative_token_ids)):
            layout.add_branch(start + 1, slot_of(block_ids, end + index, block_size), block_ids)
    return layout


def _sampling_indices(scheduled: list[ScheduledRequest]) -> list[int]:
    """Rows of the flat batch whose logits are sampled: each request's last num_samples tokens."""
    indices: list[int] = []
    end = 0
    for item in scheduled:
        end += item.num_tokens
        indices += range(end - item.num_samples, end)
    return indices
