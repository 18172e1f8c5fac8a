#!/usr/bin/env python
"""Crash torture for the tierkv store: kill a writer with SIGKILL, reopen, verify; repeat.

Each trial runs a child doing random puts (some pinned), leases, pins, invalidations and
deliberate page corruptions (read back, so they are quarantined) against a store with tiny
memory tiers (every put demotes and evicts), logging each acknowledgement to its stdout.
The child is killed with SIGKILL either by the parent after a random number of
acknowledgements, or by itself just before or just after the N-th call of a named step of
put, eviction, demotion, write-back, invalidation or quarantine (tests/store/child.py
STEPS). The store is then reopened and checked against the child's log: every acknowledged
chain whole and byte-identical, acknowledged invalidations held, an interrupted
invalidation all-or-nothing, no wrong byte anywhere, check_integrity() clean. A quarter of
the trials use a 16-slot disk (eviction from disk; there only pinned chains must survive),
a quarter write-back mode (write_through=False).

Only trials that were killed as planned count: a trial whose kill never fired (the point
was not reached, or the child finished first) is reported as unfired and run again with
another seed.

    python scripts/crash_torture.py --killed 1000           # a table of failures + summary
    python scripts/crash_torture.py --killed 50 --json      # summary as JSON on the last line

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

from store.child import NEEDS, POINTS, run_trial  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--killed", type=int, default=100, help="killed trials to run (unfired ones do not count)")
    ap.add_argument("--max-trials", type=int, default=None, help="give up after this many trials (default: 3x --killed)")
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
    kinds = ["random", *POINTS]
    failures: list[dict] = []
    killed = unfired = acked = trials = wrong = lost = corrupted = 0
    by_kind: dict[str, int] = {}
    t0 = time.monotonic()
    max_trials = args.max_trials or 3 * args.killed
    while killed < args.killed and trials < max_trials:
        t = trials
        trials += 1
        seed = rng.randrange(10**9)
        kind = rng.choice(kinds)
        needs = NEEDS.get(kind.split(":")[0])
        small, wb = needs if needs else (rng.random() < 0.25, rng.random() < 0.25)
        work = root / f"trial-{t:05d}"
        if kind == "random":
            kw: dict = dict(kill_after_acks=rng.randint(1, 8 if wb else 60))
        else:
            kw = dict(point=kind, n=rng.randint(1, 12))
        report = run_trial(work, seed, ops=args.ops, small_disk=small, write_back=wb, fork=not args.spawn, **kw)
        acked += report["acked"]
        corrupted += report["corrupted"]
        problems = report["problems"]
        wrong += sum("wrong bytes" in p for p in problems)
        lost += sum("lost" in p for p in problems)
        bad_exit = report["returncode"] not in (0, -9) or report["timed_out"]
        if report["killed"]:
            killed += 1
            by_kind[kind] = by_kind.get(kind, 0) + 1
        elif not problems and not bad_exit:
            unfired += 1  # the kill never happened: not a pass, not a failure; try another
        if problems or bad_exit:
            failures.append({"trial": t, "seed": seed, "small_disk": small, "write_back": wb, "kind": kind, **kw,
                             **report, "home": str(work)})
            print(f"FAIL trial {t} seed {seed} {kind} {kw} small={small} wb={wb}: "
                  f"{problems or report['returncode']}", flush=True)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
        if trials % 50 == 0:
            print(f"... {trials} trials, {killed} killed, {unfired} unfired, {len(failures)} failed, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
    if args.workdir is None and not failures:
        shutil.rmtree(root, ignore_errors=True)
    summary = {
        "killed": killed, "trials": trials, "unfired": unfired, "failed": len(failures), "wrong_bytes": wrong,
        "acknowledged_losses": lost, "acknowledged_chains": acked, "corrupted_on_purpose": corrupted,
        "kill_points": len(by_kind), "master_seed": master, "seconds": round(time.monotonic() - t0, 1),
        "by_kind": dict(sorted(by_kind.items())), "failures": failures[:20],
    }
    print(f"{killed} killed trials ({trials} run, {unfired} unfired) across {len(by_kind)} kill points, "
          f"{acked} acknowledged chains checked, {wrong} wrong bytes, {lost} acknowledged losses, "
          f"{len(failures)} failed, {summary['seconds']} s, master seed {master}")
    if args.json:
        print(json.dumps(summary))
    return 1 if failures or killed < args.killed else 0


if __name__ == "__main__":
    sys.exit(main())
