#!/usr/bin/env python3
"""Disk-tier slot allocation as the tier fills up with segments.

A full disk tier makes room one eviction at a time: a slot is freed somewhere and the next
page takes it. This fills a disk tier (4 KiB slots, 256 per segment, no fsync: no I/O but
the segment files' creation and the freed slots' record wipes) to each ``--segments``
count, then times ``free`` + ``alloc`` of one slot in the last segment, ``--ops`` times;
median of ``--runs`` runs per count.

    .venv/bin/python scripts/bench_disk_alloc.py --segments 100 --segments 1000 --segments 3000
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import tierkv
from tierkv.tiers.disk import DiskTier

LAYOUT = tierkv.PageLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float16")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--segments", type=int, action="append", help="full segments to measure at (repeat)")
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    counts = sorted(args.segments or [100, 1000, 3000])
    rows = []
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="tierkv-alloc-") as d:
        tier = DiskTier(Path(d), LAYOUT, capacity_bytes=(counts[-1] + 1) * 256 * 4096, segment_pages=256, fsync=False)
        held: list[int] = []
        for n in counts:
            while len(held) < n * 256:
                held.append(tier.alloc("bench"))
            runs = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                for i in range(args.ops):
                    loc = held[-1 - (i % 200)]
                    tier.free(loc)
                    if tier.alloc("bench") != loc:
                        raise SystemExit("the freed slot was not the one allocated next")
                runs.append((time.perf_counter() - t0) / args.ops * 1e6)
            rows.append({"full_segments": n, "free_alloc_us": statistics.median(runs), "runs_us": runs})
            if not args.json:
                print(f"{n:>6} full segments: free + alloc of one slot {statistics.median(runs):8.1f} us "
                      f"(runs {', '.join(f'{r:.1f}' for r in runs)})", flush=True)
        tier.close()
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
