"""Injected faults: ENOSPC and EIO on the disk tier, a full LMDB map, a second opener, fork,
bad configuration and layout mismatches."""
from __future__ import annotations

import errno
import os
import subprocess
from unittest import mock

import pytest

import tierkv
from tierkv import PageLayout, faults
from tierkv.errors import (DiskWriteError, ForkedStoreError, IndexFullError, LayoutMismatchError, LeaseError,
                           NotFoundError, StoreLockedError)
from tierkv.tiers import disk as disk_mod

from .kit import (PAGE, SCOPE, SLOT, assert_lease_exact, keys_of, open_store, put_chain, segment_files,
                  tier_counts, toks)


def _fail(err: int):
    def raiser(*a, **kw):
        raise OSError(err, os.strerror(err))

    return raiser


def _recover(store) -> None:
    store.disk._degraded_until = 0.0  # skip the 30 s back-off


@pytest.mark.parametrize("target,err,reason", [
    ("pwritev", errno.ENOSPC, "ENOSPC"),
    ("fdatasync", errno.EIO, "EIO"),
])
def test_disk_write_fault_fails_put_cleanly(make_store, home, target, err, reason):
    store = make_store()
    old = toks(400, 3)
    put_chain(store, old)
    fresh = toks(401, 2)
    with mock.patch.object(disk_mod.os, target, _fail(err)):
        with pytest.raises(DiskWriteError) as info:
            put_chain(store, fresh)
    assert "degraded" in str(info.value)
    st = store.stats()
    assert st["tiers"]["disk"]["degraded"] == reason
    store.check_integrity()
    # Existing data intact and served; the failed put stored nothing.
    with store.acquire(old, SCOPE) as lease:
        assert lease.num_blocks == 3
        assert_lease_exact(lease)
    assert store.lookup(fresh, SCOPE).num_blocks == 0
    # While degraded, puts keep to memory and say so.
    r = put_chain(store, fresh)
    assert r.stored == 2 and not r.durable
    with store.acquire(fresh, SCOPE) as lease:
        assert_lease_exact(lease)
    assert store.index.get_block(keys_of(fresh)[0]) is None
    # After the back-off the disk is tried again.
    _recover(store)
    more = toks(402, 2)
    assert put_chain(store, more).durable
    assert store.stats()["tiers"]["disk"]["degraded"] is None
    store.close()
    store = make_store()
    assert store.lookup(old, SCOPE).num_blocks == 3
    assert store.lookup(more, SCOPE).num_blocks == 2
    assert store.lookup(fresh, SCOPE).num_blocks == 0  # never acknowledged as durable


def test_fsync_failure_is_never_retried_into_success(make_store, home):
    store = make_store()
    chain = toks(403, 1)
    calls = []

    def flaky(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "EIO")
        return os.fsync(fd)

    with mock.patch.object(disk_mod.os, "fdatasync", flaky):
        with pytest.raises(DiskWriteError):
            put_chain(store, chain)
    assert len(calls) == 1  # no retry that could falsely report success
    assert store.index.get_block(keys_of(chain)[0]) is None


def test_enospc_creating_a_segment_does_not_wedge_the_keys(make_store):
    # Regression: a DiskWriteError while creating a segment (inside the store lock) left the
    # put's keys marked "being written", so every later put of them was silently skipped.
    store = make_store()
    chain = toks(404, 2)
    with mock.patch("tierkv.tiers.segments.os.posix_fallocate", _fail(errno.ENOSPC)):
        with pytest.raises(DiskWriteError):
            put_chain(store, chain)
    store.check_integrity()
    assert segment_files(store.config.home) == []
    _recover(store)
    r = put_chain(store, chain)
    assert r.stored == 2 and r.durable


def test_write_back_failure_keeps_serving(make_store):
    store = make_store(write_through=False)
    chains = [toks(405 + i, 4) for i in range(2)]
    put_chain(store, chains[0])
    with mock.patch.object(disk_mod.os, "pwritev", _fail(errno.ENOSPC)):
        put_chain(store, chains[1])
        put_chain(store, toks(407, 4))  # host eviction: write-back fails, block dropped, no raise
    assert store.stats()["tiers"]["disk"]["degraded"] == "ENOSPC"
    store.check_integrity()
    assert store.lookup(toks(407, 4), SCOPE).num_blocks == 4


def test_index_failure_during_put_rolls_back(make_store):
    store = make_store()
    chain = toks(408, 2)
    with mock.patch.object(type(store.index), "put_blocks", side_effect=IndexFullError("full")):
        with pytest.raises(IndexFullError):
            put_chain(store, chain)
    store.check_integrity()
    assert tier_counts(store)["disk"] == 0
    assert put_chain(store, chain).durable


def test_lmdb_map_full_resizes_once_then_index_full(make_store):
    store = make_store(index_map_bytes=1 << 20)
    big = {"blob": "x" * (300 << 10)}
    saved = 0
    with pytest.raises(IndexFullError) as info:
        for i in range(40):
            store.save_manifest(f"m{i}", big)
            saved += 1
    assert "index_map_bytes" in str(info.value)
    assert store.stats()["index_resizes"] == 1
    assert 3 <= saved < 40
    # The store keeps working: reads, deletes, and writes once there is room again.
    assert store.get_manifest("m0") == big
    for i in range(saved):
        assert store.delete_manifest(f"m{i}")
    chain = toks(409, 2)
    assert put_chain(store, chain).durable
    assert store.lookup(chain, SCOPE).num_blocks == 2


@pytest.mark.slow
def test_second_opener_in_another_process_is_refused(make_store, home, child_cmd):
    holder = subprocess.Popen(child_cmd("hold", home), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline().split()
        assert line[0] == "READY", line
        pid = int(line[1])
        with pytest.raises(StoreLockedError) as info:
            open_store(home)
        assert str(pid) in str(info.value)
        holder.kill()  # SIGKILL: the kernel drops the flock with the process
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    store = make_store()
    store.check_integrity()


def test_second_opener_in_same_process_is_refused(make_store, home):
    make_store()
    with pytest.raises(StoreLockedError) as info:
        open_store(home)
    assert str(os.getpid()) in str(info.value)


def test_use_after_fork_fails_in_the_child(make_store):
    store = make_store()
    chain = toks(410, 2)
    put_chain(store, chain)
    pid = os.fork()
    if pid == 0:  # the child: every data-path call must refuse, nothing may touch LMDB
        code = 0
        for call in (lambda: store.lookup(chain, SCOPE), lambda: store.acquire(chain, SCOPE),
                     lambda: put_chain(store, toks(411, 1)), lambda: store.invalidate(namespace="default"),
                     lambda: store.verify()):
            try:
                call()
                code = 1
            except ForkedStoreError:
                pass
            except BaseException:
                code = 2
        store.close()  # a no-op in the child
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.lookup(chain, SCOPE).num_blocks == 2
    assert put_chain(store, toks(411, 1)).durable
    store.check_integrity()


@pytest.mark.parametrize("opts", [
    dict(device_bytes=PAGE - 1), dict(device_bytes=0), dict(host_bytes=SLOT - 1), dict(disk_bytes=100),
    dict(disk_bytes=-1), dict(segment_pages=0), dict(verify_on_open="sometimes"), dict(index_map_bytes=1000),
    dict(device="tpu"),
])
def test_bad_config_raises_value_error(tmp_path, opts):
    with pytest.raises(ValueError):
        open_store(tmp_path / "h", **opts)
    assert not (tmp_path / "h" / "LOCK").exists() or open_store(tmp_path / "h").close() is None


@pytest.mark.parametrize("other", [
    PageLayout(2, 2, 8, block_size=8), PageLayout(2, 2, 8, 4, dtype="float16"), PageLayout(3, 2, 8, 4),
    PageLayout(2, 2, 16, 4),
])
def test_layout_mismatch_on_reopen(make_store, home, tmp_path, other):
    store = make_store()
    put_chain(store, toks(412, 1))
    store.close()
    shm = tmp_path / "shm"
    before = set(shm.iterdir())
    with pytest.raises(LayoutMismatchError):
        tierkv.open(home, other, device="cpu", device_bytes=1 << 16, host_bytes=1 << 16, disk_bytes=1 << 20,
                    shm_dir=shm)
    assert set(shm.iterdir()) == before  # nothing left behind in shared memory
    # Regression: the failed open left the LMDB environment open, so the next open in this
    # process shared (and broke) its locks.
    store = make_store()
    assert store.lookup(toks(412, 1), SCOPE).num_blocks == 1


def test_foreign_segment_layout_is_quarantined(make_store, home, tmp_path):
    # Issue 11 item 5: a segment of another layout (damaged or foreign) is moved aside and
    # counted; the rest of the home opens (it used to make the whole home unopenable).
    from tierkv.tiers.segments import SegmentHeader, create_segment

    store = make_store()
    put_chain(store, toks(414, 2))
    store.close()
    create_segment(home / "segments" / "seg-000009.safetensors", SegmentHeader(PageLayout(2, 2, 8, 8), "00" * 32, 2))
    store = make_store()
    assert store.stats()["tiers"]["disk"]["quarantined_segments"] == 1
    assert (home / "segments" / "seg-000009.safetensors.bad").exists()
    assert store.lookup(toks(414, 2), SCOPE).num_blocks == 2


def test_closed_store_and_lease_misuse(make_store, tmp_path):
    store = make_store()
    chain = toks(413, 2)
    put_chain(store, chain)
    lease = store.acquire(chain, SCOPE)
    lease.release()
    lease.release()  # Lease.release is idempotent
    with pytest.raises(LeaseError):
        store.release(lease)
    with pytest.raises(LeaseError):
        lease.pages()
    other = make_store(tmp_path / "other")
    lease = store.acquire(chain, SCOPE)
    with pytest.raises(LeaseError):
        other.release(lease)
    lease.release()
    store.close()
    with pytest.raises(NotFoundError):
        store.lookup(chain, SCOPE)
    with pytest.raises(NotFoundError):
        put_chain(store, chain)
    store.close()  # idempotent


def test_memory_only_blocks_become_durable_with_a_later_put(make_store, home):
    store = make_store()
    head = toks(420, 2)
    with mock.patch.object(disk_mod.os, "fdatasync", _fail(errno.EIO)):
        with pytest.raises(DiskWriteError):
            put_chain(store, head)
    assert not put_chain(store, head).durable  # degraded: kept in memory only
    _recover(store)
    longer = head + toks(421, 2)
    r = put_chain(store, longer)
    assert r.stored == 2 and r.skipped == 2 and r.durable  # the head went to disk first
    store.close()
    store = make_store()
    assert store.lookup(longer, SCOPE).num_blocks == 4


@pytest.mark.slow
def test_stale_lmdb_reader_of_a_killed_process_is_cleared(make_store, home):
    import signal
    import sys

    make_store().close()
    reader = subprocess.Popen(
        [sys.executable, "-c",
         "import lmdb, sys, time\n"
         "env = lmdb.open(sys.argv[1], max_dbs=8, subdir=True)\n"
         "txn = env.begin()\n"
         "print('READING', flush=True)\n"
         "time.sleep(60)\n", str(home / "index")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "READING"
        dead = reader.pid
    finally:
        reader.send_signal(signal.SIGKILL)
        reader.wait(timeout=30)
    store = make_store()
    # The first opener resets LMDB's reader table, and reader_check() clears any slot of a
    # dead process left while others had the index open: either way the slot is gone.
    assert str(dead) not in store.index.env.readers()
    assert store.stats()["stale_readers_cleared"] >= 0
    assert put_chain(store, toks(422, 1)).durable


def test_failure_while_making_room_in_acquire_leaves_nothing_leased(make_store):
    store = make_store()
    chain = toks(430, 3)
    put_chain(store, chain)
    for i in range(3):
        put_chain(store, toks(431 + i, 4))  # the chain is on disk only now
    evictions = []

    def failing() -> None:
        evictions.append(1)
        if len(evictions) == 2:  # from the host, making room for the first device eviction's demotion
            raise IndexFullError("index full while evicting")

    with faults.armed("placement.evict:before", failing):
        with pytest.raises(IndexFullError):
            store.acquire(chain, SCOPE)
    assert len(evictions) == 2
    store.check_integrity()
    assert store.stats()["leased_blocks"] == 0 and store.promotion.reads_in_flight() == 0
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 3
        assert_lease_exact(lease)


def test_write_back_survives_a_full_index(make_store):
    store = make_store(write_through=False, host_bytes=0, disk_bytes=4 * SLOT, segment_pages=4)
    for i in range(3):
        put_chain(store, toks(440 + i, 4))  # fills device and disk
    with mock.patch.object(type(store.index), "delete_blocks", side_effect=IndexFullError("full")):
        r = put_chain(store, toks(443, 2))  # evictions need index deletes: blocks are dropped instead
    assert r.stored == 2
    store.check_integrity()


def test_io_error_checking_a_segment_at_open_deletes_nothing(make_store, home, tmp_path):
    # Supplement to tests/store/test_real_faults.py: an EIO while checking a segment at open
    # must fail the open (DiskReadError), not quarantine the segment's records.
    from pathlib import Path

    from tierkv.errors import DiskReadError

    store = make_store()
    chain = toks(450, 3)
    put_chain(store, chain)
    store.close()
    real_stat = Path.stat

    def failing_stat(self, *a, **kw):
        if self.name.startswith("seg-"):
            raise OSError(errno.EIO, "EIO")
        return real_stat(self, *a, **kw)

    with mock.patch.object(Path, "stat", failing_stat):
        with pytest.raises(DiskReadError):
            open_store(home, shm_dir=tmp_path / "shm")
    store = make_store()  # the lock and the shared memory were released
    assert store.stats()["quarantined"] == 0
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 3
        assert_lease_exact(lease)


def test_fault_points_bracket_each_eviction_and_demotion(make_store):
    """The crash tests kill the process at these points (tests/store/child.py): each step
    passes its :before and its :after once per call, compiled or not."""
    store = make_store(write_through=False)
    hits = {name: 0 for name in faults.POINTS}

    def counter(name: str):
        def count() -> None:
            hits[name] += 1
        return count

    for name in faults.POINTS:
        faults.arm(name, counter(name))
    try:
        for i in range(6):
            put_chain(store, toks(450 + i, 4))  # more than the memory tiers hold
    finally:
        for name in faults.POINTS:
            faults.disarm(name)
    for step in ("evict", "demote", "write_back"):
        assert hits[f"placement.{step}:before"] == hits[f"placement.{step}:after"] > 0, (step, hits)
