"""amp-doctor's own tensor work: marking it, counting its host copies, finding tensors.

A leaf module: it imports nothing else from amp-doctor, so every stage of the
flow (hooks, stats, step records, anomaly mode, the scaler mirror) can share
these three things without an import circle.

- :data:`own_ops` marks amp-doctor's own device work, which anomaly mode must
  neither check nor count.
- :func:`count_sync` / :func:`host_syncs` count amp-doctor's device->host copies.
  Every module that copies to the host calls :func:`count_sync` once per copy,
  so the benchmark and the tests can hold the "one sync per recorded step"
  promise against an independent count (``tests/syncs.py``).
- :func:`iter_tensors` and :func:`map_tensors` are the one walker over
  arbitrary module inputs and outputs (tuples, NamedTuples, dicts, HF
  ``ModelOutput``, dataclasses, None, ints).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["own_ops", "count_sync", "host_syncs", "host_scalars", "iter_tensors", "map_tensors",
           "MAX_OUTPUT_DEPTH"]

# How deep the walker looks into nested outputs: deeper structures are rare in
# models and walking them on every call would cost more than they tell.
MAX_OUTPUT_DEPTH = 4

_own = threading.local()


class _OwnOps:
    """``with own_ops:`` marks amp-doctor's own tensor work (stats, the step's host
    copy, the scaler observer), which the dispatch mode must neither check nor count.

    Per thread: a user's thread running the model meanwhile must not have its ops
    taken for ours. On CUDA the backward pass runs on an autograd thread, and
    amp-doctor's gradient hooks enter and leave ``own_ops`` on that same thread.
    """

    @staticmethod
    def active() -> bool:
        return bool(getattr(_own, "depth", 0))

    def __enter__(self) -> None:
        _own.depth = getattr(_own, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _own.depth -= 1


own_ops = _OwnOps()

_SYNCS = [0]


def host_syncs() -> int:
    """How many device->host copies amp-doctor has made (for the benchmark)."""
    return _SYNCS[0]


def count_sync() -> None:
    """Call once for each device->host copy amp-doctor makes (each one syncs on CUDA)."""
    _SYNCS[0] += 1


def host_scalars(tensors: list[torch.Tensor]) -> list[float]:
    """One-element tensors -> floats, in one device->host copy (a sync on CUDA), counted."""
    if not tensors:
        return []
    dev = tensors[0].device
    out: list[float] = torch.stack([t.reshape(()).float().to(dev) for t in tensors]).tolist()
    count_sync()
    return out


def iter_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside an arbitrary module input or output: tuples, dicts, dataclasses, None..."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth >= MAX_OUTPUT_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float)):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from iter_tensors(v, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), depth + 1)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to each tensor in it, keeping container types."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        mapped = [map_tensors(v, fn) for v in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else tuple(mapped)
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, dict):
        # A shallow copy keeps dict subclasses (OrderedDict, HF ModelOutput) as they are.
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = map_tensors(v, fn)
        return out
    return obj
