"""Smoke test of examples/vlm/train.py: a few steps on every transport.

Checks the run's bookkeeping (nothing leaks, every row put is accounted for) and the
point of the example: the reward role materializes a tiny fraction of what shipping
whole rows costs, while the trainer does fetch the pixels.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vlm" / "train.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("streamrl_example_vlm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


vlm = _load_example()

STEPS, PROMPTS, GROUP = 6, 4, 4


def _args(transport: str, out: Path, fetch: str):
    return vlm.parse_args([
        "--steps", str(STEPS), "--prompts", str(PROMPTS), "--group-size", str(GROUP),
        "--eval-size", "32", "--transport", transport, "--fetch", fetch,
        "--out", str(out), "--quiet",
    ])


def _per_row(summary: dict, role: str) -> float:
    b = summary["bytes"][role]
    assert b["rows"] > 0, f"{role} got no rows"
    return b["fetched"] / b["rows"]


@pytest.mark.timeout(240)
async def test_vlm_example_runs_and_moves_only_what_each_role_needs(transport, tmp_path):
    lazy = await vlm.run(_args(transport, tmp_path / "lazy", "lazy"))
    eager = await vlm.run(_args(transport, tmp_path / "eager", "eager"))

    for s in (lazy, eager):
        # nothing leaks: the queue ends empty
        assert s["leaked"] == 0
        assert s["held_rows"] == 0 and s["held_bytes"] == 0
        assert s["bytes_freed"] == s["bytes_put"]
        # every row put is accounted for: filtered, stale, or trained (then consumed)
        assert s["rows_put"] == STEPS * PROMPTS * GROUP
        assert s["filtered"] + s["stale"] + s["trained"] == s["rows_put"], s["dropped_by"]
        assert s["consumed"] == s["trained"]
        assert s["trained"] % GROUP == 0  # whole groups only
        assert Path(s["plot"]).is_file()

    # the reward role reads two int64 scalars per row and never a pixel ...
    assert lazy["bytes"]["reward"]["fetched"] == 16 * lazy["bytes"]["reward"]["rows"]
    assert _per_row(lazy, "reward") < 0.01 * _per_row(eager, "reward")
    assert _per_row(eager, "reward") > vlm.IMAGE_BYTES  # (the eager baseline ships images)
    # ... while the rollout role and the trainer do fetch the pixels
    assert _per_row(lazy, "rollout") >= vlm.IMAGE_BYTES
    assert _per_row(lazy, "trainer") >= vlm.IMAGE_BYTES
    assert lazy["updates"] > 0


def test_progress_in_a_log_is_plain_lines(capsys, monkeypatch):
    """``python train.py > log`` from a terminal: stdout is no terminal (stderr is), so the
    run prints plain lines (every LOG_EVERY seconds and at the last step), never the bar's
    carriage-return redraws."""
    import re

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert not sys.stdout.isatty()
    for every, want in ((0.0, [1, 2, 3]), (None, [3])):  # None: LOG_EVERY (10 s) apart
        progress = vlm.Progress(3, "vlm lazy", every=every)
        for step in range(3):
            progress.update(f"reward=0.{step}0 held=1MiB")
        progress.close()
        out, err = capsys.readouterr()
        assert "\r" not in out + err and not err.strip(), (out, err)
        lines = out.splitlines()
        assert len(lines) == len(want), lines
        for got, n in zip(lines, want):
            assert re.fullmatch(rf"vlm lazy: step {n}/3 \(\d+ s\): reward=0\.{n - 1}0 held=1MiB",
                                got), got
