"""Memory that comes back once a burst of requests is over.

A server that has answered a run of large or malformed requests (megabytes of token ids, hundreds of
thousands of messages) held hundreds of MiB more, idle, than at start. Most of it was cyclic garbage:
exceptions raised while validating a body reference, through their tracebacks and validation errors, the
parsed body, and the cycle lives until the interpreter's next full collection, which a long-running server
with a few hundred thousand objects reaches rarely. The rest was memory glibc's malloc had freed but kept:
in arenas of its own for every thread that allocated (up to 8 per core), and in heap pages below live chunks.

So pagoda, by itself:
- limits malloc to MALLOC_ARENAS arenas (`mallopt(M_ARENA_MAX)`), before the serving threads start;
- once the model is loaded, collects and then freezes everything alive (`gc.freeze()`): the model, torch,
  the app, which are never garbage, so that later collections only walk what requests allocated;
- once the server has been idle (no HTTP request in flight, no engine request) for IDLE_SETTLE_S after
  serving requests, runs a full collection and `malloc_trim(0)`, which returns free heap pages to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter number
MALLOC_ARENAS = 2  # enough for the event loop and the engine thread to allocate without contending
IDLE_SETTLE_S = 2.0  # how long the server must have been idle before memory is released
POLL_S = 0.5


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()  # None off glibc (musl, macOS): there is nothing to tune, only gc to run


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Caps glibc's malloc arenas for threads created from now on; False where that is not glibc."""
    return _LIBC is not None and bool(_LIBC.mallopt(M_ARENA_MAX, arenas))


def freeze_startup_objects() -> None:
    """Everything alive now lives as long as the server: later collections skip it."""
    gc.collect()
    gc.freeze()


def release_memory() -> None:
    """A full collection, then free heap pages back to the kernel."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class IdleReclaimer:
    """Calls release_memory() once each time the server turns idle after work: `busy()` says whether
    anything is in flight, `served()` counts what has been served (so an idle server is released once, not
    every poll)."""

    def __init__(self, busy: Callable[[], bool], served: Callable[[], int], settle_s: float = IDLE_SETTLE_S,
                 release: Callable[[], None] = release_memory) -> None:
        self.busy, self.served, self.settle_s, self.release = busy, served, settle_s, release
        self.releases = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagoda-reclaim", daemon=True)

    def start(self) -> IdleReclaimer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        released_at = self.served()
        idle_since: float | None = None
        while not self._stop.wait(POLL_S):
            try:
                if self.busy():
                    idle_since = None
                    continue
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                served = self.served()
                if served != released_at and now - idle_since >= self.settle_s:
                    self.release()
                    self.releases += 1
                    released_at = served
            except Exception:  # never take the server down over housekeeping
                logger.exception("releasing idle memory failed")
