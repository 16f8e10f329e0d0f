"""Helpers for tests and benchmarks: tiny seeded checkpoints and tokenizers, made rather than downloaded."""

from pagoda.testing.checkpoints import (
    ARCHITECTURES,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    make_checkpoint,
    make_tokenizer,
)

__all__ = ["ARCHITECTURES", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "make_checkpoint", "make_tokenizer"]
