"""The last few minutes of serving, for the dashboard: latencies and token counts in time buckets.

Recording is O(1) per engine output, on the event loop (Generation observes every output there). Latencies go
into log-spaced bins (each LATENCY_BIN_RATIO wide), so memory is bounded whatever the load and a percentile
read from the bins is within half a bin (about 2.5%) of the exact one. The window's own bins are kept up to
date as buckets come and go, and a bucket's figures are computed once when it closes, so a snapshot costs
a fraction of a millisecond however busy the window was.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 300.0  # how far back the dashboard looks
BUCKET_S = 5.0  # one point of its charts
PERCENTILES = (50, 90, 99)
LATENCY_BIN_RATIO = 1.05  # each bin's upper edge is this times its lower edge
LATENCY_FLOOR_S = 1e-5  # latencies below this share the first bin
_LOG_RATIO = math.log(LATENCY_BIN_RATIO)


def latency_bin(seconds: float) -> int:
    """The bin of a latency: bin i holds [floor x ratio^i, floor x ratio^(i+1))."""
    if seconds <= LATENCY_FLOOR_S:
        return 0
    return int(math.log(seconds / LATENCY_FLOOR_S) / _LOG_RATIO)


def bin_value(index: int) -> float:
    """The value a bin stands for: its geometric middle."""
    return float(LATENCY_FLOOR_S * LATENCY_BIN_RATIO ** (index + 0.5))


def percentiles(bins: Counter[int], wanted: Iterable[int] = PERCENTILES) -> dict[str, float] | None:
    """{"p50": seconds, ...} from binned counts (nearest rank), or None without samples."""
    total = sum(bins.values())
    if not total:
        return None
    ordered = sorted(bins.items())
    result = {}
    for p in wanted:
        rank, seen = max(1, math.ceil(total * p / 100)), 0
        for index, count in ordered:
            seen += count
            if seen >= rank:
                result[f"p{p}"] = bin_value(index)
                break
    return result


@dataclass
class Bucket:
    """What happened in [start, start + BUCKET_S)."""

    start: float
    ttft: Counter[int] = field(default_factory=Counter)  # latency bin -> samples
    itl: Counter[int] = field(default_factory=Counter)
    prompt_tokens: int = 0  # of requests whose first token came in this bucket
    generation_tokens: int = 0
    requests: int = 0  # first tokens: requests whose prefill finished
    closed: dict[str, Any] | None = None  # its figures, kept once the bucket can no longer change

    def figures(self) -> dict[str, Any]:
        """Token and request counts, latency percentiles."""
        if self.closed is not None:
            return self.closed
        return {"prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                "requests": self.requests, "ttft": percentiles(self.ttft), "itl": percentiles(self.itl)}


class RecentActivity:
    """A ring of buckets covering the last WINDOW_S seconds, and the window's latency bins (kept as buckets
    come and go, so a snapshot does not merge them). Used from the event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S,
                 bucket_s: float = BUCKET_S) -> None:
        self.clock, self.bucket_s = clock, bucket_s
        self.num_buckets = max(1, math.ceil(window_s / bucket_s))
        self.buckets: deque[Bucket] = deque()
        self.window_ttft: Counter[int] = Counter()
        self.window_itl: Counter[int] = Counter()

    def first_token(self, ttft: float, prompt_tokens: int, new_tokens: int) -> None:
        bucket, index = self._current(), latency_bin(ttft)
        bucket.ttft[index] += 1
        self.window_ttft[index] += 1
        bucket.requests += 1
        bucket.prompt_tokens += prompt_tokens
        bucket.generation_tokens += new_tokens

    def next_tokens(self, itl: float, new_tokens: int) -> None:
        bucket, index = self._current(), latency_bin(itl)
        bucket.itl[index] += 1
        self.window_itl[index] += 1
        bucket.generation_tokens += new_tokens

    def snapshot(self) -> dict[str, Any]:
        """The window's buckets (oldest first; times as Unix seconds, an empty bucket omitted), its
        percentiles, and the generation rate over the last two buckets' span (the last one still filling)."""
        now = self.clock()
        self._expire(now)
        offset = time.time() - now  # bucket starts are on self.clock; the page wants wall-clock times
        buckets = [{"t": bucket.start + offset, **bucket.figures()} for bucket in self.buckets]
        return {
            "window_s": self.bucket_s * self.num_buckets, "bucket_s": self.bucket_s, "buckets": buckets,
            "ttft": percentiles(self.window_ttft), "itl": percentiles(self.window_itl),
            "generation_tokens_per_s": self._recent_rate(now),
        }

    def _recent_rate(self, now: float) -> float:
        """Generated tokens per second since the start of the previous bucket."""
        since = self._bucket_start(now) - self.bucket_s
        tokens = sum(b.generation_tokens for b in self.buckets if b.start >= since)
        return tokens / max(now - since, 1e-9)

    def _bucket_start(self, moment: float) -> float:
        return math.floor(moment / self.bucket_s) * self.bucket_s

    def _current(self) -> Bucket:
        now = self.clock()
        start = self._bucket_start(now)
        if not self.buckets or self.buckets[-1].start != start:
            self._expire(now)
            if self.buckets:
                self.buckets[-1].closed = self.buckets[-1].figures()
            self.buckets.append(Bucket(start))
        return self.buckets[-1]

    def _expire(self, now: float) -> None:
        """Drops the buckets that started more than a window ago, and their samples from the window's bins."""
        oldest = self._bucket_start(now) - self.bucket_s * (self.num_buckets - 1)
        while self.buckets and self.buckets[0].start < oldest:
            gone = self.buckets.popleft()
            self.window_ttft -= gone.ttft  # Counter subtraction keeps only positive counts
            self.window_itl -= gone.itl
