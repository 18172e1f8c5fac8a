"""Helpers of the daemon tests: a daemon in a thread of this process (its own event loop;
:class:`helpers.daemons.DaemonThread`, shared with the other test directories) or in a
subprocess, each in a private /tmp directory (AF_UNIX paths are limited to 108 bytes). A
module of its own, not conftest: test directories each have a conftest.py and ``from
conftest import`` would pick whichever was imported first."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tierkv import PageLayout, Scope
from tierkv.daemon.config import DaemonConfig

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
SCOPE = Scope("ab" * 32, "tenant-a")
KiB, MiB = 1 << 10, 1 << 20
LAYOUT_ARG = "num_layers=2,num_kv_heads=2,head_dim=16,block_size=16,dtype=float32"


def prompt(n_tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n_tokens).astype(np.int32)


def pages_for(n_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n_blocks, *LAYOUT.shape), generator=g, dtype=torch.float32)


def make_config(workdir: Path, **kw) -> DaemonConfig:
    base = dict(home=workdir / "home", socket=workdir / "run" / "d.sock", layout=LAYOUT, device="cpu",
                device_bytes=1 * MiB, host_bytes=2 * MiB, disk_bytes=8 * MiB, staging_bytes=256 * KiB,
                client_staging_bytes=64 * KiB, shm_dir=workdir / "shm", workers=4,
                max_layouts=1)  # the whole budget to LAYOUT (test_layouts.py splits it)
    base.update(kw)
    return DaemonConfig(**base)


def wait_for(pred, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def spawn_daemon(workdir: Path, *extra: str, env: dict | None = None, layout: str | None = LAYOUT_ARG,
                 log_path: Path | None = None) -> subprocess.Popen:
    """``python -m tierkv serve`` in a subprocess; returns once its socket answers.
    ``layout=None``: no --layout (clients declare theirs). ``log_path``: its stderr (the
    log) goes to that file instead of a pipe nobody may read while it runs."""
    sock = workdir / "run" / "d.sock"
    cmd = [sys.executable, "-m", "tierkv", "serve", "--home", str(workdir / "home"), "--socket", str(sock),
           *(("--layout", layout) if layout else ()), "--device", "cpu", "--device-bytes", "1MiB", "--host-bytes", "2MiB",
           "--disk-bytes", "8MiB", "--staging-bytes", "256KiB", "--log-level", "WARNING", *extra]
    e = dict(os.environ, **(env or {}), TIERKV_SHM_TEST=str(workdir))
    stderr = open(log_path, "wb") if log_path is not None else subprocess.PIPE
    try:
        proc = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=stderr)
    finally:
        if log_path is not None:
            stderr.close()  # the child has its own descriptor
    from tierkv.daemon.security import socket_is_live

    ok = wait_for(lambda: proc.poll() is not None or (sock.exists() and socket_is_live(sock)), timeout=60)
    if proc.poll() is not None or not ok:
        out, err = proc.communicate(timeout=10) if proc.poll() is not None else (b"", b"")
        if log_path is not None:
            err = log_path.read_bytes()
        raise RuntimeError(f"daemon did not start (rc {proc.poll()}): {(err or b'').decode()[-2000:]}")
    return proc
