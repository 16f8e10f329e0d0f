"""Ranks started by an external launcher (`--distributed-executor-backend external_launcher`), as torchrun or a
Kubernetes LeaderWorkerSet start them: every rank runs the same command, told its place by RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; rank 0 runs the engine, the others serve it and end with it.

Under torchrun, `LLM(...)` in a script gives greedy output equal to transformers' (up to the near-tie rule) and every
rank exits 0 once the script ends. `pagoda serve` started rank by rank with the variables (no torchrun) answers
over HTTP as the unsplit model does; a killed rank turns /health to 503 within seconds with the rank named, and
stopping rank 0 ends the others. A launcher that started the wrong number of ranks, or none of the variables, is
refused with what is wrong.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import compare_with_reference
from server_fixtures import ServerProcess, free_port, wait_until
from test_correctness import MAX_NEW_TOKENS, PROMPTS

from pagoda.config import ParallelConfig
from pagoda.engine.external_ranks import launched_rank

DETECTION_S = 5.0
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
SPLIT = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "external_launcher"]

SCRIPT = textwrap.dedent("""
    import json, sys
    from pagoda import LLM
    from test_correctness import PROMPTS, run_greedy
    llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="external_launcher",
              block_size=4, num_kv_blocks=64)
    print("TOKENS", json.dumps(run_greedy(llm, PROMPTS)), flush=True)
""")


def test_torchrun_runs_a_script_split_in_two_equal_to_transformers(checkpoint, hf_reference, tmp_path):
    model_dir = checkpoint("llama")
    script = tmp_path / "split.py"
    script.write_text(SCRIPT)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), ENV.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script), str(model_dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # every rank exited 0
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, "rank 0 alone runs the script past LLM(...)"
    outputs = json.loads(lines[0].removeprefix("TOKENS "))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        compare_with_reference(output, hf_reference(model_dir, prompt, MAX_NEW_TOKENS))


def launch_rank(rank: int, master_port: int, port: int, log_dir, *args: str) -> subprocess.Popen:
    env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
    log = open(log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 (the process holds it)
    return subprocess.Popen([sys.executable, "-m", "pagoda", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--uvicorn-log-level", "warning", "--dtype", "float32", *SPLIT, *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def test_ranks_started_one_by_one_serve_and_end_together(make_llm, tmp_path):
    """Rank by rank with the variables, as a Kubernetes pod per rank would: rank 1 first, then rank 0."""
    master_port, port = free_port(), free_port()
    worker = launch_rank(1, master_port, port, tmp_path)
    server = ServerProcess(launch_rank(0, master_port, port, tmp_path), port, "pagoda-demo", tmp_path / "rank0.log")
    try:
        server.wait_for_health(200)
        prompt = "What is 12 + 35?"
        answer = server.client().completions.create(model="pagoda-demo", prompt=prompt, max_tokens=16,
                                                     temperature=0, extra_body={"ignore_eos": True})
        from pagoda.demo import DEMO_MODEL_DIR
        from pagoda.sampling import SamplingParams

        with make_llm(DEMO_MODEL_DIR, dtype="float32") as unsplit:
            [expected] = unsplit.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert answer.choices[0].text == expected.outputs[0].text
        server.stop()  # SIGTERM to rank 0: it stops serving, then tells rank 1 to stop
        assert worker.wait(timeout=30) == 0
    finally:
        server.stop()
        worker.kill()
        worker.wait()


def test_a_killed_launched_rank_ends_the_engine_within_seconds(tmp_path):
    master_port, port = free_port(), free_port()
    worker = launch_rank(1, master_port, port, tmp_path)
    server = ServerProcess(launch_rank(0, master_port, port, tmp_path), port, "pagoda-demo", tmp_path / "rank0.log")
    try:
        server.wait_for_health(200)
        worker.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: server.health() == 503, DETECTION_S, "/health 503")
        assert time.monotonic() - killed_at < DETECTION_S
        refused = server.post("/v1/completions", {"model": "pagoda-demo", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "rank 1 exited" in refused.json()["error"]["message"]
    finally:
        server.stop()
        worker.kill()
        worker.wait()
    assert server.process.returncode is not None


def test_the_launchers_variables_are_checked(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        launched_rank(2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 .* is 2"):
        launched_rank(2)
    place = launched_rank(4)
    assert (place.rank, place.world_size, place.master_addr) == (1, 4, "10.0.0.5")
    with pytest.raises(ValueError, match="needs tensor_parallel_size x pipeline_parallel_size above 1"):
        ParallelConfig(distributed_executor_backend="external_launcher")


def test_serve_says_which_variable_is_missing(tmp_path):
    env = {key: value for key, value in ENV.items() if key not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "pagoda", "serve", *SPLIT], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode != 0
    assert "pagoda serve: " in done.stderr and "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in done.stderr
    assert "Traceback" not in done.stderr
