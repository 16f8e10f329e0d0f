"""Autoscaling a simulated fleet the way a Kubernetes HPA (or KEDA) scales pagoda's StatefulSet.

The autoscaler reads one of the replicas' own gauges at every poll, summed over the replicas that are up:
vllm:num_requests_waiting (the default, as deploy/k8s/keda-scaledobject.yaml) or vllm:kv_cache_usage_perc.
Averaged over the last `window_s` seconds, that sum over a target per replica is the replica count it wants
(HPA's AverageValue rule: ceil(total / target)), held within [min_replicas, max_replicas]. It scales up at once
(HPA's default) and down only when nothing was scaled for `cooldown_s` (KEDA's cooldownPeriod).

What it scales are slots, as a StatefulSet's ordinals: the router lists max_replicas of them and routes to
those whose health check answers. A new replica starts cold (an empty prefix cache) and answers its health
check `startup_delay_s` after it was asked for (weights loaded, kernels warm). Scaling down cancels replicas
still starting first, then drains the highest ordinals up: the router stops sending to them at once (their
health check fails), and what they hold runs to its end, as `pagoda serve` drains on SIGTERM; the slot is free
again when their last request has finished.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

# the gauge (vLLM's name, without its vllm: prefix) -> its default target per replica
METRICS: dict[str, float] = {"num_requests_waiting": 4.0, "kv_cache_usage_perc": 0.7}


@dataclass(frozen=True)
class AutoscaleConfig:
    min_replicas: int = 1
    max_replicas: int = 8
    metric: str = "num_requests_waiting"
    target: float = METRICS["num_requests_waiting"]  # per replica: waiting requests, or a fraction of the KV pool
    window_s: float = 30.0
    cooldown_s: float = 60.0
    startup_delay_s: float = 20.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("autoscaling needs 1 <= min_replicas <= max_replicas")
        if self.metric not in METRICS:
            raise ValueError(f"autoscale metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if not self.target > 0:
            raise ValueError("the autoscale target must be above 0")
        for name in ("window_s", "cooldown_s", "startup_delay_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"autoscale {name} must be at least 0")


class Autoscaler:
    """Decisions only: what the polls showed, and how many replicas that asks for."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._samples: deque[tuple[float, float]] = deque()  # (time, the metric summed over the replicas up)
        self._last_scaled_s = -math.inf

    def observe(self, now: float, values: list[float]) -> None:
        """One poll: the metric of each replica that is up."""
        self._samples.append((now, sum(values)))
        while self._samples[0][0] < now - self.config.window_s:
            self._samples.popleft()

    @property
    def windowed(self) -> float:
        """The metric's sum over the replicas up, averaged over the window's polls."""
        return sum(value for _, value in self._samples) / len(self._samples) if self._samples else 0.0

    def decide(self, now: float, provisioned: int) -> int:
        """How many replicas there should be (started or starting), given `provisioned` now."""
        if not self._samples:
            return provisioned
        config = self.config
        wanted = max(config.min_replicas, min(config.max_replicas, math.ceil(self.windowed / config.target - 1e-9)))
        if wanted < provisioned and now - self._last_scaled_s < config.cooldown_s:
            wanted = provisioned
        if wanted != provisioned:
            self._last_scaled_s = now
        return wanted


class SlotState(enum.Enum):
    OFF = "off"
    STARTING = "starting"
    READY = "ready"  # started; routable once the router's poller has seen its health check answer
    DRAINING = "draining"  # the router sends it nothing; its requests run to their end


@dataclass(frozen=True)
class ScaleEvent:
    t_s: float
    slot: int
    kind: str  # "start", "ready", "cancel", "drain", "retire"
    in_flight: int = 0  # requests the replica held when it was told to drain


@dataclass
class ScalingLog:
    """What the autoscaler did, for the report: a sample per poll and every slot's transitions."""

    config: AutoscaleConfig
    timeline: list[dict[str, float]] = field(default_factory=list)
    events: list[ScaleEvent] = field(default_factory=list)
