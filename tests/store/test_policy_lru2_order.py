"""tierkv/core/policy_lru2_order.py: the bucketed LRU-2 order is exactly the order of the
tuple heap it replaced (and of tierkv.traces.simulate_lru2): ``((second-to-last use, last
use, -depth), key)``, a request's keys last while it is open, on random hits, insertions,
evictions and request ends, with and without a history of evicted keys."""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import Callable

import pytest

from tierkv.core.policy_lru2_order import LRU2Order
from tierkv.core.policy_shadows import Chain, Shadow

Rank = Callable[[int, int, int, int], tuple]


def _true_rank(second: int, last: int, depth: int, key: int) -> tuple:
    return (second, last, -depth, key)


# Rules the random operations must tell from the true one: else a passing test proves nothing.
_WRONG: dict[str, Rank] = {
    "shallower first": lambda second, last, depth, key: (second, last, depth, key),
    "larger key first on a tie": lambda second, last, depth, key: (second, last, -depth, -key),
    "newest last use first": lambda second, last, depth, key: (second, -last, -depth, key),
    "last use before second-to-last": lambda second, last, depth, key: (last, second, -depth, key),
}


class Reference:
    """The order recomputed by sorting at every look: the resident keys not of the open
    request by ``rank``, then the open request's keys in the order they were ranked."""

    def __init__(self, history: int, rank: Rank) -> None:
        self.history, self.rank = history, rank
        self.uses: dict[int, tuple[int, int]] = {}  # key -> (second-to-last use, last use)
        self.depth: dict[int, int] = {}
        self.deferred: list[int] = []
        self.evicted: OrderedDict[int, int] = OrderedDict()

    def hit(self, keys: list[int], request: int) -> None:
        for k in keys:
            self.uses[k] = (self.uses[k][1], request)
            self.deferred.append(k)

    def insert(self, key: int, depth: int, request: int) -> None:
        before = self.evicted.pop(key, -1) if self.history else -1
        self.uses[key], self.depth[key] = (before, request), depth
        self.deferred.append(key)

    def drop(self, key: int) -> None:
        last = self.uses.pop(key)[1]
        del self.depth[key]
        if self.history:
            self.evicted[key] = last
            if len(self.evicted) > self.history:
                self.evicted.popitem(last=False)

    def order(self) -> list[int]:
        open_keys = set(self.deferred)
        placed = [k for k in self.uses if k not in open_keys]
        return sorted(placed, key=lambda k: self.rank(*self.uses[k], self.depth[k], k)) + self.deferred


def _may_go(shadow: Shadow, protect: list[int], kids: dict[int, int]) -> None:
    """Make ``shadow.may_go`` (the victim's test) refuse ``protect`` and keys with kids."""
    chain = Chain()
    for k in protect:
        chain.append(k, False)
    shadow._chain, shadow.seen, shadow._kids = chain, len(chain.keys), kids


def _replay(seed: int, history: int, wrong_seen: set[str]) -> None:
    rng = random.Random(seed)
    capacity = rng.choice((4, 8, 12))
    order = LRU2Order(history)
    shadow = Shadow(capacity, order)  # only its may_go, set by hand (_may_go)
    ref = Reference(history, _true_rank)
    wrong = {name: Reference(history, rank) for name, rank in _WRONG.items()}
    refs = [ref, *wrong.values()]
    resident: dict[int, object] = {}
    gone: list[int] = []  # evicted keys, which may come back (ranked by the history)
    fresh = 0

    def check() -> None:
        assert list(order.candidates()) == ref.order(), (seed, history)
        if resident:
            assert order.head() == ref.order()[0]
        for name, w in wrong.items():
            if w.order() != ref.order():
                wrong_seen.add(name)

    for request in range(1, 80):
        hits = rng.sample(sorted(resident), min(len(resident), rng.randint(0, 4)))
        # Only the first n keys of the list are hits (the rest of a chain, past the prefix).
        order.hit(hits + [fresh + 10**6], len(hits), request)
        for r in refs:
            r.hit(hits, request)
        check()
        for _ in range(rng.randint(0, 4)):
            if gone and rng.random() < 0.4:
                key = gone.pop(rng.randrange(len(gone)))
            else:
                key, fresh = fresh, fresh + 1
            if len(resident) >= capacity:
                protect = list(ref.deferred) + rng.sample(sorted(resident), rng.randint(0, 2))
                kids = {k: int(rng.random() < 0.3) for k in resident}
                _may_go(shadow, protect, kids)
                allowed = [k for k in ref.order() if k not in protect and kids[k] == 0]
                v = order.victim(shadow)
                assert v == (allowed[0] if allowed else None), (seed, history, request)
                if v is None:
                    gone.append(key)
                    continue
                order.dropped(v)
                for r in refs:
                    r.drop(v)
                del resident[v]
                gone.append(v)
            depth = rng.randint(0, 3)  # few depths: ties, broken by the key
            order.insert(key, depth, request, 0)
            for r in refs:
                r.insert(key, depth, request)
            resident[key] = None
            check()
        order.after([], resident, 0)
        for r in refs:
            r.deferred = []
        check()
        order.check_integrity(resident)


@pytest.mark.parametrize("history", [0, 6])
def test_the_buckets_give_the_tuple_heaps_order_and_victims(history):
    wrong_seen: set[str] = set()
    for seed in range(30):
        _replay(seed, history, wrong_seen)
    # Every wrong tie rule gave another order somewhere in these operations.
    assert wrong_seen == set(_WRONG)


def test_a_bucket_emptied_below_the_top_and_filled_again_is_walked_once():
    order, resident = LRU2Order(), {"a": None, "b": None}
    order.insert("a", 0, 1, 0)
    order.insert("b", 1, 1, 0)
    order.after([], resident, 0)  # second-to-last use -1: b (deeper), a
    for request, key in ((2, "a"), (3, "a"), (4, "b")):
        # a: bucket 1, then bucket 2, which leaves bucket 1 empty below the top (bucket -1
        # holds b); then b fills bucket 1 again under the same id.
        order.hit([key], 1, request)
        order.after([], resident, 0)
        order.check_integrity(resident)
    assert list(order.candidates()) == ["b", "a"] and order.head() == "b"
