"""The client's transport: one socket to the daemon, a send lock, and replies read by the
threads that wait for them (several threads may call one client at once); an error reply
becomes the same exception the embedded store raises. :class:`~tierkv.daemon.client.Client`
holds one and knows nothing of frames or sockets; the transport knows nothing of pages.

No reader thread: a caller waiting for a reply reads the socket itself while no other
thread does (the *read role*, taken under ``_io``), delivering each frame to whoever waits
for it, until its own arrives; then it hands the role on. A reply handed from a reader
thread to the caller cost two thread switches per request, which on a loaded machine was
the larger part of a client's time (issue #15: 32 client processes on 2 cores).
"""
from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

from .. import errors
from ..errors import DaemonUnavailableError, ForkedStoreError, ProtocolError, TierKVError
from ..process import current_pid
from . import messages as m
from .protocol import ConnectionClosedError, Frame, Op, close_fds, encode_frame, read_frame_sync
from .security import check_listener

log = logging.getLogger("tierkv.daemon.client")  # one logger for the whole client
REASON_WAIT_S = 0.5  # after a failed send, how long to wait for the daemon's reason


def daemon_gone(socket_path: Any, cause: BaseException) -> DaemonUnavailableError | None:
    """The error for a connection that failed because no daemon is there any more (refused,
    no socket file, closed or reset with no reason sent), or None for another cause. Issue
    #37, item 10: "connection closed after 0 of 24 bytes" did not tell a user the daemon
    had stopped."""
    if isinstance(cause, FileNotFoundError):
        return DaemonUnavailableError(f"no daemon at {socket_path}: the socket does not exist")
    if isinstance(cause, ConnectionRefusedError):
        why = "connection refused: the socket was left by a daemon that stopped"
    elif isinstance(cause, ConnectionClosedError):
        why = "connection closed" if cause.got == 0 else "connection closed in the middle of a reply"
    elif isinstance(cause, ConnectionResetError):
        why = "connection reset"
    elif isinstance(cause, BrokenPipeError):
        why = "connection closed"
    else:
        return None
    return DaemonUnavailableError(f"the daemon at {socket_path} is not running ({why})")


def _error_from(reply: m.ErrorReply) -> Exception:
    cls = getattr(errors, reply.error, None)
    if isinstance(cls, type) and issubclass(cls, TierKVError):
        return cls(reply.message, hint=reply.hint or None)
    if reply.error in ("ValueError", "KeyError", "TypeError"):
        return ValueError(reply.message)
    if reply.error in ("BadHeaderError", "FatalFrameError"):
        return ProtocolError(reply.message)
    return TierKVError(f"daemon error {reply.error}: {reply.message}", hint=reply.hint or None)


class Waiter:
    """One request's reply slot: set (under ``_io``) once, by whichever thread reads it."""

    __slots__ = ("frame", "error")

    def __init__(self) -> None:
        self.frame: Frame | None = None
        self.error: Exception | None = None

    def settled(self) -> bool:
        return self.frame is not None or self.error is not None


class ClientTransport:
    """A connection to the daemon on ``socket_path``: sends requests, reads replies, and
    fails every waiting request when the connection goes. Connects when made: the listener
    must run as root, as this user or as ``daemon_uid`` (checked before anything is sent);
    DaemonUnavailableError when no daemon answers. ``timeout``: how long a request waits
    for its reply. Usable only from the process that made it (ForkedStoreError)."""

    def __init__(self, socket_path: Path, timeout: float, connect_timeout: float, daemon_uid: int | None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._pid = os.getpid()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout)
        try:
            self._sock.connect(str(socket_path))
        except OSError as e:
            self._sock.close()
            raise daemon_gone(socket_path, e) or DaemonUnavailableError(
                f"no tierkv daemon on {socket_path}: {e.strerror or e}") from None
        try:
            check_listener(self._sock, socket_path, daemon_uid)
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._io = threading.Condition()  # guards _waiting and _reading
        self._waiting: dict[int, Waiter] = {}  # request id -> its reply slot
        self._reading = False  # a thread holds the read role
        self._closed = False
        self._failure: Exception | None = None
        self._last_send = time.monotonic()

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, op: Op, msg: Any) -> dict[str, Any]:
        """Send ``msg`` and wait for its reply's header; the daemon's error reply raised as
        the exception the embedded store raises; DaemonUnavailableError when no reply comes
        within ``timeout`` or the connection is gone."""
        return self.call_frame(op, msg).header

    def start_keepalive(self, idle_s: float) -> None:
        """Keep the connection alive although a daemon closes it after ``idle_s`` of silence."""
        threading.Thread(target=self._keepalive, args=(idle_s,), name="tierkv-client-keepalive", daemon=True).start()

    def close(self) -> None:
        """Disconnect (idempotent): requests waiting fail, later ones raise."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def check_integrity(self) -> None:
        """Connected, and no reply that came is left unclaimed."""
        assert not self._closed and self._failure is None, f"client is not connected ({self._failure})"
        with self._io:
            assert not any(w.settled() for w in self._waiting.values()), "a settled reply is still awaited"

    def _keepalive(self, idle_s: float) -> None:
        """PING when nothing was sent for a third of the daemon's idle timeout: the daemon
        closes a connection that holds nothing and sends nothing (quotas.py), and an idle
        client must stay usable."""
        period = max(0.05, idle_s / 3)
        while not self._closed and self._failure is None:
            time.sleep(period)
            if self._closed or time.monotonic() - self._last_send < period:
                continue
            try:
                self.call(Op.PING, m.Empty())
            except TierKVError:
                return

    def _deliver(self, frame: Frame) -> None:
        """Hand one frame to the request waiting for it (held: ``_io``)."""
        if frame.fds and frame.opcode != Op.HELLO:
            close_fds(frame.fds)  # descriptors only ever come with the HELLO reply
        exc: Exception | None = None
        if frame.is_error:
            reply = m.ErrorReply.decode(frame.header, frame.payload)
            if frame.request_id == 0:  # about the connection, not a request: it is closing
                self._failure = DaemonUnavailableError(f"the daemon closed the connection: {reply.message}",
                                                       hint=reply.hint or None)
                self._fail_all(self._failure)
                return
            exc = _error_from(reply)
        w = self._waiting.pop(frame.request_id, None)
        if w is None:  # its caller gave up waiting (a timeout)
            close_fds(frame.fds)
            return
        if exc is not None:
            w.error = exc
        else:
            w.frame = frame

    def _fail_all(self, cause: Exception) -> None:
        """The connection is gone (held: ``_io``): every waiting request fails with the
        daemon's reason when it sent one."""
        exc = self._failure or daemon_gone(self.socket_path, cause) or DaemonUnavailableError(
            f"connection to the daemon on {self.socket_path} was lost ({cause})")
        self._failure = exc
        waiting, self._waiting = self._waiting, {}
        for w in waiting.values():
            w.error = exc

    def check_open(self) -> None:
        """Raise what a request would meet: ForkedStoreError in another process,
        DaemonUnavailableError when closed or the connection failed."""
        if current_pid() != self._pid:
            raise ForkedStoreError(f"this client was connected by pid {self._pid}, used from pid {os.getpid()}",
                                   hint="connect again in the child with tierkv.connect()")
        if self._closed:
            raise DaemonUnavailableError("the client is closed", hint="connect again with tierkv.connect()")
        if self._failure is not None:
            raise self._failure

    def _send_frame(self, frame: bytes) -> None:
        try:
            with self._send_lock:
                self._sock.sendall(frame)
                self._last_send = time.monotonic()
        except OSError as e:
            # The daemon may have refused or closed this connection with a reason (a quota,
            # the connection limit): read it if it came; prefer it.
            self._read_until(Waiter(), time.monotonic() + REASON_WAIT_S)
            if self._failure is not None:
                raise self._failure from None
            raise daemon_gone(self.socket_path, e) or DaemonUnavailableError(
                f"cannot reach the daemon on {self.socket_path}: {e}") from None

    def send_oneway(self, op: Op, msg: Any) -> None:
        """Send a request whose reply nobody waits for (the daemon sends none)."""
        self.check_open()
        header, payload = msg.encode()
        self._send_frame(encode_frame(op, next(self._ids), header, payload))

    def call_frame(self, op: Op, msg: Any) -> Frame:
        """As :meth:`call`, the whole reply frame (its payload, descriptors sent with it)."""
        self.check_open()
        header, payload = msg.encode()
        rid = next(self._ids)
        w = Waiter()
        with self._io:
            self._waiting[rid] = w
        try:
            self._send_frame(encode_frame(op, rid, header, payload))
        except BaseException:
            with self._io:
                self._waiting.pop(rid, None)
            raise
        self._read_until(w, time.monotonic() + self.timeout)
        if w.frame is not None:
            return w.frame
        with self._io:
            self._waiting.pop(rid, None)  # a late reply is dropped when it comes
        if w.error is not None:
            raise w.error
        if self._failure is not None:  # the connection failed as this request was sent
            raise self._failure
        raise DaemonUnavailableError(f"no reply from the daemon on {self.socket_path} within {self.timeout:g} s",
                                     hint="check that the daemon is alive (its log, tierkv_request_seconds)")

    def _read_until(self, w: Waiter, deadline: float) -> None:
        """Until ``w`` is settled or ``deadline`` passes: wait while another thread reads,
        else read frames here, delivering each to its waiter."""
        io = self._io
        while True:
            with io:
                while self._reading and not w.settled() and self._failure is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    io.wait(left)
                if w.settled() or self._failure is not None:
                    return
                self._reading = True
            try:
                self._read_some(w, deadline)
            finally:
                with io:
                    self._reading = False
                    io.notify_all()  # another waiter may take the read role on
            if w.settled() or time.monotonic() >= deadline:
                return

    def _read_some(self, w: Waiter, deadline: float) -> None:
        """(the read role held) Read frames until ``w`` is settled or nothing comes before
        ``deadline``; a broken stream fails every waiter."""
        poll = select.poll()
        poll.register(self._sock, select.POLLIN)
        try:
            while not w.settled() and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0 or not poll.poll(max(0, int(left * 1000) + 1)):
                    return
                frame = read_frame_sync(self._sock)
                with self._io:
                    self._deliver(frame)
                    self._io.notify_all()  # the frame may have been another thread's reply
        except (OSError, ConnectionError, ValueError, TierKVError) as e:
            if not self._closed:
                log.debug("connection to %s lost: %s", self.socket_path, e)
            with self._io:
                self._fail_all(e)
                self._io.notify_all()
