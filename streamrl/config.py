"""The options of a queue and of a request, declared once.

:class:`QueueConfig` holds every option of :class:`streamrl.StreamQueue` (the constructor's
parameters are exactly its fields, a test checks it); the controller, the transports and
:meth:`streamrl.StreamQueue.from_config` all take it. :class:`Request` holds every option
of ``get``/``stream`` (their keyword parameters are exactly its fields). Both validate up
front, with messages that name the argument and say what to pass instead.

Examples:
    >>> cfg = QueueConfig.from_mapping({"capacity": 64, "num_shards": 2})
    >>> cfg.capacity, cfg.transport
    (64, 'embedded')
    >>> QueueConfig.from_mapping({"capacty": 64})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    streamrl.errors.InvalidArgument: unknown queue option 'capacty' (did you mean 'capacity'?); valid options: capacity, capacity_bytes, ...
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgument

__all__ = ["QueueConfig", "Request", "check_duration", "check_timeout"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_duration(name: str, v: Any, *, allow_none: bool = True) -> float | None:
    """A duration in seconds: a finite number > 0 (or ``None`` where allowed).

    Raises:
        InvalidArgument: NaN, infinite, zero or negative, or not a number.
    """
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) \
            or math.isinf(v) or v <= 0:
        raise InvalidArgument(
            f"{name} must be a finite number of seconds > 0"
            + (" (or None)" if allow_none else "") + f", got {v!r}")
    return float(v)


def check_timeout(name: str, v: Any) -> float | None:
    """A timeout in seconds: ``None`` (wait for ever), or a finite number >= 0.

    Raises:
        InvalidArgument: NaN, infinite or negative, or not a number.
    """
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) \
            or math.isinf(v) or v < 0:
        raise InvalidArgument(
            f"{name} must be None (wait for ever) or a finite number of seconds >= 0, "
            f"got {v!r}")
    return float(v)


def _check_bound(name: str, v: Any) -> None:
    if v is not None and (not _is_int(v) or v < 0):
        raise InvalidArgument(f"{name} must be an int >= 0 (or None for no bound), got {v!r}")


def _check_name(name: str, v: Any, *, allow_none: bool) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, str) or not v:
        raise InvalidArgument(
            f"{name} must be a non-empty str" + (" or None" if allow_none else "")
            + f", got {v!r}")


def _consumers(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple, set, frozenset)):
        raise InvalidArgument(
            f"consumers must be a list of task names (or None), got {v!r}")
    out = tuple(sorted(set(v)))
    if not out or not all(isinstance(c, str) and c for c in out):
        raise InvalidArgument(
            f"consumers must be a non-empty list of task names (or None), got {v!r}")
    return out


def _unknown(kind: str, bad: str, valid: Sequence[str]) -> InvalidArgument:
    close = difflib.get_close_matches(bad, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return InvalidArgument(
        f"unknown {kind} {bad!r}{hint}; valid options: {', '.join(sorted(valid))}")


@dataclass(frozen=True)
class QueueConfig:
    """Every option of a queue (see :class:`streamrl.StreamQueue` for what each means).

    Args:
        capacity: most rows held at once.
        num_shards: storage units the rows are spread over.

    Keyword Args:
        capacity_bytes: most bytes held at once (``None``: rows bound only).
        transport: a registered transport name (``"embedded"``, ``"ray"``, ...; see
            :func:`streamrl.transport.register`).
        lease_timeout: seconds a delivered batch stays leased without ``ack``.
        max_staleness: drop rows older than ``version - max_staleness`` (``None``: never).
        max_lead: admission pacer on versions (``None``: no pacing).
        consumers: tasks whose acknowledgements drop a row (``None``: no cleanup).
        group_key: a field whose value groups rows (a GRPO prompt's ``uid``), known from
            the start: rows dropped as stale take their group along, whichever stream
            or filter groups by it, or none (``None``: keys are learnt from grouped
            streams and filters).
        name: the queue's name.
        storage: the storage backend of the units: a registered name (``"memory"``,
            ``"spill"``, ...) or a mapping ``{"backend": name, **options}``.
        sampler: how ready rows are picked for a request by default: a registered name
            (``"fifo"``, ``"priority"``, ...) or a mapping ``{"sampler": name, **options}``.
        checkpoint_every: seconds between periodic checkpoints (``None``: none); needs
            ``checkpoint_dir``.
        checkpoint_dir: where periodic checkpoints go (``ckpt-NNNNNNNN`` directories).
        checkpoint_keep: how many periodic checkpoints are kept (the newest).
        metrics: serve Prometheus metrics over HTTP: ``True`` (a free port on 127.0.0.1),
            a port number (on 127.0.0.1), ``"host:port"`` (``"0.0.0.0:9100"`` for other
            machines to scrape), or ``None`` (off). See :mod:`streamrl.metrics`.
        options: transport-specific options. For ``"embedded"``
            (:data:`streamrl.transport.embedded.EMBEDDED_OPTIONS`): ``combine_puts``,
            ``put_linger``. For ``"ray"``
            (:data:`streamrl.transport.ray.RAY_OPTIONS`): ``namespace``,
            ``unit_options``, ``controller_options``, ``detached``, ``direct_calls``,
            ``arena_reserve``, ``arena_ahead``; for ``"rdt"`` also ``rdt_fields`` and
            ``rdt_hold_anywhere`` (``"ray"`` with ``rdt_fields`` is ``"rdt"``).

    Raises:
        InvalidArgument: a value the queue cannot use, named with what to pass instead.
    """

    capacity: int = 4096
    num_shards: int = 4
    capacity_bytes: int | None = None
    transport: str = "embedded"
    lease_timeout: float = 600.0
    max_staleness: int | None = None
    max_lead: int | None = None
    consumers: Sequence[str] | None = None  # (kept as a sorted tuple)
    group_key: str | None = None
    name: str | None = None
    storage: Any = "memory"
    sampler: Any = "fifo"
    checkpoint_every: float | None = None
    checkpoint_dir: str | None = None
    checkpoint_keep: int = 2
    metrics: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _is_int(self.capacity) or self.capacity <= 0:
            raise InvalidArgument(f"capacity must be a positive int of rows, got {self.capacity!r}")
        if self.capacity_bytes is not None and (not _is_int(self.capacity_bytes)
                                                or self.capacity_bytes <= 0):
            raise InvalidArgument(
                f"capacity_bytes must be a positive int or None, got {self.capacity_bytes!r}")
        if not _is_int(self.num_shards) or self.num_shards <= 0:
            raise InvalidArgument(f"num_shards must be a positive int, got {self.num_shards!r}")
        if not isinstance(self.transport, str) or not self.transport:
            raise InvalidArgument(
                f"transport must be the name of a registered transport (e.g. 'embedded' or "
                f"'ray'), got {self.transport!r}")
        object.__setattr__(self, "lease_timeout",
                           check_duration("lease_timeout", self.lease_timeout, allow_none=False))
        _check_bound("max_staleness", self.max_staleness)
        _check_bound("max_lead", self.max_lead)
        object.__setattr__(self, "consumers", _consumers(self.consumers))
        _check_name("group_key", self.group_key, allow_none=True)
        _check_name("name", self.name, allow_none=True)
        _check_sampler(self.sampler, allow_none=False)
        object.__setattr__(self, "checkpoint_every",
                           check_duration("checkpoint_every", self.checkpoint_every))
        if self.checkpoint_dir is not None:
            if hasattr(self.checkpoint_dir, "__fspath__"):
                object.__setattr__(self, "checkpoint_dir", str(self.checkpoint_dir))
            _check_name("checkpoint_dir", self.checkpoint_dir, allow_none=False)
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise InvalidArgument(
                "checkpoint_every needs checkpoint_dir: the directory periodic checkpoints "
                "go to")
        if not _is_int(self.checkpoint_keep) or self.checkpoint_keep < 1:
            raise InvalidArgument(
                f"checkpoint_keep must be an int >= 1 (periodic checkpoints kept), got "
                f"{self.checkpoint_keep!r}")
        from .metrics import parse_spec

        parse_spec(self.metrics)  # raises for a bad spec
        if not isinstance(self.options, Mapping):
            raise InvalidArgument(f"options must be a mapping, got {self.options!r}")
        object.__setattr__(self, "options", dict(self.options))
        from .storage import check_spec  # names and options, here (not in a Ray actor)

        check_spec(self.storage)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None = None, **overrides: Any
                     ) -> "QueueConfig":
        """A config from a plain dict or a YAML/OmegaConf-loaded mapping (nested
        mappings are turned into plain dicts), with ``overrides`` on top. A key that is
        not a queue option raises, naming it and listing the valid ones; transport
        options go under ``options:``.

        Raises:
            InvalidArgument: an unknown key, or a bad value.
        """
        plain = _plain(mapping)
        if plain is not None and not isinstance(plain, Mapping):
            raise InvalidArgument(
                f"a queue config is a mapping of option -> value (a dict, or a YAML/OmegaConf "
                f"config), got {type(mapping).__name__}")
        data = dict(plain or {})
        data.update(overrides)
        valid = cls.fields()
        for k in data:
            if k not in valid:
                err = _unknown("queue option", str(k), valid)
                if isinstance(data.get("transport"), str) and data["transport"] != "embedded":
                    err = InvalidArgument(f"{err}; {data['transport']!r} transport options "
                                          "go under 'options:'")
                raise err
        return cls(**data)

    def replace(self, **changes: Any) -> "QueueConfig":
        """A copy with ``changes`` (validated); unknown names raise."""
        for k in changes:
            if k not in self.fields():
                raise _unknown("queue option", k, self.fields())
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The options as a plain dict (``from_mapping`` of it gives this config back)."""
        return {f: getattr(self, f) if f != "options" else dict(self.options)
                for f in self.fields()}


def _plain(m: Any) -> Any:
    """A mapping as plain dicts and lists (OmegaConf's DictConfig/ListConfig included)."""
    try:  # OmegaConf, without importing it when it is not used
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:
        pass
    else:
        if isinstance(m, (DictConfig, ListConfig)):
            return OmegaConf.to_container(m, resolve=True)
    if m is None:
        return None
    if isinstance(m, Mapping):
        return {k: _plain(v) for k, v in m.items()}
    if isinstance(m, list):
        return [_plain(v) for v in m]
    return m


#: values of ``dp_remainder``
DP_REMAINDER = ("error", "drop", "pad")


@dataclass(frozen=True)
class Request:
    """What a consumer asks for: ``get``/``stream``'s options (see
    :meth:`streamrl.StreamQueue.stream` for what each means). Validated on creation.

    Raises:
        InvalidArgument: an option that can never be served, named with what to pass.
    """

    task: str
    fields: tuple[str, ...]
    batch_size: int
    partition: str | None = None
    group_by: str | None = None
    group_size: int | None = None
    drop_last: bool = False
    max_staleness: int | None = None
    dp_rank: int = 0
    dp_size: int = 1
    balance_by: str | None = None
    dp_remainder: str = "error"
    lease_timeout: float | None = None
    sampler: Any = None

    def __post_init__(self) -> None:
        fields = self.fields
        if isinstance(fields, str):
            fields = (fields,)
        try:
            fields = tuple(fields)
        except TypeError:
            raise InvalidArgument(
                f"fields must be a list of field names, got {self.fields!r}") from None
        object.__setattr__(self, "fields", fields)
        validate_request(self)

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The option names (every field but ``task``, ``fields`` and ``batch_size``)."""
        return tuple(f.name for f in dataclasses.fields(cls))[3:]

    def sub_key(self) -> tuple:
        """The subscription this request belongs to (requests differing only in batch
        size, timeouts, DP options or sampler share one)."""
        return (self.task, frozenset(self.fields), self.partition, self.group_by, self.group_size)


def validate_request(req: Request) -> None:
    """Raise :class:`InvalidArgument` for a request that can never be served."""
    _check_name("task", req.task, allow_none=False)
    if not req.fields or not all(isinstance(f, str) and f for f in req.fields):
        raise InvalidArgument(
            f"fields must be a non-empty list of field names, got {list(req.fields)!r}")
    if not _is_int(req.batch_size) or req.batch_size <= 0:
        raise InvalidArgument(f"batch_size must be a positive int, got {req.batch_size!r}")
    _check_name("partition", req.partition, allow_none=True)
    _check_name("group_by", req.group_by, allow_none=True)
    _check_name("balance_by", req.balance_by, allow_none=True)
    if req.group_size is not None:
        if req.group_by is None:
            raise InvalidArgument("group_size needs group_by (the field whose value groups rows)")
        if not _is_int(req.group_size) or req.group_size <= 0:
            raise InvalidArgument(f"group_size must be a positive int, got {req.group_size!r}")
        if req.batch_size % req.group_size:
            raise InvalidArgument(
                f"group_size={req.group_size} does not divide batch_size={req.batch_size}; "
                "a batch holds whole groups, so pick a batch_size that is a multiple of it")
    if not isinstance(req.drop_last, bool):
        raise InvalidArgument(f"drop_last must be True or False, got {req.drop_last!r}")
    _check_bound("max_staleness", req.max_staleness)
    if not _is_int(req.dp_size) or req.dp_size <= 0:
        raise InvalidArgument(f"dp_size must be a positive int, got {req.dp_size!r}")
    if not _is_int(req.dp_rank) or not 0 <= req.dp_rank < req.dp_size:
        raise InvalidArgument(
            f"dp_rank must be an int in [0, dp_size={req.dp_size}), got {req.dp_rank!r}")
    if req.dp_remainder not in DP_REMAINDER:
        raise InvalidArgument(
            f"dp_remainder must be 'error', 'drop' or 'pad', got {req.dp_remainder!r}")
    check_duration("lease_timeout", req.lease_timeout)
    _check_sampler(req.sampler, allow_none=True)


def _check_sampler(spec: Any, *, allow_none: bool) -> None:
    """A sampler spec must resolve (see :func:`streamrl.sampling.resolve`)."""
    if spec is None and allow_none:
        return
    if spec is None:
        raise InvalidArgument("sampler must be a registered name such as 'fifo', a mapping "
                              "{'sampler': name, **options} or a Sampler, got None")
    from .sampling import resolve

    resolve(spec)  # raises InvalidArgument, naming what there is
