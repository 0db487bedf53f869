"""Smoke test of examples/agentic: a bounded run on every transport leaves nothing behind,
accounts for every row, and (embedded, fixed seed) learns."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agentic"


def load_train():
    """examples/agentic/train.py as a module (it imports its neighbours game and agent)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec = importlib.util.spec_from_file_location("agentic_train", EXAMPLE / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLE))
    return module


@pytest.mark.timeout(120)  # the Ray run: ~40 s on a busy 2-core machine, plus Ray's
# start (~20 s) when it is the session's first Ray test
async def test_agentic_example(transport, tmp_path):
    train = load_train()
    steps = 150 if transport == "embedded" else 20
    # on Ray each env worker (and their hub) is an actor: two workers start sooner
    workers = 4 if transport == "embedded" else 2
    args = train.parse_args(["--steps", str(steps), "--seed", "0", "--quiet",
                             "--workers", str(workers),
                             "--out", str(tmp_path), "--transport", transport])
    s = await train.run(args)

    # nothing left behind
    assert s["leaked"] == 0
    assert s["rows_held"] == 0 and s["bytes_held"] == 0
    # every row accounted for: each one was trained on, filtered or went stale
    assert s["rows_put"] == steps * args.groups * args.group_size
    dropped = s["rows_dropped_by"]
    assert sum(dropped.values()) == s["rows_put"], dropped
    assert dropped.get("consumed", 0) == s["rows_trained"]
    assert dropped.get("filtered", 0) == s["rows_filtered"]
    assert dropped.get("stale", 0) == s["rows_stale"]
    assert s["rows_trained"] + s["rows_filtered"] + s["rows_stale"] == s["rows_put"]
    # every role was timed (on Ray the env workers are actors: their timings came back)
    assert set(s["time_by_role"]) == {"env_worker", "judge", "actor_update"}
    assert s["time_by_role"]["env_worker"]["calls"] > 0
    # the run's artefacts
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["rows_put"] == s["rows_put"]

    if transport == "embedded":  # fixed seed, bounded steps: it learns
        assert s["reward_end"] > s["reward_start"] + 0.15, (s["reward_start"], s["reward_end"])


def test_each_run_gets_its_own_output_directory(tmp_path, monkeypatch):
    """Without --out, every run writes to a new runs/agentic/<date>-<time>-<transport>,
    so runs (even two in the same second) do not overwrite each other's plots."""
    train = load_train()
    monkeypatch.chdir(tmp_path)
    a = train.output_dir(train.parse_args(["--transport", "ray"]))
    b = train.output_dir(train.parse_args(["--transport", "ray"]))
    assert a != b and a.is_dir() and b.is_dir()
    assert a.parent == b.parent == Path("runs/agentic") and a.name.endswith("-ray")
    assert train.output_dir(train.parse_args(["--out", "mine"])) == Path("mine")


async def test_progress_in_a_log_is_plain_lines(capsys, monkeypatch):
    """``python train.py > log`` from a terminal: stdout is no terminal (stderr is), so the
    run prints plain lines, never the bar's carriage-return redraws."""
    import re

    import streamrl

    train = load_train()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert not sys.stdout.isatty()
    async with streamrl.StreamQueue(capacity=8) as q:
        with monkeypatch.context() as mp:
            mp.setattr(train, "LOG_EVERY", 0.0)  # a line per step
            m = train.Metrics(q, 3, quiet=False)
            for step in range(3):
                await m.end_step(step, trained=4)
            m.close()
        m = train.Metrics(q, 3, quiet=False)  # LOG_EVERY (10 s) apart: the last step's only
        for step in range(3):
            await m.end_step(step, trained=4)
        m.close()
    out, err = capsys.readouterr()
    assert "\r" not in out + err and not err.strip(), (out, err)
    line = r"agentic GRPO: step {}/3 \(\d+ s\): reward=\S+ rows/s=\d+ KB/s=[\d.]+"
    lines = out.splitlines()
    assert len(lines) == 4, lines
    for got, n in zip(lines, [1, 2, 3, 3]):
        assert re.fullmatch(line.format(n), got), got
