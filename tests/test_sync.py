"""The blocking twin, :class:`streamrl.sync.StreamQueue`: the same semantics as the async
queue, from the main thread and from many threads at once; blocking calls wake when they
should (room made, queue closed), nothing hangs (every wait here is bounded), and misuse
(a blocking call on the queue's own loop thread, use after shutdown) fails clearly."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

from streamrl.errors import EndOfStream, EventLoopError, QueueClosed, QueueFull, RowsDropped, StreamTimeout
from streamrl.sync import StreamQueue as SyncQueue
from streamrl.sync import SyncBatch, SyncStream

pytestmark = pytest.mark.timeout(60)

JOIN = 20.0  # seconds any thread of a test may take; far above what a healthy run needs


def rows_of(n: int, start: int = 0) -> dict:
    ids = torch.arange(start, start + n)
    return {"idx": ids, "x": ids.float().unsqueeze(1).repeat(1, 3)}


@pytest.fixture
def make_queue():
    made: list[SyncQueue] = []

    def make(**kw) -> SyncQueue:
        kw.setdefault("capacity", 64)
        kw.setdefault("num_shards", 2)
        q = SyncQueue(**kw)
        made.append(q)
        return q

    yield make
    for q in made:
        q.close()
        q.shutdown()


class Worker(threading.Thread):
    """A daemon thread that records its result or exception."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.result = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self):
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.done.set()

    def finish(self, timeout: float = JOIN):
        assert self.done.wait(timeout), f"{self.fn.__name__} did not finish in {timeout}s"
        self.join(timeout)
        return self


def on_loop(q: SyncQueue, fn):
    """Run the plain function ``fn`` on the event loop of the blocking queue ``q``."""
    async def run():
        return fn()

    return asyncio.run_coroutine_threadsafe(run(), q._runner.loop()).result(JOIN)


def wait_until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ---------------------------------------------------------------- main thread


def test_put_get_stream_ack_drop_clear_stats_from_main_thread(make_queue):
    q = make_queue(capacity=16)
    rows = q.put(rows_of(8), partition="p")
    assert isinstance(rows, SyncBatch) and len(rows) == 8
    q.put({"y": torch.arange(8) * 10}, rows=rows)  # a later field of the same rows
    st = q.stats()
    assert st.rows == 8 and st.bytes == 8 * (8 + 12 + 8) and st.put == 8

    mb = q.get("t", ["idx", "x", "y"], batch_size=3, partition="p", timeout=5)
    assert isinstance(mb, SyncBatch) and len(mb) == 3 and mb.leased
    td = mb.materialize()
    idx = td["idx"]
    assert torch.equal(td["x"], idx.float().unsqueeze(1).repeat(1, 3))
    assert torch.equal(td["y"], idx * 10)
    # views are wrapped and blocking too
    assert torch.equal(mb[1:]["y"].materialize(), idx[1:] * 10)
    assert [len(p) for p in mb.split(2)] == [2, 1]
    assert isinstance(mb.split(2)[0], SyncBatch)
    mb.write({"z": idx.float()})
    assert torch.equal(mb.materialize(["z"])["z"], idx.float())
    mb.ack()
    assert not mb.leased
    assert q.stats().tasks["t"].acked == 3

    # the rest through a blocking stream (a plain iterator): every row once in all
    q.seal("p")
    it = q.stream("t", ["idx"], batch_size=2, partition="p", timeout=5)
    assert isinstance(it, SyncStream)
    rest = [b.materialize()["idx"].tolist() for b in it]
    assert [len(r) for r in rest] == [2, 2, 1]
    assert sorted(idx.tolist() + sum(rest, [])) == list(range(8))
    st = q.stats()
    assert st.tasks["t"].delivered == 8 and st.tasks["t"].acked == 8
    with pytest.raises(EndOfStream):
        q.get("t", ["idx"], batch_size=1, partition="p", timeout=5)

    # drop by batch and by ids, then clear the rest
    assert q.drop(rows[:2]) == 2
    ids = rows.rows
    assert q.drop(ids[2:3]) == 1
    st = q.stats()
    assert st.rows == 5 and st.dropped == 3
    with pytest.raises(RowsDropped):
        rows[:2].materialize(["idx"])
    assert q.clear("p") == 5
    st = q.stats()
    assert st.rows == 0 and st.bytes == 0

    # put_nowait raises instead of waiting; put with a timeout gives up
    q.put(rows_of(16, 100), partition="full")
    with pytest.raises(QueueFull):
        q.put_nowait(rows_of(1, 200), partition="full")
    with pytest.raises(StreamTimeout):
        q.put(rows_of(1, 200), partition="full", timeout=0.2)
    assert q.stats().rows == 16


def test_with_stream_acks_on_clean_exit_and_releases_on_exception(make_queue):
    q = make_queue()
    q.put(rows_of(6), partition="p")
    q.seal("p")

    with q.stream("t", ["idx"], batch_size=2, partition="p", timeout=5) as it:
        first = next(it)
        acked_ids = first.materialize()["idx"].tolist()
        assert first.leased
    assert not first.leased
    assert q.stats().tasks["t"].acked == 2

    with pytest.raises(RuntimeError, match="boom"):
        with q.stream("t", ["idx"], batch_size=2, partition="p", timeout=5) as it:
            second = next(it)
            released_ids = second.materialize()["idx"].tolist()
            raise RuntimeError("boom")
    assert not second.leased
    st = q.stats()
    assert st.tasks["t"].acked == 2 and st.leases == 0

    # released rows are delivered again, acknowledged ones never
    rest = []
    for b in q.stream("t", ["idx"], batch_size=4, partition="p", timeout=5):
        rest.extend(b.materialize()["idx"].tolist())
    assert sorted(rest) == sorted(set(range(6)) - set(acked_ids))
    assert set(released_ids) <= set(rest)
    assert q.stats().tasks["t"].acked == 6


# ---------------------------------------------------------------- threads


def test_one_queue_from_four_threads_delivers_exactly_once(make_queue):
    # capacity far below the rows put: producers block until consumers' acks drop rows
    q = make_queue(capacity=16, num_shards=3, consumers=["train"])
    per_producer, chunk = 60, 5

    def producer(base):
        for a in range(base, base + per_producer, chunk):
            q.put(rows_of(chunk, a), partition="p", timeout=JOIN)

    def check(td):
        assert torch.equal(td["x"], td["idx"].float().unsqueeze(1).repeat(1, 3))
        return td["idx"].tolist()

    def stream_consumer():
        seen = []
        for b in q.stream("train", ["idx", "x"], batch_size=7, partition="p", timeout=JOIN):
            seen.extend(check(b.materialize()))
        return seen

    def get_consumer():
        seen = []
        while True:
            try:
                b = q.get("train", ["idx", "x"], batch_size=4, partition="p", timeout=JOIN)
            except EndOfStream:
                return seen
            seen.extend(check(b.materialize()))
            b.ack()

    producers = [Worker(producer, 0), Worker(producer, 1000)]
    consumers = [Worker(stream_consumer), Worker(get_consumer)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.finish()
        assert t.error is None, repr(t.error)
    q.seal("p")
    for t in consumers:
        t.finish()
        assert t.error is None, repr(t.error)

    seen = consumers[0].result + consumers[1].result
    expected = list(range(per_producer)) + list(range(1000, 1000 + per_producer))
    assert len(seen) == len(expected)  # none twice
    assert sorted(seen) == expected  # none lost
    assert consumers[0].result and consumers[1].result  # both threads took part
    st = q.stats()
    assert st.tasks["train"].acked == 2 * per_producer
    assert st.rows == 0 and st.bytes == 0  # consumer-set cleanup freed everything


def test_producer_blocked_on_full_queue_is_released_by_a_drop(make_queue):
    q = make_queue(capacity=4)
    q.put(rows_of(4), partition="p")
    with pytest.raises(QueueFull):
        q.put_nowait(rows_of(1, 50), partition="p")

    producer = Worker(lambda: q.put(rows_of(2, 10), partition="p", timeout=JOIN))
    producer.start()
    wait_until(lambda: q.stats().waiting_puts == 1, what="the producer to wait for room")
    assert not producer.done.wait(0.2), "put returned although the queue is full"

    mb = q.get("t", ["idx"], batch_size=2, partition="p", timeout=5)
    mb.drop()
    producer.finish()
    assert producer.error is None, repr(producer.error)
    assert isinstance(producer.result, SyncBatch) and len(producer.result) == 2
    st = q.stats()
    assert st.rows == 4 and st.waiting_puts == 0


def test_close_wakes_threads_blocked_in_get_stream_and_put(make_queue):
    q = make_queue(capacity=2)
    q.put(rows_of(2), partition="full")

    getter = Worker(lambda: q.get("t", ["never"], batch_size=1, timeout=JOIN))
    streamer = Worker(lambda: [len(b) for b in q.stream("s", ["never"], batch_size=1, timeout=JOIN)])
    putter = Worker(lambda: q.put(rows_of(1, 9), partition="full", timeout=JOIN))
    for t in (getter, streamer, putter):
        t.start()
    wait_until(lambda: q.stats().waiting_puts == 1, what="the put to wait")
    time.sleep(0.2)
    assert not any(t.done.is_set() for t in (getter, streamer, putter)), "a waiter returned early"

    q.close()
    for t in (getter, streamer, putter):
        t.finish(10)
    assert isinstance(getter.error, EndOfStream), repr(getter.error)
    assert streamer.error is None and streamer.result == []  # the stream just ends
    assert isinstance(putter.error, QueueClosed), repr(putter.error)
    # close is idempotent, and data already held stays readable until shutdown
    q.close()
    assert q.stats().closed and q.stats().rows == 2


def test_blocking_call_on_the_queues_own_loop_thread_raises(make_queue):
    q = make_queue()
    mb = q.put(rows_of(2), partition="p")
    assert on_loop(q, threading.get_ident) == q._runner.thread_ident != threading.get_ident()
    for call in (q.stats, lambda: q.put(rows_of(1)), mb.materialize, q.shutdown):
        with pytest.raises(EventLoopError, match="queue's own event loop thread.*async API"):
            on_loop(q, call)
    assert issubclass(EventLoopError, RuntimeError)
    # the queue is unharmed
    assert q.stats().rows == 2
    assert mb.materialize()["idx"].tolist() == [0, 1]


def test_shutdown_is_idempotent_and_stops_the_loop_thread():
    q = SyncQueue(capacity=8, num_shards=2)
    q.put(rows_of(3), partition="p")
    ident = q._runner.thread_ident
    assert ident in {t.ident for t in threading.enumerate()}
    q.shutdown()
    q.shutdown()
    wait_until(lambda: ident not in {t.ident for t in threading.enumerate()},
               what="the loop thread to stop")
    assert q.close() == {}  # close after shutdown: nothing to do, no error
    with pytest.raises(QueueClosed, match="shut down"):
        q.stats()
    with pytest.raises(QueueClosed):
        q.put(rows_of(1), partition="p")

    # as a context manager: closed and shut down on exit; shutdown again is a no-op
    with SyncQueue(capacity=8) as q2:
        q2.put(rows_of(2), partition="p")
        ident2 = q2._runner.thread_ident
    wait_until(lambda: ident2 not in {t.ident for t in threading.enumerate()},
               what="the loop thread to stop")
    q2.shutdown()
    with pytest.raises(QueueClosed):
        q2.get("t", ["idx"], batch_size=1, timeout=1)


# ---------------------------------------------------------------- async misuse


async def test_plain_for_over_an_async_stream_says_what_to_use():
    import streamrl

    async with streamrl.StreamQueue(capacity=8, num_shards=1) as q:
        await q.put(rows_of(2), partition="p")
        await q.seal("p")
        stream = q.stream("t", ["idx"], batch_size=2, partition="p", timeout=5)
        with pytest.raises(TypeError, match=r"async for.*streamrl\.sync"):
            for _ in stream:
                pass
        # nothing was taken: the stream still delivers every row
        got = [len(b) async for b in stream]
        assert got == [2]


# ---------------------------------------------------------------- shutdown wakes everyone


def test_shutdown_without_close_wakes_every_blocked_thread_and_returns():
    # issue 15: shutdown() while threads block (no close first) used to hang, both sides
    q = SyncQueue(capacity=2, num_shards=1)
    q.put(rows_of(2), partition="full")
    getter = Worker(lambda: q.get("t", ["never"], batch_size=1))  # no timeout at all
    streamer = Worker(lambda: [len(b) for b in q.stream("s", ["never"], batch_size=1)])
    putter = Worker(lambda: q.put(rows_of(1, 9), partition="full"))
    versioner = Worker(lambda: q.wait_version(5))
    waiters = (getter, streamer, putter, versioner)
    for t in waiters:
        t.start()
    wait_until(lambda: q.stats().waiting_puts >= 1, what="the put to wait")
    time.sleep(0.2)
    assert not any(t.done.is_set() for t in waiters), "a waiter returned early"

    stopper = Worker(q.shutdown)
    stopper.start()
    stopper.finish(10)
    assert stopper.error is None, repr(stopper.error)
    for t in waiters:
        t.finish(10)
    # a queue this object created is closed first: waiters wake as close() wakes them
    assert isinstance(getter.error, EndOfStream), repr(getter.error)
    assert streamer.error is None and streamer.result == []
    assert isinstance(putter.error, QueueClosed), repr(putter.error)
    assert isinstance(versioner.error, QueueClosed), repr(versioner.error)
    with pytest.raises(QueueClosed, match="shut down"):
        q.get("t", ["idx"], batch_size=1)
    q.shutdown()  # idempotent


def test_shutdown_of_a_wrapper_wakes_its_blocked_callers_and_leaves_the_queue_open(make_queue):
    q = make_queue(capacity=8)
    view = SyncQueue.wrap(q.aqueue)  # not owned: its shutdown must not close the queue
    getter = Worker(lambda: view.get("t", ["idx"], batch_size=1, partition="p"))
    streamer = Worker(lambda: [len(b) for b in view.stream("s", ["idx"], batch_size=1,
                                                            partition="p")])
    for t in (getter, streamer):
        t.start()
    time.sleep(0.3)
    assert not getter.done.is_set() and not streamer.done.is_set()

    stopper = Worker(view.shutdown)
    stopper.start()
    stopper.finish(10)
    assert stopper.error is None, repr(stopper.error)
    for t in (getter, streamer):
        t.finish(10)
        assert isinstance(t.error, QueueClosed), repr(t.error)
    with pytest.raises(QueueClosed, match="shut down"):
        view.stats()

    # the queue itself is open, and the given-up waits took nothing: rows go to others
    assert not q.stats().closed
    q.put(rows_of(1), partition="p")
    mb = q.get("t", ["idx"], batch_size=1, partition="p", timeout=5)
    assert mb.materialize()["idx"].tolist() == [0]
    mb.ack()
    assert q.stats().leases == 0


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_an_interrupted_blocking_call_is_given_up_and_takes_nothing(make_queue):
    q = make_queue(capacity=8)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            q.get("t", ["idx"], batch_size=1, partition="p")  # no rows: waits
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # the given-up get is cancelled on the loop: it does not take the next row
    q.put(rows_of(1), partition="p")
    mb = q.get("t", ["idx"], batch_size=1, partition="p", timeout=5)
    assert mb.materialize()["idx"].tolist() == [0]
    mb.ack()
    st = q.stats()
    assert st.leases == 0 and st.tasks["t"].delivered == 1


# ---------------------------------------------------------------- wrap of an embedded queue


def run_with_deadline(coro_fn, timeout: float = JOIN):
    """asyncio.run(coro_fn()) on a thread of its own, so a hang fails instead of blocking."""
    w = Worker(lambda: asyncio.run(coro_fn()))
    w.start()
    w.finish(timeout)
    if w.error is not None:
        raise w.error
    return w.result


async def until(pred, timeout: float = JOIN, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_wrap_embedded_consumer_thread_and_producer_in_the_owner_loop():
    # issue 16: wake-ups were lost across loops: the consumer got rows only at its timeout
    import streamrl

    async def main():
        q = streamrl.StreamQueue(capacity=4, num_shards=2, consumers=["t"])
        view = SyncQueue.wrap(q)  # from a coroutine of the loop that owns q

        def consume():
            seen = []
            for b in view.stream("t", ["idx", "x"], batch_size=2, partition="p", timeout=JOIN):
                td = b.materialize()
                assert torch.equal(td["x"], td["idx"].float().unsqueeze(1).repeat(1, 3))
                seen.extend(td["idx"].tolist())
            return seen

        consumer = Worker(consume)
        consumer.start()
        await asyncio.sleep(0.2)  # the consumer is blocked before anything is put
        t0 = time.monotonic()
        for a in range(0, 40, 2):  # 10x the capacity: the producer waits for the acks
            await q.put(rows_of(2, a), partition="p", timeout=JOIN)
        await q.seal("p")
        await until(consumer.done.is_set, what="the consumer thread")
        elapsed = time.monotonic() - t0
        assert consumer.error is None, repr(consumer.error)
        assert sorted(consumer.result) == list(range(40))
        st = await q.stats()
        assert st.rows == 0 and st.tasks["t"].acked == 40
        await q.close()
        return elapsed

    elapsed = run_with_deadline(main)
    assert elapsed < 10, f"took {elapsed:.1f}s: wake-ups were lost"


def test_wrap_embedded_producer_thread_and_consumer_in_the_owner_loop():
    import streamrl

    async def main():
        q = streamrl.StreamQueue(capacity=4, num_shards=2, consumers=["t"])
        await q.stats()  # used in this loop first: wrap finds it without being told
        view = SyncQueue.wrap(q)

        def produce():
            for a in range(0, 40, 2):
                view.put(rows_of(2, a), partition="p", timeout=JOIN)  # waits for room
            view.seal("p")

        producer = Worker(produce)
        producer.start()
        seen = []
        t0 = time.monotonic()
        async for b in q.stream("t", ["idx"], batch_size=2, partition="p", timeout=JOIN):
            seen.extend((await b.materialize())["idx"].tolist())
        elapsed = time.monotonic() - t0
        await until(producer.done.is_set, what="the producer thread")
        assert producer.error is None, repr(producer.error)
        assert sorted(seen) == list(range(40))
        await q.close()
        return elapsed

    elapsed = run_with_deadline(main)
    assert elapsed < 10, f"took {elapsed:.1f}s: wake-ups were lost"


def test_wrap_embedded_needs_its_loop_running_and_says_so():
    import streamrl

    # not used by any loop yet, wrapped outside any loop: no loop to send calls to
    q = streamrl.StreamQueue(capacity=8, num_shards=1)
    view = SyncQueue.wrap(q)
    with pytest.raises(EventLoopError, match="not run in any event loop yet"):
        view.stats()

    # given its loop explicitly (running on another thread): works from here
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        view = SyncQueue.wrap(q, loop=loop)
        view.put(rows_of(2), partition="p")
        mb = view.get("t", ["idx"], batch_size=2, partition="p", timeout=5)
        assert mb.materialize()["idx"].tolist() == [0, 1]
        mb.ack()

        # a queue that ran in that loop is found there, wrapped from outside any loop
        q2 = streamrl.StreamQueue(capacity=8, num_shards=1)
        asyncio.run_coroutine_threadsafe(q2.put(rows_of(1), partition="p"), loop).result(JOIN)
        view2 = SyncQueue.wrap(q2)
        assert view2.get("t", ["idx"], batch_size=1, partition="p", timeout=5).rows == [0]

        # a call blocked while the loop stops: an error soon, not a hang
        blocked = Worker(lambda: view.get("t", ["idx"], batch_size=1, partition="p"))
        blocked.start()
        time.sleep(0.3)
        assert not blocked.done.is_set()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(JOIN)
    blocked.finish(10)
    assert isinstance(blocked.error, EventLoopError), repr(blocked.error)
    assert "stopped while this blocking call waited" in str(blocked.error)
    # and a call made while it is not running is refused at once
    with pytest.raises(EventLoopError, match="not running"):
        view.stats()
    loop.close()
    with pytest.raises(EventLoopError, match="closed"):
        view.stats()


def test_wrap_embedded_caller_blocked_when_asyncio_run_returns_gets_an_error():
    import streamrl

    box = {}

    async def main():
        q = streamrl.StreamQueue(capacity=8, num_shards=1)
        view = SyncQueue.wrap(q)
        blocked = Worker(lambda: view.get("t", ["idx"], batch_size=1))
        blocked.start()
        await asyncio.sleep(0.3)
        box["w"] = blocked
        # returns with the get still waiting: asyncio.run cancels it

    run_with_deadline(main)
    blocked = box["w"].finish(10)
    assert isinstance(blocked.error, EventLoopError), repr(blocked.error)


# ---------------------------------------------------------------- deadlock detection


def test_blocking_call_inside_the_loop_that_owns_the_queue_raises():
    # issue 17: a blocking get from the loop that runs the producer deadlocked silently
    import streamrl

    async def main():
        q = streamrl.StreamQueue(capacity=8, num_shards=1)
        view = SyncQueue.wrap(q)

        async def producer():
            await asyncio.sleep(0.05)
            await q.put(rows_of(2), partition="p")

        task = asyncio.create_task(producer())
        t0 = time.monotonic()
        with pytest.raises(EventLoopError, match="inside the event loop that owns.*async API"):
            view.get("t", ["idx"], batch_size=2, partition="p", timeout=5)
        assert time.monotonic() - t0 < 1
        await task
        mb = await asyncio.to_thread(view.get, "t", ["idx"], 2, partition="p", timeout=5)
        with pytest.raises(EventLoopError):
            mb.materialize()  # a batch of the view, from inside the loop: refused too
        assert (await mb.remote.materialize())["idx"].tolist() == [0, 1]
        await asyncio.to_thread(mb.ack)

        # from a plain callback of that loop as well
        fut = asyncio.get_running_loop().create_future()

        def callback():
            try:
                view.stats()
            except BaseException as e:  # noqa: BLE001
                fut.set_result(e)
            else:
                fut.set_result(None)

        asyncio.get_running_loop().call_soon(callback)
        assert isinstance(await fut, EventLoopError)
        await q.close()

    run_with_deadline(main)


# ---------------------------------------------------------------- Ray: wrap and connect


def needs_ray():
    pytest.importorskip("ray")
    if os.environ.get("STREAMRL_SKIP_RAY") == "1":
        pytest.skip("STREAMRL_SKIP_RAY=1")


@pytest.mark.ray
def test_ray_wrapper_and_connection_shutdown_wake_their_callers_and_leave_the_queue(request):
    needs_ray()
    request.getfixturevalue("ray_session")
    owner = SyncQueue(transport="ray", capacity=8, num_shards=1, name="sync-twin-wrap")
    try:
        # a wrap of the creating process's own queue (its own loop thread: Ray queues are
        # usable from any loop), blocked in get, then shut down
        view = SyncQueue.wrap(owner.aqueue)
        assert view._runner.owns_loop
        getter = Worker(lambda: view.get("t", ["idx"], batch_size=1, partition="p"))
        getter.start()
        time.sleep(0.5)
        assert not getter.done.is_set()
        stopper = Worker(view.shutdown)
        stopper.start()
        stopper.finish(20)
        assert stopper.error is None, repr(stopper.error)
        getter.finish(20)
        assert isinstance(getter.error, QueueClosed), repr(getter.error)

        # connect by name: a blocking queue that does not own the actors
        other = SyncQueue.connect("sync-twin-wrap", namespace="streamrl-tests")
        assert isinstance(other, SyncQueue) and other.transport == "ray"
        other.put(rows_of(2), partition="p")
        other.shutdown()

        # neither shutdown closed the queue or killed its actors; the given-up get took
        # nothing
        assert not owner.stats().closed
        mb = owner.get("t", ["idx"], batch_size=2, partition="p", timeout=20)
        assert sorted(mb.materialize()["idx"].tolist()) == [0, 1]
        mb.ack()
    finally:
        owner.close()
        owner.shutdown()
