"""The all-reduce of tensor-parallel ranks on one machine, through shared memory instead of gloo's loopback TCP.

A decode step all-reduces twice a layer (after o and after down), a few KiB each; through gloo one takes ~1 ms
on a small VM (loopback TCP and a helper thread per peer, scheduled on cores the ranks are computing on), a third
of a bench-1b step at TP = 2. `SharedMemoryAllReduce` runs the same sum through a region every rank maps
(kernels/cpu_shm_reduce.cpp): each rank writes its partial sums into its slot, waits for the others', and adds
the slots in rank order, so every rank holds the same sum bit for bit. What exceeds a slot (a prefill's
activations) goes through gloo as before: there the sum's arithmetic dwarfs gloo's latency.

`connect` is collective over a tensor-parallel group: it builds the reducer only where every rank of the group
is on this machine and has the kernels, and all of them agree; otherwise every rank keeps gloo.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# fp32 elements one call takes (1 MiB a slot): a decode step of 64 rows at hidden size 4,096.
CAPACITY = 1 << 18
# A rank that exits or is killed is noticed within milliseconds; this bounds a wait on one that runs but never comes.
TIMEOUT_S = 600.0


class SharedMemoryAllReduce:
    """In-place sums over the group's ranks, for fp32 and bf16 tensors of up to CAPACITY elements (`takes`). Every
    rank makes the same calls in the same order, as with any collective."""

    def __init__(self, kernels: Any, region: torch.Tensor, rank: int, pids: list[int]) -> None:
        self.kernels, self.region, self.rank, self.pids = kernels, region, rank, pids
        self.sequence = 0  # the calls made: each rank numbers them alike

    def takes(self, tensor: torch.Tensor) -> bool:
        return (tensor.dtype in (torch.float32, torch.bfloat16) and tensor.is_contiguous()
                and tensor.numel() <= CAPACITY)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.sequence += 1
        self.kernels.shm_all_reduce_(tensor, self.region, self.rank, CAPACITY, self.sequence, self.pids, TIMEOUT_S)
        return tensor

    def abort(self) -> None:
        """The other ranks' waits fail (this rank will make no more calls)."""
        self.kernels.shm_abort(self.region, len(self.pids))


def region_bytes(ranks: int, kernels: Any) -> int:
    return int(kernels.shm_line_bytes) * (ranks + 1) + 2 * ranks * CAPACITY * 4


def _kernels() -> Any:
    from pagoda.kernels import available_targets, cpu_kernels

    return cpu_kernels() if available_targets() else None


def connect(rank: int, size: int, group: dist.ProcessGroup | None, tag: str) -> SharedMemoryAllReduce | None:
    """Collective over `group` (rank: this process's place in it, of `size`): the group's shared-memory reducer,
    or None on every rank where any rank is on another machine, lacks the kernels or cannot map the region. The
    region is a file under /dev/shm that the group's first rank makes (named by its pid and `tag`, which tells its
    groups apart) and removes once every rank has mapped it: nothing is left behind, whatever becomes of the ranks."""
    kernels = _kernels() if SHM_DIR.is_dir() else None
    path = SHM_DIR / f"pagoda-all-reduce-{os.getpid()}-{tag}"
    ready = kernels is not None
    if rank == 0 and kernels is not None:
        try:
            with path.open("wb") as file:
                file.truncate(region_bytes(size, kernels))  # zeros: no rank has published a call
        except OSError as error:
            logger.warning("tensor-parallel ranks keep gloo's all-reduce: %s", error)
            ready = False
    peers: list[Any] = [None] * size
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid(), ready, str(path)), group=group)
    region = None
    if len({host for host, *_ in peers}) == 1 and all(ready for _, _, ready, _ in peers):
        assert kernels is not None
        try:
            region = torch.from_file(peers[0][3], shared=True, size=region_bytes(size, kernels), dtype=torch.uint8)
        except RuntimeError as error:
            logger.warning("tensor-parallel rank %d cannot map the all-reduce region: %s", rank, error)
    mapped: list[Any] = [None] * size
    dist.all_gather_object(mapped, region is not None, group=group)
    if rank == 0:
        path.unlink(missing_ok=True)
    if region is None or not all(mapped):
        return None
    return SharedMemoryAllReduce(kernels, region, rank, [pid for _, pid, _, _ in peers])
