"""Tensor parallelism (docs/parallelism.md): one model split across 2 processes, over gloo on the CPU.

Greedy fp32 output equals transformers' and the unsplit engine's token for token (up to the near-tie rule) for
each architecture, a KV head shared by both ranks included, whatever the batching: everything at once, chunked
prefill in a pool so small that requests are preempted, and a batch served from the prefix cache. Each rank
holds 1/N of the split weights and all of the replicated ones; closing the LLM, dropping it, or its process
exiting, even killed, leaves no worker process behind.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import compare_with_reference
from safetensors import safe_open
from test_correctness import MAX_NEW_TOKENS, PROMPTS, observe_schedules, run_greedy, same_bytes_pool
from test_native_decode import CountingStack

from pagoda.config import ParallelConfig
from pagoda.cpu_sets import split_cpus
from pagoda.kernels import available_targets
from pagoda.model.loader import load_model_config, safetensors_files
from pagoda.model_dir import ModelLoadError

# Split KV heads (llama: 2 of them, one a rank), one KV head on both ranks (llama-mqa), biases on q/k/v and tied
# embeddings (qwen2), per-head q/k norms and head_dim 32 (qwen3), a sliding window (mistral); soft-capped
# attention and logits (gemma2), a second rope table for the local layers (gemma3), q/k/v and gate/up fused in the
# checkpoint, split and then sliced, with partial rotary (phi3).
ARCHITECTURES = ["llama", "llama-mqa", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]
MODES = {
    "batched": dict(block_size=16, num_kv_blocks=64),
    # Chunks of 7 tokens in 20 blocks of 4: chunks share steps with decodes, and requests are preempted.
    "chunked+preemption": dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=7),
    # The same batch twice: the second time, every prompt's full blocks come from the prefix cache.
    "prefix-cached": dict(block_size=4, num_kv_blocks=256),
}


def process_gone(pid: int) -> bool:
    """Exited and reaped, or at least a zombie (it runs nothing more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(not process_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if not process_gone(pid)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tp2_greedy_matches_tp1_and_transformers(arch, mode, checkpoint, hf_reference, make_llm, monkeypatch):
    model_dir = checkpoint(arch)
    references = [hf_reference(model_dir, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    options = same_bytes_pool(model_dir, MODES[mode])  # a hybrid model's blocks: tests/test_correctness.py
    unsplit = run_greedy(make_llm(model_dir, **options), PROMPTS)
    with make_llm(model_dir, tensor_parallel_size=2, **options) as llm:
        assert llm.engine.executor.tensor_parallel_size == 2
        steps = observe_schedules(monkeypatch, llm.engine.scheduler)
        if mode == "prefix-cached":
            run_greedy(llm, PROMPTS)
            steps.clear()
        split = run_greedy(llm, PROMPTS)
    for index, (tokens, single, reference) in enumerate(zip(split, unsplit, references)):
        label = f"{arch}/{mode}/prompt {index} ({len(PROMPTS[index])} tokens)"
        tie = compare_with_reference(tokens, reference, f"{label}, TP=2")
        if tie is not None:
            assert tokens[:tie] == single[:tie], label
        elif tokens != single:  # then TP=1 is the one that met a near-tie, which the rule must excuse
            assert compare_with_reference(single, reference, f"{label}, TP=1") is not None, label
    scheduler = llm.engine.scheduler
    if mode == "batched":
        assert len(steps[0]) == len(PROMPTS), "all prompts should be prefilled in the first step"
    elif mode == "chunked+preemption":
        assert scheduler.num_preemptions > 0
        assert max(sum(r[1] for r in s) for s in steps) <= 7
    else:
        assert [r[0] for r in steps[0]] == [(len(p) - 1) // 4 * 4 for p in PROMPTS], "every full block is a hit"


def test_tp4_shares_each_kv_head_between_two_ranks_and_matches_transformers(checkpoint, hf_reference, make_llm):
    """4 heads and 2 KV heads over 4 ranks: one q head a rank, each KV head on two of them."""
    model_dir = checkpoint("llama")
    with make_llm(model_dir, tensor_parallel_size=4, **MODES["chunked+preemption"]) as llm:
        assert len(llm.engine.executor.worker_pids()) == 3
        assert llm.engine.model.config.num_heads == llm.engine.model.config.num_kv_heads == 1
        tokens = run_greedy(llm, PROMPTS[:5])
    for index, (output, prompt) in enumerate(zip(tokens, PROMPTS)):
        compare_with_reference(output, hf_reference(model_dir, prompt, MAX_NEW_TOKENS), f"llama TP=4/prompt {index}")


@pytest.mark.skipif(not available_targets(), reason="this CPU has neither AVX2 + FMA nor AVX-512")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_every_rank_decodes_through_the_native_stack(quantization, checkpoint, hf_reference, make_llm):
    """Each rank's decode steps run its share through the native stack, which all-reduces o's and down's partial
    sums itself: rank 0's stack runs the decode steps, and the workers report theirs."""
    model_dir = checkpoint("llama")
    with make_llm(model_dir, tensor_parallel_size=2, quantization=quantization,
                  **MODES["chunked+preemption"]) as llm:
        assert [report.native_decode for report in llm.engine.executor.rank_reports()] == [True, True]
        runner = llm.engine.model.backend.decode_runner
        runner.stack = counter = CountingStack(runner.stack)
        tokens = run_greedy(llm, PROMPTS)
        assert counter.calls > MAX_NEW_TOKENS
    if quantization is None:
        for index, (output, prompt) in enumerate(zip(tokens, PROMPTS)):
            compare_with_reference(output, hf_reference(model_dir, prompt, MAX_NEW_TOKENS), f"prompt {index}")


def checkpoint_bytes(model_dir: Path, tensor_parallel_size: int) -> tuple[int, int]:
    """(bytes of the tensors split across ranks, bytes of those every rank holds whole), from the checkpoint:
    norms and the biases added after an all-reduce are whole, and so are k and v when there are fewer KV heads
    than ranks; everything else is split."""
    config = load_model_config(model_dir)
    split = whole = 0
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = reader.get_slice(name)
                size = math.prod(tensor.get_shape()) * {"F32": 4, "BF16": 2}[tensor.get_dtype()]
                replicated = ("norm" in name or name.endswith(("o_proj.bias", "down_proj.bias"))
                              or ("k_proj" in name or "v_proj" in name) and config.num_kv_heads < tensor_parallel_size)
                if replicated:
                    whole += size
                else:
                    split += size
    return split, whole


@pytest.mark.parametrize("arch", ["llama", "llama-mqa", "qwen2"])
def test_each_rank_holds_its_share_of_the_weights(arch, checkpoint, make_llm):
    model_dir = checkpoint(arch)
    split, whole = checkpoint_bytes(model_dir, 2)
    assert split > 10 * whole > 0
    with make_llm(model_dir, use_kernels=False) as unsplit:
        assert unsplit.engine.executor.weight_bytes_per_rank() == [split + whole]
    with make_llm(model_dir, tensor_parallel_size=2) as llm:
        assert llm.engine.executor.weight_bytes_per_rank() == [split // 2 + whole] * 2


def test_bfloat16_splits_and_matches_the_unsplit_torch_path_on_the_first_token(checkpoint, make_llm):
    model_dir = checkpoint("llama")
    unsplit = run_greedy(make_llm(model_dir, dtype="bfloat16", use_kernels=False), PROMPTS)
    with make_llm(model_dir, dtype="bfloat16", tensor_parallel_size=2) as llm:
        split, whole = checkpoint_bytes(model_dir, 2)
        assert llm.engine.executor.weight_bytes_per_rank() == [(split // 2 + whole) // 2] * 2
        tokens = run_greedy(llm, PROMPTS)
    assert [t[0] for t in tokens] == [t[0] for t in unsplit]


def test_closing_the_llm_stops_its_workers(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama"), tensor_parallel_size=2)
    [pid] = llm.engine.executor.worker_pids()
    assert not process_gone(pid)
    run_greedy(llm, PROMPTS[:2])
    llm.close()
    assert process_gone(pid)
    llm.close()  # idempotent
    with make_llm(checkpoint("llama"), tensor_parallel_size=2) as again:  # the process can split a model again
        [pid] = again.engine.executor.worker_pids()
    assert process_gone(pid)


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The distinct CPU sets of the process's threads."""
    return {frozenset(os.sched_getaffinity(int(thread.name))) for thread in Path(f"/proc/{pid}/task").iterdir()}


def test_each_rank_runs_on_cpus_of_its_own_until_the_engine_closes(checkpoint, make_llm):
    everyone = frozenset(os.sched_getaffinity(0))
    expected = split_cpus(everyone, 2, max(1, torch.get_num_threads() // 2))
    with make_llm(checkpoint("llama"), tensor_parallel_size=2) as llm:
        [pid] = llm.engine.executor.worker_pids()
        ranks = [thread_cpus(os.getpid()), thread_cpus(pid)]
        bound = run_greedy(llm, PROMPTS[:2])
    assert ranks == ([{everyone}] * 2 if expected is None else [{frozenset(cpus)} for cpus in expected])
    assert thread_cpus(os.getpid()) == {everyone}, "closing gives the engine's process its CPUs back"
    with make_llm(checkpoint("llama"), tensor_parallel_size=2, cpu_threads_bind="nobind") as llm:
        [pid] = llm.engine.executor.worker_pids()
        assert thread_cpus(os.getpid()) == thread_cpus(pid) == {everyone}
        assert run_greedy(llm, PROMPTS[:2]) == bound


WORKER_OWNER = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from pagoda import LLM
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=64, block_size=4)
    print(*llm.engine.executor.worker_pids(), flush=True)
    if sys.argv[2] == "wait":
        sys.stdin.read()
""")


@pytest.mark.parametrize("ending", ["exits", "killed"])
def test_no_worker_outlives_the_engine_process(ending, checkpoint):
    """An engine process that exits without closing, or is killed (SIGKILL: no clean-up runs), leaves no worker."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    owner = subprocess.Popen([sys.executable, "-c", WORKER_OWNER, str(checkpoint("llama")),
                              "wait" if ending == "killed" else "exit"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pids) == 1
        if ending == "killed":
            assert not process_gone(pids[0])
            owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=60)
        assert wait_gone(pids) == []
    finally:
        owner.kill()
        owner.wait()


def test_olmo2_is_refused_with_the_reason(checkpoint, make_llm):
    """OLMo 2's q/k norms span every head of the projection: a rank holding some heads cannot compute them."""
    with pytest.raises(ModelLoadError, match="olmo2: its q/k norms span every head"):
        make_llm(checkpoint("olmo2"), tensor_parallel_size=2)


def test_a_model_that_does_not_divide_is_refused_before_anything_starts(checkpoint, make_llm):
    with pytest.raises(ModelLoadError, match="num_attention_heads 4 is not a multiple of 3"):
        make_llm(checkpoint("llama"), tensor_parallel_size=3)
    with pytest.raises(ModelLoadError, match="cannot split int4 weights of group size 64"):
        make_llm(checkpoint("llama"), tensor_parallel_size=2, quantization="int4",
                 quantization_config={"group_size": 64})


@pytest.mark.parametrize(("options", "message"), [
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), 'needs "mp"'),
    (dict(distributed_executor_backend="external_launcher"), "needs tensor_parallel_size x pipeline_parallel_size"),
    (dict(tensor_parallel_size=0), "must be positive"),
    (dict(cpu_threads_bind="all"), "cpu_threads_bind must be one of auto, nobind"),
])
def test_parallel_options_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**options)


def test_the_backend_follows_the_size_unless_given():
    assert ParallelConfig().executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).executor_backend == "mp"
    assert ParallelConfig(distributed_executor_backend="mp").executor_backend == "mp"
