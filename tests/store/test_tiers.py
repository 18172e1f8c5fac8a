"""Tier movement: device -> host -> disk under pressure, write-back, reopen in a new process,
and the slot allocators underneath."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tierkv import Priority
from tierkv.tiers import SlotAllocator, TierName

DISK = TierName.DISK

from .child import chain_tokens, scope_of
from .kit import (BS, LAYOUT, PAGE, SCOPE, SLOT, assert_lease_exact, assert_prefix_order, keys_of, open_store,
                  page_for, pages_for, put_chain, segment_files, tier_counts, tier_keys, toks)


def test_overfill_device_demotes_to_host_and_disk(make_store):
    store = make_store()  # device 4 pages, host 4 slots, disk 32 slots
    chains = [toks(10 + i, 4) for i in range(3)]
    for c in chains:
        assert put_chain(store, c).durable
        store.check_integrity()
    assert tier_counts(store) == {"device": 4, "host": 4, "disk": 12}
    st = store.stats()
    assert st["evictions"]["device"] >= 8 and st["demoted_bytes"] >= 4 * PAGE
    assert st["tiers"]["device"]["used_bytes"] == 4 * PAGE
    for c in chains:
        assert store.lookup(c, SCOPE).tokens_matched == len(c)
    # The newest chain is in the device tier, the one before in the host tier.
    assert tier_keys(store)["device"] == set(keys_of(chains[2]))
    assert tier_keys(store)["host"] == set(keys_of(chains[1]))
    assert store.lookup(chains[0], SCOPE).tiers == ("disk",) * 4
    with store.acquire(chains[0], SCOPE) as lease:  # promoted from disk, checksummed
        assert lease.num_blocks == 4
        assert_lease_exact(lease)
    assert store.stats()["promoted_bytes"] >= 4 * PAGE
    assert_prefix_order(store)


def test_put_larger_than_device_keeps_prefix_on_top(make_store):
    # Regression: a put of more blocks than the device holds used to leave the device with
    # the chain's tail and push its own prefix down to the host tier.
    store = make_store()
    chain = toks(20, 10)
    assert put_chain(store, chain).stored == 10
    keys = keys_of(chain)
    where = tier_keys(store)
    assert where["device"] == set(keys[:4])
    assert where["host"] == set(keys[4:8])
    assert where["disk"] == set(keys)
    assert_prefix_order(store)
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 4  # the device tier holds 4 pages
        assert_lease_exact(lease)


def test_write_back_reaches_disk_on_eviction_and_close(make_store, home):
    store = make_store(write_through=False)
    chains = [toks(30 + i, 3) for i in range(4)]  # 12 blocks: 4 device, 4 host, 4 written back
    for c in chains:
        assert not put_chain(store, c).durable
    counts = tier_counts(store)
    assert counts["device"] == 4 and counts["host"] == 4
    # Evicted from the host, a block is written back with whatever of its prefix is not on
    # disk yet, so the disk holds whole prefixes.
    assert counts["disk"] >= 4
    on_disk = tier_keys(store)["disk"]
    for c in chains:
        flags = [k in on_disk for k in keys_of(c)]
        assert flags == sorted(flags, reverse=True)
    for c in chains:
        assert store.lookup(c, SCOPE).tokens_matched == len(c)
    eph = toks(39, 1)
    put_chain(store, eph, priority=Priority.EPHEMERAL)
    store.close()
    store = make_store()
    for c in chains:
        with store.acquire(c, SCOPE) as lease:
            assert lease.num_blocks == 3
            assert_lease_exact(lease)
    assert store.lookup(eph, SCOPE).tokens_matched == 0  # ephemeral blocks are never written


def test_write_back_without_host_tier_keeps_evicted_blocks(make_store):
    # Regression: with write_through=False and no host tier, a block evicted from the
    # device was dropped instead of written back to disk.
    store = make_store(write_through=False, host_bytes=0)
    a, b = toks(40, 4), toks(42, 4)
    put_chain(store, a)
    assert tier_counts(store) == {"device": 4, "host": 0, "disk": 0}
    put_chain(store, b)  # evicts a from the device: written back, not lost
    assert tier_counts(store) == {"device": 4, "host": 0, "disk": 4}
    long = toks(43, 8)  # more than memory holds in one put: the tail goes straight to disk
    put_chain(store, long)
    for c in (a, b, long):
        assert store.lookup(c, SCOPE).tokens_matched == len(c)
    assert_prefix_order(store)


def test_memory_only_store(make_store):
    store = make_store(host_bytes=0, disk_bytes=0)
    chain = toks(41, 6)
    r = put_chain(store, chain)
    assert not r.durable and r.stored == 6
    assert store.lookup(chain, SCOPE).tokens_matched == 4 * BS  # two blocks had nowhere to go
    with store.acquire(chain, SCOPE) as lease:
        assert_lease_exact(lease)


@pytest.mark.slow
def test_reopen_in_new_process_finds_every_disk_block(make_store, home, child_cmd):
    from .child import store_options

    store = make_store(**{k: v for k, v in store_options("").items() if k != "shm_dir"})
    n = 24
    for i in range(n):
        tokens, scope = chain_tokens(7, i), scope_of(7, i)
        assert store.put(tokens, pages_for(tokens, scope), scope).durable
    blocks = store.stats()["blocks"]
    assert tier_counts(store)["disk"] == blocks
    store.close()
    out = subprocess.run(child_cmd("check", home, 7, n), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"found": n, "bad": 0, "blocks": blocks}


def test_reopen_same_process_restores_disk_tier(make_store, home):
    store = make_store()
    chains = [toks(50 + i, 5) for i in range(3)]
    for c in chains:
        put_chain(store, c)
    files = segment_files(home)
    store.close()
    store = make_store()
    assert segment_files(home) == files
    assert tier_counts(store) == {"device": 0, "host": 0, "disk": 15}
    for c in chains:
        assert store.lookup(c, SCOPE).tiers == ("disk",) * 5
        with store.acquire(c, SCOPE) as lease:
            assert_lease_exact(lease)


def test_segments_follow_model_version_and_are_deleted_when_empty(make_store, home):
    from tierkv import Scope

    from .kit import MV2

    store = make_store()
    a, b = toks(60, 3), toks(61, 3)
    put_chain(store, a)
    put_chain(store, b, Scope(MV2))
    assert len(segment_files(home)) == 2  # one model version per segment
    r = store.invalidate(model_version=MV2)
    assert r.removed_blocks == 3
    assert len(segment_files(home)) == 1
    store.invalidate(model_version=SCOPE.model_version)
    assert segment_files(home) == []
    assert store.stats()["tiers"]["disk"]["file_bytes"] == 0


def test_slot_allocator_transitions():
    a = SlotAllocator(3)
    assert [a.alloc(), a.alloc()] == [0, 1]
    a.free(0)
    assert a.alloc() == 0
    with pytest.raises(ValueError):
        a.free(2)  # never handed out
    a.free(1)
    with pytest.raises(ValueError):
        a.free(1)  # double free
    a.claim(2)
    with pytest.raises(ValueError):
        a.claim(2)
    with pytest.raises(ValueError):
        a.claim(3)
    assert a.alloc() == 1 and a.alloc() is None
    a.check_integrity()
    assert a.num_used == 3 and a.num_free == 0
    with pytest.raises(ValueError):
        SlotAllocator(-1)


def test_slot_allocator_hands_out_the_lowest_free_slot_whatever_the_free_order():
    """Against a model (the minimum of a set): random allocs and frees, ascending and
    descending runs of frees (a daemon's commit frees its staging slots in ascending
    order), a lowered limit."""
    import random

    rng = random.Random(7)
    a, free = SlotAllocator(64), set(range(64))
    for step in range(3000):
        if step == 1500:
            a.set_limit(40)
        limit_ok = [s for s in free if s < a.limit] if len(a.used_slots()) < a.limit else []
        if rng.random() < 0.55:
            got = a.alloc()
            assert got == (min(limit_ok) if limit_ok else None)
            free.discard(got)
        elif a.used_slots():
            used = sorted(a.used_slots())
            run = used[: rng.randint(1, 8)] if rng.random() < 0.5 else used[-rng.randint(1, 8):][::-1]
            for s in run:
                a.free(s)
                free.add(s)
        if step % 250 == 0:
            a.check_integrity()
    a.check_integrity()


def test_disk_slots_go_where_the_old_scan_put_them(tmp_path):
    """DiskTier.alloc finds its slot through heaps (tierkv/tiers/free_slots.py); it must give
    exactly what sorting every segment and scanning its slots gave: the lowest segment of
    the model version with room below the limit, its lowest free slot, else a new segment
    at the lowest free id. Random allocs and frees of two model versions, a lowered and a
    raised limit, a reopen (claims) in the middle."""
    import random

    from tierkv.tiers.disk import DiskTier, location, split_location

    def expected(segs: dict[int, tuple[str, set[int]]], mv: str, limit: int, pages: int, max_segs: int):
        for seg_id, (v, used) in sorted(segs.items()):
            if seg_id >= limit:
                break
            if v == mv and len(used) < pages:
                return location(seg_id, min(set(range(pages)) - used))
        if len(segs) >= limit:
            return None
        return next((location(i, 0) for i in range(limit) if i not in segs), None)

    pages, max_segs = 4, 12
    rng = random.Random(3)
    tier = DiskTier(tmp_path / "d", LAYOUT, capacity_bytes=pages * max_segs * SLOT, segment_pages=pages, fsync=False)
    model: dict[int, tuple[str, set[int]]] = {}
    held: list[tuple[int, str]] = []
    for step in range(1500):
        if step == 500:
            tier.set_limit(6 * pages * SLOT)
        if step == 1000:
            tier.set_limit(max_segs * pages * SLOT)
        if step == 700:  # reopen: the used sets come back through claims
            tier.close()
            tier = DiskTier(tmp_path / "d", LAYOUT, capacity_bytes=pages * max_segs * SLOT, segment_pages=pages,
                            fsync=False)
            for loc, mv in held:
                assert tier.claim(loc, mv)
            tier.reclaim_empty()
        if held and rng.random() < 0.45:
            loc, mv = held.pop(rng.randrange(len(held)))
            tier.free(loc)
            seg_id, index = split_location(loc)
            model[seg_id][1].discard(index)
            if not model[seg_id][1]:
                del model[seg_id]
        else:
            mv = rng.choice(["mv-a", "mv-b"])
            want = expected(model, mv, tier.segment_limit, pages, max_segs)
            got = tier.alloc(mv)
            assert got == want, (step, mv, got, want)
            if got is not None:
                seg_id, index = split_location(got)
                model.setdefault(seg_id, (mv, set()))[1].add(index)
                held.append((got, mv))
        if step % 100 == 0:
            tier.check_integrity()
    tier.check_integrity()
    tier.close()


def test_slot_allocator_reuse_is_free_then_alloc():
    """reuse(slot) hands the slot on without touching the free list only where free(slot)
    then alloc() would give that very slot; elsewhere it is those two calls."""
    def twins(n: int, used: int, limit: int | None = None) -> list[SlotAllocator]:
        out = []
        for _ in range(2):
            a = SlotAllocator(n)
            for _ in range(used):
                a.alloc()
            if limit is not None:
                a.set_limit(limit)
            out.append(a)
        return out

    cases = [(4, 4, None, 2), (4, 3, None, 2), (4, 4, 2, 1), (4, 4, 2, 3), (4, 4, 3, 0)]
    for n, used, limit, slot in cases:  # full, one free, lowered limits below and above the slot
        a, b = twins(n, used, limit)
        b.free(slot)
        assert a.reuse(slot) == b.alloc(), (n, used, limit, slot)
        assert a.used_slots() == b.used_slots() and a.num_free == b.num_free
        a.check_integrity()
    a = SlotAllocator(2)
    a.alloc()
    with pytest.raises(ValueError):
        a.reuse(1)  # never handed out: free() refuses it


def test_device_pool_views_are_pages(make_store):
    store = make_store()
    chain = toks(70, 2)
    put_chain(store, chain)
    with store.acquire(chain, SCOPE) as lease:
        assert torch.equal(store.device.pool[lease.slots[1]], pages_for(chain)[1])
        kv = lease.kv()
        assert len(kv) == 2 and kv[0][0].shape == (1, 2, 2 * BS, 8)


def test_write_many_with_the_callers_page_bytes_copies_the_rows_asked(make_store):
    """A put hands the device tier its pages' bytes (made once, for its checksums too):
    rows in any order, to any slots, land exactly as the per-page path puts them."""
    from tierkv.checksum import page_rows

    store = make_store()
    tier = store.device
    pages = torch.randn(5, *LAYOUT.shape).to(LAYOUT.torch_dtype)
    tier.write_many([0], pages, [0])  # the first copy makes the pool's byte view
    assert tier._bytes_view is not None  # so the calls below take the put's path
    for slots, rows in (([2, 0, 1], [4, 1, 3]), ([3, 1], [0, 1])):  # a gather; consecutive rows: a slice
        tier.write_many(slots, pages, rows, page_rows(pages))
        for s, r in zip(slots, rows):
            assert torch.equal(tier.page(s), pages[r])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_non_contiguous_pages_and_every_dtype_round_trip(tmp_path, dtype):
    import tierkv
    from tierkv import PageLayout

    layout = PageLayout(2, 2, 8, 4, dtype=dtype)

    def reopen():
        return tierkv.open(tmp_path / "h", layout, device="cpu", device_bytes=4 * layout.page_bytes,
                           host_bytes=2 * 4096, disk_bytes=16 * 4096, segment_pages=4, shm_dir=tmp_path / "shm")

    store = reopen()
    try:
        chain = toks(80, 4)
        raw = torch.randn(*layout.shape, 4).to(layout.torch_dtype)
        pages = raw.permute(5, 0, 1, 2, 3, 4)  # [4, L, 2, B, H, D], not contiguous
        assert not pages.is_contiguous()
        store.put(chain, pages, SCOPE)
        with store.acquire(chain, SCOPE) as lease:
            assert torch.equal(lease.pages(), pages)
        store.close()
        store = reopen()
        with store.acquire(chain, SCOPE) as lease:  # every page from disk, checksummed
            assert lease.num_blocks == 4
            assert torch.equal(lease.pages(), pages)
        store.check_integrity()
    finally:
        store.close()


def test_open_reaps_shared_memory_left_by_killed_processes(tmp_path):
    import subprocess

    import tierkv
    from tierkv import PageLayout

    shm = tmp_path / "shm"
    shm.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists
    stale = shm / f"tierkv-host-{dead.pid}-0123abcd"
    stale.write_bytes(b"\0" * 4096)
    foreign = shm / "not-tierkv-1-0123abcd"
    foreign.write_bytes(b"x")
    layout = PageLayout(2, 2, 8, block_size=4)
    with tierkv.open(tmp_path / "home", layout, shm_dir=shm, device_bytes=8 * layout.page_bytes,
                     host_bytes=8 * layout.slot_bytes, disk_bytes=1 << 20) as store:
        assert not stale.exists() and foreign.exists()
        live = {p.name for p in shm.iterdir()}
        assert any(n.startswith(f"tierkv-host-{os.getpid()}-") for n in live)  # this store's own
        store.check_integrity()



def _cached_pages(path, offset: int, nbytes: int) -> int:
    """Pages of ``path`` in ``[offset, offset + nbytes)`` that sit in the page cache (mincore
    on a read-only mapping, which itself reads nothing)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = offset // page * page
    length = -(-(offset + nbytes - start) // page) * page
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), start + length, prot=mmap.PROT_READ)
    try:
        addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        vec = ctypes.create_string_buffer(length // page)
        assert libc.mincore(ctypes.c_void_p(addr + start), length, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(b & 1 for b in vec.raw)
    finally:
        mm.close()


@pytest.mark.parametrize("direct_reads", [False, True], ids=["buffered", "odirect"])
def test_disk_reads_leave_no_copy_in_the_page_cache(make_store, home, direct_reads):
    """A cold read of a disk block (either read path) returns its bytes and leaves none of
    them in the page cache: the memory tiers are the one copy their budgets count."""
    from tierkv.tiers.diskio import drop_page_cache

    store = make_store(device_bytes=8 * PAGE, host_bytes=0, direct_reads=direct_reads)
    if direct_reads and not store.disk.odirect:
        pytest.skip("this file system refuses O_DIRECT: there is no direct read path to test")
    tokens = toks(7, 6)
    assert put_chain(store, tokens).durable
    store.close()
    store = make_store(device_bytes=8 * PAGE, host_bytes=0, direct_reads=direct_reads)
    drop_page_cache(sorted((home / "segments").glob("seg-*")))  # what opening read: only the acquire's reads count
    assert store.disk.read_path == ("posix-odirect" if direct_reads else "posix-buffered")
    blocks = [store.placement.table.get(k) for k in keys_of(tokens)]
    locs = [b.loc[DISK] for b in blocks]
    with store.acquire(tokens, SCOPE) as lease:
        assert lease.num_blocks == 6
        assert_lease_exact(lease)
    for loc in locs:
        seg, _, off = store.disk.files.offset(loc)
        assert _cached_pages(seg.path, off, store.disk.slot_bytes) == 0


def test_slot_allocator_reports_each_new_high_mark_once():
    """``on_new_high`` (a memory tier faults its pages in ahead of it) fires for each slot
    above every slot handed out before, whichever call hands it out, and never again for a
    slot reused below the mark."""
    seen: list[int] = []
    a = SlotAllocator(6, on_new_high=seen.append)
    assert [a.alloc(), a.alloc()] == [0, 1] and seen == [0, 1]
    a.free(0)
    assert a.alloc() == 0 and seen == [0, 1]  # reused below the mark
    a.claim(4)
    assert seen == [0, 1, 4] and a.high == 5
    assert a.alloc() == 2 and seen == [0, 1, 4]  # below the mark set by the claim
    a.set_limit(6)
    assert a.alloc_below_limit() == 3 and a.alloc() == 5 and seen == [0, 1, 4, 5]
    a.check_integrity()


def test_read_many_reads_runs_in_flight_and_fails_only_after_every_read_has_ended(tmp_path, monkeypatch):
    """read_many keeps READ_DEPTH runs in flight: every page lands in its buffer and each
    run is reported once; when one run's read fails, the error is raised only after the
    other reads have ended, so no buffer is written once the caller falls back to reading
    page by page."""
    import mmap
    import threading
    import time as _time

    from tierkv.tiers import disk as disk_mod
    from tierkv.tiers import disk_reads
    from tierkv.tiers.disk import DiskTier

    monkeypatch.setattr(disk_mod, "RUN_BYTES", 2 * SLOT)  # two slots a run: several runs
    tier = DiskTier(tmp_path / "d", LAYOUT, capacity_bytes=64 * SLOT, segment_pages=16, fsync=False)
    try:
        locs = [tier.alloc(SCOPE.model_version) for _ in range(10)]
        pages = [torch.randn(LAYOUT.shape) for _ in locs]
        tier.write_pages(list(zip(locs, pages)))
        bufs = [mmap.mmap(-1, SLOT) for _ in locs]
        reported: list[int] = []
        lock = threading.Lock()

        def on_run(run: list[int]) -> None:
            with lock:
                reported.extend(run)

        tier.read_many([(loc, memoryview(b)) for loc, b in zip(locs, bufs)], on_run)
        assert sorted(reported) == list(range(len(locs)))
        for b, page in zip(bufs, pages):
            got = torch.frombuffer(bytearray(b[:PAGE]), dtype=LAYOUT.torch_dtype).view(LAYOUT.shape)
            assert torch.equal(got, page)

        # One run fails at once; another is still reading when it does.
        real = os.preadv
        ended: list[float] = []

        def preadv(fd, bufs_, off):
            # os.preadv is patched for the whole process: a thread another test left behind
            # (a store's warm start, say) reads through it too, and must neither fail nor
            # count here. Only this tier's files are this test's.
            if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
                return real(fd, bufs_, off)
            if off == tier.files.offset(locs[0])[2]:
                raise OSError(5, "EIO")
            _time.sleep(0.05)
            n = real(fd, bufs_, off)
            ended.append(_time.monotonic())
            return n

        monkeypatch.setattr(disk_reads.os, "preadv", preadv)
        with pytest.raises(OSError):
            tier.read_many([(loc, memoryview(b)) for loc, b in zip(locs, bufs)])
        raised = _time.monotonic()
        assert ended and max(ended) <= raised
    finally:
        tier.close()


def test_a_put_copies_into_reserved_device_slots_beside_its_disk_write_and_frees_them_if_it_fails(make_store):
    """A write-through put whose device tier has room takes its device slots before the
    disk write and fills them on a helper thread meanwhile (tierkv/core/ingest.py). The pages
    read back exactly; when the disk write fails, the put leaves no slot taken and no
    block behind, and the next put (the disk degraded) still stores in memory."""
    from unittest import mock

    from tierkv.errors import DiskWriteError
    from tierkv.tiers.disk import DiskTier

    store = make_store(device_bytes=64 * PAGE, host_bytes=0, disk_bytes=64 * SLOT)
    tokens = toks(41, 24)
    pages = pages_for(tokens)
    reserved: list[list[int]] = []
    real_reserve = type(store.device).reserve

    def spy(tier, n):
        got = real_reserve(tier, n)
        reserved.append(got)
        return got

    with mock.patch.object(type(store.device), "reserve", spy):
        assert store.put(tokens, pages, SCOPE).durable
    assert reserved == [list(range(24))]
    assert list(store.lookup(tokens, SCOPE).tiers) == ["device"] * 24
    with store.acquire(tokens, SCOPE) as lease:
        assert list(lease.slots) == list(range(24)) and torch.equal(lease.pages(), pages)
    store.check_integrity()

    more = toks(42, 8)
    with mock.patch.object(DiskTier, "_write_pages", side_effect=OSError(28, "ENOSPC")):
        with pytest.raises(DiskWriteError):
            store.put(more, pages_for(more), SCOPE)
    store.check_integrity()  # the device slots the failed put reserved are free again
    assert store.device.slots.num_used == 24 and store.lookup(more, SCOPE).tokens_matched == 0
    r = store.put(more, pages_for(more), SCOPE)  # degraded disk: kept in memory
    assert r.stored == 8 and not r.durable
    with store.acquire(more, SCOPE) as lease:
        assert torch.equal(lease.pages(), pages_for(more))


def test_a_put_of_4k_pages_goes_to_disk_from_its_device_slots(tmp_path):
    """Pages of a 4 KiB multiple: the put copies them into its reserved device slots and the
    disk tier writes those slots (DiskTier.write_slots), with no staging copy; the bytes on
    disk are exact (checked after a reopen, read through and promoted)."""
    from unittest import mock

    from tierkv.tiers.disk import DiskTier

    from .kit import LAYOUT_4K

    opts = dict(layout=LAYOUT_4K, shm_dir=tmp_path / "shm", device_bytes=64 * LAYOUT_4K.page_bytes, host_bytes=0,
                disk_bytes=64 * SLOT, segment_pages=16)
    store = open_store(tmp_path / "h", **opts)
    chain = toks(43, 24)
    with mock.patch.object(DiskTier, "_staging", side_effect=AssertionError("staged")), \
            mock.patch.object(DiskTier, "write_slots", autospec=True, side_effect=DiskTier.write_slots) as spy:
        assert put_chain(store, chain).durable
    assert spy.call_count == 1 and len(spy.call_args.args[1]) == 24
    assert list(store.lookup(chain, SCOPE).tiers) == ["device"] * 24
    with store.acquire(chain, SCOPE) as lease:
        assert_lease_exact(lease)
    store.check_integrity()
    store.close()
    for promote in (False, True):  # read through into a buffer, then into the device tier
        store = open_store(tmp_path / "h", **opts)
        try:
            with store.acquire(chain, SCOPE, promote=promote) as lease:
                assert lease.num_blocks == 24 and (lease.read_through is None) == promote
                assert_lease_exact(lease)
            assert store.stats()["quarantined"] == 0
        finally:
            store.close()


def test_write_slots_refuses_buffers_that_are_not_whole_slots(tmp_path):
    from tierkv.tiers.disk import DiskTier

    tier = DiskTier(tmp_path / "d", LAYOUT, capacity_bytes=8 * SLOT, segment_pages=8, fsync=False)
    try:
        loc = tier.alloc(SCOPE.model_version)
        with pytest.raises(ValueError, match="whole slots"):
            tier.write_slots([(loc, memoryview(bytearray(PAGE)))], lambda positions: None)
    finally:
        tier.close()


def test_a_small_read_batch_is_two_requests_in_flight(tmp_path, monkeypatch):
    """A batch smaller than two full runs (a restore window) is cut in READ_DEPTH runs of
    equal size, so that it is READ_DEPTH requests in flight, not one."""
    import tierkv.tiers.disk_reads as disk_reads
    from tierkv.tiers.diskio import BounceBuffer

    store = open_store(tmp_path / "h", shm_dir=tmp_path / "shm", device_bytes=8 * PAGE, host_bytes=0,
                       disk_bytes=64 * SLOT, segment_pages=16)
    try:
        chain = toks(77, 5)
        put_chain(store, chain)
        with store.placement.lock:
            locs = [store.placement.table.get(k).loc[TierName.DISK] for k in keys_of(chain)]
        sizes: list[int] = []
        real = os.preadv
        monkeypatch.setattr(disk_reads.os, "preadv", lambda fd, bufs, off: sizes.append(len(bufs)) or real(fd, bufs, off))
        buf = BounceBuffer(5 * SLOT)
        mm = memoryview(buf.mm)
        store.disk.read_many([(loc, mm[i * SLOT : (i + 1) * SLOT]) for i, loc in enumerate(locs)])
        assert sorted(sizes) == [2, 3]  # 5 consecutive slots: 3 + 2, not one request of 5
        for i, key in enumerate(keys_of(chain)):
            got = buf.tensor[i * SLOT : i * SLOT + PAGE].view(LAYOUT.torch_dtype).view(LAYOUT.shape)
            assert torch.equal(got, page_for(key))
    finally:
        store.close()
