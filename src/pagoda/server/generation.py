"""One API call's generation: prompts x n choices, merged engine streams, OpenAI-shaped output.

Both /v1/completions and /v1/chat/completions go through `Generation`; only the shape of a choice
differs (`text` vs `message`/`delta`, and the logprobs layout).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagoda.engine.api import CompletionOutput, RequestFailed, RequestOutput
from pagoda.engine.async_engine import AsyncEngine
from pagoda.lora_request import LoRARequest
from pagoda.sampling import SamplingParams
from pagoda.server.admission import WaitingSlots
from pagoda.server.chat_output import ChatOutputFormat, ChoiceReader, ChoiceReading, chat_deltas, reasoning_fields
from pagoda.server.logprobs import TokenTexts, echoed_logprobs, output_logprobs
from pagoda.server.metrics import ServerMetrics
from pagoda.server.tenancy import TenantPass, tenant_share
from pagoda.wire import ERROR_SCOPE_HEADER, REQUEST_SCOPE, Kind, OpenAIError, now, usage

logger = logging.getLogger(__name__)
# What a request's pump puts on the merged queue: (prompt index, an output, an engine failure, or None at its end).
Item = tuple[int, "RequestOutput | Exception | None"]

@dataclass
class ChoiceProgress:
    """What has been sent of one choice so far (streaming sends deltas)."""

    reader: ChoiceReader | None = None  # chat: its text read into reasoning, content and tool calls
    reasoning_length: int = 0  # of the reasoning sent
    text_length: int = 0  # of the content sent (chat with tools: the text that is not a tool call)
    num_tokens: int = 0
    num_tool_calls: int = 0
    started: bool = False  # chat: the first chunk carries the role
    finished: bool = False


@dataclass
class PromptTiming:
    arrival: float
    last_token: float | None = None
    num_tokens: int = 0  # generated so far, over the prompt's n choices


class Generation:
    def __init__(
        self,
        *,
        kind: Kind,
        response_id: str,
        model_name: str,
        engine: AsyncEngine,
        token_texts: TokenTexts,
        metrics: ServerMetrics,
        slots: WaitingSlots,
        prompts: list[list[int]],
        params: SamplingParams,
        echo_texts: list[str] | None = None,
        include_usage: bool = False,
        cache_salt: str | None = None,
        chat_output: ChatOutputFormat | None = None,
        deadline: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tenant: TenantPass | None = None,
    ) -> None:
        self.kind, self.response_id, self.model_name = kind, response_id, model_name
        self.lora_request = lora_request  # the adapter the request's model named (None: the base model)
        self.engine, self.token_text, self.metrics = engine, token_texts, metrics
        self.prompts, self.params = prompts, params
        self.echo_texts = echo_texts
        self.include_usage = include_usage
        self.tenant = tenant  # charged for the prompts now and each token as it comes; its own cache namespace
        self.cache_salt = tenant.start(prompts, cache_salt) if tenant is not None else cache_salt
        self.priority = priority
        self.chat_output = chat_output or ChatOutputFormat()  # chat: which text is reasoning, a tool call
        self.created = now()
        self.finals: dict[int, RequestOutput] = {}
        arrival = time.monotonic()
        self.timings = [PromptTiming(arrival) for _ in prompts]
        self._prompt_logprobs: dict[int, list[dict[int, float] | None]] = {}
        self.deadline = deadline  # time.monotonic() by which the last token must be in
        self._slots = slots
        weakref.finalize(self, slots.release)  # a response that never ran still gives its slots back

    # --- merged engine streams ---------------------------------------------------------------------

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[Item] = asyncio.Queue()

        tenant = tenant_share(self.tenant) if self.tenant is not None else None

        async def pump(index: int, prompt: list[int]) -> None:
            finished = False
            try:
                request_id = f"{self.response_id}-{index}"
                async for output in self.engine.generate(request_id, prompt, self.params, self.cache_salt,
                                                           self.priority, self.lora_request, tenant):
                    self._slots.release(index)
                    finished = output.finished
                    await queue.put((index, output))
            except Exception as error:
                await queue.put((index, error))
            finally:
                self._slots.release(index)
                if not finished:  # cancelled (client gone) or failed
                    for _ in range(self.params.n):
                        self.metrics.request_finished("abort")
                await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(self.prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await self._next(queue)
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise self._internal_error(item) from item
                else:
                    self._observe(index, item)
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()  # a client that went away aborts its requests (AsyncEngine.generate)

    async def _next(self, queue: asyncio.Queue[Item]) -> Item:
        """The next item, or a 504 once the deadline has passed (the caller's cleanup aborts the requests)."""
        if self.deadline is None:
            return await queue.get()
        # Not asyncio.wait_for: before Python 3.12 it swallows a cancellation that lands as the item arrives,
        # and with tokens arriving every few milliseconds a non-streamed request whose client had gone would then
        # run to its end. asyncio.wait never swallows it.
        getter = asyncio.ensure_future(queue.get())
        try:
            done, _ = await asyncio.wait({getter}, timeout=max(self.deadline - time.monotonic(), 0.0))
        finally:
            if not getter.done():
                getter.cancel()
        if getter in done:
            return getter.result()
        logger.info("request %s passed its deadline: aborted", self.response_id)
        raise OpenAIError(504, "the request did not finish within the server's time limit "
                               "(--request-timeout)")

    def _internal_error(self, error: Exception) -> OpenAIError:
        """The client learns that it failed, the id to quote and whether it failed alone; the log has the
        details under that id."""
        alone = isinstance(error, RequestFailed) and error.alone
        headers = {ERROR_SCOPE_HEADER: REQUEST_SCOPE} if alone else None
        if isinstance(error, RequestFailed) and error.by_constraint:  # the engine logged it, in one line
            logger.info("request %s: %s", self.response_id, error)
            constraint = self.params.structured_outputs
            param = (constraint.error_param if constraint is not None else None) or "structured_outputs"
            return OpenAIError(400, f"the output constraint failed while generating ({error}); simplify it, or "
                                    "raise the grammar engine's limits (--grammar-* flags)", param, headers=headers)
        logger.error("request %s failed: %s", self.response_id, error, exc_info=error)
        return OpenAIError(500, f"internal error (request id {self.response_id})", headers=headers)

    def _observe(self, index: int, output: RequestOutput) -> None:
        timing, moment = self.timings[index], time.monotonic()
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[index] = output.prompt_logprobs
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        new_tokens, timing.num_tokens = num_tokens - timing.num_tokens, num_tokens
        if self.tenant is not None:
            self.tenant.charge(new_tokens, "generation")
        if timing.last_token is None:
            self.metrics.ttft.observe(moment - timing.arrival)
            self.metrics.recent.first_token(moment - timing.arrival, len(output.prompt_token_ids), new_tokens)
        else:
            self.metrics.itl.observe(moment - timing.last_token)
            self.metrics.recent.next_tokens(moment - timing.last_token, new_tokens)
        timing.last_token = moment
        if output.finished:
            self.finals[index] = output
            self.metrics.e2e.observe(moment - timing.arrival)
            self.metrics.prompt_tokens.inc(len(output.prompt_token_ids))
            for completion in output.outputs:
                if completion.timeline is not None:
                    self.metrics.observe_timeline(completion.timeline)
                self.metrics.generation_tokens.inc(len(completion.token_ids))
                self.metrics.request_finished(completion.finish_reason or "abort")

    # --- non-streaming -----------------------------------------------------------------------------

    async def response(self) -> dict[str, Any]:
        async for _ in self._outputs():
            pass
        choices = []
        for index in range(len(self.prompts)):
            for completion in self.finals[index].outputs:
                choices.append(self._full_choice(index, completion))
        body = {
            "id": self.response_id,
            "object": "text_completion" if self.kind == "completion" else "chat.completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage(),
        }
        # A prefill replica's answer: where a decode replica pulls the prompt's KV from (one prompt's, vLLM's field).
        transfer = [final.kv_transfer_params for final in self.finals.values() if final.kv_transfer_params]
        if transfer:
            body["kv_transfer_params"] = transfer[0]
        return body

    def _full_choice(self, prompt_index: int, completion: CompletionOutput) -> dict[str, Any]:
        index = prompt_index * self.params.n + completion.index
        logprobs = output_logprobs(self.kind, completion, 0, self.params.logprobs or 0, self.token_text) \
            if completion.logprobs is not None else None
        if logprobs is not None and self.echo_texts:
            logprobs = echoed_logprobs(self.prompts[prompt_index], self._prompt_logprobs.get(prompt_index),
                                       self.params.prompt_logprobs or 0, self.token_text, logprobs)
        if self.kind == "completion":
            prefix = self.echo_texts[prompt_index] if self.echo_texts else ""
            return {"index": index, "text": prefix + completion.text, "logprobs": logprobs,
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
        reading = self.chat_output.reader().read(completion.text, completion.finish_reason is not None)
        content, calls = reading.content, reading.tool_calls
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if self.chat_output.splits_reasoning:
            message.update(reasoning_fields(reading.reasoning or None))
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": _finish_reason(completion.finish_reason, bool(calls)),
                "stop_reason": completion.stop_reason}

    def _usage(self) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for out in self.finals.values() for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in self.finals.values())
        return usage(prompt_tokens, completion_tokens, cached)

    # --- streaming ---------------------------------------------------------------------------------

    async def sse(self) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice that changed, then usage (if asked) and [DONE]."""
        async for chunk in self.chunks():
            yield _event(chunk)
        yield "data: [DONE]\n\n"

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks: one per choice that changed, then usage (if asked); a failure ends it with an
        OpenAI error body (with its scope), as the stream is already under way."""
        progress: dict[tuple[int, int], ChoiceProgress] = {}
        try:
            async for prompt_index, output in self._outputs():
                for completion in output.outputs:
                    key = (prompt_index, completion.index)
                    if key not in progress:
                        progress[key] = ChoiceProgress(self.chat_output.reader() if self.kind == "chat" else None)
                    state = progress[key]
                    for chunk in self._delta_chunks(prompt_index, completion, state):
                        yield chunk
        except OpenAIError as error:
            body = error.body()
            if error.headers and ERROR_SCOPE_HEADER in error.headers:
                body["error"]["scope"] = error.headers[ERROR_SCOPE_HEADER]
            yield body
            return
        if self.include_usage:
            yield self._chunk([], usage=self._usage())

    def _delta_chunks(self, prompt_index: int, completion: CompletionOutput,
                      state: ChoiceProgress) -> list[dict[str, Any]]:
        """What the choice has new since the last chunks: its text (chat: its reasoning, its content and its new
        tool calls, see chat_deltas)."""
        if state.finished:
            return []
        finish = completion.finish_reason
        if state.reader is None:
            reading = ChoiceReading("", completion.text, [])
        else:
            reading = state.reader.read(completion.text, finish is not None)
        content, calls = reading.content, reading.tool_calls
        reasoning = reading.reasoning[state.reasoning_length :]
        text, new_calls = content[state.text_length :], calls[state.num_tool_calls :]
        if not reasoning and not text and not new_calls and finish is None:
            # Nothing to show yet (no token, a character still incomplete, a tag or tool call being written): no
            # empty chunk, and no role-only chat chunk before there is content (clients time TTFT from the
            # first chunk). The held tokens' logprobs go out with the next chunk, from state.num_tokens.
            return []
        logprobs = output_logprobs(self.kind, completion, state.num_tokens, self.params.logprobs or 0,
                                   self.token_text) if completion.logprobs is not None else None
        if self.kind == "completion" and not state.started and self.echo_texts:
            text = self.echo_texts[prompt_index] + text
            if logprobs is not None:
                logprobs = echoed_logprobs(self.prompts[prompt_index], self._prompt_logprobs.get(prompt_index),
                                       self.params.prompt_logprobs or 0, self.token_text, logprobs)
        index = prompt_index * self.params.n + completion.index
        if self.kind == "completion":
            choices = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
        else:
            choices = chat_deltas(index, ChoiceReading(reasoning, text, new_calls), state.num_tool_calls,
                                  state.started)
            choices[0]["logprobs"] = logprobs
            choices[-1]["finish_reason"] = _finish_reason(finish, state.num_tool_calls + len(new_calls) > 0)
        if finish is not None:
            choices[-1]["stop_reason"] = completion.stop_reason
        state.started = True
        state.reasoning_length = len(reading.reasoning)
        state.text_length = len(content)
        state.num_tokens = len(completion.token_ids)
        state.num_tool_calls = len(calls)
        state.finished = finish is not None
        return [self._chunk([choice]) for choice in choices]

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "text_completion" if self.kind == "completion" else "chat.completion.chunk",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk


def _finish_reason(finish_reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's: a choice that ends after calling tools ends with "tool_calls"."""
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
