"""SIGTERM while the home's file system has turned read-only (issue 11, item 11): the daemon
exited 1 and left its socket and pid file behind. It must stop cleanly, and the blocks it
acknowledged must be there when the file system is back."""
from __future__ import annotations

import signal

import pytest

import tierkv

from daemon_helpers import LAYOUT, SCOPE, pages_for, prompt, spawn_daemon
from helpers.mounts import fault_skip_reason, loop_ext4


def test_sigterm_on_a_read_only_home_stops_cleanly(workdir):
    reason = fault_skip_reason()
    if reason:
        pytest.skip(reason)  # not root, or no loop devices: outside tierkv
    with loop_ext4(workdir / "home.img", workdir / "home", errors="remount-ro") as fs:
        proc = spawn_daemon(workdir)
        sock = workdir / "run" / "d.sock"
        try:
            toks = prompt(64, seed=1)
            with tierkv.connect(sock) as c:
                assert c.put(toks, pages_for(4, 1), SCOPE).durable
            fs.force_read_only()  # every write on the home now fails with EROFS
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        text = err.decode()
        assert proc.returncode == 0, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert not sock.exists() and not (workdir / "run" / "d.sock.pid").exists()
        fs.remount()  # the file system is back
        with tierkv.open(workdir / "home", LAYOUT, device="cpu", device_bytes=1 << 20, host_bytes=0,
                         disk_bytes=8 << 20, shm_dir=workdir / "shm") as s:
            assert s.lookup(toks, SCOPE).tokens_matched == 64
            with s.acquire(toks, SCOPE) as lease:
                assert (lease.pages() == pages_for(4, 1)).all()
            s.check_integrity()
