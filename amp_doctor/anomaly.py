"""Anomaly mode: the first op that produced a NaN/Inf, forward or backward.

``torch.autograd.detect_anomaly`` is backward-only, captures a Python
traceback for every autograd node, aborts the run and names a node rather
than a module. A forward hook only sees module outputs, so an op that
overflows *inside* a module whose output stays finite (a cube in a tanh-GELU)
goes unseen until its backward turns NaN.

Two levels, so that a healthy run pays almost nothing:

* **The per-step check** runs on every step, on the device, without a sync:
  one (min, max) reduction of the batch given to each root model, and one
  ``_foreach_norm`` over the watched parameters' gradients at the step
  boundary (NaN/Inf anywhere in forward or backward ends up there). The flags
  ride in the next recorded step's single host copy; a step the GradScaler
  skipped is known on the host at once (the scaler synced for it already).
* **The op-level search** is a private :class:`TorchDispatchMode` that sees
  every aten op after autocast cast its inputs, backward ops included, and
  keeps a (min, max) summary of each floating output. It runs on the first
  step (which also records which aten ops ran in which dtype), then only
  when the per-step check saw a non-finite value: it is *armed for the next
  steps*, up to :data:`MAX_SEARCH_STEPS` of them, until it has named an
  origin. Re-running the failing step instead would need the user's RNG,
  optimizer and data-loader state rolled back, which cannot be done without
  changing the run; so a non-finite value that never comes back is reported
  as seen but not located (``nonfinite_unlocated``). After a search the next
  one waits a cool-down that doubles each time, so a problem that persists on
  every step costs a few searched steps in total, not a slower run.

An op is an *origin* (a producer, not a propagator) when an output is
non-finite while every floating input was finite, and no infinity came in as
a constant (``masked_fill(mask, -inf)``, ``full(..., -inf)``, ``where``):
intentional infinities, and the ``max``/``softmax`` that consume them, are
therefore never reported. The user can allow more ops or modules by name.

Host syncs: none on a healthy unrecorded step; on a recorded step one device
scalar (how many things were flagged) rides along in the step's single host
copy (:meth:`AnomalyMode.flagged_count`). Only an abnormal step, or a
searched step that is not recorded, costs more. In ``on_nonfinite="raise"``
mode every op of every step is checked at once, one sync per op, so that the
exception is raised where the NaN/Inf appears.

Backward ops are mapped to their forward module and op through the autograd
node running them (``torch._C._current_autograd_node()``): each forward op's
node is tagged in its ``metadata`` with the module, the op and the user's
frames. Torch's own anomaly mode is never switched on, and its flags are
never touched.

Left as they are: the user's own dispatch modes (ours is entered *below*
them and removed from wherever it is, so their ``__exit__`` pops their own
mode), other threads (dispatch modes are thread-local; hooks called from a
thread other than the one that opened the watch are ignored), and
``torch.compile``: the mode says ``ignore_compile_internals``, so a compiled
region runs compiled, with the same random numbers, and its inner ops are
not searched.
"""

from __future__ import annotations

import fnmatch
import math
import os
import sys
import sysconfig
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.utils._python_dispatch as _pd
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from .devicework import count_sync, iter_tensors, own_ops
from .dtypes import dtype_name
from .errors import AmpDoctorError, NonFiniteError
from .records import Event

__all__ = [
    "AnomalyMode",
    "MAX_PENDING_ENTRIES",
    "MAX_ORIGINS_PER_CHECK",
    "MAX_USER_FRAMES",
    "MAX_SEARCH_STEPS",
    "FIRST_COOLDOWN_STEPS",
    "LIGHT_WINDOW_STEPS",
]

# Bounded memory between checks: past this many pending op entries the check
# runs early (one extra sync) instead of growing without limit.
MAX_PENDING_ENTRIES = 200_000
# On an abnormal step, report at most this many distinct (kind, module, op) origins.
MAX_ORIGINS_PER_CHECK = 8
# The user's own frames kept per op, innermost first.
MAX_USER_FRAMES = 4
# Events kept per (kind, module, op); later ones are only counted.
MAX_EVENTS_PER_KEY = 50
# An armed op-level search looks at most this many steps for an origin of the
# non-finite values the per-step check saw, then gives up until the next one.
MAX_SEARCH_STEPS = 3
# Steps between the end of one search and the next one; doubled after each
# search, so a problem that persists on every step is searched O(log n) times.
FIRST_COOLDOWN_STEPS = 16
# Unrecorded steps whose per-step flags wait on the device for a recorded
# step's host copy; past this (a long ``every``, or ``max_steps`` reached) they
# are read with a sync of their own, once per this many steps.
LIGHT_WINDOW_STEPS = 64
# Steps listed in a ``nonfinite_unlocated`` event.
MAX_LISTED_STEPS = 50

_TAG = "amp_doctor"
# Ops whose output is garbage or constant by design: never an origin.
_UNINITIALIZED = frozenset({
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.empty_permuted",
})
# In-place ops that overwrite their first argument: its old values are not an input.
_OVERWRITES = frozenset({
    "aten.copy_", "aten.fill_", "aten.zero_", "aten.normal_", "aten.uniform_",
    "aten.bernoulli_", "aten.random_", "aten.exponential_", "aten.set_",
})

_SKIP_DIRS = tuple(
    os.path.dirname(p) + os.sep
    for p in (torch.__file__, __file__)
) + tuple(
    d + os.sep for d in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    if "site-packages" + os.sep + "click" + os.sep in filename:
        return False
    return not filename.startswith(_SKIP_DIRS)


# (min, max) of a tensor: two 0-d device tensors from one aminmax reduction.
_Summary = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class _Entry:
    """One op call (or, in raise mode, one root-model input), waiting for the next check."""

    kind: str  # "forward" | "backward" | "input"
    op: str | None
    module: str | None
    step: int
    dtype: str
    outs: list[int]  # indices into the window's summaries: each floating output
    ins: list[int]  # and each floating input
    frames: tuple[tuple[str, int, str], ...]
    node: str | None = None
    forward_op: str | None = None


@dataclass(slots=True)
class _ModuleCall:
    name: str
    end: int  # index of the first entry after this call
    outs: list[int]


@dataclass
class _Pending:
    """One window of op entries between two checks.

    Each tensor's summary is stored once in ``sums`` and referred to by index, so an
    op's inputs (earlier ops' outputs) cost nothing more to keep, or to check.
    """

    entries: list[_Entry] = field(default_factory=list)
    calls: list[_ModuleCall] = field(default_factory=list)
    sums: list[_Summary] = field(default_factory=list)


@dataclass(slots=True)
class _RootCall:
    """One call of a root model with grad on: its batch's (min, max), on the device."""

    step: int
    module: str
    dtype: str
    frames: tuple[tuple[str, int, str], ...]
    row: torch.Tensor  # [2] float32 (min, max) over the floating inputs


@dataclass
class _Window:
    """Everything checked together: op entries, root calls, per-step gradient flags.

    ``flags`` is one device bool vector over the three, in that order; ``call_rows``
    the root calls' (min, max) rows, fetched with the flags when anything was flagged.
    """

    ops: _Pending
    calls: list[_RootCall]
    grads: list[tuple[int, torch.Tensor]]  # (step, sum of gradient norms)
    flags: torch.Tensor
    op_rows: torch.Tensor | None
    call_rows: torch.Tensor | None
    weights: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class _NonFiniteMode(TorchDispatchMode):
    """Private: hands every aten op to its owner."""

    def __init__(self, owner: AnomalyMode) -> None:
        super().__init__()
        self._owner = owner

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A compiled region runs compiled, not eagerly op by op under this mode: eager
        # dropout draws other random numbers than inductor's, so the losses would change.
        return True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return self._owner._on_op(func, args, kwargs or {})




def _leaves(obj: Any) -> Iterator[Any]:
    # Op arguments are flat, with the odd list (cat, stack, foreach ops).
    for a in obj:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _summarizable(t: torch.Tensor) -> bool:
    return (t.is_floating_point() and t.layout is torch.strided and not t.is_meta
            and t.numel() > 0)


# -- the dispatch stack ------------------------------------------------------------
# ``TorchDispatchMode.__exit__`` pops whatever mode is on top. Entering ours on top
# while a user's mode is active would make the user's ``__exit__`` pop ours and
# leave theirs behind; so ours goes in below the user's modes, and is taken out
# from wherever it is.
def _pop_user_modes_above(mode: TorchDispatchMode | None) -> list[Any]:
    """Pop the non-infra modes above ``mode`` (or all, if None); top first."""
    popped: list[Any] = []
    while True:
        n = torch._C._len_torch_dispatch_stack()
        if n == 0:
            break
        top = torch._C._get_dispatch_stack_at(n - 1)
        if top is mode or top.is_infra_mode():
            break
        popped.append(torch._C._pop_torch_dispatch_stack(None))
    return popped


def _repush(popped: list[Any]) -> None:
    for m in reversed(popped):
        torch._C._push_on_torch_dispatch_stack(m)


def _sync_mode_flags() -> None:
    """torch's "a mode is active" flags, from the stack as it now is.

    Each mode saves and restores them in ``__enter__``/``__exit__`` as if the stack
    only grew and shrank at the top; after taking ours out of the middle they are
    set from what is really there.
    """
    modes = [torch._C._get_dispatch_stack_at(i)
             for i in range(torch._C._len_torch_dispatch_stack())]
    _pd._is_in_torch_dispatch_mode = bool(modes)
    _pd._is_in_non_infra_torch_dispatch_mode = any(not m.is_infra_mode() for m in modes)
    without = any(not m.ignore_compile_internals() for m in modes)
    _pd._is_in_any_mode_without_ignore_compile_internals = without
    _pd.set_is_in_mode_without_ignore_compile_internals(without)


def _enter_below_user_modes(mode: TorchDispatchMode) -> None:
    popped = _pop_user_modes_above(None)
    try:
        mode.__enter__()
    finally:
        _repush(popped)
        if popped:
            _sync_mode_flags()


def _on_stack(mode: TorchDispatchMode) -> bool:
    return any(torch._C._get_dispatch_stack_at(i) is mode
               for i in range(torch._C._len_torch_dispatch_stack()))


def _remove_mode(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off the dispatch stack wherever it is; the others keep their order."""
    if not _on_stack(mode):
        return
    popped = _pop_user_modes_above(mode)
    try:
        n = torch._C._len_torch_dispatch_stack()
        if n and torch._C._get_dispatch_stack_at(n - 1) is mode:
            mode.__exit__(None, None, None)
    finally:
        _repush(popped)
        if popped:
            _sync_mode_flags()


class AnomalyMode:
    """Finds the first op whose output went non-finite from finite inputs.

    Owned by :class:`~amp_doctor.watch.Watch`: ``start``/``stop`` install and
    remove everything; ``check_inputs`` is called at each root-model call and
    ``end_step`` at each step boundary; on a recorded step ``flagged_count``
    goes into the step's host copy and ``resolve`` reads it back.
    """

    def __init__(
        self,
        current_module: Callable[[], str | None],
        step_of: Callable[[], int],
        mode: str = "record",
        allow: Iterable[str] = (),
        module_name: Callable[[nn.Module], str | None] | None = None,
    ) -> None:
        self._current_module = current_module
        self._module_name = module_name
        self._step_of = step_of
        self._raise = mode == "raise"
        self._allow = tuple(allow)
        self._allow_cache: dict[str | None, bool] = {}
        self._mode: _NonFiniteMode | None = None
        self._handle: RemovableHandle | None = None
        self._thread = threading.get_ident()
        # id(tensor) -> (summary, version, weakref): a plain dict is several times cheaper
        # per op than WeakIdKeyDictionary; the weakref guards against a reused id, and
        # the dict is emptied at every step boundary, so it stays small.
        self._cache: dict[int, tuple[_Summary, int, weakref.ref[torch.Tensor], _Pending, int]] = {}
        self._cache_step = -1
        self._pending = _Pending()
        self._to_tag: tuple[list[torch.Tensor], tuple[Any, ...]] | None = None
        self._names: dict[Any, str] = {}
        self._user_code: dict[Any, bool] = {}
        self._op_dtypes: dict[str, dict[str, dict[str, int]]] = {}
        self._events: dict[tuple[str, str | None, str | None], list[Event]] = {}
        self._counts: dict[tuple[str, str | None, str | None], int] = {}
        self._internal_error: str | None = None
        self.checks = 0
        # -- the per-step check
        self._roots: dict[int, weakref.ref[nn.Module]] = {}
        self._params: list[torch.Tensor] | None = None
        self._root_calls: list[_RootCall] = []
        self._grad_flags: list[tuple[int, torch.Tensor]] = []
        self._param_flags: list[tuple[int, torch.Tensor]] = []
        self._weights_bad_at: int | None = None
        self._light_steps = 0  # steps whose flags wait for a host copy
        self._window: _Window | None = None
        # The root model whose forward is running (its own hooks may not see this
        # call: the CLI discovers a model in its first call): ops in it are its own.
        self._root_call: tuple[nn.Module, str] | None = None
        # -- the op-level search: step 0, then armed by a non-finite value
        self._armed = True
        self._searched: list[int] = []  # steps searched in the current search
        self._searched_total = 0
        self._cooldown = FIRST_COOLDOWN_STEPS
        self._next_search = 0
        self._unexplained: list[int] = []  # non-finite steps no origin accounts for yet
        self._unexplained_count = 0
        self._skipped: set[int] = set()
        self._input_steps: set[int] = set()
        self._first_bad: int | None = None
        self._noted: set[int] = set()
        self._explained_upto = -1
        self._found_any = False

    # -- lifecycle -------------------------------------------------------------
    # Two anomaly watches would search each other's ops and fight over the stack.
    _active: AnomalyMode | None = None

    def start(self) -> None:
        if AnomalyMode._active is not None:
            raise AmpDoctorError(
                "only one watch(..., anomaly=True) can run at a time; close the other one "
                "first, or watch several models with one call: watch([model_a, model_b], "
                "anomaly=True).")
        AnomalyMode._active = self
        self._thread = threading.get_ident()
        self._mode = _NonFiniteMode(self)
        if self._raise:
            self._push()

    @property
    def searching(self) -> bool:
        """The op-level search is running (its mode is on the dispatch stack)."""
        return self._handle is not None

    @property
    def wants_modules(self) -> bool:
        """The next step needs the module stack (every module hooked) to name modules."""
        return self._raise or self._armed or self.searching

    def _push(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook

        if self._mode is None or self.searching:
            return
        self._handle = register_module_forward_hook(self._module_post, always_call=True)
        _enter_below_user_modes(self._mode)

    def _pop(self) -> None:
        self._tag_previous()
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        if self._mode is not None:
            _remove_mode(self._mode)

    def stop(self) -> None:
        """Remove the mode and the hook, check what is pending, drop every tensor reference."""
        try:
            self._pop()
        finally:
            self._mode = None
            if AnomalyMode._active is self:
                AnomalyMode._active = None
            try:
                searching = bool(self._searched)
                self.check_now()
                if searching or not self._found_any:
                    # Non-finite steps after an origin was named, while waiting out the
                    # cool-down, are taken for more of the same.
                    self._note_unlocated()
            finally:
                self._pending = _Pending()
                self._cache = {}
                self._to_tag = None
                self._root_calls = []
                self._grad_flags = []
                self._window = None
                self._params = None
                self._roots = {}
                self._root_call = None

    # -- results ---------------------------------------------------------------
    def op_dtypes(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per layer: each forward aten op and the dtypes its outputs had, with counts
        (from the searched steps: the first step and those after a non-finite value)."""
        return {m: {op: dict(d) for op, d in ops.items()} for m, ops in self._op_dtypes.items()}

    def events(self) -> list[Event]:
        out: list[Event] = []
        for key, es in self._events.items():
            n = self._counts[key]
            first = es[0]
            out.append(Event(kind=first.kind, step=first.step, module=first.module, op=first.op,
                             frame=first.frame, data={**first.data, "occurrences": n}))
            out.extend(es[1:])
        if self._internal_error:
            out.append(Event(kind="internal_error", step=0,
                             data={"error": self._internal_error, "where": "anomaly"}))
        return out

    # -- the per-step check ------------------------------------------------------
    def check_inputs(self, module: str, args: Any, root: nn.Module | None = None) -> None:
        """A root model is being called: note its floating inputs (the batch)."""

        if torch.compiler.is_compiling() or threading.get_ident() != self._thread:
            return  # dynamo tracing the hook (the compiled region is not searched); or
            # another thread's inference
        try:
            if root is not None:
                self._root_call = (root, module)
                if id(root) not in self._roots:
                    self._roots[id(root)] = weakref.ref(root)
                    self._params = None
            if self._armed and not self.searching:
                if not self._raise:
                    # Whether the search starts from finite weights: without a GradScaler
                    # the bad step's update may have written NaN into them already.
                    with own_ops:
                        self._param_flags.extend(
                            (self._step_of(), f)
                            for f in self._norm_sums(self._watched_params()))
                self._push()
            if not torch.is_grad_enabled():
                return
            with own_ops:
                tensors = [t for t in iter_tensors(args) if _summarizable(t)]
                if not tensors:
                    return
                if self._raise:
                    outs = [self._summary(t) for t in tensors]
                    self._add(_Entry(kind="input", op=None, module=module, step=self._step_of(),
                                     dtype=dtype_name(tensors[0].dtype), outs=outs, ins=[],
                                     frames=self._user_frames()))
                    return
                rows = [torch.stack(torch.aminmax(t)).float() for t in tensors]
                if len(rows) == 1:
                    row = rows[0]
                else:
                    both = torch.stack(rows)
                    row = torch.stack((both[:, 0].min(), both[:, 1].max()))
                self._root_calls.append(_RootCall(self._step_of(), module,
                                                  dtype_name(tensors[0].dtype),
                                                  self._user_frames(), row))
        except NonFiniteError:
            raise
        except Exception as e:
            self._note_internal(e)

    def _watched_params(self) -> list[torch.Tensor]:
        if self._params is None:
            # Built once per set of roots (a model found later resets it).
            seen: set[int] = set()
            params: list[torch.Tensor] = []
            for ref in self._roots.values():
                m = ref()
                if m is None:
                    continue
                for p in m.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            self._params = params
        return self._params

    def _grads_flag(self) -> list[torch.Tensor]:
        """Per device, a 0-d float32: non-finite iff a watched parameter's gradient is. No sync."""
        grads = []
        for p in self._watched_params():
            g = p.grad
            if g is not None:
                grads.append(g)
        return self._norm_sums(grads)

    @staticmethod
    def _norm_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per device, the sum of the tensors' 2-norms: non-finite iff some value is NaN/Inf.

        Three launches per device, whatever the number of tensors. The norms are
        accumulated in float32, so a finite float16 value cannot overflow them; on the
        CPU the 2-norm is several times cheaper than the inf-norm.
        """
        strided = torch.strided
        by_dev: dict[torch.device, list[torch.Tensor]] = {}
        for g in tensors:
            if g.layout is strided and g.is_floating_point() and not g.is_meta:
                by_dev.setdefault(g.device, []).append(g)
        out = []
        with torch.no_grad():
            for gs in by_dev.values():
                out.append(torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float32)).sum())
        return out

    def end_step(self, skipped: bool = False, recorded: bool = False) -> None:
        """A step boundary: the step's gradient check; a searched step's verdict.

        ``skipped``: the GradScaler skipped this step (known on the host already).
        ``recorded``: :meth:`flagged_count` and :meth:`resolve` follow for this step,
        so the check rides in its host copy; otherwise a searched step is checked now.
        """
        if self._raise:
            return
        step = self._step_of()
        try:
            with own_ops:
                for flag in self._grads_flag():
                    self._grad_flags.append((step, flag))
            self._light_steps += 1
            if skipped:
                self._skipped.add(step)
                self._note_bad([step])
            if self.searching:
                self._searched.append(step)
                self._searched_total += 1
            if recorded:
                return  # flagged_count/resolve follow
            if self.searching or self._light_steps >= LIGHT_WINDOW_STEPS:
                self.check_now()
            else:
                self._after_check()
        except NonFiniteError:
            raise
        except Exception as e:
            self._note_internal(e)

    # -- checks: the recorded step's host copy, or a sync of their own --------------
    def flagged_count(self) -> torch.Tensor | None:
        """A device scalar: how many things are flagged since the last check. No sync.

        The owner copies it to the host with the step's other summaries and
        passes the value to :meth:`resolve`.
        """
        self._window = self._take_window()
        return None if self._window is None else self._window.flags.sum()

    def resolve(self, flagged: float | None) -> None:
        """Turn what was flagged into events (a second sync, only if anything was)."""
        w, self._window = self._window, None
        try:
            if w is not None and flagged:
                self._finish(w)
            self._after_check()
        except Exception as e:
            self._note_internal(e)

    def check_now(self) -> None:
        """Check what is pending with a sync of its own (unrecorded stretch, close)."""
        self._check_window()
        self._after_check()

    def _check_window(self) -> None:
        w = self._take_window()
        if w is not None:
            count_sync()
            if bool(w.flags.any()):
                self._finish(w)

    def _take_window(self) -> _Window | None:
        self._tag_previous()
        p, self._pending = self._pending, _Pending()
        calls, self._root_calls = self._root_calls, []
        grads, self._grad_flags = self._grad_flags, []
        wts, self._param_flags = self._param_flags, []
        self._light_steps = 0
        parts: list[torch.Tensor] = []
        op_rows = call_rows = None
        if p.entries:
            op_flags, op_rows = self._origin_flags(p, p.entries)
            parts.append(op_flags)
        if calls:
            call_rows = _stack_rows([c.row for c in calls])
            # The batch: NaN or +inf is bad data; -inf is how masks are written.
            parts.append(torch.isnan(call_rows).any(1) | (call_rows[:, 1] == math.inf))
        sums = [g for _, g in grads] + [g for _, g in wts]
        if not parts and not sums:
            return None
        # Gather on an accelerator if there is one: a copy to the CPU would sync.
        home = next((x.device for x in parts + sums if x.device.type != "cpu"),
                    (parts + sums)[0].device)
        if sums:
            parts.append(~torch.isfinite(torch.stack([s.to(home) for s in sums])))
        flags = torch.cat([x.to(home) for x in parts])
        return _Window(p, calls, grads, flags, op_rows, call_rows, wts)

    def _finish(self, w: _Window) -> None:
        """Events from a window in which something was flagged (syncs: an abnormal step)."""
        n_ops = len(w.ops.entries)
        host = w.flags.cpu()
        count_sync()
        found = False
        if n_ops and bool(host[:n_ops].any()) and w.op_rows is not None:
            found = self._report(w.ops, w.flags[:n_ops], w.op_rows) is not None
        pos = n_ops
        if w.calls:
            bad = host[pos:pos + len(w.calls)]
            pos += len(w.calls)
            if bool(bad.any()) and w.call_rows is not None:
                rows = w.call_rows.cpu()
                count_sync()
                for c, b, r in zip(w.calls, bad.tolist(), rows, strict=True):
                    if b:
                        self._input_event(c, r)
        flags = host[pos:].tolist()
        bad_grads = [s for (s, _), b in zip(w.grads, flags, strict=False) if b]
        bad_wts = [s for (s, _), b in zip(w.weights, flags[len(w.grads):], strict=True) if b]
        if bad_wts and self._weights_bad_at is None:
            self._weights_bad_at = min(bad_wts)
        self._note_bad(sorted(set(bad_grads)))
        if found:
            self._explained()

    def _input_event(self, c: _RootCall, row: torch.Tensor) -> None:
        lo, hi = float(row[0]), float(row[1])
        nan = math.isnan(lo) or math.isnan(hi)
        data: dict[str, Any] = {
            "dtype": c.dtype, "nan": nan, "pos_inf": hi == math.inf, "neg_inf": lo == -math.inf,
            "frames": [f"{f}:{ln} in {fn}" for f, ln, fn in c.frames],
            "output_min": lo, "output_max": hi,
        }
        frame = data["frames"][0] if data["frames"] else None
        ev = Event(kind="nonfinite_input", step=c.step, module=c.module, frame=frame, data=data)
        self._store(ev, [c.step])
        self._input_steps.add(c.step)

    def _note_bad(self, steps: list[int]) -> None:
        """Steps in which the per-step check saw a non-finite value: search the next ones."""
        for s in steps:
            if self._first_bad is None or s < self._first_bad:
                self._first_bad = s
            if s <= self._explained_upto or s in self._noted:
                continue
            if len(self._noted) > 4 * LIGHT_WINDOW_STEPS:
                self._noted.clear()  # bounded; at worst a step is counted twice
            self._noted.add(s)
            self._unexplained_count += 1
            if len(self._unexplained) < MAX_LISTED_STEPS:
                self._unexplained.append(s)
        if steps and not self.searching and self._step_of() + 1 >= self._next_search:
            self._armed = True

    def _explained(self) -> None:
        """An origin was named: it accounts for the non-finite steps seen so far."""
        first = min(self._unexplained, default=None)
        self._unexplained = []
        self._unexplained_count = 0
        self._noted.clear()
        self._explained_upto = self._step_of()
        self._found_any = True
        self._armed = False
        if first is not None:
            for es in self._events.values():
                for e in es:
                    if e.kind != "nonfinite_input" and "first_seen_step" not in e.data:
                        e.data["first_seen_step"] = min(first, e.step)

    def _after_check(self) -> None:
        """End a search once it named an origin, or had its steps; arm one when needed."""
        step = self._step_of()
        if self.searching and not self._raise:
            done = not self._unexplained or len(self._searched) >= MAX_SEARCH_STEPS
            if done and self._searched:
                self._pop()
                self._armed = False
                if self._unexplained:
                    self._note_unlocated()
                self._searched = []
                if self._searched_total > 1 or self._first_bad is not None:
                    # The first step's search is calibration, not a search for a cause.
                    self._next_search = step + 1 + self._cooldown
                    self._cooldown *= 2

    def _note_unlocated(self) -> None:
        """Non-finite steps that no searched step explained: say so, once per run of them."""
        # After a batch that held NaN/Inf, the weights themselves may be non-finite:
        # the input event already names the cause.
        first_input = min(self._input_steps, default=None)
        steps = [s for s in self._unexplained if first_input is None or s < first_input]
        real = [s for s in steps if s not in self._skipped]
        n = self._unexplained_count
        self._unexplained = []
        self._unexplained_count = 0
        self._noted.clear()
        if not steps:
            return
        data: dict[str, Any] = {
            "steps": steps[:MAX_LISTED_STEPS], "count": n,
            "searched_steps": list(self._searched),
            "scaler_skipped_only": not real,
            "weights_nonfinite_at": self._weights_bad_at,
            "reason": (
                "the weights were already non-finite when the op-level search ran: with no "
                "GradScaler to skip it, the bad step's update wrote NaN/Inf into them, so no "
                "later op starts from finite inputs. on_nonfinite='raise' checks every op of "
                "every step and stops at the origin" if self._weights_bad_at is not None
                else "the op-level search ran on the next steps and they stayed finite"
                if self._searched else "the run ended before the op-level search ran"),
        }
        self._store(Event(kind="nonfinite_unlocated", step=steps[0], data=data), [steps[0]])

    # -- per op ------------------------------------------------------------------
    def _on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._to_tag is not None:
            self._tag_previous()
        if own_ops.active() or (
                not torch.is_grad_enabled() and torch._C._current_autograd_node() is None):
            # amp-doctor's own work; or neither a training forward nor backward:
            # optimizer updates, GradScaler's unscale, evaluation under no_grad.
            return func(*args, **kwargs)
        try:
            pre = self._before(func, args, kwargs)
        except Exception as e:  # our bookkeeping must never break the user's run
            self._note_internal(e)
            pre = None
        out = func(*args, **kwargs)
        if pre is not None:
            try:
                self._after(pre, out)
            except NonFiniteError:
                raise
            except Exception as e:
                self._note_internal(e)
        return out

    def _before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        step = self._step_of()
        if step != self._cache_step:
            # Parameters changed in the optimizer step; last step's tensors are gone.
            self._cache = {}
            self._cache_step = step
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func.overloadpacket)
        if func.is_view:
            return (name, None, True, False, args, step)
        constant_inf = False
        ins: list[int] = []
        leaves: Iterable[Any] = _leaves(args)
        if name in _OVERWRITES:
            leaves = list(leaves)[1:]
        for a in leaves:
            if isinstance(a, torch.Tensor):
                if _summarizable(a):
                    ins.append(self._summary(a))
            elif isinstance(a, float) and not math.isfinite(a):
                constant_inf = True
        for a in kwargs.values():
            if isinstance(a, torch.Tensor) and _summarizable(a):
                ins.append(self._summary(a))
            elif isinstance(a, float) and not math.isfinite(a):
                constant_inf = True
        allowed = constant_inf or name in _UNINITIALIZED
        return (name, ins, False, allowed, None, step)

    def _after(self, pre: Any, out: Any) -> None:
        name, ins, is_view, allowed, args, step = pre
        outs = [t for t in (out if isinstance(out, (list, tuple)) else (out,))
                if isinstance(t, torch.Tensor)]
        node = torch._C._current_autograd_node()
        forward = node is None
        if is_view:
            # Same values as the viewed tensor: share its summary, record nothing.
            base = args[0] if args and isinstance(args[0], torch.Tensor) else None
            known = self._cache.get(id(base)) if base is not None else None
            if base is not None and known is not None and self._valid(base, known):
                for t in outs:
                    if not t.is_inference():
                        self._cache[id(t)] = (known[0], t._version, weakref.ref(t), known[3],
                                              known[4])
            if forward and torch.is_grad_enabled():
                self._to_tag = (outs, (self._module(), name, ()))
            return
        summaries: list[int] = []
        dtype = ""
        for t in outs:
            if not _summarizable(t) or name in _UNINITIALIZED:
                continue
            s = self._summarize(t)
            summaries.append(s)
            dtype = dtype or dtype_name(t.dtype)
        if forward:
            module = self._module()
            frames = self._user_frames()
            if dtype:
                per = self._op_dtypes.setdefault(module or "<outside>", {}).setdefault(name, {})
                per[dtype] = per.get(dtype, 0) + 1
            if torch.is_grad_enabled():
                self._to_tag = (outs, (module, name, frames))
            kind, fwd_op, node_name = "forward", None, None
        else:
            tag = cast(dict[str, Any], node.metadata).get(_TAG)
            module, fwd_op, frames = tag if tag is not None else (None, None, ())
            kind, node_name = "backward", node.name()
        if not summaries or allowed or self._allowed(name, module):
            return
        entry_ = _Entry(kind=kind, op=name, module=module, step=step, dtype=dtype,
                        outs=summaries, ins=ins, frames=frames, node=node_name,
                        forward_op=fwd_op)
        self._add(entry_)

    def _add(self, entry: _Entry) -> None:
        p = self._pending
        p.entries.append(entry)
        if self._raise:
            self._check_one(p)
        elif len(p.entries) >= MAX_PENDING_ENTRIES:
            # Mid-step: check, but leave the search running (this is inside an op).
            self._check_window()

    def _check_one(self, p: _Pending) -> None:
        flags, rows = self._origin_flags(p, p.entries[-1:])
        count_sync()
        self._pending = _Pending()
        if bool(flags[0]):
            # The module has not finished yet: whether its output stays finite is unknown.
            ev = self._report(_Pending(entries=p.entries[-1:], sums=p.sums), flags, rows)
            if ev is not None:
                raise NonFiniteError(_one_line(ev))

    def _module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._mode is None or threading.get_ident() != self._thread:
            return
        rc = self._root_call
        if rc is not None and rc[0] is module:
            self._root_call = None
        name = self._module_name(module) if self._module_name is not None else None
        if name is None:
            return

        outs = []
        for t in iter_tensors(output):
            e = self._cache.get(id(t))
            if e is not None and self._valid(t, e):
                outs.append(self._index(e))
        if outs:
            self._pending.calls.append(_ModuleCall(name, len(self._pending.entries), outs))

    # -- helpers ---------------------------------------------------------------
    def _module(self) -> str | None:
        """The innermost watched module running; the root model itself when its own
        hooks missed this call (the CLI discovers a model inside its first call)."""
        m = self._current_module()
        if m is None and self._root_call is not None:
            return self._root_call[1]
        return m

    def _summarize(self, t: torch.Tensor) -> int:
        """Reduce ``t`` to (min, max) on its device; its index in the window's summaries."""
        p = self._pending
        s = torch.aminmax(t)
        p.sums.append((s[0], s[1]))
        i = len(p.sums) - 1
        if not t.is_inference():
            self._cache[id(t)] = (p.sums[i], t._version, weakref.ref(t), p, i)
        return i

    @staticmethod
    def _valid(t: torch.Tensor, e: tuple[Any, ...]) -> bool:
        return e[2]() is t and not t.is_inference() and e[1] == t._version

    def _index(self, e: tuple[_Summary, int, Any, _Pending, int]) -> int:
        """The index of a cached summary in the current window (added once if it is new)."""
        p = self._pending
        if e[3] is p:
            return e[4]
        p.sums.append(e[0])
        return len(p.sums) - 1

    def _summary(self, t: torch.Tensor) -> int:
        e = self._cache.get(id(t))
        if e is not None and self._valid(t, e):
            return self._index(e)
        return self._summarize(t)

    def _tag_previous(self) -> None:
        pending, self._to_tag = self._to_tag, None
        if pending is None:
            return
        outs, info = pending
        for t in outs:
            gf = t.grad_fn
            if gf is not None:
                md = cast(dict[str, Any], gf.metadata)
                if _TAG not in md:
                    md[_TAG] = info

    def _user_frames(self) -> tuple[tuple[str, int, str], ...]:
        out: list[tuple[str, int, str]] = []
        f: Any = sys._getframe(2)
        known = self._user_code
        while f is not None and len(out) < MAX_USER_FRAMES:
            code = f.f_code
            user = known.get(code)
            if user is None:
                user = known[code] = _is_user_file(code.co_filename)
            if user:
                out.append((code.co_filename, f.f_lineno, code.co_name))
            f = f.f_back
        return tuple(out)

    def _allowed(self, op: str, module: str | None) -> bool:
        if not self._allow:
            return False
        key = f"{op}|{module}"
        hit = self._allow_cache.get(key)
        if hit is None:
            names = [op, op.removeprefix("aten.")] + ([module] if module else [])
            hit = any(fnmatch.fnmatchcase(n, pat) for n in names for pat in self._allow)
            self._allow_cache[key] = hit
        return hit

    def _note_internal(self, e: Exception) -> None:
        if self._internal_error is None:
            self._internal_error = f"{type(e).__name__}: {e}"

    @staticmethod
    def _origin_flags(p: _Pending, entries: list[_Entry]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per entry, on the device: an origin of non-finite values? No sync.

        Also returns the window's summaries stacked as [n, 2] rows, for the report.
        """
        rows = _stack(p.sums)
        dev = rows.device
        out_idx: list[int] = []
        out_owner: list[int] = []
        in_idx: list[int] = []
        in_owner: list[int] = []
        is_input: list[bool] = []
        for i, e in enumerate(entries):
            out_idx.extend(e.outs)
            out_owner.extend([i] * len(e.outs))
            in_idx.extend(e.ins)
            in_owner.extend([i] * len(e.ins))
            is_input.append(e.kind == "input")
        n = len(entries)
        bad_any = ~torch.isfinite(rows).all(1)
        # Inputs to the model: NaN or +inf is bad data; -inf is how masks are written.
        bad_data = torch.isnan(rows).any(1) | (rows[:, 1] == math.inf)
        oi = torch.tensor(out_idx, device=dev)
        oo = torch.tensor(out_owner, device=dev)
        sel = torch.tensor(is_input, device=dev)[oo]
        bad_out = torch.where(sel, bad_data[oi], bad_any[oi])
        out_bad = torch.zeros(n, device=dev).index_add_(0, oo, bad_out.float())
        flags = out_bad > 0
        if in_idx:
            in_bad = torch.zeros(n, device=dev).index_add_(
                0, torch.tensor(in_owner, device=dev),
                bad_any[torch.tensor(in_idx, device=dev)].float())
            flags &= in_bad == 0
        return flags, rows

    def _report(self, p: _Pending, flags: torch.Tensor, rows: torch.Tensor) -> Event | None:
        """Events for the first distinct origins among the flagged entries (syncs)."""
        idx = flags.nonzero().flatten().tolist()
        count_sync()
        # Per step and direction, only the first origin: the ones after it in the same
        # pass are usually knock-on effects (a scaled gradient overflowing in layer
        # after layer). Steps with the same first origin are grouped.
        firsts: dict[tuple[int, str], int] = {}
        for i in idx:
            e = p.entries[i]
            firsts.setdefault((e.step, e.kind), i)
        groups: dict[tuple[str, str | None, str | None], list[int]] = {}
        for i in firsts.values():
            e = p.entries[i]
            groups.setdefault((e.kind, e.module, e.op), []).append(i)
        chosen = [members[0] for members in list(groups.values())[:MAX_ORIGINS_PER_CHECK]]
        # One host copy for everything the chosen events report: their outputs, their
        # inputs and, in the forward pass, the output of the module they ran in.
        needs: list[tuple[list[int], list[int], list[int]]] = []
        for i in chosen:
            e = p.entries[i]
            call = self._module_call(p, e.module, i) if e.kind == "forward" else None
            needs.append((e.outs, e.ins, call.outs if call is not None else []))
        wanted = [j for need in needs for part in need for j in part]
        host = rows[torch.tensor(wanted, dtype=torch.long, device=rows.device)].cpu()
        count_sync()
        first: Event | None = None
        pos = 0
        for i, members, need in zip(chosen, groups.values(), needs, strict=False):
            parts = []
            for part in need:
                parts.append(host[pos:pos + len(part)])
                pos += len(part)
            ev = self._event_for(p.entries[i], *parts)
            self._store(ev, sorted({p.entries[j].step for j in members}))
            first = first or ev
        return first

    def _store(self, ev: Event, steps: list[int]) -> None:
        """Keep one event per step an origin showed up in, and count them all."""
        key = (ev.kind, ev.module, ev.op)
        es = self._events.setdefault(key, [])
        seen = {e.step for e in es}
        new = [s for s in steps if s not in seen]
        self._counts[key] = self._counts.get(key, 0) + len(new)
        for s in new:
            if len(es) >= MAX_EVENTS_PER_KEY:
                break
            es.append(ev if s == ev.step else Event(
                kind=ev.kind, step=s, module=ev.module, op=ev.op, frame=ev.frame,
                data=ev.data))

    @staticmethod
    def _event_for(e: _Entry, o: torch.Tensor, x: torch.Tensor, call: torch.Tensor) -> Event:
        """An event from host rows: ``o``/``x`` the op's outputs/inputs, ``call`` its module's."""
        has_nan = bool(torch.isnan(o).any())
        has_pos_inf = bool((o[:, 1] == math.inf).any())
        has_neg_inf = bool((o[:, 0] == -math.inf).any())
        data: dict[str, Any] = {
            "dtype": e.dtype, "nan": has_nan, "pos_inf": has_pos_inf, "neg_inf": has_neg_inf,
            "frames": [f"{f}:{ln} in {fn}" for f, ln, fn in e.frames],
        }
        if len(x):
            lo, hi = float(x[:, 0].min()), float(x[:, 1].max())
            data.update(input_min=lo, input_max=hi, input_absmax=max(abs(lo), abs(hi)))
        if e.kind == "input":
            kind = "nonfinite_input"
            data["output_min"], data["output_max"] = float(o[:, 0].min()), float(o[:, 1].max())
        elif e.kind == "backward":
            kind = "nonfinite_backward"
            data.update(node=e.node, forward_op=e.forward_op)
        else:
            kind = "nonfinite_forward"
            # What the op made: -inf from log(0) is not an overflow past the format's max.
            data["output_min"], data["output_max"] = float(o[:, 0].min()), float(o[:, 1].max())
            finite_after = bool(torch.isfinite(call).all()) if len(call) else None
            data["module_output_finite"] = finite_after
            if finite_after and not has_nan:
                kind = "activation_overflow"
                data["hidden"] = True
        frame = data["frames"][0] if data["frames"] else None
        return Event(kind=kind, step=e.step, module=e.module, op=e.op, frame=frame, data=data)

    @staticmethod
    def _module_call(p: _Pending, module: str | None, i: int) -> _ModuleCall | None:
        """The call of ``module`` that entry ``i`` ran in (the first to end after it)."""
        if module is None:
            return None
        return next((c for c in p.calls if c.name == module and c.end > i), None)


def _stack(summaries: list[_Summary]) -> torch.Tensor:
    """[n, 2] float32 (min, max) rows, on the device of the first summary.

    Summaries are stacked per dtype (stacking mixed dtypes is several times slower)
    and put back in order. A CUDA op may take a 0-d CPU tensor, so a summary can
    live elsewhere than the rest: it is moved first.
    """
    home = summaries[0][0].device
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, s in enumerate(summaries):
        groups.setdefault((s[0].dtype, s[0].device), []).append(i)
    parts = []
    order: list[int] = []
    for (_, dev), idx in groups.items():
        lo = torch.stack([summaries[i][0] for i in idx])
        hi = torch.stack([summaries[i][1] for i in idx])
        part = torch.stack((lo, hi), 1).to(torch.float32)
        parts.append(part if dev == home else part.to(home))
        order.extend(idx)
    cat = parts[0] if len(parts) == 1 else torch.cat(parts)
    if order == list(range(len(order))):
        return cat
    out = torch.empty_like(cat)
    out[torch.tensor(order, device=home)] = cat
    return out


def _stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """[n, 2] rows on the device of the first (a batch on another device is moved)."""
    home = rows[0].device
    return torch.stack([r if r.device == home else r.to(home) for r in rows])


def _one_line(ev: Event) -> str:
    """The ``NonFiniteError`` message: where, what, and analysis's fix for it."""
    from .analysis import event_advice

    d = ev.data
    where = f"module {ev.module!r}" if ev.module else "code outside the watched model"
    what = "NaN" if d.get("nan") else ("+inf" if d.get("pos_inf") else "-inf")
    at = f" at {ev.frame}" if ev.frame else ""
    if ev.kind == "nonfinite_input":
        head = f"the batch passed to {ev.module!r} holds {what} at step {ev.step}{at}"
    elif ev.kind == "nonfinite_backward":
        head = (f"{ev.op} in the backward of {d.get('forward_op')} ({d.get('node')}, {where}) "
                f"produced {what} from finite inputs at step {ev.step}{at}")
    else:
        head = (f"{ev.op} in {where} produced {what} from finite {d.get('dtype')} inputs at "
                f"step {ev.step}{at}")
    return f"{head}. Fix: {' '.join(event_advice(ev).split())}"
