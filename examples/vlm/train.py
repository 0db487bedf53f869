"""A vision-language style GRPO pipeline on one :class:`streamrl.StreamQueue`.

Images dominate the bytes: every row holds a 3x224x224 uint8 picture of coloured squares
and discs (147 KiB), a short prompt ("how many red shapes ?", 5 int64 tokens) and a few
scalars. Four roles run as separate asyncio tasks on one queue:

* **producer** renders scenes, puts ``{image, prompt, uid, label}`` (``group_size`` rows
  per scene, one GRPO group, sharing ``uid``) into partition ``step-<i>`` and seals it;
* **rollout** streams ``image`` + ``prompt``, samples an answer with its copy of the
  policy and writes ``answer`` + ``logprob``;
* **reward** streams only ``answer`` + ``label`` -- it never fetches a pixel -- and writes
  ``reward`` (1 when the count is right);
* **trainer** streams group-complete batches (``group_by="uid"``), materializes pixels,
  answers and rewards, computes GRPO advantages, updates the CNN, publishes the weights
  to the rollout role and advances the queue's policy version.

``streamrl.filters.zero_variance`` drops groups whose rewards are all equal (no learning
signal) before the trainer sees them; ``consumers=["rollout", "reward", "trainer"]`` drops
each row (and frees its image) as soon as all three roles acknowledged it, and
``max_staleness`` drops rows that waited too long. Nothing is left behind: the summary
checks ``leaked == 0`` and that the queue ends empty.

Each role counts the bytes it materializes. ``--fetch eager`` makes every role fetch
every field of its rows instead (what shipping whole rows costs); by default the command
line runs a short eager baseline after training and prints both side by side.

Run::

    python examples/vlm/train.py                   # ~1 minute on 2 CPU cores
    python examples/vlm/train.py --transport ray   # the queue as Ray actors

With the defaults (400 steps of 16 prompts x 8 rollouts) greedy accuracy on a fixed
evaluation set goes from chance (0.2) to about 0.65-0.8. The seed fixes the data and the
initial weights; the roles interleave as the scheduler decides, so numbers vary by a few
points from run to run. The plot and a JSON summary go to ``--out`` (``runs/vlm``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch import nn

import streamrl
from streamrl.errors import RowsDropped
from streamrl.filters import zero_variance

# ---------------------------------------------------------------------------- the task

IMAGE_SIZE = 224
IMAGE_BYTES = 3 * IMAGE_SIZE * IMAGE_SIZE  # uint8
COLOURS = {  # name -> RGB
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 230),
    "yellow": (230, 210, 40),
}
ASKED = ("red", "green", "blue")  # colours a question may ask about (yellow: distractor only)
MAX_COUNT = 5  # answers are 1..MAX_COUNT
VOCAB = ("<pad>", "how", "many", "shapes", "?") + tuple(COLOURS)
TOKEN = {w: i for i, w in enumerate(VOCAB)}
PROMPT_LEN = 5

HALF_SIDE = 11  # squares are 22x22 ...
DISC_RADIUS = HALF_SIDE * 2 / math.sqrt(math.pi)  # ... and discs have the same area,
CELL = 32  # so counting a colour is measuring its area; shapes sit in a 7x7 grid of cells
GRID = IMAGE_SIZE // CELL


def tokenize(question: str) -> torch.Tensor:
    ids = [TOKEN[w] for w in question.split()]
    return torch.tensor(ids + [TOKEN["<pad>"]] * (PROMPT_LEN - len(ids)), dtype=torch.int64)


def _shape_masks() -> torch.Tensor:
    """[2, 7, 7, CELL, CELL] bool: a square / a disc centred in a cell, offset by -3..3 px."""
    ys, xs = torch.meshgrid(torch.arange(CELL), torch.arange(CELL), indexing="ij")
    off = torch.arange(-3, 4).float()
    cy = (CELL / 2 - 0.5 + off)[:, None, None, None]
    cx = (CELL / 2 - 0.5 + off)[None, :, None, None]
    square = ((ys - cy).abs() < HALF_SIDE) & ((xs - cx).abs() < HALF_SIDE)
    disc = (ys - cy) ** 2 + (xs - cx) ** 2 < DISC_RADIUS ** 2
    return torch.stack([square, disc])


SHAPES = _shape_masks()
PALETTE = torch.tensor(list(COLOURS.values()), dtype=torch.uint8)  # [4, 3]


def render_scene(gen: torch.Generator, asked: str, count: int) -> torch.Tensor:
    """A 3x224x224 uint8 scene with ``count`` shapes of colour ``asked`` and 0..3
    distractor shapes of each other colour, squares or discs, in distinct grid cells."""
    names = list(COLOURS)
    colours = [names.index(asked)] * count
    for i, other in enumerate(names):
        if other != asked:
            colours += [i] * int(torch.randint(0, 4, (), generator=gen))
    k = len(colours)
    # the canvas as GRID*GRID cells of CELL x CELL pixels: noisy dark background ...
    cells = torch.randint(24, 40, (GRID * GRID, 3, CELL, CELL), generator=gen, dtype=torch.uint8)
    # ... and k shapes (random kind and offset) in k distinct cells
    where = torch.randperm(GRID * GRID, generator=gen)[:k]
    kind = torch.randint(0, 2, (k,), generator=gen)
    dy, dx = torch.randint(0, 7, (2, k), generator=gen)
    mask = SHAPES[kind, dy, dx][:, None]  # [k, 1, CELL, CELL]
    paint = PALETTE[torch.tensor(colours)][:, :, None, None]  # [k, 3, 1, 1]
    cells[where] = torch.where(mask, paint, cells[where])
    return cells.view(GRID, GRID, 3, CELL, CELL).permute(2, 0, 3, 1, 4).reshape(
        3, IMAGE_SIZE, IMAGE_SIZE)


def make_scenes(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` scenes: images [n,3,224,224] uint8, prompts [n,5] int64, labels [n] int64
    (the answer index: count - 1)."""
    images, prompts, labels = [], [], []
    for _ in range(n):
        asked = ASKED[int(torch.randint(0, len(ASKED), (), generator=gen))]
        count = int(torch.randint(1, MAX_COUNT + 1, (), generator=gen))
        images.append(render_scene(gen, asked, count))
        prompts.append(tokenize(f"how many {asked} shapes ?"))
        labels.append(count - 1)
    return torch.stack(images), torch.stack(prompts), torch.tensor(labels)


# ---------------------------------------------------------------------------- the policy


class Policy(nn.Module):
    """A tiny CNN over the (downsampled) image, gated by the prompt, with a head over the
    answer tokens "1".."5".

    The image is average-pooled 8x (224 -> 28 px, a shape is ~3 px wide), a 3x3 and a 1x1
    convolution detect colours, and summing (not averaging) over the pixels gives features
    that grow with the number of shapes; the prompt's embedding gates them (which colour
    is asked) before a small MLP picks the answer.
    """

    def __init__(self, width: int = 16):
        super().__init__()
        self.vision = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.ReLU(),
            nn.Conv2d(width, width, 1, bias=False), nn.ReLU(),
        )
        self.text = nn.EmbeddingBag(len(VOCAB), width, mode="sum", padding_idx=TOKEN["<pad>"])
        self.head = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, MAX_COUNT))
        nn.init.zeros_(self.head[-1].weight)  # start from the uniform policy: every
        nn.init.zeros_(self.head[-1].bias)  # answer equally likely, most groups have signal

    def forward(self, image: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        x = F.avg_pool2d(image.float(), 8)  # uint8 [B,3,224,224] -> float [B,3,28,28]
        x = x / 64.0 - 0.5  # the dark background (~32) maps to ~0, colours to 1..3
        feats = self.vision(x).sum((2, 3)) / 16.0  # ~ a shape's pixels at 28 px
        return self.head(feats * torch.sigmoid(self.text(prompt)))


@torch.no_grad()
def accuracy(policy: Policy, images: torch.Tensor, prompts: torch.Tensor, labels: torch.Tensor) -> float:
    """Greedy accuracy on a fixed evaluation set."""
    return (policy(images, prompts).argmax(1) == labels).float().mean().item()


def grpo_advantages(reward: torch.Tensor, uid: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(reward - group mean) / group std, groups given by ``uid`` (rows of a group need
    not be contiguous)."""
    _, group = torch.unique(uid, return_inverse=True)
    n = torch.zeros(int(group.max()) + 1).index_add_(0, group, torch.ones_like(reward))
    mean = torch.zeros_like(n).index_add_(0, group, reward) / n
    var = torch.zeros_like(n).index_add_(0, group, (reward - mean[group]) ** 2) / n
    return (reward - mean[group]) / (var[group].sqrt() + eps)


# ---------------------------------------------------------------------------- accounting


def nbytes(td: TensorDictBase) -> int:
    """Bytes of the tensors of a (materialized) TensorDict."""
    return sum(v.nbytes for v in td.values(include_nested=True, leaves_only=True)
               if isinstance(v, torch.Tensor))


@dataclasses.dataclass
class RoleBytes:
    """What one role moved: rows it got, bytes it materialized (fetched), bytes it put."""

    rows: int = 0
    fetched: int = 0
    written: int = 0


@dataclasses.dataclass
class Published:
    """The trainer's latest weights (a copy), as the rollout role sees them. Both roles
    touch it only from the event loop, never from their compute threads."""

    version: int
    state: dict[str, torch.Tensor]

    def publish(self, version: int, policy: nn.Module) -> None:
        self.version, self.state = version, copy.deepcopy(policy.state_dict())


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
        from tqdm.auto import tqdm

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


class Run:
    """State shared by the roles of one run."""

    def __init__(self, args: argparse.Namespace, q: streamrl.StreamQueue):
        self.args = args
        self.q = q
        self.n = args.group_size
        self.rows_per_step = args.prompts * args.group_size
        self.eager = args.fetch == "eager"
        self.bytes: dict[str, RoleBytes] = defaultdict(RoleBytes)
        self.reward_by_step: dict[int, list[float]] = defaultdict(list)
        self.history: list[dict[str, float]] = []  # per trainer step
        self.samples: list[dict[str, float]] = []  # queue stats over time
        self.trained_rows = 0
        self.updates = 0
        self.dropped_in_flight = 0
        self.t0 = time.perf_counter()

    def partition(self, step: int) -> str:
        return f"step-{step}"

    async def fetch(self, role: str, mb: streamrl.RowRemoteBatch, fields: list[str]):
        """Materialize what ``role`` needs -- or, eager, every field of the rows -- and
        count the bytes that came back."""
        want = sorted(mb.known_fields) if self.eager else fields
        td = await mb.materialize(want)
        acct = self.bytes[role]
        acct.rows += len(mb)
        acct.fetched += nbytes(td)
        return td

    async def write(self, role: str, mb: streamrl.RowRemoteBatch, data: dict[str, torch.Tensor]):
        self.bytes[role].written += sum(v.nbytes for v in data.values())
        await mb.write(data)


# ---------------------------------------------------------------------------- roles


async def producer(run: Run, gen: torch.Generator) -> None:
    """Render ``prompts`` scenes per step, ``group_size`` rows (one GRPO group) each."""
    args, n = run.args, run.n
    for step in range(args.steps):
        images, prompts, labels = await anyio.to_thread.run_sync(make_scenes, gen, args.prompts)
        uid = torch.arange(step * args.prompts, (step + 1) * args.prompts)
        rows = {
            "image": images.repeat_interleave(n, 0),
            "prompt": prompts.repeat_interleave(n, 0),
            "uid": uid.repeat_interleave(n),
            "label": labels.repeat_interleave(n),
        }
        run.bytes["producer"].rows += run.rows_per_step
        run.bytes["producer"].written += sum(v.nbytes for v in rows.values())
        await run.q.put(rows, partition=run.partition(step))  # waits while the queue is full
        await run.q.seal(run.partition(step))


async def rollout(run: Run, actor: Policy, weights: Published, gen: torch.Generator) -> None:
    """Sample an answer per row with the newest published weights."""
    version = weights.version
    for step in range(run.args.steps):
        async with run.q.stream("rollout", ["image", "prompt"], batch_size=run.rows_per_step,
                                partition=run.partition(step)) as batches:
            async for mb in batches:
                if weights.version != version:
                    version = weights.version
                    actor.load_state_dict(weights.state)
                try:
                    td = await run.fetch("rollout", mb, ["image", "prompt"])
                except RowsDropped:  # went stale while we waited
                    run.dropped_in_flight += len(mb)
                    continue

                def sample():
                    with torch.no_grad():
                        logits = actor(td["image"], td["prompt"])
                        logp = F.log_softmax(logits, dim=1)
                        answer = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
                        return answer, logp.gather(1, answer[:, None]).squeeze(1)

                answer, logprob = await anyio.to_thread.run_sync(sample)
                try:
                    await run.write("rollout", mb, {"answer": answer, "logprob": logprob})
                except RowsDropped:
                    run.dropped_in_flight += len(mb)


async def reward(run: Run) -> None:
    """Score answers against labels. Never asks for the image."""
    for step in range(run.args.steps):
        async with run.q.stream("reward", ["answer", "label"], batch_size=run.rows_per_step,
                                partition=run.partition(step)) as batches:
            async for mb in batches:
                try:
                    td = await run.fetch("reward", mb, ["answer", "label"])
                    r = (td["answer"] == td["label"]).float()
                    await run.write("reward", mb, {"reward": r})
                except RowsDropped:
                    run.dropped_in_flight += len(mb)
                    continue
                run.reward_by_step[step] += r.tolist()


TRAIN_FIELDS = ["image", "prompt", "uid", "answer", "logprob", "reward"]


async def trainer(run: Run, policy: Policy, weights: Published, evalset,
                  progress: Progress) -> None:
    """GRPO on group-complete batches; publish weights and advance the version after
    each update."""
    args = run.args
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    for step in range(args.steps):
        loss = None
        async with run.q.stream("trainer", TRAIN_FIELDS, batch_size=run.rows_per_step,
                                partition=run.partition(step), group_by="uid",
                                group_size=run.n) as batches:
            async for mb in batches:
                td = await run.fetch("trainer", mb, TRAIN_FIELDS)
                adv = grpo_advantages(td["reward"], td["uid"])

                def update() -> float:
                    for _ in range(args.epochs):
                        logp_all = F.log_softmax(policy(td["image"], td["prompt"]), 1)
                        logp = logp_all.gather(1, td["answer"][:, None]).squeeze(1)
                        ratio = (logp - td["logprob"]).exp()  # new policy / rollout policy
                        clipped = ratio.clamp(1 - args.clip, 1 + args.clip)
                        entropy = -(logp_all.exp() * logp_all).sum(1).mean()
                        objective = torch.min(ratio * adv, clipped * adv).mean()
                        loss = -objective - args.entropy * entropy
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                    return loss.item()

                loss = await anyio.to_thread.run_sync(update)
                run.trained_rows += len(mb)
                run.updates += 1
                await mb.ack()  # the trainer was the last consumer: the rows go now
                weights.publish(run.updates, policy)
                await run.q.set_version(run.updates)  # rows now too old go (stale)
        # one progress tick per step, even when the zero-variance filter took it all
        rewards = run.reward_by_step.get(step, [])
        entry = {"step": step, "time": time.perf_counter() - run.t0,
                 "reward": sum(rewards) / len(rewards) if rewards else float("nan"),
                 "loss": float("nan") if loss is None else loss}
        if step % args.eval_every == 0 or step == args.steps - 1:
            entry["eval_acc"] = await anyio.to_thread.run_sync(accuracy, policy, *evalset)
        run.history.append(entry)
        s = await run.q.stats()
        post = dict(reward=f"{entry['reward']:.2f}", held=f"{s.bytes / 2**20:.0f}MiB",
                    rows_s=f"{s.put / (time.perf_counter() - run.t0):.0f}")
        progress.update(" ".join(f"{k}={v}" for k, v in post.items()))


async def monitor(run: Run, stop: anyio.Event) -> None:
    """Sample the queue's holdings over time. The images' share is taken from what the
    storage units report holding (``unit_rows`` / ``unit_bytes``): every stored row has
    exactly one image."""
    while True:
        s = await run.q.stats()
        run.samples.append({"time": time.perf_counter() - run.t0, "bytes": s.bytes,
                            "rows": s.rows, "stored_bytes": sum(s.unit_bytes),
                            "image_bytes": sum(s.unit_rows) * IMAGE_BYTES,
                            "bytes_put": s.bytes_put, "bytes_freed": s.bytes_freed})
        if stop.is_set():
            return
        with anyio.move_on_after(run.args.sample_every):
            await stop.wait()


# ---------------------------------------------------------------------------- the run


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train for ``args.steps`` steps and return the summary (see :func:`parse_args`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)  # the roles already run side by side
    try:
        return await _run(args)
    finally:
        torch.set_num_threads(threads)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    scene_gen = torch.Generator().manual_seed(args.seed)
    sample_gen = torch.Generator().manual_seed(args.seed + 1)
    evalset = make_scenes(torch.Generator().manual_seed(10_000 + args.seed), args.eval_size)
    policy = Policy()
    actor = copy.deepcopy(policy)
    weights = Published(0, copy.deepcopy(policy.state_dict()))
    acc_start = accuracy(policy, *evalset)

    rows_per_step = args.prompts * args.group_size
    q = streamrl.StreamQueue(capacity=rows_per_step * args.lookahead, num_shards=2,
                             transport=args.transport, max_staleness=args.max_staleness,
                             consumers=["rollout", "reward", "trainer"])
    async with q:
        await q.add_filter(zero_variance("reward", group_by="uid", group_size=args.group_size))
        r = Run(args, q)
        stop = anyio.Event()
        progress = Progress(args.steps, f"vlm {args.fetch}", args.quiet)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(monitor, r, stop)
                async with anyio.create_task_group() as roles:
                    roles.start_soon(producer, r, scene_gen)
                    roles.start_soon(rollout, r, actor, weights, sample_gen)
                    roles.start_soon(reward, r)
                    roles.start_soon(trainer, r, policy, weights, evalset, progress)
                stop.set()
        finally:
            progress.close()
        final = await q.stats()
        leaked = await q.leaked()

    runtime = time.perf_counter() - r.t0
    rewards = [h["reward"] for h in r.history if not math.isnan(h["reward"])]
    k = max(1, len(rewards) // 10)
    summary = {
        "transport": args.transport,
        "fetch": args.fetch,
        "steps": args.steps,
        "updates": r.updates,
        "rows_put": final.put,
        "filtered": final.filtered,
        "stale": final.stale,
        "trained": r.trained_rows,
        "dropped_in_flight": r.dropped_in_flight,
        "consumed": final.consumed,
        "dropped_by": dict(final.dropped_by),
        "held_rows": final.rows,
        "held_bytes": final.bytes,
        "leaked": leaked + final.leaked,
        "bytes_put": final.bytes_put,
        "bytes_freed": final.bytes_freed,
        "peak_held_bytes": max(s["bytes"] for s in r.samples),
        "capacity_rows": rows_per_step * args.lookahead,
        "sample_every": args.sample_every,
        "bytes": {role: dataclasses.asdict(b) for role, b in r.bytes.items()},
        "accuracy_start": acc_start,
        "accuracy_end": r.history[-1].get("eval_acc", float("nan")) if r.history else acc_start,
        "reward_start": sum(rewards[:k]) / k if rewards else float("nan"),
        "reward_end": sum(rewards[-k:]) / k if rewards else float("nan"),
        "chance": 1 / MAX_COUNT,
        "runtime_s": runtime,
        "history": r.history,
        "samples": r.samples,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary["plot"] = str(plot(summary, out / f"vlm_{args.fetch}.png"))
    (out / f"summary_{args.fetch}.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def plot(summary: dict[str, Any], path: Path) -> Path:
    """Accuracy/reward per step; what the queue holds over time (images vs the other
    fields); bytes put vs freed by drop over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist, samples = summary["history"], summary["samples"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.2))

    steps = [h["step"] for h in hist]
    ax1.plot(steps, [h["reward"] for h in hist], lw=0.7, alpha=0.5, label="rollout reward (sampled)")
    ev = [(h["step"], h["eval_acc"]) for h in hist if "eval_acc" in h]
    if ev:
        ax1.plot(*zip(*ev), "o-", ms=3, label="eval accuracy (greedy)")
    ax1.axhline(summary["chance"], color="grey", ls=":", label="chance")
    ax1.set(xlabel="step", ylabel="accuracy / reward", ylim=(0, 1),
            title=f"counting shapes with GRPO ({summary['fetch']}, {summary['transport']})")
    ax1.legend(loc="upper left", fontsize=8)

    t = [s["time"] for s in samples]
    mib = 2.0 ** 20
    images = [s["image_bytes"] / mib for s in samples]
    held = [s["stored_bytes"] / mib for s in samples]
    window = max(1, round(1.0 / summary["sample_every"]))  # ~1 s running mean
    smooth = [sum(images[max(0, i - window + 1):i + 1]) / len(images[max(0, i - window + 1):i + 1])
              for i in range(len(images))]
    ax2.plot(t, held, lw=0.5, alpha=0.5, label="all fields held")
    ax2.plot(t, smooth, lw=1.8, label="images held (1 s mean)")
    ax2.axhline(summary["capacity_rows"] * IMAGE_BYTES / mib, color="grey", ls=":",
                label=f"capacity ({summary['capacity_rows']} rows of images)")
    share = sum(s["image_bytes"] for s in samples) / max(1, sum(s["stored_bytes"] for s in samples))
    ax2.set(xlabel="seconds", ylabel="MiB held by the queue",
            title=f"queue holdings (images: {share:.2%} of the bytes)")
    ax2.legend(loc="lower center", fontsize=8)

    gib = 2.0 ** 30
    ax3.plot(t, [s["bytes_put"] / gib for s in samples], label="put")
    ax3.plot(t, [s["bytes_freed"] / gib for s in samples], ls="--", label="freed by drop")
    ax3.set(xlabel="seconds", ylabel="GiB (cumulative)",
            title=f"peak held {summary['peak_held_bytes'] / mib:.0f} MiB of "
                  f"{summary['bytes_put'] / gib:.1f} GiB put")
    ax3.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- reports


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def bytes_table(lazy: dict[str, Any], eager: dict[str, Any] | None) -> str:
    """Role -> bytes materialized, lazy vs eager. Each role's bytes per row are fixed, so
    the eager run may be shorter: its per-row cost times the lazy run's rows is what
    shipping whole rows would have cost for the same rows."""
    head = f"{'role':<10}{'rows':>7}{'lazy':>12}{'lazy/row':>11}"
    if eager:
        head += f"{'eager/row':>11}{'eager':>12}{'lazy/eager':>12}"
    lines = [head]
    for role in ("producer", "rollout", "reward", "trainer"):
        key = "written" if role == "producer" else "fetched"
        lb = lazy["bytes"].get(role, {"rows": 0, key: 0})
        per = lb[key] / lb["rows"] if lb["rows"] else 0.0
        line = (f"{role + ('*' if role == 'producer' else ''):<10}{lb['rows']:>7}"
                f"{fmt_bytes(lb[key]):>12}{fmt_bytes(per):>11}")
        if eager:
            eb = eager["bytes"].get(role, {"rows": 0, key: 0})
            eper = eb[key] / eb["rows"] if eb["rows"] else 0.0
            ratio = f"{per / eper:.3%}" if eper else "-"
            line += f"{fmt_bytes(eper):>11}{fmt_bytes(eper * lb['rows']):>12}{ratio:>12}"
        lines.append(line)
    lines.append("* producer: bytes put (the same either way); other roles: bytes materialized")
    if eager:
        lines.append(f"eager/row measured by a {eager['steps']}-step run with --fetch eager "
                     "(every role fetching every field of its rows); eager = eager/row x rows")
    return "\n".join(lines)


def memory_table(summary: dict[str, Any], points: int = 6) -> str:
    """A few samples of what the queue held: bytes, the images' share, freed so far."""
    samples = summary["samples"]
    pick = sorted({round(i * (len(samples) - 1) / (points - 1)) for i in range(points)})
    lines = [f"{'t (s)':>7}{'held':>12}{'images':>9}{'put':>12}{'freed':>12}"]
    for i in pick:
        s = samples[i]
        share = f"{s['image_bytes'] / s['stored_bytes']:.2%}" if s["stored_bytes"] else "-"
        lines.append(f"{s['time']:>7.1f}{fmt_bytes(s['stored_bytes']):>12}{share:>9}"
                     f"{fmt_bytes(s['bytes_put']):>12}{fmt_bytes(s['bytes_freed']):>12}")
    return "\n".join(lines)


def summary_line(s: dict[str, Any]) -> str:
    return (f"rows put={s['rows_put']} filtered={s['filtered']} stale={s['stale']} "
            f"trained={s['trained']} held={s['held_rows']} leaked={s['leaked']} | "
            f"eval accuracy {s['accuracy_start']:.2f} -> {s['accuracy_end']:.2f} "
            f"(chance {s['chance']:.2f}) | rollout reward {s['reward_start']:.2f} -> "
            f"{s['reward_end']:.2f} | {s['runtime_s']:.0f}s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="producer steps (partitions); "
                   "each is one trainer update unless the filter drops all its groups")
    p.add_argument("--group-size", type=int, default=8, help="GRPO rollouts per prompt")
    p.add_argument("--prompts", type=int, default=16, help="prompts (scenes) per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/vlm", help="where the plot and summary go")
    p.add_argument("--transport", choices=["embedded", "ray"], default="embedded")
    p.add_argument("--fetch", choices=["lazy", "eager"], default="lazy",
                   help="lazy: each role materializes only its fields; eager: whole rows")
    p.add_argument("--baseline-steps", type=int, default=20,
                   help="steps of the eager baseline run after training (0: skip it)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=2, help="gradient steps per batch")
    p.add_argument("--entropy", type=float, default=0.05, help="entropy bonus")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--lookahead", type=int, default=2, help="queue capacity, in steps of rows")
    p.add_argument("--max-staleness", type=int, default=3,
                   help="drop rows put more than this many policy versions ago")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-size", type=int, default=300)
    p.add_argument("--sample-every", type=float, default=0.1, help="seconds between stats samples")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (the roles' compute already overlaps in threads)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    for name in ("steps", "group_size", "prompts", "lookahead", "eval_every", "eval_size",
                 "epochs", "torch_threads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.group_size < 2:
        p.error("--group-size must be at least 2 (GRPO compares rollouts of one prompt)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.transport == "ray":
        import ray

        from streamrl.transport.ray import init_ray

        if not ray.is_initialized():  # a local Ray starts on loopback (see init_ray)
            init_ray(log_to_driver=False)
    summary = asyncio.run(run(args))
    baseline = None
    if args.fetch == "lazy" and args.baseline_steps:
        print(f"eager baseline: the same pipeline for {args.baseline_steps} steps, every role "
              "fetching whole rows ...")
        eager_args = argparse.Namespace(**{**vars(args), "fetch": "eager",
                                           "steps": args.baseline_steps})
        baseline = asyncio.run(run(eager_args))
    print()
    print("bytes materialized per role")
    print(bytes_table(summary, baseline))
    print()
    print("queue memory over time (images' share of what is held; drop frees it)")
    print(memory_table(summary))
    print()
    print(f"plot: {summary['plot']}")
    print(summary_line(summary))
    return summary


if __name__ == "__main__":
    main()
