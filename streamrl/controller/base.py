"""The common base of the controller's parts: what each part (mixin) sees of the others.

:class:`Controller` is one object over one state, written in parts (:mod:`.admission`,
:mod:`.lifecycle`, ...) that read the same attributes and call each other's methods.
Each part derives from :class:`ControllerBase`, so that it type-checks on its own:

* the attributes are declared with their types, the source of truth on :class:`.State`
  (which sets them), and here the derived structures :meth:`Index._init_index` creates;
* the methods one part calls on another are declared here, under ``TYPE_CHECKING``, with
  the signatures of their implementations. The type checker checks every implementation
  against its declaration as an override (an incompatible one is an error), so the two
  cannot drift apart; and the declarations are abstract, so that a declared method no
  part implements is an error too (:class:`Controller` is ``@final``: a final class may
  not leave a method abstract). Add a declaration when a part starts calling another
  part's method.

None of this exists at run time: class annotations create no attributes and the
declarations are not defined, so no lookup on the hot paths changes.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Collection, Hashable, Iterable, KeysView, Mapping, Sequence
from typing import TYPE_CHECKING

from .state import State

if TYPE_CHECKING:
    from ..config import Request
    from ..messages import Delivery, FilterSpec, Undo, WriteToken
    from ..sampling import Sampler
    from .dispatch import _Dispatcher
    from .index import _Sub
    from .leases import _Lease
    from .state import Partition, Row


class ControllerBase(State):
    """The attributes and cross-part methods every part of :class:`Controller` uses."""

    # derived structures, created by Index._init_index and rebuilt on load (never saved)
    subs: dict[tuple, _Sub]  # request shape -> its subscription
    _subs_by_part: dict[str | None, list[_Sub]]
    _subs_by_task: dict[str, list[_Sub]]
    _cands: dict[str, list[_Sub]]  # partition -> subscriptions that see it
    # filter name -> (partition, key) -> rows that have the filter's fields, unjudged
    _filter_ready: dict[str, dict[tuple, dict[int, None]]]
    _lease_heap: list[tuple[float, int]]  # (deadline, lease id)
    _token_heap: list[tuple[float, int]]  # (deadline, token id)
    _dispatchers: dict[tuple, _Dispatcher]  # DP dispatch progress (see .dispatch)
    _wmasks: dict[tuple[str, ...], int]  # fields -> their bits in Row.writing (a cache)
    # tag field -> rows that hold it committed and whose value is being read (see
    # Groups._key_unsettled)
    _tag_reads: dict[str, set[int]]
    # sealed (or closed-queue) partitions with a short group held back while a member
    # may still come, looked at again when a write or a tag read ends
    _short_held: set[str]
    # (partition, tag field) -> whether a member may still come (see _key_unsettled),
    # valid while _unsettled_stamp is the controller's current one
    _unsettled: dict[tuple[str, str], bool]
    _unsettled_stamp: tuple[int, int, int]
    _tag_epoch: int  # counts changes of _tag_reads
    # row -> leases (DP shares) that repeat it as padding; such a row is not dropped as
    # consumed until they end (see Leases._pin)
    _pins: dict[int, int]

    if TYPE_CHECKING:
        # .admission
        @abstractmethod
        def abort(self, token: int | WriteToken) -> Undo | None: ...
        @abstractmethod
        def _track(self, tok: WriteToken) -> None: ...
        @abstractmethod
        def _wmask(self, fields: Iterable[str]) -> int: ...

        # .lifecycle
        @abstractmethod
        def _drop_rows(self, objs: list[Row], reason: str | None, *,
                       group: bool = False) -> None: ...
        @abstractmethod
        def _drop_stale(self, sub: _Sub, k: int) -> None: ...

        # .index
        @abstractmethod
        def _init_index(self) -> None: ...
        @abstractmethod
        def validate_request(self, req: Request) -> None: ...
        @abstractmethod
        def _sub(self, req: Request) -> _Sub: ...
        @abstractmethod
        def _new_sub(self, key: tuple) -> _Sub: ...
        @abstractmethod
        def _gating(self, fields: frozenset[str]) -> int: ...
        @abstractmethod
        def _eligible(self, row: Row, sub: _Sub) -> bool: ...
        @abstractmethod
        def _add(self, sub: _Sub, row: Row) -> None: ...
        @abstractmethod
        def _reindex(self, rows: Iterable[Row], tasks: Iterable[str] | None = None) -> None: ...
        @abstractmethod
        def _index_new(self, p: Partition, ids: list[int], fields: KeysView[str],
                       tags: Mapping[str, Sequence[Hashable]] | None = None) -> None: ...
        @abstractmethod
        def _unindex(self, row: Row, tasks: Iterable[str] | None = None) -> None: ...
        @abstractmethod
        def _remove(self, sub: _Sub, row: Row) -> None: ...
        def _remove_many(self, sub: _Sub, rows: list[Row]) -> None: ...
        @abstractmethod
        def _candidates(self, name: str) -> list[_Sub]: ...
        @abstractmethod
        def _wake_part(self, name: str) -> None: ...
        @abstractmethod
        def _wake_groups(self, name: str, left: Collection[tuple[str, Hashable]]) -> None: ...
        @abstractmethod
        def _check_complete(self, sub: _Sub, gk: tuple) -> None: ...

        # .leases
        @abstractmethod
        def _lease(self, sub: _Sub, req: Request, rids: list[int], *, claimed: bool = True,
                   rank: int = 0, dispatch: int | None = None) -> Delivery: ...
        @abstractmethod
        def _claim(self, lease: _Lease, objs: list[Row] | None = None) -> int: ...
        @abstractmethod
        def release(self, lease_ids: Iterable[int], *, expired: bool = False) -> None: ...
        @abstractmethod
        def expire(self, now: float | None = None) -> int: ...
        @abstractmethod
        def _pin(self, lease: _Lease, pads: list[int]) -> None: ...
        @abstractmethod
        def _unpin(self, lease: _Lease) -> None: ...
        @abstractmethod
        def _withdraw_pads(self, rids: Iterable[int], fields: set[str]) -> None: ...
        @abstractmethod
        def _unpad(self, gone: list[int]) -> None: ...
        @abstractmethod
        def _consumed(self, row: Row) -> bool: ...

        # .groups
        @abstractmethod
        def _set_tag(self, row: Row, f: str, v: Hashable) -> None: ...
        @staticmethod
        @abstractmethod
        def _ungroup(row: Row, f: str, v: Hashable) -> None: ...
        @abstractmethod
        def _filter_check(self, rows: list[Row], only: FilterSpec | None = None) -> None: ...
        @abstractmethod
        def _maybe_filter_job(self, spec: FilterSpec, p: Partition, gkey: Hashable,
                              key: tuple | None = None) -> None: ...
        @abstractmethod
        def _unjudge(self, rids: set[int], fmask: int) -> None: ...
        @abstractmethod
        def _none_coming(self, p: Partition, f: str) -> bool: ...
        @abstractmethod
        def _recheck_short(self) -> None: ...
        @abstractmethod
        def _reading_tags(self, f: str, rows: Iterable[int]) -> None: ...

        # .dispatch
        @abstractmethod
        def _sampler_of(self, req: Request) -> Sampler: ...
        @abstractmethod
        def _delivery(self, lid: int, req: Request, sub: _Sub, rids: list[int], rank: int = 0,
                      dispatch: int | None = None, nbytes: int | None = None,
                      pads: Sequence[int] = (), objs: list[Row] | None = None
                      ) -> Delivery: ...
