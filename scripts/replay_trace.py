#!/usr/bin/env python
"""Replay a Mooncake-format prefix trace through the real store and through references.

For each capacity (in blocks) the trace goes through ``tierkv.open`` (an in-memory tier of
exactly that many pages of a tiny layout: 1 layer, 1 head, head_dim 1, 512-token blocks, so
30,000 blocks take 60 MB; no host or disk tier unless ``--disk-blocks``), one store per
eviction policy, and through the references of :mod:`tierkv.traces` (leaf-first LRU, LRU-2,
the offline optimum). Each request is ``acquire`` (its hits: the longest cached prefix,
token ids verified), ``release``, then ``put`` of the rest from ``start_block = hits``. Every
hash id becomes a block of token ids that depend on the id alone (the key chain carries the
prefix), so the store's keys agree exactly when the trace's prefixes agree.

Prints block hit rate, token hit rate (full 512-token blocks), requests/s (store replays:
the wall time of acquire+release+put over the trace) and the share of the optimum's block
hit rate. ``--check-model`` also asserts that each store's per-request hits equal the
:func:`tierkv.traces.simulate_policy` model of the same policy.

    .venv/bin/python scripts/replay_trace.py ../shared/traces/synthetic_trace.jsonl \\
        --capacity 1000 --capacity 10000 --capacity 30000
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tierkv
from tierkv.daemon.gc_pauses import GcPauses, freeze_startup_heap
from tierkv.identity import Scope
from tierkv.core.policy import POLICIES
from tierkv.disk_admission import ADMISSIONS
from tierkv.tier_model import simulate_tiers
from tierkv.traces import REFERENCES, TRACE_BLOCK, Request, SimResult, block_tokens, read_trace, simulate_policy
from tierkv.workloads import trace_set

LAYOUT = tierkv.PageLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=TRACE_BLOCK, dtype="float16")
SCOPE = Scope("ab" * 32, "replay")
# Objects frozen before this module loaded: Python 3.12 starts with a few hundred frozen by
# the interpreter itself, so "nothing frozen" is not zero there (replay_store).
_FROZEN_AT_IMPORT = gc.get_freeze_count()


def generated(kind: str, seed: int = 1) -> list[Request]:
    """Traces with a known character, for checking a policy away from the Mooncake trace:
    ``loop`` (40 prefixes of 10 blocks in a cycle: pure recency defeats LRU), ``chat``
    (conversations growing a turn at a time, the recently active ones resumed: LRU's best
    case), ``zipf`` (500 documents of 8 blocks drawn Zipf(1), each with a one-off question
    block), ``zipf-scan`` (the same, with a one-off 30-block request every tenth)."""
    rng = random.Random(seed)

    def req(ids: list[int]) -> Request:
        return Request(tuple(ids), len(ids) * TRACE_BLOCK)

    if kind == "loop":
        return [req(list(range(c * 100, c * 100 + 10))) for i in range(2000) for c in [i % 40]]
    if kind == "chat":
        convs: dict[int, list[int]] = {}
        order: list[int] = []
        nxt, out = 10**6, []
        for _ in range(4000):
            if not order or rng.random() < 0.2:
                c = len(convs)
                convs[c] = [nxt]
                nxt += 1
            else:
                c = order[-1 - min(int(rng.expovariate(1 / 8)), len(order) - 1)]
            k = rng.randint(1, 4)
            convs[c] = convs[c] + list(range(nxt, nxt + k))
            nxt += k
            if c in order:
                order.remove(c)
            order.append(c)
            out.append(req(convs[c] + [nxt]))  # the turn's trailing partial block
            nxt += 1
        return out
    if kind in ("zipf", "zipf-scan"):
        weights = [1 / (i + 1) for i in range(500)]
        out, q, scan = [], 10**7, 2 * 10**7
        for i in range(4000):
            d = rng.choices(range(500), weights)[0]
            out.append(req(list(range(d * 100, d * 100 + 8)) + [q]))
            q += 1
            if kind == "zipf-scan" and i % 10 == 0:
                out.append(req(list(range(scan, scan + 30))))
                scan += 100
        return out
    raise ValueError(f"unknown generated trace {kind!r}")


def replay_store(trace: list[Request], capacity: int, policy: str, disk_blocks: int = 0,
                 freeze_heap: bool = True) -> tuple[SimResult, float, dict]:
    """Per-request hits of the real store, its requests/s, and its stats at the end (with
    ``requests_per_cpu_s``: requests per CPU-second of this process, steadier than the wall
    clock on a shared machine, ``gc_seconds``: the collector's pauses in the replay, and
    ``heap_frozen``: whether this call froze the heap, as below).

    ``freeze_heap``: the objects this process holds before the clock starts (torch, numpy,
    the trace, the references' results: ~200,000 tracked objects) are frozen out of the
    garbage collector for the replay, as ``tierkv serve`` freezes its startup heap (both with
    :func:`tierkv.daemon.gc_pauses.freeze_startup_heap`; pauses counted by its ``GcPauses``).
    Without it one full collection in the 30,000-block replay walks them all and takes
    ~0.15 s of a ~0.9 s replay, a cost of this harness's heap rather than of the store; the
    store's own objects (its blocks) are collected as usual either way. ``--no-freeze-heap``
    measures with it."""
    token_cache: dict[int, np.ndarray] = {}

    def tokens_of(ids: tuple[int, ...]) -> np.ndarray:
        parts = []
        for x in ids:
            t = token_cache.get(x)
            if t is None:
                t = token_cache[x] = block_tokens(x)
            parts.append(t)
        return np.concatenate(parts) if parts else np.zeros(0, dtype="<i4")

    longest = max((len(r.hash_ids) for r in trace), default=0)
    pages = torch.zeros((max(1, longest), *LAYOUT.shape), dtype=LAYOUT.torch_dtype)
    arrays = [tokens_of(r.hash_ids) for r in trace]  # built before the clock starts
    hits: list[int] = []
    with tempfile.TemporaryDirectory(prefix="tierkv-replay-") as home:
        store = tierkv.open(
            home, LAYOUT, device="cpu", device_bytes=capacity * LAYOUT.page_bytes, host_bytes=0,
            disk_bytes=disk_blocks * LAYOUT.slot_bytes, eviction_policy=policy, prefetch_workers=1,
            shm_dir=Path(home),
        )
        # A caller's own freeze (after this module loaded) is left alone.
        froze = freeze_heap and gc.get_freeze_count() <= _FROZEN_AT_IMPORT
        if froze:
            freeze_startup_heap()
        pauses = GcPauses().install()
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            for r, arr in zip(trace, arrays):
                lease = store.acquire(arr, SCOPE)
                n = len(lease.keys)
                store.release(lease)
                hits.append(n)
                if n < len(r.hash_ids):
                    store.put(arr, pages[: len(r.hash_ids) - n], SCOPE, start_block=n)
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - c0
            gc_seconds = sum(pauses.total_s)
            store.check_integrity()
            stats = dict(store.stats())
            stats["requests_per_cpu_s"] = len(trace) / cpu if cpu else 0.0
            stats["gc_seconds"] = gc_seconds
            stats["heap_frozen"] = froze
        finally:
            pauses.uninstall()
            if froze:
                gc.unfreeze()
            store.close()
    return SimResult(tuple(hits)), len(trace) / seconds if seconds else 0.0, stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, nargs="?", help="a Mooncake-format .jsonl (or use --generated)")
    ap.add_argument("--generated", choices=("loop", "chat", "zipf", "zipf-scan"),
                    help="replay a generated trace instead (see generated())")
    ap.add_argument("--workload", metavar="SET:NAME",
                    help="replay a trace of tierkv.workloads instead (e.g. check:sessions; see its DEVELOP and CHECK)")
    ap.add_argument("--capacity", type=int, action="append", help="tier size in blocks (repeat)")
    ap.add_argument("--policy", action="append", choices=POLICIES, help="store policies to replay (default: all)")
    ap.add_argument("--reference", action="append", choices=sorted(REFERENCES), help="default: all")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--full-blocks-only", action="store_true", help="drop each request's trailing partial block")
    ap.add_argument("--disk-blocks", type=int, default=0, help="add a disk tier of this many blocks")
    ap.add_argument("--repeat", type=int, default=1, help="store replays per policy (requests/s: median)")
    ap.add_argument("--no-store", action="store_true", help="references and policy models only")
    ap.add_argument("--no-freeze-heap", action="store_true",
                    help="leave this process's heap to the collector during store replays (see replay_store)")
    ap.add_argument("--check-model", action="store_true", help="assert the store's hits equal the policy model's")
    ap.add_argument("--tiers", action="append", metavar="HOST:DISK",
                    help="experiment on a small host tier over a disk tier (policy models, tierkv/tier_model.py), "
                         "in blocks or as percentages of the trace's distinct blocks (1%%:3%%): promote vs "
                         "read-through, admit into memory on first vs second use, write-through; with "
                         "--admission, each disk admission rule written through and written back")
    ap.add_argument("--admission", action="append", choices=[*ADMISSIONS, "adaptive"],
                    help="with --tiers: disk admission rules to compare (tierkv/disk_admission.py; 'adaptive' "
                         "follows whichever of the others is winning, tierkv/tier_model.py)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.workload:
        which, _, name = args.workload.partition(":")
        sets = trace_set(which)
        if name not in sets:
            ap.error(f"--workload: {which} has {sorted(sets)}")
        trace = sets[name][: args.limit]
        args.trace = Path(f"workload:{args.workload}")
    elif args.generated:
        trace = generated(args.generated)[: args.limit]
        args.trace = Path(f"generated:{args.generated}")
    elif args.trace is None:
        ap.error("give a trace file or --generated")
    else:
        trace = read_trace(args.trace, args.limit, args.full_blocks_only)
    if args.tiers:
        return tiers_experiment(args, trace)
    capacities = args.capacity or [1000, 10000, 30000]
    policies = args.policy or list(POLICIES)
    references = args.reference or sorted(REFERENCES)
    rows = []
    for cap in capacities:
        results: dict[str, dict] = {}
        for ref in references:
            t0 = time.perf_counter()
            res = REFERENCES[ref](trace, cap)
            # Pure-Python simulators on the same machine at the same time: a yardstick for the
            # store's requests/s when the machine is shared.
            results[ref] = {"kind": "reference", "result": res,
                            "requests_per_s": len(trace) / max(1e-9, time.perf_counter() - t0)}
        for pol in policies:
            if args.no_store:
                results[f"{pol} (model)"] = {"kind": "model", "result": simulate_policy(trace, cap, pol)}
                continue
            rates, cpu_rates = [], []
            for _ in range(max(1, args.repeat)):
                res, rps, stats = replay_store(trace, cap, pol, args.disk_blocks, not args.no_freeze_heap)
                rates.append(rps)
                cpu_rates.append(stats["requests_per_cpu_s"])
            if args.check_model:
                model = simulate_policy(trace, cap, pol)
                bad = [i for i, (a, b) in enumerate(zip(res.hits, model.hits)) if a != b]
                if bad:
                    print(f"store ({pol}) and model disagree at capacity {cap}, first at request {bad[0]}",
                          file=sys.stderr)
                    return 1
            results[f"tierkv {pol}"] = {"kind": "store", "result": res, "requests_per_s": statistics.median(rates),
                                        "requests_per_s_runs": rates, "stats": stats,
                                        "requests_per_cpu_s": statistics.median(cpu_rates)}
        best = results["belady"]["result"].block_hit_rate(trace) if "belady" in results else None
        for name, r in results.items():
            rate = r["result"].block_hit_rate(trace)
            rows.append({
                "capacity": cap, "policy": name, "kind": r["kind"], "block_hit_rate": round(rate, 4),
                "token_hit_rate": round(r["result"].token_hit_rate(trace), 4),
                "share_of_optimum": round(rate / best, 4) if best else None,
                "requests_per_s": round(r["requests_per_s"]) if "requests_per_s" in r else None,
                "requests_per_s_runs": [round(x) for x in r.get("requests_per_s_runs", [])] or None,
                "requests_per_cpu_s": round(r["requests_per_cpu_s"]) if "requests_per_cpu_s" in r else None,
                "gc_seconds": round(r["stats"]["gc_seconds"], 4) if "stats" in r else None,
                "ghost_hits": dict(r["stats"]["ghost_hits"]) if "stats" in r else None,
                "evicted_by": {t: dict(v) for t, v in r["stats"]["evicted_by"].items()} if "stats" in r else None,
            })
    if args.json:
        print(json.dumps({"trace": str(args.trace), "requests": len(trace), "native": tierkv.native.status(),
                          "rows": rows}, indent=1))
        return 0
    print(f"{args.trace}: {len(trace)} requests, {sum(len(r.hash_ids) for r in trace)} blocks; "
          f"store: {tierkv.native.describe()}; heap {'left to' if args.no_freeze_heap else 'frozen out of'} "
          f"the collector during store replays")
    print(f"{'capacity':>9} {'policy':<16} {'block hit':>9} {'token hit':>9} {'of opt':>7} {'req/s':>8} {'req/cpu-s':>9}"
          f" {'gc s':>6}")
    for row in rows:
        share = f"{row['share_of_optimum']:.3f}" if row["share_of_optimum"] is not None else "-"
        rps = str(row["requests_per_s"]) if row["requests_per_s"] is not None else "-"
        cps = str(row["requests_per_cpu_s"]) if row["requests_per_cpu_s"] is not None else "-"
        gcs = f"{row['gc_seconds']:.3f}" if row["gc_seconds"] is not None else "-"
        print(f"{row['capacity']:>9} {row['policy']:<16} {row['block_hit_rate']:>9.4f} "
              f"{row['token_hit_rate']:>9.4f} {share:>7} {rps:>8} {cps:>9} {gcs:>6}")
    return 0


def _tier_size(spec: str, distinct: int) -> int:
    return max(1, distinct * int(spec[:-1]) // 100) if spec.endswith("%") else int(spec)


def tiers_experiment(args: argparse.Namespace, trace: list[Request]) -> int:
    rows = []
    distinct = len({x for r in trace for x in r.hash_ids})
    if args.admission:  # (label, promote, admit on second use, write back, admission)
        variants = [(f"{adm}, {'write-back' if wb else 'write-through'}", True, False, wb, adm)
                    for adm in args.admission for wb in (False, True)]
    else:
        variants = [("promote, admit first use", True, False, False, "all"),
                    ("read through, admit first use", False, False, False, "all"),
                    ("promote, admit second use", True, True, False, "all")]
    for spec in args.tiers:
        host, disk = (_tier_size(x, distinct) for x in spec.split(":"))
        for pol in args.policy or list(POLICIES):
            for label, promote, second, wb, adm in variants:
                r = simulate_tiers(trace, host, disk, pol, promote, second, wb, adm)
                rows.append({"host": host, "disk": disk, "policy": pol, "variant": label,
                             "hit_rate": round(r.hit_rate, 4), "host_hit_rate": round(r.host_hit_rate, 4),
                             "disk_writes": r.disk_writes})
    if args.json:
        print(json.dumps({"trace": str(args.trace), "requests": len(trace), "distinct_blocks": distinct,
                          "tiers": rows}, indent=1))
        return 0
    print(f"{'host':>6} {'disk':>6} {'policy':<6} {'variant':<30} {'hit':>7} {'host hit':>8} {'disk writes':>11}")
    for r in rows:
        print(f"{r['host']:>6} {r['disk']:>6} {r['policy']:<6} {r['variant']:<30} {r['hit_rate']:>7.4f} "
              f"{r['host_hit_rate']:>8.4f} {r['disk_writes']:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
