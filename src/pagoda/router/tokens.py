"""A request body's prompt as token ids, rendered and tokenized exactly as a pagoda replica does it (with
--tokenizer), or as pseudo-tokens of its text (without).

The router parses the body with the wire models the server validates with (pagoda.wire) and applies the
model's chat template through the function the server uses (pagoda.text's `render_chat`).
A body the router cannot read routes by load alone; the replica then answers whatever error it deserves.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Protocol

from pydantic import ValidationError

from pagoda.router.policies import RoutedPrompt
from pagoda.text.pool import TokenizerPool
from pagoda.text.tokenizer import render_chat
from pagoda.wire import ChatCompletionRequest, CompletionRequest
from pagoda.wire.responses import ResponsesRequest


class PromptReader(Protocol):
    async def completion(self, body: dict[str, Any]) -> RoutedPrompt: ...

    async def chat(self, body: dict[str, Any]) -> RoutedPrompt: ...


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/responses body as the chat body it is (wire/responses.py), for routing by its prompt; {} (no
    prompt: route by load) when it does not validate. A continuation's earlier turns are the replica's."""
    try:
        return ResponsesRequest.model_validate(body).chat_fields([])
    except (ValidationError, ValueError):
        return {}


def embedding_as_completion(body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/embeddings body as the completion body its `input` would be, for routing by its prompt: both take
    text, token ids or a batch of either, and the replica's prefix cache serves either."""
    return {"prompt": body.get("input"), "model": body.get("model")}


class LoadOnlyReader:
    """No tokenizer: every prompt is unknown, so policies route by load alone."""

    async def completion(self, body: dict[str, Any]) -> RoutedPrompt:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return RoutedPrompt(list(prompt), _cache_salt(body))  # token ids need no tokenizer
        return RoutedPrompt(None, _cache_salt(body))

    async def chat(self, body: dict[str, Any]) -> RoutedPrompt:
        return RoutedPrompt(None, _cache_salt(body))


# Without the model's tokenizer, text stands in for tokens: every CHARS_PER_TOKEN characters of the prompt (a
# chat's tools and messages as canonical JSON) become one pseudo-token, their CRC-32. Prompts that share a text
# prefix then share block hashes in the router's own index, and counts stay near real token counts (English
# runs about 4 characters a token), so that the cost's terms keep their scale.
CHARS_PER_TOKEN = 4


def text_pseudo_tokens(text: str) -> list[int]:
    return [zlib.crc32(text[start : start + CHARS_PER_TOKEN].encode("utf-8", "surrogatepass"))
            for start in range(0, len(text), CHARS_PER_TOKEN)]


def chat_text(body: dict[str, Any]) -> str | None:
    """The conversation as text whose prefix is the earlier turns': tools first, then each message as it was
    sent. None when the body has no list of messages."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    tools = body.get("tools")
    parts = [json.dumps(tools, sort_keys=True)] if tools else []
    parts += [json.dumps(message, sort_keys=True) for message in messages]
    return "\n".join(parts)


class TextPrefixReader:
    """No tokenizer: prompts are matched by their text's prefix (CHARS_PER_TOKEN). Token-id prompts keep their
    ids. The replicas' KV events carry token hashes, which text cannot match."""

    async def completion(self, body: dict[str, Any]) -> RoutedPrompt:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:  # a batch routes as one: by its first prompt
            prompt = prompt if all(isinstance(t, int) for t in prompt) else prompt[0]
        if isinstance(prompt, str):
            return RoutedPrompt(text_pseudo_tokens(prompt), _cache_salt(body))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return RoutedPrompt(list(prompt), _cache_salt(body))
        return RoutedPrompt(None, _cache_salt(body))

    async def chat(self, body: dict[str, Any]) -> RoutedPrompt:
        text = chat_text(body)
        return RoutedPrompt(text_pseudo_tokens(text) if text else None, _cache_salt(body))


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
