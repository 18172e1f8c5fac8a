"""A store home directory: who owns it (one process at a time) and what it holds.

    HOME/LOCK          flock-ed by the owner; holds {"pid", "host", "socket"} as JSON
    HOME/index/        the LMDB index
    HOME/segments/     disk-tier segment files

The lock is an advisory ``flock`` on LOCK: it is released by the kernel when the owner dies,
so a crash never leaves a home locked, and a second opener learns who holds it.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from ..errors import DaemonOwnsHomeError, StoreLockedError
from ..layout import PageLayout


class HomeLock:
    def __init__(self, home: Path, socket_path: str | None = None) -> None:
        self.path = home / "LOCK"
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = self.read_owner(home)
            os.close(fd)
            if owner.get("socket"):
                raise DaemonOwnsHomeError(
                    f"{home} is served by a tierkv daemon (pid {owner.get('pid')}) on socket {owner['socket']}",
                    hint=f"use --socket {owner['socket']} (or tierkv.connect('{owner['socket']}'))",
                ) from None
            raise StoreLockedError(
                f"{home} is open in another process (pid {owner.get('pid')} on {owner.get('host')})"
            ) from None
        self.fd = fd
        self.write_owner(socket_path)

    def write_owner(self, socket_path: str | None) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "socket": socket_path}
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(info).encode(), 0)
        except OSError:
            # A full (or read-only) file system: the record only names the holder in another
            # opener's error; the lock itself is the flock, so the home still opens and
            # serves what it holds (issue #37, item 3: a full disk failed every command).
            pass

    @staticmethod
    def read_owner(home: Path) -> dict:
        try:
            return json.loads((home / "LOCK").read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self.fd >= 0:
            try:
                os.ftruncate(self.fd, 0)  # forget the owner record
            except OSError:
                # A read-only (or failed) file system: the record stays, but it is read only
                # when the lock is held, so it is never shown stale; the lock must still go.
                pass
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


class LentLock:
    """A :class:`HomeLock` lent to a store opened under it: releasing it does nothing, so
    the home stays locked by the lender whatever the store does. A daemon holds its home's
    LOCK for its whole life and lends it to the store at the root (issue 34, item 4: it
    used to release the LOCK for that store to take, and a store that failed to open left
    the home unlocked beside the running daemon). Rejected: taking the LOCK again after a
    failed open (another process may have taken it meanwhile)."""

    def __init__(self, lock: HomeLock) -> None:
        self.path = lock.path

    def release(self) -> None:
        pass


def peek_layout(home: Path) -> PageLayout | None:
    """The page layout recorded in the index under ``home``, read without opening the store
    or taking the home (so it works while another process owns it), or None when ``home``
    holds no store. The one home-layout peek (``tierkv.home_layout``, the daemon's layouts)."""
    from ..index import peek_meta

    raw = peek_meta(Path(home) / "index", "layout")
    return None if raw is None else PageLayout.from_dict(json.loads(raw))
