"""Continuous batching's admission: FIFO into free slots, refills in groups while a batch runs."""

import pytest

from verifier.engine.request import Request, Status
from verifier.engine.scheduler import MAX_REFILL_WAIT_STEPS, Scheduler
from verifier.step.sampling import SamplingParams


def _req(i: int) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams())


def _finish(s: Scheduler, n: int) -> None:
    for r in s.running[:n]:
        r.status = Status.FINISHED
    s.release_finished()


def test_refills_wait_for_a_group_of_free_slots():
    s = Scheduler(8, refill_group=4)
    for i in range(12):
        s.add(_req(i))
    first = s.admit()  # nothing runs yet: fill every slot at once
    assert [r.req_id for r in first] == [f"r{i}" for i in range(8)] and sorted(r.slot for r in first) == list(range(8))
    _finish(s, 2)
    assert s.admit() == []  # 2 free slots < the group of 4, and 4 are waiting
    _finish(s, 2)
    got = s.admit()  # 4 free: they join together, in FIFO order
    assert [r.req_id for r in got] == ["r8", "r9", "r10", "r11"] and len(s.running) == 8


def test_refills_never_wait_longer_than_the_cap_or_for_more_than_is_waiting():
    s = Scheduler(8, refill_group=4)
    for i in range(10):
        s.add(_req(i))
    s.admit()
    _finish(s, 1)
    for _ in range(MAX_REFILL_WAIT_STEPS):
        assert s.admit() == []
    assert [r.req_id for r in s.admit()] == ["r8"]  # held back MAX_REFILL_WAIT_STEPS steps, no more
    _finish(s, 1)
    assert [r.req_id for r in s.admit()] == ["r9"]  # the only one waiting: it all fits, no wait


def test_group_one_admits_at_once_and_bad_groups_are_refused():
    s = Scheduler(4)
    for i in range(5):
        s.add(_req(i))
    s.admit()
    _finish(s, 1)
    assert [r.req_id for r in s.admit()] == ["r4"]
    with pytest.raises(ValueError, match="refill_group"):
        Scheduler(4, refill_group=5)
    with pytest.raises(ValueError, match="refill_group"):
        Scheduler(4, refill_group=0)
