"""The real-Mooncake scenarios, run in a child process inside a private network namespace
(``unshare -rn``, loopback only) by test_mooncake.py: one master, two nodes with separate
homes. Prints one JSON line last: {scenario: "ok" | "FAIL: ..."}, or {"_skip": reason}.

    unshare -rn sh -c 'ip link set lo up && python tests/cluster/mooncake_scenarios.py WORKDIR'
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # the transfer engine must never bind a LAN address
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tierkv  # noqa: E402
from cluster.kit import BS, LAYOUT, MV2, SCOPE, STORE_OPTIONS, pages_for, toks  # noqa: E402
from tierkv import Priority, Scope  # noqa: E402
from tierkv.cluster import ClusterNode, PublishPolicy, route  # noqa: E402
from tierkv.cluster.master import MasterProcess  # noqa: E402
from tierkv.identity import block_keys  # noqa: E402
from tierkv.cluster.remote import RemoteConfig, RemoteTier, mooncake_backend  # noqa: E402


def make_node(work: Path, name: str, master: MasterProcess, policy: PublishPolicy | None = None) -> ClusterNode:
    home = work / name
    store = tierkv.open(home, LAYOUT, shm_dir=work / f"shm-{name}", **STORE_OPTIONS)
    config = RemoteConfig(master_address=master.address, metadata_url=master.metadata_url,
                          global_segment_bytes=16 << 20, local_buffer_bytes=8 << 20, op_timeout_s=1.5,
                          setup_timeout_s=5.0, backoff_initial_s=0.2, backoff_max_s=1.0)
    return ClusterNode(store, RemoteTier(config, LAYOUT), policy)


def cross_node_hit(a: ClusterNode, b: ClusterNode, master: MasterProcess) -> None:
    t = toks(1, 6, extra=1)
    pages = pages_for(t)
    a.put(t, pages, SCOPE, priority=Priority.PINNED)
    assert a.remote.counters["published"] == 6, a.remote.stats()
    assert b.lookup(t, SCOPE).tiers == ("remote",) * 6
    with b.acquire(t, SCOPE) as lease:
        assert lease.num_blocks == 6
        assert torch.equal(lease.pages().cpu(), pages), "fetched bytes differ"
    assert b.store.lookup(t, SCOPE).tokens_matched == 6 * BS


def isolation(a: ClusterNode, b: ClusterNode, master: MasterProcess) -> None:
    t = toks(2, 3)
    a.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
    assert b.lookup(t, SCOPE).tokens_matched == 3 * BS
    for other in (Scope(SCOPE.model_version, "tenant-b"), Scope(MV2)):
        assert b.lookup(t, other).tokens_matched == 0
        with b.acquire(t, other) as lease:
            assert lease.num_blocks == 0


def corrupted_page(a: ClusterNode, b: ClusterNode, master: MasterProcess) -> None:
    t = toks(3, 3)
    a.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
    name = b.remote.name(block_keys(t, SCOPE, BS)[1])
    # A third client plays the vandal. It lends no memory: an object in its own segment
    # would vanish when it closes (unmount), and the test would see a miss, not corruption.
    raw = mooncake_backend(dataclasses.replace(b.remote.config, global_segment_bytes=0))
    try:
        blob = bytearray(raw.get_batch([name])[0])
        assert blob, "object missing before corruption"
        blob[-64:] = bytes(x ^ 0xFF for x in blob[-64:])
        assert raw.remove(name, True) == 0
        assert raw.put(name, bytes(blob)) == 0
    finally:
        raw.close()
    before = b.remote.faults["verify_failed"]
    with b.acquire(t, SCOPE) as lease:
        assert lease.num_blocks == 1, lease.num_blocks
    assert b.remote.faults["verify_failed"] == before + 1


def master_restart(a: ClusterNode, b: ClusterNode, master: MasterProcess) -> None:
    t, u = toks(4, 2), toks(5, 2)
    b.store.put(u, pages_for(u), SCOPE)
    a.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
    assert b.lookup(t, SCOPE).tokens_matched == 2 * BS
    master.kill()
    t0 = time.monotonic()
    assert b.lookup(t, SCOPE).tokens_matched == 0
    with b.acquire(u, SCOPE) as lease:  # local blocks keep being served
        assert lease.num_blocks == 2
    a.put(toks(6, 1), pages_for(toks(6, 1)), SCOPE, priority=Priority.PINNED)  # publish fails quietly
    assert time.monotonic() - t0 < 10, "a dead master stalled requests"
    assert not b.remote.up and sum(b.remote.faults.values()) >= 1, b.remote.stats()
    master.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        a.publish_prefix(t, SCOPE)  # a restarted master lost every object: republish
        if b.lookup(t, SCOPE).tokens_matched == 2 * BS:
            break
        time.sleep(0.3)
    assert b.lookup(t, SCOPE).tokens_matched == 2 * BS, (a.remote.stats(), b.remote.stats())
    assert b.remote.up and b.remote.counters["reconnects"] >= 1


def routing(a: ClusterNode, b: ClusterNode, master: MasterProcess) -> None:
    t = toks(7, 4)
    a.store.put(t, pages_for(t), SCOPE)  # normal put: stays local by default
    res = route(t, {"b": b, "a": a}, SCOPE)
    assert res.per_node == {"b": 0, "a": 4 * BS} and res.best_node == "a", res
    a.set_priority(t, SCOPE, Priority.PINNED)  # pinning publishes
    res = route(t, {"b": b, "a": a}, SCOPE)
    assert res.per_node == {"b": 4 * BS, "a": 4 * BS} and res.best_node == "b", res


def master_paused(a: ClusterNode, b: ClusterNode, master: MasterProcess) -> None:
    """A master that stops answering (SIGSTOP) is a slow master: calls hit their deadline,
    the node serves locally, and comes back once the master does."""
    t = toks(8, 2)
    a.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
    assert b.lookup(t, SCOPE).tokens_matched == 2 * BS
    assert master.proc is not None
    master.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert b.lookup(t, SCOPE).tokens_matched == 0
        assert b.lookup(t, SCOPE).tokens_matched == 0  # down: answered without waiting
        assert time.monotonic() - t0 < 2 * b.remote.config.op_timeout_s + 1, "a stalled master stalled requests"
        assert b.remote.faults["timeout"] + b.remote.faults["unreachable"] >= 1, b.remote.stats()
    finally:
        master.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and b.lookup(t, SCOPE).tokens_matched != 2 * BS:
        time.sleep(0.3)
    assert b.lookup(t, SCOPE).tokens_matched == 2 * BS, b.remote.stats()


def no_master(a: ClusterNode, b: ClusterNode, master: MasterProcess) -> None:
    """A node whose master is not there (setup fails) works as a local store."""
    from tierkv.cluster.master import free_port

    work = Path(a.store.config.home).parent
    config = dataclasses.replace(b.remote.config, master_address=f"127.0.0.1:{free_port()}",
                                 metadata_url=f"http://127.0.0.1:{free_port()}/metadata")
    store = tierkv.open(work / "lonely", LAYOUT, shm_dir=work / "shm-lonely", **STORE_OPTIONS)
    c = ClusterNode(store, RemoteTier(config, LAYOUT))
    try:
        t = toks(9, 2)
        t0 = time.monotonic()
        c.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
        with c.acquire(t, SCOPE) as lease:
            assert lease.num_blocks == 2
        assert time.monotonic() - t0 < config.setup_timeout_s + 2
        assert c.remote is not None and not c.remote.up
        assert c.remote.faults["setup_failed"] + c.remote.faults["setup_timeout"] >= 1, c.remote.stats()
        c.check_integrity()
    finally:
        c.close()


SCENARIOS = [cross_node_hit, isolation, corrupted_page, routing, no_master, master_paused, master_restart]


def main(work: Path) -> dict[str, str]:
    """Every scenario on the same two nodes (each uses its own token ids); closing a node
    takes seconds (Mooncake unmounts its segment), so they are opened once."""
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
        a, b = make_node(work, "a", master), make_node(work, "b", master)
        try:
            for fn in SCENARIOS:
                t0 = time.monotonic()
                try:
                    fn(a, b, master)
                    a.check_integrity()
                    b.check_integrity()
                    results[fn.__name__] = "ok"
                except Exception:  # noqa: BLE001
                    results[fn.__name__] = "FAIL: " + traceback.format_exc(limit=4)
                print(f"{fn.__name__}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        finally:
            closer = threading.Thread(target=a.close)  # each close takes seconds: side by side
            closer.start()
            b.close()
            closer.join()
    finally:
        master.stop()
    return results


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))), flush=True)
