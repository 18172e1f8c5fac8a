"""Tier budgets are daemon-wide and shared by the layouts in use (issue 10, item 3): one
layout alone may fill every budget; when a second opens, the first evicts down to half and
gives the memory above its limit back; a block held when its limit drops stays until
released, and then goes. Before: each layout got a fixed ``budget // max_layouts`` when it
opened, so a daemon serving one model used a quarter of its memory."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from click.testing import CliRunner

import tierkv
from tierkv import PageLayout, Scope
from tierkv.cli import main
from tierkv.home.directory import layout_id

from helpers.daemons import DaemonThread
from daemon_helpers import LAYOUT, MiB, SCOPE, make_config, pages_for, prompt, wait_for

OTHER = PageLayout(num_layers=3, num_kv_heads=1, head_dim=32, block_size=32, dtype="bfloat16")
SCOPE_B = Scope("cd" * 32, "tenant-b")
A, B = layout_id(LAYOUT), layout_id(OTHER)
PAGE = LAYOUT.page_bytes  # 8 KiB: the device budget (1 MiB) holds 128 pages, the host (2 MiB) 256


def stats_json(sock: Path) -> dict:
    r = CliRunner().invoke(main, ["stats", "--socket", str(sock), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def touched(path: str) -> int:
    """Bytes of a shared-memory file that hold memory (a sparse file's allocated blocks)."""
    return os.stat(path).st_blocks * 512


def fill(client, n_puts: int, seed: int) -> list:
    """``n_puts`` prompts of 4 blocks each; returns their tokens."""
    toks = [prompt(64, seed=seed + i) for i in range(n_puts)]
    for i, t in enumerate(toks):
        assert client.put(t, pages_for(4, seed + i), SCOPE).stored == 4
    return toks


def test_one_layout_uses_every_budget_and_halves_when_a_second_opens(workdir):
    cfg = make_config(workdir, layout=None, max_layouts=4)
    d = DaemonThread(cfg).start()
    try:
        with tierkv.connect(cfg.socket, layout=LAYOUT) as a:
            toks = fill(a, 150, seed=100)  # 600 pages: more than any share but the whole holds
            s = stats_json(cfg.socket)
            tiers = s["layouts"][A]["tiers"]
            # The one layout in use may use each whole budget, and does. (On a CUDA host the
            # host pool is page-locked, which touches all of it: it keeps 1/max_layouts.)
            host_alone = cfg.host_bytes // 4 if torch.cuda.is_available() else cfg.host_bytes
            assert tiers["device"]["capacity_bytes"] == cfg.device_bytes
            assert tiers["host"]["capacity_bytes"] == host_alone
            assert tiers["disk"]["capacity_bytes"] == cfg.disk_bytes
            assert tiers["device"]["used_bytes"] == cfg.device_bytes > cfg.device_bytes // 4
            assert tiers["host"]["used_bytes"] > host_alone // 2
            assert tiers["disk"]["blocks"] == 600 > cfg.disk_bytes // 2 // PAGE
            dev_a, host_a = tiers["device"]["shm_path"], tiers["host"]["shm_path"]
            assert touched(dev_a) <= cfg.device_bytes and touched(host_a) <= cfg.host_bytes

            with tierkv.connect(cfg.socket, layout=OTHER) as b:
                s = stats_json(cfg.socket)
                ta, tb = s["layouts"][A]["tiers"], s["layouts"][B]["tiers"]
                for t, budget in (("device", cfg.device_bytes), ("host", cfg.host_bytes), ("disk", cfg.disk_bytes)):
                    assert ta[t]["capacity_bytes"] <= budget // 2 and tb[t]["capacity_bytes"] <= budget // 2, t
                    assert ta[t]["used_bytes"] <= ta[t]["capacity_bytes"], t  # evicted down to its share
                    assert s["tiers"][t]["capacity_bytes"] <= budget, t
                assert ta["device"]["capacity_bytes"] == cfg.device_bytes // 2
                # ... and the memory above its limit is given back.
                assert touched(dev_a) <= cfg.device_bytes // 2 and touched(host_a) <= cfg.host_bytes // 2
                assert ta["disk"]["segments"] <= ta["disk"]["limit_segments"] == 2
                # The second layout fills its half; together they stay within the budgets.
                for i in range(60):
                    t = prompt(128, seed=500 + i)
                    g = torch.Generator().manual_seed(i)
                    assert b.put(t, torch.randn((4, *OTHER.shape), generator=g).to(OTHER.torch_dtype),
                                 SCOPE_B).stored == 4
                s = stats_json(cfg.socket)
                tb = s["layouts"][B]["tiers"]
                assert tb["device"]["used_bytes"] > 0
                assert touched(dev_a) + touched(tb["device"]["shm_path"]) <= cfg.device_bytes
                assert touched(host_a) + touched(tb["host"]["shm_path"]) <= cfg.host_bytes
                assert s["daemon"]["budgets"]["device_bytes"] == cfg.device_bytes
                # What the first layout kept is served exactly; what it lost is a miss.
                hits = 0
                for i, t in enumerate(toks):
                    with a.acquire(t, SCOPE) as lease:
                        if lease.num_blocks:
                            hits += 1
                            assert torch.equal(lease.pages(), pages_for(4, 100 + i)[: lease.num_blocks])
                assert 0 < hits < len(toks)
                d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_a_block_leased_when_its_limit_drops_stays_until_released(workdir):
    cfg = make_config(workdir, layout=None, max_layouts=2, lease_timeout_s=60.0)
    d = DaemonThread(cfg).start()
    try:
        with tierkv.connect(cfg.socket, layout=LAYOUT) as a:
            toks = fill(a, 30, seed=200)  # 120 device slots, lowest first: the last put holds 116..119
            lease = a.acquire(toks[-1], SCOPE)
            assert lease.num_blocks == 4 and min(lease.slots) >= cfg.device_bytes // 2 // PAGE
            with tierkv.connect(cfg.socket, layout=OTHER):
                s = stats_json(cfg.socket)
                ta = s["layouts"][A]["tiers"]["device"]
                assert ta["capacity_bytes"] == cfg.device_bytes // 2
                # The leased blocks stay where they are (their pages are being read) and
                # count against the limit; the others above it moved below or went.
                assert s["daemon"]["over_limit_slots"] == {A: 4}
                assert ta["used_bytes"] == cfg.device_bytes // 2
                assert torch.equal(lease.pages(), pages_for(4, 229))
                fill(a, 10, seed=300)
                assert stats_json(cfg.socket)["layouts"][A]["tiers"]["device"]["used_bytes"] <= ta["used_bytes"]
                lease.release()
                # The daemon retries every second: released, they go, and so does their memory.
                assert wait_for(lambda: not stats_json(cfg.socket)["daemon"]["over_limit_slots"], timeout=10)
                ta = stats_json(cfg.socket)["layouts"][A]["tiers"]["device"]
                assert ta["used_bytes"] <= ta["capacity_bytes"]
                assert touched(ta["shm_path"]) <= cfg.device_bytes // 2
                assert a.lookup(toks[-1], SCOPE).tokens_matched == 64  # still on disk
                d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_set_tier_limits_evicts_leaf_first_keeps_pins_and_grows_back(workdir):
    """The store method the daemon uses: disk pages above a lowered limit go (index first),
    extensions before their prefix, a pinned chain stays; raising the limit lets the tier
    fill again."""
    from tierkv import Priority

    seg = 16  # pages a segment: the disk tier has 4; the device tier holds 4 pages
    with tierkv.open(workdir / "home", LAYOUT, device="cpu", device_bytes=4 * PAGE, host_bytes=0,
                     disk_bytes=64 * PAGE, segment_pages=seg, shm_dir=workdir / "shm") as st:
        long = prompt(16 * 40, seed=1)  # one chain of 40 blocks: segments 0, 1 and half of 2
        assert st.put(long, pages_for(40, 1), SCOPE).stored == 40
        pinned = prompt(16 * 8, seed=2)  # 8 pinned blocks: the rest of segment 2
        assert st.put(pinned, pages_for(8, 2), SCOPE, priority=Priority.PINNED).stored == 8
        assert st.set_tier_limits(disk_bytes=2 * seg * PAGE) == 8  # the pins stay above the limit
        s = st.stats().as_dict()["tiers"]["disk"]
        # The pins count against the limit: the chain gives up its tail (leaf first) to 24.
        assert s["capacity_bytes"] == 2 * seg * PAGE and s["blocks"] == 24 + 8
        assert st.lookup(long, SCOPE).tokens_matched == 16 * 24  # the prefix kept, its tail evicted
        assert st.lookup(pinned, SCOPE).tokens_matched == 16 * 8
        st.check_integrity()
        # No new page goes above the limit: a new chain finds room only by evicting below it.
        other = prompt(16 * 4, seed=3)
        st.put(other, pages_for(4, 3), SCOPE)
        assert st.stats().as_dict()["tiers"]["disk"]["segments"] <= 3
        st.set_priority(pinned, SCOPE, Priority.NORMAL)  # unpinned: the retry takes them
        assert st.set_tier_limits() == 0
        assert st.lookup(pinned, SCOPE).tokens_matched == 0
        assert st.set_tier_limits(disk_bytes=64 * PAGE) == 0
        assert st.put(prompt(16 * 20, seed=4), pages_for(20, 4), SCOPE).stored == 20
        assert st.stats().as_dict()["tiers"]["disk"]["blocks"] > 32
        st.check_integrity()


def test_a_region_is_populated_up_to_its_bound_and_gives_back_what_is_discarded(workdir):
    """What keeps a share's memory within it: the background populator stops at the bound
    (raised: it goes on; lowered: it stops), and a discarded range holds no memory."""
    from tierkv.tiers.shm import SharedRegion

    r = SharedRegion.create(workdir, "tierkv-host", 8 * MiB, populate_bytes=2 * MiB)
    try:
        assert wait_for(lambda: touched(str(r.path)) == 2 * MiB, timeout=10)
        r.set_populate_end(6 * MiB)
        assert wait_for(lambda: touched(str(r.path)) == 6 * MiB, timeout=10)
        r.set_populate_end(1 * MiB)  # lowered: nothing more is faulted in ...
        assert r.discard(1 * MiB, 7 * MiB)  # ... and what was, above it, is given back
        assert touched(str(r.path)) == 1 * MiB
        r.set_populate_end(3 * MiB)
        assert wait_for(lambda: touched(str(r.path)) == 3 * MiB, timeout=10)
    finally:
        r.close()


def test_a_lowered_memory_limit_moves_blocks_below_it_instead_of_dropping_chains(workdir):
    """Blocks above a lowered host limit move to free slots below it, bytes intact. Before
    (evicting by position only): each block above the limit took its chain's extensions
    below it along, and a full host tier halved kept a quarter."""
    with tierkv.open(workdir / "home", LAYOUT, device="cpu", device_bytes=8 * PAGE, host_bytes=128 * LAYOUT.slot_bytes,
                     disk_bytes=8 * MiB, shm_dir=workdir / "shm") as st:
        chains = [prompt(16 * 8, seed=600 + i) for i in range(20)]  # 160 pages: host full, the rest on disk
        for i, t in enumerate(chains):
            st.put(t, pages_for(8, 600 + i), SCOPE)
        assert st.stats().as_dict()["tiers"]["host"]["blocks"] == 128
        assert st.set_tier_limits(host_bytes=64 * LAYOUT.slot_bytes) == 0
        host = st.stats().as_dict()["tiers"]["host"]
        assert host["blocks"] == 64 and max(st.host.slots.used_slots()) < 64
        st.check_integrity()
        for i, t in enumerate(chains):  # every chain whole (host, device or disk) and exact
            with st.acquire(t, SCOPE) as lease:
                assert lease.num_blocks == 8 and torch.equal(lease.pages(), pages_for(8, 600 + i))


def test_an_idle_layout_gives_its_memory_share_to_the_one_in_use_and_gets_it_back(workdir):
    """Budgets are shared by the layouts in use (issue 34, item 3: idle junk layouts held
    three quarters of every tier for good). A layout no client used for layout_idle_s gives
    its device and host share to the one in use and keeps its disk share and blocks; a
    client that declares it gets its half back before its HELLO is answered."""
    cfg = make_config(workdir, layout=None, max_layouts=2, layout_idle_s=1.0)
    d = DaemonThread(cfg).start()
    host = cfg.host_bytes // 2 if torch.cuda.is_available() else cfg.host_bytes  # page-locked: fixed shares
    try:
        with tierkv.connect(cfg.socket, layout=OTHER) as b:
            toks_b = [prompt(128, seed=700 + i) for i in range(8)]
            pages_b = [torch.randn((4, *OTHER.shape), generator=torch.Generator().manual_seed(i)).to(OTHER.torch_dtype)
                       for i in range(8)]
            for t, p in zip(toks_b, pages_b):
                assert b.put(t, p, SCOPE_B).stored == 4
        with tierkv.connect(cfg.socket, layout=LAYOUT) as a:
            caps = lambda lid: {t: v["capacity_bytes"] for t, v in stats_json(cfg.socket)["layouts"][lid]["tiers"].items()}
            assert caps(A)["device"] == cfg.device_bytes // 2  # two layouts open, B not idle yet
            dev_b, disk_b = caps(B)["device"], caps(B)["disk"]  # its halves, in whole pages / segments
            # B unused for a second: A gets every memory budget, B keeps half the disk.
            assert wait_for(lambda: caps(A)["device"] == cfg.device_bytes, timeout=10)
            assert caps(A)["host"] == host and caps(A)["disk"] == cfg.disk_bytes // 2
            assert caps(B)["device"] == 0 and caps(B)["disk"] == disk_b > 0
            toks = fill(a, 40, seed=300)  # 160 pages: more than half the device tier
            assert stats_json(cfg.socket)["layouts"][A]["tiers"]["device"]["used_bytes"] > cfg.device_bytes // 2
            d.call(d.daemon.check_integrity)
            with tierkv.connect(cfg.socket, layout=OTHER) as b:  # B declared again: its share back
                assert caps(B)["device"] == dev_b > 0 and caps(A)["device"] == cfg.device_bytes // 2
                for t, p in zip(toks_b, pages_b):  # its blocks were kept (on disk), exact
                    with b.acquire(t, SCOPE_B) as lease:
                        assert lease.num_blocks == 4 and torch.equal(lease.pages(), p)
                for i, t in enumerate(toks[-8:]):
                    with a.acquire(t, SCOPE) as lease:
                        assert lease.num_blocks == 4 and torch.equal(lease.pages(), pages_for(4, 300 + 32 + i))
                d.call(d.daemon.check_integrity)
    finally:
        d.stop()
