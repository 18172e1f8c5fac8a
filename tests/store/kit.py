"""Shared helpers for the store tests: a tiny layout, deterministic tokens and pages, and
helpers that look inside a store (which blocks sit in which tier)."""
from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any, Sequence

import torch

import tierkv
from tierkv import PageLayout, Scope
from tierkv.identity import block_keys
from tierkv.core.store import Store
from tierkv.tiers import TierName

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
BS = LAYOUT.block_size
PAGE = LAYOUT.page_bytes  # 1024: what a device slot holds
SLOT = LAYOUT.slot_bytes  # 4096: a host or disk slot (padded to 4 KiB)
MV1 = hashlib.sha256(b"tiny-model v1").hexdigest()
MV2 = hashlib.sha256(b"tiny-model v2").hexdigest()
SCOPE = Scope(MV1)

DEFAULTS: dict[str, Any] = dict(
    device="cpu", device_bytes=4 * PAGE, host_bytes=4 * SLOT, disk_bytes=32 * SLOT, segment_pages=4,
)


def open_store(home: Path, layout: PageLayout | None = None, **options: Any) -> Store:
    return tierkv.open(home, layout or LAYOUT, **{**DEFAULTS, **options})


def toks(seed: int, n_blocks: int, extra: int = 0) -> list[int]:
    """``n_blocks`` full blocks (plus ``extra`` tokens) of pseudo-random token ids."""
    rng = random.Random(seed)
    return [rng.randrange(0, 50_000) for _ in range(n_blocks * BS + extra)]


# A layout whose page is exactly 4 KiB (block size 4, as LAYOUT's): a put writes its pages to
# disk straight from its device slots (tierkv/core/ingest.py), where LAYOUT's 1 KiB pages are
# copied into staging buffers first.
LAYOUT_4K = PageLayout(num_layers=2, num_kv_heads=4, head_dim=16, block_size=4)
assert LAYOUT_4K.page_bytes == LAYOUT_4K.slot_bytes == 4096


def page_for(key: bytes, layout: PageLayout = LAYOUT) -> torch.Tensor:
    """The page every test stores under ``key``: a pure function of the key, so a checker
    in another process (or after a crash) knows the expected bytes."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    return torch.randn(layout.shape, generator=g)


def pages_for(tokens: Sequence[int], scope: Scope = SCOPE, start: int = 0, n: int | None = None,
              block_extra: Any = None, layout: PageLayout = LAYOUT) -> torch.Tensor:
    keys = block_keys(tokens, scope, BS, block_extra)
    n = len(keys) - start if n is None else n
    if n <= 0:
        return torch.empty((0, *layout.shape), dtype=layout.torch_dtype)
    return torch.stack([page_for(k, layout) for k in keys[start : start + n]])


def put_chain(store: Store, tokens: Sequence[int], scope: Scope = SCOPE, **kw: Any) -> tierkv.PutResult:
    return store.put(tokens, pages_for(tokens, scope, layout=store.layout), scope, **kw)


def keys_of(tokens: Sequence[int], scope: Scope = SCOPE) -> list[bytes]:
    return block_keys(tokens, scope, BS)


def tier_keys(store: Store) -> dict[str, set[bytes]]:
    """Which blocks each tier holds right now."""
    out: dict[str, set[bytes]] = {t.value: set() for t in TierName}
    with store.placement.lock:
        for b in store.placement.table.blocks.values():
            for t in b.loc:  # keyed by the tier's name (a plain str: see tierkv.core.blocks.Block)
                out[TierName(t).value].add(b.key)
    return out


def tier_counts(store: Store) -> dict[str, int]:
    tiers = store.stats()["tiers"]
    return {t: tiers[t]["blocks"] for t in ("device", "host", "disk")}


def assert_lease_exact(lease: tierkv.Lease) -> None:
    """Every leased page is exactly the page stored under its key (never wrong bytes)."""
    for i, key in enumerate(lease.keys):
        assert torch.equal(lease.page(i), page_for(key, lease.layout)), f"wrong bytes for block {i}"


def assert_prefix_order(store: Store) -> None:
    """Leaf first, tier by tier: a block held in a tier has its prefix in that tier or a
    faster one (device < host < disk), whenever the prefix is cached at all."""
    order = {TierName.DEVICE: 0, TierName.HOST: 1, TierName.DISK: 2}
    with store.placement.lock:
        for b in store.placement.table.blocks.values():
            parent = store.placement.table.get(b.parent)
            if parent is None:
                continue
            for t in b.loc:
                assert any(order[pt] <= order[t] for pt in parent.loc), (
                    f"block in {t} whose prefix sits only in {list(parent.loc)}"
                )


def flip_byte(path: Path, offset: int) -> None:
    """Flip one bit of the byte at ``offset`` of ``path`` (a page's damage on disk)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def segment_files(home: Path) -> list[Path]:
    return sorted((home / "segments").glob("seg-*.safetensors"))


def slot_offset(store: Store, key: bytes) -> tuple[Path, int]:
    """(segment file, byte offset of the page) of a disk-resident block, computed from the
    segment header: data_offset + index * slot_bytes."""
    from tierkv.tiers.disk import split_location
    from tierkv.tiers.segments import read_header

    with store.placement.lock:
        loc = store.placement.table.get(key).loc[TierName.DISK]
    seg_id, index = split_location(loc)
    path = store.config.home / "segments" / f"seg-{seg_id:06d}.safetensors"
    return path, read_header(path).data_offset + index * store.layout.slot_bytes


def hot_between_one_offs(n: int) -> list:
    """A 4-block prefix every third request, one-off 4-block requests between: LRU loses the
    prefix to every pair of one-offs, LRU-2 keeps it (the eviction policies' tests)."""
    from tierkv.traces import Request

    out, u = [], 100
    for i in range(n):
        if i % 3 == 0:
            out.append(Request(tuple(range(4)), 4 * 512))
        else:
            out.append(Request(tuple(range(u, u + 4)), 4 * 512))
            u += 10
    return out


def random_tree_trace(rng: random.Random, n: int) -> list:
    """``n`` requests of six conversations whose histories grow and are sometimes re-read in
    part: a small prefix-tree trace for tierkv.traces' simulators (block ids, not tokens)."""
    from tierkv.traces import Request

    convs: dict[int, list[int]] = {}
    trace, nxt = [], 1000
    for _ in range(n):
        c = rng.randrange(6)
        h = convs.get(c, [c])
        if rng.random() < 0.5 and len(h) < 12:
            h = h + list(range(nxt, nxt + rng.randint(1, 3)))
            nxt += 5
        convs[c] = h
        ids = h[: rng.randint(1, len(h))] if rng.random() < 0.3 else h
        trace.append(Request(tuple(ids), len(ids) * 512))
    return trace
