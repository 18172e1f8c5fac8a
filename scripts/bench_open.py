#!/usr/bin/env python3
"""How long ``tierkv.open`` takes on a home that holds many blocks (a restart: the block
table is rebuilt from the index, every record's segment slot claimed).

Stores ``--blocks`` blocks (puts of 256 blocks of 16 tokens, 512-byte pages, 4 KiB disk
slots, durable), closes the store, then times ``--runs`` opens of the home.

    .venv/bin/python scripts/bench_open.py --blocks 61440 --runs 3
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tierkv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=61440, help="blocks to store (rounded down to puts of 256)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    layout = tierkv.PageLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float16")
    home = Path(tempfile.mkdtemp(dir="/tmp", prefix="tierkv-open-"))
    options = dict(device="cpu", device_bytes=8 << 20, host_bytes=0, disk_bytes=max(64 << 20, 2 * args.blocks * 4096),
                   shm_dir=home)
    try:
        store = tierkv.open(home, layout, **options)
        scope = tierkv.Scope("ab" * 32, "open")
        pages = torch.zeros((256, *layout.shape), dtype=layout.torch_dtype)
        puts = args.blocks // 256
        for i in range(puts):
            store.put(np.random.default_rng(i).integers(0, 30000, 4096).astype(np.int32), pages, scope)
        stored = store.stats()["tiers"]["disk"]["blocks"]
        store.close()
        runs = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            store = tierkv.open(home, layout, **options)
            runs.append(time.perf_counter() - t0)
            store.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    out = {"blocks": stored, "open_s": statistics.median(runs), "runs_s": runs,
           "open_us_per_block": statistics.median(runs) / max(1, stored) * 1e6}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"open of a home with {stored} blocks: {out['open_s']:.2f} s median "
              f"({out['open_us_per_block']:.1f} us a block; runs {', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
