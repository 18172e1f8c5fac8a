"""Counters behind ``Store.stats()`` and the Prometheus metrics (updated under the store lock)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence


def _per_tier() -> dict[str, int]:
    return {"device": 0, "host": 0, "disk": 0}


def acquire_rates(hits: dict[str, int], asked: int) -> dict[str, object]:
    """``acquire_hit_rate`` (blocks leased over full blocks asked for) and the same by the
    tier each block was found in."""
    return {"acquire_hit_rate": sum(hits.values()) / asked if asked else 0.0,
            "acquire_hit_rate_by_tier": {t: n / asked if asked else 0.0 for t, n in hits.items()}}


@dataclass
class Counters:
    lookups: int = 0
    lookup_blocks: int = 0  # full blocks asked for
    hits: dict[str, int] = field(default_factory=_per_tier)  # blocks found, by the tier found in
    acquires: int = 0
    acquire_blocks: int = 0  # full blocks asked for by acquires (each its window's)
    acquire_hits: dict[str, int] = field(default_factory=_per_tier)  # blocks leased, by the tier found in
    evictions: dict[str, int] = field(default_factory=_per_tier)
    promoted_bytes: int = 0
    read_through_bytes: int = 0  # pages read from disk into a lease's own buffer (tierkv/core/read_through.py)
    demoted_bytes: int = 0
    quarantined: int = 0
    quarantine_failed: int = 0  # bad pages the index could not record (they stay, never served)
    wait_timeouts: int = 0  # blocks an acquire gave up waiting for (another thread was reading them)
    unflushed_at_close: int = 0  # memory-only blocks close() could not write back
    token_mismatch: int = 0
    puts: int = 0
    blocks_stored: int = 0
    admissions_refused: int = 0  # blocks of a put that no tier could take (all held)
    lookup_seconds: float = 0.0
    _recent: deque = field(default_factory=lambda: deque(maxlen=4096))

    def record_lookup(self, blocks_asked: int, tiers: tuple[str, ...], seconds: float) -> None:
        self.lookups += 1
        self.lookup_blocks += blocks_asked
        for t in tiers:
            self.hits[t] += 1
        self.lookup_seconds += seconds
        self._recent.append(time.monotonic())

    def record_acquire(self, tiers: Sequence[str], asked: int) -> None:
        """An acquire that asked for ``asked`` full blocks and found blocks in ``tiers``."""
        self.acquires += 1
        self.acquire_blocks += asked
        for t in tiers:
            self.acquire_hits[t] += 1

    def record_acquire_resident(self, n_blocks: int, asked: int) -> None:
        """An acquire that asked for ``asked`` full blocks and found ``n_blocks``, all in
        the device tier."""
        self.acquires += 1
        self.acquire_blocks += asked
        self.acquire_hits["device"] += n_blocks

    def lookups_per_s(self, window_s: float = 10.0) -> float:
        now = time.monotonic()
        n = sum(1 for t in self._recent if now - t <= window_s)
        return n / window_s

    def as_dict(self) -> dict[str, object]:
        hit_blocks = sum(self.hits.values())
        return {
            "lookups": self.lookups,
            "lookup_blocks": self.lookup_blocks,
            "hits": dict(self.hits),
            "hit_rate": (hit_blocks / self.lookup_blocks) if self.lookup_blocks else 0.0,
            "hit_rate_by_tier": {t: (n / self.lookup_blocks if self.lookup_blocks else 0.0) for t, n in self.hits.items()},
            "acquires": self.acquires,
            "acquire_blocks": self.acquire_blocks,
            "acquire_hits": dict(self.acquire_hits),
            # A client that only acquires (a daemon's lookup and lease are one request) has
            # no lookups: its hit rate is this one.
            **acquire_rates(self.acquire_hits, self.acquire_blocks),
            "evictions": dict(self.evictions),
            "promoted_bytes": self.promoted_bytes,
            "read_through_bytes": self.read_through_bytes,
            "demoted_bytes": self.demoted_bytes,
            "quarantined": self.quarantined,
            "quarantine_failed": self.quarantine_failed,
            "wait_timeouts": self.wait_timeouts,
            "unflushed_at_close": self.unflushed_at_close,
            "token_mismatch": self.token_mismatch,
            "puts": self.puts,
            "blocks_stored": self.blocks_stored,
            "admissions_refused": self.admissions_refused,
            "lookups_per_s": self.lookups_per_s(),
            "mean_lookup_ms": (1000 * self.lookup_seconds / self.lookups) if self.lookups else 0.0,
        }
