"""Per-connection quotas and limits, concurrent use of one client, and cleanup of a client
that dies between staging and commit."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

import tierkv
from tierkv.daemon import messages as m
from tierkv.daemon.protocol import Op, encode_frame, read_frame_sync
from tierkv.errors import CapacityError, DaemonUnavailableError

from daemon_helpers import SCOPE, DaemonThread, make_config, pages_for, prompt, wait_for


def test_one_client_shared_by_threads(daemon):
    with tierkv.connect(daemon.config.socket) as c:
        data = [(prompt(64, seed=50 + i), pages_for(4, 50 + i)) for i in range(4)]
        for toks, pages in data:
            c.put(toks, pages, SCOPE)
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                for j in range(20):
                    toks, pages = data[(k + j) % 4]
                    assert c.lookup(toks, SCOPE).tokens_matched == 64
                    with c.acquire(toks, SCOPE) as lease:
                        assert torch.equal(lease.pages(), pages)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        assert c.stats()["leased_blocks"] == 0
        c.check_integrity()


def test_staging_quota_and_region_exhaustion_are_capacity_errors(daemon):
    with tierkv.connect(daemon.config.socket) as c, tierkv.connect(daemon.config.socket) as d:
        with pytest.raises(CapacityError, match="quota"):
            c._call(Op.STAGE, m.Stage(c.stage_quota + 1))
        held = [c._call(Op.STAGE, m.Stage(c.stage_quota))["slots"]]
        held += [d._call(Op.STAGE, m.Stage(d.stage_quota))["slots"]]
        with tierkv.connect(daemon.config.socket) as e, tierkv.connect(daemon.config.socket) as f:
            e._call(Op.STAGE, m.Stage(e.stage_quota))
            f._call(Op.STAGE, m.Stage(f.stage_quota))  # 4 x 8 = all 32 slots of the region
            with tierkv.connect(daemon.config.socket) as g, pytest.raises(CapacityError, match="no 1 staging"):
                g._call(Op.STAGE, m.Stage(1))  # within g's quota, but the region is full
        # e and f closed: their slots came back; c gives its own back by UNSTAGE.
        c._call(Op.UNSTAGE, m.Unstage(tuple(held[0])))
        assert c.stats()["daemon"]["staging_slots_used"] == d.stage_quota
        assert c.put(prompt(32, seed=60), pages_for(2, 60), SCOPE).stored == 2


def test_a_client_dying_between_stage_and_commit_frees_its_slots(daemon):
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(daemon.config.socket))
    s.sendall(encode_frame(Op.STAGE, 1, {"count": 4}))
    assert len(read_frame_sync(s).header["slots"]) == 4
    with tierkv.connect(daemon.config.socket) as c:
        assert c.stats()["daemon"]["staging_slots_used"] == 4
        s.close()
        assert wait_for(lambda: c.stats()["daemon"]["staging_slots_used"] == 0)


def test_connection_limit(workdir):
    d = DaemonThread(make_config(workdir, max_connections=2)).start()
    try:
        with tierkv.connect(d.config.socket), tierkv.connect(d.config.socket):
            with pytest.raises(DaemonUnavailableError):
                tierkv.connect(d.config.socket)
        with tierkv.connect(d.config.socket) as c:
            c.check_integrity()
    finally:
        d.stop()


def test_put_waits_for_staging_held_by_others(daemon):
    with tierkv.connect(daemon.config.socket) as c:
        others = [tierkv.connect(daemon.config.socket) for _ in range(4)]
        held = [o._call(Op.STAGE, m.Stage(o.stage_quota))["slots"] for o in others]  # the region is full
        threading.Timer(0.3, others[0].close).start()  # one frees its 8 slots a little later
        toks, pages = prompt(20 * 16, seed=70), pages_for(20, 70)
        r = c.put(toks, pages, SCOPE)
        assert (r.stored, r.skipped) == (20, 0) and held
        with c.acquire(toks, SCOPE) as lease:
            assert torch.equal(lease.pages(), pages)
        for o in others[1:]:
            o.close()
