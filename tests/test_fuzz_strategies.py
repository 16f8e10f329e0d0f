"""The grammar fuzzer's parts, without a model: grammar_poisons.py makes well-formed requests, the same for the
same seed, from every hostile family; the HTTP client reads event streams and classifies answers; a bystander
is judged lost or diverged as it should be; provenance reads the CPU."""

from __future__ import annotations

import json
import random
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pagoda.wire.limits import ServerLimits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import grammar_poisons as poisons  # noqa: E402
from fuzz_grammar import StreamResult, judge  # noqa: E402
from http_checks import Reply, error_problem, post  # noqa: E402
from provenance import cpu_summary  # noqa: E402

MODEL = "fuzzed-model"


def cases(seed: int, count: int) -> list[poisons.GrammarCase]:
    rng = random.Random(seed)
    return [poisons.grammar_case(rng, MODEL) for _ in range(count)]


def test_requests_are_well_formed() -> None:
    for case in cases(seed=1, count=300):
        body, family = case.body, poisons.FAMILIES[case.family]
        assert case.hostile == family.hostile
        encoded = json.dumps(body, allow_nan=False)
        assert len(encoded.encode()) < ServerLimits().max_request_body_bytes
        assert body["model"] == MODEL and body["max_tokens"] in poisons.MAX_TOKENS
        if case.route == "/v1/chat/completions":
            assert body["messages"][0]["role"] == "user" and "prompt" not in body
        else:
            assert case.route == "/v1/completions" and isinstance(body["prompt"], str) and "messages" not in body
        carrier, _, tool_choice = case.carrier.partition(":")
        if carrier == "tools":
            assert family.kind == "json" and case.route == "/v1/chat/completions"
            names = [tool["function"]["name"] for tool in body["tools"]]
            assert names.count("poison") == 1
            named = body["tool_choice"] == {"type": "function", "function": {"name": "poison"}}
            assert named if tool_choice == "named" else body["tool_choice"] == tool_choice
        elif carrier == "response_format":
            assert family.kind == "json" and body["response_format"]["type"] == "json_schema"
        elif carrier == "guided":
            assert f"guided_{family.kind}" in body
        else:
            assert carrier == "structured_outputs" and list(body["structured_outputs"]) == [family.kind]


def test_the_same_seed_gives_the_same_requests() -> None:
    first = cases(seed=7, count=120)
    assert first == cases(seed=7, count=120)
    assert first != cases(seed=8, count=120)


def test_every_family_is_drawn_and_hostile_ones_most() -> None:
    drawn = cases(seed=0, count=400)
    families = {case.family for case in drawn}
    assert families == set(poisons.FAMILIES)
    hostile_share = sum(case.hostile for case in drawn) / len(drawn)
    assert abs(hostile_share - (1 - poisons.VALID_SHARE)) < 0.08


def constraints(family: str, count: int = 200) -> list:
    rng = random.Random(3)
    return [poisons.FAMILIES[family].make(rng) for _ in range(count)]


def _depth(schema: object) -> int:
    """Levels of schema below the root: through properties, items and combinators."""
    if not isinstance(schema, dict):
        return 0
    below = [*schema.get("properties", {}).values(), *([schema["items"]] if "items" in schema else []),
             *schema.get("anyOf", []), *schema.get("allOf", [])]
    return 1 + max(map(_depth, below), default=0)


def test_hostile_families_hold_their_poisons() -> None:
    assert {"$ref": "#"} in constraints("schema_ref_root")
    assert "x{4294967295}" in constraints("regex_huge_repeat")
    assert [] in constraints("choice_empty")
    depths = [_depth(schema) - 1 for schema in constraints("schema_deep")]
    assert min(depths) >= 1 and max(depths) <= 200 and max(depths) > 150
    for schema in constraints("schema_ref_loop", 50):  # following the refs from the root comes back round
        section = "$defs" if "$defs" in schema else "definitions"
        seen, ref = [], schema["$ref"]
        while ref not in seen:
            seen.append(ref)
            target = schema[section][ref.rsplit("/", 1)[1]]
            ref = target["$ref"] if "$ref" in target else target["anyOf"][0]["$ref"]
        assert len(seen) >= 2
    for schema in constraints("schema_recursive_required", 30):  # the node reaches itself: nothing finite fits
        assert "#/$defs/node" in json.dumps(schema["$defs"]["node"])
    assert max(len(choices) for choices in constraints("choice_huge", 30)) >= 10_000
    assert max(len(regex.split("|")) for regex in constraints("regex_huge_alternation", 10)) >= 1000
    assert any(not isinstance(choices, list) or not all(isinstance(c, str) for c in choices)
               for choices in constraints("choice_odd_types"))
    assert any(not isinstance(value, str) for value in constraints("regex_invalid"))
    assert 'start: %json {"$ref": "#"}' in constraints("lark_hostile")


def test_error_shape() -> None:
    good = json.dumps({"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}})
    assert error_problem(200, "{}") is None
    assert error_problem(400, good) is None
    assert error_problem(404, good) == "error body is not OpenAI's shape"  # code differs from the status
    assert error_problem(400, '{"detail": "x"}') == "error body is not OpenAI's shape"
    assert error_problem(500, good) == "server error"


@pytest.fixture
def event_server() -> Iterator[str]:
    """A stdlib server answering every POST with an event stream: one token, then an engine failure."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for event in ({"choices": [{"text": "a"}]}, {"error": {"message": "engine failed", "code": 500}}):
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_post_reads_an_event_stream_and_its_errors(event_server: str) -> None:
    seen: list = []
    reply = post(event_server, "/v1/completions", {"prompt": "x"}, on_event=seen.append)
    assert seen == reply.events and len(reply.events) == 2
    assert reply.outcome() == "200+error 500" and reply.server_error() and not reply.failed_alone()
    assert not Reply(400, "{}").server_error() and Reply(503).server_error()
    assert Reply(None, transport_error="reset").outcome() == "transport error"


def test_a_failure_confined_to_its_request() -> None:
    assert Reply(500, "{}", scope="request").failed_alone()
    assert not Reply(500, "{}").failed_alone() and not Reply(400, "{}", scope="request").failed_alone()
    scoped = {"error": {"message": "m", "code": 500, "scope": "request"}}
    assert Reply(200, events=[{"choices": []}, scoped]).outcome() == "200+error 500 alone"
    assert not Reply(200, events=[scoped, {"error": {"message": "m", "code": 500}}]).failed_alone()


def test_bystander_judgement() -> None:
    reference = StreamResult("abc", 3, "length", None, 0.0)
    assert judge(StreamResult("abc", 3, "length", None, 1.0), reference, 3) is None
    assert judge(StreamResult("abd", 3, "length", None, 1.0), reference, 3).startswith("diverged")
    assert judge(StreamResult("ab", 2, "stop", None, 1.0), reference, 3).startswith("lost")
    assert judge(StreamResult("a", None, None, "error event: 500", 1.0), reference, 3).startswith("lost")


def test_cpu_summary() -> None:
    cpuinfo = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
               "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_2 avx avx2 fma\n\nprocessor\t: 1\nflags\t: avx512f\n")
    summary = cpu_summary(cpuinfo)
    assert summary == {"vendor": "AuthenticAMD", "family": "25", "model": "1", "model_name": "AMD EPYC 7B13",
                       "flags": ["sse4_2", "avx", "avx2", "fma"], "flag_count": 5}
