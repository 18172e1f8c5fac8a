"""One daemon serves every model on the host: it starts on an empty home with no layout,
opens a store per layout a client declares, splits the tier budgets among them, answers
operations across them, and keeps them across a restart."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import tierkv
from tierkv import PageLayout, Priority, Scope
from tierkv.cli import main
from tierkv.home.directory import LAYOUTS_DIR, layout_id
from tierkv.errors import CapacityError, ConfigError, DaemonOwnsHomeError

from helpers.daemons import DaemonThread
from daemon_helpers import LAYOUT, MiB, SCOPE, make_config, pages_for, prompt

OTHER = PageLayout(num_layers=3, num_kv_heads=1, head_dim=32, block_size=32, dtype="bfloat16")
SCOPE_B = Scope("cd" * 32, "tenant-b")


def other_pages(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *OTHER.shape), generator=g).to(OTHER.torch_dtype)


def empty_home_config(workdir, **kw):
    return make_config(workdir, layout=None, max_layouts=2, **kw)


def stats_json(sock) -> dict:
    r = CliRunner().invoke(main, ["stats", "--socket", str(sock), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_two_layouts_through_one_daemon_on_an_empty_home(workdir):
    cfg = empty_home_config(workdir)
    d = DaemonThread(cfg).start()
    a_toks, b_toks = prompt(64, seed=1), prompt(96, seed=2)
    try:
        with tierkv.connect(cfg.socket) as ops:  # no layout declared, none served yet
            assert ops.layout is None and ops.layouts == ()
            assert ops.stats()["blocks"] == 0 and ops.list_manifests() == {}
            with pytest.raises(ConfigError, match="layout"):
                ops.acquire(a_toks, SCOPE)
        with tierkv.connect(cfg.socket, layout=LAYOUT) as a, tierkv.connect(cfg.socket, layout=OTHER) as b:
            assert (a.layout, b.layout) == (LAYOUT, OTHER)
            assert a.put(a_toks, pages_for(4, 1), SCOPE).stored == 4
            assert b.put(b_toks, other_pages(3, 2), SCOPE_B).stored == 3
            with a.acquire(a_toks, SCOPE) as la, b.acquire(b_toks, SCOPE_B) as lb:
                assert torch.equal(la.pages(), pages_for(4, 1)) and torch.equal(lb.pages(), other_pages(3, 2))
            # Each layout is its own store: the other layout's client finds nothing.
            assert b.lookup(a_toks, SCOPE).tokens_matched == 0
            a.save_manifest("a-prefix", {"layout": LAYOUT.to_dict(), "blocks": 4})
            b.save_manifest("b-prefix", {"layout": OTHER.to_dict(), "blocks": 3})
        s = stats_json(cfg.socket)
        ids = {layout_id(LAYOUT), layout_id(OTHER)}
        assert set(s["layouts"]) == ids and s["daemon"]["layouts"] and set(s["daemon"]["layouts"]) == ids
        assert s["blocks"] == 7 and s["tiers"]["disk"]["blocks"] == 7
        assert s["layouts"][layout_id(LAYOUT)]["blocks"] == 4 and s["layouts"][layout_id(OTHER)]["blocks"] == 3
        assert s["model_versions"] == {SCOPE.model_version: 4, SCOPE_B.model_version: 3}
        # Rates are recomputed from the layouts' summed counts: two acquires, 4 + 3 blocks, all found.
        assert s["acquires"] == 2 and s["acquire_blocks"] == 7 and s["acquire_hit_rate"] == 1.0
        assert s["layouts"][layout_id(OTHER)]["acquire_blocks"] == 3
        # Budgets: each layout's tiers hold at most 1/max_layouts of each budget.
        for lid in ids:
            tiers = s["layouts"][lid]["tiers"]
            assert tiers["device"]["capacity_bytes"] <= cfg.device_bytes // 2
            assert tiers["disk"]["capacity_bytes"] <= cfg.disk_bytes // 2
        assert s["tiers"]["device"]["capacity_bytes"] <= cfg.device_bytes
        human = CliRunner().invoke(main, ["stats", "--socket", str(cfg.socket)])
        assert human.exit_code == 0 and layout_id(LAYOUT) in human.output and layout_id(OTHER) in human.output
        r = CliRunner().invoke(main, ["ls", "--socket", str(cfg.socket), "--json"])
        listed = json.loads(r.stdout)
        assert listed["layouts"][layout_id(OTHER)] == {"blocks": 3, "model_versions": {SCOPE_B.model_version: 3}}
        with tierkv.connect(cfg.socket) as ops:  # operations across both layouts
            assert ops.layout is None and set(ops.layouts) == ids
            assert set(ops.list_manifests()) == {"a-prefix", "b-prefix"}
            assert ops.get_manifest("b-prefix")["blocks"] == 3
            assert ops.verify().checked == 7
            assert ops.invalidate(namespace="tenant-b", dry_run=True).removed_blocks == 3
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
    # The first layout lives at the home's root (so --home tools keep working), the next
    # under layouts/<id>.
    home = cfg.home
    assert tierkv.home_layout(home) == LAYOUT
    assert (home / LAYOUTS_DIR / layout_id(OTHER) / "index").is_dir()
    # A restart finds both and serves their blocks.
    d = DaemonThread(cfg).start()
    try:
        assert set(stats_json(cfg.socket)["layouts"]) == {layout_id(LAYOUT), layout_id(OTHER)}
        with tierkv.connect(cfg.socket, layout=OTHER) as b, b.acquire(b_toks, SCOPE_B) as lb:
            assert torch.equal(lb.pages(), other_pages(3, 2))
        with tierkv.connect(cfg.socket, layout=LAYOUT) as a:
            assert a.lookup(a_toks, SCOPE).tokens_matched == 64
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_a_layout_beyond_max_layouts_is_refused_and_the_others_go_on(workdir):
    cfg = empty_home_config(workdir)
    d = DaemonThread(cfg).start()
    try:
        third = PageLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float16")
        with tierkv.connect(cfg.socket, layout=LAYOUT), tierkv.connect(cfg.socket, layout=OTHER):
            with pytest.raises(CapacityError, match="max_layouts"):
                tierkv.connect(cfg.socket, layout=third)
        with tierkv.connect(cfg.socket, layout=LAYOUT) as a:
            a.put(prompt(32, seed=3), pages_for(2, 3), SCOPE)
            assert a.lookup(prompt(32, seed=3), SCOPE).tokens_matched == 32
    finally:
        d.stop()


def test_an_existing_single_layout_home_is_one_of_the_layouts(workdir):
    home = workdir / "home"
    with tierkv.open(home, LAYOUT, device="cpu", device_bytes=1 * MiB, host_bytes=0, disk_bytes=8 * MiB,
                     shm_dir=workdir / "shm") as st:
        st.put(prompt(48, seed=4), pages_for(3, 4), SCOPE, priority=Priority.PINNED)
    cfg = empty_home_config(workdir)
    d = DaemonThread(cfg).start()
    try:
        with pytest.raises(DaemonOwnsHomeError):  # the daemon holds the home
            tierkv.open(home, LAYOUT, device="cpu", shm_dir=workdir / "shm")
        with tierkv.connect(cfg.socket) as c:  # its only layout, without declaring it
            assert c.layout == LAYOUT and c.lookup(prompt(48, seed=4), SCOPE).tokens_matched == 48
        with tierkv.connect(cfg.socket, layout=OTHER) as b:
            b.put(prompt(64, seed=5), other_pages(2, 5), SCOPE_B)
        assert (home / LAYOUTS_DIR / layout_id(OTHER)).is_dir()
        assert stats_json(cfg.socket)["blocks"] == 5
    finally:
        d.stop()


def test_an_empty_home_is_locked_by_the_daemon_before_any_layout(workdir):
    cfg = empty_home_config(workdir)
    d = DaemonThread(cfg).start()
    try:
        with pytest.raises(DaemonOwnsHomeError):
            tierkv.open(cfg.home, LAYOUT, device="cpu", shm_dir=workdir / "shm")
        with tierkv.connect(cfg.socket, layout=LAYOUT) as a:  # the first layout takes the root
            a.put(prompt(32, seed=6), pages_for(2, 6), SCOPE)
        with pytest.raises(DaemonOwnsHomeError):
            tierkv.open(cfg.home, LAYOUT, device="cpu", shm_dir=workdir / "shm")
    finally:
        d.stop()
    with tierkv.open(cfg.home, None, device="cpu", host_bytes=0, shm_dir=workdir / "shm") as st:
        assert st.lookup(prompt(32, seed=6), SCOPE).tokens_matched == 32


def test_serve_starts_with_nothing_but_home_and_socket(workdir):
    """`tierkv serve --home H --socket S` on a new home starts (no --layout) and a client
    declaring its layout stores and hits."""
    from daemon_helpers import spawn_daemon

    proc = spawn_daemon(workdir, layout=None)
    sock = workdir / "run" / "d.sock"
    try:
        with tierkv.connect(sock, layout=OTHER) as b:
            b.put(prompt(64, seed=7), other_pages(2, 7), SCOPE_B)
            assert b.lookup(prompt(64, seed=7), SCOPE_B).tokens_matched == 64
        assert stats_json(sock)["layouts"][layout_id(OTHER)]["blocks"] == 2
    finally:
        proc.terminate()
        proc.wait(60)
