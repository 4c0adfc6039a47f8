"""``watch()``: the context manager that owns every hook and patch.

Data flows one way: probes (module hooks) and the AMP API monitor put
device-side summaries into a per-step buffer; at each recorded step
boundary the buffer is copied to the host once and folded
(:mod:`amp_doctor.steps.folder`) into per-layer aggregates and a bounded history;
``close()`` freezes all of it into an immutable
:class:`~amp_doctor.records.Session`, runs the analysis and writes the sinks.
Everything installed is removed in ``close()``, which ``__exit__`` calls on
normal exit, on exceptions and on KeyboardInterrupt.

Longer than 500 lines: the watch wires the stages together (probes, the AMP
monitor, the step folder, anomaly mode, the sinks) and decides the step
boundary (automatic, deferred, manual, implicit); each stage's own state lives
in its module (discovery, loop, precision, monitor, steps), and splitting the
boundary state machine further would spread one decision over several files.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime as _dt
import importlib.util
import multiprocessing
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.optim import Optimizer

from amp_doctor import format as F
from amp_doctor._version import __version__
from amp_doctor.anomaly.userframes import raised_at
from amp_doctor.device.recorder import StepBuffer
from amp_doctor.devicework import as_own_work, iter_tensors, own_ops
from amp_doctor.dtypes import (
    FLOAT16,
    FORMAT_MAX,
    LOW_PRECISION_NAMES,
    FormatLimits,
    dtype_name,
    judged_format,
    limits,
    parse_dtype,
)
from amp_doctor.errors import AmpDoctorError, StopRun, UsageError, tensorboard_path_error
from amp_doctor.hooks import interrupts, threaddeaths
from amp_doctor.hooks.compiled import dynamo_compiled_something
from amp_doctor.hooks.discovery import (
    GlobalDiscovery,
    Models,
    ModelSet,
    as_models,
    compile_wrappers,
    compiled_by_method,
    is_parametrization,
    unwrap,
)
from amp_doctor.hooks.patching import Subscription, in_closure_step, subscribe
from amp_doctor.hooks.probes import COMPILED_NOTE, Probes, in_reentrant_checkpoint, own_params
from amp_doctor.hooks.replacement import ReplacementSearch
from amp_doctor.hooks.tensorkinds import input_label
from amp_doctor.records import AmpConfig, Event, RunInfo, Session
from amp_doctor.runfiles import (
    JSON_NAME,
    claim_run_dir,
    make_writable_dir,
    relocated_run_dir,
    reused_run_note,
)
from amp_doctor.steps.batches import MASK_CODES, mask_codes
from amp_doctor.steps.folder import GRAD_SCALE_KEY, StepFolder, StepListener, skip_culprits
from amp_doctor.steps.loop import INPUT_BAD_CODE, INPUT_BAD_CODES, LoopSignals, RunTotals
from amp_doctor.steps.monitor import AmpMonitor, LoopCallbacks
from amp_doctor.steps.precision import PrecisionSeen
from amp_doctor.watch_args import check_option_names, check_watch_args

if TYPE_CHECKING:
    from amp_doctor.sinks.tensorboard import TensorBoardSink

__all__ = ["Watch", "watch", "DEFAULT_EVERY"]

# Record one step in ten: enough to see persistent problems, cheap enough
# to leave on (see benchmarks/results.md). Skips, backoffs and misuse are
# tracked on every step regardless.
DEFAULT_EVERY = 10
# Steps a run needs before -inf alone in forwards no backward reached, in most of its
# steps, is taken for a mask the model returns on purpose (see _dropped_events).
MASK_MIN_STEPS = 4

_PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _warn_at_user(message: str) -> None:
    """A ``RuntimeWarning`` shown at the user's line that called into amp-doctor (however
    many of its frames lie between), not at one of amp-doctor's."""
    level = 2
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)


# The watches started and not closed, for a fork of the process (see _forget_in_child).
_LIVE: weakref.WeakSet[Watch] = weakref.WeakSet()


def _module_hidden_by_a_file(name: str) -> str | None:
    """The path of a plain module that an ``import name`` of a package would find first
    (the script's own ``tensorboard.py``), without importing either; None otherwise."""
    if name in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.submodule_search_locations is not None or not spec.origin:
        return None
    return spec.origin


def _forget_in_child() -> None:
    """A child made by ``fork`` (a ``multiprocessing.Pool`` worker, a DataLoader worker, an
    ``os.fork``) inherits the parent's watches and its TensorBoard event file. The parent's
    watch is the parent's: in the child each one lets go of everything at once, writes
    nothing, and the child runs unwatched, as under python."""
    for w in list(_LIVE):
        w._forget()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

# What a watch the script never closed records about how the run ended.
NOT_CLOSED = ("the watch was never closed (leave a `with amp_doctor.watch(...)` block, or "
              "call `doctor.close()`): closed at interpreter exit")


def run_ending(exc: BaseException) -> tuple[str, str | None, int | None]:
    """How ``exc`` ended a watched run: (outcome, error line, exit code). ``sys.exit(3)`` is
    the script's exit, code 3, as the CLI records it, not an exception (review 56c);
    ``sys.exit(0)`` or ``sys.exit(None)`` a normal end."""
    if isinstance(exc, SystemExit):
        code = exc.code
        code = 0 if code is None else code if isinstance(code, int) else 1
        return ("exit" if code else "completed"), None, code
    outcome = "interrupted" if isinstance(exc, KeyboardInterrupt) else "exception"
    return outcome, F.error_line(exc), None


def uncaught_exception() -> BaseException | None:
    """At interpreter exit: the exception whose traceback the interpreter printed, if any."""
    exc: BaseException | None = getattr(sys, "last_exc", None) or getattr(sys, "last_value",
                                                                          None)
    return exc


def _close_at_exit() -> None:
    """Close every watch still open when the interpreter exits, so that what it gathered
    is written (review 56c: a script that exited before ``doctor.close()`` left an empty
    event file and no report). A trainer callback's watch is its owner's to close. Not in
    a child process (a spawned DataLoader worker re-runs an unguarded script's top level,
    watch() included): it would write its empty report over the parent's."""
    if multiprocessing.parent_process() is not None:
        return
    for w in list(_LIVE):
        if w.closed or w.owner_closes:
            continue
        exc = uncaught_exception()
        w.set_run_meta(outcome="exception" if exc is not None else "completed",
                       error=F.error_line(exc) if exc is not None else NOT_CLOSED)
        try:
            w.close()
        except Exception:  # at interpreter exit, never raise
            continue
        if w.logdir is not None:
            print(f"amp-doctor: {NOT_CLOSED}; report: {w.logdir / JSON_NAME}", file=sys.stderr)


atexit.register(_close_at_exit)


def _in_backward() -> bool:
    """True while autograd runs a backward pass (checkpoint recomputation, hooks)."""
    try:
        return bool(torch._C._current_graph_task_id() != -1)
    except Exception:  # pragma: no cover - private API moved
        return False


@dataclass(frozen=True)
class _Options:
    """What ``watch()`` was asked for, beyond the public settings on :class:`Watch`."""

    discover: bool
    fp32: tuple[str, ...]
    stop_after: int | None
    target_dtype: str | None
    tensorboard: bool
    anomaly: bool
    on_nonfinite: str
    anomaly_allow: tuple[str, ...]
    scaler: GradScaler | None
    optimizers: tuple[Optimizer, ...]


@dataclass
class _Boundaries:
    """Where the step boundary stands (see :meth:`Watch._auto_boundary`)."""

    # An automatic boundary waits for the next forward of the step's first model.
    pending: bool = False
    # The loop's iterations the step it ends held (see FirstCycle.iterations).
    pending_iterations: int = 1
    # Another model trains after the boundary in the same iteration: boundaries wait.
    defer: bool = False
    # An automatic boundary just happened and no training work followed yet.
    idle: bool = False
    # The model whose training forward came first in the step: its next forward
    # starts the next step (a second model's forward in the same iteration does not).
    lead_root: int | None = None
    # Steps were counted from backward passes (no optimizer, scaler or doctor.step()).
    implicit: bool = False
    # The watched root models that ran a training forward so far, and in this step.
    trained_roots: set[int] = field(default_factory=set)
    step_roots: set[int] = field(default_factory=set)


class Watch:
    """Records how a model behaves under AMP, per layer and per step.

    Use as a context manager, or call :meth:`close` yourself. Host syncs:
    one per recorded step (in :meth:`step` or the automatic boundary at
    ``GradScaler.update`` / ``optimizer.step``), plus one on each step the
    GradScaler skipped that was not recorded, to name the culprit layers.
    """

    @as_own_work
    def __init__(
        self,
        model: Models | None,
        *,
        every: int = DEFAULT_EVERY,
        logdir: str | Path | None = None,
        scaler: GradScaler | None = None,
        optimizer: Optimizer | Iterable[Optimizer] | None = None,
        max_steps: int | None = None,
        anomaly: bool = False,
        on_nonfinite: str = "record",
        anomaly_allow: Iterable[str] = (),
        top_k: int = 16,
        tensorboard: bool = True,
        discover: bool = False,
        fp32: Iterable[str] = (),
        stop_after: int | None = None,
        target_dtype: str | None = None,
    ) -> None:
        # One-line errors naming the fix, before anything is installed; counts come back
        # as int, a generator of models or optimizers as a list.
        model, every, max_steps, top_k, optimizer = check_watch_args(
            model, every=every, max_steps=max_steps, top_k=top_k, scaler=scaler,
            optimizer=optimizer, on_nonfinite=on_nonfinite, logdir=logdir, discover=discover)
        self._set = ModelSet(as_models(model) if model is not None else {})
        if isinstance(fp32, str):
            fp32 = [fp32]
        if stop_after is not None and stop_after < 1:
            raise AmpDoctorError(f"stop_after must be >= 1 or None, got {stop_after!r}.")
        from amp_doctor.analysis.whatif import TARGET_DTYPES

        if target_dtype is not None and target_dtype not in TARGET_DTYPES:
            raise AmpDoctorError(f"target_dtype must be one of {', '.join(TARGET_DTYPES)} or "
                                 f"None, got {target_dtype!r}.")
        self.every = every
        self.max_steps = max_steps
        self.logdir = Path(logdir).absolute() if logdir is not None else None
        self.top_k = top_k
        opts: list[Optimizer] = []
        if isinstance(optimizer, Optimizer):
            opts = [optimizer]
        elif optimizer is not None:
            opts = list(optimizer)
        self._opts = _Options(
            discover=discover, fp32=tuple(fp32), stop_after=stop_after,
            # "raise" is anomaly mode's: asking for it asks for anomaly mode, as the CLI's
            # --on-nonfinite raise does (alone, it would do nothing, silently).
            target_dtype=target_dtype, tensorboard=tensorboard,
            anomaly=anomaly or on_nonfinite == "raise", on_nonfinite=on_nonfinite,
            anomaly_allow=tuple(anomaly_allow), scaler=scaler, optimizers=tuple(opts))
        self._fp32: Any = None

        self.step_index = 0
        # The step at which stop_after ended the run, if it did.
        self.stopped_at: int | None = None
        self.recorded = 0
        self.closed = False
        # A trainer callback (or the CLI) closes it: not closed at interpreter exit.
        self.owner_closes = False
        self.session_: Session | None = None
        self._started = (time.perf_counter(),
                         _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        self._buffer: StepBuffer | None = None
        # Bytes the last recorded step filed, per device: the next one's stage size.
        self._filed_last: dict[torch.device, int] = {}
        self._extra_events: list[Event] = []
        # The unrecorded steps' bad batches, the dropped forwards and the NaN-loss count,
        # read once when the session is built.
        self._totals = RunTotals(None, None, None)
        self._listeners: list[StepListener] = []
        self._probes: Probes | None = None
        self._precision = PrecisionSeen(
            lambda: self._probes.layers.values() if self._probes is not None else None,
            lambda: self._probes.low_precision_outputs() if self._probes else set(),
            lambda: self.recorded)
        self._folder = StepFolder(self._layer_metas, self._set.label, self._extra_events)
        self._loop = LoopSignals()
        self._sub: Subscription | None = None
        self._monitor: AmpMonitor | None = None
        self._discovery: GlobalDiscovery | None = None
        # Steps no watched model trained in, and the search for a replaced model's object.
        self._search = ReplacementSearch(self._replacement_wanted, self._found_replacement,
                                         searching=not discover)
        self._anomaly: Any = None
        self._tb: Any = None
        # Set while this run holds its logdir (runfiles.claim_run_dir).
        self._release_logdir: Callable[[], None] | None = None
        self._run_meta: dict[str, Any] = {}
        self._started_flag = False
        self._compiled_names: set[str] = set()
        # While a boundary starts the next step: the step that ended.
        self._step_ended: int | None = None
        # Found by the skip's one sync on an unrecorded step, for the step's end.
        self._pending_culprits: list[str] | None = None
        self._pending_loss_bad: bool | None = None
        self._bounds = _Boundaries()
        # The step being ended had its update dropped by the loop (see _on_root_forward).
        self._update_dropped = False
        # The model (its id) called under no_grad as the step's companion, until it returns.
        self._companion: int | None = None
        # A watched root's forward with grad on in eval mode since the last boundary (a
        # validation pass with grad, or training after a forgotten model.train()); once a
        # backward followed one in a step no train-mode forward ran in, the step it was
        # first seen in: from then on such forwards are training (review 61c).
        self._eval_grad_forward = False
        self._eval_trains_since: int | None = None
        self._holds_interrupts = False  # see hooks.interrupts

    @property
    def models(self) -> dict[str, nn.Module]:
        """The watched root models by layer-name prefix ("" for a single model)."""
        return self._set.models

    # -- lifecycle -----------------------------------------------------------
    @as_own_work
    def start(self) -> Watch:
        if self._started_flag:
            return self
        self._started_flag = True
        try:
            self._set.scan_params()
            self._probes = Probes(self.models, self._current_buffer, self._on_root_forward,
                                  events=self._extra_events, on_compiled=self._on_compiled,
                                  on_root_output=self._on_root_output,
                                  step_of=lambda: self.step_index)
            for given in self._set.given.values():
                self._attach_wrappers(given)
            if self._opts.fp32:
                from amp_doctor.hooks.fp32 import Fp32Islands

                self._fp32 = Fp32Islands(self._opts.fp32)
                for prefix, m in self.models.items():
                    self._fp32.attach(prefix, m)
                if not self._opts.discover:
                    self._fp32.check()  # the API knows every model now: fail before training
            self._monitor = AmpMonitor(
                owns_param=self._owns,
                step_of=lambda: self.step_index,
                callbacks=LoopCallbacks(
                    boundary=self._auto_boundary, param_grads=self._on_param_grads,
                    unscaled=self._on_unscaled,
                    step_after_unscale=self._on_step_after_unscale,
                    skip=self._on_skip, scale=self._on_scale, backward=self._on_backward,
                    backward_done=self._on_backward_done,
                    optimizer_done=self._on_optimizer_done,
                    scaled_grads=self._loop.note_scaled_grads,
                    grads_taken=self._on_grads_taken,
                    root_params=lambda: [list(m.parameters())
                                         for m in self._set.models.values()]),
                autocast_dtype=self._precision.scaler_dtype,
                scaler=self._opts.scaler,
                optimizers=self._opts.optimizers,
                param_layer=self._param_layer,
                layer_model=self._layer_model,
            )
            self._sub = subscribe(self._monitor)
            if self._opts.discover:
                self._discovery = GlobalDiscovery(self._wants, self._found, owners=True)
                self._discovery.start()
            if self._opts.anomaly:
                from amp_doctor.anomaly.mode import AnomalyMode

                self._anomaly = AnomalyMode(
                    current_module=self._probes.current_module,
                    step_of=lambda: self.step_index,
                    mode=self._opts.on_nonfinite,
                    allow=self._opts.anomaly_allow,
                    module_name=self._probes.name_of,
                    training_forward=self._probes.in_training_forward,
                    recomputing=self._probes.recomputing,
                )
                self._anomaly.start()
            if self.logdir is not None:
                _make_logdir(self.logdir)
                self._release_logdir = claim_run_dir(self.logdir)
                note = reused_run_note(self.logdir)
                if note is not None:  # the CLI prints it as its own line
                    _warn_at_user(note)
            if self.logdir is not None and self._opts.tensorboard:
                self._tb = self._start_tensorboard(self.logdir)
                if self._tb is not None:
                    self._listeners.append(self._tb.on_step)
            self._set_recording()
            interrupts.hold()
            self._holds_interrupts = True
            threaddeaths.listen(self._on_thread_death)
        except BaseException:
            self._teardown()
            if self._tb is not None:
                self._tb.close()
            self._let_go_of_logdir()
            raise
        _LIVE.add(self)
        return self

    def _start_tensorboard(self, logdir: Path) -> TensorBoardSink | None:
        """The TensorBoard sink, or None with a one-line warning when it cannot start (a
        disk too full for its first record, tensorboard not importable): the run is
        watched all the same, and its JSON and text reports are written."""
        hidden = _module_hidden_by_a_file("tensorboard")
        if hidden is not None:
            # Importing it would run the user's file (and then fail): python imports that
            # file for the script too, so it is left to the script.
            _warn_at_user(f"amp-doctor: TensorBoard is off for this run: {hidden} hides the "
                          "tensorboard package (the script's folder comes first on "
                          "sys.path); the reports are written as usual. To keep it: rename "
                          "that file.")
            return None
        try:
            from amp_doctor.sinks.tensorboard import TensorBoardSink

            return TensorBoardSink(logdir, top_k=self.top_k)
        except UnicodeError as e:
            raise tensorboard_path_error(logdir, e) from None
        except (OSError, ImportError) as e:
            fix = ("pip install tensorboard, or turn TensorBoard off" if isinstance(
                e, ImportError) else "free some space, or turn TensorBoard off")
            _warn_at_user(f"amp-doctor: TensorBoard is off for this run, it could not start "
                          f"({F.error_line(e)}); the reports are written as usual. To keep "
                          f"it: {fix} (--no-tensorboard, watch(tensorboard=False)).")
            return None

    def _forget(self) -> None:
        """In a forked child: remove the hooks and patches, write nothing (see
        :func:`_forget_in_child`); a later :meth:`close` returns what was gathered."""
        self._tb = None  # never touched again: its event file is the parent's
        self._listeners = []
        self.logdir = None
        self.closed = True
        try:
            self._teardown()
        finally:
            self._loop.release()

    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        outcome = "completed"
        if self.stopped_at is not None:
            outcome = "stopped"
        elif exc is not None:
            outcome, error, code = run_ending(exc)
            if code is not None:
                self._run_meta.setdefault("exit_code", code)
            if error is not None:
                self._run_meta.setdefault("error", error)
                self._run_meta.setdefault("error_at", raised_at(exc))
        self._run_meta.setdefault("outcome", outcome)
        self.close()

    @as_own_work
    def close(self) -> Session:
        """Stop watching, remove every hook and patch, and build the session."""
        if self.closed:
            if self.session_ is None:  # a forked child's copy (_forget)
                self.session_ = self._build_session()
            return self.session_
        pending, self._bounds.pending = self._bounds.pending, False
        implicit_last = self._implicit_candidate() and self._loop.backward_reached
        self.closed = True
        _LIVE.discard(self)
        try:
            if pending:
                self._close_step(partial=False)
                self.step_index += self._bounds.pending_iterations
            elif implicit_last:
                # A loop without optimizer or scaler: its last step ends with the run.
                self._bounds.implicit = True
                self._close_step(partial=False)
                self.step_index += 1
            elif self._buffer is not None and self._loop.trained_since_boundary:
                # Training work after the last boundary (a crash mid-step); an
                # evaluation pass after the last step is not a step.
                self._close_step(partial=True)
            # A dropped last forward in a step no branch above ended.
            self._loop.end_dangling(self.step_index)
        finally:
            self._teardown()
            # Leave no reference to the user's tensors behind.
            self._loop.release()
        try:
            self.session_ = self._build_session()
            if self.logdir is not None:
                self._write_outputs(self.session_)
        finally:
            self._let_go_of_logdir()
        return self.session_

    def _discard(self) -> None:
        """:meth:`close` without a report: no JSON, and the TensorBoard files this watch
        made removed (the CLI, for a script that only printed its help)."""
        self.logdir = None
        try:
            self.close()
        finally:
            if self._tb is not None:
                self._tb.discard()

    def _let_go_of_logdir(self) -> None:
        release, self._release_logdir = self._release_logdir, None
        if release is not None:
            release()

    def _attach_wrappers(self, given: nn.Module) -> None:
        """A model compiled before watch(): say so, and never toggle its sublayer hooks.

        Its root hooks still run eagerly around the compiled forward (see
        :func:`~amp_doctor.hooks.probes.run_eagerly_when_called_by_dynamo`).
        """
        assert self._probes is not None
        inner = unwrap(given)
        name = self._probes.name_of(inner)
        wrappers = compile_wrappers(given)
        for w in wrappers:
            self._probes.hook_wrapper(w, inner)
        if name is not None and (wrappers or compiled_by_method(inner)):
            self._probes.freeze(inner)
            self._on_compiled(name, "")

    def _on_compiled(self, name: str, autocast: str) -> None:
        """A watched module runs under torch.compile (``autocast``: "device:dtype" or "")."""
        dev, _, dt = autocast.partition(":")
        if dt:
            # The forward hooks cannot see autocast inside a compiled graph; the
            # trace-time state the graph was compiled for stands in for them.
            self._precision.note_compiled(dev, dt)
        if name in self._compiled_names:
            return
        self._compiled_names.add(name)
        step = self._step_ended if self._step_ended is not None else self.step_index
        self._extra_events.append(Event(
            kind="compiled_model", step=step, module=name,
            data={"severity": "info", "message": f"{name} {COMPILED_NOTE}"}))

    def _teardown(self) -> None:
        # Each removal is independent: one failing must not leave others behind.
        removers = [getattr(owner, method) for owner, method in (
            (self._discovery, "stop"), (self._search, "stop"), (self._probes, "remove"),
            (self._sub, "remove"),
            (self._anomaly, "stop"), (self._fp32, "remove")) if owner is not None]
        for fn in removers:
            try:
                fn()
            except Exception:  # pragma: no cover - best effort on teardown
                pass
        if self._buffer is not None:
            self._buffer.closed = True
        self._buffer = None
        if self._holds_interrupts:
            self._holds_interrupts = False
            interrupts.let_go()
        threaddeaths.stop(self._on_thread_death)

    def _on_thread_death(self, args: Any) -> None:
        """A thread ended with an uncaught exception: if it trained a watched model, its
        training stopped there, which neither the exit code nor the outcome shows."""
        thread = args.thread
        probes = self._probes
        # (SystemExit ends a thread silently; StopRun is --stop-after's own end.)
        if (self.closed or thread is None or probes is None
                or issubclass(args.exc_type, (SystemExit, StopRun))
                or thread.ident not in probes.trainer_threads):
            return
        error = F.error_line(args.exc_value) if args.exc_value is not None else str(
            args.exc_type.__name__)
        self._extra_events.append(Event(kind="thread_died", step=self.step_index, data={
            "severity": "warning", "thread": thread.name, "error": error,
            "message": (
                f"The script's thread {thread.name!r}, which trained the watched model, ended "
                f"with an uncaught exception at step {self.step_index} ({error}): training "
                "in it stopped there. Python prints a thread's traceback and goes on, so "
                "neither the exit code nor the run's outcome shows it."),
            "advice": (
                "Fix the error (the thread's traceback is printed above the report). For a "
                "run that fails when its training thread dies, keep the exception in the "
                "thread and re-raise it in the main thread after `join()`."),
        }))

    # -- public API ------------------------------------------------------------
    @as_own_work
    def step(self) -> None:
        """Mark the end of a training step yourself (custom loops).

        Once called, automatic boundaries at ``GradScaler.update`` and
        ``optimizer.step`` are ignored for this watch. A first call right
        after such an automatic boundary (``scaler.update(); doctor.step()``)
        ends the same step, so it is not counted twice.
        """
        mon = self._monitor
        if mon is not None and not mon.manual_steps:
            mon.manual_steps = True
            if self._bounds.idle:
                self._take_pending_boundary()
                return
        self._bounds.pending = False
        self._boundary()

    @property
    @as_own_work
    def session(self) -> Session:
        """The finished session (after close), or a snapshot of the run so far."""
        if self.session_ is not None:
            return self.session_
        return self._build_session()

    @as_own_work
    def report(self, **kwargs: Any) -> str:
        from amp_doctor.sinks.text import render_text

        return render_text(self.session, **kwargs)

    def set_run_meta(self, **kw: Any) -> None:
        """Used by the CLI to record the command, exit code and outcome."""
        self._run_meta.update(kw)

    @property
    def fp32_islands(self) -> Any:
        """The float32 forcing (``fp32=``), or None."""
        return self._fp32

    def add_listener(self, fn: StepListener) -> None:
        """Call ``fn(record, rows)`` after each recorded step (:mod:`amp_doctor.steps.folder`)."""
        self._listeners.append(fn)

    # -- discovery (the CLI's way in) ------------------------------------------
    @as_own_work
    def add_model(self, model: nn.Module, name: str | None = None) -> None:
        """Watch one more root model. With several, every layer name gets its model's prefix."""
        given = model
        model = unwrap(model)
        probes = self._probes
        if probes is None or probes.watches(model):
            return
        name = name if name is not None else type(model).__name__
        prefix = self._set.replaced(model, name, self._idle_root)
        if prefix is not None:
            self._replace_root(prefix, model, name, given)
            return
        # Roots found before it that are part of it (``model.visual(x)`` called by itself
        # under no_grad before training; review 51): its layers, under its names.
        parts = [] if probes.trained_any() else [
            m for m in self._set.models.values()
            if m is not model and not any(m is g for g in self._set.given.values())
            and any(m is sub for sub in model.modules())]
        old: dict[int, str] = {}
        for part in parts:
            old.update(probes.forget_root(part))
            self._set.remove(part)
        added = self._set.add(model, name)
        if added.renamed is not None:
            self._rename(probes.rename_root(*added.renamed))
        probes.add_root(added.prefix, model)
        if old:
            self._rename({was: now for mid, was in old.items()
                          if (now := probes.name_of_id(mid)) is not None and now != was})
        self._attach_wrappers(given)
        if self._monitor is not None:
            self._monitor.models_changed()
        if self._fp32 is not None:
            # Names may have changed (a second model prefixes the first): match anew.
            self._fp32.reattach(self.models)

    def _idle_root(self, model: nn.Module) -> bool:
        """The watched root ``model`` trained in an earlier step, and not in this one."""
        rid = id(model)
        return rid in self._bounds.trained_roots and rid not in self._bounds.step_roots

    def _replacement_wanted(self, module: nn.Module) -> bool:
        """The loop's top-level call of ``module`` may be a watched model's new object
        (see :mod:`amp_doctor.hooks.replacement`): training, not watched, of a watched
        model's class."""
        probes = self._probes
        if probes is None or self.closed or not torch.is_grad_enabled():
            return False
        model = unwrap(module)
        return (not probes.watches(model)
                and any(type(model) is type(m) for m in self._set.models.values()))

    def _found_replacement(self, module: nn.Module, name: str | None,
                           args: tuple[Any, ...] | None, called: nn.Module | None = None
                           ) -> tuple[Any, ...] | None:
        """Take ``module`` as the new object of the idle watched model of its architecture,
        if there is one; returns the inputs its call under way should take instead."""
        model = unwrap(module)
        prefix = self._set.replaced(model, None, self._idle_root)
        if prefix is None:
            return None
        mon = self._monitor
        if (self._loop.backward and not self._bounds.step_roots
                and mon is not None and mon.stepped_unwatched):
            # An update since the last step ended, of a backward with no watched model in
            # it, and no end of that step seen (its optimizer and a new GradScaler step
            # what is only now found to be the watched model's): it was a step all the
            # same. (Backward passes without an update are an accumulation window the
            # new model's forward continues: no step ended.)
            self._boundary()
        missed = self._search.taken()
        self._replace_root(prefix, model, name or type(model).__name__, module, missed)
        return self._join_call(model, args)

    def _replace_root(self, prefix: str, model: nn.Module, name: str,
                      given: nn.Module, missed: tuple[int, int] | None = None) -> None:
        """``model`` replaced the watched root at ``prefix`` (see ``ModelSet.replaced``):
        one model, under its names, whose layers' figures run on. The step boundaries
        follow it: left with the old object as the step's first model, the new one's
        forward right after a boundary looked like a second model training in the same
        iteration (a GAN's), and every later step ended one update late (review 56a)."""
        assert self._probes is not None
        old = self._set.replace(prefix, model, name)
        self._probes.replace_root(old, model)
        bounds = self._bounds
        if bounds.lead_root == id(old):
            bounds.lead_root = id(model)
        for roots in (bounds.trained_roots, bounds.step_roots):
            if id(old) in roots:
                roots.discard(id(old))
                roots.add(id(model))
        self._attach_wrappers(given)
        if self._monitor is not None:
            self._monitor.models_changed()  # its new optimizer holds the new parameters
        if self._fp32 is not None:
            self._fp32.reattach(self.models)
        of_type = f" ({type(model).__name__})" if name != type(model).__name__ else ""
        since = missed[0] if missed is not None else self.step_index
        lost = ""
        if missed is not None:
            steps = (f"step {missed[0]}" if missed[1] == 1
                     else f"steps {missed[0]}-{missed[0] + missed[1] - 1}")
            lost = (f" The watch found the new object by its class and architecture in step "
                    f"{self.step_index}; {steps} trained it before that, and none of its "
                    "layers was recorded there.")
        self._extra_events.append(Event(
            kind="model_replaced", step=since, module=prefix or None, data={
                "severity": "info", "name": name,
                "missed_steps": list(missed) if missed is not None else None,
                "message": (f"`{name}`{of_type} was replaced at step {since} by a new "
                            "object of the same architecture (a model reloaded from a full "
                            "checkpoint, a copy, or one built anew, as for the next fold of "
                            "k-fold training): it is reported as one model, its layers' "
                            f"figures running on under the same names.{lost}"),
                "advice": ("Nothing to fix: a note on why the model's figures run on across "
                           "the swap.")}))

    def _rename(self, mapping: dict[str, str]) -> None:
        if not mapping:
            return
        self._folder.rename(mapping)
        if self._buffer is not None:
            self._buffer.rename(mapping)
        if self._monitor is not None:
            self._monitor.rename_layers(mapping)

    def _wants(self, module: nn.Module) -> bool:
        """A module the loop calls is a new root model (discovery)."""
        probes = self._probes
        if (probes is None or self.closed or probes.watches(module)
                or is_parametrization(module) or next(module.parameters(), None) is None):
            return False
        # Once training ran, a module first called without grad is inference of a model
        # that is not trained (a deep copy checked after training, an EMA copy, a
        # reloaded checkpoint): adopting it would rename every layer of the trained one
        # ("model.enc.fc2"). It is found if it ever runs a forward with grad.
        return torch.is_grad_enabled() or self.step_index == 0 or not probes.trained_any()

    def _found(self, module: nn.Module, name: str | None, args: tuple[Any, ...] | None,
               called: nn.Module | None = None) -> tuple[Any, ...] | None:
        """Watch a model the loop called (``called``: the part of it the loop called);
        returns the inputs the call under way should take instead (a forced ``fp32``
        model's, cast up), or None."""
        self.add_model(module, name)
        if called is None:
            return self._join_call(module, args)
        if args is None or self._probes is None:
            return None
        self._probes.join_part_call(called, args)
        return self._fp32.enter_call(called, args) if self._fp32 is not None else None

    def _join_call(self, module: nn.Module, args: tuple[Any, ...] | None
                   ) -> tuple[Any, ...] | None:
        """A model just watched, found in its own call: the call joins the step as its
        hooks would have made it (``args`` None: found before the call)."""
        if args is None:
            return None
        # This call's own pre-hooks were collected before we added ours.
        if self._probes is not None:
            self._probes.note_root_call(module)
        self._on_root_forward(module, args)
        return self._fp32.enter_call(module, args) if self._fp32 is not None else None

    # -- hook callbacks ------------------------------------------------------
    def _layer_formats(self, run_format: str) -> dict[str, FormatLimits]:
        """The layers whose outputs ran in another low-precision format than the run's
        (a bfloat16 generator beside a float16 discriminator): judged against their own."""
        if self._probes is None:
            return {}
        return {name: limits(parse_dtype(own)) for name, meta in self._probes.layers.items()
                if (own := judged_format(meta.output_dtypes, run_format)) != run_format}

    def _current_buffer(self) -> StepBuffer | None:
        # None once closed: another thread's forward may still be in a hook then.
        return self._buffer

    def _layer_metas(self) -> dict[str, Any]:
        return self._probes.layers if self._probes is not None else {}

    def _on_root_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A forward starts at ``module``: a watched model, or a submodule of one that
        the loop calls itself (counted as its model's call)."""
        # (A model run whole through a reentrant checkpoint trains under no_grad.)
        rows: torch.Tensor | None = None  # the batch's (min, max) rows, once checked
        grad_on = (torch.is_grad_enabled() or in_reentrant_checkpoint()) and not _in_backward()
        training = grad_on and (module.training or self._eval_trains_since is not None)
        if grad_on and not module.training:
            self._eval_grad_forward = True
        if not training and self._probes is not None and self._probes.in_companion_call():
            # A frozen teacher run first in the iteration: the step starts with it, or
            # its work would be filed into the step before.
            if self._take_pending_boundary():
                self._probes.apply_armed()
            # Its batch is the step's data, and its output is checked when it returns: what
            # the loop makes from it for the trained model is not data (review 49b).
            self._companion = id(module)
            self._loop.check_input(args, self._probes.name_of(module) or self._set.label(),
                                   recorded=self._buffer is not None)
        if training:
            root = self._probes.root_id(module) if self._probes is not None else id(module)
            self._bounds.trained_roots.add(root)
            if self._bounds.lead_root is None:
                self._bounds.lead_root = root
            elif root != self._bounds.lead_root and self._bounds.idle:
                # Right after the boundary, another model trains: same iteration.
                self._bounds.defer = True
            if root == self._bounds.lead_root and self._take_pending_boundary():
                if self._probes is not None:
                    # Before any sublayer ran: hooking or unhooking them loses nothing.
                    self._probes.apply_armed()
            elif (self._implicit_candidate() and self._loop.backward_reached
                  and self._loop.updated()):
                self._implicit_boundary()
            elif self._skip_candidate() and self._loop.dropped_update():
                # The loop dropped the last iteration's update (no optimizer step since its
                # backward, and its gradients were reset: `if torch.isfinite(norm):
                # opt.step()`). That iteration was a step all the same.
                self._update_dropped = True
                try:
                    self._boundary()
                finally:
                    self._update_dropped = False
                if self._probes is not None:
                    self._probes.apply_armed()  # before any sublayer ran
            if root == id(module) == self._bounds.lead_root and not self.closed:
                # After the boundary: this forward is the new step's.
                self._loop.dropped.started(root, self._probes.name_of(module)
                                           if self._probes is not None else None)
            self._bounds.step_roots.add(root)
            self._loop.train_forward = True
            self._bounds.idle = False
            name = self._probes.name_of(module) if self._probes is not None else None
            rows = self._loop.check_input(args, name or self._set.label(),
                                          recorded=self._buffer is not None)
        if self._anomaly is not None and self._probes is not None:
            self._anomaly.check_inputs(self._probes.name_of(module) or type(module).__name__, args,
                                       module, rows=rows)
        self._precision.note_forward(module, args)

    def _on_root_output(self, module: nn.Module, output: Any) -> None:
        """A watched model (or a submodule the loop calls itself) returned ``output``."""
        if self.closed:
            return
        self._loop.batches.note_output(output)
        if self._companion == id(module):
            self._companion = None
            name = self._probes.name_of(module) if self._probes is not None else None
            made = self._loop.batches.check_output(output, name or self._set.label())
            if made is not None and self._anomaly is not None:
                self._anomaly.note_made(name or type(module).__name__, made)
        if self._bounds.lead_root == id(module):
            self._loop.dropped.ended(output, id(module))

    def _on_scale(self, scale: torch.Tensor | None, outputs: Any) -> None:
        buf = self._buffer
        if buf is None:
            return
        if scale is not None:
            buf.put_scalar(GRAD_SCALE_KEY, scale.clone())
        ts = [t for t in iter_tensors(outputs) if t.is_floating_point() and t.numel() >= 1]
        if ts:
            loss = ts[0].detach().float().mean()
            if self._loop.continues_loss("loss") and buf.has_scalar("loss"):
                buf.add_scalar("loss", loss)
            else:
                buf.put_scalar("loss", loss)

    def _on_param_grads(self, params: list[torch.Tensor], scale: float | None) -> None:
        self._loop.optimizer_stepped()
        if self._anomaly is not None and not in_closure_step():
            # (A closure computes them inside the step: the boundary's check reads them.)
            self._anomaly.note_stepped(params, scaled=scale is not None)
        buf = self._buffer
        if buf is None or self._probes is None:
            return
        if not buf.param_grads_done:
            # A host flag, not a tensor: a CPU tensor copied to the GPU would sync.
            buf.param_grads_scaled = bool(scale)
        self._probes.summarize_param_grads(params, buf)
        # The optimizer step comes next, and with it the user's own allocations
        # (Adam's state on the first step): the stage is not held through it.
        buf.release()
        if scale is None:
            self._loop.snapshot_low_params(params)

    def _on_unscaled(self, found: list[torch.Tensor]) -> None:
        if self._anomaly is not None and not in_closure_step():
            self._anomaly.note_found_inf(found)

    def _on_step_after_unscale(self, params: list[torch.Tensor],
                               found: list[torch.Tensor]) -> None:
        if self._probes is None:
            return
        with own_ops:
            got = self._probes.grads_after_unscale(params, found,
                                                   named=self._buffer is not None)
            if got is None:
                return
            bad, first, layers = got
            # Every step: the run's first such step, read with a recorded step's copy or
            # at the end; a recorded step also keeps which layer's gradient was first.
            self._loop.note_applied(bad, self.step_index)
            buf = self._buffer
            if buf is not None:
                buf.add_applied_after_unscale(bad, first, layers)

    def _on_skip(self, params: list[torch.Tensor]) -> None:
        """A GradScaler skipped a step: name the layers whose grads are not finite."""
        probes = self._probes
        if self._buffer is not None or probes is None:
            return  # a recorded step names culprits from its own summaries
        mon = self._monitor
        found = skip_culprits(params, probes.param_owner, lambda n: probes.layers[n].order,
                              self._loop.loss_flag(),
                              mon.clip_norms() if mon is not None else [])
        if found is not None:
            culprits, loss_bad = found
            # Two scalers skipping in one step (a GAN's), or one scaler skipping two
            # optimizers: both skips' layers, each timeline keeps its own models'
            # (AmpMonitor._own_culprits), in backward order across them as within each.
            merged = list(dict.fromkeys([*(self._pending_culprits or []), *culprits]))
            if self._pending_culprits:
                merged.sort(key=lambda n: -probes.layers[n].order)
            self._pending_culprits = merged
            if loss_bad is not None:
                self._pending_loss_bad = loss_bad

    # -- what the loop does (step boundaries without optimizer, losses) -------
    def _lp_param(self, i: int) -> tuple[str | None, str]:
        """The layer and dtype of the ``i``-th low-precision parameter the last update's
        check sampled (see ``LoopSignals.measure_low_params``)."""
        params = self._loop.lp_params
        if not 0 <= i < len(params):
            return None, ""
        return self._param_layer(params[i]), dtype_name(params[i].dtype)

    def _layer_model(self, name: str) -> int | None:
        """The watched model (its id) that layer ``name`` belongs to."""
        meta = self._probes.layers.get(name) if self._probes is not None else None
        return meta.root if meta is not None else None

    def _param_layer(self, p: torch.Tensor) -> str | None:
        """The layer that holds parameter ``p``, by its name now."""
        return self._probes.param_owner.get(id(p)) if self._probes is not None else None

    def _owns(self, p: torch.Tensor) -> bool:
        return self._set.owns(p, self.step_index, self._refresh_layer_params)

    def _refresh_layer_params(self) -> None:
        """Parameter objects were swapped: the layers' parameter lists follow."""
        probes = self._probes
        if probes is None:
            return
        for model in self.models.values():
            for mod in model.modules():
                name = probes.name_of(mod)
                meta = probes.layers.get(name) if name else None
                if meta is None:
                    continue
                meta.params = own_params(mod)
                for q in meta.params:
                    probes.param_owner.setdefault(id(q), name)  # type: ignore[arg-type]

    def _on_backward(self, roots: list[torch.Tensor]) -> None:
        """Before a backward: note on the device whether its loss is NaN/inf."""
        if not self.closed:
            self._loop.note_loss(roots)

    def _on_backward_done(self, roots: list[torch.Tensor]) -> None:
        self._loop.backward = True
        self._bounds.idle = False
        if self._bounds.trained_roots and not self._bounds.step_roots and not self.closed:
            if self._eval_grad_forward and self._eval_trains_since is None:
                # The model trains in eval mode: model.eval() for a validation pass, and
                # no model.train() after it. Its forwards are this loop's training ones.
                self._eval_trains_since = self.step_index
                self._extra_events.append(_eval_mode_event(self.step_index))
            else:
                self._search.untrained_backward(self.step_index)
        if self._probes is not None:
            self._probes.backward_ran()
        if self._implicit_candidate():
            # Only where no optimizer or scaler ends the steps: does this backward
            # reach the watched parameters (a training step), or another model's?
            self._loop.backward_done(roots, self._owns, self._set.first_grad)
        elif self._skip_candidate():
            self._loop.backward_since_update(self._set.first_grad)

    def _on_grads_taken(self, outputs: list[torch.Tensor], inputs: list[Any],
                        grads: list[Any], scaled: bool) -> None:
        """``torch.autograd.grad(loss, params)``: where no optimizer or scaler ends the
        steps and it took the watched weights' gradients, a training step's backward (a
        loop that updates them by hand: ``p -= lr * g``), and on a recorded step those
        gradients are the weights' gradients. One for the inputs of a gradient penalty,
        or inside a step an optimizer ends, is none."""
        if not self._implicit_candidate():
            return
        pairs = [(p, g) for p, g in zip(inputs, grads, strict=True)
                 if isinstance(p, torch.Tensor) and self._owns(p)
                 and (g is None or isinstance(g, torch.Tensor))]
        if not pairs:
            return
        self._on_backward(outputs)
        self._on_backward_done(outputs)
        self._loop.grads_taken([p for p, _ in pairs])
        buf = self._buffer
        if buf is not None and self._probes is not None:
            if not buf.param_grads_done:
                buf.param_grads_scaled = scaled
            self._probes.summarize_param_grads([p for p, _ in pairs], buf,
                                               [g for _, g in pairs])

    def _implicit_candidate(self) -> bool:
        """No optimizer step, scaler update or ``doctor.step()`` ends the steps."""
        mon = self._monitor
        return (mon is not None and not self.closed and not mon.manual_steps
                and not mon.drives_steps and not mon.stepping)

    def _skip_candidate(self) -> bool:
        """An optimizer or scaler ends the steps, and nothing else does (no
        ``doctor.step()``, no closure running)."""
        mon = self._monitor
        return (mon is not None and not self.closed and not mon.manual_steps
                and mon.drives_steps and not mon.stepping)

    def _implicit_boundary(self) -> None:
        # A hand-written update (``p.add_(p.grad, alpha=-lr)``): a new training
        # forward after a backward that reached the watched parameters.
        self._bounds.implicit = True
        self._boundary()
        if self._probes is not None:
            # Called from the root's pre-hook, before any sublayer ran: hooking or
            # unhooking them now loses no post-hook.
            self._probes.apply_armed()

    def _on_optimizer_done(self, params: list[torch.Tensor]) -> None:
        """After a plain optimizer step on a recorded step: did low-precision weights move?"""
        self._loop.measure_low_params(self._buffer)

    # -- step boundary ---------------------------------------------------------
    def _set_recording(self) -> None:
        rec = self.step_index % self.every == 0 and (
            self.max_steps is None or self.recorded < self.max_steps
        )
        if self._probes is None:
            return
        self._probes.new_step()
        self._probes.recording = rec and not self.closed
        # Anomaly mode's op-level search names modules, so it needs the module stack.
        self._probes.set_armed(not self.closed and (self._probes.recording or (
            self._anomaly is not None and self._anomaly.wants_modules)))
        self._buffer = (StepBuffer(self.step_index, self._filed_last)
                        if self._probes.recording else None)

    def _auto_boundary(self, iterations: int = 1) -> None:
        """A step boundary seen in the loop (``scaler.update``, ``optimizer.step``),
        ending a step that held ``iterations`` of the loop's iterations.

        Once the loop showed that another model trains after it in the same
        iteration (two models, two GradScalers), it takes effect at the next
        forward of the step's first model (or at close), so that the second
        model's work still belongs to this step.
        """
        if self.closed:
            return
        if not self._bounds.defer and not self._others_yet_to_train():
            self._boundary(iterations)
            self._bounds.idle = True
            return
        if self._bounds.pending:
            # Two boundaries and no forward of the step's first model in between
            # (a loop that calls submodules directly): the first one ends its step now.
            self._boundary(self._bounds.pending_iterations)
        self._bounds.pending = True
        self._bounds.pending_iterations = iterations
        self._bounds.idle = True

    def _others_yet_to_train(self) -> bool:
        """Another watched model with trainable parameters has not trained yet: it may
        train next in this very iteration (two models, two optimizers), so the first
        boundary waits like a deferred one instead of splitting the first iteration.
        If the step's first model comes back first, the boundary is taken there. Only
        the first step asks (the answer is learned then), so no step pays for the scan."""
        if self.step_index > 0 or len(self._set.models) < 2:
            return False
        return any(id(m) not in self._bounds.trained_roots
                   and any(p.requires_grad for p in m.parameters())
                   for m in self._set.models.values())

    def _take_pending_boundary(self) -> bool:
        if not self._bounds.pending:
            return False
        self._bounds.pending = False
        self._boundary(self._bounds.pending_iterations)
        return True

    def _boundary(self, iterations: int = 1) -> None:
        if self.closed:
            return
        trained = bool(self._bounds.step_roots)
        backward = self._loop.backward and bool(self._bounds.trained_roots)
        ended = self.step_index
        self._eval_grad_forward = False
        try:
            self._finish_step(partial=False)
        finally:
            # The next step starts even if the last one could not be folded (an
            # internal error, reported by the patch hub): its hooks get a new buffer.
            self.step_index += iterations
            # What the probes find of the step that ended (a model compiled in it) is its.
            self._step_ended = ended
            try:
                self._set_recording()
            finally:
                self._step_ended = None
            self._loop.new_step()
            self._bounds.idle = False
            self._bounds.step_roots.clear()
            if self._bounds.trained_roots:
                self._search.step_ended(ended, trained, backward)
        if self._opts.stop_after is not None and self.step_index >= self._opts.stop_after:
            self.stopped_at = self.step_index
            raise StopRun(self.step_index)

    def _close_step(self, partial: bool) -> None:
        """:meth:`_finish_step` at close: an internal error there must cost the user
        neither their run nor the report of the steps before, so it becomes an
        ``internal_error`` event of the report instead of an exception."""
        try:
            self._finish_step(partial)
        except Exception as e:
            if os.environ.get("AMP_DOCTOR_DEBUG"):
                raise
            self._extra_events.append(
                Event(kind="internal_error", step=self.step_index, data={"error": repr(e)}))

    def _finish_step(self, partial: bool) -> None:
        """End the current step: fold its record (if recorded), then its scaler outcome."""
        with own_ops:
            mon = self._monitor
            outcome = mon.take_outcome() if mon is not None else None
            skipped = bool(outcome and outcome.skipped) or (mon is not None and mon.other_skipped())
            culprits = self._pending_culprits or []
            loss_bad, self._pending_loss_bad = self._pending_loss_bad, None
            self._pending_culprits = None
            step = self.step_index
            # Detached first: a buffer is flushed once, even if folding it fails below.
            buf, self._buffer = self._buffer, None
            self._loop.dropped.resolve()  # its forwards no backward reached
            if self._anomaly is not None:
                self._anomaly.end_step(skipped=skipped, recorded=buf is not None,
                                       loss_bad=self._loop.loss_flag(),
                                       dropped_bad=self._loop.dropped.step_flag())
            input_module = self._loop.input_module
            flags = self._loop.end_step(step, recorded=buf is not None, skipped=skipped)
            if loss_bad is not None:
                self._folder.note_loss(step, loss_bad, skipped)
            origin = None
            if buf is not None:
                for key, flag in flags.items():
                    buf.put_scalar(key, flag)
                # Not in a step no scaler worked in: the scale it kept is none of this step's.
                for key, t in (mon.scale_tensors() if mon is not None and outcome is not None
                               and outcome.scaler_used else {}).items():
                    buf.put_scalar(key, t)
                flagged = self._anomaly.flagged_count() if self._anomaly is not None else None
                if flagged is not None:
                    buf.put_scalar("anomaly_flagged", flagged)
                hs = buf.flush()
                # The model given the step's bad batch, when one was (else the first given
                # one): a GAN's discriminator's data, not the generator's noise.
                input_module = self._loop.batches.module_of(
                    hs.scalars.get(INPUT_BAD_CODE)) or input_module
                mask = mask_codes(hs.scalars.get(INPUT_BAD_CODES, 0.0))
                # (The catch-all code: which inputs were bad is not known.)
                input_codes = (self._loop.batches.describe(mask)
                               if mask and MASK_CODES not in mask else None)
                if self._anomaly is not None:
                    self._anomaly.resolve(hs.scalars.get("anomaly_flagged"))
                self.recorded += 1
                real_scale = hs.scalars.get("scale_after")
                if mon is not None and real_scale is not None:
                    tracker = hs.scalars.get("growth_tracker")
                    mon.correct_scale(real_scale, int(tracker) if tracker is not None else None)
                    if outcome is not None:
                        outcome.scale_after = real_scale
                run_fmt = self._precision.low_dtype()
                folded = self._folder.fold(
                    hs, fmt=limits(run_fmt), formats=self._layer_formats(dtype_name(run_fmt)),
                    param_grads_scaled=buf.param_grads_scaled, skipped=skipped,
                    after_unscale_layers=buf.after_unscale_layers,
                    scale=outcome.scale_after if outcome else None,
                    check_input=self._anomaly is None, input_module=input_module,
                    input_codes=input_codes,
                    lp_param=self._lp_param, update_dropped=self._update_dropped)
                if folded.loss_bad is not None:
                    loss_bad = folded.loss_bad
                if skipped:
                    culprits, origin = folded.culprits, folded.forward_origin
                for fn in self._listeners:
                    try:
                        fn(folded.record, hs)
                    except Exception as e:  # a sink failing must not stop training
                        self._extra_events.append(
                            Event(kind="internal_error", step=step, data={"error": repr(e)}))
            if mon is not None and outcome is not None and not partial:
                mon.end_step(step, outcome, recorded=buf is not None, culprits=culprits,
                             forward_origin=origin, loss_nonfinite=loss_bad)
                if self._tb is not None:
                    try:  # live scaler charts; a sink failing must not stop training
                        self._tb.on_scaler_step(step, outcome)
                    except Exception as e:
                        self._extra_events.append(
                            Event(kind="internal_error", step=step, data={"error": repr(e)}))

    # -- session ---------------------------------------------------------------
    def _build_session(self) -> Session:
        from amp_doctor.analysis.analyze import analyze

        probes = self._probes
        layers = []
        if probes is not None:
            ops = self._anomaly.op_dtypes() if self._anomaly is not None else {}
            layers = self._folder.summaries(probes.layers, ops)
        mon = self._monitor
        timeline = mon.timeline() if mon is not None else None
        events = mon.events() if mon is not None else []
        anomaly = self._anomaly
        dropped_inputs = anomaly is not None and anomaly.saw_dropped_inputs
        # The run's one read of its batch checks, dropped forwards and NaN/inf losses.
        self._totals = self._loop.run_totals(
            want_loss=self._folder.any_loss_bad or dropped_inputs)
        if self._totals.applied_first is not None:
            self._folder.note_applied_first(self._totals.applied_first)
        if anomaly is not None:
            events.extend(anomaly.events(training_clean=dropped_inputs and self._ended_well()
                                         and not self._folder.any_loss_bad
                                         and self._totals.loss_bad == 0))
        self._extra_events.extend(self._batch_events())
        self._extra_events.extend(self._beyond_events())
        events.extend(self._extra_events)
        events.extend(self._loop_events())
        scaler_on = bool(timeline and timeline.enabled)
        low = (dtype_name(self._precision.low_dtype())
               if self._precision.low_precision_seen else None)
        amp = AmpConfig(
            device_type=self._precision.device_type,
            dtype=low,
            scaler=scaler_on,
            autocast_seen=self._precision.autocast_seen,
            other_dtypes=[d for d in self._precision.autocast_dtypes()
                          if d != low and d in LOW_PRECISION_NAMES] if low else [],
        )
        rm = self._run_meta
        run = RunInfo(
            torch_version=torch.__version__,
            started=self._started[1],
            duration_s=round(time.perf_counter() - self._started[0], 3),
            every=self.every,
            models=self._set.names(),
            command=rm.get("command"),
            exit_code=rm.get("exit_code"),
            outcome=rm.get("outcome", "completed" if self.closed else "running"),
            error=rm.get("error"),
            error_at=rm.get("error_at"),
            rank=rm.get("rank"),
            world_size=rm.get("world_size"),
            fp32_modules=self._fp32.ran() if self._fp32 is not None else [],
            fp32_not_run=self._fp32.not_run() if self._fp32 is not None else [],
            fp32_containers=dict(self._fp32.containers) if self._fp32 is not None else {},
            target_dtype=self._opts.target_dtype,
        )
        history = list(self._folder.history.records)
        if timeline is not None:
            # A skip the step's end could not read (an optimizer whose skip GradScaler
            # decides on the device, as Accelerate's wrapper: its flags are read later)
            # is in the timeline: the step's record says so too.
            late = set(timeline.skipped_steps)
            history = [dataclasses.replace(r, skipped=True)
                       if not r.skipped and r.step in late else r for r in history]
        draft = Session(
            version=__version__, amp=amp, steps=self.step_index, recorded_steps=self.recorded,
            layers=layers, scaler=timeline, history=history,
            events=events, findings=[], run=run,
            other_scalers=mon.other_timelines() if mon is not None else [],
            heatmaps=self._folder.aggregates.heatmaps(),
        )
        return Session(**{**draft.__dict__, "findings": analyze(draft)})

    def _loop_events(self) -> list[Event]:
        """What the loop itself showed: NaN losses, how steps were counted, frozen weights."""
        # The exact count costs a sync: only in a run whose loss went NaN/inf.
        total = self._totals.loss_bad if self._folder.any_loss_bad else None
        if total and self._totals.loss_first is not None:
            self._folder.loss_first = self._totals.loss_first
        out = self._folder.loss_events(
            self.step_index, anomaly=self._anomaly is not None,
            counted=None if total is None else (total, self._loop.loss_steps))
        for e in out:
            e.data["loss_dtypes"] = sorted(dtype_name(d) for d in self._loop.loss_dtypes)
        got = self._totals.batches
        if got is not None and got.made_by is not None and not got.data_bad:
            for e in out:
                if (e.kind == "nonfinite_loss" and e.data.get("recorded_at") is None
                        and not e.data.get("began_unrecorded")):
                    # No recorded step showed it: the model called under no_grad whose
                    # output went bad from a finite batch in its first step.
                    e.data["made_output"] = {"module": got.made_by, "step": got.made_first,
                                             "steps": got.made_steps}
        mon = self._monitor
        metas = self._probes.layers.values() if self._probes else []
        if (self._probes is not None and (self.step_index or self._loop.backward)
                and not self._compiled_names and not self._probes.scripted_roots
                and not any(m.calls for m in metas)):
            # Training went on, but no hook of the watched model ever ran: "autocast was
            # not active" or "no step ended" (an optimizer of another model's weights)
            # would be guesses about a forward nobody saw.
            out.append(Event(kind="model_not_run", step=0, data={
                "steps": self.step_index, "backward": self._loop.backward,
                "compiled": dynamo_compiled_something()}))
        elif (stopped := self._search.stopped()) is not None:
            out.append(Event(kind="model_stopped", step=stopped[0], data={
                "steps": stopped[1], "total": self.step_index, "uncounted": stopped[2],
                "searched": not self._opts.discover}))
        elif self._bounds.implicit:
            out.append(Event(kind="steps_from_backward", step=0, data={
                "steps": self.step_index, "severity": "info"}))
        elif (mon is not None and self.step_index == 0 and not mon.manual_steps
              and (self._loop.backward or self.recorded)):
            out.append(Event(kind="no_step_boundary", step=0, data={
                "backward": self._loop.backward,
                "foreign_optimizers": mon.registry.foreign_optimizers()}))
        out.extend(self._dropped_events())
        return out + self._folder.lowp_events(d for m in metas for d in m.param_dtypes)

    def _ended_well(self) -> bool:
        """The run completed, or was stopped on purpose: not ended on an error."""
        return self._run_meta.get("outcome", "completed") in ("completed", "stopped")

    def _batch_events(self) -> list[Event]:
        """The batches of unrecorded steps that held NaN/inf (see
        :mod:`amp_doctor.steps.batches`): they join the recorded steps' ``nonfinite_input``
        finding when both are harmful (or both harmless), or make one of their own: an
        input the model handles (info) and another it does not (an error) are two causes.
        Anomaly mode names them itself, with their line."""
        got = self._totals.batches
        if got is None or self._anomaly is not None or not got.data_bad:
            return []
        harmful = got.harmful
        data = {"unrecorded_steps": harmful, "unrecorded_first": got.first_harmful,
                "unrecorded_dropped": got.dropped, "unrecorded_harmless": got.harmless,
                "unrecorded_harmless_first": got.first_harmless,
                "loss_first_bad": got.first_loss_bad,
                **({"input": input_label(got.input_key), "inputs": got.inputs}
                   if got.inputs > 1 else {})}
        seen = next((e for e in self._extra_events if e.kind == "nonfinite_input"
                     and e.data.get("detected") == "recorded step"), None)
        if seen is not None and bool(seen.data.get("harmful")) == bool(harmful):
            seen.data.update(data)
            seen.data["nan"] = bool(seen.data.get("nan") or got.nan)
            seen.data["inf"] = bool(seen.data.get("inf") or got.inf)
            if harmful and got.first_harmful < (seen.step or 0):
                seen.data["recorded_first"] = seen.step
                i = self._extra_events.index(seen)
                self._extra_events[i] = dataclasses.replace(seen, step=got.first_harmful)
            return []
        if (seen is not None and not harmful and got.inputs == 1
                and got.module == seen.module and seen.data.get("harmful")):
            # The model's one input went bad in unrecorded steps whose loss stayed finite:
            # it handles such values, and what went wrong in a recorded step with one (a
            # GradScaler calibrating, a layer's overflow) was another cause's (review 49b:
            # log-features with -inf the model clamps).
            seen.data.update(data, harmful=0, severity="info")
            return []
        if seen is not None and not harmful:
            return []  # a recorded step's error already; the harmless rest changes nothing
        first = got.first_harmful if harmful else got.first_harmless
        # Only forwards no backward reached went bad with it, and no loss of the run did:
        # the loop dropped them (or they were an evaluation with grad on), and training
        # took none of it (review 49a). Not in a run that ended on an error: a loop that
        # raises on a NaN loss before backward ended there.
        dropped_only = (bool(harmful) and got.dropped == harmful and got.first_loss_bad < 0
                        and self._ended_well())
        ev = Event(kind="nonfinite_input", step=first, module=got.module or self._set.label(),
                   data={**data, "nan": got.nan, "inf": got.inf, "detected": "unrecorded step",
                         "occurrences": harmful or got.harmless, "harmful": harmful,
                         **({} if harmful else {"severity": "info"}),
                         **({"dropped_only": True, "severity": "warning"} if dropped_only
                            else {})})
        if seen is not None:
            # Before the recorded steps' harmless one: a model's events of one kind are one
            # finding, made from the first (the input it handles is not the cause).
            self._extra_events.insert(self._extra_events.index(seen), ev)
            return []
        return [ev]

    def _beyond_events(self) -> list[Event]:
        """A batch with finite values beyond float16's max in unrecorded steps whose loss
        went NaN/inf (autocast's cast of them is inf; see :mod:`amp_doctor.steps.batches`):
        the finding anomaly mode's per-step check makes, when no recorded step's fold
        made one (and not in anomaly mode, which makes its own)."""
        got = self._totals.batches
        if (got is None or got.beyond_module is None or self._anomaly is not None
                or any(e.kind == "input_beyond_format" for e in self._extra_events)):
            return []
        listed = list(got.beyond_listed)
        return [Event(kind="input_beyond_format", step=listed[0] if listed else 0,
                      module=got.beyond_module, data={
                          "absmax": got.beyond_absmax, "dtype": FLOAT16,
                          "max": FORMAT_MAX[FLOAT16], "occurrences": got.beyond_steps,
                          "steps": listed, "from_step_check": True,
                          "detected": "unrecorded step",
                          **({"input": input_label(got.beyond_key)}
                             if len(self._loop.batches.keys_of(got.beyond_module)) > 1
                             else {})})]

    def _batch_handled_at(self) -> int | None:
        """The first step whose batch held NaN/inf while the loss stayed finite: the model
        takes such batches in its stride (it replaces missing values), or None."""
        got = self._totals.batches
        steps = [s for s in (self._folder.bad_input_harmless,
                             got.first_harmless if got and got.harmless else None)
                 if s is not None and s >= 0]
        return min(steps) if steps else None

    def _dropped_events(self) -> list[Event]:
        """Forwards no backward reached whose output was NaN/inf (see
        :mod:`amp_doctor.steps.dropped`): with a bad batch, its ``nonfinite_input``
        finding's; otherwise, a finding of their own, which analysis folds into a layer's
        when one was found."""
        got = self._totals.dropped
        if got is None or got.steps_bad == 0:
            return []
        if (got.neg_inf_only == got.steps_bad and self.step_index >= MASK_MIN_STEPS
                and 2 * got.steps_bad >= self.step_index):
            # -inf alone, in a forward of most steps while training went on: a mask the
            # model returns on purpose (a metrics forward's masked logits), not a loss the
            # loop dropped (review 48c).
            return []
        made, first_made = got.steps_bad - got.input_bad, got.first_made
        handled = self._batch_handled_at()
        if got.input_bad and handled is not None:
            # The model takes such batches in its stride (NaN in, finite out): their NaN
            # is not why these forwards' outputs were (review 48a).
            made += got.input_bad
            first_made = min(x for x in (first_made, got.first_input_bad) if x >= 0)
        if not made:
            return []
        return [Event(kind="nonfinite_output_dropped", step=first_made, module=got.module
                      or self._set.label(), data={
                          "steps_bad": made, "steps": self.step_index,
                          "batch_nan_handled_at": handled if got.input_bad else None,
                          "loss_only": got.loss_only,
                          "anomaly": self._anomaly is not None, "every": self.every})]

    def _write_outputs(self, session: Session) -> None:
        """The JSON report, then TensorBoard's last parts; what TensorBoard could not
        write is one warning, not a traceback in the user's output."""
        from amp_doctor.sinks.jsonfile import write_json

        assert self.logdir is not None
        deleted = not self.logdir.is_dir()
        moved_from = None
        if deleted:  # by the script (shutil.rmtree("runs") to clear old TensorBoard logs)
            try:
                new = relocated_run_dir(self.logdir)
            except OSError:
                new = None
            if new is not None:  # a file in its place: the reports go beside it
                moved_from, self.logdir = self.logdir, new
            else:
                _make_logdir(self.logdir)
        try:
            write_json(session, self.logdir / JSON_NAME)
        finally:
            parts: list[warnings.WarningMessage] = []
            if self._tb is not None:
                with warnings.catch_warnings(record=True) as parts:
                    warnings.simplefilter("always")
                    self._tb.finish(session)
            if moved_from is not None:
                warnings.warn(f"amp-doctor: {moved_from} was replaced by a file while the "
                              f"run was on (by the script?): its TensorBoard events are "
                              f"lost; the reports are written to {self.logdir} instead.",
                              RuntimeWarning, stacklevel=3)
            elif deleted:
                warnings.warn(f"amp-doctor: {self.logdir} was deleted while the run was on "
                              "(by the script?): its TensorBoard events are lost; the "
                              "reports are written there again.", RuntimeWarning, stacklevel=3)
            elif self._tb is not None and self._tb.error:
                warnings.warn(f"amp-doctor: TensorBoard could not write its events in "
                              f"{self.logdir} ({self._tb.error}); check free space.",
                              RuntimeWarning, stacklevel=3)
            else:  # the parts that failed on their own
                for w in parts:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def watch(model: Models, **kwargs: Any) -> Watch:
    """Start watching ``model`` (an ``nn.Module``, or a list/dict of them).

    Returns a :class:`Watch`; use it as a context manager or call
    ``close()``. Keyword options: ``every`` (record one step in N),
    ``logdir`` (write JSON and TensorBoard logs there), ``scaler`` and
    ``optimizer`` (found automatically when omitted), ``max_steps``,
    ``anomaly`` and ``on_nonfinite`` (``"record"`` or ``"raise"``),
    ``top_k`` (per-layer TensorBoard scalars for the worst K layers).
    """
    check_option_names(kwargs, Watch.__init__)
    return Watch(model, **kwargs).start()


def _eval_mode_event(step: int) -> Event:
    """The watched model trains in eval mode from ``step`` on (a forgotten model.train())."""
    return Event(kind="trains_in_eval_mode", step=step, data={
        "severity": "warning",
        "message": (f"The watched model ran its training forwards in eval mode from step "
                    f"{step} on: a backward and an optimizer step followed forwards made "
                    "after `model.eval()` (a validation pass) with no `model.train()` since. "
                    "Its Dropout is off and its BatchNorm normalises with running statistics "
                    "while it trains. amp-doctor takes those forwards for training ones."),
        "advice": ("Call `model.train()` after each validation pass, before the next "
                   "training forward.")})


def _make_logdir(logdir: Path) -> None:
    """The logdir exists and takes files, or a one-line error names it (a file in its
    place, a read-only parent) before any hook is on the user's model."""
    try:
        make_writable_dir(logdir)
    except OSError as e:
        raise UsageError(f"cannot write to logdir {str(logdir)!r} ({e.strerror or e}); pass a "
                         "writable directory, e.g. logdir='runs/amp'.") from None
