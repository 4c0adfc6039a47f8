"""``watch()``: the context manager that owns every hook and patch.

Data flows one way: probes (module hooks) and the AMP API monitor put
device-side summaries into a per-step buffer; at each recorded step
boundary the buffer is copied to the host once and folded into per-layer
aggregates and a bounded history; ``close()`` freezes all of it into an
immutable :class:`~amp_doctor.records.Session`, runs the analysis and
writes the sinks. Everything installed is removed in ``close()``, which
``__exit__`` calls on normal exit, on exceptions and on KeyboardInterrupt.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.optim import Optimizer

from . import stats as S
from ._version import __version__
from .devicework import count_sync, iter_tensors, own_ops
from .dtypes import dtype_name, limits
from .errors import AmpDoctorError
from .probes import (
    COMPILED_NOTE,
    Probes,
    run_eagerly_when_called_by_dynamo,
    unsummarizable,
)
from .recorder import History, HostStep, LayerAggregate, StepBuffer, host_step_layers
from .records import AmpConfig, Event, RunInfo, ScalerEvent, Session, StepRecord
from .scaler import AmpMonitor, subscribe
from .watch_args import check_option_names, check_watch_args

__all__ = ["Watch", "watch", "DEFAULT_EVERY"]

# Record one step in ten: enough to see persistent problems, cheap enough
# to leave on (see benchmarks/results.md). Skips, backoffs and misuse are
# tracked on every step regardless.
DEFAULT_EVERY = 10
# Judge what-if overflow/underflow against float16 when autocast never ran:
# it is the format with the narrower range, so the stricter question.
WHAT_IF_DTYPE = torch.float16
# Pure low-precision training: parameter elements sampled per tensor on a recorded
# step to see whether the optimizer's update changed them at all.
UPDATE_SAMPLE = 1024
_LOW_DTYPES = (torch.float16, torch.bfloat16)


def _in_backward() -> bool:
    """True while autograd runs a backward pass (checkpoint recomputation, hooks)."""
    try:
        return bool(torch._C._current_graph_task_id() != -1)
    except Exception:  # pragma: no cover - private API moved
        return False

Models = nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module]


def _as_models(model: Models) -> dict[str, nn.Module]:
    if isinstance(model, nn.Module):
        return {"": model}
    if isinstance(model, Mapping):
        out = dict(model)
    else:
        items = list(model)
        names = [type(m).__name__ for m in items]
        out = {}
        for i, (n, m) in enumerate(zip(names, items, strict=True)):
            out[n if names.count(n) == 1 else f"{n}{i}"] = m
    for k, m in out.items():
        if not isinstance(m, nn.Module):
            raise AmpDoctorError(
                f"watch() got a {type(m).__name__} for {k!r}, not a torch.nn.Module. "
                "Pass the model (or a list/dict of models) you call in the training loop."
            )
    return out


def _compile_wrappers(model: nn.Module) -> list[nn.Module]:
    """The ``torch.compile`` wrappers (``OptimizedModule``) on the way to the user's module."""
    out: list[nn.Module] = []
    while True:
        name = type(model).__name__
        inner = getattr(model, "_orig_mod" if name == "OptimizedModule" else "module", None)
        if not isinstance(inner, nn.Module) or name not in (
                "DistributedDataParallel", "DataParallel", "OptimizedModule"):
            return out
        if name == "OptimizedModule":
            out.append(model)
        model = inner


def _compiled_by_method(model: nn.Module) -> bool:
    """``model.compile()`` was called: its hooks run inside the compiled graph."""
    return getattr(model, "_compiled_call_impl", None) is not None


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP/DataParallel/torch.compile wrappers: watch the user's module so
    # layer names carry no "module." / "_orig_mod." prefix.
    for attr in ("module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module) and type(model).__name__ in (
            "DistributedDataParallel", "DataParallel", "OptimizedModule"):
            return _unwrap(inner)
    return model


class Watch:
    """Records how a model behaves under AMP, per layer and per step.

    Use as a context manager, or call :meth:`close` yourself. Host syncs:
    one per recorded step (in :meth:`step` or the automatic boundary at
    ``GradScaler.update`` / ``optimizer.step``), plus one on each step the
    GradScaler skipped that was not recorded, to name the culprit layers.
    """

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
        self._given_models = _as_models(model) if model is not None else {}
        self.models = {k: _unwrap(m) for k, m in self._given_models.items()}
        self._discover = discover
        if isinstance(fp32, str):
            fp32 = [fp32]
        self._fp32_patterns = tuple(fp32)
        self._fp32: Any = None
        if stop_after is not None and stop_after < 1:
            raise AmpDoctorError(f"stop_after must be >= 1 or None, got {stop_after!r}.")
        self._stop_after = stop_after
        from .whatif import TARGET_DTYPES

        if target_dtype is not None and target_dtype not in TARGET_DTYPES:
            raise AmpDoctorError(f"target_dtype must be one of {', '.join(TARGET_DTYPES)} or "
                                 f"None, got {target_dtype!r}.")
        self._target_dtype = target_dtype
        self.every = every
        self.max_steps = max_steps
        self.logdir = Path(logdir).absolute() if logdir is not None else None
        self.top_k = top_k
        self._tensorboard = tensorboard
        self._anomaly_opts = (anomaly, on_nonfinite, tuple(anomaly_allow))
        opts: list[Optimizer] = []
        if isinstance(optimizer, Optimizer):
            opts = [optimizer]
        elif optimizer is not None:
            opts = list(optimizer)
        self._explicit_scaler = scaler
        self._explicit_opts = opts

        self.step_index = 0
        self.recorded = 0
        self.closed = False
        self.session_: Session | None = None
        self._started = time.perf_counter()
        self._started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self._device_type: str | None = None
        self._autocast_dtypes: dict[str, int] = {}
        self._buffer: StepBuffer | None = None
        self._activity = False
        self._grad_scale_key = "grad_scale"
        self._agg: dict[str, LayerAggregate] = {}
        self._history = History()
        self._extra_events: list[Event] = []
        self._scalers_seen: set[int] = set()
        self._listeners: list[Callable[[StepRecord, HostStep], None]] = []
        self._probes: Probes | None = None
        self._sub: Any = None
        self._monitor: AmpMonitor | None = None
        self._anomaly: Any = None
        self._tb: Any = None
        self._run_meta: dict[str, Any] = {}
        self._owned_params: set[int] = set()
        self._started_flag = False
        self._global_handles: list[Any] = []
        self._global_depth = 0
        self._given_names: dict[int, str] = {}
        # Device flags of the current step (loss / root input non-finite), OR-ed over
        # micro-steps; they ride in the step's one host copy, or in the skip's sync.
        self._step_flags: dict[str, torch.Tensor] = {}
        # Steps whose loss was checked on the host (recorded steps, and skipped steps
        # in the skip's one sync), and those of them where it was NaN/inf.
        self._loss_checked: set[int] = set()
        self._loss_bad: set[int] = set()
        self._loss_origin: tuple[int, str | None] | None = None
        # What the loop did since the last step boundary.
        self._backward_since_boundary = False
        self._backward_reached = False
        self._train_forward_since_boundary = False
        self._auto_boundary_idle = False
        self._implicit_steps = False
        self._owned_at_step = -1
        # Pure low-precision training: sampled parameter elements before the update.
        self._lp_snap: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._lp_counts = [0.0, 0.0]  # sampled elements with a gradient, unchanged of those

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> Watch:
        if self._started_flag:
            return self
        self._started_flag = True
        self._compiled_names = set()
        try:
            self._owned_params = {id(p) for m in self.models.values() for p in m.parameters()}
            self._probes = Probes(self.models, self._current_buffer, self._on_root_forward,
                                  events=self._extra_events, on_compiled=self._on_compiled)
            for given in self._given_models.values():
                self._attach_wrappers(given)
            if self._fp32_patterns:
                from .fp32 import Fp32Islands

                self._fp32 = Fp32Islands(self._fp32_patterns)
                for prefix, m in self.models.items():
                    self._fp32.attach(prefix, m)
                if not self._discover:
                    self._fp32.check()  # the API knows every model now: fail before training
            self._monitor = AmpMonitor(
                owns_param=self._owns,
                on_boundary=self._auto_boundary,
                step_of=lambda: self.step_index,
                scaler=self._explicit_scaler,
                optimizers=self._explicit_opts,
                on_unscale=self._on_param_grads,
                on_skip=self._on_skip,
                on_scale=self._on_scale,
                on_backward=self._on_backward,
                on_backward_done=self._on_backward_done,
                on_optimizer_done=self._on_optimizer_done,
            )
            self._monitor.autocast_dtype = self._autocast_dtype
            self._sub = subscribe(self._monitor)
            if self._discover:
                run_eagerly_when_called_by_dynamo(self._global_pre, self._global_post)
                self._register_global()
                self._patch_compiled_call()
            anomaly, mode, allow = self._anomaly_opts
            if anomaly:
                from .anomaly import AnomalyMode

                self._anomaly = AnomalyMode(
                    current_module=self._probes.current_module,
                    step_of=lambda: self.step_index,
                    mode=mode,
                    allow=allow,
                    module_name=self._probes.name_of,
                )
                self._anomaly.start()
            if self.logdir is not None and self._tensorboard:
                from .sinks.tensorboard import TensorBoardSink

                self._tb = TensorBoardSink(self.logdir, top_k=self.top_k)
                self._listeners.append(self._tb.on_step)
            self._set_recording()
        except BaseException:
            self._teardown()
            raise
        return self

    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        outcome = "completed"
        if exc_type is not None:
            outcome = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "exception"
            self._run_meta.setdefault("error", f"{exc_type.__name__}: {exc}")
        self._run_meta.setdefault("outcome", outcome)
        self.close()

    def close(self) -> Session:
        """Stop watching, remove every hook and patch, and build the session."""
        if self.closed:
            assert self.session_ is not None
            return self.session_
        pending, self._boundary_pending = self._boundary_pending, False
        implicit_last = self._implicit_candidate() and self._backward_reached
        self.closed = True
        try:
            if pending:
                self._finish_step(partial=False)
                self.step_index += 1
            elif implicit_last:
                # A loop without optimizer or scaler: its last step ends with the run.
                self._implicit_steps = True
                self._finish_step(partial=False)
                self.step_index += 1
            elif self._buffer is not None and (self._train_forward_since_boundary
                                               or self._backward_since_boundary):
                # Training work after the last boundary (a crash mid-step); an
                # evaluation pass after the last step is not a step.
                self._finish_step(partial=True)
        finally:
            self._teardown()
            # Leave no reference to the user's tensors behind.
            self._sentinel = None
            self._lp_snap = []
            self._step_flags = {}
        self.session_ = self._build_session()
        if self.logdir is not None:
            self._write_outputs(self.session_)
        return self.session_

    def _attach_wrappers(self, given: nn.Module) -> None:
        """A model compiled before watch(): say so, and never toggle its sublayer hooks.

        Its root hooks still run eagerly around the compiled forward (see
        :func:`~amp_doctor.probes.run_eagerly_when_called_by_dynamo`).
        """
        assert self._probes is not None
        inner = _unwrap(given)
        name = self._probes.name_of(inner)
        if name is not None and (_compile_wrappers(given) or _compiled_by_method(inner)):
            self._probes.freeze(inner)
            self._on_compiled(name, "")

    def _on_compiled(self, name: str, autocast: str) -> None:
        """A watched module runs under torch.compile (``autocast``: "device:dtype" or "")."""
        dev, _, dt = autocast.partition(":")
        if dt:
            # The forward hooks cannot see autocast inside a compiled graph; the
            # trace-time state the graph was compiled for stands in for them.
            self._autocast_dtypes[dt] = self._autocast_dtypes.get(dt, 0) + 1
            if self._device_type is None:
                self._device_type = dev
        if name in self._compiled_names:
            return
        self._compiled_names.add(name)
        self._extra_events.append(Event(
            kind="compiled_model", step=self.step_index, module=name,
            data={"severity": "info", "message": f"{name} {COMPILED_NOTE}"}))

    _compiled_names: set[str] = set()
    _unpatch: Callable[[], None] | None = None

    def _register_global(self) -> None:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._global_handles = [
            register_module_forward_pre_hook(self._global_pre),
            register_module_forward_hook(self._global_post, always_call=True),
        ]

    def _patch_compiled_call(self) -> None:
        """Discovery without global hooks around a ``torch.compile``'d module's call.

        ``OptimizedModule.__call__`` warns on every call while any global module
        hook exists, and dynamo would trace ours. So the call itself discovers the
        model, and amp-doctor's global hooks are off while it runs (the model's
        own root hooks still run, eagerly, around the compiled forward).
        """
        try:
            from torch._dynamo.eval_frame import OptimizedModule
        except ImportError:  # pragma: no cover - torch without dynamo
            return
        orig: Callable[..., Any] = OptimizedModule.__call__
        ref = weakref.ref(self)

        def __call__(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            watch = ref()
            if watch is None or not watch._global_handles or torch.compiler.is_compiling():
                return orig(module, *args, **kwargs)
            handles, watch._global_handles = watch._global_handles, []
            for h in handles:
                h.remove()
            try:
                probes = watch._probes
                if (watch._global_depth == 0 and not watch.closed and probes is not None
                        and not probes.watches(_unwrap(module))
                        and next(module.parameters(), None) is not None):
                    # Hooked before the call: its root hooks see this very call.
                    watch.add_model(module, _variable_name(module))
                return orig(module, *args, **kwargs)
            finally:
                if not watch.closed and watch._unpatch is not None:
                    watch._register_global()

        __call__.__wrapped__ = orig  # type: ignore[attr-defined]
        OptimizedModule.__call__ = __call__  # type: ignore[method-assign,assignment]

        def unpatch() -> None:
            if OptimizedModule.__call__ is __call__:
                OptimizedModule.__call__ = orig  # type: ignore[method-assign]

        self._unpatch = unpatch

    def _teardown(self) -> None:
        # Each removal is independent: one failing must not leave others behind.
        removers: list[Callable[[], Any]] = [h.remove for h in self._global_handles]
        for owner, method in ((self._probes, "remove"), (self._sub, "remove"),
                              (self._anomaly, "stop"), (self._fp32, "remove")):
            if owner is not None:
                removers.append(getattr(owner, method))
        self._global_handles = []
        if self._unpatch is not None:
            removers.append(self._unpatch)
            self._unpatch = None
        for fn in removers:
            try:
                fn()
            except Exception:  # pragma: no cover - best effort on teardown
                pass
        if self._buffer is not None:
            self._buffer.closed = True
        self._buffer = None

    # -- public API ------------------------------------------------------------
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
            if self._auto_boundary_idle:
                self._take_pending_boundary()
                return
        self._boundary_pending = False
        self._boundary()

    @property
    def session(self) -> Session:
        """The finished session (after close), or a snapshot of the run so far."""
        if self.session_ is not None:
            return self.session_
        return self._build_session()

    def report(self, **kwargs: Any) -> str:
        from .sinks.text import render_text

        return render_text(self.session, **kwargs)

    def set_run_meta(self, **kw: Any) -> None:
        """Used by the CLI to record the command, exit code and outcome."""
        self._run_meta.update(kw)

    @property
    def fp32_islands(self) -> Any:
        """The float32 forcing (``fp32=``), or None."""
        return self._fp32

    def add_listener(self, fn: Callable[[StepRecord, HostStep], None]) -> None:
        self._listeners.append(fn)

    # -- discovery (the CLI's way in) ------------------------------------------
    def add_model(self, model: nn.Module, name: str | None = None) -> None:
        """Watch one more root model. With several, every layer name gets its model's prefix."""
        given = model
        model = _unwrap(model)
        if self._probes is None or self._probes.watches(model):
            return
        if name is None:
            name = type(model).__name__
        self._given_names[id(model)] = name
        if not self.models:
            prefix = ""
        else:
            taken = set(self.models)
            if "" in self.models:
                # The first model was unprefixed while it was alone; name it now.
                first = self.models.pop("")
                first_name = self._free_name(
                    self._given_names.get(id(first), type(first).__name__), taken | {name})
                self._rename(self._probes.rename_root(first, first_name))
                self.models[first_name] = first
                taken = set(self.models)
            prefix = self._free_name(name, taken)
        self.models[prefix] = model
        self._probes.add_root(prefix, model)
        self._attach_wrappers(given)
        self._owned_params.update(id(p) for p in model.parameters())
        if self._monitor is not None:
            self._monitor.models_changed()
        if self._fp32 is not None:
            # Names may have changed (a second model prefixes the first): match anew.
            self._fp32.reattach(self.models)

    @staticmethod
    def _free_name(name: str, taken: set[str]) -> str:
        if name not in taken:
            return name
        i = 1
        while f"{name}{i}" in taken:
            i += 1
        return f"{name}{i}"

    def _rename(self, mapping: dict[str, str]) -> None:
        if not mapping:
            return
        self._agg = {mapping.get(k, k): v for k, v in self._agg.items()}
        self._history.records = [
            StepRecord(**{**r.__dict__, "layers": {mapping.get(k, k): v
                                                   for k, v in r.layers.items()}})
            for r in self._history.records
        ]
        buf = self._buffer
        if buf is not None:
            buf.assigned = {(mapping.get(k, k), f): v for (k, f), v in buf.assigned.items()}
            buf.backward_order = [mapping.get(k, k) for k in buf.backward_order]
            buf.param_grads_done = {mapping.get(k, k) for k in buf.param_grads_done}
        if self._monitor is not None:
            self._monitor.scaler_events = [
                ScalerEvent(**{**e.__dict__, "culprits": [mapping.get(c, c) for c in e.culprits]})
                for e in self._monitor.scaler_events
            ]

    def _global_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.compiler.is_compiling():
            return  # traced into a compiled graph: do nothing, so dynamo adds nothing
        self._global_depth += 1
        if self._global_depth != 1 or self._probes is None or self.closed:
            return
        if self._probes.watches(module) or next(module.parameters(), None) is None:
            return  # loss functions and other parameter-free callables are not models
        self.add_model(module, _variable_name(module))
        # This call's own pre-hooks were collected before we added ours.
        self._on_root_forward(module, args)

    def _global_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self._global_depth = max(0, self._global_depth - 1)

    # -- hook callbacks ------------------------------------------------------
    def _current_buffer(self) -> StepBuffer:
        assert self._buffer is not None
        self._activity = True
        return self._buffer

    def _on_root_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._activity = True
        training = torch.is_grad_enabled() and module.training and not _in_backward()
        if training:
            if self._lead_root is None:
                self._lead_root = id(module)
            elif id(module) != self._lead_root and self._auto_boundary_idle:
                # Right after the boundary, another model trains: same iteration.
                self._defer_boundaries = True
            if id(module) == self._lead_root and self._take_pending_boundary():
                if self._probes is not None:
                    # Before any sublayer ran: hooking or unhooking them loses nothing.
                    self._probes._apply_armed()
            elif self._implicit_candidate() and self._backward_reached and self._loop_updated():
                self._implicit_boundary()
            self._train_forward_since_boundary = True
            self._auto_boundary_idle = False
            if self._buffer is not None:
                self._check_input(args)
        if self._anomaly is not None and self._probes is not None:
            self._anomaly.check_inputs(self._probes.name_of(module) or type(module).__name__, args,
                                       module)
        if self._device_type is None:
            dev = None
            for t in iter_tensors(args):
                dev = t.device.type
                break
            if dev is None:
                p = next(module.parameters(), None)
                dev = p.device.type if p is not None else "cpu"
            self._device_type = dev
        dev = self._device_type
        if torch.is_grad_enabled() and torch.is_autocast_enabled(dev):
            name = dtype_name(torch.get_autocast_dtype(dev))
            self._autocast_dtypes[name] = self._autocast_dtypes.get(name, 0) + 1

    def _autocast_dtype(self) -> torch.dtype | None:
        if not self._autocast_dtypes:
            inside = self._autocast_inside()
            return getattr(torch, inside) if inside else None
        name = max(self._autocast_dtypes, key=lambda k: self._autocast_dtypes[k])
        return getattr(torch, name)

    def _autocast_inside(self) -> str | None:
        """Autocast entered inside the model's forward (Accelerate wraps ``forward``).

        The root's pre-hook runs before it, so it sees no autocast. But a layer
        whose own parameters are float32 and whose output is float16/bfloat16
        ran under autocast: its recorded output dtype says so.
        """
        if self._probes is None:
            return None
        # Output dtypes only change on recorded steps: judge once per recorded step.
        if self._inside_at == self.recorded:
            return self._inside
        self._inside_at = self.recorded
        seen: dict[str, int] = {}
        for meta in self._probes.layers.values():
            if meta.param_dtypes and meta.param_dtypes <= {"float32"}:
                for d in meta.output_dtypes & {"float16", "bfloat16"}:
                    seen[d] = seen.get(d, 0) + 1
        self._inside = max(seen, key=lambda k: seen[k]) if seen else None
        return self._inside

    _inside: str | None = None
    _inside_at = -1

    def _low_dtype(self) -> torch.dtype:
        dt = self._autocast_dtype()
        if dt is not None:
            return dt
        lows = self._probes.low_precision_outputs() if self._probes else set()
        if lows:
            return torch.float16 if "float16" in lows else torch.bfloat16
        return WHAT_IF_DTYPE

    def _on_scale(self, scaler: GradScaler, outputs: Any) -> None:
        self._scalers_seen.add(id(scaler))
        buf = self._buffer
        if buf is None:
            return
        if scaler._enabled and scaler._scale is not None:
            buf.put_scalar(self._grad_scale_key, scaler._scale.clone())
        ts = [t for t in iter_tensors(outputs) if t.is_floating_point() and t.numel() >= 1]
        if ts:
            buf.put_scalar("loss", ts[0].detach().float().mean())

    def _on_param_grads(self, params: list[torch.Tensor], scale: float | None) -> None:
        buf = self._buffer
        if buf is None or self._probes is None:
            return
        if not buf.param_grads_done:
            # A host flag, not a tensor: a CPU tensor copied to the GPU would sync.
            buf.param_grads_scaled = bool(scale)
        self._probes.summarize_param_grads(params, buf)
        if scale is None and not self._lp_snap and any(p.dtype in _LOW_DTYPES for p in params):
            self._snapshot_low_params(params)

    def _on_skip(self, params: list[torch.Tensor]) -> None:
        """A GradScaler skipped a step: name the layers whose grads are not finite."""
        if self._buffer is not None or self._probes is None:
            return  # a recorded step names culprits from its own summaries
        by_layer: dict[str, list[torch.Tensor]] = {}
        for p in params:
            name = self._probes.param_owner.get(id(p))
            if name is not None and p.grad is not None:
                by_layer.setdefault(name, []).append(p.grad)
        loss_flag = self._step_flags.get("loss_bad")
        if not by_layer and loss_flag is None:
            return
        names = list(by_layer)
        parts = [torch.stack([~torch.isfinite(g).all() for g in gs]).any()
                 for gs in by_layer.values()]
        if loss_flag is not None:
            dev = parts[0].device if parts else loss_flag.device
            parts.append(loss_flag.to(dev))
        bad = torch.stack(parts).tolist()  # the one sync of an unrecorded skipped step
        count_sync()
        if loss_flag is not None:
            self._pending_loss_bad = bool(bad.pop())
        order = {n: self._probes.layers[n].order for n in names}
        culprits = sorted((n for n, b in zip(names, bad, strict=True) if b),
                          key=lambda n: -order[n])
        self._pending_culprits = culprits

    _pending_culprits: list[str] | None = None
    _pending_loss_bad: bool | None = None

    # -- what the loop does (step boundaries without optimizer, losses) -------
    def _owns(self, p: torch.Tensor) -> bool:
        """A parameter of a watched model; rescanned (once a step) on a miss, since
        ``load_state_dict(assign=True)`` or ``to_empty`` swap parameter objects."""
        if id(p) in self._owned_params:
            return True
        if self._owned_at_step != self.step_index and self.models:
            self._owned_at_step = self.step_index
            self._rescan_params()
        return id(p) in self._owned_params

    def _rescan_params(self) -> None:
        self._owned_params = {id(q) for m in self.models.values() for q in m.parameters()}
        probes = self._probes
        if probes is None:
            return
        for model in self.models.values():
            for mod in model.modules():
                name = probes.name_of(mod)
                meta = probes.layers.get(name) if name else None
                if meta is None:
                    continue
                meta.params = list(mod.parameters(recurse=False))
                for q in meta.params:
                    probes.param_owner.setdefault(id(q), name)  # type: ignore[arg-type]

    def _on_backward(self, roots: list[torch.Tensor]) -> None:
        """Before a backward: note on the device whether its loss is NaN/inf."""
        if self.closed:
            return
        losses = [t for t in roots if t.numel() == 1 and t.is_floating_point()
                  and t.grad_fn is not None]
        if not losses:
            return
        flag = torch.stack([~torch.isfinite(t.detach()).all() for t in losses]).any()
        prev = self._step_flags.get("loss_bad")
        self._step_flags["loss_bad"] = flag if prev is None else (prev | flag.to(prev.device))

    def _on_backward_done(self, roots: list[torch.Tensor]) -> None:
        self._backward_since_boundary = True
        self._auto_boundary_idle = False
        if not self._implicit_candidate():
            return
        mon = self._monitor
        assert mon is not None
        # Only where no optimizer or scaler ends the steps: does this backward
        # reach the watched parameters (a training step), or another model's?
        if not self._backward_reached:
            self._backward_reached = mon._reaches_watched_params(
                [t.grad_fn for t in roots if t.grad_fn is not None])
        if self._backward_reached:
            # After every backward: accumulation changes the grads in place.
            self._sentinel = None
            for m in self.models.values():
                for q in m.parameters():
                    if q.grad is not None:
                        self._sentinel = (q, id(q.grad), q.grad._version, q._version)
                        break
                if self._sentinel is not None:
                    break

    _sentinel: tuple[torch.Tensor, int, int, int] | None = None

    def _loop_updated(self) -> bool:
        """Since the last backward, did the loop update the weights or reset the grads?

        That is what ends a step without an optimizer. Gradient accumulation
        (several backward passes into one update) changes neither in between.
        """
        sn = self._sentinel
        if sn is None:
            return False
        p, gid, gver, pver = sn
        g = p.grad
        return g is None or id(g) != gid or g._version != gver or p._version != pver

    def _implicit_candidate(self) -> bool:
        """No optimizer step, scaler update or ``doctor.step()`` ends the steps."""
        mon = self._monitor
        return (mon is not None and not self.closed and not mon.manual_steps
                and mon.primary_scaler is None and mon._primary_opt is None)

    def _implicit_boundary(self) -> None:
        # A hand-written update (``p.add_(p.grad, alpha=-lr)``): a new training
        # forward after a backward that reached the watched parameters.
        self._implicit_steps = True
        self._boundary()
        if self._probes is not None:
            # Called from the root's pre-hook, before any sublayer ran: hooking or
            # unhooking them now loses no post-hook.
            self._probes._apply_armed()

    def _check_input(self, args: tuple[Any, ...]) -> None:
        """On a recorded step: does the batch itself hold NaN/inf? Device flags only."""
        # vmap's wrapped tensors must not escape into the step's flags; nor odd layouts.
        ts = [t for t in iter_tensors(args) if t.is_floating_point() and t.numel() > 0
              and unsummarizable(t) is None]
        if not ts:
            return
        with own_ops:
            try:
                nan = torch.stack([t.detach().isnan().any() for t in ts]).any()
                inf = torch.stack([t.detach().isinf().any() for t in ts]).any()
            except Exception:  # odd tensors (nested, float8): skip the check
                return
        for key, flag in (("input_nan", nan), ("input_inf", inf)):
            prev = self._step_flags.get(key)
            self._step_flags[key] = flag if prev is None else (prev | flag.to(prev.device))

    def _on_optimizer_done(self, params: list[torch.Tensor]) -> None:
        """After a plain optimizer step on a recorded step: did low-precision weights move?"""
        snap, self._lp_snap = self._lp_snap, []
        buf = self._buffer
        if not snap or buf is None:
            return
        with own_ops, torch.no_grad():
            moved = [(p.detach().reshape(-1)[idx] == before) & has_grad
                     for p, idx, before, has_grad in snap]
            unchanged = torch.stack([m.sum() for m in moved]).sum()
            with_grad = torch.stack([h.sum() for _, _, _, h in snap]).sum()
        buf.put_scalar("lp_unchanged", unchanged)
        buf.put_scalar("lp_with_grad", with_grad)

    def _snapshot_low_params(self, params: list[torch.Tensor]) -> None:
        snap = []
        with own_ops, torch.no_grad():
            for p in params:
                if p.dtype not in _LOW_DTYPES or p.grad is None or p.grad.is_sparse:
                    continue
                n = p.numel()
                if n == 0:
                    continue
                step = max(1, n // UPDATE_SAMPLE)
                idx = torch.arange(0, n, step, device=p.device)[:UPDATE_SAMPLE]
                before = p.detach().reshape(-1)[idx].clone()
                has_grad = p.grad.detach().reshape(-1)[idx] != 0
                snap.append((p, idx, before, has_grad))
        self._lp_snap = snap

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
        self._buffer = StepBuffer(self.step_index) if self._probes.recording else None
        self._activity = False

    def _auto_boundary(self) -> None:
        """A step boundary seen in the loop (``scaler.update``, ``optimizer.step``).

        Once the loop showed that another model trains after it in the same
        iteration (two models, two GradScalers), it takes effect at the next
        forward of the step's first model (or at close), so that the second
        model's work still belongs to this step.
        """
        if self.closed:
            return
        if not self._defer_boundaries:
            self._boundary()
            self._auto_boundary_idle = True
            return
        if self._boundary_pending:
            # Two boundaries and no forward of the step's first model in between
            # (a loop that calls submodules directly): the first one ends its step now.
            self._boundary()
        self._boundary_pending = True
        self._auto_boundary_idle = True

    _boundary_pending = False
    _defer_boundaries = False
    # The model whose training forward came first in the step: its next forward
    # starts the next step (a second model's forward in the same iteration does not).
    _lead_root: int | None = None

    def _take_pending_boundary(self) -> bool:
        if not self._boundary_pending:
            return False
        self._boundary_pending = False
        self._boundary()
        return True

    def _boundary(self) -> None:
        if self.closed:
            return
        self._finish_step(partial=False)
        self.step_index += 1
        self._set_recording()
        self._backward_since_boundary = False
        self._sentinel = None
        self._backward_reached = False
        self._train_forward_since_boundary = False
        self._auto_boundary_idle = False
        if self._stop_after is not None and self.step_index >= self._stop_after:
            from .errors import StopRun

            raise StopRun(self.step_index)

    def _finish_step(self, partial: bool) -> None:
        with own_ops:
            self._finish_step_quiet(partial)

    def _finish_step_quiet(self, partial: bool) -> None:
        mon = self._monitor
        outcome = mon.take_outcome() if mon is not None else None
        culprits = self._pending_culprits or []
        self._pending_culprits = None
        loss_bad: bool | None = self._pending_loss_bad
        self._pending_loss_bad = None
        step = self.step_index
        rec: StepRecord | None = None
        buf = self._buffer
        if self._anomaly is not None:
            self._anomaly.end_step(skipped=bool(outcome and outcome.skipped),
                                   recorded=buf is not None)
        flags, self._step_flags = self._step_flags, {}
        self._lp_snap = []
        if loss_bad is not None:
            self._note_loss(step, loss_bad)
        if buf is not None:
            for key, flag in flags.items():
                buf.put_scalar(key, flag)
            if mon is not None and mon.primary_scaler is not None:
                st = mon.scalers[mon.primary_scaler]
                sc = st.ref()
                if sc is not None and sc._enabled and sc._scale is not None:
                    buf.put_scalar("scale_after", sc._scale)
                    if sc._growth_tracker is not None:
                        buf.put_scalar("growth_tracker", sc._growth_tracker)
            flagged = self._anomaly.flagged_count() if self._anomaly is not None else None
            if flagged is not None:
                buf.put_scalar("anomaly_flagged", flagged)
            hs = buf.flush()
            if self._anomaly is not None:
                self._anomaly.resolve(hs.scalars.get("anomaly_flagged"))
            self.recorded += 1
            fmt = limits(self._low_dtype())
            grad_scale = hs.scalars.get(self._grad_scale_key)
            pg_scaled = buf.param_grads_scaled
            layers, raw = host_step_layers(hs, fmt, grad_scale, grad_scale if pg_scaled else None)
            for name, ls in layers.items():
                self._agg.setdefault(name, LayerAggregate()).add(ls, raw[name])
            origin = self._forward_origin(layers)
            if hs.scalars.get("input_nan") or hs.scalars.get("input_inf"):
                # The batch was already non-finite: no layer is the origin. (Anomaly
                # mode checks every step's batch itself and reports it.)
                origin = None
                if self._anomaly is None:
                    self._note_bad_input(step, hs.scalars)
            if origin is not None:
                self._agg[origin].origin_steps += 1
            if "loss_bad" in hs.scalars:
                loss_bad = bool(hs.scalars["loss_bad"])
                self._note_loss(step, loss_bad)
                if loss_bad and self._loss_origin is None:
                    self._loss_origin = (step, origin)
            if "lp_with_grad" in hs.scalars:
                self._lp_counts[0] += hs.scalars["lp_with_grad"]
                self._lp_counts[1] += hs.scalars.get("lp_unchanged", 0.0)
            real_scale = hs.scalars.get("scale_after")
            if mon is not None and real_scale is not None and mon.primary_scaler is not None:
                tracker = hs.scalars.get("growth_tracker")
                mon.correct_scale(mon.primary_scaler, real_scale,
                                  int(tracker) if tracker is not None else None)
                if outcome is not None:
                    outcome.scale_after = real_scale
            skipped = bool(outcome and outcome.skipped)
            if skipped:
                culprits = self._culprits(hs, layers)
                self._pending_origin = origin
            rec = StepRecord(
                step=step,
                loss=hs.scalars.get("loss"),
                scale=outcome.scale_after if outcome else None,
                skipped=skipped,
                layers=layers,
            )
            self._history.add(rec)
            for fn in self._listeners:
                try:
                    fn(rec, hs)
                except Exception as e:  # a sink failing must not stop training
                    self._extra_events.append(
                        Event(kind="internal_error", step=step, data={"error": repr(e)}))
        if mon is not None and outcome is not None and not partial:
            self._note_scaler(step, outcome, culprits, loss_bad)
            if self._tb is not None:
                try:  # live scaler charts; a sink failing must not stop training
                    self._tb.on_scaler_step(step, outcome)
                except Exception as e:
                    self._extra_events.append(
                        Event(kind="internal_error", step=step, data={"error": repr(e)}))

    def _note_loss(self, step: int, bad: bool) -> None:
        # Host flags only, from copies made anyway: no sync of its own.
        self._loss_checked.add(step)
        if bad:
            self._loss_bad.add(step)

    def _note_bad_input(self, step: int, scalars: dict[str, float]) -> None:
        if any(e.kind == "nonfinite_input" and e.data.get("detected") == "recorded step"
               for e in self._extra_events):
            for e in self._extra_events:
                if e.kind == "nonfinite_input" and e.data.get("detected") == "recorded step":
                    e.data["occurrences"] = int(e.data.get("occurrences", 1)) + 1
            return
        root = next(iter(self.models), "")
        name = root or (type(self.models[root]).__name__ if self.models else "the model")
        self._extra_events.append(Event(kind="nonfinite_input", step=step, module=name, data={
            "nan": bool(scalars.get("input_nan")), "inf": bool(scalars.get("input_inf")),
            "detected": "recorded step"}))

    def _forward_origin(self, layers: dict[str, Any]) -> str | None:
        """The first layer to finish its forward with an overflowed or non-finite output.

        Hooks run in completion order (children before parents), so the first
        such layer produced the problem; the ones after it only passed it on.
        """
        assert self._probes is not None
        metas = self._probes.layers
        bad = [
            n for n, ls in layers.items()
            if ls.act is not None and n in metas and (
                ls.act.nonfinite_frac > 0
                or (ls.act.overflow_frac > 0 and metas[n].output_dtypes & {"float16", "bfloat16"}))
        ]
        return min(bad, key=lambda n: metas[n].order) if bad else None

    _pending_origin: str | None = None

    def _culprits(self, hs: HostStep, layers: dict[str, Any]) -> list[str]:
        bad = [
            n for n, ls in layers.items()
            if (ls.grad is not None and ls.grad.nonfinite_frac > 0)
            or (ls.param_grad is not None and ls.param_grad.nonfinite_frac > 0)
        ]
        seen: dict[str, int] = {}
        for i, n in enumerate(hs.backward_order):
            seen.setdefault(n, i)
        assert self._probes is not None
        metas = self._probes.layers
        big = len(hs.backward_order) + 1
        return sorted(
            bad, key=lambda n: (seen.get(n, big), -metas[n].order if n in metas else 0)
        )

    def _note_scaler(self, step: int, out: Any, culprits: list[str],
                     loss_bad: bool | None = None) -> None:
        mon = self._monitor
        assert mon is not None
        if out.scale_after is not None:
            tl = mon.timeline_scale
            changed = not tl or tl[-1][1] != out.scale_after
            if changed or self._buffer is not None:
                tl.append((step, out.scale_after))
                if len(tl) > 4 * 1024:  # bounded: thin the unchanged points
                    mon.timeline_scale = _thin_timeline(tl)
        if out.skipped:
            mon.skipped_steps.append(step)
            for name in out.skipped_optimizers:
                mon.skipped_by_optimizer.setdefault(name, []).append(step)
            mon.last_step_skipped = True
        else:
            mon.last_step_skipped = False
        mon.last_step_id = step
        if out.backoff:
            mon.backoff_steps.append(step)
            mon.scaler_events.append(ScalerEvent(
                step=step, kind="backoff", scale_before=out.scale_before or math.nan,
                scale_after=out.scale_after or math.nan, culprits=culprits,
                forward_origin=self._pending_origin, loss_nonfinite=loss_bad))
        self._pending_origin = None
        if out.growth:
            mon.growth_steps.append(step)
            mon.scaler_events.append(ScalerEvent(
                step=step, kind="growth", scale_before=out.scale_before or math.nan,
                scale_after=out.scale_after or math.nan))

    # -- session ---------------------------------------------------------------
    def _build_session(self) -> Session:
        from .analysis import analyze

        probes = self._probes
        fmt_dtype = self._low_dtype()
        layers = []
        if probes is not None:
            ops = self._anomaly.op_dtypes() if self._anomaly is not None else {}
            for name, meta in probes.layers.items():
                agg = self._agg.get(name)
                if agg is None and meta.calls == 0:
                    continue
                agg = agg or LayerAggregate()
                layers.append(agg.summary(
                    name, meta.type, meta.order, meta.calls, meta.input_dtypes,
                    meta.output_dtypes, meta.param_dtypes, ops.get(name, {}),
                    passthrough=meta.calls > 0 and meta.passthrough_calls >= meta.calls))
        mon = self._monitor
        timeline = mon.timeline() if mon is not None else None
        events = list(mon.events) if mon is not None else []
        if self._anomaly is not None:
            events.extend(self._anomaly.events())
        events.extend(self._extra_events)
        events.extend(self._loop_events())
        scaler_on = bool(timeline and timeline.enabled)
        amp = AmpConfig(
            device_type=self._device_type,
            dtype=dtype_name(fmt_dtype) if (self._autocast_dtypes or (
                probes and probes.low_precision_outputs())) else None,
            scaler=scaler_on,
            autocast_seen=bool(self._autocast_dtypes) or self._autocast_inside() is not None,
        )
        rm = self._run_meta
        run = RunInfo(
            torch_version=torch.__version__,
            started=self._started_at,
            duration_s=round(time.perf_counter() - self._started, 3),
            every=self.every,
            models=[k or type(m).__name__ for k, m in self.models.items()],
            command=rm.get("command"),
            exit_code=rm.get("exit_code"),
            outcome=rm.get("outcome", "completed" if self.closed else "running"),
            error=rm.get("error"),
            rank=rm.get("rank"),
            world_size=rm.get("world_size"),
            fp32_modules=list(self._fp32.forced) if self._fp32 is not None else [],
            target_dtype=self._target_dtype,
        )
        draft = Session(
            version=__version__, amp=amp, steps=self.step_index, recorded_steps=self.recorded,
            layers=sorted(layers, key=lambda x: (x.order < 0, x.order)),
            scaler=timeline, history=list(self._history.records), events=events,
            findings=[], run=run,
        )
        return Session(**{**draft.__dict__, "findings": analyze(draft)})

    def _loop_events(self) -> list[Event]:
        """What the loop itself showed: NaN losses, how steps were counted, frozen weights."""
        out: list[Event] = []
        if self._loss_bad:
            seen = self._loss_origin
            out.append(Event(kind="nonfinite_loss", step=min(self._loss_bad),
                             module=seen[1] if seen else None, data={
                                 "steps_bad": len(self._loss_bad),
                                 "checked": len(self._loss_checked), "steps": self.step_index,
                                 "recorded_at": seen[0] if seen else None,
                                 "origin": seen[1] if seen else None}))
        mon = self._monitor
        if self._implicit_steps:
            out.append(Event(kind="steps_from_backward", step=0, data={
                "steps": self.step_index, "severity": "info"}))
        elif (mon is not None and self.step_index == 0 and not mon.manual_steps
              and (self._backward_since_boundary or self.recorded)):
            out.append(Event(kind="no_step_boundary", step=0, data={
                "backward": self._backward_since_boundary}))
        with_grad, unchanged = self._lp_counts
        if with_grad > 0:
            out.append(Event(kind="lowp_updates_lost", step=0, data={
                "sampled": int(with_grad), "unchanged": int(unchanged),
                "frac": unchanged / with_grad,
                "dtypes": sorted({d for m in (self._probes.layers.values() if self._probes
                                              else []) for d in m.param_dtypes
                                  if d in ("float16", "bfloat16")})}))
        return out

    def _write_outputs(self, session: Session) -> None:
        from .sinks.jsonfile import write_json

        assert self.logdir is not None
        write_json(session, self.logdir / "amp_doctor.json")
        if self._tb is not None:
            self._tb.finish(session)


def _variable_name(module: nn.Module) -> str | None:
    """The name the user's code binds ``module`` to ("gen", "disc"), for layer prefixes."""
    import os
    import sys

    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frame: Any = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            break
        if not frame.f_code.co_filename.startswith(skip):
            for name, value in frame.f_locals.items():
                if value is module and not name.startswith("_") and name != "self":
                    return name
        frame = frame.f_back
    return None


def _thin_timeline(tl: list[tuple[int, float]]) -> list[tuple[int, float]]:
    keep = [tl[0]]
    for i in range(1, len(tl)):
        if tl[i][1] != tl[i - 1][1] or i % 2 == 0:
            keep.append(tl[i])
    return keep


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


_ = S  # stats layout is part of this module's contract with recorder
