"""Observers of the AMP API: GradScaler, optimizers, gradient clipping,
LR schedulers and backward.

One process-wide :class:`_ApiHub` installs the patches and global hooks
when the first watch starts and restores every one of them when the last
watch stops, so several watches can overlap in any order. The hub only
forwards calls to subscribers; what they mean for one watch is decided by
:class:`AmpMonitor`.

Nothing here adds a host sync on a healthy step. Whether GradScaler skipped
an optimizer step is known without reading a device value: ``scaler.step``
calls ``optimizer.step`` only when no inf/NaN was found (GradScaler's own
sync decides that), so an optimizer step that did not happen *is* the skip.
The scale itself is tracked on the host by replaying GradScaler's
growth/backoff rule, and corrected from the real device value on every
recorded step, whose single host copy includes it.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim import Optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.weak import WeakIdKeyDictionary

from .records import Event, ScalerEvent, ScalerTimeline

__all__ = ["AmpMonitor", "ApiSubscriber", "StepOutcome", "subscribe", "patches_installed"]

_CLIP_FUNCS = ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm")
_LOW = (torch.float16, torch.bfloat16)


class ApiSubscriber(Protocol):
    def on_scale(self, scaler: GradScaler, outputs: Any, result: Any) -> None: ...
    def on_unscale(self, scaler: GradScaler, optimizer: Optimizer) -> None: ...
    def on_scaler_step(self, scaler: GradScaler, optimizer: Optimizer, stepped: bool) -> None: ...
    def on_update_begin(self, scaler: GradScaler) -> None: ...
    def on_update_end(self, scaler: GradScaler) -> None: ...
    def on_optimizer_pre(self, optimizer: Optimizer) -> None: ...
    def on_optimizer_post(self, optimizer: Optimizer) -> None: ...
    def on_clip(self, func: str, parameters: list[torch.Tensor]) -> None:
        for st in self.scalers.values():
            scaler = st.ref()
            if scaler is None or not scaler._enabled or not st.scaled_since_update:
                continue
            states = scaler._per_optimizer_states
            if any(ost.get("stage") is OptState.UNSCALED for ost in list(states.values())):
                continue
            # A scaled backward ran and no optimizer was unscaled since: the
            # gradients being clipped still carry the loss scale.
            self._event(
                "clip_before_unscale",
                data={"func": func, "scale": st.scale},
            )
            return

    def on_scheduler_step(self, scheduler: Any) -> None: ...
    def on_backward(self, tensors: Any) -> None: ...


def _all_subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


class _ApiHub:
    """Process-wide patches, installed once and restored when unused."""

    def __init__(self) -> None:
        self.subscribers: list[ApiSubscriber] = []
        self._restore: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.step_counts: dict[int, int] = {}
        self._in_scaler_step = 0

    # -- subscription ------------------------------------------------------
    def add(self, sub: ApiSubscriber) -> None:
        with self._lock:
            if not self.subscribers:
                self._install()
            self.subscribers.append(sub)

    def remove(self, sub: ApiSubscriber) -> None:
        with self._lock:
            if sub in self.subscribers:
                self.subscribers.remove(sub)
            if not self.subscribers:
                self._uninstall()

    def emit(self, method: str, *args: Any) -> None:
        for sub in list(self.subscribers):
            try:
                getattr(sub, method)(*args)
            except Exception as e:  # never let amp-doctor break a training run
                _internal_error(sub, method, e)

    # -- installation ------------------------------------------------------
    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        had = name in vars(owner)
        orig = vars(owner)[name] if had else getattr(owner, name)
        setattr(owner, name, make(orig))

        def restore() -> None:
            if had:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)

        self._restore.append(restore)

    def _install(self) -> None:
        self.step_counts.clear()
        # Subclasses that override a method (e.g. FSDP's ShardedGradScaler)
        # need their own patch; the deprecated torch.cuda.amp / torch.cpu.amp
        # spellings inherit and are covered by the base class.
        for cls in _all_subclasses(GradScaler):
            for meth, wrapper in (
                ("scale", self._wrap_scale),
                ("unscale_", self._wrap_unscale),
                ("step", self._wrap_step),
                ("update", self._wrap_update),
            ):
                if meth in vars(cls):
                    self._patch(cls, meth, wrapper)
        h1 = register_optimizer_step_pre_hook(self._opt_pre)
        h2 = register_optimizer_step_post_hook(self._opt_post)
        self._restore.extend([h1.remove, h2.remove])
        import torch.nn.utils as nnu
        import torch.nn.utils.clip_grad as cg

        for mod in (nnu, cg):
            for fn in _CLIP_FUNCS:
                if hasattr(mod, fn):
                    self._patch(mod, fn, functools.partial(self._wrap_clip, fn))
        from torch.optim.lr_scheduler import LRScheduler

        self._patch(LRScheduler, "step", self._wrap_sched)
        self._patch(torch.autograd, "backward", self._wrap_backward)

    def _uninstall(self) -> None:
        while self._restore:
            self._restore.pop()()

    # -- wrappers ------------------------------------------------------------
    def _wrap_scale(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def scale(scaler: GradScaler, outputs: Any) -> Any:
            result = orig(scaler, outputs)
            hub.emit("on_scale", scaler, outputs, result)
            return result

        return scale

    def _wrap_unscale(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def unscale_(scaler: GradScaler, optimizer: Optimizer) -> Any:
            if scaler._enabled:
                hub.emit("on_unscale", scaler, optimizer)
            return orig(scaler, optimizer)

        return unscale_

    def _wrap_step(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def step(scaler: GradScaler, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
            before = hub.step_counts.get(id(optimizer), 0)
            hub._in_scaler_step += 1
            try:
                result = orig(scaler, optimizer, *args, **kwargs)
            finally:
                hub._in_scaler_step -= 1
            stepped = hub.step_counts.get(id(optimizer), 0) != before
            hub.emit("on_scaler_step", scaler, optimizer, stepped)
            return result

        return step

    def _wrap_update(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def update(scaler: GradScaler, new_scale: Any = None) -> Any:
            hub.emit("on_update_begin", scaler)
            result = orig(scaler, new_scale)
            hub.emit("on_update_end", scaler)
            return result

        return update

    def _opt_pre(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.emit("on_optimizer_pre", optimizer)

    def _opt_post(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.step_counts[id(optimizer)] = self.step_counts.get(id(optimizer), 0) + 1
        self.emit("on_optimizer_post", optimizer)

    def _wrap_clip(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(parameters, torch.Tensor):
                params = [parameters]
            else:
                params = list(parameters)
            hub.emit("on_clip", name, params)
            return orig(params, *args, **kwargs)

        return clip

    def _wrap_sched(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def sched_step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            hub.emit("on_scheduler_step", scheduler)
            return orig(scheduler, *args, **kwargs)

        return sched_step

    def _wrap_backward(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            hub.emit("on_backward", tensors)
            return orig(tensors, *args, **kwargs)

        return backward


_HUB = _ApiHub()
_REPORTED: set[tuple[int, str]] = set()


def _internal_error(sub: Any, method: str, exc: Exception) -> None:
    key = (id(sub), method)
    if key not in _REPORTED:
        _REPORTED.add(key)
        import warnings

        warnings.warn(
            f"amp-doctor: internal error in {method} ({type(exc).__name__}: {exc}); "
            "training continues unaffected, but this part of the report may be incomplete. "
            "Please report it with the traceback from AMP_DOCTOR_DEBUG=1.",
            RuntimeWarning,
            stacklevel=3,
        )
    import os

    if os.environ.get("AMP_DOCTOR_DEBUG"):
        raise exc


class _Subscription:
    """Removable like a hook handle; removing the last one restores every patch."""

    def __init__(self, sub: ApiSubscriber) -> None:
        self._sub: ApiSubscriber | None = sub
        _HUB.add(sub)

    def remove(self) -> None:
        if self._sub is not None:
            _HUB.remove(self._sub)
            self._sub = None


def subscribe(sub: ApiSubscriber) -> _Subscription:
    """Start forwarding AMP API calls to ``sub``; the handle's ``remove`` stops it."""
    return _Subscription(sub)


def patches_installed() -> bool:
    """True while any watch is active (tests use it to prove nothing is left behind)."""
    return bool(_HUB._restore)


# ---------------------------------------------------------------------------
# Per-watch interpretation
# ---------------------------------------------------------------------------


@dataclass
class _ScalerState:
    """Host mirror of one GradScaler's scale, replaying its update rule."""

    ref: weakref.ref[GradScaler]
    name: str
    enabled: bool
    scale: float | None = None
    growth_tracker: int = 0
    stepped_this_step: set[int] = field(default_factory=set)
    skipped_this_step: set[int] = field(default_factory=set)
    found_inf_pending: bool = False
    scaled_since_update: bool = False

    def params(self) -> tuple[float, float, int]:
        s = self.ref()
        if s is None:
            return (2.0, 0.5, 2000)
        return (s._growth_factor, s._backoff_factor, s._growth_interval)


@dataclass
class StepOutcome:
    """What the AMP API did in one training step, known without a sync."""

    scale_before: float | None = None
    scale_after: float | None = None
    skipped: bool = False
    skipped_optimizers: list[str] = field(default_factory=list)
    backoff: bool = False
    growth: bool = False


class AmpMonitor:
    """Turns AMP API calls into step boundaries, a scale timeline and misuse events.

    ``owns_optimizer`` filters optimizers to those that update the watched
    models. ``on_boundary`` is called when a training step ends.
    """

    def __init__(
        self,
        owns_param: Callable[[torch.Tensor], bool],
        on_boundary: Callable[[], None],
        step_of: Callable[[], int],
        scaler: GradScaler | None = None,
        optimizers: Iterable[Optimizer] = (),
        on_unscale: Callable[[list[torch.Tensor], float | None], None] | None = None,
        on_skip: Callable[[list[torch.Tensor]], None] | None = None,
        on_scale: Callable[[GradScaler, Any], None] | None = None,
    ) -> None:
        self._owns_param = owns_param
        self._on_boundary = on_boundary
        self._step_of = step_of
        self._on_unscale = on_unscale
        self._on_skip = on_skip
        self._on_scale_cb = on_scale
        self._explicit_scaler = scaler
        self._explicit_opts = {id(o) for o in optimizers}
        self.scalers: dict[int, _ScalerState] = {}
        self._opt_names: dict[int, str] = {}
        self._opt_relevant: dict[int, bool] = {}
        self._primary_opt: int | None = None
        self.primary_scaler: int | None = None
        self.manual_steps = False
        self.events: list[Event] = []
        self._event_keys: set[tuple[str, str | None]] = set()
        self.timeline_scale: list[tuple[int, float]] = []
        self.scaler_events: list[ScalerEvent] = []
        self.backoff_steps: list[int] = []
        self.growth_steps: list[int] = []
        self.skipped_steps: list[int] = []
        self.skipped_by_optimizer: dict[str, list[int]] = {}
        self.outcome = StepOutcome()
        self.last_step_skipped = False
        self.last_step_id = -1
        self._unscaled: set[int] = set()
        self._stepped_since_update: dict[int, set[int]] = {}
        # Identity-keyed: tensors compare elementwise, so a WeakSet would not do.
        self._scaled_outputs: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.low_param_dtypes: set[str] = set()
        self.scaled_loss_seen = False
        self.autocast_dtype: Callable[[], torch.dtype | None] = lambda: None
        self.step_params: dict[int, list[torch.Tensor]] = {}
        if scaler is not None:
            self._state(scaler)
        if optimizers:
            for o in optimizers:
                self._relevant(o)

    # -- bookkeeping -------------------------------------------------------
    def _state(self, scaler: GradScaler) -> _ScalerState | None:
        if self._explicit_scaler is not None and scaler is not self._explicit_scaler:
            return None
        st = self.scalers.get(id(scaler))
        if st is None or st.ref() is not scaler:
            st = _ScalerState(
                ref=weakref.ref(scaler),
                name=f"scaler{len(self.scalers)}",
                enabled=bool(scaler._enabled),
                scale=scaler._init_scale if scaler._enabled else None,
            )
            self.scalers[id(scaler)] = st
            if self.primary_scaler is None:
                self.primary_scaler = id(scaler)
        return st

    def _relevant(self, opt: Optimizer) -> bool:
        key = id(opt)
        if key not in self._opt_relevant:
            if self._explicit_opts:
                rel = key in self._explicit_opts
            else:
                rel = any(
                    self._owns_param(p) for g in opt.param_groups for p in g["params"]
                )
            self._opt_relevant[key] = rel
            self._opt_names[key] = f"{type(opt).__name__}#{len(self._opt_names)}"
        return self._opt_relevant[key]

    def opt_name(self, opt: Optimizer) -> str:
        self._relevant(opt)
        return self._opt_names[id(opt)]

    def _event(self, kind: str, once_key: str | None = None, **kw: Any) -> None:
        if once_key is not None:
            if (kind, once_key) in self._event_keys:
                return
            self._event_keys.add((kind, once_key))
        self.events.append(Event(kind=kind, step=self._step_of(), **kw))

    @staticmethod
    def _params(opt: Optimizer) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"]]

    # -- subscriber interface ---------------------------------------------
    def on_scale(self, scaler: GradScaler, outputs: Any, result: Any) -> None:
        st = self._state(scaler)
        if st is None:
            return
        if scaler._enabled:
            self.scaled_loss_seen = True
            st.scaled_since_update = True
            for t in _tensors(result):
                self._scaled_outputs[t] = True
        if self._on_scale_cb is not None:
            self._on_scale_cb(scaler, outputs)
        dt = self.autocast_dtype()
        if scaler._enabled and dt == torch.bfloat16:
            self._event("scaler_with_bf16", once_key="bf16", data={"dtype": "bfloat16"})

    def on_unscale(self, scaler: GradScaler, optimizer: Optimizer) -> None:
        st = self._state(scaler)
        if st is None or not self._relevant(optimizer):
            return
        params = self._params(optimizer)
        halfs = sorted({str(p.grad.dtype).removeprefix("torch.") for p in params
                        if p.grad is not None and p.grad.dtype in (torch.float16,)})
        if halfs:
            self._event("fp16_params", once_key="fp16", data={"dtypes": halfs,
                        "count": sum(1 for p in params if p.dtype == torch.float16)})
        if self._on_unscale is not None:
            self._on_unscale(params, st.scale)

    def on_scaler_step(self, scaler: GradScaler, optimizer: Optimizer, stepped: bool) -> None:
        st = self._state(scaler)
        if st is None or not self._relevant(optimizer) or not scaler._enabled:
            return
        if not stepped:
            st.skipped_this_step.add(id(optimizer))
            if self._on_skip is not None:
                self._on_skip(self._params(optimizer))
        else:
            st.stepped_this_step.add(id(optimizer))
        st.found_inf_pending = True

    def on_update_begin(self, scaler: GradScaler) -> None:
        st = self._state(scaler)
        if st is None:
            return
        self.outcome.scale_before = st.scale

    def on_update_end(self, scaler: GradScaler) -> None:
        st = self._state(scaler)
        if st is None:
            return
        step = self._step_of()
        if scaler._enabled and st.scale is not None:
            growth, backoff, interval = st.params()
            before = st.scale
            if st.skipped_this_step:
                st.scale = before * backoff
                st.growth_tracker = 0
            else:
                st.growth_tracker += 1
                if st.growth_tracker >= interval:
                    st.scale = before * growth
                    st.growth_tracker = 0
            if st.skipped_this_step:
                self.outcome.backoff = True
                self.outcome.skipped = True
                for oid in st.skipped_this_step:
                    self.outcome.skipped_optimizers.append(self._opt_names.get(oid, "?"))
            elif st.scale != before:
                self.outcome.growth = True
            self.outcome.scale_before = before
            self.outcome.scale_after = st.scale
        st.skipped_this_step = set()
        st.stepped_this_step = set()
        st.found_inf_pending = False
        st.scaled_since_update = False
        if not self.manual_steps and id(scaler) == self.primary_scaler:
            self._unscaled.clear()
            self._on_boundary()
        del step

    def on_optimizer_pre(self, optimizer: Optimizer) -> None:
        if not self._relevant(optimizer):
            return
        self.step_params[id(optimizer)] = self._params(optimizer)
        if self._on_unscale is not None and not self._scaler_active():
            self._on_unscale(self._params(optimizer), None)

    def on_optimizer_post(self, optimizer: Optimizer) -> None:
        if not self._relevant(optimizer):
            return
        if self._primary_opt is None:
            self._primary_opt = id(optimizer)
        if (
            not self.manual_steps
            and self.primary_scaler is None
            and id(optimizer) == self._primary_opt
        ):
            self._on_boundary()

    def on_clip(self, func: str, parameters: list[torch.Tensor]) -> None:
        ids = {id(p) for p in parameters}
        for sid, st in self.scalers.items():
            scaler = st.ref()
            if scaler is None or not scaler._enabled or not self.scaled_loss_seen:
                continue
            for state_opt_id, ostate in scaler._per_optimizer_states.items():
                del state_opt_id
                if ostate["stage"] is OptState.UNSCALED:
                    return
            # No optimizer has been unscaled this step: the grads being
            # clipped still carry the loss scale.
            if any(id(p) in ids for p in self._all_watched_params()):
                self._event(
                    "clip_before_unscale",
                    once_key=None if len(self.events) < 200 else "many",
                    data={"func": func, "scale": st.scale},
                )
            del sid
            return

    def on_scheduler_step(self, scheduler: Any) -> None:
        opt = getattr(scheduler, "optimizer", None)
        if opt is None or not self._relevant(opt):
            return
        if self.last_step_skipped and self._step_of() - 1 == self.last_step_id:
            self._event(
                "scheduler_on_skipped_step",
                once_key=None,
                data={"scheduler": type(scheduler).__name__, "skipped_step": self.last_step_id},
            )

    def on_backward(self, tensors: Any) -> None:
        for dev in ("cuda", "cpu"):
            try:
                on = torch.is_autocast_enabled(dev)
            except Exception:
                on = False
            if on:
                self._event("backward_in_autocast", once_key="bwd", data={"device": dev})
                break
        if not self.scaled_loss_seen or not self._any_enabled_scaler():
            return
        ts = _tensors(tensors)
        if ts and not any(t in self._scaled_outputs for t in ts):
            if all(t.numel() == 1 for t in ts) and any(t.requires_grad for t in ts):
                self._event("loss_not_scaled", once_key="loss")

    # -- helpers ------------------------------------------------------------
    def _scaler_active(self) -> bool:
        return any((s := st.ref()) is not None and s._enabled and self._in_scaler_step()
                   for st in self.scalers.values())

    @staticmethod
    def _in_scaler_step() -> bool:
        return _HUB._in_scaler_step > 0

    def _any_enabled_scaler(self) -> bool:
        return any((s := st.ref()) is not None and s._enabled for st in self.scalers.values())

    def take_outcome(self) -> StepOutcome:
        out, self.outcome = self.outcome, StepOutcome()
        return out

    def correct_scale(self, scaler_id: int, real_scale: float, tracker: int | None) -> None:
        st = self.scalers.get(scaler_id)
        if st is not None and math.isfinite(real_scale):
            st.scale = real_scale
            if tracker is not None:
                st.growth_tracker = tracker

    def timeline(self) -> ScalerTimeline | None:
        if self.primary_scaler is None:
            return None
        st = self.scalers[self.primary_scaler]
        s = st.ref()
        return ScalerTimeline(
            scale=list(self.timeline_scale),
            backoff_steps=list(self.backoff_steps),
            growth_steps=list(self.growth_steps),
            skipped_steps=list(self.skipped_steps),
            skipped_by_optimizer={k: list(v) for k, v in self.skipped_by_optimizer.items()},
            events=list(self.scaler_events),
            init_scale=s._init_scale if s is not None else None,
            growth_interval=s._growth_interval if s is not None else None,
            growth_factor=s._growth_factor if s is not None else None,
            backoff_factor=s._backoff_factor if s is not None else None,
            enabled=st.enabled,
        )


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    return []
