"""The daemon's hot path (issue 15): ``acquire`` is one request (the longest cached prefix,
leased, or a miss that holds nothing), ``release`` is one write the daemon does not answer,
and a connection still reads its own writes."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import numpy as np
import pytest
import torch

import tierkv
from tierkv.daemon import messages as m
from tierkv.daemon.protocol import Op, encode_frame, read_frame_sync
from tierkv.errors import LeaseError

from daemon_helpers import LAYOUT, SCOPE, pages_for, prompt


def count_requests(daemon_thread, fn) -> dict[str, float]:
    """Requests the daemon served, by opcode, while ``fn()`` ran (its latency histogram)."""
    def counts() -> dict[str, float]:
        out = {}
        for fam in daemon_thread.daemon.metrics.registry.collect():
            for s in fam.samples:
                if s.name == "tierkv_request_seconds_count":
                    out[s.labels["op"]] = s.value
        return out

    time.sleep(0.05)  # earlier requests' latencies are recorded after their replies
    before = counts()
    fn()
    time.sleep(0.05)
    after = counts()
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def test_acquire_and_release_are_one_request_and_one_write(daemon):
    with tierkv.connect(daemon.config.server.socket) as c:
        toks = prompt(64, seed=21)
        c.put(toks, pages_for(4, 21), SCOPE)

        def iteration() -> None:
            lease = c.acquire(toks, SCOPE)
            assert lease.tokens_matched == 64 and torch.equal(lease.pages(), pages_for(4, 21))
            lease.release()

        served = count_requests(daemon, lambda: [iteration() for _ in range(5)])
        assert served == {"acquire": 5, "release": 5}
        # The release had no reply, and yet the next request of this connection sees it done.
        assert c.stats()["leased_blocks"] == 0 and c.stats()["daemon"]["leases"] == 0


def test_a_miss_holds_nothing_and_costs_no_release(daemon):
    with tierkv.connect(daemon.config.server.socket) as c:
        miss = c.acquire(prompt(64, seed=22), SCOPE)
        assert miss.num_blocks == 0 and miss.tokens_matched == 0 and miss.lease_id == 0
        assert c.stats()["daemon"]["leases"] == 0
        served = count_requests(daemon, miss.release)
        assert served == {}
        with pytest.raises(LeaseError):
            c.release(miss)  # released twice


def test_token_ids_are_checked_against_the_stored_ones(daemon):
    """A hit needs the stored token ids to equal the request's, not only an equal key: a
    block whose stored ids differ (a collision, a damaged record) is a counted miss."""
    from tierkv import block_keys

    with tierkv.connect(daemon.config.server.socket) as c:
        toks = prompt(64, seed=23)
        c.put(toks, pages_for(4, 23), SCOPE)
        key = block_keys(toks, SCOPE, LAYOUT.block_size)[2]
        block = daemon.daemon.store.placement.table.blocks[key]
        damaged = bytearray(block.tokens)
        damaged[0] ^= 1
        block.tokens = bytes(damaged)  # as if another prompt had hashed to this key
        with c.acquire(toks, SCOPE) as lease:
            assert lease.num_blocks == 2  # the chain ends before the block whose ids differ
        assert c.stats()["token_mismatch"] == 1


def test_one_way_release_of_an_unknown_lease_is_logged_not_answered(daemon, caplog):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(daemon.config.server.socket))
    try:
        s.sendall(encode_frame(Op.RELEASE, 1, *m.Release((12345,), reply=False).encode()))
        s.sendall(encode_frame(Op.PING, 2, {}))
        f = read_frame_sync(s)  # the first frame back answers the ping: the release got none
        assert f.request_id == 2 and not f.is_error
        s.sendall(encode_frame(Op.RELEASE, 3, *m.Release((12345,), reply=True).encode()))
        f = read_frame_sync(s)
        assert f.request_id == 3 and f.is_error and f.header["error"] == "LeaseError"
        s.sendall(encode_frame(Op.RELEASE, 4, {"lease_id": 12345}))  # the first version's message
        f = read_frame_sync(s)
        assert f.request_id == 4 and f.header["error"] == "LeaseError"
    finally:
        s.close()


def test_queued_releases_are_ended_without_another_request(daemon):
    c = tierkv.connect(daemon.config.server.socket)
    watcher = tierkv.connect(daemon.config.server.socket)
    try:
        toks = prompt(48, seed=24)
        c.put(toks, pages_for(3, 24), SCOPE)
        c.acquire(toks, SCOPE).release()
        # Nothing else comes from c; the daemon's drain ends the store lease shortly.
        deadline = time.monotonic() + 5
        while watcher.stats()["leased_blocks"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert watcher.stats()["leased_blocks"] == 0
    finally:
        c.close()
        watcher.close()


def test_many_clients_interleaved_keep_the_tables_consistent(daemon):
    import threading

    toks = [prompt(64, seed=30 + i) for i in range(4)]
    with tierkv.connect(daemon.config.server.socket) as c:
        for i, t in enumerate(toks):
            c.put(t, pages_for(4, 30 + i), SCOPE)
    errors: list[BaseException] = []

    def loop(j: int) -> None:
        try:
            with tierkv.connect(daemon.config.server.socket) as cl:
                for k in range(40):
                    t = toks[(j + k) % 4]
                    with cl.acquire(t, SCOPE) as lease:
                        assert lease.tokens_matched == 64
                    if k % 2:
                        assert cl.acquire(np.concatenate([t, t]), SCOPE, start_block=4).num_blocks == 0
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(j,)) for j in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with tierkv.connect(daemon.config.server.socket) as c:
        assert c.stats()["leased_blocks"] == 0
    daemon.call(daemon.daemon.check_integrity)


@contextlib.contextmanager
def store_lock_held(daemon, seconds: float) -> Iterator[None]:
    """The daemon's store lock held by another thread from entry until ``seconds`` later."""
    store = daemon.daemon.layouts.only().local
    held, go = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with store.placement.lock:
            held.set()
            go.wait(10)

    t = threading.Thread(target=hold_lock)
    t.start()
    held.wait(10)
    threading.Timer(seconds, go.set).start()
    try:
        yield
    finally:
        go.set()
        t.join(10)


def test_resident_acquires_run_on_the_loop_and_the_rest_in_a_worker(daemon):
    """A resident prefix is leased on the event loop (no worker hop); when the store lock is
    busy the acquire waits in a worker instead, and both give the same, correct lease."""
    with tierkv.connect(daemon.config.server.socket) as c:
        toks = prompt(64, seed=41)
        c.put(toks, pages_for(4, 41), SCOPE)
        before = c.stats()["daemon"]["acquires"]
        with c.acquire(toks, SCOPE) as lease:
            assert torch.equal(lease.pages(), pages_for(4, 41))
        mid = c.stats()["daemon"]["acquires"]
        assert mid["inline"] == before["inline"] + 1 and mid["worker"] == before["worker"]

        with store_lock_held(daemon, 0.2):  # the worker's acquire waits for it
            with c.acquire(toks, SCOPE) as lease:
                assert lease.tokens_matched == 64 and torch.equal(lease.pages(), pages_for(4, 41))
        after = c.stats()["daemon"]["acquires"]
        assert after["worker"] == mid["worker"] + 1 and after["inline"] == mid["inline"]
        assert c.stats()["daemon"]["leases"] == 0


def test_lookups_run_on_the_loop_and_wait_in_a_worker_for_a_held_lock(daemon):
    """A lookup is answered as it is read (fast_path.py), with no worker hop; with the store
    lock held elsewhere it must not block the loop: it waits in a worker, and both answer
    the same."""
    def fast_served() -> int:
        return daemon.call(lambda: daemon.daemon._daemon_stats()["fast_path_requests"])

    with tierkv.connect(daemon.config.server.socket) as c:
        toks = prompt(64, seed=42)
        c.put(toks, pages_for(4, 42), SCOPE)
        before = fast_served()
        found = [c.lookup(toks, SCOPE) for _ in range(10)]
        assert fast_served() - before >= 9  # the first may have found the read loop awake
        assert {(r.tokens_matched, r.keys) for r in found} == {(64, tuple(c.block_keys(toks, SCOPE)))}
        assert c.lookup(prompt(64, seed=43), SCOPE).tokens_matched == 0

        mid = fast_served()
        with store_lock_held(daemon, 0.2):
            t0 = time.monotonic()
            r = c.lookup(toks, SCOPE)
            assert time.monotonic() - t0 >= 0.15  # it waited for the lock
        assert (r.tokens_matched, r.keys) == (found[0].tokens_matched, found[0].keys)
        assert fast_served() == mid  # not on the loop
    daemon.call(daemon.daemon.check_integrity)


def test_a_lease_repr_is_short_whatever_its_size(daemon):
    """Issue #37, item 10: a daemon lease's repr printed what it holds (the pool tensor, then
    every 32-byte key); printing a lease in a log line or a debugger must stay one short line."""
    with tierkv.connect(daemon.config.server.socket) as c:
        toks = prompt(64 * 16, seed=23)
        c.put(toks, pages_for(64, 23), SCOPE)
        with c.acquire(toks, SCOPE) as lease:
            assert lease.num_blocks == 64
            text = repr(lease)
            assert text.startswith("Lease(blocks=64, start_block=0, slots=") and len(text) < 200, text
            assert f"lease_id={lease.lease_id}" in text and "float32-l2-h2-d16-b16" in text
            assert "tensor" not in text and "\\x" not in text and str(lease) == text
        assert "released=True" in repr(lease)
    with tierkv.open(daemon.config.store.home / "direct", LAYOUT, device="cpu") as st:  # a Store's own leases too
        st.put(toks, pages_for(64, 23), SCOPE)
        with st.acquire(toks, SCOPE) as lease:
            assert repr(lease).startswith("Lease(blocks=64") and len(repr(lease)) < 200
