"""Threads: lookups, leases, puts, prefetches and invalidations at once on overlapping
prefixes; a read racing with eviction or demotion gets the whole block or a miss."""
from __future__ import annotations

import random
import threading
import time
import traceback
from unittest import mock

import pytest

from tierkv import Scope

from .kit import BS, MV1, PAGE, SCOPE, SLOT, assert_lease_exact, keys_of, put_chain, tier_counts, toks


def _run(workers, n_threads: int = 4) -> None:
    errors: list[str] = []

    def wrap(i: int) -> None:
        try:
            workers(i)
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a worker hung"
    assert not errors, errors[0]


@pytest.mark.slow
def test_threads_on_overlapping_prefixes(make_store):
    store = make_store(device_bytes=6 * PAGE, host_bytes=6 * SLOT, disk_bytes=32 * SLOT, segment_pages=4)
    base = toks(700, 3)
    chains = [base + toks(701 + i, 2) for i in range(6)] + [toks(710 + i, 3) for i in range(3)]

    def worker(wid: int) -> None:
        rng = random.Random(wid)
        for _ in range(80):
            c = rng.choice(chains)
            op = rng.random()
            if op < 0.35:
                put_chain(store, c[: BS * rng.randint(1, len(c) // BS)])
            elif op < 0.7:
                with store.acquire(c, SCOPE, max_blocks=rng.choice([None, 2])) as lease:
                    assert lease.keys == tuple(keys_of(c)[: lease.num_blocks])
                    assert_lease_exact(lease)
            elif op < 0.9:
                r = store.lookup(c, SCOPE)
                assert r.keys == tuple(keys_of(c)[: r.num_blocks])
            else:
                assert store.prefetch(c, SCOPE).result(timeout=60) % BS == 0

    _run(worker)
    store.check_integrity()
    assert store.stats()["leased_blocks"] == 0


@pytest.mark.slow
def test_read_racing_with_eviction_and_demotion(make_store):
    # One reader, so the hot chain is unleased between its acquires (regression: with two
    # overlapping readers it was leased throughout and never moved, so nothing raced). A
    # writer keeps pushing it down the tiers; each acquire must bring it back up whole.
    store = make_store(device_bytes=4 * PAGE, host_bytes=2 * SLOT, disk_bytes=64 * SLOT, segment_pages=8)
    hot = toks(720, 3)
    hot_keys = tuple(keys_of(hot))
    put_chain(store, hot)
    stop = threading.Event()
    found_in: dict[str, int] = {"device": 0, "host": 0, "disk": 0}  # the hot blocks' tier at acquire
    full = [0]
    puts = [0]

    def worker(wid: int) -> None:
        if wid == 0:  # the writer: a steady stream of new chains pushes everything down
            for i in range(60):
                put_chain(store, toks(730 + i, 2))
                puts[0] += 1
            stop.set()
            return
        seen = 0
        while not stop.is_set():
            # Acquiring in a tight loop keeps the chain the most recently used, so it never
            # moves: wait for two more puts (enough to push it out of the device tier), then
            # acquire while the writer goes on with the next ones.
            if puts[0] - seen < 2:
                time.sleep(0.001)
                continue
            seen = puts[0]
            before = store.lookup(hot, SCOPE).tiers  # a probe: where the chain is right now
            for t in before:
                found_in[t] += 1
            with store.acquire(hot, SCOPE) as lease:
                assert lease.keys == hot_keys[: lease.num_blocks]  # the chain under test, in order
                assert_lease_exact(lease)  # whole pages, never a torn one
                full[0] += lease.num_blocks == 3

    _run(worker, 2)
    store.check_integrity()
    assert store.stats()["evictions"]["device"] > 0
    # The race happened: the hot chain itself was found below the device tier (demoted or
    # evicted by the writer between two acquires) and promoted back, whole, many times.
    print("hot chain found in", found_in, "full leases", full[0])
    assert found_in["host"] + found_in["disk"] > 0, found_in
    assert full[0] > 0
    assert store.stats()["acquire_hits"]["host"] + store.stats()["acquire_hits"]["disk"] > 0


@pytest.mark.slow
def test_invalidate_racing_with_leases_and_puts(make_store):
    store = make_store(device_bytes=8 * PAGE, disk_bytes=64 * SLOT, segment_pages=8)
    tenant = Scope(MV1, namespace="tenant")
    chains = [toks(800 + i, 2) for i in range(4)]

    def worker(wid: int) -> None:
        rng = random.Random(wid)
        for _ in range(50):
            c = rng.choice(chains)
            if wid == 0:
                store.invalidate(namespace="tenant")
            elif wid == 1:
                put_chain(store, c, tenant)
            else:
                with store.acquire(c, tenant) as lease:
                    assert_lease_exact(lease)

    _run(worker, 4)
    store.check_integrity()
    store.invalidate(namespace="tenant")
    assert tier_counts(store) == {"device": 0, "host": 0, "disk": 0}


def test_invalidate_during_verify_frees_space(make_store):
    # Regression: blocks retired while verify() was reading them were never freed.
    store = make_store()
    chain = toks(850, 2)
    put_chain(store, chain)
    reading, go_on = threading.Event(), threading.Event()
    real = type(store.disk).read_page

    def slow_read(self, loc):
        reading.set()
        go_on.wait(30)
        return real(self, loc)

    with mock.patch.object(type(store.disk), "read_page", slow_read):
        t = threading.Thread(target=store.verify)
        t.start()
        assert reading.wait(30)
        assert store.invalidate(namespace="default").removed_blocks == 2
        go_on.set()
        t.join(30)
    store.check_integrity()
    assert tier_counts(store) == {"device": 0, "host": 0, "disk": 0}
    assert store.placement.pending_frees() == 0


def test_acquire_waits_for_a_promotion_in_flight(make_store):
    store = make_store()
    chain = toks(860, 2)
    put_chain(store, chain)
    for i in range(3):
        put_chain(store, toks(861 + i, 4))  # push the chain to disk only
    assert store.lookup(chain, SCOPE).tiers == ("disk", "disk")
    reading, go_on = threading.Event(), threading.Event()
    real = type(store.disk).read_page
    first = [True]

    def slow_read(self, loc):
        if first[0]:
            first[0] = False
            reading.set()
            go_on.wait(30)
        return real(self, loc)

    results = []
    with mock.patch.object(type(store.disk), "read_page", slow_read):
        t = threading.Thread(target=lambda: results.append(store.acquire(chain, SCOPE)))
        t.start()
        assert reading.wait(30)
        u = threading.Thread(target=lambda: results.append(store.acquire(chain, SCOPE)))
        u.start()
        go_on.set()
        t.join(30)
        u.join(30)
    assert len(results) == 2
    for lease in results:
        assert lease.num_blocks == 2
        assert_lease_exact(lease)
    assert results[0].slots == results[1].slots
    for lease in results:
        lease.release()
    store.check_integrity()


def test_failed_read_wakes_waiters(make_store):
    store = make_store()
    chain = toks(870, 2)
    put_chain(store, chain)
    for i in range(3):
        put_chain(store, toks(871 + i, 4))
    reading, go_on = threading.Event(), threading.Event()

    def failing_read(self, loc):
        reading.set()
        go_on.wait(30)
        raise OSError(5, "EIO")

    results = []
    with mock.patch.object(type(store.disk), "read_page", failing_read):
        t = threading.Thread(target=lambda: results.append(store.acquire(chain, SCOPE)))
        t.start()
        assert reading.wait(30)
        u = threading.Thread(target=lambda: results.append(store.acquire(chain, SCOPE)))
        u.start()
        go_on.set()
        t.join(30)
        u.join(30)
        assert not t.is_alive() and not u.is_alive()
    assert [r.num_blocks for r in results] == [0, 0]
    for lease in results:
        lease.release()
    # An I/O error proves nothing about the page: a miss and a read-degraded tier, no deletion.
    st = store.stats()
    assert st["quarantined"] == 0
    assert st["tiers"]["disk"]["read_degraded"] == "EIO" and st["tiers"]["disk"]["read_errors"] >= 1
    store.check_integrity()
    with store.acquire(chain, SCOPE) as lease:  # the fault cleared: served again, byte-exact
        assert lease.num_blocks == 2
        assert_lease_exact(lease)
    assert store.stats()["tiers"]["disk"]["read_degraded"] is None


def test_waiting_for_a_stuck_read_is_bounded(make_store, monkeypatch):
    # Every wait has a bound: a second acquire of a block whose read (by another thread) is
    # stuck gives up after PROMOTION_WAIT_S with a shorter lease instead of hanging.
    import tierkv.core.promotion as promotion

    monkeypatch.setattr(promotion, "PROMOTION_WAIT_S", 0.5)
    store = make_store()
    chain = toks(880, 2)
    put_chain(store, chain)
    for i in range(3):
        put_chain(store, toks(881 + i, 4))
    reading, go_on = threading.Event(), threading.Event()
    real = type(store.disk).read_page

    def stuck_read(self, loc):
        reading.set()
        go_on.wait(30)
        return real(self, loc)

    results = []
    with mock.patch.object(type(store.disk), "read_page", stuck_read):
        t = threading.Thread(target=lambda: results.append(store.acquire(chain, SCOPE)))
        t.start()
        assert reading.wait(30)
        lease = store.acquire(chain, SCOPE)  # waits 0.5 s for block 0, then a miss
        assert lease.num_blocks == 0
        lease.release()
        assert store.stats()["wait_timeouts"] >= 1
        go_on.set()
        t.join(30)
    assert results[0].num_blocks == 2
    assert_lease_exact(results[0])
    results[0].release()
    with store.placement.lock:
        assert store.promotion.reads_in_flight() == 0
        assert all(b.busy == 0 and b.leases == 0 for b in store.placement.table.blocks.values())
    store.check_integrity()
