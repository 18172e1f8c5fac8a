"""The client has the embedded store's API and gives the same results and bytes."""
from __future__ import annotations

import time

import pytest
import torch

import tierkv
from tierkv import Priority, Scope
from tierkv.daemon.client import RemoteLease
from tierkv.errors import LeaseError, NotFoundError, PageFormatError

from helpers.daemons import DaemonThread
from daemon_helpers import LAYOUT, MiB, SCOPE, make_config, pages_for, prompt, wait_for


def test_same_results_and_bytes_as_the_embedded_store(daemon, workdir):
    embedded = tierkv.open(workdir / "embedded", LAYOUT, device="cpu", device_bytes=1 * MiB, host_bytes=2 * MiB,
                           disk_bytes=8 * MiB, shm_dir=workdir / "shm")
    client = tierkv.connect(daemon.config.socket)
    try:
        cases = [(prompt(100, seed=1), pages_for(6, 1), 0), (prompt(160, seed=2), pages_for(10, 2), 0),
                 (prompt(160, seed=2), pages_for(3, 3), 10 - 3)]  # a put starting mid-prompt (all skipped)
        for toks, pages, start in cases:
            a = embedded.put(toks, pages, SCOPE, start_block=start)
            b = client.put(toks, pages, SCOPE, start_block=start)
            assert a == b
        other_scope = Scope("cd" * 32, "tenant-a")
        for toks, *_ in cases + [(prompt(80, seed=9), None, 0)]:
            for scope in (SCOPE, other_scope):
                la, lb = embedded.lookup(toks, scope), client.lookup(toks, scope)
                assert (la.tokens_matched, la.keys) == (lb.tokens_matched, lb.keys)
                with embedded.acquire(toks, scope) as ea, client.acquire(toks, scope, max_blocks=None) as ca:
                    assert isinstance(ca, RemoteLease) and isinstance(ca, tierkv.Lease)
                    assert (ea.keys, ea.num_blocks, ea.tokens_matched) == (ca.keys, ca.num_blocks, ca.tokens_matched)
                    assert torch.equal(ea.pages(), ca.pages())
                    for i in range(ca.num_blocks):
                        assert torch.equal(ca.page(i), ea.page(i))
                    ka, kb = ea.kv(), ca.kv()
                    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(ka, kb))
        with client.acquire(cases[1][0], SCOPE, max_blocks=2) as lease:
            assert lease.num_blocks == 2 and torch.equal(lease.pages(), cases[1][1][:2])
        client.check_integrity()
    finally:
        client.close()
        embedded.check_integrity()
        embedded.close()


def test_put_larger_than_the_staging_quota_is_chunked(daemon):
    # quota: 64 KiB of 8 KiB pages = 8 slots; 21 blocks take three chunks.
    with tierkv.connect(daemon.config.socket) as c:
        assert c.stage_quota == 8
        toks, pages = prompt(21 * 16 + 5, seed=4), pages_for(21, 4)
        r = c.put(toks, pages, SCOPE)
        assert (r.stored, r.skipped, r.durable) == (21, 0, True)
        with c.acquire(toks, SCOPE) as lease:
            assert lease.tokens_matched == 21 * 16 and torch.equal(lease.pages(), pages)
        assert c.stats()["daemon"]["staging_slots_used"] == 0


def test_operations_through_the_client(daemon):
    with tierkv.connect(daemon.config.socket) as c:
        toks = prompt(64, seed=5)
        c.put(toks, pages_for(4, 5), SCOPE)
        assert c.prefetch(toks, SCOPE).result(timeout=10) == 64
        assert c.set_priority(toks, SCOPE, Priority.PINNED) == 4
        c.save_manifest("sys", {"tokens": 64})
        assert c.get_manifest("sys") == {"tokens": 64} and "sys" in c.list_manifests()
        assert c.delete_manifest("sys") and not c.delete_manifest("sys")
        with pytest.raises(NotFoundError):
            c.get_manifest("sys")
        assert c.verify().checked == 4 and c.verify().corrupt == ()
        assert c.invalidate(namespace="tenant-a", dry_run=True).removed_blocks == 4
        s = c.stats()
        assert s["blocks"] == 4 and s["daemon"]["leases"] == 0
        with pytest.raises(PageFormatError):
            c.put(toks, torch.zeros(2, 3), SCOPE)
        with pytest.raises(ValueError):
            c.invalidate()
        assert c.invalidate(namespace="tenant-a").removed_blocks == 4
        assert c.lookup(toks, SCOPE).tokens_matched == 0
        assert c.layout == LAYOUT


def test_release_twice_and_foreign_leases_are_errors(daemon):
    with tierkv.connect(daemon.config.socket) as c, tierkv.connect(daemon.config.socket) as d:
        toks = prompt(32, seed=6)
        c.put(toks, pages_for(2, 6), SCOPE)
        lease = c.acquire(toks, SCOPE)
        with pytest.raises(LeaseError):
            d.release(lease)
        lease.release()
        lease.release()  # Lease.release() is idempotent, like the embedded lease
        with pytest.raises(LeaseError):
            c.release(lease)
        with pytest.raises(LeaseError):
            lease.pages()
        assert c.stats()["leased_blocks"] == 0


def test_leases_end_with_the_connection(daemon):
    c = tierkv.connect(daemon.config.socket)
    toks = prompt(48, seed=7)
    c.put(toks, pages_for(3, 7), SCOPE)
    c.acquire(toks, SCOPE)
    c.acquire(toks, SCOPE)
    with tierkv.connect(daemon.config.socket) as watcher:
        assert watcher.stats()["leased_blocks"] == 3
        c.close()
        assert wait_for(lambda: watcher.stats()["leased_blocks"] == 0)
        assert watcher.stats()["daemon"]["leases"] == 0


def test_idle_leases_time_out(workdir):
    d = DaemonThread(make_config(workdir, lease_timeout_s=0.3)).start()
    try:
        with tierkv.connect(d.config.socket) as c:
            toks = prompt(32, seed=8)
            c.put(toks, pages_for(2, 8), SCOPE)
            kept, idle = c.acquire(toks, SCOPE), c.acquire(toks, SCOPE)
            t_end = time.monotonic() + 1.0
            while time.monotonic() < t_end:
                kept.renew()
                time.sleep(0.1)
            assert c.stats()["daemon"]["leases"] == 1  # the idle one was released by the daemon
            with pytest.raises(LeaseError, match="expired"):
                idle.pages()
            with pytest.raises(LeaseError):
                idle.release()
            kept.renew()
            assert torch.equal(kept.pages(), pages_for(2, 8))
            kept.release()
            assert c.stats()["leased_blocks"] == 0
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
