"""The samplers TransferQueue users configure, with TransferQueue 0.1.11's protocol.

A sampler picks, for one ``get_meta`` in fetch mode, which ready samples make the batch:
``sample(ready_indexes, batch_size, **kwargs) -> (sampled, consumed)``; the controller
marks ``consumed`` as consumed by the task. ``ready_indexes`` are the global indexes of the
samples whose requested fields are all written and that the task has not consumed, in
index order. The controller also passes ``task_name``, ``partition_id``, ``partition``
(a view with ``get_custom_meta(indexes)`` and ``sequence(indexes)``) and the request's
``sampling_config`` (``dp_rank``, ``batch_index``, ...). Subclass :class:`BaseSampler` for a
policy of your own, as with TransferQueue.

How they map onto streamrl's own options:

==========================  ===============================================================
sampler                     streamrl ``stream``/``get``
==========================  ===============================================================
``SequentialSampler``       the default ``"fifo"`` sampler
``GRPOGroupNSampler(n)``    ``group_by=<prompt key>, group_size=n`` (here the group is the n
                            consecutive samples of the puts, counted from the partition's
                            first sample, see below)
``RankAwareSampler``        one process takes the batch and sends it to its peers
``SeqlenBalancedSampler``   ``dp_size=R, balance_by="total_lengths", group_size=n``; the
                            split is streamrl's own (:func:`streamrl.sampling.balanced_split`)
==========================  ===============================================================

The mapping is one of meaning, not of code, except for the balanced split: these
samplers choose among TransferQueue *samples* in this layer's own controller
(:class:`~.controller.TQController`), which keeps what streamrl's controller does not
(global indexes, consumption marked when metadata is handed out, a cache per ``dp_rank``
and ``batch_index``), while a :class:`streamrl.sampling.Sampler` orders the ready rows of
streamrl's controller for ``stream``/``get``. A TransferQueue sampler sees a list of
global indexes and returns two; a streamrl sampler sees ready units and yields them in
order. Code moving to the native API replaces the sampler by the options in the table.

One fix against TransferQueue: ``GRPOGroupNSampler`` groups samples by their *insertion
sequence* in the partition (sample ``k`` of the partition belongs to group ``k // n``),
not by runs of consecutive global indexes. TransferQueue's scan forms a group from any
``n`` consecutive ready indexes, so when the first sample of a group is late, the rest of
that group and the start of the next are handed out together; and global indexes reused
after ``clear_samples`` are not consecutive at all. Puts of whole groups (TransferQueue's
documented usage) give the same groups either way.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol

from streamrl.errors import InvalidArgument
from streamrl.sampling import balanced_split


__all__ = ["BaseSampler", "SequentialSampler", "GRPOGroupNSampler", "RankAwareSampler",
           "SeqlenBalancedSampler", "PartitionView", "resolve_sampler"]


class PartitionView(Protocol):
    """What a sampler may ask about the partition it samples from (the controller passes
    one as ``partition``)."""

    def get_custom_meta(self, global_indices: Sequence[int]) -> dict[int, dict[str, Any]]:
        """The ``custom_meta`` of those samples that have one."""
        ...

    def sequence(self, global_indices: Sequence[int]) -> list[int | None]:
        """Insertion order of each sample in the partition (``None``: not in it)."""
        ...


class BaseSampler(abc.ABC):
    """A selection policy for fetch-mode ``get_meta`` (see the module docstring).

    ``_states`` caches results per ``partition_id -> task_name -> dp_rank -> batch_index``
    so that every rank of one data-parallel replica asking for the same ``batch_index``
    gets the same samples; :meth:`has_cached_result` lets a polling ``get_meta`` return a
    cached batch even when fewer samples are ready now.
    """

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abc.abstractmethod
    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any,
               **kwargs: Any) -> tuple[list[int], list[int]]:
        """Return ``(sampled, consumed)`` global indexes (``([], [])``: not enough now)."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        return self.sample(*args, **kwargs)

    def has_cached_result(self, partition_id: str, task_name: str,
                          sampling_config: dict[str, Any] | None = None) -> bool:
        """Whether a result for ``(partition_id, task_name, dp_rank, batch_index)`` of
        ``sampling_config`` is cached (always false without a ``dp_rank``)."""
        cfg = sampling_config or {}
        rank = cfg.get("dp_rank")
        if rank is None:
            return False
        by_rank = self._states.get(partition_id, {}).get(task_name, {})
        return rank in by_rank and cfg.get("batch_index") in by_rank[rank]

    def _cache(self, partition_id: str, task_name: str) -> dict[Any, dict[Any, Any]]:
        return self._states.setdefault(partition_id, {}).setdefault(task_name, {})

    def clear_cache(self, partition_id: str) -> None:
        """Forget what was cached for a partition (it was cleared)."""
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict:
        return {"_states": self._states}

    def load_checkpoint(self, state: dict) -> None:
        self._states = state["_states"]


class SequentialSampler(BaseSampler):
    """The first ``batch_size`` ready samples, in global-index order (the default)."""

    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any,
               **kwargs: Any) -> tuple[list[int], list[int]]:
        picked = list(ready_indexes[:batch_size])
        return picked, list(picked)


class RankAwareSampler(BaseSampler):
    """Every caller with the same ``dp_rank`` and ``batch_index`` gets the same samples:
    the first to ask takes the first ``batch_size`` ready samples (or nothing when fewer
    are ready) and the others get that batch from the cache."""

    def sample(self, ready_indexes: list[int], batch_size: int, dp_rank: int = 0,
               batch_index: int = 0, task_name: str = "", partition_id: str = "",
               *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        if dp_rank < 0:
            raise InvalidArgument(f"dp_rank must be >= 0, got {dp_rank}")
        by_rank = self._cache(partition_id, task_name).setdefault(dp_rank, {})
        if batch_index in by_rank:
            picked = by_rank[batch_index]
            return list(picked), list(picked)
        if len(ready_indexes) < batch_size:
            return [], []
        picked = list(ready_indexes[:batch_size])
        by_rank[batch_index] = picked
        return list(picked), list(picked)


class GRPOGroupNSampler(BaseSampler):
    """Whole groups of ``n_samples_per_prompt`` samples only: ``batch_size // n`` groups
    whose every sample is ready, earliest groups first (``batch_size`` must be a multiple
    of ``n``); nothing when not enough groups are complete. See the module docstring for
    what a group is. With a ``dp_rank`` in ``sampling_config`` the result is cached per
    ``(dp_rank, batch_index)``."""

    def __init__(self, n_samples_per_prompt: int = 1):
        super().__init__()
        if not isinstance(n_samples_per_prompt, int) or n_samples_per_prompt <= 0:
            raise InvalidArgument(f"n_samples_per_prompt must be a positive int, got "
                             f"{n_samples_per_prompt!r}")
        self.n_samples_per_prompt = n_samples_per_prompt

    def _groups(self, ready_indexes: list[int], partition: PartitionView | None
                ) -> list[list[int]]:
        """Complete groups among ``ready_indexes``, earliest first."""
        n = self.n_samples_per_prompt
        if partition is not None:
            seq = partition.sequence(ready_indexes)
            by_group: dict[int, list[tuple[int, int]]] = {}
            for idx, s in zip(ready_indexes, seq):
                if s is not None:
                    by_group.setdefault(s // n, []).append((s, idx))
            return [[idx for _, idx in sorted(members)]
                    for _, members in sorted(by_group.items()) if len(members) == n]
        # no partition view (a sampler called on its own): runs of n consecutive indexes
        out: list[list[int]] = []
        run: list[int] = []
        for idx in sorted(ready_indexes):
            run = run + [idx] if run and idx == run[-1] + 1 else [idx]
            if len(run) == n:
                out.append(run)
                run = []
        return out

    def sample(self, ready_indexes: list[int], batch_size: int, task_name: str = "",
               partition_id: str = "", *args: Any, **kwargs: Any
               ) -> tuple[list[int], list[int]]:
        rank, index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        by_rank = self._cache(partition_id, task_name) if rank is not None else {}
        if rank is not None and index in by_rank.get(rank, {}):
            picked = by_rank[rank][index]
            return list(picked), list(picked)
        n = self.n_samples_per_prompt
        if batch_size % n:
            raise InvalidArgument(f"batch_size={batch_size} is not a multiple of "
                             f"n_samples_per_prompt={n}; a batch holds whole groups")
        groups = self._groups(ready_indexes, kwargs.get("partition"))
        if len(groups) < batch_size // n:
            return [], []
        picked = [i for g in groups[:batch_size // n] for i in g]
        if rank is not None:
            by_rank.setdefault(rank, {})[index] = picked
        return list(picked), list(picked)


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """Whole groups for ``dp_size`` ranks at once, balanced by length.

    The first rank asking for ``(partition_id, task_name, batch_index)`` takes
    ``batch_size * dp_size`` samples in whole groups (as :class:`GRPOGroupNSampler`),
    weighs each group by the sum of its samples' ``custom_meta["total_lengths"]``
    (1 when absent), and splits the groups over the ranks with streamrl's own balanced
    split (:func:`streamrl.sampling.balanced_split`, what ``balance_by`` uses): every rank
    the same number of groups (when they do not divide evenly, some ranks get one fewer:
    nothing is repeated), the heaviest rank as light as a longest-first pass and swaps
    make it. Every rank then gets its share from the cache; ``batch_size`` is per rank.
    """

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1):
        super().__init__(n_samples_per_prompt)
        if not isinstance(dp_size, int) or dp_size <= 0:
            raise InvalidArgument(f"dp_size must be a positive int, got {dp_size!r}")
        self.dp_size = dp_size
        self._balanced: dict[tuple, list[list[int]]] = {}

    def sample(self, ready_indexes: list[int], batch_size: int, task_name: str = "",
               partition_id: str = "", *args: Any, **kwargs: Any
               ) -> tuple[list[int], list[int]]:
        rank, index = kwargs.get("dp_rank", 0) or 0, kwargs.get("batch_index", 0)
        key = (partition_id, task_name, index)
        if key not in self._balanced:
            n = self.n_samples_per_prompt
            total = batch_size * self.dp_size
            if total % n:
                raise InvalidArgument(f"batch_size * dp_size = {total} is not a multiple of "
                                 f"n_samples_per_prompt={n}")
            partition = kwargs.get("partition")
            groups = self._groups(ready_indexes, partition)
            if len(groups) < total // n:
                return [], []
            groups = groups[:total // n]
            meta = partition.get_custom_meta([i for g in groups for i in g]) \
                if partition is not None else {}
            weights = [sum(meta.get(i, {}).get("total_lengths", 1) for i in g) for g in groups]
            shares, _ = balanced_split([[g] for g in range(len(groups))], self.dp_size,
                                       weights)  # (its padding of short ranks unused)
            self._balanced[key] = [sorted(i for g in share for i in groups[g])
                                   for share in shares]
            cache = self._cache(partition_id, task_name)
            for r, share in enumerate(self._balanced[key]):
                cache.setdefault(r, {})[index] = share
        shares = self._balanced[key]
        picked = shares[rank] if rank < len(shares) else []
        return list(picked), list(picked)

    def clear_cache(self, partition_id: str) -> None:
        super().clear_cache(partition_id)
        for k in [k for k in self._balanced if k[0] == partition_id]:
            del self._balanced[k]

    def save_checkpoint(self) -> dict:
        return {**super().save_checkpoint(), "_balanced": self._balanced}

    def load_checkpoint(self, state: dict) -> None:
        super().load_checkpoint(state)
        self._balanced = state.get("_balanced", {})


_BY_NAME = {c.__name__: c for c in (SequentialSampler, GRPOGroupNSampler, RankAwareSampler,
                                     SeqlenBalancedSampler)}


def resolve_sampler(spec: Any) -> BaseSampler:
    """A sampler from config: an instance, a subclass of :class:`BaseSampler` (built with
    no arguments) or a class name (``"SequentialSampler"``...).

    Raises:
        ValueError: an unknown name, or something that is not a sampler.
    """
    if isinstance(spec, BaseSampler):
        return spec
    if isinstance(spec, type) and issubclass(spec, BaseSampler):
        return spec()
    if isinstance(spec, str):
        if spec not in _BY_NAME:
            raise InvalidArgument(f"unknown sampler {spec!r}; the samplers are "
                             f"{', '.join(sorted(_BY_NAME))}, or pass a BaseSampler instance")
        return _BY_NAME[spec]()
    # a sampler of the real TransferQueue package: same protocol, use it as it is
    if callable(getattr(spec, "sample", None)):
        return spec
    raise InvalidArgument(f"controller.sampler must be a sampler name, a BaseSampler subclass or "
                     f"an instance, got {spec!r}")
