"""Helpers for the server tests: tiny checkpoints, `pagoda serve` as a subprocess, /metrics scraping and
OpenAI's error shape.

Each server test module starts its own server once (module-scoped fixture) on a free loopback port and
waits for /health by polling, never by sleeping a fixed time. Servers run with one thread each.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

LOOPBACK = "127.0.0.1"
POLL_INTERVAL_S = 0.02
STARTUP_TIMEOUT_S = 120.0
CLIENT_TIMEOUT_S = 30.0
API_KEY = "test-key"  # what clients send when the server does not check keys


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


def make_server_checkpoint(out_dir: Path, *, chat_template: bool = True, **kwargs) -> Path:
    """A tiny seeded Llama checkpoint (hidden 64, vocab 512); without a chat template when asked."""
    from pagoda.testing.checkpoints import make_checkpoint

    model_dir = make_checkpoint(Path(out_dir), "llama", **kwargs)
    if not chat_template:
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config.pop("chat_template", None)
        config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
        for name in ("chat_template.jinja", "chat_template.json"):
            (model_dir / name).unlink(missing_ok=True)
    return model_dir


# --------------------------------------------------------------------------------------------------
# The server process
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = POLL_INTERVAL_S):
    """Polls predicate() until it returns something truthy (and returns that), or fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    model_name: str
    log_path: Path
    api_key: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    # --- clients -----------------------------------------------------------------------------------

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key or API_KEY,
                             max_retries=0, timeout=CLIENT_TIMEOUT_S)

    def async_client(self, api_key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key or API_KEY,
                                  max_retries=0, timeout=CLIENT_TIMEOUT_S)

    def http(self, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, timeout=CLIENT_TIMEOUT_S, headers=headers, **kwargs)

    def post(self, path: str, body: object = None, **kwargs) -> httpx.Response:
        with self.http() as http:
            return http.post(path, json=body, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        with self.http() as http:
            return http.get(path, **kwargs)

    # --- state -------------------------------------------------------------------------------------

    def health(self) -> int | None:
        """/health's status code, or None while nothing listens on the port."""
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code
        except httpx.TransportError:
            return None

    def wait_for_health(self, wanted: int, timeout: float = STARTUP_TIMEOUT_S) -> None:
        def reached() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            return self.health() == wanted

        wait_until(reached, timeout, f"/health {wanted}")

    def metrics(self) -> Metrics:
        response = httpx.get(f"{self.url}/metrics", timeout=10.0)
        assert response.status_code == 200, response.text
        return Metrics.parse(response.text)

    def wait_for_metrics(self, predicate: Callable[[Metrics], bool], what: str, timeout: float = 20.0) -> Metrics:
        def check() -> Metrics | None:
            metrics = self.metrics()
            return metrics if predicate(metrics) else None

        return wait_until(check, timeout, what)

    def wait_until_idle(self, timeout: float = 20.0) -> Metrics:
        """No request running or waiting, and every KV block back in the pool."""
        return self.wait_for_metrics(
            lambda m: m.gauge("vllm:num_requests_running") == 0 and m.gauge("vllm:num_requests_waiting") == 0
            and m.gauge("vllm:kv_cache_usage_perc") == 0,
            "an idle engine (nothing running or waiting, kv usage 0)",
            timeout,
        )

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def launch_server(
    model_dir: Path | None,
    log_dir: Path,
    *args: str,
    served_model_name: str | None = None,
    api_key: str | None = None,
    wrapper: str | None = None,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Starts `python -m pagoda serve` (or `python -c wrapper serve ...`) without waiting for it. No model_dir:
    the built-in demo model, as the README's `make serve` does."""
    port = free_port()
    model_args = [] if model_dir is None else ["--model", str(model_dir)]
    serve_args = ["serve", *model_args, "--host", LOOPBACK, "--port", str(port), "--uvicorn-log-level", "warning",
                  *args]
    if served_model_name:
        serve_args += ["--served-model-name", served_model_name]
    if api_key:
        serve_args += ["--api-key", api_key]
    command = [sys.executable, "-c", wrapper] if wrapper else [sys.executable, "-m", "pagoda"]
    process_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                   "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path = Path(log_dir) / f"server-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command + serve_args, stdout=log, stderr=subprocess.STDOUT, env=process_env)
    return ServerProcess(process, port, served_model_name or str(model_dir), log_path, api_key)


def launch_router(replica_urls: list[str], log_dir: Path, *args: str, served_model_name: str) -> ServerProcess:
    """Starts `python -m pagoda route` over the replicas, polling often, without waiting for it."""
    port = free_port()
    command = [sys.executable, "-m", "pagoda", "route", "--host", LOOPBACK, "--port", str(port),
               "--poll-interval", "0.2", *args]
    for url in replica_urls:
        command += ["--replica", url]
    log_path = Path(log_dir) / f"router-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return ServerProcess(process, port, served_model_name, log_path)


def start_server(model_dir: Path, log_dir: Path, *args: str, **kwargs) -> ServerProcess:
    """launch_server, then wait for /health 200 (stopping the process if it never gets there)."""
    server = launch_server(model_dir, log_dir, *args, **kwargs)
    try:
        server.wait_for_health(200)
    except BaseException:
        server.stop()
        raise
    return server


# --------------------------------------------------------------------------------------------------
# /metrics
# --------------------------------------------------------------------------------------------------


@dataclass
class Metrics:
    """Samples of one scrape: (sample name, sorted labels) -> value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    families: dict[str, str]  # family name -> type

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples, families = {}, {}
        for family in text_string_to_metric_families(text):
            families[family.name] = family.type
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return cls(samples, families)

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 when there is none)."""
        wanted = set(labels.items())
        return sum(v for (n, sample_labels), v in self.samples.items() if n == name and wanted <= set(sample_labels))

    def gauge(self, name: str) -> float:
        return self.value(name)

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [dict(labels) for (n, labels) in self.samples if n == name]


# --------------------------------------------------------------------------------------------------
# OpenAI's error shape
# --------------------------------------------------------------------------------------------------


def assert_openai_error(response: httpx.Response, status: int, *, param: str | None | type = ...,
                        contains: Sequence[str] = ()) -> dict:
    """The response is `status` with OpenAI's body {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, f"{response.status_code} {response.text}"
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] in (status, str(status)), error
    if param is not ...:
        assert error["param"] == param, error
    for text in contains:
        assert text in error["message"], error
    return error
