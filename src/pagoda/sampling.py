"""SamplingParams: the user's knobs, with vLLM's names. Validated once, at the door."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.kv_transfer_params import KVTransferParams
from pagoda.structured.params import StructuredOutputsParams

# Rows with temperature below this are greedy: argmax, no randomness at all.
GREEDY_EPS = 1e-5
MAX_SEED = 2**63 - 1  # seeds travel as int64 tensors


class InvalidParam(ValueError):
    """A parameter out of its range. `param` names it, for OpenAI's error body, and the message starts with it."""

    def __init__(self, param: str, requirement: str) -> None:
        super().__init__(f"{param} {requirement}")
        self.param = param
        self.requirement = requirement

    def renamed(self, param: str) -> InvalidParam:
        """The same error under the name the caller gave the parameter (a request field, say)."""
        return InvalidParam(param, self.requirement)


# vLLM's default, and OpenAI's for legacy completions (chat completions default to the context's room).
DEFAULT_MAX_TOKENS = 16


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per output position, besides the chosen token's
    prompt_logprobs: int | None = None  # the same for prompt positions (computes the whole prompt)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # Output constrained to a JSON schema, regex, choice or grammar (vLLM's name and shape).
    structured_outputs: StructuredOutputsParams | None = None
    # Prefill/decode disaggregation (vLLM's field, kv_transfer_params.py): keep the prompt's KV for a decode
    # replica, or pull it from a prefill replica.
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """Each parameter's range, checked here only: the server builds SamplingParams from every request,
        and on top keeps only OpenAI's own caps (wire/)."""

        def check(ok: bool, name: str, requirement: str) -> None:
            if not ok:
                raise InvalidParam(name, f"{requirement}, got {getattr(self, name)!r}")

        check(self.n >= 1, "n", "must be at least 1")
        check(self.temperature >= 0.0, "temperature", "must be non-negative")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "top_k", "must be 0 or -1 (disabled) or at least 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1")
        check(self.min_tokens >= 0, "min_tokens", "must be non-negative")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens ({self.max_tokens})",
        )
        check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs", "must be in [0, 20]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        check(all(s for s in self.stop), "stop", "must not contain empty strings")
        biases = (self.logit_bias or {}).values()
        check(all(-100.0 <= bias <= 100.0 for bias in biases), "logit_bias", "values must be in [-100, 100]")
        check(self.seed is None or 0 <= self.seed <= MAX_SEED, "seed", f"must be in [0, {MAX_SEED}]")
