"""The controller actor's service: :class:`~streamrl.service.ControllerService` with the
storage units' arena bytes and the bytes clients moved by path in its ``stats``.

Its own module so that a process that only holds the controller actor's handle (which Ray
deserializes by importing :mod:`.controller`) does not load the service and the
controller's state machine."""

from __future__ import annotations

from typing import Any

from ...service import ControllerService
from ...stats import Stats
from .data import RayDataPlane

__all__ = ["ActorService"]


class ActorService(ControllerService):
    """The controller service inside the actor: its ``stats`` also say how much shared
    memory each storage unit's arena holds and how much of it readers still view."""

    data: RayDataPlane

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: bytes the queue's clients moved, per path (see :meth:`add_moved`)
        self.bytes_by_path: dict[str, int] = {}

    def add_moved(self, by_path: dict[str, int]) -> bool:
        """Add bytes some client moved, per path (``stats().bytes_by_path``)."""
        for path, n in by_path.items():
            self.bytes_by_path[path] = self.bytes_by_path.get(path, 0) + int(n)
        return True

    async def stats(self, with_units: bool = True) -> Stats:
        st = await super().stats(with_units)
        st.bytes_by_path = dict(self.bytes_by_path)
        if with_units:
            arenas = await self.data.arena_stats()
            st.unit_shared_bytes = [a.get("size", 0) for a in arenas]
            st.unit_pinned_bytes = [a.get("pinned", 0) for a in arenas]
        return st
