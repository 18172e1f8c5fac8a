"""The daemon with the remote tier (``tierkv serve --remote-master ...``).

Fast tests (always run): a daemon whose master is unreachable starts and serves locally
with the remote tier reported degraded; two daemons sharing the in-memory stand-in cluster
(kit.FakeCluster) see each other's published prefixes through their clients and through
``tierkv route``; config precedence of the new keys. The same against a real Mooncake
master runs in a private network namespace (daemon_scenarios.py, like test_mooncake.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import tierkv
from tierkv import Priority, Scope
from tierkv.cli import main
from tierkv.cluster import open_node, route
from tierkv.cluster.master import free_port
from helpers.daemons import DaemonThread
from tierkv.daemon.config import DaemonConfig, merge, read_config_file
from tierkv.identity import block_keys
from tierkv.errors import ConfigError

from .kit import BS, LAYOUT, MV1, SCOPE, FakeCluster, pages_for, toks
from .test_mooncake import _namespace_ok

SCRIPT = Path(__file__).with_name("daemon_scenarios.py")


def daemon_config(work: Path, name: str, **kw) -> DaemonConfig:
    base = dict(home=work / name / "home", socket=work / "run" / f"{name}.sock", layout=LAYOUT, device="cpu",
                device_bytes=16 * LAYOUT.page_bytes, host_bytes=8 * LAYOUT.slot_bytes,
                disk_bytes=64 * LAYOUT.slot_bytes, staging_bytes=256 << 10, client_staging_bytes=64 << 10,
                shm_dir=work / name / "shm", workers=2, remote_metadata_url="http://127.0.0.1:2/metadata",
                remote_segment_bytes=16 << 20, remote_buffer_bytes=8 << 20, remote_op_timeout_s=1.0,
                remote_setup_timeout_s=2.0, remote_backoff_max_s=1.0)
    base.update(kw)
    return DaemonConfig(**base)


@pytest.fixture
def work(monkeypatch):
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)  # the daemon sets it; restored after
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvdr-"))  # AF_UNIX paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def wait_for(pred, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_unreachable_master_daemon_serves_locally_and_reports_degraded(work):
    cfg = daemon_config(work, "a", remote_master=f"127.0.0.1:{free_port()}",
                        remote_metadata_url=f"http://127.0.0.1:{free_port()}/metadata")
    d = DaemonThread(cfg).start()
    try:
        assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
        t = toks(1, 3)
        with tierkv.connect(cfg.socket) as c:
            c.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)  # the publish fails quietly
            assert c.lookup(t, SCOPE).tiers == ("device",) * 3
            with c.acquire(t, SCOPE) as lease:
                assert torch.equal(lease.pages().cpu(), pages_for(t))
            assert wait_for(lambda: c.stats()["tiers"]["remote"]["state"] == "degraded")
            r = c.stats()["tiers"]["remote"]
            assert r["available"] is False and "setup_failed" in r["degraded_reason"], r
            assert r["faults"].get("setup_failed", 0) >= 1 and r["hits"] == 0, r
            for key in ("hits", "fetched_bytes", "verify_failures", "reconnects"):
                assert key in r
        r = CliRunner().invoke(main, ["stats", "--socket", str(cfg.socket), "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["tiers"]["remote"]["state"] == "degraded"
        r = CliRunner().invoke(main, ["stats", "--socket", str(cfg.socket)])
        assert r.exit_code == 0, r.output
        from prometheus_client import generate_latest

        text = generate_latest(d.daemon.metrics.registry).decode()
        assert "tierkv_remote_up 0.0" in text
        assert 'tierkv_remote_faults_total{reason="setup_failed"}' in text
        assert "tierkv_remote_hit_blocks_total 0.0" in text
        assert 'tierkv_tier_used_bytes{tier="remote"}' not in text
        d.daemon.check_integrity()
    finally:
        d.stop()
    assert not cfg.socket.exists()


def test_two_daemons_share_published_prefixes(work):
    """Daemons with separate homes and one (stand-in) cluster: a pinned prefix put through
    A is a remote hit through B's client, byte for byte, and route counts it."""
    cluster = FakeCluster()
    kw = dict(remote_master="127.0.0.1:1", remote_bind="127.0.0.2")
    a = DaemonThread(daemon_config(work, "a", **kw), remote_backend_factory=cluster.factory).start()
    b = DaemonThread(daemon_config(work, "b", **kw), remote_backend_factory=cluster.factory).start()
    try:
        assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.2"
        t, private = toks(2, 4), toks(3, 2)
        with tierkv.connect(a.config.socket) as ca, tierkv.connect(b.config.socket) as cb:
            ca.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
            ca.put(private, pages_for(private), SCOPE)  # normal put: stays on A
            assert cb.lookup(t, SCOPE).tiers == ("remote",) * 4
            assert cb.lookup(private, SCOPE).tokens_matched == 0
            nodes = {"b": open_node(b.config.socket), "a": open_node(a.config.socket)}
            try:
                res = route(t, nodes, SCOPE)
                assert res.per_node == {"b": 4 * BS, "a": 4 * BS} and res.best_node == "b", res
                assert res.to_dict()["tiers"] == {"b": {"remote": 4}, "a": {"device": 4}}
                assert route(private, nodes, SCOPE).best_node == "a"
            finally:
                for n in nodes.values():
                    n.close()
            with cb.acquire(t, SCOPE) as lease:
                assert lease.num_blocks == 4
                assert torch.equal(lease.pages().cpu(), pages_for(t)), "fetched bytes differ"
            assert cb.lookup(t, SCOPE).tiers == ("device",) * 4  # pulled: local now
            s = cb.stats()
            assert s["tiers"]["remote"]["state"] == "up" and s["tiers"]["remote"]["hits"] == 4, s["tiers"]["remote"]
            assert s["tiers"]["remote"]["fetched_bytes"] > 4 * LAYOUT.page_bytes
            assert s["hits"]["remote"] >= 4
            assert ca.stats()["tiers"]["remote"]["published"] == 4
            # A local-only namespace and another model are neither published nor found.
            other = Scope(MV1, "tenant-x")
            ca.set_priority(private, SCOPE, Priority.PINNED)  # pinning publishes
            assert cb.lookup(private, SCOPE).tiers == ("remote",) * 2
            assert cb.lookup(t, other).tokens_matched == 0
        a.daemon.check_integrity()
        b.daemon.check_integrity()
    finally:
        a.stop()
        b.stop()


def test_daemon_republishes_named_prefixes_when_the_master_comes_back(work):
    """A restarted master has lost every object: once A's keeper sees the tier up again it
    republishes A's named prefixes, and B finds them without anyone re-pinning."""
    cluster = FakeCluster()
    kw = dict(remote_master="127.0.0.1:1")
    a = DaemonThread(daemon_config(work, "a", **kw), remote_backend_factory=cluster.factory).start()
    b = DaemonThread(daemon_config(work, "b", **kw), remote_backend_factory=cluster.factory).start()
    try:
        t = toks(7, 3)
        with tierkv.connect(a.config.socket) as ca, tierkv.connect(b.config.socket) as cb:
            ca.put(t, pages_for(t), SCOPE)
            last = block_keys(t, SCOPE, BS)[-1]
            ca.save_manifest("doc", {"kind": "prefix", "last_block_key": last.hex()})  # materialised: published
            assert wait_for(lambda: cb.lookup(t, SCOPE).tiers == ("remote",) * 3)
            cluster.down = True  # the master dies ...
            assert wait_for(lambda: ca.stats()["tiers"]["remote"]["state"] == "degraded")
            cluster.restart()  # ... and comes back empty
            cluster.down = False
            assert wait_for(lambda: ca.stats()["tiers"]["remote"]["reconnects"] >= 1)
            assert wait_for(lambda: cb.lookup(t, SCOPE).tiers == ("remote",) * 3), "not republished"
            with cb.acquire(t, SCOPE) as lease:
                assert torch.equal(lease.pages().cpu(), pages_for(t))
    finally:
        a.stop()
        b.stop()


def test_local_only_namespace_stays_on_the_node(work):
    cluster = FakeCluster()
    kw = dict(remote_master="127.0.0.1:1", local_only_namespaces=("secret",))
    a = DaemonThread(daemon_config(work, "a", **kw), remote_backend_factory=cluster.factory).start()
    try:
        t = toks(4, 2)
        with tierkv.connect(a.config.socket) as ca:
            ca.put(t, pages_for(t, Scope(MV1, "secret")), Scope(MV1, "secret"), priority=Priority.PINNED)
            ca.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
        assert len(cluster.objects) == 2  # SCOPE's two blocks only
    finally:
        a.stop()


def test_remote_config_precedence(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('remote_bind = "10.0.0.9"\nlocal_only_namespaces = ["a", "b"]\n'
                 '[remote]\nmaster = "10.0.0.5:50051"\nmetadata_url = "http://10.0.0.5:8080/metadata"\n'
                 'segment_bytes = "1GiB"\nkey_prefix = "c1/"\nwrite_back_evicted = true\n')
    file_values = read_config_file(f)
    env = {"MC_TCP_BIND_ADDRESS": "10.0.0.1", "TIERKV_HOME": str(tmp_path / "h"), "TIERKV_SOCKET": "/tmp/x.sock"}
    cfg = merge({}, file_values, env)
    assert cfg.remote_master == "10.0.0.5:50051" and cfg.remote_metadata_url == "http://10.0.0.5:8080/metadata"
    assert cfg.remote_bind == "10.0.0.9"  # the file beats the environment
    assert cfg.remote_segment_bytes == 1 << 30 and cfg.remote_key_prefix == "c1/"
    assert cfg.local_only_namespaces == ("a", "b")
    policy = cfg.publish_policy()
    assert policy.write_back_evicted and policy.publish_pinned and policy.publish_materialised
    assert policy.local_only_namespaces == {"a", "b"}
    rc = cfg.remote_config()
    assert rc.global_segment_bytes == 1 << 30 and rc.key_prefix == "c1/"
    flags = {"remote_bind": "10.0.0.3", "remote_key_prefix": "c2/", "local_only_namespaces": ("z",),
             "publish_pinned": False, "remote_segment_bytes": "64MiB"}
    cfg = merge(flags, file_values, env)  # flags beat the file
    assert (cfg.remote_bind, cfg.remote_key_prefix, cfg.local_only_namespaces) == ("10.0.0.3", "c2/", ("z",))
    assert cfg.remote_segment_bytes == 64 << 20 and not cfg.publish_policy().publish_pinned
    cfg = merge({}, {}, env)  # no remote tier; the bind address comes from the environment
    assert cfg.remote_config() is None and not cfg.remote_enabled and cfg.resolved_remote_bind == "10.0.0.1"
    assert merge({}, {}, {"TIERKV_HOME": "/h"}).resolved_remote_bind == "127.0.0.1"
    with pytest.raises(ConfigError, match="remote_metadata_url"):
        merge({"remote_master": "10.0.0.5:50051"}, {}, env)
    with pytest.raises(ConfigError, match="key_prefix"):
        merge({"remote_key_prefix": "bad prefix!"}, file_values, env)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        merge({"remote_master": "nohost"}, file_values, env)


def test_serve_cli_remote_flags(tmp_path):
    r = CliRunner().invoke(main, ["serve", "--help"])
    for flag in ("--remote-master", "--remote-metadata-url", "--remote-hostname", "--remote-bind",
                 "--remote-segment-bytes", "--remote-key-prefix", "--write-back-evicted", "--local-only-namespace"):
        assert flag in r.output
    r = CliRunner().invoke(main, ["serve", "--home", str(tmp_path / "h"), "--socket", str(tmp_path / "s.sock"),
                                  "--remote-master", "127.0.0.1:1"])
    assert r.exit_code != 0 and "remote_metadata_url" in r.output


# ---- real Mooncake --------------------------------------------------------------------------
def test_daemons_with_real_mooncake(tmp_path_factory):
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)")
    if not _namespace_ok():
        pytest.skip("cannot create a private network namespace (unshare -rn) for the Mooncake test cluster")
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvdm-"))
    try:
        cmd = f'ip link set lo up && exec "{sys.executable}" "{SCRIPT}" "{work}"'
        r = subprocess.run(["unshare", "-rn", "sh", "-c", cmd], capture_output=True, text=True, timeout=180)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            pytest.fail(f"daemon scenario runner exited {r.returncode} without results:\n{r.stderr[-4000:]}")
        results = json.loads(lines[-1])
        if "_skip" in results:
            pytest.skip(results["_skip"])
        bad = {k: v for k, v in results.items() if v != "ok"}
        assert not bad, json.dumps(bad, indent=1) + "\n" + r.stderr[-3000:]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_write_back_of_evicted_blocks(nodes, cluster):
    """write_back_evicted: a block leaving a node's last tier is published, and another
    node fetches it byte for byte; without the option nothing normal is published."""
    from tierkv.cluster import PublishPolicy

    a = nodes("a", policy=PublishPolicy(write_back_evicted=True))
    b = nodes("b")
    prompts = [toks(100 + i, 2) for i in range(60)]  # 120 blocks: more than a's 64 disk slots
    for t in prompts:
        a.put(t, pages_for(t), SCOPE)
    a.close()  # waits for the publisher
    assert a.counters["written_back_blocks"] > 0 and len(cluster.objects) == a.counters["written_back_blocks"]
    gone = [t for t in prompts if b.lookup(t, SCOPE).tiers == ("remote",) * 2]
    assert gone, "no evicted prefix is in the cluster"
    with b.acquire(gone[0], SCOPE) as lease:
        assert torch.equal(lease.pages().cpu(), pages_for(gone[0]))
    c = nodes("c")  # the default policy: normal puts and their evictions stay local
    for t in prompts[:40]:
        c.put(t, pages_for(t), Scope(MV1, "other"))
    assert c.stats()["evictions"].get("disk", 0) > 0
    assert len(cluster.objects) == a.counters["written_back_blocks"]
