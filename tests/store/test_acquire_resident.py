"""``acquire_resident`` and ``try_release``: the store calls the daemon makes on its event
loop. They finish now or do nothing: a lease only of blocks already in the device tier, with
the lock free; otherwise None, with no lease taken and no block marked used."""
from __future__ import annotations

import threading

import torch

from tierkv.tiers import TierName

from .kit import SCOPE, pages_for, toks


def _hold(lock):
    held, go = threading.Event(), threading.Event()

    def run() -> None:
        with lock:
            held.set()
            go.wait(10)

    t = threading.Thread(target=run)
    t.start()
    held.wait(10)
    return t, go


def test_resident_prefix_is_leased_like_acquire(make_store):
    store = make_store()
    t = toks(1, 3)
    store.put(t, pages_for(t, SCOPE), SCOPE)
    lease = store.acquire_resident(t, SCOPE)
    assert lease is not None and lease.num_blocks == 3
    assert torch.equal(lease.pages(), pages_for(t, SCOPE))
    assert all(b.leases == 1 for b in lease.blocks)
    with store.acquire(t, SCOPE) as other:
        assert other.keys == lease.keys and other.slots == lease.slots
    assert store.try_release(lease)
    assert all(b.leases == 0 for b in lease.blocks)
    window = store.acquire_resident(t, SCOPE, start_block=1, max_blocks=1)
    assert window is not None and window.keys == lease.keys[1:2]
    store.release(window)
    miss = store.acquire_resident(toks(2, 2), SCOPE)
    assert miss is not None and miss.num_blocks == 0
    store.release(miss)
    store.check_integrity()


def test_a_block_outside_the_device_tier_means_none_and_nothing_held(make_store):
    store = make_store()  # device tier: 4 pages, then host, then disk
    first, second = toks(3, 3), toks(4, 4)
    store.put(first, pages_for(first, SCOPE), SCOPE)
    store.put(second, pages_for(second, SCOPE), SCOPE)  # pushes `first` out of the device tier
    blocks = [store.placement.table.get(k) for k in store.lookup(first, SCOPE).keys]
    assert blocks and any(TierName.DEVICE not in b.loc for b in blocks)
    order = {t: list(store.placement.table._order[t][b.priority].keys()) for t in TierName for b in blocks[:1]}
    assert store.acquire_resident(first, SCOPE) is None
    assert all(b.leases == 0 for b in blocks)
    assert {t: list(store.placement.table._order[t][blocks[0].priority].keys()) for t in order} == order
    with store.acquire(first, SCOPE) as lease:  # the full acquire promotes them
        assert torch.equal(lease.pages(), pages_for(first, SCOPE))
    store.check_integrity()


def test_a_busy_lock_means_none_and_try_release_false(make_store):
    store = make_store()
    t = toks(5, 2)
    store.put(t, pages_for(t, SCOPE), SCOPE)
    lease = store.acquire(t, SCOPE)
    thread, go = _hold(store.placement.lock)
    try:
        assert store.acquire_resident(t, SCOPE) is None
        assert store.try_release(lease) is False
        assert not lease.released and all(b.leases == 1 for b in lease.blocks)
    finally:
        go.set()
        thread.join(10)
    assert store.try_release(lease) is True
    assert all(b.leases == 0 for b in lease.blocks)
    store.check_integrity()
