"""Type names shared by every layer (this module imports nothing heavy: Ray storage-unit
actors use it without torch)."""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Column"]

#: The data of one field for ``n`` rows: a tensor whose first dimension counts rows (a
#: ``torch.Tensor`` in clients, a :class:`streamrl.wire.WireTensor` inside Ray storage
#: units), a jagged nested tensor, or a ``list`` of ``n`` per-row values (Python objects,
#: or tensors of different shapes). See :mod:`streamrl.columns`.
Column: TypeAlias = Any
