"""How the daemon serves one connection: accept or refuse it, read its frames in order,
and run each request (as it is read, or as a task), replying or answering the error.

A part of :class:`tierkv.daemon.server.Daemon` (a base class of it), split out of server.py,
which opens the home and runs the event loop. Requests that can be answered as their bytes
arrive, before this read loop wakes: fast_path.py.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..errors import DaemonUnavailableError, ProtocolError, TierKVError
from . import security
from .connection import Connection
from .fast_path import FastProtocol
from .protocol import BadHeaderError, FatalFrameError, Frame, FrameTimeoutError, IdleConnectionError, Op, read_frame

if TYPE_CHECKING:
    import itertools

    from .config import DaemonConfig
    from .handlers import Handlers
    from .metrics import DaemonMetrics

log = logging.getLogger("tierkv.daemon.server")  # one logger for the daemon's messages, as before the split
OP_NAMES = {int(op): op.name.lower() for op in Op}  # metric labels, without an enum lookup per request


class Serving:
    """The per-connection half of the daemon (state owned by :class:`Daemon`)."""

    config: "DaemonConfig"
    handlers: "Handlers | None"
    metrics: "DaemonMetrics | None"
    connections: dict[int, Connection]
    _ids: "itertools.count[int]"
    _stop: asyncio.Event | None

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        creds = security.peer_credentials(writer.get_extra_info("socket"))
        conn = Connection(next(self._ids), creds, writer, asyncio.Semaphore(self.config.max_inflight),
                          send_timeout_s=self.config.quotas.send_timeout_s,
                          idle_timeout_s=self.config.quotas.idle_timeout_s)
        reason = None
        assert self.handlers is not None
        # The gate (gate.py) refused other uids at accept; checked again here for a uid that
        # a reload removed from allowed_uids between the accept and this task.
        if not security.peer_allowed(creds, self.config.allowed_uids):
            reason = "uid"
            err: TierKVError = security.PeerRejectedError(f"peer uid {creds.uid} (pid {creds.pid}) may not use this daemon")
        elif len(self.connections) >= self.config.max_connections:
            reason = "limit"
            err = DaemonUnavailableError(f"the daemon serves {self.config.max_connections} connections already",
                                         hint="retry later; the operator can raise max_connections")
        elif (err2 := self._uid_connection_refusal(creds.uid)) is not None:
            reason, err = "uid_connections", err2
        elif self._stop is not None and self._stop.is_set():
            reason = "stopping"
            err = DaemonUnavailableError("the daemon is shutting down")
        if reason is not None:
            log.warning("refused connection from pid %d uid %d: %s", creds.pid, creds.uid, reason)
            if self.metrics:
                self.metrics.rejected.labels(reason).inc()
            await conn.send_error(0, 0, err)
            writer.close()
            return
        self.connections[conn.id] = conn
        protocol = writer.transport.get_protocol()
        if isinstance(protocol, FastProtocol):
            protocol.conn = conn  # requests may now be served as they arrive (fast_path.py)
        try:
            await self._serve_connection(conn, reader)
        finally:
            if isinstance(protocol, FastProtocol):
                protocol.conn = None
            conn.parked = False
            if conn.tasks:
                await asyncio.wait(list(conn.tasks))  # their leases must be known before we free
            assert self.handlers is not None
            n = await self.handlers.end_connection(conn)
            if n:
                log.info("connection %d (pid %d) ended holding %d leases; released", conn.id, conn.client_pid, n)
            del self.connections[conn.id]
            writer.close()

    def _uid_connection_refusal(self, uid: int) -> TierKVError | None:
        assert self.handlers is not None
        try:
            self.handlers.quota.check_connection(uid, [c.creds.uid for c in self.connections.values()])
        except TierKVError as e:
            return e
        return None

    async def _read_frame(self, conn: Connection, reader: asyncio.StreamReader) -> Frame | None:
        """The connection's next frame. Parked until its first byte: meanwhile requests may
        be answered as they arrive, without this loop (fast_path.py), and count as activity
        for the idle timeout."""
        q = self.config.quotas
        conn.parked = True
        try:
            return await read_frame(reader, idle_timeout=conn.idle_timeout_s, frame_timeout=q.frame_timeout_s,
                                    is_idle=lambda: self._holds_nothing(conn) and self._quiet(conn),
                                    started=conn.unpark)
        finally:
            conn.parked = False

    def _quiet(self, conn: Connection) -> bool:
        """No request served on the fast path for the idle timeout."""
        return time.monotonic() - conn.fast_at >= conn.idle_timeout_s

    def _holds_nothing(self, conn: Connection) -> bool:
        """No request in flight, reply unsent or lease held. Staging slots do not count
        (issue #34, item 10: two silent connections holding staging kept it forever):
        a client between STAGE and COMMIT is busy writing pages, not silent for the idle
        timeout, and its slots expire anyway (staging_timeout_s)."""
        assert self.handlers is not None
        return conn.holds_nothing() and self.handlers.leases.count(conn.id) == 0

    async def _serve_connection(self, conn: Connection, reader: asyncio.StreamReader) -> None:
        q = self.config.quotas
        while True:
            if conn.unsent > q.unread_reply_bytes and not await conn.wait_for_reader(q.unread_reply_bytes,
                                                                                  q.send_timeout_s):
                log.warning("connection %d: %d reply bytes unread for %.0f s; closing it", conn.id, conn.unsent,
                            q.send_timeout_s)
                if self.metrics:
                    self.metrics.rejected.labels("unread_replies").inc()
                conn.writer.transport.abort()
                return
            try:
                frame = await self._read_frame(conn, reader)
            except BadHeaderError as e:
                await conn.send_error(e.opcode, e.request_id, e)
                continue
            except FatalFrameError as e:
                log.warning("connection %d: %s; closing it", conn.id, e.message)
                if self.metrics:
                    reason = {IdleConnectionError: "idle", FrameTimeoutError: "frame_timeout"}.get(type(e), "frame")
                    self.metrics.rejected.labels(reason).inc()
                await conn.send_error(0, 0, e)
                return
            except (ConnectionError, OSError):
                return
            if frame is None:
                return
            if frame.opcode == Op.RELEASE:
                # Served here, without a task: a one-way release waits on nothing (it ends
                # the store leases on the loop or queues them), and a task per request is
                # a measurable share of the daemon's time at thousands of requests a second.
                await self._serve_request(conn, frame)
                continue
            if frame.opcode in self.handlers.now and await self._serve_request(conn, frame, now=True):
                continue  # answered as read (an acquire of resident blocks): no task either
            await conn.inflight.acquire()
            task = asyncio.create_task(self._serve_request(conn, frame))
            conn.tasks.add(task)
            task.add_done_callback(conn.request_done)

    async def _serve_request(self, conn: Connection, frame: Frame, now: bool = False) -> bool:
        """Decode one request, run its handler, send the reply (or the error). With
        ``now``: only if the handler's synchronous form (``Handlers.now``) can answer
        without waiting; False, with nothing done or sent, when it cannot."""
        assert self.handlers is not None
        t0, measured = time.perf_counter(), True
        op_name = OP_NAMES.get(frame.opcode, "unknown")
        try:
            if frame.is_reply:
                raise ProtocolError("clients send requests, not replies")
            entry = self.handlers.table.get(frame.opcode)
            if entry is None:
                raise ProtocolError(f"unknown opcode {frame.opcode}")
            if self._stop is not None and self._stop.is_set() and frame.opcode != Op.RELEASE:
                raise DaemonUnavailableError("the daemon is shutting down")
            cls, handler = entry
            msg = cls.decode(frame.header, frame.payload)
            if now:
                out = self.handlers.now[frame.opcode](conn, msg)
                if out is None:
                    measured = False  # not served here: the task that serves it measures it
                    return False
            else:
                out = await handler(conn, msg)
            if out is None:
                return True  # a one-way request (RELEASE with reply=False): the client waits for nothing
            header, payload, *fds = out
            await conn.send(frame.opcode, frame.request_id, header, payload, fds=fds[0] if fds else ())
        except ConnectionError:
            return True  # the peer is gone; the connection's reader notices and cleans up
        except Exception as e:  # noqa: BLE001 - every failure becomes an error reply
            if not isinstance(e, (TierKVError, ValueError, OSError)):
                log.exception("request %s failed", op_name)
            if self.metrics:
                self.metrics.errors.labels(op_name, type(e).__name__).inc()
            await conn.send_error(frame.opcode, frame.request_id, e)
        finally:
            if self.metrics and measured:
                self.metrics.observe_latency(op_name, time.perf_counter() - t0)
        return True
