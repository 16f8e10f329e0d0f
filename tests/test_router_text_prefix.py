"""`pagoda route` without --tokenizer: cache_aware matches prompts by their text's prefix, so that each
conversation keeps to the replica that holds its earlier turns. Against fake replicas over loopback HTTP:
they answer every chat, and record which of them got which conversation's turns."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from server_fixtures import LOOPBACK, free_port, wait_until

from pagoda.router.tokens import CHARS_PER_TOKEN, TextPrefixReader, chat_text, text_pseudo_tokens

NUM_CONVERSATIONS = 6
NUM_TURNS = 4


class ChatReplica(BaseHTTPRequestHandler):
    """Up, idle, and answering every chat with "ok"; `served` maps each conversation's name (its first user
    message) to the ports of the replicas that got its turns, in order."""

    served: dict[str, list[int]] = {}
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(200 if self.path in ("/health", "/metrics") else 404, b"")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with self.lock:
            self.served.setdefault(body["messages"][0]["content"], []).append(self.server.server_address[1])
        answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "fake",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                               "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}
        self._answer(200, json.dumps(answer).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def replicas() -> Iterator[list[str]]:
    ChatReplica.served = {}
    servers = [ThreadingHTTPServer((LOOPBACK, 0), ChatReplica) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [f"http://{LOOPBACK}:{server.server_address[1]}" for server in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


def test_interleaved_conversations_each_keep_to_one_replica_without_a_tokenizer(replicas, tmp_path: Path):
    port = free_port()
    log_path = tmp_path / "router.log"
    command = [sys.executable, "-m", "pagoda", "route", "--host", LOOPBACK, "--port", str(port),
               "--poll-interval", "0.1"]
    for url in replicas:
        command += ["--replica", url]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://{LOOPBACK}:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 60, "the router's /health")
        histories = {f"conversation {n}: " + "tell me about the weather in Oslo " * 8: [] for n in
                     range(NUM_CONVERSATIONS)}
        with httpx.Client(base_url=f"http://{LOOPBACK}:{port}", timeout=30) as client:
            for turn in range(NUM_TURNS):  # every conversation's turn, then the next turn of each
                for name, history in histories.items():
                    history.append({"role": "user", "content": name if turn == 0 else f"and turn {turn}?"})
                    reply = client.post("/v1/chat/completions", json={"model": "fake", "messages": history})
                    assert reply.status_code == 200, reply.text
                    history.append(reply.json()["choices"][0]["message"])
    finally:
        process.terminate()
        process.wait(timeout=20)
    served = ChatReplica.served
    assert sorted(served) == sorted(histories)
    assert all(len(set(ports)) == 1 and len(ports) == NUM_TURNS for ports in served.values()), served
    assert len({ports[0] for ports in served.values()}) == 2, served  # new conversations still spread
    assert "cache_aware: prompts matched by text prefix" in log_path.read_text()


def test_a_conversations_pseudo_tokens_extend_its_earlier_turns():
    first = {"messages": [{"role": "user", "content": "What is 12 + 35?"}]}
    later = {"messages": [*first["messages"], {"role": "assistant", "content": "47"},
                          {"role": "user", "content": "And 3 + 4?"}]}
    earlier_tokens, later_tokens = text_pseudo_tokens(chat_text(first)), text_pseudo_tokens(chat_text(later))
    whole_chunks = len(chat_text(first)) // CHARS_PER_TOKEN
    assert later_tokens[:whole_chunks] == earlier_tokens[:whole_chunks]
    other = text_pseudo_tokens(chat_text({"messages": [{"role": "user", "content": "What is 12 - 35?"}]}))
    assert other[:whole_chunks] != earlier_tokens[:whole_chunks]
    assert len(earlier_tokens) == -(-len(chat_text(first)) // CHARS_PER_TOKEN)


def test_the_text_reader_reads_text_token_ids_and_nothing_else():
    reader = TextPrefixReader()
    text = asyncio.run(reader.completion({"prompt": "Reverse the list: red, tea", "cache_salt": "s"}))
    assert text.token_ids == text_pseudo_tokens("Reverse the list: red, tea") and text.cache_salt == "s"
    assert asyncio.run(reader.completion({"prompt": [5, 6, 7]})).token_ids == [5, 6, 7]
    assert asyncio.run(reader.completion({"prompt": ["first", "second"]})).token_ids == text_pseudo_tokens("first")
    assert asyncio.run(reader.completion({"prompt": {"odd": 1}})).token_ids is None
    assert asyncio.run(reader.chat({"messages": "not a list"})).token_ids is None
