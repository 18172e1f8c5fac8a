"""Per-uid quotas and connection timeouts with real attacks (issue 11, item 10): idle and
half-sent connections, one uid taking a whole tier or the staging region while another uid
is connected (a real second user: a forked child as nobody), concurrent acquires racing the
lease cap, and a client that never reads its replies."""
from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

import tierkv
from tierkv import Priority
from tierkv.daemon import messages as m
from tierkv.daemon.protocol import HEAD, MAGIC, VERSION, Op, encode_frame, read_frame_sync
from tierkv.daemon.quotas import Quotas
from tierkv.errors import DaemonUnavailableError, QuotaExceededError

from as_user import NOBODY, need_root, run_as
from helpers.daemons import DaemonThread
from daemon_helpers import SCOPE, make_config, pages_for, prompt, wait_for


def raw(d) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(d.config.socket))
    return s


def closed_by_daemon(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass  # the error frame, then EOF
        return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionError:
        return True


def rejected(d, reason: str) -> float:
    return d.daemon.metrics.rejected.labels(reason)._value.get()


def refused(d, quota: str) -> float:
    return d.daemon.metrics.quota_refusals.labels(quota)._value.get()


def test_idle_and_half_sent_connections_are_closed_and_do_not_lock_others_out(workdir):
    """256 idle or half-sent connections locked every other client out. Now a connection
    that sends nothing (and holds nothing) is closed after idle_timeout_s, a half-sent frame
    after frame_timeout_s, and one uid may hold only connections_per_uid connections."""
    q = Quotas(idle_timeout_s=1.0, frame_timeout_s=1.0, connections_per_uid=12)
    d = DaemonThread(make_config(workdir, max_connections=16, quotas=q, metrics_port=0)).start()
    try:
        idle = [raw(d) for _ in range(6)]
        half = [raw(d) for _ in range(6)]
        for s in half:
            s.sendall(HEAD.pack(MAGIC, VERSION, Op.PING, 0, 1, 10, 0)[:7])  # a head cut short, never finished
        with pytest.raises(DaemonUnavailableError, match="connections_per_uid"):  # 13th of this uid
            tierkv.connect(d.config.socket)
        s = raw(d)
        f = read_frame_sync(s)
        assert f.is_error and f.header["error"] == "QuotaExceededError"
        s.close()
        assert refused(d, "connections") >= 1
        t0 = time.monotonic()
        assert all(closed_by_daemon(s, 5) for s in idle + half)
        assert time.monotonic() - t0 < 4
        assert rejected(d, "idle") >= 6 and rejected(d, "frame_timeout") >= 6
        with tierkv.connect(d.config.socket) as c:  # room again
            toks = prompt(32, seed=3)
            c.put(toks, pages_for(2, 3), SCOPE)
            with c.acquire(toks, SCOPE) as lease:  # a lease held across the idle timeout stays
                time.sleep(2.5)
                assert torch.equal(lease.pages(), pages_for(2, 3))
            time.sleep(2.5)  # a library client holding nothing stays connected (keepalive)
            c.check_integrity()
        for s in idle + half:
            s.close()
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_concurrent_acquires_cannot_pass_the_lease_cap(workdir):
    """The 4,096-lease cap was checked before an await: concurrent acquires passed it
    together (4,123 granted). Acquires in flight now count."""
    d = DaemonThread(make_config(workdir, quotas=Quotas(leases_per_connection=8))).start()
    try:
        with tierkv.connect(d.config.socket) as c:
            toks = prompt(16, seed=4)
            c.put(toks, pages_for(1, 4), SCOPE)
            got, errors = [], []
            lock = threading.Lock()

            def grab() -> None:
                for _ in range(4):
                    try:
                        lease = c.acquire(toks, SCOPE)
                        with lock:
                            got.append(lease)
                    except QuotaExceededError as e:
                        errors.append(e)

            threads = [threading.Thread(target=grab) for _ in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert len(got) == 8 and len(errors) == 64 - 8
            assert d.call(lambda: d.daemon.handlers.leases.count(next(iter(d.daemon.connections)))) == 8
            for lease in got:
                lease.release()
            assert c.stats()["leased_blocks"] == 0
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_while_another_uid_is_connected_no_uid_takes_more_than_half(workdir):
    """One client could lease the whole device tier or hold every staging slot. While
    another uid (a real child as nobody) is connected, each uid gets at most half."""
    need_root()
    os.chmod(workdir, 0o711)
    q = Quotas(shared_pinned_fraction=0.05)
    d = DaemonThread(make_config(workdir, allowed_uids=(NOBODY,), metrics_port=0, quotas=q)).start()
    try:
        slots = d.call(lambda: d.daemon.handlers.layouts.only().local.device.slots.capacity)  # 128
        n = slots * 3 // 4
        toks = prompt(n * 16, seed=5)
        with tierkv.connect(d.config.socket) as c:
            c.put(toks, pages_for(n, 5), SCOPE)
            r_ready, w_ready = os.pipe()
            r_go, w_go = os.pipe()

            def tenant() -> str:
                with tierkv.connect(d.config.socket) as t:
                    t.ping()
                    os.write(w_ready, b"1")
                    os.read(r_go, 1)  # stay connected until the parent is done
                return "ok"

            child = threading.Thread(target=lambda: run_as(NOBODY, tenant), daemon=True)
            child.start()
            assert os.read(r_ready, 1) == b"1"
            try:
                with pytest.raises(QuotaExceededError, match="shared_tier_fraction"):
                    c.acquire(toks, SCOPE)  # 3/4 of the tier
                assert wait_for(lambda: c.stats()["leased_blocks"] == 0)  # the refused lease was released
                # A long prompt of which little is stored is judged by what it leases.
                mixed = np.concatenate([toks[: 4 * 16], prompt(slots * 16, seed=9)])
                with c.acquire(mixed, SCOPE) as lease:
                    assert lease.num_blocks == 4
                with c.acquire(toks, SCOPE, max_blocks=slots // 2) as lease:  # half is fine
                    assert lease.num_blocks == slots // 2
                    with pytest.raises(QuotaExceededError):
                        c.acquire(toks, SCOPE, max_blocks=1, start_block=slots // 2)
                held = c._transport.call(Op.STAGE, m.Stage(c.stage_quota))["slots"]
                capacity = d.call(lambda: d.daemon.handlers.layouts.only().staging.slots.capacity)
                others = [tierkv.connect(d.config.socket) for _ in range(4)]
                try:
                    with pytest.raises(QuotaExceededError, match="shared_staging_fraction"):
                        for o in others:
                            o._transport.call(Op.STAGE, m.Stage(o.stage_quota))
                    assert d.call(lambda: d.daemon.handlers.layouts.only().staging.slots.num_used) <= capacity // 2
                finally:
                    for o in others:
                        o.close()
                c._transport.call(Op.UNSTAGE, m.Unstage(tuple(held)))
                # Pinned blocks never leave the disk: pinned junk evicted another tenant's
                # blocks (400 of 400 lost). At most shared_pinned_fraction of the disk tier.
                disk_slots = d.call(lambda: d.daemon.handlers.layouts.only().local.disk.capacity_slots)
                limit = int(disk_slots * q.shared_pinned_fraction)
                junk = prompt(2 * limit * 16, seed=8)
                with pytest.raises(QuotaExceededError, match="shared_pinned_fraction"):
                    c.put(junk, pages_for(2 * limit, 8), SCOPE, priority=Priority.PINNED)
                assert d.call(lambda: d.daemon.handlers.layouts.only().local.pinned_blocks("")) <= limit
                with pytest.raises(QuotaExceededError):
                    c.set_priority(toks, SCOPE, Priority.PINNED)
                assert refused(d, "leased_blocks") >= 2 and refused(d, "staging") >= 1 and refused(d, "pinned") >= 2
            finally:
                os.write(w_go, b"1")
                child.join(30)
            assert wait_for(lambda: len(d.daemon.connections) == 1)
            with c.acquire(toks, SCOPE) as lease:  # alone again: the whole tier
                assert lease.num_blocks == n
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_a_client_that_never_reads_its_replies_is_cut_off(workdir):
    """Two clients that never read replies pinned 1.1 GiB of daemon memory. Now the daemon
    stops reading a connection whose unread replies pass unread_reply_bytes and closes it
    when it reads nothing for send_timeout_s; its leases are released."""
    q = Quotas(unread_reply_bytes=256 << 10, send_timeout_s=2.0)
    d = DaemonThread(make_config(workdir, quotas=q, metrics_port=0)).start()
    try:
        with tierkv.connect(d.config.socket) as c:
            toks = prompt(64 * 16, seed=6)
            c.put(toks, pages_for(64, 6), SCOPE)
            s = raw(d)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            h, p = m.PrefixRequest(m.WireScope(SCOPE.model_version, SCOPE.namespace), toks).encode()
            frame = encode_frame(Op.LOOKUP, 1, h, p)
            s.settimeout(0.5)
            sent = 0
            peak = 0
            deadline = time.monotonic() + 20
            try:
                while time.monotonic() < deadline:
                    s.sendall(frame)  # never read a reply
                    sent += 1
                    conns = list(d.daemon.connections.values())
                    peak = max([peak] + [x.unsent for x in conns])
            except (socket.timeout, TimeoutError, ConnectionError, OSError):
                pass
            assert sent > 10
            assert wait_for(lambda: len(d.daemon.connections) == 1, timeout=15)  # cut off
            # The daemon held at most the limit plus the replies already in flight.
            assert peak <= q.unread_reply_bytes + 32 * len(frame) + (1 << 20)
            s.close()
            c.check_integrity()
            assert c.lookup(toks, SCOPE).tokens_matched == 64 * 16
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
