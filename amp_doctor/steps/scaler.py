"""The host mirror of each GradScaler's scale, and the run's scale timeline.

Nothing here adds a host sync on a healthy step. Whether GradScaler skipped
an optimizer step is known without reading a device value (see
:mod:`amp_doctor.hooks.patching`), and the scale itself is tracked on the host by
replaying GradScaler's growth/backoff rule in float32 (:class:`ScalerMirror`),
corrected from the real device value on every recorded step, whose single
host copy includes it. Optimizers that check for inf themselves on the device
(``fused=True``) give no such sync: their inf flags are kept on the device and
read in one batch (:meth:`ScalerMirror.resolve`) when the session is built.

:class:`ScaleTimeline` is the one place that creates scaler events (backoff,
growth): from a step's :class:`StepOutcome` as the step ends, or from the
replayed deferred updates.
"""

from __future__ import annotations

import math
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch.amp.grad_scaler import GradScaler

from amp_doctor.devicework import host_scalars
from amp_doctor.hooks.patching import (  # noqa: F401 - the old import path of these names
    ApiSubscriber,
    patches_installed,
    scaled_backwards,
    subscribe,
)
from amp_doctor.records import ScalerEvent, ScalerReset, ScalerTimeline

__all__ = ["ScalerMirror", "StepOutcome", "ScaleTimeline", "Replayed", "DEFERRED_LIMIT",
           "f32", "replay_update", "patches_installed", "subscribe"]

# Device-side inf flags of fused optimizers are read in one batch at this many.
DEFERRED_LIMIT = 1024
# The timeline keeps at most this many scale points before thinning unchanged ones.
MAX_SCALE_POINTS = 4 * 1024
# At most this many scaler replacements are kept (a scaler built every iteration would
# add one a step): the first ones say what the finding needs.
MAX_RESETS = 1024
# GradScaler's own defaults, reported for a scaler whose settings were never seen.
DEFAULT_SETTINGS = (2.0, 0.5, 2000)
DEFAULT_INIT_SCALE = 2.0 ** 16


def f32(x: float) -> float:
    """``x`` rounded to float32, as GradScaler's scale tensor holds it."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def replay_update(scale: float | None, tracker: int | None, found_inf: bool,
                  growth: float, backoff: float, interval: int
                  ) -> tuple[float | None, int | None]:
    """GradScaler's ``_amp_update_scale_`` on the host, in float32 like the kernel."""
    if found_inf:
        return (f32(scale * backoff) if scale is not None else None), 0
    t = (tracker or 0) + 1
    if t >= interval:
        if scale is not None:
            grown = f32(scale * growth)
            if math.isfinite(grown):
                scale = grown
        t = 0
    return scale, t


class Replayed(NamedTuple):
    """One deferred update, replayed once its device flags were read."""

    step: int
    before: float | None
    after: float | None
    skipped: list[str]  # optimizer names whose step was skipped
    # The update backed off: an inf flag was set (also for an optimizer stepped outside
    # scaler.step after unscale_, which nothing skipped).
    backoff: bool = False


@dataclass
class _Deferred:
    """Updates whose skip is known only on the device (fused optimizers), in order."""

    scale: float | None
    tracker: int | None
    # (step, {optimizer name: device inf flag, or host bool when known}, the names of
    # those stepped outside scaler.step, whose flag backs off without a skip)
    entries: list[tuple[int, dict[str, Any], frozenset[str]]] = field(default_factory=list)


@dataclass
class ScalerMirror:
    """Host mirror of one GradScaler's scale, replaying its update rule."""

    ref: weakref.ref[GradScaler]
    name: str
    enabled: bool
    scale: float | None = None
    tracker: int | None = 0
    steps_total: int = 0
    updates: int = 0
    steps_since_update: int = 0
    # This step's inf flags per optimizer name: a bool, or a device tensor (fused, or
    # unscale_ then optimizer.step() outside the scaler: in ``applied``).
    flags: dict[str, Any] = field(default_factory=dict)
    applied: set[str] = field(default_factory=set)
    skipped: dict[int, str] = field(default_factory=dict)  # optimizer id -> name
    flows_at_update: int = 0
    deferred: _Deferred | None = None
    # The scaler's settings, kept for the report after the scaler is gone.
    init_scale: float | None = None
    settings: tuple[float, float, int] = DEFAULT_SETTINGS
    # It stepped or unscaled an optimizer of the watched models.
    relevant: bool = False
    # The optimizers it stepped or unscaled (ids).
    opt_ids: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, scaler: GradScaler, name: str) -> ScalerMirror:
        """A mirror of ``scaler`` as it is now, read without a device sync."""
        enabled = bool(scaler._enabled)
        scale: float | None = None
        tracker: int | None = 0
        if enabled:
            if scaler._scale is None:
                # Not used yet: the first scale() creates it from these.
                scale = f32(float(scaler._init_scale))
                tracker = int(getattr(scaler, "_init_growth_tracker", 0))
            elif scaler._scale.device.type == "cpu" and scaler._growth_tracker is not None:
                # Host memory already: reading it is not a device sync.
                scale = float(scaler._scale)
                tracker = int(scaler._growth_tracker)
            else:
                # Used before the watch, on a device: the first recorded
                # step's host copy corrects it (see correct).
                tracker = None
        st = cls(ref=weakref.ref(scaler), name=name, enabled=enabled, scale=scale,
                 tracker=tracker, flows_at_update=scaled_backwards(scaler),
                 init_scale=scale if scale is not None else float(
                     getattr(scaler, "_init_scale", DEFAULT_INIT_SCALE)))
        st.params()
        return st

    def params(self) -> tuple[float, float, int]:
        s = self.ref()
        if s is not None and s._enabled:  # a disabled scaler has no settings
            self.settings = (s._growth_factor, s._backoff_factor, s._growth_interval)
        return self.settings

    @property
    def scaled_since_update(self) -> bool:
        """A backward went through this scaler's scaled outputs since the last update()."""
        return scaled_backwards(self.ref()) != self.flows_at_update

    def device_scale(self) -> dict[str, torch.Tensor]:
        """The live scaler's scale and growth tracker tensors, for a step's host copy."""
        sc = self.ref()
        out: dict[str, torch.Tensor] = {}
        if sc is not None and sc._enabled and sc._scale is not None:
            out["scale_after"] = sc._scale
            if sc._growth_tracker is not None:
                out["growth_tracker"] = sc._growth_tracker
        return out

    def update(self, step: int, new_scale: Any) -> tuple[float | None, float | None]:
        """``scaler.update(new_scale)`` ran: (scale before, scale after), None if on the device.

        With ``new_scale``, :meth:`resolve` must have run first: the deferred
        updates come before it.
        """
        self.updates += 1
        before, after = self.scale, self.scale
        if new_scale is not None:
            self.scale = _manual_scale(new_scale)
            after = self.scale
        elif self.deferred is not None or any(
                isinstance(v, torch.Tensor) for v in self.flags.values()):
            if self.deferred is None:
                self.deferred = _Deferred(self.scale, self.tracker)
            self.deferred.entries.append((step, dict(self.flags), frozenset(self.applied)))
            before = after = None
        else:
            found = any(self.flags.values())
            self.scale, self.tracker = replay_update(self.scale, self.tracker, found,
                                                     *self.params())
            after = self.scale
        return before, after

    def end_update(self) -> None:
        """Forget the step's flags once ``update()`` has used them."""
        self.flags = {}
        self.applied = set()
        self.skipped = {}
        self.steps_since_update = 0
        self.flows_at_update = scaled_backwards(self.ref())

    @property
    def deferred_full(self) -> bool:
        return self.deferred is not None and len(self.deferred.entries) >= DEFERRED_LIMIT

    def resolve(self) -> list[Replayed]:
        """Read the deferred inf flags in one host copy and replay their updates."""
        d = self.deferred
        if d is None:
            return []
        self.deferred = None
        tensors = [v for _, flags, _ in d.entries for v in flags.values()
                   if isinstance(v, torch.Tensor)]
        it = iter(host_scalars(tensors))
        scale, tracker = d.scale, d.tracker
        out: list[Replayed] = []
        for step, flags, applied in d.entries:
            found = [n for n, v in flags.items()
                     if (next(it) > 0 if isinstance(v, torch.Tensor) else bool(v))]
            before = scale
            scale, tracker = replay_update(scale, tracker, bool(found), *self.params())
            out.append(Replayed(step, before, scale, [n for n in found if n not in applied],
                                backoff=bool(found)))
        self.scale, self.tracker = scale, tracker
        return out

    def correct(self, real_scale: float, tracker: int | None) -> None:
        """The real scale, read in a recorded step's host copy, replaces the replayed one."""
        if self.deferred is None and math.isfinite(real_scale):
            self.scale = real_scale
            if tracker is not None:
                self.tracker = tracker

    @staticmethod
    def read_state(state: Any) -> tuple[float, int] | None:
        """The scale and growth tracker in a ``GradScaler.state_dict()`` (None if unreadable)."""
        if not isinstance(state, dict):
            return None
        try:
            return f32(float(state["scale"])), int(state.get("_growth_tracker", 0))
        except (KeyError, TypeError, ValueError):
            return None


def _manual_scale(new_scale: Any) -> float | None:
    if isinstance(new_scale, (int, float)):
        return f32(float(new_scale))
    if isinstance(new_scale, torch.Tensor) and new_scale.device.type == "cpu":
        return float(new_scale.reshape(-1)[0])  # host memory: no device sync
    return None  # corrected on the next recorded step


@dataclass
class StepOutcome:
    """What the AMP API did in one training step, known without a sync."""

    scale_before: float | None = None
    scale_after: float | None = None
    skipped: bool = False
    skipped_optimizers: list[str] = field(default_factory=list)
    backoff: bool = False
    # The step's update() calls that backed off (one, unless the loop updates the scaler
    # more than once per iteration).
    backoffs: int = 0
    growth: bool = False
    # A scaler scaled, unscaled, stepped or updated in the step: a loop that dropped its
    # GradScaler (model.half() and a plain optimizer step) has no scale in the steps after.
    scaler_used: bool = False
    # A new GradScaler took over from the previous one in the step (kept in the timeline's
    # resets): the live TensorBoard count of them rises here.
    resets: int = 0
    # The total norms clip_grad_norm_ computed in the step (0-d device tensors; read only
    # in a skip's one sync): a NaN one multiplied every gradient by NaN.
    clip_norms: list[torch.Tensor] = field(default_factory=list)


class ScaleTimeline:
    """The primary scaler's scale over the run, its skips, backoffs and growths."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []  # (step, scale after its update)
        self._events: list[ScalerEvent] = []
        self._backoff: list[int] = []
        self._growth: list[int] = []
        self._skipped: list[int] = []
        self._skipped_by_optimizer: dict[str, list[int]] = {}
        self._resets: list[ScalerReset] = []
        # Every step's, not only the recorded ones': with every=N the last recorded step
        # with a scale may be up to N-1 steps before the scaler's last.
        self._last_used: int | None = None

    def reset(self, step: int, old_scale: float | None, new_scale: float | None) -> bool:
        """A new scaler took over from the previous one at ``step``, starting at
        ``new_scale`` (None: on the device, not known yet). False when it was not kept
        (past :data:`MAX_RESETS`), so that a live count matches the kept ones."""
        if len(self._resets) >= MAX_RESETS:
            return False
        self._resets.append(ScalerReset(step=step, scale_before=_nan(old_scale),
                                        scale_after=_nan(new_scale)))
        return True

    def _event(self, step: int, kind: Literal["backoff", "growth"], before: float, after: float,
               **extra: Any) -> None:
        (self._backoff if kind == "backoff" else self._growth).append(step)
        self._events.append(ScalerEvent(step=step, kind=kind, scale_before=before,
                                        scale_after=after, **extra))

    def _skip(self, step: int, optimizers: list[str]) -> None:
        self._skipped.append(step)
        for name in optimizers:
            self._skipped_by_optimizer.setdefault(name, []).append(step)

    def end_step(self, step: int, out: StepOutcome, *, recorded: bool, culprits: list[str],
                 forward_origin: str | None, loss_nonfinite: bool | None) -> None:
        """A training step ended with ``out``; the culprits are the step's bad layers."""
        if out.scaler_used:
            self._last_used = step
        if out.scale_after is not None:
            tl = self.points
            changed = not tl or tl[-1][1] != out.scale_after
            if changed or recorded:
                tl.append((step, out.scale_after))
                if len(tl) > MAX_SCALE_POINTS:  # bounded: thin the unchanged points
                    self.points = _thin(tl)
        if out.skipped:
            self._skip(step, out.skipped_optimizers)
        before = _nan(out.scale_before)  # not `or`: a scale that underflowed to 0 is 0
        after = _nan(out.scale_after)
        if out.backoff:
            self._event(step, "backoff", before, after, culprits=culprits,
                        forward_origin=forward_origin, loss_nonfinite=loss_nonfinite,
                        recorded=recorded, count=max(1, out.backoffs))
        if out.growth:
            self._event(step, "growth", before, after)

    def add_replayed(self, replayed: list[Replayed]) -> None:
        """Deferred updates, replayed once their device flags were read."""
        points: dict[int, float] = dict(self.points)
        for r in replayed:
            if r.after is not None:
                points[r.step] = r.after
            if r.skipped:
                self._skip(r.step, r.skipped)
            if r.backoff:
                self._event(r.step, "backoff", _nan(r.before), _nan(r.after))
            elif r.after != r.before:
                self._event(r.step, "growth", _nan(r.before), _nan(r.after))
        for lst in (self._skipped, self._backoff, self._growth):
            lst.sort()
        for v in self._skipped_by_optimizer.values():
            v.sort()
        self._events.sort(key=lambda e: e.step)
        self.points = sorted(points.items())

    def load(self, step: int, scale: float) -> None:
        """A scale loaded at ``step``: the one in force after the step before it."""
        self.points = [(s, v) for s, v in self.points if s < step - 1] + [(step - 1, scale)]

    def rename_layers(self, mapping: dict[str, str]) -> None:
        self._events = [
            ScalerEvent(**{**e.__dict__, "culprits": [mapping.get(c, c) for c in e.culprits]})
            for e in self._events
        ]

    def freeze(self, mirror: ScalerMirror) -> ScalerTimeline:
        growth, backoff, interval = mirror.params()
        on = mirror.enabled
        return ScalerTimeline(
            scale=list(self.points),
            backoff_steps=list(self._backoff),
            growth_steps=list(self._growth),
            skipped_steps=list(self._skipped),
            skipped_by_optimizer={k: list(v) for k, v in self._skipped_by_optimizer.items()},
            events=list(self._events),
            init_scale=mirror.init_scale if on else None,
            growth_interval=interval if on else None,
            growth_factor=growth if on else None,
            backoff_factor=backoff if on else None,
            enabled=on,
            resets=list(self._resets),
            last_step=self._last_used,
        )


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def _thin(tl: list[tuple[int, float]]) -> list[tuple[int, float]]:
    keep = [tl[0]]
    for i in range(1, len(tl)):
        if tl[i][1] != tl[i - 1][1] or i % 2 == 0:
            keep.append(tl[i])
    return keep
