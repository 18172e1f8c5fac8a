"""Eviction: leaf first in every tier, pinned blocks stay on disk, leased blocks never move,
ephemeral blocks go when their lease ends."""
from __future__ import annotations

import pytest
import torch

from tierkv import Priority
from tierkv.core.blocks import Block, BlockTable
from tierkv.errors import LeaseError
from .kit import (SCOPE, assert_lease_exact, assert_prefix_order, keys_of, page_for, pages_for, put_chain,
                  tier_counts, tier_keys, toks)


def _chain_prefix_in(store, chain, tier: str) -> list[bool]:
    held = tier_keys(store)[tier]
    return [k in held for k in keys_of(chain)]


def _is_prefix(flags: list[bool]) -> bool:
    """True, True, ..., False, False: what a tier holds of a chain is a prefix of it."""
    return flags == sorted(flags, reverse=True)


def test_leaf_first_in_device_and_host(make_store):
    store = make_store()  # device 4, host 4
    a = toks(100, 4)
    put_chain(store, a)
    put_chain(store, toks(101, 2))
    # Room for the two new blocks came from a's leaves; a's prefix stays on the device.
    assert _chain_prefix_in(store, a, "device") == [True, True, False, False]
    assert _chain_prefix_in(store, a, "host") == [False, False, True, True]
    put_chain(store, toks(102, 4))
    put_chain(store, toks(103, 1))
    assert _is_prefix(_chain_prefix_in(store, a, "host"))
    assert_prefix_order(store)
    # A lookup of a's prefix refreshes only that prefix.
    store.lookup(a[:8], SCOPE)
    put_chain(store, toks(104, 2))
    assert _is_prefix(_chain_prefix_in(store, a, "host"))
    assert_prefix_order(store)


def test_leaf_first_on_disk(make_store):
    store = make_store(disk_bytes=8 * 4096, segment_pages=4)
    chains = [toks(110 + i, 3) for i in range(6)]
    for c in chains:
        put_chain(store, c)
        for old in chains:
            assert _is_prefix(_chain_prefix_in(store, old, "disk")), "a prefix left the disk before its extension"
        assert_prefix_order(store)
        store.check_integrity()
    assert tier_counts(store)["disk"] == 8
    # The oldest chain is gone from disk entirely; what lookup finds is a whole prefix.
    for c in chains:
        r = store.lookup(c, SCOPE)
        assert r.keys == tuple(keys_of(c)[: r.num_blocks])


def test_extension_stored_before_prefix_is_known_as_child(make_store):
    # Regression: a suffix put before its prefix was not registered as the prefix's child,
    # so leaf-first eviction could take the prefix from disk under it.
    store = make_store(disk_bytes=4 * 4096, segment_pages=4)
    chain = toks(120, 2)
    pages = pages_for(chain)
    store.put(chain, pages[1:], SCOPE, start_block=1)
    store.put(chain, pages[:1], SCOPE)
    k0, k1 = keys_of(chain)
    assert k1 in store.placement.table.get(k0).children
    put_chain(store, toks(121, 3))  # disk pressure: 4 slots
    assert _is_prefix(_chain_prefix_in(store, chain, "disk"))


def test_pinned_never_evicted_from_disk(make_store):
    store = make_store(disk_bytes=8 * 4096, segment_pages=4)
    pinned = toks(130, 3)
    put_chain(store, pinned, priority=Priority.PINNED)
    later = toks(131, 2)
    put_chain(store, later)
    assert store.set_priority(later, SCOPE, Priority.PINNED) == 2
    for i in range(12):
        put_chain(store, toks(140 + i, 2))
        assert _chain_prefix_in(store, pinned, "disk") == [True] * 3
        assert _chain_prefix_in(store, later, "disk") == [True] * 2
    assert store.lookup(pinned, SCOPE).tokens_matched == len(pinned)
    assert store.stats()["evictions"]["disk"] > 0
    # Unpinned, they are ordinary cache entries again.
    store.set_priority(later, SCOPE, Priority.NORMAL)
    for i in range(4):
        put_chain(store, toks(160 + i, 2))
    assert _chain_prefix_in(store, later, "disk") == [False, False]


def test_put_into_disk_full_of_pinned_blocks_stays_in_memory(make_store):
    # Regression: when the disk ran out of room halfway through a put, the blocks that did
    # get a disk slot were placed there without being written or indexed.
    store = make_store(disk_bytes=4 * 4096, segment_pages=4)
    put_chain(store, toks(170, 3), priority=Priority.PINNED)
    chain = toks(171, 2)
    r = put_chain(store, chain)
    assert r.stored == 2 and not r.durable
    keys = keys_of(chain)
    assert _chain_prefix_in(store, chain, "disk") == [True, False]
    assert store.index.get_block(keys[0]) is not None and store.index.get_block(keys[1]) is None
    store.check_integrity()
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 2
        assert_lease_exact(lease)


def test_leased_blocks_never_evicted_or_moved(make_store):
    store = make_store(disk_bytes=8 * 4096, segment_pages=4)
    chain = toks(180, 3)
    put_chain(store, chain)
    with store.acquire(chain, SCOPE) as lease:
        slots = lease.slots
        snapshot = lease.pages().clone()
        locs = [dict(store.placement.table.get(k).loc) for k in lease.keys]
        for i in range(10):  # device, host and disk pressure
            put_chain(store, toks(181 + i, 2))
            assert lease.slots == slots
            assert [dict(store.placement.table.get(k).loc) for k in lease.keys] == locs
            assert torch.equal(lease.pages(), snapshot)
            store.check_integrity()
        assert_lease_exact(lease)
        assert store.stats()["leased_blocks"] == 3
        # Only one device slot is free for others; another chain's lease is shorter.
        other = toks(190, 2)  # the newest chain, still cached
        with store.acquire(other, SCOPE) as short:
            assert short.num_blocks == 1
            assert_lease_exact(short)
    assert store.stats()["leased_blocks"] == 0


def test_full_device_of_leases_gives_empty_lease_and_put_goes_below(make_store):
    store = make_store()
    a = toks(190, 4)
    put_chain(store, a)
    with store.acquire(a, SCOPE) as lease:
        assert lease.num_blocks == 4
        b = toks(191, 2)
        r = put_chain(store, b)
        assert r.stored == 2
        assert _chain_prefix_in(store, b, "device") == [False, False]
        assert _chain_prefix_in(store, b, "host") == [True, True]
        with store.acquire(b, SCOPE) as none:
            assert none.num_blocks == 0
    with store.acquire(b, SCOPE) as got:
        assert got.num_blocks == 2
        assert_lease_exact(got)


def test_ephemeral_dropped_when_lease_ends(make_store):
    store = make_store()
    eph = toks(200, 2)
    r = put_chain(store, eph, priority=Priority.EPHEMERAL)
    assert r.stored == 2 and not r.durable
    assert tier_counts(store)["disk"] == 0
    lease = store.acquire(eph, SCOPE)
    assert lease.num_blocks == 2
    assert store.lookup(eph, SCOPE).tokens_matched == 8  # still there while leased
    lease.release()
    assert store.lookup(eph, SCOPE).tokens_matched == 0
    assert tier_counts(store) == {"device": 0, "host": 0, "disk": 0}


def test_ephemeral_goes_first_and_is_never_written_back(make_store):
    store = make_store(write_through=False)
    eph = toks(210, 2)
    put_chain(store, eph, priority=Priority.EPHEMERAL)
    normal = toks(211, 3)
    put_chain(store, normal)
    put_chain(store, toks(212, 3))  # device: 4 slots; ephemeral blocks are the first victims
    assert _chain_prefix_in(store, eph, "device") == [False, False]
    assert _chain_prefix_in(store, normal, "device")[0]
    for i in range(4):
        put_chain(store, toks(213 + i, 2))
    assert _chain_prefix_in(store, eph, "disk") == [False, False]
    store.check_integrity()


def test_dead_pages_not_reused_while_leased(make_store):
    store = make_store()
    chain = toks(220, 2)
    put_chain(store, chain)
    with store.acquire(chain, SCOPE) as lease:
        store.invalidate(namespace="default")
        for i in range(6):
            put_chain(store, toks(221 + i, 2))
        for i, k in enumerate(lease.keys):
            assert torch.equal(lease.page(i), page_for(k))
        assert store.device.slots.is_used(lease.slots[0])
    assert store.lookup(chain, SCOPE).tokens_matched == 0


def test_ephemeral_survives_an_acquire_that_could_not_lease_it(make_store):
    # Regression: when acquire stopped short (device full of leases), the ephemeral blocks it
    # had tentatively leased were dropped as if their lease had ended.
    store = make_store()
    hog = toks(230, 4)
    put_chain(store, hog)
    eph = toks(231, 2)
    with store.acquire(hog, SCOPE):
        put_chain(store, eph, priority=Priority.EPHEMERAL)  # lands in the host tier
        with store.acquire(eph, SCOPE) as none:
            assert none.num_blocks == 0
        assert store.lookup(eph, SCOPE).num_blocks == 2
    with store.acquire(eph, SCOPE) as lease:
        assert lease.num_blocks == 2
        assert_lease_exact(lease)
    assert store.lookup(eph, SCOPE).num_blocks == 0  # this lease did end


def test_ephemeral_prefix_is_never_written_to_disk(make_store):
    store = make_store()
    head = toks(240, 2)
    put_chain(store, head, priority=Priority.EPHEMERAL)
    longer = head + toks(241, 1)
    r = put_chain(store, longer)
    assert r.stored == 1 and not r.durable  # the head is ephemeral: memory only
    assert _chain_prefix_in(store, longer, "disk") == [False, False, True]
    store.set_priority(longer, SCOPE, Priority.PINNED)  # pinning makes the whole prefix durable
    assert _chain_prefix_in(store, longer, "disk") == [True, True, True]


def test_ending_leases_in_one_pass_restores_counts_on_a_double_release():
    """BlockTable.unlease_many drops one lease per block in one pass; a block released more
    often than leased raises with every count as before; it hands back only the unheld
    blocks whose release asks more of the caller (dead or ephemeral)."""
    def block(i: int, priority=Priority.NORMAL, leases=1, busy=0) -> Block:
        return Block(key=bytes([i]) * 32, parent=b"", model_version="", namespace="", tokens=b"", checksum=0,
                     priority=priority, leases=leases, busy=busy)

    table = BlockTable()
    a, b, c = block(1, leases=2), block(2), block(3, leases=0)
    with pytest.raises(LeaseError):
        table.holds.unlease_many([a, b, c])
    assert (a.leases, b.leases, c.leases) == (2, 1, 0)
    eph, dead, busy, normal = block(4, Priority.EPHEMERAL), block(5), block(6, Priority.EPHEMERAL, busy=1), block(7)
    dead.dead = True
    assert table.holds.unlease_many([a, eph, dead, busy, normal]) == [eph, dead]
    assert [x.leases for x in (a, eph, dead, busy, normal)] == [1, 0, 0, 0, 0]


def test_a_stored_block_is_one_object_for_the_garbage_collector(make_store):
    """A block's locations and child keys are dicts of str/int and bytes/None, which
    Python's cyclic GC does not track: a full collection walks one object per block, not
    three. Extensions stored before their prefix (orphans) are adopted, evictions hand
    children on, and the table's check keeps the location keys plain str."""
    import gc

    store = make_store()  # device 4, host 4, disk
    a = toks(300, 6)
    pages = pages_for(a)
    store.put(a, pages[4:], SCOPE, start_block=4)  # blocks 4..5 first: orphans until their prefix comes
    store.put(a, pages[:4], SCOPE)
    put_chain(store, toks(301, 4))  # evicts some of a from the device
    table = store.placement.table
    with store.placement.lock:
        blocks = list(table.blocks.values())
        assert len(blocks) == 10 and all(b.loc for b in blocks)
        for b in blocks:
            assert not gc.is_tracked(b.loc) and not gc.is_tracked(b.children), b.loc
            assert all(type(t) is str for t in b.loc)
        keys = keys_of(a)
        assert keys[5] in table.get(keys[4]).children and keys[4] in table.get(keys[3]).children
        table.check_integrity()


def test_a_put_says_durable_only_when_every_block_it_names_is_on_disk(make_store):
    mem = make_store(disk_bytes=0)  # no disk tier: nothing is durable, nothing to walk
    chain = toks(990, 3)
    assert not mem.put(chain, pages_for(chain, SCOPE), SCOPE).durable
    assert not mem.put(chain, pages_for(chain, SCOPE), SCOPE).durable  # all skipped, still memory only
    assert mem.put(chain, pages_for(chain, SCOPE)[:0], SCOPE, start_block=3).durable  # names no block
    mem.close()
    disk = make_store()
    assert disk.put(chain, pages_for(chain, SCOPE), SCOPE).durable
    assert disk.put(chain, pages_for(chain, SCOPE), SCOPE).durable  # already there, on disk
    eph = toks(991, 2)
    assert not disk.put(eph, pages_for(eph, SCOPE), SCOPE, priority=Priority.EPHEMERAL).durable
