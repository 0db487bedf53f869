"""Checkpoint and restore of a whole queue, orchestrated by the client
(:meth:`streamrl.StreamQueue.checkpoint`, :meth:`streamrl.StreamQueue.restore`).

Writing one (``checkpoint(q, path)``):

1. a temporary directory is made next to ``path`` (``.<name>.tmp-<host>-<pid>-<id>``);
2. the controller takes the cut, starts holding the storage deletes of its rows, and
   writes its state there (:meth:`~streamrl.control.ControlPlane.checkpoint_begin`);
3. every storage unit writes its rows of the cut to files of its own, all at once
   (:meth:`~streamrl.transport.base.DataPlane.checkpoint_write`: threads of this
   process for the embedded transport, the unit actors themselves on Ray);
4. the hold ends (``checkpoint_end``), whatever happened;
5. the manifest is written last, every file and directory is ``fsync``\\ ed, and the
   temporary directory is renamed to ``path`` (an existing checkpoint at ``path`` is
   renamed away first and removed after). A crash before the rename leaves the previous
   checkpoint as it was; a crash between the two renames leaves it under
   ``.<name>.prev-<id>``, where :func:`restore` finds it.

Restoring (``restore(cls, path, ...)``): the manifest is read and checked, the
filters are found, a new queue is made from the saved options with the overrides,
each storage unit reads and checks its files, then the controller loads its state
(leases come back released, writes in flight aborted, filter jobs judged again). A
checkpoint that does not check out raises :class:`~streamrl.errors.CheckpointError` and
the new queue is shut down: nothing partial is ever returned.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import time
import uuid
import weakref
import zlib
from dataclasses import dataclass
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgpack

from .._aio import shielded, to_thread_whole, wait_whole
from ..errors import CheckpointError, InvalidArgument
from .cut import STATE_FILE
from .files import fsync_dir, read_file, write_msgpack
from .refs import resolve_filters

if TYPE_CHECKING:
    from ..queue import StreamQueue

__all__ = ["CheckpointInfo", "checkpoint", "restore", "open_checkpoint", "Periodic",
           "MANIFEST", "FORMAT", "FORMAT_VERSION"]

log = logging.getLogger("streamrl")

#: the manifest of a checkpoint directory, written last
MANIFEST = "manifest.msgpack"
#: the manifest's ``"format"`` and the newest ``"version"`` this streamrl reads
FORMAT = "streamrl.checkpoint"
FORMAT_VERSION = 1
_UNITS = "units"
_PERIODIC = "ckpt-"


@dataclass(frozen=True)
class CheckpointInfo:
    """What :meth:`~streamrl.StreamQueue.checkpoint` wrote.

    Attributes:
        path: the checkpoint directory.
        rows: rows saved.
        bytes: bytes of the files written (data, metadata and state).
        files: files written.
        seconds: how long the checkpoint took.
        pause: seconds the controller spent taking the cut, when no other queue call
            ran (what producers and consumers may notice).
        policy_version: the policy version at the cut.
    """

    path: str
    rows: int
    bytes: int
    files: int
    seconds: float
    pause: float
    policy_version: int


# ------------------------------------------------------------------ manifest


def _write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    body = dict(manifest)
    body["crc32"] = 0
    body["crc32"] = zlib.crc32(msgpack.packb(body, use_bin_type=True))
    write_msgpack(os.path.join(directory, MANIFEST), body)


def _read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    data = read_file(path, None, "the checkpoint's manifest")
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"the manifest {path} is not readable msgpack ({e}); the "
                              "checkpoint is damaged") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not the manifest of a streamrl checkpoint")
    v = m.get("version")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise CheckpointError(f"the checkpoint {directory} has an unknown format version {v!r}")
    if v > FORMAT_VERSION:
        raise CheckpointError(
            f"the checkpoint {directory} has format version {v}, written by a newer streamrl "
            f"({m.get('streamrl', '?')}); this one ({_version()}) reads up to version "
            f"{FORMAT_VERSION}. Restore it with a streamrl at least as new as the one that "
            "wrote it")
    crc = m.get("crc32")
    body = dict(m)
    body["crc32"] = 0
    if crc != zlib.crc32(msgpack.packb(body, use_bin_type=True)):
        raise CheckpointError(f"the manifest {path} is corrupt (its CRC-32 does not match); "
                              "restore an earlier checkpoint")
    return m


def _version() -> str:
    from .. import __version__

    return __version__


def open_checkpoint(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """The checkpoint directory at ``path`` and its checked manifest.

    ``path`` is a checkpoint (what :meth:`~streamrl.StreamQueue.checkpoint` wrote), or a
    ``checkpoint_dir`` of periodic checkpoints (the newest complete one is taken). If a
    crash interrupted the replacement of a checkpoint at ``path``, the previous one is
    found where the replacement left it.

    Raises:
        CheckpointError: no checkpoint there, or its manifest is damaged or newer.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path, _read_manifest(path)
    if os.path.isdir(path):
        done = sorted(d for d in os.listdir(path) if d.startswith(_PERIODIC)
                      and os.path.isfile(os.path.join(path, d, MANIFEST)))
        if done:
            d = os.path.join(path, done[-1])
            return d, _read_manifest(d)
    parent, name = os.path.split(path)
    if os.path.isdir(parent):
        prev = sorted((os.path.getmtime(os.path.join(parent, d)), d) for d in os.listdir(parent)
                      if d.startswith(f".{name}.prev-")
                      and os.path.isfile(os.path.join(parent, d, MANIFEST)))
        if prev:
            d = os.path.join(parent, prev[-1][1])
            log.warning("streamrl: %s was being replaced by a newer checkpoint when its writer "
                        "stopped; restoring the previous one, left at %s", path, d)
            return d, _read_manifest(d)
    raise CheckpointError(
        f"no checkpoint at {path}: no {MANIFEST} there (a checkpoint whose writer stopped "
        "before the end leaves none), and no periodic checkpoints (ckpt-*) in it")


# ------------------------------------------------------------------ writing


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def _clean_stale(parent: str, name: str) -> None:
    """Remove temporary directories of checkpoints to ``name`` whose writer (a process
    of this host) is gone."""
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    host = _host()
    for d in entries:
        if not d.startswith(f".{name}.tmp-{host}-"):
            continue
        try:  # .<name>.tmp-<host>-<pid>-<id> (the name may hold dashes, the host none)
            pid = int(d[len(f".{name}.tmp-{host}-"):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(parent, d), ignore_errors=True)


def _check_target(path: str) -> bool:
    """Whether ``path`` can take a checkpoint: it does not exist, is an empty
    directory, or holds a checkpoint (replaced). Returns whether it exists."""
    if not os.path.lexists(path):
        return False
    if os.path.isdir(path) and not os.listdir(path):
        return True
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise CheckpointError(
            f"{path} exists and is not a streamrl checkpoint; checkpoint to a new path "
            "(or remove it)")
    return True


def _publish(tmp: str, path: str, nonce: str) -> None:
    """Rename the finished ``tmp`` to ``path``, replacing a checkpoint there."""
    parent, name = os.path.split(path)
    if _check_target(path) and os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
        fsync_dir(parent)
        return
    prev = os.path.join(parent, f".{name}.prev-{nonce}")
    os.rename(path, prev)
    os.rename(tmp, path)
    fsync_dir(parent)
    shutil.rmtree(prev, ignore_errors=True)


def _clean_prev(parent: str, name: str) -> None:
    """Remove checkpoints left aside by replacements that did not finish (the one at
    ``path`` is newer)."""
    for d in os.listdir(parent):
        if d.startswith(f".{name}.prev-"):
            shutil.rmtree(os.path.join(parent, d), ignore_errors=True)


def _plain_config(q: "StreamQueue", summary: dict[str, Any]) -> tuple[dict, list[str]]:
    """The queue's options as plain data, and those that are not (not saved)."""
    cfg = q.config
    if cfg is not None:
        d = cfg.to_dict()
    else:  # a handle of a queue made elsewhere: what the controller knows
        d = dict(summary.get("config") or {})
        d.update(transport=q.transport, name=q.name)
    out: dict[str, Any] = {}
    unsaved: list[str] = []
    for k, v in d.items():
        try:
            out[k] = _plain(v)
        except TypeError:
            unsaved.append(k)
    return out, unsaved


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _plain(x) for k, x in v.items()}
    raise TypeError(type(v).__name__)


async def checkpoint(q: "StreamQueue", path: str | os.PathLike, *,
                     timeout: float | None = None) -> CheckpointInfo:
    """Write a checkpoint of ``q`` to ``path`` (see the module docstring and
    :meth:`streamrl.StreamQueue.checkpoint`)."""
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    if not name:
        raise InvalidArgument(f"checkpoint needs a directory path to write, got {path!r}")
    nonce = uuid.uuid4().hex[:12]
    tmp = os.path.join(parent, f".{name}.tmp-{_host()}-{os.getpid()}-{nonce}")
    units_dir = os.path.join(tmp, _UNITS)

    def prepare() -> None:
        os.makedirs(parent, exist_ok=True)
        _check_target(path)  # (before any work; checked again at the rename)
        _clean_stale(parent, name)
        os.makedirs(units_dir)

    try:
        await to_thread_whole(prepare)
    except BaseException:
        await to_thread_whole(shutil.rmtree, tmp, True)  # (made just now: empty)
        raise
    hold = timeout if timeout is not None else max(600.0, _lease_timeout(q))
    published = False
    try:
        control, data = q.session.control, q.session.data
        cut = await control.checkpoint_begin(tmp, hold)
        try:
            units = await data.checkpoint_write(units_dir, cut.plans, cut.rows)
        finally:
            await shielded(control.checkpoint_end(cut.token))
        config, unsaved = _plain_config(q, cut.summary)
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "id": nonce,
            "streamrl": _version(), "created": time.time(),
            "transport": q.transport, "num_shards": len(units),
            "config": config, "unsaved": unsaved,
            "controller": {"file": STATE_FILE, **cut.state},
            "units": [dict(u, dir=f"{_UNITS}/{u['dir']}") for u in units],
            "filters": cut.filters,
            "summary": {k: v for k, v in cut.summary.items() if k != "config"},
            "pause": cut.pause,
        }

        def finish() -> None:  # file system calls that may take long: not in the loop
            nonlocal published
            _check_visible(tmp, cut, units)
            _write_manifest(tmp, manifest)
            fsync_dir(units_dir)
            fsync_dir(tmp)
            _publish(tmp, path, nonce)
            published = True
            _clean_prev(parent, name)

        # (waited for to its end even when cancelled: the cleanup below must never run
        # beside a rename of tmp into place)
        await to_thread_whole(finish)
    except BaseException:
        if not published:  # once published, the checkpoint stays, cancelled or not
            await to_thread_whole(shutil.rmtree, tmp, True)
        raise
    files = 2 + sum(u["files"] for u in units)
    nbytes = cut.state["bytes"] + sum(u["bytes"] + u["index"]["bytes"] for u in units)
    return CheckpointInfo(path=path, rows=cut.summary.get("rows", 0), bytes=nbytes,
                          files=files, seconds=time.perf_counter() - t0, pause=cut.pause,
                          policy_version=cut.summary.get("policy_version", 0))


def _lease_timeout(q: "StreamQueue") -> float:
    cfg = q.config
    return float(cfg.lease_timeout) if cfg is not None else 600.0


def _check_visible(tmp: str, cut: Any, units: list[dict]) -> None:
    """Every file the controller and the units wrote must be where this process sees
    it: the checkpoint directory must be on a filesystem all of them share."""
    missing = []
    state = os.path.join(tmp, STATE_FILE)
    if not os.path.isfile(state) or os.path.getsize(state) != cut.state["bytes"]:
        missing.append(f"the controller's state ({STATE_FILE})")
    for u in units:
        idx = os.path.join(tmp, _UNITS, u["dir"], "index.msgpack")
        if not os.path.isfile(idx) or os.path.getsize(idx) != u["index"]["bytes"]:
            missing.append(f"storage unit {u['shard']}'s files (written on node "
                           f"{u.get('node') or '?'})")
    if missing:
        raise CheckpointError(
            f"this process does not see {', '.join(missing)} under {tmp}: the actors wrote "
            "them on their own nodes. A checkpoint of a queue spread over several nodes "
            "needs a directory on a filesystem every node mounts at the same path (NFS, "
            "Lustre, ...); see docs/checkpoint.md")


# ------------------------------------------------------------------ restoring


def _config(manifest: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The new queue's options: the saved ones, with the overrides."""
    from ..config import QueueConfig

    saved = dict(manifest["config"])
    fields = set(QueueConfig.fields())
    given = {k: v for k, v in overrides.items() if k in fields}
    options = {k: v for k, v in overrides.items() if k not in fields}
    lacking = [k for k in manifest.get("unsaved", ()) if k not in given]
    if lacking:
        raise CheckpointError(
            f"the checkpoint could not save the queue options {lacking} (not plain data: a "
            f"Sampler or storage object?); pass them to restore: "
            + ", ".join(f"{k}=..." for k in lacking))
    transport = given.get("transport", saved.get("transport", "embedded"))
    if transport != saved.get("transport") and "options" not in given:
        saved["options"] = {}  # the old transport's options mean nothing to the new one
    saved.update(given)
    saved["options"] = {**dict(saved.get("options") or {}), **options}
    for k in ("consumers",):
        if isinstance(saved.get(k), list):
            saved[k] = tuple(saved[k])
    return {k: v for k, v in saved.items() if k in fields}


async def restore(cls: Any, path: str | os.PathLike, *,
                  filters: Mapping[str, Callable] | None = None,
                  **overrides: Any) -> "tuple[StreamQueue, frozenset[str]]":
    """A running queue from the checkpoint at ``path`` (see
    :meth:`streamrl.StreamQueue.restore`), and the tag fields (group keys...) its
    controller knows."""
    directory, manifest = open_checkpoint(path)
    fns = resolve_filters(manifest.get("filters") or {}, filters)
    config = _config(manifest, overrides)
    q = cls.from_config(config)
    try:
        old_n, new_n = int(manifest["num_shards"]), q.num_shards
        shards = None if old_n == new_n else {s: s % new_n for s in range(old_n)}
        sources: dict[int, list[dict]] = {}
        for u in manifest["units"]:
            new = u["shard"] if shards is None else shards[u["shard"]]
            sources.setdefault(new, []).append(dict(u, dir=os.path.basename(u["dir"])))
        await q.session.data.checkpoint_load(os.path.join(directory, _UNITS), sources)
        got = await q.session.control.checkpoint_load(directory, manifest["controller"],
                                                      shards, fns)
        tags = frozenset(got.get("tag_fields", ()))
    except BaseException:
        async def stop() -> None:
            try:
                await q.close()
            except Exception:  # noqa: BLE001 - the error that matters is the one below
                pass
            await q.shutdown()

        await wait_whole(stop())  # (a native cancellation included: nothing half made)
        raise
    return q, tags


# ------------------------------------------------------------------ periodic


class Periodic:
    """Checkpoints of a queue every ``every`` seconds into ``directory/ckpt-NNNNNNNN``,
    keeping the last ``keep`` (a background task of the queue's event loop, from its
    first call on; stopped by ``shutdown``). A failed checkpoint is logged and the next
    one is tried as usual."""

    def __init__(self, queue: "StreamQueue", every: float, directory: str, keep: int):
        self._queue = weakref.ref(queue)
        self.every = every
        self.dir = os.path.abspath(directory)
        self.keep = keep
        self.task: asyncio.Task | None = None
        self.last: CheckpointInfo | None = None
        self.failures = 0

    def start(self) -> bool:
        """Start the task in the running event loop; False when there is none yet."""
        if self.task is not None:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self.task = loop.create_task(self._run(), name="streamrl-periodic-checkpoint")
        return True

    def _seq(self) -> int:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return 0
        seqs = [int(d[len(_PERIODIC):]) for d in names
                if d.startswith(_PERIODIC) and d[len(_PERIODIC):].isdigit()]
        return max(seqs, default=0)

    async def _run(self) -> None:
        seq = self._seq()
        while True:
            await asyncio.sleep(self.every)
            q = self._queue()
            if q is None:
                return
            seq += 1
            try:
                info = await checkpoint(q, os.path.join(self.dir, f"{_PERIODIC}{seq:08d}"))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next one may succeed
                self.failures += 1
                log.exception("streamrl: a periodic checkpoint into %s failed", self.dir)
                continue
            finally:
                del q
            await to_thread_whole(self._prune)
            self.last = info  # (once the older ones are pruned)

    def _prune(self) -> None:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        done = sorted(d for d in names if d.startswith(_PERIODIC)
                      and os.path.isfile(os.path.join(self.dir, d, MANIFEST)))
        for d in done[:-self.keep]:
            shutil.rmtree(os.path.join(self.dir, d), ignore_errors=True)

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - cancelled, or it had failed
                pass
