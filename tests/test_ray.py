"""Ray-only behaviour: actors as producers and consumers, handles, named queues, several
nodes, and failures (a storage unit or the controller dying, a consumer dying)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import time

import anyio
import numpy as np
import pytest
import torch

import streamrl
from streamrl.errors import InvalidArgument, RowsLost, SchemaError, TransportError

ray = pytest.importorskip("ray")
# the shared make_queue fixture, on the Ray transport only
pytestmark = [pytest.mark.ray, pytest.mark.timeout(120),
              pytest.mark.parametrize("transport", ["ray"], indirect=True)]


@pytest.fixture
def rq(make_queue):
    return make_queue


@ray.remote(num_cpus=0)
class AsyncProducer:
    async def run(self, q, n, start):
        for i in range(start, start + n, 8):
            await q.put({"idx": torch.arange(i, i + 8),
                         "x": torch.arange(i, i + 8, dtype=torch.float64).unsqueeze(1) * torch.ones(1, 1000),
                         "bf": torch.full((8, 3), i, dtype=torch.bfloat16),
                         "chat": [{"turn": j, "text": "é" * (j % 5)} for j in range(i, i + 8)]},
                        partition="p")
        return n


@ray.remote(num_cpus=0)
class SyncConsumer:
    """A plain (synchronous) actor using the blocking twin."""

    def run(self, q):
        from streamrl.sync import StreamQueue

        sq = StreamQueue.wrap(q)
        seen = []
        try:
            for mb in sq.stream("train", ["idx", "x", "bf", "chat"], 16, partition="p", timeout=60):
                td = mb.materialize()
                idx = td["idx"]
                assert torch.equal(td["x"], idx.double().unsqueeze(1) * torch.ones(1, 1000))
                assert td["bf"].dtype == torch.bfloat16
                assert [c["turn"] for c in td["chat"]] == idx.tolist()
                seen.extend(idx.tolist())
        finally:
            sq.shutdown()
        return seen


@ray.remote(num_cpus=0)
class ModuleProbe:
    """Says which of streamrl's modules its process has loaded."""

    def loaded(self):
        return sorted(m for m in sys.modules if m.startswith("streamrl"))

    async def put(self, q):
        await q.put({"x": torch.zeros(1, 4)}, partition="p")
        return self.loaded()


#: what a producer's process has no use for: the controller's state machine and service
#: (they run in the controller actor) and the embedded transport
_NOT_A_PRODUCERS = ("streamrl.controller", "streamrl.service",
                    "streamrl.transport.ray.actor_service", "streamrl.combine",
                    "streamrl.transport.embedded")


async def test_a_producer_process_loads_neither_the_controller_nor_the_embedded_transport(rq):
    """An actor given the queue puts rows without importing the controller's state machine,
    its service or the embedded transport (Ray loads the module of each actor class whose
    handle the queue carries: those modules import them only inside the actors). Each
    such import costs every producer process of an agentic run its start-up time. (A
    runtime_env of its own gives the probe a fresh worker process.)"""
    q = rq()
    probe = ModuleProbe.options(
        runtime_env={"env_vars": {"STREAMRL_FRESH_WORKER": "modules"}}).remote()
    try:
        assert await probe.loaded.remote() == []
        loaded = await probe.put.remote(q)
        assert "streamrl.transport.ray.data" in loaded  # (it did use the queue)
        assert [m for m in _NOT_A_PRODUCERS if m in loaded] == []
    finally:
        ray.kill(probe)
    assert (await q.stats()).rows == 1


@pytest.mark.parametrize("direct_calls", [True, False], ids=["socket-calls", "ray-calls"])
async def test_actors_produce_and_consume_byte_for_byte(rq, direct_calls):
    q = rq(num_shards=3, direct_calls=direct_calls)
    assert (q._transport.control.rpc is not None) == direct_calls
    producers = [AsyncProducer.remote() for _ in range(2)]
    consumer = SyncConsumer.remote()
    got = consumer.run.remote(q)
    await producers[0].run.remote(q, 64, 0)
    await producers[1].run.remote(q, 64, 1000)
    await q.seal("p")
    seen = await got
    assert sorted(seen) == list(range(64)) + list(range(1000, 1064))
    st = await q.stats()
    assert st.tasks["train"].acked == 128 and sum(st.unit_rows) == 128


@ray.remote(num_cpus=0)
def consume_in_task(q, n):
    import asyncio

    async def main():
        out = []
        async for mb in q.stream("task", ["idx"], 4, partition="p"):
            out.extend((await mb.materialize())["idx"].tolist())
            if len(out) >= n:
                break
        return out

    return asyncio.run(main())


async def test_queue_handle_works_in_a_task_and_by_name(rq):
    q = rq(name="named-q")
    await q.put({"idx": torch.arange(8)}, partition="p")
    await q.seal("p")
    assert sorted(await consume_in_task.remote(q, 8)) == list(range(8))
    other = streamrl.StreamQueue.connect("named-q")
    st = await other.stats()
    assert st.put == 8
    await other.shutdown()  # not the owner: the queue lives on
    assert (await q.stats()).put == 8
    with pytest.raises(TransportError):
        streamrl.StreamQueue.connect("no-such-queue")


async def _kill(actor) -> None:
    """Kill an actor and wait until its process is gone: ``ray.kill`` is asynchronous,
    and the process outlives Ray's word that the actor died by a little; the socket
    channels keep talking to it until it exits."""
    pid = await actor.__ray_call__.remote(lambda self: os.getpid())
    ray.kill(actor)
    with anyio.fail_after(30):
        while os.path.exists(f"/proc/{pid}"):
            await anyio.sleep(0.02)


async def test_storage_unit_death_loses_only_its_rows(rq):
    q = rq(num_shards=2)
    a = await q.put({"idx": torch.arange(4)}, partition="p")
    b = await q.put({"idx": torch.arange(4, 8)}, partition="p")
    shards = set(a.shards) | set(b.shards)
    assert shards == {0, 1}
    victim = q._transport._units[0]
    await _kill(victim)
    mb = await q.get("t", ["idx"], 8, partition="p")
    with anyio.fail_after(30):
        with pytest.raises(RowsLost) as e:
            await mb.materialize()
    assert e.value.unit == 0 and set(e.value.rows) == {r for r, s in zip(mb.rows, mb.shards) if s == 0}
    survivors = mb[[i for i, s in enumerate(mb.shards) if s == 1]]
    td = await survivors.materialize()
    assert len(td) == 4
    with anyio.fail_after(30):
        while (await q.stats()).dropped_by.get("lost", 0) != 4:
            await anyio.sleep(0.05)
    c = await q.put({"idx": torch.arange(100, 104)}, partition="p")  # new rows avoid the dead unit
    assert set(c.shards) == {1}


async def test_controller_death_fails_fast(rq):
    q = rq()
    await q.put({"x": torch.ones(2)})
    await _kill(q._transport._controller)
    with anyio.fail_after(30):
        with pytest.raises(TransportError):
            await q.put({"x": torch.ones(2)})
        with pytest.raises(TransportError):
            await q.get("t", ["x"], 2)


@ray.remote(num_cpus=0)
class LeaseHolder:
    async def hold(self, q):
        mb = await q.get("t", ["x"], 4, partition="p")
        return mb.rows


async def test_dead_consumer_lease_returns_after_timeout(rq):
    q = rq(lease_timeout=1.0)
    await q.put({"x": torch.arange(4)}, partition="p")
    holder = LeaseHolder.remote()
    rows = await holder.hold.remote(q)
    ray.kill(holder)
    with anyio.fail_after(30):
        mb = await q.get("t", ["x"], 4, partition="p", timeout=20)
    assert sorted(mb.rows) == sorted(rows)
    assert (await q.stats()).tasks["t"].expired == 4


async def test_consumer_that_dies_while_waiting_takes_no_rows(rq):
    # its take is still waiting in the controller when it dies: the closed connection
    # cancels it, so the rows put later go to the living consumer at once, not after the
    # (long) lease timeout
    q = rq(lease_timeout=600.0)
    waiter = LeaseHolder.remote()
    call = waiter.hold.remote(q)
    ctl = q._transport._controller
    with anyio.fail_after(60):  # until its take waits in the controller
        while not await ctl.__ray_call__.remote(lambda self: len(self._inflight)):
            await anyio.sleep(0.05)
    await _kill(waiter)
    await q.put({"x": torch.arange(4)}, partition="p")
    mb = await q.get("t", ["x"], 4, partition="p", timeout=10)
    assert len(mb) == 4
    with pytest.raises(ray.exceptions.RayActorError):
        await call


MULTINODE = textwrap.dedent("""
    import asyncio, torch, ray, streamrl
    from ray.cluster_utils import Cluster

    @ray.remote(num_cpus=0, resources={"nodeC": 0.01})
    def consume(q):
        async def main():
            mb = await q.get("t", ["x", "idx"], 96, partition="p", timeout=60)
            td = await mb.materialize()
            assert torch.equal(td["x"], td["idx"].float().unsqueeze(1).repeat(1, 4096))
            return sorted(td["idx"].tolist())
        return asyncio.run(main())

    async def main():
        q = streamrl.StreamQueue(transport="ray", num_shards=3, unit_options=[
            {"resources": {"nodeA": 0.01}}, {"resources": {"nodeB": 0.01}},
            {"resources": {"nodeC": 0.01}}])
        nodes = q._transport.node_ids()
        assert len(set(nodes)) == 3, nodes
        for i in range(0, 96, 32):
            idx = torch.arange(i, i + 32)
            await q.put({"idx": idx, "x": idx.float().unsqueeze(1).repeat(1, 4096)}, partition="p")
        got = ray.get(consume.remote(q))
        assert got == list(range(96)), got
        await q.close()
        await q.shutdown()
        print("MULTINODE-OK", len(set(nodes)))

    lo = "127.0.0.1"  # keep all traffic on loopback
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"nodeA": 1}, "node_ip_address": lo,
        "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"nodeB": 1}, node_ip_address=lo)
        cluster.add_node(num_cpus=1, resources={"nodeC": 1}, node_ip_address=lo)
        ray.init(address=cluster.address, log_to_driver=False, _node_ip_address=lo)
        cluster.wait_for_nodes()
        asyncio.run(main())
    finally:
        ray.shutdown()
        cluster.shutdown()
""")


@pytest.mark.slow
def test_multinode_cluster_moves_data_between_nodes(tmp_path, transport):
    """Three Ray nodes on this machine (ray.cluster_utils): units on different nodes, a
    consumer on a third reads rows from all of them. Runs in its own process because a
    process can join only one Ray cluster."""
    script = tmp_path / "multinode.py"
    script.write_text(MULTINODE)
    # loopback only: Ray resolves 127.0.0.1 to the host's IP unless told not to
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240, env=env)
    assert "MULTINODE-OK 3" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


AUTO_INIT = textwrap.dedent("""
import asyncio, torch, streamrl

async def main():
    q = streamrl.StreamQueue(transport="ray", num_shards=1)
    await q.put({"x": torch.arange(3)}, partition="p")
    mb = await q.get("t", ["x"], 3, partition="p", timeout=30)
    print("AUTO-OK", (await mb.materialize())["x"].tolist())
    import ray
    print("NODES", sorted(n["NodeManagerAddress"] for n in ray.nodes()))
    await q.shutdown()

asyncio.run(main())
""")


@pytest.mark.slow
def test_a_ray_queue_starts_ray_as_ray_would(tmp_path, transport):
    """Ray not initialised: the queue starts a local Ray the way ``ray.init()`` does,
    listening on loopback only (``init_ray``). A script of its own (it starts a Ray)."""
    script = tmp_path / "auto.py"
    script.write_text(AUTO_INIT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, env=env)
    assert "AUTO-OK [0, 1, 2]" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert "NODES ['127.0.0.1']" in out.stdout, out.stdout[-2000:]


@pytest.mark.parametrize("address", ["", None])
def test_init_ray_starts_a_loopback_ray_when_ray_address_is_unset_or_empty(
        monkeypatch, address, transport):
    """Ray treats an empty RAY_ADDRESS as an unset one: with either (and no ``ray start``
    on this machine), ``init_ray`` starts a new local Ray on 127.0.0.1, not one that
    joins. The call it makes, recorded (the script test above starts a real one); a
    RAY_ADDRESS that names a cluster is joined as ``ray.init()`` would."""
    from streamrl.transport.ray import transport as ray_transport

    calls: list[dict] = []
    monkeypatch.setattr(ray_transport.ray, "init", lambda **kw: calls.append(kw))
    # no `ray start` on this machine, whatever other tests left (a simulated cluster
    # writes the file a `ray start` writes, which ray.init() would then join)
    monkeypatch.setattr("ray._private.services.find_bootstrap_address",
                        lambda temp_dir=None: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if address is not None:
        monkeypatch.setenv("RAY_ADDRESS", address)
    ray_transport.init_ray(log_to_driver=False)
    assert calls == [{"address": "local", "_node_ip_address": "127.0.0.1",
                      "ignore_reinit_error": True, "include_dashboard": False,
                      "log_to_driver": False}]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6399")
    ray_transport.init_ray()
    assert calls[1] == {"ignore_reinit_error": True, "include_dashboard": False}


@ray.remote(num_cpus=0)
class BigProducer:
    async def put(self, q, part):
        rows = await q.put({"x": torch.arange(64 * 1024, dtype=torch.float32).view(4, -1)},
                           partition=part)
        return rows.rows


async def test_rows_outlive_their_producer(rq):
    q = rq()
    p = BigProducer.remote()
    await p.put.remote(q, "p")  # 256 KiB: copied into the unit's shared-memory arena
    await _kill(p)
    mb = await q.get("t", ["x"], 4, partition="p", timeout=30)
    td = await mb.materialize()
    assert torch.equal(td["x"].flatten(), torch.arange(64 * 1024, dtype=torch.float32))


async def _arena(q, shard: int = 0) -> dict:
    return await q._transport._units[shard].arena_stats.remote()


async def _until(cond, what: str, timeout: float = 30.0):
    with anyio.fail_after(timeout):
        while not await cond():
            await anyio.sleep(0.05)


async def test_a_view_keeps_its_bytes_until_it_is_gone(rq):
    """A read views the arena in place; the blocks it views are not reused while any of
    its tensors lives, even after the rows are dropped and new rows are put."""
    import gc

    q = rq(num_shards=1)
    x = torch.arange(8 * 4096, dtype=torch.float32).view(8, 4096)  # 128 KiB: arena
    await q.put({"x": x}, partition="p")
    mb = await q.get("t", ["x"], 8, partition="p")
    view = (await mb.materialize())["x"][2:5]  # a slice of the read's tensor
    del mb
    await q.clear("p")
    for i in range(3):  # new rows of the same size would fit in the dropped rows' block
        await q.put({"x": torch.full((8, 4096), -1.0 - i)}, partition=f"p{i}")
    assert torch.equal(view, x[2:5])  # untouched
    assert (await _arena(q))["pins"] == 1
    st = await q.stats()
    assert st.unit_pinned_bytes == [x.nbytes] and st.unit_shared_bytes[0] >= 4 * x.nbytes
    used = (await _arena(q))["used"]
    del view
    gc.collect()
    await q.put({"y": torch.zeros(1)}, partition="z")  # any call carries the news
    await _until(lambda: _pins_zero(q), "the unpin")
    assert (await _arena(q))["used"] < used  # the dropped rows' block is free again
    assert (await q.stats()).unit_pinned_bytes == [0]


def _mapping_of(t: torch.Tensor) -> str:
    """The /proc/self/maps line of the mapping holding ``t``'s first byte."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line
    raise AssertionError("no mapping holds the tensor")


async def test_a_copy_read_is_owned_without_a_copy_of_the_arena(rq):
    """materialize(copy=True) on the arena's node maps the blocks copy-on-write: the
    bytes are not copied (the tensor lives in a private mapping of the unit's memfd, not
    in fresh memory), writing into it changes neither what is stored nor another read,
    and nothing the queue does changes it. Small inline tensors are copied."""
    import gc

    q = rq(num_shards=1)
    x = torch.arange(8 * 4096, dtype=torch.float32).view(8, 4096)  # 128 KiB: arena
    small = torch.arange(8)  # inline
    await q.put({"x": x, "s": small}, partition="p")
    mb = await q.get("t", ["x", "s"], 8, partition="p")
    owned = await mb.materialize(copy=True)
    line = _mapping_of(owned["x"])
    assert " rw-p " in line and "memfd" in line, line  # private (copy-on-write), no copy
    shared = await mb.materialize()
    assert " rw-s " in _mapping_of(shared["x"])
    owned["x"][:] = -1.0
    owned["s"][:] = -1
    assert torch.equal(shared["x"], x)  # another read, and what is stored: untouched
    again = await mb.materialize(copy=True)
    assert torch.equal(again["x"], x) and torch.equal(again["s"], small)
    await mb.drop()
    await q.put({"x": torch.full((8, 4096), 7.0)}, partition="p2")  # could reuse the block
    assert torch.equal(again["x"], x)  # pinned while viewed: the unit did not reuse it
    assert bool((owned["x"] == -1.0).all())
    del owned, shared, again
    gc.collect()
    await q.put({"y": torch.zeros(1)}, partition="z")  # any call carries the news
    await _until(lambda: _pins_zero(q), "the unpin")


async def test_dropping_a_batch_frees_its_blocks_before_new_rows_need_them(rq):
    """drop() lets go of what the batch read, and tells the unit before the controller
    frees the room: a producer admitted into that room reuses the blocks instead of
    growing the arena (a consumer that drops each batch keeps the arena at capacity)."""
    q = rq(num_shards=1)
    x = torch.ones(8, 4096)  # 128 KiB: arena
    await q.put({"x": x}, partition="p")
    mb = await q.get("t", ["x"], 8, partition="p")
    td = await mb.materialize()
    assert (await _arena(q))["pins"] == 1
    del td
    await mb.drop()  # the batch object itself lives on
    await _until(lambda: _pins_zero(q), "the unpin")
    size = (await _arena(q))["size"]
    await q.put({"x": x}, partition="p2")
    assert (await _arena(q))["size"] == size


async def _pins_zero(q) -> bool:
    return (await _arena(q))["pins"] == 0


async def test_arena_is_reused_and_empty_once_rows_are_consumed(rq):
    """Cycles of put / read / drop reuse the same blocks: the arena stops growing, and
    holds no used bytes once every row is gone and no view is left."""
    import gc

    q = rq(num_shards=1)
    sizes = []
    for i in range(6):
        await q.put({"x": torch.full((16, 16384), float(i))}, partition="p")  # 1 MiB
        mb = await q.get("t", ["x"], 16, partition="p")
        td = await mb.materialize()
        assert td["x"][15, -1].item() == float(i)
        await mb.drop()
        del td, mb
        gc.collect()
        sizes.append((await _arena(q))["size"])
    assert len(set(sizes)) == 1
    await q.put({"y": torch.zeros(1)}, partition="z")
    await _until(lambda: _pins_zero(q), "the unpin")
    assert (await _arena(q))["used"] == 0
    st = await q.stats()
    assert st.rows == 1


async def test_put_cancelled_after_reserving_gives_its_blocks_back(rq, monkeypatch):
    from streamrl.transport import ray as ray_transport

    q = rq(num_shards=1)
    orig = ray_transport.RayDataPlane._call

    async def slow_store(self, shard, method, *args, **kw):
        if method == "put":
            await anyio.sleep(2.0)  # the blocks are reserved and written by now
        return await orig(self, shard, method, *args, **kw)

    monkeypatch.setattr(ray_transport.RayDataPlane, "_call", slow_store)
    with anyio.move_on_after(0.5):
        await q.put({"x": torch.zeros(4, 65536)}, partition="p")  # 1 MiB
    monkeypatch.setattr(ray_transport.RayDataPlane, "_call", orig)
    st = await q.stats()
    assert st.rows == 0 and st.bytes_in_flight == 0
    await _until(lambda: _used_zero(q), "the unreserve")


async def test_put_cancelled_while_reserving_gives_the_blocks_back(rq, monkeypatch):
    """Cancelled while its reserve call is on its way (the unit reserves the blocks, the
    answer comes late): the blocks are given back when the answer comes."""
    from streamrl.transport import ray as ray_transport

    q = rq(num_shards=1)
    orig = ray_transport.RayDataPlane._call

    async def slow_answer(self, shard, method, *args, **kw):
        res = await orig(self, shard, method, *args, **kw)
        if method == "reserve":
            await anyio.sleep(1.0)  # reserved by now; the answer is late
        return res

    monkeypatch.setattr(ray_transport.RayDataPlane, "_call", slow_answer)
    reserving = asyncio.ensure_future(q.put({"x": torch.zeros(4, 65536)}, partition="p"))
    await _until(lambda: _used_nonzero(q), "the reserve")
    reserving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reserving
    monkeypatch.setattr(ray_transport.RayDataPlane, "_call", orig)
    st = await q.stats()
    assert st.rows == 0 and st.bytes_in_flight == 0
    await _until(lambda: _used_zero(q), "the unreserve")


async def _used_nonzero(q) -> bool:
    return (await _arena(q))["used"] > 0


async def _used_zero(q) -> bool:
    return (await _arena(q))["used"] == 0


async def test_rows_of_one_row_puts_are_read_back_as_one_piece_a_field(rq):
    """One-row puts are stored apart (a segment each); a storage unit's read joins
    consecutive small ones of one dtype and row shape, so a batch of them reaches the
    reader as one piece a field, with every row's values in the batch's order."""
    q = rq(num_shards=1)
    for i in range(12):
        await q.put({"tokens": torch.full((1, 6), i), "reward": torch.tensor([i / 2]),
                     "chat": [f"turn {i}"]}, partition="p")
    mb = await q.get("t", ["tokens", "reward", "chat"], 12, partition="p")
    rows = list(mb.rows)
    pieces, _, _ = await q._transport._units[0].read.remote(rows, ["tokens", "reward", "chat"])
    assert [len(pieces[f]) for f in ("tokens", "reward", "chat")] == [1, 1, 1]
    td = await mb.materialize()
    order = td["tokens"][:, 0].tolist()
    assert sorted(order) == list(range(12))
    assert torch.equal(td["tokens"], torch.tensor(order)[:, None].expand(12, 6))
    assert td["reward"].tolist() == [i / 2 for i in order]
    assert td["chat"] == [f"turn {i}" for i in order]
    await mb.ack()


async def test_blocks_of_dead_processes_are_released_when_room_is_needed(rq):
    """A reader that dies holding views, or a producer that dies between reserving blocks
    and storing them, cannot call back: the unit releases their blocks when it next needs
    room (a process is dead when /proc has no entry for it)."""
    q = rq(num_shards=1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    unit = q._transport._units[0]
    await unit.reserve.remote([1 << 20], int(dead))  # a producer that died after reserving
    await q.put({"x": torch.zeros(4, 65536)}, partition="p")
    await unit.read.remote(list((await q.get("t", ["x"], 4, partition="p")).rows), ["x"],
                           int(dead))  # a reader that died holding its views
    await q.clear("p")
    a = await _arena(q)
    assert a["used"] >= 2 << 20 and a["pins"] == 1
    await unit.__ray_call__.remote(lambda self: self._sweep())  # what a full arena does
    a = await _arena(q)
    assert a["used"] == 0 and a["pins"] == 0


async def test_bytes_go_inline_when_shared_memory_cannot_be_mapped(rq, monkeypatch):
    """A client that may not map a unit's arena (another user, a hardened /proc) sends
    and receives the bytes in the calls instead: slower, same data."""
    from streamrl.transport import ray as ray_transport

    q = rq(num_shards=1)
    data = q._transport._data
    data._maps.clear()
    data._local = [None] * data.num_shards

    def denied(path, size):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(ray_transport.data, "map_segment", denied)
    x = torch.randn(8, 16384)  # 512 KiB
    await q.put({"x": x}, partition="p")
    await _until(lambda: _used_zero(q), "the unreserve")  # the reserved block went back
    assert data._local == [False]
    mb = await q.get("t", ["x"], 8, partition="p")
    assert torch.equal((await mb.materialize())["x"], x)


async def test_a_process_stats_see_its_own_moves_at_once(rq):
    """Bytes moved are reported to the controller at most every REPORT_EVERY seconds a
    process, but a stats call first sends what its process holds back: a put and a read
    in a row, then stats, count every byte of both."""
    from streamrl.transport.ray import data as ray_data

    q = rq(num_shards=1)
    await q.put({"x": torch.ones(4, 1024)}, partition="p")  # (the first report goes at once)
    before = sum((await q.stats()).bytes_by_path.values())
    x = torch.randn(8, 1024)
    await q.put({"x": x}, partition="p")  # within the window: held back
    mb = await q.get("t", ["x"], 12, partition="p")
    assert torch.equal((await mb.materialize())["x"][4:], x)
    assert q._transport._data._unreported  # (held back: the window has not passed)
    got = sum((await q.stats()).bytes_by_path.values()) - before
    assert got >= x.nbytes + 12 * 1024 * 4, (got, ray_data.REPORT_EVERY)


@ray.remote(num_cpus=0)
class _SmallPutter:
    async def put(self, q, n: int) -> int:
        for i in range(n):  # one-row puts: each admitted by a storage unit
            await q.put({"tokens": torch.full((1, 256), i), "reward": torch.ones(1)},
                        partition="p")
            await asyncio.sleep(0.002)
        return n * (256 * 8 + 4)


async def test_bytes_of_a_producer_that_never_calls_the_controller_are_reported(rq):
    """A producer whose puts all go to storage units (small puts) has no connection
    of its own to the controller: its reports of bytes moved still arrive (they used to
    wait for a connection that never came)."""
    q = rq(num_shards=2)
    before = sum((await q.stats()).bytes_by_path.values())
    putter = _SmallPutter.remote()  # (kept: a process that exits within REPORT_EVERY of
    # its last move may take those moves' report with it; see stats.bytes_by_path)
    moved = await putter.put.remote(q, 60)
    deadline = time.monotonic() + 10
    while True:
        got = sum((await q.stats()).bytes_by_path.values()) - before
        if got >= moved or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert got >= moved, (got, moved)


async def test_a_queue_shut_down_right_after_a_put_logs_no_failure(transport, caplog):
    """The report of bytes a put moved, sent as the queue's actors are killed, is not a
    failure to warn of: nobody is left to tell (it printed 'sending path_bytes failed'
    after every such shutdown)."""
    caplog.set_level(logging.DEBUG, logger="streamrl")
    q = streamrl.StreamQueue(transport=transport, num_shards=1)
    try:
        await q.put({"x": torch.zeros(4, 8)}, partition="p")
        await q.close()
    finally:
        await q.shutdown()
    await asyncio.sleep(0.5)  # (the report goes out, and its connection is cut)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_data_arriving_after_its_write_was_aborted_is_dropped(rq):
    """A put cancelled while its data is on its way to the unit: the controller forgets
    the rows and deletes them from the unit, possibly before the data lands. The late
    data must not stay behind in the unit."""
    q = rq(num_shards=1)
    ctl, data = q._transport.control, q._transport.data
    tok = await ctl.allocate("p", 2, ("x",), nbytes=2 * 65536, version=None, timeout=None,
                             nowait=False)
    await ctl.abort(tok)  # deletes rows 0, 1 from the unit, which never had them
    await data.put([(tok.shards[0], tok.rows, {"x": torch.zeros(2, 16384)})])  # late data
    st = await q.stats()
    assert st.rows == 0 and st.unit_rows == [0] and st.unit_bytes == [0]
    assert (await _arena(q))["used"] == 0


def _count_calls(monkeypatch) -> list[str]:
    """The names of the socket calls this process makes from now on (until
    ``monkeypatch.undo()``), but for reports of bytes moved (``path_bytes``: sent on
    their own schedule, a call when this loop has no connection to the controller yet)."""
    from streamrl.transport.rpc import RpcClient

    calls: list[str] = []
    call = RpcClient.call

    async def counted(self, method, *args, **kwargs):
        # a call the caller may cancel goes as cancellable(rid, method, args, kwargs)
        if method != "path_bytes":
            calls.append(args[1] if method == "cancellable" else method)
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(RpcClient, "call", counted)
    return calls


async def test_a_small_put_is_one_call_to_a_storage_unit(rq, monkeypatch):
    """A small put of new rows goes to one storage unit, which admits and commits it
    (producer -> unit -> controller): no call from the producer to the controller. A big
    put (tensors through the arena) asks the controller for room first."""
    q = rq(num_shards=2)
    await q.put({"x": torch.zeros(1)}, partition="warm")  # connections and id leases
    calls = _count_calls(monkeypatch)
    put = await q.put({"x": torch.arange(3.0), "chat": [{"t": i} for i in range(3)]},
                      partition="p")
    assert calls == ["put_rows"]
    calls.clear()
    await q.put({"x": torch.zeros(2, 65536)}, partition="big")
    assert calls[0] == "allocate" and "put_rows" not in calls
    monkeypatch.undo()
    mb = await q.get("t", ["x", "chat"], 3, partition="p", timeout=10)
    td = await mb.materialize()
    assert mb.rows == put.rows and torch.equal(td["x"], torch.arange(3.0))
    assert [c["t"] for c in td["chat"]] == [0, 1, 2]


async def test_a_small_write_of_new_fields_is_one_call_to_its_unit(rq, monkeypatch):
    """A small write of new fields to rows of one storage unit goes to that unit, which
    stores it and has the controller admit and commit it (one call from the writer, none
    to the controller). The usual way (room asked of the controller, the store, the
    commit) stays for an overwrite, rows of several units, big tensors and a field the
    rows hold already, which says why (DuplicateField). Nothing is left behind by any."""
    from streamrl.errors import DuplicateField, RowsDropped

    q = rq(num_shards=2)
    await q.put({"x": torch.zeros(1)}, partition="warm")  # connections and id leases
    rows = await q.put({"x": torch.arange(3.0)}, partition="p")
    calls = _count_calls(monkeypatch)
    await rows.write({"y": torch.arange(3.0) * 2, "chat": ["a", "b", "c"]})
    assert calls == ["write_rows"]
    calls.clear()
    with pytest.raises(DuplicateField):
        await rows[1:].write({"y": torch.zeros(2)})
    assert calls == ["write_rows", "begin_write"]  # (the unit holds y: the usual way)
    calls.clear()
    await rows.write({"y": torch.full((3,), 7.0)}, overwrite=True)
    await rows.write({"big": torch.zeros(3, 65536)})
    assert "write_rows" not in calls and calls.count("begin_write") == 2
    parts = [await q.put({"x": torch.zeros(1)}, partition="p") for _ in range(2)]
    spread = streamrl.RowRemoteBatch.concat(parts)  # (small puts go round the units)
    assert sorted(spread.shards) == [0, 1]
    calls.clear()
    await spread.write({"y": torch.ones(2)})
    assert "write_rows" not in calls and "begin_write" in calls
    monkeypatch.undo()
    await q.drop(rows[2:])
    with pytest.raises(RowsDropped):
        await rows.write({"z": torch.ones(3)})  # (refused by the controller: taken back)
    mb = await q.get("t", ["x", "y", "chat"], 2, partition="p", timeout=10)
    td = await mb.materialize()
    assert mb.rows == rows.rows[:2] and td["y"].tolist() == [7.0, 7.0]
    assert td["chat"] == ["a", "b"]
    await mb.drop()
    await q.drop(spread)
    assert await q.audit() == []
    st = await q.stats()
    assert st.rows == 1 and st.bytes == 4  # (the warm-up row)


async def test_concurrent_small_puts_of_a_process_are_combined_into_fewer_calls(rq, monkeypatch):
    """One process putting many one-row samples at once (the episodes of an env worker):
    the puts made while others are in flight go to a unit as one call, and every row
    is delivered once, with the values its own put gave it."""
    q = rq(num_shards=2)
    await q.put({"x": torch.zeros(1)}, partition="warm")  # connections and id leases
    calls = _count_calls(monkeypatch)
    puts = await asyncio.gather(*[q.put({"x": torch.tensor([float(i)]), "chat": [f"c{i}"]},
                                        partition="p") for i in range(64)])
    monkeypatch.undo()
    assert 2 <= calls.count("put_rows") < 16 and "allocate" not in calls
    assert len({r for p in puts for r in p.rows}) == 64
    want = {p.rows[0]: i for i, p in enumerate(puts)}
    mb = await q.get("t", ["x", "chat"], 64, partition="p", timeout=10)
    td = await mb.materialize()
    for r, x, c in zip(mb.rows, td["x"].tolist(), td["chat"]):
        assert x == want[r] and c == f"c{want[r]}"
    await mb.drop()
    st = await q.stats()
    assert st.put == 65 and st.rows == 1


async def test_one_row_puts_of_dense_tensors_take_the_quick_path_and_combine(rq, monkeypatch):
    """A one-row put of plain dense tensors skips the column checks (read once, see
    ``columns.one_row_dense``) and still combines with puts of its kind that went the
    usual way (numpy rows, made tensors by ``to_columns``); every row reads back with its
    own values, and a one-row put that is not plain still raises its usual error."""
    import streamrl.queue as queue_mod

    q = rq(num_shards=2)
    await q.put({"x": torch.zeros(1, 2), "r": torch.zeros(1)}, partition="warm")
    usual = []
    to_columns = queue_mod.to_columns

    def counted(data):
        usual.append(data)
        return to_columns(data)

    monkeypatch.setattr(queue_mod, "to_columns", counted)
    calls = _count_calls(monkeypatch)

    def row(i: int):
        if i % 2:  # (numpy: the usual way)
            return {"x": np.full((1, 2), i, dtype=np.float32), "r": np.array([i], np.float32)}
        return {"x": torch.full((1, 2), float(i)), "r": torch.tensor([float(i)])}

    puts = await asyncio.gather(*[q.put(row(i), partition="p") for i in range(64)])
    monkeypatch.undo()
    assert len(usual) == 32  # the numpy puts alone went through to_columns
    assert 2 <= calls.count("put_rows") < 16 and "allocate" not in calls
    want = {p.rows[0]: i for i, p in enumerate(puts)}
    mb = await q.get("t", ["x", "r"], 64, partition="p", timeout=10)
    td = await mb.materialize()
    for r, x, v in zip(mb.rows, td["x"].tolist(), td["r"].tolist()):
        assert x == [want[r]] * 2 and v == want[r]
    await mb.drop()
    with pytest.raises(SchemaError):  # (one row of x, two of r: the usual path's error)
        await q.put({"x": torch.zeros(1, 2), "r": torch.zeros(2)}, partition="p")
    st = await q.stats()
    assert st.put == 65 and st.rows == 1


async def test_a_combined_small_put_cancelled_in_flight_takes_back_only_its_rows(rq):
    """A put cancelled while the call it was combined into is in flight: once the call
    is answered, its row is dropped as "cancelled" and the cancellation goes on; the
    other puts of the call keep theirs."""
    from streamrl.transport.ray.coalesce import PutCoalescer

    q = rq(num_shards=1)
    await q.put({"x": torch.tensor([-1.0])}, partition="warm")
    unit = q._transport._units[0]
    await unit.__ray_call__.remote(
        lambda self: setattr(self, "_controller", _SlowController(self._controller)))
    dp = q._transport.data
    c = dp._coalescer = PutCoalescer(dp._put_rows_call, dp._retract_rows, max_in_flight=1)
    await _cancel_one_of_three_combined(
        q, lambda: _true(c.in_flight == 1), lambda: _true(c.calls == 2), 0.2)
    assert c.rows == 4  # (one call with the three combined)
    await _only_the_cancelled_row_dropped(q)


async def _cancel_one_of_three_combined(q, first_sent, three_sent, pause: float) -> None:
    """Put one row; once ``first_sent()``, three more (combined behind it); once
    ``three_sent()``, cancel the middle one: it must wait for its call (and the undo),
    then raise, while the others are put."""
    first = asyncio.ensure_future(q.put({"x": torch.tensor([0.0])}, partition="p"))
    await _until(first_sent, "the first put to be sent")
    rest = [asyncio.ensure_future(q.put({"x": torch.tensor([float(i)])}, partition="p"))
            for i in (1, 2, 3)]
    await _until(three_sent, "the three to be sent together", timeout=10)
    rest[1].cancel()
    await asyncio.sleep(pause)
    assert not rest[1].done()  # it waits for the answer and the undo
    await asyncio.gather(first, rest[0], rest[2])
    with pytest.raises(asyncio.CancelledError):
        await rest[1]


async def _only_the_cancelled_row_dropped(q) -> None:
    """After :func:`_cancel_one_of_three_combined` (and one warm-up row): controller and
    unit hold 4 rows, one was dropped as "cancelled", the three put read back."""
    st = await q.stats()
    assert st.rows == 4 and st.unit_rows == [4] and st.dropped_by.get("cancelled") == 1
    mb = await q.get("t", ["x"], 3, partition="p", timeout=10)
    assert sorted((await mb.materialize())["x"].tolist()) == [0.0, 1.0, 3.0]


async def _true(v: bool) -> bool:
    return v


async def test_a_small_put_that_is_refused_leaves_nothing_in_its_unit(rq):
    """The unit stores a small put before the controller admits it; a put the controller
    refuses (sealed partition, closed queue) raises as usual and the unit forgets it."""
    from streamrl.errors import QueueClosed

    q = rq(num_shards=1)
    await q.put({"x": torch.zeros(1)}, partition="p")
    await q.seal("p")
    with pytest.raises(InvalidArgument, match="sealed"):
        await q.put({"x": torch.zeros(1)}, partition="p")
    st = await q.stats()
    assert st.rows == 1 and st.unit_rows == [1]
    await q.close()
    with pytest.raises(QueueClosed):
        await q.put({"x": torch.zeros(1)}, partition="q")
    st = await q.stats()
    assert st.rows == 1 and st.unit_rows == [1]


async def test_a_small_put_into_a_full_queue_waits_its_turn_at_the_controller(rq, monkeypatch):
    """No room: the put goes again to a unit, which holds its row (outside the
    capacity) while the controller has it wait its turn; once room frees it is admitted
    and committed there. The producer makes no call to the controller: the first
    attempt is handed back (the queue is full), the second waits."""
    q = rq(num_shards=2, capacity=2)
    for i in range(2):
        await q.put({"x": torch.tensor([i])}, partition="p")
    calls = _count_calls(monkeypatch)
    third = asyncio.ensure_future(q.put({"x": torch.tensor([2])}, partition="p"))
    await anyio.sleep(0.3)
    assert not third.done() and calls == ["put_rows", "put_rows"]
    monkeypatch.undo()
    st = await q.stats()
    assert st.rows == 2 and sum(st.unit_rows) == 3  # its unit holds it while it waits
    assert await q.audit() == []  # (a row waiting for room is no stray)
    mb = await q.get("t", ["x"], 1, partition="p", timeout=10)
    await mb.drop()
    with anyio.fail_after(10):
        put = await third
    st = await q.stats()
    assert st.rows == 2 and sum(st.unit_rows) == 2
    mb = await q.get("t", ["x"], 2, partition="p", timeout=10)
    assert put.rows[0] in mb.rows


async def test_a_unit_holds_at_most_wait_bytes_of_waiting_puts(rq, monkeypatch):
    """Past its WAIT_BYTES of waiting puts, a unit hands a put that may wait back, and
    the producer waits for room the usual way, holding its row itself."""
    q = rq(num_shards=1, capacity=2)
    await q._transport._units[0].__ray_call__.remote(lambda u: setattr(u, "wait_bytes", 0))
    for i in range(2):
        await q.put({"x": torch.tensor([i])}, partition="p")
    calls = _count_calls(monkeypatch)
    third = asyncio.ensure_future(q.put({"x": torch.tensor([2])}, partition="p"))
    await anyio.sleep(0.3)
    assert not third.done() and calls == ["put_rows", "put_rows", "allocate"]
    monkeypatch.undo()
    assert (await q.stats()).unit_rows == [2]  # the waiting put's row is not stored
    mb = await q.get("t", ["x"], 1, partition="p", timeout=10)
    await mb.drop()
    with anyio.fail_after(10):
        await third
    st = await q.stats()
    assert st.rows == 2 and st.unit_rows == [2]


async def test_a_small_put_cancelled_while_it_waits_for_room_leaves_nothing(rq):
    """Cancelled while it waits at the controller: the controller forgets it, its unit
    deletes its row, and nothing of it is ever admitted or delivered; the room that
    frees goes to the next put."""
    q = rq(num_shards=1, capacity=2)
    for i in range(2):
        await q.put({"x": torch.tensor([i])}, partition="p")
    third = asyncio.ensure_future(q.put({"x": torch.tensor([2])}, partition="p"))

    async def held() -> bool:
        return (await q.stats()).unit_rows == [3]

    await _until(held, "the unit to hold the waiting put")
    third.cancel()
    with pytest.raises(asyncio.CancelledError):
        await third
    st = await q.stats()
    assert st.rows == 2 and st.unit_rows == [2] and st.put == 2
    assert "cancelled" not in st.dropped_by  # (never admitted)
    mb = await q.get("t", ["x"], 1, partition="p", timeout=10)
    await mb.drop()
    await q.put({"x": torch.tensor([3])}, partition="p")
    await q.seal("p")
    got = []
    async for mb in q.stream("t", ["x"], 1, partition="p", timeout=10):
        got += (await mb.materialize())["x"].tolist()
        await mb.drop()
    assert sorted(got) == [1, 3]
    st = await q.stats()
    assert st.rows == 0 and st.unit_rows == [0]


async def test_concurrent_small_puts_into_a_full_queue_wait_for_room_together(rq, monkeypatch):
    """No room in the units: the puts a process makes meanwhile ask the controller for
    room together (one request for them all) instead of one request each, and every row
    is delivered once, with the values its own put gave it."""
    q = rq(num_shards=2, capacity=16)
    for i in range(16):
        await q.put({"x": torch.tensor([float(i)])}, partition="p")
    calls = _count_calls(monkeypatch)
    puts = asyncio.ensure_future(asyncio.gather(*[
        q.put({"x": torch.tensor([float(100 + i)])}, partition="p") for i in range(12)]))
    seen: dict[int, float] = {}
    while len(seen) < 28:
        mb = await q.get("t", ["x"], 4, partition="p", timeout=10)
        for r, x in zip(mb.rows, (await mb.materialize())["x"].tolist()):
            assert r not in seen
            seen[r] = x
        await mb.drop()
    rows = await puts
    monkeypatch.undo()
    assert sorted(seen.values()) == [float(i) for i in range(16)] + [
        float(100 + i) for i in range(12)]
    for i, p in enumerate(rows):
        assert seen[p.rows[0]] == 100 + i
    assert calls.count("allocate") <= 4  # one for the first, one for those behind it (+2)
    st = await q.stats()
    assert st.rows == 0 and sum(st.unit_rows) == 0 and st.put == 28


async def test_a_small_put_cancelled_while_its_group_waits_for_room_leaves_at_once(rq):
    """A put combined with others that wait for room together, cancelled: it leaves
    once the group's waiting put is withdrawn (the group asks again without it) and
    nothing of it is kept; the others are put once room comes."""
    from streamrl.transport.ray.coalesce import ROOMS

    q = rq(num_shards=1, capacity=4)
    for i in range(4):
        await q.put({"x": torch.tensor([float(i)])}, partition="p")
    c = q._transport.data._coalescer
    c0 = c.calls
    first = [asyncio.ensure_future(q.put({"x": torch.tensor([float(10 + i)])}, partition="p"))
             for i in range(ROOMS)]  # each waits for room at the controller, alone
    await _until(lambda: _true(sum(c._rooms.values()) == ROOMS), "the first puts to wait")
    rest = [asyncio.ensure_future(q.put({"x": torch.tensor([float(20 + i)])}, partition="p"))
            for i in range(3)]
    await asyncio.sleep(0.2)
    assert c.calls == c0 + ROOMS  # (the three wait behind them, in this process)
    seen = []
    mb = await q.get("t", ["x"], 1, partition="p", timeout=10)  # room for one
    seen += (await mb.materialize())["x"].tolist()
    await mb.drop()
    await first[0]
    await _until(lambda: _true(c.calls == c0 + ROOMS + 1), "the three to go together")
    await asyncio.sleep(0.3)  # (they find no room and wait for it)
    assert not any(t.done() for t in rest) and sum(c._rooms.values()) == ROOMS
    rest[1].cancel()
    with anyio.fail_after(5):
        with pytest.raises(asyncio.CancelledError):
            await rest[1]
    want = [0.0, 1.0, 2.0, 3.0] + [float(10 + i) for i in range(ROOMS)] + [20.0, 22.0]
    while len(seen) < len(want):
        mb = await q.get("t", ["x"], 1, partition="p", timeout=10)
        seen += (await mb.materialize())["x"].tolist()
        await mb.drop()
    await asyncio.gather(*first, rest[0], rest[2])
    assert sorted(seen) == want
    # (the first ones, then the two left, together: each waited at the controller)
    assert c.wait_rows == ROOMS + 2 and c.usual_rows == 0
    st = await q.stats()
    assert st.put == len(want) and st.rows == 0 and sum(st.unit_rows) == 0
    assert "cancelled" not in st.dropped_by


async def test_a_small_put_cancelled_while_its_group_is_stored_takes_back_its_row(rq,
                                                                                 monkeypatch):
    """Puts that went the usual way together (the units had no room): one cancelled
    while the group's rows are being stored waits for the store, has its own row (only
    it) dropped as "cancelled", then raises; controller and units agree."""
    import time

    q = rq(num_shards=1, capacity=16)
    await q.put({"x": torch.tensor([-1.0])}, partition="warm")
    dp = q._transport.data
    c = dp._coalescer
    dp._busy_until = time.monotonic() + 600  # the units say "no room": the usual way
    monkeypatch.setattr(c, "_send_waiting", None)  # (not waiting at the controller)
    stores = []
    put = dp.put

    async def slow(*args, **kwargs):
        stores.append(args)
        await asyncio.sleep(0.5)
        return await put(*args, **kwargs)

    monkeypatch.setattr(dp, "put", slow)
    await _cancel_one_of_three_combined(
        q, lambda: _true(len(stores) == 1), lambda: _true(len(stores) == 2), 0.1)
    monkeypatch.undo()
    assert c.usual_rows == 4 and len(stores) == 2
    await _only_the_cancelled_row_dropped(q)


class _SlowController:
    """Wraps a unit's control-plane client: put_rows waits 2 s before it is sent."""

    def __init__(self, control):
        self.control = control

    def __getattr__(self, name):
        return getattr(self.control, name)

    async def put_rows(self, *args, **kwargs):
        await asyncio.sleep(2.0)
        return await self.control.put_rows(*args, **kwargs)


@ray.remote(num_cpus=0)
class OneRowProducer:
    async def put(self, q):
        await q.put({"x": torch.tensor([7])}, partition="p")


async def test_a_producer_that_dies_during_a_small_put_leaves_no_stray_data(rq):
    """The producer dies after its unit stored the put and before the controller
    admitted it: the unit finishes the put (the rows land, whole), so no data is left
    in the unit that the controller does not know of."""
    q = rq(num_shards=1)
    unit = q._transport._units[0]
    await unit.__ray_call__.remote(
        lambda self: setattr(self, "_controller", _SlowController(self._controller)))
    prod = OneRowProducer.remote()
    prod.put.remote(q)
    await _until(lambda: _stored_not_admitted(q), "the unit to store the put")
    await _kill(prod)
    await _until(lambda: _rows_are(q, 1), "the put to land")
    mb = await q.get("t", ["x"], 1, partition="p", timeout=10)
    assert (await mb.materialize())["x"].tolist() == [7]
    await mb.drop()
    await _until(lambda: _rows_are(q, 0), "the drop")


async def _stored_not_admitted(q) -> bool:
    st = await q.stats()
    return st.unit_rows == [1] and st.rows == 0


async def _rows_are(q, n: int) -> bool:
    st = await q.stats()
    return st.rows == n and st.unit_rows == [n]


def _no_room(self, need):
    raise OSError(28, "No space left on device")


async def test_bytes_go_inline_when_the_arena_cannot_grow(rq):
    q = rq(num_shards=1)
    unit = q._transport._units[0]
    await unit.__ray_call__.remote(lambda self: setattr(self.arena, "_grow", _no_room.__get__(self.arena)))
    x = torch.randn(8, 16384)
    await q.put({"x": x}, partition="p")
    assert (await _arena(q))["used"] == 0
    mb = await q.get("t", ["x"], 8, partition="p")
    assert torch.equal((await mb.materialize())["x"], x)


def test_bad_ray_options_say_what_to_pass(transport):
    with pytest.raises(streamrl.errors.InvalidArgument, match="ownership"):
        streamrl.StreamQueue(transport="ray", ownership="producer")
    with pytest.raises(streamrl.errors.InvalidArgument, match="direct_calls"):
        streamrl.StreamQueue(transport="ray", direct_calls="yes")


async def test_controller_actor_runs_on_uvloop(rq):
    pytest.importorskip("uvloop")
    q = rq()
    assert (await q._transport._controller.event_loop.remote()).startswith("uvloop")


async def test_arena_reserve_makes_room_at_start_and_is_validated(rq):
    """arena_reserve= makes shared memory on each unit at start (whole segments); bad
    values are refused before any actor starts."""
    from streamrl.arena import SEGMENT_BYTES

    q = rq(num_shards=1, arena_reserve=1 << 20)
    await _until(lambda: _arena_size_is(q, SEGMENT_BYTES), "the reserve")
    await q.put({"x": torch.ones(4, 1024)}, partition="p")  # lands in the reserved segment
    assert (await _arena(q))["size"] == SEGMENT_BYTES
    for bad in (-1, 1.5, "1G"):
        with pytest.raises(InvalidArgument, match="arena_reserve"):
            streamrl.StreamQueue(transport="ray", arena_reserve=bad)
    with pytest.raises(InvalidArgument, match="capacity_bytes"):
        streamrl.StreamQueue(transport="ray", arena_reserve=True)


async def _arena_size_is(q, size: int) -> bool:
    return (await _arena(q))["size"] == size


async def test_controller_and_unit_actors_start_without_torch(rq):
    """The controller and storage-unit actors hold metadata and bytes: they never import
    torch or tensordict, which cost each new actor process seconds of CPU to start (most
    of a Ray queue's start on this machine), unless a filter of the queue needs them."""
    q = rq(consumers=["t"])
    rows = await q.put({"x": torch.arange(8).reshape(2, 4), "o": ["a", "b"]}, partition="p")
    mb = await q.get("t", ["x", "o"], batch_size=2, partition="p", timeout=30)
    assert (await mb.materialize())["x"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    await mb.ack()
    assert len(rows) == 2
    t = q._transport
    # (a lambda travels by value: a function of this module would make the actor
    # import the module, and with it torch)
    heavy = lambda self: sorted(  # noqa: E731
        m for m in ("torch", "tensordict") if m in __import__("sys").modules)
    for actor in [t._controller, *t._units]:
        assert await actor.__ray_call__.remote(heavy) == []


def _families(rpc) -> list:
    """The address families of an RpcClient's open connections (one per event loop)."""
    from streamrl.transport.rpc import _ready

    return [c.transport.get_extra_info("socket").family
            for c in (_ready(f) for f in list(rpc._conns.values())) if c is not None]


async def test_calls_between_processes_of_one_machine_go_over_unix_sockets(rq):
    """On Linux, every call between the driver and the actors, and from a storage unit
    to the controller, goes over the actors' Unix sockets when they share a machine (a
    lighter message than TCP loopback); nothing is lost on the way."""
    import socket
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("the abstract Unix socket namespace is Linux's")
    q = rq(num_shards=2, consumers=["t"])
    for i in range(4):  # one-row puts: each a call to a unit, and from it to the controller
        await q.put({"x": torch.full((1, 3), i)}, partition="p")
    mb = await q.get("t", ["x"], batch_size=4, partition="p", timeout=30)
    assert sorted((await mb.materialize())["x"][:, 0].tolist()) == [0, 1, 2, 3]
    await mb.ack()
    t = q._transport
    clients = [t._control.rpc, *t._data.rpcs]
    assert all(_families(c) == [socket.AF_UNIX] for c in clients), [
        _families(c) for c in clients]

    def unit_to_controller(unit) -> list:
        return _families(unit._controller.rpc)

    got = await asyncio.gather(*[u.__ray_call__.remote(unit_to_controller) for u in t._units])
    assert [f for fams in got for f in fams] and all(
        f == socket.AF_UNIX for fams in got for f in fams), got
