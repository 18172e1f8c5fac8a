"""One client connection as the daemon sees it: the peer's credentials, the requests in
flight (at most ``max_inflight``), and the replies it is sent, in order under a write lock,
with a send timeout that cuts off a peer that reads nothing. Split out of server.py, which
accepts connections and runs their read loop.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from . import messages, security
from .layouts import LayoutEntry
from .protocol import FLAG_ERROR, FLAG_REPLY, encode_frame, send_with_fds


@dataclass(eq=False)
class Connection:
    id: int
    creds: security.PeerCredentials
    writer: asyncio.StreamWriter
    inflight: asyncio.Semaphore
    client_pid: int = 0
    entry: LayoutEntry | None = None  # the layout bound at HELLO (None: operations only)
    tasks: set[asyncio.Task] = field(default_factory=set)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    unsent: int = 0  # bytes of replies encoded and not yet taken by the peer (quotas.py)
    send_timeout_s: float = 30.0

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
                try:
                    if not fds:
                        self.writer.write(frame)
                        if not self.writer.transport.get_write_buffer_size():
                            return  # the kernel took it all: nothing to wait for (no timer armed)
                    async with asyncio.timeout(self.send_timeout_s):
                        if fds:  # shared-memory descriptors travel with this reply (SCM_RIGHTS)
                            await send_with_fds(self.writer, frame, fds)
                            return
                        await self.writer.drain()
                except TimeoutError:
                    self.writer.transport.abort()
                    raise ConnectionError(f"the peer read no reply for {self.send_timeout_s:g} s") from None
        finally:
            self.unsent -= len(frame)

    async def wait_for_reader(self, max_unsent: int, timeout_s: float) -> bool:
        """The peer does not read its replies: read no more of its requests until it does
        (each would pin another reply). Whether its unread replies fell to ``max_unsent``
        bytes within ``timeout_s`` (False: the caller cuts it off)."""
        deadline = time.monotonic() + timeout_s
        while self.unsent > max_unsent and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.unsent <= max_unsent

    def holds_nothing(self) -> bool:
        """No request in flight and no reply waiting (leases and staging are checked by
        the daemon, which owns those tables)."""
        return not self.tasks and self.unsent == 0

    async def send_error(self, opcode: int, request_id: int, exc: BaseException) -> None:
        name, hint = type(exc).__name__, getattr(exc, "hint", "") or ""
        message = getattr(exc, "message", None) or str(exc)
        header, _ = messages.ErrorReply(name, message, hint).encode()
        try:
            await self.send(opcode & 0xFF, request_id, header, flags=FLAG_REPLY | FLAG_ERROR)
        except (ConnectionError, OSError):
            pass
