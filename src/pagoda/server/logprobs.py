"""Logprobs in OpenAI's two layouts: completions' (tokens, token_logprobs, top_logprobs keyed by text,
text_offset) and chat's (content entries with bytes and top_logprobs), and `echo`'s prompt logprobs before a
completion's. Token texts come from TokenTexts, decoded once per id on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagoda.engine.api import CompletionOutput, best_logprobs
from pagoda.text.tokenizer import Tokenizer
from pagoda.wire import Kind


class TokenTexts:
    """Each token id's text on its own, decoded once per id. Logprobs ask for the same ids over and over (every
    token, its offsets, its top-k alternatives), on the event loop: a lookup instead of a decode each time.
    Used from the event loop only, with the event loop's own tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def echoed_logprobs(prompt_ids: list[int], prompt_logprobs: list[dict[int, float] | None] | None, k: int,
                    decode: Callable[[int], str], completion_logprobs: dict[str, Any]) -> dict[str, Any]:
    """echo: the prompt's tokens come first, the first one without a logprob (nothing precedes it)."""
    prompt_logprobs = prompt_logprobs or [None] * len(prompt_ids)
    tokens = [decode(t) for t in prompt_ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens + completion_logprobs["tokens"],
        "token_logprobs": [lp[t] if lp else None for t, lp in zip(prompt_ids, prompt_logprobs)]
        + completion_logprobs["token_logprobs"],
        "top_logprobs": [{decode(i): v for i, v in best_logprobs(lp, k)} if lp else None
                         for lp in prompt_logprobs] + completion_logprobs["top_logprobs"],
        "text_offset": offsets + [o + offset for o in completion_logprobs["text_offset"]],
    }


def output_logprobs(kind: Kind, completion: CompletionOutput, start: int, k: int,
                    decode: Callable[[int], str]) -> dict[str, Any]:
    """The logprobs of the completion's tokens from `start` on, in the route's layout; k alternatives each."""
    token_ids = completion.token_ids[start:]
    positions = (completion.logprobs or [])[start:]
    if kind == "completion":
        offset = len(completion.text) - sum(len(decode(t)) for t in token_ids)
        offsets = []
        for token_id in token_ids:
            offsets.append(max(offset, 0))
            offset += len(decode(token_id))
        return {
            "tokens": [decode(t) for t in token_ids],
            "token_logprobs": [lp[t] for t, lp in zip(token_ids, positions)],
            "top_logprobs": [_by_text(best_logprobs(lp, k), decode) for lp in positions],
            "text_offset": offsets,
        }

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(t, lp[t]), "top_logprobs": [entry(i, v) for i, v in best_logprobs(lp, k)]}
        for t, lp in zip(token_ids, positions)
    ]}


def _by_text(pairs: list[tuple[int, float]], decode: Callable[[int], str]) -> dict[str, float]:
    """Completions key top logprobs by text; two ids with the same text keep the better logprob."""
    result: dict[str, float] = {}
    for token_id, logprob in pairs:
        result.setdefault(decode(token_id), logprob)
    return result
