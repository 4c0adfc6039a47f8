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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.optim import Optimizer

from . import stats as S
from ._version import __version__
from .anomaly import own_ops
from .dtypes import dtype_name, limits
from .errors import AmpDoctorError
from .probes import Probes, iter_tensors
from .recorder import History, HostStep, LayerAggregate, StepBuffer, count_sync, host_step_layers
from .records import AmpConfig, Event, RunInfo, ScalerEvent, Session, StepRecord
from .scaler import AmpMonitor, subscribe

__all__ = ["Watch", "watch", "DEFAULT_EVERY"]

# Record one step in ten: enough to see persistent problems, cheap enough
# to leave on (see benchmarks/results.md). Skips, backoffs and misuse are
# tracked on every step regardless.
DEFAULT_EVERY = 10
# Judge what-if overflow/underflow against float16 when autocast never ran:
# it is the format with the narrower range, so the stricter question.
WHAT_IF_DTYPE = torch.float16

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
        if not isinstance(every, int) or every < 1:
            raise AmpDoctorError(f"every must be a positive integer, got {every!r}; e.g. every=10.")
        if max_steps is not None and max_steps < 1:
            raise AmpDoctorError(f"max_steps must be >= 1 or None, got {max_steps!r}.")
        if on_nonfinite not in ("record", "raise"):
            raise AmpDoctorError(
                f"on_nonfinite must be 'record' or 'raise', got {on_nonfinite!r}."
            )
        self.models = {k: _unwrap(m) for k, m in _as_models(model).items()} if model else {}
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

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> Watch:
        if self._started_flag:
            return self
        self._started_flag = True
        try:
            self._owned_params = {id(p) for m in self.models.values() for p in m.parameters()}
            self._probes = Probes(self.models, self._current_buffer, self._on_root_forward)
            if self._fp32_patterns:
                from .fp32 import Fp32Islands

                self._fp32 = Fp32Islands(self._fp32_patterns)
                for prefix, m in self.models.items():
                    self._fp32.attach(prefix, m)
                if not self._discover:
                    self._fp32.check()  # the API knows every model now: fail before training
            self._monitor = AmpMonitor(
                owns_param=lambda p: id(p) in self._owned_params,
                on_boundary=self._boundary,
                step_of=lambda: self.step_index,
                scaler=self._explicit_scaler,
                optimizers=self._explicit_opts,
                on_unscale=self._on_param_grads,
                on_skip=self._on_skip,
                on_scale=self._on_scale,
            )
            self._monitor.autocast_dtype = self._autocast_dtype
            self._sub = subscribe(self._monitor)
            if self._discover:
                from torch.nn.modules.module import (
                    register_module_forward_hook,
                    register_module_forward_pre_hook,
                )

                self._global_handles = [
                    register_module_forward_pre_hook(self._global_pre),
                    register_module_forward_hook(self._global_post, always_call=True),
                ]
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
        self.closed = True
        try:
            if self._buffer is not None and self._activity:
                self._finish_step(partial=True)
        finally:
            self._teardown()
        self.session_ = self._build_session()
        if self.logdir is not None:
            self._write_outputs(self.session_)
        return self.session_

    def _teardown(self) -> None:
        # Each removal is independent: one failing must not leave others behind.
        removers: list[Callable[[], Any]] = [h.remove for h in self._global_handles]
        for owner, method in ((self._probes, "remove"), (self._sub, "remove"),
                              (self._anomaly, "stop"), (self._fp32, "remove")):
            if owner is not None:
                removers.append(getattr(owner, method))
        self._global_handles = []
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
        ``optimizer.step`` are ignored for this watch.
        """
        if self._monitor is not None:
            self._monitor.manual_steps = True
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
        self._global_depth += 1
        if self._global_depth != 1 or self._probes is None or self.closed:
            return
        if self._probes.watches(module) or next(module.parameters(), None) is None:
            return  # loss functions and other parameter-free callables are not models
        self.add_model(module, _variable_name(module))
        # This call's own pre-hooks were collected before we added ours.
        self._on_root_forward(module, args)

    def _global_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._global_depth = max(0, self._global_depth - 1)

    # -- hook callbacks ------------------------------------------------------
    def _current_buffer(self) -> StepBuffer:
        assert self._buffer is not None
        self._activity = True
        return self._buffer

    def _on_root_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._activity = True
        if self._anomaly is not None and self._probes is not None:
            self._anomaly.check_inputs(self._probes.name_of(module) or type(module).__name__, args)
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
            return None
        name = max(self._autocast_dtypes, key=lambda k: self._autocast_dtypes[k])
        return getattr(torch, name)

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

    def _on_skip(self, params: list[torch.Tensor]) -> None:
        """A GradScaler skipped a step: name the layers whose grads are not finite."""
        if self._buffer is not None or self._probes is None:
            return  # a recorded step names culprits from its own summaries
        by_layer: dict[str, list[torch.Tensor]] = {}
        for p in params:
            name = self._probes.param_owner.get(id(p))
            if name is not None and p.grad is not None:
                by_layer.setdefault(name, []).append(p.grad)
        if not by_layer:
            return
        names = list(by_layer)
        flags = torch.stack(
            [torch.stack([~torch.isfinite(g).all() for g in gs]).any() for gs in by_layer.values()]
        )
        bad = flags.tolist()  # the one sync of an unrecorded skipped step
        count_sync()
        order = {n: self._probes.layers[n].order for n in names}
        culprits = sorted((n for n, b in zip(names, bad, strict=True) if b),
                          key=lambda n: -order[n])
        self._pending_culprits = culprits

    _pending_culprits: list[str] | None = None

    # -- step boundary ---------------------------------------------------------
    def _set_recording(self) -> None:
        rec = self.step_index % self.every == 0 and (
            self.max_steps is None or self.recorded < self.max_steps
        )
        if self._probes is None:
            return
        self._probes.new_step()
        self._probes.recording = rec and not self.closed
        # Anomaly mode names modules on every step, so it needs the module stack.
        self._probes.set_armed(not self.closed and (self._probes.recording
                                                     or self._anomaly is not None))
        self._buffer = StepBuffer(self.step_index) if self._probes.recording else None
        self._activity = False

    def _boundary(self) -> None:
        if self.closed:
            return
        self._finish_step(partial=False)
        self.step_index += 1
        self._set_recording()
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
        step = self.step_index
        rec: StepRecord | None = None
        buf = self._buffer
        if buf is not None:
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
            if origin is not None:
                self._agg[origin].origin_steps += 1
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
            self._note_scaler(step, outcome, culprits)

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

    def _note_scaler(self, step: int, out: Any, culprits: list[str]) -> None:
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
                forward_origin=self._pending_origin))
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
        scaler_on = bool(timeline and timeline.enabled)
        amp = AmpConfig(
            device_type=self._device_type,
            dtype=dtype_name(fmt_dtype) if (self._autocast_dtypes or (
                probes and probes.low_precision_outputs())) else None,
            scaler=scaler_on,
            autocast_seen=bool(self._autocast_dtypes),
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
    return Watch(model, **kwargs).start()


_ = S  # stats layout is part of this module's contract with recorder
