"""What tierkv adds to a vLLM hit served by a running daemon, without vLLM: its floor.

    python scripts/bench_daemon_hit.py --json

A vLLM engine restarted beside a daemon that kept its pages asks tierkv three things for its
first hit on a stored prompt: a lookup (scheduler side, one round trip), an acquire (worker
side, one round trip) and the copy of the leased pages from the daemon's shared memory
into vLLM's KV blocks. ``scripts/bench_vllm.py`` measures that hit inside vLLM, where the
copy shares the CPU with vLLM's OpenMP threads; this measures the same three steps alone,
for bench_vllm's shape (8 layers, 2 KV heads of 64, block 128, bf16, a 4,097-token prompt:
32 pages, 16 MiB) and CPU_ATTN's cache layout (:class:`~tierkv.integrations.vllm.pages.PagedKV`,
vLLM not needed; the tiles of its amx kernels where the CPU has AMX tiles, as vLLM picks
them for bf16, else those of its vec kernels: ``--kv-split``). A real ``tierkv serve`` runs
in a child process; a fresh client connects as a restarted engine would, then
``--iterations`` rounds of lookup, acquire, copy and release. The first round is reported
apart (the first copy out of a newly mapped region pays its page faults), then the medians
of the rest; then a lookup alone (in the rounds it follows a release, which the daemon
handles first) and a PING round trip. The copies of
the first and last rounds are checked against the pages stored.

With ``--json`` the last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tierkv
from tierkv import PageLayout, Scope
from tierkv.integrations.vllm.pages import KV_AMX, KV_BY_TOKENS, PagedKV

LAYOUT = PageLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=128, dtype="bfloat16")
LAYOUT_ARG = "num_layers=8,num_kv_heads=2,head_dim=64,block_size=128,dtype=bfloat16"
SCOPE = Scope("ab" * 32, "default")
VLLM_BLOCKS = 512  # blocks in the stand-in for vLLM's KV cache


def ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--eviction-policy", default=None, help="the daemon's (default: the store's default)")
    ap.add_argument("--kv-split", choices=(KV_BY_TOKENS, KV_AMX), default=None,
                    help="CPU_ATTN's tiles: as its vec kernels lay them out or its amx kernels (default: what "
                         "vLLM picks for bf16 here: amx where the CPU has AMX tiles)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    split = a.kv_split or (KV_AMX if torch.cpu._is_amx_tile_supported() else KV_BY_TOKENS)
    policy = ["--eviction-policy", a.eviction_policy] if a.eviction_policy else []
    work = Path(tempfile.mkdtemp(prefix="tierkv-daemon-hit-"))
    sock = work / "tierkv.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tierkv.cli import main; main()", "serve", "--home", str(work / "home"),
         "--socket", str(sock), "--layout", LAYOUT_ARG, "--device", "cpu", "--device-bytes", str(256 << 20),
         "--host-bytes", str(512 << 20), "--disk-bytes", str(4 << 30), "--no-warm-at-open", *policy],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("tierkv serve did not start")
            time.sleep(0.05)
        tokens = np.random.default_rng(0).integers(3, 30000, 32 * 128 + 1).astype(np.int32)
        pages = torch.randn((32, *LAYOUT.shape)).to(torch.bfloat16)
        with tierkv.connect(sock, layout=LAYOUT) as writer:
            writer.put(tokens, pages, SCOPE)
        caches = {f"model.layers.{i}.self_attn.attn": torch.zeros((VLLM_BLOCKS, 2, 128, 128), dtype=torch.bfloat16)
                  for i in range(LAYOUT.num_layers)}
        paged = PagedKV(caches, LAYOUT, VLLM_BLOCKS, split)
        blocks = list(range(100, 132))
        t0 = time.perf_counter()
        client = tierkv.connect(sock, layout=LAYOUT)  # as a restarted engine connects
        connect_s = time.perf_counter() - t0
        lookup, acquire, copy = [], [], []
        try:
            for i in range(a.iterations):
                t0 = time.perf_counter()
                found = client.lookup(tokens, SCOPE)
                t1 = time.perf_counter()
                lease = client.acquire(tokens, SCOPE, max_blocks=32)
                t2 = time.perf_counter()
                paged.copy_in(lease.pool, lease.slots, blocks)
                t3 = time.perf_counter()
                lease.release()
                if found.tokens_matched != 32 * 128 or lease.num_blocks != 32:
                    raise SystemExit(f"expected a 32-block hit, got {found.tokens_matched} tokens, {lease.num_blocks} blocks")
                # Checked on the first and last rounds only: a gather between copies would
                # leave other cache lines warm than a forward pass does.
                if i in (0, a.iterations - 1) and not torch.equal(paged.gather(blocks).view(torch.int16),
                                                                   pages.view(torch.int16)):
                    raise SystemExit("the copied KV differs from the pages stored")
                lookup.append(t1 - t0)
                acquire.append(t2 - t1)
                copy.append(t3 - t2)
            alone, ping = [], []
            for _ in range(a.iterations):
                t0 = time.perf_counter()
                client.lookup(tokens, SCOPE)
                t1 = time.perf_counter()
                client.ping()
                alone.append(t1 - t0)
                ping.append(time.perf_counter() - t1)
        finally:
            client.close()
            paged.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "connect_ms": round(1000 * connect_s, 3),
        "first_lookup_ms": round(1000 * lookup[0], 3), "first_acquire_ms": round(1000 * acquire[0], 3),
        "first_copy_ms": round(1000 * copy[0], 3),
        "lookup_ms": ms(lookup[1:]), "acquire_ms": ms(acquire[1:]), "copy_ms": ms(copy[1:]),
        "lookup_alone_ms": ms(alone), "ping_ms": ms(ping),
        "copy_bytes": 32 * LAYOUT.page_bytes, "kv_split": split,
    }
    out["first_total_ms"] = round(out["first_lookup_ms"] + out["first_acquire_ms"] + out["first_copy_ms"], 3)
    out["total_ms"] = round(out["lookup_ms"] + out["acquire_ms"] + out["copy_ms"], 3)
    for k, v in out.items():
        print(f"{k:18} {v}")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
