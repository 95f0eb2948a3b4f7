"""The package's worker threads (updates during backward, write-behind): each is fed by a queue
that a None ends, and each is ended and joined before the interpreter finalizes.

A daemon thread still inside the C++ core (an eviction, a lease) when Python finalizes is
stopped from inside that frame, which calls std::terminate; so at exit every worker still
running gets its None (after the work queued before it) and is joined. An owner collected
earlier has queued its None already (weakref.finalize); its thread is joined too.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from typing import Any

_RUNNING: dict[threading.Thread, queue.Queue] = {}
_LOCK = threading.Lock()


def start(
    target: Callable[..., Any], args: tuple, feed: queue.Queue, name: str
) -> threading.Thread:
    """Starts `target(*args)` on a daemon thread fed by `feed`, ended at exit."""

    def run() -> None:
        try:
            target(*args)
        finally:
            with _LOCK:
                _RUNNING.pop(thread, None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _LOCK:
        _RUNNING[thread] = feed
    thread.start()
    return thread


@atexit.register
def _stop_all() -> None:
    with _LOCK:
        running = list(_RUNNING.items())
    for _, feed in running:
        feed.put(None)
    for thread, _ in running:
        if thread is not threading.current_thread():
            thread.join()
