"""Two nodes with separate homes sharing one (fake) remote store: cross-node hits with
identical bytes, publishing policy, isolation, corruption and a dead master."""
from __future__ import annotations

import torch

from tierkv import Priority, Scope
from tierkv.cluster import PublishPolicy
from tierkv.identity import block_keys
from tierkv.cluster.remote import RemoteMeta

from .kit import BS, MV2, SCOPE, pages_for, toks


def test_cross_node_hit_serves_identical_bytes(nodes):
    a, b = nodes("a"), nodes("b")
    t = toks(1, 4, extra=2)
    pages = pages_for(t)
    a.put(t, pages, SCOPE, priority=Priority.PINNED)  # pinned: write-through to the cluster
    assert b.store.lookup(t, SCOPE).tokens_matched == 0
    res = b.lookup(t, SCOPE)
    assert res.tokens_matched == 4 * BS and res.tiers == ("remote",) * 4
    with b.acquire(t, SCOPE) as lease:
        assert lease.num_blocks == 4
        assert torch.equal(lease.pages().cpu(), pages)
    assert b.store.lookup(t, SCOPE).tokens_matched == 4 * BS  # promoted into b's own tiers
    assert b.counters["pulled_blocks"] == 4


def test_remote_extends_a_partial_local_prefix(nodes):
    a, b = nodes("a"), nodes("b")
    t = toks(2, 5)
    pages = pages_for(t)
    a.put(t, pages, SCOPE, priority=Priority.PINNED)
    b.store.put(t[: 2 * BS], pages[:2], SCOPE)
    with b.acquire(t, SCOPE) as lease:
        assert lease.num_blocks == 5
        assert torch.equal(lease.pages().cpu(), pages)
    assert b.counters["pulled_blocks"] == 3


def test_default_policy_keeps_normal_puts_local(nodes, cluster):
    a = nodes("a")
    a.put(toks(3, 2), pages_for(toks(3, 2)), SCOPE)
    assert not cluster.objects
    a.put(toks(3, 2), pages_for(toks(3, 2)), SCOPE, priority=Priority.EPHEMERAL)
    assert not cluster.objects


def test_pinning_and_materialising_publish(nodes, cluster):
    a = nodes("a")
    t1, t2 = toks(4, 2), toks(5, 3)
    a.put(t1, pages_for(t1), SCOPE)
    a.set_priority(t1, SCOPE, Priority.PINNED)
    assert len(cluster.objects) == 2
    a.put(t2, pages_for(t2), SCOPE)
    last = block_keys(t2, SCOPE, BS)[-1]
    a.save_manifest("doc", {"kind": "prefix", "last_block_key": last.hex()})
    assert len(cluster.objects) == 5


def test_local_only_namespace_never_leaves_the_node(nodes, cluster):
    policy = PublishPolicy(publish_puts=True, local_only_namespaces=frozenset({"secret"}))
    a, b = nodes("a", policy=policy), nodes("b", policy=policy)
    secret = Scope(SCOPE.model_version, "secret")
    t = toks(6, 2)
    a.put(t, pages_for(t, secret), secret, priority=Priority.PINNED)
    assert not cluster.objects
    assert b.lookup(t, secret).tokens_matched == 0


def test_namespace_and_model_version_isolation(nodes):
    policy = PublishPolicy(publish_puts=True)
    a, b = nodes("a", policy=policy), nodes("b", policy=policy)
    t = toks(7, 3)
    a.put(t, pages_for(t), SCOPE)
    assert b.lookup(t, SCOPE).tokens_matched == 3 * BS
    for other in (Scope(SCOPE.model_version, "tenant-b"), Scope(MV2), Scope(SCOPE.model_version, extra_keys=("lora",))):
        assert b.lookup(t, other).tokens_matched == 0
        with b.acquire(t, other) as lease:
            assert lease.num_blocks == 0


def test_corrupted_remote_page_is_a_counted_miss(nodes, cluster):
    a, b = nodes("a"), nodes("b")
    t = toks(8, 3)
    a.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
    name = b.remote.name(block_keys(t, SCOPE, BS)[1])
    blob = bytearray(cluster.objects[name])
    for i in range(len(blob) - 64, len(blob)):
        blob[i] ^= 0xFF
    cluster.objects[name] = bytes(blob)
    with b.acquire(t, SCOPE) as lease:
        assert lease.num_blocks == 1  # block 0 fetched, block 1 bad: the prefix stops there
        assert torch.equal(lease.pages().cpu(), pages_for(t)[:1])
    assert b.remote.faults["verify_failed"] == 1


def test_dead_master_degrades_to_local_then_reconnects(nodes, cluster, clock):
    a, b = nodes("a"), nodes("b")
    t, u = toks(9, 2), toks(10, 2)
    b.store.put(u, pages_for(u), SCOPE)
    a.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
    assert b.lookup(t, SCOPE).tokens_matched == 2 * BS
    cluster.down = True
    assert b.lookup(t, SCOPE).tokens_matched == 0
    with b.acquire(u, SCOPE) as lease:  # local blocks still served
        assert lease.num_blocks == 2
    a.put(toks(11, 1), pages_for(toks(11, 1)), SCOPE, priority=Priority.PINNED)  # publish fails quietly
    assert not b.remote.up and b.remote.faults["unreachable"] >= 1
    cluster.down = False
    cluster.restart()  # a restarted master has lost every object
    clock.t += 60
    a.put(t, pages_for(t), SCOPE, priority=Priority.NORMAL)
    assert a.set_priority(t, SCOPE, Priority.PINNED) == 2  # republished after the restart
    assert b.lookup(t, SCOPE).tokens_matched == 2 * BS
    assert b.remote.up and b.remote.counters["reconnects"] == 1


def test_eviction_hook_publishes_only_with_write_back(nodes, cluster):
    t = toks(12, 1)
    key = block_keys(t, SCOPE, BS)[0]
    page = pages_for(t)[0]
    from tierkv.checksum import page_checksum

    meta = RemoteMeta(key, SCOPE.seed, SCOPE.model_version, SCOPE.namespace,
                      torch.tensor(t, dtype=torch.int32).numpy().tobytes(), page_checksum(key, page))
    assert not nodes("a").evicted(meta, page)
    assert nodes("b", policy=PublishPolicy(write_back_evicted=True)).evicted(meta, page)
    assert len(cluster.objects) == 1


def test_blocks_evicted_from_the_last_tier_are_written_back_through_the_listener(nodes, cluster):
    # Disk holds 64 slots: 20 chains of 4 blocks push the first ones out of every tier.
    a = nodes("a", policy=PublishPolicy(write_back_evicted=True, publish_materialised=False))
    chains = [toks(300 + i, 4) for i in range(20)]
    for t in chains:
        a.put(t, pages_for(t), SCOPE)
    assert a.store.stats().counters.evictions["disk"] > 0
    a.publisher.flush()  # the write-backs queued so far are done
    assert a.counters["written_back_blocks"] == len(cluster.objects) > 0
    gone = [t for t in chains if a.store.lookup(t, SCOPE).tokens_matched < len(t)]
    assert gone
    b = nodes("b")  # pulls what a evicted, byte for byte
    t = gone[0]
    with b.acquire(t, SCOPE) as lease:
        assert lease.num_blocks == 4 and torch.equal(lease.pages().cpu(), pages_for(t))


def test_no_listener_without_write_back(nodes, cluster):
    a = nodes("a")
    assert not a.store.placement.eviction_listeners
    for i in range(20):
        t = toks(400 + i, 4)
        a.put(t, pages_for(t), SCOPE)
    assert a.store.stats().counters.evictions["disk"] > 0 and not cluster.objects


def test_prefetch_pulls_from_the_cluster(nodes):
    a, b = nodes("a"), nodes("b")
    t = toks(13, 3)
    a.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
    assert b.prefetch(t, SCOPE).result(10) == 3 * BS
    assert b.store.lookup(t, SCOPE).tiers == ("device",) * 3


def test_named_prefixes_are_republished_after_a_master_restart(nodes, cluster):
    a, b = nodes("a"), nodes("b")
    t = toks(40, 3)
    a.put(t, pages_for(t), SCOPE)
    last = block_keys(t, SCOPE, BS)[-1]
    a.save_manifest("doc", {"kind": "prefix", "last_block_key": last.hex()})
    assert len(cluster.objects) == 3
    cluster.restart()  # a restarted master has lost every object
    assert b.lookup(t, SCOPE).num_blocks == 0
    assert a.republish() == 3
    assert a.republish() == 0  # already there: skipped
    with b.acquire(t, SCOPE) as lease:
        assert lease.num_blocks == 3
        assert torch.equal(lease.pages().view(torch.uint8), pages_for(t).view(torch.uint8))


def test_publish_prefix_larger_than_the_device_tier(nodes, cluster):
    a = nodes("a")
    t = toks(41, 12)
    a.put(t, pages_for(t), SCOPE)
    r = a.publish_prefix(t, SCOPE, window=5)  # three leases of at most 5 blocks
    assert (r.published, r.failed) == (12, 0) and len(cluster.objects) == 12
