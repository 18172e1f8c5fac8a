"""tierkv.bundle: the export/import format, its validation, and export/import on a store."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

import tierkv
from tierkv import PageLayout, Priority, Scope, block_keys
from tierkv.bundle import (
    BUNDLE_VERSION, END, MAGIC, BundleError, BundleHeader, BundleReader, page_digest, read_header, verify_bundle,
    write_bundle,
)
from tierkv.signing import Keyring
from tierkv.transfer import Trust, UntrustedBundleError, export_prefix, import_bundle
from tierkv.errors import CapacityError, LayoutMismatchError, ModelVersionMismatchError

LAYOUT = PageLayout(2, 2, 8, block_size=4, dtype="bfloat16")
MV = hashlib.sha256(b"bundle model").hexdigest()
OTHER_MV = hashlib.sha256(b"other model").hexdigest()


def tokens_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, size=n).astype("<i4")


def pages_of(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.shape), generator=g).to(LAYOUT.torch_dtype)


def header_for(tokens: np.ndarray, scope: Scope = Scope(MV), **over) -> BundleHeader:
    keys = block_keys(tokens, scope, LAYOUT.block_size)
    fields = dict(
        layout=LAYOUT, model_version=scope.model_version, namespace=scope.namespace, tokens=len(tokens),
        blocks=len(keys), last_block_key=keys[-1].hex(), tokens_sha256=hashlib.sha256(tokens.tobytes()).hexdigest(),
        name="p", manifest={"kind": "prefix", "model_version": scope.model_version, "last_block_key": keys[-1].hex(),
                            "blocks": len(keys), "tokens": len(tokens), "pinned": False},
    )
    fields.update(over)
    return BundleHeader(**fields)


def raw_bundle(header: BundleHeader, tokens: np.ndarray, pages: torch.Tensor, *, version: int = BUNDLE_VERSION,
               magic: bytes = MAGIC, digest_fix: int = 0, tail: bytes | None = None, extra: bytes = b"") -> bytes:
    """A bundle built byte by byte, so each field can be damaged on purpose."""
    raw = header.to_json()
    body = io.BytesIO()
    body.write(magic + struct.pack("<II", version, len(raw)) + raw + tokens.tobytes())
    for p in pages:
        data = p.contiguous().view(torch.uint8).numpy().tobytes()
        body.write(data + struct.pack("<Q", (page_digest(data) + digest_fix) % 2**64))
    body.write(tail if tail is not None else END + struct.pack("<Q", len(pages)))
    body.write(extra)
    return zstandard.ZstdCompressor(write_checksum=True).compress(body.getvalue())


@pytest.fixture
def good(tmp_path) -> tuple[Path, np.ndarray, torch.Tensor]:
    tokens, pages = tokens_of(40), pages_of(10)
    path = tmp_path / "good.tkv"
    write_bundle(path, header_for(tokens), tokens, iter(pages))
    return path, tokens, pages


def test_round_trip_is_byte_identical(good):
    path, tokens, pages = good
    header = verify_bundle(path)
    assert header == header_for(tokens, created_at=header.created_at)
    with BundleReader(path) as r:
        assert np.array_equal(r.tokens, tokens)
        chunks = list(r.iter_pages(chunk_blocks=3))
    assert [start for start, _ in chunks] == [0, 3, 6, 9]
    got = torch.cat([c for _, c in chunks])
    assert got.dtype == LAYOUT.torch_dtype and torch.equal(got.view(torch.uint8), pages.view(torch.uint8))


def test_hand_built_bundle_matches_the_writer(good, tmp_path):
    path, tokens, pages = good
    p = tmp_path / "hand.tkv"
    p.write_bytes(raw_bundle(read_header(path), tokens, pages))
    assert verify_bundle(p) == verify_bundle(path)


@pytest.mark.parametrize("damage, message", [
    (dict(magic=b"NOTABUND"), "bad magic"),
    (dict(version=BUNDLE_VERSION + 1), "format version"),
    (dict(digest_fix=1), "fails its checksum"),
    (dict(tail=b"TKVBEND\0" + struct.pack("<Q", 99)), "bad end marker"),
    (dict(extra=b"more"), "data after its end marker"),
])
def test_damage_is_refused(good, tmp_path, damage, message):
    path, tokens, pages = good
    bad = tmp_path / "bad.tkv"
    bad.write_bytes(raw_bundle(read_header(path), tokens, pages, **damage))
    with pytest.raises(BundleError, match=message):
        verify_bundle(bad)


def test_header_lies_are_refused(tmp_path):
    tokens, pages = tokens_of(40), pages_of(10)
    cases = {
        "last key": (header_for(tokens, last_block_key="00" * 32), "do not end at the recorded last key"),
        "sha": (header_for(tokens, tokens_sha256="0" * 64), "SHA-256"),
        "namespace": (header_for(tokens, namespace="elsewhere"), "last key"),
    }
    for name, (header, message) in cases.items():
        p = tmp_path / f"{name}.tkv"
        p.write_bytes(raw_bundle(header, tokens, pages))
        with pytest.raises(BundleError, match=message):
            verify_bundle(p)
    # Counts that do not add up are refused when the header is read.
    p = tmp_path / "counts.tkv"
    p.write_bytes(raw_bundle(header_for(tokens, blocks=11), tokens, pages))
    with pytest.raises(BundleError, match="tokens in 11 blocks"):
        read_header(p)


def test_truncated_and_flipped_files_are_refused(good, tmp_path):
    path, _, _ = good
    data = path.read_bytes()
    for i, damaged in enumerate([data[:-7], data[: len(data) // 2], data[:20]]):
        p = tmp_path / f"t{i}.tkv"
        p.write_bytes(damaged)
        with pytest.raises(BundleError, match="truncated|damaged"):
            verify_bundle(p)
    for pos in (30, len(data) // 2, len(data) - 10):
        flipped = bytearray(data)
        flipped[pos] ^= 0x08
        p = tmp_path / f"f{pos}.tkv"
        p.write_bytes(bytes(flipped))
        with pytest.raises(BundleError):
            verify_bundle(p)


def test_failed_write_leaves_no_file(tmp_path):
    tokens = tokens_of(40)
    path = tmp_path / "x.tkv"
    with pytest.raises(BundleError, match="wrote 9 pages for 10 blocks"):
        write_bundle(path, header_for(tokens), tokens, iter(pages_of(9)))
    assert not path.exists() and not list(tmp_path.iterdir())


# ---- on a store -------------------------------------------------------------------------
@pytest.fixture
def keyring(tmp_path) -> Keyring:
    k = Keyring(tmp_path / "keys")
    k.generate()
    return k


@pytest.fixture
def trust(keyring) -> Trust:
    return Trust(keys=(keyring.public_key(),))


def make_store(home: Path, layout: PageLayout = LAYOUT, **options) -> tierkv.Store:
    return tierkv.open(home, layout, **{"device": "cpu", "device_bytes": 64 * layout.page_bytes, "host_bytes": 0,
                                        "disk_bytes": 16 << 20, **options})


def store_prefix(store, name: str, tokens: np.ndarray, pages: torch.Tensor, scope: Scope = Scope(MV)) -> None:
    store.put(tokens, pages, scope)
    keys = block_keys(tokens, scope, LAYOUT.block_size)
    store.save_manifest(name, {"kind": "prefix", "model_version": scope.model_version, "tokens": len(tokens),
                               "blocks": len(keys), "last_block_key": keys[-1].hex(), "pinned": True})


def test_export_then_import_on_stores(tmp_path, keyring, trust):
    tokens, pages = tokens_of(40, 1), pages_of(10, 1)
    with make_store(tmp_path / "a") as a:
        store_prefix(a, "p", tokens, pages, Scope(MV, "team"))
        r = export_prefix(a, "p", tmp_path / "p.tkv", signer=keyring.sign)
        assert (r.blocks, r.tokens, r.namespace) == (10, 40, "team")
        assert r.signed_by == keyring.public_key().hex()
    with make_store(tmp_path / "b") as b:
        res = import_bundle(b, tmp_path / "p.tkv", name="q", model_version=MV, trust=trust)
        assert (res.stored, res.skipped, res.durable, res.name) == (10, 0, True, "q")
        with b.acquire(tokens, Scope(MV, "team")) as lease:
            assert torch.equal(lease.pages().view(torch.uint8), pages.view(torch.uint8))
        m = b.get_manifest("q")
        assert m["namespace"] == "team" and m["pinned"] and m["imported"]["name"] == "p"
        # Pinned in the bundle's manifest: imported as pinned.
        assert b.set_priority_from(bytes.fromhex(m["last_block_key"]), Priority.PINNED) == 10
        with pytest.raises(ModelVersionMismatchError):
            import_bundle(b, tmp_path / "p.tkv", name="r", model_version=OTHER_MV, trust=trust)
        assert import_bundle(b, tmp_path / "p.tkv", name="r", model_version=OTHER_MV, force=True,
                             trust=trust).skipped == 10
        store_prefix(b, "taken", tokens_of(8, 2), pages_of(2, 2))
        with pytest.raises(BundleError, match="already named"):
            import_bundle(b, tmp_path / "p.tkv", name="taken", trust=trust)
        b.check_integrity()
    with make_store(tmp_path / "c", PageLayout(2, 2, 8, block_size=4)) as c:
        with pytest.raises(LayoutMismatchError):
            import_bundle(c, tmp_path / "p.tkv", trust=trust)
        assert c.stats()["blocks"] == 0


def test_export_of_a_prefix_larger_than_the_device_tier(tmp_path, keyring, trust):
    # Export leases a window of blocks at a time (acquire start_block/max_blocks), so a
    # 10-block prefix exports through a 4-slot device tier, byte-identical.
    tokens, pages = tokens_of(40, 3), pages_of(10, 3)
    with make_store(tmp_path / "a", device_bytes=4 * LAYOUT.page_bytes) as a:
        store_prefix(a, "p", tokens, pages)
        r = export_prefix(a, "p", tmp_path / "p.tkv", signer=keyring.sign)
        assert r.blocks == 10
        assert a.stats()["leased_blocks"] == 0
        a.check_integrity()
    with make_store(tmp_path / "b") as b:
        assert import_bundle(b, tmp_path / "p.tkv", name="p", trust=trust).stored == 10
        with b.acquire(tokens, Scope(MV)) as lease:
            assert torch.equal(lease.pages().view(torch.uint8), pages.view(torch.uint8))


def test_export_fails_cleanly_when_nothing_can_be_leased(tmp_path):
    tokens, pages = tokens_of(40, 3), pages_of(10, 3)
    with make_store(tmp_path / "a", device_bytes=4 * LAYOUT.page_bytes) as a:
        store_prefix(a, "p", tokens, pages)
        with a.acquire(tokens, Scope(MV), max_blocks=4):  # every device slot held: blocks 4.. cannot come in
            with pytest.raises(CapacityError, match="could not lease block 4 of the 10"):
                export_prefix(a, "p", tmp_path / "p.tkv")
        assert not (tmp_path / "p.tkv").exists()
        assert a.stats()["leased_blocks"] == 0
        a.check_integrity()


# ---- trust and bounds (issue 11, item 7) ----------------------------------------------------
def test_a_forged_bundle_is_refused_unless_a_trusted_key_signed_it(tmp_path, keyring, trust):
    """Forged pages with valid (unseeded) checksums were imported and served as hits."""
    tokens, forged = tokens_of(40, 5), pages_of(10, 99)
    victim_scope = Scope(MV, "victims")
    unsigned = tmp_path / "forged.tkv"
    unsigned.write_bytes(raw_bundle(header_for(tokens, victim_scope), tokens, forged))
    assert verify_bundle(unsigned).blocks == 10  # intact: every checksum is right
    stranger = Keyring(tmp_path / "stranger")
    stranger.generate()
    by_stranger = tmp_path / "stranger.tkv"
    write_bundle(by_stranger, header_for(tokens, victim_scope), tokens, iter(forged), signer=stranger.sign)
    with make_store(tmp_path / "s") as s:
        with pytest.raises(UntrustedBundleError, match="unsigned"):
            import_bundle(s, unsigned, trust=trust)
        with pytest.raises(UntrustedBundleError, match="untrusted key"):
            import_bundle(s, by_stranger, trust=trust)
        with pytest.raises(UntrustedBundleError):
            import_bundle(s, unsigned)  # no keys at all: nothing vouches for it
        assert s.stats()["blocks"] == 0 and s.list_manifests() == {}
        assert s.lookup(tokens, victim_scope).tokens_matched == 0
        # Trusting the stranger's key is the importer's explicit decision.
        assert import_bundle(s, by_stranger, trust=Trust(keys=(stranger.public_key(),))).stored == 10
        s.check_integrity()


def test_a_signed_bundle_altered_afterwards_fails_its_signature(tmp_path, keyring, trust):
    tokens, pages = tokens_of(40, 6), pages_of(10, 6)
    path = tmp_path / "signed.tkv"
    write_bundle(path, header_for(tokens), tokens, iter(pages), signer=keyring.sign)
    body = zstandard.ZstdDecompressor().decompress(path.read_bytes(), max_output_size=1 << 26)
    hlen = struct.unpack_from("<I", body, 12)[0]
    first_page = 16 + hlen + 4 * len(tokens)
    pb = LAYOUT.page_bytes
    page = bytearray(body[first_page : first_page + pb])
    page[0] ^= 0x40  # a forged page, with its checksum recomputed: only the signature can tell
    forged = body[:first_page] + bytes(page) + struct.pack("<Q", page_digest(bytes(page))) + body[first_page + pb + 8:]
    bad = tmp_path / "altered.tkv"
    bad.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(forged))
    with make_store(tmp_path / "s") as s:
        with pytest.raises(BundleError, match="signature"):
            import_bundle(s, bad, trust=trust)
        assert s.stats()["blocks"] == 0
        assert import_bundle(s, path, trust=trust).stored == 10


def test_declared_sizes_are_checked_before_allocating(tmp_path, trust):
    """A 33 KB bundle declaring a 1 GiB page took 3.3 GiB of memory; one declaring 2^26
    token ids 2.2 GiB. Now: refused from the header, or bounded by the store's layout."""
    import tracemalloc

    tokens, pages = tokens_of(8, 7), pages_of(2, 7)
    huge_layout = PageLayout(4096, 64, 256, block_size=4, dtype="bfloat16")  # 1 GiB per page
    big_page = tmp_path / "big-page.tkv"
    big_page.write_bytes(raw_bundle(header_for(tokens, layout=huge_layout), tokens, pages[:0]))
    other_page = tmp_path / "other-page.tkv"  # 128 MiB pages
    other_page.write_bytes(raw_bundle(header_for(tokens, layout=PageLayout(512, 64, 256, block_size=4, dtype="bfloat16")),
                                      tokens, pages[:0]))
    many = tmp_path / "many-tokens.tkv"
    many.write_bytes(raw_bundle(dataclasses.replace(header_for(tokens), tokens=1 << 26, blocks=1 << 24), tokens,
                                pages[:0]))
    tracemalloc.start()
    try:
        with pytest.raises(BundleError, match="pages of"):
            verify_bundle(big_page)
        with pytest.raises(BundleError, match="tokens"):
            verify_bundle(many)
        with make_store(tmp_path / "s") as s:
            with pytest.raises(BundleError, match="pages of"):
                import_bundle(s, big_page, trust=trust)
            with pytest.raises(LayoutMismatchError):  # within the bound, but not the store's: no page read
                import_bundle(s, other_page, trust=trust)
            assert s.stats()["blocks"] == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak >> 20} MiB"


def test_a_name_with_a_slash_is_refused_before_anything_is_stored(tmp_path, keyring, trust):
    from tierkv.errors import InvalidNameError

    tokens, pages = tokens_of(40, 8), pages_of(10, 8)
    path = tmp_path / "p.tkv"
    write_bundle(path, header_for(tokens, name="a/b"), tokens, iter(pages), signer=keyring.sign)
    with make_store(tmp_path / "s") as s:
        for name in ("x/y", None, ""):  # None: the bundle's own name, "a/b"
            with pytest.raises(InvalidNameError):
                import_bundle(s, path, name=name, trust=trust)
        assert s.stats()["blocks"] == 0


def test_import_streams_pages_in_bounded_chunks(tmp_path, keyring, trust):
    """Pages are read straight into chunk buffers of at most CHUNK_BYTES: memory beyond the
    pages in flight stays small (measured with tracemalloc over numpy's buffers)."""
    import tracemalloc

    from tierkv import bundle as b

    tokens, pages = tokens_of(400, 9), pages_of(100, 9)
    path = tmp_path / "p.tkv"
    write_bundle(path, header_for(tokens), tokens, iter(pages), signer=keyring.sign)
    with make_store(tmp_path / "s", device_bytes=128 * LAYOUT.page_bytes) as s:
        old = b.CHUNK_BYTES
        b.CHUNK_BYTES = 8 * LAYOUT.page_bytes
        tracemalloc.start()
        try:
            assert import_bundle(s, path, trust=trust).stored == 100
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            b.CHUNK_BYTES = old
        with s.acquire(tokens, Scope(MV)) as lease:
            assert torch.equal(lease.pages().view(torch.uint8), pages.view(torch.uint8))
    assert peak < 16 * LAYOUT.page_bytes + (4 << 20), f"peak {peak} bytes"


def _real_and_forged(tmp_path: Path, n_tokens: int, forged_block: int):
    """A tiny model's directory, its layout, and two unsigned bundles of the same prefix:
    the model's own pages, and the same with block ``forged_block`` replaced by noise
    (valid checksums: only the model can tell)."""
    from helpers import tiny_models
    from tierkv.hf import load_model

    model_dir = tiny_models.save_model_dir(tmp_path / "model")
    lm = load_model(model_dir, block_size=4)
    layout = lm.layout
    ids = list(np.random.default_rng(3).integers(5, 300, size=n_tokens))
    n = n_tokens // layout.block_size
    with tierkv.open(tmp_path / "a", layout, device="cpu", device_bytes=2 * n * layout.page_bytes, host_bytes=0,
                     disk_bytes=16 << 20) as a:
        lm.prefill(ids, store=a, need_logits=False)
        scope = lm.scope()
        keys = block_keys(np.asarray(ids, dtype="<i4"), scope, layout.block_size)
        a.save_manifest("real", {"last_block_key": keys[-1].hex(), "pinned": False})
        export_prefix(a, "real", tmp_path / "real.tkv")  # unsigned
        with a.acquire(ids, scope) as lease:
            real_pages = lease.pages().clone()
    tokens = np.asarray(ids, dtype="<i4")
    forged_pages = real_pages.clone()
    forged_pages[forged_block] = torch.randn_like(forged_pages[forged_block])
    header = BundleHeader(layout=layout, model_version=lm.model_version, namespace="default", tokens=n_tokens,
                          blocks=n, last_block_key=keys[-1].hex(),
                          tokens_sha256=hashlib.sha256(tokens.tobytes()).hexdigest(), name="forged", manifest={})
    write_bundle(tmp_path / "forged.tkv", header, tokens, iter(forged_pages))
    return model_dir, layout, tmp_path / "real.tkv", tmp_path / "forged.tkv"


def test_verify_model_accepts_real_pages_and_refuses_forged_ones(tmp_path):
    """An unsigned bundle is trusted only when every block, recomputed by the model,
    matches (--verify-model)."""
    from tierkv.transfer import model_checker

    model_dir, layout, real, forged = _real_and_forged(tmp_path, 32, forged_block=5)
    check = Trust(model_check=model_checker(model_dir))
    with tierkv.open(tmp_path / "b", layout, device="cpu", device_bytes=64 * layout.page_bytes, host_bytes=0,
                     disk_bytes=16 << 20) as b:
        with pytest.raises(UntrustedBundleError, match="block 5"):
            import_bundle(b, forged, trust=check)
        assert b.stats()["blocks"] == 0
        assert import_bundle(b, real, trust=check).stored == 8
        b.check_integrity()


def test_verify_model_finds_one_forged_block_in_64(tmp_path):
    """Issue 34, item 6: the model check sampled 4 blocks (first, last, two at random), so a
    64-block bundle with one forged block in the middle was accepted 4 times in 4 and the
    forged page served as a hit. Every block is checked now: refused every time."""
    from tierkv.transfer import model_checker

    model_dir, layout, real, forged = _real_and_forged(tmp_path, 256, forged_block=37)
    check = Trust(model_check=model_checker(model_dir))
    with tierkv.open(tmp_path / "b", layout, device="cpu", device_bytes=128 * layout.page_bytes, host_bytes=0,
                     disk_bytes=16 << 20) as b:
        for _ in range(4):
            with pytest.raises(UntrustedBundleError, match="block 37"):
                import_bundle(b, forged, trust=check)
        assert b.stats()["blocks"] == 0 and b.list_manifests() == {}
        assert import_bundle(b, real, trust=check).stored == 64
        b.check_integrity()


def test_a_model_check_that_skips_pages_vouches_for_nothing(tmp_path):
    """A model check must see every page: one that returns after the first chunk (a
    sampling or truncated check) does not make the bundle trusted."""
    from unittest import mock

    import tierkv.bundle

    tokens, pages = tokens_of(40), pages_of(10)
    write_bundle(tmp_path / "u.tkv", header_for(tokens), tokens, iter(pages))

    def first_chunk_only(header, tokens, chunks):
        next(iter(chunks))

    with tierkv.open(tmp_path / "b", LAYOUT, device="cpu", device_bytes=64 * LAYOUT.page_bytes, host_bytes=0,
                     disk_bytes=16 << 20) as b, \
            mock.patch.object(tierkv.bundle, "CHUNK_BYTES", 4 * LAYOUT.page_bytes):  # chunks of 4 pages
        with pytest.raises(UntrustedBundleError, match="saw 4 of the bundle's 10 blocks"):
            import_bundle(b, tmp_path / "u.tkv", trust=Trust(model_check=first_chunk_only))
        assert b.stats()["blocks"] == 0
