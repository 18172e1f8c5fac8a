"""Two ``tierkv serve`` daemons (separate homes, subprocesses, started with the CLI's remote
flags) and one real Mooncake master, inside a private network namespace (``unshare -rn``,
loopback only); run by test_daemon_remote.py. Prints one JSON line last:
{step: "ok" | "FAIL: ..."} or {"_skip": reason}.

    unshare -rn sh -c 'ip link set lo up && python tests/cluster/daemon_scenarios.py WORKDIR'
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import tierkv  # noqa: E402
from cluster.kit import BS, LAYOUT, SCOPE, pages_for, toks  # noqa: E402
from tierkv import Priority  # noqa: E402
from tierkv.cli import main as cli_main  # noqa: E402
from tierkv.cluster.master import MasterProcess  # noqa: E402
from tierkv.daemon.security import socket_is_live  # noqa: E402

LAYOUT_ARG = ",".join(f"{k}={v}" for k, v in LAYOUT.to_dict().items() if k in
                      ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def wait_for(pred, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def spawn(work: Path, name: str, master: MasterProcess) -> tuple[subprocess.Popen, Path]:
    sock = work / "run" / f"{name}.sock"
    env = {k: v for k, v in os.environ.items() if k != "MC_TCP_BIND_ADDRESS"}  # the daemon sets it
    cmd = [sys.executable, "-m", "tierkv", "serve", "--home", str(work / name), "--socket", str(sock),
           "--layout", LAYOUT_ARG, "--device", "cpu", "--device-bytes", str(16 * LAYOUT.page_bytes),
           "--host-bytes", str(8 * LAYOUT.slot_bytes), "--disk-bytes", str(64 * LAYOUT.slot_bytes),
           "--staging-bytes", "256KiB", "--shm-dir", str(work / f"shm-{name}"), "--log-level", "INFO",
           "--remote-master", master.address, "--remote-metadata-url", master.metadata_url,
           "--remote-segment-bytes", "16MiB", "--remote-buffer-bytes", "8MiB", "--remote-op-timeout", "1.5",
           "--remote-backoff-max", "1.0"]
    out = open(work / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, sock


def remote_state(client) -> dict:
    return client.stats()["tiers"]["remote"]


def run(work: Path, master: MasterProcess, results: dict[str, str]) -> None:
    (work / "run").mkdir(mode=0o700, exist_ok=True)
    pa, sa = spawn(work, "a", master)
    pb, sb = spawn(work, "b", master)
    procs = [pa, pb]
    try:
        for p, s in ((pa, sa), (pb, sb)):
            if not wait_for(lambda: p.poll() is not None or (s.exists() and socket_is_live(s)), 60):
                raise RuntimeError(f"daemon {s} did not start")
            if p.poll() is not None:
                raise RuntimeError(f"daemon {s} exited {p.returncode}")
        ca, cb = tierkv.connect(sa), tierkv.connect(sb)
        t, u = toks(11, 5, extra=2), toks(12, 3)

        def step(name, fn):
            t0 = time.monotonic()
            try:
                fn()
                results[name] = "ok"
            except Exception:  # noqa: BLE001
                results[name] = "FAIL: " + traceback.format_exc(limit=5)
            log(f"{name}: {time.monotonic() - t0:.1f} s")

        def joined():
            assert wait_for(lambda: remote_state(ca)["state"] == "up" and remote_state(cb)["state"] == "up", 20), \
                (remote_state(ca), remote_state(cb))

        def cross_daemon_hit():
            ca.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
            assert remote_state(ca)["published"] == 5, remote_state(ca)
            assert cb.lookup(t, SCOPE).tiers == ("remote",) * 5

        def route_over_sockets():
            ca.put(u, pages_for(u), SCOPE)  # normal put: A only
            tf = work / "req.json"
            tf.write_text(json.dumps([int(x) for x in t]))
            r = CliRunner().invoke(cli_main, ["route", "--node", str(sb), "--node", str(sa), "--tokens-file",
                                                     str(tf), "--model-version", SCOPE.model_version, "--namespace",
                                                     SCOPE.namespace, "--json"])
            assert r.exit_code == 0, r.output
            out = json.loads(r.output.strip().splitlines()[-1])
            assert out["per_node"] == {str(sb): 5 * BS, str(sa): 5 * BS} and out["best_node"] == str(sb), out
            assert out["tiers"][str(sb)] == {"remote": 5}, out

        def acquire_identical_pages():
            with cb.acquire(t, SCOPE) as lease:
                assert lease.num_blocks == 5
                assert torch.equal(lease.pages().cpu(), pages_for(t)), "fetched bytes differ"
            assert cb.lookup(t, SCOPE).tiers == ("device",) * 5
            r = remote_state(cb)
            assert r["hits"] == 5 and r["fetched_bytes"] > 5 * LAYOUT.page_bytes and r["verify_failures"] == 0, r

        def master_restart():
            w = toks(13, 2)
            ca.put(w, pages_for(w), SCOPE, priority=Priority.PINNED)
            assert cb.lookup(w, SCOPE).tokens_matched == 2 * BS
            master.kill()
            t0 = time.monotonic()
            assert cb.lookup(w, SCOPE).tokens_matched == 0  # the remote tier is gone: local only
            with cb.acquire(t, SCOPE) as lease:  # pulled earlier: still served locally
                assert lease.num_blocks == 5 and torch.equal(lease.pages().cpu(), pages_for(t))
            assert time.monotonic() - t0 < 10, "a dead master stalled requests"
            r = remote_state(cb)
            assert r["state"] == "degraded" and r["degraded_reason"], r
            master.start()
            # The keeper reconnects on its own; A republishes what its policy publishes.
            assert wait_for(lambda: remote_state(cb)["state"] == "up", 30), remote_state(cb)
            assert wait_for(lambda: remote_state(ca)["state"] == "up", 30), remote_state(ca)
            assert remote_state(cb)["reconnects"] >= 1, remote_state(cb)

            def republished() -> bool:
                # A restarted master lost every object, and takes puts again only once the
                # nodes' segments are mounted anew: pin again (publishes) until B sees it.
                ca.set_priority(w, SCOPE, Priority.PINNED)
                return cb.lookup(w, SCOPE).tokens_matched == 2 * BS

            assert wait_for(republished, 30, interval=0.3), (remote_state(ca), remote_state(cb))
            with cb.acquire(w, SCOPE) as lease:
                assert torch.equal(lease.pages().cpu(), pages_for(w))

        step("joined", joined)
        step("cross_daemon_hit", cross_daemon_hit)
        step("route_over_sockets", route_over_sockets)
        step("acquire_identical_pages", acquire_identical_pages)
        step("master_restart", master_restart)
        ca.close()
        cb.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                rc = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            results.setdefault("clean_stop", "ok")
            if rc != 0:
                results["clean_stop"] = f"FAIL: a daemon exited {rc}"
        for name in ("a", "b"):
            for s in (work / "run" / f"{name}.sock",):
                if s.exists():
                    results["clean_stop"] = f"FAIL: {s} left behind"
        if any(v != "ok" for v in results.values()):
            for name in ("a", "b"):
                p = work / f"{name}.log"
                if p.exists():
                    log(f"---- daemon {name} log (tail) ----\n" + p.read_text(errors="replace")[-3000:])


def main(work: Path) -> dict[str, str]:
    results: dict[str, str] = {}
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as e:
        return {"_skip": f"mooncake is not importable: {e}"}
    try:
        master = MasterProcess(log_path=work / "master.log").start()
    except Exception as e:  # noqa: BLE001
        return {"_skip": f"mooncake master did not start: {e}"}
    try:
        run(work, master, results)
    except Exception:  # noqa: BLE001
        results["setup"] = "FAIL: " + traceback.format_exc(limit=5)
    finally:
        master.stop()
    return results


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))), flush=True)
