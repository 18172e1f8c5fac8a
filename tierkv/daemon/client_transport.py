"""The client's transport: one socket, a send lock, and a reader thread that matches
replies to requests by id (several threads may call one client at once); an error reply
becomes the same exception the embedded store raises. :class:`~tierkv.daemon.client.Client`
inherits it and owns its state (``_sock``, ``_pending``, ``_reader``, ...). Split out of
client.py, which keeps the connect, the shared-memory mapping and the StoreAPI methods.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from .. import errors
from ..errors import DaemonUnavailableError, ForkedStoreError, ProtocolError, TierKVError
from ..process import current_pid
from . import messages as m
from .protocol import Frame, Op, close_fds, encode_frame, read_frame_sync

log = logging.getLogger("tierkv.daemon.client")  # the client's log, as before the split


def _error_from(reply: m.ErrorReply) -> Exception:
    cls = getattr(errors, reply.error, None)
    if isinstance(cls, type) and issubclass(cls, TierKVError):
        return cls(reply.message, hint=reply.hint or None)
    if reply.error in ("ValueError", "KeyError", "TypeError"):
        return ValueError(reply.message)
    if reply.error in ("BadHeaderError", "FatalFrameError"):
        return ProtocolError(reply.message)
    return TierKVError(f"daemon error {reply.error}: {reply.message}", hint=reply.hint or None)


class ClientTransport:
    """Sending requests and delivering replies; mixed into Client."""

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
                self._call_async(Op.PING, m.Empty())
            except TierKVError:
                return

    def _read_loop(self) -> None:
        try:
            while True:
                frame = read_frame_sync(self._sock)
                self._deliver(frame)
        except (OSError, ConnectionError, TierKVError) as e:
            if not self._closed:
                log.debug("connection to %s lost: %s", self.socket_path, e)
            self._fail_all(e)

    def _deliver(self, frame: Frame) -> None:
        if frame.fds and frame.opcode != Op.HELLO:
            close_fds(frame.fds)  # descriptors only ever come with the HELLO reply
        if frame.is_error:
            reply = m.ErrorReply.decode(frame.header, frame.payload)
            if frame.request_id == 0:  # about the connection, not a request: it is closing
                self._failure = DaemonUnavailableError(f"the daemon closed the connection: {reply.message}",
                                                       hint=reply.hint or None)
                return
            exc = _error_from(reply)
        with self._pending_lock:
            fut = self._pending.pop(frame.request_id, None)
        if fut is None:
            close_fds(frame.fds)
            return
        if frame.is_error:
            fut.set_exception(exc)
        else:
            fut.set_result(frame)

    def _fail_all(self, cause: Exception) -> None:
        exc = self._failure or DaemonUnavailableError(f"connection to the daemon on {self.socket_path} was lost ({cause})")
        self._failure = exc
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(exc)

    def _check_open(self) -> None:
        if current_pid() != self._pid:
            raise ForkedStoreError(f"this client was connected by pid {self._pid}, used from pid {os.getpid()}",
                                   hint="connect again in the child with tierkv.connect()")
        if self._closed:
            raise DaemonUnavailableError("the client is closed", hint="connect again with tierkv.connect()")
        if self._failure is not None:
            raise self._failure

    def _send_oneway(self, op: Op, msg: Any) -> None:
        """Send a request whose reply nobody waits for (the daemon sends none)."""
        self._check_open()
        header, payload = msg.encode()
        frame = encode_frame(op, next(self._ids), header, payload)
        try:
            with self._send_lock:
                self._sock.sendall(frame)
                self._last_send = time.monotonic()
        except OSError as e:
            raise DaemonUnavailableError(f"cannot reach the daemon on {self.socket_path}: {e}") from None

    def _call_async(self, op: Op, msg: Any) -> Future:
        self._check_open()
        header, payload = msg.encode()
        rid = next(self._ids)
        fut: Future = Future()
        with self._pending_lock:
            self._pending[rid] = fut
        frame = encode_frame(op, rid, header, payload)
        try:
            with self._send_lock:
                self._sock.sendall(frame)
                self._last_send = time.monotonic()
        except OSError as e:
            with self._pending_lock:
                self._pending.pop(rid, None)
            # The daemon may have refused or closed this connection with a reason (a quota,
            # the connection limit): the reader is about to deliver it; prefer it.
            if threading.current_thread() is not self._reader:
                self._reader.join(0.5)
            if self._failure is not None:
                raise self._failure from None
            raise DaemonUnavailableError(f"cannot reach the daemon on {self.socket_path}: {e}") from None
        return fut

    def _call_frame(self, op: Op, msg: Any) -> Frame:
        fut = self._call_async(op, msg)
        try:
            return fut.result(timeout=self.timeout)
        except TimeoutError:
            raise DaemonUnavailableError(f"no reply from the daemon on {self.socket_path} within {self.timeout:g} s",
                                         hint="check that the daemon is alive (its log, tierkv_request_seconds)") from None

    def _call(self, op: Op, msg: Any) -> dict[str, Any]:
        return self._call_frame(op, msg).header
