"""Requests answered as their bytes arrive, inside the connection protocol's
``data_received``, without waking the connection's read loop.

Each connection has a read loop (server.py, ``_serve_connection``): a coroutine that reads
a frame through an ``asyncio.StreamReader`` and serves it. When a request arrives, the
bytes go into the reader, the reader wakes the loop's task, and the task runs on the next
turn of the event loop: on this project's 2-core machine a bare echo server built that way
(``scripts/bench_rtt_floor.py``, a daemon-sized request and reply) took 115 us a round
trip against 70 us for one that answers in ``data_received`` (2026-12-03), and dropping
the per-frame timeout gained only 13 us of the difference. A daemon's typical traffic is
a lookup, an acquire of resident blocks and a one-way release, all answered without
waiting (``Handlers.now``, ``LeaseHandlers.release_oneway``), so they are served here when it
is safe to jump the loop:

- the read loop is parked, waiting for the first byte of a frame (``Connection.parked``),
  so no frame is half read and every earlier request has been dispatched in order;
- no reply is being sent or waits in the transport's buffer, and the peer reads its
  replies (the quota on unread reply bytes, connection.py), and the daemon is not stopping.

Only whole frames at the start of the bytes are served here; from the first frame this
cannot serve (another opcode, a bad head or header, an acquire that must wait, an error)
everything goes to the reader as before, so that frame and all after it take the usual
path in order, and errors are answered there (nothing here has side effects before it
knows it can finish, except an acquire's lease, whose reply is then always sent).
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

from . import messages as m
from .connection import Connection
from .protocol import HEAD, FatalFrameError, Op, parse_head, parse_header

if TYPE_CHECKING:
    from .handlers import Handlers
    from .metrics import DaemonMetrics


class FastProtocol(asyncio.StreamReaderProtocol):
    """A connection's protocol: bytes go to the fast path while the read loop is parked,
    the rest (and everything else) to the stream reader as usual."""

    def __init__(self, reader: asyncio.StreamReader, connected: Callable[..., Any],
                 loop: asyncio.AbstractEventLoop, fast: "FastPath") -> None:
        super().__init__(reader, connected, loop=loop)
        self.conn: Connection | None = None  # set by the server once it accepted the connection
        self._fast = fast

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is not None and conn.parked:
            data = self._fast.serve(conn, data)
            if not data:
                return
            # The reader holds bytes from here on (a frame not served, or its first part):
            # the read loop must take them before anything else is served here, though it
            # only runs at the loop's next turn, after more bytes may have arrived.
            conn.parked = False
        super().data_received(data)


class FastPath:
    """Serves the whole frames it can at the start of the bytes a connection received."""

    def __init__(self, handlers: "Handlers", unread_reply_bytes: int, stopping: Callable[[], bool],
                 metrics: "DaemonMetrics | None", op_names: dict[int, str]) -> None:
        self.handlers = handlers
        self.unread_reply_bytes = unread_reply_bytes
        self.stopping = stopping
        self.metrics = metrics
        self.op_names = op_names

    def serve(self, conn: Connection, data: bytes) -> bytes:
        """Serve the whole frames at the start of ``data`` that need neither a task nor a
        wait; returns the bytes left for the read loop (from the first frame not served)."""
        pos, end_of_data = 0, len(data)
        head_size = HEAD.size
        while end_of_data - pos >= head_size:
            if (conn.unsent > self.unread_reply_bytes or conn.write_lock.locked() or self.stopping()
                    or conn.writer.is_closing() or conn.writer.transport.get_write_buffer_size()):
                break
            try:
                opcode, flags, request_id, hlen, plen = parse_head(data[pos : pos + head_size])
            except FatalFrameError:
                break  # the read loop reads it again and answers why
            end = pos + head_size + hlen + plen
            if end > end_of_data or flags or not (opcode == Op.RELEASE or opcode in self.handlers.now):
                break  # a frame not whole yet, a reply sent as a request, or another kind
            if not self._serve_one(conn, opcode, request_id, data[pos + head_size : pos + head_size + hlen],
                                   data[pos + head_size + hlen : end]):
                break
            pos = end
        return data[pos:] if pos else data

    def _serve_one(self, conn: Connection, opcode: int, request_id: int, raw_header: bytes, payload: bytes) -> bool:
        """One request served and answered now; False, with nothing done, when it must take
        the read loop's path."""
        t0 = time.perf_counter()
        if opcode == Op.RELEASE:
            try:
                msg = m.Release.decode(parse_header(raw_header), payload)
            except Exception:  # noqa: BLE001 - the read loop decodes it again and answers the error
                return False
            try:
                if not self.handlers.lease_ops.release_oneway(conn, msg):
                    return False  # it wants a reply: the usual path
            except Exception:  # noqa: BLE001 - the usual path runs it again and logs or answers
                return False
        else:
            serve_now = self.handlers.table[opcode].serve_now
            if serve_now is None:
                return False
            try:
                out = serve_now(conn, parse_header(raw_header), payload)
            except Exception:  # noqa: BLE001 - nothing was done: the usual path decodes and runs it again, and answers
                return False
            if out is None:
                return False
            header, reply_payload, *fds = out
            # A reply of this request from here on: sent now (the checks in serve() ensured
            # nothing else is being sent), or by a task if the kernel did not take it all.
            conn.send_now(opcode, request_id, header, reply_payload, fds=fds[0] if fds else ())
        conn.fast_at = time.monotonic()
        self.handlers.fast_path_requests += 1
        if self.metrics is not None:
            self.metrics.observe_latency(self.op_names.get(opcode, "unknown"), time.perf_counter() - t0)
        return True
