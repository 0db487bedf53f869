"""Ready-made filters for :meth:`streamrl.StreamQueue.add_filter`.

Each is a callable object that also carries the ``fields`` (and grouping) it needs, so
``await q.add_filter(zero_variance("reward", group_by="uid", group_size=8))`` is enough;
keyword arguments given to ``add_filter`` override them.

Examples:
    >>> f = zero_variance("reward", group_by="uid", group_size=4)
    >>> f.fields, f.group_by, f.group_size
    (('reward',), 'uid', 4)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from .errors import InvalidArgument, SchemaError

__all__ = ["Filter", "zero_variance", "max_length", "predicate"]


class Filter:
    """Base of the ready-made filters: ``fields``, ``group_by``, ``group_size`` and
    ``name`` are what :meth:`~streamrl.StreamQueue.add_filter` uses by default."""

    fields: tuple[str, ...] = ()
    group_by: str | None = None
    group_size: int | None = None
    name: str = "filter"

    def __call__(self, td: TensorDictBase) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def judge_many(self, td: TensorDictBase, sizes: Sequence[int]) -> list[Any] | None:
        """The verdicts on several groups (or batches) of rows at once, if this filter
        can give them cheaper than one call each: ``td`` holds the groups one after the
        other, ``sizes`` their rows; one verdict a group, each what ``self`` would
        return on that group's rows. ``None`` (what this base class returns): judge
        them one by one. The queue calls it when filter work for several groups is
        ready at once (one-row puts combined, a seal); if it raises, the groups are
        judged one by one, so a failure is reported as the call's on its own group."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fields={self.fields}, group_by={self.group_by!r})"


#: reward dtypes that ``Tensor.float()`` converts without rounding
_EXACT_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)


class zero_variance(Filter):
    """Reject GRPO groups with no learning signal: all rewards of the group equal (within
    ``atol``), so every advantage would be zero.

    Args:
        reward: the reward field (one scalar per row).

    Keyword Args:
        group_by: the group-key field (one value per prompt), default ``"uid"``.
        group_size: rollouts per prompt; the group is judged when that many are rewarded
            (``None``: when its partition is sealed).
        atol: rewards closer than this count as equal.
        name: the name counted in ``stats().filtered_by``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> f = zero_variance("reward", group_by="uid", group_size=2)
        >>> f(TensorDict({"reward": torch.tensor([1.0, 1.0])}, batch_size=[2]))  # rejected
        False
        >>> f(TensorDict({"reward": torch.tensor([0.0, 1.0])}, batch_size=[2]))
        True
    """

    def __init__(self, reward: str = "reward", *, group_by: str = "uid",
                 group_size: int | None = None, atol: float = 0.0,
                 name: str = "zero_variance"):
        self.fields = (reward,)
        self.reward = reward
        self.group_by = group_by
        self.group_size = group_size
        self.atol = float(atol)
        self.name = name

    def __call__(self, td: TensorDictBase) -> bool:
        r = td.get(self.reward)
        if not isinstance(r, torch.Tensor) or r.is_nested:
            raise SchemaError(f"zero_variance needs a numeric reward tensor, got {type(r).__name__}")
        if (not self.atol and r.dtype in _EXACT_IN_FLOAT32 and r.device.type == "cpu"
                and 0 < r.numel() == r.shape[0] <= 256):
            # a group's scalar rewards, judged in Python (a tenth of the torch calls'
            # time): the same verdict, since these dtypes convert to float32 exactly and
            # two float32 values differ exactly when their difference is above 0. A NaN
            # reward rejects the group, as the torch way does.
            vals = (r if r.dim() == 1 else r.reshape(-1)).tolist()
            hi = max(vals)
            return hi == hi and hi > min(vals) and all(v == v for v in vals)
        r = r.reshape(r.shape[0], -1).float()
        return bool((r.max(0).values - r.min(0).values).abs().max() > self.atol) if len(r) else False

    def judge_many(self, td: TensorDictBase, sizes: Sequence[int]) -> list[bool] | None:
        """The verdicts on consecutive groups of ``sizes`` rows: for scalar rewards
        that ``__call__`` judges in Python (``atol=0``, a float dtype of at most 32
        bits, on the CPU), read once for all groups and judged as ``__call__`` judges
        each; ``None`` otherwise (judged one by one)."""
        r = td.get(self.reward)
        if (self.atol or not isinstance(r, torch.Tensor) or r.is_nested or not r.dim()
                or r.dtype not in _EXACT_IN_FLOAT32 or r.device.type != "cpu"
                or r.numel() != r.shape[0] or sum(sizes) != r.shape[0]
                or not all(0 < n <= 256 for n in sizes)):
            return None
        vals = (r if r.dim() == 1 else r.reshape(-1)).tolist()
        out = []
        a = 0
        for n in sizes:  # (__call__'s verdict on vals[a:a + n])
            g = vals[a:a + n]
            a += n
            hi = max(g)
            out.append(hi == hi and hi > min(g) and all(v == v for v in g))
        return out


class max_length(Filter):
    """Reject rows longer than ``limit`` (truncated or runaway generations).

    Args:
        field: either a per-row length (a scalar per row) or a per-row sequence (a ragged
            list / jagged nested tensor, or a padded ``[n, L]`` tensor, whose length is
            counted; for padded tensors pass ``pad_value``).
        limit: the longest length kept.

    Keyword Args:
        pad_value: padding value not counted in ``[n, L]`` tensors.
        name: the name counted in ``stats().filtered_by``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> f = max_length("response_ids", 3, pad_value=0)
        >>> ids = torch.tensor([[5, 6, 0, 0], [5, 6, 7, 8]])
        >>> f(TensorDict({"response_ids": ids}, batch_size=[2]))  # a mask of rows kept
        tensor([ True, False])
    """

    def __init__(self, field: str, limit: int, *, pad_value: Any = None, name: str = "max_length"):
        if not isinstance(limit, int) or limit < 0:
            raise InvalidArgument(f"limit must be an int >= 0, got {limit!r}")
        self.fields = (field,)
        self.field = field
        self.limit = limit
        self.pad_value = pad_value
        self.name = name

    def lengths(self, col: Any) -> torch.Tensor:
        """The length of each row of ``col`` (see the class docstring)."""
        if isinstance(col, torch.Tensor):
            if col.is_nested:
                return torch.tensor([t.shape[0] for t in col.unbind()])
            if col.dim() == 1:
                return col
            if col.dim() == 2 and self.pad_value is not None:
                return (col != self.pad_value).sum(1)
            if col.dim() == 2:
                return torch.full((col.shape[0],), col.shape[1])
        return torch.tensor([len(x) for x in col])

    def __call__(self, td: TensorDictBase) -> torch.Tensor:
        col = _column(td, self.field)
        return self.lengths(col) <= self.limit


class predicate(Filter):
    """Keep rows for which ``fn(column)`` is true.

    Args:
        field: the field ``fn`` looks at.
        fn: gets the column (a tensor, or a list for Python objects) and returns a bool
            mask with one entry per row (or one bool for all).

    Keyword Args:
        group_by: judge whole groups keyed by this field (``fn`` then sees one group's
            column).
        group_size: rows per group; the group is judged when that many are ready
            (``None``: when its partition is sealed). Needs ``group_by``.
        name: the name counted in ``stats().filtered_by`` (default
            ``"predicate:<field>"``).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> keep_finished = predicate("finished", lambda col: col)
        >>> keep_finished(TensorDict({"finished": torch.tensor([True, False])}, batch_size=[2]))
        tensor([ True, False])
        >>> keep_short_chats = predicate("chat", lambda chats: [len(c) < 8 for c in chats])
    """

    def __init__(self, field: str, fn: Callable[[Any], Any], *, group_by: str | None = None,
                 group_size: int | None = None, name: str | None = None):
        if not callable(fn):
            raise InvalidArgument(f"predicate needs a callable, got {type(fn).__name__}")
        self.fields = (field,)
        self.field = field
        self.fn = fn
        self.group_by = group_by
        self.group_size = group_size
        self.name = name or f"predicate:{field}"

    def __call__(self, td: TensorDictBase) -> Any:
        col = _column(td, self.field)
        return self.fn(col)


def _column(td: TensorDictBase, field: str) -> Any:
    """A field of the TensorDict a filter gets: the tensor, or a list of Python objects."""
    col = td.get(field)
    if isinstance(col, torch.Tensor):
        return col
    return list(col.tolist()) if hasattr(col, "tolist") else list(col)
