"""A home's budgets are the home's (issue #32): a command that opens a home itself gives each
layout the share a daemon with the same budgets gives it (tierkv/home/budgets.py), where it
once gave every layout the whole budget (two layouts written without a daemon could hold
twice the disk budget between them)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tierkv
from tierkv import PageLayout, Scope
from tierkv.cli import main
from tierkv.cli.common import open_store
from tierkv.home.directory import layout_id, store_home
from tierkv.home.home import Home

from helpers.daemons import DaemonThread

pytestmark = pytest.mark.usefixtures("private_caches")
A = PageLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
B = PageLayout(num_layers=3, num_kv_heads=1, head_dim=32, block_size=32, dtype="bfloat16")
MiB = 1 << 20
BUDGETS = {"TIERKV_DEVICE_BYTES": str(16 * MiB), "TIERKV_HOST_BYTES": str(8 * MiB), "TIERKV_DISK_BYTES": str(64 * MiB)}


def two_layout_home(tmp_path):
    home = tmp_path / "home"
    scope = Scope("ab" * 32, "default")
    for layout in (A, B):
        with tierkv.open(store_home(home, layout), layout, device="cpu", device_bytes=4 * MiB, host_bytes=0,
                         disk_bytes=16 * MiB) as st:
            toks = np.arange(4 * layout.block_size, dtype=np.int32)
            st.put(toks, torch.zeros((4, *layout.shape), dtype=layout.torch_dtype), scope)
    return home


def assert_disk_share(disk: dict, share: int) -> None:
    # The disk tier's limit is whole segments: the most that fit in the share.
    segment = disk["capacity_bytes"] // disk["limit_segments"]
    assert disk["capacity_bytes"] <= share < disk["capacity_bytes"] + segment, (disk, share)


def limits(rows):
    return {r["layout_id"]: r["limit_bytes"] for r in rows}


def test_home_open_gives_each_layout_its_share(tmp_path):
    home = two_layout_home(tmp_path)
    with Home.open(home, device="cpu", device_bytes=16 * MiB, host_bytes=8 * MiB, disk_bytes=64 * MiB) as h:
        by_layout = {layout_id(s.layout): s.stats().as_dict()["tiers"] for s in h.stores}
    for lid in (layout_id(A), layout_id(B)):  # nothing in use: every budget split in two
        tiers = by_layout[lid]
        assert_disk_share(tiers["disk"], 32 * MiB)
        assert tiers["device"]["capacity_bytes"] <= 8 * MiB and tiers["host"]["capacity_bytes"] <= 4 * MiB


def test_a_command_opening_one_layout_gets_the_memory_whole_and_its_disk_share(tmp_path):
    home = two_layout_home(tmp_path)
    with open_store(home, A, device="cpu", device_bytes=16 * MiB, host_bytes=0, disk_bytes=64 * MiB) as st:
        tiers = st.stats().as_dict()["tiers"]
    assert 15 * MiB < tiers["device"]["capacity_bytes"] <= 16 * MiB  # the one layout in use
    assert_disk_share(tiers["disk"], 32 * MiB)


def test_home_and_daemon_give_the_same_disk_shares(tmp_path, monkeypatch):
    home = two_layout_home(tmp_path)
    for name, value in BUDGETS.items():
        monkeypatch.setenv(name, value)
    out = CliRunner().invoke(main, ["layouts", "--home", str(home), "--json"])
    assert out.exit_code == 0, out.output
    by_home = limits(json.loads(out.stdout)["layouts"])
    from tierkv.daemon.config import DaemonConfig, ServerSettings, StoreSettings

    sizes = {k.removeprefix("TIERKV_").lower(): int(v) for k, v in BUDGETS.items()}
    cfg = DaemonConfig(store=StoreSettings(home=home, device="cpu", shm_dir=tmp_path / "shm", **sizes),
                       server=ServerSettings(socket=tmp_path / "d.sock", workers=1))
    with DaemonThread(cfg) as daemon:
        out = CliRunner().invoke(main, ["layouts", "--socket", str(daemon.config.server.socket), "--json"])
    assert out.exit_code == 0, out.output
    by_daemon = limits(json.loads(out.stdout)["layouts"])
    assert set(by_home) == set(by_daemon) == {layout_id(A), layout_id(B)}
    for lid in by_home:
        assert by_home[lid]["disk"] == by_daemon[lid]["disk"] <= 32 * MiB, (lid, by_home, by_daemon)
