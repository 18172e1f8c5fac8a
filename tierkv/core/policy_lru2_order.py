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
there (the figures and their command: docs/eviction.md, "Replay speed"). Then three dicts
per key (last use, second-to-last use, depth) became one record (:class:`_Uses`), and a
chain's keys, which mostly share one bucket, look it up once: a hit's chain of 256 keys in
one shadow went from 107 to 41 us (docs/eviction.md, "The hit path made cheaper").
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterator, Optional

from .policy import Key, heap_in_order
from .policy_shadows import Shadow, ShadowOrder

_NO_USE = -1  # a block's second-to-last use before it has one


class _Uses:
    """One resident key's ranking: its second-to-last use (its bucket), its last use and
    its depth. One object per key, not three dicts: a hit reads and writes one record
    instead of three lookups (a compiled class: plain int fields)."""

    def __init__(self, key: Key, rank: int, last: int, depth: int) -> None:
        self.key = key
        self.rank = rank
        self.last = last
        self.depth = depth
        self.gone = False  # dropped: a deferred record left behind is skipped


class LRU2Order(ShadowOrder):
    """:func:`tierkv.traces.simulate_lru2` as a shadow's order (module docstring).
    ``history`` > 0: an evicted key's last use is remembered (up to ``history`` keys, oldest
    forgotten first), so a returning block ranks by it (``lru2-history``)."""

    def __init__(self, history: int = 0) -> None:
        self.name = "lru2-history" if history else "lru2"
        self.history = history
        self._uses: dict[Key, _Uses] = {}  # resident key -> its ranking
        self._buckets: dict[int, OrderedDict[Key, None]] = {}  # second-to-last use -> keys, victim first
        # The bucket ids as a heap: each key of _buckets exactly once. An emptied bucket stays
        # until it reaches the top (or the rebuild in after()): deleted in the middle, its id
        # would stay in the heap, and a bucket made again under it would be walked twice.
        self._ids: list[int] = []
        self._evicted: OrderedDict[Key, int] = OrderedDict()  # evicted key -> last use
        self._deferred: list[_Uses] = []  # the open request's keys, ranked but in no bucket

    def hit(self, keys: list[Key], n: int, request: int) -> None:
        uses, buckets, deferred = self._uses, self._buckets, self._deferred
        bid, bucket = _NO_USE - 1, None  # the last bucket looked up: a chain's keys share one
        for i in range(n):
            k = keys[i]
            u = uses[k]
            if u.rank != bid:
                bid = u.rank
                bucket = buckets.get(bid)
            if bucket is not None:
                bucket.pop(k, None)  # not there: deferred already (a second hit in one request)
            u.rank = u.last
            u.last = request
            deferred.append(u)

    def insert(self, key: Key, depth: int, request: int, hint: int) -> None:
        u = _Uses(key, self._evicted.pop(key, _NO_USE) if self.history else _NO_USE, request, depth)
        self._uses[key] = u
        self._deferred.append(u)

    def after(self, keys: list[Key], resident: dict[Key, Key], hits: int) -> None:
        deferred = self._deferred
        if not deferred:
            return
        self._deferred = []
        # A request's keys come root first (its hits, then its insertions, deeper each), so
        # reversed they are in (-depth, key) order; sorted only when depths repeat (a key
        # seen twice, or keys that are not chains, in tests).
        ordered = True
        prev = _NO_USE - 1
        for u in deferred:
            if u.depth <= prev:
                ordered = False
                break
            prev = u.depth
        buckets = self._buckets
        bid, bucket = _NO_USE - 1, None
        for u in (deferred[::-1] if ordered else sorted(deferred, key=lambda x: (-x.depth, x.key))):
            if u.gone:
                continue  # dropped while its request was open (a request's keys may not go)
            if u.rank != bid or bucket is None:
                bid = u.rank
                bucket = buckets.get(bid)
                if bucket is None:
                    bucket = buckets[bid] = OrderedDict()
                    heapq.heappush(self._ids, bid)
            bucket[u.key] = None
        if len(buckets) > 2 * len(self._uses) + 64:  # mostly emptied buckets: drop them all
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
        u = self._uses.pop(key)
        u.gone = True
        bucket = self._buckets.get(u.rank)
        if bucket is not None:
            bucket.pop(key, None)  # not there: deferred
        if self.history:
            h = self._evicted
            h[key] = u.last
            if len(h) > self.history:
                h.popitem(last=False)

    def candidates(self) -> Iterator[Key]:
        buckets = self._buckets
        for r in heap_in_order(self._ids):
            yield from buckets[r]
        for u in self._deferred:  # the open request's: last (none of them may go now)
            if not u.gone:
                yield u.key

    def head(self) -> Key:
        bucket = self._front()
        if bucket is not None:
            return next(iter(bucket))
        return next(u.key for u in self._deferred if not u.gone)

    def check_integrity(self, resident: dict[Key, Key]) -> None:
        name = self.name
        uses = self._uses
        assert set(uses) == set(resident), f"shadow {name}: uses and residency disagree"
        assert all(u.key == k and not u.gone for k, u in uses.items()), f"shadow {name}: a record of another key"
        assert sorted(self._ids) == sorted(self._buckets) and len(set(self._ids)) == len(self._ids), (
            f"shadow {name}: bucket heap and buckets disagree")
        ids = self._ids
        assert all(ids[(i - 1) // 2] <= ids[i] for i in range(1, len(ids))), f"shadow {name}: not a heap"
        placed = 0
        for r, bucket in self._buckets.items():
            prev: Optional[tuple[int, int, Key]] = None
            for k in bucket:
                u = uses[k]
                assert u.rank == r, f"shadow {name}: a key in another use's bucket"
                assert u.last >= r, f"shadow {name}: last use before the second-to-last"
                here = (u.last, -u.depth, k)
                assert prev is None or prev < here, f"shadow {name}: a bucket out of order"
                prev = here
            placed += len(bucket)
        deferred = {u.key for u in self._deferred if not u.gone}
        assert placed + len(deferred & set(resident)) == len(resident), (
            f"shadow {name}: a key neither in a bucket nor deferred")
        assert len(self._evicted) <= self.history, f"shadow {name}: history over its bound"
        assert not (set(self._evicted) & set(resident)), f"shadow {name}: a resident key in the history"
