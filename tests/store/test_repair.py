"""The index is a cache of the segments (issue 11, items 4 and 5).

Each disk slot carries its slot record, so a damaged or lost index is rebuilt from the
segments (``tierkv verify --repair``); a segment whose header is damaged is quarantined and
the rest of the home opens. All damage here is real: files deleted, truncated, bytes flipped.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tierkv import PageLayout, Priority, Scope
from tierkv.errors import IndexDamagedError, LayoutMismatchError
from tierkv.repair import rebuild_index
from tierkv.tiers.segments import SegmentHeader, read_header

from .kit import LAYOUT, MV1, MV2, SCOPE, assert_lease_exact, keys_of, open_store, put_chain, segment_files, slot_offset, toks

OPTS = dict(disk_bytes=64 * 4096, segment_pages=8)
CHAINS = [(toks(i, 1 + i % 4), Scope(MV1 if i % 3 else MV2, namespace=f"ns{i % 2}")) for i in range(14)]


def fill(home: Path, shm: Path) -> int:
    """Store CHAINS (several segments, two model versions, one chain pinned); returns blocks."""
    with open_store(home, shm_dir=shm, **OPTS) as store:
        for i, (t, scope) in enumerate(CHAINS):
            put_chain(store, t, scope, priority=Priority.PINNED if i == 3 else Priority.NORMAL)
        return store.stats()["blocks"]


def assert_all_served(home: Path, shm: Path, chains=CHAINS) -> None:
    with open_store(home, shm_dir=shm, **{**OPTS, "device_bytes": 8 * 1024}) as store:
        store.check_integrity()
        for t, scope in chains:
            with store.acquire(t, scope) as lease:
                assert lease.num_blocks == len(t) // 4, f"chain of {len(t) // 4} blocks: {lease.num_blocks} served"
                assert_lease_exact(lease)


def test_rebuild_after_the_index_is_deleted(tmp_path):
    home, shm = tmp_path / "home", tmp_path / "shm"
    blocks = fill(home, shm)
    shutil.rmtree(home / "index")
    with pytest.raises(IndexDamagedError, match="verify --repair"):
        open_store(home, shm_dir=shm, **OPTS)
    seen: list[tuple[int, int]] = []
    r = rebuild_index(home, progress=lambda d, t: seen.append((d, t)))
    assert r.rebuilt == blocks and r.corrupt == 0 and r.duplicates == 0 and r.moved_aside is None
    assert seen and seen[-1][0] == seen[-1][1]
    assert_all_served(home, shm)
    with open_store(home, shm_dir=shm, **OPTS) as store:  # the pinned chain is pinned again
        pinned = keys_of(*CHAINS[3])
        assert all(store.placement.table.get(k).priority == Priority.PINNED for k in pinned)


def test_rebuild_keeps_a_pin_made_after_the_write(tmp_path):
    home, shm = tmp_path / "home", tmp_path / "shm"
    fill(home, shm)
    t, scope = CHAINS[6]
    with open_store(home, shm_dir=shm, **OPTS) as store:
        store.set_priority(t, scope, Priority.PINNED)
    shutil.rmtree(home / "index")
    rebuild_index(home)
    with open_store(home, shm_dir=shm, **OPTS) as store:
        assert all(store.placement.table.get(k).priority == Priority.PINNED for k in keys_of(t, scope))
        assert store.placement.table.get(keys_of(*CHAINS[7])[0]).priority == Priority.NORMAL


def test_verify_repair_rebuilds_a_truncated_index(tmp_path):
    from tierkv.cli.ops import verify

    home, shm = tmp_path / "home", tmp_path / "shm"
    blocks = fill(home, shm)
    data = home / "index" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    out = CliRunner().invoke(verify, ["--home", str(home), "--json"])
    assert out.exit_code != 0 and "verify --repair" in str(out.exception or out.output)
    out = CliRunner().invoke(verify, ["--repair", "--home", str(home), "--json"])
    assert out.exit_code == 0, out.output + repr(out.exception)
    report = json.loads(out.output.strip().splitlines()[-1])
    assert report["ok"] and report["index_rebuilt"]["rebuilt"] == blocks and report["checked"] == blocks
    assert Path(report["index_rebuilt"]["moved_aside"]).is_dir()  # kept for inspection
    assert_all_served(home, shm)


def test_freed_slots_are_not_brought_back(tmp_path):
    home, shm = tmp_path / "home", tmp_path / "shm"
    gone, kept = (toks(1, 3), Scope(MV1, namespace="gone")), (toks(2, 3), Scope(MV1, namespace="kept"))
    with open_store(home, shm_dir=shm, **OPTS) as store:
        put_chain(store, *gone)
        put_chain(store, *kept)
        store.invalidate(namespace="gone")
    shutil.rmtree(home / "index")
    r = rebuild_index(home)
    assert r.rebuilt == 3 and r.skipped > 0
    with open_store(home, shm_dir=shm, **OPTS) as store:
        assert store.lookup(*gone).num_blocks == 0
        assert store.lookup(*kept).num_blocks == 3


def test_rebuild_leaves_out_a_corrupt_page(tmp_path):
    home, shm = tmp_path / "home", tmp_path / "shm"
    t, scope = CHAINS[5]
    with open_store(home, shm_dir=shm, **OPTS) as store:
        for c in CHAINS:
            put_chain(store, *c)
        blocks = store.stats()["blocks"]
        seg, off = slot_offset(store, keys_of(t, scope)[1])
    with open(seg, "r+b") as f:
        f.seek(off + 100)
        b = f.read(1)
        f.seek(off + 100)
        f.write(bytes([b[0] ^ 0x01]))
    shutil.rmtree(home / "index")
    r = rebuild_index(home)
    assert r.corrupt == 1 and r.rebuilt == blocks - 1
    with open_store(home, shm_dir=shm, **OPTS) as store:
        with store.acquire(t, scope) as lease:  # the chain ends before the bad block
            assert lease.num_blocks == 1
            assert_lease_exact(lease)
    assert_all_served(home, shm, [c for c in CHAINS if c != CHAINS[5]])


def test_rebuild_leaves_out_a_damaged_slot_record(tmp_path):
    home, shm = tmp_path / "home", tmp_path / "shm"
    with open_store(home, shm_dir=shm, **OPTS) as store:
        for c in CHAINS:
            put_chain(store, *c)
        blocks = store.stats()["blocks"]
    seg = segment_files(home)[0]
    h = read_header(seg)
    with open(seg, "r+b") as f:  # one byte inside the record of slot 2 (its parent key)
        f.seek(h.record_offset(2) + 60)
        b = f.read(1)
        f.seek(h.record_offset(2) + 60)
        f.write(bytes([b[0] ^ 0x40]))
    shutil.rmtree(home / "index")
    r = rebuild_index(home)
    assert r.corrupt == 1 and r.rebuilt == blocks - 1


@pytest.mark.parametrize("where", ["num_layers", "model_version", "segment_pages", "records", "data_offsets"])
def test_flipped_byte_in_a_segment_header_quarantines_that_segment(tmp_path, where):
    home, shm = tmp_path / "home", tmp_path / "shm"
    fill(home, shm)
    victim = segment_files(home)[1]
    raw = victim.read_bytes()[:4096]
    pos = raw.index(where.encode()) + len(where)
    while not chr(raw[pos]).isalnum():  # the first digit or letter of its value
        pos += 1
    with open(victim, "r+b") as f:
        f.seek(pos)
        f.write(bytes([raw[pos] ^ 0x01]))  # '2' -> '3', 'a' -> '`', ...
    with open_store(home, shm_dir=shm, **{**OPTS, "device_bytes": 8 * 1024}) as store:
        assert store.stats()["tiers"]["disk"]["quarantined_segments"] == 1
        assert victim.with_name(victim.name + ".bad").exists() and not victim.exists()
        served = 0
        for t, scope in CHAINS:
            with store.acquire(t, scope) as lease:
                assert_lease_exact(lease)  # never a wrong byte
                served += lease.num_blocks
        assert served >= sum(len(t) // 4 for t, _ in CHAINS) - 8  # only that segment's pages lost
        store.check_integrity()


def test_format_1_segments_stay_readable(tmp_path, monkeypatch):
    home, shm = tmp_path / "home", tmp_path / "shm"
    import tierkv.tiers.disk as disk

    monkeypatch.setattr(disk, "SegmentHeader", functools.partial(SegmentHeader, format_version=1))
    blocks = fill(home, shm)
    monkeypatch.undo()
    assert {read_header(p).format_version for p in segment_files(home)} == {1}
    assert_all_served(home, shm)  # written by an older tierkv, read by this one
    shutil.rmtree(home / "index")
    r = rebuild_index(home)
    assert r.rebuilt == 0 and r.unrecoverable >= blocks


def test_page_sized_slots_carry_records_too(tmp_path):
    """A page that is a 4 KiB multiple leaves no slack in its slot: records live apart."""
    from tierkv import PageLayout

    import tierkv

    layout = PageLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=4)  # 16 KiB pages
    assert layout.page_bytes == layout.slot_bytes
    home, shm = tmp_path / "home", tmp_path / "shm"
    import torch

    page = layout.page_bytes
    opts = dict(device="cpu", device_bytes=8 * page, host_bytes=8 * page, disk_bytes=64 * page, segment_pages=16,
                shm_dir=shm)
    t = toks(3, 5)
    pages = torch.randn(5, *layout.shape)
    with tierkv.open(home, layout, **opts) as store:
        store.put(t, pages, SCOPE)
    shutil.rmtree(home / "index")
    assert rebuild_index(home).rebuilt == 5
    with tierkv.open(home, layout, **opts) as store:
        with store.acquire(t, SCOPE) as lease:
            assert lease.num_blocks == 5
            for i in range(5):
                assert torch.equal(lease.page(i), pages[i])


# ---- the layout comes from a record, never a vote (issue #34, item 7) ------------------------
FOREIGN = PageLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)  # block size as LAYOUT's


def _plant_foreign_segments(store_dir: Path, tmp_path: Path, shm: Path, n: int = 2) -> list[Path]:
    """Copy ``n`` segments of another layout into ``store_dir``'s segments, numbered after its own."""
    other = tmp_path / "foreign"
    with open_store(other, FOREIGN, shm_dir=shm, **OPTS) as store:
        for i in range(n):
            put_chain(store, toks(100 + i, 8), Scope(MV2))  # 8 blocks: one full segment each
    planted = []
    top = max(int(p.name[4:10]) for p in segment_files(store_dir))
    for i, seg in enumerate(segment_files(other)[:n]):
        to = store_dir / "segments" / f"seg-{top + 1 + i:06d}.safetensors"
        shutil.copyfile(seg, to)
        planted.append(to)
    assert [read_header(p).layout for p in planted] == [FOREIGN] * n
    return planted


def _one_segment(store_dir: Path, shm: Path, layout: PageLayout = LAYOUT) -> list[tuple[list[int], Scope]]:
    chains = [(toks(7, 3), Scope(MV1, namespace="own"))]
    with open_store(store_dir, layout, shm_dir=shm, **OPTS) as store:
        for t, scope in chains:
            put_chain(store, t, scope)
    assert len(segment_files(store_dir)) == 1
    return chains


def test_repair_takes_the_layout_from_the_index_not_a_majority_of_segments(tmp_path):
    """One own segment beside two foreign ones: the vote rebuilt the home as the foreign
    layout, renamed its own segment .bad, and the home no longer opened."""
    home, shm = tmp_path / "home", tmp_path / "shm"
    chains = _one_segment(home, shm)
    planted = _plant_foreign_segments(home, tmp_path, shm)
    r = rebuild_index(home)  # the index still records the layout
    assert json.loads(r.layout) == json.loads(LAYOUT.to_json()) and r.rebuilt == 3 and r.quarantined_segments == 2
    assert all(p.with_name(p.name + ".bad").exists() for p in planted)
    assert_all_served(home, shm, chains)


def test_repair_of_a_root_store_without_its_index_refuses_disagreeing_segments(tmp_path):
    """No index records the layout and the segments disagree: refused, nothing renamed."""
    home, shm = tmp_path / "home", tmp_path / "shm"
    chains = _one_segment(home, shm)
    planted = _plant_foreign_segments(home, tmp_path, shm)
    shutil.rmtree(home / "index")
    before = sorted(p.name for p in (home / "segments").iterdir())
    with pytest.raises(LayoutMismatchError, match="refusing to guess") as exc:
        rebuild_index(home)
    assert "move the segments" in exc.value.hint
    assert sorted(p.name for p in (home / "segments").iterdir()) == before and not (home / "index").exists()
    for p in planted:  # the operator moves the foreign ones out, as the hint says: then it rebuilds
        p.rename(tmp_path / p.name)
    assert rebuild_index(home).rebuilt == 3
    assert_all_served(home, shm, chains)


def test_verify_repair_of_a_daemon_layout_takes_it_from_the_directory_name(tmp_path):
    """HOME/layouts/<id> whose index is damaged: its layout is the directory's name."""
    from tierkv.cli import main
    from tierkv.home.directory import LAYOUTS_DIR, layout_id

    home, shm = tmp_path / "home", tmp_path / "shm"
    _one_segment(home, shm, FOREIGN)  # the root store: another layout, as a daemon serving two models makes
    sub = home / LAYOUTS_DIR / layout_id(LAYOUT)
    chains = _one_segment(sub, shm)
    planted = _plant_foreign_segments(sub, tmp_path, shm)
    data = sub / "index" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    r = CliRunner().invoke(main, ["verify", "--repair", "--home", str(home), "--json"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    rebuilt = out["layouts_rebuilt"][f"{LAYOUTS_DIR}/{layout_id(LAYOUT)}"]
    assert json.loads(rebuilt["layout"]) == json.loads(LAYOUT.to_json()) and rebuilt["rebuilt"] == 3
    assert rebuilt["quarantined_segments"] == 2 and all(p.with_name(p.name + ".bad").exists() for p in planted)
    assert_all_served(sub, shm, chains)
