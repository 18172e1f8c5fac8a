"""Crash safety: a child doing puts, evictions, demotions and invalidations is killed with
SIGKILL (at random points, and at each named step); after a reopen every acknowledged
block is whole and byte-identical, invalidations hold, nothing dangles.
scripts/crash_torture.py runs the same trials by the hundred."""
from __future__ import annotations

import json
import random
import subprocess

import pytest

from .child import POINTS, run_trial


@pytest.mark.slow
@pytest.mark.parametrize("small_disk", [False, True])
def test_sigkill_at_random_points(tmp_path, small_disk):
    rng = random.Random(1234 + small_disk)
    trials = [(tmp_path / f"t{i}", rng.randrange(10**6), rng.randint(2, 40)) for i in range(4)]
    reports = [run_trial(t, seed, small_disk=small_disk, kill_after_acks=k) for t, seed, k in trials]
    for (_, seed, k), r in zip(trials, reports):
        assert r["killed"], (seed, k, r)
        assert r["problems"] == [], (seed, k, r)
    assert sum(r["acked"] for r in reports) > 0


# (point, call number, small disk) chosen so that every point is reached.
KILL_AT = [
    ("segment-created", 2, False), ("page-written", 5, False), ("page-synced", 4, False),
    ("index-committed", 6, False), ("index-deleted", 3, True), ("slot-freed", 4, True), ("demoted", 5, False),
    ("index-deleted", 1, False),  # the first invalidation on the big disk
]


@pytest.mark.slow
def test_sigkill_at_each_step(tmp_path):
    assert {p for p, _, _ in KILL_AT} >= set(POINTS) - {"quarantine"}
    reports = [run_trial(tmp_path / f"{point}-{i}", 77 + i, ops=300, small_disk=small, point=point, n=n)
               for i, (point, n, small) in enumerate(KILL_AT)]
    for (point, n, small), r in zip(KILL_AT, reports):
        assert r["killed"], f"{point}#{n} was never reached: {r}"
        assert r["problems"] == [], (point, r)


def test_torture_runs_to_completion_cleanly(tmp_path):
    r = run_trial(tmp_path, 5, ops=60)
    assert r["returncode"] == 0 and r["problems"] == [], r


@pytest.mark.slow
def test_sigkill_of_a_fresh_interpreter(tmp_path):
    # The same trial without fork(): a child that imported everything itself.
    r = run_trial(tmp_path, 11, kill_after_acks=5, fork=False)
    assert r["killed"] and r["problems"] == [], r


@pytest.mark.slow
def test_crash_torture_script_reports_json(tmp_path):
    from pathlib import Path
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "crash_torture.py"
    out = subprocess.run([sys.executable, str(script), "--trials", "2", "--workdir", str(tmp_path), "--seed", "3", "--json"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["trials"] == 2 and summary["failed"] == 0
