"""The RDT transport on gloo (CPU): held tensor fields moved between actors of one group.

One group of actors serves the module (a process joins one RDT group for its life, and
making one costs seconds here): four async producers, an async consumer, a synchronous
consumer (the blocking twin) and a producer that is killed. Two tests make groups of
their own: the one of groups that cannot be made or are destroyed, and the one of the
naive design (transfers bypassing the serialising thread), which may kill its actors.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest
import torch

import streamrl
from polling import wait_for
from streamrl.errors import CheckpointError, RowsLost

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

W = 4096  # same-size rows: 16 KiB of float32
PUTS = int(os.environ.get("STREAMRL_RDT_PUTS", "8"))  # concurrent puts per producer, stress
CHURN = int(os.environ.get("STREAMRL_RDT_CHURN", "24"))  # puts per producer, leak check


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Producer:
    """Async producer: ``puts`` concurrent puts, each of rows with a same-size field ``x``,
    a mixed-size (ragged) field ``v`` and ids; returns each row's digests."""

    async def run(self, q, who: int, puts: int, part: str, ragged: bool = True,
                  rows_per_put: int = 3, width: int = W):
        gen = torch.Generator().manual_seed(who)
        sums: dict[int, tuple] = {}

        async def one(i):
            n = rows_per_put
            uid = torch.arange(n) + (who * 1000 + i * 10)
            x = torch.randn(n, width, generator=gen)
            cols = {"x": x, "uid": uid}
            if ragged:
                # mostly small rows (packed into one message), a few of over 1 MiB
                # (messages of their own)
                v = [torch.randn(300_000 if (i % 4 == 0 and r == 0) else
                                 int(torch.randint(1, 20000, (1,), generator=gen)),
                                 generator=gen)
                     for r in range(n)]
                cols["v"] = v
            for r in range(n):
                sums[int(uid[r])] = (digest(x[r]), digest(cols["v"][r]) if ragged else None)
            await q.put(cols, partition=part)

        await asyncio.gather(*[one(i) for i in range(puts)])
        return sums

    async def churn(self, q, rounds: int, part: str, seed: int):
        """Puts of 2 rows (64 KiB field ``x``), every other one cancelled at a random
        point; the digests of the rows whose put completed."""
        import random

        rnd = random.Random(seed)
        sums = {}
        for i in range(rounds):
            x = torch.randn(2, 1 << 14)
            uid = torch.tensor([seed * 10000 + 2 * i, seed * 10000 + 2 * i + 1])
            task = asyncio.ensure_future(q.put({"x": x, "uid": uid}, partition=part))
            if i % 2:
                await asyncio.sleep(rnd.random() * 0.01)
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                continue
            sums.update({int(u): digest(r) for u, r in zip(uid, x)})
        return sums

    def hold(self, n: int, nbytes: int, seed: int):
        """Hold ``n`` tensors of ``nbytes`` (distinct contents) in this process's holder;
        their references and digests."""
        from streamrl.transport.rdt import runtime

        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            ref, _ = runtime().hold(t)
            out.append((ref, digest(t)))
        return out

    def free(self, refs):
        from streamrl.transport.rdt import runtime

        runtime().free([r.key for r in refs])

    def held(self):
        from streamrl.transport.rdt import holder_stats

        return holder_stats()

    def pid(self):
        return os.getpid()

    def stall(self, seconds: float):
        """Keep this process's transfer thread busy for ``seconds`` (its sends wait)."""
        from streamrl.transport.rdt import runtime

        runtime().thread.call(lambda: time.sleep(seconds))

    def set_bypass(self, on: bool):
        from streamrl.transport.rdt.runtime import set_bypass

        return set_bypass(on)

    def group_name(self):
        """The RDT group this process is in (``None``: none)."""
        from streamrl.transport.rdt import current

        rt = current()
        return rt.group.name if rt is not None and rt.group is not None else None

    async def feed(self, q, part: str, n: int):
        """The suite's producer role: rows ``idx`` and ``prompt`` in puts of 8, then seal."""
        for i in range(0, n, 8):
            await q.put({"idx": torch.arange(i, i + 8), "prompt": torch.arange(i, i + 8).float()},
                        partition=part)
        await q.seal(part)

    async def role(self, q, task: str, fields, batch_size: int, part: str, fn):
        """A role of the suite's pipeline: every batch of ``task`` materialized, and
        ``fn(td)`` written to its rows (``None``: the batch is checked and dropped);
        the ``idx`` of the rows dropped."""
        return await role(q, task, fields, batch_size, part, fn)


async def role(q, task, fields, batch_size, part, fn):
    done = []
    async for mb in q.stream(task, fields, batch_size, partition=part, timeout=120):
        td = await mb.materialize()
        out = fn(td)
        if out is None:
            done.extend(td["idx"].tolist())
            await mb.drop()
        else:
            await mb.write(out)
    return done


def generate(td):
    return {"response": td["prompt"] * 2}


def reward(td):
    return {"reward": td["response"] + 1}


def ref_lp(td):
    return {"ref_lp": td["prompt"] - td["response"]}


def train(td):
    assert torch.equal(td["reward"], td["prompt"] * 2 + 1)
    assert torch.equal(td["ref_lp"], -td["prompt"])
    assert torch.equal(td["prompt"], td["idx"].float())
    return None


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Consumer:
    """Async consumer: ``workers`` concurrent readers, each materializing batches."""

    async def run(self, q, part: str, workers: int, batch_size: int, fields, timeout=60):
        got: dict[int, tuple] = {}
        errors: list[str] = []

        async def worker():
            while True:
                try:
                    mb = await q.get("t", fields, batch_size=batch_size, partition=part,
                                     timeout=timeout)
                except (streamrl.errors.EndOfStream, streamrl.errors.QueueClosed):
                    return
                except streamrl.errors.StreamRLError as e:
                    errors.append(repr(e))
                    return
                try:
                    td = await mb.materialize()
                except Exception as e:  # noqa: BLE001 - reported
                    errors.append(f"{type(e).__name__}: {e}")
                    await mb.drop()
                    continue
                vs = td["v"].unbind() if "v" in fields else [None] * len(td)
                for uid, x, v in zip(td["uid"].tolist(), td["x"], vs):
                    got[uid] = (digest(x), digest(v) if v is not None else None)
                await mb.ack()

        await asyncio.gather(*[worker() for _ in range(workers)])
        return got, errors

    def moved(self, q):
        """The bytes this process's reads moved per path, and those not reported yet (a
        test's message, when the queue's tally of them falls short)."""
        data = q._transport.data
        return dict(data.moved), dict(data._unreported)


    async def read_cancelling(self, q, part: str, seed: int):
        """Read every row in batches of 4; each materialize is first cancelled at a random
        point, then done again. The digests read."""
        import random

        rnd = random.Random(seed)
        got = {}
        while True:
            try:
                mb = await q.get("t", ["x", "uid"], batch_size=4, partition=part, timeout=30)
            except streamrl.errors.EndOfStream:
                return got
            task = asyncio.ensure_future(mb.materialize())
            await asyncio.sleep(rnd.random() * 0.01)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            td = await mb.materialize()
            got.update({u: digest(x) for u, x in zip(td["uid"].tolist(), td["x"])})
            await mb.ack()

    async def read_losing(self, q, part: str, workers: int, batch_size: int, timeout=60):
        """``workers`` concurrent readers of ``x`` (held) and ``uid`` (through the
        units). A batch whose read raises RowsLost has its other rows read again. The
        digests read, the uids lost (with the holder named), and any other errors."""
        got: dict[int, str] = {}
        lost: dict[int, str] = {}
        errors: list[str] = []
        self.reading = 0

        async def worker():
            while True:
                try:
                    mb = await q.get("t", ["x", "uid"], batch_size=batch_size, partition=part,
                                     timeout=timeout)
                except (streamrl.errors.EndOfStream, streamrl.errors.QueueClosed):
                    return
                except streamrl.errors.StreamRLError as e:
                    errors.append(repr(e))
                    return
                uids = (await mb.materialize(["uid"]))["uid"].tolist()
                keep = list(range(len(mb)))
                self.reading += 1
                try:
                    td = await mb.materialize(["x"])
                except RowsLost as e:
                    gone = set(e.rows)
                    lost.update({u: e.holder for r, u in zip(mb.rows, uids) if r in gone})
                    keep = [i for i, r in enumerate(mb.rows) if r not in gone]
                    td = await mb[keep].materialize(["x"]) if keep else None
                except Exception as e:  # noqa: BLE001 - reported
                    errors.append(f"{type(e).__name__}: {e}")
                    td = None
                finally:
                    self.reading -= 1
                if td is not None:
                    got.update({uids[i]: digest(x) for i, x in zip(keep, td["x"])})
                try:
                    await mb.ack()
                except streamrl.errors.StreamRLError as e:
                    errors.append(repr(e))

        await asyncio.gather(*[worker() for _ in range(workers)])
        return got, lost, errors

    def busy(self):
        """Reads of held fields in progress (of :meth:`read_losing`)."""
        return getattr(self, "reading", 0)

    async def role(self, q, task: str, fields, batch_size: int, part: str, fn):
        """A role of the suite's pipeline (see :func:`role`)."""
        return await role(q, task, fields, batch_size, part, fn)

    def held(self):
        from streamrl.transport.rdt import holder_stats

        return holder_stats()

    def set_bypass(self, on: bool):
        from streamrl.transport.rdt.runtime import set_bypass

        return set_bypass(on)


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class SyncConsumer:
    """A synchronous actor reading through the blocking twin."""

    def run(self, q, part: str):
        from streamrl.sync import StreamQueue as SyncQueue

        sq = SyncQueue.wrap(q)
        got = {}
        try:
            for mb in sq.stream("s", ["x", "uid"], batch_size=4, partition=part, timeout=60):
                td = mb.materialize()
                for uid, x in zip(td["uid"].tolist(), td["x"]):
                    got[uid] = digest(x)
        finally:
            sq.shutdown()
        return got

    def held(self):
        from streamrl.transport.rdt import holder_stats

        return holder_stats()

    def role(self, q, task: str, fields, batch_size: int, part: str, fn):
        """:func:`role` through the blocking twin."""
        from streamrl.sync import StreamQueue as SyncQueue

        sq = SyncQueue.wrap(q)
        try:
            for mb in sq.stream(task, fields, batch_size, partition=part, timeout=120):
                mb.write(fn(mb.materialize()))
        finally:
            sq.shutdown()


def test_reads_plan_few_messages_and_no_copies_of_big_ranges():
    """One read of a holder: touching ranges of a tensor merge; ranges of 1 MiB or more
    are messages of their own, the small ones share one packed message."""
    from streamrl.transport.rdt.data import coalesce
    from streamrl.transport.rdt.runtime import ALIGN, BIG, layout, plan

    merged, where = coalesce([(1, 100, 50), (1, 0, 100), (2, 0, 10), (1, 200, 5)])
    assert merged == [(1, 0, 150), (1, 200, 5), (2, 0, 10)]
    assert where == [(0, 100), (0, 0), (2, 0), (1, 0)]
    sizes = [10, BIG, 3, 2 * BIG, 0]
    assert plan(sizes) == [[1], [3], [0, 2, 4]]
    offs, total = layout([10, 3, 0])
    assert offs == [0, ALIGN, 2 * ALIGN] and total == 2 * ALIGN
    assert layout([BIG + 1]) == ([0], BIG + 1)  # alone: not padded, not copied


@pytest.mark.parametrize("transport", ["rdt"], indirect=True)
async def test_a_row_dropped_during_a_read_is_the_only_row_reported_dropped(make_queue,
                                                                          monkeypatch):
    """Rows of one holder in separate held tensors (four one-row puts); one is dropped
    after the storage unit answered the read and before the holder is read. The read
    raises RowsDropped naming that row only: it named all four, so a consumer that skips
    the rows named and acknowledges its batch (as the error says to) consumed three rows
    it never read. The others read back, and the queue holds them until they are
    consumed."""
    from streamrl.errors import RowsDropped
    from streamrl.transport.rdt import holder_stats
    from streamrl.transport.rdt.data import RdtDataPlane

    q = make_queue(capacity=64, num_shards=1, consumers=["t"])
    rows = [(await q.put({"sid": torch.tensor([i]), "x": torch.full((1, 16), float(i))},
                         partition="p")).rows[0] for i in range(4)]
    mb = await q.get("t", ["sid", "x"], 4, partition="p", timeout=30)
    read = RdtDataPlane._fetch_ranges

    async def dropped_first(self, ref0, ranges, items):
        monkeypatch.setattr(RdtDataPlane, "_fetch_ranges", read)
        held = holder_stats()["tensors"]
        await q.drop([rows[0]])
        # (the holder frees the row's tensor: it is gone before the read)
        async def freed():
            return holder_stats()["tensors"] < held

        assert await wait_for(freed, timeout=10)
        return await read(self, ref0, ranges, items)

    monkeypatch.setattr(RdtDataPlane, "_fetch_ranges", dropped_first)
    with pytest.raises(RowsDropped) as e:
        await mb.materialize()
    assert e.value.rows == [rows[0]]
    keep = mb[[i for i, r in enumerate(mb.rows) if r not in e.value.rows]]
    assert (await keep.materialize())["sid"].tolist() == [1, 2, 3]
    await mb.ack()
    st = await q.stats()
    assert (st.rows, st.dropped_by.get("dropped"), st.consumed) == (0, 1, 3)


def test_a_transfer_whose_peer_is_gone_is_given_up_and_the_next_ones_run():
    """The transfer thread's watchdog: an operation blocked on a peer the group says is
    gone is given up (its waiter fails with HolderGone) and the operations after it run
    on a new thread, in order; one whose peer is alive but slow is waited for. (Killed
    processes make gloo fail at once; this is for peers that vanish without closing
    their sockets, a lost node, which one machine cannot stage.)"""
    import concurrent.futures
    import threading

    from streamrl.transport.rdt.runtime import HolderGone, TransferThread

    asked = []

    def gone(rank):
        asked.append(rank)
        return rank == 3

    th = TransferThread(gone, check=0.05)
    stuck, waiter = threading.Event(), concurrent.futures.Future()
    ran = []
    th.submit(2, lambda: ran.append(2), peer=4)  # early: waits for 1
    th.submit(1, stuck.wait, peer=3, abandon=waiter.set_exception)  # a dead peer
    th.submit(3, lambda: (time.sleep(0.3), ran.append(3)), peer=4)  # a slow, live peer
    with pytest.raises(HolderGone, match="member 3 is gone"):
        waiter.result(10)
    deadline = time.monotonic() + 10
    while len(ran) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == [2, 3] and th.abandoned == 1 and 4 in asked
    stuck.set()  # the abandoned thread returns, and leaves
    th.submit(4, lambda: ran.append(4))
    while len(ran) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == [2, 3, 4]
    time.sleep(0.1)
    assert [t.name for t in threading.enumerate()].count("streamrl-rdt-transfer") == 1


def test_rdt_options_are_checked_up_front():
    from streamrl.errors import InvalidArgument
    from streamrl.transport.rdt.transport import rdt_options

    spec, rest = rdt_options({"rdt_fields": ["logits"], "namespace": "n"}, all_fields=False)
    assert spec.fields == ("logits",) and not spec.hold_anywhere and rest == {"namespace": "n"}
    assert rdt_options({}, all_fields=True)[0].fields is None
    for bad in ({"rdt_fields": "logits"}, {"rdt_fields": [1]}, {"rdt_hold_anywhere": 1},
                {"rdt_fields": ["x"], "direct_calls": False}):
        with pytest.raises(InvalidArgument):
            rdt_options(bad, all_fields=False)


@pytest.fixture(scope="module")
def group(ray_session):
    """One RDT group: 4 producers, an async consumer, a sync consumer, a victim producer."""
    from streamrl.transport.rdt import create_group

    producers = [Producer.remote() for _ in range(4)]
    consumer, sync_consumer, victim = Consumer.remote(), SyncConsumer.remote(), Producer.remote()
    actors = [*producers, consumer, sync_consumer, victim]
    g = create_group(actors, "gloo")
    yield {"group": g, "producers": producers, "consumer": consumer, "sync": sync_consumer,
           "victim": victim}
    g.destroy()
    for a in actors:
        ray.kill(a)


async def stress(q, producers, consumer) -> tuple[dict, dict, list]:
    """The stress test's body: 4 async producers x ``PUTS`` concurrent puts of rows with
    a same-size field ``x`` and a mixed-size field ``v``, then an async consumer with 8
    concurrent readers. The digests taken at the producers, those read, and the
    consumer's errors."""
    sums = {}
    for s in await asyncio.gather(*[p.run.remote(q, i + 1, PUTS, "p")
                                    for i, p in enumerate(producers)]):
        sums.update(s)
    assert len(sums) == len(producers) * PUTS * 3
    await q.seal("p")
    got, errors = await consumer.run.remote(q, "p", 8, 4, ["x", "v", "uid"])
    return sums, got, errors


async def test_concurrent_puts_and_reads_between_async_actors_arrive_intact(group):
    """4 async producers x 8 concurrent puts (``STREAMRL_RDT_PUTS`` for more) of same-size
    and mixed-size tensors, an async consumer with 8 concurrent readers: every tensor
    matches the digest taken where it was made; every byte moved by RDT; the holders hold
    nothing once the rows are gone."""
    async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["t"]) as q:
        sums, got, errors = await stress(q, group["producers"], group["consumer"])
        assert errors == []
        assert got == sums  # every row, every tensor intact
        st = await wait_for(lambda: _settled(q))
        assert st.rows == 0 and st.bytes == 0
        assert st.bytes_by_path.get("rdt", 0) > 0
        assert st.bytes_by_path.get("shm", 0) == 0  # no tensor bytes through the units
        held = await wait_for(lambda: _all_free(group["producers"]))
        assert held, [ray.get(p.held.remote()) for p in group["producers"]]


async def _settled(q):
    st = await q.stats()
    return st if st.rows == 0 and st.bytes_by_path.get("rdt") else None


async def _all_free(producers):
    held = await asyncio.gather(*[p.held.remote() for p in producers])
    return all(h == {"tensors": 0, "bytes": 0} for h in held)


async def test_a_batch_of_many_small_rows_moves_in_few_transfers(group):
    """Reads are batched per holder: 64 rows of 1 KiB put by one producer and read as one
    micro-batch move in at most one transfer per held field (not one per row), all by RDT,
    none over the holder's socket. A read that went row by row would make 64 or more."""
    async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["t"]) as q:
        sums = await group["producers"][1].run.remote(q, 11, 1, "p", ragged=False,
                                                      rows_per_put=64, width=256)
        await q.seal("p")
        before = (await asyncio.to_thread(group["group"].info))["transfers"]
        got, errors = await group["consumer"].run.remote(q, "p", 1, 64, ["x", "uid"])
        transfers = (await asyncio.to_thread(group["group"].info))["transfers"] - before
        assert errors == [] and got == sums
        assert 1 <= transfers <= 2, transfers  # fields x and uid, one holder, one batch
        st = await wait_for(lambda: _settled(q))
        assert st.bytes_by_path.get("rdt", 0) >= 64 * 256 * 4
        assert not st.bytes_by_path.get("socket"), st.bytes_by_path


async def test_the_blocking_twin_reads_held_fields_in_a_sync_actor(group):
    async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["s"]) as q:
        sums = await group["producers"][0].run.remote(q, 7, 4, "p", ragged=False)
        await q.seal("p")
        got = await group["sync"].run.remote(q, "p")
        assert got == {u: s[0] for u, s in sums.items()}
        assert await wait_for(lambda: _all_free(group["producers"][:1]))


async def test_readers_outside_the_group_fall_back_to_the_holders_socket(group):
    """The driver is in no group: it reads held fields over the holder's socket."""
    async with streamrl.StreamQueue(transport="rdt", num_shards=2) as q:
        sums = await group["producers"][1].run.remote(q, 9, 2, "p", ragged=False)
        await q.seal("p")
        got = {}
        async for mb in q.stream("d", ["x", "uid"], batch_size=6, partition="p"):
            td = await mb.materialize()
            got.update({u: digest(x) for u, x in zip(td["uid"].tolist(), td["x"])})
        assert got == {u: s[0] for u, s in sums.items()}
        st = await wait_for(lambda: _has(q, "socket"))
        assert st.bytes_by_path["socket"] >= 6 * W * 4
        await q.clear("p")
        assert await wait_for(lambda: _all_free(group["producers"][1:2]))


async def _quiet(q, path, deadline=30.0):
    """Stats once ``bytes_by_path[path]`` has settled: every process reports its moves at
    most every REPORT_EVERY seconds, so a count taken right after reads may still grow;
    settled is unchanged over two report windows."""
    from streamrl.transport.ray.data import REPORT_EVERY

    last = None
    end = asyncio.get_running_loop().time() + deadline
    while True:
        st = await q.stats()
        got = st.bytes_by_path.get(path, 0)
        if got == last or asyncio.get_running_loop().time() > end:
            return st
        last = got
        await asyncio.sleep(2 * REPORT_EVERY)


async def _has(q, path, n=None):
    st = await q.stats()
    got = st.bytes_by_path.get(path)
    return st if got and (n is None or got == n) else None


async def test_rdt_fields_on_the_ray_transport_hold_only_those_fields(group):
    async with streamrl.StreamQueue(transport="ray", rdt_fields=["x"], num_shards=2,
                                    consumers=["t"]) as q:
        assert q.transport == "rdt"
        sums = await group["producers"][2].run.remote(q, 11, 4, "p", ragged=True)
        await q.seal("p")
        got, errors = await group["consumer"].run.remote(q, "p", 2, 4, ["x", "v", "uid"])
        assert errors == [] and got == sums
        # x by RDT (4 puts x 3 rows x 16 KiB), v and uid through the storage units
        st = await wait_for(lambda: _has(q, "rdt", 12 * W * 4))
        assert st.bytes_by_path["rdt"] == 12 * W * 4
        assert st.bytes_by_path.get("shm", 0) + st.bytes_by_path.get("inline", 0) > 0


async def test_a_holder_killed_mid_transfer_loses_its_rows_by_name(group, tmp_path):
    """A producer dies while 8 readers of an async consumer are waiting for its tensors,
    in batches that mix its rows with a live producer's: its transfer thread is kept busy
    so that the readers' receives from it are posted and waiting (and, in the
    consumer's one ordered transfer thread, ahead of receives from the live producer),
    then the process is killed. Its rows raise RowsLost naming them and the holder, and
    are dropped as "lost" (the acks count only the rest); the live rows arrive intact;
    the consumer's later reads by RDT are not stuck behind the dead transfer. A checkpoint,
    which needs their bytes, fails naming the holder. Rows of the dead holder read later
    raise RowsLost too, outside the group (the driver, over the socket) and in it."""
    victim, live, consumer = group["victim"], group["producers"][3], group["consumer"]
    async with streamrl.StreamQueue(transport="rdt", rdt_fields=["x"], num_shards=2,
                                    consumers=["t"]) as q:
        dead, alive = {}, {}
        for i in range(4):  # alternate: batches of 4 mix the two holders' rows
            dead.update(await victim.run.remote(q, 21 + i, 1, "mixed", ragged=False))
            alive.update(await live.run.remote(q, 31 + i, 1, "mixed", ragged=False))
        later = await victim.run.remote(q, 25, 2, "later", ragged=False)
        later2 = await victim.run.remote(q, 26, 2, "later2", ragged=False)
        pid = await victim.pid.remote()
        await q.seal("mixed")
        await victim.stall.remote(120)  # its sends wait behind this
        reading = consumer.read_losing.remote(q, "mixed", 8, 4)
        assert await wait_for(_busy(consumer), 60), "the readers never started"
        await asyncio.sleep(1.0)  # (their receives are posted)
        assert await consumer.busy.remote() > 0  # reads of the victim's rows are waiting
        ray.kill(victim)
        got, lost, errors = await asyncio.wait_for(reading, 120)  # (not stuck)
        assert errors == []
        assert sorted(lost) == sorted(dead)  # every row of the victim, by name
        assert all(h.endswith(f":{pid}") for h in lost.values())
        assert got == {u: d[0] for u, d in alive.items()}  # the live rows, intact
        st = await wait_for(lambda: _lost(q, len(dead)))
        assert st.dropped_by["lost"] == len(dead), st.dropped_by
        assert st.tasks["t"].acked == len(alive)  # the lost rows were not consumed
        # what a transfer thread's watchdog would hear (rank 6: the victim; 3: alive)
        coordinator = group["group"].coordinator
        assert await coordinator.alive.remote(6) is False
        assert await coordinator.alive.remote(3) is True

        # later reads of that consumer: by RDT as before, intact
        before = (await _quiet(q, "rdt")).bytes_by_path.get("rdt", 0)
        sums = await live.run.remote(q, 41, 2, "after", ragged=False)
        await q.seal("after")
        got, lost, errors = await asyncio.wait_for(
            consumer.read_losing.remote(q, "after", 2, 4), 60)
        assert (got, lost, errors) == ({u: d[0] for u, d in sums.items()}, {}, [])
        st = await wait_for(lambda: _has(q, "rdt", before + 6 * W * 4))
        assert st is not None

        # a checkpoint needs the held bytes: it names the dead holder
        with pytest.raises(CheckpointError, match=f":{pid}"):
            await q.checkpoint(tmp_path / "ck")

        # rows of the dead holder read later: outside the group and inside it
        mb = await q.get("d", ["x", "uid"], batch_size=6, partition="later", timeout=10)
        with pytest.raises(RowsLost) as e:  # the driver: over the socket
            await mb.materialize()
        assert sorted(e.value.rows) == sorted(mb.rows) and e.value.holder.endswith(f":{pid}")
        await q.seal("later2")
        got, lost, errors = await consumer.read_losing.remote(q, "later2", 1, 8, timeout=10)
        assert got == {} and sorted(lost) == sorted(later2) and errors == []
        st = await wait_for(lambda: _lost(q, len(dead) + len(later) + len(later2)))
        assert st is not None


def _busy(actor):
    async def pred():
        return await actor.busy.remote() > 0
    return pred


async def _lost(q, n):
    st = await q.stats()
    return st if st.dropped_by.get("lost") == n and st.tasks.get("t") else None


async def test_cancelled_puts_and_reads_leave_holders_empty(group):
    """Holder memory leak check: puts cancelled at random points, reads cancelled at
    random points (then done again, intact); once every row is consumed, every holder
    holds nothing and the queue holds no rows and no bytes."""
    async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["t"]) as q:
        sums = {}
        for s in await asyncio.gather(*[p.churn.remote(q, CHURN, "c", i + 1)
                                        for i, p in enumerate(group["producers"][:2])]):
            sums.update(s)
        await q.seal("c")
        got = await group["consumer"].read_cancelling.remote(q, "c", 5)
        assert got == sums
        assert await wait_for(lambda: _all_free(group["producers"][:2]))
        st = await q.stats()
        assert st.rows == 0 and st.bytes == 0


async def test_partial_samples_pipeline_through_four_roles_in_group_members(group):
    """The behavioural suite's pipeline (tests/test_semantics.py, same name without
    "_in_group_members") with each role in another member of the group: a producer puts
    prompts, and four roles, in an async consumer, the blocking twin in a sync actor and
    two other producers, read fields that other members hold (by RDT) and write new
    fields (held where written). Every row reaches training with the right values, once;
    no byte went over a socket or through the storage units; nothing is left, rows,
    bytes or held tensors."""
    p = group["producers"]
    N = 96
    async with streamrl.StreamQueue(transport="rdt", capacity=64, num_shards=2) as q:
        res = await asyncio.gather(
            p[0].feed.remote(q, "step", N),
            group["consumer"].role.remote(q, "gen", ["prompt"], 4, "step", generate),
            group["sync"].role.remote(q, "reward", ["response"], 6, "step", reward),
            p[1].role.remote(q, "ref", ["prompt", "response"], 5, "step", ref_lp),
            p[2].role.remote(q, "train", ["idx", "prompt", "response", "reward", "ref_lp"], 8,
                             "step", train))
        assert sorted(res[-1]) == list(range(N))
        st = await wait_for(lambda: _settled(q))
        assert st.rows == 0 and st.bytes == 0 and sum(st.unit_rows) == 0
        assert st.bytes_by_path.get("rdt", 0) > 0
        assert not st.bytes_by_path.get("socket") and not st.bytes_by_path.get("shm"), \
            st.bytes_by_path
        everyone = [*p[:3], group["consumer"], group["sync"]]
        assert await wait_for(lambda: _all_free(everyone))


async def test_groups_that_cannot_be_made_leave_nothing_and_a_destroyed_group_falls_back(
        group):
    """create_group refuses, with TransportError and nothing made, a backend a member
    cannot use (nixl is not installed here) and an actor already in a group; the same
    actors then make a group. Once its coordinator is stopped (its process still alive:
    what ``destroy`` does before it kills it), and again once the group is destroyed, its
    members read each other's held fields over the holders' sockets and none by RDT: no
    RowsLost while the holder lives. (Before the coordinator was stopped first, a read
    right after ``destroy`` could still go by RDT on a loaded machine: Ray reported the
    killed coordinator dead before its process stopped serving.)"""
    import importlib.util

    from streamrl.errors import TransportError
    from streamrl.transport.rdt import create_group

    producer, consumer = Producer.remote(), Consumer.remote()
    try:
        if importlib.util.find_spec("nixl") is None:  # (the actors share this environment)
            with pytest.raises(TransportError, match="nixl package"):
                await asyncio.to_thread(create_group, [producer, consumer], "nixl")
        with pytest.raises(TransportError, match="member 1: it is in RDT group"):
            await asyncio.to_thread(create_group, [producer, group["consumer"]], "gloo")
        assert await producer.group_name.remote() is None
        g = await asyncio.to_thread(create_group, [producer, consumer], "gloo")
        assert await producer.group_name.remote() == g.name
        async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["t"]) as q:
            rows = 2 * 3
            first = await producer.run.remote(q, 51, 2, "a", ragged=False)
            await q.seal("a")
            got, errors = await consumer.run.remote(q, "a", 2, 3, ["x", "uid"])
            assert errors == [] and got == first
            assert await wait_for(lambda: _has(q, "rdt", rows * (W * 4 + 8)))
            assert await g.coordinator.stop.remote()
            for k, part in enumerate(("b", "c")):
                if k:
                    await asyncio.to_thread(g.destroy)
                else:  # (stopped, and alive)
                    assert await g.coordinator.ping.remote()
                want = await producer.run.remote(q, 52 + k, 2, part, ragged=False)  # held
                await q.seal(part)
                got, errors = await consumer.run.remote(q, part, 2, 3, ["x", "uid"])
                assert errors == [] and got == want
                n = (k + 1) * rows * (W * 4 + 8)
                st = await wait_for(lambda: _has(q, "socket", n))
                # (what it came to; and what the consumer counted, and has not reported)
                assert st is not None, ((await q.stats()).bytes_by_path,
                                        await consumer.moved.remote(q))
                assert st.bytes_by_path["rdt"] == rows * (W * 4 + 8)  # none by RDT any more
                assert not st.dropped_by.get("lost")
    finally:
        for a in (producer, consumer):
            ray.kill(a)


@ray.remote(num_cpus=0)
class _StuckCoordinator:
    """A coordinator that never answers ``stop`` (hung)."""

    def stop(self):
        time.sleep(3600)

    def ping(self):
        return True


def test_destroy_says_when_the_coordinator_would_not_stop_or_die(ray_session, caplog,
                                                                  monkeypatch):
    """``destroy`` promises no transfer starts once it returns; when it cannot be sure
    (the coordinator did not answer ``stop`` in time, so it was killed without it; or
    Ray did not report it dead after the kill) it says so in a warning instead of
    returning as if all were well. A coordinator already gone is no warning."""
    import logging

    from streamrl.transport.rdt import group as rdt_group

    caplog.set_level(logging.WARNING, logger="streamrl")
    stuck = _StuckCoordinator.remote()
    ray.get(stuck.ping.remote())
    for bad in (-1, float("nan"), "1"):  # refused before anything is done
        with pytest.raises(streamrl.errors.InvalidArgument, match="timeout"):
            rdt_group.RdtGroup("g-stuck", "gloo", [], stuck).destroy(timeout=bad)
    assert ray.get(stuck.ping.remote())
    rdt_group.RdtGroup("g-stuck", "gloo", [], stuck).destroy(timeout=1.0)
    warned = [r.getMessage() for r in caplog.records]
    assert any("did not answer stop" in m and "g-stuck" in m for m in warned), warned
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stuck.ping.remote(), timeout=30)  # (killed: it is gone now)

    caplog.clear()
    monkeypatch.setattr(ray, "kill", lambda actor: None)  # (a kill that does not take)
    alive = _StuckCoordinator.remote()
    ray.get(alive.ping.remote())
    rdt_group.RdtGroup("g-alive", "gloo", [], alive).destroy(timeout=1.0)
    warned = [r.getMessage() for r in caplog.records]
    assert any("still there" in m and "g-alive" in m for m in warned), warned
    monkeypatch.undo()
    ray.kill(alive)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(alive.ping.remote(), timeout=30)

    caplog.clear()
    rdt_group.RdtGroup("g-gone", "gloo", [], alive).destroy(timeout=1.0)  # gone already
    assert not caplog.records, [r.getMessage() for r in caplog.records]


async def test_a_queue_of_held_fields_is_checkpointed_and_restored_on_any_transport(
        group, tmp_path):
    """A checkpoint of an "rdt" queue saves held fields (the storage units read them from
    their holders): restored on "embedded" and on "rdt", every row not consumed reads
    back the tensors its producer put (same-size and ragged, one row over 1 MiB)."""
    async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["t"]) as q:
        sums = await group["producers"][0].run.remote(q, 61, 4, "p", ragged=True)
        mb = await q.get("t", ["uid"], batch_size=3, partition="p", timeout=10)
        consumed = (await mb.materialize())["uid"].tolist()
        await mb.ack()
        await q.checkpoint(tmp_path / "ck")
    want = {u: d for u, d in sums.items() if u not in consumed}
    assert len(want) == 9
    r = await streamrl.StreamQueue.restore(tmp_path / "ck", transport="embedded")
    try:
        await r.seal("p")
        got = {}
        async for mb in r.stream("t", ["x", "v", "uid"], 4, partition="p", timeout=30):
            td = await mb.materialize()
            vs = td["v"].unbind() if td["v"].is_nested else td["v"]
            got.update({u: (digest(x), digest(v)) for u, x, v in zip(td["uid"].tolist(),
                                                                     td["x"], vs)})
        assert got == want
    finally:
        await r.shutdown()
    r = await streamrl.StreamQueue.restore(tmp_path / "ck", transport="rdt", num_shards=1)
    try:
        assert r.transport == "rdt"
        await r.seal("p")
        got, errors = await group["consumer"].run.remote(r, "p", 2, 4, ["x", "v", "uid"])
        assert errors == [] and got == want
    finally:
        await r.shutdown()


@pytest.mark.skipif(os.environ.get("STREAMRL_RDT_BYPASS", "") not in ("1", "strict"),
                    reason="a report, not a check (~17 s): STREAMRL_RDT_BYPASS=1 runs it, "
                    "=strict also fails it when the naive design came out right; the design "
                    "as built is checked by test_concurrent_puts_and_reads_between_async_"
                    "actors_arrive_intact")
async def test_the_stress_test_goes_wrong_when_transfers_bypass_the_serialising_thread(
        ray_session, record_property):
    """The serialising transfer thread is what keeps concurrent transfers apart. The
    stress test's body (:func:`stress`) runs twice on a group of its own (5 fresh
    actors): as built, where it must be right; then with the naive design switched on
    in every process of the group (``set_bypass``: each send and receive runs at once on
    a thread of its own, and readers ask holders directly, unordered). What the naive run
    did is reported (printed, and recorded as the test's ``bypassed`` property), not
    asserted: gloo's failures under concurrency depend on timing (see docs/rdt.md for
    what runs here showed). It runs with ``STREAMRL_RDT_BYPASS=1`` only (being a report,
    it is not in the default run); ``STREAMRL_RDT_BYPASS=strict`` also makes a naive run
    that came out right fail the test."""
    from streamrl.transport.rdt import create_group

    producers, consumer = [Producer.remote() for _ in range(4)], Consumer.remote()
    actors = [*producers, consumer]
    g = await asyncio.to_thread(create_group, actors, "gloo")
    try:
        async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["t"]) as q:
            sums, got, errors = await stress(q, producers, consumer)
            assert errors == [] and got == sums  # the design as built: right
        await asyncio.gather(*[a.set_bypass.remote(True) for a in actors])
        outcome = await _naive_run(producers, consumer)
    finally:
        g.destroy()
        for a in actors:
            ray.kill(a)
    print(f"stress test with the serialising thread bypassed: {outcome}")
    record_property("bypassed", outcome)
    if os.environ.get("STREAMRL_RDT_BYPASS") == "strict":
        assert not outcome.startswith("right"), outcome


async def _naive_run(producers, consumer) -> str:
    """:func:`stress` in the naive design; what came of it, in words."""
    q = streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["t"])
    try:
        sums, got, errors = await asyncio.wait_for(stress(q, producers, consumer), 90)
    except asyncio.TimeoutError:
        return "hung: no answer within 90 s"
    except ray.exceptions.RayActorError as e:
        return f"crashed: {type(e).__name__} (gloo killed the actors)"
    except Exception as e:  # noqa: BLE001 - reported
        return f"failed: {type(e).__name__}: {str(e)[:200]}"
    finally:
        try:
            st = await asyncio.wait_for(q.stats(), 10)
            socket = st.bytes_by_path.get("socket", 0)
        except Exception:  # noqa: BLE001 - (reported above)
            socket = 0
        await q.close()
        await q.shutdown()
    wrong = sum(got.get(u) != d for u, d in sums.items())
    where = f"; {socket} bytes read over the socket after failed transfers" if socket else ""
    if errors:
        return f"errors: {len(errors)} reads failed ({errors[0][:160]}){where}"
    if wrong:
        return f"wrong: {wrong} of {len(sums)} rows read with other tensors' bytes{where}"
    return f"right: every row intact{where}"
