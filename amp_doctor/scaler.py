"""Observers of the AMP API: GradScaler, optimizers, gradient clipping,
LR schedulers and backward.

One process-wide :class:`_ApiHub` installs the patches and global hooks
when the first watch starts and restores every one of them when the last
watch stops, so several watches can overlap in any order. The hub only
forwards calls to subscribers; what they mean for one watch is decided by
:class:`AmpMonitor`.

What is patched, and why at that level:

* ``GradScaler.scale/unscale_/step/update`` on the class (and on every
  subclass that overrides one of them), so every scaler is seen: passed to
  ``watch``, created before the watch or after it, and the deprecated
  ``torch.cuda.amp.GradScaler`` / ``torch.cpu.amp.GradScaler`` spellings,
  which are subclasses;
* global optimizer step pre/post hooks (every ``torch.optim.Optimizer``);
* ``torch.nn.utils.clip_grad``'s inner functions, which ``clip_grad_norm_``
  and ``clip_grad_value_`` look up at call time, so a clip is seen even when
  the user's code imported the function before the watch started;
* ``LRScheduler.step`` (and subclasses that override it) and
  ``torch.autograd.backward`` (which ``Tensor.backward`` calls).

Nothing here adds a host sync on a healthy step. Whether GradScaler skipped
an optimizer step is known without reading a device value: ``scaler.step``
calls ``optimizer.step`` only when no inf/NaN was found (GradScaler's own
sync decides that), so an optimizer step that did not happen *is* the skip.
The scale itself is tracked on the host by replaying GradScaler's
growth/backoff rule in float32, and corrected from the real device value on
every recorded step, whose single host copy includes it. Optimizers that
check for inf themselves on the device (``fused=True``) give no such sync:
their inf flags are kept on the device and read in one batch when the
session is built.
"""

from __future__ import annotations

import math
import struct
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim import Optimizer

from .devicework import count_sync
from .patching import (
    ApiSubscriber,
    in_scaler_step,
    patches_installed,
    scaled_backwards,
    subscribe,
    tensor_list,
)
from .records import Event, ScalerEvent, ScalerTimeline

__all__ = ["AmpMonitor", "ApiSubscriber", "StepOutcome", "subscribe", "patches_installed"]

# Events of one kind kept with their details; further ones are only counted.
MAX_EVENTS_PER_KIND = 50
# Device-side inf flags of fused optimizers are read in one batch at this many.
DEFERRED_LIMIT = 1024
# Autograd graph nodes visited to decide whether an unscaled backward reached
# the watched parameters (only done when an enabled scaler then steps them).
GRAPH_WALK_LIMIT = 200_000

_SCALER_METHODS = ("scale", "unscale_", "step", "update", "load_state_dict")


def _f32(x: float) -> float:
    """``x`` rounded to float32, as GradScaler's scale tensor holds it."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _is_deferred(opt: Any) -> bool:
    """Optimizers whose skip GradScaler does not decide on the host."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False)) or not isinstance(
        opt, Optimizer)


# ---------------------------------------------------------------------------
# Per-watch interpretation
# ---------------------------------------------------------------------------


@dataclass
class _Deferred:
    """Updates whose skip is known only on the device (fused optimizers), in order."""

    scale: float | None
    tracker: int | None
    # (step, {optimizer name: device inf flag, or host bool when known})
    entries: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


@dataclass
class _ScalerState:
    """Host mirror of one GradScaler's scale, replaying its update rule."""

    ref: weakref.ref[GradScaler]
    name: str
    enabled: bool
    scale: float | None = None
    tracker: int | None = 0
    steps_total: int = 0
    updates: int = 0
    steps_since_update: int = 0
    # This step's inf flags per optimizer name: a bool, or a device tensor (fused).
    flags: dict[str, Any] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)  # optimizer id -> name
    flows_at_update: int = 0
    deferred: _Deferred | None = None
    # The scaler's settings, kept for the report after the scaler is gone.
    init_scale: float | None = None
    settings: tuple[float, float, int] = (2.0, 0.5, 2000)
    # It stepped or unscaled an optimizer of the watched models.
    relevant: bool = False
    # The optimizers it stepped or unscaled (ids).
    opt_ids: set[int] = field(default_factory=set)

    def params(self) -> tuple[float, float, int]:
        s = self.ref()
        if s is not None and s._enabled:  # a disabled scaler has no settings
            self.settings = (s._growth_factor, s._backoff_factor, s._growth_interval)
        return self.settings

    @property
    def scaled_since_update(self) -> bool:
        """A backward went through this scaler's scaled outputs since the last update()."""
        return scaled_backwards(self.ref()) != self.flows_at_update


@dataclass
class StepOutcome:
    """What the AMP API did in one training step, known without a sync."""

    scale_before: float | None = None
    scale_after: float | None = None
    skipped: bool = False
    skipped_optimizers: list[str] = field(default_factory=list)
    backoff: bool = False
    growth: bool = False


def _replay(scale: float | None, tracker: int | None, found_inf: bool,
            growth: float, backoff: float, interval: int) -> tuple[float | None, int | None]:
    """GradScaler's ``_amp_update_scale_`` on the host, in float32 like the kernel."""
    if found_inf:
        return (_f32(scale * backoff) if scale is not None else None), 0
    t = (tracker or 0) + 1
    if t >= interval:
        if scale is not None:
            grown = _f32(scale * growth)
            if math.isfinite(grown):
                scale = grown
        t = 0
    return scale, t


class AmpMonitor:
    """Turns AMP API calls into step boundaries, a scale timeline and misuse events.

    ``owns_param`` tells parameters of the watched models. ``on_boundary`` is
    called when a training step ends (at the primary scaler's ``update()``,
    or at the primary optimizer's step when no scaler is in use).
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
        on_backward: Callable[[list[torch.Tensor]], None] | None = None,
        on_backward_done: Callable[[list[torch.Tensor]], None] | None = None,
        on_optimizer_done: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        self._owns_param = owns_param
        self._on_backward_cb = on_backward
        self._on_backward_done_cb = on_backward_done
        self._on_optimizer_done_cb = on_optimizer_done
        self._on_boundary = on_boundary
        self._step_of = step_of
        self._on_unscale = on_unscale
        self._on_skip = on_skip
        self._on_scale_cb = on_scale
        self._explicit_scaler = scaler
        self._explicit_opts = {id(o) for o in optimizers}
        self.scalers: dict[int, _ScalerState] = {}
        self._opt_names: dict[int, str] = {}
        self._opt_count = 0
        self._opt_relevant: dict[int, bool] = {}
        self._opts: dict[int, weakref.ref[Any]] = {}
        self._primary_opt: int | None = None
        self.primary_scaler: int | None = None
        self.manual_steps = False
        self._events: list[Event] = []
        self._event_keys: set[tuple[str, str]] = set()
        self._event_counts: dict[str, int] = {}
        self.timeline_scale: list[tuple[int, float]] = []
        self.scaler_events: list[ScalerEvent] = []
        self.backoff_steps: list[int] = []
        self.growth_steps: list[int] = []
        self.skipped_steps: list[int] = []
        self.skipped_by_optimizer: dict[str, list[int]] = {}
        self.outcome = StepOutcome()
        # Written by the watch at each boundary; kept for its use.
        self.last_step_skipped = False
        self.last_step_id = -1
        # The primary scaler's last update: (step, skipped optimizer ids, before, after).
        self._last_update: tuple[int, set[int], float | None, float | None] | None = None
        self._sched_flagged: set[tuple[int, int]] = set()
        # Root autograd nodes of this step's backward passes that did not go
        # through scaler.scale(); judged when an enabled scaler steps.
        self._unscaled_roots: list[Any] = []
        self._bwd_autocast_step = -1
        self._fp16_checked: set[int] = set()
        self.autocast_dtype: Callable[[], torch.dtype | None] = lambda: None
        self.step_params: dict[int, list[torch.Tensor]] = {}
        if scaler is not None:
            self._state(scaler)
        for o in optimizers:
            self._relevant(o)

    # -- bookkeeping -------------------------------------------------------
    def _state(self, scaler: GradScaler) -> _ScalerState | None:
        if self._explicit_scaler is not None and scaler is not self._explicit_scaler:
            return None
        st = self.scalers.get(id(scaler))
        if st is None or st.ref() is not scaler:
            enabled = bool(scaler._enabled)
            scale: float | None = None
            tracker: int | None = 0
            if enabled:
                if scaler._scale is None:
                    # Not used yet: the first scale() creates it from these.
                    scale = _f32(float(scaler._init_scale))
                    tracker = int(getattr(scaler, "_init_growth_tracker", 0))
                elif scaler._scale.device.type == "cpu" and scaler._growth_tracker is not None:
                    # Host memory already: reading it is not a device sync.
                    scale = float(scaler._scale)
                    tracker = int(scaler._growth_tracker)
                else:
                    # Used before the watch, on a device: the first recorded
                    # step's host copy corrects it (see correct_scale).
                    tracker = None
            st = _ScalerState(ref=weakref.ref(scaler), name=f"scaler{len(self.scalers)}",
                              enabled=enabled, scale=scale, tracker=tracker,
                              flows_at_update=scaled_backwards(scaler),
                              init_scale=scale if scale is not None else float(
                                  getattr(scaler, "_init_scale", 2.0 ** 16)))
            st.params()
            self.scalers[id(scaler)] = st
            if self.primary_scaler == id(scaler):  # a new scaler at a dead one's address
                self.primary_scaler = None
            if scaler is self._explicit_scaler:
                self._claim(scaler, st)
        return st

    def _claim(self, scaler: GradScaler, st: _ScalerState) -> None:
        """``scaler`` works for the watched models (it stepped or unscaled one of
        their optimizers). The first such scaler drives step boundaries; a new
        one takes over when that one is gone (a training function called again).
        Scalers of other models, seen by an overlapping watch, never do."""
        st.relevant = True
        cur = self.scalers.get(self.primary_scaler) if self.primary_scaler is not None \
            else None
        if cur is None or cur.ref() is None or not cur.relevant or (
                cur is not st and cur.opt_ids & st.opt_ids):
            # A new scaler for the same optimizer replaced the old one (a resumed or
            # restarted loop), even while the old object is still alive.
            self.primary_scaler = id(scaler)

    def _known(self, opt: Any) -> None:
        if id(opt) not in self._opts or self._opts[id(opt)]() is not opt:
            if id(opt) in self._opts:
                # A new optimizer at a dead one's address: forget what was decided about it.
                self._opt_relevant.pop(id(opt), None)
                self._opt_names.pop(id(opt), None)
                self._fp16_checked.discard(id(opt))
            try:
                self._opts[id(opt)] = weakref.ref(opt)
            except TypeError:  # pragma: no cover - optimizer wrappers without __weakref__
                pass

    def _relevant(self, opt: Any) -> bool:
        key = id(opt)
        self._known(opt)
        if key not in self._opt_relevant:
            if self._explicit_opts:
                rel = key in self._explicit_opts
            else:
                rel = any(self._owns_param(p) for p in self._params(opt))
            self._opt_relevant[key] = rel
        if key not in self._opt_names:
            self._opt_names[key] = f"{type(opt).__name__}#{self._opt_count}"
            self._opt_count += 1
        return self._opt_relevant[key]

    def models_changed(self) -> None:
        """The watch gained a model: optimizers judged "not ours" before may be ours now.

        An LR scheduler's constructor, for one, shows us the optimizer before the
        ``diagnose`` CLI has seen the model's first forward pass.
        """
        self._opt_relevant = {k: v for k, v in self._opt_relevant.items() if v}

    def opt_name(self, opt: Any) -> str:
        self._relevant(opt)
        return self._opt_names[id(opt)]

    def _event(self, kind: str, once_key: str | None = None, **kw: Any) -> None:
        if once_key is not None:
            if (kind, once_key) in self._event_keys:
                return
            self._event_keys.add((kind, once_key))
        n = self._event_counts.get(kind, 0) + 1
        self._event_counts[kind] = n
        if n <= MAX_EVENTS_PER_KIND:
            self._events.append(Event(kind=kind, step=self._step_of(), **kw))

    @staticmethod
    def _params(opt: Any) -> list[torch.Tensor]:
        groups = getattr(opt, "param_groups", None) or []
        return [p for g in groups for p in g.get("params", [])]

    @staticmethod
    def _stage(scaler: GradScaler, opt: Any) -> Any:
        # _per_optimizer_states is a defaultdict: .get never adds an entry.
        ost = scaler._per_optimizer_states.get(id(opt))
        return ost.get("stage") if ost else OptState.READY

    def _enabled_states(self) -> list[tuple[GradScaler, _ScalerState]]:
        out = []
        for st in self.scalers.values():
            s = st.ref()
            if s is not None and s._enabled:
                out.append((s, st))
        return out

    # -- GradScaler --------------------------------------------------------
    def on_scale_begin(self, scaler: GradScaler) -> None:
        # Before the first scale() creates the scale tensor: the mirror
        # starts from init_scale without reading a device value.
        self._state(scaler)

    def on_scale(self, scaler: GradScaler, outputs: Any, result: Any) -> None:
        st = self._state(scaler)
        if st is None:
            return
        if self.primary_scaler not in (None, id(scaler)) and not st.relevant:
            return  # another model's scaler, seen by an overlapping watch
        if self._on_scale_cb is not None:
            self._on_scale_cb(scaler, outputs)

    def on_unscale(self, scaler: GradScaler, optimizer: Any) -> None:
        st = self._state(scaler)
        if st is None or not self._relevant(optimizer):
            return
        st.opt_ids.add(id(optimizer))
        self._claim(scaler, st)
        stage = self._stage(scaler, optimizer)
        if stage is OptState.UNSCALED:
            self._event("missing_update", data={
                "call": "unscale_", "optimizer": self.opt_name(optimizer),
                "steps_since_update": st.steps_since_update, "scale": st.scale,
                "reason": "unscale_ twice"})
        elif stage is OptState.STEPPED:
            self._event("missing_update", data={
                "call": "unscale_", "optimizer": self.opt_name(optimizer),
                "steps_since_update": st.steps_since_update, "scale": st.scale,
                "reason": "unscale_ after step"})
        if id(optimizer) not in self._fp16_checked:
            self._fp16_checked.add(id(optimizer))
            self._check_fp16(optimizer, st)
        self._judge_unscaled_backward(scaler, st, optimizer)
        if self._on_unscale is not None:
            self._on_unscale(self._params(optimizer), st.scale)

    def _check_fp16(self, optimizer: Any, st: _ScalerState) -> None:
        params = self._params(optimizer)
        halfs = [p for p in params if p.grad is not None and p.grad.dtype == torch.float16]
        if halfs:
            self._event("fp16_params", once_key="fp16", data={
                "optimizer": self.opt_name(optimizer),
                "count": len(halfs), "total": len(params),
                "numel": sum(p.numel() for p in halfs),
                "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in halfs}),
                "scale": st.scale})

    def on_scaler_step_begin(self, scaler: GradScaler, optimizer: Any) -> None:
        st = self._state(scaler)
        if st is None or not self._relevant(optimizer):
            return
        st.opt_ids.add(id(optimizer))
        self._claim(scaler, st)
        if not scaler._enabled:
            return
        if self.autocast_dtype() == torch.bfloat16:
            self._event("scaler_with_bf16", once_key="bf16",
                        data={"dtype": "bfloat16", "scale": st.scale, "scaler": st.name})
        if self._stage(scaler, optimizer) is OptState.STEPPED:
            # torch raises "step() has already been called since the last update()".
            self._event("missing_update", data={
                "call": "step", "optimizer": self.opt_name(optimizer),
                "steps_since_update": st.steps_since_update, "scale": st.scale,
                "updates": st.updates, "reason": "step twice"})
        self._judge_unscaled_backward(scaler, st, optimizer)

    def on_scaler_step(self, scaler: GradScaler, optimizer: Any, stepped: bool) -> None:
        st = self._state(scaler)
        if st is None or not scaler._enabled:
            return
        relevant = self._relevant(optimizer)
        name = self.opt_name(optimizer)
        st.steps_total += 1
        st.steps_since_update += 1
        if _is_deferred(optimizer):
            ost = scaler._per_optimizer_states.get(id(optimizer)) or {}
            infs = list((ost.get("found_inf_per_device") or {}).values())
            if infs:
                dev = infs[0].device
                st.flags[name] = torch.stack([f.to(dev) for f in infs]).sum()
            return
        st.flags[name] = not stepped
        if not stepped:
            st.skipped[id(optimizer)] = name
            if relevant and self._on_skip is not None:
                self._on_skip(self._params(optimizer))

    def on_update_end(self, scaler: GradScaler, new_scale: Any) -> None:
        st = self._state(scaler)
        if st is None:
            return
        primary = id(scaler) == self.primary_scaler
        if scaler._enabled:
            step = self._step_of()
            st.updates += 1
            before, after = st.scale, st.scale
            if new_scale is not None:
                self._resolve(st)
                before = st.scale
                st.scale = self._manual_scale(new_scale)
                after = st.scale
            elif st.deferred is not None or any(
                    isinstance(v, torch.Tensor) for v in st.flags.values()):
                if st.deferred is None:
                    st.deferred = _Deferred(st.scale, st.tracker)
                st.deferred.entries.append((step, dict(st.flags)))
                before = after = None
                if len(st.deferred.entries) >= DEFERRED_LIMIT:
                    self._resolve(st)
            else:
                found = any(st.flags.values())
                st.scale, st.tracker = _replay(st.scale, st.tracker, found, *st.params())
                after = st.scale
            if primary:
                out = self.outcome
                if out.scale_before is None:
                    out.scale_before = before
                out.scale_after = after
                if st.skipped:
                    out.backoff = out.skipped = True
                    out.skipped_optimizers.extend(st.skipped.values())
                elif new_scale is None and after is not None and after != before:
                    out.growth = True
                self._last_update = (step, set(st.skipped), before, after)
        st.flags = {}
        st.skipped = {}
        st.steps_since_update = 0
        st.flows_at_update = scaled_backwards(scaler)
        self._unscaled_roots = []
        if not self.manual_steps and primary:
            self._on_boundary()

    @staticmethod
    def _manual_scale(new_scale: Any) -> float | None:
        if isinstance(new_scale, (int, float)):
            return _f32(float(new_scale))
        if isinstance(new_scale, torch.Tensor) and new_scale.device.type == "cpu":
            return float(new_scale.reshape(-1)[0])  # host memory: no device sync
        return None  # corrected on the next recorded step

    # -- optimizers --------------------------------------------------------
    def on_optimizer_pre(self, optimizer: Optimizer) -> None:
        if not self._relevant(optimizer):
            return
        params = self._params(optimizer)
        self.step_params[id(optimizer)] = params
        if not in_scaler_step():
            self._judge_plain_step(optimizer)
        if self._on_unscale is None:
            return
        if not in_scaler_step():
            self._on_unscale(params, None)
            return
        # Inside scaler.step: unscale_ has summarised the gradients, unless
        # the optimizer unscales them itself (fused) or the scaler is disabled.
        for scaler, st in self._enabled_states():
            if id(optimizer) in scaler._per_optimizer_states:
                if _is_deferred(optimizer) and self._stage(scaler, optimizer) is OptState.READY:
                    self._on_unscale(params, st.scale)
                return
        self._on_unscale(params, None)

    def _judge_plain_step(self, optimizer: Optimizer) -> None:
        """``optimizer.step()`` outside ``scaler.step``: are its gradients still scaled?

        ``scaler.scale(loss).backward(); optimizer.step()`` with neither
        ``scaler.unscale_`` nor ``scaler.step``: the update is the loss scale
        times too large, inf/NaN gradients are not skipped, and the scaler
        never learns anything. Judged only for a scaler that never stepped
        anything, so that a second, unscaled model trained next to a scaled
        one (GANs) is not mistaken for this.
        """
        for scaler, st in self._enabled_states():
            if (st.scaled_since_update and st.steps_total == 0 and st.updates == 0
                    and self._stage(scaler, optimizer) is OptState.READY):
                self._event("scaled_grads_stepped", data={
                    "optimizer": self.opt_name(optimizer), "scaler": st.name,
                    "scale": st.scale})
                return

    def on_optimizer_post(self, optimizer: Optimizer) -> None:
        if not self._relevant(optimizer):
            return
        if self._on_optimizer_done_cb is not None:
            self._on_optimizer_done_cb(self.step_params.get(id(optimizer)) or [])
        if not in_scaler_step():
            # A plain optimizer.step(): those backward passes are not a scaler's.
            self._unscaled_roots = []
        if self._primary_opt is None:
            self._primary_opt = id(optimizer)
        if (
            not self.manual_steps
            and self.primary_scaler is None
            and id(optimizer) == self._primary_opt
        ):
            self._on_boundary()

    # -- clipping ------------------------------------------------------------
    def on_clip(self, func: str, parameters: list[torch.Tensor], info: dict[str, Any]) -> None:
        grads = info.get("grads")
        if grads is None:
            grads = [p.grad for p in parameters
                     if isinstance(p, torch.Tensor) and p.grad is not None]
        if not grads:
            return
        ids = {id(p) for p in parameters}
        gids = {id(g) for g in grads}

        def clipped(p: torch.Tensor) -> bool:
            return id(p) in ids or (p.grad is not None and id(p.grad) in gids)

        for scaler, st in self._enabled_states():
            if not st.scaled_since_update:
                continue
            owners = []
            for oid, ref in list(self._opts.items()):
                opt = ref()
                if opt is not None and any(clipped(p) for p in self._params(opt)):
                    owners.append((oid, opt))
            if owners and not any(self._relevant(o) for _, o in owners):
                continue  # another model's gradients (an overlapping watch's business)
            owners = [(oid, o) for oid, o in owners if self._relevant(o)]
            if owners:
                still_scaled = [self.opt_name(o) for _, o in owners
                                if self._stage(scaler, o) is OptState.READY]
            else:
                # The optimizer is not known yet (first step): unscale_ would
                # have marked some optimizer UNSCALED by now.
                if parameters and not any(self._owns_param(p) for p in parameters):
                    continue
                stages = [v.get("stage") for v in scaler._per_optimizer_states.values()]
                still_scaled = [] if any(s is not OptState.READY for s in stages) else ["?"]
            if not still_scaled:
                continue
            data: dict[str, Any] = {"func": func, "scale": st.scale, "scaler": st.name,
                                    "optimizers": [n for n in still_scaled if n != "?"]}
            for k in ("max_norm", "clip_value"):
                if info.get(k) is not None:
                    data[k] = float(info[k])
            tn = info.get("total_norm")
            if isinstance(tn, torch.Tensor):
                data["total_norm"] = tn.detach()  # read when the session is built
            self._event("clip_before_unscale", data=data)
            return

    # -- LR schedulers -------------------------------------------------------
    def on_scheduler_step(self, scheduler: Any) -> None:
        opt = getattr(scheduler, "optimizer", None)
        if opt is None or not self._relevant(opt):
            return
        oid = id(opt)
        hit: tuple[int, float | None, float | None] | None = None
        for _, st in self._enabled_states():
            if oid in st.skipped:  # stepped after scaler.step, before scaler.update
                hit = (self._step_of(), st.scale, None)
                break
        if hit is None and self._last_update is not None and oid in self._last_update[1]:
            step, _, before, after = self._last_update
            hit = (step, before, after)
        if hit is None:
            return
        key = (id(scheduler), hit[0])
        if key in self._sched_flagged:
            return
        self._sched_flagged.add(key)
        lrs = [g.get("lr") for g in getattr(opt, "param_groups", [])]
        self._event("scheduler_on_skipped_step", data={
            "scheduler": type(scheduler).__name__, "optimizer": self.opt_name(opt),
            "skipped_step": hit[0], "scale_before": hit[1], "scale_after": hit[2],
            "lr": float(lrs[0]) if lrs and isinstance(lrs[0], (int, float)) else None})

    # -- backward ------------------------------------------------------------
    def on_scaler_load(self, scaler: GradScaler, state: Any) -> None:
        """``GradScaler.load_state_dict``: a resumed run continues from the loaded scale."""
        st = self._state(scaler)
        if st is None or not scaler._enabled or not isinstance(state, dict):
            return
        try:
            scale = _f32(float(state["scale"]))
            tracker = int(state.get("_growth_tracker", 0))
        except (KeyError, TypeError, ValueError):
            return
        self._resolve(st)  # pending device flags belong to the steps before the load
        st.scale, st.tracker = scale, tracker
        st.params()
        step = self._step_of()
        if id(scaler) == self.primary_scaler and step > 0:
            # The timeline holds the scale after each step's update: the loaded
            # scale is the one in force after the step before this one.
            tl = [(s_, v) for s_, v in self.timeline_scale if s_ < step - 1]
            self.timeline_scale = tl + [(step - 1, scale)]

    def on_backward(self, tensors: Any) -> None:
        if self._on_backward_cb is not None:
            self._on_backward_cb(tensor_list(tensors))
        step = self._step_of()
        if step == self._bwd_autocast_step:
            return
        for dev in ("cuda", "cpu"):
            try:
                on = torch.is_autocast_enabled(dev)
            except Exception:  # devices this torch build does not know
                on = False
            if on:
                self._bwd_autocast_step = step
                try:
                    dt = str(torch.get_autocast_dtype(dev)).removeprefix("torch.")
                except Exception:  # pragma: no cover
                    dt = None
                self._event("backward_in_autocast", data={"device": dev, "dtype": dt})
                break

    def on_backward_end(self, tensors: Any, through_scaler: bool) -> None:
        ts = tensor_list(tensors)
        if self._on_backward_done_cb is not None:
            self._on_backward_done_cb(ts)
        if through_scaler:
            return
        # A loss: scalar tensors with a graph. backward(gradient) on a
        # non-scalar output is a different pattern and is not judged.
        if not ts or not all(t.numel() == 1 and t.grad_fn is not None for t in ts):
            return
        if len(self._unscaled_roots) < 8:
            self._unscaled_roots.extend(t.grad_fn for t in ts)

    def _judge_unscaled_backward(self, scaler: GradScaler, st: _ScalerState, opt: Any) -> None:
        """An enabled scaler is about to unscale gradients; were some never scaled?"""
        roots, self._unscaled_roots = self._unscaled_roots, []
        if not roots or not scaler._enabled or not self._relevant(opt):
            return
        # Usually a few nodes: the loss's graph reaches the last layer's weights at once.
        if not self._reaches_watched_params(roots):
            return  # e.g. a separate float32 model's backward
        self._event("loss_not_scaled", data={
            "scale": st.scale, "optimizer": self.opt_name(opt), "scaler": st.name,
            "backwards": len(roots), "scaled_too": st.scaled_since_update})

    def _reaches_watched_params(self, roots: list[Any]) -> bool:
        seen: set[int] = set()
        todo = [r for r in roots if r is not None]
        while todo and len(seen) < GRAPH_WALK_LIMIT:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            var = getattr(node, "variable", None)
            if isinstance(var, torch.Tensor) and self._owns_param(var):
                return True
            for nxt, _ in getattr(node, "next_functions", ()):
                if nxt is not None:
                    todo.append(nxt)
        return False

    # -- results ------------------------------------------------------------
    @property
    def events(self) -> list[Event]:
        """Misuse events so far, with device values (clip norms) read in one batch."""
        self._resolve_event_tensors()
        out = list(self._events)
        for kind, n in self._event_counts.items():
            kept = [e for e in out if e.kind == kind]
            if kept and n > len(kept):
                kept[0].data["occurrences"] = n
        for st in self.scalers.values():
            if st.relevant and st.enabled and st.steps_total and not st.updates and not any(
                    e.kind == "missing_update" for e in out):
                out.append(Event(kind="missing_update", step=self._step_of(), data={
                    "call": "end", "steps_total": st.steps_total, "scale": st.scale,
                    "scaler": st.name, "reason": "never updated", "severity": "warning"}))
        return out

    def _resolve_event_tensors(self) -> None:
        pending = [(e, k) for e in self._events for k, v in e.data.items()
                   if isinstance(v, torch.Tensor)]
        if not pending:
            return
        dev = pending[0][0].data[pending[0][1]].device
        vals = torch.stack([e.data[k].reshape(()).float().to(dev) for e, k in pending])
        host = vals.tolist()
        count_sync()
        for (e, k), v in zip(pending, host, strict=True):
            e.data[k] = float(v)

    def _resolve(self, st: _ScalerState) -> None:
        """Read the deferred inf flags in one host copy and replay their updates."""
        d = st.deferred
        if d is None:
            return
        st.deferred = None
        tensors = [v for _, flags in d.entries for v in flags.values()
                   if isinstance(v, torch.Tensor)]
        host: list[float] = []
        if tensors:
            dev = tensors[0].device
            host = torch.stack([t.reshape(()).float().to(dev) for t in tensors]).tolist()
            count_sync()
        it = iter(host)
        primary = self.primary_scaler is not None and self.scalers.get(
            self.primary_scaler) is st
        scale, tracker = d.scale, d.tracker
        points: dict[int, float] = dict(self.timeline_scale)
        for step, flags in d.entries:
            skipped = [n for n, v in flags.items()
                       if (next(it) > 0 if isinstance(v, torch.Tensor) else bool(v))]
            before = scale
            scale, tracker = _replay(scale, tracker, bool(skipped), *st.params())
            if not primary:
                continue
            if scale is not None:
                points[step] = scale
            if skipped:
                self.skipped_steps.append(step)
                self.backoff_steps.append(step)
                for n in skipped:
                    self.skipped_by_optimizer.setdefault(n, []).append(step)
                self.scaler_events.append(ScalerEvent(
                    step=step, kind="backoff", scale_before=_nan(before),
                    scale_after=_nan(scale)))
            elif scale != before:
                self.growth_steps.append(step)
                self.scaler_events.append(ScalerEvent(
                    step=step, kind="growth", scale_before=_nan(before),
                    scale_after=_nan(scale)))
        st.scale, st.tracker = scale, tracker
        if primary:
            for lst in (self.skipped_steps, self.backoff_steps, self.growth_steps):
                lst.sort()
            for v in self.skipped_by_optimizer.values():
                v.sort()
            self.scaler_events.sort(key=lambda e: e.step)
            self.timeline_scale = sorted(points.items())

    def take_outcome(self) -> StepOutcome:
        out, self.outcome = self.outcome, StepOutcome()
        return out

    def correct_scale(self, scaler_id: int, real_scale: float, tracker: int | None) -> None:
        st = self.scalers.get(scaler_id)
        if st is not None and st.deferred is None and math.isfinite(real_scale):
            st.scale = real_scale
            if tracker is not None:
                st.tracker = tracker

    def timeline(self) -> ScalerTimeline | None:
        if self.primary_scaler is None:
            return None
        st = self.scalers[self.primary_scaler]
        self._resolve(st)
        growth, backoff, interval = st.params()
        on = st.enabled
        return ScalerTimeline(
            scale=list(self.timeline_scale),
            backoff_steps=list(self.backoff_steps),
            growth_steps=list(self.growth_steps),
            skipped_steps=list(self.skipped_steps),
            skipped_by_optimizer={k: list(v) for k, v in self.skipped_by_optimizer.items()},
            events=list(self.scaler_events),
            init_scale=st.init_scale if on else None,
            growth_interval=interval if on else None,
            growth_factor=growth if on else None,
            backoff_factor=backoff if on else None,
            enabled=on,
        )


def _nan(x: float | None) -> float:
    return math.nan if x is None else x
