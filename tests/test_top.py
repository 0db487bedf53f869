"""``python -m streamrl top`` run as a person would: against a live named Ray queue, in a
pseudo-terminal; the screen's numbers agree with stats()."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(180),
              pytest.mark.parametrize("transport", ["ray"], indirect=True)]

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _env():
    here = os.path.dirname(os.path.abspath(__file__))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here),
                                                         os.environ.get("PYTHONPATH", "")]),
            "COLUMNS": "200", "LINES": "60", "TERM": "xterm"}


def _top(*args: str) -> list[str]:
    return [sys.executable, "-m", "streamrl", "top", *args,
            "--address", ray.get_runtime_context().gcs_address,
            "--namespace", ray.get_runtime_context().namespace]


async def _live_queue(make_queue):
    q = make_queue(name="topq", capacity=128, capacity_bytes=4096, consumers=["train"],
                   num_shards=2)  # (the view has a row per storage unit)
    await q.add_filter(lambda td: td["x"] % 5 != 0, fields=["x"], name="no5")
    # 20 rows of 8 + 16 bytes; the filter drops 4 of them
    await q.put({"x": torch.arange(20), "y": torch.zeros(20, 4)}, partition="step-0")
    mb = await q.get("train", ["x", "y"], 6, partition="step-0", timeout=30)
    await mb.ack()
    held = await q.get("train", ["x"], 4, partition="step-0", timeout=30)
    return q, held


async def test_top_once_json_agrees_with_stats(make_queue):
    q, held = await _live_queue(make_queue)
    out = subprocess.run(_top("topq", "--once", "--json", "--interval", "0"), env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    snap = json.loads(out.stdout.strip().splitlines()[-1])
    st = await q.stats()
    assert snap["rows"] == st.rows == 10 and snap["put"] == 20
    assert snap["filtered_by"] == {"no5": 4} and snap["bytes_filtered_by"] == {"no5": 4 * 24}
    t = snap["tasks"]["train"]
    assert t["acked"] == 6 and t["leased"] == 4 and t["lag"] == st.tasks["train"].ready + 4
    assert snap["partitions"]["step-0"]["leased"] == 4
    assert snap["partitions"]["step-0"]["bytes"] == 10 * 24
    await held.ack()


def _frames(screen: str) -> list[str]:
    """The frames of the view drawn so far, each whole (the last one drawn may be cut
    off, so it is left out): each frame starts with the header."""
    return ANSI.sub("", screen).split("streamrl queue topq")[1:-1]


def _cells(frame: str, first: str) -> list[str]:
    """The cells of the table row of ``frame`` whose first cell is ``first``."""
    for line in frame.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in\n{frame}")


def _check(frame: str, st) -> None:
    """The frame shows what ``st`` (a stats() snapshot) says."""
    from streamrl.top import _size

    assert f"rows {st.rows}/128" in frame, frame
    assert f"bytes {_size(st.bytes)}/{_size(4096)}" in frame, frame
    assert f"put {st.put}" in frame and f"leases {st.leases}" in frame, frame
    p = st.partitions["step-0"]
    assert _cells(frame, "step-0") == [
        "step-0", *(str(p[k]) for k in ("rows", "waiting", "ready", "leased", "consumed")),
        _size(p["bytes"]), str(p["put"]), "no"]
    t = st.tasks["train"]
    cells = _cells(frame, "train")
    assert cells[1:3] == [str(t.delivered), str(t.acked)]
    assert cells[4:10] == [str(t.ready + t.waiting + t.leased), str(t.ready), str(t.waiting),
                           str(t.leased), str(t.redelivered), str(t.expired)]
    assert _cells(frame, "filter no5") == [
        "filter no5", str(st.filtered_by["no5"]), _size(st.bytes_filtered_by["no5"]),
        str(st.filter_pending["no5"])]
    assert _cells(frame, "consumed")[:3] == [
        "consumed", str(st.dropped_by["consumed"]), _size(st.bytes_dropped_by["consumed"])]
    for i, (rows, nbytes) in enumerate(zip(st.unit_rows, st.unit_bytes)):
        assert _cells(frame, str(i))[:3] == [str(i), str(rows), _size(nbytes)]


async def test_top_in_a_terminal_shows_the_queue_and_follows_it(make_queue):
    q, held = await _live_queue(make_queue)
    st = await q.stats()
    assert len(st.unit_rows) == 2 and sum(st.unit_rows) == st.rows
    main, sub = pty.openpty()
    proc = subprocess.Popen(_top("topq", "--interval", "0.5"), env=_env(), stdin=sub,
                            stdout=sub, stderr=sub, close_fds=True)
    os.close(sub)
    screen = ""

    async def read_until(done) -> None:
        nonlocal screen
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not done():
            r, _, _ = await asyncio.to_thread(select.select, [main], [], [], 1.0)
            if r:
                try:
                    screen += os.read(main, 65536).decode(errors="replace")
                except OSError:
                    break
        assert done(), ANSI.sub("", screen)[-4000:]

    try:
        await read_until(lambda: _frames(screen))
        _check(_frames(screen)[0], st)
        # the queue changes under the view: the held batch is acked (consumed), ten more
        # rows come (two of them filtered)
        await held.ack()
        await q.put({"x": torch.arange(20, 30), "y": torch.zeros(10, 4)}, partition="step-0")
        while (st2 := await q.stats()).filter_pending["no5"]:  # the filter runs apart
            await asyncio.sleep(0.1)
        assert st2.put == 30 and st2.filtered_by["no5"] == 6
        await read_until(lambda: any(f"put {st2.put}" in f for f in _frames(screen)))
        later = next(f for f in _frames(screen) if f"put {st2.put}" in f)
        _check(later, st2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.close(main)
