"""Shared fixtures: tiny checkpoints, cached Hugging Face references, the near-tie comparison, and the
check that every engine gives all its KV blocks back after each test."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from hypothesis import settings

# One thread: on 2 shared cores a second OpenMP thread makes tiny matmuls ~50x slower under contention.
torch.set_num_threads(1)

# Hypothesis: no deadline (2 shared cores make timings noisy); derandomized on CI.
settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# The near-tie rule. Random weights give near-tied logits, and two correct fp32 implementations that sum in
# different orders may then pick different greedy tokens. A divergence is accepted only at a near-tie: the
# two tokens' reference logits differ by less than NEAR_TIE_RTOL * max(1, |logit|).
NEAR_TIE_RTOL = 1e-3
# And only rarely: a test (one architecture in one batching mode, in the correctness suite) may excuse at most
# this many sequences that diverged at a near-tie. A path that rounds differently everywhere would meet ties
# often; its near-ties, each excusable alone, must not add up to a pass. Not zero: each kernel target sums in
# its own order, and one may meet a tie that another does not.
MAX_NEAR_TIES_PER_TEST = 2


# --------------------------------------------------------------------------------------------------
# Engines: every one made through `LLM(...)` is checked after each test for leaked KV blocks.
# --------------------------------------------------------------------------------------------------

_ENGINES: weakref.WeakSet = weakref.WeakSet()


def assert_all_blocks_free(engine) -> None:
    """All KV blocks are back in the pool (cached or empty) and the pool's bookkeeping is consistent."""
    kv_cache = engine.kv_cache
    kv_cache.check_invariants()
    assert not engine.has_unfinished_requests(), (
        f"engine still holds requests: {engine.scheduler.num_running} running, "
        f"{engine.scheduler.num_waiting} waiting"
    )
    assert kv_cache.num_free_blocks == kv_cache.num_blocks, (
        f"{kv_cache.num_blocks - kv_cache.num_free_blocks} of {kv_cache.num_blocks} KV blocks leaked"
    )


def register_engine(engine) -> None:
    _ENGINES.add(engine)


@pytest.fixture(scope="session", autouse=True)
def _every_llm_registered() -> Iterator[None]:
    """Every `LLM(...)` a test makes, through make_llm or not, is registered for the leak check."""
    from pagoda import LLM

    original = LLM.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        register_engine(self.engine)

    LLM.__init__ = init  # type: ignore[method-assign]
    yield
    LLM.__init__ = original  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _kv_blocks_returned():
    """After every test, every engine made through LLM(...) or given to register_engine has freed all blocks."""
    yield
    failures = []
    for engine in list(_ENGINES):
        try:
            assert_all_blocks_free(engine)
        except AssertionError as error:
            _ENGINES.discard(engine)  # reported once, here, not again by every later test
            failures.append(str(error))
    if failures:
        pytest.fail("after the test: " + "\n".join(failures), pytrace=False)


@pytest.fixture
def make_llm() -> Callable:
    """LLM(model_dir, **options), always with an explicit (small) KV pool."""
    from pagoda import LLM

    def make(model_dir: str | Path, **options):
        options.setdefault("num_kv_blocks", 256)
        options.setdefault("block_size", 4)
        return LLM(str(model_dir), **options)

    return make


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """checkpoint(arch, **kwargs) -> the directory of a tiny seeded checkpoint, built once per session."""
    from pagoda.testing import make_checkpoint

    built: dict[tuple, Path] = {}

    def get(arch: str, **kwargs) -> Path:
        key = (arch, json.dumps(kwargs, sort_keys=True, default=str))  # values may be lists and dicts
        if key not in built:
            name = re.sub(r"[^\w=.-]+", "_", "-".join([arch] + [f"{k}={v}" for k, v in sorted(kwargs.items())]))[:80]
            built[key] = make_checkpoint(tmp_path_factory.mktemp(name), arch, **kwargs)
        return built[key]

    return get


# --------------------------------------------------------------------------------------------------
# Hugging Face references
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of one prompt, and its raw fp32 logits at each output position."""

    token_ids: list[int]
    logits: torch.Tensor  # [num_new_tokens, vocab]


@pytest.fixture(scope="session")
def hf_reference() -> Callable[[Path, Sequence[int], int], Reference]:
    """hf_reference(model_dir, prompt_ids, max_new_tokens): fp32 `generate`, one unpadded prompt at a
    time, greedy, no eos stopping. Cached per (model, prompt, length) for the session."""
    import transformers

    transformers.logging.set_verbosity_error()
    models: dict[str, torch.nn.Module] = {}
    cache: dict[tuple, Reference] = {}

    def get(model_dir: Path, prompt_ids: Sequence[int], max_new_tokens: int) -> Reference:
        key = (str(model_dir), tuple(prompt_ids), max_new_tokens)
        if key in cache:
            return cache[key]
        if str(model_dir) not in models:
            models[str(model_dir)] = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32
            ).eval()
        model = models[str(model_dir)]
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
                output_logits=True,
                return_dict_in_generate=True,
            )
        token_ids = out.sequences[0, input_ids.shape[1] :].tolist()
        assert len(token_ids) == max_new_tokens, "transformers stopped early: eos stopping not disabled?"
        logits = torch.cat([step.float() for step in out.logits], dim=0)
        cache[key] = Reference(token_ids, logits)
        return cache[key]

    return get


_near_ties: list[str] = []  # the current test's sequences that diverged at a near-tie


def check_near_tie_count(labels: Sequence[str], cap: int = MAX_NEAR_TIES_PER_TEST) -> None:
    assert len(labels) <= cap, (
        f"{len(labels)} sequences diverged from the reference at near-ties, more than the {cap} one test may "
        "excuse:\n  " + "\n  ".join(labels)
    )


@pytest.fixture(autouse=True)
def _near_ties_capped() -> Iterator[None]:
    """After every test, at most MAX_NEAR_TIES_PER_TEST of its comparisons were excused by the near-tie rule."""
    _near_ties.clear()
    yield
    labels = list(_near_ties)
    _near_ties.clear()
    try:
        check_near_tie_count(labels)
    except AssertionError as error:
        pytest.fail(str(error), pytrace=False)


def compare_with_reference(actual: Sequence[int], reference: Reference, label: str = "") -> int | None:
    """Asserts `actual` equals the reference token for token, up to the near-tie rule.

    At the first position where they differ, the two tokens' reference logits must differ by less than
    NEAR_TIE_RTOL * max(1, |logit|); the comparison of this sequence stops there. Returns that position,
    or None when the sequences are equal. Each near-tie counts against the test's MAX_NEAR_TIES_PER_TEST.
    """
    actual = list(actual)
    expected = reference.token_ids
    for position, (got, want) in enumerate(zip(actual, expected)):
        if got == want:
            continue
        row = reference.logits[position]
        got_logit, want_logit = row[got].item(), row[want].item()
        tolerance = NEAR_TIE_RTOL * max(1.0, abs(want_logit))
        assert abs(got_logit - want_logit) < tolerance, (
            f"{label}: token {position} is {got} (reference logit {got_logit:.6f}), transformers chose "
            f"{want} (logit {want_logit:.6f}); not a near-tie (tolerance {tolerance:.2e}).\n"
            f"  pagoda:       {actual}\n  transformers: {expected}"
        )
        _near_ties.append(f"{label or 'a sequence'} at token {position}")
        return position
    assert len(actual) == len(expected), f"{label}: {len(actual)} tokens, transformers made {len(expected)}"
    return None


def random_prompts(lengths: Sequence[int], vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths over ordinary (non-special) token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(length)] for length in lengths]


# The official client against a module's `server` fixture (the server tests define one per module).
@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    """The served model's id, as /v1/models lists it."""
    return client.models.list().data[0].id
