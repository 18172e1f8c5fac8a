#!/usr/bin/env python
"""Memory an eviction policy keeps per slot of a full tier (issue #33: ``leader``'s shadows).

A stream of distinct 32-byte keys (a scan: every key a put of its own) goes through each
policy of a tier of ``--capacity`` slots, the table's calls as the store makes them (the
victim is the first candidate, then ``remove(evicted=True)``, ``add``, ``touch(hit=False)``),
for ``--turnovers`` x capacity keys, so every bounded history and ghost list is full. The
figure is what ``tracemalloc`` counts as held by the policy at the end, over the capacity;
the keys themselves are allocated before tracing starts and not counted (the store holds
them anyway while the block is resident; a history keeps evicted ones alive, 65 bytes each).

    .venv/bin/python scripts/policy_memory.py --capacity 20000
"""
from __future__ import annotations

import argparse
import json
import os
import tracemalloc

from tierkv.core.policy import HINT_FRESH, HINT_TAIL, POLICIES
from tierkv.core.policy_mix import make_policy


def bytes_per_slot(policy: str, capacity: int, turnovers: int) -> float:
    keys = [os.urandom(32) for _ in range(capacity * turnovers)]
    tracemalloc.start()
    try:
        pol = make_policy(policy, capacity)
        for k in keys:
            if len(pol) >= capacity:
                pol.remove(next(iter(pol.candidates())), True)
            pol.add(k, HINT_FRESH | HINT_TAIL)
            pol.touch([k], False)
        pol.check_integrity()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return held / capacity


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacity", type=int, default=20000, help="tier slots (default 20,000)")
    ap.add_argument("--turnovers", type=int, default=12, help="keys streamed, in capacities (default 12)")
    ap.add_argument("--policy", action="append", choices=POLICIES, help="default: all")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = {p: round(bytes_per_slot(p, args.capacity, args.turnovers)) for p in args.policy or POLICIES}
    if args.json:
        print(json.dumps({"capacity": args.capacity, "turnovers": args.turnovers, "bytes_per_slot": rows}))
    else:
        for p, b in rows.items():
            print(f"{p:8s} {b:6d} bytes per slot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
