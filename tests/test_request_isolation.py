"""One request's fault fails that request alone, inside the engine: a grammar that breaks while filling its mask
or while advancing, a mask that allows nothing, a sampler error on its row. The failed request's KV blocks
go back to the pool, and the requests beside it produce exactly what they produce alone (greedy)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import assert_all_blocks_free, random_prompts

from pagoda import SamplingParams
from pagoda.engine import runner as runner_module
from pagoda.structured import StructuredOutputsParams
from pagoda.structured.interface import GrammarMatcher, GrammarStateError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CONSTRAINED = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(
    regex=r"[a-z ]{1,40}"))
PROMPTS = random_prompts([7, 11, 5, 9, 6], seed=11)
FAIL_AT = 3  # the broken matcher's call (fill or accept) that fails: mid-generation, not at its start


class BrokenMatcher:
    """A real matcher that breaks at its FAIL_AT-th fill (`on="fill"`), accept (`on="accept"`), or whose
    mask from then on allows nothing (`on="empty"`)."""

    def __init__(self, inner: GrammarMatcher, on: str) -> None:
        self.inner, self.on, self.calls = inner, on, 0

    def _tick(self, kind: str) -> bool:
        if self.on in (kind, "empty" if kind == "fill" else None):
            self.calls += 1
        return self.calls >= FAIL_AT

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)
        if self._tick("fill"):
            if self.on == "empty":
                bitmask[row] = 0
            elif self.on == "fill":
                raise GrammarStateError("injected: the mask cannot be filled")

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        if self._tick("accept") and self.on == "accept":
            raise GrammarStateError("injected: the matcher cannot advance")
        return self.inner.accept_tokens(tokens)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], broken: dict[str, str] | None = None,
        check_freed: str | None = None):
    """Steps the engine over `requests` until none is left: (finished outputs by id, failures by id).
    broken: request id -> how its matcher breaks. check_freed: a request whose blocks must be back when it fails."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    for request_id, on in (broken or {}).items():
        request = engine.scheduler.requests[request_id]
        request.grammar = BrokenMatcher(request.grammar, on)
    finished, failures = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        failed_now = engine.pop_failures()
        failures.update(failed_now)
        if check_freed in failed_now:
            engine.kv_cache.check_invariants()
            assert check_freed not in engine.kv_cache._blocks
            assert check_freed not in engine.scheduler.requests
    return finished, failures


def alone(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    finished, failures = run(engine, {"alone": (prompt, params)})
    assert not failures
    return finished["alone"]


@pytest.mark.parametrize("on", ["fill", "accept", "empty"])
def test_a_grammar_that_breaks_mid_generation_fails_only_its_request(make_llm, model_dir, on):
    engine = make_llm(model_dir, num_kv_blocks=64, block_size=4, max_model_len=128).engine
    requests = {f"plain-{i}": (PROMPTS[i], GREEDY) for i in range(3)}
    requests["constrained"] = (PROMPTS[3], CONSTRAINED)
    requests["broken"] = (PROMPTS[4], CONSTRAINED)
    expected = {request_id: alone(engine, prompt, params) for request_id, (prompt, params) in requests.items()
                if request_id != "broken"}
    free_at_start = engine.kv_cache.num_free_blocks

    finished, failures = run(engine, requests, broken={"broken": on}, check_freed="broken")

    assert set(failures) == {"broken"}
    assert "injected" in str(failures["broken"]) or on == "empty"
    assert finished == expected  # the others: every token as when each ran alone
    assert engine.kv_cache.num_free_blocks == free_at_start
    assert_all_blocks_free(engine)


def test_a_sampler_error_on_one_row_fails_only_that_request(make_llm, model_dir, monkeypatch):
    engine = make_llm(model_dir, num_kv_blocks=64, block_size=4, max_model_len=128).engine
    requests = {f"plain-{i}": (PROMPTS[i], GREEDY) for i in range(3)}
    requests["constrained"] = (PROMPTS[3], CONSTRAINED)
    expected = {request_id: alone(engine, prompt, params) for request_id, (prompt, params) in requests.items()}
    requests["poison"] = (PROMPTS[4], GREEDY)
    real_build, real_sample = runner_module.build_sampling_metadata, runner_module.sample

    def build(rows, vocab_size, bitmask=None):
        meta = real_build(rows, vocab_size, bitmask)
        meta.poisoned = any(row.request.request_id == "poison" and row.position >= 2 for row in rows)
        return meta

    def sample(logits, meta):
        if meta.poisoned:
            raise RuntimeError("injected: this row cannot be sampled")
        return real_sample(logits, meta)

    monkeypatch.setattr(runner_module, "build_sampling_metadata", build)
    monkeypatch.setattr(runner_module, "sample", sample)
    finished, failures = run(engine, requests, check_freed="poison")

    assert set(failures) == {"poison"} and "injected" in str(failures["poison"])
    assert finished == expected
    assert_all_blocks_free(engine)


def test_a_failure_no_request_can_be_blamed_for_still_fails_the_step(make_llm, model_dir, monkeypatch):
    engine = make_llm(model_dir, num_kv_blocks=64, block_size=4, max_model_len=128).engine

    def sample(logits, meta):
        raise RuntimeError("injected: every row fails")

    monkeypatch.setattr(runner_module, "sample", sample)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    with pytest.raises(RuntimeError, match="every row fails"):
        engine.step()
    engine.abort_request(["a", "b"])
