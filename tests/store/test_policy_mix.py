"""tierkv/core/policy_mix.py: lru2's order and bounded history, mix's regret and leader, the
invariants both keep, and where they must beat LRU (the store-level invariants, leaf first,
leases and pins, run for every policy in tests/store/test_policy.py)."""
from __future__ import annotations

import random

from tierkv.core.policy_mix import LRU2Policy, MixPolicy, make_policy
from tierkv.traces import Request, simulate_belady, simulate_lru, simulate_lru2, simulate_policy

from .kit import hot_between_one_offs, random_tree_trace


def _random_trees(seed: int, n: int = 60) -> list[Request]:
    return random_tree_trace(random.Random(seed), n)


def test_lru2_orders_once_seen_first_then_by_second_to_last_use():
    p = LRU2Policy(capacity=10)
    for k in (b"a", b"b", b"c", b"d"):
        p.add(k)
    p.touch([b"b"], hit=True)  # b: uses 2, 5
    p.touch([b"a"], hit=True)  # a: uses 1, 6
    p.touch([b"b"], hit=True)  # b: uses 5, 7 (its second-to-last is now newer than a's)
    p.touch([b"c"], hit=False)  # not a use: c stays once-seen, moved behind d
    assert list(p.candidates()) == [b"d", b"c", b"a", b"b"]
    assert p.head() == b"d" and p.segment(b"a") == "frequent" and p.segment(b"c") == "recent"
    p.check_integrity()


def test_lru2_remembers_evicted_blocks_within_its_bound():
    p = LRU2Policy(capacity=2, history_factor=2.0)  # history of 4 keys
    for i in range(10):
        p.add(i)
        p.remove(i, evicted=True)
        p.check_integrity()
    assert len(p) == 0 and len(p._history) == p.history_limit == 4
    p.add(9)  # remembered: its second use, ranked with the twice-seen
    p.add(0)  # forgotten: seen once again
    assert p.ghost_hits == 1 and p.segment(9) == "frequent" and p.segment(0) == "recent"
    p.remove(5)  # not resident: nothing happens, no ghost
    p.remove(9)  # removed, not evicted: no history entry
    assert 9 not in p._history
    p.check_integrity()


def test_candidates_do_not_mutate_and_head_is_their_first():
    rng = random.Random(5)
    for name in ("lru2", "mix"):
        p = make_policy(name, 50)
        for i in range(200):  # adds, hits, evictions at random
            p.add(i)
            if rng.random() < 0.5:
                p.touch([rng.randrange(i + 1)], hit=True)
            if len(p) > 40:
                v = list(p.candidates())[rng.randrange(3)]
                p.remove(v, evicted=True)
            p.check_integrity()
        before = list(p.candidates())
        assert before == list(p.candidates()) and set(before) == p.keys() and len(before) == len(p)
        assert p.head() == before[0]


def test_lru2_model_equals_the_issues_lru2_reference():
    # With a history longer than the trace's distinct blocks, the store's lru2 is exactly the
    # reference that keeps every block's history (issue #33's "LRU-2, leaf-first").
    for seed in range(10):
        trace = _random_trees(seed)
        for cap in (3, 6, 10):
            assert simulate_policy(trace, cap, "lru2").hits == simulate_lru2(trace, cap, keep_history=True).hits


def test_new_policies_never_beat_belady_and_keep_their_bounds():
    for seed in range(10):
        trace = _random_trees(seed)
        for cap in (3, 6, 10):
            best = sum(simulate_belady(trace, cap).hits)
            for name in ("lru2", "mix"):
                assert sum(simulate_policy(trace, cap, name).hits) <= best


def test_mix_charges_the_expert_that_led_an_undone_eviction():
    p = MixPolicy(capacity=4, learning_rate=0.5)
    assert p.leader == 0 and p.experts[0].name == "arc"
    p.add(b"x")
    p.remove(b"x", evicted=True)  # evicted while arc leads
    p.add(b"x")  # and needed again: arc's mistake
    assert p.regrets == [1, 0] and p.weights[0] < p.weights[1] and p.leader == 1
    p.remove(b"x", evicted=True)  # now lru2 leads: the blame goes to it
    p.add(b"x")
    assert p.regrets == [1, 1] and p.ghost_hits == 2
    p.check_integrity()


def test_mix_history_is_bounded():
    p = MixPolicy(capacity=3, history_factor=2.0)
    for i in range(100):
        p.add(i)
        p.remove(i, evicted=True)
    assert len(p._blame) == p.history_limit == 6
    p.check_integrity()


def test_lru2_and_mix_beat_lru_on_a_hot_prefix_between_one_offs():
    trace = hot_between_one_offs(60)
    assert sum(simulate_lru(trace, 8).hits) == 0
    best = sum(simulate_belady(trace, 8).hits)
    for name in ("lru2", "mix"):
        assert sum(simulate_policy(trace, 8, name).hits) > 0.8 * best, name
