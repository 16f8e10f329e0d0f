"""Input processing: a user request's prompt and parameters, checked and made into its sample Requests.

`validate` reads only configuration and compiles into a thread-safe cache, so the server may call it from
any thread before it queues a request; `process_inputs` runs on the engine's thread.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pagoda.config import SchedulerConfig
from pagoda.engine.api import RequestRejected, TenantShare
from pagoda.engine.core.lora import AdapterId
from pagoda.engine.core.request import Request
from pagoda.engine.grammar_masks import StructuredOutputs
from pagoda.engine.parallel_sampling import sample_request_id, sample_seed
from pagoda.sampling import SamplingParams
from pagoda.structured import InvalidConstraint
from pagoda.text.tokenizer import Tokenizer


@dataclass
class ProcessedInputs:
    prompt: str | None  # as the user gave it, when that was text
    samples: list[Request]  # one per `n`, in sample order


class InputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, scheduler_config: SchedulerConfig, vocab_size: int,
        eos_token_ids: tuple[int, ...], structured: StructuredOutputs, seed: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler_config = scheduler_config  # max_model_len as the KV pool clamped it
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.structured = structured
        self._seed_source = random.Random(seed)  # the seeds of requests that give none

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def process_inputs(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
        priority: int = 0, lora: AdapterId | None = None, tenant: TenantShare | None = None,
    ) -> ProcessedInputs:
        """Tokenizes, validates (RequestRejected) and builds the request's samples."""
        prompt_ids, prompt_text = self._tokenize(prompt)
        self.validate(prompt_ids, params, priority)
        constraint = params.structured_outputs
        grammar = None if constraint is None else self.structured.compile(constraint)  # cached by validate
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        samples = [
            Request(
                request_id=sample_request_id(request_id, index, params.n),
                prompt_token_ids=prompt_ids,
                params=params,
                seed=sample_seed(seed, index),
                sample_index=index,
                group_id=request_id,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                cache_salt=cache_salt,
                lora=lora,
                priority=priority,
                tenant=tenant,
                grammar=None if grammar is None else grammar.matcher(),
            )
            for index in range(params.n)
        ]
        return ProcessedInputs(prompt_text, samples)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, as a request made from it has them. Thread-safe."""
        return self._tokenize(prompt)[0]

    def _tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        return list(prompt), None

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raises RequestRejected for a request that can never run. Thread-safe: reads only config, and
        compiles the request's grammar (into a thread-safe cache) so that a bad constraint fails here."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        if params.structured_outputs is not None:  # first: a constraint's fault is named whatever else is wrong
            try:
                self.structured.compile(params.structured_outputs)
            except InvalidConstraint as error:
                raise RequestRejected(str(error), error.param) from error
        if priority != 0 and self.scheduler_config.scheduling_policy != "priority":
            # vLLM's rule: a priority the scheduler would ignore is an error, not a silent no-op.
            raise RequestRejected(f"got priority {priority}, but priority scheduling is not enabled "
                                  "(--scheduling-policy priority)", "priority")
        vocab_size = self.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab_size})")
        for param, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            for token_id in token_ids:
                if not 0 <= token_id < vocab_size:
                    raise RequestRejected(f"token id {token_id} is outside the vocabulary [0, {vocab_size})", param)
        wanted = len(prompt_ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens or 1} for the completion)."
            )
