"""The offline API (`LLM.generate`) and LLMEngine's request lifecycle: output shapes, rejection at the
door, the context clamp, prefix caching across calls, and abort returning every block."""

from __future__ import annotations

import json

import pytest
from conftest import assert_all_blocks_free, random_prompts

from pagoda import SamplingParams
from pagoda.engine.api import RequestRejected

ARCH = "llama"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture
def llm(model_dir, make_llm):
    return make_llm(model_dir, num_kv_blocks=64, block_size=4, max_model_len=128)


def test_string_and_token_id_prompts_give_vllm_shaped_outputs(llm):
    tokenizer = llm.get_tokenizer()
    text = "Bai chou sta tra, neck plou."
    ids = tokenizer.encode(text)
    from_text, from_ids = llm.generate([text, ids], GREEDY, use_tqdm=False)

    assert from_text.prompt == text and from_text.prompt_token_ids == ids
    assert from_ids.prompt is None and from_ids.prompt_token_ids == ids
    for output in (from_text, from_ids):
        assert output.finished and len(output.outputs) == 1
        completion = output.outputs[0]
        assert completion.index == 0
        assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert from_text.outputs[0].token_ids == from_ids.outputs[0].token_ids
    assert from_text.request_id != from_ids.request_id


def test_single_prompt_forms(llm):
    ids = random_prompts([5])[0]
    (by_list,) = llm.generate(ids, GREEDY, use_tqdm=False)
    (by_text,) = llm.generate("one prompt", GREEDY, use_tqdm=False)
    assert by_list.prompt_token_ids == ids and by_text.prompt == "one prompt"


def test_vllm_prompt_dicts_are_read_and_anything_else_is_refused(llm):
    ids = random_prompts([5])[0]
    (by_list,) = llm.generate(ids, GREEDY, use_tqdm=False)
    (by_dict,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    by_text, by_text_dict = llm.generate(["one prompt", {"prompt": "one prompt"}], GREEDY, use_tqdm=False)
    assert by_dict.prompt_token_ids == ids and by_dict.outputs[0].token_ids == by_list.outputs[0].token_ids
    assert by_text_dict.prompt == "one prompt" and by_text_dict.outputs[0].token_ids == by_text.outputs[0].token_ids
    with pytest.raises(ValueError, match="got keys \\['prompt_ids'\\]"):
        llm.generate({"prompt_ids": ids}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="got int"):
        llm.generate([ids, 7], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="got set"):
        llm.generate({"a prompt"}, GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm.engine)


def test_outputs_come_back_in_prompt_order_with_per_prompt_params(llm):
    prompts = random_prompts([9, 2, 14, 5], seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 1, 7, 2)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 1, 7, 2]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompts, params[:2], use_tqdm=False)


def test_n_gives_n_outputs(llm):
    (output,) = llm.generate("abc", SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3), use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_too_long_prompt_is_rejected_at_submission_with_both_numbers(llm):
    assert llm.engine.max_model_len == 128
    with pytest.raises(RequestRejected, match=r"128.*130") as rejected:
        llm.generate([list(range(5, 125))], SamplingParams(max_tokens=10), use_tqdm=False)
    assert "120" in str(rejected.value)  # the prompt's own length
    with pytest.raises(RequestRejected, match=r"128.*201"):
        llm.generate([list(range(5, 205))], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # Exactly the context length is fine.
    (output,) = llm.generate([list(range(5, 125))], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8


def test_rejected_batch_leaves_nothing_behind(llm):
    """A batch with one bad prompt fails as a whole, before any request is queued."""
    with pytest.raises(RequestRejected):
        llm.generate([[10, 11, 12], list(range(5, 205))], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests(), "the good prompt of a rejected batch was left queued"


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([10, 512], SamplingParams(), r"\[0, 512\)"),
        ([10], SamplingParams(stop_token_ids=[600]), "600"),
        ([10], SamplingParams(logit_bias={-1: 1.0}), "-1"),
    ],
)
def test_bad_requests_are_rejected(llm, prompt, params, message):
    with pytest.raises(RequestRejected, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused(llm):
    llm.engine.add_request("same", [10, 11], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("same", [12, 13], GREEDY)
    llm.engine.abort_request("same")


def test_max_model_len_is_clamped_to_the_pool(model_dir, make_llm):
    llm = make_llm(model_dir, num_kv_blocks=4, block_size=16, max_model_len=256)
    assert llm.engine.max_model_len == 64
    (output,) = llm.generate([list(range(5, 61))], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    with pytest.raises(RequestRejected, match=r"64.*65"):
        llm.generate([list(range(5, 61))], SamplingParams(max_tokens=9), use_tqdm=False)
    # max_tokens=None: up to the (clamped) context length.
    (output,) = llm.generate([list(range(5, 61))], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8 and output.outputs[0].finish_reason == "length"


def test_max_model_len_capped_by_the_model(model_dir, make_llm):
    llm = make_llm(model_dir, num_kv_blocks=256, block_size=4, max_model_len=4096)
    assert llm.engine.max_model_len == 512  # the checkpoint's max_position_embeddings


def test_a_pool_below_one_block_is_refused(model_dir):
    from pagoda import LLM

    with pytest.raises(ValueError, match="KV cache holds only 8 tokens"):
        LLM(str(model_dir), num_kv_blocks=2, block_size=4)


def test_prefix_cache_serves_a_repeated_prompt(llm):
    prompt = random_prompts([23], seed=9)[0]
    (first,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    (second,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20  # 5 full blocks of 4; the last prompt token is recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_step_streams_cumulative_outputs(llm):
    engine = llm.engine
    engine.add_request("s", [10, 11, 12], GREEDY)
    seen = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.append((len(output.outputs[0].token_ids), output.finished))
    assert seen == [(n, n == 6) for n in range(1, 7)]


def test_abort_running_and_waiting_requests_returns_blocks(model_dir, make_llm):
    llm = make_llm(model_dir, num_kv_blocks=64, block_size=4, max_num_seqs=1)
    engine = llm.engine
    long_run = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("running", random_prompts([10])[0], long_run)
    engine.add_request("waiting", random_prompts([6], seed=4)[0], long_run)
    for _ in range(3):
        engine.step()
    assert engine.scheduler.num_running == 1 and engine.scheduler.num_waiting == 1
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks
    engine.abort_request("running")
    assert engine.scheduler.num_running == 0
    engine.abort_request(["waiting", "never-existed"])
    assert_all_blocks_free(engine)
    # The engine carries on.
    (output,) = llm.generate([[10, 11]], GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 6


def test_abort_a_preempted_request_returns_blocks(model_dir, make_llm):
    llm = make_llm(model_dir, num_kv_blocks=8, block_size=4)  # 32 tokens
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for index, prompt in enumerate(random_prompts([12, 12, 12], seed=8)):
        engine.add_request(f"r{index}", prompt, params)
    while engine.scheduler.num_preemptions == 0:
        engine.step()
    preempted = [r.request_id for r in engine.scheduler.waiting if r.num_preemptions]
    assert preempted
    engine.abort_request(preempted)
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_abort_mid_generation_via_an_n_group(llm):
    engine = llm.engine
    engine.add_request("group", [10, 11, 12], SamplingParams(n=3, max_tokens=30, seed=1))
    engine.step()
    engine.step()
    assert engine.scheduler.num_running == 3
    engine.abort_request("group")
    assert_all_blocks_free(engine)


def test_n_samples_after_the_first_wait_for_its_first_token_then_queue_first_in_order(model_dir, make_llm):
    """With prefix caching, samples 1.. of an n > 1 request find the prompt's blocks cached by sample 0."""
    engine = make_llm(model_dir, num_kv_blocks=64, block_size=4, max_num_seqs=1).engine
    params = SamplingParams(n=3, temperature=1.0, max_tokens=4, ignore_eos=True, seed=2)
    engine.add_request("group", random_prompts([10], seed=5)[0], params)
    engine.add_request("later", random_prompts([6], seed=6)[0], GREEDY)
    assert [r.request_id for r in engine.scheduler.waiting] == ["group#0", "later"]
    engine.step()  # sample 0 computes the prompt and samples its first token
    assert [r.request_id for r in engine.scheduler.waiting] == ["group#1", "group#2", "later"]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().prefix_cache_hits >= 2 * 8  # the two full prompt blocks, for each later sample


def test_a_request_that_fails_is_aborted_reported_once_and_the_others_carry_on(model_dir, make_llm, monkeypatch):
    from pagoda.engine.output_processor import SequenceText

    engine = make_llm(model_dir, num_kv_blocks=64, block_size=4).engine
    add_token = SequenceText.add_token

    def failing_add_token(self, token_id):
        if self.request.group_id == "bad":
            raise RuntimeError("injected fault")
        return add_token(self, token_id)

    monkeypatch.setattr(SequenceText, "add_token", failing_add_token)
    engine.add_request("bad", random_prompts([7], seed=1)[0], SamplingParams(n=2, max_tokens=4, seed=1))
    engine.add_request("good", random_prompts([7], seed=2)[0], GREEDY)
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["good"]
    failures = engine.pop_failures()
    assert list(failures) == ["bad"] and str(failures["bad"]) == "injected fault"
    assert engine.pop_failures() == {}
    engine.add_request("bad", [10, 11], GREEDY)  # the id is free again
    engine.abort_request("bad")
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert [o.request_id for o in outputs] == ["good"] and outputs[0].finished
    assert engine.pop_failures() == {}


def test_async_engine_public_api(model_dir, make_llm):
    import asyncio

    from pagoda.engine.async_engine import AsyncEngine

    engine = make_llm(model_dir, num_kv_blocks=64, block_size=4, max_model_len=128).engine
    async_engine = AsyncEngine(engine)
    try:
        assert async_engine.max_model_len == 128
        with pytest.raises(RequestRejected, match="128"):
            async_engine.validate([10] * 125, GREEDY)  # 125 + 6 tokens
        prompt = random_prompts([12], seed=7)[0]

        async def main() -> tuple[list[int], int]:
            async for output in async_engine.generate("a", prompt, GREEDY):
                last = output
            return last.outputs[0].token_ids, await async_engine.reset_prefix_cache()

        token_ids, forgotten = asyncio.run(main())
        assert len(token_ids) == 6
        assert forgotten == 4  # 12 + 6 - 1 = 17 computed tokens (the last output token never is): 4 full blocks
        assert async_engine.stats.prefix_cache_queries == 12 and async_engine.stats.num_running == 0
    finally:
        async_engine.shutdown()


def test_offline_generate_raises_when_a_request_fails_and_leaves_nothing_running(model_dir, make_llm, monkeypatch):
    from pagoda.engine.output_processor import SequenceText

    llm = make_llm(model_dir, num_kv_blocks=64, block_size=4)
    add_token = SequenceText.add_token

    def failing_add_token(self, token_id):
        if self.request.num_output_tokens == 2 and self.request.prompt_token_ids[0] == 7:
            raise RuntimeError("injected fault")
        return add_token(self, token_id)

    monkeypatch.setattr(SequenceText, "add_token", failing_add_token)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate([[7, 8, 9], [10, 11, 12]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_read_per_step_are_every_weight_but_the_input_table(tied, checkpoint, make_llm):
    model_dir = checkpoint("llama", tie_word_embeddings=tied)
    description = make_llm(model_dir).engine.describe()
    config = json.loads((model_dir / "config.json").read_text())
    # A step indexes the input table; tied, it is read whole as the LM head, and counted once.
    table = 0 if tied else config["vocab_size"] * config["hidden_size"]
    assert description.weight_bytes_read_per_step == 4 * (description.num_parameters - table) > 0
