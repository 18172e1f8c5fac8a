"""Read-through (tierkv/core/read_through.py): ``acquire(..., promote=False)`` of a window that is
on disk only reads it into a buffer of the lease, never into the device tier, the first time;
the second time it promotes. Every page is verified; a bad page is quarantined and ends the
lease; the blocks stay leased (not evictable) until release; buffers are reused and bounded.
The real EIO case is in test_real_faults.py."""
from __future__ import annotations

import errno

import pytest
import torch

from tierkv.errors import LeaseError
from tierkv.layout import kv_buffer, kv_layers, split_layers, unpack_into, unpack_pages
from tierkv.core.read_through import KEEP_BUFFERS, POOL, release_buffers

from .kit import (LAYOUT, PAGE, SCOPE, SLOT, assert_lease_exact, keys_of, pages_for, put_chain, slot_offset, tier_keys,
                  toks)

DISK_ONLY = dict(device_bytes=8 * PAGE, host_bytes=0, disk_bytes=64 * SLOT, segment_pages=16)


@pytest.fixture(autouse=True)
def empty_pool():
    """The pool of free buffers is the process's: each test starts and ends with it empty."""
    release_buffers()
    yield
    release_buffers()


def _cold(make_store, chain, **opts):
    """A store whose only copy of ``chain`` is on disk (put, closed, reopened)."""
    store = make_store(**{**DISK_ONLY, **opts})
    assert put_chain(store, chain).durable
    store.close()
    return make_store(**{**DISK_ONLY, **opts})


def test_first_read_is_read_through_second_promotes(make_store):
    chain = toks(1, 4)
    store = _cold(make_store, chain)
    keys = set(keys_of(chain))
    with store.acquire(chain, SCOPE, promote=False) as lease:
        assert lease.num_blocks == 4 and lease.read_through is not None
        assert lease.keys == tuple(keys_of(chain))
        assert_lease_exact(lease)
        assert not keys & tier_keys(store)["device"]  # nothing was promoted
        with store.placement.lock:  # leased while held: nothing may evict or free them
            assert all(store.placement.table.get(k).leases == 1 for k in keys)
        store.check_integrity()
    st = store.stats()
    assert st["read_through_bytes"] == 4 * LAYOUT.page_bytes and st["promoted_bytes"] == 0
    assert st["acquire_hits"]["disk"] == 4
    with store.placement.lock:
        assert all(store.placement.table.get(k).leases == 0 for k in keys)
    # The same blocks again: now worth their place in memory.
    with store.acquire(chain, SCOPE, promote=False) as lease:
        assert lease.read_through is None and lease.num_blocks == 4
        assert_lease_exact(lease)
    assert keys <= tier_keys(store)["device"]
    assert store.stats()["read_through_bytes"] == 4 * LAYOUT.page_bytes


def test_promote_default_and_resident_blocks_never_read_through(make_store):
    chain = toks(2, 4)
    store = _cold(make_store, chain)
    with store.acquire(chain[: 2 * LAYOUT.block_size], SCOPE) as lease:  # default: promotes
        assert lease.read_through is None
    # Blocks 0-1 are in the device tier now: a window with them is promoted as a whole.
    with store.acquire(chain, SCOPE, promote=False) as lease:
        assert lease.read_through is None and lease.num_blocks == 4
        assert_lease_exact(lease)
    assert set(keys_of(chain)) <= tier_keys(store)["device"]


def test_windows_read_through_one_after_another(make_store):
    """As a restore reads them: windows of a long prefix, each its own buffer."""
    chain = toks(3, 8)
    store = _cold(make_store, chain)
    leases = [store.acquire(chain[: (w + 2) * LAYOUT.block_size], SCOPE, max_blocks=2, start_block=w, promote=False)
              for w in range(0, 8, 2)]
    try:
        for w, lease in zip(range(0, 8, 2), leases):
            assert lease.read_through is not None and lease.start_block == w
            assert lease.keys == tuple(keys_of(chain)[w : w + 2])
            assert_lease_exact(lease)
    finally:
        for lease in leases:
            lease.release()
    store.check_integrity()
    assert len(POOL) == KEEP_BUFFERS  # four windows' buffers, kept for reuse


def test_bad_page_ends_the_lease_and_is_quarantined(make_store):
    chain = toks(4, 4)
    store = make_store(**DISK_ONLY)
    put_chain(store, chain)
    path, off = slot_offset(store, keys_of(chain)[2])
    store.close()
    with open(path, "r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 0x20]))
    store = make_store(**DISK_ONLY)
    with store.acquire(chain, SCOPE, promote=False) as lease:
        assert lease.num_blocks == 2  # block 2 failed its checksum: the lease ends before it
        assert_lease_exact(lease)
    st = store.stats()
    assert st["quarantined"] == 1 and st["acquire_hits"]["disk"] == 2
    assert store.lookup(chain, SCOPE).num_blocks == 2
    with store.placement.lock:
        assert all(b.leases == 0 for b in store.placement.table.blocks.values())
    store.check_integrity()


def test_io_error_is_a_miss_and_the_blocks_stay(make_store, monkeypatch):
    """(A supplement to the real EIO test in test_real_faults.py.)"""
    chain = toks(5, 3)
    store = _cold(make_store, chain)

    def fail(*a, **k):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(store.disk, "read_many", fail)
    monkeypatch.setattr(store.disk, "read_into", fail)
    with store.acquire(chain, SCOPE, promote=False) as lease:
        assert lease.num_blocks == 0
    st = store.stats()
    assert st["quarantined"] == 0 and st["tiers"]["disk"]["read_degraded"] == "EIO"
    assert store.lookup(chain, SCOPE).num_blocks == 3  # still stored
    monkeypatch.undo()
    with store.acquire(chain, SCOPE, promote=False) as lease:  # the retry
        assert lease.num_blocks == 3
        assert_lease_exact(lease)
    assert store.stats()["tiers"]["disk"]["read_degraded"] is None


def test_release_returns_the_buffer_once(make_store):
    chain = toks(6, 2)
    store = _cold(make_store, chain)
    lease = store.acquire(chain, SCOPE, promote=False)
    buf = lease.read_through
    assert buf is not None and store.read_through._lent == 1
    assert "tensor" not in repr(lease)  # a lease's repr names its blocks, not its pages' bytes
    lease.release()
    assert lease.read_through is None and lease.pool.shape[0] == 0  # nothing reaches the buffer now
    assert store.read_through._lent == 0 and POOL.holds(buf)
    lease.release()  # a second release through the lease is a no-op ...
    with pytest.raises(LeaseError):
        store.release(lease)  # ... and through the store an error; the buffer is not given twice
    assert store.read_through._lent == 0 and POOL.holds(buf) and len(POOL) == 1
    store.check_integrity()


def test_a_store_opened_later_reuses_the_buffers_of_one_closed(make_store):
    """The free buffers outlive the store that made them: the next store's reads land in
    memory already faulted in (as a plain file's reader reuses its heap)."""
    chain = toks(8, 2)
    store = _cold(make_store, chain)
    with store.acquire(chain, SCOPE, promote=False) as lease:
        first = lease.read_through
        assert_lease_exact(lease)
    store.close()
    assert first is not None and POOL.holds(first) and first.tensor.numel() > 0  # not unmapped by the close
    store = make_store(**DISK_ONLY)  # the same home, opened again: the chain is cold again
    with store.acquire(chain, SCOPE, promote=False) as lease:
        assert lease.read_through is first  # the same buffer, taken from the pool
        assert not POOL.holds(first)  # ... and lent: nobody else can take it meanwhile
        assert_lease_exact(lease)
    assert POOL.holds(first)
    release_buffers()
    assert len(POOL) == 0 and first.tensor.numel() == 0  # unmapped


def test_a_codec_store_promotes(make_store):
    """Pages stored in a codec's form must be decoded: no read-through."""
    chain = toks(7, 2)
    store = _cold(make_store, chain, page_codec="int8")
    assert not store.read_through.enabled
    with store.acquire(chain, SCOPE, promote=False) as lease:
        assert lease.read_through is None and lease.num_blocks == 2


def test_kv_layers_equal_kv_buffer():
    """unpack_into per-layer tensors gives what the one-buffer form gives, also in halves."""
    n = 5
    pages = torch.randn(n, *LAYOUT.shape)
    one = kv_buffer(LAYOUT, n)
    unpack_into(one, pages, 0, LAYOUT)
    per = kv_layers(LAYOUT, n)
    half = LAYOUT.num_layers // 2
    unpack_into(per, pages[:3], 0, LAYOUT, (0, half))
    unpack_into(per, pages[:3], 0, LAYOUT, (half, LAYOUT.num_layers))
    unpack_into(per, pages[3:], 3, LAYOUT)
    for (k1, v1), (k2, v2) in zip(split_layers(one), per):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    with pytest.raises(Exception, match="outside a buffer"):
        unpack_into(per, pages, 1, LAYOUT)


def test_restore_reads_through_then_promotes(make_store):
    """restore_cache leases with promote=False: a cold prefix is not copied into the device
    tier by its first restore; the second restore promotes it."""
    from tierkv.hf.prefill import restore_cache

    class Model:
        device = torch.device("cpu")
        dtype = LAYOUT.torch_dtype

    chain = toks(8, 6)
    store = _cold(make_store, chain)
    first = restore_cache(store, chain, SCOPE, 6, Model())
    assert first.tokens == 6 * LAYOUT.block_size
    assert not set(keys_of(chain)) & tier_keys(store)["device"]
    second = restore_cache(store, chain, SCOPE, 6, Model())
    assert set(keys_of(chain)) <= tier_keys(store)["device"]
    expected = unpack_pages(pages_for(chain), LAYOUT)
    for layer, (k, v) in enumerate(expected):
        for got in (first, second):
            assert torch.equal(got.cache.layers[layer].keys, k) and torch.equal(got.cache.layers[layer].values, v)
