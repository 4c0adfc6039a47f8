"""Misuse of the AMP API, judged from the calls the patches forward.

Clipping before ``unscale_``, an LR scheduler stepped on a skipped step,
``backward`` inside autocast or of an unscaled loss, float16 parameters under
a GradScaler, a GradScaler used with bfloat16, an optimizer stepped outside
the scaler (on scaled gradients, after ``unscale_``, or a second time after
``scaler.step``), and ``step``/``unscale_`` without ``update``. Each is an
:class:`~amp_doctor.records.Event`; the analysis turns them into findings.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch.amp.grad_scaler import GradScaler, OptState

from amp_doctor.devicework import count_sync, host_scalars, user_autocast_enabled
from amp_doctor.dtypes import dtype_name
from amp_doctor.records import Event
from amp_doctor.steps.registry import AmpRegistry, optimizer_params, optimizer_stage
from amp_doctor.steps.scaler import ScalerMirror

__all__ = ["MisuseChecks", "reaches_params", "MAX_EVENTS_PER_KIND", "GRAPH_WALK_LIMIT"]

# Events of one kind kept with their details; further ones are only counted.
MAX_EVENTS_PER_KIND = 50
# Steps of optimizer.step() after unscale_ whose inf/NaN flag is kept to be judged.
MAX_JUDGED_STEPS = 10_000
_COMPACT = 64  # flags stacked into one tensor every this many
# Autograd graph nodes visited to decide whether an unscaled backward reached
# the watched parameters (only done when an enabled scaler then steps them).
GRAPH_WALK_LIMIT = 200_000
# Unscaled backward passes remembered per step (a loss's graph, not a list of them).
MAX_UNSCALED_ROOTS = 8
# A scheduler stepped at most this many steps after its previous call (or after the
# run's start) steps with the optimizer; one stepped further apart is a per-epoch one.
SCHEDULER_STEPS_APART = 1


class _LastUpdate(NamedTuple):
    step: int
    skipped: set[int]  # optimizer ids
    before: float | None
    after: float | None


def reaches_params(roots: list[Any], owns: Callable[[torch.Tensor], bool]) -> bool:
    """Does the autograd graph from ``roots`` reach a parameter ``owns`` accepts?"""
    seen: set[int] = set()
    todo = [r for r in roots if r is not None]
    while todo and len(seen) < GRAPH_WALK_LIMIT:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor) and owns(var):
            return True
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None:
                todo.append(nxt)
    return False


# How far up the stack a backward looks for Lightning's manual_backward.
_LIGHTNING_FRAMES = 40


def _lightning_manual_backward() -> bool:
    """Is this backward Lightning's ``LightningModule.manual_backward``?"""
    f: FrameType | None = sys._getframe(1)
    for _ in range(_LIGHTNING_FRAMES):
        if f is None:
            return False
        if f.f_code.co_name == "manual_backward" and "lightning" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


class MisuseChecks:
    """The misuse events of one watch."""

    def __init__(self, registry: AmpRegistry, step_of: Callable[[], int],
                 autocast_dtype: Callable[[], torch.dtype | None]) -> None:
        self._reg = registry
        self._step_of = step_of
        self._autocast_dtype = autocast_dtype
        self._events: list[Event] = []
        self._event_keys: set[tuple[str, str]] = set()
        self._event_counts: dict[str, int] = {}
        # The primary scaler's last update.
        self._last_update: _LastUpdate | None = None
        self._sched_flagged: set[tuple[int, int]] = set()
        # The step of each scheduler's last call: a per-epoch schedule is not judged.
        self._sched_last: dict[int, int] = {}
        # Root autograd nodes of this step's backward passes that did not go
        # through scaler.scale(); judged when an enabled scaler steps.
        self._unscaled_roots: list[Any] = []
        # The same of backward passes through scaler.scale(), until the next update:
        # which optimizers' gradients they scaled (see plain_step).
        self._scaled_roots: list[Any] = []
        self._unreached: set[int] = set()  # optimizers no scaled backward reached
        # A backward not through the scaler ran since the last scaler.step: an optimizer
        # stepped again after it steps that backward's gradients (see plain_step).
        self._unscaled_backward_since_step = False
        # Steps taken with optimizer.step() after unscale_, and whether their gradients held
        # inf/NaN (device bools, compacted into chunks), judged with the session.
        self._unscale_steps: list[tuple[int, str, str, float | None]] = []
        self._unscale_flags: list[torch.Tensor] = []
        self._unscale_chunks: list[torch.Tensor] = []
        self._bwd_autocast_step = -1
        self._fp16_checked: set[int] = set()
        registry.forget_hooks.append(self._fp16_checked.discard)
        registry.forget_hooks.append(self._unreached.discard)

    def _event(self, kind: str, once_key: str | None = None, **kw: Any) -> None:
        if once_key is not None:
            if (kind, once_key) in self._event_keys:
                return
            self._event_keys.add((kind, once_key))
        n = self._event_counts.get(kind, 0) + 1
        self._event_counts[kind] = n
        if n <= MAX_EVENTS_PER_KIND:
            step = kw.pop("step", None)
            self._events.append(Event(kind=kind, step=self._step_of() if step is None else step,
                                      **kw))

    # -- GradScaler ----------------------------------------------------------
    def unscale(self, scaler: GradScaler, st: ScalerMirror, optimizer: Any) -> None:
        """``scaler.unscale_(optimizer)`` is about to run."""
        stage = optimizer_stage(scaler, optimizer)
        reason = {OptState.UNSCALED: "unscale_ twice",
                  OptState.STEPPED: "unscale_ after step"}.get(stage)
        if reason is not None:
            self._event("missing_update", data={
                "call": "unscale_", "optimizer": self._reg.opt_name(optimizer),
                "steps_since_update": st.steps_since_update, "scale": st.scale,
                "reason": reason})
        if id(optimizer) not in self._fp16_checked:
            self._fp16_checked.add(id(optimizer))
            self._check_fp16(optimizer, st)
        self.judge_unscaled_backward(scaler, st, optimizer)

    def _check_fp16(self, optimizer: Any, st: ScalerMirror) -> None:
        params = optimizer_params(optimizer)
        halfs = [p for p in params if p.grad is not None and p.grad.dtype == torch.float16]
        if halfs:
            self._event("fp16_params", once_key="fp16", data={
                "optimizer": self._reg.opt_name(optimizer),
                "count": len(halfs), "total": len(params),
                "numel": sum(p.numel() for p in halfs),
                "param_dtypes": sorted({dtype_name(p.dtype) for p in halfs}),
                "scale": st.scale})

    def scaler_step(self, scaler: GradScaler, st: ScalerMirror, optimizer: Any) -> None:
        """An enabled ``scaler.step(optimizer)`` is about to run."""
        self._unscaled_backward_since_step = False
        if self._autocast_dtype() == torch.bfloat16:
            self._event("scaler_with_bf16", once_key="bf16",
                        data={"dtype": "bfloat16", "scale": st.scale, "scaler": st.name})
        if optimizer_stage(scaler, optimizer) is OptState.STEPPED:
            # torch raises "step() has already been called since the last update()".
            self._event("missing_update", data={
                "call": "step", "optimizer": self._reg.opt_name(optimizer),
                "steps_since_update": st.steps_since_update, "scale": st.scale,
                "updates": st.updates, "reason": "step twice"})
        elif st.updates and not st.scaled_since_update and not self._unscaled_roots:
            # scaler.step(opt1); scaler.update(); scaler.step(opt2); scaler.update() after
            # one backward: opt2's gradients were scaled by the scale before the first
            # update and are unscaled by the one after it (review 46b).
            self._event("update_between_steps", data={
                "optimizer": self._reg.opt_name(optimizer), "scaler": st.name,
                "scale": st.scale})
        self.judge_unscaled_backward(scaler, st, optimizer)

    def update_without_step(self, st: ScalerMirror) -> None:
        """``scaler.update()`` is about to run with no ``scaler.step`` (nor ``unscale_``)
        since the last update: torch raises "No inf checks were recorded prior to
        update" (an update on every micro-step of gradient accumulation)."""
        self._event("update_without_step", data={
            "scaler": st.name, "updates": st.updates, "steps_total": st.steps_total,
            "scale": st.scale})

    def note_update(self, step: int, skipped: set[int], before: float | None,
                    after: float | None) -> None:
        """The primary scaler's ``update()``: what a scheduler stepped next is judged on."""
        self._last_update = _LastUpdate(step, skipped, before, after)

    def scaler_updated(self) -> None:
        """An enabled scaler's ``update()``: the scaled backward passes before it are done."""
        self._scaled_roots = []

    def plain_step(self, optimizer: Any) -> None:
        """``optimizer.step()`` outside ``scaler.step`` after a scaled backward.

        Three mistakes, one event each (review 46b):

        - ``scaled_grads_stepped``: neither ``scaler.unscale_`` nor ``scaler.step`` for
          this optimizer (``scaler.step(opt_body); opt_head.step()``): the update is the
          loss scale times too large, inf/NaN gradients are not skipped. Judged when the
          scaler never stepped anything, or when this optimizer's parameters are in the
          graph of a scaled backward since the last update, so that a second, unscaled
          model trained next to a scaled one (GANs) is not mistaken for this.
        - ``step_after_unscale``: ``scaler.unscale_(opt); clip; opt.step()``: the update
          has the right size, but a step with inf/NaN gradients is not skipped.
        - ``stepped_twice``: ``scaler.step(opt); opt.step()``: every update is applied
          twice, and the steps the scaler skipped are applied anyway.
        """
        for scaler, st in self._reg.enabled():
            if not st.scaled_since_update:
                continue
            stage = optimizer_stage(scaler, optimizer)
            if stage is OptState.UNSCALED:
                self._note_step_after_unscale(scaler, st, optimizer)
                return
            if stage is OptState.STEPPED and self._unscaled_backward_since_step:
                return  # new gradients of a float32 loss of its own (a regulariser's)
            kind = ("stepped_twice" if stage is OptState.STEPPED
                    else "scaled_grads_stepped" if (
                        st.steps_total == 0 and st.updates == 0
                        or self._scaled_reach(optimizer)) else None)
            if kind is not None:
                self._event(kind, data={
                    "optimizer": self._reg.opt_name(optimizer), "scaler": st.name,
                    "scale": st.scale})
                return

    def _note_step_after_unscale(self, scaler: GradScaler, st: ScalerMirror,
                                 optimizer: Any) -> None:
        """``unscale_`` then ``optimizer.step()``: a misuse only in steps whose gradients
        held inf/NaN (a loop that checks the norm itself, ``if torch.isfinite(norm):
        opt.step()``, steps only finite ones; review 46c). The scaler's inf flag is kept on
        the device and read with the session, no sync now."""
        ost = scaler._per_optimizer_states.get(id(optimizer)) or {}
        infs = list((ost.get("found_inf_per_device") or {}).values())
        if not infs:
            return
        dev = infs[0].device
        flag = torch.stack([f.to(dev) for f in infs]).sum() > 0
        if len(self._unscale_steps) < MAX_JUDGED_STEPS:
            self._unscale_steps.append((self._step_of(), self._reg.opt_name(optimizer),
                                        st.name, st.scale))
            self._unscale_flags.append(flag)
            if len(self._unscale_flags) >= _COMPACT:
                self._unscale_chunks.append(torch.stack(self._unscale_flags))
                self._unscale_flags = []

    def _judge_steps_after_unscale(self) -> None:
        """The ``step_after_unscale`` events: the noted steps whose gradients held inf/NaN
        (one host copy, when the session is built)."""
        if not self._unscale_steps:
            return
        parts = self._unscale_chunks + (
            [torch.stack(self._unscale_flags)] if self._unscale_flags else [])
        flags = torch.cat([p.to(parts[0].device) for p in parts]).tolist()
        count_sync()
        for (step, opt, scaler, scale), bad in zip(self._unscale_steps, flags, strict=True):
            if bad:
                self._event("step_after_unscale", step=step, data={
                    "optimizer": opt, "scaler": scaler, "scale": scale})
        self._unscale_steps, self._unscale_flags, self._unscale_chunks = [], [], []

    def _scaled_reach(self, optimizer: Any) -> bool:
        """Did a scaled backward since the scaler's last update reach ``optimizer``'s
        parameters? (A graph walk: only for an optimizer stepped outside ``scaler.step``
        while a scaler has scaled a loss, never in the documented recipe.)"""
        if not self._scaled_roots or id(optimizer) in self._unreached:
            return False
        ids = {id(p) for p in optimizer_params(optimizer)}
        if reaches_params(self._scaled_roots, lambda t: id(t) in ids):
            return True
        # A separate unscaled model: not walked again on every step.
        self._unreached.add(id(optimizer))
        return False

    # -- clipping ------------------------------------------------------------
    def clip(self, func: str, parameters: list[torch.Tensor], info: dict[str, Any]) -> None:
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

        reg = self._reg
        for scaler, st in reg.enabled():
            if not st.scaled_since_update:
                continue
            owners = [o for o in reg.optimizers()
                      if any(clipped(p) for p in optimizer_params(o))]
            if owners and not any(reg.relevant(o) for o in owners):
                continue  # another model's gradients (an overlapping watch's business)
            owners = [o for o in owners if reg.relevant(o)]
            if owners:
                still_scaled = [reg.opt_name(o) for o in owners
                                if optimizer_stage(scaler, o) is OptState.READY]
            else:
                # The optimizer is not known yet (first step): unscale_ would
                # have marked some optimizer UNSCALED by now.
                if parameters and not any(reg.owns_param(p) for p in parameters):
                    continue
                stages = [v.get("stage") for v in scaler._per_optimizer_states.values()]
                still_scaled = [] if any(s is not OptState.READY for s in stages) else ["?"]
            if not still_scaled:
                continue
            data: dict[str, Any] = {"func": func, "scale": st.scale, "scaler": st.name,
                                    "optimizers": [n for n in still_scaled if n != "?"],
                                    "others_unscaled": len(still_scaled) < len(owners)}
            for k in ("max_norm", "clip_value"):
                if info.get(k) is not None:
                    data[k] = float(info[k])
            if any(data.get(k) == math.inf for k in ("max_norm", "clip_value")):
                # A measurement, not a clip (the Hugging Face Trainer's grad_norm with
                # max_grad_norm=0): nothing was cut; only the norm it returns is scaled.
                data["measured_only"] = True
                data["severity"] = "info"
            tn = info.get("total_norm")
            if isinstance(tn, torch.Tensor):
                data["total_norm"] = tn.detach()  # read when the session is built
            self._event("clip_before_unscale", data=data)
            return

    # -- LR schedulers -------------------------------------------------------
    def scheduler_step(self, scheduler: Any) -> None:
        opt = getattr(scheduler, "optimizer", None)
        if opt is None or not self._reg.relevant(opt):
            return
        oid = id(opt)
        now, prev = self._step_of(), self._sched_last.get(id(scheduler))
        self._sched_last[id(scheduler)] = now
        if now - (prev or 0) > SCHEDULER_STEPS_APART:
            # Stepped once an epoch (or every few steps): one skipped step among the
            # epoch's does not stop its parameters from changing, and stepping it only
            # when the last step was not skipped would lose an epoch's decay.
            return
        hit: tuple[int, float | None, float | None] | None = None
        for _, st in self._reg.enabled():
            if oid in st.skipped:  # stepped after scaler.step, before scaler.update
                hit = (self._step_of(), st.scale, None)
                break
        last = self._last_update
        if hit is None and last is not None and oid in last.skipped:
            hit = (last.step, last.before, last.after)
        if hit is None:
            return
        key = (id(scheduler), hit[0])
        if key in self._sched_flagged:
            return
        self._sched_flagged.add(key)
        lrs = [g.get("lr") for g in getattr(opt, "param_groups", [])]
        self._event("scheduler_on_skipped_step", step=hit[0], data={
            "scheduler": type(scheduler).__name__, "optimizer": self._reg.opt_name(opt),
            "skipped_step": hit[0], "scale_before": hit[1], "scale_after": hit[2],
            "lr": float(lrs[0]) if lrs and isinstance(lrs[0], (int, float)) else None})

    # -- backward ------------------------------------------------------------
    def backward(self) -> None:
        """A backward pass starts: inside autocast? (judged once a step)"""
        step = self._step_of()
        if step == self._bwd_autocast_step:
            return
        for dev in ("cuda", "cpu"):
            try:
                # Read inside the hub's own_ops, which turns autocast off for its work.
                on = user_autocast_enabled(dev)
            except Exception:  # devices this torch build does not know
                on = False
            if on and _lightning_manual_backward():
                # Lightning runs training_step inside autocast, and its documented
                # manual optimization calls self.manual_backward(loss) there: the user
                # cannot move it out, and backward ops keep the forward's dtypes anyway.
                return
            if on:
                self._bwd_autocast_step = step
                try:
                    dt = dtype_name(torch.get_autocast_dtype(dev))
                except Exception:  # pragma: no cover
                    dt = None
                self._event("backward_in_autocast", data={"device": dev, "dtype": dt})
                break

    def backward_end(self, ts: list[torch.Tensor], through_scaler: bool) -> None:
        if through_scaler:
            if len(self._scaled_roots) < MAX_UNSCALED_ROOTS:
                self._scaled_roots.extend(t.grad_fn for t in ts if t.grad_fn is not None)
            return
        # An unscaled backward after the scaled ones (a GAN's float32 critic, zeroed and
        # trained on its own loss next): the gradients an optimizer steps next are its.
        self._scaled_roots = []
        self._unscaled_backward_since_step = True
        # A loss: scalar tensors with a graph. backward(gradient) on a
        # non-scalar output is a different pattern and is not judged.
        if not ts or not all(t.numel() == 1 and t.grad_fn is not None for t in ts):
            return
        if len(self._unscaled_roots) < MAX_UNSCALED_ROOTS:
            self._unscaled_roots.extend(t.grad_fn for t in ts)

    def forget_backwards(self) -> None:
        """The step's backward passes were not a scaler's (or were judged already)."""
        self._unscaled_roots = []

    def judge_unscaled_backward(self, scaler: GradScaler, st: ScalerMirror, opt: Any) -> None:
        """An enabled scaler is about to unscale gradients; were some never scaled?"""
        roots, self._unscaled_roots = self._unscaled_roots, []
        if not roots or not scaler._enabled or not self._reg.relevant(opt):
            return
        # Usually a few nodes: the loss's graph reaches the last layer's weights at once.
        if not reaches_params(roots, self._reg.owns_param):
            return  # e.g. a separate float32 model's backward
        self._event("loss_not_scaled", data={
            "scale": st.scale, "optimizer": self._reg.opt_name(opt), "scaler": st.name,
            "backwards": len(roots), "scaled_too": st.scaled_since_update})

    # -- results ------------------------------------------------------------
    def events(self) -> list[Event]:
        """Misuse events so far, with device values (clip norms) read in one batch."""
        self._judge_steps_after_unscale()
        self._resolve_event_tensors()
        out = list(self._events)
        for kind, n in self._event_counts.items():
            kept = [e for e in out if e.kind == kind]
            if kept and n > len(kept):
                kept[0].data["occurrences"] = n
        for st in self._reg.scalers.values():
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
        host = host_scalars([e.data[k] for e, k in pending])
        for (e, k), v in zip(pending, host, strict=True):
            e.data[k] = float(v)
