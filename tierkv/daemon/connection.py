"""One client connection as the daemon sees it: the peer's credentials, the requests in
flight (at most ``max_inflight``), and the replies it is sent, in order under a write lock,
with a send timeout that cuts off a peer that reads nothing. Connections are accepted and
read by serving.py.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProtocolError, TierKVError
from . import messages, security
from .layouts import LayoutEntry
from .tenant_regions import TenantRegions
from .protocol import FLAG_ERROR, FLAG_REPLY, encode_frame, send_with_fds


@dataclass(eq=False)
class Connection:
    id: int
    creds: security.PeerCredentials
    writer: asyncio.StreamWriter
    inflight: asyncio.Semaphore
    client_pid: int = 0
    entry: LayoutEntry | None = None  # the layout bound at HELLO (None: operations only)
    # Another uid's connection under namespace_per_uid: its own read window and staging
    # (tenant_regions.py; closed when the connection ends). None: the tiers are mapped.
    tenant: TenantRegions | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    unsent: int = 0  # bytes of replies encoded and not yet taken by the peer (quotas.py)
    send_timeout_s: float = 30.0
    # Told to the client at HELLO, which pings at a third of it: fixed for the connection's
    # life (a reload's shorter one applies to connections accepted after it).
    idle_timeout_s: float = 30.0
    # The read loop waits for the first byte of a frame: requests may be served as they
    # arrive (fast_path.py), and ``fast_at`` is when one last was (time.monotonic()).
    parked: bool = False
    fast_at: float = 0.0
    sending: set[asyncio.Task] = field(default_factory=set)  # send_now's tasks (a task needs a reference)

    def request_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.inflight.release()

    async def send(self, opcode: int, request_id: int, header: dict, payload: bytes = b"", flags: int = FLAG_REPLY,
                   fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send one reply. A peer that takes nothing for ``send_timeout_s`` is cut off
        (ConnectionError; its leases are released when its reader ends)."""
        frame = encode_frame(opcode, request_id, header, payload, flags)
        self.unsent += len(frame)
        try:
            async with self.write_lock:
                if self.writer.is_closing():
                    return
                if fds:  # shared-memory descriptors travel with this reply (SCM_RIGHTS)
                    await self._bounded(send_with_fds(self.writer, frame, fds))
                    return
                self.writer.write(frame)
                if self.writer.transport.get_write_buffer_size():  # else the kernel took it all (no timer armed)
                    await self._bounded(self.writer.drain())
        finally:
            self.unsent -= len(frame)

    async def _bounded(self, sending: Any) -> None:
        """Await ``sending`` (held: the write lock); a peer that takes nothing for
        ``send_timeout_s`` is cut off (ConnectionError)."""
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await sending
        except TimeoutError:
            self.writer.transport.abort()
            raise ConnectionError(f"the peer read no reply for {self.send_timeout_s:g} s") from None

    def unpark(self) -> None:
        self.parked = False

    def send_now(self, opcode: int, request_id: int, header: dict, payload: bytes = b"",
                 fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send one reply from outside a coroutine (fast_path.py, which has checked that no
        other reply is being sent). What the kernel does not take at once, and a reply
        carrying descriptors, is finished by a task holding the write lock, as :meth:`send`."""
        if fds:
            self._spawn(self._send_quietly(opcode, request_id, header, payload, fds))
            return
        try:
            frame = encode_frame(opcode, request_id, header, payload, FLAG_REPLY)
        except ProtocolError as e:  # a reply over the frame limits: its error instead, as send() callers do
            self._spawn(self.send_error(opcode, request_id, e))
            return
        self.writer.write(frame)
        left = self.writer.transport.get_write_buffer_size()
        if left:
            self.unsent += left
            self._spawn(self._drain_quietly(left))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _send_quietly(self, opcode: int, request_id: int, header: dict, payload: bytes,
                            fds: list[int] | tuple[int, ...]) -> None:
        try:
            await self.send(opcode, request_id, header, payload, fds=fds)
        except (ConnectionError, OSError):
            pass  # the peer is gone; its reader notices and cleans up

    async def _drain_quietly(self, n: int) -> None:
        """Wait, as :meth:`send` does, until the peer took the ``n`` bytes a reply left in
        the transport's buffer (cut off after ``send_timeout_s``)."""
        try:
            async with self.write_lock:
                await self._bounded(self.writer.drain())
        except (ConnectionError, OSError):
            pass  # cut off, or the peer is gone; its reader notices and cleans up
        finally:
            self.unsent -= n

    async def wait_for_reader(self, max_unsent: int, timeout_s: float) -> bool:
        """The peer does not read its replies: read no more of its requests until it does
        (each would pin another reply). Whether its unread replies fell to ``max_unsent``
        bytes within ``timeout_s`` (False: the caller cuts it off)."""
        deadline = time.monotonic() + timeout_s
        while self.unsent > max_unsent and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.unsent <= max_unsent

    def cut_off(self, reason: TierKVError) -> None:
        """End this connection now (its uid was revoked): ``reason`` as an error frame about
        the connection when nothing else is being sent, then the socket is aborted. The read
        loop ends and the daemon ends the connection's leases, staging and tenant regions."""
        transport = self.writer.transport
        if not transport.is_closing() and not self.write_lock.locked() and not transport.get_write_buffer_size():
            header, _ = messages.ErrorReply(type(reason).__name__, reason.message, reason.hint).encode()
            transport.write(encode_frame(0, 0, header, b"", FLAG_REPLY | FLAG_ERROR))  # taken by the kernel, or lost
        transport.abort()

    def holds_nothing(self) -> bool:
        """No request in flight and no reply waiting (leases and staging are checked by
        the daemon, which owns those tables)."""
        return not self.tasks and self.unsent == 0

    async def send_error(self, opcode: int, request_id: int, exc: BaseException) -> None:
        if isinstance(exc, TierKVError):
            message, hint = exc.message or str(exc), exc.hint or ""
        else:  # ValueError, OSError, ...: no hint to pass on
            message, hint = str(exc), ""
        header, _ = messages.ErrorReply(type(exc).__name__, message, hint).encode()
        try:
            await self.send(opcode & 0xFF, request_id, header, flags=FLAG_REPLY | FLAG_ERROR)
        except (ConnectionError, OSError):
            pass
