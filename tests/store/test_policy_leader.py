"""tierkv/core/policy_leader.py: each shadow replays its reference exactly, the leader is the
shadow with the most recent hits (switching only past the margin, at a request boundary),
the tier converges on the leader's contents, and the order's invariants (the store-level
ones, leaf first, leases and pins, and store == model, run for every policy in
tests/store/test_policy.py)."""
from __future__ import annotations

import random

from tierkv.core.policy import HINT_CONTINUATION
from tierkv.core.policy_leader import LeaderPolicy, scored
from tierkv.core.policy_shadows import Chain
from tierkv.traces import Request, _replay, simulate_belady, simulate_lru, simulate_lru2, simulate_policy

from .kit import hot_between_one_offs, random_tree_trace


def _replay_leader(trace: list[Request], capacity: int, **kw: float) -> tuple[LeaderPolicy, int]:
    """simulate_policy with a LeaderPolicy we keep (its shadows' hits are read after)."""
    pol = LeaderPolicy(capacity, **kw)
    res = _replay(trace, capacity,
                  on_hit=lambda r, ks: pol.touch(ks[::-1], True),
                  on_insert=lambda r, x, i, hint: pol.add(x, hint),
                  victim=lambda ok: next((k for k in pol.candidates() if ok(k)), None),
                  on_evict=lambda x: pol.remove(x, True),
                  after=lambda r, ks: pol.touch(ks[::-1], False))
    pol.check_integrity()
    return pol, sum(res.hits)


def test_each_shadow_equals_its_reference_request_by_request():
    for seed in range(12):
        trace = random_tree_trace(random.Random(seed), 60)
        for cap in (3, 6, 10):
            # history_factor large enough to remember every block: lru2-history is exact too.
            pol, _ = _replay_leader(trace, cap, history_factor=100.0)
            lru, lru2, hist, arc = pol.shadows
            assert arc.hits == sum(simulate_policy(trace, cap, "arc").hits), (seed, cap)
            assert lru.hits == sum(simulate_lru(trace, cap).hits), (seed, cap)
            assert lru2.hits == sum(simulate_lru2(trace, cap).hits), (seed, cap)
            assert hist.hits == sum(simulate_lru2(trace, cap, keep_history=True).hits), (seed, cap)


def test_a_requests_score_in_closed_form_is_the_per_key_steps():
    """scored() is the rule it replaced, a step per key of the chain: +1 per hit (the first
    h keys), x d after each key that came by add (the last a of t + a)."""
    rng = random.Random(7)
    for _ in range(2000):
        t, a = rng.randrange(0, 300), rng.randrange(0, 300)
        h = rng.randrange(0, t + a + 1)
        d = rng.choice([0.5, 0.9, 0.999, 1.0 - 1e-6])
        score = step = rng.uniform(0.0, 1000.0)
        for i in range(t + a):
            if i < h:
                step += 1.0
            if i >= t:
                step *= d
        assert abs(scored(score, d, t, a, h) - step) <= 1e-9 * max(1.0, step), (t, a, h, d)


def test_chain_positions_are_first_positions_however_the_appends_and_the_asks_interleave():
    """Chain.position indexes the keys appended since it was last asked: a key's first
    position, whether it came by append or extend, asked before or after later appends."""
    rng = random.Random(3)
    for _ in range(200):
        chain, keys = Chain(), []
        for _ in range(rng.randrange(1, 40)):
            if rng.random() < 0.5:
                k = rng.randrange(12)
                chain.append(k, False)
                keys.append(k)
            else:
                more = [rng.randrange(12) for _ in range(rng.randrange(4))]
                chain.extend(more)
                keys.extend(more)
            if rng.random() < 0.4:
                k = rng.randrange(14)
                assert chain.position(k, -1) == (keys.index(k) if k in keys else -1)
        assert chain.keys == keys and len(chain.tails) == len(keys)


def test_leader_leaves_lru_on_a_hot_prefix_between_one_offs_and_the_tier_follows():
    trace = hot_between_one_offs(90)
    assert sum(simulate_lru(trace, 8).hits) == 0
    pol, hits = _replay_leader(trace, 8)
    assert pol.shadows[pol.leader].name != "lru" and pol.switches >= 1
    assert hits >= 0.8 * sum(simulate_lru2(trace, 8).hits)
    # Once it leads, the tier holds what the leader's shadow holds: no strays left.
    assert not pol._strays and pol.keys() == set(pol.shadows[pol.leader].resident)


def test_margin_holds_the_recent_lead_while_the_tier_is_ahead_of_the_baselines():
    # The bank (LeaderPolicy._choose): ahead of every baseline shadow's hits since the start,
    # the recent (decayed) leader leads, past the margin; not ahead, the most hits since the
    # start, whatever the recent scores.
    pol = LeaderPolicy(capacity=4, margin=0.5)
    lru, lru2, hist, arc = pol.shadows
    lru.hits, lru2.hits, hist.hits, arc.hits = 10, 12, 11, 9
    pol.scores = [1.0, 1.0, 1.0, 9.0]
    pol.hits = 12  # level with the best baseline: not ahead
    assert pol._choose() == 1  # lru2: the most hits since the start
    pol.hits = 13  # ahead: the recent leader (arc, far past the margin)
    assert pol._choose() == 3
    pol.scores = [1.0, 1.0, 1.0, 1.4]  # arc ahead, but within the margin: lru keeps the lead
    assert pol._choose() == 0
    pol.leader = 3
    arc.hits = 13  # arc leads on both counts: it keeps the lead either way
    pol.hits = 0
    assert pol._choose() == 3


def test_the_tier_tracks_the_best_shadow_on_a_trace_where_one_baseline_wins_throughout():
    # A hot prefix between one-offs: lru2 (and lru2-history) keep it, lru loses it to every
    # pair of one-offs. The tier ends within the switches' cost of the best shadow.
    trace = hot_between_one_offs(300)
    pol, hits = _replay_leader(trace, 8)
    best = max(s.hits for s in pol.shadows)
    assert pol.shadows[pol.leader].hits == best
    assert hits >= best - 8  # at most one tier's worth lost to the one switch


def test_switch_happens_only_at_a_request_boundary_and_strays_go_first():
    pol = LeaderPolicy(capacity=4, margin=0.0)
    for k in (1, 2):  # one request: a fresh chain 1-2
        pol.add(k, 0 if k == 1 else 0)
    pol.touch([2, 1], False)
    pol.shadows[1].hits = 5  # lru2 ahead (and the tier not): nothing changes until the next request begins
    assert pol.leader == 0
    pol.add(3, 0)  # a put that found no prefix: a new request, so the switch happens here
    assert pol.leader == 1 and pol.switches == 1
    pol.check_integrity()
    # A block the leader does not hold is a stray, and strays are offered first.
    pol._in_tier[99] = None
    pol._strays[99] = None
    assert pol.head() == 99 and next(pol.candidates()) == 99 and pol.segment(99) == "stray"
    assert pol.remove(99, evicted=True) == "stray"
    pol.check_integrity()


def test_an_add_with_the_continuation_hint_continues_the_request_a_hit_opened():
    pol = LeaderPolicy(capacity=10)
    pol.add(1, 0)
    pol.touch([1], False)
    pol.touch([1], True)  # request 2 hits 1 ...
    pol.add(2, HINT_CONTINUATION)  # ... and stores 2 after it: one request, 2 a child of 1
    lead = pol.shadows[pol.leader]  # reads each key as it comes; the others at the request's end
    assert lead.request == 2 and lead.resident[2] == 1 and lead.hits == 1
    pol.check_integrity()  # holds with the other shadows behind
    pol.touch([2, 1], False)  # the put's end
    for s in pol.shadows:
        assert s.request == 2 and s.resident[2] == 1 and s.hits == 1
    pol.touch([1], True)  # request 3: a hit and no put
    pol.add(7, 0)  # a put that found no prefix (no continuation hint): request 4, 7 a root
    assert lead.request == 4 and lead.resident[7] is None and lead.hits == 2
    pol.touch([7], False)
    assert all(s.request == 4 and s.resident[7] is None and s.hits == 2 for s in pol.shadows)
    pol.check_integrity()


def test_candidates_do_not_mutate_head_is_first_and_never_beats_belady():
    for seed in range(6):
        trace = random_tree_trace(random.Random(seed), 60)
        for cap in (3, 6, 10):
            pol, hits = _replay_leader(trace, cap)
            before = list(pol.candidates())
            assert before == list(pol.candidates()) and set(before) == pol.keys() and len(before) == len(pol)
            assert pol.head() == before[0]
            assert hits <= sum(simulate_belady(trace, cap).hits)
            assert hits == sum(simulate_policy(trace, cap, "leader").hits)
