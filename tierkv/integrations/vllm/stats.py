"""Counters of the vLLM connector: what it found, loaded and saved, and how long loads took.

:class:`Counters` is kept by each side of the connector (cumulative, for ``stats()``);
the worker side also reports per-interval deltas to vLLM's logger through
:class:`TierKVConnectorStats`, vLLM's ``KVConnectorStats`` API.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class Counters:
    """Cumulative counts (updated under ``lock``; ``snapshot()`` reads them consistently)."""

    lookups: int = 0  # scheduler: requests looked up in tierkv
    lookups_skipped: int = 0  # scheduler: requests vLLM's cache covered, tierkv known to hold the prompt
    hit_requests: int = 0  # scheduler: lookups that found tokens beyond vLLM's own cache
    hit_tokens: int = 0  # scheduler: tokens promised to vLLM from tierkv
    loads: int = 0  # worker: load operations (one per request)
    loaded_tokens: int = 0  # worker: tokens written into vLLM's KV blocks
    load_failed_blocks: int = 0  # worker: promised blocks that could not be loaded (recomputed)
    load_seconds: float = 0.0  # worker: time spent in loads
    saved_tokens: int = 0  # worker: tokens written to tierkv (by the save queue's writer)
    save_failures: int = 0  # worker: puts that failed (the blocks are simply not cached)
    save_dropped_blocks: int = 0  # worker: blocks not saved because the save queue was full
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self.lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


STAT_KEYS = ("loads", "loaded_tokens", "load_failed_blocks", "load_seconds", "saved_tokens", "save_failures",
             "save_dropped_blocks")


@dataclass
class TierKVConnectorStats(KVConnectorStats):
    """Worker-side deltas since the last report (summed across workers)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> "TierKVConnectorStats":
        for k in STAT_KEYS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        loads = self.data.get("loads", 0)
        return {
            "tierkv_loaded_tokens": self.data.get("loaded_tokens", 0),
            "tierkv_load_failed_blocks": self.data.get("load_failed_blocks", 0),
            "tierkv_saved_tokens": self.data.get("saved_tokens", 0),
            "tierkv_save_failures": self.data.get("save_failures", 0),
            "tierkv_save_dropped_blocks": self.data.get("save_dropped_blocks", 0),
            "tierkv_avg_load_ms": round(1000 * self.data.get("load_seconds", 0.0) / loads, 3) if loads else 0.0,
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in STAT_KEYS)


def interval_stats(now: dict[str, Any], last: dict[str, Any]) -> TierKVConnectorStats | None:
    """The deltas between two snapshots of worker counters, or None when nothing happened."""
    stats = TierKVConnectorStats(data={k: now[k] - last.get(k, 0) for k in STAT_KEYS})
    return None if stats.is_empty() else stats
