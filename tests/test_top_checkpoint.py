"""``python -m streamrl top DIR`` on a checkpoint directory: one read-only snapshot whose
numbers agree with the stats of the queue it was taken from, and the directory is left as
it was."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys

import torch

import streamrl


def _digest(path: str) -> str:
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            with open(os.path.join(root, f), "rb") as fh:
                h.update(f.encode() + fh.read())
    return h.hexdigest()


async def test_top_on_a_checkpoint_shows_it_and_leaves_it_alone(tmp_path, capsys):
    async with streamrl.StreamQueue(capacity=64, consumers=["train"]) as q:
        # a filter that cannot be imported: the view must not need it
        await q.add_filter(lambda td: td["x"] % 5 != 0, fields=["x"], name="no5")
        await q.put({"x": torch.arange(20), "y": torch.zeros(20, 4)}, partition="step-0")
        mb = await q.get("train", ["x", "y"], 6, partition="step-0", timeout=10)
        await mb.ack()
        await q.get("train", ["x"], 4, partition="step-0", timeout=10)  # held: released
        st = await q.stats()
        path = str(tmp_path / "ckpt")
        await q.checkpoint(path)
    before = _digest(path)
    from streamrl.top import main

    capsys.readouterr()
    # without --once too: a directory is always one snapshot (here in this process)
    assert await asyncio.to_thread(main, [path, "--json"]) == 0
    in_process = capsys.readouterr().out
    for out in (_top_without_ray(path, "--once", "--json"), None):
        if out is None:
            snap = json.loads(in_process.strip().splitlines()[-1])
        else:
            assert out.returncode == 0, out.stderr[-2000:]
            assert not out.stderr.strip() or "Traceback" not in out.stderr
            snap = json.loads(out.stdout.strip().splitlines()[-1])
        assert snap["checkpoint"] == path
        assert snap["rows"] == st.rows == 10 and snap["put"] == st.put == 20
        assert snap["filtered_by"] == {"no5": 4}
        assert snap["partitions"]["step-0"]["put"] == 20
        t = snap["tasks"]["train"]
        assert t["acked"] == 6 and t["leased"] == 0  # the held lease came back released
        assert t["ready"] == 10
    assert _digest(path) == before


def _env() -> dict:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}


def _top_without_ray(*args: str) -> subprocess.CompletedProcess:
    """``python -m streamrl top ARGS`` in a process where ``import ray`` fails (as where
    Ray is not installed)."""
    code = ("import sys; sys.modules['ray'] = None  # import ray: ImportError\n"
            "from streamrl.__main__ import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "top", *args], env=_env(),
                          capture_output=True, text=True, timeout=120)


def test_top_json_without_once_is_refused():
    """A refreshing view of a queue has no JSON form: the user hears what to add, before
    anything connects to Ray."""
    out = _top_without_ray("no-such-queue", "--json")
    assert out.returncode == 2 and "--once" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not out.stdout


async def test_top_on_a_checkpoint_reads_no_row_data(tmp_path, capsys):
    """The view is made of the manifest and the controller's state: with every data
    file of the checkpoint gone it shows the same numbers, the storage units as the
    manifest records them, and the leases open at the save."""
    import shutil

    async with streamrl.StreamQueue(capacity=64, num_shards=2, consumers=["train"]) as q:
        await q.put({"x": torch.arange(12), "y": torch.zeros(12, 4)}, partition="p")
        mb = await q.get("train", ["x", "y"], 4, partition="p", timeout=10)
        await mb.ack()
        held = await q.get("train", ["x"], 3, partition="p", timeout=10)  # open at the save
        st = await q.stats()
        path = str(tmp_path / "ckpt")
        info = await q.checkpoint(path)
        assert len(held) == 3
    from streamrl.checkpoint.client import open_checkpoint

    directory, manifest = open_checkpoint(path)
    data = [os.path.join(directory, u["dir"]) for u in manifest["units"]]
    assert data and all(os.path.isdir(d) and os.listdir(d) for d in data)
    for d in data:  # every row's data gone
        shutil.rmtree(d)
    from streamrl.top import main

    capsys.readouterr()
    assert await asyncio.to_thread(main, [path, "--once", "--json"]) == 0
    snap = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert snap["rows"] == st.rows == 8 and snap["bytes"] == st.bytes == 8 * (8 + 16)
    assert snap["put"] == 12 and snap["partitions"]["p"]["put"] == 12
    assert sum(snap["unit_rows"]) == info.rows == 8
    assert snap["unit_rows"] == [u["rows"] for u in sorted(manifest["units"],
                                                          key=lambda u: u["shard"])]
    assert snap["saved_leases"] == {"leases": 1, "rows": {"train": 3}}
    t = snap["tasks"]["train"]
    assert t["acked"] == 4 and t["leased"] == 0 and t["ready"] == 8  # shown released
    assert snap["partition_tasks"]["p"]["train"]["delivered"] == 7
    # the table says so
    assert await asyncio.to_thread(main, [path, "--once"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "saved with 1 open lease(s) (train 3 rows): shown released" in out
    # a damaged state file is still an error, not an empty view
    with open(os.path.join(directory, "controller.msgpack"), "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xff\xff\xff")
    assert await asyncio.to_thread(main, [path, "--once", "--json"]) == 1
    captured = capsys.readouterr()
    assert not captured.out and "corrupt" in captured.err
