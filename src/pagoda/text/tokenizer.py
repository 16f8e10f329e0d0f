"""The model directory's own tokenizer (tokenizer.json + tokenizer_config.json with its chat template): what
of it the engine and the server use, how it is loaded, and the one place a chat template is applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from pagoda.model_dir import ModelLoadError


class Tokenizer(Protocol):
    """What the runtime and the server use of a Hugging Face tokenizer."""

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> str: ...

    def __len__(self) -> int: ...  # the vocabulary's size, added tokens included


def has_tokenizer(model_dir: str | Path) -> bool:
    model_dir = Path(model_dir)
    return (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file()


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not has_tokenizer(model_dir):
        raise ModelLoadError(f"{model_dir / 'tokenizer.json'}: file not found (pagoda needs the model's tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as error:  # transformers raises many types; the message must name the directory
        raise ModelLoadError(f"{model_dir}: cannot load tokenizer ({error})") from error


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: no template, or the template rejects it (the caller's fault)."""


# apply_chat_template's own arguments: a request's template variables may not override them.
RENDERER_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation as the model's own chat template writes it: the one place a template is applied.
    tools: OpenAI tool definitions, for templates that describe them to the model. template_kwargs: extra
    variables the template may read (vLLM's chat_template_kwargs; callers refuse RENDERER_ARGUMENTS)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
            **(template_kwargs or {}),
        )
        return str(text)
    except Exception as error:  # jinja's raise_exception, unknown roles: the conversation's fault
        raise ChatTemplateError(f"cannot apply the chat template: {error}") from error


def encode_chat(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """render_chat's token ids. The template writes its own special tokens, so encoding adds none."""
    text = render_chat(tokenizer, messages, add_generation_prompt, tools)
    return list(tokenizer.encode(text, add_special_tokens=False))
