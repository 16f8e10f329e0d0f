"""`pagoda chat`: a multi-turn conversation in the terminal, streamed as it is generated.

Answers come from a `ChatBackend`, chosen at start-up: the engine in this process (`--model`, default the
built-in model) or, with `--url`, any OpenAI-compatible server through the `openai` client. At the prompt:
/reset, /system TEXT, /stats, /help, /exit. Ctrl-C during an answer stops that answer (what was said stays
in the conversation); Ctrl-C or Ctrl-D at the prompt ends the chat.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import signal
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from pagoda.engine.api import RequestOutput
from pagoda.engine_args import (
    DEMO_SERVED_NAME,
    add_engine_args,
    engine_config_from,
    engine_flags,
    is_builtin_model,
    model_to_load,
    served_model_name,
)

if TYPE_CHECKING:
    from pagoda.engine.engine import LLMEngine

Message = dict[str, str]
PROMPT = ">>> "
HELP = """commands:
  /reset          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (/system alone removes it)
  /stats          show or hide each answer's time to first token and tokens/s
  /exit           leave (also Ctrl-D, or Ctrl-C at the prompt)
Ctrl-C while an answer streams stops that answer."""


class ChatError(Exception):
    """An answer could not be had (a rejected request, a server error): said, and the chat goes on."""


@dataclass(frozen=True)
class AnswerSettings:
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    ignore_eos: bool  # keep generating past the end of the turn, up to max_tokens


@dataclass(frozen=True)
class Delta:
    text: str  # new text since the previous delta (may be empty)
    num_tokens: int | None = None  # tokens of the answer so far, where the backend counts them


class ChatBackend(Protocol):
    """Where answers come from. Closing `answer`'s iterator before it ends stops that generation."""

    description: str

    def answer(self, messages: list[Message], settings: AnswerSettings) -> Generator[Delta, None, None]: ...


class EngineBackend:
    """The engine in this process, stepped on the caller's thread: a step is never interrupted, and a
    stopped answer is aborted between two steps."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.description = f"{model_name} (in this process)"
        self._turn_ids = itertools.count()

    def answer(self, messages: list[Message], settings: AnswerSettings) -> Generator[Delta, None, None]:
        from pagoda.sampling import SamplingParams
        from pagoda.text.tokenizer import encode_chat

        request_id = f"chat-{next(self._turn_ids)}"
        try:
            prompt = encode_chat(self.engine.tokenizer, messages)
            params = SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature,
                                    top_p=settings.top_p, seed=settings.seed, ignore_eos=settings.ignore_eos)
            self.engine.add_request(request_id, prompt, params)
        except ValueError as error:  # too long for the context, a template error, a bad setting
            raise ChatError(str(error)) from error
        return self._stream(request_id)

    def _stream(self, request_id: str) -> Generator[Delta, None, None]:
        text_so_far = ""
        try:
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                for failed_id, failure in self.engine.pop_failures().items():
                    raise ChatError(f"request {failed_id} failed: {failure}")
                completion = next((o.outputs[0] for o in outputs if isinstance(o, RequestOutput)), None)
                if completion is None:  # a prompt chunk: nothing new, but a chance to stop
                    yield Delta("")
                    continue
                yield Delta(completion.text[len(text_so_far):], len(completion.token_ids))
                text_so_far = completion.text
        finally:
            self.engine.abort_request(request_id)  # a no-op once it has finished


class OpenAIBackend:
    """Any OpenAI-compatible server, through the official client."""

    def __init__(self, url: str, api_key: str | None, model: str | None, timeout: float) -> None:
        import openai  # a runtime dependency, imported here: the in-process chat does not need it

        base_url = url.rstrip("/")
        base_url = base_url if base_url.endswith("/v1") else f"{base_url}/v1"
        self._errors: tuple[type[Exception], ...] = (openai.OpenAIError,)
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0, timeout=timeout)
        try:
            self.model = model or self.client.models.list().data[0].id
        except (*self._errors, IndexError) as error:
            raise ChatError(f"{base_url}: cannot list its models ({error})") from error
        self.description = f"{self.model} at {base_url}"

    def answer(self, messages: list[Message], settings: AnswerSettings) -> Generator[Delta, None, None]:
        try:
            # Plain {"role", "content"} dicts, where the client's stub wants one TypedDict per role.
            stream = self.client.chat.completions.create(  # type: ignore[call-overload]
                model=self.model, messages=messages, stream=True,
                stream_options={"include_usage": True}, max_tokens=settings.max_tokens,
                temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed,
                extra_body={"ignore_eos": True} if settings.ignore_eos else None,
            )
        except self._errors as error:
            raise ChatError(str(error)) from error
        return self._stream(stream)

    def _stream(self, stream: Any) -> Generator[Delta, None, None]:
        try:
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        yield Delta(choice.delta.content)
                if chunk.usage is not None:
                    yield Delta("", chunk.usage.completion_tokens)
        except self._errors as error:
            raise ChatError(str(error)) from error
        finally:
            stream.close()  # closing the connection is how a client stops a server's generation


@dataclass(frozen=True)
class Answer:
    text: str
    stopped: bool  # by Ctrl-C
    ttft: float | None  # seconds from sending to the first token
    num_tokens: int | None  # None where the backend did not say (an OpenAI stream stopped early)
    decode_seconds: float  # from the first token to the last

    def stats_line(self) -> str:
        if self.ttft is None:
            return "[no tokens]"
        parts = [f"TTFT {self.ttft * 1000:.0f} ms"]
        if self.num_tokens is not None:
            parts.append(f"{self.num_tokens} token{'' if self.num_tokens == 1 else 's'}")
            if self.num_tokens > 1 and self.decode_seconds > 0:
                parts.append(f"{(self.num_tokens - 1) / self.decode_seconds:.1f} tokens/s")
        return "[" + ", ".join(parts) + "]"


class StopOnInterrupt:
    """While an answer streams, the first Ctrl-C asks it to stop (seen at its next delta); a second one
    raises KeyboardInterrupt, for a backend stuck waiting on a server."""

    def __enter__(self) -> StopOnInterrupt:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, _signum: int, _frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *_exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


class TerminalChat:
    def __init__(self, backend: ChatBackend, settings: AnswerSettings, system: str | None = None,
                 show_stats: bool = False, out: TextIO = sys.stdout, intro: str | None = None) -> None:
        self.backend = backend
        self.intro = intro
        self.settings = settings
        self.system = system
        self.show_stats = show_stats
        self.out = out
        self.history: list[Message] = []  # user and assistant turns, in order

    def run(self) -> int:
        self._say(f"chatting with {self.backend.description}; /help for commands, Ctrl-D to leave")
        if self.intro:
            self._say(self.intro)
        while True:
            try:
                line = input(PROMPT).strip()
            except (EOFError, KeyboardInterrupt):
                self._say("")
                return 0
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return 0
                continue
            self.turn(line)

    def command(self, line: str) -> bool:
        """Runs a /command; False when it ends the chat."""
        name, _, argument = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.history.clear()
            self._say("(conversation cleared)")
        elif name == "/system":
            self.system = argument.strip() or None
            self._say(f"(system prompt: {self.system!r})" if self.system else "(no system prompt)")
        elif name == "/stats":
            self.show_stats = not self.show_stats
            self._say(f"(stats {'on' if self.show_stats else 'off'})")
        elif name == "/help":
            self._say(HELP)
        else:
            self._say(f"unknown command {name}; /help lists them")
        return True

    def messages(self) -> list[Message]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def turn(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        try:
            answer = self.stream_answer(self.messages())
        except ChatError as error:
            self.history.pop()
            self._say(f"error: {error}")
            return
        self.history.append({"role": "assistant", "content": answer.text})
        if answer.stopped:
            self._say("[stopped]")
        if self.show_stats:
            self._say(answer.stats_line())

    def stream_answer(self, messages: list[Message]) -> Answer:
        started = time.monotonic()
        first_token_at = last_token_at = None
        parts: list[str] = []
        num_tokens: int | None = None
        stopped = False
        with StopOnInterrupt() as interrupt:
            deltas = self.backend.answer(messages, self.settings)
            try:
                for delta in deltas:
                    if delta.text or (delta.num_tokens or 0) > (num_tokens or 0):
                        last_token_at = time.monotonic()
                        first_token_at = first_token_at or last_token_at
                    num_tokens = delta.num_tokens if delta.num_tokens is not None else num_tokens
                    parts.append(delta.text)
                    self.out.write(delta.text)
                    self.out.flush()
                    if interrupt.requested:
                        stopped = True
                        break
            except KeyboardInterrupt:
                stopped = True
            finally:
                deltas.close()  # stops the generation if it is still going
        self.out.write("\n")
        ttft = None if first_token_at is None else first_token_at - started
        decode_seconds = 0.0 if first_token_at is None or last_token_at is None else last_token_at - first_token_at
        return Answer("".join(parts), stopped, ttft, num_tokens, decode_seconds)

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)


# --------------------------------------------------------------------------------------------------
# The `pagoda chat` command
# --------------------------------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    chat = commands.add_parser("chat", help="a conversation in the terminal (in-process, or --url a server)")
    add_engine_args(chat)
    chat.add_argument("--url", default=None,
                      help="an OpenAI-compatible server (e.g. http://localhost:8000) instead of a model in this "
                           "process; --model then names the server's model (default: the first it lists)")
    chat.add_argument("--api-key", default=None, help="the server's API key (default: $PAGODA_API_KEY, "
                                                      "$OPENAI_API_KEY)")
    chat.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server (--url)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer")
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--gen-seed", type=int, default=None, help="sampling seed")
    chat.add_argument("--ignore-eos", action="store_true", help="keep generating past the end of each turn")
    chat.add_argument("--stats", action="store_true", help="time to first token and tokens/s after each answer")
    chat.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    settings = AnswerSettings(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.gen_seed, ignore_eos=args.ignore_eos)
    try:
        backend = _url_backend(args) if args.url else _engine_backend(args)
    except ChatError as error:
        print(f"pagoda chat: {error}", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    logging.getLogger().setLevel(logging.WARNING)  # start-up said its piece; per-request logs would cut into answers
    builtin = backend.model == DEMO_SERVED_NAME if isinstance(backend, OpenAIBackend) else is_builtin_model(args.model)
    return TerminalChat(backend, settings, system=args.system, show_stats=args.stats,
                        intro=demo_intro() if builtin else None).run()


def demo_intro() -> str:
    """What the built-in model can do, and questions to type: two lines at the start of the chat."""
    from pagoda.demo import DEMO_EXAMPLES, DEMO_INTRO

    return f"{DEMO_INTRO} /reset starts a new one.\ntry: " + "  |  ".join(DEMO_EXAMPLES)


def _url_backend(args: argparse.Namespace) -> ChatBackend:
    # Every engine flag but --model (with --url, the server's model name) means nothing for a server's model.
    given = [flag for name, flag in engine_flags().items() if name != "model" and getattr(args, name) is not None]
    if given:
        raise ChatError(f"{', '.join(given)}: engine flags apply to a model in this process, not with --url")
    api_key = args.api_key or os.environ.get("PAGODA_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return OpenAIBackend(args.url, api_key, args.model, args.timeout)


def _engine_backend(args: argparse.Namespace) -> ChatBackend:
    from pagoda.engine.engine import LLMEngine

    args.model = model_to_load(args.model, "chat")
    engine = LLMEngine(engine_config_from(args))
    return EngineBackend(engine, served_model_name(args.model))
