"""Which tensors a step has already summarised: an identity map that never keeps one alive.

The probes must know whether an output is a tensor they filed earlier in the
step (a ``Sequential`` returns its last child's output; an in-place op returns
its input with new values). ``torch.utils.weak.WeakIdKeyDictionary`` answers
that, but each insertion builds a Python-level weak reference with a callback:
about 9 us, on every output of every recorded step. A plain dict keyed by
``id`` plus a bare ``weakref.ref`` (which checks that the id still names the same
tensor: ids are reused once a tensor dies) costs a fraction of that. Dead entries
are dropped when the map is cleared at the step boundary, or pruned when it
grows past :data:`PRUNE_AT` in a loop that has none.

A leaf module: it imports nothing else from amp-doctor.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

import torch

__all__ = ["SeenTensors", "PRUNE_AT"]

_V = TypeVar("_V")

# Entries kept before dead ones are pruned (a loop with no step boundary).
PRUNE_AT = 4096


class SeenTensors(Generic[_V]):
    """``tensor -> value`` by identity, for one step; holds no strong reference."""

    def __init__(self) -> None:
        self._map: dict[int, tuple[weakref.ref[torch.Tensor], _V]] = {}

    def get(self, t: torch.Tensor) -> _V | None:
        entry = self._map.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    def __setitem__(self, t: torch.Tensor, value: _V) -> None:
        if len(self._map) >= PRUNE_AT:
            self._map = {k: e for k, e in self._map.items() if e[0]() is not None}
        self._map[id(t)] = (weakref.ref(t), value)

    def __len__(self) -> int:
        return len(self._map)

    def values(self) -> list[_V]:
        """The values of the tensors still alive."""
        return [v for ref, v in self._map.values() if ref() is not None]

    def clear(self) -> None:
        self._map.clear()
