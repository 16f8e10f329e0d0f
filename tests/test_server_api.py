"""The OpenAI-compatible server end to end: `pagoda serve` in a subprocess, driven by the official `openai`
client (sync and async, streaming and not) and by raw HTTP where the client would hide the wire.

One server for the module (a tiny random Llama, 64 KV blocks of 16 tokens, max_model_len 1024). Greedy and
seeded requests are deterministic, so each test compares the server with itself under another batch
composition, another transport or another parameter, and every expectation is exact.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_fixtures import assert_openai_error, make_server_checkpoint, start_server

import pagoda

pytestmark = pytest.mark.timeout(120)

MODEL = "pagoda-tiny"
MAX_MODEL_LEN = 1024  # the checkpoint's max_position_embeddings; the pool (64 x 16 tokens) holds it
BLOCK_SIZE = 16
VOCAB_SIZE = 512  # the checkpoint's default
EOS = 1  # </s>: config.json's eos_token_id
IM_END = 4  # <|im_end|>: ends a chat turn (generation_config.json's eos_token_id lists 1 and 4)
PROMPT = "Hello world"
PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time, in a land", "def f(x):"]
CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-api")
    model_dir = make_server_checkpoint(root / "model", max_position_embeddings=MAX_MODEL_LEN)
    server = start_server(
        model_dir, root, "--num-kv-blocks", "64", "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "16",
        "--max-num-batched-tokens", "512", "--max-model-len", str(MAX_MODEL_LEN), served_model_name=MODEL,
    )
    yield server
    server.stop()


def complete(client: openai.OpenAI, prompt=PROMPT, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("temperature", 0.0)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def chat(client: openai.OpenAI, messages=None, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("temperature", 0.0)
    return client.chat.completions.create(model=MODEL, messages=messages or CHAT, **kwargs)


def tokenize(server, prompt: str, add_special_tokens: bool = True) -> list[int]:
    response = server.post("/tokenize", {"prompt": prompt, "add_special_tokens": add_special_tokens})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def detokenize(server, tokens: list[int]) -> str:
    response = server.post("/detokenize", {"tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def stream_text(stream) -> tuple[str, str | None, list]:
    """Concatenated text of a one-choice completion stream, its finish reason, and all chunks."""
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1, finishes
    return text, finishes[0], chunks


def clean_tokens(choice) -> list[tuple[int, str]]:
    """(index, text) of the generated tokens whose own text is clean ASCII and sits at its place in the
    choice's text (tokens after a partial UTF-8 character are left out: their offsets are unknown)."""
    tokens = choice.logprobs.tokens
    result, offset = [], 0
    for index, token in enumerate(tokens):
        if not choice.text.startswith(token, offset):
            break
        if token and token.isascii() and token.isprintable():
            result.append((index, token))
        offset += len(token)
    return result


# --------------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------------


def test_health_and_version(server):
    assert server.get("/health").status_code == 200
    response = server.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": pagoda.__version__}


def test_models_lists_the_served_model(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"
    card = server.get("/v1/models").json()
    assert card["object"] == "list"
    assert card["data"][0]["id"] == MODEL
    assert card["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_and_detokenize_round_trip(server):
    response = server.post("/tokenize", {"prompt": PROMPT})
    assert response.status_code == 200
    body = response.json()
    assert body["tokens"][0] == 0  # <s>: plain text gets the BOS token
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert tokenize(server, PROMPT, add_special_tokens=False) == body["tokens"][1:]
    assert detokenize(server, body["tokens"][1:]) == PROMPT

    chat_tokens = server.post("/tokenize", {"messages": CHAT}).json()["tokens"]
    assert detokenize(server, chat_tokens) == (
        "<s><|im_start|>user\nTell me a story about a fox.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tokenize_and_detokenize_reject_bad_input(server):
    assert_openai_error(server.post("/tokenize", {}), 400)
    assert_openai_error(server.post("/tokenize", {"prompt": "a", "messages": CHAT}), 400)
    assert_openai_error(server.post("/detokenize", {"tokens": [VOCAB_SIZE]}), 400, param="tokens")
    assert_openai_error(server.post("/detokenize", {"tokens": [-1]}), 400, param="tokens")


def test_prefix_cache_hits_are_reported_and_reset_prefix_cache_forgets_them(server, client):
    prompt = list(range(300, 340))  # 40 tokens no other test uses: 2 full blocks of 16 can be cached
    first = complete(client, prompt, max_tokens=2)
    assert first.usage.prompt_tokens == 40
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hits_before = server.metrics().value("vllm:prefix_cache_hits_total")
    second = complete(client, prompt, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK_SIZE
    assert second.choices[0].text == first.choices[0].text
    assert server.metrics().value("vllm:prefix_cache_hits_total") - hits_before == 2 * BLOCK_SIZE

    response = server.post("/reset_prefix_cache")
    assert response.status_code == 200, response.text
    assert response.json()["reset_blocks"] >= 2
    third = complete(client, prompt, max_tokens=2)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert third.choices[0].text == first.choices[0].text


# --------------------------------------------------------------------------------------------------
# Completions
# --------------------------------------------------------------------------------------------------


def test_completion_response_has_openai_shape(server, client):
    response = complete(client, max_tokens=8, user="someone")  # `user` is accepted and ignored
    assert response.id.startswith("cmpl-")
    assert response.object == "text_completion"
    assert response.model == MODEL
    assert response.created > 0
    [choice] = response.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    assert isinstance(choice.text, str) and choice.text
    usage = response.usage
    assert usage.prompt_tokens == len(tokenize(server, PROMPT))
    assert usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0  # shorter than a block: nothing to cache
    raw = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).json()
    assert raw["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_prompt_as_text_token_ids_and_batches_of_each(server, client):
    singles = [complete(client, p).choices[0].text for p in PROMPTS[:2]]
    ids = [tokenize(server, p) for p in PROMPTS[:2]]
    assert complete(client, ids[0]).choices[0].text == singles[0]

    for batch in (PROMPTS[:2], ids):
        response = complete(client, batch)
        assert [c.index for c in response.choices] == [0, 1]
        assert [c.text for c in response.choices] == singles
        assert response.usage.prompt_tokens == sum(len(i) for i in ids)
        assert response.usage.completion_tokens == sum(
            complete(client, p).usage.completion_tokens for p in PROMPTS[:2]
        )


def test_async_client_completion_and_chat(server, client):
    expected_completion = complete(client).choices[0].text
    expected_chat = chat(client).choices[0].message.content

    async def main():
        async with server.async_client() as aclient:
            completion = await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
            reply = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
            stream = await aclient.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True
            )
            streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        return completion.choices[0].text, reply.choices[0].message.content, streamed

    completion, reply, streamed = asyncio.run(main())
    assert completion == expected_completion == streamed
    assert reply == expected_chat


# --------------------------------------------------------------------------------------------------
# Sampling parameters
# --------------------------------------------------------------------------------------------------


def test_temperature_zero_is_greedy_whatever_the_seed_and_filters_that_keep_one_token_are_greedy(client):
    greedy = complete(client).choices[0].text
    assert complete(client, seed=1).choices[0].text == greedy
    assert complete(client, seed=2, temperature=0.0, extra_body={"top_k": 5}).choices[0].text == greedy
    # At a high temperature, each filter below keeps only the most likely token: sampling becomes argmax.
    assert complete(client, temperature=1.5, seed=3, extra_body={"top_k": 1}).choices[0].text == greedy
    assert complete(client, temperature=1.5, seed=3, top_p=1e-6).choices[0].text == greedy
    assert complete(client, temperature=1.5, seed=3, extra_body={"min_p": 1.0}).choices[0].text == greedy
    # ... and without them the same seed samples something else.
    assert complete(client, temperature=1.5, seed=3).choices[0].text != greedy


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(client):
    texts = {seed: complete(client, temperature=1.0, seed=seed).choices[0].text for seed in (11, 12, 13)}
    assert complete(client, temperature=1.0, seed=11).choices[0].text == texts[11]
    assert len(set(texts.values())) == 3
    # Neutral filter values change nothing.
    neutral = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    assert complete(client, temperature=1.0, seed=12, top_p=1.0, extra_body=neutral).choices[0].text == texts[12]
    # A filter that really filters changes the draw for some seed.
    top_k = [complete(client, temperature=1.0, seed=s, extra_body={"top_k": 2}).choices[0].text for s in texts]
    assert top_k != list(texts.values())


def test_max_tokens_min_tokens_and_ignore_eos_with_eos_forced_by_logit_bias(client):
    force_eos = {str(EOS): 100}
    stopped = complete(client, logit_bias=force_eos)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == ""  # eos is not text
    assert stopped.usage.completion_tokens == 1

    held = complete(client, logit_bias=force_eos, extra_body={"min_tokens": 3})
    assert held.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 4  # three tokens with eos banned, then eos

    ignored = complete(client, max_tokens=5, logit_bias=force_eos, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == 5

    for max_tokens in (1, 7):
        response = complete(client, max_tokens=max_tokens, extra_body={"ignore_eos": True})
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == max_tokens


def test_logit_bias_forces_and_bans_tokens(server, client):
    forced_id = 300
    forced_text = detokenize(server, [forced_id] * 4)
    forced = complete(client, max_tokens=4, logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == forced_text
    assert forced.choices[0].text != complete(client, max_tokens=4).choices[0].text
    # Sampled rows honour the bias too.
    sampled = complete(client, max_tokens=4, temperature=1.0, seed=5, logit_bias={str(forced_id): 100})
    assert sampled.choices[0].text == forced_text

    # -100 on the greedy first token: another token comes first.
    greedy = complete(client, max_tokens=1, logprobs=0).choices[0].logprobs.tokens[0]
    banned_ids = tokenize(server, greedy, add_special_tokens=False)
    assert len(banned_ids) == 1, (greedy, banned_ids)
    banned = complete(client, max_tokens=1, logprobs=0, logit_bias={str(banned_ids[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != greedy


def test_stop_string_spanning_two_tokens_ends_the_text_before_it(client):
    reference = complete(client, max_tokens=32, logprobs=0, extra_body={"ignore_eos": True})
    text = reference.choices[0].text
    tokens = reference.choices[0].logprobs.tokens
    candidates = []
    offset = 0
    for index, token in enumerate(tokens[:-1]):
        offset += len(token)
        following = tokens[index + 1]
        if not text.startswith(token + following, offset - len(token)) or not token or not following:
            continue
        stop = token[-1] + following[0]
        if (token + following).isprintable() and "\ufffd" not in stop and text.find(stop) == offset - 1:
            candidates.append((stop, offset - 1))
    assert candidates, f"no stop string spanning two tokens in {tokens!r}"
    stop, position = candidates[0]
    expected = text[:position]

    response = complete(client, max_tokens=32, stop=["\x00never\x00", stop], extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].stop_reason == stop

    streamed, finish, chunks = stream_text(
        complete(client, max_tokens=32, stop=stop, stream=True, extra_body={"ignore_eos": True})
    )
    assert streamed == expected
    assert finish == "stop"
    assert all(stop not in c.choices[0].text for c in chunks if c.choices)

    # A stop string that never appears changes nothing.
    unmatched = complete(client, max_tokens=32, stop="\x00never\x00", extra_body={"ignore_eos": True})
    assert unmatched.choices[0].text == text
    assert unmatched.choices[0].finish_reason == "length"


def test_stop_string_in_chat(client):
    reference = chat(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = next((reference[i : i + 2] for i in range(1, len(reference) - 2)
                 if reference[i : i + 2].isprintable() and "\ufffd" not in reference[i : i + 2]), None)
    assert stop, reference
    position = reference.find(stop)
    response = chat(client, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert response.choices[0].message.content == reference[:position]
    assert response.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_request_at_that_token(server, client):
    reference = complete(client, max_tokens=24, logprobs=0, extra_body={"ignore_eos": True})
    choice = reference.choices[0]
    chosen = None
    for index, token in clean_tokens(choice):
        if token.startswith("<") and token.endswith(">"):
            continue  # a special token: not text
        ids = tokenize(server, token, add_special_tokens=False)
        if len(ids) == 1 and token not in choice.logprobs.tokens[:index]:
            chosen = (index, token, ids[0])
            break
    assert chosen, f"no single-token clean output token in {choice.logprobs.tokens!r}"
    index, token, token_id = chosen

    response = complete(client, max_tokens=24, extra_body={"stop_token_ids": [token_id], "ignore_eos": True})
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].stop_reason == token_id
    assert response.usage.completion_tokens == index + 1
    # A stop token that is not special stays in the text (vLLM's rule).
    assert response.choices[0].text == "".join(choice.logprobs.tokens[: index + 1])


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}],
    ids=["presence", "frequency", "repetition"],
)
def test_penalties_change_the_greedy_output(client, penalty):
    plain = complete(client, max_tokens=32).choices[0].text
    penalised = complete(client, max_tokens=32, **penalty).choices[0].text
    assert penalised != plain
    assert complete(client, max_tokens=32, **penalty).choices[0].text == penalised


def test_n_choices(client):
    response = complete(client, n=3, temperature=1.0, seed=7, max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    texts = [c.text for c in response.choices]
    assert len(set(texts)) == 3
    assert response.usage.completion_tokens == 3 * 8
    assert response.usage.prompt_tokens == complete(client, max_tokens=1).usage.prompt_tokens  # counted once
    again = complete(client, n=3, temperature=1.0, seed=7, max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == texts

    # Batch x n: choice index = prompt index * n + sample index.
    greedy = [complete(client, p, max_tokens=8).choices[0].text for p in PROMPTS[:2]]
    batch = complete(client, PROMPTS[:2], n=2, max_tokens=8)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [greedy[0], greedy[0], greedy[1], greedy[1]]

    replies = chat(client, n=2, temperature=1.0, seed=3, max_tokens=8)
    assert [c.index for c in replies.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in replies.choices)


def test_completion_logprobs(client):
    response = complete(client, max_tokens=8, logprobs=3, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert len(logprobs.text_offset) == 8
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert chosen <= 0.0
        assert 1 <= len(top) <= 3  # tokens that decode alike share a key
        assert chosen >= max(top.values()) - 1e-5  # greedy: the chosen token is the most likely
        assert sum(2.718281828459045**v for v in top.values()) <= 1.0 + 1e-5

    assert complete(client, max_tokens=8).choices[0].text == response.choices[0].text
    zero = complete(client, max_tokens=4, logprobs=0).choices[0].logprobs
    assert len(zero.token_logprobs) == 4
    assert all(top == {} for top in zero.top_logprobs)


def test_chat_logprobs(client):
    response = chat(client, max_tokens=6, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0.0
        assert isinstance(entry.token, str) and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    without_top = chat(client, max_tokens=3, logprobs=True).choices[0].logprobs.content
    assert len(without_top) == 3 and all(entry.top_logprobs == [] for entry in without_top)
    assert chat(client, max_tokens=3).choices[0].logprobs is None


def test_echo_returns_the_prompt_then_the_completion(client):
    plain = complete(client, max_tokens=6).choices[0].text
    echoed = complete(client, max_tokens=6, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    streamed, _, _ = stream_text(complete(client, max_tokens=6, echo=True, stream=True))
    assert streamed == PROMPT + plain


def test_echo_with_logprobs_scores_the_prompt_too(server, client):
    prompt_ids = tokenize(server, PROMPT)
    response = complete(client, prompt_ids, max_tokens=3, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing precedes it
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset)

    # A prompt token's logprob is the one the model gave it as the next token: force token 300 after the
    # prompt (the bias changes the choice, not the reported logprob), then score prompt + [300] with echo.
    forced = complete(client, prompt_ids, max_tokens=1, logprobs=0, logit_bias={"300": 100})
    forced_logprob = forced.choices[0].logprobs.token_logprobs[0]
    scored = complete(client, prompt_ids + [300], max_tokens=1, echo=True, logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs[len(prompt_ids)] == pytest.approx(forced_logprob, abs=1e-4)


def test_stream_options_include_usage_adds_a_final_usage_chunk(client):
    chunks = list(complete(client, max_tokens=5, stream=True, stream_options={"include_usage": True},
                           extra_body={"ignore_eos": True}))
    *content, last = chunks
    assert last.choices == []
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == complete(client, max_tokens=1).usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens is not None
    assert all(c.usage is None for c in content)

    chat_chunks = list(chat(client, max_tokens=5, stream=True, stream_options={"include_usage": True},
                            extra_body={"ignore_eos": True}))
    assert chat_chunks[-1].choices == [] and chat_chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chat_chunks[:-1])

    without = list(complete(client, max_tokens=5, stream=True))
    assert all(c.usage is None for c in without)


# --------------------------------------------------------------------------------------------------
# Chat
# --------------------------------------------------------------------------------------------------


def test_chat_response_shape_and_token_limits(client):
    response = chat(client, max_tokens=6, extra_body={"ignore_eos": True})
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == MODEL
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 6
    assert response.usage.prompt_tokens_details.cached_tokens is not None

    newer = chat(client, max_tokens=None, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert newer.usage.completion_tokens == 3
    both = chat(client, max_tokens=9, max_completion_tokens=4, extra_body={"ignore_eos": True})
    assert both.usage.completion_tokens == 4  # max_completion_tokens wins


def test_chat_stream_starts_with_content_and_matches_non_streamed(client):
    expected = chat(client, max_tokens=12, temperature=0.9, seed=21)
    chunks = list(chat(client, max_tokens=12, temperature=0.9, seed=21, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    first = chunks[0].choices[0].delta
    assert first.role == "assistant"
    assert first.content, "the first chunk must carry content (no role-only chunk)"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    finishes = [c.choices[0].finish_reason for c in chunks]
    assert finishes[-1] == expected.choices[0].finish_reason and not any(finishes[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.choices[0].message.content


def test_a_chat_turn_ends_at_im_end(client):
    """<|im_end|> ends an assistant turn: generation_config.json lists it as an eos token (as HF does)."""
    response = chat(client, logit_bias={str(IM_END): 100})
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content == ""
    assert response.usage.completion_tokens == 1


# --------------------------------------------------------------------------------------------------
# Streaming and concurrency
# --------------------------------------------------------------------------------------------------


def test_streamed_text_equals_non_streamed_text(client):
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 99}, {"temperature": 0.8, "seed": 5, "n": 2}):
        full = complete(client, PROMPTS[2], max_tokens=20, **kwargs)
        chunks = list(complete(client, PROMPTS[2], max_tokens=20, stream=True, **kwargs))
        for choice in full.choices:
            mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
            assert "".join(c.text for c in mine) == choice.text, kwargs
            assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason], kwargs



def test_stream_sends_no_empty_text_chunks_and_loses_no_logprobs(client):
    """Random sampling over a byte-level vocabulary emits partial UTF-8 characters, which the detokenizer
    holds back: no chunk may then go out empty, and the held tokens' logprobs arrive with the next one."""
    kwargs = {"max_tokens": 60, "temperature": 2.0, "seed": 11, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    full = complete(client, PROMPTS[1], **kwargs)
    chunks = [c.choices[0] for c in complete(client, PROMPTS[1], stream=True, **kwargs) if c.choices]
    assert all(c.text or c.finish_reason for c in chunks)
    assert "".join(c.text for c in chunks) == full.choices[0].text
    streamed_tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert streamed_tokens == full.choices[0].logprobs.tokens
    assert len(streamed_tokens) == full.usage.completion_tokens == 60
    assert len(chunks) < 60, "some tokens completed no character on their own (else this test shows nothing)"

CONCURRENT_REQUESTS = [
    ("completion", {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0.8, "seed": 1}),
    ("completion", {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 1.0, "seed": 2, "extra_body": {"top_k": 5}}),
    ("completion", {"prompt": PROMPTS[2], "max_tokens": 16, "temperature": 1.2, "top_p": 0.9, "seed": 3}),
    ("completion", {"prompt": PROMPTS[3], "max_tokens": 20, "temperature": 0.0, "frequency_penalty": 1.0}),
    ("completion", {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 1.0, "seed": 4,
                    "extra_body": {"min_p": 0.05, "min_tokens": 4}}),
    ("chat", {"messages": CHAT, "max_tokens": 16, "temperature": 0.7, "seed": 5}),
    ("chat", {"messages": CHAT, "max_tokens": 10, "temperature": 0.0, "presence_penalty": 1.5}),
]


def test_concurrent_streams_with_different_params_match_each_request_alone(server, client):
    """Seeded and greedy requests give the same text alone (not streamed) and streamed in one batch."""
    alone = []
    for kind, kwargs in CONCURRENT_REQUESTS:
        if kind == "completion":
            choice = client.completions.create(model=MODEL, **kwargs).choices[0]
            alone.append((choice.text, choice.finish_reason))
        else:
            choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
            alone.append((choice.message.content, choice.finish_reason))

    async def one(aclient, kind, kwargs):
        if kind == "completion":
            stream = await aclient.completions.create(model=MODEL, stream=True, **kwargs)
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].text for c in chunks)
        else:
            stream = await aclient.chat.completions.create(model=MODEL, stream=True, **kwargs)
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        return text, chunks[-1].choices[0].finish_reason

    async def main():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, kind, kwargs) for kind, kwargs in CONCURRENT_REQUESTS))

    together = asyncio.run(main())
    assert together == alone
    server.wait_until_idle()


def test_seeded_request_gives_the_same_text_alone_and_in_a_crowd(server, client):
    kwargs = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 1.0, "seed": 1234}
    alone = client.completions.create(model=MODEL, **kwargs).choices[0].text

    async def main():
        async with server.async_client() as aclient:
            crowd = [
                aclient.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=1.0, seed=s)
                for s, p in enumerate(PROMPTS * 2)
            ]
            results = await asyncio.gather(aclient.completions.create(model=MODEL, **kwargs), *crowd)
        return results[0].choices[0].text

    assert asyncio.run(main()) == alone


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------

BAD_COMPLETION_PARAMS = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"seed": -1}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, ...),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop": ""}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"prompt": []}, ...),
    ({"prompt": [[]]}, ...),
    ({"prompt": [-1]}, ...),
    ({"prompt": [VOCAB_SIZE]}, ...),
    ({"prompt": None}, ...),
    ({"suffix": "tail"}, ...),
]


@pytest.mark.parametrize(
    "overrides,param", BAD_COMPLETION_PARAMS, ids=[json.dumps(o) for o, _ in BAD_COMPLETION_PARAMS]
)
def test_invalid_completion_parameters_are_400(server, overrides, param):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **overrides}
    assert_openai_error(server.post("/v1/completions", body), 400, param=param)


BAD_CHAT_PARAMS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, ...),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"top_logprobs": 2}, ...),  # top_logprobs without logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"n": 0}, "n"),
]


@pytest.mark.parametrize("overrides,param", BAD_CHAT_PARAMS, ids=[json.dumps(o) for o, _ in BAD_CHAT_PARAMS])
def test_invalid_chat_parameters_are_400(server, overrides, param):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **overrides}
    assert_openai_error(server.post("/v1/chat/completions", body), 400, param=param)


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_out_of_vocabulary_token_ids_are_400_naming_their_field(server, field):
    value = [VOCAB_SIZE] if field == "stop_token_ids" else {str(VOCAB_SIZE): 1.0}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, field: value}
    assert_openai_error(server.post("/v1/completions", body), 400, param=field, contains=[str(VOCAB_SIZE)])


def test_seed_outside_int64_is_400_and_never_fails_other_requests(server):
    """A seed the sampler cannot hold must be refused at the door: in the engine it fails the whole step,
    and with it every request that shares the batch."""
    prompt_tokens = len(tokenize(server, PROMPT))

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            bystander = asyncio.create_task(http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - prompt_tokens, "ignore_eos": True}))
            await asyncio.to_thread(server.wait_for_metrics, lambda m: m.gauge("vllm:num_requests_running") == 1,
                                    "the bystander to run")
            bad = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 2**63})
            return bad, await bystander

    bad, bystander = asyncio.run(main())
    assert bystander.status_code == 200, bystander.text
    assert bystander.json()["choices"][0]["finish_reason"] == "length"
    assert_openai_error(bad, 400, param="seed")
    ok = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "seed": 2**63 - 1})
    assert ok.status_code == 200, ok.text


def test_prompt_longer_than_the_context_is_400_naming_both_lengths(server, client):
    too_long = MAX_MODEL_LEN + 76
    error = assert_openai_error(
        server.post("/v1/completions", {"model": MODEL, "prompt": [5] * too_long, "max_tokens": 4}), 400
    )
    assert str(MAX_MODEL_LEN) in error["message"] and str(too_long) in error["message"], error
    # The prompt fits but prompt + max_tokens does not.
    error = assert_openai_error(
        server.post("/v1/completions", {"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN - 10), "max_tokens": 20}), 400
    )
    assert str(MAX_MODEL_LEN) in error["message"] and str(MAX_MODEL_LEN - 10) in error["message"], error
    long_chat = [{"role": "user", "content": "fox " * MAX_MODEL_LEN}]
    error = assert_openai_error(server.post("/v1/chat/completions", {"model": MODEL, "messages": long_chat}), 400)
    assert str(MAX_MODEL_LEN) in error["message"], error
    with pytest.raises(openai.BadRequestError) as raised:
        complete(client, "fox " * MAX_MODEL_LEN)
    assert raised.value.status_code == 400
    # A prompt that fits exactly is fine.
    fits = complete(client, [5] * (MAX_MODEL_LEN - 4), max_tokens=4, extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == 4


MALFORMED_BODIES = [b"{not json", b'{"prompt": "x",}', b"", b"[1, 2]", b'"a string"', b"null", b"\xff\xfe\x00",
                    b'{"prompt": "x"', b"[" * 100_000]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_json_is_400_never_500(server, path):
    with server.http() as http:
        for body in MALFORMED_BODIES:
            response = http.post(path, content=body, headers={"content-type": "application/json"})
            assert_openai_error(response, 400)
        response = http.post(path, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
        assert_openai_error(response, 400)


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    response = server.post("/v1/completions", {"model": "no-such-model", "prompt": PROMPT})
    assert_openai_error(response, 404, param="model", contains=["no-such-model"])


def test_unknown_route_and_wrong_method_use_the_error_shape(server):
    assert_openai_error(server.get("/v1/nothing"), 404)
    assert_openai_error(server.get("/v1/completions"), 405)


# --------------------------------------------------------------------------------------------------
# Metrics and load
# --------------------------------------------------------------------------------------------------


def test_metrics_parse_and_move_as_requests_run(server, client):
    server.wait_until_idle()
    before = server.metrics()
    for name, kind in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prompt_tokens", "counter"),
                       ("vllm:generation_tokens", "counter"), ("vllm:request_success", "counter"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"),
                       ("vllm:request_queue_time_seconds", "histogram")]:
        assert before.families.get(name) == kind, (name, before.families)

    by_length = complete(client, max_tokens=5, extra_body={"ignore_eos": True})
    by_stop = complete(client, max_tokens=5, logit_bias={str(EOS): 100})
    replies = chat(client, max_tokens=3, extra_body={"ignore_eos": True})
    after = server.metrics()

    def moved(name: str, **labels) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    responses = [by_length, by_stop, replies]
    assert moved("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in responses)
    assert moved("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r in responses) == 9
    assert moved("vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:request_success_total", finished_reason="stop") == 1
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds"):
        assert moved(f"{histogram}_count") == 3, histogram
        assert moved(f"{histogram}_bucket", le="+Inf") == 3, histogram
        assert moved(f"{histogram}_sum") > 0, histogram
    # One inter-token gap per token after the first.
    assert moved("vllm:inter_token_latency_seconds_count") == (5 - 1) + (1 - 1) + (3 - 1)

    vllm_samples = [labels for (name, labels) in after.samples if name.startswith("vllm:")]
    assert vllm_samples
    assert all(dict(labels).get("model_name") == MODEL for labels in vllm_samples)
    assert after.gauge("vllm:num_requests_running") == 0
    assert after.gauge("vllm:kv_cache_usage_perc") == 0


def test_load_64_requests_at_concurrency_16_without_errors_or_leaked_blocks(server):
    server.wait_until_idle()
    before = server.metrics()
    num_requests, concurrency = 64, 16

    async def one(aclient, semaphore, index: int):
        async with semaphore:
            is_completion, stream = index % 4 < 2, index % 2 == 1
            common = {"model": MODEL, "max_tokens": 4 + index % 5, "temperature": (index % 3) * 0.5,
                      "seed": index, "extra_body": {"ignore_eos": True}}
            if is_completion:
                if stream:
                    chunks = [c async for c in await aclient.completions.create(
                        prompt=PROMPTS[index % 4], stream=True, **common)]
                    return chunks[-1].choices[0].finish_reason
                response = await aclient.completions.create(prompt=PROMPTS[index % 4], **common)
                assert response.usage.completion_tokens == common["max_tokens"]
                return response.choices[0].finish_reason
            if stream:
                chunks = [c async for c in await aclient.chat.completions.create(messages=CHAT, stream=True, **common)]
                return chunks[-1].choices[0].finish_reason
            response = await aclient.chat.completions.create(messages=CHAT, **common)
            assert response.usage.completion_tokens == common["max_tokens"]
            return response.choices[0].finish_reason

    async def main():
        semaphore = asyncio.Semaphore(concurrency)
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, semaphore, i) for i in range(num_requests)),
                                        return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert results == ["length"] * num_requests
    after = server.wait_until_idle()
    assert after.value("vllm:request_success_total") - before.value("vllm:request_success_total") == num_requests
