"""A layout a client declares at HELLO and the daemon refuses changes nothing: the home stays
locked by the daemon, nothing is written under it, no other layout loses blocks (issue 34,
items 2-4). Real daemon processes (``tierkv serve``) and real clients."""
from __future__ import annotations

import pytest

import tierkv
from tierkv import PageLayout
from tierkv.daemon.layouts import LAYOUTS_DIR, layout_id
from tierkv.errors import DaemonOwnsHomeError, TierKVError
from tierkv.home import peek_layout

from daemon_helpers import LAYOUT, SCOPE, pages_for, prompt, spawn_daemon

# A page of 4 MiB: more than the spawned daemon's whole device budget (1 MiB), so its store
# cannot be built.
HUGE = PageLayout(num_layers=64, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


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
