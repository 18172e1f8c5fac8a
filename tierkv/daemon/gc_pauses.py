"""The daemon's garbage-collector pauses: kept short, and counted.

Python's cyclic collector stops the whole process while it runs, the event loop included,
and a full (generation 2) collection walks every tracked object. In a daemon process the
imports alone (torch, numpy, the store) leave ~170,000 of them: a full collection took
~100 ms on the CPU machine, twenty times the p99 the daemon aims at (issue #15), and it
comes whenever enough long-lived objects have piled up (stored blocks, for instance).

Two measures:

- :func:`freeze_startup_heap`: the daemon's process moves what exists once it is
  configured (modules, classes, functions: nothing that becomes garbage) into the
  collector's permanent generation, so that no later collection walks it again
  (``gc.freeze``, meant for exactly this). Only the process that is the daemon does it
  (``tierkv serve``); a daemon run in a thread of another program leaves that program's
  heap alone.
- :class:`GcPauses` times every collection (``gc.callbacks``) and reports counts and the
  longest pause per generation in the daemon's ``stats``, so an operator can see them.

Stored blocks are one tracked object each (tierkv.core.blocks.Block says how), so a full
collection over a large table costs a third of what it did.
"""
from __future__ import annotations

import gc
import threading
import time
from typing import Any


def freeze_startup_heap() -> int:
    """Collect once, then freeze everything that survives; returns the frozen count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Collections and their pauses, per generation, since :meth:`install`."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._started = 0.0
        self._lock = threading.Lock()  # a callback may run on any thread that allocates

    def install(self) -> "GcPauses":
        gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # The collector holds the GIL from "start" to "stop": one collection at a time.
        if phase == "start":
            self._started = time.perf_counter()
            return
        paused = time.perf_counter() - self._started
        g = min(int(info.get("generation", 0)), 2)
        with self._lock:
            self.collections[g] += 1
            self.total_s[g] += paused
            self.max_s[g] = max(self.max_s[g], paused)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "frozen_objects": gc.get_freeze_count(),
                "collections": list(self.collections),
                "pause_ms_max": [round(1000 * s, 3) for s in self.max_s],
                "pause_ms_total": [round(1000 * s, 3) for s in self.total_s],
            }
