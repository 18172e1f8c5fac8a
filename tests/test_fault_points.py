"""Named fault points (tierkv/faults.py): no-ops until armed, armed only by name, and every
name a test can arm is a call in the store (and the other way round)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tierkv import faults

ROOT = Path(__file__).resolve().parents[1]
CALL = re.compile(r"""fault_point\(["']([^"']+)["']\)""")


def test_a_point_runs_its_action_only_while_armed():
    hits: list[str] = []
    faults.fault_point("placement.evict:before")  # unarmed: nothing
    with faults.armed("placement.evict:before", lambda: hits.append("evict")):
        faults.fault_point("placement.evict:before")
        faults.fault_point("placement.evict:after")  # another point: not armed
    faults.fault_point("placement.evict:before")
    assert hits == ["evict"]
    assert faults._armed is None  # back to the one-check state


def test_an_armed_point_can_fail_the_step_and_is_disarmed_after_it():
    def boom() -> None:
        raise OSError(5, "EIO")

    with pytest.raises(OSError):
        with faults.armed("placement.retire:after", boom):
            faults.fault_point("placement.retire:after")
    faults.fault_point("placement.retire:after")  # disarmed by the with, despite the error
    assert faults._armed is None


def test_arming_a_name_that_is_no_point_is_refused():
    with pytest.raises(ValueError, match="not a fault point"):
        faults.arm("placement.evict", lambda: None)  # no ":before"
    assert faults._armed is None


def test_every_point_is_called_in_the_store_and_every_call_is_a_point():
    called: dict[str, list[str]] = {}
    for path in (ROOT / "tierkv").rglob("*.py"):
        for name in CALL.findall(path.read_text()):
            called.setdefault(name, []).append(path.name)
    assert set(called) == faults.POINTS
