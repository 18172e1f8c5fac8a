"""A tierkv daemon serving from a thread of the test process: the one way the tests start
one in-process (the daemon tests, the CLI's, the cluster's and the conformance suite).
A subprocess daemon (``tierkv serve``) is tests/daemon/daemon_helpers.spawn_daemon."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from tierkv.daemon.config import DaemonConfig
from tierkv.daemon.server import Daemon

T = TypeVar("T")


class DaemonThread:
    """``Daemon(config, **daemon_kw)`` (no signal handlers: those belong to the main thread)
    serving from a daemon thread. :meth:`start` returns once it serves, or raises what kept
    it from starting; :meth:`stop` asks it to stop and waits. ``with DaemonThread(cfg) as
    d:`` does both."""

    def __init__(self, config: DaemonConfig, **daemon_kw: Any) -> None:
        self.config = config
        self.daemon = Daemon(config, install_signals=False, **daemon_kw)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def socket(self) -> Path:
        return self.config.socket

    def start(self) -> "DaemonThread":
        self.thread.start()
        assert self.daemon.ready.wait(30), "daemon did not start"
        if self.error is not None:
            raise self.error
        return self

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the daemon's loop thread (the tables are loop-owned)."""

        async def wrap() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrap(), self.daemon._loop).result(10)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.daemon.request_stop()
            self.thread.join(30)
            assert not self.thread.is_alive(), "daemon did not stop"

    def __enter__(self) -> "DaemonThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            self.daemon.run()
        except BaseException as e:  # noqa: BLE001 - raised by start()
            self.error = e
            self.daemon.ready.set()  # start() is waiting for it
