"""Eviction policies: the order in which one tier's blocks of one priority class are offered
as victims.

A policy only orders keys; :class:`tierkv.core.blocks.BlockTable` owns locations and decides
what may go (leased, busy, pinned-on-disk and non-leaf blocks are skipped), so every policy
keeps the same invariants. The table calls, with the store lock held:

- ``add(key, hint)`` when a block is placed in the tier (``hint``: see :data:`HINT_CONTINUATION`);
- ``remove(key, evicted)`` when it leaves (``evicted=True`` only when chosen as a victim:
  only those leave a ghost);
- ``touch(keys, hit)`` when a chain is used, keys leaf first (``hit=True`` for a read that
  found the blocks, ``False`` for the re-ordering after a put);
- ``candidates()``: resident keys, best victim first (the caller stops at the first it can
  evict; nothing is mutated while it iterates);
- ``segment(key)``: which part of the policy holds the key (for eviction reasons in stats).

Two policies here, two more in :mod:`tierkv.core.policy_mix` (``lru2``: LRU-2 with a bounded
history of evicted blocks; ``mix``: a regret-weighted choice between ``arc`` and ``lru2``,
issue #33) and one in :mod:`tierkv.core.policy_leader` (``leader``: exact shadow caches of
LRU, both LRU-2s and ``arc``, victims in the order of the one that leads, issue #33).
``leader`` has the better hit rates away from the trace ``arc`` was tuned on (at or above the
best of LRU and both LRU-2s on 34 of 44 develop and check rows and 32 of 40 fresh ones,
against ``arc``'s 20 and 19), but every key a request touches goes through its four shadows:
a daemon's acquire/release of a 256-block prompt runs at about half of ``arc``'s rate (a
third before its hit path was made cheaper), and it keeps about 2.9 KB per slot against
0.36 KB. So ``arc`` stays the default and ``leader`` is
the choice where hits matter more than that (docs/eviction.md, "Why not `leader` by default").

``lru``: the original rule. One recency list; a touched chain moves leaf first, root last,
so a prefix is always more recent than its extensions and the head is normally a leaf.

``arc`` (default): ARC (Megiddo & Modha, FAST '03) on the prefix tree. ``recent`` holds
blocks seen in one request since they entered, ``frequent`` those seen in two or more;
ghost lists remember recently evicted keys of each (metadata only, bounded by
``ghost_factor`` x capacity). A ghost hit in the recent ghost grows the recent target ``p``
(recency was evicted too early), one in the frequent ghost shrinks it; the victim comes
from ``recent`` while it holds more than ``p`` blocks. So the policy slides between LRU
(large capacities, recency traces) and frequency (small capacities, hot shared prefixes)
from what the trace does, not from a tuning knob. Two adaptations to a prefix tree:

* leaf first: a parent has been used in every request its child was, so a frequent child
  has a frequent parent, and in each list a chain is ordered leaf first as in LRU. When a
  list's head is not evictable (an extension in the tier, or held) the heads of the other
  lists are tried before anything deeper.
* insertion class: a new block is classed by two bits, whether its request found a cached
  prefix (continuation) and whether it is the last block of its put (tail). On the
  synthetic Mooncake trace 88% of continuation suffixes are never seen again (a question
  after a shared document) against 57% of fresh blocks, and a request's last block (in
  Mooncake's convention its partial block) is rarely reused; on chat traces, continuations
  are exactly what the next turn reuses. So nothing is assumed: the policy *measures* each
  class's reuse (a block of the class seen again while resident, or in the recent ghost)
  and inserts a class whose reuse rate is below half the overall rate into a ``cold``
  segment evicted before ``recent``, and a class reused more than 1.2x the overall rate
  (and more often than not) straight into ``frequent`` ("warm": a chat's new turn, which
  the next turn reuses, must not be the first victim while stale frequent chains stay;
  without this, arc fell 0.002 below LRU on a recency-only chat trace). A warm block not
  seen again leaves a recent ghost, so its class keeps being measured. The counters decay
  (halved every ``capacity`` insertions), so the decisions follow the trace.

Rejected (replayed on the synthetic trace with the same leaf-first rules, in scratch
simulators not kept; block hit rate at 1,000 / 10,000 / 30,000 blocks, LRU being 0.0841 /
0.4239 / 0.6242): S3-FIFO (10% small queue, ghosts of one capacity) 0.0304 / 0.3068 /
0.6260, its small queue evicting the next turn of a conversation (median reuse distance
233 requests); LRFU (LFU with exponential decay per request) 0.0889 / 0.4250 / 0.6242 at
lambda 0.01 and 0.0704 / 0.4363 / 0.6251 at 0.001, never ahead everywhere, and its keys
would need recomputing whenever lambda adapts. ARC without the insertion classes: 0.0929 /
0.4445 / 0.6260 (a tie with LRU-2 at 30,000).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any, Callable, Iterator, TypeVar

try:  # the compiler's class options (setup.py); mypy's package, not a dependency at run time
    from mypy_extensions import mypyc_attr
except ImportError:  # plain Python, or a compiled install without mypy: a decorator that does nothing
    _C = TypeVar("_C")

    def mypyc_attr(**_: object) -> Callable[[_C], _C]:  # type: ignore[misc]
        return lambda cls: cls

HINT_FRESH = 0
HINT_CONTINUATION = 1  # bit: the block is part of a put whose request found a cached prefix
HINT_TAIL = 2  # bit: the block is the last one of its put (the deepest of the request)
# What a policy orders: block keys (bytes) in the store, int ids in tierkv.traces' model
# replays of these same classes. Any rather than bytes: compiled (setup.py), an annotation
# is a type check at every call.
Key = Any
POLICIES = ("lru", "arc", "lru2", "mix", "leader")  # lru2, mix: core/policy_mix.py; leader: core/policy_leader.py
DEFAULT_POLICY = "arc"  # see the module docstring (why not "leader")
_SEEN = -1  # an ARC list's value for a key seen again since it entered (no insertion class)
_NOT_LISTED = -2  # pop()'s default: the key is not in that list (an int: no boxing, compiled)
_E = TypeVar("_E")


def heap_in_order(heap: list[_E]) -> Iterator[_E]:
    """The entries of ``heap`` (a list with heapq's invariant) smallest first, without popping
    it: a best-first walk of its tree (a frontier of the entries whose parent was yielded),
    so a caller that stops after a few entries pays for a few, not for sorting the heap.
    Stale entries of a lazy heap are yielded too: the caller skips them. The heap must not
    change while the walk runs."""
    if not heap:
        return
    n = len(heap)
    frontier: list[tuple[_E, int]] = [(heap[0], 0)]
    while frontier:
        entry, i = heapq.heappop(frontier)
        yield entry
        c = 2 * i + 1
        if c < n:
            heapq.heappush(frontier, (heap[c], c))
            if c + 1 < n:
                heapq.heappush(frontier, (heap[c + 1], c + 1))


@mypyc_attr(allow_interpreted_subclasses=True)  # tests wrap a policy to check each eviction
class EvictionPolicy:
    """What the table calls (the module docstring says when). A base class rather than a
    Protocol: compiled (setup.py), the table's calls on a policy are then direct calls
    into the compiled methods, where through a Protocol each was a Python method call
    with its arguments parsed (a put into a full tier makes three or four per block)."""

    name = ""
    ghost_hits: int
    # touch(keys, False) right after touch(keys, True) of the same keys changes nothing: a
    # shadow of this order may skip the re-ordering after a request that was all hits
    # (tierkv/core/policy_shadows.py, PolicyOrder).
    rehit_idempotent = False

    def __len__(self) -> int:
        raise NotImplementedError

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError

    def add(self, key: Key, hint: int = HINT_FRESH) -> None:
        raise NotImplementedError

    def remove(self, key: Key, evicted: bool = False) -> str:  # the segment it left
        raise NotImplementedError

    def touch(self, keys: list[Key], hit: bool) -> None:
        raise NotImplementedError

    def candidates(self) -> Iterator[Key]:
        raise NotImplementedError

    def head(self) -> Key:  # the first of candidates() (asked only when non-empty)
        raise NotImplementedError

    def segment(self, key: Key) -> str:
        raise NotImplementedError

    def keys(self) -> set[Key]:
        raise NotImplementedError

    def check_integrity(self) -> None:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    name = "lru"
    rehit_idempotent = True  # both touches move each key to its list's end, in the same order

    def __init__(self) -> None:
        self._d: OrderedDict[Key, None] = OrderedDict()
        self.ghost_hits = 0  # LRU keeps no ghosts

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def add(self, key: Key, hint: int = HINT_FRESH) -> None:
        self._d[key] = None

    def remove(self, key: Key, evicted: bool = False) -> str:
        self._d.pop(key, None)
        return "lru"

    def touch(self, keys: list[Key], hit: bool) -> None:
        d = self._d
        for k in keys:
            if k in d:
                d.move_to_end(k)

    def candidates(self) -> Iterator[Key]:
        return iter(self._d)

    def head(self) -> Key:
        return next(iter(self._d))

    def segment(self, key: Key) -> str:
        return "lru"

    def keys(self) -> set[Key]:
        return set(self._d)

    def check_integrity(self) -> None:
        pass


class ARCPolicy(EvictionPolicy):
    """ARC on a prefix tree with measured insertion classes (see the module docstring)."""

    name = "arc"
    rehit_idempotent = True  # after a hit every key is frequent: touch(False) moves it to frequent's end again

    def __init__(self, capacity: int, ghost_factor: float = 1.5, cold_ratio: float = 0.5,
                 warm_ratio: float = 1.2) -> None:
        self.capacity = max(1, capacity)
        self.ghost_limit = int(self.capacity * ghost_factor)
        self.cold_ratio = cold_ratio
        self.warm_ratio = warm_ratio
        self.p = 0.0  # target size of cold + recent
        # Each resident key maps to its insertion class while it has not been seen again
        # (all of cold and recent, and the blocks of a warm class that entered frequent
        # directly), to _SEEN in frequent once it has: the class rides in the list itself,
        # not in a dict beside it (one dict operation fewer per insertion and eviction).
        self._cold: OrderedDict[Key, int] = OrderedDict()
        self._recent: OrderedDict[Key, int] = OrderedDict()
        self._frequent: OrderedDict[Key, int] = OrderedDict()
        self._ghost_recent: OrderedDict[Key, int] = OrderedDict()  # key -> insertion class
        self._ghost_frequent: OrderedDict[Key, None] = OrderedDict()
        self._inserted = [0.0] * 4  # per insertion class (HINT_* bits), decayed
        self._reused = [0.0] * 4
        self._since_decay = 0
        self.ghost_hits = 0
        self.cold_inserts = 0
        self.warm_inserts = 0

    def __len__(self) -> int:
        return len(self._cold) + len(self._recent) + len(self._frequent)

    def __bool__(self) -> bool:  # asked before every victim search: no three len() calls
        return bool(self._frequent or self._recent or self._cold)

    def __contains__(self, key: object) -> bool:
        return key in self._recent or key in self._frequent or key in self._cold

    # ---- the measured reuse of each insertion class ----
    def _count_insert(self, hint: int) -> None:
        self._inserted[hint] += 1
        self._since_decay += 1
        if self._since_decay >= self.capacity:
            self._since_decay = 0
            self._inserted = [x / 2 for x in self._inserted]
            self._reused = [x / 2 for x in self._reused]

    def _insert_segment(self, hint: int) -> OrderedDict[Key, int]:
        """Where a new block of class ``hint`` goes, after counting it: ``cold`` when the
        class's measured reuse rate is below ``cold_ratio`` x the overall rate, ``frequent``
        (warm) above ``warm_ratio`` x overall and 0.5. The sums are written out, not sum():
        Python 3.12's sum() of floats compensates rounding and 3.11's does not, and a
        policy decision must not depend on the interpreter."""
        self._count_insert(hint)
        r, i = self._reused, self._inserted
        rate = (r[hint] + 1) / (i[hint] + 2)
        overall = (r[0] + r[1] + r[2] + r[3] + 1) / (i[0] + i[1] + i[2] + i[3] + 2)
        if rate < self.cold_ratio * overall:
            self.cold_inserts += 1
            return self._cold
        if rate > 0.5 and rate > self.warm_ratio * overall:
            # Most blocks of this class are seen again (a chat's new turn, which the next
            # turn reuses): they compete with the frequent blocks from the start instead
            # of being the first victims while stale frequent chains stay.
            self.warm_inserts += 1
            return self._frequent
        return self._recent

    def add(self, key: Key, hint: int = HINT_FRESH) -> None:
        hint &= 3
        if key not in self._ghost_recent and key not in self._ghost_frequent:
            self._insert_segment(hint)[key] = hint
        elif key in self._ghost_recent:
            self.ghost_hits += 1
            self._reused[self._ghost_recent.pop(key)] += 1
            ratio = len(self._ghost_frequent) / max(1, len(self._ghost_recent))
            self.p = min(float(self.capacity), self.p + max(ratio, 1.0))
            self._frequent[key] = _SEEN
        else:
            self.ghost_hits += 1
            del self._ghost_frequent[key]
            ratio = len(self._ghost_recent) / max(1, len(self._ghost_frequent))
            self.p = max(0.0, self.p - max(ratio, 1.0))
            self._frequent[key] = _SEEN

    def remove(self, key: Key, evicted: bool = False) -> str:
        hint = self._frequent.pop(key, _NOT_LISTED)
        if hint != _NOT_LISTED:
            segment = "frequent"
            if not evicted:
                return segment
            if hint != _SEEN:  # warm, never seen again: a recent block really
                self._ghost_recent[key] = hint
            else:
                self._ghost_frequent[key] = None
        else:
            hint = self._cold.pop(key, _NOT_LISTED)
            if hint == _NOT_LISTED:
                hint = self._recent.pop(key, HINT_FRESH)
                segment = "recent"
            else:
                segment = "cold"
            if not evicted:
                return segment
            self._ghost_recent[key] = hint
        gr, gf = self._ghost_recent, self._ghost_frequent
        while len(gr) + len(gf) > self.ghost_limit:  # only an eviction adds a ghost
            if gr and (len(gr) > len(gf) or not gf):
                gr.popitem(last=False)
            else:
                gf.popitem(last=False)
        return segment

    def touch(self, keys: list[Key], hit: bool) -> None:
        cold, recent, frequent = self._cold, self._recent, self._frequent
        to_end = frequent.move_to_end
        for k in keys:
            h = frequent.get(k)
            if h is not None:
                to_end(k)
                if hit and h != _SEEN:  # a warm block seen again
                    self._reused[h] += 1
                    frequent[k] = _SEEN
            elif k in recent or k in cold:
                if hit:  # seen in a second request: frequent from now on
                    self._reused[(recent if k in recent else cold).pop(k)] += 1
                    frequent[k] = _SEEN
                else:
                    (recent if k in recent else cold).move_to_end(k)

    def _lists(self) -> tuple[OrderedDict[Key, int], ...]:
        cold, recent, frequent = self._cold, self._recent, self._frequent
        if (cold or recent) and (not frequent or len(cold) + len(recent) > self.p):
            return (cold, recent, frequent)
        return (frequent, cold, recent)

    def head(self) -> Key:
        """The first of :meth:`candidates` (the policy is not empty): the head of the
        first non-empty list in victim order."""
        cold, recent, frequent = self._cold, self._recent, self._frequent
        if (cold or recent) and (not frequent or len(cold) + len(recent) > self.p):
            return next(iter(cold or recent))
        return next(iter(frequent or cold or recent))

    def candidates(self) -> Iterator[Key]:
        lists = self._lists()
        for d in lists:  # each head first: a non-leaf head must not stall the others
            if d:
                yield next(iter(d))
        for d in lists:
            it = iter(d)
            next(it, None)
            yield from it

    def segment(self, key: Key) -> str:
        if key in self._frequent:
            return "frequent"
        return "cold" if key in self._cold else "recent"

    def keys(self) -> set[Key]:
        return set(self._cold) | set(self._recent) | set(self._frequent)

    def check_integrity(self) -> None:
        resident = [self._cold, self._recent, self._frequent]
        total = sum(len(d) for d in resident)
        assert len(self.keys()) == total, "a key sits in two ARC lists"
        assert all(0 <= h <= 3 for d in (self._cold, self._recent) for h in d.values()), (
            "an unseen block without its insertion class")
        assert all(h == _SEEN or 0 <= h <= 3 for h in self._frequent.values()), "a frequent block's class out of range"
        ghosts = set(self._ghost_recent) | set(self._ghost_frequent)
        assert len(ghosts) == len(self._ghost_recent) + len(self._ghost_frequent), "a key in both ghosts"
        assert len(ghosts) <= self.ghost_limit, "ghost lists over their bound"
        assert 0.0 <= self.p <= self.capacity, "ARC target out of range"
