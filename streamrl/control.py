"""The control plane: every call a client (or a storage unit) makes to a queue's controller.

:class:`ControlPlane` names each call with typed arguments and results (the dataclasses
and enums of :mod:`streamrl.messages`). :class:`streamrl.service.ControllerService`
implements it in-process; transports that put the controller elsewhere generate their
client proxy and their server side from this class (:data:`CONTROL_METHODS`), so a
changed signature changes every side at once. ``tests/test_seams.py`` fails when an
implementation lacks a method or has another signature.

Every method is a coroutine. None of them moves row data: only metadata (row ids,
field names, sizes, scalar tags, leases) and the small values filters read.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from .checkpoint.cut import CheckpointCut
from .config import Request
from .messages import CommitResult, Delivery, FilterSpec, PutAnswer, WriteToken
from .stats import Stats

__all__ = ["ControlPlane", "CONTROL_METHODS", "CANCELLABLE", "check_implements"]


@runtime_checkable
class ControlPlane(Protocol):
    """The controller service, as clients see it. What each call waits for, raises and
    takes back on cancellation is documented on
    :class:`streamrl.service.ControllerService`, which implements it."""

    # -- writes
    async def allocate(self, partition: str, n: int, fields: Sequence[str], *, nbytes: int = 0,
                       version: int | None = None, timeout: float | None = None,
                       nowait: bool = False, dtypes: dict[str, str] | None = None
                       ) -> WriteToken:
        """Admit ``n`` new rows (waits for room and version pacing)."""
        ...

    async def begin_write(self, rows: Sequence[int], fields: Sequence[str], *,
                          overwrite: bool = False, dtypes: dict[str, str] | None = None
                          ) -> WriteToken:
        """Admit a write of fields to existing rows."""
        ...

    async def commit(self, token: WriteToken, nbytes: Mapping[str, Sequence[int]],
                     tags: Mapping[str, Sequence[Hashable]] | None = None) -> CommitResult:
        """The write's data is stored: mark its fields ready."""
        ...

    async def abort(self, token: WriteToken | int) -> None:
        """Forget a write that failed before its commit."""
        ...

    async def retract(self, token: WriteToken) -> None:
        """Take back a committed write whose writer gave up."""
        ...

    # -- storage units
    async def unit_ids(self, shard: int, n: int) -> tuple[int, int]:
        """Lease ``n`` fresh row ids to storage unit ``shard``."""
        ...

    async def put_rows(self, partition: str, fields: Sequence[str], ids: Sequence[int],
                       shard: int, nbytes: Mapping[str, Sequence[int]],
                       tags: Mapping[str, Sequence[Hashable]] | None = None,
                       version: int | None = None, dtypes: dict[str, str] | None = None
                       ) -> PutAnswer:
        """Admit and commit new rows a unit already stored (no waiting)."""
        ...

    async def put_rows_many(self, puts: Sequence[Sequence[Any]]) -> list[PutAnswer]:
        """:meth:`put_rows` of several puts (each its arguments, in order; a small
        write's are ``None`` then :meth:`write_rows`'s), one answer each."""
        ...

    async def put_rows_wait(self, partition: str, fields: Sequence[str], ids: Sequence[int],
                            shard: int, nbytes: Mapping[str, Sequence[int]],
                            tags: Mapping[str, Sequence[Hashable]] | None = None,
                            version: int | None = None, dtypes: dict[str, str] | None = None
                            ) -> PutAnswer:
        """As :meth:`put_rows`, waiting its turn for room (a full queue)."""
        ...

    async def write_rows(self, rows: Sequence[int], fields: Sequence[str], shard: int,
                         write: int, nbytes: Mapping[str, Sequence[int]],
                         tags: Mapping[str, Sequence[Hashable]] | None = None,
                         dtypes: dict[str, str] | None = None) -> PutAnswer:
        """Admit and commit a write of new fields to rows of one unit, which already
        stored its data as write ``write``."""
        ...

    async def retract_rows(self, rows: Sequence[int]) -> int:
        """Drop new rows whose put was cancelled after it landed."""
        ...

    async def report_lost(self, shard: int) -> None:
        """Storage unit ``shard`` is gone."""
        ...

    async def report_lost_rows(self, rows: Sequence[int], holder: str) -> int:
        """``rows`` are lost with the process that held their tensor fields (RDT)."""
        ...

    # -- reads and leases
    async def take(self, req: Request, timeout: float | None = None) -> Delivery | None:
        """Lease the next batch for ``req`` (``None``: end of stream)."""
        ...

    async def ack(self, lease_ids: Sequence[int]) -> None:
        """Acknowledge leases."""
        ...

    async def ack_take(self, lease_ids: Sequence[int], req: Request,
                       timeout: float | None = None) -> tuple[Delivery | None, str | None]:
        """Acknowledge leases, then lease the next batch: one call (what a stream does
        when the next batch is asked for). Returns the take's answer and the ack's
        :class:`~streamrl.errors.LeaseExpired` message, if it raised one."""
        ...

    async def release(self, lease_ids: Sequence[int]) -> None:
        """Give leases back unacknowledged."""
        ...

    async def lease_rows(self, lease_ids: Sequence[int]) -> list[int]:
        """Rows still held under these leases."""
        ...

    async def ensure_tags(self, fields: Sequence[str], partition: str | None = None) -> None:
        """Make the values of these tag fields known for every row of ``partition``."""
        ...

    # -- lifecycle
    async def drop(self, rows: Sequence[int]) -> int:
        """Drop rows for good."""
        ...

    async def clear(self, partition: str) -> int:
        """Drop every row of a partition."""
        ...

    async def seal(self, partition: str | None) -> None:
        """No new rows in ``partition`` (``None``: anywhere)."""
        ...

    async def declare(self, partition: str, consumers: Sequence[str] | None) -> None:
        """Set the consumers whose acks drop a row of ``partition``."""
        ...

    async def set_version(self, version: int) -> int:
        """Advance the policy version; rows dropped as stale."""
        ...

    async def wait_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until the policy version reaches ``version``."""
        ...

    async def close(self) -> dict[str, int]:
        """Close the queue; rows still held per partition."""
        ...

    async def add_filter(self, fn: Callable, spec: FilterSpec) -> None:
        """Register a filter function."""
        ...

    # -- checkpoints
    async def checkpoint_begin(self, directory: str, timeout: float | None = None
                               ) -> CheckpointCut:
        """Take a checkpoint's cut, write the controller's state under ``directory``;
        hold storage deletes of the cut's rows until ``checkpoint_end``."""
        ...

    async def checkpoint_end(self, token: int) -> None:
        """The units wrote the cut: do the storage deletes held since."""
        ...

    async def checkpoint_load(self, directory: str, state: dict[str, Any],
                              shards: dict[int, int] | None = None,
                              filters: dict[str, Callable] | None = None) -> dict[str, Any]:
        """Load a checkpoint's controller state into this new queue."""
        ...

    # -- introspection
    async def stats(self, with_units: bool = True) -> Stats:
        """A snapshot of counters and holdings."""
        ...

    async def leaked(self) -> dict[str, int]:
        """Leaked rows per sealed partition."""
        ...

    async def audit(self) -> list[str]:
        """Where the controller and the storage units disagree."""
        ...


def _methods(proto: type) -> dict[str, inspect.Signature]:
    out = {}
    for name, fn in vars(proto).items():
        if name.startswith("_") or not inspect.iscoroutinefunction(fn):
            continue
        out[name] = inspect.signature(fn)
    return out


#: Name -> signature of every control-plane call (from :class:`ControlPlane`).
CONTROL_METHODS: dict[str, inspect.Signature] = _methods(ControlPlane)

#: Calls whose effect is taken back if the caller gives up while it waits: a take's
#: lease (an ``ack_take``'s ack stands), an admitted write, a commit, the rows of a
#: ``put_rows_wait``, a checkpoint's hold on deletes (see
#: :meth:`ControllerService.cancel`).
CANCELLABLE = frozenset({"take", "ack_take", "allocate", "begin_write", "commit",
                         "put_rows_wait", "checkpoint_begin"})


def check_implements(cls: type, proto: type = ControlPlane) -> list[str]:
    """How ``cls`` differs from ``proto``: methods it lacks, or has with another
    signature (parameter names, kinds and defaults). Empty when it implements it."""
    problems = []
    for name, sig in _methods(proto).items():
        impl = getattr(cls, name, None)
        if impl is None:
            problems.append(f"{cls.__qualname__} lacks {name}{sig}")
            continue
        if not inspect.iscoroutinefunction(impl):
            problems.append(f"{cls.__qualname__}.{name} is not a coroutine function")
            continue
        got = inspect.signature(impl)
        want = [(p.name, p.kind, p.default) for p in sig.parameters.values()]
        have = [(p.name, p.kind, p.default) for p in got.parameters.values()]
        if want != have:
            problems.append(f"{cls.__qualname__}.{name}{got} is not {name}{sig}")
    return problems


def forwarders(call: Callable[..., Any], proto: type = ControlPlane
               ) -> dict[str, Callable[..., Any]]:
    """Methods that forward each call of ``proto`` (default: the control plane) to
    ``call(self, name, *args, **kwargs)``, with the protocol's own signatures (for
    ``inspect`` and IDEs): what a proxy class is built from, instead of hand-written
    forwarders."""
    out = {}
    methods = CONTROL_METHODS if proto is ControlPlane else _methods(proto)
    for name, sig in methods.items():
        def make(name=name, sig=sig):
            async def method(self, *args, **kwargs):
                return await call(self, name, *args, **kwargs)

            method.__name__ = method.__qualname__ = name
            method.__signature__ = sig  # type: ignore[attr-defined]
            method.__doc__ = getattr(proto, name).__doc__
            return method

        out[name] = make()
    return out
