"""The dispatch table's entries: for one opcode, the message class its frames decode to and
the handler that takes that message, typed together.

:class:`Route`'s constructor is generic in the message type, so a type checker sees that
the handler takes exactly what the class decodes (``Route(m.Stats, ops.stats)`` checks,
``Route(m.Stats, ops.verify)`` does not); what it keeps, :attr:`Route.serve` and
:attr:`Route.serve_now`, take a frame's header and payload and name no message type, so one
table holds every route with nothing typed ``Any``.

Rejected: a ``dict[int, tuple[type, handler]]`` (what the table was: the class typed
``Any``, so nothing checked that a handler got the message it expects); a generic
``Route[M]`` stored as such (a table of routes of different messages needs ``Route[Any]``,
since a route cannot be covariant in the message its handler takes).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable, Protocol, Self, TypeVar

from .fields import Header

if TYPE_CHECKING:
    from .connection import Connection
    from .messages import Answer


class Request(Protocol):
    """A request message (messages.py): built from a frame's header and payload, every
    field checked (ProtocolError otherwise)."""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> Self: ...


M = TypeVar("M", bound=Request)


class Route:
    """One opcode's entry in :attr:`Handlers.table <tierkv.daemon.handlers.Handlers.table>`.

    ``serve(conn, header, payload)``: decode the request and run its handler (a coroutine:
    the server awaits it). ``serve_now``: the handler's synchronous form, tried first as the
    request is read (the reply, or None when it must wait and ``serve`` runs instead); None
    for an opcode that has none. Either raises what decoding or the handler raises."""

    __slots__ = ("message", "serve", "serve_now")

    def __init__(self, message: type[M], handle: Callable[[Connection, M], Awaitable[Answer | None]],
                 now: Callable[[Connection, M], Answer | None] | None = None) -> None:
        self.message: type[Request] = message  # for reading the table (tests, docs)

        # Closures rather than methods reading self.message: what they capture keeps its
        # type M, which an attribute of a class that is not generic cannot.
        def serve(conn: Connection, header: Header, payload: bytes) -> Awaitable[Answer | None]:
            return handle(conn, message.decode(header, payload))

        self.serve = serve
        self.serve_now: Callable[[Connection, Header, bytes], Answer | None] | None = None
        if now is not None:
            answer_now = now  # bound for the closure: mypy does not narrow ``now`` inside it

            def serve_now(conn: Connection, header: Header, payload: bytes) -> Answer | None:
                return answer_now(conn, message.decode(header, payload))

            self.serve_now = serve_now
