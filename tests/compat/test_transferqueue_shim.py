"""streamrl.compat.transferqueue: TransferQueue's client API over a StreamQueue.

Round trips, insert mode, the key-value calls, the status calls, waiting and polling
get_meta, and the TransferQueue defects the layer fixes (a waiting get_meta holds up
nobody, no CPU asked for, bounded data, owned reads, GRPO groups by insertion order), on
the embedded and Ray transports. The pure controller and the samplers are tested without
any transport.
"""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import streamrl
import streamrl.compat.transferqueue as tq
from streamrl.compat.transferqueue import interface
from streamrl.compat.transferqueue.controller import TQController
from streamrl.compat.transferqueue.metadata import BatchMeta
from streamrl.compat.transferqueue.sampler import (GRPOGroupNSampler, RankAwareSampler,
                                                   SeqlenBalancedSampler, SequentialSampler)
from streamrl.errors import NotSupported, QueueFull, StreamTimeout

from conftest import TRANSPORTS

CAPACITY = 64


def _conf(transport: str, **controller) -> dict:
    return {"controller": {"polling_mode": False, "get_meta_timeout": 10.0, **controller},
            "backend": {"SimpleStorage": {"total_storage_size": CAPACITY,
                                          "num_data_storage_units": 2}},
            "streamrl": {"transport": transport}}


@pytest.fixture(scope="module", params=TRANSPORTS)
def system(request):
    """One TransferQueue system per transport for the module (blocking get_meta, 64 rows)."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    tq.init(_conf(request.param))
    yield request.param
    tq.close()


@pytest.fixture
def client(system):
    c = tq.get_client()
    yield c
    for pid in c.get_partition_list():
        c.clear_partition(pid)
    assert _held() == (0, 0), "rows left behind after every partition was cleared"


def _held() -> tuple[int, int]:
    sysm = interface._SYSTEM
    st = sysm.loop.run(sysm.queue.stats())
    return st.rows, st.bytes


def _td(n: int, start: int = 0) -> TensorDict:
    idx = torch.arange(start, start + n)
    return TensorDict({
        "prompt": torch.stack([torch.arange(i, i + 4, dtype=torch.float32) for i in idx]),
        "uid": idx.clone(),
        "text": NonTensorStack(*[f"s{i}" for i in idx.tolist()]),
        "resp": torch.nested.as_nested_tensor([torch.ones(1 + i % 3) * i for i in idx.tolist()],
                                              layout=torch.jagged),
    }, batch_size=[n])


# ---------------------------------------------------------------------- round trips


def test_put_get_meta_get_data_round_trip(client):
    put = client.put(data=_td(6), partition_id="p")
    assert put.size == 6 and put.is_ready and put.partition_ids == ["p"] * 6
    assert put.field_schema["resp"]["is_nested"] and not put.field_schema["prompt"]["is_nested"]
    meta = client.get_meta(data_fields=["prompt", "text", "resp", "uid"], batch_size=6,
                           partition_id="p", task_name="train")
    assert sorted(meta.global_indexes) == sorted(put.global_indexes) and meta.is_ready
    td = client.get_data(meta)
    order = [put.global_indexes.index(i) for i in meta.global_indexes]
    want = _td(6)
    assert td["prompt"].is_nested  # TransferQueue's layout: samples of >= 1 dim, nested
    for k, j in enumerate(order):
        assert torch.equal(td["prompt"][k], want["prompt"][j])
        assert torch.equal(td["resp"][k], want["resp"][j])
    assert td["uid"].tolist() == [want["uid"][j].item() for j in order]
    assert td["text"] == [f"s{j}" for j in order]


def test_get_data_of_a_put_meta_and_a_subset_of_fields(client):
    put = client.put(data=_td(4), partition_id="p")
    td = client.get_data(put.select_fields(["uid"]))
    assert list(td.keys()) == ["uid"] and td["uid"].tolist() == [0, 1, 2, 3]
    assert client.get_data(BatchMeta.empty()).batch_size[0] == 0


def test_numpy_and_non_tensor_data_are_per_sample(client):
    n = 3
    data = TensorDict({"b": np.array([b"a", b"b", b"c"], dtype="|S4"),
                       "o": np.array(["x", "y", "z"], dtype=object),
                       "f": np.arange(6.0).reshape(3, 2),
                       "d": [{"k": i} for i in range(n)]}, batch_size=[n])
    meta = client.put(data=data, partition_id="p")
    td = client.get_data(meta)
    assert list(td["b"]) == [b"a", b"b", b"c"] and list(td["o"]) == ["x", "y", "z"]
    assert td["d"] == [{"k": 0}, {"k": 1}, {"k": 2}]
    assert torch.equal(td["f"][1], torch.tensor([2.0, 3.0], dtype=torch.float64))


def test_insert_then_put_with_metadata_and_overwrite(client):
    alloc = client.get_meta(data_fields=["x", "y"], batch_size=4, partition_id="p", mode="insert")
    assert alloc.size == 4 and not alloc.is_ready and alloc.field_names == ["x", "y"]
    assert not client.check_production_status(["x"], "p")
    client.put(data=TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]),
               metadata=alloc.select_samples([0, 1]))
    # a stale metadata (no rows known) writing to bound and unbound samples alike
    client.put(data=TensorDict({"x": torch.ones(4, 3), "y": torch.arange(4)}, batch_size=[4]),
               metadata=alloc)
    assert client.check_production_status(["x", "y"], "p")
    meta = client.get_meta(data_fields=["x", "y"], batch_size=4, partition_id="p",
                           mode="force_fetch")
    td = client.get_data(meta)
    assert all(torch.equal(td["x"][i], torch.ones(3)) for i in range(4))
    assert _held()[0] == 4, "the overwrite made rows of its own"


def test_dtype_is_per_partition(client):
    client.put(data=TensorDict({"s": torch.ones(2)}, batch_size=[2]), partition_id="a")
    client.put(data=TensorDict({"s": NonTensorStack("u", "v")}, batch_size=[2]), partition_id="b")
    assert client.get_data(client.get_meta(["s"], 2, "b", mode="force_fetch"))["s"] == ["u", "v"]
    alloc = client.get_meta(data_fields=["s"], batch_size=2, partition_id="a", mode="insert")
    before = _held()[0]
    with pytest.raises(ValueError, match="one dtype in a partition"):
        client.put(data=TensorDict({"s": torch.arange(2)}, batch_size=[2]), metadata=alloc)
    assert _held()[0] == before, "a refused put left rows behind"


def test_get_data_is_a_copy_the_caller_owns(client):
    client.put(data=TensorDict({"x": torch.zeros(3, 4), "l": [{"v": [i]} for i in range(3)]},
                               batch_size=[3]), partition_id="p")
    meta = client.get_meta(["x", "l"], 3, "p", mode="force_fetch")
    td = client.get_data(meta)
    first = copy.deepcopy(td["l"][0])
    td["x"].values().fill_(7)
    td["l"][0]["v"].append(99)
    again = client.get_data(meta)
    assert float(again["x"].values().sum()) == 0 and again["l"][0] == first


def test_clear_samples_and_clear_partition_free_room(client):
    put = client.put(data=_td(8), partition_id="p")
    client.clear_samples(put.select_samples([0, 1, 2]))
    assert _held()[0] == 5
    assert client.get_meta(["uid"], 1, "p", mode="force_fetch").size == 5
    client.clear_partition("p")
    assert "p" not in client.get_partition_list() and _held() == (0, 0)
    assert not client.check_production_status(["uid"], "p")


# ---------------------------------------------------------------------- status calls


def test_consumption_is_marked_at_get_meta_and_reset(client):
    client.put(data=_td(4), partition_id="p")
    assert not client.check_consumption_status("t", "p")
    meta = client.get_meta(["uid"], 4, "p", task_name="t")
    assert client.check_consumption_status("t", "p")
    idx, st = client.get_consumption_status("t", "p")
    assert sorted(idx.tolist()) == sorted(meta.global_indexes) and st.tolist() == [1] * 4
    assert client.reset_consumption("p", "t") is True
    assert not client.check_consumption_status("t", "p")
    assert client.get_meta(["uid"], 4, "p", task_name="t").size == 4
    assert client.reset_consumption("nowhere") is False


def test_set_custom_meta_and_partition_list(client):
    put = client.put(data=_td(3), partition_id="p")
    put.update_custom_meta([{"score": i / 10} for i in range(3)])
    client.set_custom_meta(put)
    meta = client.get_meta(["uid"], 3, "p", mode="force_fetch")
    got = {i: m["score"] for i, m in zip(meta.global_indexes, meta.get_all_custom_meta())}
    assert got == {i: k / 10 for k, i in enumerate(put.global_indexes)}
    _, prod = client.get_production_status(["uid", "text"], "p")
    assert prod.shape == (3, 2) and bool((prod == 1).all())
    assert client.get_production_status(["nope"], "p") == (None, None)
    assert client.get_partition_list() == ["p"]


# ---------------------------------------------------------------------- key-value calls


def test_kv_calls(client):
    m = tq.kv_put("a", "kv", fields={"x": torch.tensor([1, 2, 3])}, tag={"v": 1})
    assert m.fields == ["x"] and m.tags == [{"v": 1}]
    m = tq.kv_put("a", "kv", fields={"y": torch.tensor([9])}, tag={"v": 2})
    assert m.fields == ["x", "y"], "the fields of a key accumulate"
    tq.kv_batch_put(["b", "c"], "kv", TensorDict({"x": torch.tensor([[4, 5, 6], [7, 8, 9]])},
                                                 batch_size=[2]), tags=[{"v": 3}, {"v": 4}])
    got = tq.kv_batch_get(["c", "a"], "kv", select_fields="x")
    assert [t.tolist() for t in got["x"]] == [[7, 8, 9], [1, 2, 3]]
    assert tq.kv_list("kv") == {"kv": {"a": {"v": 2}, "b": {"v": 3}, "c": {"v": 4}}}
    assert [t.tolist() for t in tq.kv_batch_get_by_meta(m)["y"]] == [[9]]
    with pytest.raises(ValueError, match="select_fields"):
        tq.kv_batch_get_by_meta(m, select_fields="nope")
    tq.kv_clear(["a", "missing"], "kv")
    assert set(tq.kv_list("kv")["kv"]) == {"b", "c"}
    with pytest.raises(ValueError, match="not found"):
        tq.kv_batch_get("a", "kv")
    assert client.kv_retrieve_keys(client.kv_retrieve_meta("b", "kv").global_indexes, "kv") == ["b"]


def test_async_twins_from_fresh_event_loops(client):
    async def go():
        await tq.async_kv_batch_put(["k0", "k1"], "akv",
                                    TensorDict({"x": torch.arange(2)}, batch_size=[2]))
        c = tq.get_client()
        await c.async_put(data=_td(2), partition_id="ap")
        meta = await c.async_get_meta(["uid"], 2, "ap", task_name="t")
        return (await tq.async_kv_batch_get(["k1"], "akv"))["x"].tolist(), \
            (await c.async_get_data(meta))["uid"].tolist(), await tq.async_kv_list()

    for _ in range(2):  # each asyncio.run is a new loop, as TransferQueue's tests use it
        x, uid, listed = asyncio.run(go())
        assert x == [1] and sorted(uid) == [0, 1] and set(listed["akv"]) == {"k0", "k1"}
        asyncio.run(tq.async_kv_clear(["k0", "k1"], "akv"))
        tq.get_client().clear_partition("ap")


# ---------------------------------------------------------------------- waiting


def _in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_waiting_get_meta_holds_up_no_other_client(client):
    """TransferQueue's controller sleeps 5 s in its only request thread while a
    get_meta waits; here the others go on, and the waiter wakes when data comes."""
    t, box = _in_thread(lambda: client.get_meta(["uid"], 2, "slow", task_name="t"))
    time.sleep(0.3)
    t0 = time.perf_counter()
    client.put(data=_td(2), partition_id="fast")
    td = client.get_data(client.get_meta(["uid"], 2, "fast", task_name="t"))
    assert time.perf_counter() - t0 < 2.0 and len(td) == 2
    assert t.is_alive(), "get_meta did not wait"
    t1 = time.perf_counter()
    client.put(data=_td(2), partition_id="slow")
    t.join(5)
    assert not t.is_alive() and box["value"].size == 2, box
    assert time.perf_counter() - t1 < 2.0


def test_waiting_get_meta_times_out(system):
    if system != "embedded":
        pytest.skip("transport-independent (the controller's loop); a Ray restart costs 10 s")
    tq.close()
    tq.init(_conf(system, get_meta_timeout=0.3))
    try:
        with pytest.raises(TimeoutError, match="get_meta waited"):
            tq.get_client().get_meta(["uid"], 1, "never", task_name="t")
    finally:
        tq.close()
        tq.init(_conf(system))


def test_polling_mode_returns_empty_at_once(system):
    if system != "embedded":
        pytest.skip("transport-independent (the controller's loop); a Ray restart costs 10 s")
    tq.close()
    tq.init(_conf(system, polling_mode=True))
    try:
        c = tq.get_client()
        t0 = time.perf_counter()
        assert c.get_meta(["uid"], 1, "p", task_name="t").size == 0
        assert time.perf_counter() - t0 < 1.0
        c.put(data=_td(1), partition_id="p")
        assert c.get_meta(["uid"], 1, "p", task_name="t").size == 1
        c.clear_partition("p")
    finally:
        tq.close()
        tq.init(_conf(system))


# ---------------------------------------------------------------------- bounded


def test_put_waits_for_room_and_one_too_big_raises(client):
    client.put(data=_td(CAPACITY), partition_id="full")
    t, box = _in_thread(lambda: client.put(data=_td(1), partition_id="more"))
    time.sleep(0.5)
    assert t.is_alive(), "a put into a full queue did not wait"
    client.clear_partition("full")
    t.join(10)
    assert not t.is_alive() and box["value"].size == 1, box
    with pytest.raises(QueueFull):
        client.put(data=_td(CAPACITY + 1), partition_id="huge")


def test_put_timeout(system):
    if system != "embedded":
        pytest.skip("the client's code path, the same on every transport")
    tq.close()
    tq.init({**_conf(system), "streamrl": {"transport": system, "put_timeout": 0.3}})
    try:
        c = tq.get_client()
        c.put(data=_td(CAPACITY), partition_id="full")
        with pytest.raises(StreamTimeout):
            c.put(data=_td(1), partition_id="more")
        c.clear_partition("full")
        assert _held() == (0, 0)
    finally:
        tq.close()
        tq.init(_conf(system))


def test_concurrent_first_writes_to_inserted_samples(client):
    """Two producers write different fields to the same new samples at once: one's rows
    win, the other's values are rewritten into them, nothing is left behind."""
    alloc = client.get_meta(["a", "b"], 8, "p", mode="insert")
    go = threading.Barrier(2)

    def write(name):
        go.wait()
        client.put(data=TensorDict({name: torch.full((8,), ord(name))}, batch_size=[8]),
                   metadata=alloc.copy())

    threads = [threading.Thread(target=write, args=(n,)) for n in "ab"]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    meta = client.get_meta(["a", "b"], 8, "p", task_name="t")
    td = client.get_data(meta)
    assert td["a"].tolist() == [97] * 8 and td["b"].tolist() == [98] * 8
    assert _held()[0] == 8


# ---------------------------------------------------------------------- lifecycle


def _rows(x: torch.Tensor) -> list:
    """Per-sample values of a column get_data returned (2-d columns come nested)."""
    return [t.tolist() for t in x.unbind()]


def test_checkpoint_calls_refuse_what_is_not_a_checkpoint(client, tmp_path):
    tq.kv_put("k", "p", fields={"x": torch.ones(2)})
    with pytest.raises(FileNotFoundError, match="not found"):
        tq.load_checkpoint(tmp_path / "missing")
    (tmp_path / "ck").mkdir()
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        tq.load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "metadata.json").write_text('{"storage_saved": false}')
    with pytest.raises(streamrl.errors.CheckpointError, match="holds no data"):
        tq.load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "metadata.json").write_text('{"storage_saved": true}')
    with pytest.raises(FileNotFoundError, match="controller_state.pkl"):
        tq.load_checkpoint(tmp_path / "ck")
    with pytest.raises(NotSupported, match="controller's checkpoint alone"):
        client.save_controller_checkpoint(str(tmp_path / "c.pkl"))
    assert isinstance(NotSupported("x"), (NotImplementedError, streamrl.errors.StreamRLError))
    assert _rows(tq.kv_batch_get("k", "p")["x"]) == [[1.0, 1.0]], "a refused load changed data"


def test_controller_state_round_trip_and_bad_state():
    a = TQController(GRPOGroupNSampler())
    fields = {"x": {"dtype": torch.float32, "_key": "torch.float32", "is_non_tensor": False,
                    "_shapes": [(2,), (3,), (2,)]}}
    a.commit("p", None, [10, 11, 12], [0, 1, 0], fields, [{"i": 0}, {"i": 1}, {}])
    a.kv_retrieve_meta(["k"], "q", create=True)
    assert a.fetch(["x"], 2, "p", "t") is not None
    a.clear_samples("p", [2])
    b = TQController(GRPOGroupNSampler())
    b.load_state(a.state())
    for pid in ("p", "q"):
        sa, sb = a.snapshot(pid), b.snapshot(pid)
        assert sa.global_indexes == sb.global_indexes and sa.keys_mapping == sb.keys_mapping
        assert sa.custom_meta == sb.custom_meta and sa.field_schema == sb.field_schema
        assert torch.equal(sa.production_status, sb.production_status)
        assert {t: v.tolist() for t, v in sa.consumption_status.items()} == \
            {t: v.tolist() for t, v in sb.consumption_status.items()}
    assert b.insert("p", ["x"], 1).global_indexes == a.insert("p", ["x"], 1).global_indexes, \
        "a freed global index was not reused the same way after a load"
    b.rebind({("p", 0): (99, 1)})
    assert b.locate({"p": [0, 1]}, ["x"])["p"][:2] == ([99, 11], [1, 1])
    with pytest.raises(streamrl.errors.CheckpointError, match="format"):
        b.load_state({"format": "something else"})
    assert b.locate({"p": [0]}, ["x"])["p"][0] == [99], "a refused state changed the controller"


def test_checkpoint_round_trip_into_a_changed_system(client, tmp_path):
    """Data of every kind, keys, tags and consumption come back; what was put after the
    save is gone; the queue holds exactly the saved samples."""
    tq.kv_batch_put(["a", "b"], "kv", fields=TensorDict(
        {"x": torch.tensor([[1, 2], [3, 4]]), "t": NonTensorStack("s1", "s2")}, batch_size=[2]),
        tags=[{"i": 0}, {"i": 1}])
    client.put(_td(4), partition_id="train")
    first = client.get_meta(["prompt", "resp"], 2, "train", task_name="actor")
    tq.save_checkpoint(tmp_path / "ck", metadata={"step": 7})
    saved = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert saved["storage_saved"] is True and saved["user_metadata"] == {"step": 7}

    client.clear_partition("kv")
    client.get_meta(["prompt"], 2, "train", task_name="actor")  # consume the rest
    client.put(_td(3, start=100), partition_id="after")
    tq.load_checkpoint(tmp_path / "ck")

    assert sorted(client.get_partition_list()) == ["kv", "train"]
    kv = tq.kv_batch_get(["a", "b"], "kv")
    assert _rows(kv["x"]) == [[1, 2], [3, 4]] and kv["t"].tolist() == ["s1", "s2"]
    assert tq.kv_list("kv") == {"kv": {"a": {"i": 0}, "b": {"i": 1}}}
    rest = client.get_meta(["prompt", "resp"], 2, "train", task_name="actor")
    assert sorted(rest.global_indexes) == sorted(
        set(client.get_meta(["prompt"], 4, "train", mode="force_fetch").global_indexes)
        - set(first.global_indexes)), "consumption before the save was not restored"
    td = client.get_data(rest)
    want = _td(4)
    pos = [sorted(client.get_meta(["prompt"], 4, "train", mode="force_fetch").global_indexes)
           .index(i) for i in rest.global_indexes]
    assert torch.equal(td["prompt"].values().reshape(2, 4), want["prompt"][pos])
    assert [t.tolist() for t in td["resp"].unbind()] == [want["resp"][p].tolist() for p in pos]
    assert _held()[0] == 6, "the queue should hold the 6 saved samples and nothing else"


def test_failed_save_keeps_the_previous_checkpoint_and_damage_is_caught(client, tmp_path,
                                                                       monkeypatch):
    tq.kv_put("k", "p", fields={"x": torch.tensor([1, 2])})
    tq.save_checkpoint(tmp_path / "ck", metadata={"n": 1})

    def boom(self, path):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tq.TransferQueueClient, "save_storage_checkpoint", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        tq.save_checkpoint(tmp_path / "ck", metadata={"n": 2})
    monkeypatch.undo()
    assert json.loads((tmp_path / "ck" / "metadata.json").read_text())["user_metadata"] == {"n": 1}
    assert not (tmp_path / "ck.tmp").exists()

    info = tmp_path / "ck" / "simple_storage" / "storage_unit_info.json"
    info.write_text(json.dumps(json.loads(info.read_text())[:1]))
    with pytest.raises(streamrl.errors.CheckpointError, match="count mismatch"):
        tq.load_checkpoint(tmp_path / "ck")
    assert _rows(tq.kv_batch_get("k", "p")["x"]) == [[1, 2]], "a refused load changed data"


def test_init_twice_and_attach_keep_one_system(client):
    assert tq.init({"controller": {"polling_mode": True}}) is not None
    assert tq.get_client() is client, "a second init replaced the system"


@pytest.mark.ray
@pytest.mark.skipif("ray" not in TRANSPORTS, reason="the Ray transport is not in this run")
def test_ray_default_config_asks_for_no_cpu(ray_session):
    """TransferQueue's default configuration asks for 3 CPUs (controller + 2 units) and
    waits for ever on a 2-CPU node; here nothing asks for a CPU."""
    import ray

    before = ray.available_resources().get("CPU", 0)
    tq.init({"streamrl": {"transport": "ray"}})
    try:
        c = tq.get_client()
        c.put(data=_td(2), partition_id="p")
        assert c.get_meta(["uid"], 2, "p", task_name="t").size == 2
        assert ray.available_resources().get("CPU", 0) == before
        actor = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        snap = ray.get(actor.get_partition_snapshot.remote("p"))
        assert snap.total_samples_num == 2 and set(snap.field_name_mapping) >= {"uid", "prompt"}
        assert ray.get(actor.list_partitions.remote()) == ["p"]

        @ray.remote(num_cpus=0)
        def attached():
            import streamrl.compat.transferqueue as tq2

            tq2.init()
            got = tq2.get_client().get_meta(["uid"], 2, "p", mode="force_fetch").size
            tq2.close()  # an attached process leaves the system running
            return got

        assert ray.get(attached.remote(), timeout=60) == 2
        assert c.get_meta(["uid"], 1, "p", mode="force_fetch").size == 2
    finally:
        tq.close()


def test_ignored_settings_warn():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        from streamrl.compat.transferqueue.config import merge

        merge({"metrics": {"enabled": True},
               "backend": {"SimpleStorage": {"ssd_offload": {"enabled": True,
                                                             "threshold_bytes": 64},
                                             "zmq_info": 1}},
               "controler": {}})
    text = " ".join(str(x.message) for x in w)
    assert "metrics.enabled" in text and "ssd_offload.threshold_bytes" in text
    assert "controler" in text and "zmq_info" not in text
    assert "ssd_offload.enabled" not in text  # used: see the next test


def test_ssd_offload_is_streamrls_spill_backend(tmp_path):
    """ssd_offload.enabled/path put the samples' tensors beyond a memory budget into a
    spill file under <path>/transfer_queue_ssd_offload; they come back equal."""
    from streamrl.compat.transferqueue.config import merge, queue_options

    conf = merge({"backend": {"SimpleStorage": {"ssd_offload": {"enabled": True,
                                                                "path": str(tmp_path)}}},
                  "streamrl": {"transport": "embedded", "spill_memory_bytes": 0}})
    opts = queue_options(conf)
    assert opts["storage"] == {"backend": "spill", "memory_bytes": 0,
                               "dir": str(tmp_path / "transfer_queue_ssd_offload")}
    assert "storage" not in queue_options(merge({"streamrl": {"transport": "embedded"}}))

    async def main():
        async with streamrl.StreamQueue(**opts) as q:
            rows = await q.put({"x": torch.arange(64.0).view(8, 8)}, partition="p")
            units = q.session.data.units
            assert sum(u.usage()["disk"] for u in units) == 8 * 8 * 4  # all spilled
            td = await rows.select("x").materialize(copy=True)
            assert torch.equal(td["x"], torch.arange(64.0).view(8, 8))

    asyncio.run(main())
    assert (tmp_path / "transfer_queue_ssd_offload").is_dir()


# ---------------------------------------------------------------------- pure controller


def _ctl(sampler=None) -> TQController:
    return TQController(sampler or SequentialSampler())


def _produce(c: TQController, pid: str, idx, fields=("x",), custom=None):
    schema = {f: {"dtype": torch.float32, "_key": "torch.float32", "is_non_tensor": False,
                  "_shapes": (1,)} for f in fields}
    n = len(idx)
    c.commit(pid, list(idx), list(range(1000 + idx[0], 1000 + idx[0] + n)), [0] * n, schema,
             custom)


def test_grpo_groups_follow_insertion_not_ready_runs():
    """TransferQueue's scan makes a group of any n consecutive ready indexes: with the
    first sample of group 0 late, it hands out 1..4 (half of two groups)."""
    c = _ctl(GRPOGroupNSampler(n_samples_per_prompt=4))
    alloc = c.insert("p", ["x"], 8)
    _produce(c, "p", alloc.global_indexes[1:5])
    assert c.fetch(["x"], 4, "p", "t") is None
    _produce(c, "p", alloc.global_indexes[0:1])
    assert c.fetch(["x"], 4, "p", "t").global_indexes == alloc.global_indexes[:4]


def test_grpo_groups_survive_reused_indexes():
    c = _ctl(GRPOGroupNSampler(n_samples_per_prompt=2))
    first = c.insert("old", ["x"], 5)
    c.clear_samples("old", [first.global_indexes[i] for i in (0, 2, 4)])  # free 0, 2, 4
    alloc = c.insert("p", ["x"], 4)  # reuses 0, 2, 4 then takes 5
    assert alloc.global_indexes == [0, 2, 4, 5]
    _produce(c, "p", [0])
    _produce(c, "p", [2])
    _produce(c, "p", [4])
    _produce(c, "p", [5])
    got = c.fetch(["x"], 4, "p", "t").global_indexes
    assert got == [0, 2, 4, 5]


def test_rank_aware_sampler_gives_a_replica_group_one_batch():
    c = _ctl(RankAwareSampler())
    alloc = c.insert("p", ["x"], 6)
    _produce(c, "p", alloc.global_indexes)
    a = c.fetch(["x"], 2, "p", "t", {"dp_rank": 0, "batch_index": 0})
    b = c.fetch(["x"], 2, "p", "t", {"dp_rank": 0, "batch_index": 0})
    other = c.fetch(["x"], 2, "p", "t", {"dp_rank": 1, "batch_index": 0})
    assert a.global_indexes == b.global_indexes and set(other.global_indexes).isdisjoint(a.global_indexes)


def test_seqlen_balanced_sampler_equal_groups_balanced_lengths():
    c = _ctl(SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2))
    alloc = c.insert("p", ["x"], 8)
    lengths = [100, 100, 1, 1, 50, 50, 49, 49]
    _produce(c, "p", alloc.global_indexes, custom=[{"total_lengths": v} for v in lengths])
    shares = [c.fetch(["x"], 4, "p", "t", {"dp_rank": r, "batch_index": 0}).global_indexes
              for r in range(2)]
    assert sorted(shares[0] + shares[1]) == alloc.global_indexes
    loads = [sum(lengths[alloc.global_indexes.index(i)] for i in s) for s in shares]
    assert len(shares[0]) == len(shares[1]) == 4 and sorted(loads) == [198, 202]  # the best split
    for s in shares:  # whole groups
        assert {i // 2 for i in s} == {i // 2 for i in s if i % 2 == 0}


def test_seqlen_balanced_split_is_streamrls_balanced_split():
    """SeqlenBalancedSampler splits its groups with streamrl.sampling.balanced_split (the
    split of balance_by), not a copy of it: the shares are the same, rank by rank."""
    from streamrl.sampling import balanced_split

    lengths = [9, 8, 7, 1, 1, 1, 5]
    c = _ctl(SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=3))
    alloc = c.insert("p", ["x"], 7)
    _produce(c, "p", alloc.global_indexes, custom=[{"total_lengths": v} for v in lengths])
    shares = [sorted(c.fetch(["x"], 2, "p", "t", {"dp_rank": r, "batch_index": 0}).global_indexes)
              for r in range(3)]
    want, _ = balanced_split([[i] for i in range(6)], 3, lengths[:6])
    assert shares == [sorted(alloc.global_indexes[i] for i in w) for w in want]
    assert sorted(len(s) for s in shares) == [2, 2, 2]


def test_the_controller_service_and_its_ray_proxy_implement_one_protocol():
    """Clients call the compatibility controller through TQControlPlane: the service
    implements it, the Ray proxy is generated from it, and the check can fail."""
    import inspect

    from streamrl.compat.transferqueue.control import RayTQControl, TQControlPlane
    from streamrl.compat.transferqueue.controller import TQControllerService
    from streamrl.control import check_implements

    assert check_implements(TQControllerService, TQControlPlane) == []
    assert check_implements(RayTQControl, TQControlPlane) == []
    for name, fn in vars(TQControlPlane).items():
        if inspect.iscoroutinefunction(fn):
            assert inspect.signature(getattr(RayTQControl, name)) == inspect.signature(fn)
    assert not hasattr(RayTQControl, "__getattr__") and not hasattr(RayTQControl, "call")

    class Renamed(TQControllerService):
        async def clear_samples(self, partition_id, global_indexes):  # another name
            ...

    problems = check_implements(Renamed, TQControlPlane)
    assert len(problems) == 1 and "Renamed.clear_samples" in problems[0]


def test_jagged_columns_are_what_torchs_public_constructor_makes():
    """get_data makes its jagged columns with torch's NestedTensor class directly (the
    public nested_tensor_from_jagged costs 10x); on this torch the two are the same."""
    from streamrl.compat.transferqueue.client import jagged

    x = torch.arange(24.0).view(4, 6)
    off = torch.tensor([0, 6, 12, 18, 24])
    a, b = jagged(x.reshape(-1), off), torch.nested.nested_tensor_from_jagged(x.reshape(-1), off)
    assert type(a) is type(b) and a.is_nested and a.layout is b.layout is torch.jagged
    assert a.dim() == b.dim() == 2 and a.size(0) == b.size(0) == 4 and a.dtype == b.dtype
    assert a.values().data_ptr() == b.values().data_ptr() == x.data_ptr()  # views, no copy
    assert torch.equal(a.offsets(), b.offsets())
    assert all(torch.equal(u, v) for u, v in zip(a.unbind(), b.unbind()))
    assert torch.equal(torch.nested.to_padded_tensor(a * 2, 0.0),
                       torch.nested.to_padded_tensor(b * 2, 0.0))
    td = TensorDict({"x": a}, batch_size=[4])
    assert td["x"][1].shape == (6,) and torch.equal(td[1:3]["x"].values(), x[1:3].reshape(-1))


def test_snapshot_has_transferqueue_names():
    c = _ctl()
    km = c.kv_retrieve_meta(["k"], "p", create=True)
    _produce(c, "p", km.global_indexes, fields=("x", "y"))
    c.set_custom_meta({"p": {km.global_indexes[0]: {"tag": 1}}})
    s = c.snapshot("p")
    i = s.keys_mapping["k"]
    assert i in s.global_indexes and s.custom_meta[i] == {"tag": 1}
    assert s.production_status[i, s.field_name_mapping["y"]] == 1 and s.revert_keys_mapping[i] == "k"
    assert c.snapshot("nowhere") is None


def test_batchmeta_views_and_pickle():
    m = BatchMeta([3, 4, 5, 6], ["p"] * 4, {"x": {"dtype": torch.float32, "shape": (2,),
                                                "is_nested": False, "is_non_tensor": False}},
                  [1, 1, 0, 1], {"step": 1}, [{"a": i} for i in range(4)],
                  _rows=[10, 11, 12, 13], _shards=[0, 1, 0, 1], _store={"x": "x@torch.float32"})
    assert [c.size for c in m.chunk(3)] == [2, 1, 1] and not m.is_ready and m[0:2].is_ready
    both = BatchMeta.concat([m[:2], m[2:]])
    assert both.global_indexes == m.global_indexes and both._rows == m._rows
    m2 = pickle.loads(pickle.dumps(m))
    m2.production_status[:] = 1  # writable after a round trip
    assert m2.is_ready and m2._store == m._store and m2.get_all_custom_meta()[3] == {"a": 3}
    r = m.copy()
    r.reorder([3, 2, 1, 0])
    assert r.global_indexes == [6, 5, 4, 3] and r._rows == [13, 12, 11, 10]
    u = m.select_fields([]).union(m)
    assert u.field_names == ["x"]
    with pytest.raises(ValueError):
        m.select_samples([4])


def test_bulk_field_updates_match_one_sample_at_a_time():
    """commit updates a field's shapes for all its samples at once (_Field.set_many);
    the shapes and per-shape counts (what the schema's shape / is_nested come from) must
    be those of setting the samples one by one, with overwrites, repeats and ragged
    shapes."""
    from streamrl.compat.transferqueue.controller import _Field

    rng = np.random.default_rng(7)
    for _ in range(300):
        bulk, one = _Field(torch.float32, "torch.float32", False), _Field(torch.float32, "k", False)
        for _ in range(4):
            idx = [int(i) for i in rng.integers(0, 12, int(rng.integers(1, 9)))]
            if rng.random() < 0.5:
                shapes: object = (int(rng.integers(1, 4)),)
            else:
                shapes = [(int(rng.integers(1, 4)),) for _ in idx]
            bulk.set_many(idx, shapes)
            for pos, i in enumerate(idx):
                one.set(i, shapes[pos] if isinstance(shapes, list) else shapes)
            for i in idx[:2]:
                bulk.remove(i)
                one.remove(i)
            assert bulk.shapes == one.shapes and dict(bulk.counts) == dict(one.counts)
            assert bulk.schema(sorted(bulk.shapes)) == one.schema(sorted(one.shapes))


def test_commit_and_clear_partition_keep_the_controllers_bookkeeping():
    """A commit with a conflict (a sample bound to another row) writes only the other
    samples; clear_partition frees every index (reused in order) and returns each row."""
    c = _ctl()
    meta = c.insert("p", ["x"], 4)
    idx = meta.global_indexes
    fields = {"x": {"dtype": torch.float32, "_key": "torch.float32", "is_non_tensor": False,
                    "_shapes": [(2,), (3,), (2,), (2,)]}}
    c.commit("p", idx[:1], [50], [1], {"x": {**fields["x"], "_shapes": (9,)}})
    _, conflicts = c.commit("p", idx, [10, 11, 12, 13], [0, 0, 0, 0], fields,
                            [{"i": i} for i in range(4)])
    assert conflicts == [(0, 50, 1)]
    s = c.snapshot("p")
    assert s.field_schema["x"]["is_nested"] and s.custom_meta == {i: {"i": k} for k, i in
                                                                   enumerate(idx) if k}
    assert c.force_fetch(["x"], "p").field_schema["x"]["per_sample_shapes"] == \
        [(9,), (3,), (2,), (2,)]
    assert sorted(c.clear_partition("p")) == [(11, 0), (12, 0), (13, 0), (50, 1)]
    assert c.snapshot("p") is None and c.insert("q", ["x"], 4).global_indexes == idx
