"""The daemon's wire format: versioned binary frames on a Unix socket (see docs/protocol.md).

    frame  = head (24 bytes) | header (JSON object, UTF-8) | payload (raw bytes)
    head   = magic "TKVD" | version u8 | opcode u8 | flags u16 | request id u64
             | header length u32 | payload length u32          (little endian)

Every length is checked against a fixed limit *before* anything is allocated or read, so a
hostile or broken peer cannot make either side allocate more than ``MAX_HEADER`` +
``MAX_PAYLOAD`` bytes per frame. The header is JSON (decoded by ``json.loads`` into plain
dicts, lists, strings and numbers only); token ids travel as raw little-endian int32 in the
payload. Nothing is ever unpickled: pickle was the root of several CVEs in peer projects
that read objects from a socket or shared memory.

Rejected design: a struct-only header per message. It is faster to parse but each message
change is a wire break; a small JSON header with a version in the head stays readable and
extensible, and the hot data (token ids) is raw bytes anyway.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable

from ..errors import ProtocolError

MAGIC = b"TKVD"
VERSION = 1
HEAD = struct.Struct("<4sBBHQII")
MAX_HEADER = 64 * 1024  # bytes of JSON header
MAX_TOKENS = 4 * 1024 * 1024  # token ids per request
MAX_PAYLOAD = 4 * MAX_TOKENS  # bytes of payload (int32 token ids)
MAX_DEPTH = 32  # nesting of JSON arrays/objects in a header; real messages use at most 4

FLAG_REPLY = 0x1  # a reply to the request with the same id
FLAG_ERROR = 0x2  # a reply whose header is an ErrorReply


class Op(IntEnum):
    """Request opcodes; a reply carries the opcode of its request and FLAG_REPLY."""

    HELLO = 1
    LOOKUP = 2
    ACQUIRE = 3
    RELEASE = 4
    RENEW = 5
    STAGE = 6
    COMMIT = 7
    UNSTAGE = 8
    PREFETCH = 9
    SET_PRIORITY = 10
    SAVE_MANIFEST = 11
    GET_MANIFEST = 12
    LIST_MANIFESTS = 13
    DELETE_MANIFEST = 14
    INVALIDATE = 15
    VERIFY = 16
    STATS = 17
    PING = 18
    CHAIN_TOKENS = 19
    CHAIN_RESIDENCY = 20
    SET_PRIORITY_FROM = 21
    CHECK_INTEGRITY = 22
    REMOVE_LAYOUT = 23
    GC = 24


class FatalFrameError(ProtocolError):
    """The byte stream can no longer be trusted (bad magic, version or length): the
    receiver replies once if it can and closes the connection."""


MAX_FDS = 8  # descriptors one frame may carry (SCM_RIGHTS): the HELLO reply's shared regions


@dataclass(frozen=True)
class Frame:
    opcode: int
    flags: int
    request_id: int
    header: dict
    payload: bytes
    fds: tuple[int, ...] = ()  # received with the frame (SCM_RIGHTS); the receiver owns them

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & FLAG_REPLY)

    @property
    def is_error(self) -> bool:
        return bool(self.flags & FLAG_ERROR)


def encode_frame(opcode: int, request_id: int, header: dict, payload: bytes = b"", flags: int = 0) -> bytes:
    """One frame as bytes; raises ProtocolError when a part exceeds its limit."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds the {MAX_HEADER}-byte limit",
                            hint="per-block data belongs in the payload; this message is too large for its header "
                                 "(shorter names or manifests, or fewer blocks per request)")
    if len(payload) > MAX_PAYLOAD:
        # A reply can only outgrow the limit through what the request asked for, so the hint
        # names the knobs that shrink a reply; a request's payload is its token ids.
        hint = ("ask for less per request (stats pages with namespace_limit, acquire windows with max_blocks)"
                if flags & FLAG_REPLY else f"send at most {MAX_TOKENS} token ids per request")
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD}-byte limit", hint=hint)
    return HEAD.pack(MAGIC, VERSION, opcode, flags, request_id, len(raw), len(payload)) + raw + bytes(payload)


def parse_head(head: bytes) -> tuple[int, int, int, int, int]:
    """Validate a frame head: (opcode, flags, request_id, header_len, payload_len).
    Raises FatalFrameError for a wrong magic, version or an over-limit length."""
    magic, version, opcode, flags, request_id, hlen, plen = HEAD.unpack(head)
    if magic != MAGIC:
        raise FatalFrameError(f"bad frame magic {magic!r} (expected {MAGIC!r}); not a tierkv client?")
    if version != VERSION:
        raise FatalFrameError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    if hlen > MAX_HEADER:
        raise FatalFrameError(f"header length {hlen} exceeds the {MAX_HEADER}-byte limit")
    if plen > MAX_PAYLOAD:
        raise FatalFrameError(f"payload length {plen} exceeds the {MAX_PAYLOAD}-byte limit")
    return opcode, flags, request_id, hlen, plen


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw``, found by a flat scan (no
    recursion: the point is to refuse what would make ``json.loads`` recurse too deep).
    Brackets inside strings do not count. Malformed input may give a wrong depth;
    ``json.loads`` rejects it afterwards anyway."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0  # fast path: cannot be deeper than the number of openers
    depth = deepest = 0
    for ch in _STRING.sub(b'""', raw):
        if ch in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif ch in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def parse_header(raw: bytes) -> dict:
    """The JSON header as a dict; ProtocolError (not fatal: framing is intact) otherwise.
    Nesting deeper than MAX_DEPTH is refused before decoding: ``json.loads`` recurses per
    level and a header of 64 KiB of ``[`` raised RecursionError (issue 11, item 8)."""
    if not raw:
        return {}
    if json_depth(raw) > MAX_DEPTH:
        raise ProtocolError(f"frame header nests deeper than {MAX_DEPTH} levels",
                            hint="tierkv messages nest a few levels; send a flatter header")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"frame header is not UTF-8 JSON: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame header must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        # JSON may escape a lone surrogate, which is no Unicode text: every later encode
        # (keys, LMDB names) raised a raw UnicodeEncodeError. Pairs (emoji) decode whole.
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError("frame header holds a lone UTF-16 surrogate (not valid Unicode)",
                                hint="send valid Unicode strings") from None
    return obj


class ConnectionClosedError(ConnectionError):
    """The peer closed the stream after ``got`` of the ``wanted`` bytes being read (0: at a
    frame's start). The client words it for the user (client_transport.daemon_gone)."""

    def __init__(self, got: int, wanted: int) -> None:
        super().__init__(f"connection closed after {got} of {wanted} bytes")
        self.got, self.wanted = got, wanted


class IdleConnectionError(FatalFrameError):
    """The peer sent nothing for the idle timeout while holding nothing (quotas.py)."""


class FrameTimeoutError(FatalFrameError):
    """A frame began but did not arrive whole within the frame timeout (a half-sent frame
    would hold the connection's reader forever)."""


async def read_frame(reader: asyncio.StreamReader, *, idle_timeout: float | None = None,
                     frame_timeout: float | None = None, is_idle: Callable[[], bool] = lambda: True,
                     started: Callable[[], None] | None = None) -> Frame | None:
    """The next frame, or None at a clean end of stream (EOF between frames).

    Raises FatalFrameError on a bad head or a stream cut inside a frame (truncated), and
    ProtocolError on an undecodable header (the caller can reply and go on). With
    ``idle_timeout``: IdleConnectionError when no byte came for that long and ``is_idle()``
    (otherwise it keeps waiting); with ``frame_timeout``: FrameTimeoutError when the frame's
    remaining bytes do not all come within that long of its first byte. ``started`` is
    called when that first byte is read."""
    loop = asyncio.get_running_loop()
    while True:
        waiting = True  # for the first byte (idle_timeout), else for the rest (frame_timeout)
        try:
            # One timeout for the whole frame, moved on at its first byte: arming one per
            # phase was a measurable share of a small request's time in the daemon.
            async with asyncio.timeout(idle_timeout) as deadline:
                first = await reader.readexactly(1)
                waiting = False
                if started is not None:
                    started()
                deadline.reschedule(None if frame_timeout is None else loop.time() + frame_timeout)
                head = first + await _read_exactly(reader, HEAD.size - 1, "frame head", 1)
                opcode, flags, rid, hlen, plen = parse_head(head)
                body = await _read_exactly(reader, hlen + plen, "frame body")
            break
        except TimeoutError:
            if not waiting:
                raise FrameTimeoutError(f"a frame did not arrive whole within {frame_timeout:g} s of its first byte",
                                        hint="send each frame at once") from None
            if is_idle():
                raise IdleConnectionError(f"no request for {idle_timeout:g} s; closing an idle connection",
                                          hint="connect again when needed") from None
        except asyncio.IncompleteReadError:  # at the first byte: the later reads raise FatalFrameError
            return None
    try:
        header = parse_header(body[:hlen])
    except ProtocolError as e:
        raise BadHeaderError(e.message, opcode, rid) from None
    return Frame(opcode, flags, rid, header, body[hlen:])


class BadHeaderError(ProtocolError):
    """A frame whose header did not decode; framing is intact, so the connection survives."""

    def __init__(self, message: str, opcode: int, request_id: int) -> None:
        super().__init__(message)
        self.opcode = opcode
        self.request_id = request_id


async def _read_exactly(reader: asyncio.StreamReader, n: int, what: str, before: int = 0) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise FatalFrameError(f"truncated {what} ({before + len(e.partial)} of {before + n} bytes)") from None


def recv_exact(sock: socket.socket, n: int, fds: list[int] | None = None) -> bytes:
    """Exactly ``n`` bytes from a blocking socket; ConnectionError at EOF. With ``fds``,
    descriptors that arrive with these bytes (SCM_RIGHTS) are appended to it: they travel
    on the first byte of the frame they belong to, and a plain ``recv`` would close them."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if fds is None:
            k = sock.recv_into(view[got:], n - got)
        else:
            data, received, msg_flags, _ = socket.recv_fds(sock, n - got, MAX_FDS)
            fds.extend(received)
            if msg_flags & socket.MSG_CTRUNC:
                raise FatalFrameError(f"a frame carried more than {MAX_FDS} file descriptors")
            k = len(data)
            view[got : got + k] = data
        if k == 0:
            raise ConnectionClosedError(got, n)
        got += k
    return bytes(buf)


def read_frame_sync(sock: socket.socket) -> Frame:
    """Blocking counterpart of :func:`read_frame` for the client's reader thread. The
    frame's ``fds`` are the descriptors sent with it; the caller must close or keep them."""
    fds: list[int] = []
    try:
        opcode, flags, rid, hlen, plen = parse_head(recv_exact(sock, HEAD.size, fds))
        body = recv_exact(sock, hlen + plen) if hlen + plen else b""
        return Frame(opcode, flags, rid, parse_header(body[:hlen]), body[hlen:], tuple(fds))
    except BaseException:
        close_fds(fds)
        raise


def close_fds(fds: list[int] | tuple[int, ...]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


async def send_with_fds(writer: asyncio.StreamWriter, data: bytes, fds: list[int] | tuple[int, ...]) -> None:
    """Write ``data`` (one frame) with ``fds`` attached to its first byte (SCM_RIGHTS).

    asyncio's transports cannot send ancillary data, so the first bytes go out with
    ``sendmsg`` on a duplicate of the socket once the transport's own buffer is empty (the
    order of bytes on the stream is kept), and the rest through the transport. The caller
    holds the connection's write lock."""
    transport = writer.transport
    for _ in range(1000):  # bounded: the peer must read what was sent before
        await writer.drain()
        if transport.get_write_buffer_size() == 0:
            break
        await asyncio.sleep(0.01)
    else:
        raise ConnectionError("the peer does not read its replies; cannot hand it descriptors")
    raw = writer.get_extra_info("socket")
    dup = socket.socket(fileno=os.dup(raw.fileno()))
    try:
        sent = 0
        for _ in range(1000):
            try:
                sent = socket.send_fds(dup, [data], list(fds))
                break
            except BlockingIOError:
                await asyncio.sleep(0.01)
        else:
            raise ConnectionError("the peer does not read its replies; cannot hand it descriptors")
    finally:
        dup.close()  # closes the duplicate only
    if sent < len(data):
        writer.write(data[sent:])
        await writer.drain()
