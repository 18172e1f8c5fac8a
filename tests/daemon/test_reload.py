"""SIGHUP applies every setting it can and loudly refuses the rest (issue #34, item 12): a
uid removed from ``allowed_uids`` kept its connection and mappings, and turning on
``namespace_per_uid`` or changing quotas by reload was ignored without a log line. A real
daemon process, a real SIGHUP, a real second uid (a forked child as nobody)."""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import fields

import pytest

import tierkv
from tierkv.daemon.config import DaemonConfig
from tierkv.daemon.reload import AT_RESTART, LIVE, NOT_SETTINGS
from tierkv.errors import DaemonUnavailableError

from as_user import NOBODY, need_root, run_as
from daemon_helpers import SCOPE, pages_for, prompt, spawn_daemon, wait_for


def test_every_setting_is_applied_live_or_refused_until_restart():
    """No setting may be ignored silently: each field is live or refused with a reason."""
    names = {f.name for f in fields(DaemonConfig)}
    assert set(LIVE) | set(AT_RESTART) | set(NOT_SETTINGS) == names
    assert not set(LIVE) & set(AT_RESTART)
    assert all(AT_RESTART.values())


def config_text(allowed: list[int], per_uid: bool, connections_per_uid: int) -> str:
    return (f"allowed_uids = {allowed}\nnamespace_per_uid = {str(per_uid).lower()}\n"
            f"[quotas]\nconnections_per_uid = {connections_per_uid}\n")


@pytest.mark.parametrize("per_uid", [False, True], ids=["shared", "namespace_per_uid"])
def test_sighup_revokes_a_removed_uid_applies_quotas_and_refuses_namespace_per_uid(workdir, per_uid):
    need_root()
    os.chmod(workdir, 0o711)  # others pass through to the socket
    cfg, log, shm = workdir / "daemon.toml", workdir / "daemon.log", workdir / "shm"
    cfg.write_text(config_text([NOBODY], per_uid, 64))
    proc = spawn_daemon(workdir, "--config", str(cfg), "--shm-dir", str(shm), log_path=log)
    sock = workdir / "run" / "d.sock"
    try:
        with tierkv.connect(sock) as c:
            shared_files = set(os.listdir(shm))
            r_ready, w_ready = os.pipe()
            r_go, w_go = os.pipe()
            theirs = prompt(48, seed=2)

            def tenant() -> dict:
                t = tierkv.connect(sock)
                t.put(theirs, pages_for(3, 2), SCOPE)
                lease = t.acquire(theirs, SCOPE)
                os.write(w_ready, b"1")
                os.read(r_go, 1)  # the parent reloaded
                out: dict = {"leased": lease.num_blocks}
                try:
                    t.lookup(theirs, SCOPE)
                    out["after"] = "served"
                except tierkv.TierKVError as e:
                    out["after"] = f"{type(e).__name__}: {e.message}"
                try:
                    tierkv.connect(sock).close()
                    out["again"] = "connected"
                except tierkv.TierKVError as e:
                    out["again"] = f"{type(e).__name__}: {e.message}"
                return out

            out: dict = {}
            child = threading.Thread(target=lambda: out.update(run_as(NOBODY, tenant)), daemon=True)
            child.start()
            try:
                assert os.read(r_ready, 1) == b"1"
                assert c.stats()["daemon"]["leases"] == 1  # the tenant's lease
                tenant_files = set(os.listdir(shm)) - shared_files  # its read window and staging
                assert len(tenant_files) == (2 if per_uid else 0)

                cfg.write_text(config_text([], not per_uid, 2))
                proc.send_signal(signal.SIGHUP)
                assert wait_for(lambda: c.stats()["daemon"]["leases"] == 0, timeout=5), "the revoked uid kept its lease"
            finally:
                os.write(w_go, b"1")  # the child holds this pipe's write end too: it waits for this
                child.join(60)
            assert "ok" in out, out
            r = out["ok"]
            assert r["leased"] == 3
            assert r["after"].startswith("DaemonUnavailableError") and "allowed_uids" in r["after"], r
            assert r["again"].startswith("DaemonUnavailableError") and f"uid {NOBODY}" in r["again"], r
            assert not tenant_files & set(os.listdir(shm))  # its regions are gone

            report = c.stats()["daemon"]["reload"]
            assert report["revoked_uids"] == [NOBODY] and report["closed_connections"] == 1
            assert {"allowed_uids", "quotas"} <= set(report["applied"])
            assert [x["name"] for x in report["refused"]] == ["namespace_per_uid"]
            assert bool(report["warnings"]) == (not per_uid)  # shared tiers' mappings: until restart
            assert c.stats()["daemon"]["config"]["namespace_per_uid"]["value"] == str(per_uid)  # unchanged

            other = tierkv.connect(sock)  # connections_per_uid = 2, applied live
            try:
                with pytest.raises(DaemonUnavailableError, match="connections_per_uid"):
                    tierkv.connect(sock)
            finally:
                other.close()
            c.check_integrity()
        lines = log.read_text().splitlines()
        assert any("WARNING" in x and "namespace_per_uid" in x and "not applied" in x for x in lines), lines[-20:]
        assert any("WARNING" in x and f"uid {NOBODY} removed from allowed_uids" in x for x in lines), lines[-20:]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
