#!/usr/bin/env python3
"""The GPU half's data paths, each against the plain way a user would move the same bytes.

    python scripts/bench_gpu_io.py --json            # on a machine with an NVIDIA GPU
    python scripts/bench_gpu_io.py --small --json    # rehearsal: 64 MiB; CPU-only parts skip

1. **Disk to device pool** (``disk_*``): ``--gib`` of 1 MiB bf16 pages put into a store whose
   device tier is on CUDA, the store closed, the segment files dropped from the page cache,
   then a cold ``acquire`` promotes every page into the device pool (read, checksummed,
   placed). In a fresh process per read path, alternated, ``--runs`` rounds: kvikio as it
   comes (GPUDirect Storage where the driver and file system allow, else its compat mode),
   kvikio with ``KVIKIO_COMPAT_MODE=ON``, and POSIX (kvikio hidden). Beside them ``dd
   iflag=direct`` of the same segment files to /dev/null and kvikio reading the whole files
   into one CUDA buffer (``kvikio_raw``: the most any kvikio path can do here). Bytes checked
   against what was put.
2. **Pinned host to device** (``h2d_*``): the store's host tier (shared memory, page-locked
   with cudaHostRegister) copied into its device pool, against ``copy_`` from
   ``torch.empty(pin_memory=True)`` and from pageable memory; and a store-level promotion of
   blocks that only the host tier holds (``set_tier_limits(device_bytes=0)`` first).
3. **CUDA IPC** (``ipc_*``): a daemon (``tierkv serve --device cuda:0``, its own process)
   and a client process: the client puts a prefix, leases it and reads ``lease.pages()``
   from the daemon's device pool through the CUDA IPC handle (no host copy: the pool tensor
   is on CUDA in the client), bytes compared on the GPU; against a device-to-device
   ``copy_`` of the same size in the client.

Medians per figure; GB/s are 1e9 bytes per second. The last line with ``--json`` is one
JSON object. Without CUDA, parts 1 (POSIX path and dd only) and 2 (pageable copies only)
run as a rehearsal of the script itself.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# 16 layers x 2 x 16 tokens x 8 KV heads x 128 dims in bf16: 1 MiB pages.
LAYOUT_ARGS = dict(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
SCOPE_HEX = "5e" * 32
CUDA = torch.cuda.is_available()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def layout() -> Any:
    from tierkv import PageLayout

    return PageLayout(**LAYOUT_ARGS)


def pages_for(n: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(-(2**15), 2**15, (n, layout().numel), dtype=torch.int16, device=device, generator=g)
    return raw.view(torch.bfloat16).view(n, *layout().shape)


def store_opts(n: int, device: str) -> dict[str, Any]:
    lay = layout()
    return dict(device=device, device_bytes=(n + 8) * lay.page_bytes, host_bytes=(n + 8) * lay.slot_bytes,
                disk_bytes=2 * (n + 8) * lay.slot_bytes, segment_pages=256)


def segments(home: Path) -> list[Path]:
    return [p for p in sorted((home / "segments").glob("*")) if p.is_file()]


# ---- 1. disk to device pool ------------------------------------------------------------------
def child_read(home: Path, n: int, runs: int, device: str) -> dict[str, Any]:
    """In a fresh process (the read path is chosen at open): ``runs`` cold promotions."""
    import tierkv
    from tierkv import Scope
    from tierkv.tiers.diskio import drop_page_cache

    tokens = np.arange(n * 16, dtype=np.int64)
    expected = pages_for(n, 0, device).view(torch.int16)
    out: dict[str, Any] = {"times": []}
    for _ in range(runs):
        drop_page_cache(segments(home))
        with tierkv.open(home, layout(), **store_opts(n, device)) as store:
            out["path"] = store.stats()["disk_read_path"]
            sync()
            t0 = time.perf_counter()
            with store.acquire(tokens, Scope(SCOPE_HEX)) as lease:
                sync()
                out["times"].append(time.perf_counter() - t0)
                out["blocks"] = lease.num_blocks
                out["bytes_equal"] = bool(torch.equal(lease.pages().view(torch.int16), expected))
            out["quarantined"] = store.stats()["quarantined"]
            store.check_integrity()
    if CUDA and out["path"].startswith("kvikio"):
        import kvikio  # type: ignore[import-not-found]

        raw = []
        total = sum(p.stat().st_size for p in segments(home))
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        for _ in range(runs):
            drop_page_cache(segments(home))
            t0 = time.perf_counter()
            off = 0
            futures = []
            for p in segments(home):
                size = p.stat().st_size
                f = kvikio.CuFile(str(p), "r")
                futures.append((f, f.pread(buf[off: off + size], size, 0)))
                off += size
            for f, fut in futures:
                fut.get()
                f.close()
            sync()
            raw.append(time.perf_counter() - t0)
        out["raw_times"] = raw
        out["raw_bytes"] = total
    return out


def run_child(mode: str, home: Path, n: int, runs: int, device: str) -> dict[str, Any]:
    env = dict(os.environ)
    code = ["import sys, json; sys.path.insert(0, %r)" % str(Path(__file__).parent)]
    if mode == "posix":
        code.append("sys.modules['kvikio'] = None")  # import kvikio then fails: the POSIX path
    if mode == "kvikio-compat":
        env["KVIKIO_COMPAT_MODE"] = "ON"
    code.append("import bench_gpu_io as b; from pathlib import Path")
    code.append(f"print(json.dumps(b.child_read(Path({str(home)!r}), {n}, {runs}, {device!r})))")
    r = subprocess.run([sys.executable, "-c", "\n".join(code)], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"read child ({mode}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def dd_read(files: list[Path]) -> float:
    from tierkv.tiers.diskio import drop_page_cache

    drop_page_cache(files)
    t0 = time.perf_counter()
    for p in files:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=4M", "iflag=direct"], check=True, capture_output=True)
    return time.perf_counter() - t0


def bench_disk(work: Path, n: int, runs: int, device: str) -> dict[str, Any]:
    import tierkv
    from tierkv import Scope

    home = work / "home-disk"
    lay = layout()
    pages = pages_for(n, 0, device)
    with tierkv.open(home, lay, **store_opts(n, device)) as store:
        sync()
        t0 = time.perf_counter()
        assert store.put(np.arange(n * 16, dtype=np.int64), pages, Scope(SCOPE_HEX)).durable
        put_s = time.perf_counter() - t0
    del pages
    log(f"  put {n} pages: {n * lay.page_bytes / put_s / 1e9:.2f} GB/s")
    files = segments(home)
    nbytes = n * lay.page_bytes
    modes = ["kvikio", "kvikio-compat", "posix"] if CUDA else ["posix"]
    res: dict[str, Any] = {"disk_bytes": nbytes, "disk_put_gbps": nbytes / put_s / 1e9}
    times: dict[str, list[float]] = {m: [] for m in ["dd", *modes]}
    for rnd in range(runs):  # one process per path per round, dd between: alternated
        for m in (modes if rnd % 2 == 0 else modes[::-1]):
            times["dd"].append(dd_read(files))
            got = run_child(m, home, n, 1, device)
            log(f"  round {rnd + 1} {m}: {nbytes / got['times'][-1] / 1e9:.2f} GB/s ({got['path']}), "
                f"dd {nbytes / times['dd'][-1] / 1e9:.2f} GB/s"
                + (f", kvikio raw {got['raw_bytes'] / got['raw_times'][-1] / 1e9:.2f} GB/s" if "raw_times" in got else ""))
            times[m] += got["times"]
            res[f"disk_path_{m}"] = got["path"]
            res[f"disk_bytes_equal_{m}"] = got["bytes_equal"] and got["blocks"] == n and got["quarantined"] == 0
            if "raw_times" in got:
                times.setdefault("kvikio_raw", []).extend(got["raw_times"])
    for m, ts in times.items():
        b = res.get("raw_bytes", nbytes) if m == "kvikio_raw" else nbytes
        res[f"disk_{m.replace('-', '_')}_gbps"] = b / statistics.median(ts) / 1e9
    dd = res["disk_dd_gbps"]
    for m in modes:
        res[f"disk_{m.replace('-', '_')}_ratio_vs_dd"] = res[f"disk_{m.replace('-', '_')}_gbps"] / dd
    return res


# ---- 2. pinned host to device ----------------------------------------------------------------
def timed_copy(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_h2d(work: Path, n: int, runs: int, device: str) -> dict[str, Any]:
    import tierkv
    from tierkv import Scope

    lay = layout()
    nbytes = n * lay.page_bytes
    res: dict[str, Any] = {"h2d_bytes": nbytes}
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    res["h2d_pageable_gbps"] = nbytes / timed_copy(dst, pageable, runs) / 1e9
    if not CUDA:
        return res
    pinned = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    res["h2d_torch_pinned_gbps"] = nbytes / timed_copy(dst, pinned, runs) / 1e9
    tokens = np.arange(n * 16, dtype=np.int64)
    pages = pages_for(n, 3, device)
    with tierkv.open(work / "home-h2d", lay, **store_opts(n, device)) as store:
        res["h2d_host_tier_pinned"] = bool(store.host.pinned)
        store.put(tokens, pages, Scope(SCOPE_HEX))
        host = store.host.region.bytes  # the host tier's whole mapping, as uint8
        src = host[: min(nbytes, host.numel())]
        res["h2d_host_tier_gbps"] = src.numel() / timed_copy(dst[: src.numel()], src, runs) / 1e9
        ts = []
        for _ in range(runs):
            store.set_tier_limits(device_bytes=0)  # the host tier alone holds the pages now
            store.set_tier_limits(device_bytes=(n + 8) * lay.page_bytes)
            sync()
            t0 = time.perf_counter()
            with store.acquire(tokens, Scope(SCOPE_HEX)) as lease:
                sync()
                ts.append(time.perf_counter() - t0)
                ok = lease.num_blocks == n and torch.equal(lease.pages().view(torch.int16), pages.view(torch.int16))
            res["h2d_promote_bytes_equal"] = bool(ok)
        res["h2d_promote_gbps"] = nbytes / statistics.median(ts) / 1e9
        res["h2d_promote_vs_torch_pinned"] = res["h2d_promote_gbps"] / res["h2d_torch_pinned_gbps"]
        store.check_integrity()
    return res


# ---- 3. CUDA IPC -----------------------------------------------------------------------------
def child_ipc(sock: Path, n: int, runs: int) -> dict[str, Any]:
    import tierkv
    from tierkv import Scope

    lay = layout()
    tokens = np.arange(n * 16, dtype=np.int64) + 7
    pages = pages_for(n, 5, "cuda")
    with tierkv.connect(sock, layout=lay) as c:
        out: dict[str, Any] = {"pool_is_cuda": bool(c.device_pool.is_cuda)}
        c.put(tokens, pages, Scope(SCOPE_HEX))
        dst = torch.empty_like(pages)
        with c.acquire(tokens, Scope(SCOPE_HEX)) as lease:
            out["blocks"] = lease.num_blocks
            got = lease.pages()
            sync()
            out["lease_pages_on_cuda"] = bool(got.is_cuda)
            out["bytes_equal"] = bool(torch.equal(got.view(torch.int16), pages.view(torch.int16)))
            ts = []
            for _ in range(runs):
                sync()
                t0 = time.perf_counter()
                lease.pages()
                sync()
                ts.append(time.perf_counter() - t0)
            out["read_s"] = statistics.median(ts)
        out["d2d_s"] = timed_copy(dst, pages, runs)
        out["bytes"] = n * lay.page_bytes
    return out


def bench_ipc(work: Path, n: int, runs: int) -> dict[str, Any]:
    lay = layout()
    sock = work / "ipc" / "d.sock"
    sock.parent.mkdir(mode=0o700)  # the daemon refuses a socket directory others can enter
    budget = f"{(n + 8) * lay.slot_bytes}"
    cmd = [sys.executable, "-c", "from tierkv.cli import main; main()", "serve", "--home", str(work / "home-ipc"),
           "--socket", str(sock), "--device", "cuda:0", "--device-bytes", budget, "--host-bytes", budget,
           "--disk-bytes", str(2 * int(budget)), "--max-layouts", "1", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start (rc {proc.poll()})")
            time.sleep(0.05)
        code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_gpu_io as b; "
                f"from pathlib import Path; print(json.dumps(b.child_ipc(Path({str(sock)!r}), {n}, {runs})))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"IPC client failed:\n{r.stderr[-3000:]}")
        got = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"ipc_pool_is_cuda": got["pool_is_cuda"], "ipc_lease_pages_on_cuda": got["lease_pages_on_cuda"],
            "ipc_bytes_equal": got["bytes_equal"] and got["blocks"] == n, "ipc_bytes": got["bytes"],
            "ipc_read_gbps": got["bytes"] / got["read_s"] / 1e9, "ipc_d2d_gbps": got["bytes"] / got["d2d_s"] / 1e9,
            "ipc_read_vs_d2d": got["d2d_s"] / got["read_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--small", action="store_true", help="64 MiB (a rehearsal)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--parts", default="disk,h2d,ipc", help="comma-separated: disk, h2d, ipc")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = 64 if args.small else int(args.gib * 1024)
    device = "cuda:0" if CUDA else "cpu"
    parts = set(args.parts.split(","))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu", "pages": n}
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-io-", dir=os.environ.get("TIERKV_BENCH_DIR")))
    try:
        for name, fn in (("disk", lambda: bench_disk(work, n, args.runs, device)),
                         ("h2d", lambda: bench_h2d(work, n, args.runs, device)),
                         ("ipc", lambda: bench_ipc(work, n, args.runs))):
            if name not in parts or (name == "ipc" and not CUDA):
                continue
            log(f"{name} ...")
            try:  # one part failing must not lose the others' figures
                out.update(fn())
                log(json.dumps(out, sort_keys=True))  # so far, in case a later part is cut off
            except Exception as e:  # noqa: BLE001 - reported, and the exit status says so
                out[f"{name}_error"] = f"{type(e).__name__}: {e}"[-2000:]
                log(f"{name} FAILED: {out[f'{name}_error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        for k, v in out.items():
            print(f"{k:36} {v:.4g}" if isinstance(v, float) else f"{k:36} {v}")
    sys.exit(1 if any(k.endswith("_error") for k in out) else 0)


if __name__ == "__main__":
    main()
