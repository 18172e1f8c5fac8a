"""The gate: the daemon's accept loop, where a peer it does not admit costs one cheap close.

Issue #34, item 11: with ``allowed_uids`` the socket is 0666, so every local user can
connect. ~11,000 refused connects a second from a uid not admitted slowed an admitted
client's acquire p50 from 0.2 ms to 15.6 ms and wrote 1.1 MiB/s of WARNING lines: asyncio's
server made a task, a transport, a stream reader and a protocol for each accepted socket,
the daemon then a Connection and a task that read the credentials, encoded an error reply,
logged a line and closed.

Here the listening socket is read directly (``loop.add_reader``). Each accepted socket's
uid is read from the kernel (``SO_PEERCRED``) before anything else; a peer not admitted is
sent one error frame, encoded once per uid, with a send that never waits (a fresh socket's
buffer is empty; if the kernel did not take it, the peer only misses the reason), and is
closed: no task, no transport, nothing it sent is read. Refusals are logged at most once per
``log_interval_s``: the first at once, the rest summed up in one line with their count.
At most ``BATCH`` sockets are accepted per wakeup, so requests of admitted clients are served
in between. An admitted socket goes to asyncio (``connect_accepted_socket``) with the
daemon's connection protocol, as the server did before.

Rejected: a filter before accept. An AF_UNIX socket has none (no BPF on the listener, no
credentials before accept); keeping other users off the socket by its mode and a group is
the operator's choice (docs/operations.md), the gate is for whoever reaches it anyway.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections import Counter
from typing import Any, Callable

from . import messages, security
from .protocol import FLAG_ERROR, FLAG_REPLY, encode_frame

log = logging.getLogger("tierkv.daemon.server")  # the daemon's log
BATCH = 32  # sockets accepted per wakeup of the loop
LOG_INTERVAL_S = 10.0  # at most one line of refusals per this (and the first at once)
ACCEPT_PAUSE_S = 1.0  # out of descriptors or memory: accept again after this (as asyncio does)
FRAMES_KEPT = 256  # error frames kept encoded (one per refused uid)
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class RefusalLog:
    """Rate-limited log of refused peers: the first refusal of a quiet spell is logged at
    once, later ones within ``interval_s`` of the last line are counted and logged as one
    line when the interval ends."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self.clock = clock
        self._last_line = float("-inf")
        self._held: Counter[int] = Counter()  # uid -> refusals since the last line
        self._flush: asyncio.TimerHandle | None = None

    def refused(self, creds: security.PeerCredentials) -> None:
        now = self.clock()
        if not self._held and now - self._last_line >= self.interval_s:
            self._last_line = now
            log.warning("refused connection from pid %d uid %d: not the daemon's uid nor in allowed_uids "
                        "(further refusals are logged once per %.0f s)", creds.pid, creds.uid, self.interval_s)
            return
        self._held[creds.uid] += 1
        if self._flush is None:
            self._flush = self.loop.call_at(self.loop.time() + max(0.0, self._last_line + self.interval_s - now),
                                            self.flush)

    def flush(self) -> None:
        self._flush = None
        if not self._held:
            return
        n, uids = sum(self._held.values()), self._held.most_common(5)
        shown = ", ".join(f"uid {u}: {k}" for u, k in uids) + (", ..." if len(self._held) > len(uids) else "")
        log.warning("refused %d more connections in the last %.0f s (%s)", n, self.clock() - self._last_line, shown)
        self._last_line = self.clock()
        self._held.clear()

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        self.flush()


class Gate:
    """Accepts on ``sock`` (listening, non-blocking): ``admitted(uid)`` decides, ``admit``
    takes each admitted socket. Runs on the loop thread; :meth:`close` stops accepting."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, admitted: Callable[[int], bool],
                 admit: Callable[[socket.socket], None], on_refuse: Callable[[], None] | None = None,
                 log_interval_s: float = LOG_INTERVAL_S) -> None:
        self.sock = sock
        self.loop = loop
        self.admitted = admitted
        self.admit = admit
        self.on_refuse = on_refuse  # the metric
        self.refused = 0  # peers refused since start (daemon stats)
        self.log = RefusalLog(loop, log_interval_s)
        self._frames: dict[int, bytes] = {}
        self._reading = False
        self._closed = False

    def start(self) -> None:
        self.loop.add_reader(self.sock.fileno(), self._accept)
        self._reading = True

    def close(self) -> None:
        """No more connections: the listening socket is closed (queued connects fail)."""
        if self._closed:
            return
        self._closed = True
        if self._reading:
            self.loop.remove_reader(self.sock.fileno())
            self._reading = False
        self.sock.close()
        self.log.close()

    def _accept(self) -> None:
        for _ in range(BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the peer gave up while queued
            except OSError as e:
                if e.errno not in _RESOURCE_ERRNOS:
                    raise
                log.error("cannot accept connections: %s; trying again in %.0f s", e.strerror, ACCEPT_PAUSE_S)
                self.loop.remove_reader(self.sock.fileno())
                self._reading = False
                self.loop.call_later(ACCEPT_PAUSE_S, self._resume)
                return
            try:
                creds = security.peer_credentials(conn)
            except OSError:
                conn.close()  # gone already
                continue
            if self.admitted(creds.uid):
                conn.setblocking(False)
                self.admit(conn)
            else:
                self._refuse(conn, creds)

    def _resume(self) -> None:
        if not self._closed and not self._reading:
            self.start()

    def _refuse(self, conn: socket.socket, creds: security.PeerCredentials) -> None:
        try:
            conn.send(self._frame(creds.uid), socket.MSG_DONTWAIT)
        except OSError:
            pass  # full or gone: it only misses the reason
        conn.close()
        self.refused += 1
        if self.on_refuse is not None:
            self.on_refuse()
        self.log.refused(creds)

    def _frame(self, uid: int) -> bytes:
        """The error frame of a refused uid (request id 0: about the connection; the client
        raises DaemonUnavailableError with this reason)."""
        frame = self._frames.get(uid)
        if frame is None:
            if len(self._frames) >= FRAMES_KEPT:
                self._frames.clear()
            err = security.PeerRejectedError(f"peer uid {uid} may not use this daemon")
            header, _ = messages.ErrorReply(type(err).__name__, err.message, err.hint).encode()
            frame = self._frames[uid] = encode_frame(0, 0, header, b"", FLAG_REPLY | FLAG_ERROR)
        return frame


def admit_with(loop: asyncio.AbstractEventLoop, protocol: Callable[[], Any],
               tasks: set[asyncio.Task]) -> Callable[[socket.socket], None]:
    """``Gate.admit`` handing each socket to asyncio with ``protocol`` (its transport is
    made by a task, kept in ``tasks`` until done)."""

    def admit(sock: socket.socket) -> None:
        task = loop.create_task(loop.connect_accepted_socket(protocol, sock))
        tasks.add(task)

        def done(t: asyncio.Task) -> None:
            tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("could not set up an accepted connection: %s", t.exception())
                sock.close()

        task.add_done_callback(done)

    return admit
