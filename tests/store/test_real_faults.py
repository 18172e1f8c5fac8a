"""Real faults, injected by the kernel (tests/helpers/mounts.py), not by mocks: a device that
returns EIO under the segments and heals, an index on a file system forced read-only, a full
index file system, a full segments file system, a short pwrite, a reader table exhausted by
killed readers. Each test says which row of docs/operations.md ("What we survive") it proves.

Skipped only when not root or when the kernel lacks loop devices; as root (CI) they run."""
from __future__ import annotations

import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import pytest

from helpers.mounts import fault_skip_reason, loop_ext4, tmpfs
from tierkv.errors import DiskWriteError, IndexNoSpaceError, IndexWriteError
from tierkv.index import Index

from .kit import (LAYOUT, LAYOUT_4K, PAGE, SCOPE, SLOT, assert_lease_exact, keys_of, open_store, put_chain,
                  slot_offset, tier_counts, toks)

pytestmark = pytest.mark.skipif(fault_skip_reason() is not None, reason=str(fault_skip_reason()))


def _open(home: Path, tmp_path: Path, **kw):
    return open_store(home, shm_dir=tmp_path / "shm", **kw)


# Both write paths of a durable put (tierkv/core/ingest.py): 1 KiB pages copied into staging
# buffers, and 4 KiB pages written from the device slots the put copied them into.
WRITE_PATHS = pytest.mark.parametrize("layout", [LAYOUT, LAYOUT_4K], ids=["staged", "from-device-slots"])


def _writes_from_slots(store) -> bool:
    """Whether a put with room in the device tier writes from its device slots."""
    return store.layout.page_bytes == store.disk.slot_bytes and store.device.direct_target(0) is not None


def _exact(store, chain: list[int]) -> int:
    """Acquire the whole chain; every leased page byte-exact. Returns the blocks leased."""
    with store.acquire(chain, SCOPE) as lease:
        assert lease.keys == tuple(keys_of(chain)[: lease.num_blocks])
        assert_lease_exact(lease)
        return lease.num_blocks


def _in_thread(fn, timeout: float = 60):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} hung for {timeout} s"
    assert out, f"{fn} raised (see the thread's traceback above)"
    return out[0]


def _settled(store) -> None:
    """Nothing leased, busy or being promoted; every count back to zero."""
    with store.placement.lock:
        assert store.promotion.reads_in_flight() == 0
        for b in store.placement.table.blocks.values():
            assert b.leases == 0 and b.busy == 0, f"block {b.key.hex()[:12]}: leases {b.leases}, busy {b.busy}"
    store.check_integrity()


# ---- a device that fails under the segments ---------------------------------------------------

@pytest.mark.parametrize("direct_reads", [True, False], ids=["odirect", "buffered"])
def test_read_eio_is_a_miss_never_a_deletion(tmp_path, direct_reads):
    """EIO while promoting or verifying: a miss, the tier read-degraded, nothing quarantined;
    once the device answers every acknowledged block is served again, byte-identical, also
    after a reopen. (Before: 176 of 608 healthy blocks were deleted by such a fault.) Both
    read paths: buffered reads drop what they read from the page cache, so the device
    answers them too."""
    home = tmp_path / "home"
    chains = [toks(1000 + i, 4) for i in range(8)]
    with loop_ext4(tmp_path / "seg.img", home / "segments") as fs:
        store = _open(home, tmp_path, device_bytes=4 * PAGE, host_bytes=0, disk_bytes=64 * SLOT, segment_pages=8,
                      direct_reads=direct_reads)
        try:
            for c in chains:
                assert put_chain(store, c).durable
            assert store.disk.read_path == ("posix-odirect" if direct_reads else "posix-buffered")
            fs.fail()
            leased = [_exact(store, c) for c in chains]
            assert sum(leased) < 4 * len(chains)  # disk-only blocks missed
            v = store.verify(repair=True)
            assert v.corrupt == () and len(v.unreadable) > 0
            st = store.stats()
            assert st["quarantined"] == 0
            assert st["tiers"]["disk"]["read_degraded"] == "EIO" and st["tiers"]["disk"]["read_errors"] > 0
            assert all(store.lookup(c, SCOPE).num_blocks == 4 for c in chains)  # still stored
            assert store.index.quarantined() == {}
            _settled(store)
            fs.heal()
            for c in chains:
                assert _exact(store, c) == 4
            assert store.stats()["tiers"]["disk"]["read_degraded"] is None
            v = store.verify()
            assert v.corrupt == () and v.unreadable == () and v.checked == 32
            _settled(store)
        finally:
            store.close()
        store = _open(home, tmp_path, device_bytes=4 * PAGE, host_bytes=0, disk_bytes=64 * SLOT, segment_pages=8)
        try:
            assert store.stats()["quarantined"] == 0
            for c in chains:
                assert _exact(store, c) == 4
            store.check_integrity()
        finally:
            store.close()


def test_read_through_eio_is_a_miss_never_a_deletion(tmp_path):
    """The same for a read into a lease's own buffer (acquire(promote=False), as a restore
    reads a cold prefix: tierkv/core/read_through.py): a miss, nothing quarantined, every block
    served byte-identical once the device answers."""
    home = tmp_path / "home"
    chains = [toks(1100 + i, 4) for i in range(4)]
    opts = dict(device_bytes=4 * PAGE, host_bytes=0, disk_bytes=64 * SLOT, segment_pages=8)
    with loop_ext4(tmp_path / "seg.img", home / "segments") as fs:
        store = _open(home, tmp_path, **opts)
        for c in chains:
            assert put_chain(store, c).durable
        store.close()
        store = _open(home, tmp_path, **opts)  # every block on disk only
        try:
            fs.fail()
            for c in chains:
                with store.acquire(c, SCOPE, promote=False) as lease:
                    assert lease.num_blocks == 0
            st = store.stats()
            assert st["quarantined"] == 0 and st["read_through_bytes"] == 0
            assert st["tiers"]["disk"]["read_degraded"] == "EIO"
            assert all(store.lookup(c, SCOPE).num_blocks == 4 for c in chains)  # still stored
            _settled(store)
            fs.heal()
            for c in chains:
                with store.acquire(c, SCOPE, promote=False) as lease:
                    assert lease.read_through is not None and lease.num_blocks == 4
                    assert_lease_exact(lease)
            assert store.stats()["tiers"]["disk"]["read_degraded"] is None
            _settled(store)
        finally:
            store.close()


@WRITE_PATHS
def test_write_eio_fails_the_put_cleanly(tmp_path, layout):
    """EIO on the segment write: DiskWriteError, the tier degraded, the put stored nothing
    durable, existing blocks intact; after the back-off the disk is used again."""
    home = tmp_path / "home"
    old = toks(1100, 3)
    opts = dict(layout=layout, device_bytes=16 * layout.page_bytes, disk_bytes=64 * SLOT, segment_pages=16)
    with loop_ext4(tmp_path / "seg.img", home / "segments") as fs:
        store = _open(home, tmp_path, **opts)
        try:
            assert _writes_from_slots(store) == (layout is LAYOUT_4K)
            put_chain(store, old)  # the segment exists with free slots: no file is created while failed
            fresh = toks(1101, 2)
            fs.fail()
            with pytest.raises(DiskWriteError):
                put_chain(store, fresh)
            # The errno is the kernel's: EIO, or ENOMEM from ext4's O_DIRECT path on 6.18.
            assert store.stats()["tiers"]["disk"]["degraded"] in ("EIO", "ENOMEM")
            assert store.index.get_block(keys_of(fresh)[0]) is None
            store.check_integrity()
            assert _exact(store, old) == 3  # served from memory meanwhile
            fs.heal()
            store.disk._degraded_until = 0.0  # skip the 30 s back-off
            assert put_chain(store, fresh).durable
        finally:
            store.close()
        store = _open(home, tmp_path, **opts)
        try:
            assert _exact(store, old) == 3 and _exact(store, fresh) == 2
        finally:
            store.close()


# ---- the index refuses writes during a read -------------------------------------------------------

def test_read_only_index_during_quarantine_never_hangs(tmp_path):
    """A bad page must be quarantined, but the index file system is read-only (ext4 forced it
    after an error): acquire returns a shorter lease instead of raising, and the next acquire
    of the chain returns too (before: the promotion events were never set and it waited
    forever); no lease, busy count or promotion is left behind."""
    home = tmp_path / "home"
    chain = toks(1200, 3)
    with loop_ext4(tmp_path / "idx.img", home / "index", journal=True, errors="remount-ro") as fs:
        store = _open(home, tmp_path)
        try:
            put_chain(store, chain)
            path, off = slot_offset(store, keys_of(chain)[1])
            for i in range(3):
                put_chain(store, toks(1201 + i, 4))  # the chain is on disk only now
            assert store.lookup(chain, SCOPE).tiers == ("disk", "disk", "disk")
            with open(path, "r+b") as f:  # block 1's page is bad
                f.seek(off + 5)
                b = f.read(1)
                f.seek(off + 5)
                f.write(bytes([b[0] ^ 0xFF]))
            fs.force_read_only()
            with pytest.raises(IndexWriteError):
                store.save_manifest("x", {"a": 1})  # the fault is real: the index refuses writes
            for _ in range(3):
                assert _in_thread(lambda: _exact(store, chain), 30) == 1
            st = store.stats()
            assert st["quarantine_failed"] >= 1 and st["quarantined"] == 0
            _settled(store)
        finally:
            store.close()  # releases the lock even though the index is read-only
        fs.remount()  # the file system is writable again
        store = _open(home, tmp_path)
        try:
            assert _exact(store, chain) == 1  # now the bad page is quarantined for good
            assert store.stats()["quarantined"] == 1
            assert keys_of(chain)[1].hex() in store.index.quarantined()
            _settled(store)
        finally:
            store.close()


def test_read_only_index_at_close_loses_only_the_warm_start_record(tmp_path, caplog):
    """A store that warms records its device tier at close; on an index file system forced
    read-only that write fails: close still releases everything (a warning, no raise), and
    the next open, with no record, warms the newest blocks instead."""
    home = tmp_path / "home"
    chain = toks(1210, 3)
    with loop_ext4(tmp_path / "idx.img", home / "index", journal=True, errors="remount-ro") as fs:
        store = _open(home, tmp_path, warm_at_open=True)
        try:
            put_chain(store, chain)
            fs.force_read_only()
        finally:
            _in_thread(store.close, 30)
        assert any("warm-start record was not written" in r.message for r in caplog.records)
        fs.remount()
        store = _open(home, tmp_path, warm_at_open=True)
        try:
            assert store.warm_start.wait(30)
            st = store.warm_start.stats()
            assert st["source"] == "newest" and st["warmed_blocks"] == 3
            assert _exact(store, chain) == 3
            _settled(store)
        finally:
            store.close()


# ---- full file systems -------------------------------------------------------------------------

def _fill_until(fn, limit: int = 400) -> int:
    for i in range(limit):
        try:
            fn(i)
        except IndexNoSpaceError:
            return i
    raise AssertionError("the index never filled up")


def test_full_index_file_system_write_back(tmp_path):
    """Index on a tiny tmpfs, write_through=False: evictions write back until the index file
    system is full; then write-back fails cleanly (the slot is given back, the block dropped:
    it was never acknowledged as durable), puts keep working, no slot leaks, check_integrity
    holds, and close() releases the home lock and the shared memory although its final
    write-back fails."""
    home = tmp_path / "home"
    shm = tmp_path / "shm"
    with tmpfs(home / "index", 96 << 10):
        store = _open(home, tmp_path, write_through=False, device_bytes=4 * PAGE, host_bytes=4 * SLOT,
                      disk_bytes=1024 * SLOT, segment_pages=64)
        try:
            for i in range(120):
                put_chain(store, toks(1300 + i, 4))  # never raises: write-back is best effort
            store.check_integrity()  # includes: disk slots used == blocks indexed (no leak)
            assert store.disk.num_used == store.index.count_blocks() > 0
            assert tier_counts(store)["disk"] < 120 * 4 - 8  # the index filled up: blocks were dropped
            assert store.stats()["tiers"]["disk"]["degraded"] is None  # the segments are fine
        finally:
            store.close()  # memory-only blocks cannot be indexed: logged and counted, not raised
        assert list(shm.iterdir()) == []
        store = _open(home, tmp_path, write_through=False)  # the lock was released
        try:
            store.check_integrity()
        finally:
            store.close()


def test_full_index_file_system_fails_put_with_a_typed_error(tmp_path):
    """write_through=True: the put whose commit finds the index file system full raises
    IndexNoSpaceError (an IndexWriteError with a hint), and rolls back: no slot, no block."""
    home = tmp_path / "home"
    with tmpfs(home / "index", 96 << 10):
        store = _open(home, tmp_path, disk_bytes=2048 * SLOT, segment_pages=64, host_bytes=0)
        try:
            n = _fill_until(lambda i: put_chain(store, toks(1400 + i, 4)))
            assert n > 0
            with pytest.raises(IndexNoSpaceError) as info:
                put_chain(store, toks(1400 + n, 4))
            assert "free space" in str(info.value)
            store.check_integrity()
            assert store.disk.num_used == store.index.count_blocks() == 4 * n
            assert store.lookup(toks(1400 + n, 4), SCOPE).num_blocks == 0
            assert _exact(store, toks(1400, 4)) == 4  # what was stored is served
        finally:
            store.close()


def test_segments_file_system_full(tmp_path):
    """ENOSPC on the segments' file system: the put fails cleanly (DiskWriteError, tier
    degraded), existing blocks stay byte-exact, later puts keep to memory until it clears."""
    home = tmp_path / "home"
    with tmpfs(home / "segments", 64 << 10):
        store = _open(home, tmp_path, disk_bytes=256 * SLOT, segment_pages=4)
        try:
            stored = []
            with pytest.raises(DiskWriteError):
                for i in range(64):
                    c = toks(1500 + i, 4)
                    put_chain(store, c)
                    stored.append(c)
            assert stored, "the file system held no segment at all"
            assert store.stats()["tiers"]["disk"]["degraded"] == "ENOSPC"
            store.check_integrity()
            r = put_chain(store, toks(1599, 2))
            assert r.stored == 2 and not r.durable
            for c in stored:
                assert store.index.get_block(keys_of(c)[-1]) is not None
        finally:
            store.close()
        store = _open(home, tmp_path, disk_bytes=256 * SLOT, segment_pages=4)
        try:
            for c in stored:
                assert store.lookup(c, SCOPE).num_blocks == 4
            assert _exact(store, stored[0]) == 4
        finally:
            store.close()


@WRITE_PATHS
def test_short_pwrite_fails_the_put(tmp_path, layout):
    """A real short write: RLIMIT_FSIZE inside the segment makes the kernel write only part of
    a run (generic_write_check_limits). DiskWriteError, nothing of the put indexed, the
    device slots the put took free again."""
    home = tmp_path / "home"
    store = _open(home, tmp_path, layout=layout, device_bytes=16 * layout.page_bytes, disk_bytes=64 * SLOT,
                  segment_pages=16, host_bytes=0)
    assert _writes_from_slots(store) == (layout is LAYOUT_4K)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        first = toks(1600, 1)
        put_chain(store, first)  # slot 0 of the segment
        path, off = slot_offset(store, keys_of(first)[0])
        chain = toks(1601, 4)  # slots 1-4: one run, one pwrite of 4 slots
        resource.setrlimit(resource.RLIMIT_FSIZE, (off + 3 * SLOT, limits[1]))
        try:
            with pytest.raises(DiskWriteError) as info:
                put_chain(store, chain)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        assert "short write" in str(info.value.__cause__)
        assert store.index.get_block(keys_of(chain)[0]) is None
        assert store.device.slots.num_used == 1  # the first chain's block only
        store.check_integrity()
        store.disk._degraded_until = 0.0
        assert put_chain(store, chain).durable
        assert _exact(store, chain) == 4
    finally:
        signal.signal(signal.SIGXFSZ, old_handler)
        store.close()


# ---- LMDB's reader table ------------------------------------------------------------------------

_READER = ("import lmdb, sys, time\n"
           "env = lmdb.open(sys.argv[1], max_dbs=8, subdir=True)\n"
           "txn = env.begin()\n"
           "print('READING', flush=True)\n"
           "time.sleep(120)\n")


def _killed_readers(path: Path, n: int) -> int:
    """Start ``n`` processes that each hold a read transaction of the index, then SIGKILL
    them: their reader slots stay taken. Returns how many got a slot."""
    procs = [subprocess.Popen([sys.executable, "-c", _READER, str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(n)]
    got = 0
    try:
        for p in procs:
            got += p.stdout.readline().strip() == "READING"
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
    return got


def test_reader_table_exhausted_by_killed_readers(tmp_path):
    """Killed readers fill every slot (small max_readers): the next read clears them with
    reader_check() and retries, instead of failing for good."""
    index = Index(tmp_path / "index", 1 << 20, max_readers=4)
    try:
        index.put_meta("x", "1")
        got = _killed_readers(tmp_path / "index", 4)
        assert got >= 3  # (this process may keep one slot of its own)
        with pytest.raises(lmdb.ReadersFullError):
            index.env.begin()  # the table really is full of dead readers
        before = index.stale_readers_cleared
        assert index.get_meta("x") == "1"
        assert index.stale_readers_cleared - before == got
    finally:
        index.close()


def test_reader_check_runs_periodically(tmp_path, monkeypatch):
    """While the store is used, reader slots of killed processes are cleared every
    READER_CHECK_S (here: at once), not only at open."""
    import tierkv.index as index_mod

    home = tmp_path / "home"
    store = _open(home, tmp_path)
    try:
        put_chain(store, toks(1700, 1))
        before = store.stats()["stale_readers_cleared"]
        assert _killed_readers(home / "index", 2) == 2
        monkeypatch.setattr(index_mod, "READER_CHECK_S", 0.0)
        put_chain(store, toks(1701, 1))
        assert store.stats()["stale_readers_cleared"] - before == 2
        assert "no active readers" in store.index.env.readers()  # nothing of the dead is left
    finally:
        store.close()
