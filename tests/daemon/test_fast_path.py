"""Acquires and one-way releases answered as their bytes arrive (tierkv/daemon/fast_path.py),
against a real daemon: right answers, frames kept in order when only some of them can be
served that way, half-sent and bad frames still going to the read loop, and the idle
timeout not closing a connection that is busy on the fast path."""
from __future__ import annotations

import socket
import time

import torch

import tierkv
from tierkv.daemon import messages as m
from tierkv.daemon.protocol import HEAD, VERSION, Op, encode_frame, read_frame_sync
from tierkv.daemon.quotas import Quotas

from helpers.daemons import DaemonThread
from daemon_helpers import SCOPE, make_config, pages_for, prompt
from test_quotas import closed_by_daemon


def raw(d) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(d.config.socket))
    return s


def acquire_frame(rid: int, toks) -> bytes:
    return encode_frame(Op.ACQUIRE, rid, *m.PrefixRequest(m.WireScope.of(SCOPE), toks).encode())


def release_frame(rid: int, lease_ids: tuple[int, ...], reply: bool = False) -> bytes:
    return encode_frame(Op.RELEASE, rid, *m.Release(lease_ids, reply=reply).encode())


def lease_reply(s: socket.socket, rid: int) -> m.KeysReply:
    f = read_frame_sync(s)
    assert f.request_id == rid and f.is_reply and not f.is_error, f.header
    return m.KeysReply.decode(f.header, f.payload)


def fast_served(d) -> int:
    return d.call(lambda: d.daemon._daemon_stats()["fast_path_requests"])


def test_acquire_and_release_are_answered_as_they_arrive(daemon):
    with tierkv.connect(daemon.config.socket) as c:
        toks = prompt(64, seed=7)
        c.put(toks, pages_for(4, 7), SCOPE)
        before = fast_served(daemon)
        for _ in range(20):
            with c.acquire(toks, SCOPE) as lease:  # released one-way at the end of the block
                assert lease.num_blocks == 4 and torch.equal(lease.pages(), pages_for(4, 7))
        c.check_integrity()  # a round trip after the last release: it has been served
        # 20 acquires and 20 releases; the first of each may have taken the read loop.
        assert fast_served(daemon) - before >= 38
        d = c.stats()["daemon"]  # what a client and an operator see
        assert d["leases"] == 0 and d["fast_path_requests"] >= before + 38
    daemon.call(daemon.daemon.check_integrity)


def test_frames_sent_together_are_each_answered_across_both_paths(daemon):
    """One write holding an acquire (served as it arrives), a ping (the read loop's) and
    another acquire: the fast path stops at the ping and hands the rest to the read loop,
    which reads them in order (the ping runs as a task, so its reply may come last), and
    every request is answered once."""
    with tierkv.connect(daemon.config.socket) as c:
        toks = prompt(48, seed=8)
        c.put(toks, pages_for(3, 8), SCOPE)
    s = raw(daemon)
    try:
        s.sendall(acquire_frame(1, toks) + encode_frame(Op.PING, 2, {}) + acquire_frame(3, toks))
        first = lease_reply(s, 1)  # answered before the read loop saw anything
        replies = {f.request_id: f for f in (read_frame_sync(s), read_frame_sync(s))}
        assert set(replies) == {2, 3} and not any(f.is_error for f in replies.values())
        third = m.KeysReply.decode(replies[3].header, replies[3].payload)
        assert len(first.keys) == len(third.keys) == 3 and first.keys == third.keys
        ids = (first.fields["lease_id"], third.fields["lease_id"])
        assert 0 not in ids and ids[0] != ids[1]
        # Both released in one one-way frame and one wanting a reply (the read loop's),
        # sent together: the second finds nothing left to release and says so.
        s.sendall(release_frame(4, ids) + release_frame(5, ids[:1], reply=True))
        err = read_frame_sync(s)
        assert err.request_id == 5 and err.is_error and err.header["error"] == "LeaseError"
    finally:
        s.close()
    daemon.call(daemon.daemon.check_integrity)


def test_half_sent_and_bad_frames_still_take_the_read_loop(daemon):
    with tierkv.connect(daemon.config.socket) as c:
        toks = prompt(32, seed=9)
        c.put(toks, pages_for(2, 9), SCOPE)
    s = raw(daemon)
    try:
        frame = acquire_frame(1, toks)
        s.sendall(frame[:10])  # a head cut short: nothing can be served until the rest comes
        time.sleep(0.2)
        s.sendall(frame[10:])
        first = lease_reply(s, 1)
        assert len(first.keys) == 2
        s.sendall(release_frame(2, (first.fields["lease_id"],)))
        # A good acquire and, in the same write, a head with a bad magic: the acquire is
        # answered, then the bad frame gets its error and the connection is closed.
        bad = HEAD.pack(b"XXXX", VERSION, Op.PING, 0, 9, 0, 0)
        s.sendall(acquire_frame(3, toks) + bad)
        assert len(lease_reply(s, 3).keys) == 2
        f = read_frame_sync(s)
        assert f.is_error and f.request_id == 0
        assert closed_by_daemon(s, 5)
    finally:
        s.close()
    daemon.call(daemon.daemon.check_integrity)  # the closed connection's lease was released


def test_a_connection_busy_on_the_fast_path_is_not_idle(workdir):
    """The read loop stays parked while requests are served as they arrive; its idle
    timeout must count them (it closed connections mid-traffic otherwise), and still close
    the connection once it really is idle."""
    d = DaemonThread(make_config(workdir, quotas=Quotas(idle_timeout_s=0.5))).start()
    try:
        with tierkv.connect(d.config.socket) as c:
            toks = prompt(32, seed=10)
            c.put(toks, pages_for(2, 10), SCOPE)
        s = raw(d)
        before = fast_served(d)
        t0, rid = time.monotonic(), 0
        while time.monotonic() - t0 < 1.6:  # three idle timeouts of traffic, holding nothing between
            rid += 1
            s.sendall(acquire_frame(rid, toks))
            reply = lease_reply(s, rid)
            s.sendall(release_frame(rid + 1000, (reply.fields["lease_id"],)))
            time.sleep(0.05)
        assert fast_served(d) - before >= 2 * rid - 2
        t1 = time.monotonic()
        assert closed_by_daemon(s, 5)  # now idle: closed
        assert time.monotonic() - t1 < 2.5
        s.close()
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_bytes_after_a_frame_handed_to_the_reader_go_to_the_reader_too():
    """A frame's first part handed to the stream reader, then its rest arriving before the
    read loop ran (two data_received calls in one turn of the event loop): the rest must
    not be taken for the start of a new frame and served here."""
    import asyncio

    from tierkv.daemon.fast_path import FastProtocol

    class Conn:
        parked = True

    class Fast:
        def __init__(self) -> None:
            self.seen: list[bytes] = []

        def serve(self, conn, data: bytes) -> bytes:
            self.seen.append(data)
            return data  # nothing whole to serve: all of it goes on to the reader

    loop = asyncio.new_event_loop()
    try:
        reader = asyncio.StreamReader(loop=loop)
        fast = Fast()
        protocol = FastProtocol(reader, lambda r, w: None, loop, fast)
        protocol.conn = conn = Conn()
        frame = acquire_frame(1, prompt(16, seed=11))
        protocol.data_received(frame[:10])
        assert fast.seen == [frame[:10]] and not conn.parked
        protocol.data_received(frame[10:])  # the loop has not run: still the reader's
        assert fast.seen == [frame[:10]]
        assert loop.run_until_complete(reader.readexactly(len(frame))) == frame
    finally:
        loop.close()
