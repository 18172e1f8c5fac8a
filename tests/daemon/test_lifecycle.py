"""Daemon processes: signals, crashes and restarts, clients that die, disk faults, metrics,
configuration."""
from __future__ import annotations

import errno
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from unittest import mock

import pytest
import torch

import tierkv
from tierkv.daemon.config import merge, read_config_file
from tierkv.errors import ConfigError, DaemonUnavailableError, DiskWriteError, TierKVError
from tierkv.layout import PageLayout

from helpers.daemons import DaemonThread, with_sections
from daemon_helpers import LAYOUT, SCOPE, make_config, pages_for, prompt, spawn_daemon, wait_for


def put_until_stopped(sock, acked: list, stop: threading.Event) -> None:
    """Put distinct prompts until the daemon goes away; record what was acknowledged."""
    with tierkv.connect(sock) as c:
        i = 0
        while not stop.is_set():
            toks, pages = prompt(48, seed=1000 + i), pages_for(3, 1000 + i)
            try:
                r = c.put(toks, pages, SCOPE)
            except TierKVError:
                return
            if r.durable:
                acked.append(i)
            i += 1


def check_acked(store, acked: list) -> None:
    for i in acked:
        toks, pages = prompt(48, seed=1000 + i), pages_for(3, 1000 + i)
        with store.acquire(toks, SCOPE) as lease:
            assert lease.tokens_matched == 48, f"acknowledged put {i} lost"
            assert torch.equal(lease.pages(), pages), f"acknowledged put {i} has other bytes"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_during_puts_keeps_everything_acknowledged(workdir, sig):
    proc = spawn_daemon(workdir, "--shm-dir", str(workdir / "shm"))
    sock = workdir / "run" / "d.sock"
    acked: list[int] = []
    stop = threading.Event()
    t = threading.Thread(target=put_until_stopped, args=(sock, acked, stop))
    t.start()
    assert wait_for(lambda: len(acked) >= 5, timeout=30)
    if sig == signal.SIGTERM:
        proc.send_signal(signal.SIGHUP)  # no --config: logged and ignored, the daemon serves on
        n = len(acked)
        assert wait_for(lambda: len(acked) > n, timeout=30) and proc.poll() is None
    proc.send_signal(sig)
    rc = proc.wait(30)
    stop.set()
    t.join(30)
    assert acked
    if sig == signal.SIGTERM:
        assert rc == 0, proc.stderr.read().decode()[-2000:]
        assert not sock.exists() and not (workdir / "run" / "d.sock.pid").exists()
        assert not list((workdir / "shm").iterdir())  # its shared memory went with it
        store = tierkv.open(workdir / "home", LAYOUT, device="cpu", shm_dir=workdir / "shm")
        try:
            check_acked(store, acked)
            store.check_integrity()
        finally:
            store.close()
    else:
        assert rc == -signal.SIGKILL and sock.exists()  # a stale socket is left behind
        again = spawn_daemon(workdir, "--shm-dir", str(workdir / "shm"))  # replaces it; no --layout needed
        try:
            with tierkv.connect(sock) as c:
                check_acked(c, acked)
                c.check_integrity()
            leftovers = [p.name for p in (workdir / "shm").iterdir() if f"-{proc.pid}-" in p.name]
            assert not leftovers, f"shared memory of the killed daemon not reclaimed: {leftovers}"
        finally:
            again.send_signal(signal.SIGTERM)
            assert again.wait(30) == 0


CLIENT = textwrap.dedent("""
    import sys, time, numpy as np, tierkv
    sys.path.insert(0, {tests!r})
    from daemon_helpers import SCOPE, prompt
    c = tierkv.connect({sock!r})
    leases = [c.acquire(prompt(64, seed=21), SCOPE) for _ in range(3)]
    print(sum(le.num_blocks for le in leases), flush=True)
    time.sleep(600)
""")


def test_leases_of_a_killed_client_are_reclaimed(daemon):
    sock = str(daemon.config.server.socket)
    with tierkv.connect(sock) as c:
        c.put(prompt(64, seed=21), pages_for(4, 21), SCOPE)
        code = CLIENT.format(tests=os.path.dirname(__file__), sock=sock)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "12"
            assert c.stats()["leased_blocks"] == 4 and c.stats()["daemon"]["leases"] == 3
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            assert wait_for(lambda: c.stats()["daemon"]["leases"] == 0)
            assert c.stats()["leased_blocks"] == 0
        finally:
            child.kill()
            child.wait()


def test_enospc_while_serving_is_an_error_reply_and_the_daemon_goes_on(daemon):
    with tierkv.connect(daemon.config.server.socket) as c:
        c.put(prompt(32, seed=30), pages_for(2, 30), SCOPE)
        with mock.patch("tierkv.tiers.disk.os.pwritev", side_effect=OSError(errno.ENOSPC, "No space left on device")):
            try:
                r = c.put(prompt(32, seed=31), pages_for(2, 31), SCOPE)
                assert not r.durable  # the store kept it in memory only and said so
            except DiskWriteError as e:  # the store's typed error, carried over the socket
                assert "No space left" in str(e)
            r = c.put(prompt(32, seed=32), pages_for(2, 32), SCOPE)  # degraded: memory only
            assert not r.durable
        assert c.lookup(prompt(32, seed=30), SCOPE).tokens_matched == 32
        with c.acquire(prompt(32, seed=30), SCOPE) as lease:
            assert torch.equal(lease.pages(), pages_for(2, 30))
        assert c.stats()["daemon"]["staging_slots_used"] == 0
        c.check_integrity()


def test_metrics_endpoint(workdir):
    import gc

    frozen = gc.get_freeze_count()  # not 0 on Python 3.12: the interpreter freezes a few hundred
    d = DaemonThread(make_config(workdir, metrics=dict(port=0))).start()
    try:
        with tierkv.connect(d.config.server.socket) as c:
            toks = prompt(64, seed=40)
            c.put(toks, pages_for(4, 40), SCOPE)
            c.lookup(toks, SCOPE)
            with c.acquire(toks, SCOPE):
                text = urllib.request.urlopen(f"http://127.0.0.1:{d.daemon.metrics_port}/metrics", timeout=10).read().decode()
        for name in ("tierkv_lookups_total 1.0", 'tierkv_hit_blocks_total{tier="device"} 4.0',
                     'tierkv_tier_used_bytes{tier="device"}', "tierkv_evictions_total", "tierkv_promotions_total",
                     "tierkv_demotions_total", "tierkv_quarantined_blocks_total", "tierkv_leased_blocks 4.0",
                     'tierkv_request_seconds_bucket{le="0.001",op="lookup"}', "tierkv_daemon_connections 1.0",
                     'tierkv_daemon_gc_collections_total{generation="0"}',
                     'tierkv_daemon_gc_pause_max_seconds{generation="2"}'):
            assert name in text, name
        assert "python_gc" not in text  # a private registry
    finally:
        d.stop()
    assert d.daemon.gc_pauses._on_gc not in gc.callbacks  # a daemon in a thread leaves no callback behind
    assert gc.get_freeze_count() == frozen  # nor a frozen heap in the program that ran it


def test_the_daemon_process_freezes_its_startup_heap_and_reports_gc_pauses(workdir):
    """`tierkv serve` moves its startup heap (imports: torch, numpy, tierkv) out of the
    garbage collector's reach before serving, so a full collection no longer walks it
    (tierkv/daemon/gc_pauses.py); every collection's pause is counted in stats."""
    proc = spawn_daemon(workdir, "--shm-dir", str(workdir / "shm"))
    try:
        with tierkv.connect(workdir / "run" / "d.sock") as c:
            for i in range(20):  # enough allocation for some young collections
                c.put(prompt(48, seed=500 + i), pages_for(3, 500 + i), SCOPE)
            gc_stats = c.stats()["daemon"]["gc"]
        assert gc_stats["frozen_objects"] > 10_000, gc_stats  # the imports alone are ~170,000
        assert len(gc_stats["collections"]) == 3 and gc_stats["collections"][0] > 0, gc_stats
        assert all(m >= 0 for m in gc_stats["pause_ms_max"]) and gc_stats["pause_ms_max"][0] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read().decode()[-2000:]


def test_config_precedence_flag_over_env_over_file(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('[server]\nsocket = "/tmp/from-file.sock"\n[store]\nhost_bytes = "2GiB"\n[leases]\ntimeout_s = 30.0\n'
                 '[layouts.preload]\nnum_layers = 4\nnum_kv_heads = 2\nhead_dim = 64\ndtype = "bfloat16"\n')
    env = {"TIERKV_HOME": str(tmp_path / "env-home"), "TIERKV_SOCKET": "/tmp/from-env.sock"}
    cfg = merge({"store.host_bytes": "512MiB", "store.home": None}, read_config_file(f), env)
    assert cfg.store.home == tmp_path / "env-home" and str(cfg.server.socket) == "/tmp/from-env.sock"  # issue #37: env > file
    assert str(merge({}, read_config_file(f), {}).server.socket) == "/tmp/from-file.sock"
    assert cfg.store.host_bytes == 512 << 20 and cfg.leases.timeout_s == 30.0
    assert cfg.layouts.preload == PageLayout(4, 2, 64, 16, "bfloat16")
    assert str(merge({}, {}, env).server.socket) == "/tmp/from-env.sock"
    f.write_text("bogus = 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        read_config_file(f)
    with pytest.raises(ConfigError):
        merge({"server.socket": "/tmp/" + "x" * 120}, {}, env)


def test_sighup_reload_applies_limits_now_and_capacities_at_restart(workdir, caplog):
    cfg = make_config(workdir)
    d = DaemonThread(cfg).start()
    try:
        d.daemon.reload.read = lambda: with_sections(cfg, leases=dict(timeout_s=5.0), store=dict(host_bytes=4 << 20),
                                                     staging=dict(per_client_bytes=16 << 10))
        with caplog.at_level(logging.INFO, logger="tierkv.daemon.server"):
            d.call(d.daemon.reload.on_sighup)
        assert d.daemon.handlers.leases.timeout_s == 5.0 and d.daemon.layouts.only().staging.quota == 2
        assert any("store.host_bytes" in r.message and "restart" in r.message for r in caplog.records)
        with tierkv.connect(cfg.server.socket) as c:
            assert c.lease_timeout_s == 5.0 and c.stats()["tiers"]["host"]["capacity_bytes"] < 4 << 20
    finally:
        d.stop()


def test_connect_without_a_daemon(workdir):
    with pytest.raises(DaemonUnavailableError):
        tierkv.connect(workdir / "nothing.sock")


def test_a_busy_metrics_port_fails_the_start_and_leaves_nothing_behind(workdir):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cfg = make_config(workdir, metrics=dict(port=busy.getsockname()[1]))
    try:
        with pytest.raises(ConfigError, match="metrics"):
            DaemonThread(cfg).start()
    finally:
        busy.close()
    assert not cfg.server.socket.exists() and not cfg.server.resolved_pid_file.exists()
    assert not list((workdir / "shm").iterdir())
    tierkv.open(cfg.store.home, LAYOUT, device="cpu", device_bytes=1 << 20, host_bytes=0, disk_bytes=0,
                shm_dir=workdir / "shm").close()  # the home is free again


def _missing_cuda_device() -> str:
    """A CUDA device this machine lacks: cuda:0 without CUDA, else one past the last GPU."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda:0"


def test_serve_refuses_a_cuda_device_the_machine_lacks(workdir):
    """Issue #37, item 6: `serve --device cuda:0` on a CPU-only torch started, and every
    client then failed with `daemon error AssertionError`."""
    bad = _missing_cuda_device()
    with pytest.raises(RuntimeError) as exc:
        spawn_daemon(workdir, "--device", bad)  # the last --device wins over the helper's cpu
    message = str(exc.value)
    assert "rc 1" in message and "Traceback" not in message
    assert "Error: cannot start: cuda: " in message and f"device '{bad}' is not available" in message
    assert "pass --device cpu" in message
    assert not (workdir / "run" / "d.sock").exists() and not (workdir / "home").exists()


def test_a_stopped_daemon_is_reported_as_not_running(workdir):
    """Issue #37, item 10: a daemon that went away showed as "connection closed after 0 of
    24 bytes" (or a bare errno); the user is told the daemon is not running."""
    sock = workdir / "run" / "d.sock"
    daemon = spawn_daemon(workdir)
    os.kill(daemon.pid, signal.SIGSTOP)  # accepts nothing: a client waits in the listen queue
    failure: list[BaseException] = []

    def client() -> None:
        try:
            tierkv.connect(sock, timeout=60).close()
        except BaseException as e:  # noqa: BLE001 - inspected below
            failure.append(e)

    waiting = threading.Thread(target=client)
    waiting.start()
    time.sleep(1.0)  # connected (the listen queue takes it), its HELLO unanswered
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.wait(30)
    waiting.join(30)
    assert len(failure) == 1 and isinstance(failure[0], DaemonUnavailableError), failure
    assert re.fullmatch(rf"the daemon at {re.escape(str(sock))} is not running \(connection (reset|closed)\) "
                        r"\(hint: start it with `tierkv serve`, or check the --socket path\)",
                        failure[0].for_command_line()), failure[0].for_command_line()
    # The socket file a killed daemon left: the command says so, in one line.
    assert sock.exists()
    r = subprocess.run([sys.executable, "-m", "tierkv", "stats", "--socket", str(sock)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"Error: the daemon at {sock} is not running (connection refused: the socket was left by a daemon that "
        "stopped) (hint: start it with `tierkv serve`, or check the --socket path)"]
