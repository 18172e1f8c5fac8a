"""Benchmark the daemon against the embedded store.

    python scripts/bench_daemon.py --clients 32 --seconds 10 --runs 3 --json

1. Iterations: one iteration = ``acquire`` of a 4,096-token prompt (all cached: the longest
   cached prefix, leased; a miss would be an empty lease) + ``release``. The daemon's
   ``acquire`` is one round trip (lookup and lease in one request, the prompt hashed once,
   token ids compared with the stored ones) and ``release`` is one write with no reply.
   N client processes loop against one daemon (started with only --home and --socket: the
   clients declare the layout), then N threads against an embedded store in one process;
   then 1 client against each. ``--runs`` rounds, interleaved; medians and the paired
   ratios daemon/embedded are reported. Latency: one whole iteration, client side.
   With ``--rate R`` the N clients also offer R iterations/s in all (open loop: Poisson
   arrivals, each iteration's latency counted from when it was due, so time spent queued
   behind a slow one counts). A closed loop of N clients at X iterations/s has a mean
   latency of N / X by Little's law whatever the daemon does; the open loop says what
   latency a given load gets.
2. Writes (``--puts N``): one client stores N distinct prompts of ``--tokens`` tokens (4 KiB
   pages of 16 tokens, memory tier only, so no fsync: the daemon's own cost per block)
   through a daemon, then N more into an embedded store, ``--runs`` rounds alternated;
   per-put latency, blocks/s, and the daemon's garbage-collector pauses (its ``stats``).
3. Shared-memory reads: a client leases a 256 MiB prefix (256 pages of 1 MiB) and copies it
   out with ``lease.pages()`` (reading the daemon's device tier in place through shm),
   against a plain memcpy of 256 MiB in the same process (``np.copyto`` into a fresh array,
   so both sides pay the same first-touch page faults of a new destination).
   ``shm_read_ratio_vs_memcpy`` = memcpy time / shm read time (1.0: as fast as memcpy).

With ``--json`` the last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

MV = "ab" * 32
SMALL = "num_layers=2,num_kv_heads=2,head_dim=64,block_size=16,dtype=float16"  # 16 KiB pages
BIG = "num_layers=16,num_kv_heads=8,head_dim=128,block_size=16,dtype=float16"  # 1 MiB pages
PUT = "num_layers=1,num_kv_heads=1,head_dim=64,block_size=16,dtype=float16"  # 4 KiB pages

CLIENT = """
import json, sys, time, numpy as np, tierkv
from tierkv import Scope
from tierkv.daemon.config import parse_layout
c = tierkv.connect(sys.argv[1], layout=parse_layout({layout!r}))
scope = Scope({mv!r}, "bench")
prompts = [np.random.default_rng(i).integers(0, 30000, {tokens}).astype(np.int32) for i in range({n_prompts})]
print("ready", flush=True)
i = int(sys.argv[2])
rng = np.random.default_rng(1000 + i)
for line in sys.stdin:  # one measurement per line ("seconds [rate]"); EOF ends the client
    seconds, *rate = map(float, line.split())
    lat, n = [], 0
    end = time.perf_counter() + seconds
    due = time.perf_counter()
    while time.perf_counter() < end:
        if rate:  # open loop: Poisson arrivals at this client's rate; latency from when due
            due += rng.exponential(1.0 / rate[0])
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        toks = prompts[i % len(prompts)]; i += 1
        t0 = due if rate else time.perf_counter()
        lease = c.acquire(toks, scope)
        assert lease.tokens_matched == len(toks)
        lease.release()
        lat.append(time.perf_counter() - t0)
        n += 1
    print(json.dumps({{"n": n, "lat": lat}}), flush=True)
c.close()
"""


def prompts(n: int, tokens: int) -> list[np.ndarray]:
    return [np.random.default_rng(i).integers(0, 30000, tokens).astype(np.int32) for i in range(n)]


def start_daemon(work: Path, name: str, *sizes: str) -> tuple[subprocess.Popen, Path]:
    sock = work / f"run-{name}" / "d.sock"
    cmd = [sys.executable, "-c", "from tierkv.cli import main; main()", "serve", "--home", str(work / f"home-{name}"),
           "--socket", str(sock), "--device", "cpu", "--max-layouts", "1", "--log-level", "WARNING", *sizes]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 120
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"daemon did not start (rc {proc.poll()})")
        time.sleep(0.05)
    return proc, sock


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


def populate(store, layout, n_prompts: int, tokens: int) -> None:
    from tierkv import Scope

    scope = Scope(MV, "bench")
    n_blocks = tokens // layout.block_size
    for i, toks in enumerate(prompts(n_prompts, tokens)):
        pages = torch.full((n_blocks, *layout.shape), float(i), dtype=layout.torch_dtype)
        store.put(toks, pages, scope)


def _summary(prefix: str, n: int, wall: float, lat_s: list[float]) -> dict:
    lat = np.array(lat_s) * 1000
    return {f"{prefix}iterations_per_s": n / wall, f"{prefix}p50_ms": float(np.percentile(lat, 50)),
            f"{prefix}p99_ms": float(np.percentile(lat, 99))}


def start_clients(sock: Path, args: argparse.Namespace) -> list[subprocess.Popen]:
    """The client processes, started once (importing torch 32 times takes long on 2 cores)
    and reused for every measurement."""
    code = CLIENT.format(mv=MV, tokens=args.tokens, n_prompts=args.prompts, layout=SMALL)
    kids = [subprocess.Popen([sys.executable, "-c", code, str(sock), str(i)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for i in range(args.clients)]
    for k in kids:
        assert k.stdout.readline().strip() == "ready"
    return kids


def stop_clients(kids: list[subprocess.Popen]) -> None:
    for k in kids:
        k.stdin.close()
    for k in kids:
        try:
            k.wait(120)
        except subprocess.TimeoutExpired:
            k.kill()


def bench_daemon(kids: list[subprocess.Popen], args: argparse.Namespace, rate: float | None = None) -> dict:
    """Closed loop (each client's next iteration as soon as its last ends), or with
    ``rate`` open loop: that many iterations/s offered in all, Poisson arrivals per client,
    latency counted from each iteration's due time (so a backlog shows in it)."""
    t0 = time.perf_counter()
    per_client = "" if rate is None else f" {rate / len(kids)}"
    for k in kids:
        k.stdin.write(f"{args.seconds}{per_client}\n")
        k.stdin.flush()
    results = [json.loads(k.stdout.readline()) for k in kids]
    wall = time.perf_counter() - t0
    return _summary("", sum(r["n"] for r in results), wall, [x for r in results for x in r["lat"]])


def bench_embedded(store, args: argparse.Namespace, threads: int) -> dict:
    from tierkv import Scope

    scope = Scope(MV, "bench")
    counts = [0] * threads
    lats: list[list[float]] = [[] for _ in range(threads)]
    ps = prompts(args.prompts, args.tokens)
    end = time.perf_counter() + args.seconds

    def worker(j: int) -> None:
        i = j
        while time.perf_counter() < end:
            toks = ps[i % len(ps)]
            i += 1
            t0 = time.perf_counter()
            lease = store.acquire(toks, scope)
            assert lease.tokens_matched == len(toks)
            lease.release()
            lats[j].append(time.perf_counter() - t0)
            counts[j] += 1

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(j,)) for j in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return _summary("", sum(counts), time.perf_counter() - t0, [x for ls in lats for x in ls])


def bench_iterations(work: Path, args: argparse.Namespace) -> dict:
    """``--runs`` rounds of: daemon with N clients, embedded with N threads, daemon with 1
    client, embedded with 1 thread (interleaved, so load from elsewhere hits all four)."""
    import tierkv
    from tierkv.daemon.config import parse_layout

    layout = parse_layout(SMALL)
    sizes = ("--device-bytes", "96MiB", "--host-bytes", "32MiB", "--disk-bytes", "256MiB")
    if args.workers is not None:
        sizes += ("--workers", str(args.workers))
    proc, sock = start_daemon(work, "lookup", *sizes)
    store = tierkv.open(work / "home-embedded", layout, device="cpu", device_bytes=96 << 20, host_bytes=32 << 20,
                        disk_bytes=256 << 20)
    rounds: list[dict] = []
    kids: list[subprocess.Popen] = []
    try:
        with tierkv.connect(sock, layout=layout) as c:
            populate(c, layout, args.prompts, args.tokens)
        populate(store, layout, args.prompts, args.tokens)
        kids = start_clients(sock, args)
        for run in range(args.runs):
            r = {}
            for n, tag in ((args.clients, "n"), (1, "1")):
                r.update({f"daemon_{tag}_{k}": v for k, v in bench_daemon(kids[:n], args).items()})
                r.update({f"embedded_{tag}_{k}": v for k, v in bench_embedded(store, args, n).items()})
            for rate in args.rate or ():
                r.update({f"daemon_n_at_{rate:g}_{k}": v for k, v in bench_daemon(kids, args, rate).items()})
            print(f"round {run + 1}: {json.dumps(r)}", file=sys.stderr, flush=True)
            r["ratio_n_iterations"] = r["daemon_n_iterations_per_s"] / r["embedded_n_iterations_per_s"]
            r["ratio_1_latency_p50"] = r["daemon_1_p50_ms"] / r["embedded_1_p50_ms"]
            rounds.append(r)
    finally:
        stop_clients(kids)
        store.close()
        stop_daemon(proc)
    out = {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}
    out["rounds"] = rounds
    return out


def bench_puts(work: Path, args: argparse.Namespace) -> dict:
    """Rounds of: ``--puts`` puts of new prompts through the daemon, then as many into an
    embedded store (same process as the client, same layout and tier sizes)."""
    import tierkv
    from tierkv import Scope
    from tierkv.daemon.config import parse_layout

    layout = parse_layout(PUT)
    proc, sock = start_daemon(work, "puts", "--device-bytes", "256MiB", "--host-bytes", "0", "--disk-bytes", "0")
    store = tierkv.open(work / "home-puts-embedded", layout, device="cpu", device_bytes=256 << 20, host_bytes=0,
                        disk_bytes=0)
    scope = Scope(MV, "bench")
    pages = torch.zeros((args.tokens // layout.block_size, *layout.shape), dtype=layout.torch_dtype)
    lat: dict[str, list[float]] = {"daemon": [], "embedded": []}
    spent = {"daemon": 0.0, "embedded": 0.0}
    seed = 10_000
    try:
        with tierkv.connect(sock, layout=layout) as c:
            for _ in range(args.runs):
                for name, target in (("daemon", c), ("embedded", store)):
                    for _ in range(args.puts):
                        toks = np.random.default_rng(seed).integers(0, 30000, args.tokens).astype(np.int32)
                        seed += 1
                        t0 = time.perf_counter()
                        target.put(toks, pages, scope)
                        lat[name].append(time.perf_counter() - t0)
                        spent[name] += lat[name][-1]
            gc_stats = c.stats()["daemon"].get("gc", {})  # absent from daemons before gc_pauses.py
    finally:
        store.close()
        stop_daemon(proc)
    out: dict = {"put_tokens": args.tokens, "put_blocks": pages.shape[0], "daemon_gc": gc_stats}
    for name, ls in lat.items():
        a = np.array(ls) * 1000
        out.update({f"{name}_put_p50_ms": float(np.percentile(a, 50)), f"{name}_put_p99_ms": float(np.percentile(a, 99)),
                    f"{name}_put_max_ms": float(a.max()), f"{name}_put_blocks_per_s": len(ls) * pages.shape[0] / spent[name]})
    out["ratio_put_p50"] = out["daemon_put_p50_ms"] / out["embedded_put_p50_ms"]
    return out


def bench_shm_read(work: Path, args: argparse.Namespace) -> dict:
    import tierkv
    from tierkv import Scope

    from tierkv.daemon.config import parse_layout

    proc, sock = start_daemon(work, "shm", "--device-bytes", "264MiB", "--host-bytes", "0", "--disk-bytes", "0")
    try:
        with tierkv.connect(sock, layout=parse_layout(BIG)) as c:
            populate(c, c.layout, 1, 4096)
            scope = Scope(MV, "bench")
            with c.acquire(prompts(1, 4096)[0], scope) as lease:
                nbytes = lease.num_blocks * c.layout.page_bytes
                shm = min(_timed(lease.pages) for _ in range(args.repeats))
            src = np.ones(nbytes, dtype=np.uint8)
            mem = min(_timed(lambda: np.copyto(np.empty_like(src), src)) for _ in range(args.repeats))
    finally:
        stop_daemon(proc)
    return {"shm_read_ratio_vs_memcpy": mem / shm, "shm_read_gbps": nbytes / shm / 1e9, "memcpy_gbps": nbytes / mem / 1e9,
            "shm_read_bytes": nbytes}


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each measurement")
    p.add_argument("--runs", type=int, default=3, help="rounds (medians reported)")
    p.add_argument("--no-shm", action="store_true", help="skip the shared-memory read benchmark")
    p.add_argument("--workers", type=int, default=None, help="the daemon's store-call threads (default: its own)")
    p.add_argument("--tokens", type=int, default=4096, help="prompt length")
    p.add_argument("--prompts", type=int, default=8, help="distinct cached prompts")
    p.add_argument("--repeats", type=int, default=5, help="repeats of the 256 MiB read (best kept)")
    p.add_argument("--puts", type=int, default=0, help="also measure writes: this many puts per round and side")
    p.add_argument("--no-iterations", action="store_true", help="skip the acquire/release iterations")
    p.add_argument("--rate", type=float, action="append",
                   help="also offer this many iterations/s in all from the N clients (open loop, Poisson "
                        "arrivals; p99 from each iteration's due time); repeat for several rates")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvb-"))
    try:
        out = {"clients": args.clients, "seconds": args.seconds, "prompt_tokens": args.tokens, "cpus": os.cpu_count()}
        if not args.no_iterations:
            out.update(bench_iterations(work, args))
        if args.puts:
            out.update(bench_puts(work, args))
        if not args.no_shm:
            out.update(bench_shm_read(work, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if k not in ("rounds", "daemon_gc"):
                print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")


if __name__ == "__main__":
    main()
