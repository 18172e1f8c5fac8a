"""Page codecs (tierkv/codec.py): the int8 round trip and its error bound, the stored sizes,
and a store with ``page_codec="int8"`` end to end (host and disk hold the stored form, the
device tier the decoded page), plus the default store left exactly as it was."""
from __future__ import annotations

import json

import pytest
import torch

import tierkv
from tierkv import PageLayout
from tierkv.codec import PageCodec, _decode_torch, _encode_torch, decode_int8, encode_int8
from tierkv.errors import CodecMismatchError, PageFormatError
from tierkv.tiers import TierName
from tierkv.tiers.segments import read_header

from .kit import LAYOUT, SCOPE, keys_of, page_for, put_chain, segment_files, tier_counts, tier_keys, toks

INT8 = PageCodec("int8", LAYOUT)


def _pages(layout: PageLayout, n: int, seed: int = 0) -> torch.Tensor:
    """Pages with a wide spread of magnitudes (per group and within one)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *layout.shape), generator=g)
    scale = torch.exp(torch.randn((n, *layout.shape[:-1], 1), generator=g) * 3)
    return (x * scale).to(layout.torch_dtype)


def _bound_holds(x: torch.Tensor, y: torch.Tensor, layout: PageLayout) -> None:
    """|x - y| <= max|group| / 127 for every group (a channel of a head over the block's
    tokens), against float64."""
    hd = layout.num_kv_heads * layout.head_dim
    xd, yd = x.double().reshape(-1, layout.block_size, hd), y.double().reshape(-1, layout.block_size, hd)
    amax = xd.abs().amax(dim=1, keepdim=True)
    err = (xd - yd).abs()
    assert bool((err <= amax / 127 + 1e-300).all()), float((err / amax.clamp_min(1e-300)).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_within_the_bound_and_re_encoding_is_exact(dtype):
    layout = PageLayout(num_layers=2, num_kv_heads=3, head_dim=16, block_size=4, dtype=dtype)
    codec = PageCodec("int8", layout)
    x = _pages(layout, 5)
    if dtype == "float16":
        x = x.clamp(-60000, 60000)
    stored = codec.to_stored(x)
    assert stored.dtype == torch.uint8 and stored.shape == (5, codec.stored_bytes)
    y = codec.to_layout(stored)
    assert y.dtype == layout.torch_dtype and y.shape == x.shape
    _bound_holds(x, y, layout)
    # The mean error is well under the bound (it is half a step, the step at most max/64).
    rel = ((x.double() - y.double()).norm() / x.double().norm()).item()
    assert rel < 0.01, rel
    # Encoding a decoded page gives back the same bytes: a demoted block keeps its checksum.
    assert torch.equal(codec.to_stored(y), stored)
    # One page at a time is the same as a batch.
    assert torch.equal(codec.to_stored(x[2]), stored[2])
    # The numpy (CPU) and torch (CUDA) paths agree bit for bit.
    flat = torch.empty_like(stored)
    B, HD, numel = layout.block_size, layout.num_kv_heads * layout.head_dim, layout.numel
    lo, hi = {"float16": (-24, 9)}.get(dtype, (-126, 126))
    _encode_torch(x, flat, B, HD, lo, hi)
    assert torch.equal(flat, stored)
    out = torch.empty_like(y)
    _decode_torch(stored, out, numel, B, HD, lo, hi)
    assert torch.equal(out, y)


def test_edge_values():
    layout = PageLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16")
    x = torch.zeros(layout.shape, dtype=torch.float16)
    x[0, 0, 0] = torch.tensor([65504, -65504, 1, 0, 0, 0, 0, 0])  # float16's largest
    x[0, 0, 1] = torch.tensor([6e-8, 0, 0, 0, 0, 0, 0, -6e-8])  # float16 subnormals
    y = decode_int8(encode_int8(x, layout), layout)
    assert bool(torch.isfinite(y).all())
    _bound_holds(x, y, layout)
    assert torch.equal(y[0, 0, 2:], x[0, 0, 2:])  # zeros stay zeros
    for bad in (float("inf"), float("nan")):
        x[0, 1, 3, 0, 5] = bad
        with pytest.raises(PageFormatError):
            encode_int8(x, layout)


def test_a_loud_channel_does_not_cost_the_others_their_precision():
    """The documented choice: one scale per channel of a head over the block's tokens. A
    channel a hundred times louder than the rest (as keys of trained models have) is scaled
    on its own; with one scale per token, it would flatten the token's other channels."""
    layout = PageLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16)
    g = torch.Generator().manual_seed(3)
    x = torch.randn((2, *layout.shape), generator=g)
    x[..., 1, 5] *= 100  # channel 5 of head 1, K and V, every token
    y = decode_int8(encode_int8(x, layout), layout)
    quiet = torch.ones(layout.shape[-2:], dtype=torch.bool)
    quiet[1, 5] = False
    rel = ((y - x)[..., quiet].norm() / x[..., quiet].norm()).item()
    assert rel < 0.01, rel
    # One scale per (token, head) instead: the loud channel sets every token's step.
    xt = x.reshape(-1, layout.head_dim)
    step = torch.exp2(torch.ceil(torch.log2(xt.abs().amax(dim=1, keepdim=True) / 127)))
    yt = (torch.round(xt / step) * step).reshape(x.shape)
    assert ((yt - x)[..., quiet].norm() / x[..., quiet].norm()).item() > 4 * rel


def test_stored_sizes_halve_bfloat16():
    layout = PageLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    codec = PageCodec("int8", layout)
    assert layout.page_bytes == 262_144
    assert codec.stored_bytes == 131_072 + 8_192  # int8 values, then one exponent byte per 16
    assert codec.slot_bytes == 139_264 and codec.slot_bytes / layout.slot_bytes == 0.53125
    assert PageCodec("none", layout).stored_bytes == layout.page_bytes
    with pytest.raises(ValueError):
        PageCodec("int4", layout)


# ---- a store with the int8 codec ----------------------------------------------------------
def _expected(key: bytes) -> torch.Tensor:
    """What an int8 store serves for ``key`` once its page has left the device tier."""
    return INT8.to_layout(INT8.to_stored(page_for(key)))


def _assert_lease_decoded(lease: tierkv.Lease) -> None:
    for i, key in enumerate(lease.keys):
        assert torch.equal(lease.page(i), _expected(key)), f"block {i}"
        _bound_holds(page_for(key), lease.page(i), LAYOUT)


def test_put_evict_to_disk_reopen_acquire(make_store, home):
    store = make_store(page_codec="int8")
    assert store.host.encoded and store.disk.codec.name == "int8" and not store.device.encoded
    chains = [toks(s, 3) for s in range(4)]  # 12 blocks: 4 fit the device tier, 4+ the host
    for c in chains:
        put_chain(store, c)
    # Device pages are the exact ones put; the device tier is CPU shared memory here.
    with store.acquire(chains[-1], SCOPE) as lease:
        assert lease.num_blocks == 3
        for i, key in enumerate(lease.keys):
            assert torch.equal(lease.page(i), page_for(key))
    # Host holds stored forms (evicted from the device, encoded on the way down).
    assert tier_counts(store)["host"] > 0
    with store.placement.lock:
        for b in store.placement.table.blocks.values():
            if TierName.HOST in b.loc:
                assert torch.equal(store.host.page(b.loc[TierName.HOST]), INT8.to_stored(page_for(b.key)))
    # From the host (or disk) tier: decoded into the device tier.
    assert not tier_keys(store)["device"] & set(keys_of(chains[0]))
    with store.acquire(chains[0], SCOPE) as lease:
        assert lease.num_blocks == 3
        _assert_lease_decoded(lease)
    store.close()
    reopened = make_store()  # no codec asked: the home's
    assert reopened.disk.codec.name == "int8" and reopened.host.encoded
    for c in chains:
        with reopened.acquire(c, SCOPE) as lease:
            assert lease.num_blocks == 3
            _assert_lease_decoded(lease)
    # Promoted, evicted again and re-encoded: still the bytes its checksum covers.
    assert reopened.verify().corrupt == ()
    assert reopened.stats()["quarantined"] == 0


def test_write_back_mode_flushes_stored_pages(make_store):
    store = make_store(page_codec="int8", write_through=False)
    chains = [toks(10 + s, 3) for s in range(3)]
    for c in chains:
        put_chain(store, c)
    store.close()  # write-back at close: host pages go to disk as stored, device pages encoded
    reopened = make_store()
    for c in chains:
        with reopened.acquire(c, SCOPE) as lease:
            assert lease.num_blocks == 3
            _assert_lease_decoded(lease)
    assert reopened.verify().corrupt == ()


def test_disk_and_host_bytes_halved(tmp_path):
    # 128 KiB bfloat16 pages: 64 KiB of int8 values and 4 KiB of exponents, in 17 x 4 KiB.
    layout = PageLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
    chain = toks(5, 16)  # the kit's block size is 4: 64 tokens, 4 blocks of 16
    pages = _pages(layout, 4)
    sizes = {}
    for codec in ("none", "int8"):
        s = tierkv.open(tmp_path / codec, layout, device="cpu", device_bytes=4 * layout.page_bytes,
                        host_bytes=1 << 20, disk_bytes=1 << 23, segment_pages=4, page_codec=codec,
                        shm_dir=tmp_path / "shm")
        try:
            s.put(chain[: 4 * 16], pages, SCOPE)
            st = s.stats()["tiers"]
            sizes[codec] = (s.disk.slot_bytes, st["disk"]["used_bytes"], s.host.stride_bytes,
                            s.host.slots.capacity, s.disk.file_bytes())
            s.check_integrity()
        finally:
            s.close()
    none, int8 = sizes["none"], sizes["int8"]
    assert none[0] == 32 * 4096 and int8[0] == 17 * 4096  # disk slots: 0.53 of bfloat16's
    assert none[1] == 4 * 131_072 and int8[1] == 4 * (65_536 + 4_096)  # used: half, plus the exponents
    assert int8[2] == 17 * 4096 and none[2] == 32 * 4096  # host slots likewise
    assert int8[3] == (1 << 20) // (17 * 4096) and none[3] == (1 << 20) // (32 * 4096)  # 15 pages, not 8
    assert int8[4] < 0.6 * none[4]  # segment files (records included)


def test_corrupt_encoded_page_is_a_miss(make_store, home):
    from .kit import slot_offset

    store = make_store(page_codec="int8")
    chain = toks(300, 3)
    put_chain(store, chain)
    path, off = slot_offset(store, keys_of(chain)[1])
    store.close()
    with open(path, "r+b") as f:  # a byte of the exponents (the stored page's tail)
        f.seek(off + INT8.stored_bytes - 3)
        b = f.read(1)
        f.seek(off + INT8.stored_bytes - 3)
        f.write(bytes([b[0] ^ 0x01]))
    store = make_store()
    with store.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 1
        _assert_lease_decoded(lease)
    assert store.stats()["quarantined"] == 1
    assert store.lookup(chain, SCOPE).num_blocks == 1


def test_codec_mismatch_on_reopen_is_an_error(make_store, home, tmp_path):
    make_store(page_codec="int8").close()
    with pytest.raises(CodecMismatchError, match="int8"):
        make_store(page_codec="none")
    make_store(page_codec="int8").close()  # the same codec, and no codec at all, open it
    make_store().close()
    other = tmp_path / "exact"
    make_store(other).close()
    with pytest.raises(CodecMismatchError):
        make_store(other, page_codec="int8")
    with pytest.raises(ValueError):
        make_store(tmp_path / "bad", page_codec="int4")


def test_segment_of_another_codec_is_quarantined(make_store, home, tmp_path):
    exact_home = tmp_path / "exact"
    s = make_store(exact_home)
    put_chain(s, toks(1, 2))
    s.close()
    s = make_store(page_codec="int8")
    put_chain(s, toks(2, 2))
    s.close()
    seg = segment_files(exact_home)[0]
    seg.rename(home / "segments" / "seg-000009.safetensors")  # a foreign (exact) segment
    s = make_store()
    assert s.stats()["tiers"]["disk"]["quarantined_segments"] == 1
    with s.acquire(toks(2, 2), SCOPE) as lease:
        assert lease.num_blocks == 2


def test_repair_rebuilds_an_int8_home(make_store, home):
    import shutil

    from tierkv.repair import rebuild_index

    s = make_store(page_codec="int8")
    chain = toks(7, 3)
    put_chain(s, chain)
    s.close()
    shutil.rmtree(home / "index")
    rebuild_index(home)
    s = make_store()
    assert s.disk.codec.name == "int8"
    with s.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 3
        _assert_lease_decoded(lease)


def test_default_store_is_unchanged(make_store, home):
    store = make_store()
    assert store.disk.codec.exact and not store.host.encoded
    chain = toks(42, 3)
    put_chain(store, chain)
    store.close()
    header = read_header(segment_files(home)[0])
    assert header.page_codec == "none" and header.slot_bytes == LAYOUT.slot_bytes
    raw = segment_files(home)[0].read_bytes()
    meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    assert "page_codec" not in meta  # exact homes write the header they always wrote
    store = make_store()
    assert store.index.get_meta("page_codec") == "none"
    with store.acquire(chain, SCOPE) as lease:
        for i, key in enumerate(lease.keys):
            assert torch.equal(lease.page(i), page_for(key))  # bit-exact


def test_staged_reads_fall_back_page_by_page_and_an_io_error_is_a_plain_miss(make_store):
    from unittest import mock

    store = make_store(page_codec="int8")
    chain = toks(77, 4)
    put_chain(store, chain)
    store.close()
    store = make_store()
    bad_loc = None
    real_read_into = type(store.disk).read_into

    def read_into(self, loc, buf):  # the third block's page cannot be read (EIO)
        if loc == bad_loc:
            raise OSError(5, "EIO")
        return real_read_into(self, loc, buf)

    with store.placement.lock:
        bad_loc = store.placement.table.get(keys_of(chain)[2]).loc[TierName.DISK]
    with mock.patch.object(type(store.disk), "read_many", side_effect=OSError(5, "EIO")), \
            mock.patch.object(type(store.disk), "read_into", read_into):
        with store.acquire(chain, SCOPE) as lease:
            assert lease.num_blocks == 2  # re-read one by one; the lease stops at the unreadable page
            _assert_lease_decoded(lease)
    assert store.stats()["quarantined"] == 0  # an I/O error proves nothing about the page
    with store.acquire(chain, SCOPE) as lease:  # the next acquire is the retry
        assert lease.num_blocks == 4
        _assert_lease_decoded(lease)


def test_invalidate_counts_the_stored_bytes(make_store):
    store = make_store(page_codec="int8")
    chain = toks(88, 2)
    put_chain(store, chain)  # write-through: each block on disk, and in the device tier
    with store.placement.lock:
        tiers = [t for k in keys_of(chain) for t in store.placement.table.get(k).loc]
    want = sum(INT8.slot_bytes if t == TierName.DISK else
               (INT8.stored_bytes if t == TierName.HOST else LAYOUT.page_bytes) for t in tiers)
    r = store.invalidate(model_version=SCOPE.model_version, dry_run=True)
    assert r.removed_blocks == 2 and r.freed_bytes == want


def test_staged_promotion_goes_through_a_bounded_buffer(make_store, home, monkeypatch):
    """A promotion of stored pages is read through STAGED_BYTES of staging at a time, not a
    buffer the size of the prefix (1 GiB for an 8k-token prefix of an 8B model), and every
    page still arrives decoded and verified."""
    from tierkv.core import promotion

    store = make_store(page_codec="int8")
    chain = toks(9, 3)
    put_chain(store, chain)
    store.close()
    reopened = make_store()
    monkeypatch.setattr(promotion, "STAGED_BYTES", reopened.disk.slot_bytes)  # one page at a time
    calls: list[int] = []
    original = promotion.Promotion._read_staged
    monkeypatch.setattr(promotion.Promotion, "_read_staged",
                        lambda self, reads: calls.append(len(reads)) or original(self, reads))
    with reopened.acquire(chain, SCOPE) as lease:
        assert lease.num_blocks == 3
        _assert_lease_decoded(lease)
    assert calls == [1, 1, 1]
    assert reopened.stats()["quarantined"] == 0
