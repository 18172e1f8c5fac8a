"""Run a function in a forked child that has dropped to another uid (a real second user:
the kernel's SO_PEERCRED, file modes and SCM_RIGHTS all see that uid).

Fork, not a fresh interpreter: the interpreter and its standard library may live where
another user cannot read them (e.g. under /root). The parent imports everything the child
needs before forking (run one session as itself first). The child writes its JSON-able
result (or the repr of what it raised) to a pipe and exits without running any cleanup of
the parent's."""
from __future__ import annotations

import json
import os
import select
import signal
import time
from typing import Any, Callable

import pytest

NOBODY = 65534


def need_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to switch to another uid (CI runs the suite as root)")


def run_as(uid: int, fn: Callable[[], Any], timeout_s: float = 60.0) -> dict[str, Any]:
    """``{"ok": result}`` or ``{"error": name, "message": str}`` of ``fn()`` run as ``uid``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            assert os.getuid() == uid and os.geteuid() == uid
            out: dict[str, Any] = {"ok": fn()}
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = {"error": type(e).__name__, "message": str(e)}
        try:
            data = json.dumps(out, default=str).encode()
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout_s
    with os.fdopen(r, "rb", buffering=0) as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"the child as uid {uid} did not finish within {timeout_s:.0f} s (killed)")
            chunk = f.read(65536)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    raw = b"".join(chunks)
    assert raw, f"child as uid {uid} wrote nothing (status {status})"
    return json.loads(raw)
