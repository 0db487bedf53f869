"""``python -m streamrl top NAME``: a live terminal view of a named Ray queue (or, given
a checkpoint directory, one read-only snapshot of it).

Attaches to the queue (``StreamQueue.connect``) and redraws, every ``--interval``
seconds: the queue's holdings against its capacity; its partitions with rows by state;
each task with its rates, lag, leases and latencies; the filters and what they dropped;
the storage units and their memory. ``--once`` prints one snapshot and exits; ``--json``
(with ``--once``) prints it as JSON (for scripts). A checkpoint directory is read without
Ray (always one snapshot), from its metadata only: no row data is read.

Examples:
    python -m streamrl top rollouts --address auto --namespace rl
    python -m streamrl top rollouts --once --json | jq .tasks
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any, cast

from .stats import Stats, _dur

__all__ = ["checkpoint_stats", "main", "render", "snapshot"]


def snapshot(st: Stats, prev: tuple[float, Stats] | None, now: float) -> dict[str, Any]:
    """What the view shows, as plain data: the stats plus per-task rates (rows/s since
    the previous snapshot) and lag (rows not yet consumed: ready + waiting + leased)."""
    out = st.to_dict()
    dt = now - prev[0] if prev else 0.0
    for name, t in st.tasks.items():
        d = out["tasks"][name]
        before = prev[1].tasks.get(name) if prev else None
        d["rate_delivered"] = ((t.delivered - before.delivered) / dt) if before and dt else None
        d["rate_acked"] = ((t.acked - before.acked) / dt) if before and dt else None
        d["lag"] = t.ready + t.waiting + t.leased
        d.pop("delivery_latency", None)
        d.pop("wait", None)
    out.pop("partition_delivery", None)  # (histograms: for exporters)
    out.pop("partition_wait", None)
    out["rate_put"] = ((st.put - prev[1].put) / dt) if prev and dt else None
    return out


def render(snap: dict[str, Any], name: str) -> Any:
    """A rich renderable of one snapshot."""
    from rich.console import Group
    from rich.table import Table

    cap_b = snap["capacity_bytes"]
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[bold]streamrl queue {name}[/bold]",
        f"rows {snap['rows']}/{snap['capacity']}",
        f"bytes {_size(snap['bytes'])}" + (f"/{_size(cap_b)}" if cap_b else ""),
        f"version {snap['version']}", f"leases {snap['leases']}",
        f"producers waiting {snap['waiting_puts']}",
        f"put {snap['put']}" + (f" ({snap['rate_put']:.0f}/s)" if snap["rate_put"] else ""),
        f"leaked {snap['leaked']}", "closed" if snap["closed"] else "open")
    parts = Table(title="partitions", title_justify="left", expand=False)
    for col in ("partition", "rows", "waiting", "ready", "leased", "consumed", "bytes", "put",
                "sealed"):
        parts.add_column(col, justify="left" if col == "partition" else "right")
    for p, s in sorted(snap["partitions"].items()):
        parts.add_row(p, str(s.get("rows", 0)), str(s.get("waiting", 0)), str(s.get("ready", 0)),
                      str(s.get("leased", 0)), str(s.get("consumed", 0)),
                      _size(s.get("bytes", 0)), str(s.get("put", 0)),
                      "yes" if s.get("sealed") else "no")
    tasks = Table(title="tasks", title_justify="left")
    for col in ("task", "delivered", "acked", "rows/s", "lag", "ready", "waiting", "leased",
                "again", "expired", "MB", "put->deliv p50/p99", "wait p50/p99"):
        tasks.add_column(col, justify="left" if col == "task" else "right")
    for t, d in sorted(snap["tasks"].items()):
        rate = d["rate_acked"]
        tasks.add_row(t, str(d["delivered"]), str(d["acked"]),
                      "-" if rate is None else f"{rate:.0f}", str(d["lag"]), str(d["ready"]),
                      str(d["waiting"]), str(d["leased"]), str(d["redelivered"]),
                      str(d["expired"]), f"{d['bytes'] / 1e6:.1f}",
                      f"{_dur(d['delivery_p50'])} / {_dur(d['delivery_p99'])}",
                      f"{_dur(d['wait_p50'])} / {_dur(d['wait_p99'])}")
    drops = Table(title="dropped and filtered", title_justify="left")
    drops.add_column("reason or filter")
    drops.add_column("rows", justify="right")
    drops.add_column("bytes", justify="right")
    drops.add_column("pending", justify="right")
    for reason, n in sorted(snap["dropped_by"].items()):
        drops.add_row(reason, str(n), _size(snap["bytes_dropped_by"].get(reason, 0)), "")
    for f, n in sorted(snap["filtered_by"].items()):
        drops.add_row(f"filter {f}", str(n), _size(snap["bytes_filtered_by"].get(f, 0)),
                      str(snap["filter_pending"].get(f, 0)))
    units = Table(title="storage units", title_justify="left")
    for col in ("unit", "rows", "bytes", "shared memory", "pinned"):
        units.add_column(col, justify="right")
    shared, pinned = snap["unit_shared_bytes"], snap["unit_pinned_bytes"]
    for i, (r, b) in enumerate(zip(snap["unit_rows"], snap["unit_bytes"])):
        units.add_row(str(i), str(r), _size(b), _size(shared[i]) if i < len(shared) else "-",
                      _size(pinned[i]) if i < len(pinned) else "-")
    out: list[Any] = [head]
    saved = snap.get("saved_leases")
    if saved is not None:  # a checkpoint's view
        rows = ", ".join(f"{t} {n}" for t, n in sorted(saved["rows"].items()))
        out.append(f"saved with {saved['leases']} open lease(s)"
                   + (f" ({rows} rows)" if rows else "")
                   + ": shown released, as a restore brings them back")
    return Group(*out, parts, tasks, drops, units)


def _size(n: int | None) -> str:
    """Bytes, readable: ``"240B"``, ``"12.3KB"``, ``"1.5MB"``, ``"2.0GB"``."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


class _NoData:
    """The data plane of a checkpoint's view: the storage units as the manifest
    describes them (rows and bytes each wrote), and no data at all. Deletes are
    nothing (the view changes nothing); any read raises."""

    def __init__(self, manifest: dict[str, Any]):
        units: dict[int, list[int]] = {}
        for u in manifest.get("units") or ():
            acc = units.setdefault(int(u["shard"]), [0, 0])
            acc[0] += int(u.get("rows", 0))
            acc[1] += int(u.get("bytes", 0))
        n = max([int(manifest.get("num_shards") or 0), *(s + 1 for s in units)])
        self._units = [tuple(units.get(s, (0, 0))) for s in range(n)]

    async def unit_stats(self) -> list[tuple[int, int]]:
        return [(r, b) for r, b in self._units]

    async def unit_usage(self) -> list[dict[str, int]]:
        return [{} for _ in self._units]  # where a unit kept its bytes is not saved

    async def delete(self, parts: Any) -> None:
        pass

    async def delete_fields(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        from .errors import CheckpointError

        raise CheckpointError(f"a checkpoint's view reads no row data (asked for {name})")


async def checkpoint_stats(path: str) -> tuple[Stats, dict[str, Any]]:
    """The :class:`Stats` of the queue saved at ``path`` (a checkpoint, or a directory of
    periodic ones), read from its manifest and its controller's state only: no row data
    is read (the storage units' rows and bytes are those the manifest records), nothing
    is written, no filter runs (rows a filter had not judged show as pending). Leases
    open at the save show as a restore brings them back, released; the second value
    describes them as saved: ``{"leases": n, "rows": {task: rows leased}}``."""
    from .checkpoint.client import open_checkpoint
    from .checkpoint.cut import read_state
    from .controller import Controller
    from .service import ControllerService

    directory, manifest = open_checkpoint(path)
    state = await asyncio.to_thread(read_state, directory, manifest["controller"])
    saved = dict(manifest.get("config") or {})
    consumers = saved.get("consumers")
    ctl = Controller(
        capacity=int(saved.get("capacity", 4096)), capacity_bytes=saved.get("capacity_bytes"),
        num_shards=int(manifest.get("num_shards") or saved.get("num_shards", 4)),
        lease_timeout=float(saved.get("lease_timeout", 600.0)),
        max_staleness=saved.get("max_staleness"), max_lead=saved.get("max_lead"),
        consumers=tuple(consumers) if consumers is not None else None)
    leases: dict[str, int] = {}
    for le in state.get("leases") or ():
        leases[le["task"]] = leases.get(le["task"], 0) + len(le["rows"])
    ctl.load_state_dict(state)
    ctl.drain()  # filter jobs to judge again, deletes: nothing is run in a view
    service = ControllerService(ctl, cast(Any, _NoData(manifest)))
    st = await service.stats()
    return st, {"leases": len(state.get("leases") or ()), "rows": leases}


async def _from_checkpoint(args: argparse.Namespace) -> int:
    """One snapshot of a checkpoint directory, read-only, from its metadata alone (see
    :func:`checkpoint_stats`)."""
    st, leases = await checkpoint_stats(args.name)
    snap = snapshot(st, None, time.monotonic())
    snap["checkpoint"] = args.name
    snap["saved_leases"] = leases
    if args.json:
        print(json.dumps(snap, default=str))
    else:
        from rich.console import Console

        Console().print(render(snap, f"{args.name} (checkpoint, read-only)"))
    return 0


async def _run(args: argparse.Namespace) -> int:
    import ray  # (not for a checkpoint directory: see main)

    from .queue import StreamQueue

    if not ray.is_initialized():
        ray.init(address=args.address, namespace=args.namespace, log_to_driver=False,
                 logging_level=logging.ERROR)
    q = StreamQueue.connect(args.name, namespace=args.namespace)
    prev: tuple[float, Stats] | None = None
    if args.once:
        st = await q.stats()
        if args.interval > 0:  # two snapshots, for rates
            prev = (time.monotonic(), st)
            await asyncio.sleep(args.interval)
            st = await q.stats()
        snap = snapshot(st, prev, time.monotonic())
        if args.json:
            print(json.dumps(snap, default=str))
        else:
            from rich.console import Console

            Console().print(render(snap, args.name))
        return 0
    from rich.live import Live

    with Live(auto_refresh=False, screen=False) as live:
        while True:
            st = await q.stats()
            now = time.monotonic()
            live.update(render(snapshot(st, prev, now), args.name), refresh=True)
            prev = (now, st)
            await asyncio.sleep(args.interval)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamrl top",
                                description="A live terminal view of a named Ray queue.")
    p.add_argument("name", help="the queue's name (StreamQueue(transport='ray', name=...)), "
                   "or a checkpoint directory (one snapshot, read-only)")
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    p.add_argument("--namespace", default=None, help="the Ray namespace of the queue")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: print JSON")
    args = p.parse_args(argv)
    checkpoint = os.path.isdir(args.name)  # before anything imports Ray: none needed
    if args.json and not args.once and not checkpoint:
        print("python -m streamrl top: --json prints one snapshot; add --once "
              f"(python -m streamrl top {args.name} --once --json)", file=sys.stderr)
        return 2
    if not args.json:
        try:
            import rich  # noqa: F401
        except ImportError:
            print("python -m streamrl top needs rich: pip install 'streamrl[metrics]' "
                  "(or use --once --json)", file=sys.stderr)
            return 2
    from .errors import CheckpointError

    try:
        return asyncio.run(_from_checkpoint(args) if checkpoint else _run(args))
    except KeyboardInterrupt:
        return 0
    except CheckpointError as e:  # a damaged or newer checkpoint: said plainly
        print(f"python -m streamrl top: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
