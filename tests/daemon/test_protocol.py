"""Frame and message encoding: round trips, bounds, no pickle."""
from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest

from tierkv.daemon import fields, messages as m
from tierkv.daemon.protocol import (
    FLAG_REPLY, HEAD, MAGIC, MAX_HEADER, MAX_PAYLOAD, VERSION, BadHeaderError, FatalFrameError, Op, encode_frame,
    parse_head, read_frame,
)
from tierkv.errors import ProtocolError

MV = "ab" * 32


def _read(data: bytes):
    async def go():
        r = asyncio.StreamReader()
        r.feed_data(data)
        r.feed_eof()
        return await read_frame(r)

    return asyncio.run(go())


def test_frame_round_trip():
    req = m.PrefixRequest(m.WireScope(MV, "ns", ("lora-1",)), np.arange(40, dtype=np.int32), [["img", b"\x00\xff"]], 2)
    h, p = req.encode()
    f = _read(encode_frame(Op.ACQUIRE, 7, h, p))
    assert (f.opcode, f.request_id, f.flags) == (Op.ACQUIRE, 7, 0)
    back = m.PrefixRequest.decode(f.header, f.payload)
    assert back.scope == req.scope and back.max_blocks == 2 and back.block_extra == [["img", b"\x00\xff"]]
    assert np.array_equal(back.tokens, req.tokens)


def test_every_message_round_trips():
    ws = m.WireScope(MV)
    toks = np.arange(32, dtype=np.int32)
    for msg in (m.Hello(1, 99), m.LeaseRef(5), m.Stage(3), m.Unstage((1, 2)), m.Commit(ws, toks, (4, 5), 1, None, 2),
                m.SetPriority(ws, toks, 2), m.ManifestRequest("p", {"k": [1]}), m.Invalidate(MV, None, True),
                m.Verify(True), m.Empty(), m.ErrorReply("LeaseError", "msg", "hint")):
        h, p = msg.encode()
        f = _read(encode_frame(1, 1, h, p, FLAG_REPLY))
        back = type(msg).decode(f.header, f.payload)
        for name in msg.__dataclass_fields__:
            a, b = getattr(msg, name), getattr(back, name)
            assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, (msg, name)


def test_clean_eof_is_none_and_truncation_is_fatal():
    assert _read(b"") is None
    frame = encode_frame(Op.PING, 1, {})
    with pytest.raises(FatalFrameError):
        _read(frame[:10])
    frame = encode_frame(Op.PING, 1, {"a": "b" * 100})
    with pytest.raises(FatalFrameError):
        _read(frame[:-5])


@pytest.mark.parametrize("head,what", [
    (HEAD.pack(b"XXXX", VERSION, 1, 0, 1, 0, 0), "magic"),
    (HEAD.pack(MAGIC, VERSION + 1, 1, 0, 1, 0, 0), "version"),
    (HEAD.pack(MAGIC, VERSION, 1, 0, 1, MAX_HEADER + 1, 0), "header length"),
    (HEAD.pack(MAGIC, VERSION, 1, 0, 1, 0, 2**32 - 1), "payload length"),
])
def test_bad_heads_are_rejected_before_any_allocation(head, what):
    with pytest.raises(FatalFrameError, match=what):
        parse_head(head)


def test_pickle_in_header_is_a_protocol_error_not_an_object():
    blob = pickle.dumps({"lease_id": 1})
    with pytest.raises(BadHeaderError):
        _read(HEAD.pack(MAGIC, VERSION, Op.RELEASE, 0, 3, len(blob), 0) + blob)


def test_encode_refuses_over_limit_parts():
    with pytest.raises(ProtocolError):
        encode_frame(Op.PING, 1, {"x": "y" * MAX_HEADER})
    with pytest.raises(ProtocolError) as request:
        encode_frame(Op.PING, 1, {}, b"\0" * (MAX_PAYLOAD + 4))
    assert "token ids" in request.value.hint
    # An oversized reply's hint names what shrinks a reply, not token ids the client never sent.
    with pytest.raises(ProtocolError) as reply:
        encode_frame(Op.STATS, 1, {}, b"\0" * (MAX_PAYLOAD + 4), flags=FLAG_REPLY)
    assert "namespace_limit" in reply.value.hint and "token ids" not in reply.value.hint


@pytest.mark.parametrize("header", [
    {"scope": 5}, {"scope": {"model_version": 1, "namespace": "n"}}, {"scope": {"model_version": MV, "namespace": "n"},
                                                                       "max_blocks": -1},
    {"scope": {"model_version": MV, "namespace": "n"}, "block_extra": [[{"b": "zz"}]]},
    {"scope": {"model_version": MV, "namespace": "n"}, "max_blocks": True},
])
def test_bad_fields_raise_protocol_error(header):
    with pytest.raises(ProtocolError):
        m.PrefixRequest.decode(header, b"")


def test_token_payload_must_be_whole_int32s():
    with pytest.raises(ProtocolError):
        m.tokens_from(b"\0\0\0")


@pytest.mark.parametrize("n", [0, 1, 256, fields.SPLIT_STRUCT_MAX, fields.SPLIT_STRUCT_MAX + 3])
def test_keys_reply_keeps_every_key_byte_for_byte(n):
    """Keys travel as raw 32-byte strings; those ending (or made) of NUL bytes must come
    back whole, whichever way the reply is split (one struct, or slices past the cap)."""
    rng = np.random.default_rng(n)
    keys = [rng.bytes(32) for _ in range(n)]
    if n:
        keys[0] = bytes(32)
        keys[-1] = keys[-1][:30] + b"\0\0"
    header, payload = m.KeysReply(tuple(keys), {"lease_id": 7}, tuple(range(n))).encode()
    back = m.KeysReply.decode(header, payload)
    assert back.keys == tuple(keys) and all(type(k) is bytes for k in back.keys)
    assert back.values == tuple(range(n)) and back.fields == {"lease_id": 7}
