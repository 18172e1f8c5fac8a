"""Corruption: bit flips, truncated or damaged segments, bad index records, pages under the
wrong key and forced key collisions -> a miss (shorter lease), a quarantine entry and a
counter; never wrong bytes."""
from __future__ import annotations

import hashlib
import os
from unittest import mock

import pytest
import torch

import tierkv.identity
import tierkv.core.matching
from tierkv import Scope
from tierkv.index import BlockRecord
from tierkv.tiers.segments import read_header

from .kit import LAYOUT, SCOPE, SLOT, assert_lease_exact, flip_byte, keys_of, put_chain, segment_files, tier_counts, toks


def _stored_then_closed(make_store, chain, **opts):
    """Put ``chain``, note where each page sits on disk, close (memory copies gone)."""
    from .kit import slot_offset

    store = make_store(**opts)
    put_chain(store, chain)
    where = [slot_offset(store, k) for k in keys_of(chain)]
    store.close()
    return where


@pytest.mark.parametrize("within", [0, 17, LAYOUT.page_bytes - 1])
def test_flipped_byte_in_page_is_a_miss_and_quarantined(make_store, within):
    chain = toks(300, 3)
    where = _stored_then_closed(make_store, chain)
    path, off = where[1]
    flip_byte(path, off + within)
    store = make_store()
    assert store.lookup(chain, SCOPE).num_blocks == 3  # the index cannot know yet
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 1  # block 1 failed its checksum: the lease stops before it
        assert_lease_exact(lease)
    st = store.stats()
    assert st["quarantined"] == 1
    # Acquire hits count the blocks the lease held once its reads settled, not those planned.
    assert st["acquire_blocks"] == 3 and st["acquire_hits"] == {"device": 0, "host": 0, "disk": 1}
    assert store.lookup(chain, SCOPE).num_blocks == 1
    q = store.index.quarantined()
    assert list(q) == [keys_of(chain)[1].hex()] and "checksum" in q[keys_of(chain)[1].hex()]
    store.check_integrity()
    # The orphaned extension is still evictable space, never served without its prefix.
    assert store.lookup(chain[:4], SCOPE).num_blocks == 1


def test_flip_in_slot_padding_is_harmless(make_store):
    chain = toks(301, 2)
    where = _stored_then_closed(make_store, chain)
    path, off = where[0]
    flip_byte(path, off + LAYOUT.page_bytes + 5)  # past the page, inside its 4 KiB slot
    store = make_store()
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 2
        assert_lease_exact(lease)


def test_verify_finds_and_repairs_flipped_pages(make_store):
    chain = toks(302, 4)
    where = _stored_then_closed(make_store, chain)
    flip_byte(*where[2])
    store = make_store()
    r = store.verify()
    assert r.checked == 4 and r.corrupt == (keys_of(chain)[2].hex(),) and not r.repaired
    assert store.lookup(chain, SCOPE).num_blocks == 4
    r = store.verify(repair=True)
    assert r.repaired and len(r.corrupt) == 1
    assert store.lookup(chain, SCOPE).num_blocks == 2
    assert store.stats()["quarantined"] == 1
    assert store.verify().corrupt == ()


def test_verify_on_open_full_drops_corrupt_pages(make_store):
    chain = toks(303, 3)
    where = _stored_then_closed(make_store, chain)
    flip_byte(*where[0])
    store = make_store(verify_on_open="full")
    assert store.lookup(chain, SCOPE).num_blocks == 0
    assert store.stats()["quarantined"] == 1


def test_truncated_segment_drops_its_tail_on_reopen(make_store, home):
    chain = toks(304, 8)  # segment_pages=4: two segments
    where = _stored_then_closed(make_store, chain)
    path, off = where[5]  # block 5 = second segment, slot 1
    assert where[4][0] == path
    os.truncate(path, off + 100)  # block 5 torn mid-page, 6 and 7 gone
    store = make_store()
    assert store.stats()["quarantined"] == 3
    assert store.lookup(chain, SCOPE).num_blocks == 5
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 4  # the device tier holds 4
        assert_lease_exact(lease)
    store.check_integrity()


def test_truncated_page_read_is_a_miss(make_store, home):
    # Truncated while the store is open (no reopen to notice it): the read comes up short.
    store = make_store()
    chain = toks(305, 2)
    put_chain(store, chain)
    from .kit import slot_offset

    path, off = slot_offset(store, keys_of(chain)[1])
    for i in range(3):  # push the chain out of memory
        put_chain(store, toks(306 + i, 4))
    assert store.lookup(chain, SCOPE).tiers == ("disk", "disk")
    os.truncate(path, off + 10)
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 1
        assert_lease_exact(lease)
    assert store.stats()["quarantined"] == 1


@pytest.mark.parametrize("damage", ["json", "length", "empty", "format"])
def test_damaged_segment_header(make_store, home, damage):
    a, b = toks(310, 4), toks(311, 4)
    store = make_store()
    put_chain(store, a)
    put_chain(store, b)
    store.close()
    first = segment_files(home)[0]  # holds chain a (segment_pages=4)
    with open(first, "r+b") as f:
        if damage == "json":
            f.seek(8)
            f.write(b"}}}}")
        elif damage == "length":
            f.write((12345).to_bytes(8, "little"))
        elif damage == "empty":
            f.truncate(0)
        else:
            raw = f.read(4096)
            f.seek(0)
            f.write(raw.replace(b"tierkv-segment", b"tierkv-segmenX"))
    store = make_store()
    assert store.lookup(a, SCOPE).num_blocks == 0
    assert store.lookup(b, SCOPE).num_blocks == 4
    assert store.stats()["quarantined"] == 4
    assert first.with_name(first.name + ".bad").exists()
    put_chain(store, a)  # the space is usable again
    with store.acquire(a, SCOPE) as lease:
        assert_lease_exact(lease)


def test_page_copied_under_another_key_fails_its_checksum(make_store):
    a, b = toks(320, 1), toks(321, 1)
    store = make_store()
    put_chain(store, a)
    put_chain(store, b)
    from .kit import slot_offset

    pa, oa = slot_offset(store, keys_of(a)[0])
    pb, ob = slot_offset(store, keys_of(b)[0])
    store.close()
    with open(pa, "rb") as f:
        f.seek(oa)
        page_a = f.read(SLOT)
    with open(pb, "r+b") as f:
        f.seek(ob)
        f.write(page_a)  # b's slot now holds a's (valid) page
    store = make_store()
    with store.acquire(b, SCOPE) as lease:
        assert lease.num_blocks == 0
    with store.acquire(a, SCOPE) as lease:
        assert lease.num_blocks == 1
        assert_lease_exact(lease)
    assert store.stats()["quarantined"] == 1


def _colliding_keys(tokens, seed, block_size, block_extra=None, start=0, parent=None, raw=None):
    """Keys that ignore token ids: every request of the same length collides (``start``:
    resume at that block, as iter_block_keys does)."""
    for i in range(start, len(tokens) // block_size):
        yield hashlib.sha256(seed + i.to_bytes(4, "little")).digest()


def test_forced_key_collision_is_a_miss(make_store, monkeypatch):
    monkeypatch.setattr(tierkv.core.matching, "iter_block_keys", _colliding_keys)  # lookup, acquire
    monkeypatch.setattr(tierkv.identity, "iter_block_keys", _colliding_keys)  # put (ChainMemo.chain_keys)
    store = make_store()
    a, b = toks(330, 2), toks(331, 2)
    zeros = torch.zeros((2, *LAYOUT.shape))
    ones = torch.ones((2, *LAYOUT.shape))
    store.put(a, zeros, SCOPE)
    assert store.lookup(b, SCOPE).num_blocks == 0  # same keys, other token ids: a miss
    assert store.stats()["token_mismatch"] == 1
    with store.acquire(b, SCOPE) as lease:
        assert lease.num_blocks == 0
    store.put(b, ones, SCOPE)
    with store.acquire(b, SCOPE) as lease:
        assert lease.num_blocks == 2 and torch.equal(lease.pages(), ones)
    with store.acquire(a, SCOPE) as lease:
        assert lease.num_blocks == 0  # never b's bytes for a's tokens
    assert store.stats()["quarantined"] >= 2
    assert store.stats()["token_mismatch"] >= 2


def test_corrupt_index_records_are_quarantined_on_open(make_store):
    store = make_store()
    good, bad, odd = toks(340, 1), toks(341, 1), toks(342, 1)
    for c in (good, bad, odd):
        put_chain(store, c)
    kb, ko = keys_of(bad)[0], keys_of(odd)[0]
    rec = store.index.get_block(ko)
    with store.index.env.begin(write=True) as txn:
        txn.put(kb, b"\x01garbage", db=store.index._blocks)
        odd_rec = BlockRecord(**{**rec.__dict__, "priority": 9})
        txn.put(ko, odd_rec.encode(), db=store.index._blocks)
    store.close()
    store = make_store()  # regression: a record with an unknown priority crashed the open
    assert store.lookup(good, SCOPE).num_blocks == 1
    assert store.lookup(bad, SCOPE).num_blocks == 0
    assert store.lookup(odd, SCOPE).num_blocks == 0
    assert store.stats()["quarantined"] == 2
    assert tier_counts(store)["disk"] == 1


def test_model_version_retag_of_segment_drops_entries(make_store, home):
    # A segment whose header names another model version cannot back these records.
    from tierkv.tiers.segments import SegmentHeader, encode_header

    from .kit import MV2

    chain = toks(350, 2)
    _stored_then_closed(make_store, chain)
    seg = segment_files(home)[0]
    with open(seg, "r+b") as f:
        f.write(encode_header(SegmentHeader(LAYOUT, MV2, 4)))
    store = make_store()
    assert store.lookup(chain, SCOPE).num_blocks == 0
    assert store.lookup(chain, Scope(MV2)).num_blocks == 0
    assert store.stats()["quarantined"] == 2


# Pages whose size is a multiple of 4 KiB take the direct path: consecutive disk slots read with
# one preadv straight into the device slots, each verified before it is placed.
ALIGNED = tierkv.PageLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=4)  # 8 KiB pages


def _aligned_store(home, **kw):
    return tierkv.open(home, ALIGNED, device="cpu", device_bytes=16 * ALIGNED.page_bytes, host_bytes=0,
                       disk_bytes=64 * ALIGNED.slot_bytes, segment_pages=32, **kw)


def test_direct_reads_into_the_device_pool_are_verified(tmp_path):
    assert ALIGNED.page_bytes % 4096 == 0
    tokens = toks(901, 6)
    pages = torch.randn((6, *ALIGNED.shape))
    with _aligned_store(tmp_path / "h") as store:
        store.put(tokens, pages, SCOPE)
    seg = sorted((tmp_path / "h" / "segments").glob("seg-*.safetensors"))[0]
    with _aligned_store(tmp_path / "h") as store:  # cold: every page read through the direct path
        assert store.device.direct_target(0) is not None
        with store.acquire(tokens, SCOPE) as lease:
            assert lease.num_blocks == 6
            assert torch.equal(lease.pages(), pages)
    off = read_header(seg).data_offset + 3 * ALIGNED.slot_bytes + 17
    with open(seg, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x01]))
    with _aligned_store(tmp_path / "h") as store:
        with store.acquire(tokens, SCOPE) as lease:
            assert lease.num_blocks == 3  # blocks 0-2 verified; block 3 failed its checksum
            assert torch.equal(lease.pages(), pages[:3])
        assert store.stats()["quarantined"] == 1
        store.check_integrity()


def test_a_failed_run_read_falls_back_to_page_by_page(tmp_path):
    tokens = toks(902, 4)
    pages = torch.randn((4, *ALIGNED.shape))
    with _aligned_store(tmp_path / "h") as store:
        store.put(tokens, pages, SCOPE)
    with _aligned_store(tmp_path / "h") as store:
        with mock.patch.object(type(store.disk), "read_many", side_effect=OSError(5, "EIO")):
            with store.acquire(tokens, SCOPE) as lease:
                assert lease.num_blocks == 4  # each page re-read on its own, all good
                assert torch.equal(lease.pages(), pages)
        assert store.stats()["quarantined"] == 0
        store.check_integrity()
