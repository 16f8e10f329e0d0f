"""Constrained decoding end to end: every case of the schema suite sampled at temperature 1 gives valid output,
on a random-weight model (where only the grammar can make output valid) and on the demo model; and the
constraint holds through the engine's paths: mixed batches, chunked prefill, preemption, prefix-cache hits,
n > 1, seeds, stop strings and abort.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import torch
from conftest import NEAR_TIE_RTOL, assert_all_blocks_free, random_prompts

from pagoda import LLM, SamplingParams
from pagoda.demo import DEMO_MODEL_DIR
from pagoda.engine.api import RequestOutput, RequestRejected
from pagoda.structured import StructuredOutputsParams
from pagoda.structured.bitmask import allocate_bitmask, apply_bitmask
from pagoda.structured.llguidance_backend import LLGuidanceBackend
from pagoda.testing.schema_suite import ALL_CASES, FORMATS, SCHEMAS, Case, InvalidOutput, SchemaCase, case
from pagoda.text.tokenizer import encode_chat

ARCH = "llama"
SAMPLES_PER_CASE = 16  # seeds per case and model: 45 cases x 16 = 720 requests, one generate call
MIN_COMPLETED = 0.9  # of the samples, finished by their grammar within the case's max_tokens
POINT = case("object_array")  # an array of objects, up to 3 long: a few dozen tokens
ENGINE = {"num_kv_blocks": 4096, "block_size": 16}


@pytest.fixture(scope="module")
def model_dir(checkpoint) -> Path:
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def random_llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **ENGINE)


def constrained(item: Case, **kwargs: object) -> SamplingParams:
    kwargs.setdefault("max_tokens", item.max_tokens)
    return SamplingParams(structured_outputs=item.params(), **kwargs)


def completions(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams]) -> list:
    return [output.outputs[0] for output in llm.generate(prompts, params, use_tqdm=False)]


def check_suite(outputs: list[RequestOutput], cases: list[Case]) -> None:
    """Every completed sample is valid; enough samples complete."""
    invalid, unfinished = [], Counter[str]()
    for output, item in zip(outputs, cases):
        for sample in output.outputs:
            if sample.finish_reason != "stop":
                assert sample.finish_reason == "length"
                unfinished[item.name] += 1
                continue
            try:
                item.check(sample.text)
            except InvalidOutput as error:
                invalid.append(f"{item.name}: {error}")
    assert not invalid, "invalid outputs:\n" + "\n".join(invalid)
    total = sum(len(output.outputs) for output in outputs)
    completed = 1 - sum(unfinished.values()) / total
    assert completed >= MIN_COMPLETED, f"{completed:.0%} completed; unfinished by case: {dict(unfinished)}"


# --------------------------------------------------------------------------------------------------
# The suite: every case, several seeds, temperature 1
# --------------------------------------------------------------------------------------------------


def test_the_suite_uses_only_formats_that_both_sides_check() -> None:
    def formats(node: object) -> set[str]:
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
        own = {node["format"]} if isinstance(node, dict) and "format" in node else set()
        return own.union(*(formats(child) for child in children))

    used = {f for item in ALL_CASES if isinstance(item, SchemaCase) for f in formats(item.schema)}
    assert used == set(FORMATS)
    assert used <= set(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
    assert len({item.name for item in ALL_CASES}) == len(ALL_CASES) and len(SCHEMAS) >= 30


def test_suite_on_a_random_weight_model(random_llm: LLM) -> None:
    cases = [item for item in ALL_CASES for _ in range(SAMPLES_PER_CASE)]
    prompts = random_prompts([4 + i % 9 for i in range(len(cases))], seed=11)
    params = [constrained(item, seed=i) for i, item in enumerate(cases)]
    check_suite(random_llm.generate(prompts, params, use_tqdm=False), cases)


def test_suite_on_the_demo_model() -> None:
    llm = LLM(str(DEMO_MODEL_DIR), num_kv_blocks=2048, block_size=16)
    tokenizer = llm.get_tokenizer()
    cases = [item for item in ALL_CASES for _ in range(SAMPLES_PER_CASE)]
    prompts = [
        encode_chat(tokenizer, [{"role": "user", "content": f"Give me {item.name.replace('_', ' ')}."}])
        for item in cases
    ]
    params = [constrained(item, seed=i) for i, item in enumerate(cases)]
    check_suite(llm.generate(prompts, params, use_tqdm=False), cases)


# --------------------------------------------------------------------------------------------------
# Through the engine's paths
# --------------------------------------------------------------------------------------------------


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(random_llm: LLM) -> None:
    prompts = random_prompts([5, 9, 13, 7], seed=21)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [completions(random_llm, [prompt], plain)[0].token_ids for prompt in prompts]
    # Constrained and plain requests alternate, so the constrained rows are not the batch's first rows.
    items = [POINT, case("format_uuid"), case("string_enum"), POINT]
    batch_prompts = [p for pair in zip(random_prompts([6, 8, 4, 10], seed=22), prompts) for p in pair]
    batch_params = [p for i, item in enumerate(items) for p in (constrained(item, seed=i), plain)]
    mixed = completions(random_llm, batch_prompts, batch_params)
    assert [c.token_ids for c in mixed[1::2]] == alone
    for completion, item in zip(mixed[::2], items):
        assert completion.finish_reason == "stop"
        item.check(completion.text)


def test_seed_reproduces_the_output_whatever_the_batch(random_llm: LLM) -> None:
    prompt = random_prompts([8], seed=3)[0]
    params = constrained(POINT, seed=77)
    first, again = (completions(random_llm, [prompt], params)[0] for _ in range(2))
    noise = random_prompts([6, 10], seed=4)
    crowd = completions(random_llm, [noise[0], prompt, noise[1]], [constrained(POINT), params, constrained(POINT)])
    assert first.token_ids == again.token_ids == crowd[1].token_ids
    others = [completions(random_llm, [prompt], constrained(POINT, seed=seed))[0].text for seed in (1, 2, 3)]
    assert len({first.text, *others}) > 1  # the seed matters


def test_chunked_prefill_gives_the_same_output(model_dir: Path, make_llm, random_llm: LLM) -> None:
    prompts = random_prompts([30, 23, 17], seed=5)
    params = [constrained(POINT, seed=10 + i) for i in range(len(prompts))]
    reference = completions(random_llm, prompts, params)
    chunked = make_llm(model_dir, **ENGINE, max_num_batched_tokens=8)
    assert [c.token_ids for c in completions(chunked, prompts, params)] == [c.token_ids for c in reference]
    for completion in reference:
        POINT.check(completion.text)


def test_preemption_gives_the_same_output(model_dir: Path, make_llm, random_llm: LLM) -> None:
    prompts = random_prompts([12, 10, 14, 9], seed=6)
    params = [constrained(case("nested_object"), seed=20 + i, max_tokens=60) for i in range(len(prompts))]
    reference = completions(random_llm, prompts, params)
    small = make_llm(model_dir, num_kv_blocks=24, block_size=4)  # 96 tokens for four requests of up to 74
    assert [c.token_ids for c in completions(small, prompts, params)] == [c.token_ids for c in reference]
    assert small.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hit_gives_the_same_output(model_dir: Path, make_llm) -> None:
    llm = make_llm(model_dir, num_kv_blocks=256, block_size=4)
    prompt = random_prompts([23], seed=9)[0]
    params = constrained(POINT, seed=5)
    (first,) = llm.generate([prompt], params, use_tqdm=False)
    (second,) = llm.generate([prompt], params, use_tqdm=False)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 20
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    POINT.check(first.outputs[0].text)


def test_n_samples_are_each_valid(random_llm: LLM) -> None:
    item = case("required_fields")
    (output,) = random_llm.generate(random_prompts([6], seed=7), constrained(item, n=6, seed=3), use_tqdm=False)
    assert len(output.outputs) == 6
    check_suite([output], [item])
    assert len({sample.text for sample in output.outputs}) > 1


def test_stop_string_ends_a_constrained_output_early(random_llm: LLM) -> None:
    pattern = r"[a-z]{3}-[0-9]{3}"
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=pattern), stop=["-"], seed=1)
    for completion in completions(random_llm, random_prompts([5, 8, 11], seed=8), params):
        assert completion.finish_reason == "stop" and completion.stop_reason == "-"
        assert len(completion.text) == 3 and completion.text.isalpha(), completion.text


def test_max_tokens_cuts_a_constrained_output(random_llm: LLM) -> None:
    (completion,) = completions(random_llm, random_prompts([5], seed=1), constrained(case("format_uuid"), max_tokens=5))
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    assert completion.text.startswith('"')


def test_abort_mid_generation_frees_every_block(model_dir: Path, make_llm) -> None:
    llm = make_llm(model_dir, **ENGINE)
    engine = llm.engine
    for index, prompt in enumerate(random_prompts([10, 6, 14], seed=12)):
        engine.add_request(f"r{index}", prompt, constrained(POINT, n=2 if index == 1 else 1, seed=index))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.num_running > 0
    engine.abort_request(["r0", "r1", "r2"])
    assert_all_blocks_free(engine)
    # The engine carries on, constrained or not.
    (completion,) = completions(llm, random_prompts([7], seed=13), constrained(POINT, seed=4))
    POINT.check(completion.text)


def test_an_invalid_constraint_is_rejected_and_leaves_nothing_behind(random_llm: LLM) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "array", "uniqueItems": True}))
    with pytest.raises(RequestRejected, match="uniqueItems"):
        random_llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(), bad], use_tqdm=False)
    assert_all_blocks_free(random_llm.engine)


# --------------------------------------------------------------------------------------------------
# Greedy: deterministic, and the reference model's argmax under the same masks
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["required_fields", "string_pattern", "format_ipv4", "capitalized_words", "sentiment"])
def test_greedy_matches_masked_transformers(hf_model, random_llm: LLM, name: str) -> None:
    """transformers' fp32 logits, masked by a fresh matcher of the same grammar at each step, argmax: the same
    tokens as pagoda's greedy constrained output, up to a near-tie (then the comparison stops there)."""
    item = case(name)
    prompt = random_prompts([9], seed=len(name))[0]
    greedy = constrained(item, temperature=0.0)
    completion = completions(random_llm, [prompt], greedy)[0]
    assert completions(random_llm, [prompt], greedy)[0].token_ids == completion.token_ids
    assert completion.finish_reason == "stop", completion.text
    item.check(completion.text)

    tokenizer = random_llm.get_tokenizer()
    eos = list(random_llm.engine.eos_token_ids)
    backend = LLGuidanceBackend(tokenizer, vocab_size=random_llm.engine.model_config.vocab_size, eos_token_ids=eos)
    matcher = backend.compile(item.params()).matcher()
    ids = list(prompt)
    for position, got in enumerate(completion.token_ids):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1:].float()
        bitmask = allocate_bitmask(1, backend.vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask, [0])
        want = int(logits.argmax())
        if got != want:
            gap = abs(logits[0, got].item() - logits[0, want].item())
            assert gap < NEAR_TIE_RTOL * max(1.0, abs(logits[0, want].item())), (position, got, want)
            return
        assert matcher.accept_tokens([want])
        ids.append(want)
    assert matcher.is_terminated()
