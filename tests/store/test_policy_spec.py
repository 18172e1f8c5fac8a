"""tierkv/core/policy_spec.py: the eviction_policy setting, one policy for every tier or one
per tier, read in one place; a store built from a per-tier setting gives each tier its own
policy and keeps its invariants."""
from __future__ import annotations

import pytest

from tierkv.core.policy import DEFAULT_POLICY, ARCPolicy, LRUPolicy
from tierkv.core.policy_leader import LeaderPolicy
from tierkv.core.policy_spec import describe, tier_policies
from tierkv.tiers.base import TierName

from .kit import PAGE, SCOPE, SLOT, put_chain, toks

D, H, K = TierName.DEVICE, TierName.HOST, TierName.DISK


@pytest.mark.parametrize("spec, want", [
    ("arc", {D: "arc", H: "arc", K: "arc"}),
    ("leader", {D: "leader", H: "leader", K: "leader"}),
    ("leader,disk=arc", {D: "leader", H: "leader", K: "arc"}),
    ("disk=arc,leader", {D: "leader", H: "leader", K: "arc"}),
    ("host=leader", {D: DEFAULT_POLICY, H: "leader", K: DEFAULT_POLICY}),
    (" host = leader , device=lru ", {D: "lru", H: "leader", K: DEFAULT_POLICY}),
    ("device=lru,host=lru2,disk=mix", {D: "lru", H: "lru2", K: "mix"}),
])
def test_a_spec_names_every_tiers_policy_and_describe_gives_it_back(spec, want):
    assert tier_policies(spec) == want
    assert tier_policies(describe(want)) == want
    assert describe({D: "arc", H: "arc", K: "arc"}) == "arc"
    assert describe(want) == (want[D] if len(set(want.values())) == 1 else
                              f"device={want[D]},host={want[H]},disk={want[K]}")


@pytest.mark.parametrize("spec, says", [
    ("lfu", "unknown policy 'lfu'"),
    ("disk=lfu", "unknown policy 'lfu'"),
    ("ssd=arc", "unknown tier 'ssd'"),
    ("arc,lru", "two policies for every tier"),
    ("host=arc,host=lru", "names the host tier twice"),
    ("", "empty part"),
    ("arc,", "empty part"),
    ("host=", "unknown policy ''"),
    (3, "must be a string"),
])
def test_a_bad_spec_is_a_value_error_that_says_what_is_wrong(spec, says):
    with pytest.raises(ValueError, match="eviction_policy") as e:
        tier_policies(spec)
    assert says in str(e.value)


def test_a_store_with_a_policy_per_tier_gives_each_tier_its_own_and_keeps_its_invariants(make_store, tmp_path):
    store = make_store(eviction_policy="leader,disk=arc", device_bytes=6 * PAGE, disk_bytes=64 * SLOT)
    orders = store.placement.table._order
    for tier, cls in ((D, LeaderPolicy), (H, LeaderPolicy), (K, ARCPolicy)):
        assert all(type(o) is cls for o in orders[tier].values()), tier
    for i in range(24):  # chains sharing prefixes, more than the device tier holds
        put_chain(store, toks(900 + i % 5, 1) + toks(950 + i, 1 + i % 3))
        with store.acquire(toks(900 + i % 5, 1), SCOPE) as lease:
            assert lease.num_blocks == 1
        store.check_integrity()
    s = store.stats()
    assert s["eviction_policy"] == "device=leader,host=leader,disk=arc"
    assert s["evictions"]["device"] > 0
    # One policy for every tier is reported by its name, as before.
    other = make_store(tmp_path / "other", eviction_policy="device=lru,host=lru,disk=lru")
    assert other.stats()["eviction_policy"] == "lru"
    assert all(type(o) is LRUPolicy for t in other.placement.table._order.values() for o in t.values())
