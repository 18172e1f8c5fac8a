"""Crash safety: a child doing puts, evictions, demotions and invalidations is killed with
SIGKILL (at random points, and at each named step); after a reopen every acknowledged
block is whole and byte-identical, invalidations hold, nothing dangles.
scripts/crash_torture.py runs the same trials by the hundred."""
from __future__ import annotations

import json
import random
import subprocess

import pytest

from .child import NEEDS, POINTS, run_trial


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


def _config(point: str, k: int) -> tuple[int, bool, bool]:
    """(call number, small disk, write-back) for the k-th point: early calls, so every point
    is reached; write-back where the hook needs it, and on every third point besides."""
    hook = point.split(":")[0]
    small, wb = NEEDS.get(hook, (k % 4 == 3, k % 3 == 1))
    rare = "quarantine" in hook  # only after a deliberate corruption: a few calls per run
    return 1 if rare else 1 + k % 3, small, wb


@pytest.mark.slow
@pytest.mark.parametrize("k,point", list(enumerate(POINTS)))
def test_sigkill_at_each_step(tmp_path, k, point):
    """Every step of put, evict, demote, write-back, invalidate and quarantine, killed just
    before and just after its call; the trial counts only if that kill fired."""
    n, small, wb = _config(point, k)
    r = run_trial(tmp_path, 77 + k, ops=300, small_disk=small, point=point, n=n, write_back=wb)
    assert r["killed"], f"{point}#{n} (small={small}, write-back={wb}) was never reached: {r}"
    assert r["problems"] == [], (point, r)


def test_kill_points_hook_their_own_calls_not_pwrite(tmp_path):
    """The first page write kills before any page is written, but after the segment's
    header was written (create_segment's own pwrite is not a kill point)."""
    from tierkv.tiers.segments import read_header

    r = run_trial(tmp_path, 5, ops=60, point="page-run-write:before", n=1)
    assert r["killed"] and r["problems"] == [], r
    segs = list((tmp_path / "home" / "segments").glob("seg-*"))
    assert segs == [] or all(read_header(p).segment_pages for p in segs)  # reclaimed or whole


@pytest.mark.slow
def test_sigkill_in_write_back_mode(tmp_path):
    rng = random.Random(99)
    for i in range(3):
        r = run_trial(tmp_path / f"wb{i}", rng.randrange(10**6), kill_after_acks=rng.randint(1, 4), write_back=True)
        assert r["killed"] and r["problems"] == [], r


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
    out = subprocess.run([sys.executable, str(script), "--killed", "2", "--workdir", str(tmp_path), "--seed", "3", "--json"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["killed"] == 2 and summary["failed"] == 0
