"""Tokenization, chat templating and detokenization of request inputs, off the event loop.

A long prompt takes seconds to tokenize; on the event loop that would stall every route, /health included.
HF tokenizers release the GIL while they encode, so worker threads keep the loop free; but one tokenizer
instance is not safe to use from two threads at once, so each worker takes an instance of its own from
a small pool of copies.
"""

from __future__ import annotations

import asyncio
import copy
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

_T = TypeVar("_T")

DEFAULT_POOL_SIZE = 4  # concurrent tokenizations; a copy of a tokenizer is a few MB


class TokenizerPool:
    def __init__(self, tokenizer: Any, size: int = DEFAULT_POOL_SIZE) -> None:
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(size):
            self._idle.put(copy.deepcopy(tokenizer))
        # As many threads as copies: a thread that runs always finds an idle copy.
        self._executor = ThreadPoolExecutor(size, thread_name_prefix="pagoda-tokenizer")

    async def run(self, function: Callable[[Any], _T]) -> _T:
        """function(tokenizer) on a worker thread, with a tokenizer no other thread is using."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._with_tokenizer, function)

    def _with_tokenizer(self, function: Callable[[Any], _T]) -> _T:
        tokenizer = self._idle.get_nowait()
        try:
            return function(tokenizer)
        finally:
            self._idle.put(tokenizer)
