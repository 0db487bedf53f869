"""``python -m streamrl top`` run as a person would: against a live named Ray queue, in a
pseudo-terminal; the screen's numbers agree with stats()."""

from __future__ import annotations

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
    q = make_queue(name="topq", capacity=128, consumers=["train"])
    await q.add_filter(lambda td: td["x"] % 5 != 0, fields=["x"], name="no5")
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
    assert snap["filtered_by"] == {"no5": 4}
    t = snap["tasks"]["train"]
    assert t["acked"] == 6 and t["leased"] == 4 and t["lag"] == st.tasks["train"].ready + 4
    assert snap["partitions"]["step-0"]["leased"] == 4
    await held.ack()


async def test_top_in_a_terminal_shows_the_queue(make_queue):
    q, held = await _live_queue(make_queue)
    st = await q.stats()
    main, sub = pty.openpty()
    proc = subprocess.Popen(_top("topq", "--interval", "0.5"), env=_env(), stdin=sub,
                            stdout=sub, stderr=sub, close_fds=True)
    os.close(sub)
    screen = ""
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "storage units" not in ANSI.sub("", screen):
            r, _, _ = select.select([main], [], [], 1.0)
            if r:
                try:
                    screen += os.read(main, 65536).decode(errors="replace")
                except OSError:
                    break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.close(main)
    text = ANSI.sub("", screen)
    assert "streamrl queue topq" in text, text[-3000:]
    assert f"rows {st.rows}/128" in text
    task_line = next(line for line in text.splitlines() if line.strip("│ ").startswith("train"))
    numbers = [int(x) for x in re.findall(r"(?<![\d.])\d+(?![\d.])", task_line)]
    assert numbers[:2] == [st.tasks["train"].delivered, st.tasks["train"].acked]
    assert "filter no5" in text and "step-0" in text
    await held.ack()
