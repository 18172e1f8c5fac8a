#!/usr/bin/env python
"""Crash torture for the tierkv store: kill a writer with SIGKILL, reopen, verify; repeat.

Each trial runs a child doing random puts (some pinned), leases, pins and invalidations
against a store with tiny memory tiers (every put demotes and evicts), logging each
acknowledgement to its stdout. The child is killed with SIGKILL either after a random
number of acknowledgements or at the N-th call of a named step (page written, page synced,
index committed, index deleted, slot freed, segment created, demoted). The store is then
reopened and checked against the child's log: every acknowledged chain whole and
byte-identical, acknowledged invalidations held, an interrupted invalidation all-or-nothing,
no wrong byte anywhere, check_integrity() clean. A quarter of the trials use a 16-slot disk
so that eviction from disk is exercised too (there only pinned chains must survive).

    python scripts/crash_torture.py --trials 300            # a table of failures + summary
    python scripts/crash_torture.py --trials 50 --json      # summary as JSON on the last line

Exit status 1 when any trial found a problem. The verification code lives in
tests/store/child.py, shared with tests/store/test_crash.py.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from store.child import POINTS, run_trial  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=None, help="master seed (default: time based)")
    ap.add_argument("--ops", type=int, default=400, help="operations a child would run if never killed")
    ap.add_argument("--workdir", type=Path, default=None, help="where trial homes go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the homes of failed trials")
    ap.add_argument("--spawn", action="store_true", help="start each child as a fresh interpreter, not a fork")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    args = ap.parse_args(argv)

    master = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(master)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="tierkv-torture-"))
    root.mkdir(parents=True, exist_ok=True)
    points = sorted(set(POINTS) - {"quarantine"})
    failures: list[dict] = []
    killed = acked = 0
    by_kind: dict[str, int] = {}
    t0 = time.monotonic()
    for t in range(args.trials):
        seed = rng.randrange(10**9)
        small = rng.random() < 0.25
        work = root / f"trial-{t:05d}"
        if rng.random() < 0.5:
            kind, kw = "random", dict(kill_after_acks=rng.randint(1, 60))
        else:
            point = rng.choice(points)
            kind, kw = point, dict(point=point, n=rng.randint(1, 12))
        report = run_trial(work, seed, ops=args.ops, small_disk=small, fork=not args.spawn, **kw)  # type: ignore[arg-type]
        by_kind[kind] = by_kind.get(kind, 0) + 1
        killed += report["killed"]
        acked += report["acked"]
        if report["problems"] or report["returncode"] not in (0, -9):
            failures.append({"trial": t, "seed": seed, "small_disk": small, "kind": kind, **kw, **report,
                             "home": str(work)})
            print(f"FAIL trial {t} seed {seed} {kind} {kw}: {report['problems'] or report['returncode']}", flush=True)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.workdir is None and not failures:
        shutil.rmtree(root, ignore_errors=True)
    summary = {
        "trials": args.trials, "failed": len(failures), "killed": killed, "acknowledged_chains": acked,
        "master_seed": master, "seconds": round(time.monotonic() - t0, 1), "by_kind": by_kind,
        "failures": failures[:20],
    }
    print(f"{args.trials} trials ({killed} killed mid-run), {acked} acknowledged chains checked, "
          f"{len(failures)} failed, {summary['seconds']} s, master seed {master}")
    if args.json:
        print(json.dumps(summary))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
