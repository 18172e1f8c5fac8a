"""tierkv.bundle: the export/import format, its validation, and export/import on a store."""
from __future__ import annotations

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
from tierkv.transfer import export_prefix, import_bundle
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
def make_store(home: Path, layout: PageLayout = LAYOUT, **options) -> tierkv.Store:
    return tierkv.open(home, layout, **{"device": "cpu", "device_bytes": 64 * layout.page_bytes, "host_bytes": 0,
                                        "disk_bytes": 16 << 20, **options})


def store_prefix(store, name: str, tokens: np.ndarray, pages: torch.Tensor, scope: Scope = Scope(MV)) -> None:
    store.put(tokens, pages, scope)
    keys = block_keys(tokens, scope, LAYOUT.block_size)
    store.save_manifest(name, {"kind": "prefix", "model_version": scope.model_version, "tokens": len(tokens),
                               "blocks": len(keys), "last_block_key": keys[-1].hex(), "pinned": True})


def test_export_then_import_on_stores(tmp_path):
    tokens, pages = tokens_of(40, 1), pages_of(10, 1)
    with make_store(tmp_path / "a") as a:
        store_prefix(a, "p", tokens, pages, Scope(MV, "team"))
        r = export_prefix(a, "p", tmp_path / "p.tkv")
        assert (r.blocks, r.tokens, r.namespace) == (10, 40, "team")
    with make_store(tmp_path / "b") as b:
        res = import_bundle(b, tmp_path / "p.tkv", name="q", model_version=MV)
        assert (res.stored, res.skipped, res.durable, res.name) == (10, 0, True, "q")
        with b.acquire(tokens, Scope(MV, "team")) as lease:
            assert torch.equal(lease.pages().view(torch.uint8), pages.view(torch.uint8))
        m = b.get_manifest("q")
        assert m["namespace"] == "team" and m["pinned"] and m["imported"]["name"] == "p"
        # Pinned in the bundle's manifest: imported as pinned.
        assert b.set_priority_from(bytes.fromhex(m["last_block_key"]), Priority.PINNED) == 10
        with pytest.raises(ModelVersionMismatchError):
            import_bundle(b, tmp_path / "p.tkv", name="r", model_version=OTHER_MV)
        assert import_bundle(b, tmp_path / "p.tkv", name="r", model_version=OTHER_MV, force=True).skipped == 10
        store_prefix(b, "taken", tokens_of(8, 2), pages_of(2, 2))
        with pytest.raises(BundleError, match="already named"):
            import_bundle(b, tmp_path / "p.tkv", name="taken")
        b.check_integrity()
    with make_store(tmp_path / "c", PageLayout(2, 2, 8, block_size=4)) as c:
        with pytest.raises(LayoutMismatchError):
            import_bundle(c, tmp_path / "p.tkv")
        assert c.stats()["blocks"] == 0


def test_export_of_a_prefix_larger_than_the_device_tier(tmp_path):
    # Export leases a window of blocks at a time (acquire start_block/max_blocks), so a
    # 10-block prefix exports through a 4-slot device tier, byte-identical.
    tokens, pages = tokens_of(40, 3), pages_of(10, 3)
    with make_store(tmp_path / "a", device_bytes=4 * LAYOUT.page_bytes) as a:
        store_prefix(a, "p", tokens, pages)
        r = export_prefix(a, "p", tmp_path / "p.tkv")
        assert r.blocks == 10
        assert a.stats()["leased_blocks"] == 0
        a.check_integrity()
    with make_store(tmp_path / "b") as b:
        assert import_bundle(b, tmp_path / "p.tkv", name="p").stored == 10
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
