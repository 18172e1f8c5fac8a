"""The local trust boundary: socket path, directory and file modes, peer uid, home ownership."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

import tierkv
from tierkv.daemon import security
from tierkv.daemon.security import PeerCredentials, SocketPathError
from tierkv.errors import DaemonOwnsHomeError, StoreLockedError

from helpers.daemons import DaemonThread
from daemon_helpers import LAYOUT, SCOPE, make_config, pages_for, prompt


def test_socket_is_0600_in_a_0700_directory_with_a_pid_file(daemon):
    sock = daemon.config.server.socket
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
    assert daemon.config.server.resolved_pid_file.read_text().strip() == str(os.getpid())


def test_allowed_uids_admit_by_kernel_uid(workdir):
    """peer_allowed's rule; the real refusal of another user (a child that drops to another
    uid) is tests/daemon/test_tenants.py::test_a_uid_not_allowed_is_refused_for_real."""
    foreign = PeerCredentials(pid=1, uid=os.getuid() + 4242, gid=0)
    assert not security.peer_allowed(foreign, ())
    allowed = make_config(workdir, access=dict(allowed_uids=(foreign.uid,)))
    assert security.peer_allowed(foreign, allowed.access.allowed_uids)
    assert security.peer_allowed(PeerCredentials(1, os.getuid(), 0), ())


@pytest.mark.parametrize("kind", ["file", "dir", "symlink-to-nothing", "symlink-to-socket"])
def test_refuses_to_start_over_something_at_the_socket_path(workdir, kind):
    cfg = make_config(workdir)
    cfg.server.socket.parent.mkdir(mode=0o700)
    if kind == "file":
        cfg.server.socket.write_text("not a socket")
    elif kind == "dir":
        cfg.server.socket.mkdir()
    elif kind == "symlink-to-nothing":
        cfg.server.socket.symlink_to(workdir / "elsewhere")
    else:
        live = workdir / "live.sock"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(live))
        s.listen()
        cfg.server.socket.symlink_to(live)
    with pytest.raises(SocketPathError):
        DaemonThread(cfg).start()
    assert os.path.lexists(cfg.server.socket)  # left alone
    tierkv.open(cfg.store.home, LAYOUT, shm_dir=workdir / "shm", device="cpu", device_bytes=1 << 20,
                host_bytes=0, disk_bytes=0).close()  # and the home was not left locked


def test_refuses_a_shared_socket_directory(workdir):
    cfg = make_config(workdir)
    cfg.server.socket.parent.mkdir(mode=0o755)
    os.chmod(cfg.server.socket.parent, 0o755)
    with pytest.raises(SocketPathError, match="0700"):
        DaemonThread(cfg).start()


def test_a_stale_socket_is_replaced(workdir):
    cfg = make_config(workdir)
    cfg.server.socket.parent.mkdir(mode=0o700)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(cfg.server.socket))  # bound, never listening, then closed: connect is refused
    dead.close()
    assert stat.S_ISSOCK(os.lstat(cfg.server.socket).st_mode)
    d = DaemonThread(cfg).start()
    try:
        with tierkv.connect(cfg.server.socket) as c:
            c.check_integrity()
    finally:
        d.stop()
    assert not os.path.lexists(cfg.server.socket) and not cfg.server.resolved_pid_file.exists()


def test_a_live_daemon_is_not_replaced(daemon, workdir):
    cfg = make_config(workdir, store=dict(home=workdir / "home2"))
    with pytest.raises(SocketPathError, match="already serving"):
        DaemonThread(cfg).start()
    with tierkv.connect(daemon.config.server.socket) as c:
        c.check_integrity()


def test_opening_the_home_beside_the_daemon_names_the_socket(daemon):
    with pytest.raises(DaemonOwnsHomeError, match=str(daemon.config.server.socket)) as info:
        tierkv.open(daemon.config.store.home, LAYOUT)
    assert isinstance(info.value, StoreLockedError)
    # A second daemon (another process, another socket) on the same home is refused too.
    other = daemon.config.store.home.parent / "r2" / "x.sock"
    proc = subprocess.run([sys.executable, "-m", "tierkv", "serve", "--home", str(daemon.config.store.home),
                           "--socket", str(other), "--device", "cpu", "--device-bytes", "1MiB",
                           "--shm-dir", str(daemon.config.store.shm_dir)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "served by a tierkv daemon" in proc.stderr and str(daemon.config.server.socket) in proc.stderr
    assert not other.exists()


def test_namespace_per_uid_is_derived_by_the_daemon(workdir):
    d = DaemonThread(make_config(workdir, access=dict(namespace_per_uid=True))).start()
    try:
        with tierkv.connect(d.config.server.socket) as c:
            toks = prompt(32, seed=11)
            c.put(toks, pages_for(2, 11), SCOPE)
            assert c.lookup(toks, SCOPE).tokens_matched == 32
            assert set(c.stats()["namespaces"]) == {SCOPE.namespace}  # its own, without the tenant prefix
            assert d.call(lambda: set(d.daemon.store.stats()["namespaces"])) == {f"uid{os.getuid()}/{SCOPE.namespace}"}
            assert c.invalidate(namespace=SCOPE.namespace).removed_blocks == 2
    finally:
        d.stop()
