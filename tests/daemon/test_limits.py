"""Per-connection quotas and limits, concurrent use of one client, and cleanup of a client
that dies between staging and commit."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

import tierkv
from tierkv import PageLayout
from tierkv.daemon import messages as m
from tierkv.daemon.protocol import Op, encode_frame, read_frame_sync
from tierkv.errors import CapacityError, DaemonUnavailableError

from helpers.daemons import DaemonThread
from daemon_helpers import SCOPE, make_config, pages_for, prompt, wait_for


def test_one_client_shared_by_threads(daemon):
    with tierkv.connect(daemon.config.socket) as c:
        data = [(prompt(64, seed=50 + i), pages_for(4, 50 + i)) for i in range(4)]
        for toks, pages in data:
            c.put(toks, pages, SCOPE)
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                for j in range(20):
                    toks, pages = data[(k + j) % 4]
                    assert c.lookup(toks, SCOPE).tokens_matched == 64
                    with c.acquire(toks, SCOPE) as lease:
                        assert torch.equal(lease.pages(), pages)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        assert c.stats()["leased_blocks"] == 0
        c.check_integrity()


def test_staging_quota_and_region_exhaustion_are_capacity_errors(daemon):
    with tierkv.connect(daemon.config.socket) as c, tierkv.connect(daemon.config.socket) as d:
        with pytest.raises(CapacityError, match="quota"):
            c._transport.call(Op.STAGE, m.Stage(c.stage_quota + 1))
        held = [c._transport.call(Op.STAGE, m.Stage(c.stage_quota))["slots"]]
        held += [d._transport.call(Op.STAGE, m.Stage(d.stage_quota))["slots"]]
        with tierkv.connect(daemon.config.socket) as e, tierkv.connect(daemon.config.socket) as f:
            e._transport.call(Op.STAGE, m.Stage(e.stage_quota))
            f._transport.call(Op.STAGE, m.Stage(f.stage_quota))  # 4 x 8 = all 32 slots of the region
            with tierkv.connect(daemon.config.socket) as g, pytest.raises(CapacityError, match="no 1 staging"):
                g._transport.call(Op.STAGE, m.Stage(1))  # within g's quota, but the region is full
        # e and f closed: their slots came back; c gives its own back by UNSTAGE.
        c._transport.call(Op.UNSTAGE, m.Unstage(tuple(held[0])))
        assert c.stats()["daemon"]["staging_slots_used"] == d.stage_quota
        assert c.put(prompt(32, seed=60), pages_for(2, 60), SCOPE).stored == 2


def test_a_client_dying_between_stage_and_commit_frees_its_slots(daemon):
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(daemon.config.socket))
    s.sendall(encode_frame(Op.STAGE, 1, {"count": 4}))
    assert len(read_frame_sync(s).header["slots"]) == 4
    with tierkv.connect(daemon.config.socket) as c:
        assert c.stats()["daemon"]["staging_slots_used"] == 4
        s.close()
        assert wait_for(lambda: c.stats()["daemon"]["staging_slots_used"] == 0)


def test_connection_limit(workdir):
    d = DaemonThread(make_config(workdir, max_connections=2)).start()
    try:
        with tierkv.connect(d.config.socket), tierkv.connect(d.config.socket):
            with pytest.raises(DaemonUnavailableError):
                tierkv.connect(d.config.socket)
        with tierkv.connect(d.config.socket) as c:
            c.check_integrity()
    finally:
        d.stop()


def test_put_waits_for_staging_held_by_others(daemon):
    with tierkv.connect(daemon.config.socket) as c:
        others = [tierkv.connect(daemon.config.socket) for _ in range(4)]
        held = [o._transport.call(Op.STAGE, m.Stage(o.stage_quota))["slots"] for o in others]  # the region is full
        threading.Timer(0.3, others[0].close).start()  # one frees its 8 slots a little later
        toks, pages = prompt(20 * 16, seed=70), pages_for(20, 70)
        r = c.put(toks, pages, SCOPE)
        assert (r.stored, r.skipped) == (20, 0) and held
        with c.acquire(toks, SCOPE) as lease:
            assert torch.equal(lease.pages(), pages)
        for o in others[1:]:
            o.close()


# ---- reply sizes (issue 11, item 9) ----------------------------------------------------------
SMALL_LAYOUT = PageLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype="float32")


def test_lookup_and_acquire_of_8192_blocks(workdir):
    """A LOOKUP of 8,000+ blocks failed: its per-block tier list overflowed the 64 KiB
    header. Per-block values now travel in the payload."""
    n = 8192
    page = SMALL_LAYOUT.page_bytes
    d = DaemonThread(make_config(workdir, layout=SMALL_LAYOUT, device_bytes=(n + 64) * page, host_bytes=0,
                                 disk_bytes=(n + 64) * SMALL_LAYOUT.slot_bytes, staging_bytes=1024 * page,
                                 client_staging_bytes=1024 * page)).start()
    try:
        toks = prompt(n * 16, seed=80)
        pages = torch.randn((n, *SMALL_LAYOUT.shape))
        with tierkv.connect(d.config.socket) as c:
            assert c.put(toks, pages, SCOPE).stored == n
            r = c.lookup(toks, SCOPE)
            assert r.tokens_matched == n * 16 and len(r.keys) == n and len(r.tiers) == n
            assert set(r.tiers) <= {"device", "host", "disk"}
            with c.acquire(toks, SCOPE) as lease:
                assert lease.num_blocks == n and len(set(lease.slots)) == n
                assert torch.equal(lease.page(n - 1), pages[n - 1])
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_stats_larger_than_a_frame_header(workdir):
    """stats failed for everyone once there were 3,000 namespaces: the reply header passed
    64 KiB. The same overflow with fewer, longer names (400 x 200 characters, ~90 KB of
    namespaces) keeps the test quick; the stats JSON now travels in the payload."""
    from tierkv import Scope

    n = 400
    home = workdir / "home"
    with tierkv.open(home, SMALL_LAYOUT, device="cpu", device_bytes=64 * SMALL_LAYOUT.page_bytes, host_bytes=0,
                     disk_bytes=2 * n * SMALL_LAYOUT.slot_bytes, write_through=False, shm_dir=workdir / "shm") as s:
        toks = prompt(16, seed=81)
        page = torch.randn((1, *SMALL_LAYOUT.shape))
        for i in range(n):
            s.put(toks, page, Scope(SCOPE.model_version, f"{i:06d}-" + "n" * 193))
    d = DaemonThread(make_config(workdir, layout=SMALL_LAYOUT, disk_bytes=2 * n * SMALL_LAYOUT.slot_bytes)).start()
    try:
        with tierkv.connect(d.config.socket) as c:
            st = c.stats()
            assert len(st["namespaces"]) == n and st["blocks"] == n
            assert sum(len(k) for k in st["namespaces"]) > 64 * 1024
    finally:
        d.stop()


def _pages(api, limit):
    """Every page of ``api.stats`` at ``limit`` namespaces a page."""
    pages, after = [], None
    while True:
        st = api.stats(namespace_limit=limit, namespace_after=after)
        pages.append(st)
        after = st.namespaces_next
        if after is None:
            return pages


def test_stats_pages_bound_the_namespaces_of_a_reply(workdir):
    """With 2,500 namespaces (more than two default pages) the daemon's stats reply carries
    at most a page of them; the pages, joined, are every namespace once, and `tierkv stats`
    and `tierkv ls` still print all of them."""
    import json

    from click.testing import CliRunner

    from tierkv import Scope
    from tierkv.cli import main
    from tierkv.results import DEFAULT_STATS_NAMESPACES

    n = 2500
    names = {f"ns{i:05d}" for i in range(n)}
    home = workdir / "home"
    with tierkv.open(home, SMALL_LAYOUT, device="cpu", device_bytes=64 * SMALL_LAYOUT.page_bytes, host_bytes=0,
                     disk_bytes=2 * n * SMALL_LAYOUT.slot_bytes, write_through=False, shm_dir=workdir / "shm") as s:
        toks = prompt(16, seed=82)
        page = torch.randn((1, *SMALL_LAYOUT.shape))
        for ns in names:
            s.put(toks, page, Scope(SCOPE.model_version, ns))
        assert len(s.stats().namespaces) == n and s.stats().namespaces_next is None  # embedded: all by default
        pages = _pages(s, 1000)
        assert [len(p.namespaces) for p in pages] == [1000, 1000, 500]
        joined = [ns for p in pages for ns in p.namespaces]
        assert joined == sorted(names) and all(p.blocks == n for p in pages)
        with pytest.raises(ValueError):
            s.stats(namespace_limit=0)
    d = DaemonThread(make_config(workdir, layout=SMALL_LAYOUT, disk_bytes=2 * n * SMALL_LAYOUT.slot_bytes)).start()
    try:
        with tierkv.connect(d.config.socket) as c:
            st = c.stats()
            assert len(st.namespaces) == DEFAULT_STATS_NAMESPACES and st.namespaces_next == max(st.namespaces)
            assert st.blocks == n and st["namespaces_next"] == st.namespaces_next
            assert all(len(ls["namespaces"]) <= DEFAULT_STATS_NAMESPACES for ls in st["layouts"].values())
            pages = _pages(c, 700)
            assert all(len(p.namespaces) <= 700 for p in pages) and len(pages) == 4
            joined = [ns for p in pages for ns in p.namespaces]
            assert joined == sorted(names) and all(p.blocks == n for p in pages)
            assert "namespaces_next" not in pages[-1].as_dict()
            assert c.stats(namespace_after=max(names)).namespaces == {}
            with pytest.raises(ValueError):
                c.stats(namespace_limit=-1)
        for cmd in ("stats", "ls"):
            r = CliRunner().invoke(main, [cmd, "--socket", str(d.config.socket), "--json"])
            assert r.exit_code == 0, r.output
            out = json.loads(r.output)
            assert set(out["namespaces"]) == names and "namespaces_next" not in out
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
