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
  every step costs a few searched steps in total, not a slower run. A value that
  comes back every k > :data:`MAX_SEARCH_STEPS` steps (the short last batch of
  each epoch) falls between such searches every time: once a search has found
  nothing, the next one is *aimed* at the one step that the last two non-finite
  steps' spacing predicts, or, when they came within :data:`MAX_SEARCH_STEPS` of
  each other, is an ordinary search armed at once, without the cool-down; at most
  :data:`MAX_AIMED_SEARCHES` of these a run.

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

Torch's own anomaly mode is never switched on, and its flags are never
touched.

The parts, one module each: :mod:`~amp_doctor.anomaly.stepcheck` (the per-step
check), :mod:`~amp_doctor.anomaly.oprecord` (the op-level search's per-op recording,
in the private dispatch mode of :mod:`~amp_doctor.anomaly.dispatchstack`),
:mod:`~amp_doctor.anomaly.origins` (which op is an origin, and its event),
:mod:`~amp_doctor.anomaly.checkwindow` (what one check reads, as one device vector),
:mod:`~amp_doctor.anomaly.events` (the events kept) and
:mod:`~amp_doctor.anomaly.userframes` (the user's frames). This module is the public
:class:`AnomalyMode`, which schedules them.

Left as they are: the user's own dispatch modes (ours is entered *below*
them and removed from wherever it is, so their ``__exit__`` pops their own
mode), other threads (dispatch modes are thread-local; hooks called from a
thread other than the one that opened the watch are ignored), and
``torch.compile``: the mode says ``ignore_compile_internals``, so a compiled
region runs compiled, with the same random numbers, and its inner ops are
not searched; module ends come from the probes' own hooks (no global module
hook of ours for dynamo to trace or guard on), so a compiled model gets no
extra graph break or recompile.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from amp_doctor.anomaly.checkwindow import CheckWindow, gather, input_event
from amp_doctor.anomaly.dispatchstack import OpMode, enter_below_user_modes, remove_mode
from amp_doctor.anomaly.events import MAX_EVENTS_PER_KEY, EventLog, one_line
from amp_doctor.anomaly.oprecord import OpRecorder
from amp_doctor.anomaly.origins import (
    MAX_ORIGINS_PER_CHECK,
    OpEntry,
    OpWindow,
    origin_flags,
    report_origins,
)
from amp_doctor.anomaly.stepcheck import RootCall, StepCheck
from amp_doctor.anomaly.userframes import MAX_USER_FRAMES, format_frames
from amp_doctor.device.stats import bad_batch
from amp_doctor.devicework import cast_limit, count_sync, own_ops
from amp_doctor.dtypes import dtype_name
from amp_doctor.errors import AmpDoctorError, NonFiniteError
from amp_doctor.hooks import moduleends
from amp_doctor.hooks.compiled import capturing
from amp_doctor.hooks.patching import in_scaled_backward
from amp_doctor.hooks.tensorkinds import given_data_keyed, input_label
from amp_doctor.records import Event

__all__ = [
    "AnomalyMode",
    "MAX_PENDING_ENTRIES",
    "MAX_ORIGINS_PER_CHECK",
    "MAX_USER_FRAMES",
    "MAX_SEARCH_STEPS",
    "FIRST_COOLDOWN_STEPS",
    "LIGHT_WINDOW_STEPS",
    "MAX_AIMED_SEARCHES",
]

# Bounded memory between checks: past this many pending op entries the check
# runs early (one extra sync) instead of growing without limit.
MAX_PENDING_ENTRIES = 200_000
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
# Searches outside the cool-down after a search that found nothing, per run: one-step
# searches aimed at a predicted recurrence (a wrong guess costs one searched step), and
# ordinary ones armed when the value came back on steps close together (at most
# MAX_SEARCH_STEPS each), so a non-finite value that comes back irregularly costs at
# most this many.
MAX_AIMED_SEARCHES = 4


class _RootRunning(NamedTuple):
    """The root model whose forward is running, and its name."""

    module: nn.Module
    name: str


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
        training_forward: Callable[[], bool] = lambda: False,
        recomputing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._current_module = current_module
        self._module_name = module_name
        self._step_of = step_of
        self._raise = mode == "raise"
        self._log = EventLog()
        self._recorder = OpRecorder(self._module, step_of, allow, self._on_entry,
                                    self._log.note_internal, training_forward, recomputing)
        self._check = StepCheck()
        self._mode: OpMode | None = None
        self._handle: moduleends.Listening | None = None
        self._thread = threading.get_ident()
        self._window: CheckWindow | None = None
        # The root model whose forward is running (its own hooks may not see this
        # call: the CLI discovers a model in its first call): ops in it are its own.
        self._root_call: _RootRunning | None = None
        # -- the op-level search: step 0, then armed by a non-finite value
        self._armed = True
        self._searched: list[int] = []  # steps searched in the current search
        # Steps searched since the unexplained steps began (for their report).
        self._searched_pending: list[int] = []
        self._searched_total = 0
        self._cooldown = FIRST_COOLDOWN_STEPS
        self._next_search = 0
        self._unexplained: list[int] = []  # non-finite steps no origin accounts for yet
        self._unexplained_count = 0
        self._skipped: set[int] = set()
        self._input_steps: set[int] = set()
        # Per model, the first batch that held NaN/inf in a step whose loss and gradients
        # stayed finite (the model handles such values, or that forward reached no backward).
        self._handled: dict[str, Event] = {}
        # Bad calls whose step went bad only through a forward the loop dropped.
        self._dropped_calls: list[tuple[RootCall, torch.Tensor, tuple[str, ...]]] = []
        self._dropped_more: dict[str, int] = {}  # such calls beyond those kept, per model
        self._handled_keys: set[tuple[str, str]] = set()  # (model, input key)
        # The batches that held NaN/inf in a step that went wrong, with their bad inputs'
        # keys: judged at the end, when every step the model handled such values is known.
        self._bad_calls: list[tuple[RootCall, torch.Tensor, tuple[str, ...]]] = []
        self._bad_kinds: dict[tuple[str, tuple[str, ...]], int] = {}
        # The one event of batches beyond the cast format's max (see _beyond_events).
        self._beyond: Event | None = None
        self._first_bad: int | None = None
        self._weights_bad_at: int | None = None
        self._noted: set[int] = set()
        self._explained_upto = -1
        self._found_any = False
        # -- aimed searches: the last non-finite steps, the step they predict
        self._recent_bad: list[int] = []
        self._missed = False  # a search has found nothing since the last origin
        self._aim: int | None = None
        self._aim_gap = 0  # the spacing the aim was taken from
        self._aiming = False  # the running search is an aimed one
        self._aims_left = MAX_AIMED_SEARCHES

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
        self._mode = OpMode(self._recorder.on_op)
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
        if self._mode is None or self.searching:
            return
        self._handle = moduleends.listen(self._module_post)
        enter_below_user_modes(self._mode)

    def _pop(self) -> None:
        self._recorder.tag_previous()
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        if self._mode is not None:
            remove_mode(self._mode)

    def stop(self) -> None:
        """Remove the mode and the listener, check what is pending, drop every tensor reference."""
        try:
            self._pop()
        finally:
            self._mode = None
            if AnomalyMode._active is self:
                AnomalyMode._active = None
            try:
                searching = bool(self._searched)
                self._searched_pending.extend(self._searched)
                self._searched = []
                self.check_now()
                if searching or not self._found_any or self._missed:
                    # Non-finite steps after an origin was named, while waiting out the
                    # cool-down, are taken for more of the same.
                    self._note_unlocated()
            finally:
                self._recorder.clear()
                self._check.clear()
                self._window = None
                self._root_call = None

    # -- results ---------------------------------------------------------------
    def op_dtypes(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per layer: each forward aten op and the dtypes its outputs had, with counts
        (from the searched steps: the first step and those after a non-finite value)."""
        return self._recorder.op_dtypes()

    @property
    def saw_dropped_inputs(self) -> bool:
        """Some batch that held NaN/inf went only to forwards the loop dropped: whether
        training took none of it is judged with the run's losses (:meth:`events`)."""
        return bool(self._dropped_calls)

    def events(self, training_clean: bool = False) -> list[Event]:
        """The run's events. ``training_clean``: no step's loss went NaN/inf and the run
        ended well, so a batch only dropped forwards took harmed nothing."""
        out = self._log.events()
        out.extend(self._input_events(training_clean))
        return out

    def _dropped_input_events(self) -> list[Event]:
        """A warning per model whose bad batches only forwards the loop dropped took, in
        a run whose training stayed finite (the default mode's rule, review 49a)."""
        by_module: dict[str, list[tuple[RootCall, torch.Tensor, tuple[str, ...]]]] = {}
        for call in self._dropped_calls:
            by_module.setdefault(call[0].module, []).append(call)
        out = []
        for calls in by_module.values():
            c, r, keys = min(calls, key=lambda x: x[0].step)
            e = input_event(c, r)
            n = len({x[0].step for x in calls}) + self._dropped_more.get(c.module, 0)
            e.data.update(dropped_only=True, severity="warning", harmful=n, occurrences=n)
            if len(c.keys) > 1 and keys[0]:
                e.data.update(input=input_label(keys[0]), inputs=len(c.keys))
            out.append(e)
        return out

    def _input_events(self, training_clean: bool = False) -> list[Event]:
        """The batches judged (see :meth:`_finish`): an error per model given an input that
        held NaN/inf in a step that went wrong and that it does not handle in others (a
        second input it does not clean); an info per model that took every such batch in
        its stride, or whose bad steps went wrong for another reason (a GradScaler
        calibrating, a layer's overflow: review 49b); a warning per model whose bad
        batches only forwards the loop dropped took, when ``training_clean``."""
        culprits: dict[str, list[tuple[RootCall, torch.Tensor, tuple[str, ...]]]] = {}
        handled = {m: dataclasses.replace(e, data=dict(e.data)) for m, e in self._handled.items()}
        dropped: list[Event] = []
        bad_calls = self._bad_calls
        if training_clean:
            dropped = self._dropped_input_events()
        elif self._dropped_calls:
            # Training went wrong somewhere, or the run ended on an error (a loop that
            # raises on the NaN loss before backward): the batch is the cause, as before.
            bad_calls = sorted(bad_calls + self._dropped_calls, key=lambda x: x[0].step)
        for c, r, keys in bad_calls:
            bad = [k for k in keys if (c.module, k) not in self._handled_keys]
            if bad or c.module not in handled:
                culprits.setdefault(c.module, []).append((c, r, tuple(bad or keys)))
            else:
                e = handled[c.module]
                e.data["beside"] = int(e.data.get("beside", 0)) + 1
                e.data["occurrences"] = int(e.data["occurrences"]) + 1
                if c.step < e.step:
                    handled[c.module] = dataclasses.replace(e, step=c.step)
        out: list[Event] = []
        for m, calls in culprits.items():
            for i, (c, r, keys) in enumerate(calls[:MAX_EVENTS_PER_KEY]):
                if not r.numel():
                    break  # (kept for its step only)
                e = input_event(c, r)
                if len(c.keys) > 1 and keys[0]:
                    e.data.update(input=input_label(keys[0]), inputs=len(c.keys))
                if i == 0:
                    e.data["occurrences"] = len({x.step for x, _, _ in calls})
                out.append(e)
            handled.pop(m, None)
        return out + list(handled.values()) + dropped

    # -- the per-step check ------------------------------------------------------
    def check_inputs(self, module: str, args: Any, root: nn.Module | None = None,
                     rows: torch.Tensor | None = None) -> None:
        """A root model is being called: note its floating inputs (the batch). ``rows``:
        their (min, max) rows, when the watch's own batch check made them already."""

        if capturing() or threading.get_ident() != self._thread:
            return  # dynamo or torch.jit.trace tracing the hook (the compiled region is
            # not searched); or another thread's inference
        try:
            if root is not None:
                self._root_call = _RootRunning(root, module)
                self._check.add_root(root)
            if self._armed and not self.searching:
                if not self._raise:
                    # Whether the search starts from finite weights: without a GradScaler
                    # the bad step's update may have written NaN into them already.
                    self._check.note_weights(self._step_of())
                self._push()
            if not torch.is_grad_enabled():
                return
            with own_ops:
                keyed = given_data_keyed(args, complex_too=True)
                tensors = [t for _, t in keyed]
                if not tensors:
                    return
                frames = self._recorder.frames.capture(1)
                if self._raise:
                    outs = [self._recorder.summary(t) for t in tensors]
                    self._recorder.add(OpEntry(
                        kind="input", op=None, module=module, step=self._step_of(),
                        dtype=dtype_name(tensors[0].dtype), outs=outs, ins=[], frames=frames))
                    return
                if rows is not None and (len(tensors) != rows.shape[0]
                                         or any(t.is_complex() for t in tensors)):
                    rows = None  # another selection than the watch's: its own pass
                self._check.note_batch(self._step_of(), module, tensors, frames,
                                       cast_limit(tensors[0].device.type), rows,
                                       tuple(k for k, _ in keyed))
        except NonFiniteError:
            raise
        except Exception as e:
            self._log.note_internal(e)

    def note_made(self, module: str, rows: torch.Tensor) -> None:
        """A model called under no_grad in the step (a frozen backbone, a teacher) returned
        tensors whose (min, max) rows are ``rows``: a batch given after they went bad is
        made from them, not data (see :meth:`StepCheck.note_made`). No sync."""
        if self._raise or capturing() or threading.get_ident() != self._thread:
            return
        try:
            self._check.note_made(self._step_of(), module, rows)
        except Exception as e:
            self._log.note_internal(e)

    def note_stepped(self, params: list[torch.Tensor], scaled: bool = False) -> None:
        """An optimizer step is about to take the gradients of ``params`` (see
        :meth:`StepCheck.note_stepped`). No sync."""
        if self._raise or threading.get_ident() != self._thread:
            return
        try:
            self._check.note_stepped(params, scaled)
        except Exception as e:
            self._log.note_internal(e)

    def note_found_inf(self, found: list[torch.Tensor]) -> None:
        """A GradScaler's check of the gradients :meth:`note_stepped` awaits (see
        :meth:`StepCheck.note_found_inf`). No sync."""
        if self._raise or threading.get_ident() != self._thread:
            return
        try:
            self._check.note_found_inf(found)
        except Exception as e:
            self._log.note_internal(e)

    def end_step(self, skipped: bool = False, recorded: bool = False,
                 loss_bad: torch.Tensor | None = None,
                 dropped_bad: torch.Tensor | None = None) -> None:
        """A step boundary: the step's gradient check; a searched step's verdict.

        ``skipped``: the GradScaler skipped this step (known on the host already).
        ``recorded``: :meth:`flagged_count` and :meth:`resolve` follow for this step,
        so the check rides in its host copy; otherwise a searched step is checked now.
        ``loss_bad``: the step's loss check (a device bool), if it had a loss.
        ``dropped_bad``: a forward the loop dropped before backward was NaN/inf (device).
        """
        if self._raise:
            return
        step = self._step_of()
        try:
            self._check.end_step(step, loss_bad, dropped_bad)
            if skipped:
                self._skipped.add(step)
                self._note_bad([step])
            if self.searching:
                self._searched.append(step)
                self._searched_total += 1
            if recorded:
                return  # flagged_count/resolve follow
            if self.searching or self._check.light_steps >= LIGHT_WINDOW_STEPS:
                self.check_now()
            else:
                self._after_check()
        except NonFiniteError:
            raise
        except Exception as e:
            self._log.note_internal(e)

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
            self._log.note_internal(e)

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

    def _take_window(self) -> CheckWindow | None:
        calls, grads, wts, losses = self._check.take()
        return gather(self._recorder.take(), calls, grads, wts, losses)

    def _finish(self, w: CheckWindow) -> None:
        """Events from a window in which something was flagged (syncs: an abnormal step)."""
        n_ops = len(w.ops.entries)
        host = w.flags.cpu()
        count_sync()
        listed: list[bool] = host.tolist()  # bools: the flags are a bool vector
        w.note_host_flags(listed)
        found = False
        if n_ops and bool(host[:n_ops].any()) and w.op_rows is not None:
            # A forward origin in a step whose loss and gradients stayed finite made values
            # that a later op dropped (torch.where(z > 0, log(z), 0)); gradients that a
            # backward op overflowed (a GradScaler calibrating) do not count against it.
            at = n_ops + len(w.calls)
            grads_bad = {g.step for g, b in zip(
                w.grads, host[at:at + len(w.grads)].tolist(), strict=True) if b}
            finite_grads = frozenset(g.step for g in w.grads if g.step not in grads_bad)
            ev = report_origins(w.ops, w.flags[:n_ops], w.op_rows, self._log.store,
                                w.finite_loss_steps(), finite_grads)
            found = ev is not None and ev.kind != "nonfinite_discarded"
        pos = n_ops
        if w.calls:
            bad = host[pos:pos + len(w.calls)]
            pos += len(w.calls)
            if bool(bad.any()) and w.call_rows is not None:
                rows = w.call_rows.cpu()
                count_sync()
                # Steps whose loss was checked and stayed finite; of them, the ones whose
                # gradients stayed finite too.
                at = pos
                loss_ok = w.finite_loss_steps()
                grad_flags = host[at:at + len(w.grads)].tolist()
                calm = loss_ok - {g.step for g, b in zip(w.grads, grad_flags, strict=True)
                                  if b}
                dropped_only = w.dropped_only_steps(grad_flags)
                made: set[int] = set()  # steps in which a model's output went bad
                for c, b, r in zip(w.calls, bad.tolist(), rows, strict=True):
                    if not b:
                        continue
                    if c.made:
                        made.add(c.step)
                    elif c.step in calm:
                        self._handled_input(c, r, self._bad_keys(c))
                    elif c.step in dropped_only:
                        # Only a forward the loop dropped took it (or an evaluation with
                        # grad on): judged at the end, with the run's losses (review 49a).
                        # Bounded as bad calls are: rows for the first few per model.
                        if sum(x[0].module == c.module for x in self._dropped_calls
                               ) < MAX_EVENTS_PER_KEY:
                            self._dropped_calls.append((c, r, self._bad_keys(c)))
                        else:
                            self._dropped_more[c.module] = self._dropped_more.get(
                                c.module, 0) + 1
                        self._input_steps.add(c.step)
                    elif c.step not in made:
                        # The step went wrong (or only its gradients did: a GradScaler
                        # calibrating, or a NaN sample the loss leaves out), or the weights
                        # were NaN already (review 49b); a batch given after a model's output
                        # went bad is made from it.
                        self._note_bad_call(c, r, self._bad_keys(c))
                        self._input_steps.add(c.step)
        flags = listed[pos:]
        bad_grads = [g.step for g, b in zip(w.grads, flags, strict=False) if b]
        if w.beyond is not None:
            # Steps whose loss went non-finite too: the cast's inf reached the loss. Not a
            # GradScaler calibrating on finite losses, whose gradients alone overflowed
            # (large values a float32 op took first; review 46c).
            finite = w.finite_loss_steps()
            loss_bad = {x.step for x in w.losses} - finite
            self._beyond_events(w, set(bad_grads) & loss_bad)
        at = len(w.grads) + len(w.weights)
        bad_wts = [g.step for g, b in zip(w.weights, flags[len(w.grads):at], strict=True) if b]
        if bad_wts and self._weights_bad_at is None:
            self._weights_bad_at = min(bad_wts)
        # A dropped forward's flag is among the gradients' already.
        bad_losses = [x.step for x, b in zip(w.losses, flags[at:], strict=True)
                      if b and not x.dropped]
        self._note_bad(sorted(set(bad_grads) | set(bad_losses)))
        if found:
            self._explained()

    def _note_bad_call(self, c: RootCall, row: torch.Tensor, keys: tuple[str, ...]) -> None:
        """Keep a bad call for the end's judgment: its row and frames for the first
        MAX_EVENTS_PER_KEY per model and set of bad inputs, only its step beyond them (a
        long run whose every step goes wrong holds no device rows per step)."""
        kind = (c.module, keys)
        self._bad_kinds[kind] = self._bad_kinds.get(kind, 0) + 1
        if self._bad_kinds[kind] > MAX_EVENTS_PER_KEY:
            # (No view of the rows: it would keep their storage.)
            row = torch.empty(0)
            c = dataclasses.replace(c, frames=(), row=row, per=None)
        self._bad_calls.append((c, row, keys))

    def _bad_keys(self, c: RootCall) -> tuple[str, ...]:
        """The keys of a bad call's inputs that held NaN/inf ("": not known). Syncs: read
        in an abnormal window only."""
        if c.per is None or len(c.keys) != c.per.shape[0]:
            return ("",)
        flags = bad_batch(c.per).tolist()
        count_sync()
        return tuple(k for k, b in zip(c.keys, flags, strict=True) if b) or ("",)

    def _handled_input(self, c: RootCall, row: torch.Tensor, keys: tuple[str, ...]) -> None:
        """A batch that held NaN/inf in a step whose loss and gradients stayed finite: the
        model took it in its stride (it replaces missing values), or that forward reached
        no backward (an evaluation with grad on; review 49a). Info, counted per model."""
        e = self._handled.get(c.module)
        if e is None:
            e = self._handled[c.module] = input_event(c, row)
            e.data.update(harmful=0, handled=0, severity="info")
        e.data["handled"] = int(e.data["handled"]) + 1
        e.data["occurrences"] = e.data["handled"]
        self._handled_keys.update((c.module, k) for k in keys)

    def _beyond_events(self, w: CheckWindow, bad_steps: set[int]) -> None:
        """Batches with finite values beyond the format autocast cast them to, in steps
        whose gradients and loss went non-finite: the cast made the inf (review 46a: a data spike
        in an unrecorded step was "unknown"). Read in an abnormal window only."""
        if w.beyond is None or w.call_rows is None or not bad_steps:
            return
        beyond = w.beyond.cpu().tolist()
        rows = w.call_rows.cpu()
        count_sync()
        for c, b, r in zip(w.calls, beyond, rows, strict=True):
            if not b or c.step not in bad_steps or c.step in self._input_steps:
                continue
            top = float(r.abs().max())
            e = self._beyond
            if e is None:
                e = self._beyond = Event(
                    kind="input_beyond_format", step=c.step, module=c.module,
                    frame=format_frames(c.frames)[0] if c.frames else None,
                    data={"absmax": top, "dtype": "float16", "max": c.limit,
                          "occurrences": 0, "steps": [], "from_step_check": True})
                self._log.store(e, [c.step])
            e.data["absmax"] = max(float(e.data["absmax"]), top)
            if c.step not in e.data["steps"]:
                e.data["occurrences"] = int(e.data["occurrences"]) + 1
                e.data["steps"].append(c.step)
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
            if not self._recent_bad or s > self._recent_bad[-1]:
                self._recent_bad = [*self._recent_bad[-1:], s]
        if steps and not self.searching and self._step_of() + 1 >= self._next_search:
            self._armed = True
        elif steps and self._recurs_densely(steps):
            # After a search that found nothing, the value is back on steps close
            # together: an ordinary search of the next steps likely sees it, where the
            # cool-down (meant for a value searched already, on every step) would wait
            # past them all (review 59a: NaN at 23, 31, 32, 35, 38 of 40; searched at
            # 24-26 only, and "it did not recur"). From the aims' budget: bounded.
            self._aims_left -= 1
            self._armed = True
        self._take_aim()

    def _recurs_densely(self, steps: list[int]) -> bool:
        """Whether the newest of ``steps`` came within :data:`MAX_SEARCH_STEPS` of the
        non-finite step before it, after a search missed, with no search armed or running."""
        if (not self._missed or self._aims_left <= 0 or self.searching or self._armed
                or self._weights_bad_at is not None or len(self._recent_bad) < 2):
            return False
        prev, last = self._recent_bad
        return last in steps and last - prev <= MAX_SEARCH_STEPS

    def _take_aim(self) -> None:
        """Once a search has missed, aim the next one at the step where a recurring
        non-finite value should come back: the last two non-finite steps' spacing,
        carried past the current step. No aim when the spacing is short enough for an
        ordinary search to cover, or the aims are used up."""
        self._aim = None
        if not self._missed or self._aims_left <= 0 or len(self._recent_bad) < 2:
            return
        prev, last = self._recent_bad
        gap = last - prev
        if gap <= MAX_SEARCH_STEPS:
            return
        self._aim_gap = gap
        self._aim = last + gap * max(1, -(-(self._step_of() + 1 - last) // gap))

    def _explained(self) -> None:
        """An origin was named: it accounts for the non-finite steps seen so far, or,
        found by an aimed search, for those of its recurrence; the others are reported
        as not located."""
        if self._aiming:
            now, gap = self._step_of(), self._aim_gap
            chain = [s for s in self._unexplained if not (now - s) % gap]
            # The steps off the recurrence are reported (and cleared) as not located.
            self._unexplained = [s for s in self._unexplained if (now - s) % gap]
            self._unexplained_count = len(self._unexplained)
            self._note_unlocated()
            self._unexplained = chain
        first = min(self._unexplained, default=None)
        if not self._aiming and self._unexplained:
            # The start of the latest run of consecutive non-finite steps, the one that
            # armed this search: not a GradScaler's calibration overflow many steps before
            # (review 55: "armed by ... at step 1" of a search armed at step 16).
            seen = set(self._unexplained)
            first = max(seen)
            while first - 1 in seen:
                first -= 1
        self._unexplained = []
        self._unexplained_count = 0
        self._noted.clear()
        self._searched_pending = []
        self._explained_upto = self._step_of()
        self._found_any = True
        self._armed = False
        self._missed = False
        self._aim = None
        if first is not None:
            self._log.mark_first_seen(first)

    def _after_check(self) -> None:
        """End a search once it named an origin, or had its steps; arm one when needed."""
        step = self._step_of()
        if self.searching and not self._raise:
            limit = 1 if self._aiming else MAX_SEARCH_STEPS
            done = not self._unexplained or len(self._searched) >= limit
            if done and self._searched:
                self._pop()
                self._armed = False
                if self._unexplained:
                    room = MAX_LISTED_STEPS - len(self._searched_pending)
                    self._searched_pending.extend(self._searched[:max(0, room)])
                    self._missed = True
                    self._take_aim()
                    if self._aims_left <= 0:
                        self._note_unlocated()
                    # else kept pending: if they come back, an aimed search names their
                    # origin; if not, they are reported at the end.
                self._searched = []
                if not self._aiming and (self._searched_total > 1
                                         or self._first_bad is not None):
                    # The first step's search is calibration, not a search for a cause.
                    self._next_search = step + 1 + self._cooldown
                    self._cooldown *= 2
                self._aiming = False
        if (not self.searching and not self._raise and self._aim is not None
                and self._aim == step + 1):
            self._aim = None
            self._aims_left -= 1
            self._armed = self._aiming = True

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
            "searched_steps": list(self._searched_pending),
            "scaler_skipped_only": not real,
            "weights_nonfinite_at": self._weights_bad_at,
            "raise_mode": self._raise,
            "reason": (
                "the weights were already non-finite when the op-level search ran: with no "
                "GradScaler to skip it, the bad step's update wrote NaN/Inf into them, so no "
                "later op starts from finite inputs. Checking every op of every step "
                "(on_nonfinite='raise') stops at the origin" if self._weights_bad_at is not None
                else "the op-level search ran on the next steps but saw no op inside the "
                "watched model: it runs under torch.compile, whose compiled ops are not "
                "searched one by one (run a few steps without compiling to name the op)"
                if self._searched_pending and not self._recorder.saw_module_ops()
                else "the op-level search ran on the next steps and they stayed finite"
                if self._searched_pending
                else "the run ended before the op-level search ran"),
        }
        self._log.store(Event(kind="nonfinite_unlocated", step=steps[0], data=data), [steps[0]])
        self._searched_pending = []

    # -- the op-level search's callbacks ---------------------------------------------
    def _on_entry(self) -> None:
        """The recorder added an op entry: check it at once (raise mode), or when the
        window is full (mid-step: the search keeps running, this is inside an op)."""
        if self._raise:
            self._check_one()
        elif len(self._recorder.window.entries) >= MAX_PENDING_ENTRIES:
            self._check_window()

    def _check_one(self) -> None:
        p = self._recorder.window
        flags, rows = origin_flags(p, p.entries[-1:])
        count_sync()
        self._recorder.window = OpWindow()
        if bool(flags[0]):
            # The module has not finished yet: whether its output stays finite is unknown.
            ev = report_origins(OpWindow(entries=p.entries[-1:], sums=p.sums), flags, rows,
                                self._log.store)
            if ev is not None and not (ev.kind == "nonfinite_backward"
                                       and in_scaled_backward()):
                # (A backward through an enabled GradScaler's scale() overflowing is what
                # the scaler detects and skips, at its first steps and after each growth
                # in a healthy float16 run: recorded, as in record mode, not raised.)
                raise NonFiniteError(one_line(ev))

    def _module_post(self, module: nn.Module, output: Any) -> None:
        if self._mode is None or threading.get_ident() != self._thread:
            return
        rc = self._root_call
        if rc is not None and rc.module is module:
            self._root_call = None
        name = self._module_name(module) if self._module_name is not None else None
        if name is not None:
            self._recorder.module_end(name, output)

    def _module(self) -> str | None:
        """The innermost watched module running; the root model itself when its own
        hooks missed this call (the CLI discovers a model inside its first call)."""
        m = self._current_module()
        if m is None and self._root_call is not None:
            return self._root_call.name
        return m
