"""The processes of the checkpoint crash tests (tests/test_checkpoint.py runs them).

``python checkpoint_worker.py write PATH TRANSPORT``: puts rows, acks some, holds a lease
on others, leaves a field unwritten on some rows, sets the version, checkpoints to PATH,
prints what it did (one JSON line) and is killed (``os._exit``) without closing anything.

``python checkpoint_worker.py finish PATH TRANSPORT``: restores PATH on TRANSPORT, writes
the missing field, consumes everything and prints what each task got (one JSON line).

``python checkpoint_worker.py crash PATH TRANSPORT WHERE``: checkpoints to PATH (the
"first" one), changes the queue, then is killed in the middle of a second checkpoint to
the same PATH: ``WHERE`` is ``units`` (while a storage unit writes its files;
embedded only), ``manifest`` (every file written, before the manifest and the rename)
or ``rename`` (between moving the first checkpoint away and moving the second in).

On Ray it joins the cluster at ``$STREAMRL_TEST_RAY`` (the test session's) as a driver
of its own, or else starts a local Ray on 127.0.0.1 with 2 CPUs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
N = 48


def keep(td) -> torch.Tensor:
    """The filter (an importable module-level function: restored by itself)."""
    return td["sid"] % 13 != 0


def _ray(transport: str) -> None:
    if "ray" in transport:
        import ray

        # (tests/ on the workers' path through the environment the local Ray inherits,
        # as tests/conftest.py does: a job-level runtime_env doubles each actor's start;
        # joining the test run's Ray, its workers have the path already)
        if os.environ.get("STREAMRL_TEST_RAY"):
            ray.init(address=os.environ["STREAMRL_TEST_RAY"], log_to_driver=False)
            return
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")] if p)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=256 << 20, _node_ip_address="127.0.0.1")


def _rows(sids: list[int]) -> dict:
    s = torch.tensor(sids)
    return {"sid": s, "x": s.float().unsqueeze(1).repeat(1, 2048),
            "chat": [{"turn": f"t{i}", "n": i} for i in sids]}  # (as tests/test_checkpoint.py)


async def write(path: str, transport: str) -> None:
    import streamrl

    q = streamrl.StreamQueue(capacity=256, num_shards=2, transport=transport,
                             consumers=["train", "ref"], max_staleness=4)
    await q.add_filter(keep, fields=["sid"], name="keep")
    batches = [await q.put(_rows(list(range(i, i + 8))), partition="p", version=i // 16)
               for i in range(0, N, 8)]
    for b in batches[:4]:  # rows 32.. have no reward yet (0, 13, 26 were filtered)
        sids = (await b.materialize(["sid"]))["sid"]
        live = [r for r, s in zip(b.rows, sids.tolist()) if s % 13]
        await q.put({"reward": sids[sids % 13 != 0].float() * 0.5}, rows=live)
    acked = await q.get("train", ["sid", "x"], 8, partition="p", timeout=30)
    acked_sids = (await acked.materialize(["sid"]))["sid"].tolist()
    await acked.ack()
    held = await q.get("train", ["sid", "x"], 8, partition="p", timeout=30)  # never acked
    ref = await q.get("ref", ["sid"], 8, partition="p", timeout=30)
    ref_sids = (await ref.materialize(["sid"]))["sid"].tolist()
    await ref.ack()
    await q.set_version(2)
    info = await q.checkpoint(path)
    st = await q.stats()
    print(json.dumps({
        "acked_train": acked_sids,
        "held_train": (await held.materialize(["sid"]))["sid"].tolist(),
        "acked_ref": ref_sids,
        "rows": st.rows, "ckpt_rows": info.rows, "filtered": st.filtered,
        "version": st.version}), flush=True)
    os._exit(0)  # killed: nothing closed, nothing shut down


async def finish(path: str, transport: str) -> None:
    import streamrl

    q = await streamrl.StreamQueue.restore(path, transport=transport, lease_timeout=30)
    st0 = await q.stats()
    await q.seal("p")  # no new rows; the rows put without a reward get it now
    async with q.stream("fixer", ["sid"], 8, partition="p", timeout=30) as s:
        async for mb in s:
            sids = (await mb.materialize())["sid"]
            need = [r for r, sid in zip(mb.rows, sids.tolist()) if sid >= 32]
            if need:
                await q.put({"reward": sids[sids >= 32].float() * 0.5}, rows=need)
    got: dict[str, list[int]] = {}
    bad = []
    for task in ("train", "ref"):
        got[task] = []
        async for mb in q.stream(task, ["sid", "x", "chat", "reward"], 8, partition="p",
                                 timeout=30):
            td = await mb.materialize()
            sids = td["sid"].tolist()
            got[task] += sids
            if not torch.equal(td["x"][:, 7], td["sid"].float()):
                bad.append("x")
            if [c["turn"] for c in td["chat"]] != [f"t{i}" for i in sids]:
                bad.append("chat")
            if not torch.equal(td["reward"], td["sid"].float() * 0.5):
                bad.append("reward")
    st = await q.stats()
    print(json.dumps({"got": got, "bad": bad, "version": st0.version, "rows_at_restore": st0.rows,
                      "redelivered": st.tasks["train"].redelivered, "rows_left": st.rows,
                      "audit": await q.audit(), "filtered": st.filtered}), flush=True)
    await q.close()
    await q.shutdown()


async def crash(path: str, transport: str, where: str) -> None:
    import streamrl
    from streamrl.checkpoint import client, files

    q = streamrl.StreamQueue(capacity=256, num_shards=2, transport=transport)
    await q.put(_rows(list(range(16))), partition="p")
    await q.set_version(1)
    first = await q.checkpoint(path)
    await q.put(_rows(list(range(16, 40))), partition="p")
    await q.set_version(2)
    print(json.dumps({"first_rows": first.rows}), flush=True)
    if where == "units":  # while a unit writes its files (embedded: in this process)
        real = files.write_safetensors

        def dying(*a, **kw):
            real(*a, **kw)
            os._exit(3)

        import streamrl.checkpoint.units as units
        units.write_safetensors = dying
    elif where == "manifest":
        def dying_check(*a, **kw):
            os._exit(3)

        client._check_visible = dying_check
    elif where == "rename":
        real_rename = os.rename
        calls = []

        def dying_rename(src, dst):
            real_rename(src, dst)
            calls.append(dst)
            if len(calls) == 1:  # the first checkpoint moved away, the new one not in
                os._exit(3)

        client.os.rename = dying_rename
    await q.checkpoint(path)
    os._exit(4)  # not reached


def main() -> None:
    phase, path, transport = sys.argv[1:4]
    _ray(transport)
    if phase == "write":
        asyncio.run(write(path, transport))
    elif phase == "finish":
        asyncio.run(finish(path, transport))
        if "ray" in transport:
            import ray

            ray.shutdown()
    else:
        asyncio.run(crash(path, transport, sys.argv[4]))


if __name__ == "__main__":
    main()
