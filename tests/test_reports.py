"""Bytes moved per path (``stats().bytes_by_path``) are reported by each process to the
controller without waiting, at most every ``REPORT_EVERY`` seconds: moves made within
that window go as one report once it has passed, none is lost, a report the transport
could not send is offered again, and a timer left on an event loop that ended does not
stop later reports. (That a process's own ``stats()`` sees its own moves at once is
tests/test_ray.py's.)"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("ray")

from streamrl.transport.ray.data import REPORT_EVERY, RayDataPlane  # noqa: E402


def _plane(sent: list, taken: list[bool] | None = None) -> RayDataPlane:
    d = RayDataPlane([], None)

    def report(by_path: dict[str, int]) -> bool:
        ok = taken.pop(0) if taken else True
        if ok:
            sent.append(dict(by_path))
        return ok

    d.report_moved = report
    return d


def _total(sent: list, path: str) -> int:
    return sum(s.get(path, 0) for s in sent)


async def test_moves_within_the_window_go_as_one_report_once_it_passed():
    sent: list = []
    d = _plane(sent)
    for _ in range(10):
        d.count_moved({"inline": 100})
    d.count_moved({"shm": 7, "inline": 0})
    assert sent == [{"inline": 100}]  # the first at once, the rest held
    await asyncio.sleep(REPORT_EVERY * 3)
    assert len(sent) == 2 and sent[1] == {"inline": 900, "shm": 7}
    assert d.moved == {"inline": 1000, "shm": 7}  # what this process counts itself


async def test_a_move_after_a_quiet_window_is_reported_at_once():
    sent: list = []
    d = _plane(sent)
    d.count_moved({"inline": 1})
    await asyncio.sleep(REPORT_EVERY * 2)
    d.count_moved({"inline": 2})
    assert sent == [{"inline": 1}, {"inline": 2}]


async def test_report_now_sends_what_is_held_and_cancels_nothing_it_needs():
    sent: list = []
    d = _plane(sent)
    d.count_moved({"shm": 5})
    d.count_moved({"shm": 6})
    d.report_now()  # (what a stats call of this process does first)
    assert _total(sent, "shm") == 11
    await asyncio.sleep(REPORT_EVERY * 2)
    assert _total(sent, "shm") == 11  # the timer found nothing left: nothing twice


async def test_a_report_not_taken_is_offered_again():
    sent: list = []
    d = _plane(sent, taken=[False])  # no connection yet: the first report is refused
    d.count_moved({"inline": 3})
    assert sent == []
    await asyncio.sleep(REPORT_EVERY * 2)
    d.count_moved({"inline": 4})
    await asyncio.sleep(REPORT_EVERY * 2)
    assert _total(sent, "inline") == 7


def test_a_timer_on_an_event_loop_that_ended_does_not_stop_reports():
    sent: list = []
    d = _plane(sent)

    async def burst():
        d.count_moved({"inline": 1})
        d.count_moved({"inline": 2})  # held behind a timer of this loop, which ends

    asyncio.run(burst())
    assert _total(sent, "inline") == 1
    time.sleep(REPORT_EVERY * 2)

    async def later():
        d.count_moved({"inline": 4})
        await asyncio.sleep(REPORT_EVERY * 2)

    asyncio.run(later())
    assert _total(sent, "inline") == 7


def test_without_an_event_loop_a_move_is_reported_at_once():
    sent: list = []
    d = _plane(sent)
    d.count_moved({"rdt": 1})
    d.count_moved({"rdt": 2})
    assert sent == [{"rdt": 1}, {"rdt": 2}]


def test_moves_counted_from_several_threads_are_all_reported_once():
    """A process's plane is shared by its threads (a sync twin's loop thread, an RDT
    reader, the caller's loop): moves counted and reports taken at the same time from
    several of them lose nothing and send nothing twice."""
    import sys
    import threading

    sent: list = []
    d = _plane(sent)
    n, threads = 20_000, 3
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (switch threads as often as possible: races show)
    try:
        def work(path: str) -> None:
            for i in range(n):
                d.count_moved({path: 1, "all": 1})  # (no event loop: reported at once)
                if i % 7 == 0:
                    d.report_now()

        ts = [threading.Thread(target=work, args=(f"p{k}",)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    d.report_now()
    assert _total(sent, "all") == n * threads
    assert all(_total(sent, f"p{k}") == n for k in range(threads))
    assert d.moved["all"] == n * threads
