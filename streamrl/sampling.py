"""Sampling: which ready rows a request gets.

When a consumer asks for a batch, the controller knows which rows are *ready* for it
(every asked-for field written, not consumed by its task, not leased, passed the
filters; with ``group_by``, whole complete groups). A :class:`Sampler` decides which of
them make the batch: it puts the ready *units* (single rows, or whole groups when the
request groups rows) in the order they should be taken, and the controller takes units
in that order while they fit the batch. With DP dispatch (``dp_size > 1``) the sampler
also splits the units of a dispatch over the ranks.

A sampler only orders and splits. Everything else stays with the controller: when a
short batch may go out, when a stream has ended, ``drop_last``, leases, staleness.

Built-in samplers (registered by name):

* ``"fifo"`` -- :class:`FifoSampler`, the default: the order rows became ready (for
  groups: the order groups became complete). O(batch) per batch.
* ``"priority"`` -- :class:`PrioritySampler`: highest (or lowest) value of a per-row
  scalar field first, for example the newest policy version or the largest advantage.

A sampler is chosen per queue (``StreamQueue(sampler=...)``) and per request
(``stream(..., sampler=...)``, which overrides the queue's), as a registered name, a
mapping ``{"sampler": name, **options}`` or a :class:`Sampler` instance::

    q = StreamQueue(sampler={"sampler": "priority", "field": "advantage"})
    async for mb in q.stream("train", ["input_ids"], 32, sampler="fifo"): ...

Examples:
    >>> resolve({"sampler": "priority", "field": "advantage"})
    PrioritySampler('advantage', order='desc', reduce='max')
    >>> resolve("fifo") is resolve("fifo")  # one instance serves every request naming it
    True

See ``docs/sampling.md`` for a recipe to write your own.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ._registry import Registry
from .errors import InvalidArgument

__all__ = ["Sampler", "BalancedSampler", "FifoSampler", "PrioritySampler", "Ready", "VERSION",
           "register", "unregister", "available", "resolve", "balanced_split", "deal",
           "imbalance", "ENTRY_POINT_GROUP"]

#: The entry-point group third-party samplers register under.
ENTRY_POINT_GROUP = "streamrl.samplers"

#: The name by which a sampler reads a row's policy version (stamped by ``put``) instead of
#: a field: ``PrioritySampler(VERSION)`` takes the newest rows first.
VERSION = "@version"

Unit = Sequence[int]


class Ready:
    """The rows a request could take now, as a sampler sees them: read-only, and valid
    only during the :meth:`Sampler.order` call it is passed to.

    Attributes:
        group_by: the request's group field (``None``: rows are taken one by one).
        group_size: the request's group size (``None``: whole groups of any size).
    """

    __slots__ = ("_units", "_rows", "group_by", "group_size")

    def __init__(self, units: Callable[[], Iterator[list[int]]], rows: Mapping[int, Any], *,
                 group_by: str | None = None, group_size: int | None = None):
        self._units = units
        self._rows = rows
        self.group_by = group_by
        self.group_size = group_size

    @property
    def grouped(self) -> bool:
        """Whether units are groups (the request has ``group_by``)."""
        return self.group_by is not None

    def units(self) -> Iterator[list[int]]:
        """The ready units in the order they became ready: one ``[row]`` per ready row,
        or, for a grouped request, the rows of each complete group (at most
        ``group_size`` of them), groups in the order they became complete. Lazy: a
        sampler that needs only the first few pays only for those."""
        return self._units()

    def value(self, row: int, field: str, default: Any = None) -> Any:
        """The scalar value of ``field`` of ``row`` (a field the sampler lists in
        :attr:`Sampler.fields`, or :data:`VERSION`), or ``default`` if the row has none
        yet (the field is written after the row became ready)."""
        r = self._rows[row]
        if field == VERSION:
            return r.version
        return r.tags.get(field, default)

    def version(self, row: int) -> int:
        """The policy version of ``row`` (stamped by the ``put`` that created it)."""
        return self._rows[row].version


class Sampler:
    """Decides which ready rows make a batch (the base class of every sampler).

    Implement :meth:`order`. A sampler is shared by every request that names it and
    used from the controller's event loop, so it should hold no per-request state. On
    the Ray transport it runs in the controller actor: pass an instance (its class must
    be importable there) or register it in a module that process imports (or through the
    ``streamrl.samplers`` entry-point group).

    Attributes:
        fields: per-row scalar fields the sampler reads with :meth:`Ready.value`. The
            queue keeps their values as tags (reading the values of rows written before
            the field was needed), like ``group_by`` and ``balance_by`` fields.
        balances: whether :meth:`split` balances ranks on the request's ``balance_by``
            weights (a request with ``balance_by`` and ``dp_size > 1`` needs it).
    """

    fields: tuple[str, ...] = ()
    balances: bool = False

    def order(self, ready: Ready, size: int) -> Iterable[Unit]:
        """The units the next batch should take, best first.

        Args:
            ready: the ready units and their rows' values.
            size: the rows the batch has room for. Yield at least enough units to fill
                it when there are that many; more is fine (they are not taken).

        Returns:
            Units of ``ready.units()`` (each one whole: a row, or a group's rows), in
            the order they should be taken. The controller takes each unit that still
            fits the batch; it may stop iterating once the batch is full.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement order(ready, size)")

    def split(self, units: list[list[int]], ranks: int, weights: list[float]
              ) -> tuple[list[list[int]], list[list[int]]]:
        """Split the units of one DP dispatch over ``ranks`` ranks, the same number of
        units each (see :func:`deal`, the default: round robin in :meth:`order`'s order).

        Args:
            units: the dispatch's units, in the order :meth:`order` gave them.
            ranks: the request's ``dp_size``.
            weights: per unit, the total of its rows' ``balance_by`` values (its row
                count without ``balance_by``).

        Returns:
            ``(shares, pads)``: per rank, the rows of its units, and the rows it repeats
            to reach the others' unit count (only when ``len(units)`` is not a multiple
            of ``ranks``, with ``dp_remainder="pad"``). Every unit must be in exactly one
            share.
        """
        return deal(units, ranks)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class BalancedSampler(Sampler):
    """A sampler whose DP split balances ranks: the base of the built-in samplers, and
    the one to derive from to keep ``balance_by`` working (see :func:`balanced_split`)."""

    balances = True

    def split(self, units: list[list[int]], ranks: int, weights: list[float]
              ) -> tuple[list[list[int]], list[list[int]]]:
        """Equal-count shares with the total weight balanced (:func:`balanced_split`)."""
        return balanced_split(units, ranks, weights)


class FifoSampler(BalancedSampler):
    """Rows in the order they became ready (commit order; a row given back goes last);
    groups in the order they became complete. O(batch) per batch. The default.

    Examples:
        >>> FifoSampler()
        FifoSampler()
    """

    def order(self, ready: Ready, size: int) -> Iterable[Unit]:
        """The ready units as they are."""
        return ready.units()


_REDUCE: dict[str, Callable[[list[float]], float]] = {
    "max": max, "min": min, "mean": lambda xs: sum(xs) / len(xs), "sum": sum}


class PrioritySampler(BalancedSampler):
    """Rows with the highest (``order="desc"``) or lowest (``"asc"``) value of a per-row
    scalar field first; ties, and rows without a value, in ready order (rows without a
    value after every row with one).

    Args:
        field: a numeric per-row field (``"advantage"``, ``"length"``), or
            :data:`VERSION` for the row's policy version (newest first with ``"desc"``).
            A row is ready without it unless the request lists it in ``fields``.

    Keyword Args:
        order: ``"desc"`` (highest first, the default) or ``"asc"``.
        reduce: how a group's priority comes from its rows' values, for requests with
            ``group_by`` (groups are always taken whole): ``"max"`` (the default),
            ``"min"``, ``"mean"`` or ``"sum"`` of the values its rows have.

    Cost: O(ready rows * log batch) per batch without groups, O(groups * log groups)
    with them (FIFO is O(batch)).

    Raises:
        InvalidArgument: a bad option; at a take, a value that is not a number.

    Examples:
        >>> PrioritySampler("advantage")
        PrioritySampler('advantage', order='desc', reduce='max')
        >>> PrioritySampler(VERSION, order="asc").fields  # no tag needed for versions
        ()
    """

    def __init__(self, field: str, *, order: str = "desc", reduce: str = "max"):
        if not isinstance(field, str) or not field:
            raise InvalidArgument(
                f"PrioritySampler needs the name of a numeric per-row field (or "
                f"streamrl.sampling.VERSION), got {field!r}")
        if order not in ("desc", "asc"):
            raise InvalidArgument(f"PrioritySampler order must be 'desc' or 'asc', got {order!r}")
        if reduce not in _REDUCE:
            raise InvalidArgument(
                f"PrioritySampler reduce must be one of {sorted(_REDUCE)}, got {reduce!r}")
        self.field = field
        self.direction = order
        self.reduce = reduce
        self.fields = () if field == VERSION else (field,)
        self._sign = -1.0 if order == "desc" else 1.0

    def _num(self, row: int, v: Any) -> float:
        if isinstance(v, (int, float)):  # bools too
            return float(v)
        raise InvalidArgument(
            f"PrioritySampler({self.field!r}): row {row} has {v!r} ({type(v).__name__}); "
            "the priority field must hold one number per row")

    def order(self, ready: Ready, size: int) -> Iterable[Unit]:
        """The ready units sorted by priority (stable: ties keep ready order)."""
        field, sign = self.field, self._sign

        if not ready.grouped:
            def key(unit: list[int]) -> tuple[int, float]:
                v = ready.value(unit[0], field)
                return (1, 0.0) if v is None else (0, sign * self._num(unit[0], v))

            return heapq.nsmallest(size, ready.units(), key=key)  # stable, like sorted
        reduce = _REDUCE[self.reduce]

        def gkey(unit: list[int]) -> tuple[int, float]:
            vals = [self._num(r, v) for r in unit if (v := ready.value(r, field)) is not None]
            return (1, 0.0) if not vals else (0, sign * reduce(vals))

        return sorted(ready.units(), key=gkey)

    def __repr__(self) -> str:
        return f"PrioritySampler({self.field!r}, order={self.direction!r}, reduce={self.reduce!r})"


# ---------------------------------------------------------------------- DP splits


def deal(units: list[list[int]], ranks: int) -> tuple[list[list[int]], list[list[int]]]:
    """Deal ``units`` over ``ranks`` like cards: rank ``r`` gets units ``r``,
    ``r + ranks``, ... (so each rank's share keeps their order). Ranks left one unit
    short are padded with repeats of the first units. Ignores weights."""
    members = [units[r::ranks] for r in range(ranks)]
    per = max((len(m) for m in members), default=0)
    shares = [[row for u in m for row in u] for m in members]
    pads: list[list[int]] = [[] for _ in range(ranks)]
    i = 0
    for r in range(ranks):
        for _ in range(per - len(members[r])):
            pads[r].extend(units[i % len(units)])
            i += 1
    return shares, pads


def balanced_split(units: list[list[int]], R: int, weights: list[float]
                   ) -> tuple[list[list[int]], list[list[int]]]:
    """Split ``units`` (groups of rows) over ``R`` ranks, every rank the same number of
    units, balancing the total weight.

    Greedy longest-processing-time first with a cardinality bound (each unit goes,
    heaviest first, to the lightest rank that still has room), then pairwise swaps between
    the heaviest and the lightest rank while a swap narrows their gap. When ``len(units)``
    is not a multiple of ``R``, short ranks are padded by repeating units of other ranks
    (returned separately, since those rows are leased by their own share).
    """
    per = math.ceil(len(units) / R) if units else 0
    order = sorted(range(len(units)), key=lambda i: -weights[i])
    load = [0.0] * R
    members: list[list[int]] = [[] for _ in range(R)]
    for i in order:
        r = min((r for r in range(R) if len(members[r]) < per), key=lambda r: (load[r], len(members[r])))
        members[r].append(i)
        load[r] += weights[i]
    for _ in range(4 * len(units)):
        h = max(range(R), key=load.__getitem__)
        lo = min(range(R), key=load.__getitem__)
        gap = load[h] - load[lo]
        best, pick = gap, None
        for a in members[h]:
            for b in members[lo]:
                d = weights[a] - weights[b]
                if 0 < d < gap and abs(gap - 2 * d) < best:
                    best, pick = abs(gap - 2 * d), (a, b)
        if pick is None:
            break
        a, b = pick
        members[h].remove(a)
        members[lo].remove(b)
        members[h].append(b)
        members[lo].append(a)
        d = weights[a] - weights[b]
        load[h] -= d
        load[lo] += d
    shares = [[r for i in m for r in units[i]] for m in members]
    pads: list[list[int]] = [[] for _ in range(R)]
    donors = deque(order)  # (heaviest first, taken in turn by the short ranks)
    for r in range(R):
        need = per - len(members[r])
        mine = set(members[r])
        while need > 0:
            for _ in range(len(donors)):  # the next unit of another rank
                i = donors.popleft()
                donors.append(i)
                if i not in mine:
                    break
            pads[r].extend(units[i])
            need -= 1
    return shares, pads


def imbalance(loads: Sequence[float]) -> float:
    """(max - min) / mean of per-rank loads: 0 is perfect balance."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return (max(loads) - min(loads)) / mean if mean else 0.0


# ---------------------------------------------------------------------- registry

Factory = Callable[..., Sampler]

_BUILTIN: dict[str, Factory | str] = {"fifo": FifoSampler, "priority": PrioritySampler}
_cache: dict[Hashable, Sampler] = {}
_REG: Registry[Factory] = Registry("sampler", ENTRY_POINT_GROUP, _BUILTIN,
                                   "**options -> Sampler", on_change=_cache.clear)


def register(name: str, factory: Factory | str, *, replace: bool = False) -> None:
    """Make ``sampler=name`` (and ``{"sampler": name, **options}``) build a sampler with
    ``factory(**options)``.

    Args:
        name: the sampler's name.
        factory: a :class:`Sampler` subclass or any callable taking the spec's options
            as keyword arguments and returning a :class:`Sampler`, or
            ``"module:attribute"`` naming one (imported on first use).

    Keyword Args:
        replace: allow replacing a registered sampler of that name.

    Raises:
        InvalidArgument: a bad name or factory, or the name is taken (without ``replace``).

    Examples:
        >>> register("newest", lambda: PrioritySampler(VERSION))  # newest version first
        >>> resolve("newest")
        PrioritySampler('@version', order='desc', reduce='max')
        >>> unregister("newest")
    """
    _REG.register(name, factory, replace=replace)


def unregister(name: str) -> None:
    """Forget a registered sampler (built-ins come back with their default)."""
    _REG.unregister(name)


def available() -> list[str]:
    """The names of the registered samplers (entry points included)."""
    return _REG.available()


def resolve(spec: Any) -> Sampler:
    """The sampler a spec names: ``None`` or ``"fifo"`` (the default), another registered
    name, a mapping ``{"sampler": name, **options}``, or a :class:`Sampler` instance
    (returned as it is). Samplers made from names are made once per spec and shared.

    Raises:
        InvalidArgument: an unknown name (the message lists those there are), a mapping
            without ``"sampler"``, options the sampler refuses, or another type.
    """
    if isinstance(spec, Sampler):
        return spec
    if spec is None:
        spec = "fifo"
    if isinstance(spec, str):
        name, options = spec, {}
    elif isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("sampler", None)
        if not isinstance(name, str) or not name:
            raise InvalidArgument(
                f"a sampler mapping needs 'sampler': <registered name>, got {dict(spec)!r}; "
                f"registered samplers: {', '.join(available())}")
    else:
        raise InvalidArgument(
            f"sampler must be a registered name, a mapping {{'sampler': name, **options}} "
            f"or a streamrl.sampling.Sampler, got {type(spec).__name__} {spec!r}")
    try:
        key: Hashable = (name, frozenset(options.items()))
        hash(key)
    except TypeError:  # unhashable options: made anew each time
        key = None
    if key is not None and key in _cache:
        return _cache[key]
    sampler = _make(name, options)
    if key is not None:
        _cache[key] = sampler
    return sampler


def _make(name: str, options: dict[str, Any]) -> Sampler:
    f = _REG.get(name)
    if f is None:
        raise InvalidArgument(
            f"unknown sampler {name!r}; registered samplers: {', '.join(available())}. "
            "Register yours with streamrl.sampling.register(name, factory) (in every process "
            "that resolves it: on Ray, the controller's) or the "
            f"{ENTRY_POINT_GROUP!r} entry-point group, or pass a Sampler instance")
    try:
        sampler = f(**options)
    except TypeError as e:
        raise InvalidArgument(f"sampler {name!r} does not take options {options!r}: {e}") from e
    if not isinstance(sampler, Sampler):
        raise InvalidArgument(
            f"the factory of sampler {name!r} returned {type(sampler).__name__}, not a "
            "streamrl.sampling.Sampler")
    return sampler
