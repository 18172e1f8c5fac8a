#!/usr/bin/env python
"""What a hit costs an eviction policy alone: ``touch(keys, hit=True)`` of one resident chain
(issue #33: ``leader``'s shadows replay every key of every request; a daemon's acquire
touches its chain in the policy of each tier in use, three with a disk tier).

A chain of ``--keys`` 32-byte keys is put (``add``, then the re-ordering after a put) into a
policy of ``--capacity`` slots, then touched as a hit ``--touches`` times; the figure is the
time per touch. The policies take turns within each of ``--runs`` rounds and the median
over the rounds is reported, so a slow spell of the machine falls on every policy alike.
Compiled modules are used when the install has them (``tierkv.native``).

    .venv/bin/python scripts/bench_policy_touch.py --policy arc --policy leader
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tierkv.core.policy import HINT_CONTINUATION, HINT_FRESH, HINT_TAIL, POLICIES
from tierkv.core.policy_mix import make_policy


def touch_us(policy: str, capacity: int, n_keys: int, touches: int) -> float:
    """Microseconds per hit touch of an ``n_keys`` chain (root first in ``keys``)."""
    keys = [os.urandom(32) for _ in range(n_keys)]
    pol = make_policy(policy, capacity)
    for i, k in enumerate(keys):
        pol.add(k, (HINT_CONTINUATION if i else HINT_FRESH) | (HINT_TAIL if i == n_keys - 1 else 0))
    leaf_first = keys[::-1]
    pol.touch(leaf_first, False)
    pol.touch(leaf_first, True)  # the first hit makes the chain frequent: not timed
    start = time.perf_counter()
    for _ in range(touches):
        pol.touch(leaf_first, True)
    took = time.perf_counter() - start
    pol.check_integrity()
    return took / touches * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", action="append", choices=POLICIES, help="default: all")
    ap.add_argument("--capacity", type=int, default=4096, help="slots of the tier")
    ap.add_argument("--keys", type=int, default=256, help="blocks of the chain (256: 4,096 tokens of 16)")
    ap.add_argument("--touches", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.keys > args.capacity:
        ap.error("--keys must fit in --capacity (the chain is resident)")
    policies = args.policy or list(POLICIES)
    runs: dict[str, list[float]] = {p: [] for p in policies}
    for _ in range(args.runs):
        for p in policies:
            runs[p].append(touch_us(p, args.capacity, args.keys, args.touches))
    out = {p: {"us_per_touch": statistics.median(r), "runs": r} for p, r in runs.items()}
    if args.json:
        print(json.dumps({"capacity": args.capacity, "keys": args.keys, "policies": out}))
        return
    print(f"touch(hit=True) of a resident {args.keys}-key chain, tier of {args.capacity} slots, "
          f"median of {args.runs} rounds:")
    for p, r in out.items():
        print(f"  {p:8s} {r['us_per_touch']:8.1f} us   (rounds: {', '.join(f'{x:.1f}' for x in r['runs'])})")


if __name__ == "__main__":
    main()
