"""`pagoda chat` in a pseudo-terminal, as a person uses it: turns that remember the conversation, /reset,
and Ctrl-C that stops an answer and not the program; in-process with the built-in model, and with --url
against `pagoda serve`. Each answer is compared with what the engine says to the same conversation."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

import pexpect
import pytest
from server_fixtures import start_server

from pagoda import LLM, SamplingParams
from pagoda.chat import PROMPT
from pagoda.demo import DEMO_EXAMPLES, DEMO_INTRO, DEMO_MODEL_DIR
from pagoda.engine_args import add_engine_args
from pagoda.flag_values import json_object
from pagoda.text.tokenizer import encode_chat

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 48
LONG_MAX_TOKENS = 480  # with --ignore-eos: ~2 s of streaming here, so Ctrl-C lands mid-answer
EXPECT_TIMEOUT_S = 90
# An OpenAI stream stopped early never says its token count: only the TTFT is shown then.
STATS = re.compile(r"\[TTFT \d+ ms(?:, (\d+) tokens?)?(?:, [\d.]+ tokens/s)?\]")


@pytest.fixture(scope="module")
def demo_llm():
    llm = LLM(str(DEMO_MODEL_DIR), num_kv_blocks=128, block_size=16)
    yield llm
    assert not llm.engine.has_unfinished_requests()


def engine_answer(llm: LLM, messages: list[dict[str, str]]) -> str:
    prompt = encode_chat(llm.get_tokenizer(), messages)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text.strip("\n")


def spawn_chat(*args: str) -> pexpect.spawn:
    return spawn_chat_with_start_up(*args)[0]


def spawn_chat_with_start_up(*args: str) -> tuple[pexpect.spawn, str]:
    """The chat at its first prompt, and what it printed before its greeting."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "TERM": "dumb"}
    # ^C as a terminal's shell would deliver it: a suite started in the background (`cmd &` in a script)
    # ignores SIGINT, the child would inherit that, and Python then raises no KeyboardInterrupt.
    child = pexpect.spawn(sys.executable, ["-m", "pagoda", "chat", *args], env=env, encoding="utf-8",
                          timeout=EXPECT_TIMEOUT_S, dimensions=(50, 400),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect_exact("chatting with")
    start_up = child.before
    child.expect_exact(PROMPT)  # child.before: the greeting
    return child, start_up


def ask(child: pexpect.spawn, text: str) -> str:
    """Sends a line; returns what the chat printed before its next prompt (echo removed, \\n line ends)."""
    child.sendline(text)
    child.expect_exact(text)
    child.expect_exact(PROMPT)
    return child.before.replace("\r\n", "\n").strip("\n")


def close(child: pexpect.spawn) -> None:
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before


def test_two_turns_remember_the_conversation_and_reset_forgets_it(demo_llm):
    child, start_up = spawn_chat_with_start_up("--max-tokens", str(MAX_TOKENS))
    assert "loading weights" in start_up  # the progress bar, on a terminal's stderr
    try:
        first, second = "What is 12 + 35?", "Count the words: red tea oslo"
        answer = ask(child, first)
        assert answer == engine_answer(demo_llm, [{"role": "user", "content": first}])
        conversation = [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                        {"role": "user", "content": second}]
        assert ask(child, second) == engine_answer(demo_llm, conversation)

        assert ask(child, "/reset") == "(conversation cleared)"
        assert ask(child, second) == engine_answer(demo_llm, [{"role": "user", "content": second}])

        assert ask(child, "/system Answer briefly.") == "(system prompt: 'Answer briefly.')"
        with_system = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": first}]
        assert ask(child, "/reset") == "(conversation cleared)"
        assert ask(child, first) == engine_answer(demo_llm, with_system)
    finally:
        close(child)


def stop_an_answer_then_chat_on(child: pexpect.spawn, counts_stopped_answers: bool = True) -> None:
    """Ctrl-C while an answer streams stops it; the next turn runs to its full length."""
    child.sendline("What is 12 + 35?")
    child.expect_exact("What is 12 + 35?")
    child.expect(r"\S")  # the answer is streaming
    child.sendintr()
    child.expect_exact("[stopped]")
    child.expect(STATS)
    if counts_stopped_answers:
        assert int(child.match.group(1)) < LONG_MAX_TOKENS
    child.expect_exact(PROMPT)
    assert child.isalive()

    assert ask(child, "/reset") == "(conversation cleared)"  # the stopped answer would not leave room for another
    child.sendline("Count the words: a b c")
    child.expect(STATS)
    assert int(child.match.group(1)) == LONG_MAX_TOKENS
    assert "[stopped]" not in child.before
    child.expect_exact(PROMPT)


def test_ctrl_c_stops_the_answer_not_the_chat():
    child = spawn_chat("--ignore-eos", "--max-tokens", str(LONG_MAX_TOKENS), "--stats")
    try:
        stop_an_answer_then_chat_on(child)
    finally:
        close(child)


def test_ctrl_c_at_the_prompt_ends_the_chat():
    child = spawn_chat("--url", "http://127.0.0.1:9", "--model", "unused", "--timeout", "1")  # no server: no model
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_url_chat_refuses_engine_flags(capsys):
    from pagoda.cli import main

    assert main(["chat", "--url", "http://127.0.0.1:9", "--dtype", "bfloat16", "--num-kv-blocks", "8"]) == 2
    assert "--dtype, --num-kv-blocks: engine flags apply to a model in this process" in capsys.readouterr().err


def test_url_chat_refuses_every_engine_flag_but_model(capsys):
    """Each flag `add_engine_args` defines, given alone with --url, is refused by name: a flag added there later
    cannot be silently ignored by a chat with a server (--model names the server's model instead)."""
    from pagoda.cli import main

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    flags = [action for action in parser._actions if action.dest != "model"]
    assert len(flags) > 20  # the grammar limits and the scheduling flags are among them
    for action in flags:
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:  # a switch takes no value
            given = [flag]
        elif action.choices:
            given = [flag, str(next(iter(action.choices)))]
        else:
            given = [flag, "{}" if action.type is json_object else "1"]
        assert main(["chat", "--url", "http://127.0.0.1:9", *given]) == 2, flag
        assert f"{flag}: engine flags apply to a model in this process" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("chat-server"), "--num-kv-blocks", "256")
    yield server
    server.stop()


def test_url_chat_talks_to_a_server(server, demo_llm):
    child = spawn_chat("--url", server.url, "--max-tokens", str(MAX_TOKENS))
    try:
        question = "What is 12 + 35?"
        answer = ask(child, question)
        assert answer == engine_answer(demo_llm, [{"role": "user", "content": question}])
        assert ask(child, "/reset") == "(conversation cleared)"
        assert ask(child, question) == answer
    finally:
        close(child)
    with server.client() as client:
        assert client.models.list().data[0].id == "pagoda-demo"  # the name the chat sent its requests under


def test_serve_logs_one_summary_when_ready(server):
    log = server.log_tail(20_000)
    assert "loading weights" not in log  # no progress bar where stderr is not a terminal
    summary = log[log.index("model pagoda-demo ready in"):]
    for row in ("parameters", "dtype", "quantization", "KV cache", "max_model_len", "threads", "native kernels"):
        assert f"\n  {row} " in summary, row
    assert re.search(rf"\n  URL +{re.escape(server.url)}  \(OpenAI API under ", summary)
    assert "256 blocks x 16 tokens = 4096 tokens" in summary and "(num_kv_blocks given)" in summary


def test_url_chat_stops_a_server_answer(server):
    child = spawn_chat("--url", server.url, "--ignore-eos", "--max-tokens", str(LONG_MAX_TOKENS), "--stats")
    try:
        stop_an_answer_then_chat_on(child, counts_stopped_answers=False)
    finally:
        close(child)
    server.wait_until_idle()


def test_the_chat_says_what_the_built_in_model_can_do_and_answers_its_examples(server):
    child = spawn_chat("--url", server.url, "--max-tokens", str(MAX_TOKENS))
    try:
        greeting = child.before.replace("\r\n", "\n")
        assert DEMO_INTRO in greeting and all(example in greeting for example in DEMO_EXAMPLES), greeting
        for question, answer in DEMO_EXAMPLES.items():  # one conversation: the model follows it
            assert ask(child, question) == answer
        assert ask(child, "What is my name?") == "Rex"  # from the last example, several turns back
    finally:
        close(child)
