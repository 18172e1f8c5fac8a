"""``leader``: follow the order that is winning now (issue #33). Same contract as
:mod:`tierkv.policy`: a policy only orders keys, the block table decides what may go.

The target of issue #33 is "at every capacity of every trace, at least the better of LRU and
both LRU-2s". So this policy replays those three baselines beside the tier, exactly, as
metadata-only *shadow caches* of the tier's capacity (each with its own residency, its own
leaf-first victims and the rules of :func:`tierkv.traces.simulate_lru` /
:func:`~tierkv.traces.simulate_lru2`), and a fourth shadow ordered by ``arc`` (the calls of
:func:`tierkv.traces.simulate_policy`); it counts the hits each would have had
(exponentially decayed: half-life ``half_life`` x capacity placements) and offers as victims:

1. *strays*: resident blocks the leading shadow does not hold (it evicted them, or they
   were kept by a former leader), in the order they became strays;
2. then the leader's own victim order, restricted to resident blocks.

So while the leader does not change the tier holds what the leader's shadow holds, and
its hits are the leader's; after a switch the strays go first and the tier converges on
the new leader's contents within about one turnover. The leader changes only at a request
boundary, by *the bank* (``_choose``): while the tier's own hits since the start exceed
every baseline shadow's, the shadow whose decayed score exceeds the leader's by ``margin``
leads (switches are paid from hits already won); otherwise the shadow with the most hits
since the start. The decayed leader alone took leads on a handful of hits and lost them
again (worst develop row -0.0047; with the bank -0.0013).

What a shadow sees: the table's calls, read as requests. ``touch(keys, hit=True)`` starts a
request (its keys, root first, are the first of the request's chain); the ``add`` calls that
follow continue it (``add`` without :data:`HINT_CONTINUATION` and no ``add`` yet starts a
request of its own: a put that found no prefix); ``touch(hit=False)`` (after a put) ends
it. In each shadow the chain is a hit as far as the shadow holds its prefix; the hits are
touched when the prefix breaks, then the rest is inserted, evicting the shadow's own victim
(never a block of the request, never a block with a resident child), as the references
do. In a store with one tier and one priority class (``scripts/replay_trace.py``) a shadow's
hits equal its reference's request by request (a test); with several classes or tiers each
policy's shadows see every chain touched, so they approximate.

Metadata: each shadow holds up to ``capacity`` keys; the ``lru2-history`` shadow also
remembers the last use of up to ``history_factor`` x capacity evicted keys (the reference
remembers every key of the trace, which no store can), the ``arc`` shadow its ghosts.

Chosen on the develop set and the shared synthetic trace (24 rows, docs/eviction.md has
the figures): the ``arc`` shadow beside the three baselines, half-life 8, margin 0.01 (other
half-lives 1-16 and margins 0-0.05 switched too often or stayed too long with LRU), then the
bank. Tried and dropped: the most hits since the start alone, a wider margin for ``arc``,
hysteresis on the since-the-start lead, a lead change only when the advantage exceeds the
blocks the two shadows disagree on times the hit rate, and strays that another shadow holds
offered after the others.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable, Iterator

from .policy import HINT_CONTINUATION, HINT_FRESH, HINT_TAIL, ARCPolicy, EvictionPolicy, Key

_NO_USE = -1  # a block's second-to-last use before it has one


class Shadow:
    """One baseline's cache of ``capacity`` keys replayed from the table's calls. Residency
    (key -> parent) and child counts here; the order in the subclasses (``_hit``,
    ``_insert``, ``_victim``, ``_dropped``, ``_after``, ``candidates``, ``head``)."""

    name = ""
    baseline = True  # one of issue #33's baselines (the leader must not fall behind these)

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.resident: dict[Key, Key] = {}  # key -> its parent (None for a root)
        self._kids: dict[Key, int] = {}  # resident key -> resident children
        self.request = 0  # requests begun
        self.hits = 0  # blocks hit, over the whole replay
        self.evicted: Key = None  # the victim of the last see(), None if none
        self.hint = HINT_FRESH  # the insertion class of the last key inserted
        self._chain: list[Key] = []
        self._protect: set[Key] = set()
        self._pending: list[Key] = []  # hits not yet touched, root first
        self._missed = False  # the request's prefix broke in this shadow
        self._broken = False  # an insertion found no victim: the rest is not placed
        self._open = False

    def begin(self) -> None:
        """Start a request (ending the open one)."""
        self.end()
        self.request += 1
        self._chain, self._protect, self._pending = [], set(), []
        self._missed = self._broken = False
        self._open = True

    def see(self, key: Key, tail: bool = False) -> bool:
        """The next key of the open request's chain: a hit (True) while the shadow holds
        the prefix so far; otherwise inserted, evicting (``evicted``) if full. ``tail``:
        the key is the last of its put (for an order that classes insertions)."""
        self.evicted = None
        depth = len(self._chain)
        parent = self._chain[-1] if depth else None
        self._chain.append(key)
        self._protect.add(key)
        resident = self.resident
        if not self._missed:
            if key in resident:
                self._pending.append(key)
                self.hits += 1
                return True
            self._missed = True
            if self._pending:
                self._hit(self._pending)
        if self._broken or key in resident:
            return False
        if len(resident) >= self.capacity:
            protect, kids = self._protect, self._kids
            v = self._victim(lambda k: k not in protect and kids[k] == 0)
            if v is None:
                self._broken = True
                return False
            self._drop(v)
            self.evicted = v
        resident[key] = parent
        self._kids[key] = 0
        if parent is not None and parent in resident:
            self._kids[parent] += 1
        # The insertion class as the references give it: the request found a prefix here.
        self.hint = (HINT_CONTINUATION if self._pending else HINT_FRESH) | (HINT_TAIL if tail else 0)
        self._insert(key, depth)
        return False

    def end(self) -> None:
        """End the open request: its hits touched if not yet, then the re-ordering after a
        put (the request's resident keys)."""
        if not self._open:
            return
        self._open = False
        if not self._missed and self._pending:
            self._hit(self._pending)
        self._after([k for k in self._chain if k in self.resident])

    def _drop(self, v: Key) -> None:
        p = self.resident.pop(v)
        del self._kids[v]
        if p is not None and p in self.resident:
            self._kids[p] -= 1
        self._dropped(v)

    # ---- the order ----
    def _hit(self, keys: list[Key]) -> None:
        raise NotImplementedError

    def _insert(self, key: Key, depth: int) -> None:
        raise NotImplementedError

    def _victim(self, ok: Callable[[Key], bool]) -> Key:
        raise NotImplementedError

    def _dropped(self, key: Key) -> None:
        raise NotImplementedError

    def _after(self, keys: list[Key]) -> None:
        raise NotImplementedError

    def candidates(self) -> Iterator[Key]:
        """The resident keys, this baseline's victim first."""
        raise NotImplementedError

    def head(self) -> Key:
        raise NotImplementedError

    def check_integrity(self) -> None:
        res = self.resident
        assert len(res) <= self.capacity, f"shadow {self.name} over its capacity"
        kids = {k: 0 for k in res}
        for k, p in res.items():
            if p is not None and p in res:
                kids[p] += 1
        assert kids == self._kids, f"shadow {self.name}: child counts out of step"
        assert set(self.candidates()) == set(res), f"shadow {self.name}: order and residency disagree"


class LRUShadow(Shadow):
    """:func:`tierkv.traces.simulate_lru`: chains touched leaf first, root last."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def _touch(self, keys: list[Key]) -> None:
        to_end = self._order.move_to_end
        for k in reversed(keys):
            to_end(k)

    def _hit(self, keys: list[Key]) -> None:
        self._touch(keys)

    def _after(self, keys: list[Key]) -> None:
        self._touch(keys)

    def _insert(self, key: Key, depth: int) -> None:
        self._order[key] = None

    def _victim(self, ok: Callable[[Key], bool]) -> Key:
        for k in self._order:
            if ok(k):
                return k
        return None

    def _dropped(self, key: Key) -> None:
        del self._order[key]

    def candidates(self) -> Iterator[Key]:
        return iter(self._order)

    def head(self) -> Key:
        return next(iter(self._order))


class LRU2Shadow(Shadow):
    """:func:`tierkv.traces.simulate_lru2`: the oldest second-to-last use (by request) goes
    first, blocks used in one request before any used in two, deeper first on a tie.
    ``history`` > 0: an evicted key's last use is remembered (up to ``history`` keys, oldest
    forgotten first), so a returning block ranks by it (``lru2-history``)."""

    def __init__(self, capacity: int, history: int = 0) -> None:
        super().__init__(capacity)
        self.name = "lru2-history" if history else "lru2"
        self.history = history
        self._uses: dict[Key, tuple[int, int]] = {}  # resident key -> (second-to-last, last use)
        self._prio: dict[Key, tuple[int, int, int]] = {}
        self._depth: dict[Key, int] = {}
        self._heap: list[tuple[tuple[int, int, int], Key]] = []  # lazy: stale entries skipped
        self._evicted: OrderedDict[Key, int] = OrderedDict()  # evicted key -> last use
        self._deferred: list[Key] = []  # keys of the open request, ranked but not in the heap

    def _set(self, key: Key, prio: tuple[int, int, int]) -> None:
        # Only keys of the open request get a new rank, and none of them may go while it is
        # open: their heap entries wait for the request's end (_after). Pushed at once, a
        # chain just hit sat at the heap's front, ranked by its previous use, and every
        # eviction of the request walked past it (10x slower on develop:sessions at 10%).
        self._prio[key] = prio
        self._deferred.append(key)

    def _after(self, keys: list[Key]) -> None:
        prio, heap = self._prio, self._heap
        for k in self._deferred:
            p = prio.get(k)
            if p is not None:
                heapq.heappush(heap, (p, k))
        self._deferred = []
        if len(heap) > 2 * len(prio) + 64:  # mostly stale: rebuild from the truth
            self._heap = [(p, k) for k, p in prio.items()]
            heapq.heapify(self._heap)

    def _hit(self, keys: list[Key]) -> None:
        r, uses, depth = self.request, self._uses, self._depth
        for k in keys:
            last = uses[k][1]
            uses[k] = (last, r)
            self._set(k, (last, r, -depth[k]))

    def _insert(self, key: Key, depth: int) -> None:
        before = self._evicted.pop(key, _NO_USE) if self.history else _NO_USE
        self._depth[key] = depth
        self._uses[key] = (before, self.request)
        self._set(key, (before, self.request, -depth))

    def _valid(self, entry: tuple[tuple[int, int, int], Key]) -> bool:
        return self._prio.get(entry[1]) == entry[0]

    def _victim(self, ok: Callable[[Key], bool]) -> Key:
        heap = self._heap
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)  # re-ranked keys leave old, low entries at the front
        if heap and ok(heap[0][1]):
            return heap[0][1]  # the usual case: the first of candidates(), without the walk
        for k in self.candidates():
            if ok(k):
                return k
        return None

    def _dropped(self, key: Key) -> None:
        del self._prio[key]
        del self._depth[key]
        last = self._uses.pop(key)[1]
        if self.history:
            h = self._evicted
            h[key] = last
            if len(h) > self.history:
                h.popitem(last=False)

    def candidates(self) -> Iterator[Key]:
        # The heap in order without popping it: a best-first walk of its tree.
        heap = self._heap
        frontier: list[tuple[tuple[tuple[int, int, int], Key], int]] = [(heap[0], 0)] if heap else []
        n = len(heap)
        while frontier:
            entry, i = heapq.heappop(frontier)
            if self._valid(entry):
                yield entry[1]
            for c in (2 * i + 1, 2 * i + 2):
                if c < n:
                    heapq.heappush(frontier, (heap[c], c))
        yield from self._deferred  # the open request's: last (none of them may go now)

    def head(self) -> Key:
        heap = self._heap
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)  # a stale entry: dropping it changes no order
        return heap[0][1] if heap else self._deferred[0]

    def check_integrity(self) -> None:
        super().check_integrity()
        assert set(self._uses) == set(self._prio) == set(self._depth) == set(self.resident), (
            f"shadow {self.name}: uses and residency disagree")
        assert len(self._evicted) <= self.history, f"shadow {self.name}: history over its bound"
        assert not (set(self._evicted) & set(self.resident)), f"shadow {self.name}: a resident key in the history"


class PolicyShadow(Shadow):
    """Any :mod:`tierkv.policy` order as a shadow (``arc``): the calls
    :func:`tierkv.traces.simulate_policy` makes, on the shadow's own residency."""

    def __init__(self, capacity: int, order: EvictionPolicy) -> None:
        super().__init__(capacity)
        self.name = order.name
        self.order = order
        self.baseline = False

    def _hit(self, keys: list[Key]) -> None:
        self.order.touch(keys[::-1], True)

    def _after(self, keys: list[Key]) -> None:
        self.order.touch(keys[::-1], False)

    def _insert(self, key: Key, depth: int) -> None:
        self.order.add(key, self.hint)

    def _victim(self, ok: Callable[[Key], bool]) -> Key:
        for k in self.order.candidates():
            if ok(k):
                return k
        return None

    def _dropped(self, key: Key) -> None:
        self.order.remove(key, True)

    def candidates(self) -> Iterator[Key]:
        return self.order.candidates()

    def head(self) -> Key:
        return self.order.head()

    def check_integrity(self) -> None:
        super().check_integrity()
        self.order.check_integrity()


class LeaderPolicy(EvictionPolicy):
    """Victims in the order of the shadow with the most recent hits (module docstring)."""

    name = "leader"

    def __init__(self, capacity: int, half_life: float = 8.0, margin: float = 0.01,
                 history_factor: float = 8.0, arc: bool = True) -> None:
        self.capacity = max(1, capacity)
        self.shadows: list[Shadow] = [LRUShadow(capacity), LRU2Shadow(capacity),
                                      LRU2Shadow(capacity, max(1, int(self.capacity * history_factor)))]
        if arc:
            self.shadows.append(PolicyShadow(capacity, ARCPolicy(capacity)))
        self.scores = [0.0] * len(self.shadows)
        self.decay = 0.5 ** (1.0 / (half_life * self.capacity))
        self.margin = margin
        self.leader = 0  # lru until the trace says otherwise (all agree until the tier fills)
        self.switches = 0
        self.hits = 0  # the tier's own hits (the keys of touch(hit=True)), since the start
        self._in_tier: dict[Key, None] = {}  # the tier's keys (not "_real": mypyc names it __real, a GCC keyword)
        self._strays: OrderedDict[Key, None] = OrderedDict()  # ... that the leader does not hold
        self._open = False  # a request is open (see the module docstring)
        self._added = False  # ... and an add has continued it
        self.ghost_hits = 0

    def __len__(self) -> int:
        return len(self._in_tier)

    def __contains__(self, key: object) -> bool:
        return key in self._in_tier

    # ---- requests, as the shadows see them ----
    def _begin(self) -> None:
        for s in self.shadows:
            s.end()
        self._switch()
        for s in self.shadows:
            s.begin()
        self._open = True
        self._added = False

    def _see(self, key: Key, tail: bool = False) -> None:
        scores = self.scores
        for j, s in enumerate(self.shadows):
            if s.see(key, tail):
                scores[j] += 1.0
        lead = self.shadows[self.leader]
        v = lead.evicted
        if v is not None and v in self._in_tier:
            self._strays[v] = None
        if key in self._strays and key in lead.resident:
            del self._strays[key]

    def _switch(self) -> None:
        """At a request boundary: pick the leader (``_choose``) and, if it changes, make
        the blocks the new leader does not hold strays (those already strays first, then in
        the old leader's order)."""
        best = self._choose()
        if best == self.leader:
            return
        old, new = self.shadows[self.leader], self.shadows[best].resident
        real = self._in_tier
        strays: OrderedDict[Key, None] = OrderedDict((k, None) for k in self._strays if k not in new)
        for k in old.candidates():
            if k in real and k not in new:
                strays[k] = None
        for k in real:
            if k not in new:
                strays[k] = None
        self._strays = strays
        self.leader = best
        self.switches += 1

    def _choose(self) -> int:
        """The bank: the recent (decayed) leader only while the tier's hits since the start
        are ahead of every baseline shadow's, i.e. a switch is paid from hits already won;
        otherwise the shadow with the most hits since the start. Following the recent leader
        everywhere lost the switches where the lead changed on noise (docs/eviction.md)."""
        lead, shadows = self.leader, self.shadows
        best_baseline = max(s.hits for s in shadows if s.baseline)
        if self.hits > best_baseline:  # ahead: the recent leader, past the margin
            s = self.scores
            best = max(range(len(s)), key=lambda j: (s[j], j == lead))
            return best if s[best] > s[lead] * (1.0 + self.margin) else lead
        best = max(range(len(shadows)), key=lambda j: (shadows[j].hits, j == lead))
        return best if shadows[best].hits > shadows[lead].hits else lead

    # ---- the table's calls ----
    def add(self, key: Key, hint: int = HINT_FRESH) -> None:
        if not self._open or (not self._added and not hint & HINT_CONTINUATION):
            self._begin()  # a put that found no prefix: a request of its own
        self._added = True
        self._see(key, bool(hint & HINT_TAIL))
        self._in_tier[key] = None
        if key not in self.shadows[self.leader].resident:
            self._strays[key] = None
        d = self.decay
        scores = self.scores
        for j in range(len(scores)):
            scores[j] *= d

    def remove(self, key: Key, evicted: bool = False) -> str:
        self._in_tier.pop(key, None)
        if self._strays.pop(key, 0) is None:
            return "stray"
        return self.shadows[self.leader].name

    def touch(self, keys: list[Key], hit: bool) -> None:
        if not keys:
            return
        if hit:
            self._begin()
            self.hits += len(keys)
            for k in reversed(keys):
                self._see(k)
        elif self._open:
            for s in self.shadows:
                s.end()
            self._open = False

    def candidates(self) -> Iterator[Key]:
        yield from self._strays
        real = self._in_tier
        lead = self.shadows[self.leader]
        for k in lead.candidates():
            if k in real:
                yield k
        strays, held = self._strays, lead.resident
        for k in real:  # by the invariant (check_integrity) nothing is left; kept for safety
            if k not in held and k not in strays:
                yield k

    def head(self) -> Key:
        if self._strays:
            return next(iter(self._strays))
        lead = self.shadows[self.leader]
        if lead.resident:
            k = lead.head()
            if k in self._in_tier:
                return k
        return next(self.candidates())

    def segment(self, key: Key) -> str:
        return "stray" if key in self._strays else self.shadows[self.leader].name

    def keys(self) -> set[Key]:
        return set(self._in_tier)

    def check_integrity(self) -> None:
        for s in self.shadows:
            s.check_integrity()
        held = self.shadows[self.leader].resident
        assert set(self._strays) == {k for k in self._in_tier if k not in held}, (
            "strays are not the tier's blocks the leader does not hold")
        assert all(x >= 0.0 for x in self.scores)
