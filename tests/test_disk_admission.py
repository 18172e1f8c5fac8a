"""The disk admission rules (tierkv/disk_admission.py) on their own: what each answers,
and the bounds on what they remember."""
from __future__ import annotations

from tierkv.disk_admission import AdmitEither, AdmitReused, DiskAdmission


def test_all_admits_everything():
    rule: DiskAdmission[int] = DiskAdmission()
    assert rule.stored(1) and rule.leaving(1, False)


def test_reused_lets_a_one_off_go_and_takes_it_when_it_returns():
    rule = AdmitReused[int](pending=4, ghost=4)
    assert not rule.stored(1)  # not yet reused: stays in memory only
    assert not rule.leaving(1, False)  # left memory unserved: let go, remembered
    assert rule.stored(1)  # put again while remembered: reuse, written at once
    assert rule.leaving(1, True)  # no longer pending: nothing to judge


def test_reused_writes_back_a_block_served_since_it_was_stored():
    rule = AdmitReused[int](pending=4, ghost=4)
    assert not rule.stored(7)
    rule.served(7, from_disk=False)
    assert rule.leaving(7, False)


def test_reused_memory_is_bounded():
    rule = AdmitReused[int](pending=3, ghost=2)
    for k in range(10):
        rule.stored(k)
        rule.check_integrity()
    assert rule.leaving(0, False)  # forgotten (the oldest of more than 3 pending): written back as under "all"
    for k in range(7, 10):
        assert not rule.leaving(k, False)
        rule.check_integrity()
    assert not rule.stored(7)  # pushed out of the 2-key ghost by 8 and 9
    assert rule.stored(9)


def test_either_answers_as_told_and_keeps_judging_in_both():
    rule = AdmitEither[int](disk=4, host=2)
    assert rule.stored(1)  # "all": written, though "reused" would not have
    assert rule.leaving(1, True)  # on disk; "reused" lets it go, so it is remembered
    rule.choice = "reused"
    assert rule.stored(1)  # back while remembered: reuse
    assert not rule.stored(2)
    rule.served(2, from_disk=False)
    assert rule.leaving(2, False)
    assert not rule.stored(3) and not rule.leaving(3, False)
    rule.choice = "all"
    assert rule.stored(4) and rule.leaving(4, False)
    rule.check_integrity()
