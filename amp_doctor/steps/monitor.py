"""One watch's view of the AMP API: step boundaries, step outcomes, the scale.

:class:`AmpMonitor` subscribes to :mod:`amp_doctor.hooks.patching`'s hub and turns
the forwarded calls into what one watch needs: a step boundary at the primary
scaler's ``update()`` (or the primary optimizer's step when no scaler is in
use, or no longer: float16 with a scaler, then bfloat16 without it), a
:class:`~amp_doctor.steps.scaler.StepOutcome` per step, the scale mirrors
(:mod:`amp_doctor.steps.scaler`) and the misuse checks (:mod:`amp_doctor.steps.misuse`).
Which scalers and optimizers are the watch's is decided by
:class:`~amp_doctor.steps.registry.AmpRegistry`.

It tells the watch through the :class:`LoopCallbacks` it is given, and never
reads the watch's state: the watch ends the step and hands the outcome back
through :meth:`AmpMonitor.end_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim import Optimizer

from amp_doctor.devicework import iter_tensors
from amp_doctor.hooks.patching import in_scaler_step
from amp_doctor.records import Event, ScalerEvent, ScalerTimeline
from amp_doctor.steps.misuse import MisuseChecks
from amp_doctor.steps.registry import (
    AmpRegistry,
    FirstCycle,
    is_deferred,
    optimizer_params,
    optimizer_stage,
)
from amp_doctor.steps.scaler import ScalerMirror, ScaleTimeline, StepOutcome

__all__ = ["AmpMonitor", "LoopCallbacks"]

Params = list[torch.Tensor]


@dataclass(frozen=True)
class LoopCallbacks:
    """What the watch wants to hear about the loop, as it happens."""

    # A training step ended (the primary scaler's update, or the primary optimizer's
    # step); it held this many of the loop's iterations (more only in a first step that
    # waited in vain for another optimizer, see FIRST_CYCLE_MAX_STEPS).
    boundary: Callable[[int], None]
    # The optimizer's gradients are final; the scale they still carry (None: unscaled).
    param_grads: Callable[[Params, float | None], None]
    # A GradScaler's unscale_ of those gradients found NaN/Inf where these device
    # tensors (its found_inf_per_device) are 1.
    unscaled: Callable[[list[torch.Tensor]], None]
    # scaler.step is about to apply these parameters' gradients, which the loop had
    # unscaled itself (``scaler.unscale_(optimizer)``) and may have changed since: that
    # unscale_ found NaN/Inf where these tensors are 1.
    step_after_unscale: Callable[[Params, list[torch.Tensor]], None]
    # GradScaler skipped the optimizer step of these parameters.
    skip: Callable[[Params], None]
    # scaler.scale(outputs): the scale tensor (None when disabled or not created yet).
    scale: Callable[[torch.Tensor | None, Any], None]
    backward: Callable[[Params], None]
    backward_done: Callable[[Params], None]
    optimizer_done: Callable[[Params], None]
    # torch.autograd.grad of a scaled output returned these (still scaled) gradients.
    scaled_grads: Callable[[Params], None]
    # torch.autograd.grad(outputs, inputs) returned these gradients of the inputs (a loop
    # that updates by hand from them has no .grad, no optimizer and no backward() to end
    # its steps); True when they are of a GradScaler's scaled output.
    grads_taken: Callable[[Params, list[Any], list[Any], bool], None]
    # The watched root models' parameters, one list per root.
    root_params: Callable[[], list[Params]]


@dataclass
class _OtherScaler:
    """A relevant, enabled scaler other than the primary, with its own timeline."""

    mirror: ScalerMirror
    timeline: ScaleTimeline = field(default_factory=ScaleTimeline)
    outcome: StepOutcome = field(default_factory=StepOutcome)
    # It stepped an optimizer since its last update(): its outcome is not complete.
    stepped: bool = False
    # The step its optimizer stepped in, ended before its update() came.
    open_step: int | None = None


class AmpMonitor:
    """Turns AMP API calls into step boundaries, a scale timeline and misuse events."""

    def __init__(
        self,
        owns_param: Callable[[torch.Tensor], bool],
        step_of: Callable[[], int],
        callbacks: LoopCallbacks,
        autocast_dtype: Callable[[], torch.dtype | None],
        scaler: GradScaler | None = None,
        optimizers: Iterable[Optimizer] = (),
        param_layer: Callable[[torch.Tensor], str | None] = lambda p: None,
        layer_model: Callable[[str], int | None] = lambda name: None,
    ) -> None:
        self._cb = callbacks
        self._param_layer = param_layer
        # The watched model (its id) a layer belongs to, by the layer's name now.
        self._layer_model = layer_model
        # Optimizers whose step() is running: a closure's forward and backward passes
        # (LBFGS evaluates it several times in one step) belong to that step.
        self.stepping: set[int] = set()
        # Optimizers stepped outside scaler.step since the last update (ids).
        self._plain_stepped: set[int] = set()
        # Per optimizer id: how many parameters it held, and the layers holding them, read
        # when it steps (it may be gone by the end of the run) and renamed with the layers.
        self._opt_layers: dict[int, tuple[int, set[str]]] = {}
        self._step_of = step_of
        self.registry = AmpRegistry(owns_param, scaler, optimizers)
        self.registry.forget_hooks.append(self._forget_opt_layers)
        self._misuse = MisuseChecks(self.registry, step_of, autocast_dtype)
        self._timeline = ScaleTimeline()
        # The other relevant, enabled scalers (a GAN with one per network), by id of
        # their mirrors; and what end_step was told of the step that ended last.
        self._others: dict[int, _OtherScaler] = {}
        self._ended: tuple[int, bool, list[str], str | None, bool | None] | None = None
        # Set by the watch once its loop calls ``doctor.step()`` itself.
        self.manual_steps = False
        self._outcome = StepOutcome()
        self._step_params: dict[int, Params] = {}
        # Several models, each with its own optimizer: until the update that ends an
        # iteration is known (_cycle_started: it was asked for).
        self._cycle: FirstCycle | None = None
        self._cycle_started = False
        # With GradScalers, once the first step waited: the optimizer stepping last in
        # an iteration, and whether it stepped since the last boundary.
        self._closing: int | None = None
        # Per scaler id: the step and the losses its scale() multiplied while it was not
        # yet known to work for the watched models (a new scaler before its first
        # step()); the step's scale and loss once it takes over from the primary.
        self._unclaimed_scales: dict[int, tuple[int, list[Any]]] = {}
        self._closing_stepped = False
        # Since the last step ended: a relevant scaler was used (scale, unscale_, step or
        # update), and a backward pass ran. A plain step of the scaler's parameters in a
        # step without the first but with the second is a loop that stopped using it.
        self._scaler_in_step = False
        self._backward_in_step = False
        # Since the last step ended, an optimizer stepped parameters no watched model owns
        # (yet: a model the loop replaced, with its new optimizer, before it is found).
        self.stepped_unwatched = False
        # The layers whose parameters a scaler stepped, kept after their optimizer is gone
        # (a loop that drops the scaler may make a new optimizer for the same model).
        self._scaled_layers: set[str] = set()
        # Per optimizer: what the loop's own scaler.unscale_ found (its found_inf tensors),
        # until the scaler's step applies those gradients (see step_after_unscale).
        self._unscaled_by_loop: dict[int, list[torch.Tensor]] = {}

    @property
    def drives_steps(self) -> bool:
        """A scaler's update or an optimizer's step ends the watch's training steps."""
        reg = self.registry
        return reg.primary_scaler is not None or reg.primary_opt is not None

    def models_changed(self) -> None:
        self.registry.models_changed()

    def _mirror(self, scaler: GradScaler, optimizer: Any = None) -> ScalerMirror | None:
        return self.registry.mirror(scaler, optimizer)

    # -- GradScaler --------------------------------------------------------
    def on_scale_begin(self, scaler: GradScaler) -> None:
        # Before the first scale() creates the scale tensor: the mirror
        # starts from init_scale without reading a device value.
        self._mirror(scaler)

    def on_scale(self, scaler: GradScaler, outputs: Any, result: Any) -> None:
        st = self._mirror(scaler)
        # None: a scaler other than the one named to the watch (watch(scaler=...)), which
        # may still take over from it at its step() (a GradScaler built anew each epoch).
        if st is None or (self.registry.primary_scaler not in (None, id(scaler))
                          and not st.relevant):
            # Another model's scaler, seen by an overlapping watch, or a new one that takes
            # over at its step(): kept until that says which.
            step, pending = self._unclaimed_scales.get(id(scaler), (self._step_of(), []))
            if step != self._step_of():
                pending = []
            self._unclaimed_scales[id(scaler)] = (self._step_of(), [*pending, outputs])
            return
        self._scaler_in_step = True
        self._cb.scale(scaler._scale if scaler._enabled else None, outputs)

    def on_unscale(self, scaler: GradScaler, optimizer: Any) -> None:
        st = self._mirror(scaler, optimizer)
        if st is None or not self.registry.relevant(optimizer):
            return
        st.opt_ids.add(id(optimizer))
        self._claim(scaler, st)
        self._scaler_in_step = True
        self._misuse.unscale(scaler, st, optimizer)
        self._cb.param_grads(optimizer_params(optimizer), st.scale)

    def on_unscaled(self, scaler: GradScaler, optimizer: Any) -> None:
        # As on_unscale: the gradients it passed on to param_grads.
        if self._mirror(scaler, optimizer) is None or not self.registry.relevant(optimizer):
            return
        state = scaler._per_optimizer_states.get(id(optimizer)) or {}
        found = list((state.get("found_inf_per_device") or {}).values())
        if not in_scaler_step():
            self._unscaled_by_loop[id(optimizer)] = found
        if found:
            self._cb.unscaled(found)

    def on_scaler_step_begin(self, scaler: GradScaler, optimizer: Any) -> None:
        st = self._mirror(scaler, optimizer)
        if st is None or not self.registry.relevant(optimizer):
            return
        st.opt_ids.add(id(optimizer))
        self._claim(scaler, st)
        self._scaler_in_step = True
        # Skipped or not, the optimizer had its turn in this iteration.
        cycle = self._learning()
        if cycle is not None:
            cycle.stepped(optimizer)
        if id(optimizer) == self._closing:
            self._closing_stepped = True
        if scaler._enabled:
            self._misuse.scaler_step(scaler, st, optimizer)

    def on_scaler_step(self, scaler: GradScaler, optimizer: Any, stepped: bool) -> None:
        st = self._mirror(scaler, optimizer)
        if st is None or not scaler._enabled:
            return
        relevant = self.registry.relevant(optimizer)
        name = self.registry.opt_name(optimizer)
        st.steps_total += 1
        st.steps_since_update += 1
        if is_deferred(optimizer):
            ost = scaler._per_optimizer_states.get(id(optimizer)) or {}
            infs = list((ost.get("found_inf_per_device") or {}).values())
            if infs:
                dev = infs[0].device
                st.flags[name] = torch.stack([f.to(dev) for f in infs]).sum()
            return
        st.flags[name] = not stepped
        if relevant and not self.registry.is_primary(scaler):
            self._other(st).stepped = True
        if not stepped:
            st.skipped[id(optimizer)] = name
            if relevant:
                self._cb.skip(optimizer_params(optimizer))

    def on_update_begin(self, scaler: GradScaler) -> None:
        st = self._mirror(scaler)
        if st is None:
            return
        if not any(s.get("found_inf_per_device") for s in scaler._per_optimizer_states.values()):
            # torch raises "No inf checks were recorded prior to update." next.
            self._misuse.update_without_step(st)
            if self.registry.primary_scaler is None:
                self._claim(scaler, st)  # the report's GradScaler is this one
            return
        if scaler._enabled:
            self._flags_of_unscaled(scaler, st)

    def _claim(self, scaler: GradScaler, st: ScalerMirror) -> None:
        """``scaler`` works for the watched models; if it took over from the primary, the
        timeline marks the reset, so that the new scaler's start (its init_scale again,
        and the backoffs that calibrate it) is not read as the old one's scale growing
        and collapsing."""
        old = self.registry.claim(scaler, st)
        step, pending = self._unclaimed_scales.pop(id(scaler), (None, []))
        if old is None:
            return
        if step == self._step_of():
            # The new scaler's first scale() multiplied this step's loss: its scale is the
            # step's (the loss and gradients are recorded unscaled, as every other step's).
            for outputs in pending:
                self._cb.scale(scaler._scale if scaler._enabled else None, outputs)
        # The old scaler's pending device flags are its steps', before the takeover.
        replayed = old.resolve()
        if replayed:
            self._timeline.add_replayed(replayed)
        if self._timeline.reset(self._step_of(), old.scale, st.scale):
            self._outcome.resets += 1

    def _flags_of_unscaled(self, scaler: GradScaler, st: ScalerMirror) -> None:
        """Optimizers unscaled but not stepped through ``scaler.step`` (``unscale_`` then
        ``optimizer.step()``): update() backs off on their inf flags all the same, with no
        skip. The flags stay on the device, read with the deferred updates (no sync)."""
        for key, ost in scaler._per_optimizer_states.items():
            infs = list((ost.get("found_inf_per_device") or {}).values())
            if ost.get("stage") is not OptState.UNSCALED or not infs:
                continue
            name = self.registry.opt_name_of(key)
            if name in st.flags:
                continue
            dev = infs[0].device
            st.flags[name] = torch.stack([f.to(dev) for f in infs]).sum()
            if key in self._plain_stepped:
                st.applied.add(name)  # stepped all the same: a backoff without a skip
            # else the loop skipped it itself (`if torch.isfinite(norm): opt.step()`)

    def on_update_end(self, scaler: GradScaler, new_scale: Any) -> None:
        st = self._mirror(scaler)
        if st is None:
            return
        primary = self.registry.is_primary(scaler)
        if primary or st.relevant:
            self._scaler_in_step = True
        if scaler._enabled:
            self._misuse.scaler_updated()
            step = self._step_of()
            if new_scale is not None:
                self._resolve(st)  # the deferred updates came before this one
            before, after = st.update(step, new_scale)
            if st.deferred_full:
                self._resolve(st)
            out = other = None
            if primary:
                out = self._outcome
                self._misuse.note_update(step, set(st.skipped), before, after)
            elif st.relevant:
                other = self._other(st)
                out = other.outcome
            if out is not None:
                if out.scale_before is None:
                    out.scale_before = before
                out.scale_after = after
                if st.skipped:
                    out.backoff = out.skipped = True
                    out.backoffs += 1
                    out.skipped_optimizers.extend(st.skipped.values())
                elif new_scale is None and after is not None and after != before:
                    out.growth = True
            if other is not None:
                self._other_updated(other)
        st.end_update()
        self._plain_stepped.clear()
        self._misuse.forget_backwards()
        if self.manual_steps:
            return
        if st.relevant and self._settle_cycle():
            return
        if self._closing is not None:
            if self._closing_stepped and st.relevant:
                self._closing_stepped = False
                self._cb.boundary(1)
        elif primary:
            self._cb.boundary(1)

    def on_scaler_load(self, scaler: GradScaler, state: Any) -> None:
        """``GradScaler.load_state_dict``: a resumed run continues from the loaded scale."""
        st = self._mirror(scaler)
        if st is None or not scaler._enabled:
            return
        loaded = ScalerMirror.read_state(state)
        if loaded is None:
            return
        self._resolve(st)  # pending device flags belong to the steps before the load
        st.scale, st.tracker = loaded
        st.params()
        step = self._step_of()
        if self.registry.is_primary(scaler) and step > 0:
            # The timeline holds the scale after each step's update: the loaded
            # scale is the one in force after the step before this one.
            self._timeline.load(step, loaded[0])

    # -- optimizers --------------------------------------------------------
    def on_optimizer_pre(self, optimizer: Optimizer) -> None:
        # Any optimizer: under diagnose the model may be found only inside the closure.
        self.stepping.add(id(optimizer))
        if not self.registry.relevant(optimizer):
            return
        params = optimizer_params(optimizer)
        self._step_params[id(optimizer)] = params
        known = self._opt_layers.get(id(optimizer))
        if known is None or known[0] != len(params) or not known[1]:
            self._opt_layers[id(optimizer)] = (len(params), {
                n for n in map(self._param_layer, params) if n is not None})
        if not in_scaler_step():
            self._misuse.plain_step(optimizer)
            self._cb.param_grads(params, None)
            return
        self._scaled_layers |= self._opt_layers[id(optimizer)][1]
        # Inside scaler.step: unscale_ has summarised the gradients, unless
        # the optimizer unscales them itself (fused) or the scaler is disabled.
        for scaler, st in self.registry.enabled():
            if id(optimizer) in scaler._per_optimizer_states:
                if is_deferred(optimizer) and optimizer_stage(
                        scaler, optimizer) is OptState.READY:
                    self._cb.param_grads(params, st.scale)
                found = self._unscaled_by_loop.pop(id(optimizer), None)
                if found is not None:
                    self._cb.step_after_unscale(params, found)
                return
        self._cb.param_grads(params, None)

    def on_optimizer_post(self, optimizer: Optimizer) -> None:
        reg = self.registry
        self.stepping.discard(id(optimizer))
        if not reg.relevant(optimizer):
            self.stepped_unwatched = True
            return
        self._cb.optimizer_done(self._step_params.get(id(optimizer)) or [])
        if not in_scaler_step():
            self._plain_stepped.add(id(optimizer))
            # A plain optimizer.step(): those backward passes are not a scaler's.
            self._misuse.forget_backwards()
        if reg.primary_scaler is not None or self.manual_steps:
            if reg.primary_opt is None:
                reg.primary_opt = id(optimizer)
            if not self.manual_steps and not in_scaler_step():
                self._plain_beside_scaler(optimizer)
            return
        if reg.primary_opt is None:
            reg.primary_opt = id(optimizer)  # drives_steps from now on; the cycle decides
        cycle = self._learning()
        if cycle is not None:
            cycle.stepped(optimizer)
            if cycle.waiting():
                return
            self._cycle = None
            reg.primary_opt = id(optimizer)
            self._cb.boundary(cycle.iterations)
            return
        if id(optimizer) == reg.primary_opt:
            self._cb.boundary(1)

    def _plain_beside_scaler(self, optimizer: Optimizer) -> None:
        """A plain ``optimizer.step()`` in a run whose steps a GradScaler ends: a model
        trained without one beside a model trained with one (a bfloat16 generator, a
        float16 discriminator). While the first step waits for it, it has its turn; when
        it is the iteration's last update, its step ends each step. A loop that stopped
        using the scaler ends its steps at such a step (see _scaler_dropped)."""
        if self._cycle is not None:
            self._cycle.stepped(optimizer)
            self._settle_cycle()
        elif self._closing == id(optimizer) or (
                self._closing is None and self._scaler_dropped(optimizer)):
            self._cb.boundary(1)

    def _scaler_dropped(self, optimizer: Optimizer) -> bool:
        """Has the loop stopped using the scaler: this plain step, on gradients of a backward
        in a step no scaler took part in, steps parameters a scaler stepped before
        (float16 with a GradScaler, then bfloat16 or ``model.half()`` without it)? An
        optimizer beside the scaler (a bfloat16 generator) steps parameters no scaler
        steps, and one stepped again after ``update()`` steps the same gradients: neither
        ends a step."""
        if self._scaler_in_step or not self._backward_in_step:
            return False
        st = self.registry.primary()
        if st is not None and id(optimizer) in st.opt_ids:
            return True
        layers = self._opt_layers.get(id(optimizer), (0, set()))[1]
        return not layers.isdisjoint(self._scaled_layers)

    def _settle_cycle(self) -> bool:
        """After an update in the first step: does the step go on (another optimizer is
        due), or did this update, after waiting, end it (it is the iteration's last: it
        ends every later step)? False with no cycle, or one that never waited."""
        cycle = self._cycle
        if cycle is None:
            return False
        if cycle.waiting():
            return True
        self._cycle = None
        if cycle.waited:
            self._closing = cycle.last
            self._cb.boundary(cycle.iterations)
            return True
        return False

    def _learning(self) -> FirstCycle | None:
        """The first step's :class:`FirstCycle`, made at the first update it is asked
        about; None once it decided, or with one model."""
        if not self._cycle_started:
            self._cycle_started = True
            self._cycle = self.registry.first_cycle(self._cb.root_params())
        return self._cycle

    # -- clipping, schedulers, backward ------------------------------------
    def on_clip(self, func: str, parameters: list[torch.Tensor], info: dict[str, Any]) -> None:
        self._misuse.clip(func, parameters, info)
        norm = info.get("total_norm")
        if isinstance(norm, torch.Tensor) and norm.numel() == 1:
            self._outcome.clip_norms.append(norm.detach())

    def clip_norms(self) -> list[torch.Tensor]:
        """The total norms clipping computed in the current step (see StepOutcome)."""
        return self._outcome.clip_norms

    def on_scheduler_step(self, scheduler: Any) -> None:
        self._misuse.scheduler_step(scheduler)

    def on_backward(self, tensors: Any) -> None:
        self._backward_in_step = True
        self._cb.backward(list(iter_tensors(tensors)))
        self._misuse.backward()

    def on_scaled_grads(self, grads: Any) -> None:
        self._cb.scaled_grads(list(iter_tensors(grads)))

    def on_grads_taken(self, outputs: Any, inputs: Any, grads: Any, scaled: bool) -> None:
        ins = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        outs = list(grads) if isinstance(grads, (list, tuple)) else [grads]
        if len(outs) != len(ins):
            return  # not (inputs, their gradients) as torch.autograd.grad returns them
        self._backward_in_step = True
        self._cb.grads_taken(list(iter_tensors(outputs)), ins, outs, scaled)

    def on_backward_end(self, tensors: Any, through_scaler: bool) -> None:
        ts = list(iter_tensors(tensors))
        self._cb.backward_done(ts)
        self._misuse.backward_end(ts, through_scaler)

    # -- the step boundary ---------------------------------------------------
    def take_outcome(self) -> StepOutcome:
        """What the AMP API did since the last step ended; starts a new outcome."""
        out, self._outcome = self._outcome, StepOutcome()
        out.scaler_used = self._scaler_in_step or out.scale_after is not None
        self._scaler_in_step = self._backward_in_step = False
        self.stepped_unwatched = False
        # The step's held losses are no later step's: nothing of a step outlives it here
        # (a finished watch holds no loss tensor of the run).
        self._unclaimed_scales.clear()
        return out

    def scale_tensors(self) -> dict[str, torch.Tensor]:
        """The primary scaler's scale and growth tracker, for a recorded step's host copy."""
        st = self.registry.primary()
        return st.device_scale() if st is not None else {}

    def correct_scale(self, real_scale: float, tracker: int | None) -> None:
        """The primary scaler's real scale, read in a recorded step's host copy."""
        st = self.registry.primary()
        if st is not None:
            st.correct(real_scale, tracker)

    def other_skipped(self) -> bool:
        """Another scaler skipped an optimizer step in the step now ending (its update()
        may still be to come): the step's gradients were not finite, as for a skip of
        the primary."""
        return any(o.outcome.skipped or (o.stepped and o.mirror.skipped)
                   for o in self._others.values())

    def _other(self, st: ScalerMirror) -> _OtherScaler:
        other = self._others.get(id(st))
        if other is None:
            other = self._others[id(st)] = _OtherScaler(st)
        return other

    def _other_updated(self, other: _OtherScaler) -> None:
        """Another scaler's ``update()`` after the step its optimizer stepped in ended (the
        primary's update came first and ended it): the outcome is that step's."""
        other.stepped = False
        ended = self._ended
        if other.open_step is None or ended is None or ended[0] != other.open_step:
            return
        self._close_other(other, *ended)
        other.open_step = None

    def _close_other(self, other: _OtherScaler, step: int, recorded: bool,
                     culprits: list[str], forward_origin: str | None,
                     loss_nonfinite: bool | None) -> None:
        out, other.outcome = other.outcome, StepOutcome()
        other.timeline.end_step(step, out, recorded=recorded,
                                culprits=culprits if out.skipped else [],
                                forward_origin=forward_origin, loss_nonfinite=loss_nonfinite)

    def end_step(self, step: int, outcome: StepOutcome, *, recorded: bool,
                 culprits: list[str], forward_origin: str | None,
                 loss_nonfinite: bool | None) -> None:
        """The watch ended ``step``: its outcome joins the scale timeline, and each other
        scaler's joins its own, or at its ``update()`` if that is still to come. The
        step's culprits are every skip's: its gradients are flagged whichever scaler
        skipped."""
        self._unscaled_by_loop.clear()
        self._timeline.end_step(step, outcome, recorded=recorded, culprits=culprits,
                                forward_origin=forward_origin, loss_nonfinite=loss_nonfinite)
        self._ended = (step, recorded, culprits, forward_origin, loss_nonfinite)
        for other in self._others.values():
            if other.stepped:
                other.open_step = step
            else:
                self._close_other(other, *self._ended)

    def _forget_opt_layers(self, key: int) -> None:
        self._opt_layers.pop(key, None)

    def rename_layers(self, mapping: dict[str, str]) -> None:
        self._timeline.rename_layers(mapping)
        self._opt_layers = {k: (n, {mapping.get(x, x) for x in names})
                            for k, (n, names) in self._opt_layers.items()}
        self._scaled_layers = {mapping.get(x, x) for x in self._scaled_layers}

    # -- results ------------------------------------------------------------
    def events(self) -> list[Event]:
        """Misuse events so far, with device values (clip norms) read in one batch."""
        return self._misuse.events()

    def _resolve(self, st: ScalerMirror) -> None:
        replayed = st.resolve()
        if not replayed:
            return
        if self.registry.primary() is st:
            self._timeline.add_replayed(replayed)
        elif id(st) in self._others:
            self._others[id(st)].timeline.add_replayed(replayed)

    def timeline(self) -> ScalerTimeline | None:
        st = self.registry.primary()
        if st is None:
            return None
        self._resolve(st)
        return self._named(self._timeline.freeze(st), st)

    def _named(self, tl: ScalerTimeline, st: ScalerMirror) -> ScalerTimeline:
        """``tl`` with the names of the optimizers ``st`` steps, and where their
        parameters sit."""
        name = ", ".join(sorted(self.registry.opt_name_of(i) for i in st.opt_ids))
        layers = {n for key in st.opt_ids for n in self._opt_layers.get(key, (0, set()))[1]}
        return replace(tl, name=name, stepping=_where_layers_sit(layers),
                       events=self._own_culprits(tl.events, layers))

    def _own_culprits(self, events: list[ScalerEvent], layers: set[str]) -> list[ScalerEvent]:
        """Each backoff's culprits, kept to the watched models whose parameters the
        scaler's optimizers step: a step's culprits are all of its non-finite gradients,
        and with a GAN's two scalers the discriminator's backward (on a detached fake)
        cannot have made the generator's. One model watched: unchanged."""
        models = {self._layer_model(n) for n in layers} - {None}
        if not models:
            return events
        keep = models | {None}  # a culprit of no known model stays
        return [replace(e, culprits=[c for c in e.culprits if self._layer_model(c) in keep])
                if e.culprits else e for e in events]

    def other_timelines(self) -> list[ScalerTimeline]:
        """The other relevant, enabled scalers' timelines, named after the optimizers they
        step, in the order they were first seen."""
        out = []
        primary = self.registry.primary()
        for other in self._others.values():
            st = other.mirror
            if st is primary or not st.enabled:
                continue  # became the primary (a replacement scaler), or disabled
            self._resolve(st)
            out.append(self._named(other.timeline.freeze(st), st))
        return out


def _where_layers_sit(names: Iterable[str]) -> str:
    """The dotted prefix ``names`` share ("g.net"), else their distinct top-level names
    ("d, g"; "d, e, g, ..." past three); "" for none."""
    parts = sorted(n.split(".") for n in set(names))
    if not parts:
        return ""
    common = parts[0]
    for p in parts[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    if common:
        return ".".join(common)
    tops = sorted({p[0] for p in parts})
    return ", ".join(tops[:3]) + (", ..." if len(tops) > 3 else "")
