"""The eviction table of issue #33: block hit rate per trace x policy x capacity, beside the
references (leaf-first LRU, both LRU-2 rankings, Belady) of :mod:`tierkv.traces`.

Traces: a set of :mod:`tierkv.workloads` (``--set develop`` or ``--set check``) and/or
Mooncake-format files (``--trace``). Capacities are shares of each trace's distinct blocks
(``--share``, default 1%, 3%, 10%, 30%). The policies run as models
(:func:`tierkv.traces.simulate_policy`), which ``scripts/replay_trace.py --check-model``
proves equal to the store request by request. For each row the table marks the best of the
LRU family (``lru``, ``lru2``, ``lru2-history``) and each policy's share of Belady.

    .venv/bin/python scripts/eviction_table.py --set develop --trace ../shared/traces/synthetic_trace.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tierkv.core.policy import POLICIES
from tierkv.traces import REFERENCES, Request, read_trace, simulate_policy
from tierkv.workloads import trace_set

BASELINES = ("lru", "lru2", "lru2-history")


def distinct(trace: list[Request]) -> int:
    return len({x for r in trace for x in r.hash_ids})


def table(traces: dict[str, list[Request]], shares: list[float], policies: list[str]) -> list[dict]:
    """One row per trace and capacity: the block hit rate of each reference and policy."""
    rows = []
    for name, trace in traces.items():
        d = distinct(trace)
        for share in shares:
            cap = max(1, round(d * share))
            rates: dict[str, float] = {}
            seconds: dict[str, float] = {}
            for ref in (*BASELINES, "belady"):
                t0 = time.perf_counter()
                rates[ref] = REFERENCES[ref](trace, cap).block_hit_rate(trace)
                seconds[ref] = time.perf_counter() - t0
            best = max(rates[b] for b in BASELINES)
            for pol in policies:  # keyed "tierkv NAME": the store's lru and lru2 are not the references
                t0 = time.perf_counter()
                rates[f"tierkv {pol}"] = simulate_policy(trace, cap, pol).block_hit_rate(trace)
                seconds[f"tierkv {pol}"] = time.perf_counter() - t0
            rows.append({"trace": name, "requests": len(trace), "distinct": d, "share": share, "capacity": cap,
                         "rates": {k: round(v, 4) for k, v in rates.items()}, "best_baseline": round(best, 4),
                         "of_belady": {p: round(rates[f"tierkv {p}"] / rates["belady"], 3) if rates["belady"] else None
                                       for p in policies},
                         "beats_baselines": {p: rates[f"tierkv {p}"] >= best for p in policies},
                         "seconds": {k: round(v, 2) for k, v in seconds.items()}})
            print(f"  {name} {share:.0%} done", file=sys.stderr)
    return rows


def markdown(rows: list[dict], policies: list[str]) -> str:
    cols = [*BASELINES, *(f"tierkv {p}" for p in policies), "belady"]
    out = ["| trace | capacity | " + " | ".join(cols) + " | " + " | ".join(f"{p} / Belady" for p in policies) + " |",
           "|---" * (2 + len(cols) + len(policies)) + "|"]
    for r in rows:
        cells = []
        for c in cols:
            v = f"{r['rates'][c]:.4f}"
            if c.startswith("tierkv ") and not r["beats_baselines"][c[7:]]:
                v = f"*{v}*"  # below the best of the LRU family
            if c in BASELINES and r["rates"][c] == r["best_baseline"]:
                v = f"**{v}**"
            cells.append(v)
        shares = [f"{r['of_belady'][p]:.2f}" if r["of_belady"][p] is not None else "-" for p in policies]
        out.append(f"| {r['trace']} | {r['capacity']:,} ({r['share']:.0%}) | " + " | ".join(cells) + " | "
                   + " | ".join(shares) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", choices=("develop", "check"), default=[],
                    help="generated trace set (tierkv.workloads; repeat)")
    ap.add_argument("--reseed", type=int, default=0,
                    help="add this to every seed of the sets: the same shapes drawn afresh (tierkv.workloads.trace_set)")
    ap.add_argument("--trace", action="append", type=Path, default=[], help="a Mooncake-format .jsonl (repeat)")
    ap.add_argument("--only", action="append", help="only these trace names")
    ap.add_argument("--share", action="append", type=float, help="capacity as a share of distinct blocks (repeat)")
    ap.add_argument("--policy", action="append", choices=POLICIES, help="default: all")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    traces: dict[str, list[Request]] = {}
    for s in args.set:
        name = f"{s}+{args.reseed}" if args.reseed else s
        traces.update({f"{name}:{k}": v for k, v in trace_set(s, args.reseed).items()})
    for p in args.trace:
        traces[p.stem] = read_trace(p)
    if args.only:
        traces = {k: v for k, v in traces.items() if any(o in k for o in args.only)}
    if not traces:
        ap.error("give --set and/or --trace")
    policies = args.policy or list(POLICIES)
    rows = table(traces, args.share or [0.01, 0.03, 0.1, 0.3], policies)
    if args.json:
        print(json.dumps({"policies": policies, "rows": rows}, indent=1))
    else:
        print(markdown(rows, policies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
