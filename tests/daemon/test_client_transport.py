"""The client's transport (tierkv/daemon/client_transport.py): replies are read by the
callers waiting for them, one thread at a time, with no reader thread. A reader hands the
read role on when its own reply comes, and reads the others' replies for them meanwhile; a
caller that times out leaves the client usable; a broken connection fails a waiting
caller at once. (Eight threads sharing one client, each checking its own replies:
test_limits.py.) A daemon in a thread of this process, with PING slowed down where a test
needs a reply to arrive late."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import tierkv
from tierkv.daemon import messages as m
from tierkv.daemon.protocol import Op
from tierkv.errors import DaemonUnavailableError

from daemon_helpers import SCOPE, pages_for, prompt


def slow_ping(daemon, seconds: float) -> None:
    """Make the daemon answer PING after ``seconds`` (on its loop, without blocking it)."""

    async def ping(conn, msg):
        await asyncio.sleep(seconds)
        return {}, b""

    daemon.daemon.handlers.table[Op.PING] = (m.Empty, ping)


def test_the_reader_delivers_another_callers_reply_and_hands_the_role_on(daemon):
    slow_ping(daemon, 0.6)
    with tierkv.connect(daemon.config.socket, timeout=20) as c:
        toks = prompt(32, seed=7)
        c.put(toks, pages_for(2, seed=7), SCOPE)
        done: dict[str, float] = {}

        def slow() -> None:
            c.ping()
            done["slow"] = time.monotonic()

        t0 = time.monotonic()
        t = threading.Thread(target=slow)
        t.start()
        time.sleep(0.1)  # the slow caller holds the read role, waiting for its reply
        assert c.lookup(toks, SCOPE).tokens_matched == 32  # read for us by the slow caller
        done["fast"] = time.monotonic()
        t.join(10)
        assert done["fast"] - t0 < 0.5 < done["slow"] - t0, done

        # The other way round: the first caller's reply comes first; it must hand the read
        # role to the one still waiting, which would otherwise wait out its whole timeout.
        done.clear()
        t0 = time.monotonic()
        t = threading.Thread(target=slow)
        t.start()
        for _ in range(20):
            assert c.lookup(toks, SCOPE).tokens_matched == 32
        t.join(10)
        assert not t.is_alive() and done["slow"] - t0 < 3, done
        c.check_integrity()


def test_a_caller_that_times_out_leaves_the_client_usable(daemon):
    slow_ping(daemon, 1.0)
    with tierkv.connect(daemon.config.socket, timeout=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="no reply"):
            c.ping()
        assert time.monotonic() - t0 < 1.0
        time.sleep(1.0)  # the late reply arrives; whoever reads next drops it
        toks = prompt(16, seed=9)
        c.put(toks, pages_for(1, seed=9), SCOPE)
        with c.acquire(toks, SCOPE) as lease:
            assert torch.equal(lease.pages(), pages_for(1, seed=9))
        c.check_integrity()


def test_a_waiting_caller_fails_at_once_when_the_daemon_goes(daemon):
    slow_ping(daemon, 4.0)
    with tierkv.connect(daemon.config.socket, timeout=60) as c:
        out: list[BaseException] = []

        def wait() -> None:
            try:
                c.ping()
            except BaseException as e:  # noqa: BLE001 - checked below
                out.append(e)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        c._transport._sock.shutdown(2)  # the connection breaks under the waiting reader (as at a daemon's exit)
        t.join(10)
        assert not t.is_alive() and time.monotonic() - t0 < 2  # not the 4 s of the reply
        assert len(out) == 1 and isinstance(out[0], DaemonUnavailableError), out
        with pytest.raises(DaemonUnavailableError):
            c.lookup(prompt(16), SCOPE)
