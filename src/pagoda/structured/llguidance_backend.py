"""The llguidance grammar engine behind the GrammarBackend interface.

llguidance compiles a grammar when an LLMatcher is constructed, so a compiled grammar here is a pristine
"template" matcher; each request's matcher is its `deep_copy()` (about a microsecond), never a recompile.

Error policy: whatever llguidance cannot honour exactly is an InvalidConstraint, never an approximation.
JSON schemas are compiled with `lenient` forced off (a schema's own "x-guidance" options cannot turn it
on), so unimplemented keywords are errors; any grammar warning (llguidance warns where it approximates,
e.g. oneOf coerced to anyOf) is an error too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import torch

from pagoda.structured.bitmask import allocate_bitmask, bitmask_width
from pagoda.structured.bounds import bounds_problem
from pagoda.structured.interface import GrammarMatcher, GrammarStateError
from pagoda.structured.limits import GrammarLimits, grammar_flag
from pagoda.structured.llguidance_vocab import llguidance_tokenizer
from pagoda.structured.lru import LRUCache
from pagoda.structured.params import CacheKey, ConstraintKind, InvalidConstraint, StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict that exists only in the type stubs

DEFAULT_CACHE_SIZE = 256
# llguidance's messages quote the grammar and parser state; enough to find the fault, not a wall of text.
MAX_ERROR_CHARS = 2000

_WHAT: dict[ConstraintKind, str] = {
    "json": "the JSON schema",
    "json_object": "the JSON object grammar",
    "regex": "the regex",
    "choice": "the choice list",
    "grammar": "the grammar",
}


@dataclass(frozen=True)
class _CompileFailure:
    """A constraint that does not compile: cached like a grammar, so a repeated bad request costs nothing."""

    message: str


class LLGuidanceBackend:
    """Compiles constraints with llguidance for one tokenizer and one model; grammars cached in an LRU.

    Thread-safe: `compile` may be called from several threads at once. Build one per tokenizer: building
    llguidance's tokenizer walks the whole vocabulary.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        any_whitespace: bool = False,
        limits: GrammarLimits | None = None,
        mask_threads: int | None = None,
    ) -> None:
        """hf_tokenizer: a fast transformers tokenizer. vocab_size: the model's (its logits' width), which may
        exceed the tokenizer's; ids past the tokenizer are never allowed. eos_token_ids: every id the engine
        stops on; the grammar allows them exactly where it may end. any_whitespace: JSON may put any
        whitespace between tokens (llguidance's default; a model may then pad with newlines until max_tokens)
        rather than one line with Python's separators, ", " and ": " (what models write most).
        limits: llguidance's bounds on grammar size and per-step work, the compile timeout (which bounds the
        work in time too, whatever the machine's load) and pagoda's rule bounds (`bounds.py`), all checked
        before a grammar is cached. mask_threads: workers for `fill_bitmasks` (None: llguidance's default).
        """
        if not eos_token_ids:
            raise ValueError("eos_token_ids must not be empty: a grammar needs a token that ends it")
        # llguidance refuses an n_vocab below the tokenizer's own size; a model smaller than its tokenizer
        # just never produces the extra ids, so the mask may be wider than its logits.
        self._vocab_size = max(vocab_size, len(hf_tokenizer))
        self._tokenizer = llguidance_tokenizer(hf_tokenizer, self._vocab_size, list(eos_token_ids))
        self._eos_token_ids = frozenset(eos_token_ids)
        self._limits = limits or GrammarLimits()
        self._cache: LRUCache[CacheKey, LLGuidanceGrammar | _CompileFailure] = LRUCache(
            cache_size, self._limits.cache_chars, weight=lambda key: len(key[1]))
        self._json_options: JsonCompileOptions = (
            {"whitespace_flexible": True} if any_whitespace
            else {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        # The stub checks the unpacked ints against every keyword, the bool ones too.
        self._llparser_limits = llguidance.LLParserLimits(
            **self._limits.llparser_limits(), verbose_errors=False)  # type: ignore[arg-type]
        self._mask_threads = mask_threads
        self._executor: llguidance.LLExecutor | None = None
        self._executor_lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (for tests and tools: decode, tokenize_str)."""
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        key = params.cache_key()
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._cache.put_if_absent(key, self._compile_within_timeout(params))
        if isinstance(compiled, _CompileFailure):
            raise InvalidConstraint(params.param_for(params.kind), compiled.message)
        return compiled

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Fill the rows of several matchers in parallel (llguidance's thread pool, the GIL released).

        Same result as each matcher's fill_bitmask; each matcher at most once. Raises GrammarStateError,
        with `rows` naming the failed rows, after writing every row.
        """
        if not rows:
            return
        _check_bitmask(bitmask, bitmask_width(self._vocab_size))
        if not bitmask.is_contiguous():
            raise ValueError("fill_bitmasks needs a contiguous bitmask")
        for _, row in rows:
            _check_row(bitmask, row)
        matchers = [(_as_llguidance_matcher(matcher), row) for matcher, row in rows]
        self._get_executor().unsafe_compute_mask_ptr(
            [(matcher.llmatcher, row) for matcher, row in matchers],
            bitmask.data_ptr(),
            bitmask.shape[1] * bitmask.element_size(),
            bitmask.shape[0],
        )
        failed = [(row, matcher.error_message()) for matcher, row in matchers if matcher.llmatcher.is_error()]
        if failed:
            raise GrammarStateError(failed[0][1], rows=tuple(row for row, _ in failed))

    def _get_executor(self) -> llguidance.LLExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(self._mask_threads)
            return self._executor

    def _compile_within_timeout(self, params: StructuredOutputsParams) -> LLGuidanceGrammar | _CompileFailure:
        """Compile on a helper thread and stop waiting after the timeout.

        llguidance cannot be interrupted, so a compile that times out finishes in the background (its work
        is bounded by `limits`) and is dropped; it is not cached, as the next try may be on a quieter machine.
        """
        outcome: list[LLGuidanceGrammar | _CompileFailure | BaseException] = []

        def compile_into_outcome() -> None:
            try:
                outcome.append(self._compile(params))
            except BaseException as error:  # handed to the waiting thread, which re-raises it
                outcome.append(error)

        worker = threading.Thread(target=compile_into_outcome, name="grammar-compile", daemon=True)
        worker.start()
        timeout = self._limits.compile_timeout_s
        worker.join(timeout)
        if not outcome:
            raise InvalidConstraint(
                params.param_for(params.kind),
                f"{_WHAT[params.kind]} took longer than {timeout:g} s to compile (compile_timeout_s, "
                f"{grammar_flag('compile_timeout_s')})",
            )
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar | _CompileFailure:
        what = _WHAT[params.kind]
        problem = bounds_problem(params, self._limits)
        if problem is not None:
            return _CompileFailure(problem)
        try:
            # The matcher constructor reports a bad grammar as an error state, but the grammar text's
            # builders raise on some inputs (a schema nested past serde's recursion limit): either way the
            # constraint's fault.
            template = llguidance.LLMatcher(self._tokenizer, self._grammar_text(params), log_level=0,
                                            limits=self._llparser_limits)
        except Exception as error:
            return _CompileFailure(_truncate(f"{what} cannot be compiled: {error}"))
        if template.is_error():
            return _CompileFailure(_truncate(f"{what} cannot be compiled: {template.get_error()}"))
        warnings = template.get_grammar_warnings()
        if warnings:
            return _CompileFailure(_truncate(f"{what} uses unsupported features: {'; '.join(warnings)}"))
        grammar = LLGuidanceGrammar(params.cache_key(), template, self._vocab_size, self._eos_token_ids)
        return self._first_mask_failure(grammar, what) or grammar

    def _first_mask_failure(self, grammar: LLGuidanceGrammar, what: str) -> _CompileFailure | None:
        """Some grammars compile and then fail, or allow nothing, at their very first mask ($ref cycles):
        computed here, on a copy, so that such a constraint is refused at the door and not in a step."""
        bitmask = allocate_bitmask(1, self._vocab_size)
        try:
            grammar.matcher().fill_bitmask(bitmask, 0)
        except GrammarStateError as error:
            return _CompileFailure(_truncate(f"{what} fails at its first token: {error}"))
        if not bitmask.any():
            return _CompileFailure(f"{what} allows no first token")
        return None

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        """The constraint in a form LLMatcher takes: Lark text or llguidance's JSON grammar envelope."""
        kind, text = params.kind, params.canonical_text
        if kind == "json":
            return self._json_grammar(text)
        if kind == "json_object":
            return self._json_grammar('{"type": "object"}')
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return _choice_grammar(params.choice or ())
        return _lark_wrapped(text)

    def _json_grammar(self, schema_text: str) -> str:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema_text, defaults=self._json_options, overrides={"lenient": False}
        )


class LLGuidanceGrammar:
    """A compiled constraint: a matcher at the start of the grammar, copied for each request."""

    def __init__(
        self, key: CacheKey, template: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self._key = key
        self._template = template  # never advanced: only ever deep-copied
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids

    @property
    def key(self) -> CacheKey:
        return self._key

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._vocab_size, self._eos_token_ids)


class LLGuidanceMatcher:
    """One sample's progress through its grammar. Not thread-safe (llguidance raises on concurrent use).

    Invariant: `num_accepted_tokens` = tokens llguidance has consumed + EOS tokens accepted after the end.
    The latter exist because llguidance's batch consume refuses EOS once the grammar has ended, while an
    engine that samples past the end (the mask then allows only EOS) still hands those EOS tokens back.
    """

    def __init__(self, llmatcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.llmatcher = llmatcher  # the backend's batched fill hands it to llguidance directly
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._num_consumed = 0
        self._num_eos_after_end = 0

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_consumed + self._num_eos_after_end

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        tokens = list(tokens)
        consumed, eos_after_end = self._consume_allowed_prefix(tokens)
        if consumed + eos_after_end < len(tokens):
            self._undo(consumed)
            return False
        self._num_consumed += consumed
        self._num_eos_after_end += eos_after_end
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        # Consume and undo rather than llguidance's validate_tokens, so that the answer is exactly
        # what accept_tokens would take (EOS after the end included).
        consumed, eos_after_end = self._consume_allowed_prefix(list(tokens))
        self._undo(consumed)
        return consumed + eos_after_end

    def rollback(self, num_tokens: int) -> None:
        # llguidance enters its (permanent) error state when asked to roll back too far: refuse first.
        if not 0 <= num_tokens <= self.num_accepted_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted_tokens} accepted")
        from_eos = min(num_tokens, self._num_eos_after_end)
        self._num_eos_after_end -= from_eos
        from_grammar = num_tokens - from_eos
        if from_grammar:
            self.llmatcher.rollback(from_grammar)
            self._raise_if_error()
            self._num_consumed -= from_grammar

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # llguidance writes through a raw pointer: every check below guards memory, not just correctness.
        _check_bitmask(bitmask, bitmask_width(self._vocab_size))
        _check_row(bitmask, row)
        target = bitmask[row]
        self.llmatcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        self._raise_if_error()

    def is_accepting(self) -> bool:
        accepting = self.llmatcher.is_accepting()
        self._raise_if_error()
        return accepting

    def is_terminated(self) -> bool:
        self._raise_if_error()
        return self.llmatcher.is_stopped()

    def error_message(self) -> str:
        """llguidance's reason for the error state, shortened; empty when there is no error."""
        return _truncate(self.llmatcher.get_error())

    def _consume_allowed_prefix(self, tokens: list[int]) -> tuple[int, int]:
        """Consume the longest allowed prefix of `tokens`: (tokens llguidance consumed, EOS after the end).

        Ids outside the vocabulary end the prefix here: llguidance would enter its error state on them.
        """
        in_vocab = next((i for i, token in enumerate(tokens) if not 0 <= token < self._vocab_size), len(tokens))
        consumed = self.llmatcher.try_consume_tokens(tokens[:in_vocab])
        self._raise_if_error()
        eos_after_end = 0
        if self.llmatcher.is_stopped():
            for token in tokens[consumed:in_vocab]:
                if token not in self._eos_token_ids:
                    break
                eos_after_end += 1
        return consumed, eos_after_end

    def _undo(self, consumed: int) -> None:
        if consumed:
            self.llmatcher.rollback(consumed)
            self._raise_if_error()

    def _raise_if_error(self) -> None:
        if self.llmatcher.is_error():
            raise GrammarStateError(self.error_message())


def _as_llguidance_matcher(matcher: GrammarMatcher) -> LLGuidanceMatcher:
    if not isinstance(matcher, LLGuidanceMatcher):
        raise TypeError(f"expected an LLGuidanceMatcher, got {type(matcher).__name__}")
    return matcher


def _check_bitmask(bitmask: torch.Tensor, width: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError(
            f"bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
        )
    if bitmask.shape[1] != width or bitmask.stride(1) != 1:
        raise ValueError(
            f"bitmask rows must be {width} contiguous words, got shape {tuple(bitmask.shape)} "
            f"with strides {bitmask.stride()}"
        )


def _check_row(bitmask: torch.Tensor, row: int) -> None:
    if not 0 <= row < bitmask.shape[0]:
        raise IndexError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")


def _truncate(message: str) -> str:
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


def _lark_wrapped(lark: str) -> str:
    """A Lark grammar in llguidance's JSON envelope: bare text starting with "{" would be read as JSON."""
    return json.dumps({"grammars": [{"lark_grammar": lark}]})


def _choice_grammar(choices: Sequence[str]) -> str:
    # JSON string literals are Lark string literals (escapes included); ensure_ascii=False keeps characters
    # outside the BMP whole rather than as surrogate-pair escapes.
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in dict.fromkeys(choices))
    return _lark_wrapped(f"start: {alternatives}")
