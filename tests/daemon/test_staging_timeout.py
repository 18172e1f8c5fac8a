"""Staging slots expire (issue #34, item 10): two silent connections held the whole staging
region, holding it exempted them from the idle timeout, and every other uid's puts failed.
Now slots not committed within ``staging_timeout_s`` are taken back, a connection holding
staging is closed when it goes silent, and the late COMMIT fails with StagingExpiredError
and stores nothing. The other uid is real (a forked child as nobody)."""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch

import tierkv
from tierkv.daemon import messages as m
from tierkv.daemon.leases import StagingSlots
from tierkv.daemon.protocol import Op, encode_frame, read_frame_sync
from tierkv.daemon.quotas import Quotas
from tierkv.errors import StagingExpiredError

from as_user import NOBODY, need_root, run_as
from helpers.daemons import DaemonThread
from daemon_helpers import KiB, SCOPE, make_config, pages_for, prompt, wait_for


def used(d) -> int:
    return d.call(lambda: d.daemon.layouts.only().staging.slots.num_used)


def test_staging_slots_expire_unless_their_commit_started():
    st = StagingSlots(8, 8)
    a = st.alloc(1, 3, now=0.0)
    b = st.alloc(2, 2, now=0.0)
    st.begin_commit(2, b)  # a commit copies them: never taken back under it
    assert st.take_expired(5.0, now=4.0) == {}
    assert st.take_expired(5.0, now=6.0) == {1: a}
    assert not st.owns(1, tuple(a)) and st.expired(1, a) and not st.expired(2, b)
    again = st.alloc(1, 8 - 2, now=7.0)  # the expired slots, its own again
    assert set(a) <= set(again) and not st.expired(1, a)
    st.free_connection(1)
    st.free(2, b)
    assert st.slots.num_used == 0
    st.check_integrity()


def test_a_silent_holder_loses_its_staging_and_its_late_commit_stores_nothing(workdir):
    """One connection holds every staging slot and commits nothing. Another uid's put
    waits for room and stores its pages once the slots expire (before: CapacityError after
    the client's timeout); the holder's late commit is refused, its tokens are a miss."""
    need_root()
    os.chmod(workdir, 0o711)
    cfg = make_config(workdir, allowed_uids=(NOBODY,), client_staging_bytes=256 * KiB, staging_timeout_s=1.0)
    d = DaemonThread(cfg).start()
    try:
        sock = cfg.socket
        theirs = prompt(48, seed=2)
        with tierkv.connect(sock) as c:
            capacity = d.call(lambda: d.daemon.layouts.only().staging.slots.capacity)
            held = [int(s) for s in c._transport.call(Op.STAGE, m.Stage(capacity))["slots"]]  # the whole region
            mine = prompt(16 * capacity, seed=1)
            c._write_staging(held, pages_for(capacity, 1))
            assert used(d) == capacity

            def tenant() -> dict:
                with tierkv.connect(sock, timeout=8) as t:
                    t0 = time.monotonic()
                    t.put(theirs, pages_for(3, 2), SCOPE)
                    took = time.monotonic() - t0
                    with t.acquire(theirs, SCOPE) as lease:
                        equal = bool(torch.equal(lease.pages(), pages_for(3, 2)))
                return {"took": took, "equal": equal}

            got = run_as(NOBODY, tenant)
            assert "ok" in got, got
            assert got["ok"]["equal"] and got["ok"]["took"] < 6
            with pytest.raises(StagingExpiredError, match="staging_timeout_s"):
                c._transport.call(Op.COMMIT, m.Commit(m.WireScope.of(SCOPE), mine, tuple(held), 0, None, 1))
            assert c.lookup(mine, SCOPE).tokens_matched == 0  # nothing of the late commit stored
            with c.acquire(theirs, SCOPE) as lease:  # the other uid's put has its own bytes
                assert torch.equal(lease.pages(), pages_for(3, 2))
            c.put(mine[:32], pages_for(2, 3), SCOPE)  # the holder can put again
        assert wait_for(lambda: used(d) == 0)
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_a_silent_connection_holding_staging_is_closed_when_idle(workdir):
    """Holding staging slots exempted a connection from the idle timeout. Now it is
    closed like any silent connection (the slots themselves would expire much later)."""
    q = Quotas(idle_timeout_s=1.0)
    d = DaemonThread(make_config(workdir, quotas=q, staging_timeout_s=600.0, metrics_port=0)).start()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(d.config.socket))
        s.sendall(encode_frame(Op.STAGE, 1, {"count": 8}, b""))
        assert not read_frame_sync(s).is_error
        assert used(d) == 8
        s.settimeout(5)
        t0 = time.monotonic()
        try:
            while s.recv(65536):
                pass  # the idle error frame, then EOF
        except ConnectionError:
            pass
        assert time.monotonic() - t0 < 4, "the holder was not closed"
        assert wait_for(lambda: used(d) == 0)
        assert d.daemon.metrics.rejected.labels("idle")._value.get() >= 1
        s.close()
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
