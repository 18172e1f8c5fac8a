"""Disk admission rules: which blocks are worth writing to the disk tier at all (issue #33,
item 3), as measured by the two-tier model (:mod:`tierkv.tier_model`,
``scripts/replay_trace.py --tiers HOST:DISK --admission RULE``).

The store writes every block it stores to disk: at the put (write-through, its default) or
when its last memory copy is evicted (write-back). That is right when the disk is large
next to the working set: anything may come back. When it is not, one-off blocks (a scanned
document, a conversation that never returns) push reused prefixes off the disk, and every
write costs bandwidth a read could have used. A rule is asked at the two moments a block
can go to disk:

- :meth:`DiskAdmission.stored`: a new block was put; write it to disk now (write-through)?
- :meth:`DiskAdmission.leaving`: its last memory copy is being evicted; if it is not on
  disk, write it back, or let it go?

``all`` says yes to both (the store). ``reused`` writes a block only once it has shown
reuse: it was served (a hit) since it was stored, or it is put again while a bounded ghost
of the blocks this rule let go still remembers it. :class:`AdmitEither` answers as one or
the other, as told: the two-tier model's ``adaptive`` rule tells it which of two exact
shadow systems, one per rule, served more blocks lately.

Not in the store: measured on the develop traces and the shared synthetic trace,
``reused`` writes 1.4-11.6x fewer blocks and wins hits when the disk is small but loses up
to 0.095 of the hit rate when it is large, and ``adaptive`` stays within 0.008 of the
better of the two (at or above it on 33 of 36 rows with ``arc``); its exact shadows would
triple the store's metadata work (docs/eviction.md has the table and the design left to
build). Keys are opaque (the model's ints); nothing here
hashes them beyond dict membership.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
ADMISSIONS = ("all", "reused")  # and the model's "adaptive" (tierkv/tier_model.py), which follows them
# Blocks pending a decision, per block of the memory tier above the disk: a block is judged
# for as long as memory can hold it.
PENDING_PER_MEMORY_BLOCK = 4


class DiskAdmission(Generic[K]):
    """``all``: every block is worth a disk write. The base of the other rules."""

    name = "all"

    def stored(self, key: K) -> bool:
        """A new block was put: write it to disk now? (Told of every put; the answer is
        used only with write-through.)"""
        return True

    def served(self, key: K, from_disk: bool) -> None:
        """A block was served (a hit), from disk or from memory."""

    def leaving(self, key: K, on_disk: bool) -> bool:
        """``key``'s last memory copy is being evicted: write it back (if not ``on_disk``)?"""
        return True

    def check_integrity(self) -> None:
        pass


class AdmitReused(DiskAdmission[K]):
    """Write a block to disk only once it has shown reuse. ``pending``: blocks put and not
    yet judged (key -> served since), bounded (the oldest forgotten: a block no longer
    tracked is written back as under ``all``); ``ghost``: blocks let go, bounded, so that
    one put again counts as reused."""

    name = "reused"

    def __init__(self, pending: int, ghost: int) -> None:
        self.pending_bound, self.ghost_bound = max(1, pending), max(1, ghost)
        self._pending: OrderedDict[K, bool] = OrderedDict()
        self._ghost: OrderedDict[K, None] = OrderedDict()

    def stored(self, key: K) -> bool:
        if self._ghost.pop(key, 0) is None:  # it came back: reuse
            return True
        _bounded_set(self._pending, key, False, self.pending_bound)
        return False

    def served(self, key: K, from_disk: bool) -> None:
        if key in self._pending:
            self._pending[key] = True

    def leaving(self, key: K, on_disk: bool) -> bool:
        # Judged on disk too (the answer unused): so that under AdmitEither, while "all"
        # writes everything, this rule's ghost still learns what it would have let go.
        reused = self._pending.pop(key, None)
        if reused is None or reused:
            return True
        _bounded_set(self._ghost, key, None, self.ghost_bound)
        return False

    def check_integrity(self) -> None:
        assert len(self._pending) <= self.pending_bound, "admission: pending over its bound"
        assert len(self._ghost) <= self.ghost_bound, "admission: ghost over its bound"
        assert not (self._pending.keys() & self._ghost.keys()), "admission: a key both pending and let go"


def _bounded_set(d: "OrderedDict[K, V]", key: K, value: V, bound: int) -> None:
    """``d[key] = value``, forgetting the oldest entry beyond ``bound``."""
    d[key] = value
    if len(d) > bound:
        d.popitem(last=False)


class AdmitEither(DiskAdmission[K]):
    """Answer as ``all`` or as ``reused`` per :attr:`choice`, which the caller sets (the
    model's ``adaptive``, tierkv/tier_model.py, from its shadows). ``reused``'s state is
    kept up in both, so that a switch finds it judging the blocks in memory."""

    name = "either"

    def __init__(self, disk: int, host: int) -> None:
        self.reused = AdmitReused[K](PENDING_PER_MEMORY_BLOCK * host, disk)
        self.choice = "all"

    def stored(self, key: K) -> bool:
        reused = self.reused.stored(key)
        return reused if self.choice == "reused" else True

    def served(self, key: K, from_disk: bool) -> None:
        self.reused.served(key, from_disk)

    def leaving(self, key: K, on_disk: bool) -> bool:
        reused = self.reused.leaving(key, on_disk)
        return reused if self.choice == "reused" else True

    def check_integrity(self) -> None:
        self.reused.check_integrity()
        assert self.choice in ("all", "reused"), f"admission: choice {self.choice!r}"


def make_admission(name: str, disk: int, host: int) -> DiskAdmission[K]:
    """A fresh rule for a disk tier of ``disk`` blocks under a memory tier of ``host``
    blocks (which bounds the blocks pending a decision: PENDING_PER_MEMORY_BLOCK x)."""
    if name == "all":
        return DiskAdmission[K]()
    if name == "reused":
        return AdmitReused[K](PENDING_PER_MEMORY_BLOCK * host, disk)
    raise ValueError(f"unknown disk admission {name!r}; choose one of {ADMISSIONS}")
