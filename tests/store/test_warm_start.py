"""Warm start (tierkv/core/warm_start.py): a store opened with ``warm_at_open`` reads back
into its device tier what that tier held at the last close, or after a crash (a real
SIGKILL) the newest blocks; it evicts nothing, serves nothing unverified, and a store that
does not warm leaves the record alone."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from tierkv.core.warm_start import WARM_META
from tierkv.tiers import TierName

from .kit import (LAYOUT, PAGE, SCOPE, assert_lease_exact, flip_byte, keys_of, page_for, put_chain, slot_offset,
                  tier_keys, toks)

DEVICE = TierName.DEVICE


def _device_order(store) -> list[bytes]:
    with store.placement.lock:
        return store.placement.table.in_order(DEVICE)


def _warmed(store, timeout: float = 30.0) -> dict:
    assert store.warm_start.wait(timeout), "the warm start did not end"
    return store.warm_start.stats()


def test_a_reopened_store_reads_back_what_its_device_tier_held(make_store):
    chains = [toks(900 + i, 2) for i in range(3)]  # 6 blocks; the device tier holds 4
    store = make_store(warm_at_open=True)
    for c in chains:
        put_chain(store, c)
    with store.acquire(chains[0], SCOPE) as lease:  # chain 0 used again: the most recent
        assert lease.num_blocks == 2
    before = _device_order(store)
    assert len(before) == 4 and set(keys_of(chains[0])) <= set(before)
    store.close()

    store = make_store(warm_at_open=True)
    st = _warmed(store)
    assert st["state"] == "done" and st["source"] == "record"
    assert st["asked_blocks"] == 4 and st["warmed_blocks"] == 4
    assert tier_keys(store)["device"] == set(before)
    assert _device_order(store) == before  # least recent first: the eviction order comes back
    assert store.index.get_meta(WARM_META) is None  # consumed: a crash now warms the newest instead
    promoted = store.stats()["promoted_bytes"]
    with store.acquire(chains[0], SCOPE) as lease:
        assert lease.num_blocks == 2
        assert_lease_exact(lease)
    st = store.stats()
    assert st["promoted_bytes"] == promoted  # nothing read: both blocks were in the device tier
    assert st["acquire_hits"]["device"] == 2
    assert st["evictions"] == {"device": 0, "host": 0, "disk": 0}


def test_each_warmed_chain_is_one_run_of_slots_root_first(make_store):
    # The record lists a chain leaf first (leaf-first eviction); slots taken in that order
    # would put a prompt in reverse, one run per block, and a vLLM load would copy it block
    # by block. The reads keep the record's order; the slots follow the chains.
    chains = [toks(905 + i, 4) for i in range(2)]
    store = make_store(warm_at_open=True, device_bytes=8 * PAGE)
    for c in chains:
        put_chain(store, c)
    before = _device_order(store)
    assert set(before) == set(keys_of(chains[0])) | set(keys_of(chains[1]))
    assert before.index(keys_of(chains[0])[-1]) < before.index(keys_of(chains[0])[0])  # leaf first
    store.close()

    store = make_store(warm_at_open=True, device_bytes=8 * PAGE)
    st = _warmed(store)
    assert st["warmed_blocks"] == 8
    assert _device_order(store) == before  # the eviction order comes back as it was
    for c in chains:
        with store.acquire(c, SCOPE) as lease:
            assert lease.num_blocks == 4
            first = lease.slots[0]
            assert list(lease.slots) == list(range(first, first + 4)), lease.slots
            assert_lease_exact(lease)
    assert store.stats()["acquire_hits"]["device"] == 8


def test_warming_uses_only_free_slots_and_keeps_the_most_recent(make_store):
    chains = [toks(910 + i, 2) for i in range(2)]
    store = make_store(warm_at_open=True)
    for c in chains:
        put_chain(store, c)
    before = _device_order(store)
    store.close()

    store = make_store(warm_at_open=True, device_bytes=2 * PAGE)  # room for half of the record
    st = _warmed(store)
    assert st["asked_blocks"] == 2 and st["warmed_blocks"] == 2
    assert tier_keys(store)["device"] == set(before[-2:])  # the two most recent
    assert store.stats()["evictions"]["device"] == 0


def test_a_bad_page_is_quarantined_not_warmed(make_store):
    chain = toks(920, 3)
    store = make_store(warm_at_open=True)
    put_chain(store, chain)
    keys = keys_of(chain)
    path, off = slot_offset(store, keys[1])
    store.close()
    flip_byte(path, off + 5)

    store = make_store(warm_at_open=True)
    st = _warmed(store)
    assert st["asked_blocks"] == 3 and st["warmed_blocks"] == 2
    assert keys[1] not in tier_keys(store)["device"]
    assert store.stats()["quarantined"] == 1
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 1  # never past the bad block
        assert_lease_exact(lease)


def test_a_store_that_does_not_warm_leaves_the_record_alone(make_store):
    chain = toks(930, 2)
    store = make_store(warm_at_open=True)
    put_chain(store, chain)
    store.close()
    recorded = make_store().index.get_meta(WARM_META)  # a CLI's open: no warm, no record
    assert recorded is not None and set(recorded.split(",")) == {k.hex() for k in keys_of(chain)}


def test_an_acquire_during_the_warm_start_gets_exact_pages(make_store):
    chains = [toks(940 + i, 1) for i in range(4)]
    store = make_store(warm_at_open=True)
    for c in chains:
        put_chain(store, c)
    store.close()
    for _ in range(3):  # the acquire races the warm start's reads: either order is right
        store = make_store(warm_at_open=True)
        for c in reversed(chains):
            with store.acquire(c, SCOPE) as lease:
                assert lease.num_blocks == 1
                assert_lease_exact(lease)
        _warmed(store)
        store.check_integrity()
        assert store.stats()["quarantined"] == 0
        store.close()


def test_close_during_the_warm_start_stops_it_between_batches(make_store, monkeypatch):
    import threading

    from tierkv.core import warm_start
    from tierkv.core.promotion import Promotion

    chains = [toks(950 + i, 4) for i in range(4)]  # 16 blocks
    opts = dict(warm_at_open=True, device_bytes=16 * PAGE, host_bytes=0)
    store = make_store(**opts)
    for c in chains:
        put_chain(store, c)
    store.close()

    monkeypatch.setattr(warm_start, "BATCH_BYTES", 4 * PAGE)  # four batches of four blocks
    entered, release = threading.Event(), threading.Event()
    real = Promotion.promote

    def held_first_batch(self, plan):
        if threading.current_thread().name == "tierkv-warm-start" and not entered.is_set():
            entered.set()
            assert release.wait(30)
        return real(self, plan)

    monkeypatch.setattr(Promotion, "promote", held_first_batch)
    store = make_store(**opts)
    assert entered.wait(30), "the warm start did not begin reading"
    with store.placement.lock:
        assert len(store.promotion.reserved_slots()) == 4  # the first batch's slots, not yet placed
    store.check_integrity()  # holds with reads in flight: their slots are reserved, not lost
    closing = threading.Thread(target=store.close)
    closing.start()
    deadline = time.monotonic() + 30
    while not store.warm_start._stop.is_set():  # close() asked the warm start to stop
        assert time.monotonic() < deadline
        time.sleep(0.001)
    release.set()  # the batch in flight ends; no other starts
    closing.join(30)
    assert not closing.is_alive()
    st = store.warm_start.stats()
    assert st["state"] == "stopped" and st["asked_blocks"] == 16 and st["warmed_blocks"] == 4


_CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from store.kit import open_store, put_chain, toks, keys_of
    store = open_store(Path({home!r}), shm_dir=Path({shm!r}))
    order = []
    for i in range(6):
        c = toks(960 + i, 1)
        put_chain(store, c)
        order.append(keys_of(c)[0].hex())
        time.sleep(0.02)  # distinct last_access times
    print(json.dumps(order), flush=True)
    time.sleep(600)
""")


def test_after_a_sigkill_the_newest_blocks_are_warmed(tmp_path, home, make_store):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(tests=tests, home=str(home), shm=str(tmp_path / "shm"))],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line, "the child wrote nothing"
        order = [bytes.fromhex(h) for h in json.loads(line)]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    store = make_store(warm_at_open=True)  # device tier: 4 pages
    st = _warmed(store)
    assert st["source"] == "newest" and st["warmed_blocks"] == 4
    assert tier_keys(store)["device"] == set(order[-4:])
    assert _device_order(store) == order[-4:]  # newest last: the most recent in the order
    assert all(store.placement.table.get(k) is not None for k in order)  # acknowledged: all kept
    with store.acquire(toks(965, 1), SCOPE) as lease:
        assert torch.equal(lease.page(0), page_for(order[-1], LAYOUT))


def test_a_warm_start_on_a_new_home_warms_nothing(make_store):
    store = make_store(warm_at_open=True)
    st = _warmed(store)
    assert st["state"] == "done" and st["asked_blocks"] == 0 and st["warmed_blocks"] == 0
    t0 = time.perf_counter()
    store.close()
    assert time.perf_counter() - t0 < 5.0


def test_the_vllm_connectors_embedded_store_warms_after_an_engine_restart(tmp_path):
    from tierkv import PageLayout
    from tierkv.identity import block_keys
    from tierkv.integrations.vllm.config import ConnectorConfig
    from tierkv.integrations.vllm.store import _close_shared, _open_shared

    layout = PageLayout(num_layers=1, num_kv_heads=4, head_dim=128, block_size=16, dtype="float32")
    cfg = ConnectorConfig(home=str(tmp_path / "home"), device_bytes=8 << 20, host_bytes=8 << 20, disk_bytes=64 << 20)
    tokens = list(range(1000, 1000 + 4 * layout.block_size))
    pages = torch.randn((4, *layout.shape), generator=torch.Generator().manual_seed(5))
    store = _open_shared(cfg, layout)  # the engine before its restart
    try:
        assert store.config.warm_at_open
        store.put(tokens, pages, SCOPE)
    finally:
        _close_shared(store)
    store = _open_shared(cfg, layout)  # the restarted engine's
    try:
        st = _warmed(store)
        assert st["source"] == "record" and st["warmed_blocks"] == 4
        assert tier_keys(store)["device"] == set(block_keys(tokens, SCOPE, layout.block_size))
        with store.acquire(tokens, SCOPE) as lease:
            assert torch.equal(lease.pages(), pages)
    finally:
        _close_shared(store)
    off = ConnectorConfig.from_extra({"home": cfg.home, "device_bytes": 8 << 20, "warm_at_open": "false"})
    store = _open_shared(off, layout)  # the option turned off: nothing read back
    try:
        assert not store.config.warm_at_open and store.warm_start.stats()["state"] == "off"
        assert not tier_keys(store)["device"]
    finally:
        _close_shared(store)


def test_index_newest_keeps_the_n_last_written_and_skips_short_records(tmp_path):
    from tierkv.index import BlockRecord, Index

    index = Index(tmp_path / "index", 1 << 20)
    try:
        stamps = [5.0, 1.0, 9.0, 3.0, 7.0]
        index.put_blocks([BlockRecord(bytes([i]) * 32, b"\0" * 32, "ab" * 32, "", 1, 0, i, t, b"\0" * 16)
                          for i, t in enumerate(stamps)])
        index._write(lambda txn: txn.put(b"\xff" * 32, b"short", db=index._blocks))  # a damaged record
        assert index.newest(3) == [bytes([i]) * 32 for i in (0, 4, 2)]  # 5.0, 7.0, 9.0: oldest first
        assert index.newest(0) == [] and len(index.newest(10)) == 5
        assert index.get_meta("x") is None and not index.delete_meta("x")
        index.put_meta("x", "y")
        assert index.delete_meta("x") and index.get_meta("x") is None
    finally:
        index.close()
