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

import contextlib
import copy
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from amp_doctor.dtypes import FLOAT16, FORMAT_MAX

__all__ = ["own_ops", "OWN_MODE_FLAG", "pop_dispatch_modes", "push_dispatch_modes",
           "as_own_work", "without_subclasses", "user_autocast_enabled", "cast_limit",
           "count_sync", "host_syncs",
           "host_scalars", "iter_tensors", "map_tensors", "MAX_OUTPUT_DEPTH"]

# How deep the walker looks into nested outputs: deeper structures are rare in
# models and walking them on every call would cost more than they tell.
MAX_OUTPUT_DEPTH = 4


class _OwnState(threading.local):
    """:data:`own_ops`'s per-thread state, every field present from a thread's first
    use: a ``getattr`` with a default on a ``threading.local`` that lacks the field
    raises and catches an AttributeError inside, 0.7 us each, and leaving ``own_ops``
    read five (session 62: enter and exit 3.5 us, most of a step boundary's event)."""

    def __init__(self) -> None:
        self.depth = 0
        self.plain: contextlib.AbstractContextManager[None] | None = None
        self.autocast_off: tuple[str, ...] = ()
        self.cpu_default: torch.device | None = None
        self.normal: Any = None
        self.user_modes: list[Any] | None = None


_own = _OwnState()

# Set on amp-doctor's own dispatch mode (anomaly mode's), which :data:`own_ops` leaves
# on the stack while it takes the user's modes off.
OWN_MODE_FLAG = "_amp_doctor_own_mode"


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
    return device_type in _own.autocast_off or torch.is_autocast_enabled(
        device_type)


def cast_limit(device_type: str) -> float:
    """The max of the format the user's autocast casts to on ``device_type`` (float16's),
    or inf: a finite batch value beyond it is inf after the first layer's cast. Two C
    calls, no tensor op."""
    try:
        if user_autocast_enabled(device_type) and \
                torch.get_autocast_dtype(device_type) == torch.float16:
            return FORMAT_MAX[FLOAT16]
    except Exception:  # a device type this torch build does not know
        pass
    return math.inf


def _torch_function_off() -> contextlib.AbstractContextManager[None] | None:
    """The context that keeps the user's ``__torch_function__`` code away from
    amp-doctor's ops, or None when none of it would run.

    With a function mode on the stack, both modes and subclasses are turned off: a
    mode of the user's that logs, counts or refuses ops (``aminmax``, ``empty``) would
    otherwise see amp-doctor's and could fail the user's step in a hook. That also
    takes the user's default device (itself a function mode) away from amp-doctor's
    tensors, so they are made on the CPU. With subclasses only, only they are turned
    off; and nothing is entered when they are off already: ``DisableTorchFunctionSubclass``
    entered under ``DisableTorchFunction`` would turn the modes back on.
    """
    if torch._C._is_torch_function_mode_enabled():
        return torch._C.DisableTorchFunction()
    if torch._C._is_torch_function_enabled():
        return torch._C.DisableTorchFunctionSubclass()
    return None


def pop_dispatch_modes(stop_at: Callable[[Any], bool]) -> list[Any]:
    """Pop the non-infra dispatch modes off the top of this thread's stack, top first, up
    to the first for which ``stop_at`` is true; :func:`push_dispatch_modes` puts them
    back in order. Infra modes (fake or functional tensors while tracing) stay, as do
    the modes below them."""
    popped: list[Any] = []
    while n := torch._C._len_torch_dispatch_stack():
        top = torch._C._get_dispatch_stack_at(n - 1)
        if stop_at(top) or top.is_infra_mode():
            break
        popped.append(torch._C._pop_torch_dispatch_stack(None))
    return popped


def push_dispatch_modes(popped: list[Any]) -> None:
    """Undo :func:`pop_dispatch_modes`."""
    for m in reversed(popped):
        torch._C._push_on_torch_dispatch_stack(m)


def _is_own_mode(mode: Any) -> bool:
    return bool(getattr(mode, OWN_MODE_FLAG, False))


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
    - a ``__torch_function__`` tensor subclass or function mode of the user's (one
      that logs, counts or refuses ops), which would see amp-doctor's ops and, for a
      subclass, make its statistics instances of itself (:func:`_torch_function_off`);
    - the user's ``__torch_dispatch__`` modes (:func:`pop_dispatch_modes`);
    - ``torch.inference_mode``, under which a buffer amp-doctor makes (a step's staging
      buffer, made at the first tensor filed: a teacher's, or a validation's) would be an
      inference tensor, which no later in-place write outside inference mode may touch
      (a RuntimeError in the user's next training forward).

    Per thread: a user's thread running the model meanwhile must not have its ops
    taken for ours. On CUDA the backward pass runs on an autograd thread, and
    amp-doctor's gradient hooks enter and leave ``own_ops`` on that same thread.
    """

    @staticmethod
    def active() -> bool:
        return bool(_own.depth)

    @staticmethod
    def needed_for(t: torch.Tensor) -> bool:
        """Whether reading ``t`` with views, reductions and copies into amp-doctor's own
        buffers needs this guard. Not for a plain tensor while no dispatch mode runs
        (the usual hook on a recorded step; a third of the cost of filing a small
        tensor): no subclass or mode of the user's would see those ops, and no mode
        of amp-doctor's must tell them from the user's. Autocast and the user's
        default device do not reach them: they make no new tensor without naming its
        device, and none is in an autocast list.
        """
        return (type(t) is not torch.Tensor or bool(torch._C._len_torch_dispatch_stack())
                or torch._C._is_torch_function_mode_enabled())

    def __enter__(self) -> None:
        depth = _own.depth
        _own.depth = depth + 1
        if depth:
            return
        plain = _torch_function_off()
        if plain is not None:
            plain.__enter__()
            _own.plain = plain
        if torch._C._is_any_autocast_enabled():
            off = tuple(d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))
            for d in off:
                torch.set_autocast_enabled(d, False)
            _own.autocast_off = off
        if plain is None and _user_default_device():
            cpu = torch.device("cpu")
            cpu.__enter__()
            _own.cpu_default = cpu
        if torch.is_inference_mode_enabled():
            normal = torch.inference_mode(False)
            normal.__enter__()
            _own.normal = normal
        if torch._C._len_torch_dispatch_stack():
            # A mode of the user's (FlopCounterMode, a logging or counting one) would see
            # amp-doctor's ops as the user's: a watched run's FLOP count would include the
            # histograms' mm. Amp-doctor's own anomaly mode stays: it is below every user
            # mode, tells amp-doctor's ops apart by own_ops, and is entered and left
            # inside own_ops, where it must be found on top.
            _own.user_modes = pop_dispatch_modes(_is_own_mode)

    def __exit__(self, *exc: object) -> None:
        _own.depth -= 1
        if _own.depth:
            return
        modes = _own.user_modes
        if modes:
            push_dispatch_modes(modes)
        _own.user_modes = None
        normal = _own.normal
        if normal is not None:
            _own.normal = None
            normal.__exit__(None, None, None)
        cpu = _own.cpu_default
        if cpu is not None:
            _own.cpu_default = None
            cpu.__exit__(None, None, None)
        off = _own.autocast_off
        if off:
            _own.autocast_off = ()
            for d in off:
                torch.set_autocast_enabled(d, True)
        plain = _own.plain
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
    off = _torch_function_off()
    if off is None:
        return fn(*args)
    with off:
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
