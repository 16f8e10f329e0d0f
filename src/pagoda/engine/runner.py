"""ModelRunner: SchedulerOutput -> flat batch tensors -> model forward -> sampled tokens.

Owns the paged KV cache tensors. Logits are computed only for rows that sample: the last token of a
prefill chunk that reaches the end of the prompt, and every decode.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pagoda.engine.request import Request
from pagoda.engine.sampler import build_sampling_metadata, sample, top_logprobs
from pagoda.engine.scheduler import ScheduledRequest, SchedulerOutput
from pagoda.engine.structured import StructuredOutputs
from pagoda.model.attention import build_metadata
from pagoda.model.llama import LlamaModel

# A chunk of one request's prompt logprobs: (index of the first prompt position covered, logprobs of the
# prompt tokens that follow each covered position).
PromptLogprobsChunk = tuple[int, list[dict[int, float]]]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> new token id
    logprobs: dict[str, dict[int, float]]  # request id -> {chosen id: lp, top ids: lp}, when asked
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)  # by request id


class ModelRunner:
    def __init__(
        self, model: LlamaModel, num_blocks: int, block_size: int, device: str = "cpu",
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.model = model
        self.structured = structured
        # Grammar masks are filled here while the forward runs: step t's mask depends only on tokens known
        # before step t (llguidance releases the GIL while it computes).
        self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar")
        self.block_size = block_size
        self.device = device
        config = model.config
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype, device=device))
            for _ in range(config.num_layers)
        ]
        self.windows = set(config.sliding_windows) or {None}

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = scheduler_output.scheduled
        input_ids = []
        for item in scheduled:
            start = item.request.num_computed_tokens
            input_ids += item.request.all_token_ids[start : start + item.num_tokens]
        sampling_requests = [item.request for item in scheduled if item.samples]
        masks = self._start_grammar_masks(sampling_requests)
        meta = build_metadata(
            query_lens=[item.num_tokens for item in scheduled],
            seq_lens=[item.request.num_computed_tokens + item.num_tokens for item in scheduled],
            block_tables=[item.request.block_ids for item in scheduled],
            block_size=self.block_size,
            windows=self.windows,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            meta.positions.to(self.device),
            self.kv_caches,
            meta,
        )
        prompt_logprobs = self._prompt_logprobs(scheduled, hidden)
        if not sampling_requests:
            return ModelRunnerOutput({}, {}, prompt_logprobs)
        sampling_rows, row = [], 0
        for item in scheduled:
            row += item.num_tokens
            if item.samples:
                sampling_rows.append(row - 1)
        logits = self.model.compute_logits(hidden[torch.tensor(sampling_rows, device=self.device)])
        bitmask = None if masks is None else masks.result()
        result = sample(logits, build_sampling_metadata(sampling_requests, logits.shape[1], bitmask))
        ids = [r.request_id for r in sampling_requests]
        logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None}
        return ModelRunnerOutput(dict(zip(ids, result.token_ids)), logprobs, prompt_logprobs)

    def _start_grammar_masks(self, sampling_requests: list[Request]) -> Future[torch.Tensor] | None:
        """The constrained requests' masks, being filled on the mask thread (None: nobody is constrained)."""
        matchers = [r.grammar for r in sampling_requests if r.grammar is not None]
        if not matchers or self.structured is None:
            return None
        return self._mask_worker.submit(self.structured.fill_bitmask, matchers)

    def _prompt_logprobs(
        self, scheduled: list[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, PromptLogprobsChunk]:
        """For requests that asked: logprobs of each prompt token given the ones before it."""
        result: dict[str, PromptLogprobsChunk] = {}
        row = 0
        for item in scheduled:
            request, start, k = item.request, item.request.num_computed_tokens, item.request.params.prompt_logprobs
            end = min(start + item.num_tokens, request.num_prompt_tokens - 1)  # positions with a next prompt token
            if k is not None and start < end:
                logits = self.model.compute_logits(hidden[row : row + end - start])
                targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], device=logits.device)
                result[request.request_id] = (start, top_logprobs(logits, targets, k))
            row += item.num_tokens
        return result
