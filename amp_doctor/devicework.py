"""amp-doctor's own tensor work: marking it, counting its host copies, finding tensors.

A leaf module: it imports nothing else from amp-doctor, so every stage of the
flow (hooks, stats, step records, anomaly mode, the scaler mirror) can share
these three things without an import circle.

- :data:`own_ops` marks amp-doctor's own device work, which anomaly mode must
  neither check nor count, and keeps the user's global state away from it (default
  device, autocast, ``__torch_function__`` subclasses; :func:`as_own_work` for the
  entry points the user calls, :func:`user_autocast_enabled` to read the user's
  autocast from inside it).
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
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

__all__ = ["own_ops", "as_own_work", "without_subclasses", "user_autocast_enabled",
           "count_sync", "host_syncs",
           "host_scalars", "iter_tensors", "map_tensors", "MAX_OUTPUT_DEPTH"]

# How deep the walker looks into nested outputs: deeper structures are rare in
# models and walking them on every call would cost more than they tell.
MAX_OUTPUT_DEPTH = 4

_own = threading.local()


def _user_default_device() -> bool:
    """Whether the user's code made another device than the CPU the default for new
    tensors (``torch.set_default_device("cuda")`` or ``with torch.device(...)``).

    Both push a ``DeviceContext`` function mode: with no function mode at all (one C
    call) there is none, so the usual case costs nothing more. The mode's device is
    read as ``torch.get_default_device()`` finds it, without that function's probe
    tensor (a device allocation on every hook, when the device has no index).
    """
    if not torch._C._len_torch_function_stack():
        return False
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return bool(mode.device.type != "cpu")
    return False


def _autocast_device_types() -> tuple[str, ...]:
    """The device types whose autocast this torch build can report."""
    out = []
    for dev in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia"):
        try:
            torch.is_autocast_enabled(dev)
        except (RuntimeError, ValueError, TypeError):
            continue
        out.append(dev)
    return tuple(out)


_AUTOCAST_DEVICES = _autocast_device_types()


def user_autocast_enabled(device_type: str) -> bool:
    """Whether the user's code has autocast on for ``device_type``, also from inside
    :data:`own_ops` (which turns it off for amp-doctor's own work)."""
    return device_type in getattr(_own, "autocast_off", ()) or torch.is_autocast_enabled(
        device_type)


class _OwnOps:
    """``with own_ops:`` marks amp-doctor's own tensor work (stats, the step's host
    copy, the scaler observer, the session built at close), which the dispatch mode
    must neither check nor count.

    It also keeps the user's default device away from that work: amp-doctor makes its
    host-side tensors without a device argument, and under the user's
    ``torch.set_default_device("cuda")`` they would land on the GPU, to meet host
    tensors there (a device mismatch inside the user's step). On entering, the CPU is
    made the default again, for amp-doctor's work only; tensors made for the user's
    device always name it.

    Two more pieces of the user's state are kept away from it, because a hook or a
    step boundary can run inside the user's forward:
    - autocast, which would recast amp-doctor's tensors and, for ops that promote
      (``stack``, ``cat``), raise on a mix of float16 and bfloat16 statistics (two
      models trained in the two formats, one step boundary inside the second one's
      forward); it is turned off and restored (:func:`user_autocast_enabled` reads
      the user's setting meanwhile);
    - a ``__torch_function__`` tensor subclass of the user's (one that logs, counts or
      refuses ops), which would see amp-doctor's ops on its tensors and make its
      statistics instances of itself.

    Per thread: a user's thread running the model meanwhile must not have its ops
    taken for ours. On CUDA the backward pass runs on an autograd thread, and
    amp-doctor's gradient hooks enter and leave ``own_ops`` on that same thread.
    """

    @staticmethod
    def active() -> bool:
        return bool(getattr(_own, "depth", 0))

    @staticmethod
    def needed_for(t: torch.Tensor) -> bool:
        """Whether reading ``t`` with views, reductions and copies into amp-doctor's own
        buffers needs this guard. Not for a plain tensor while no dispatch mode runs
        (the usual hook on a recorded step; a third of the cost of filing a small
        tensor): no subclass would see those ops, and no mode must tell them from the
        user's. Autocast and the user's default device do not reach them: they make
        no new tensor without naming its device, and none is in an autocast list.
        """
        return type(t) is not torch.Tensor or bool(torch._C._len_torch_dispatch_stack())

    def __enter__(self) -> None:
        depth = getattr(_own, "depth", 0)
        _own.depth = depth + 1
        if depth:
            return
        if torch._C._is_torch_function_enabled():
            # Not when already off: entering it under DisableTorchFunction would turn
            # the function modes (the user's default device) back on.
            plain = torch._C.DisableTorchFunctionSubclass()
            plain.__enter__()
            _own.plain = plain
        if torch._C._is_any_autocast_enabled():
            off = tuple(d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))
            for d in off:
                torch.set_autocast_enabled(d, False)
            _own.autocast_off = off
        if _user_default_device():
            cpu = torch.device("cpu")
            cpu.__enter__()
            _own.cpu_default = cpu

    def __exit__(self, *exc: object) -> None:
        _own.depth -= 1
        if _own.depth:
            return
        cpu = getattr(_own, "cpu_default", None)
        if cpu is not None:
            _own.cpu_default = None
            cpu.__exit__(None, None, None)
        off = getattr(_own, "autocast_off", ())
        if off:
            _own.autocast_off = ()
            for d in off:
                torch.set_autocast_enabled(d, True)
        plain = getattr(_own, "plain", None)
        if plain is not None:
            _own.plain = None
            plain.__exit__(None, None, None)


own_ops = _OwnOps()

_F = TypeVar("_F", bound=Callable[..., Any])
_R = TypeVar("_R")


def without_subclasses(fn: Callable[..., _R], *args: Any) -> _R:
    """``fn(*args)`` where a user's ``__torch_function__`` tensor subclass (one that logs,
    counts or refuses ops) does not see what amp-doctor does with its tensors: for the
    hooks' bookkeeping outside :data:`own_ops`. Nothing to do when it is off already."""
    if not torch._C._is_torch_function_enabled():
        return fn(*args)
    with torch._C.DisableTorchFunctionSubclass():
        return fn(*args)


def as_own_work(fn: _F) -> _F:
    """Run ``fn`` inside :data:`own_ops`: for the entry points the user calls
    (``watch()``, ``close()``...), which make amp-doctor's tensors outside any hook."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with own_ops:
            return fn(*args, **kwargs)

    return cast(_F, wrapper)

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
