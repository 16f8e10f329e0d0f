"""Load patterns: closed loop (a fixed number of requests in flight) and open loop (arrivals on a schedule).

Open-loop arrivals are offsets from one start time on one monotonic clock (`time.monotonic`, which the
event loop's timers use too): each send is scheduled at `start + offset`, never `previous + interval`, so
lateness does not accumulate. How late each one actually went out is recorded (dispatch lag), and a timer
task measures how late the event loop wakes up (loop lag): together they say whether the client kept up.

The unit of scheduling is a conversation; its turns go one after another (the next turn needs the answer).
Warm-up conversations run first, closed loop, and are not measured.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.bench.records import RequestRecord
from pagoda.bench.workloads import Conversation

ARRIVALS = ("constant", "poisson", "gamma")
LOOP_LAG_INTERVAL_S = 0.01

# sender(conversation, turn index, earlier outputs, origin) -> (filled record, output text)
Sender = Callable[[Conversation, int, list[str], float], Awaitable[tuple[RequestRecord, str]]]
OnDone = Callable[[RequestRecord], None] | None


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int | None = None  # closed loop: requests in flight at all times
    rate: float | None = None  # open loop: conversations per second (math.inf: all at once)
    arrival: str = "poisson"
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None  # open loop: at most this many requests in flight

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) and rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("request rate must be > 0")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be > 0")

    @property
    def closed(self) -> bool:
        return self.concurrency is not None

    @property
    def level(self) -> float:
        """The knob a sweep turns: concurrency, or request rate."""
        if self.concurrency is not None:
            return float(self.concurrency)
        assert self.rate is not None  # __post_init__: exactly one of the two is given
        return self.rate

    def label(self) -> str:
        if self.closed:
            return f"concurrency {self.concurrency}"
        cap = f", cap {self.max_concurrency}" if self.max_concurrency else ""
        shape = f" gamma k={self.burstiness:g}" if self.arrival == "gamma" else f" {self.arrival}"
        return f"rate {self.rate:g}/s{shape}{cap}"

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "closed" if self.closed else "open", "concurrency": self.concurrency,
                "rate": None if self.rate is None or math.isinf(self.rate) else self.rate,
                "arrival": None if self.closed else self.arrival, "burstiness": self.burstiness,
                "max_concurrency": self.max_concurrency}


def arrival_offsets(count: int, rate: float, arrival: str, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (seconds after the start) of `count` arrivals at `rate` per second; the first is at 0.

    constant: every 1/rate. poisson: exponential gaps of mean 1/rate. gamma: gaps of shape k = burstiness and
    scale 1/(rate k), mean 1/rate and coefficient of variation 1/sqrt(k).
    """
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        if arrival == "constant":
            now += 1.0 / rate
        elif arrival == "poisson":
            now += rng.expovariate(rate)
        elif arrival == "gamma":
            now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        else:
            raise ValueError(f"unknown arrival process {arrival!r}")
    return offsets


@dataclass
class LoadResult:
    records: list[RequestRecord]
    outputs: dict[str, str]  # request id -> output text
    wall_s: float
    dispatch_lags: list[float] = field(default_factory=list)
    loop_lags: list[float] = field(default_factory=list)
    cpu_fraction: float | None = None
    warmup: dict[str, Any] = field(default_factory=dict)


class LoopLagMonitor:
    """Sleeps `interval` again and again and records how much later than asked it woke up."""

    def __init__(self, interval: float = LOOP_LAG_INTERVAL_S) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            asked = time.monotonic() + self.interval
            await asyncio.sleep(self.interval)
            self.lags.append(max(time.monotonic() - asked, 0.0))

    def __enter__(self) -> LoopLagMonitor:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


async def run_load(sender: Sender, conversations: Sequence[Conversation], spec: LoadSpec, *, seed: int = 0,
                   warmup: Sequence[Conversation] = (),
                   on_done: Callable[[RequestRecord], None] | None = None,
                   before_measured: Callable[[], Awaitable[None]] | None = None) -> LoadResult:
    """Runs the warm-up, then the measured conversations under `spec`; returns their records.
    `before_measured` runs between the two (e.g. to read server counters that must not count the warm-up)."""
    warmup_records: list[RequestRecord] = []
    if warmup:
        width = spec.concurrency or spec.max_concurrency or len(warmup)
        await _closed(sender, warmup, min(width, len(warmup)), time.monotonic(), warmup_records, {}, None)
    if before_measured is not None:
        await before_measured()
    records: list[RequestRecord] = []
    outputs: dict[str, str] = {}
    dispatch_lags: list[float] = []
    cpu_start, origin = time.process_time(), time.monotonic()
    with LoopLagMonitor() as monitor:
        if spec.concurrency is not None:
            await _closed(sender, conversations, spec.concurrency, origin, records, outputs, on_done)
        else:
            assert spec.rate is not None  # LoadSpec: exactly one of concurrency and rate
            offsets = arrival_offsets(len(conversations), spec.rate, spec.arrival, spec.burstiness,
                                      random.Random(seed))
            await _open(sender, conversations, offsets, spec.max_concurrency, origin, records, outputs,
                        dispatch_lags, on_done)
    wall = time.monotonic() - origin
    # CPU per wall second means little over a blink (imports, first connections): only over half a second
    cpu = (time.process_time() - cpu_start) / wall if wall >= 0.5 else None
    records.sort(key=lambda r: (r.sent, r.request_id))
    warm = {"requests": len(warmup_records), "errors": sum(1 for r in warmup_records if not r.ok)}
    return LoadResult(records, outputs, wall, dispatch_lags, monitor.lags, cpu, warm)


async def _conversation(sender: Sender, conversation: Conversation, origin: float, scheduled: float | None,
                        slots: asyncio.Semaphore | None, records: list[RequestRecord], outputs: dict[str, str],
                        on_done: OnDone) -> None:
    earlier: list[str] = []
    for turn_index in range(len(conversation.turns)):
        if slots is None:
            record, text = await sender(conversation, turn_index, earlier, origin)
        else:
            async with slots:
                record, text = await sender(conversation, turn_index, earlier, origin)
        if turn_index == 0:
            record.scheduled = scheduled
        records.append(record)
        outputs[record.request_id] = text
        if on_done is not None:
            on_done(record)
        if not record.ok:
            return  # the next turn would be built on an answer that never came
        earlier.append(text)


async def _closed(sender: Sender, conversations: Sequence[Conversation], concurrency: int, origin: float,
                  records: list[RequestRecord], outputs: dict[str, str], on_done: OnDone) -> None:
    pending = iter(conversations)

    async def worker() -> None:
        for conversation in pending:  # shared iterator: each worker takes the next one when it is free
            await _conversation(sender, conversation, origin, None, None, records, outputs, on_done)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open(sender: Sender, conversations: Sequence[Conversation], offsets: list[float],
                max_concurrency: int | None, origin: float, records: list[RequestRecord], outputs: dict[str, str],
                dispatch_lags: list[float], on_done: OnDone) -> None:
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tasks: list[asyncio.Task[None]] = []
    for conversation, offset in zip(conversations, offsets):
        delay = origin + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        dispatch_lags.append(max(time.monotonic() - origin - offset, 0.0))
        tasks.append(asyncio.create_task(
            _conversation(sender, conversation, origin, offset, slots, records, outputs, on_done)))
    await asyncio.gather(*tasks)
