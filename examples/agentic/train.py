"""Agentic GRPO on a streamrl queue: env workers play, a judge scores, a trainer learns.

    python examples/agentic/train.py                     # under a minute on 2 CPU cores
    python examples/agentic/train.py --transport ray      # env workers as Ray actors

The roles run concurrently and meet only in the queue (with ``--transport ray`` the env
workers are Ray actors, each with the pickled queue handle; the judge and the trainer
stay in the driver). One row is one episode:

* env workers put the row when the episode starts (``prompt``, group ``uid``, the
  ``secret`` the judge will check; stamped with the policy version that plays it) and add
  one field per turn (``turn_t``: what was guessed and answered, ``logp_t``: the guess's
  log-prob);
* the judge streams whole groups as soon as their last turn lands, reads only the turns
  and the secret, and writes ``reward``;
* the ``zero_variance`` filter drops groups whose rollouts all scored alike (no signal);
* the trainer streams whole groups of one step's partition, fetches what the loss needs
  (never the secret), takes one GRPO step per partition and publishes the new weights
  and version.

Rows leave the queue once both consumers (judge, trainer) acknowledged them, or when
filtered, or when they fall more than ``--max-staleness`` versions behind the trainer.
Workers are paced so that the last never happens: step ``k`` is played with weights of
version ``k - max_staleness`` or newer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import streamrl
from agent import Agent, grpo_advantages, grpo_loss
from game import PAD, GuessTheNumber
from streamrl.filters import zero_variance


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=500, help="training steps (one partition each)")
    p.add_argument("--workers", type=int, default=4, help="env workers")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per task (GRPO group)")
    p.add_argument("--groups", type=int, default=8, help="tasks per step")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--max-staleness", type=int, default=1,
                   help="drop rollouts more than this many policy versions old")
    p.add_argument("--seed", type=int, default=0, help="tasks, sampling and initial weights")
    p.add_argument("--out", default=None,
                   help="where the plot and summary go (default: a new directory "
                        "runs/agentic/<date>-<time>-<transport> per run)")
    p.add_argument("--transport", choices=["embedded", "ray"], default="embedded",
                   help="where the queue lives")
    p.add_argument("--quiet", action="store_true", help="no progress bar or report")
    return p.parse_args(argv)


def turn_fields(game: GuessTheNumber) -> list[str]:
    return [f"turn_{t}" for t in range(game.max_turns)]


def logp_fields(game: GuessTheNumber) -> list[str]:
    return [f"logp_{t}" for t in range(game.max_turns)]


def stack(td, fields: list[str]) -> torch.Tensor:
    """Per-turn fields ``[n]`` -> one ``[n, turns]`` tensor."""
    return torch.stack([td[f] for f in fields], 1)


@dataclass(frozen=True)
class Task:
    step: int
    uid: int
    hi: int
    secret: int


class Schedule:
    """The task instances of every step, handed out in order to whichever worker asks.

    Each task is played as one GRPO group. ``put_done(step)`` is true once every group of
    the step has its rows in the queue: then its partition can be sealed.
    """

    def __init__(self, game: GuessTheNumber, steps: int, groups: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.groups = groups
        self._tasks = iter([Task(s, s * groups + g, *game.sample_task(gen))
                            for s in range(steps) for g in range(groups)])
        self._to_put = [groups] * steps

    def __iter__(self):
        return self._tasks  # one iterator shared by all workers: each task is taken once

    def put_done(self, step: int) -> bool:
        self._to_put[step] -= 1
        return self._to_put[step] == 0

    def step_of(self, uid: int) -> int:
        return uid // self.groups


class Hub:
    """What the env workers share: the task schedule, pacing, and the newest weights.

    In the driver's event loop with ``--transport embedded``; a Ray actor with
    ``--transport ray`` (the env workers are Ray actors then). Workers call it through
    :func:`hub_call`, the same way in both cases.
    """

    def __init__(self, schedule: Schedule, state: dict[str, torch.Tensor],
                 max_staleness: int):
        self.schedule = schedule
        self._tasks = iter(schedule)
        self._max_staleness = max_staleness
        self._published = asyncio.Condition()
        self.version = 0
        self._state = state

    async def next_task(self, have: int) -> tuple[Task, int, dict | None] | None:
        """The next task, once weights new enough to play it are out (step ``k`` is
        trained at version ``k``, so it is played with ``k - max_staleness`` or newer):
        ``(task, version, weights)``, the weights ``None`` when the worker's version
        ``have`` is the newest. ``None`` when every task was handed out."""
        task = next(self._tasks, None)
        if task is None:
            return None
        async with self._published:
            await self._published.wait_for(
                lambda: self.version >= task.step - self._max_staleness)
        return task, self.version, (self._state if have < self.version else None)

    async def put_done(self, step: int) -> bool:
        """A group of ``step`` is in the queue; true once all of them are."""
        return self.schedule.put_done(step)

    async def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        async with self._published:
            self.version, self._state = version, state
            self._published.notify_all()


def weights_of(agent: Agent) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in agent.state_dict().items()}


async def hub_call(hub, method: str, *args):
    """``hub.method(*args)``: on the :class:`Hub` itself, or on its Ray actor."""
    if isinstance(hub, Hub):
        return await getattr(hub, method)(*args)
    return await getattr(hub, method).remote(*args)


async def env_worker(q: streamrl.StreamQueue, game: GuessTheNumber, hub,
                     args: argparse.Namespace) -> None:
    async with q.timed("env_worker"):  # how much of its time goes to the queue
        await _play(q, game, hub, args)


async def _play(q: streamrl.StreamQueue, game: GuessTheNumber, hub,
                args: argparse.Namespace) -> None:
    n = args.group_size
    agent = Agent(game.vocab_size, game.num_actions).requires_grad_(False)
    version = -1
    while (got := await hub_call(hub, "next_task", version)) is not None:
        task, version, weights = got  # paced: weights new enough for this step
        if weights is not None:
            agent.load_state_dict(weights)
        games = game.play(task.hi, task.secret, n)
        rows = await q.put({"uid": torch.full((n,), task.uid), "prompt": games.prompt,
                            "secret": torch.full((n,), task.secret)},
                           partition=f"step-{task.step}", version=version)
        if await hub_call(hub, "put_done", task.step):
            await q.seal(f"step-{task.step}")
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + task.uid)
        state = agent.start(games.prompt)
        try:
            for t in range(game.max_turns):
                guess, logp = agent.act(state, gen)
                tokens = games.step(guess)
                # the episode grows in the queue one turn at a time
                await rows.write({f"turn_{t}": tokens,
                                  f"logp_{t}": logp.masked_fill(tokens == PAD, 0.0)})
                state = agent.observe(state, tokens)
        except streamrl.errors.RowsDropped:
            pass  # dropped under us (stale, cleared): the episode is of no use any more


class EnvWorkerActor:
    """An env worker in a Ray actor of its own (``--transport ray``): the queue handle
    and the hub's actor handle arrive as arguments and work there as they are."""

    async def run(self, q: streamrl.StreamQueue, game: GuessTheNumber, hub,
                  args: argparse.Namespace) -> dict:
        torch.set_num_threads(1)
        await env_worker(q, game, hub, args)
        return q.timings()["env_worker"].to_dict()


def ray_env_workers(q: streamrl.StreamQueue, game: GuessTheNumber, hub: Hub,
                    args: argparse.Namespace) -> tuple[object, list, list]:
    """Start the hub and ``args.workers`` env workers as Ray actors; (hub actor, the
    worker actors, their results to await: each worker's timing)."""
    import ray
    import ray.cloudpickle

    # this example's modules are not importable in Ray's workers: send them by value
    for mod in {Agent.__module__, GuessTheNumber.__module__, __name__} - {"__main__"}:
        ray.cloudpickle.register_pickle_by_value(sys.modules[mod])
    hub_actor = ray.remote(num_cpus=0)(Hub).remote(hub.schedule, hub._state, args.max_staleness)
    workers = [ray.remote(num_cpus=0)(EnvWorkerActor).remote() for _ in range(args.workers)]
    return hub_actor, workers, [w.run.remote(q, game, hub_actor, args) for w in workers]


async def judge(q: streamrl.StreamQueue, game: GuessTheNumber, schedule: Schedule,
                args: argparse.Namespace, metrics: "Metrics") -> None:
    """The reward role: one finished group at a time, from its turns and secret only."""
    async with q.timed("judge"):
        await _judge(q, game, schedule, args, metrics)


async def _judge(q: streamrl.StreamQueue, game: GuessTheNumber, schedule: Schedule,
                 args: argparse.Namespace, metrics: "Metrics") -> None:
    turns = turn_fields(game)
    async for mb in q.stream("judge", fields=["uid", "secret", *turns],
                             batch_size=args.group_size, group_by="uid",
                             group_size=args.group_size):
        try:
            td = await mb.materialize()
            reward = game.score(stack(td, turns), td["secret"])
            await mb.write({"reward": reward})
        except streamrl.errors.RowsDropped:
            continue  # dropped while being judged (stale, cleared)
        metrics.rewards[schedule.step_of(int(td["uid"][0]))].extend(reward.tolist())


async def trainer(q: streamrl.StreamQueue, game: GuessTheNumber, agent: Agent,
                  hub, args: argparse.Namespace, metrics: "Metrics") -> None:
    """One GRPO step per partition, accumulating gradients over whole-group micro-batches."""
    async with q.timed("actor_update"):
        await _train(q, game, agent, hub, args, metrics)


async def _train(q: streamrl.StreamQueue, game: GuessTheNumber, agent: Agent,
                 hub, args: argparse.Namespace, metrics: "Metrics") -> None:
    opt = torch.optim.Adam(agent.parameters(), lr=args.lr)
    n = args.group_size
    turns, logps = turn_fields(game), logp_fields(game)
    for step in range(args.steps):
        trained = 0
        async for mb in q.stream("actor_update", fields=["uid", "prompt", *turns, *logps, "reward"],
                                 batch_size=2 * n,  # two whole groups per micro-batch
                                 group_by="uid", group_size=n, partition=f"step-{step}"):
            td = await mb.materialize()
            turn = stack(td, turns)
            guess, _ = game.decode(turn)
            logp = agent.log_probs(td["prompt"], turn, guess)
            adv = grpo_advantages(td["reward"], td["uid"])
            # a fixed normalizer: filtered groups would have added zero anyway
            loss = grpo_loss(logp, stack(td, logps), adv, turn != PAD) / (args.groups * n)
            loss.backward()
            trained += len(mb)
        if trained:
            opt.step()
            opt.zero_grad()
        await q.set_version(step + 1)
        await hub_call(hub, "publish", step + 1, weights_of(agent))
        await metrics.end_step(step, trained)


def moving_mean(xs: list[float], k: int = 10) -> list[float]:
    out = []
    for i in range(len(xs)):
        w = [x for x in xs[max(0, i - k + 1):i + 1] if not math.isnan(x)]
        out.append(sum(w) / len(w) if w else math.nan)
    return out


#: seconds between progress lines when the output is not a terminal
LOG_EVERY = 10.0


class Progress:
    """A run's progress, one update per step: a tqdm bar when stdout is a terminal;
    otherwise (CI, ``nohup``, ``> log``) one plain line every ``every`` seconds and at the
    last step, so that a log never fills with the bar's carriage-return redraws. Decided
    by stdout, where the lines and the report go (the bar is drawn there too)."""

    def __init__(self, total: int, desc: str, quiet: bool = False, every: float | None = None):
        self.total, self.desc, self.quiet = total, desc, quiet
        self.every = LOG_EVERY if every is None else every
        self.tty = sys.stdout.isatty()
        self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stdout,
                        dynamic_ncols=True, disable=quiet or not self.tty)
        self.done = 0
        self.t0 = self._logged = time.perf_counter()

    def update(self, text: str) -> None:
        """One more step done; ``text``: the figures to show with it."""
        self.done += 1
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update()
        now = time.perf_counter()
        if not self.tty and not self.quiet and (now - self._logged >= self.every
                                                or self.done == self.total):
            self._logged = now
            print(f"{self.desc}: step {self.done}/{self.total} ({now - self.t0:.0f} s): {text}",
                  flush=True)

    def close(self) -> None:
        self.bar.close()


class Metrics:
    """Per-step reward and throughput, the progress bar, the plot."""

    def __init__(self, q: streamrl.StreamQueue, steps: int, quiet: bool):
        self.q = q
        self.rewards: dict[int, list[float]] = defaultdict(list)  # step -> episode rewards
        self.history: list[dict] = []
        self.t0 = time.perf_counter()
        # (seconds, rows put, bytes put, rows trained, rows filtered) at the last 10 steps
        self._window = deque([(0.0, 0, 0, 0, 0)], maxlen=11)
        self._trained = 0
        self.steps = steps
        # a progress bar on a terminal; in a log (CI, nohup, a pipe) a line now and then
        self.progress = Progress(steps, "agentic GRPO", quiet)

    async def end_step(self, step: int, trained: int) -> None:
        st = await self.q.stats()
        self._trained += trained
        now = time.perf_counter() - self.t0
        self._window.append((now, st.put, st.bytes_put, self._trained, st.filtered))
        first, last = self._window[0], self._window[-1]
        dt = max(last[0] - first[0], 1e-9)
        put, nbytes, trained_, filtered = ((b - a) / dt for a, b in zip(first[1:], last[1:]))
        r = self.rewards.get(step, [])
        self.history.append({
            "step": step, "seconds": now, "reward": sum(r) / len(r) if r else math.nan,
            "trained": trained, "rows_per_s": put, "bytes_per_s": nbytes,
            "trained_per_s": trained_, "filtered_per_s": filtered})
        reward = moving_mean([h["reward"] for h in self.history])[-1]
        self.progress.update(f"reward={reward:.2f} rows/s={put:.0f} KB/s={nbytes / 1e3:.1f}")

    def close(self) -> None:
        self.progress.close()

    def mean_reward(self, steps: range) -> float:
        r = [x for s in steps for x in self.rewards.get(s, [])]
        return sum(r) / len(r) if r else math.nan

    def plot(self, path: Path, timings: dict[str, dict] | None = None) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        h = self.history
        t = [x["seconds"] for x in h]
        reward = [x["reward"] for x in h]
        fig = plt.figure(figsize=(8, 9.5))
        grid = fig.add_gridspec(4, 1, height_ratios=[3, 3, 3, 2])
        ax_r = fig.add_subplot(grid[0])
        ax_rows = fig.add_subplot(grid[1], sharex=ax_r)
        ax_bytes = fig.add_subplot(grid[2], sharex=ax_r)
        ax_time = fig.add_subplot(grid[3])
        ax_r.plot(t, reward, alpha=0.3, label="per step")
        ax_r.plot(t, moving_mean(reward), label="10-step mean")
        ax_r.set_ylabel("reward (games won)")
        ax_r.legend(loc="lower right")
        for key, label in (("rows_per_s", "put"), ("trained_per_s", "trained"),
                           ("filtered_per_s", "filtered")):
            ax_rows.plot(t, [x[key] for x in h], label=label)
        ax_rows.set_ylabel("rows/s")
        ax_rows.set_ylim(0, 1.3 * max(x["rows_per_s"] for x in h))  # room for the legend
        ax_rows.legend(loc="upper left", ncol=3)
        ax_bytes.plot(t, [x["bytes_per_s"] / 1e3 for x in h])
        ax_bytes.set_ylabel("KB/s put")
        ax_bytes.set_xlabel("seconds")
        if timings:  # where each role's time went: the queue against its own work
            roles = list(timings)
            queue = [timings[r]["queue_seconds"] for r in roles]
            compute = [timings[r]["compute_seconds"] for r in roles]
            ax_time.barh(roles, compute, label="computing")
            ax_time.barh(roles, queue, left=compute, label="waiting on the queue")
            ax_time.set_xlabel("seconds (summed over a role's workers)")
            ax_time.legend(loc="lower right", fontsize="small")
        fig.suptitle("agentic GRPO on streamrl: guess the number")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def sample_games(game: GuessTheNumber, agent: Agent, seed: int, n: int = 3) -> list[str]:
    """``n`` games played by ``agent``, as text."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        games = game.play(*game.sample_task(gen), n=1)
        state, turns = agent.start(games.prompt), []
        with torch.no_grad():
            for _ in range(game.max_turns):
                guess, _ = agent.act(state, gen)
                turns.append(games.step(guess))
                state = agent.observe(state, turns[-1])
        out.append(game.describe(games.prompt[0], torch.cat(turns)))
    return out


async def run(args: argparse.Namespace) -> dict:
    """Train; returns the summary (also written to ``<out>/summary.json``)."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a tiny model: more threads only add overhead
    game = GuessTheNumber()
    agent = Agent(game.vocab_size, game.num_actions)
    schedule = Schedule(game, args.steps, args.groups, args.seed)
    hub = Hub(schedule, weights_of(agent), args.max_staleness)
    rows_per_step = args.groups * args.group_size
    out = output_dir(args)
    if not args.quiet:
        print(f"guess a number below {game.max_number // 2}..{game.max_number} in {game.max_turns} "
              f"guesses: {args.steps} steps x "
              f"{args.groups} tasks x {args.group_size} rollouts, {args.workers} env workers, "
              f"transport={args.transport}")

    async with streamrl.StreamQueue(
            capacity=2 * rows_per_step, num_shards=2, transport=args.transport,
            max_staleness=args.max_staleness, consumers=["judge", "actor_update"]) as q:
        await q.add_filter(zero_variance("reward", group_by="uid", group_size=args.group_size))
        metrics = Metrics(q, args.steps, args.quiet)
        worker_timings: list = []
        actors: list = []
        async with asyncio.TaskGroup() as tg:
            tg.create_task(judge(q, game, schedule, args, metrics))
            if args.transport == "ray":  # env workers in Ray actors of their own
                hub, workers, done = ray_env_workers(q, game, hub, args)
                actors = [hub, *workers]

                async def gather_workers():
                    worker_timings.extend(await asyncio.gather(*done))

                tg.create_task(gather_workers())
            else:  # env workers as tasks of this event loop
                for _ in range(args.workers):
                    tg.create_task(env_worker(q, game, hub, args))
            await trainer(q, game, agent, hub, args, metrics)
            await q.close()  # ends the judge's stream
        metrics.close()
        st = await q.stats()
        timings = {role: t.to_dict() for role, t in q.timings().items()}
        if worker_timings:  # summed over the worker actors
            timings["env_worker"] = merged(worker_timings)
        for a in actors:
            import ray

            ray.kill(a)

    window = range(max(1, args.steps // 10))
    summary = {
        "steps": args.steps,
        "seconds": round(time.perf_counter() - metrics.t0, 2),
        "transport": args.transport,
        "reward_start": metrics.mean_reward(window),
        "reward_end": metrics.mean_reward(range(args.steps - len(window), args.steps)),
        "rows_put": st.put,
        "rows_filtered": st.filtered,
        "rows_stale": st.stale,
        "rows_trained": sum(h["trained"] for h in metrics.history),
        "rows_dropped_by": st.dropped_by,
        "rows_held": st.rows,
        "leaked": st.leaked,
        "bytes_put": st.bytes_put,
        "bytes_held": st.bytes,
        "time_by_role": timings,
        "history": metrics.history,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    metrics.plot(out / "curves.png", timings)
    if not args.quiet:
        print(f"mean reward: start {summary['reward_start']:.3f} -> end {summary['reward_end']:.3f}"
              f" (first and last {len(window)} steps)")
        print(f"rows put {st.put} | filtered {st.filtered} | stale {st.stale} | trained "
              f"{summary['rows_trained']} | leaked {st.leaked} (held {st.rows} rows, {st.bytes} B)"
              f" | {st.bytes_put / 1e6:.1f} MB in {summary['seconds']:.0f} s")
        print("where the time went (per role, summed over its workers):")
        for role, t in timings.items():
            print(f"  {role:<13} {t['seconds']:6.1f} s: {100 * t['queue_share']:4.1f}% waiting on "
                  f"the queue, {100 * (1 - t['queue_share']):4.1f}% computing ({t['calls']} calls)")
        print("games after training:\n  " + "\n  ".join(sample_games(game, agent, args.seed + 1)))
        print(f"wrote {out / 'curves.png'} and {out / 'summary.json'}")
    return summary


def output_dir(args: argparse.Namespace) -> Path:
    """``--out``, or a new ``runs/agentic/<date>-<time>-<transport>`` per run (so runs
    do not overwrite each other's plots); created."""
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return out
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{args.transport}"
    for i in range(1, 1000):
        out = Path("runs/agentic") / (stem if i == 1 else f"{stem}-{i}")
        try:
            out.mkdir(parents=True)
            return out
        except FileExistsError:
            continue
    raise RuntimeError(f"no free output directory for {stem} under runs/agentic; pass --out")


def merged(timings: list[dict]) -> dict:
    """Role timings of several workers, summed (as ``q.timings()`` sums a process's)."""
    out = {k: sum(t[k] for t in timings) for k in ("seconds", "queue_seconds",
                                                  "compute_seconds", "blocks", "calls")}
    out["queue_share"] = out["queue_seconds"] / out["seconds"] if out["seconds"] else 0.0
    return out


def main() -> None:
    asyncio.run(run(parse_args()))


if __name__ == "__main__":
    main()
