"""Eviction policies (tierkv/core/policy.py) and the trace references (tierkv/traces.py):
invariants every policy keeps in a real store, the references on hand-made traces with
known answers, the adaptive policy beating LRU where it must, and the replay tool."""
from __future__ import annotations

import gc
import importlib.util
import json
import random
from pathlib import Path

import pytest

from tierkv import Priority, StoreConfig
from tierkv.core.policy import HINT_FRESH, POLICIES, ARCPolicy, EvictionPolicy, LRUPolicy, heap_in_order
from tierkv.core.policy_mix import MixPolicy
from tierkv.traces import (Request, block_tokens, read_trace, simulate_belady, simulate_lru, simulate_lru2,
                           simulate_policy)
from .kit import LAYOUT, PAGE, SCOPE, SLOT, assert_lease_exact, keys_of, put_chain, random_tree_trace, tier_keys, toks

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"


def _trace(*reqs: tuple[int, ...]) -> list[Request]:
    return [Request(tuple(r), len(r) * 512) for r in reqs]


def _hot_and_scans(scan: int = 4, n: int = 40) -> list[Request]:
    """A 4-block prefix used every third request between one-off requests of ``scan`` blocks."""
    out, u = [], 100
    for i in range(n):
        if i % 3 == 0:
            out.append(Request(tuple(range(4)), 4 * 512))
        else:
            out.append(Request(tuple(range(u, u + scan)), scan * 512))
            u += 10
    return out


# ---- invariants of every policy, in a real store ------------------------------------------
class CheckedOrder(EvictionPolicy):
    """One tier's policy for one priority class, checking the policy's rules at the moment
    of every eviction (the table tells the policy ``remove(key, evicted=True)`` while the
    block is still in the table): never a leased or busy block (the one being evicted holds
    itself busy while it moves, hence <= 1), never pinned on disk, never a block with an
    extension in the same tier. (The table's own methods cannot be patched: it is compiled,
    see tierkv/native.py; a policy is a base class compiled to allow such subclasses.)"""

    def __init__(self, inner, tier, table, evicted: list[str]) -> None:
        self.inner, self.tier, self.table, self.evicted = inner, tier, table, evicted
        self.name, self.ghost_hits = inner.name, inner.ghost_hits  # (a compiled attribute: kept in step in add)

    def remove(self, key, evicted=False):
        if evicted:
            block = self.table.get(key)
            assert block is not None, "evicted a block that is not in the table"
            assert not block.leases and block.busy <= 1, "evicted a leased or busy block"
            assert not (block.priority == Priority.PINNED and self.tier.value == "disk"), "evicted a pinned block from disk"
            kids = [self.table.get(c) for c in block.children]
            assert not any(k is not None and self.tier.value in k.loc for k in kids), "evicted a block before its extension"
            self.evicted.append(self.tier.value)
        return self.inner.remove(key, evicted)

    def __getattr__(self, name):  # anything else a caller reads (cold_inserts...)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def __bool__(self) -> bool:
        return bool(self.inner)

    def __contains__(self, key) -> bool:
        return key in self.inner

    def add(self, key, hint=HINT_FRESH):
        self.inner.add(key, hint)
        self.ghost_hits = self.inner.ghost_hits  # a ghost hit happens on add

    def touch(self, keys, hit):
        self.inner.touch(keys, hit)

    def candidates(self):
        return self.inner.candidates()

    def head(self):
        return self.inner.head()

    def segment(self, key):
        return self.inner.segment(key)

    def keys(self):
        return self.inner.keys()

    def check_integrity(self):
        self.inner.check_integrity()


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_keeps_leaf_first_pinned_and_leased(make_store, policy):
    store = make_store(eviction_policy=policy, disk_bytes=12 * 4096, segment_pages=4)
    rng = random.Random(7)
    pinned = toks(500, 2)
    put_chain(store, pinned, priority=Priority.PINNED)
    held = toks(501, 2)
    put_chain(store, held)
    lease = store.acquire(held, SCOPE)
    assert lease.num_blocks == 2
    held_keys = set(keys_of(held))
    evicted: list[str] = []
    table = store.placement.table
    for tier, orders in table._order.items():
        for prio in orders:
            orders[prio] = CheckedOrder(orders[prio], tier, table, evicted)
    convs = [toks(600 + c, 1) for c in range(5)]
    for step in range(60):
        c = rng.randrange(len(convs))
        if rng.random() < 0.5:  # the conversation grows by a turn
            convs[c] = convs[c] + toks(1000 + step, 1)
        tokens = convs[c] if rng.random() < 0.7 else toks(2000 + step, rng.randint(1, 3))
        with store.acquire(tokens, SCOPE) as lease2:
            assert_lease_exact(lease2)
        put_chain(store, tokens, priority=Priority.EPHEMERAL if rng.random() < 0.1 else Priority.NORMAL)
        where = tier_keys(store)
        assert held_keys <= where["device"], "a leased block left the device tier"
        assert set(keys_of(pinned)) <= where["disk"], "a pinned block left the disk tier"
        store.check_integrity()
    assert_lease_exact(lease)
    store.release(lease)
    s = store.stats()
    assert s["eviction_policy"] == policy
    for tier in ("device", "host", "disk"):
        assert sum(s["evicted_by"][tier].values()) == s["evictions"][tier]
    assert s["evictions"]["device"] > 0 and len(evicted) == sum(s["evictions"].values())


# Not lru2: LRU-2 ranks a hit block by its previous use, not at the recent end
# (tests/store/test_policy_mix.py checks its order).
@pytest.mark.parametrize("policy", ("lru", "arc", "mix"))
def test_a_hit_reorders_every_tier_and_class_leaf_first(make_store, policy):
    """A hit moves its chain to the recent end of each list that holds it (the device and
    disk tiers here, one chain pinned), leaf first so that the root is the most recent, and
    leaves the other chains' order alone (mix: in its arc expert, which leads at first)."""
    store = make_store(eviction_policy=policy, device_bytes=16 * PAGE, disk_bytes=64 * SLOT)
    a, b, c = toks(700, 3), toks(701, 3), toks(702, 2)
    put_chain(store, a)
    put_chain(store, b)
    put_chain(store, c, priority=Priority.PINNED)
    with store.acquire(a, SCOPE) as lease:
        assert lease.num_blocks == 3
    with store.acquire(c, SCOPE) as lease:
        assert lease.num_blocks == 2
    orders = store.placement.table._order

    def recency(tier: str, prio: Priority) -> list[bytes]:
        """Keys from least to most recently used (every list of the policy, in order)."""
        o = orders[next(t for t in orders if t.value == tier)][prio]
        if isinstance(o, MixPolicy):
            o = o.experts[0]
        if isinstance(o, LRUPolicy):
            return list(o.candidates())
        return [k for d in (o._cold, o._recent, o._frequent) for k in d]

    ka, kb, kc = keys_of(a), keys_of(b), keys_of(c)
    for tier in ("device", "disk"):
        normal = recency(tier, Priority.NORMAL)
        assert set(normal) == set(ka) | set(kb), tier
        # a's blocks were used after b's, and each chain sits leaf first, root last.
        tail = normal[-3:]
        assert tail == ka[::-1], f"{tier}: the hit chain is not at the recent end, leaf first"
        assert [k for k in normal if k in kb] == kb[::-1], f"{tier}: another chain's order changed"
        assert recency(tier, Priority.PINNED)[-2:] == kc[::-1], f"{tier}: the pinned chain was not reordered"


def test_config_rejects_unknown_policy(tmp_path):
    with pytest.raises(ValueError, match="eviction_policy"):
        StoreConfig(home=tmp_path, layout=LAYOUT, eviction_policy="lfu")


def test_arc_ghosts_are_bounded_metadata():
    p = ARCPolicy(capacity=4)
    for i in range(50):
        key = bytes([i])
        p.add(key)
        p.remove(key, evicted=True)
        p.check_integrity()
    assert len(p) == 0 and len(p._ghost_recent) + len(p._ghost_frequent) <= p.ghost_limit == 6
    p.add(bytes([49]))  # still remembered: enters as frequent
    assert p.ghost_hits == 1 and p.segment(bytes([49])) == "frequent"


def test_lru_policy_orders_by_last_touch():
    p = LRUPolicy()
    for k in (b"a", b"b", b"c"):
        p.add(k)
    p.touch([b"a"], hit=True)
    assert list(p.candidates()) == [b"b", b"c", b"a"]


# ---- the references on hand-made traces ----------------------------------------------------
def test_lru_reference_known_answer():
    # cap 2: r2 needs room; the least recently used is 1, so 1 misses again at r3.
    trace = _trace((1,), (2,), (3,), (1,))
    assert simulate_lru(trace, 2).hits == (0, 0, 0, 0)
    # Leaf first: 2 goes before its prefix 1, so r2 still hits 1.
    trace = _trace((1, 2), (3,), (1, 2))
    assert simulate_lru(trace, 2).hits == (0, 0, 1)


def test_belady_reference_known_answer():
    trace = _trace((1,), (2,), (3,), (1,))
    assert simulate_belady(trace, 2).hits == (0, 0, 0, 1)  # 2 is never used again: it goes
    # Prefix constraint: only the leaf 3 may go although 1 and 2 are used as late.
    trace = _trace((1, 2, 3), (4,), (1, 2, 3))
    assert simulate_belady(trace, 3).hits == (0, 0, 2)


def test_lru2_reference_known_answer():
    # 1 is used twice, 2 once: LRU-2 keeps 1 where LRU would keep the more recent 2.
    trace = _trace((1,), (1,), (2,), (3,), (1,))
    assert simulate_lru2(trace, 2).hits == (0, 1, 0, 0, 1)
    assert simulate_lru(trace, 2).hits == (0, 1, 0, 0, 0)


def test_belady_bounds_every_policy_on_random_trees():
    rng = random.Random(3)
    for _ in range(30):
        trace = random_tree_trace(rng, 50)
        for cap in (3, 6, 10):
            best = sum(simulate_belady(trace, cap).hits)
            for f in (simulate_lru, simulate_lru2, lambda t, c: simulate_policy(t, c, "arc")):
                assert sum(f(trace, cap).hits) <= best


def test_policy_model_lru_equals_reference():
    trace = _hot_and_scans(3)
    for cap in (5, 7, 9):
        assert simulate_policy(trace, cap, "lru").hits == simulate_lru(trace, cap).hits


def test_arc_beats_lru_on_hot_prefix_between_scans():
    trace = _hot_and_scans(4)
    assert sum(simulate_lru(trace, 8).hits) == 0  # every scan pushes the hot prefix out
    arc = sum(simulate_policy(trace, 8, "arc").hits)
    assert arc > 0.8 * sum(simulate_belady(trace, 8).hits)


def test_block_tokens_depend_on_the_id_only():
    assert (block_tokens(5) == block_tokens(5)).all()
    assert not (block_tokens(5) == block_tokens(6)).all()
    big = block_tokens(1 << 40)
    assert big.min() >= 0 and len(big) == 512


# ---- the replay tool -----------------------------------------------------------------------
def _replay_module():
    spec = importlib.util.spec_from_file_location("replay_trace", ROOT / "scripts" / "replay_trace.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _small_trace(tmp_path: Path) -> Path:
    if TRACE.exists():
        return TRACE
    path = tmp_path / "trace.jsonl"  # a stand-in with the same shape
    with open(path, "w") as f:
        for r in _hot_and_scans(4, 80):
            f.write(json.dumps({"timestamp": 0, "input_length": r.input_length - 100, "output_length": 1,
                                "hash_ids": list(r.hash_ids)}) + "\n")
    return path


@pytest.mark.parametrize("policy", POLICIES)
def test_store_replay_equals_policy_model(tmp_path, policy):
    mod = _replay_module()
    trace = read_trace(_small_trace(tmp_path), limit=80)
    frozen = gc.get_freeze_count()  # not 0 on Python 3.12: the interpreter freezes a few hundred
    res, rps, stats = mod.replay_store(trace, 150, policy)
    assert res.hits == simulate_policy(trace, 150, policy).hits
    if policy == "lru":  # the store's LRU is exactly the original rule
        assert res.hits == simulate_lru(trace, 150).hits
    assert rps > 0 and stats["eviction_policy"] == policy
    # The harness freezes its own heap out of the collector for the replay only, and the
    # collector changes no hit.
    assert stats["heap_frozen"] and gc.get_freeze_count() <= frozen and stats["gc_seconds"] >= 0
    res2, _, stats2 = mod.replay_store(trace, 150, policy, freeze_heap=False)
    assert res2.hits == res.hits and not stats2["heap_frozen"]


def test_replay_ab_script_replays_two_trees_in_lockstep(tmp_path, capsys):
    """scripts/replay_ab.py: this tree against a git revision's tierkv (here HEAD), side by
    side in one process; it refuses to report a speed when the two stores' hits differ."""
    spec = importlib.util.spec_from_file_location("replay_ab", ROOT / "scripts" / "replay_ab.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    # --no-compile-base: compiling the base with mypyc takes a minute or more (used by hand,
    # docs/performance-history.md); the lockstep and its checks are the same either way.
    rc = mod.main([str(_small_trace(tmp_path)), "--limit", "60", "--capacity", "100", "--repeat", "2", "--json",
                   "--no-compile-base"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["rows"]
    assert row["capacity"] == 100 and len(row["runs"]) == 2 and out["requests"] == 60
    model = simulate_policy(read_trace(_small_trace(tmp_path), limit=60), 100, "arc")
    for run in row["runs"]:
        assert run["block_hits"] == sum(model.hits) and run["speedup"] > 0 and run["base_rps"] > 0


def test_replay_script_json(tmp_path, capsys):
    mod = _replay_module()
    rc = mod.main([str(_small_trace(tmp_path)), "--limit", "120", "--capacity", "300", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in out["rows"]}
    assert set(rows) >= {"belady", "lru", "lru2", "tierkv lru", "tierkv arc"}
    assert rows["tierkv lru"]["block_hit_rate"] == rows["lru"]["block_hit_rate"]
    assert rows["belady"]["share_of_optimum"] == 1.0
    for r in rows.values():
        assert r["block_hit_rate"] <= rows["belady"]["block_hit_rate"]
        assert 0 <= r["token_hit_rate"] <= 1


def test_policy_metrics_from_store_stats(make_store):
    from tierkv.daemon.metrics import policy_metrics

    store = make_store()  # device 4, host 4, disk 32: evictions from both memory tiers
    for i in range(6):
        put_chain(store, toks(700 + i, 2))
    fams = {f.name: f for f in policy_metrics(store.stats())}
    by_reason = {(s.labels["tier"], s.labels["reason"]): s.value for s in fams["tierkv_evictions_by_reason"].samples}
    assert sum(v for (t, _), v in by_reason.items() if t == "device") == store.stats()["evictions"]["device"] > 0
    assert {"tierkv_ghost_hits", "tierkv_cold_admissions", "tierkv_admissions_refused", "tierkv_hit_rate",
            "tierkv_acquire_hit_rate"} <= set(fams)
    with store.acquire(toks(705, 2) + toks(706, 1), SCOPE) as lease:  # 2 of 3 blocks stored
        assert lease.num_blocks == 2
    fams = {f.name: f for f in policy_metrics(store.stats())}
    rates = {s.labels["tier"]: s.value for s in fams["tierkv_acquire_hit_rate"].samples}
    assert sum(rates.values()) == pytest.approx(2 / 3)


def test_arc_not_below_lru_on_recency_chat():
    # Chat: LRU's best case (recently active conversations resumed). The warm insertion
    # class keeps arc level with it where LRU already holds everything reused.
    trace = _replay_module().generated("chat")[:1500]
    for cap in (300, 1500):
        assert sum(simulate_policy(trace, cap, "arc").hits) >= sum(simulate_lru(trace, cap).hits)


def test_heap_in_order_walks_a_heap_smallest_first_without_popping_it():
    import heapq

    rng = random.Random(7)
    for n in (0, 1, 2, 5, 64, 301):
        heap = [(rng.randint(0, 20), rng.randint(0, 3)) for _ in range(n)]  # repeats: ties
        heapq.heapify(heap)
        before = list(heap)
        assert list(heap_in_order(heap)) == sorted(heap) and heap == before
        walk = heap_in_order(heap)
        assert [next(walk) for _ in range(min(n, 3))] == sorted(heap)[:3]  # stops early


def _claims_idempotent_rehits() -> list[str]:
    from tierkv.core.policy_mix import make_policy

    return [p for p in POLICIES if make_policy(p, 1).rehit_idempotent]


@pytest.mark.parametrize("policy", _claims_idempotent_rehits())
def test_a_policy_that_says_a_rehit_is_idempotent_keeps_its_order_and_segments(policy):
    """rehit_idempotent (what lets a leader's shadow skip the re-ordering after a request
    that was all hits): a touch(keys, False) right after touch(keys, True) changes neither
    the victim order nor any key's segment. Checked for the policies that claim it."""
    from tierkv.core.policy_mix import make_policy

    rng = random.Random(11)
    keys = [bytes([i]) * 4 for i in range(40)]
    pol = make_policy(policy, 8)
    held: list[bytes] = []
    for step in range(400):
        k = rng.choice(keys)
        if k not in held:
            if len(held) >= 8:
                v = next(iter(pol.candidates()))
                pol.remove(v, True)
                held.remove(v)
            pol.add(k, rng.randrange(4))
            held.append(k)
        chain = rng.sample(held, rng.randint(1, len(held)))
        pol.touch(chain, True)
        before = (list(pol.candidates()), [pol.segment(x) for x in held])
        pol.touch(chain, False)
        assert (list(pol.candidates()), [pol.segment(x) for x in held]) == before, step
        pol.check_integrity()
