"""A request body's prompt as token ids, rendered and tokenized exactly as a pagoda replica does it.

The router parses the body with the wire models the server validates with (pagoda.wire) and applies the
model's chat template through the function the server uses (pagoda.text's `render_chat`).
A body the router cannot read routes by load alone; the replica then answers whatever error it deserves.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import ValidationError

from pagoda.router.policies import RoutedPrompt
from pagoda.text.pool import TokenizerPool
from pagoda.text.tokenizer import render_chat
from pagoda.wire import ChatCompletionRequest, CompletionRequest


class PromptReader(Protocol):
    async def completion(self, body: dict[str, Any]) -> RoutedPrompt: ...

    async def chat(self, body: dict[str, Any]) -> RoutedPrompt: ...


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


class LoadOnlyReader:
    """No tokenizer: every prompt is unknown, so policies route by load alone."""

    async def completion(self, body: dict[str, Any]) -> RoutedPrompt:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return RoutedPrompt(list(prompt), _cache_salt(body))  # token ids need no tokenizer
        return RoutedPrompt(None, _cache_salt(body))

    async def chat(self, body: dict[str, Any]) -> RoutedPrompt:
        return RoutedPrompt(None, _cache_salt(body))


class TokenizingReader:
    def __init__(self, tokenizers: TokenizerPool) -> None:
        self.tokenizers = tokenizers

    async def completion(self, body: dict[str, Any]) -> RoutedPrompt:
        try:
            request = CompletionRequest.model_validate(body)
            first = request.prompts()[0]  # a batch routes as one: by its first prompt
        except (ValidationError, ValueError, IndexError):
            return RoutedPrompt(None, _cache_salt(body))
        if isinstance(first, str):
            text = first
            token_ids = await self.tokenizers.run(lambda t: list(t.encode(text, add_special_tokens=True)))
        else:
            token_ids = list(first)
        return RoutedPrompt(token_ids, request.cache_salt)

    async def chat(self, body: dict[str, Any]) -> RoutedPrompt:
        try:
            request = ChatCompletionRequest.model_validate(body)
            conversation = [message.for_template() for message in request.messages]
            tools = request.tool_dicts() if request.tools and request.resolved_tool_choice() != "none" else None
        except (ValidationError, ValueError):
            return RoutedPrompt(None, _cache_salt(body))
        add_generation_prompt = request.add_generation_prompt

        def tokenize(tokenizer: Any) -> list[int] | None:
            try:
                text = render_chat(tokenizer, conversation, add_generation_prompt, tools)
            except ValueError:  # the template refuses the conversation: the replica will say why
                return None
            return list(tokenizer.encode(text, add_special_tokens=False))  # the template wrote them

        return RoutedPrompt(await self.tokenizers.run(tokenize), request.cache_salt)
