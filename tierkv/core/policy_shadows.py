"""Shadow caches for ``leader`` (:mod:`tierkv.core.policy_leader`): one baseline's cache of
the tier's capacity replayed beside the tier from the block table's calls, metadata only.

What a shadow sees: the table's calls, read as requests. ``touch(keys, hit=True)`` starts a
request (its keys, root first, are the first of the request's chain); the ``add`` calls that
follow continue it (``add`` without :data:`HINT_CONTINUATION` and no ``add`` yet starts a
request of its own: a put that found no prefix); ``touch(hit=False)`` (after a put) ends
it. In each shadow the chain is a hit as far as the shadow holds its prefix; the hits are
touched when the prefix breaks, then the rest is inserted, evicting the shadow's own victim
(never a block of the request seen so far, never a block with a resident child), as the
references do. In a store with one tier and one priority class (``scripts/replay_trace.py``)
a shadow's hits equal its reference's request by request (a test); with several classes or
tiers each policy's shadows see every chain touched, so they approximate.

One :class:`Chain` per request, shared (issue #33's replay speed): the leader appends each
key once, and each shadow reads the chain at its own pace (``Shadow.seen``). Only the
leading shadow must read each key as it comes (its evictions make the tier's strays); the
others catch up when the request ends (``Shadow.end``), which is exact: a shadow's replay
depends on its own state and the chain alone, and nothing reads a lagging shadow before
the request's end but :meth:`Shadow.check_integrity`, which holds at every key.

A hit, most of a daemon's requests, costs each shadow little beyond its order's moves: the
keys it holds are read in one loop (``Shadow.see_hits``), the chain's first positions are
indexed only when a shadow evicts (``Chain.position``), and an order whose re-ordering
after a put would repeat the hit's moves skips it (``after(..., hits)``). With the
closed-form scores in ``leader`` and the one record per key of ``LRU2Order``, a 256-key
hit went from 252-265 to 113-117 us (compiled; docs/eviction.md, "The hit path made
cheaper").

Metadata: each shadow holds up to ``capacity`` keys; the ``lru2-history`` shadow also
remembers the last use of up to ``history_factor`` x capacity evicted keys (the reference
remembers every key of the trace, which no store can), the ``arc`` shadow its ghosts. The
orders: :class:`LRUOrder` and :class:`PolicyOrder` here, ``LRU2Order`` in
:mod:`tierkv.core.policy_lru2_order`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from .policy import HINT_CONTINUATION, HINT_FRESH, HINT_TAIL, EvictionPolicy, Key


class ShadowOrder:
    """The victim order of one shadow (an interface, like :class:`EvictionPolicy`: a plain
    base class so that compiled calls through it are direct; it holds no state). Told of
    hits, insertions (with the request's number and the insertion class), drops and the
    re-ordering after a put by its :class:`Shadow`, which owns the residency."""

    name = ""
    baseline = True  # one of issue #33's baselines (the leader must not fall behind these)

    def hit(self, keys: list[Key], n: int, request: int) -> None:
        """The first ``n`` keys of the chain ``keys`` (root first) were hits in ``request``."""
        raise NotImplementedError

    def insert(self, key: Key, depth: int, request: int, hint: int) -> None:
        raise NotImplementedError

    def victim(self, shadow: Shadow) -> Key:
        """The first key of this order that ``shadow.may_go``; None if none may."""
        raise NotImplementedError

    def dropped(self, key: Key) -> None:
        raise NotImplementedError

    def after(self, keys: list[Key], resident: dict[Key, Key], hits: int) -> None:
        """The request whose chain is ``keys`` ended, its first ``hits`` keys hits: the
        re-ordering after a put, of the chain's keys in ``resident``."""
        raise NotImplementedError

    def candidates(self) -> Iterator[Key]:
        """The resident keys, this order's victim first."""
        raise NotImplementedError

    def head(self) -> Key:
        raise NotImplementedError

    def check_integrity(self, resident: dict[Key, Key]) -> None:
        raise NotImplementedError


class Chain:
    """One request's keys, root first, shared by a leader's shadows (module docstring):
    appended by the leader, read by each shadow at its own pace."""

    def __init__(self) -> None:
        self.keys: list[Key] = []
        self.tails: list[bool] = []  # the key is the last of its put (an insertion class bit)
        # key -> its first position: a shadow that has seen ``seen`` keys protects the keys
        # placed before that (the original per-shadow set held exactly those; a shadow that
        # reads the chain late must not protect a key the request brings only later). Built
        # when first asked (``position``): only a shadow that evicts asks, and a hit's chain,
        # most of a daemon's requests, evicts nothing.
        self._first: dict[Key, int] = {}
        self._indexed = 0  # keys[:_indexed] are in _first

    def append(self, key: Key, tail: bool) -> None:
        self.keys.append(key)
        self.tails.append(tail)

    def extend(self, keys: list[Key]) -> None:
        """Append ``keys`` in order, none the last of a put (a hit's chain)."""
        self.keys.extend(keys)
        self.tails.extend([False] * len(keys))

    def position(self, key: Key, default: int) -> int:
        """The first position of ``key`` in the chain; ``default`` if it is not there."""
        keys, first = self.keys, self._first
        for i in range(self._indexed, len(keys)):
            k = keys[i]
            if k not in first:
                first[k] = i
        self._indexed = len(keys)
        return first.get(key, default)


class Shadow:
    """One baseline's cache of ``capacity`` keys replayed from the table's calls: the
    residency (key -> parent) and child counts here, the victim order in ``order`` (a part
    it owns: :class:`LRUOrder`, ``LRU2Order``, :class:`PolicyOrder`)."""

    def __init__(self, capacity: int, order: ShadowOrder) -> None:
        self.capacity = max(1, capacity)
        self.order = order
        self.name = order.name
        self.baseline = order.baseline
        self.resident: dict[Key, Key] = {}  # key -> its parent (None for a root)
        self._kids: dict[Key, int] = {}  # resident key -> resident children
        self.request = 0  # requests begun
        self.hits = 0  # blocks hit, over the whole replay
        self.evicted: Key = None  # the victim of the last see(), None if none
        self.seen = 0  # keys of the open request's chain read so far
        self.prefix = 0  # ... of which the first ``prefix`` were hits
        self._chain = Chain()
        self._missed = False  # the request's prefix broke in this shadow
        self._broken = False  # an insertion found no victim: the rest is not placed
        self._open = False

    def begin(self, chain: Chain) -> None:
        """Start a request (ending the open one) whose keys the caller appends to ``chain``
        as they come; :meth:`see` reads them in order, :meth:`end` reads the rest."""
        self.end()
        self.request += 1
        self._chain = chain
        self.seen = self.prefix = 0
        self._missed = self._broken = False
        self._open = True

    def see_hits(self) -> None:
        """Read the chain's next keys while they are hits (the prefix so far held), as
        :meth:`see` would one by one, without a call per key: the whole of a hit's chain in
        a shadow that holds it, which is most of a daemon's requests."""
        if self._missed:
            return
        keys, resident = self._chain.keys, self.resident
        start = i = self.seen
        n = len(keys)
        while i < n and keys[i] in resident:
            i += 1
        self.seen = i
        self.prefix += i - start
        self.hits += i - start

    def see(self) -> bool:
        """Read the chain's next key (the caller has appended it): a hit (True) while the
        shadow holds the prefix so far; otherwise inserted, evicting (``evicted``) if full."""
        self.evicted = None
        chain = self._chain
        depth = self.seen
        key = chain.keys[depth]
        self.seen = depth + 1
        resident = self.resident
        if not self._missed:
            if key in resident:
                self.prefix += 1
                self.hits += 1
                return True
            self._missed = True
            if self.prefix:
                self.order.hit(chain.keys, self.prefix, self.request)
        if self._broken or key in resident:
            return False
        if len(resident) >= self.capacity:
            v = self.order.victim(self)
            if v is None:
                self._broken = True
                return False
            self._drop(v)
            self.evicted = v
        parent = chain.keys[depth - 1] if depth else None
        resident[key] = parent
        self._kids[key] = 0
        if parent is not None and parent in resident:
            self._kids[parent] += 1
        # The insertion class as the references give it: the request found a prefix here.
        hint = (HINT_CONTINUATION if self.prefix else HINT_FRESH) | (HINT_TAIL if chain.tails[depth] else 0)
        self.order.insert(key, depth, self.request, hint)
        return False

    def may_go(self, key: Key) -> bool:
        """Whether ``key`` (resident) may be this shadow's victim now: not a key of the open
        request seen so far, and no resident child."""
        return self._chain.position(key, self.seen) >= self.seen and self._kids[key] == 0

    def end(self) -> None:
        """End the open request: the rest of its chain read, its hits touched if not yet,
        then the re-ordering after a put (the request's resident keys)."""
        if not self._open:
            return
        keys = self._chain.keys
        self.see_hits()
        while self.seen < len(keys):
            self.see()
        self._open = False
        if not self._missed and self.prefix:
            self.order.hit(keys, self.prefix, self.request)
        self.order.after(keys, self.resident, self.prefix)

    def _drop(self, v: Key) -> None:
        p = self.resident.pop(v)
        del self._kids[v]
        if p is not None and p in self.resident:
            self._kids[p] -= 1
        self.order.dropped(v)

    def candidates(self) -> Iterator[Key]:
        """The resident keys, this shadow's victim first."""
        return self.order.candidates()

    def head(self) -> Key:
        return self.order.head()

    def check_integrity(self) -> None:
        res = self.resident
        assert len(res) <= self.capacity, f"shadow {self.name} over its capacity"
        kids = {k: 0 for k in res}
        for k, p in res.items():
            if p is not None and p in res:
                kids[p] += 1
        assert kids == self._kids, f"shadow {self.name}: child counts out of step"
        assert set(self.candidates()) == set(res), f"shadow {self.name}: order and residency disagree"
        assert self.seen <= len(self._chain.keys) and self.prefix <= self.seen, f"shadow {self.name}: read past its chain"
        self.order.check_integrity(res)


class LRUOrder(ShadowOrder):
    """:func:`tierkv.traces.simulate_lru`: chains touched leaf first, root last."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def hit(self, keys: list[Key], n: int, request: int) -> None:
        to_end = self._order.move_to_end
        for i in range(n - 1, -1, -1):
            to_end(keys[i])

    def after(self, keys: list[Key], resident: dict[Key, Key], hits: int) -> None:
        if hits == len(keys):  # all hits: hit() made these very moves (a daemon's lookup)
            return
        to_end = self._order.move_to_end
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in resident:
                to_end(keys[i])

    def insert(self, key: Key, depth: int, request: int, hint: int) -> None:
        self._order[key] = None

    def victim(self, shadow: Shadow) -> Key:
        for k in self._order:
            if shadow.may_go(k):
                return k
        return None

    def dropped(self, key: Key) -> None:
        del self._order[key]

    def candidates(self) -> Iterator[Key]:
        return iter(self._order)

    def head(self) -> Key:
        return next(iter(self._order))

    def check_integrity(self, resident: dict[Key, Key]) -> None:
        pass  # candidates() == residency: checked by the Shadow


class PolicyOrder(ShadowOrder):
    """Any :mod:`tierkv.core.policy` order as a shadow's (``arc``): the calls
    :func:`tierkv.traces.simulate_policy` makes, on the shadow's own residency."""

    baseline = False

    def __init__(self, order: EvictionPolicy) -> None:
        self.name = order.name
        self.order = order

    def hit(self, keys: list[Key], n: int, request: int) -> None:
        if n:  # keys[-1::-1] would be the whole chain
            self.order.touch(keys[n - 1::-1], True)  # the hits, leaf first

    def after(self, keys: list[Key], resident: dict[Key, Key], hits: int) -> None:
        if hits == len(keys) and self.order.rehit_idempotent:  # all hits: hit()'s touch did it already
            return
        self.order.touch([k for k in reversed(keys) if k in resident], False)

    def insert(self, key: Key, depth: int, request: int, hint: int) -> None:
        self.order.add(key, hint)

    def victim(self, shadow: Shadow) -> Key:
        k = self.order.head()  # the first of candidates() without a generator (the order is full)
        if shadow.may_go(k):
            return k
        for k in self.order.candidates():
            if shadow.may_go(k):
                return k
        return None

    def dropped(self, key: Key) -> None:
        self.order.remove(key, True)

    def candidates(self) -> Iterator[Key]:
        return self.order.candidates()

    def head(self) -> Key:
        return self.order.head()

    def check_integrity(self, resident: dict[Key, Key]) -> None:
        self.order.check_integrity()
