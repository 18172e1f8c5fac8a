"""Malformed frames reach a live daemon: each gets an error reply or a closed connection,
and the daemon keeps serving other clients (RELIABILITY.md case 10)."""
from __future__ import annotations

import os
import pickle
import socket

import pytest

import tierkv
from tierkv.daemon import messages as m
from tierkv.daemon.protocol import FLAG_ERROR, HEAD, MAGIC, MAX_HEADER, VERSION, Op, encode_frame, read_frame_sync

from daemon_helpers import SCOPE, pages_for, prompt


def raw(daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(daemon.config.server.socket))
    return s


def closed_after_optional_error(s: socket.socket) -> None:
    """The daemon replies once (error frame, request id 0) or not at all, then closes."""
    try:
        f = read_frame_sync(s)
        assert f.is_error and f.request_id == 0
        assert s.recv(1) == b""
    except ConnectionError:
        pass


@pytest.fixture
def good(daemon):
    c = tierkv.connect(daemon.config.server.socket)
    toks = prompt(64)
    c.put(toks, pages_for(4), SCOPE)
    yield c, toks
    c.close()


def still_serving(daemon, good):
    c, toks = good
    assert c.lookup(toks, SCOPE).tokens_matched == 64
    with tierkv.connect(daemon.config.server.socket) as other:
        other.check_integrity()
    daemon.call(daemon.daemon.check_integrity)


@pytest.mark.parametrize("data", [
    HEAD.pack(MAGIC, VERSION, Op.PING, 0, 1, 0, 0)[:11],  # truncated head
    HEAD.pack(MAGIC, VERSION, Op.LOOKUP, 0, 1, 100, 0) + b"{" * 40,  # truncated body
])
def test_truncated_frames_close_the_connection(daemon, good, data):
    s = raw(daemon)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    closed_after_optional_error(s)
    s.close()
    still_serving(daemon, good)


@pytest.mark.parametrize("head", [
    HEAD.pack(b"XXXX", VERSION, Op.PING, 0, 1, 0, 0),
    HEAD.pack(MAGIC, VERSION + 1, Op.PING, 0, 1, 0, 0),
    HEAD.pack(MAGIC, 0, Op.PING, 0, 1, 0, 0),
    HEAD.pack(MAGIC, VERSION, Op.LOOKUP, 0, 1, 2**32 - 1, 0),  # absurd header length
    HEAD.pack(MAGIC, VERSION, Op.LOOKUP, 0, 1, MAX_HEADER + 1, 2**32 - 1),  # absurd payload length
], ids=["magic", "newer-version", "old-version", "huge-header", "huge-payload"])
def test_bad_heads_get_an_error_and_close(daemon, good, head):
    s = raw(daemon)
    s.sendall(head)  # nothing follows: the daemon must not wait for (or allocate) the body
    f = read_frame_sync(s)
    assert f.flags & FLAG_ERROR and f.request_id == 0 and f.header["error"] == "FatalFrameError"
    assert s.recv(1) == b""
    s.close()
    still_serving(daemon, good)


def test_a_pickle_blob_is_never_unpickled(daemon, good, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    blob = pickle.dumps(Evil())
    s = raw(daemon)
    s.sendall(blob)  # as a whole stream: wrong magic
    closed_after_optional_error(s)
    s.close()
    s = raw(daemon)
    s.sendall(HEAD.pack(MAGIC, VERSION, Op.RELEASE, 0, 9, len(blob), 0) + blob)  # as a header: not JSON
    f = read_frame_sync(s)
    assert f.is_error and f.request_id == 9 and f.header["error"] == "BadHeaderError"
    s.sendall(encode_frame(Op.PING, 10, {}))  # framing was intact: the connection goes on
    assert read_frame_sync(s).request_id == 10
    s.close()
    assert not marker.exists()
    still_serving(daemon, good)


def test_unknown_opcode_and_bad_fields_get_error_replies(daemon, good):
    s = raw(daemon)
    s.sendall(encode_frame(200, 1, {}))
    f = read_frame_sync(s)
    assert f.is_error and f.request_id == 1 and "unknown opcode" in f.header["message"]
    s.sendall(encode_frame(Op.LOOKUP, 2, {"scope": 5}))
    f = read_frame_sync(s)
    assert f.is_error and f.request_id == 2 and f.header["error"] == "ProtocolError"
    s.sendall(encode_frame(Op.LOOKUP, 3, {"scope": {"model_version": "zz", "namespace": "n"}}, b"\0" * 8))
    assert read_frame_sync(s).header["error"] == "ValueError"  # Scope validation, daemon side
    h, p = m.Commit(m.WireScope(SCOPE.model_version), prompt(32), (0, 1)).encode()
    s.sendall(encode_frame(Op.COMMIT, 4, h, p))
    assert "staging slots" in read_frame_sync(s).header["message"]  # slots it never staged
    s.sendall(encode_frame(Op.RELEASE, 5, {"lease_id": 12345}))
    assert read_frame_sync(s).header["error"] == "LeaseError"
    s.sendall(encode_frame(Op.PING, 6, {}, flags=1))  # a "reply" sent to the daemon
    assert read_frame_sync(s).is_error
    s.sendall(encode_frame(Op.PING, 7, {}))
    f = read_frame_sync(s)
    assert f.request_id == 7 and not f.is_error
    s.close()
    still_serving(daemon, good)


@pytest.mark.parametrize("body", [b"[" * 1000 + b"]" * 1000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
                                  b"[" * (MAX_HEADER - 1)], ids=["arrays-1000", "objects-5000", "unclosed-64k"])
def test_deeply_nested_header_gets_bad_header_and_the_connection_goes_on(daemon, good, body):
    """Issue 11 item 8: json.loads recursed per level and raised RecursionError, which
    dropped the connection with no reply and logged a traceback."""
    s = raw(daemon)
    s.sendall(HEAD.pack(MAGIC, VERSION, Op.LOOKUP, 0, 21, len(body), 0) + body)
    f = read_frame_sync(s)
    assert f.is_error and f.request_id == 21 and f.header["error"] == "BadHeaderError"
    assert "nests deeper" in f.header["message"]
    s.sendall(encode_frame(Op.PING, 22, {}))
    assert read_frame_sync(s).request_id == 22
    s.close()
    still_serving(daemon, good)


def test_a_deep_string_is_not_nesting(daemon, good):
    """Brackets inside strings are data, not depth: such a header still decodes."""
    s = raw(daemon)
    s.sendall(encode_frame(Op.PING, 23, {"note": "[{" * 2000 + '\\"' + "[" * 100}))
    f = read_frame_sync(s)
    assert f.request_id == 23 and not f.is_error
    s.close()


def test_bad_names_and_lone_surrogates_are_typed_errors(daemon, good):
    """Issue 11 item 11: an empty or over-long name reached the client as a raw LMDB
    BadValsizeError, a lone surrogate as a raw UnicodeEncodeError."""
    from tierkv import Scope
    from tierkv.errors import InvalidNameError, ProtocolError

    c, toks = good
    for name in ("", "x" * 300, "€" * 200, "a/b"):
        for call in (lambda: c.get_manifest(name), lambda: c.delete_manifest(name),
                     lambda: c.save_manifest(name, {"k": 1})):
            with pytest.raises((InvalidNameError, ProtocolError)) as info:  # typed: refused by name or by message
                call()
            assert "daemon error" not in str(info.value)  # not a raw exception of another library
    for call in (lambda: c.save_manifest("\ud800", {}), lambda: c.get_manifest("ok\udfff"),
                 lambda: c.lookup(toks, Scope(SCOPE.model_version, "\ud800")),
                 lambda: c.lookup(toks, Scope(SCOPE.model_version, "n", ("\udc00",)))):
        with pytest.raises(ProtocolError, match="surrogate"):
            call()
    c.save_manifest("ok-😀", {"k": 1})  # a surrogate pair is a valid character
    assert c.get_manifest("ok-😀") == {"k": 1}
    still_serving(daemon, good)
