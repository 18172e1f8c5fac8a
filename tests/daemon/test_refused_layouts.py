"""A layout a client declares at HELLO and the daemon refuses changes nothing: the home stays
locked by the daemon, nothing is written under it, no other layout loses blocks (issue 34,
items 2-4), and another uid makes at most its quota of layouts. Real daemon processes (``tierkv serve``) and real clients."""
from __future__ import annotations

import os

import pytest

import tierkv
from tierkv import PageLayout
from tierkv.home.directory import LAYOUTS_DIR, layout_id
from tierkv.errors import DaemonOwnsHomeError, TierKVError
from tierkv.home import peek_layout

from as_user import NOBODY, need_root, run_as
from daemon_helpers import LAYOUT, SCOPE, pages_for, prompt, spawn_daemon

# A page of 4 MiB: more than the spawned daemon's whole device budget (1 MiB), so its store
# cannot be built.
HUGE = PageLayout(num_layers=64, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
OTHER = PageLayout(num_layers=3, num_kv_heads=1, head_dim=32, block_size=32, dtype="bfloat16")


def stop(proc) -> None:
    proc.terminate()
    assert proc.wait(60) == 0, proc.stderr.read().decode()[-2000:]


def test_a_refused_first_hello_keeps_the_home_locked(workdir):
    """The daemon handed the root's LOCK to the first layout's store and never took it back
    when that store failed: another process's tierkv.open(HOME) then succeeded beside the
    running daemon (and after a restart its root store shadowed the daemon's layout)."""
    proc = spawn_daemon(workdir, layout=None)
    sock, home, shm = workdir / "run" / "d.sock", workdir / "home", workdir / "shm"
    try:
        # The root store's open fails past every check of the layout: its index cannot be
        # created (a file where its directory goes).
        (home / "index").write_bytes(b"not a directory")
        with pytest.raises(TierKVError, match="FileExistsError"):
            tierkv.connect(sock, layout=LAYOUT)
        with pytest.raises(DaemonOwnsHomeError, match="served by a tierkv daemon"):
            tierkv.open(home, LAYOUT, device="cpu", host_bytes=0, shm_dir=shm)
        (home / "index").unlink()
        # The root is still free for the daemon's first real layout, and still locked after.
        with tierkv.connect(sock, layout=LAYOUT) as c:
            c.put(prompt(32, seed=1), pages_for(2, 1), SCOPE)
        assert peek_layout(home) == LAYOUT and not (home / LAYOUTS_DIR / layout_id(LAYOUT)).exists()
        with pytest.raises(DaemonOwnsHomeError):
            tierkv.open(home, LAYOUT, device="cpu", host_bytes=0, shm_dir=shm)
    finally:
        stop(proc)
    with tierkv.open(home, None, device="cpu", host_bytes=0, shm_dir=shm) as st:  # released at exit
        assert st.lookup(prompt(32, seed=1), SCOPE).tokens_matched == 32


TINY = PageLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype="float16")  # 4-byte pages


@pytest.mark.parametrize("layout,error", [(TINY, "pages of 512 to"), (HUGE, "share of the home's budgets")])
def test_a_page_too_small_or_too_large_is_refused_at_hello_and_changes_nothing(workdir, layout, error):
    """A 2-byte page grew the daemon by 1.75 GiB of per-slot objects per 64 MiB of budget; a
    page larger than the budget's share was built into a store anyway. Both are refused at
    HELLO with a clear error, and the home and the served layout are untouched."""
    proc = spawn_daemon(workdir, "--max-layouts", "2")  # serving LAYOUT, room for one more
    sock, home = workdir / "run" / "d.sock", workdir / "home"
    try:
        with tierkv.connect(sock, layout=LAYOUT) as c:
            c.put(prompt(64, seed=2), pages_for(4, 2), SCOPE)
        rss = _rss_kib(proc.pid)
        with pytest.raises(TierKVError, match=error):
            tierkv.connect(sock, layout=layout)
        assert _rss_kib(proc.pid) < rss + 16 * 1024  # nothing the size of the budget was built
        assert not (home / LAYOUTS_DIR).exists() or not any((home / LAYOUTS_DIR).iterdir())
        with tierkv.connect(sock, layout=LAYOUT) as c:
            assert c.lookup(prompt(64, seed=2), SCOPE).tokens_matched == 64
            assert c.stats()["tiers"]["device"]["capacity_bytes"] == 1 << 20  # its whole share still
    finally:
        stop(proc)


def test_a_layout_whose_tiers_fail_is_not_recorded(workdir):
    """The layout was written to the new store's index before its tiers existed: a store that
    failed there (OOM-killed under a memory limit, in the issue) left HOME/layouts/<id>
    recording it, and every restart opened it and failed the same way. Here the disk tier
    fails (a file where its segments directory goes)."""
    proc = spawn_daemon(workdir, layout=None)
    sock, home = workdir / "run" / "d.sock", workdir / "home"
    sub = home / LAYOUTS_DIR / layout_id(OTHER)
    try:
        with tierkv.connect(sock, layout=LAYOUT) as c:  # the root's layout
            c.put(prompt(64, seed=3), pages_for(4, 3), SCOPE)
        sub.mkdir(parents=True)
        (sub / "segments").write_bytes(b"not a directory")
        with pytest.raises(TierKVError):
            tierkv.connect(sock, layout=OTHER)
        assert peek_layout(sub) is None
    finally:
        stop(proc)
    proc = spawn_daemon(workdir, layout=None)  # the restart does not trip over it
    try:
        (sub / "segments").unlink()
        with tierkv.connect(sock, layout=OTHER) as b:
            assert b.layout == OTHER
        assert peek_layout(sub) == OTHER
        with tierkv.connect(sock, layout=LAYOUT) as c:
            assert c.lookup(prompt(64, seed=3), SCOPE).tokens_matched == 64
    finally:
        stop(proc)


def test_a_failed_open_of_a_new_home_records_no_layout(workdir):
    """The same in the store itself: a new home whose tiers cannot be built (its shared
    memory directory is a file) holds no layout after, and opens later with another one."""
    home, not_a_dir = workdir / "home", workdir / "shm-file"
    not_a_dir.write_bytes(b"")
    with pytest.raises(OSError):
        tierkv.open(home, LAYOUT, device="cpu", host_bytes=0, shm_dir=not_a_dir)
    assert peek_layout(home) is None
    with tierkv.open(home, OTHER, device="cpu", host_bytes=0, shm_dir=workdir / "shm") as st:
        st.check_integrity()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_layout_whose_store_fails_evicts_nothing_of_the_others(workdir):
    """Issue 34, item 3: the open layouts were lowered to the share they would have with one
    more *before* the new store was built, and raised back when it failed: by then their
    disk blocks above the lowered limit were deleted (1,472 of 1,760 in the issue). The new
    store is built first now; a failure costs the others nothing."""
    proc = spawn_daemon(workdir, "--max-layouts", "2")  # serving LAYOUT, room for one more
    sock, home = workdir / "run" / "d.sock", workdir / "home"
    sub = home / LAYOUTS_DIR / layout_id(OTHER)
    n_prompts, blocks_each = 22, 32  # 704 blocks of 8 KiB: more than half the 8 MiB disk budget
    try:
        with tierkv.connect(sock, layout=LAYOUT) as c:
            for i in range(n_prompts):
                assert c.put(prompt(16 * blocks_each, seed=100 + i), pages_for(blocks_each, i), SCOPE).stored == blocks_each
            before = c.stats()
        assert before["blocks"] == before["tiers"]["disk"]["blocks"] == n_prompts * blocks_each
        sub.mkdir(parents=True)
        (sub / "segments").write_bytes(b"not a directory")  # OTHER's store fails past every check
        with pytest.raises(TierKVError):
            tierkv.connect(sock, layout=OTHER)
        with tierkv.connect(sock, layout=LAYOUT) as c:
            after = c.stats()
            assert after["blocks"] == after["tiers"]["disk"]["blocks"] == n_prompts * blocks_each
            assert after["tiers"]["disk"]["capacity_bytes"] == before["tiers"]["disk"]["capacity_bytes"]
            for i in range(n_prompts):
                assert c.lookup(prompt(16 * blocks_each, seed=100 + i), SCOPE).tokens_matched == 16 * blocks_each
        # Once it can open, OTHER gets its half and LAYOUT is lowered to the other half.
        (sub / "segments").unlink()
        with tierkv.connect(sock, layout=OTHER) as b:
            assert 0 < b.stats()["layouts"][layout_id(OTHER)]["tiers"]["device"]["capacity_bytes"] <= 1 << 19
        with tierkv.connect(sock, layout=LAYOUT) as c:
            tiers = c.stats()["layouts"][layout_id(LAYOUT)]["tiers"]
            assert tiers["device"]["capacity_bytes"] == 1 << 19 and tiers["disk"]["capacity_bytes"] <= 4 << 20
    finally:
        stop(proc)


THIRD = PageLayout(num_layers=2, num_kv_heads=1, head_dim=32, block_size=32, dtype="bfloat16")
FOURTH = PageLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=32, dtype="bfloat16")


def test_another_uid_makes_at_most_layouts_per_uid_layouts_also_after_a_restart(workdir):
    """Three junk layouts of another uid cut the real model to a quarter of every budget,
    stayed across a restart, and the next real model was refused. Another uid now makes at
    most ``layouts_per_uid`` (1) new layouts; the refused one changes nothing; who made a
    layout is kept, so a restart counts it; the daemon's own uid still opens more."""
    need_root()
    os.chmod(workdir, 0o711)
    args = ("--max-layouts", "4", "--allowed-uid", str(NOBODY))
    home = workdir / "home"

    def declare(layout: PageLayout) -> dict:
        with tierkv.connect(workdir / "run" / "d.sock", layout=layout) as c:
            return {"tiers": c.stats()["tiers"]["device"]["capacity_bytes"]}

    proc = spawn_daemon(workdir, *args)  # serving LAYOUT
    try:
        assert "ok" in run_as(NOBODY, lambda: declare(OTHER))
        refused = run_as(NOBODY, lambda: declare(THIRD))
        assert refused["error"] == "QuotaExceededError" and "layouts_per_uid = 1" in refused["message"], refused
        assert not (home / LAYOUTS_DIR / layout_id(THIRD)).exists()
        assert (home / LAYOUTS_DIR / layout_id(OTHER) / "CREATOR").read_text() == str(NOBODY)
        with tierkv.connect(workdir / "run" / "d.sock", layout=LAYOUT) as c:  # two layouts: a half each
            per = c.stats()["layouts"]
            assert sorted(per) == sorted([layout_id(LAYOUT), layout_id(OTHER)])
            assert per[layout_id(LAYOUT)]["tiers"]["device"]["capacity_bytes"] == (1 << 20) // 2
    finally:
        stop(proc)
    proc = spawn_daemon(workdir, *args)
    try:
        assert run_as(NOBODY, lambda: declare(THIRD))["error"] == "QuotaExceededError"  # still counted
        assert "ok" in run_as(NOBODY, lambda: declare(OTHER))  # its own layout is still served to it
        declare(FOURTH)  # the daemon's own uid: bound by --max-layouts only
        assert (home / LAYOUTS_DIR / layout_id(FOURTH)).is_dir()
        assert not (home / LAYOUTS_DIR / layout_id(FOURTH) / "CREATOR").exists()
    finally:
        stop(proc)
