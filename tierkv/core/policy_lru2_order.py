"""LRU-2's victim order for a ``leader`` shadow (:mod:`tierkv.core.policy_shadows`): the
``lru2`` and ``lru2-history`` baselines of issue #33, kept without an allocation per re-rank.

The order is :func:`tierkv.traces.simulate_lru2`'s heap of ``((second-to-last use, last use,
-depth), key)``: the oldest second-to-last use (a request number) goes first, so blocks used
in one request (second-to-last use ``-1``) go before any used in two; then the oldest last
use; then the deeper block; on a full tie the smaller key (the tuple's last field).

How it is kept: the keys grouped in *buckets* by their second-to-last use (each bucket an
OrderedDict in victim order) and a min-heap of the bucket ids, plain ints. The bucket orders
its keys by itself because of when a key is ranked: only as a key of the open request (a hit
or an insertion, so its last use *is* that request), and its new rank waits for the
request's end (``after``), when the request's keys are appended to their buckets deepest
first (smaller key first on a depth tie). So a bucket receives keys by increasing last use,
and one request's keys in (-depth, key) order: appending is sorting. Why the rank waits (it
did before this module too): pushed at once, a chain just hit sat at the front, ranked by
its previous use, and every eviction of the request walked past it (10x slower on
develop:sessions at 10%).

Replaced (issue #33's replay speed): a lazy heap of those tuples, which allocated three
tuples per re-rank (the heap entry, the priority and the pair of uses) and left a stale
entry behind each. The collector's time in a compiled store replay of the synthetic trace
at 10,000 blocks went from about 0.2 s to 0.02-0.03 s, and ``leader`` 1.33-1.77x faster
there (the figures and their command: docs/eviction.md, "Replay speed").
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterator, Optional

from .policy import Key, heap_in_order
from .policy_shadows import Shadow, ShadowOrder

_NO_USE = -1  # a block's second-to-last use before it has one


class LRU2Order(ShadowOrder):
    """:func:`tierkv.traces.simulate_lru2` as a shadow's order (module docstring).
    ``history`` > 0: an evicted key's last use is remembered (up to ``history`` keys, oldest
    forgotten first), so a returning block ranks by it (``lru2-history``)."""

    def __init__(self, history: int = 0) -> None:
        self.name = "lru2-history" if history else "lru2"
        self.history = history
        self._last: dict[Key, int] = {}  # resident key -> its last use
        self._rank: dict[Key, int] = {}  # resident key -> its second-to-last use: its bucket
        self._depth: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}  # second-to-last use -> keys, victim first
        # The bucket ids as a heap: each key of _buckets exactly once. An emptied bucket stays
        # until it reaches the top (or the rebuild in after()): deleted in the middle, its id
        # would stay in the heap, and a bucket made again under it would be walked twice.
        self._ids: list[int] = []
        self._evicted: OrderedDict[Key, int] = OrderedDict()  # evicted key -> last use
        self._deferred: list[Key] = []  # keys of the open request, ranked but in no bucket

    def _unplace(self, key: Key) -> None:
        bucket = self._buckets.get(self._rank[key])
        if bucket is not None:
            bucket.pop(key, None)  # not there: deferred already (a second hit in one request)

    def hit(self, keys: list[Key], n: int, request: int) -> None:
        last, rank, deferred = self._last, self._rank, self._deferred
        for i in range(n):
            k = keys[i]
            self._unplace(k)
            rank[k] = last[k]
            last[k] = request
            deferred.append(k)

    def insert(self, key: Key, depth: int, request: int, hint: int) -> None:
        self._rank[key] = self._evicted.pop(key, _NO_USE) if self.history else _NO_USE
        self._last[key] = request
        self._depth[key] = depth
        self._deferred.append(key)

    def after(self, keys: list[Key], resident: dict[Key, Key]) -> None:
        deferred = self._deferred
        if not deferred:
            return
        self._deferred = []
        depth = self._depth
        # A request's keys come root first (its hits, then its insertions, deeper each), so
        # reversed they are in (-depth, key) order; sorted only when depths repeat (a key
        # seen twice, or keys that are not chains, in tests).
        ordered = True
        prev = _NO_USE - 1
        for k in deferred:
            d = depth.get(k, prev)
            if d <= prev:
                ordered = False
                break
            prev = d
        rank, buckets = self._rank, self._buckets
        for k in (deferred[::-1] if ordered else sorted(deferred, key=lambda x: (-depth.get(x, 0), x))):
            r = rank.get(k)
            if r is None:
                continue  # dropped while its request was open (a request's keys may not go)
            bucket = buckets.get(r)
            if bucket is None:
                bucket = buckets[r] = OrderedDict()
                heapq.heappush(self._ids, r)
            bucket[k] = None
        if len(buckets) > 2 * len(rank) + 64:  # mostly emptied buckets: drop them all
            for r in [r for r, b in buckets.items() if not b]:
                del buckets[r]
            self._ids = list(buckets)
            heapq.heapify(self._ids)

    def _front(self) -> Optional[OrderedDict[Key, None]]:
        """The first non-empty bucket (None if every bucket is empty), dropping the emptied
        buckets on top of the heap."""
        ids, buckets = self._ids, self._buckets
        while ids:
            bucket = buckets[ids[0]]
            if bucket:
                return bucket
            del buckets[heapq.heappop(ids)]
        return None

    def victim(self, shadow: Shadow) -> Key:
        bucket = self._front()
        if bucket is not None:
            k = next(iter(bucket))
            if shadow.may_go(k):
                return k  # the usual case: the first of candidates(), without the walk
        for k in self.candidates():
            if shadow.may_go(k):
                return k
        return None

    def dropped(self, key: Key) -> None:
        self._unplace(key)
        del self._rank[key]
        del self._depth[key]
        last = self._last.pop(key)
        if self.history:
            h = self._evicted
            h[key] = last
            if len(h) > self.history:
                h.popitem(last=False)

    def candidates(self) -> Iterator[Key]:
        buckets = self._buckets
        for r in heap_in_order(self._ids):
            yield from buckets[r]
        yield from self._deferred  # the open request's: last (none of them may go now)

    def head(self) -> Key:
        bucket = self._front()
        return next(iter(bucket)) if bucket is not None else self._deferred[0]

    def check_integrity(self, resident: dict[Key, Key]) -> None:
        name = self.name
        assert set(self._last) == set(self._rank) == set(self._depth) == set(resident), (
            f"shadow {name}: uses and residency disagree")
        assert sorted(self._ids) == sorted(self._buckets) and len(set(self._ids)) == len(self._ids), (
            f"shadow {name}: bucket heap and buckets disagree")
        ids = self._ids
        assert all(ids[(i - 1) // 2] <= ids[i] for i in range(1, len(ids))), f"shadow {name}: not a heap"
        placed = 0
        for r, bucket in self._buckets.items():
            prev: Optional[tuple[int, int, Key]] = None
            for k in bucket:
                assert self._rank[k] == r, f"shadow {name}: a key in another use's bucket"
                assert self._last[k] >= r, f"shadow {name}: last use before the second-to-last"
                here = (self._last[k], -self._depth[k], k)
                assert prev is None or prev < here, f"shadow {name}: a bucket out of order"
                prev = here
            placed += len(bucket)
        assert placed + len(set(self._deferred) & set(resident)) == len(resident), (
            f"shadow {name}: a key neither in a bucket nor deferred")
        assert len(self._evicted) <= self.history, f"shadow {name}: history over its bound"
        assert not (set(self._evicted) & set(resident)), f"shadow {name}: a resident key in the history"
