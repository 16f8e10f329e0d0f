"""How one model is split across processes: tensor and pipeline parallelism (docs/parallelism.md).

Torch-free, like the rest of the configuration (pagoda.config re-exports it): the CLI's --help reads its
defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

# How the ranks of one model are started (vLLM's names): "uni" one process, "mp" pagoda starts them as processes on
# this machine; "external_launcher": torchrun, Kubernetes or a script started one process a rank
# (engine/external_ranks.py).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "uni", "external_launcher")
# Whether the ranks pagoda starts are bound to CPUs of their own (vLLM's VLLM_CPU_OMP_THREADS_BIND values):
# cpu_sets.py.
CPU_THREADS_BIND = ("auto", "nobind")


@dataclass(frozen=True)
class ParallelConfig:
    """How one model is split across processes (docs/parallelism.md).

    tensor_parallel_size: ranks every layer is split across, Megatron-style, one process each.
    pipeline_parallel_size: stages the layers are split into, contiguous, each stage on its own
    tensor_parallel_size ranks (world size: their product).
    distributed_executor_backend: "uni" (one process; one rank only), "mp" (pagoda starts the ranks as worker
    processes on this machine) or "external_launcher" (torchrun or Kubernetes started one process a rank, each
    running the same command); None: "mp" when there are several ranks, else "uni".
    enable_expert_parallel: a mixture of experts' routed experts are placed across the tensor-parallel ranks, whole
    (each rank holds num_experts / tensor_parallel_size of them), and tokens travel to them (docs/moe.md).
    enable_eplb: vLLM's expert load balancing (hot experts replicated); named so that it is refused by name.
    cpu_threads_bind: "auto": under "mp", each rank's threads bound to CPUs of its own where the machine has
    enough (cpu_sets.py); "nobind": left to the OS.
    cpu_threads_adapt: one process's step runs with fewer threads while that is clearly faster (another process
    busy on one of its cores), probing from time to time whether more are faster again (engine/thread_tuner.py);
    False: always the threads it started with. Ranks of a split model keep theirs (they meet at collectives).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    cpu_threads_bind: str = "auto"
    cpu_threads_adapt: bool = True

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                             f"got {backend!r}")
        if backend == "external_launcher" and self.world_size == 1:
            raise ValueError('distributed_executor_backend "external_launcher" starts one process a rank: it needs '
                             'tensor_parallel_size x pipeline_parallel_size above 1')
        if self.cpu_threads_bind not in CPU_THREADS_BIND:
            raise ValueError(f"cpu_threads_bind must be one of {', '.join(CPU_THREADS_BIND)}, "
                             f"got {self.cpu_threads_bind!r}")
        if self.enable_eplb:
            raise ValueError("enable_eplb (expert load balancing: hot experts replicated across ranks) is not built; "
                             "enable_expert_parallel places each expert on one rank")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f'distributed_executor_backend "uni" runs one process; tensor_parallel_size '
                             f'{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size} '
                             'needs "mp"')

    @property
    def world_size(self) -> int:
        """The ranks the model runs on: tensor_parallel_size in each of pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend that runs: the one given, else "mp" for several ranks and "uni" for one."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.world_size > 1 else "uni"
