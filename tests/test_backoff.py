"""tierkv.backoff: doubling waits up to a ceiling, reset by a success."""
from __future__ import annotations

import pytest

from tierkv.backoff import Backoff


def test_doubles_to_the_ceiling_and_resets():
    now = [10.0]
    b = Backoff(0.5, 2.0, clock=lambda: now[0])
    assert b.ready()
    assert [b.failed() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
    assert not b.ready()
    now[0] += 2.0
    assert b.ready()
    b.attempt()  # one try at a time: others wait the current delay, which does not double
    assert not b.ready() and b.delay_s == 2.0
    b.succeeded()
    assert b.ready() and b.delay_s == 0.5
    b.check_integrity()


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        Backoff(0.0, 1.0)
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)
