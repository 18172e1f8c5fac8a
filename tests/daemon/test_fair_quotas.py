"""Quotas that cannot be raced and that share fairly (issue 34, item 9), with real second
and third users (forked children as other uids): concurrent pinned puts cannot pass the
pinned limit together; one uid cannot pin the whole disk through two namespaces, nor while
alone (a uid arriving later still gets durable puts); a share shrinks as users arrive; a uid
above its share cannot renew its leases."""
from __future__ import annotations

import contextlib
import os
import threading

import pytest

import tierkv
from tierkv import Priority, Scope
from tierkv.daemon.quotas import Quotas
from tierkv.errors import QuotaExceededError

from as_user import NOBODY, need_root, run_as
from helpers.daemons import DaemonThread
from daemon_helpers import SCOPE, make_config, pages_for, prompt, wait_for

OTHER = NOBODY - 1  # a third user


@pytest.fixture
def shared_daemon(workdir):
    """A daemon that admits two other uids (no namespace_per_uid: namespaces are shared)."""
    need_root()
    os.chmod(workdir, 0o711)
    started: list[DaemonThread] = []

    def start(**quotas) -> DaemonThread:
        cfg = make_config(workdir, allowed_uids=(NOBODY, OTHER), quotas=Quotas(**quotas))
        started.append(DaemonThread(cfg).start())
        return started[-1]

    yield start
    for d in started:
        d.stop()


@contextlib.contextmanager
def connected_as(d: DaemonThread, *uids: int):
    """Other users connected to the daemon (each a forked child as that uid, holding one
    connection) until the block ends."""
    before = len(d.daemon.connections)
    gos, threads = [], []
    try:
        for uid in uids:
            r_ready, w_ready = os.pipe()
            r_go, w_go = os.pipe()
            gos.append(w_go)

            def hold(r_go: int = r_go, w_ready: int = w_ready) -> str:
                with tierkv.connect(d.config.socket) as t:
                    t.ping()
                    os.write(w_ready, b"1")
                    os.read(r_go, 1)
                return "ok"

            threads.append(threading.Thread(target=run_as, args=(uid, hold), daemon=True))
            threads[-1].start()
            assert os.read(r_ready, 1) == b"1", f"uid {uid} did not connect"
        yield
    finally:
        for w in gos:
            os.write(w, b"1")
        for t in threads:
            t.join(30)
        assert wait_for(lambda: len(d.daemon.connections) == before)


def pinned(d: DaemonThread) -> int:
    return d.call(lambda: d.daemon.handlers.layouts.only().local.pinned_blocks(""))


def disk_slots(d: DaemonThread) -> int:
    return d.call(lambda: d.daemon.handlers.layouts.only().local.disk.capacity_slots)


def test_concurrent_pinned_puts_cannot_pass_the_limit_together(shared_daemon):
    """16 clients pinning at once: the check ran before an await and the pin after it, so
    they passed it together (1,600 pinned against a limit of 1,024)."""
    d = shared_daemon(shared_pinned_fraction=0.25)
    limit = int(disk_slots(d) * 0.25)
    refusals: list[BaseException] = []

    def pin(i: int) -> None:
        with tierkv.connect(d.config.socket) as c:
            try:
                c.put(prompt(40 * 16, seed=100 + i), pages_for(40, 100 + i), SCOPE, priority=Priority.PINNED)
            except QuotaExceededError as e:
                refusals.append(e)

    with connected_as(d, NOBODY):
        threads = [threading.Thread(target=pin, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert 16 * 40 > limit and refusals, "the test must ask for more than the limit"
    assert limit - 16 * 8 < pinned(d) <= limit  # up to the limit, not past it (8 blocks a commit)
    d.call(d.daemon.check_integrity)


def test_one_uid_cannot_pin_the_disk_through_two_namespaces_nor_while_alone(shared_daemon):
    """Pins outlive connections: a uid alone pinned the whole disk tier, and a uid arriving
    later got non-durable puts; with namespaces shared, each namespace had its own limit,
    so two namespaces of one uid pinned 100%."""
    d = shared_daemon(shared_pinned_fraction=0.5)
    limit = int(disk_slots(d) * 0.5)
    with tierkv.connect(d.config.socket) as c:  # alone
        with pytest.raises(QuotaExceededError, match="shared_pinned_fraction"):
            c.put(prompt(disk_slots(d) * 16, seed=1), pages_for(disk_slots(d), 1), SCOPE, priority=Priority.PINNED)
        assert limit - 8 < pinned(d) <= limit
        with pytest.raises(QuotaExceededError, match="shared_pinned_fraction"):
            c.put(prompt(64 * 16, seed=2), pages_for(64, 2), Scope(SCOPE.model_version, "tenant-b"),
                  priority=Priority.PINNED)
        assert pinned(d) <= limit

    def later_user() -> dict:
        with tierkv.connect(d.config.socket) as t:
            r = t.put(prompt(32 * 16, seed=3), pages_for(32, 3), Scope(SCOPE.model_version, "late"))
            return {"stored": r.stored, "durable": r.durable}

    got = run_as(NOBODY, later_user)
    assert got.get("ok") == {"stored": 32, "durable": True}, got
    d.call(d.daemon.check_integrity)


def test_a_share_shrinks_as_users_arrive_and_is_not_renewed_above_it(shared_daemon):
    """A uid alone leased the whole device tier and kept it; later uids got acquires of 0
    blocks. With k users connected each gets at most 1/k; a uid above its share when
    others arrive keeps its leases but cannot renew them."""
    d = shared_daemon(shared_tier_fraction=0.5)
    slots = d.call(lambda: d.daemon.handlers.layouts.only().local.device.slots.limit)  # 128
    n = slots * 3 // 4
    toks = prompt(n * 16, seed=5)
    with tierkv.connect(d.config.socket) as c:
        c.put(toks, pages_for(n, 5), SCOPE)
        lease = c.acquire(toks, SCOPE)  # alone: 3/4 of the tier
        assert lease.num_blocks == n
        with connected_as(d, NOBODY):
            with pytest.raises(QuotaExceededError, match="fair share"):
                c.renew(lease)
        c.renew(lease)  # alone again: within its share
        lease.release()
        with connected_as(d, NOBODY):
            with c.acquire(toks, SCOPE, max_blocks=slots // 2) as half:  # two users: a half each
                assert half.num_blocks == slots // 2
        with connected_as(d, NOBODY, OTHER):  # three: a third each
            with pytest.raises(QuotaExceededError, match="3 users are connected"):
                c.acquire(toks, SCOPE, max_blocks=slots // 2)
            with c.acquire(toks, SCOPE, max_blocks=slots // 3) as third:
                assert third.num_blocks == slots // 3
        assert wait_for(lambda: c.stats()["leased_blocks"] == 0)
    d.call(d.daemon.check_integrity)
