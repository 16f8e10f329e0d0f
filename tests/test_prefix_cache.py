"""Automatic prefix caching, end to end through the engine and property-based on KVCacheManager.

Engine scenarios run every workload twice, on an engine with prefix caching and on one without, and
hold both to `transformers` with the near-tie rule (conftest.compare_with_reference): a cache hit changes
the prefill's shape, so the two runs may differ only where the reference itself is at a near-tie.
Chosen-token logprobs must agree within fp32 tolerance up to that point. Each scenario also asserts that
the hits really happened (exact token counts) and that they did not happen where they must not.

The property-based half drives KVCacheManager through random admit / chunk / decode / preempt / finish /
reset sequences against a shadow copy of what each KV slot holds, so that handing out a block that is
still in use, or serving a hit whose KV was written for other tokens, shows up as a wrong slot.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest
from conftest import compare_with_reference, random_prompts
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pagoda import SamplingParams
from pagoda.engine.core import kv_cache as kv_cache_module
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.request import FinishReason, Request, RequestStatus

ARCH = "llama"
BLOCK_SIZE = 4
MAX_NEW_TOKENS = 12
LOGPROB_ATOL = 1e-4  # fp32: the same logits through a differently shaped prefill
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=2)
_request_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture
def engines(model_dir, make_llm):
    """make(**options) -> (cached, uncached): two engines on the same weights, differing only in caching."""

    made = []

    def make(**options):
        options = {"num_kv_blocks": 256, "block_size": BLOCK_SIZE, "max_model_len": 128, **options}
        pair = (make_llm(model_dir, **options), make_llm(model_dir, enable_prefix_caching=False, **options))
        made.append(pair[1])
        return pair

    yield make
    for uncached in made:  # caching off means no hit, ever
        assert uncached.engine.scheduler.prefix_cache_hits == 0


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def generate(llm, prompts: Sequence[list[int]], params: SamplingParams = GREEDY, cache_salt: str | None = None):
    """All prompts added at once (one batch), stepped to the end; outputs in prompt order."""
    engine = llm.engine
    ids = []
    for prompt in prompts:
        request_id = f"r{next(_request_ids)}"
        engine.add_request(request_id, list(prompt), params, cache_salt=cache_salt)
        ids.append(request_id)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[request_id] for request_id in ids]


def assert_same_as_uncached(model_dir, hf_reference, cached, uncached, label: str) -> None:
    """Both runs equal transformers up to a near-tie, hence each other; logprobs agree up to there."""
    assert len(cached) == len(uncached)
    for index, (on, off) in enumerate(zip(cached, uncached)):
        assert on.prompt_token_ids == off.prompt_token_ids
        assert len(on.outputs) == len(off.outputs)
        for on_sample, off_sample in zip(on.outputs, off.outputs):
            reference = hf_reference(model_dir, on.prompt_token_ids, len(off_sample.token_ids))
            where = f"{label}/prompt {index}/sample {on_sample.index}"
            tie_off = compare_with_reference(off_sample.token_ids, reference, f"{where} (caching off)")
            tie_on = compare_with_reference(on_sample.token_ids, reference, f"{where} (caching on)")
            agreed = min(p for p in (tie_on, tie_off, len(off_sample.token_ids)) if p is not None)
            assert on_sample.token_ids[:agreed] == off_sample.token_ids[:agreed]
            if on_sample.logprobs is None:
                continue
            for position in range(agreed):
                token = off_sample.token_ids[position]
                assert on_sample.logprobs[position][token] == pytest.approx(
                    off_sample.logprobs[position][token], abs=LOGPROB_ATOL
                ), f"{where}: logprob of token {position}"


def computed_sequence(output, sample: int = 0) -> list[int]:
    """The tokens whose KV a finished request computed: its prompt and all but its last output token."""
    return list(output.prompt_token_ids) + list(output.outputs[sample].token_ids[:-1])


def expected_hit_tokens(prompt: Sequence[int], computed: Sequence[Sequence[int]], block_size: int = BLOCK_SIZE) -> int:
    """Prompt tokens the cache can serve, nothing evicted: full blocks of the longest common prefix with
    something computed before, never the prompt's last token."""
    best = 0
    for sequence in computed:
        common = 0
        while common < min(len(sequence), len(prompt)) and sequence[common] == prompt[common]:
            common += 1
        best = max(best, min(common, len(sequence) // block_size * block_size))
    return min(best, len(prompt) - 1) // block_size * block_size


def fresh_tokens(count: int, avoid: Sequence[int], seed: int) -> list[int]:
    """`count` random token ids whose first one differs from avoid[0] (so a shared prefix ends exactly)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(5, 512) for _ in range(count)]
    while avoid and tokens[0] == avoid[0]:
        tokens[0] = rng.randrange(5, 512)
    return tokens


def cached_tokens(outputs) -> list[int]:
    return [output.num_cached_tokens for output in outputs]


# --------------------------------------------------------------------------------------------------
# Engine scenarios: caching on == caching off, and the hits are where they should be
# --------------------------------------------------------------------------------------------------


def test_identical_prompts(engines, model_dir, hf_reference):
    cached, uncached = engines()
    prompt = random_prompts([18], seed=11)[0]
    first = generate(cached, [prompt])
    assert cached_tokens(first) == [0], "a fresh engine has nothing cached"
    again = generate(cached, [prompt])
    assert cached_tokens(again) == [16], "all full blocks but the one holding the last prompt token"
    both = generate(cached, [prompt, prompt])
    assert cached_tokens(both) == [16, 16]
    assert cached.engine.scheduler.prefix_cache_hits == 16 * 3
    assert cached.engine.scheduler.prefix_cache_queries == 18 * 4

    reference_run = generate(uncached, [prompt])
    assert cached_tokens(reference_run) == [0]
    for outputs in (first, again, both[:1], both[1:]):
        assert_same_as_uncached(model_dir, hf_reference, outputs, reference_run, "identical")


@pytest.mark.parametrize("shared_len", [10, 12], ids=["ends-mid-block", "ends-on-boundary"])
def test_shared_prefix(engines, model_dir, hf_reference, shared_len):
    cached, uncached = engines()
    base = random_prompts([22], seed=12)[0]
    other = base[:shared_len] + fresh_tokens(9, base[shared_len:], seed=shared_len)
    # The same blocks after a different first token: chained hashes must not hit any of them.
    other_start = fresh_tokens(1, base, seed=99) + base[1:]
    prompts = [base, other, other_start]

    outputs = [generate(cached, [prompt])[0] for prompt in prompts]
    assert cached_tokens(outputs) == [0, shared_len // BLOCK_SIZE * BLOCK_SIZE, 0]
    assert_same_as_uncached(model_dir, hf_reference, outputs, generate(uncached, prompts), "shared prefix")


@pytest.mark.parametrize("short_first", [True, False], ids=["short-then-long", "long-then-short"])
def test_prompt_that_is_a_prefix_of_another(engines, model_dir, hf_reference, short_first):
    cached, uncached = engines()
    long = random_prompts([21], seed=13)[0]
    short = long[:13]
    order = [short, long] if short_first else [long, short]
    first = generate(cached, [order[0]])[0]
    second = generate(cached, [order[1]])[0]
    assert first.num_cached_tokens == 0
    # The short prompt's 3 full blocks serve the long one; the long one serves the short one up to its
    # last token (13 tokens: 3 blocks). The short run's own output tokens fill its 4th block, which the
    # long prompt continues differently.
    assert second.num_cached_tokens == 12 == expected_hit_tokens(order[1], [computed_sequence(first)])
    assert_same_as_uncached(model_dir, hf_reference, [first, second], generate(uncached, order), "prefix of")


def chat_ids(tokenizer, conversation) -> list[int]:
    """What the server feeds the engine for a chat request."""
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_multi_turn_chat_hits_up_to_where_the_history_is_retokenized_differently(engines, model_dir, hf_reference):
    cached, uncached = engines()
    tokenizer = cached.get_tokenizer()
    turn1 = [{"role": "user", "content": "Tell me a story about a fox."}]
    ids1 = chat_ids(tokenizer, turn1)
    (answer1,) = generate(cached, [ids1])
    assert answer1.num_cached_tokens == 0

    # Turn 2 re-renders the history: the assistant's text goes back through the tokenizer, which need
    # not give back the generated ids (here random bytes merge differently).
    turn2 = turn1 + [{"role": "assistant", "content": answer1.outputs[0].text},
                     {"role": "user", "content": "And then?"}]
    ids2 = chat_ids(tokenizer, turn2)
    history = computed_sequence(answer1)
    first_difference = next(i for i, (a, b) in enumerate(zip(history, ids2)) if a != b)
    assert first_difference >= len(ids1), "turn 2 starts with all of turn 1's prompt"
    (answer2,) = generate(cached, [ids2])
    assert answer2.num_cached_tokens == first_difference // BLOCK_SIZE * BLOCK_SIZE > 0
    assert answer2.num_cached_tokens == expected_hit_tokens(ids2, [history])

    # A client that sends the history as the generated ids (completions API) hits its decode blocks too.
    ids3 = ids1 + answer1.outputs[0].token_ids + tokenizer.encode("And then?", add_special_tokens=False)
    (answer3,) = generate(cached, [ids3])
    assert answer3.num_cached_tokens == len(history) // BLOCK_SIZE * BLOCK_SIZE > len(ids1)

    assert_same_as_uncached(model_dir, hf_reference, [answer1, answer2, answer3],
                            generate(uncached, [ids1, ids2, ids3]), "multi-turn")


def test_cache_salt_separates_tenants(engines, model_dir, hf_reference):
    cached, uncached = engines()
    prompt = random_prompts([18], seed=14)[0]
    runs = [(salt, generate(cached, [prompt], cache_salt=salt)[0]) for salt in ("a", "b", "a", "b", None, None, "a")]
    assert [output.num_cached_tokens for _, output in runs] == [0, 0, 16, 16, 0, 16, 16], (
        "no hit across salts (or between a salt and none), hits within one"
    )
    reference_run = generate(uncached, [prompt], cache_salt="a")
    for salt, output in runs:
        assert_same_as_uncached(model_dir, hf_reference, [output], reference_run, f"salt {salt}")


def test_eviction_under_a_small_pool_keeps_the_first_blocks(engines, model_dir, hf_reference):
    # 10 blocks of 4: a 20 + 8 token request takes 7, so the next one must evict 2 of its blocks.
    cached, uncached = engines(num_kv_blocks=10, max_model_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    first_prompt, other_prompt = random_prompts([20, 20], seed=15)
    first = generate(cached, [first_prompt], params)[0]
    other = generate(cached, [other_prompt], params)[0]
    again = generate(cached, [first_prompt], params)[0]
    assert cached_tokens([first, other, again]) == [0, 0, 12], (
        "the 3 never-used blocks go first, then the first request's last blocks (its 7th and 6th, then "
        "5th, 4th): its first 3 blocks survive, its 4th (still a full prompt block) does not"
    )
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_same_as_uncached(model_dir, hf_reference, [first, other, again],
                            [generate(uncached, [p], params)[0] for p in (first_prompt, other_prompt, first_prompt)],
                            "eviction")


def record_admissions(monkeypatch, llm) -> list[tuple[str, RequestStatus, int]]:
    """(request id, status before admission, hit tokens) for each successful admission from the queue."""
    kv_cache, admissions = llm.engine.kv_cache, []
    original = kv_cache.allocate_slots

    def allocate_slots(request, num_new_tokens, computed_blocks=()):
        result = original(request, num_new_tokens, computed_blocks)
        if result is not None and request.status != RequestStatus.RUNNING:
            admissions.append((request.request_id, request.status, len(computed_blocks) * BLOCK_SIZE))
        return result

    monkeypatch.setattr(kv_cache, "allocate_slots", allocate_slots)
    return admissions


def test_preempted_requests_find_their_blocks_again(engines, model_dir, hf_reference, monkeypatch):
    # 20 blocks of 4: four requests sharing a 16-token prefix need 4 + 4 * 6 blocks at their longest. (With
    # 16 the running requests take a victim's own blocks as soon as it frees them: nothing left to find.)
    cached, uncached = engines(num_kv_blocks=20, max_model_len=64)
    admissions = record_admissions(monkeypatch, cached)
    prefix = random_prompts([16], seed=16)[0]
    prompts = [prefix + tail for tail in random_prompts([6, 6, 6, 6], seed=17)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    generate(cached, prompts[:1], params)  # the shared prefix is cached before the batch arrives
    outputs = generate(cached, prompts, params)

    scheduler = cached.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert cached_tokens(outputs) == [20, 16, 16, 16]
    readmissions = [(status, hits) for _, status, hits in admissions if status == RequestStatus.PREEMPTED]
    assert readmissions, "no preempted request came back"
    assert all(hits >= 16 for _, hits in readmissions), "a preempted request lost its shared prefix"
    assert any(hits > 22 for _, hits in readmissions), "no preempted request found its own decoded blocks"
    # The counters include the re-admissions' hits.
    assert scheduler.prefix_cache_hits == 20 + 16 * 3 + sum(hits for _, hits in readmissions)

    reference_runs = generate(uncached, prompts, params)
    assert uncached.engine.scheduler.num_preemptions > 0
    assert_same_as_uncached(model_dir, hf_reference, outputs, reference_runs, "preemption")


def test_chunked_prefill_hits_blocks_of_a_prompt_still_being_prefilled(engines, model_dir, hf_reference, monkeypatch):
    # 7 tokens a step: the first prompt takes 5 steps, and its blocks are cached chunk by chunk.
    cached, uncached = engines(max_num_batched_tokens=7)
    prefix = random_prompts([24], seed=18)[0]
    prompts = [prefix + tail for tail in random_prompts([6, 10, 10], seed=19)]
    steps = []
    original = cached.engine.scheduler.schedule

    def schedule():
        output = original()
        steps.append([(s.request.num_computed_tokens, s.num_tokens, s.request.num_prompt_tokens)
                      for s in output.scheduled])
        return output

    monkeypatch.setattr(cached.engine.scheduler, "schedule", schedule)
    outputs = generate(cached, prompts)  # all at once: nothing was cached when they arrived
    assert cached_tokens(outputs) == [0, 24, 24]
    # Some request resumed after its hits in a chunk that did not finish its prompt.
    assert any(computed == 24 and computed + num_tokens < num_prompt
               for step in steps for computed, num_tokens, num_prompt in step)
    assert max(sum(num_tokens for _, num_tokens, _ in step) for step in steps) <= 7
    assert_same_as_uncached(model_dir, hf_reference, outputs, generate(uncached, prompts), "chunked")


def test_n_samples_share_the_prompt(engines, model_dir, hf_reference):
    cached, uncached = engines()
    prompt = random_prompts([18], seed=20)[0]
    greedy_n = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=2, n=3)
    (on,) = generate(cached, [prompt], greedy_n)
    scheduler = cached.engine.scheduler
    assert scheduler.prefix_cache_hits == 2 * 16, "the two later samples each hit the first one's 4 blocks"
    assert scheduler.prefix_cache_queries == 3 * 18
    (off,) = generate(uncached, [prompt], greedy_n)
    assert uncached.engine.scheduler.prefix_cache_queries == 3 * 18
    assert len({tuple(sample.token_ids) for sample in on.outputs}) == 1
    assert_same_as_uncached(model_dir, hf_reference, [on], [off], "n=3 greedy")

    # Seeded sampling: siblings draw the same tokens whether their prompt was computed or served.
    sampled_n = SamplingParams(temperature=0.8, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, n=2, seed=7)
    (on_sampled,) = generate(cached, [prompt], sampled_n)
    (off_sampled,) = generate(uncached, [prompt], sampled_n)
    assert [s.token_ids for s in on_sampled.outputs] == [s.token_ids for s in off_sampled.outputs]
    assert on_sampled.num_cached_tokens == 16  # the prompt was cached by the greedy run
    assert scheduler.prefix_cache_hits == 2 * 16 + 2 * 16


def test_prompt_logprobs_compute_the_whole_prompt(engines, model_dir, hf_reference):
    cached, uncached = engines()
    prompt = random_prompts([18], seed=21)[0]
    with_prompt_logprobs = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    (fresh,) = generate(cached, [prompt], with_prompt_logprobs)  # computes and caches the prompt
    (plain,) = generate(cached, [prompt])
    assert plain.num_cached_tokens == 16, "a prompt-logprobs request's blocks are cached for others"
    hits_before = cached.engine.scheduler.prefix_cache_hits
    (again,) = generate(cached, [prompt], with_prompt_logprobs)
    assert again.num_cached_tokens == 0 and cached.engine.scheduler.prefix_cache_hits == hits_before, (
        "cached prompt tokens have no logits: the prompt must be computed again"
    )
    (off,) = generate(uncached, [prompt], with_prompt_logprobs)
    for output in (fresh, again):
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            token = prompt[position]
            assert output.prompt_logprobs[position][token] == pytest.approx(
                off.prompt_logprobs[position][token], abs=LOGPROB_ATOL
            )
    assert_same_as_uncached(model_dir, hf_reference, [fresh, again], [off, off], "prompt logprobs")


def test_reset_prefix_cache(engines):
    cached, _ = engines()
    prompt = random_prompts([18], seed=22)[0]
    generate(cached, [prompt])
    kv_cache = cached.engine.kv_cache
    assert kv_cache.reset_prefix_cache() == (18 + MAX_NEW_TOKENS - 1) // BLOCK_SIZE, "every full block forgotten"
    assert kv_cache.num_free_blocks == kv_cache.num_blocks
    assert cached_tokens(generate(cached, [prompt])) == [0]
    assert cached_tokens(generate(cached, [prompt])) == [16]
    assert kv_cache.reset_prefix_cache() > 0 and kv_cache.reset_prefix_cache() == 0


# --------------------------------------------------------------------------------------------------
# KVCacheManager, property-based: allocate / share / free / evict against a shadow of the KV slots
# --------------------------------------------------------------------------------------------------

PROPERTY_BLOCK_SIZE = 2
PROPERTY_NUM_BLOCKS = 12
ALPHABET = st.integers(0, 2)  # few distinct tokens: blocks repeat, hashes and hits are common
STEMS = [[], [0, 1, 0, 1], [0, 1, 0, 2, 2], [1, 1, 1, 1, 1, 1]]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Plays the scheduler's part over a small pool, writing a shadow KV: slot -> the tokens it was computed
    for (the token and every token before it, since a KV entry depends on its whole prefix).

    After every rule, every computed position of every live request must read back its own prefix: a
    block handed out while in use, or a hit on a block holding other tokens, breaks that. New blocks must
    come off the free list in LRU order (a request's last blocks are released first); the model of that
    order is kept here, from what the manager returns.
    """

    check_full_prefix = True  # with a colliding hash only the block's own tokens are promised

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(PROPERTY_NUM_BLOCKS, PROPERTY_BLOCK_SIZE)
        self.slots: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix its KV was computed for
        self.lru: list[int] = list(range(PROPERTY_NUM_BLOCKS))  # free blocks, next to be taken first
        self.running: list[Request] = []
        self.waiting: list[Request] = []  # preempted, or not admitted for want of room
        self.num_requests = 0
        self.num_hits = 0

    # --- what the scheduler would do --------------------------------------------------------------

    def _admit(self, request: Request, chunk: int) -> None:
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens == len(hits) * PROPERTY_BLOCK_SIZE <= request.num_tokens - 1
        for index, block in enumerate(hits):
            assert block.block_hash is not None, "a hit on a block that is not cached"
            self._assert_block_holds(block.block_id, request.all_token_ids, index)
        num_tokens = min(request.num_tokens - num_hit_tokens, chunk)
        in_use = {b.block_id for b in self.manager.pool.blocks if b.ref_count > 0}
        num_free = self.manager.num_free_blocks
        if self.manager.allocate_slots(request, num_tokens, hits) is None:
            assert self.manager.num_free_blocks == num_free and request.block_ids == []
            self.waiting.append(request)
            return
        for block in hits:
            if block.block_id in self.lru:
                self.lru.remove(block.block_id)  # a hit on a free block revives it
        self._check_new_blocks(request.block_ids[len(hits):], in_use)
        self.num_hits += num_hit_tokens
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._compute(request, num_tokens)

    def _check_new_blocks(self, new_blocks: list[int], in_use: set[int]) -> None:
        assert in_use.isdisjoint(new_blocks), "a block still in use was handed out"
        assert new_blocks == self.lru[: len(new_blocks)], "new blocks are not the least recently used"
        del self.lru[: len(new_blocks)]

    def _compute(self, request: Request, num_tokens: int) -> None:
        for position in range(request.num_computed_tokens, request.num_computed_tokens + num_tokens):
            block_id = request.block_ids[position // PROPERTY_BLOCK_SIZE]
            slot = block_id * PROPERTY_BLOCK_SIZE + position % PROPERTY_BLOCK_SIZE
            self.slots[slot] = tuple(request.all_token_ids[: position + 1])
        request.num_computed_tokens += num_tokens
        self.manager.cache_full_blocks(request)

    def _release(self, request: Request) -> None:
        blocks = list(request.block_ids)
        self.manager.free(request)
        for block_id in reversed(blocks):  # last blocks first: they are evicted first
            if self.manager.pool.blocks[block_id].ref_count == 0:
                self.lru.append(block_id)
        self.running.remove(request)

    def _assert_block_holds(self, block_id: int, tokens: list[int], index: int) -> None:
        """Block `block_id` holds the KV of tokens' block `index` (and, if cached, says so)."""
        block = self.manager.pool.blocks[block_id]
        start = index * PROPERTY_BLOCK_SIZE
        if block.block_hash is not None:  # a full block whose content is cached elsewhere has no hash
            assert block.token_ids == tuple(tokens[start : start + PROPERTY_BLOCK_SIZE]), "other tokens"
        for offset in range(PROPERTY_BLOCK_SIZE):
            written = self.slots.get(block_id * PROPERTY_BLOCK_SIZE + offset)
            if self.check_full_prefix:
                assert written == tuple(tokens[: start + offset + 1]), f"block {block_id} holds other KV"
            else:
                assert written is not None and written[-1] == tokens[start + offset]

    # --- rules ------------------------------------------------------------------------------------

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(ALPHABET, max_size=6), salt=st.sampled_from([None, "t"]),
          chunk=st.integers(1, 9))
    def admit(self, stem, tail, salt, chunk):
        prompt = (stem + tail) or [0]
        self.num_requests += 1
        request = Request(request_id=f"r{self.num_requests}", prompt_token_ids=prompt,
                          params=SamplingParams(max_tokens=64), seed=0, max_model_len=1024, cache_salt=salt)
        self._admit(request, chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 9), token=ALPHABET)
    def advance(self, data, chunk, token):
        """A prefill chunk, or a decode step (a sampled token, then its KV slot). No room: preempt it."""
        request = data.draw(st.sampled_from(self.running))
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(token)
        num_tokens = min(request.num_tokens - request.num_computed_tokens, chunk)
        in_use = {b.block_id for b in self.manager.pool.blocks if b.ref_count > 0}
        held = list(request.block_ids)
        if self.manager.allocate_slots(request, num_tokens) is None:
            request.status = RequestStatus.PREEMPTED
            self._release(request)
            request.num_computed_tokens = 0
            self.waiting.append(request)
            return
        assert request.block_ids[: len(held)] == held, "a block table only grows"
        self._check_new_blocks(request.block_ids[len(held):], in_use)
        self._compute(request, num_tokens)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def readmit(self, data, chunk):
        request = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(request)
        self._admit(request, chunk)  # back on the waiting list if there is still no room

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        request = data.draw(st.sampled_from(self.running))
        request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
        self._release(request)

    @rule()
    def reset_prefix_cache(self):
        self.manager.reset_prefix_cache()
        for block in self.manager.pool.blocks:
            assert block.block_hash is None or block.ref_count > 0, "a free block kept its hash"

    # --- invariants -------------------------------------------------------------------------------

    @invariant()
    def accounting(self):
        self.manager.check_invariants()
        in_use = sum(1 for block in self.manager.pool.blocks if block.ref_count > 0)
        assert in_use + self.manager.num_free_blocks == PROPERTY_NUM_BLOCKS
        assert sorted(self.lru) == sorted(i for i, b in enumerate(self.manager.pool.blocks) if b.ref_count == 0)

    @invariant()
    def every_computed_slot_holds_its_own_tokens(self):
        for request in self.running:
            assert len(request.block_ids) * PROPERTY_BLOCK_SIZE >= request.num_computed_tokens
            for index in range(request.num_computed_tokens // PROPERTY_BLOCK_SIZE):
                self._assert_block_holds(request.block_ids[index], request.all_token_ids, index)
            for position in range(request.num_computed_tokens // PROPERTY_BLOCK_SIZE * PROPERTY_BLOCK_SIZE,
                                  request.num_computed_tokens):
                block_id = request.block_ids[position // PROPERTY_BLOCK_SIZE]
                slot = block_id * PROPERTY_BLOCK_SIZE + position % PROPERTY_BLOCK_SIZE
                assert self.slots[slot] == tuple(request.all_token_ids[: position + 1])

    def teardown(self):
        for request in list(self.running):
            request.status = RequestStatus.FINISHED
            self._release(request)
        for request in self.waiting:
            request.status = RequestStatus.FINISHED
            self.manager.free(request)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == PROPERTY_NUM_BLOCKS
        assert not self.manager._blocks and not self.manager._block_hashes, "per-request state leaked"


MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, suppress_health_check=[HealthCheck.too_slow])


def test_kv_cache_manager_state_machine():
    run_state_machine_as_test(PrefixCacheMachine, settings=MACHINE_SETTINGS)


class CollidingHashMachine(PrefixCacheMachine):
    # Only what the token comparison promises: a hit holds the same tokens. (Not the same prefix: see
    # test_a_hash_collision_cannot_serve_kv_computed_after_another_prefix.)
    check_full_prefix = False


def colliding_hash(parent: bytes | None, tokens, extra_key: str | None = None) -> bytes:
    """The real chain over one bit of each block's tokens: blocks with the same parent collide half the time."""
    return REAL_HASH(parent, [sum(tokens) % 2], extra_key)


REAL_HASH = kv_cache_module.hash_block


def test_kv_cache_manager_state_machine_with_colliding_hashes(monkeypatch):
    """Block hashes that collide all the time: the token comparison must keep a lookup from returning a
    block that holds other tokens, and the accounting must survive hash reuse."""
    monkeypatch.setattr(kv_cache_module, "hash_block", colliding_hash)
    run_state_machine_as_test(CollidingHashMachine, settings=MACHINE_SETTINGS)


def test_a_hash_collision_cannot_serve_kv_computed_after_another_prefix(monkeypatch):
    """A cached block is compared by its tokens, never trusted on the hash alone. A block's KV depends
    on every token before it, so a hit also checks the physical block that preceded it. Under a collision
    (here forced: hashes ignore the parent) a lookup must not return a block computed after another
    prefix, nor the request's own first block again for a later block with the same tokens."""
    monkeypatch.setattr(kv_cache_module, "hash_block", lambda parent, tokens, extra_key=None: REAL_HASH(None, tokens))
    manager = KVCacheManager(num_blocks=8, block_size=2)

    def admit(request_id: str, prompt: list[int]) -> Request:
        request = Request(request_id, prompt, SamplingParams(), seed=0, max_model_len=64)
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
        request.num_computed_tokens = request.num_tokens
        manager.cache_full_blocks(request)
        return request

    repeated = admit("a", [5, 6, 5, 6])  # blocks 0 and 1 hold the same tokens at different positions
    later = admit("b", [5, 6, 5, 6, 7])
    assert len(set(later.block_ids)) == len(later.block_ids), (
        f"block {later.block_ids[0]} serves positions 0-1 and 2-3 of one request: {later.block_ids}"
    )
    assert later.block_ids[0] == repeated.block_ids[0]  # the genuinely shared first block is still a hit
    manager.check_invariants()


def test_lru_a_hit_refreshes_a_blocks_place_in_the_free_list():
    """Of two freed requests the one freed first is evicted first, unless a hit touched its blocks since."""
    manager = KVCacheManager(num_blocks=6, block_size=2)

    def run(request_id: str, prompt: list[int]) -> Request:
        request = Request(request_id, prompt, SamplingParams(max_tokens=4), seed=0, max_model_len=64)
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
        request.num_computed_tokens = request.num_tokens
        manager.cache_full_blocks(request)
        request.status = RequestStatus.FINISHED
        manager.free(request)
        return request

    run("a", [1, 1, 1])  # caches [1, 1] in one block, the other holds the last token
    run("b", [2, 2, 2])
    run("a-again", [1, 1, 1])  # hits a's first block: now the most recently used
    # 4 blocks: the never-used one, the two partial ones, then b's cached block, not a's (without the
    # hit above, a's would have gone before b's).
    run("c", [3, 3, 3, 3, 3, 3, 3])
    probe_a = Request("pa", [1, 1, 1], SamplingParams(), seed=0, max_model_len=64)
    probe_b = Request("pb", [2, 2, 2], SamplingParams(), seed=0, max_model_len=64)
    assert manager.get_computed_blocks(probe_a)[1] == 2
    assert manager.get_computed_blocks(probe_b)[1] == 0
    manager.check_invariants()
