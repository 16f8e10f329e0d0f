"""A request's input as token ids, before any engine work: prompt characters bounded, text tokenized on the
tokenizer pool, a chat rendered through the model's template (OpenAIError 400 for what cannot be)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagoda.text.tokenizer import ChatTemplateError, render_chat
from pagoda.wire import ChatMessage, OpenAIError

if TYPE_CHECKING:
    from pagoda.server.state import LoadedModel, ServerState


def check_prompt_chars(state: ServerState, loaded: LoadedModel, num_chars: int, param: str) -> None:
    """A prompt of more characters than max_model_len tokens can plausibly hold is refused before it is
    tokenized: tokenizing megabytes takes seconds, only to find that it does not fit."""
    max_model_len = loaded.engine.max_model_len
    limit = int(max_model_len * state.limits.max_chars_per_token)
    if num_chars > limit:
        raise OpenAIError(400, f"{param} has {num_chars} characters: more than this model's maximum context "
                               f"length ({max_model_len} tokens) can hold (at most {limit} characters are "
                               f"accepted)", param)


async def encode_prompts(loaded: LoadedModel, inputs: list[str | list[int]]) -> list[list[int]]:
    """Token ids for every prompt: text prompts tokenized on the pool, id prompts as given."""
    texts = [p for p in inputs if isinstance(p, str)]
    if not texts:
        return [list(p) for p in inputs if not isinstance(p, str)]
    encoded = iter(await loaded.tokenizers.run(
        lambda tokenizer: [list(tokenizer.encode(text, add_special_tokens=True)) for text in texts]))
    return [next(encoded) if isinstance(p, str) else list(p) for p in inputs]


async def echo_texts(loaded: LoadedModel, inputs: list[str | list[int]]) -> list[str]:
    """echo: each prompt as the user gave it, token-id prompts decoded (on the pool)."""
    return await loaded.tokenizers.run(
        lambda tokenizer: [p if isinstance(p, str) else tokenizer.decode(p) for p in inputs])


def conversation_of(state: ServerState, loaded: LoadedModel,
                    messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them; their text already bounded like a prompt's."""
    try:
        conversation = [m.for_template() for m in messages]
    except ValueError as error:  # a content part that is not text
        raise OpenAIError(400, f"cannot apply the chat template: {error}", "messages") from error
    check_prompt_chars(state, loaded, sum(len(m["content"]) for m in conversation), "messages")
    return conversation


async def render_chat_prompt(state: ServerState, loaded: LoadedModel, conversation: list[dict[str, Any]],
                       add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
                       template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The conversation through the chat template, then tokenized: both on the pool. The rendered text is
    bounded like any prompt before it is tokenized (tool definitions and the template add to it)."""

    def render(tokenizer: Any) -> list[int] | OpenAIError:
        try:
            text = render_chat(tokenizer, conversation, add_generation_prompt, tools, template_kwargs)
        except ChatTemplateError as error:  # no template, or the template rejects the conversation
            return OpenAIError(400, str(error), "messages")
        try:
            check_prompt_chars(state, loaded, len(text), "messages")
        except OpenAIError as error:
            return error
        # The template writes its own special tokens, so encoding adds none.
        return list(tokenizer.encode(text, add_special_tokens=False))

    result = await loaded.tokenizers.run(render)
    if isinstance(result, OpenAIError):
        raise result
    return result
