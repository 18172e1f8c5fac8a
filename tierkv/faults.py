"""Named fault points: the places in the store where a test makes a step fail, or the
process die, without patching the store's methods.

    fault_point("placement.evict:before")          # in the store: a no-op unless armed

    with faults.armed("placement.evict:before", kill):   # in a test (or a crash child)
        store.put(...)

Why not ``mock.patch``: the store's per-block modules are compiled with mypyc
(tierkv/compiled.py), a compiled class cannot be patched at run time, and its calls to its
own methods skip a patch set on the class. A named point also marks in the code where a
crash must be survivable. Only tests arm points; nothing reads the environment here (a
crash child arms the points it is told to on its command line: tests/store/child.py).

Cost: unarmed (always, outside tests) a call is one check of a module global for None.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

# Every name passed to fault_point in tierkv; arm() refuses others, so that a renamed point
# fails its test instead of arming nothing (tests/test_fault_points.py checks both ways).
# "<step>:before" runs first thing in the step; "<step>:after" when it returns (not when it
# raises), as a hook around the method would.
POINTS = frozenset({
    f"placement.{step}:{when}"
    for step in ("evict", "demote", "write_back", "retire", "quarantine") for when in ("before", "after")
})

Action = Callable[[], None]
_armed: dict[str, Action] | None = None  # None: nothing armed, the only state outside tests


def fault_point(name: str) -> None:
    """Run the action armed at ``name``, if any: it may raise (the step fails there) or kill
    the process (a crash there). Unarmed, nothing happens."""
    if _armed is None:
        return
    action = _armed.get(name)
    if action is not None:
        action()


def arm(name: str, action: Action) -> None:
    """Make ``fault_point(name)`` call ``action`` (replacing an action armed there before).
    Raises ValueError for a name that is no fault point."""
    global _armed
    if name not in POINTS:
        raise ValueError(f"{name!r} is not a fault point; known: {', '.join(sorted(POINTS))}")
    _armed = {**(_armed or {}), name: action}


def disarm(name: str) -> None:
    """Make ``fault_point(name)`` a no-op again."""
    global _armed
    rest = {k: v for k, v in (_armed or {}).items() if k != name}
    _armed = rest or None


@contextmanager
def armed(name: str, action: Action) -> Iterator[None]:
    """``arm(name, action)`` for the ``with`` block."""
    arm(name, action)
    try:
        yield
    finally:
        disarm(name)
