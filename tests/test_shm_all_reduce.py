"""The shared-memory all-reduce of one machine's tensor-parallel ranks (model/shm_all_reduce.py), in two processes.

Every rank gets the rank-ordered fp32 sum, bit for bit the same on each, for fp32 and bf16 tensors of every size
up to a slot (calls of alternating sizes exercise the two slots a rank alternates between); what exceeds a slot
goes through gloo. Ranks on different machines keep gloo. A rank that exits is noticed by the one waiting on it
within a second, not at a timeout. No region file is left in /dev/shm.
"""

from __future__ import annotations

import io
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagoda.kernels import available_targets
from pagoda.model import shm_all_reduce

pytestmark = pytest.mark.skipif(not available_targets() or not shm_all_reduce.SHM_DIR.is_dir(),
                                reason="needs the CPU kernels and /dev/shm")

SIZES = [1, 2048, 4096 * 3 + 5, shm_all_reduce.CAPACITY, shm_all_reduce.CAPACITY + 1]


def _partial(rank: int, call: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(size, generator=gen).to(dtype)


def _join(rank: int, port: int, scenario: str) -> shm_all_reduce.SharedMemoryAllReduce | None:
    torch.set_num_threads(1)
    if scenario == "two machines" and rank == 1:
        socket.gethostname = lambda: "elsewhere"  # type: ignore[assignment]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    return shm_all_reduce.connect(rank, 2, None, "test")


def _sums(rank: int, port: int, scenario: str, results: mp.Queue) -> None:
    reducer = _join(rank, port, scenario)
    outputs = []
    for call, (size, dtype) in enumerate((size, dtype) for _ in range(3) for size in SIZES
                                         for dtype in (torch.float32, torch.bfloat16)):
        tensor = _partial(rank, call, size, dtype)
        if reducer is not None and reducer.takes(tensor):
            reducer(tensor)
        else:
            dist.all_reduce(tensor)
        outputs.append(tensor)
    saved = io.BytesIO()  # as bytes: a tensor put on a queue is shared through this process, which may be gone
    torch.save(outputs, saved)
    results.put((rank, reducer is not None, None if reducer is None else reducer.sequence, saved.getvalue()))
    dist.barrier()


def _exits(rank: int, port: int, _: str, results: mp.Queue) -> None:
    reducer = _join(rank, port, "one machine")
    assert reducer is not None
    if rank == 1:
        os._exit(0)  # gone without a word: no collective, no abort
    started = time.monotonic()
    try:
        reducer(torch.ones(8))
        results.put("returned")
    except RuntimeError as error:
        results.put((str(error), time.monotonic() - started))


def _run(target, scenario: str, reports: int) -> list:
    """The first `reports` things the two ranks put (read before joining: a process exits once its puts are read)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = [context.Process(target=target, args=(rank, port, scenario, results)) for rank in range(2)]
    for process in processes:
        process.start()
    got = [results.get(timeout=120) for _ in range(reports)]
    for process in processes:
        process.join(timeout=30)
    return got


def _leftovers() -> list[Path]:
    return list(shm_all_reduce.SHM_DIR.glob("pagoda-all-reduce-*"))


@pytest.mark.parametrize("scenario", ["one machine", "two machines"])
def test_every_rank_gets_the_same_rank_ordered_sum(scenario):
    before = _leftovers()
    got = {rank: (shared, sequence, torch.load(io.BytesIO(saved)))
           for rank, shared, sequence, saved in _run(_sums, scenario, 2)}
    shared, sequence, outputs = got[0]
    assert shared == (scenario == "one machine") == got[1][0]
    if shared:  # the calls that fit a slot took the shared region, the same count on each rank
        assert sequence == got[1][1] == 3 * 2 * sum(size <= shm_all_reduce.CAPACITY for size in SIZES)
    calls = [(size, dtype) for _ in range(3) for size in SIZES for dtype in (torch.float32, torch.bfloat16)]
    for call, ((size, dtype), mine, theirs) in enumerate(zip(calls, outputs, got[1][2])):
        assert mine.dtype == dtype and torch.equal(mine.view(-1), theirs.view(-1)), f"call {call}: ranks differ"
        expected = _partial(0, call, size, dtype).float() + _partial(1, call, size, dtype).float()
        if shared and size <= shm_all_reduce.CAPACITY:  # summed in fp32, rounded once
            assert torch.equal(mine, expected.to(dtype)), f"call {call}"
        else:
            torch.testing.assert_close(mine.float(), expected, rtol=1e-2, atol=1e-2)
    assert _leftovers() == before


def test_a_rank_that_exits_is_noticed_at_once():
    (result,) = _run(_exits, "one machine", 1)
    assert result != "returned"
    message, waited = result
    assert "rank 1" in message and "exited" in message
    assert waited < 2.0
