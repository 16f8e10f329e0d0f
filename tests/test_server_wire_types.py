"""What a hostile probe sends, through real HTTP: every documented field typed as OpenAI and vLLM document it,
message roles and tool messages validated, fields pagoda does not implement refused unless at their
defaults, bodies UTF-8 JSON only, /detokenize's oversized bodies refused before they are parsed, and
connections that trickle their requests closed after --request-read-timeout while others are served."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_fixtures import LOOPBACK, assert_openai_error, make_server_checkpoint, start_server

pytestmark = pytest.mark.timeout(180)

MODEL = "pagoda-wire"
MAX_MODEL_LEN = 256
READ_TIMEOUT_S = 1.5
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-wire")
    model_dir = make_server_checkpoint(root / "model", max_position_embeddings=MAX_MODEL_LEN)
    server = start_server(model_dir, root, "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64",
                          "--block-size", "16", "--request-read-timeout", str(READ_TIMEOUT_S),
                          served_model_name=MODEL)
    yield server
    server.stop()


def post_raw(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=body, timeout=60, headers={"content-type": "application/json"})


def post(server, path: str, body: object) -> httpx.Response:
    return post_raw(server, path, json.dumps(body).encode())


# --------------------------------------------------------------------------------------------------
# Field types
# --------------------------------------------------------------------------------------------------

WRONG_TYPES = [
    ("best_of", "x"), ("best_of", {}), ("best_of", 1.5), ("user", {}), ("user", 5), ("user", ["a"]),
    ("metadata", {"k": 1}), ("store", "yes"), ("service_tier", "gold"), ("use_beam_search", 1),
    ("length_penalty", "1"), ("include_stop_str_in_output", "false"), ("allowed_token_ids", [True]),
    ("bad_words", [1]), ("truncate_prompt_tokens", "8"), ("request_id", 7), ("vllm_xargs", {"a": [1]}),
    ("spaces_between_special_tokens", 0), ("logits_processors", [{"qualname": 1}]),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value", WRONG_TYPES, ids=[f"{f}={json.dumps(v)}" for f, v in WRONG_TYPES])
def test_every_documented_field_is_typed(server, route, field, value):
    base = {"prompt": "hi"} if route == "/v1/completions" else {"messages": CHAT}
    assert_openai_error(post(server, route, {**base, "max_tokens": 2, field: value}), 400, param=field)


CHAT_ONLY_WRONG_TYPES = [("reasoning_effort", "max"), ("verbosity", 1), ("modalities", ["video"]),
                         ("documents", [{"title": 1}]), ("chat_template_kwargs", []), ("continue_final_message", "no"),
                         ("parallel_tool_calls", "yes"), ("echo", 1)]


@pytest.mark.parametrize("field,value", CHAT_ONLY_WRONG_TYPES,
                         ids=[f"{f}={json.dumps(v)}" for f, v in CHAT_ONLY_WRONG_TYPES])
def test_chat_fields_are_typed(server, field, value):
    body = {"messages": CHAT, "max_tokens": 2, field: value}
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, param=field)


def test_nan_and_infinity_are_not_json(server):
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + literal + b"}"
        assert_openai_error(post_raw(server, "/v1/completions", body), 400, contains=["not a JSON number"])
        body = b'{"messages": [{"role": "user", "content": "hi"}], "user": ' + literal + b"}"
        assert_openai_error(post_raw(server, "/v1/chat/completions", body), 400, contains=["not a JSON number"])


UNSUPPORTED = [
    ("/v1/completions", "use_beam_search", True), ("/v1/completions", "include_stop_str_in_output", True),
    ("/v1/completions", "length_penalty", 0.5), ("/v1/completions", "bad_words", ["fox"]),
    ("/v1/completions", "allowed_token_ids", [5, 6]), ("/v1/completions", "add_special_tokens", False),
    ("/v1/completions", "best_of", 3), ("/v1/completions", "prompt_logprobs", 1),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ("/v1/chat/completions", "continue_final_message", True), ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "reasoning_effort", "low"), ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "stream_options", {"include_usage": True, "continuous_usage_stats": True}),
]


@pytest.mark.parametrize("route,field,value", UNSUPPORTED, ids=[f"{f}={json.dumps(v)}" for _, f, v in UNSUPPORTED])
def test_what_pagoda_does_not_do_is_refused_by_name(server, route, field, value):
    base = {"prompt": "hi"} if route == "/v1/completions" else {"messages": CHAT}
    body = {**base, "max_tokens": 2, "stream": field == "stream_options", field: value}
    assert_openai_error(post(server, route, body), 400, param=field, contains=["not supported"])


def test_defaults_labels_and_documented_nulls_are_accepted(server):
    labels = {"user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
              "prompt_cache_key": "k", "safety_identifier": "s"}
    at_defaults = {"best_of": 1, "use_beam_search": False, "length_penalty": 1.0, "bad_words": [],
                   "include_stop_str_in_output": False, "spaces_between_special_tokens": True}
    nulls = {"temperature": None, "top_p": None, "n": None, "presence_penalty": None, "frequency_penalty": None,
             "stream": None, "seed": None, "stop": None}
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **labels, **at_defaults, **nulls,
                                                "echo": None})
    assert response.status_code == 200, response.text
    response = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **labels, **at_defaults,
                                                     **nulls, "logprobs": None, "modalities": ["text"],
                                                     "chat_template_kwargs": None})
    assert response.status_code == 200, response.text


def test_chat_template_kwargs_reach_the_template_but_never_its_renderers_arguments(server):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, ...): variables the template may read, never one
    of apply_chat_template's own arguments, which the request's fields set."""
    body = {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False, "x": [1]}}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    body["chat_template_kwargs"] = {"tokenize": True, "add_generation_prompt": False}
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, param="chat_template_kwargs",
                        contains=["add_generation_prompt, tokenize"])


# --------------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------------

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
BAD_MESSAGES = [
    [{"role": "root", "content": "x"}],
    [{"role": "function", "name": "f", "content": "x"}],
    [{"content": "no role"}],
    [{"role": 1, "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": "x", "name": 3}],
    [{"role": "assistant"}],
    [{"role": "assistant", "content": None, "tool_calls": [{**TOOL_CALL, "type": "web"}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{**TOOL_CALL, "function": {"name": "f",
                                                                                       "arguments": {}}}]}],
    [{"role": "user", "content": "x"}, {"role": "tool", "content": "sunny"}],
    [{"role": "user", "content": "x"}, {"role": "tool", "content": "sunny", "tool_call_id": 1}],
    [{"role": "system"}],
]


@pytest.mark.parametrize("messages", BAD_MESSAGES, ids=[json.dumps(m)[:60] for m in BAD_MESSAGES])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_messages_are_validated_by_role(server, route, messages):
    assert_openai_error(post(server, route, {"messages": messages, "max_tokens": 2}), 400, param="messages")


def test_every_role_openai_documents_is_served(server):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "system", "content": [{"type": "text",
                                                                                              "text": "Or not."}]},
                {"role": "user", "content": "Weather in Oslo?", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
    tokens = post(server, "/tokenize", {"messages": messages})
    assert tokens.status_code == 200, tokens.text
    as_system = post(server, "/tokenize", {"messages": [{"role": "system", "content": "Be brief."}, *messages[2:]]})
    assert as_system.json()["tokens"] != tokens.json()["tokens"]  # the second system message is in the first
    just_developer = post(server, "/tokenize", {"messages": [{"role": "developer", "content": "Be brief."}]})
    just_system = post(server, "/tokenize", {"messages": [{"role": "system", "content": "Be brief."}]})
    assert just_developer.json()["tokens"] == just_system.json()["tokens"]  # a developer message is the system's


# --------------------------------------------------------------------------------------------------
# Bodies
# --------------------------------------------------------------------------------------------------


def test_bodies_must_be_utf8(server):
    body = {"prompt": "héllo", "max_tokens": 2}
    for encoding in ("utf-16", "utf-16-le", "utf-32", "latin-1"):
        error = assert_openai_error(post_raw(server, "/v1/completions", json.dumps(body, ensure_ascii=False)
                                             .encode(encoding)), 400)
        assert "UTF-8" in error["message"] or "JSON" in error["message"], error
    assert_openai_error(post_raw(server, "/v1/completions", b'{"prompt": "h\xe9llo", "max_tokens": 2}'), 400,
                        contains=["not UTF-8 (at byte 13)"])
    response = post_raw(server, "/v1/completions", json.dumps(body, ensure_ascii=False).encode("utf-8"))
    assert response.status_code == 200, response.text


def test_detokenize_refuses_a_million_ids_before_parsing_them(server):
    ids = json.dumps({"model": MODEL, "tokens": [7] * 1_000_000}).encode()
    started = time.monotonic()
    response = post_raw(server, "/detokenize", ids)
    elapsed = time.monotonic() - started
    assert_openai_error(response, 400, param="tokens", contains=[f"at most {MAX_MODEL_LEN} token ids"])
    assert elapsed < 1.0, f"{elapsed:.2f} s to refuse"  # parsing them took 3-5 s
    pretty = json.dumps({"model": MODEL, "tokens": [7] * MAX_MODEL_LEN}, indent=4).encode()
    response = post_raw(server, "/detokenize", pretty)  # the most ids the context holds, however written
    assert response.status_code == 200, response.text
    response = post(server, "/detokenize", {"model": MODEL, "tokens": [7] * (MAX_MODEL_LEN + 1)})
    assert_openai_error(response, 400, param="tokens")


# --------------------------------------------------------------------------------------------------
# Slow clients
# --------------------------------------------------------------------------------------------------


def _closed_by_server(sock: socket.socket, deadline: float) -> tuple[bool, bytes]:
    """Trickles one byte of a request head every 0.2 s until the server closes the connection (True, with what
    it sent) or the deadline passes (False)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n" + "X-Padding: " + "a" * 4000 + "\r\n\r\n").encode()
    received, sent = b"", 0
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if sent < len(head):
                sock.send(head[sent:sent + 1])
                sent += 1
            chunk = sock.recv(4096)
            if not chunk:
                return True, received
            received += chunk
        except (TimeoutError, BlockingIOError):
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True, received
    return False, received


def test_trickling_clients_are_closed_after_the_read_timeout_while_others_are_served(server):
    trickling = [socket.create_connection((LOOPBACK, server.port)) for _ in range(20)]
    silent = socket.create_connection((LOOPBACK, server.port))
    slow_body = socket.create_connection((LOOPBACK, server.port))
    slow_body.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 100\r\n\r\n{{\"prompt\": ".encode())
    opened = time.monotonic()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for _ in range(3):  # served throughout, each on a connection of its own
                response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                     headers={"connection": "close"})
                assert response.status_code == 200, response.text
        deadline = opened + READ_TIMEOUT_S + 10
        closed, answer = _closed_by_server(trickling[0], deadline)
        assert closed, "a trickling connection was still open"
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert time.monotonic() - opened >= READ_TIMEOUT_S * 0.9
        for sock in [*trickling[1:], silent, slow_body]:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                while sock.recv(4096):  # whatever it sends, then the end of the connection
                    pass
            except ConnectionResetError:
                pass
        with httpx.Client(base_url=server.url, timeout=30) as http:
            response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert response.status_code == 200, response.text
    finally:
        for sock in [*trickling, silent, slow_body]:
            sock.close()


def test_a_slow_response_is_not_cut_by_the_read_timeout(server):
    """The deadline covers reading the request, not answering it: a stream longer than the timeout completes."""
    wanted = MAX_MODEL_LEN - 8
    body = {"prompt": "hi", "max_tokens": wanted, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started, events = time.monotonic(), []
    with httpx.Client(base_url=server.url, timeout=60) as http, http.stream("POST", "/v1/completions",
                                                                            json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
            time.sleep(0.01)  # a slow reader too
    assert time.monotonic() - started > READ_TIMEOUT_S
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == wanted
