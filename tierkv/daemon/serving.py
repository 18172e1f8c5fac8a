"""How the daemon serves one connection: accept or refuse it, read its frames in order,
and run each request (as it is read, or as a task), replying or answering the error.

:class:`Serving` is a part of :class:`tierkv.daemon.server.Daemon` (which opens the home and
runs the event loop): it is handed the handlers, the metrics and the daemon's connection
table, which only this class adds to and removes from. Requests that can be answered as
their bytes arrive, before this read loop wakes: fast_path.py.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING, Callable

from ..errors import DaemonUnavailableError, ProtocolError, TierKVError
from . import security
from .connection import Connection
from .fast_path import FastProtocol
from .protocol import BadHeaderError, FatalFrameError, Frame, FrameTimeoutError, IdleConnectionError, Op, read_frame

if TYPE_CHECKING:
    from .config import DaemonConfig
    from .handlers import Handlers
    from .metrics import DaemonMetrics

log = logging.getLogger("tierkv.daemon.server")  # the daemon's log (operators and tests filter on it)
OP_NAMES = {int(op): op.name.lower() for op in Op}  # metric labels, without an enum lookup per request
DRAIN_TIMEOUT_S = 60.0


class Serving:
    """Accepting, reading and running the requests of every connection."""

    def __init__(self, config: "DaemonConfig", handlers: "Handlers", metrics: "DaemonMetrics",
                 connections: dict[int, Connection], stopping: Callable[[], bool]) -> None:
        """``connections``: the daemon's table (id -> connection) this class keeps;
        ``stopping``: whether the daemon is shutting down (new requests are refused)."""
        self.config = config
        self.handlers = handlers
        self.metrics = metrics
        self.connections = connections
        self._stopping = stopping
        self._ids = itertools.count(1)

    def apply_config(self, config: "DaemonConfig") -> None:
        """The settings a reload changed (reload.py): new connections get them, and the
        send timeout applies to every connection now."""
        self.config = config
        for conn in self.connections.values():
            conn.send_timeout_s = config.quotas.send_timeout_s

    def cut_off(self, uids: tuple[int, ...], why: Callable[[int], TierKVError]) -> int:
        """End every connection of ``uids`` now, each told ``why(uid)``; returns how many.
        Their leases, staging and tenant regions end with them (:meth:`on_connect`)."""
        closed = 0
        for conn in list(self.connections.values()):
            if conn.creds.uid in uids:
                conn.cut_off(why(conn.creds.uid))
                closed += 1
        return closed

    async def drain(self) -> None:
        """Let every request already read finish, then end the connections (which releases
        their leases)."""
        tasks = [t for c in self.connections.values() for t in c.tasks]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S)
            if pending:
                log.warning("%d requests did not finish within %.0f s", len(pending), DRAIN_TIMEOUT_S)
        for c in list(self.connections.values()):
            c.writer.close()
        deadline = time.monotonic() + 10
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        creds = security.peer_credentials(writer.get_extra_info("socket"))
        conn = Connection(next(self._ids), creds, writer, asyncio.Semaphore(self.config.max_inflight),
                          send_timeout_s=self.config.quotas.send_timeout_s,
                          idle_timeout_s=self.config.quotas.idle_timeout_s)
        reason = None
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
        elif self._stopping():
            reason = "stopping"
            err = DaemonUnavailableError("the daemon is shutting down")
        if reason is not None:
            log.warning("refused connection from pid %d uid %d: %s", creds.pid, creds.uid, reason)
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
            n = await self.handlers.lease_ops.end_connection(conn)
            if n:
                log.info("connection %d (pid %d) ended holding %d leases; released", conn.id, conn.client_pid, n)
            del self.connections[conn.id]
            writer.close()

    def _uid_connection_refusal(self, uid: int) -> TierKVError | None:
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
        return conn.holds_nothing() and self.handlers.leases.count(conn.id) == 0

    async def _serve_connection(self, conn: Connection, reader: asyncio.StreamReader) -> None:
        q = self.config.quotas
        while True:
            if conn.unsent > q.unread_reply_bytes and not await conn.wait_for_reader(q.unread_reply_bytes,
                                                                                  q.send_timeout_s):
                log.warning("connection %d: %d reply bytes unread for %.0f s; closing it", conn.id, conn.unsent,
                            q.send_timeout_s)
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
        t0, measured = time.perf_counter(), True
        op_name = OP_NAMES.get(frame.opcode, "unknown")
        try:
            if frame.is_reply:
                raise ProtocolError("clients send requests, not replies")
            entry = self.handlers.table.get(frame.opcode)
            if entry is None:
                raise ProtocolError(f"unknown opcode {frame.opcode}")
            if frame.opcode != Op.RELEASE and self._stopping():
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
            self.metrics.errors.labels(op_name, type(e).__name__).inc()
            await conn.send_error(frame.opcode, frame.request_id, e)
        finally:
            if measured:
                self.metrics.observe_latency(op_name, time.perf_counter() - t0)
        return True
