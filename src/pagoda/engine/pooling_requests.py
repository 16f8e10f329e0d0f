"""Embedding requests on the engine's side (the pooling runner): checked and made into Requests at submission,
held until their prompt is computed, then answered with one EmbeddingRequestOutput.

An engine runs one runner, as vLLM's does: a pooling engine refuses generate requests, a generate engine
refuses embedding requests, each with a RequestRejected that says which runner it is and how to get the other.
"""

from __future__ import annotations

from pagoda.config import SchedulerConfig
from pagoda.engine.api import EmbeddingOutput, EmbeddingRequestOutput, RequestRejected
from pagoda.engine.core.request import Request
from pagoda.engine.core.scheduler import EngineCoreOutput
from pagoda.pooling import PoolingConfig, PoolingParams
from pagoda.sampling import SamplingParams
from pagoda.text.tokenizer import Tokenizer

NOT_A_POOLING_ENGINE = ("this model runs the generate runner, which does not embed: start it with --runner pooling "
                        "(LLM(..., runner=\"pooling\")) to serve it as an embedding model")
NOT_A_GENERATE_ENGINE = ("this model runs the pooling runner (--runner pooling): it embeds (/v1/embeddings, "
                         "LLM.embed) and does not generate")
# An embedding request's sampling parameters are never read (it never samples); one value for all of them.
_NO_SAMPLING = SamplingParams(max_tokens=1)


class PoolingRequests:
    def __init__(self, tokenizer: Tokenizer, scheduler_config: SchedulerConfig, vocab_size: int,
                 config: PoolingConfig | None) -> None:
        """config: the model's pooling; None for a generate engine, which refuses embedding requests."""
        self.tokenizer = tokenizer
        self.scheduler_config = scheduler_config
        self.vocab_size = vocab_size
        self.config = config
        self._requests: dict[str, Request] = {}  # submitted, not yet finished or aborted
        self.failures: dict[str, Exception] = {}  # failed since the engine last popped them

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def validate(self, prompt_ids: list[int], params: PoolingParams) -> None:
        """Raises RequestRejected for an embedding request that can never run. Reads only config: thread-safe."""
        config = self.config
        if config is None:
            raise RequestRejected(NOT_A_POOLING_ENGINE, "model")
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")
        max_len = self.scheduler_config.max_model_len
        if len(prompt_ids) > max_len:
            raise RequestRejected(f"This model's maximum context length is {max_len} tokens. However, you requested "
                                  f"{len(prompt_ids)} tokens in the input for embedding generation.")
        try:
            config.check_dimensions(params.dimensions)
        except ValueError as error:
            raise RequestRejected(str(error), "dimensions") from error

    def add(self, request_id: str, prompt: str | list[int], params: PoolingParams, cache_salt: str | None = None,
            priority: int = 0) -> Request:
        """The request to schedule, checked (RequestRejected)."""
        prompt_ids = (self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str)
                      else list(prompt))
        self.validate(prompt_ids, params)
        assert self.config is not None
        request = Request(request_id=request_id, prompt_token_ids=prompt_ids, params=_NO_SAMPLING, seed=0,
                          max_model_len=self.scheduler_config.max_model_len, cache_salt=cache_salt,
                          priority=priority, pooling=self.config.resolve(params))
        self._requests[request_id] = request
        return request

    def pop(self, request_id: str) -> Request | None:
        return self._requests.pop(request_id, None)

    def take_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[
            list[EmbeddingRequestOutput], list[Request], list[EngineCoreOutput]]:
        """This step's embeddings, the embedding requests that failed (to abort; their errors in `failures`),
        and the core outputs that are not embedding requests'."""
        if not self._requests:
            return [], [], core_outputs
        embeddings: list[EmbeddingRequestOutput] = []
        failed: list[Request] = []
        others: list[EngineCoreOutput] = []
        for core_output in core_outputs:
            request = self._requests.pop(core_output.request.request_id, None)
            if request is None:
                others.append(core_output)
            elif core_output.error is not None:
                self.failures[request.request_id] = core_output.error
                failed.append(request)
            elif core_output.pooled is not None:
                embeddings.append(EmbeddingRequestOutput(
                    request.request_id, request.prompt_token_ids, EmbeddingOutput(core_output.pooled),
                    num_cached_tokens=request.num_cached_tokens, timeline=request.timeline()))
        return embeddings, failed, others
