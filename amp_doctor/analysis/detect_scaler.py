"""The GradScaler's timeline -> findings: backoffs, a collapsed scale, a stuck scale.

Backoffs in consecutive steps are one episode. An episode is GradScaler working as
designed (calibration at the start, a probe right after a growth) or a problem,
which is grouped with the others that began at the same layer. Where the
non-finite values began comes from anomaly mode or the recorded forward pass;
an unrecorded step is only blamed on a layer its own gradients point at.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from amp_doctor import format as F
from amp_doctor.analysis.advice import ADVICE
from amp_doctor.analysis.detect_layers import low_format, median_loss
from amp_doctor.analysis.thresholds import (
    BACKOFF_RUN_COLLAPSE,
    BACKOFF_SHARE_COLLAPSE,
    CALIBRATED_MIN,
    CALIBRATION_START,
    CALIBRATION_STEPS,
    DEFAULT_GROWTH_INTERVAL,
    DEFAULT_INIT_SCALE,
    LARGE_LOSS,
    LOSS_NOT_LARGE,
    SCALE_COLLAPSE_MIN,
    SCALED_GRAD_NEAR_MAX,
    SETTLING_BACKOFFS,
    STUCK_INTERVALS,
)
from amp_doctor.dtypes import FORMAT_MAX
from amp_doctor.records import Event, Finding, ScalerEvent, ScalerTimeline, Session

__all__ = ["scaler_findings", "normal_backoff_steps", "ORIGIN_RANK", "ScaledGradArrival",
           "scaled_grad_arrival", "scaled_grad_text"]

# Findings keep at most this many of their steps.
MAX_STEPS_KEPT = 50


def _scale(x: float | None) -> str:
    return F.scale(x, unknown="?")


def _culprits_of(group: list[ScalerEvent]) -> list[str]:
    """Every culprit of the group once: a recorded step's first, in the order its gradients
    arrived (layers without parameters too: an unrecorded step's list holds only the layers
    with parameters, in reverse forward order), then the others'."""
    out: dict[str, None] = {}
    for e in sorted(group, key=lambda e: not e.recorded):
        out.update(dict.fromkeys(e.culprits))
    return list(out)


def _normal_backoff(i: int, groups: list[list[ScalerEvent]], growths: list[ScalerEvent],
                    last_step: int, floor: float, loss_counts: bool = True,
                    start: int = 0) -> str | None:
    """Why a group of backoffs is GradScaler working as designed, or None.

    ``groups`` are the episodes of one scaler, the one that started at step ``start``
    (a new scaler that replaced the old one calibrates from its own start: see
    :func:`restarts`), and ``i`` indexes them.

    * calibration: the scale starts high (2**16) and halves in the first steps
      until the gradients fit: a run starting at once that ends, short or leaving
      the scale above :data:`CALIBRATED_MIN` (from a higher ``init_scale``), and
      leaves the scale >= 1;
    * probe: the scale grew, a later step overflowed, and one backoff put the scale
      back where it was before the growth;
    A group whose forward pass failed (an origin, or a NaN loss when ``loss_counts``: a
    NaN loss makes the gradients NaN in this run) is never one.

    * settling: at most :data:`SETTLING_BACKOFFS` in a row that leave the scale at or
      above ``floor``: a noisy batch, or the scale oscillating at the level the
      gradients allow (grown from S to 2S, it backs off to S or S/2 and grows again),
      one or two skipped steps at a time, also in a run too short for a growth.
      Longer runs of backoffs, a scale fallen below ``floor`` and backoffs in too many
      steps (:data:`BACKOFF_SHARE_COLLAPSE`) are findings.
    """
    g = groups[i]
    if any(e.forward_origin or (e.loss_nonfinite and loss_counts) for e in g):
        # The loss itself was NaN/inf: the forward pass failed, whatever the scale.
        return None
    after = g[-1].scale_after
    prev = [x for x in growths if start <= x.step < g[0].step]
    if (i == 0 and not prev and g[0].step - start < CALIBRATION_START
            and (len(g) < BACKOFF_RUN_COLLAPSE or after > CALIBRATED_MIN)
            # Still halving when the run ended: calibration cut short, if the scale is still
            # above the default start (a quick trial of a high init_scale; review 46a).
            and (g[-1].step < last_step or after >= DEFAULT_INIT_SCALE)
            and not (after < SCALE_COLLAPSE_MIN)):
        return "calibration"
    if (i == 1 and not prev and len(g) == 1 and g[0].step - start < CALIBRATION_STEPS
            and after > CALIBRATED_MIN
            and _normal_backoff(0, groups, growths, last_step, floor,
                                start=start) == "calibration"):
        # One more halving soon after, before the scale ever grew: the scale the
        # calibration stopped at was just too high for a later batch.
        return "calibration"
    if len(g) == 1 and prev and not (after < prev[-1].scale_before):
        return "probe"
    if len(g) <= SETTLING_BACKOFFS and after >= floor:
        return "settling"
    return None


def _settled_floor(session: Session) -> float:
    """The lowest scale a settling episode may leave (see :func:`_normal_backoff`)."""
    init = (session.scaler.init_scale if session.scaler is not None else None) \
        or DEFAULT_INIT_SCALE
    return min(CALIBRATED_MIN, init / 2)


def _skipped_in(session: Session, steps: list[int]) -> dict[str, int]:
    """Per optimizer, how many of its steps were skipped in ``steps``."""
    sc = session.scaler
    want = set(steps)
    return {name: len(want.intersection(v))
            for name, v in (sc.skipped_by_optimizer if sc else {}).items()
            if want.intersection(v)}


def _unskipped(session: Session, steps: list[int]) -> set[int]:
    """The backoffs in ``steps`` that skipped no optimizer step (``unscale_`` then
    ``optimizer.step()``: the update backs off on the unscale's inf checks)."""
    sc = session.scaler
    return set(steps) - set(sc.skipped_steps if sc else ())


def _backoffs(evs: list[ScalerEvent]) -> str:
    """How many times the scale backed off in ``evs``: '9x', or '9x in 8 steps' where a
    loop's second ``update()`` in one iteration backed off again."""
    n = sum(e.count for e in evs)
    return f"{n}x" if n == len(evs) else f"{n}x in {F.counted(len(evs), 'step')}"


def _skips_per_optimizer(session: Session, steps: list[int]) -> str:
    """' and N optimizer step(s) were skipped (skipped per optimizer: ...)': N counts
    each optimizer's skipped steps (two optimizers skipping in one step are two)."""
    per = _skipped_in(session, steps)
    n = sum(per.values()) or len(_unskipped(session, steps) ^ set(steps))
    if not n:
        return (", and no optimizer step was skipped: the optimizer stepped outside "
                "scaler.step, after scaler.unscale_, whose inf checks the update backed off on")
    parts = [f"{name} {k}" for name, k in per.items()]
    return (f", and {n} optimizer step(s) were skipped"
            + (f" (skipped per optimizer: {', '.join(parts)})" if parts else ""))


def _skipped_of_steps(session: Session) -> str:
    """'N of M optimizer steps were skipped', or, when the scaler steps several
    optimizers, in how many steps any of them skipped and which did: one optimizer
    skipping while another stepped is not every optimizer step skipped."""
    sc = session.scaler
    if sc is None:
        return ""
    n = len(sc.skipped_steps)
    stepped = [s for s in sc.name.split(", ") if s]
    if len(stepped) <= 1 and len(sc.skipped_by_optimizer) <= 1:
        return f"{n} of {session.steps} optimizer steps were skipped"
    per = ", ".join(f"{name} {len(v)}" for name, v in sc.skipped_by_optimizer.items())
    unskipped = [s for s in stepped if s not in sc.skipped_by_optimizer]
    return (f"In {n} of {session.steps} steps an optimizer step was skipped (skipped per "
            f"optimizer: {per}" + (f"; never skipped: {', '.join(unskipped)}" if unskipped
                                   else "") + ")")


@dataclass(frozen=True)
class ScaledGradArrival:
    """A backward op that overflowed only because the scaled gradient it was given was
    already near the format's max (see :func:`scaled_grad_arrival`)."""

    absmax: float  # the largest |value| of the layer's scaled output gradient that step
    fmax: float  # the format's max
    dtype: str
    scale: float | None  # the loss scale of that step's backward, when known
    loss: float | None  # the median |loss| over the recorded steps, when known
    model_output: bool  # the layer returns the model's output: the loss's gradient itself


def scaled_grad_arrival(session: Session, e: Event) -> ScaledGradArrival | None:
    """Whether anomaly mode's first non-finite backward op ``e`` overflowed a gradient that
    arrived within :data:`SCALED_GRAD_NEAR_MAX` of the format's max, with a GradScaler on:
    its layer's recorded output gradient (scaled, what the backward ran on) was finite and
    that large in the op's step, and so was the op's largest input (the gradient reached
    the op). Then the op only added up terms too large already; the loss times the scale
    made them (review 57g: a summed cross-entropy, whose lm_head matmul was blamed)."""
    d = e.data
    sc = session.scaler
    if (e.kind != "nonfinite_backward" or not e.module or d.get("nan")
            or not session.amp.scaler or sc is None or not sc.enabled):
        return None
    dtype = str(d.get("dtype"))
    fmax = FORMAT_MAX.get(dtype)
    top = d.get("input_absmax")
    if fmax is None or not isinstance(top, (int, float)) or not math.isfinite(top) \
            or top * SCALED_GRAD_NEAR_MAX < fmax:
        return None
    rec = next((r for r in session.history if r.step == e.step), None)
    ls = rec.layers.get(e.module) if rec is not None else None
    g = ls.grad if ls is not None else None
    if g is None or g.nonfinite_frac > 0 or not math.isfinite(g.absmax) \
            or g.absmax * SCALED_GRAD_NEAR_MAX < fmax:
        return None
    scale = next((x.scale_before for x in sc.events if x.step == e.step
                  and not math.isnan(x.scale_before)), None)
    lay = next((x for x in session.layers if x.name == e.module), None)
    return ScaledGradArrival(absmax=g.absmax, fmax=fmax, dtype=dtype, scale=scale,
                             loss=median_loss(session),
                             model_output=lay is not None and lay.model_output)


def scaled_grad_text(a: ScaledGradArrival, module: str, loss: bool = True) -> str:
    """Why the op is not the cause, in words: where the near-max gradient came from.
    ``loss``: name the loss's size (not where a sentence of its own says it)."""
    scale = f" {_scale(a.scale)}" if a.scale is not None else ""
    size = f" (the loss was {F.num(a.loss)})" if a.loss is not None and loss else ""
    came = ("the loss's gradient" if a.model_output
            else "the loss's gradient, passed back by the layers after it,")
    return (f"the gradient arriving at {F.layer(module)} was already up to {F.num(a.absmax)}, "
            f"against {a.dtype}'s max {a.fmax:g}: {came} times "
            f"the loss scale{scale}{size}. Its backward only added up values that large; the "
            f"scaled loss gradient is too large for {a.dtype}, not {F.layer(module)}")


# Anomaly-mode origins, in the order they happen within a step.
ORIGIN_RANK = {"nonfinite_input": 0, "nonfinite_forward": 1, "activation_overflow": 2,
                "nonfinite_backward": 3}


def _origin_events(session: Session) -> dict[int, Event]:
    """Per step, the anomaly-mode event where the NaN/Inf began (the earliest kind)."""
    best: dict[int, tuple[int, Event]] = {}
    for e in session.events:
        rank = ORIGIN_RANK.get(e.kind)
        if rank is None or not e.module or (
                e.kind == "activation_overflow" and not e.data.get("hidden")):
            continue
        # A batch finding moved to an earlier unrecorded step keeps its recorded step too.
        steps = {e.step, e.data.get("recorded_first")} - {None}
        for step in steps:
            assert isinstance(step, int)
            if step not in best or rank < best[step][0]:
                best[step] = (rank, e)
    return {step: e for step, (_, e) in best.items()}


def _origins_by_step(session: Session) -> dict[int, tuple[str, str]]:
    """Per step, where anomaly mode saw the NaN/Inf begin: (module, how, in words)."""
    out: dict[int, tuple[str, str]] = {}
    for step, e in _origin_events(session).items():
        assert e.module is not None
        if e.kind == "nonfinite_input":
            how = f"the batch given to {F.layer(e.module)} already held NaN/Inf"
        elif e.kind == "nonfinite_backward":
            how = (f"the backward of {e.data.get('forward_op')} in {F.layer(e.module)} "
                   f"({e.op}) was the first op to go non-finite")
            arrival = scaled_grad_arrival(session, e)
            if arrival is not None:
                how += ", but only because " + scaled_grad_text(
                    arrival, e.module, loss=_large_loss(session) is None)
        elif e.kind == "activation_overflow":
            how = f"{e.op} overflowed inside {F.layer(e.module)} in the forward pass"
        else:
            how = f"{e.op} in {F.layer(e.module)} was the first op to produce NaN/Inf"
        out[step] = (e.module, how)
    return out


def _arrivals_by_step(session: Session) -> dict[int, ScaledGradArrival]:
    """The steps whose first origin is a backward op given a scaled gradient already near
    the format's max (:func:`scaled_grad_arrival`): the loss's doing, not the op's."""
    out: dict[int, ScaledGradArrival] = {}
    for step, e in _origin_events(session).items():
        if (a := scaled_grad_arrival(session, e)) is not None:
            out[step] = a
    return out


def _backoff_origins(session: Session, backoffs: list[ScalerEvent],
                     origins: dict[int, tuple[str, str]]) -> dict[int, tuple[str, str]]:
    """Per backoff step: (layer where the non-finite values began, how it is known).

    ``anomaly`` and ``recorded`` are seen in that very step. An unrecorded step
    only knows which layers' parameter gradients were non-finite; it is given a
    recorded step's origin when those layers are a subset of that step's
    non-finite layers and cover at least half of its parameter-owning ones
    (``inferred``); otherwise it has none. A layer is never blamed for a step
    whose own gradients do not point at it.
    """
    known: dict[int, tuple[str, str]] = {}
    op_modules = {m for m, _ in origins.values()}
    # Layers the op search saw only carry an op's inf on (self.B(h * 1e5): B).
    carried_from = {c: ev.module for ev in session.events if ev.kind == "nonfinite_forward"
                    and ev.module for c in ev.data.get("carriers") or ()}
    for e in backoffs:
        if e.step in origins and _same_models(session, origins[e.step][0], e.culprits):
            known[e.step] = (origins[e.step][0], "anomaly")
        elif e.forward_origin:
            # A child of a module where anomaly mode found the op, in a step it did not
            # search (its cool-down): the inf its parent's own code made, passed on. One
            # origin, not a second backoff finding of its own.
            parent = carried_from.get(e.forward_origin) or max(
                (m for m in op_modules if e.forward_origin.startswith(m + ".")),
                key=len, default=None)
            known[e.step] = (parent or e.forward_origin, "recorded")
    with_params = {lay.name for lay in session.layers if lay.param_dtypes}
    refs = [(set(e.culprits), known[e.step][0]) for e in backoffs
            if e.step in known and e.culprits]
    for e in backoffs:
        if e.step in known or not e.culprits:
            continue
        mine = set(e.culprits)
        for theirs, where in refs:
            # Not a layer with parameters that this step's gradients leave out: the origin's
            # own gradients go non-finite with everything downstream of it.
            if (mine <= theirs and 2 * len(mine) >= len(theirs & with_params)
                    and (where in mine or where not in with_params)):
                known[e.step] = (where, "inferred")
                break
    return known


# Recorded backoffs, with a finite loss, that must show the output layer's own gradient
# non-finite before a collapse is put on the loss's size.
LOSS_TOO_LARGE_MIN_BACKOFFS = 2
# Weightless layers (activations) followed from a culprit to the layer whose backward
# made its gradient, at most.
MAX_PASS_THROUGH = 4


def _loss_gradient_overflow(session: Session, backoffs: list[ScalerEvent]
                            ) -> tuple[str, str] | None:
    """(layer, words) when most recorded backoffs' first non-finite gradient is the output
    gradient of a layer that returns the model's output (not the model's own code): the
    loss's gradient, times the scale, is beyond float16. The loss is too large."""
    models = set(session.run.models)
    # Its output gradient itself went non-finite: the loss's. Its weights' alone is its
    # input's size times a finite gradient (a GAN discriminator given a huge fake).
    outputs = {lay.name for lay in session.layers
               if lay.model_output and lay.name not in models and lay.grad_nonfinite_steps}
    # The model itself first is its output layer's gradient too when it returns that
    # layer's tensor (a Sequential); then its own code made the output (CLIP's logits),
    # and the next culprit is no output layer.
    recs = {r.step: r for r in session.history}

    def own_output_gradient(e: ScalerEvent, name: str) -> bool:
        # In that very backoff, its output gradient itself went non-finite, not only its
        # weights' (an input grown large times a finite gradient: review 44c). A step the
        # history left it out of is taken at the run's word.
        ls = recs[e.step].layers.get(name) if e.step in recs else None
        return ls is None or ls.grad is None or ls.grad.nonfinite_frac > 0

    # A backoff whose loss was NaN/inf already (0 * log(0) in an entropy term) says
    # nothing of the loss's size: its gradient is NaN at any scale.
    leads = [(e, next((c for c in e.culprits if c not in models), None))
             for e in backoffs if e.recorded and e.culprits and not e.loss_nonfinite]
    rec = [c for _, c in leads if c is not None]
    first = [c for e, c in leads if c is not None and c in outputs
             and own_output_gradient(e, c)]
    # One backoff is the scaler's calibration at a scale too high for any loss: the size
    # of the loss shows in the backoffs that keep coming.
    if len(first) < LOSS_TOO_LARGE_MIN_BACKOFFS or 2 * len(first) < len(rec):
        return _loss_beyond_format(session, [e for e, c in leads if c is not None], rec)
    top = max(dict.fromkeys(first), key=first.count)
    said = (f"; in {len(first)} of {len(rec)} recorded backoffs the first non-finite "
            f"gradients were those of {top}, which returns the model's output: the "
            "gradient it gets is the loss's own times the scale (and its weights' "
            "gradients that times its input), ")
    peak = loss_peak(session, backoffs)
    if peak is not None and peak <= LOSS_NOT_LARGE:
        return top, said + (f"yet the loss was at most {F.num(peak)} in those steps: an op "
                            "of the loss code makes the large gradient in its backward, not "
                            f"the loss's size, nor {top}")
    return top, said + f"so the loss is too large for float16, not {top}"


def _loss_beyond_format(session: Session, evs: list[ScalerEvent], leads: list[str]
                        ) -> tuple[str, str] | None:
    """(layer, words) when the loss itself was beyond the format's max in the recorded
    backoffs: its gradient, times the scale, overflows whatever layer still runs in the
    format, the output layer or (run in float32: review 54, `--fp32` on a regression on
    raw prices, a loss of 2.4e9) the one before it. Not that layer's doing."""
    fmax = FORMAT_MAX.get(low_format(session))
    peak = loss_peak(session, evs)
    if (fmax is None or peak is None or peak <= fmax
            or len(leads) < LOSS_TOO_LARGE_MIN_BACKOFFS):
        return None
    top = max(dict.fromkeys(leads), key=leads.count)
    return top, (f"; the loss was up to {F.num(peak)} in the recorded steps that backed off, "
                 f"beyond {low_format(session)}'s max {fmax:g}: the gradient it sends back, "
                 "times the scale, overflows the layers that still run in that format "
                 "(running the output layer in float32 only moves the overflow to the layer "
                 f"before it), so the loss is too large, not {top}")


def loss_peak(session: Session, evs: list[ScalerEvent]) -> float | None:
    """The largest |loss| of the recorded steps among ``evs`` whose loss was finite."""
    recs = {r.step: r for r in session.history}
    losses = [abs(r.loss) for e in evs if (r := recs.get(e.step)) is not None
              and isinstance(r.loss, float) and math.isfinite(r.loss)]
    return max(losses) if losses else None


def loss_code_advice(session: Session, evs: list[ScalerEvent]) -> str:
    """The advice for backoffs made after the model: the loss code's ops when the loss
    itself stayed small (:data:`LOSS_NOT_LARGE`), else its size."""
    peak = loss_peak(session, evs)
    small = peak is not None and peak <= LOSS_NOT_LARGE
    return ADVICE["scale_collapse_loss_code" if small else "scale_collapse_loss_gradient"]


def _model_of(session: Session, name: str) -> str | None:
    """The watched model a layer's name belongs to, when several are watched."""
    return next((m for m in session.run.models if name == m or name.startswith(m + ".")),
                None)


def _same_models(session: Session, origin: str, culprits: list[str]) -> bool:
    """Whether an op origin anomaly mode found in a step can be this backoff's: with several
    models watched (a GAN's, one GradScaler each), not when it is in another model than
    every culprit of the backoff (the step's first origin, in the discriminator's backward,
    is not the generator's scaler's)."""
    if len(session.run.models) < 2 or not culprits:
        return True
    mine = {_model_of(session, c) for c in culprits}
    return _model_of(session, origin) in mine or None in mine


def _untraced_text(backoffs: list[ScalerEvent], known: dict[int, tuple[str, str]]) -> str:
    """The backoffs no origin was found for: unrecorded ones want ``every=1``; a recorded
    one's gradients went non-finite where no forward output did (in a backward)."""
    lost = [e for e in backoffs if e.step not in known]
    if not lost:
        return ""
    recorded = [e for e in lost if e.recorded]
    out = ""
    if recorded:
        leads = list(dict.fromkeys(e.culprits[0] for e in recorded if e.culprits))
        out += (f"; {len(recorded)} recorded backoff(s) (steps "
                f"{F.steps_list([e.step for e in recorded])}) had no forward origin: their "
                "gradients went non-finite in the backward pass"
                + (f", first in {', '.join(leads[:3])}" if leads else ""))
    if len(lost) > len(recorded):
        out += (f"; {len(lost) - len(recorded)} backoff(s) on unrecorded steps could not be "
                "traced (record every step with `every=1` to see them)")
    return out


def _lead(e: ScalerEvent, with_params: set[str]) -> str | None:
    """The first culprit that owns parameters: the same on recorded and unrecorded steps."""
    return next((c for c in e.culprits if c in with_params), e.culprits[0] if e.culprits
                else None)


def _origin_of(evs: list[ScalerEvent], origins: dict[int, tuple[str, str]]
               ) -> tuple[str, str] | None:
    """Where the non-finite gradients of these backoffs began, if anything says so."""
    for e in evs:
        if e.step in origins:
            return origins[e.step]
    for e in evs:
        if e.forward_origin:
            how = (f"{F.layer(e.forward_origin)}'s output went non-finite first, in the "
                   f"forward pass, at step {e.step}")
            if e.step > evs[0].step:
                # An overflow in the backward pass alone (the forward was finite), or a step
                # not recorded: the earlier backoffs are not said to have begun there.
                before = [x for x in evs if x.step < e.step]
                if not any(x.recorded for x in before):
                    how += (f" (the backoffs before it, from step {evs[0].step}, were on steps "
                            "not recorded: `every=1` records every step)")
                else:
                    how += (f" (the backoffs before it, from step {evs[0].step}, show no "
                            "forward origin)")
            return (e.forward_origin, how)
    return None


def _top_lead(evs: list[ScalerEvent], with_params: set[str]) -> tuple[str | None, int]:
    """The layer that led the non-finite gradients in most backoffs (ties: the later one,
    since it kept overflowing as the scale fell), and in how many."""
    leads = [x for x in (_lead(e, with_params) for e in evs) if x]
    if not leads:
        return None, 0
    last = {x: i for i, x in enumerate(leads)}
    top = max(last, key=lambda x: (leads.count(x), last[x]))
    return top, leads.count(top)


def passed_through(session: Session, name: str) -> list[str]:
    """The layers without weights that carried culprit ``name``'s output to the next layer
    with weights, in forward order: each its one consumer, each with a non-finite output
    gradient too (an activation module: a Tanh's gradient, at most 1, passes an overflow
    on but cannot make one; review 47c: a head's backward into a Tanh blamed layer 0)."""
    by = {lay.name: lay for lay in session.layers}
    lay, via = by.get(name), list[str]()
    while lay is not None and len(via) < MAX_PASS_THROUGH:
        users = [c for c in lay.consumers if c in by]
        if (len(users) != 1 or by[users[0]].param_dtypes or users[0] in via
                or not by[users[0]].grad_nonfinite_steps):
            break
        via.append(users[0])
        lay = by[users[0]]
    return via


def made_by(session: Session, name: str) -> str | None:
    """The layer whose backward made culprit ``name``'s non-finite output gradient, when
    that is another layer: the one layer with weights that took its output (directly or
    through :func:`passed_through`), whose own output gradient stayed finite. Its backward
    multiplies that gradient by its weights; the product overflowed (review 44a: a LoRA B
    weight grown to 3000, and A, the layer before it, was blamed; review 44d: a float32
    LayerNorm before an overflowing head)."""
    by = {lay.name: lay for lay in session.layers}
    lay = by.get(name)
    if lay is None or not lay.grad_nonfinite_steps:
        return None  # its weights' gradients alone: made in its own backward
    via = passed_through(session, name)
    last = by[via[-1]] if via else lay
    users = [c for c in last.consumers if c in by and by[c].param_dtypes]
    if len(users) != 1 or by[users[0]].grad_nonfinite_steps:
        return None
    return users[0]


def made_in_parent(session: Session, name: str) -> str | None:
    """The module whose own forward code made culprit ``name``'s non-finite output
    gradient, when that is its parent's: ``name``'s output stayed finite (never non-finite,
    never past the max) and fed no watched layer, so the parent's code took it (a
    hand-written GELU's ``h.pow(3)`` between ``c_fc`` and ``c_proj``), and the parent's own
    output gradient stayed finite, so the inf did not come in from after the parent: the
    backward of that code made it. Float32 for the parent runs that code in float32
    whatever it casts; float32 for ``name`` does only while the code keeps its float32
    output (elementwise ops do, a matmul is cast back). None when the parent is a watched
    model itself: float32 for all of it is no mixed precision left to try."""
    by = {lay.name: lay for lay in session.layers}
    lay = by.get(name)
    if (lay is None or "." not in name or not lay.grad_nonfinite_steps or lay.consumers
            or lay.model_output or lay.nonfinite_steps or lay.overflow_frac > 0):
        return None
    parent = by.get(name.rsplit(".", 1)[0])
    if parent is None or parent.name in session.run.models or parent.grad_nonfinite_steps:
        return None
    return parent.name


def made_outside(session: Session, name: str, evs: list[ScalerEvent]) -> bool:
    """Whether culprit ``name`` returns the watched model's output and, in most recorded
    backoffs of ``evs`` it led with a finite loss, its output gradient itself was
    non-finite: that gradient is made by the backward of the code after the model (the
    loss, times the scale), never by the layer (review 47a: a contrastive loss's
    ``z1 @ z2.T / 0.07`` overflowed in backward, and `--fp32 proj` was advised). Not when
    its weights' gradients alone were (a huge input times a finite gradient)."""
    lay = next((x for x in session.layers if x.name == name), None)
    models = set(session.run.models)
    if lay is None or not lay.model_output or name in models:
        return False
    recs = {r.step: r for r in session.history}
    bad = []
    for e in evs:
        lead = next((c for c in e.culprits if c not in models), None)
        ls = recs[e.step].layers.get(name) if e.step in recs else None
        if e.recorded and not e.loss_nonfinite and lead == name and ls is not None:
            bad.append(ls.grad is not None and ls.grad.nonfinite_frac > 0)
    return bool(bad) and 2 * sum(bad) > len(bad)


def made_in(session: Session, name: str, evs: list[ScalerEvent]) -> str:
    """The words for :func:`made_by` or :func:`made_outside`, or ""."""
    if made_outside(session, name, evs):
        return (f"; {name} returns the model's output, and its output gradient was "
                "non-finite as it arrived: it was made in the backward of the code after the "
                "model (the loss computation: a matmul of embeddings, a division by a "
                f"temperature, a large loss), times the scale, not in {name}, so running "
                f"{name} in float32 does not help")
    c = made_by(session, name)
    parent = made_in_parent(session, name) if c is None else None
    if parent is not None:
        return (f"; {name}'s output stayed finite and fed no watched layer but {parent}'s own "
                f"code, and {parent}'s output gradient stayed finite: the overflow is in the "
                f"backward of {parent}'s code after {name} (an op of its forward, such as a "
                f"power or an exp), and shows first in {name} (anomaly mode names the op)")
    if c is None:
        return ""
    via = passed_through(session, name)
    through = f" (through {', '.join(via)}, which only passed it on)" if via else ""
    return (f"; {name}'s output gradient is computed in the backward of {c}, which takes "
            f"{name}'s output{through} and multiplies the gradient it got (finite) by its "
            "weights: the "
            f"overflow is in {c}'s backward (its weights grown large, or a gradient too large "
            f"for float16 times them), and shows first in {name}")


def blamed(session: Session, name: str | None) -> str | None:
    """The layer a finding about culprit ``name`` is about: the one whose backward made
    its gradient (see :func:`made_by`), else itself."""
    return (made_by(session, name) or name) if name else name


def unplaced_culprits(session: Session, culprits: list[str]) -> list[str]:
    """Culprits after the first whose place in backward order is not known: only their
    weights' gradients went non-finite (never their output gradient), and they ran more
    than once a step (two backward calls: accumulation), so which backward call made
    them non-finite, before or after the first culprit's, is not known."""
    by = {lay.name: lay for lay in session.layers}
    out = []
    for n in culprits[1:]:
        lay = by.get(n)
        if (lay is not None and lay.param_grad_nonfinite_steps and not lay.grad_nonfinite_steps
                and lay.calls > lay.recorded_steps):
            out.append(n)
    return out


def _culprit_text(culprits: list[str], origin: tuple[str, str] | None,
                  lead: tuple[str | None, int, int] = (None, 0, 0),
                  loss_bad: bool = False, every: int = 0,
                  unplaced: list[str] | None = None,
                  made: Callable[[str], str] = lambda n: "",
                  models: Iterable[str] = (), recorded: bool = True,
                  loss_made: bool = False) -> str:
    if loss_bad and not origin:
        # The loss itself was NaN/inf: the first layer with non-finite gradients is only
        # where it entered the backward pass (the layer the loss is computed from), not
        # where the NaN began in the forward pass.
        top = lead[0] or (culprits[0] if culprits else None)
        entered = (f"; the first of them in backward order, {top}, only says where the "
                   "backward pass met the NaN/inf first (the last layer with trainable weights "
                   "before the loss), not where it began" if top else "")
        # The model itself is no layer of its own (review 55b: "4 layers" of a model of 3).
        n = len([c for c in culprits if c not in set(models)])
        return ("; the loss itself was NaN/inf in each of these steps, so the gradients "
                f"of every layer were too ({F.counted(n, 'layer')} with "
                f"non-finite gradients){entered}. Where it began in the forward "
                "pass is not known from these steps: "
                + ("" if every == 1 else "record every step (`every=1`, --every 1) to see "
                   "the first layer to go non-finite, or ")
                + "stop at the op that makes it (--anomaly --on-nonfinite raise)")
    if not culprits and not recorded:
        # None of these steps was recorded: no layer was seen, which is not "none had them".
        text = ("; none of these steps was recorded, so which layers' gradients went "
                "non-finite is not known (record every step: `every=1`, --every 1)")
    elif not culprits:
        text = ("; no watched layer had non-finite gradients (the inf/NaN was in parameters "
                "outside the watched model(s), or the optimizer checks for inf on the device, "
                "e.g. fused=True, so the gradients were not inspected)")
    else:
        shown = ", ".join(culprits[:6]) + ("..." if len(culprits) > 6 else "")
        text = (f"; non-finite gradients in {len(culprits)} layer(s)"
                + (": " if unplaced and not origin else ", in backward order: ") + shown)
        top, n, total = lead
        if not origin and unplaced and (top is None or top == culprits[0]):
            text += (f". The first with a non-finite output gradient is "
                     f"{F.layer(culprits[0])}{made(culprits[0])}; only the weights' gradients of "
                     f"{', '.join(unplaced[:4])} went non-finite, in one of the step's "
                     "backward calls, so whether they came before it is not known: look at "
                     "each (anomaly mode names the first op)")
        elif not origin and (top is None or top == culprits[0]):
            text += (f". The first, {F.layer(culprits[0])}, is where they appeared"
                     + (made(culprits[0]) or ": look there"))
        elif not origin:
            text += (f". {F.layer(top)} came first in {n} of {total} of these backoffs (the layers "
                     "before it stopped overflowing as the scale fell)"
                     + ((made(top) if top else "") or ": look there"))
    if origin:
        # Not "look there" when the origin's own gradient came in near the max: the scaled
        # loss gradient is what to change (``loss_made``), which its words say.
        text += (f". They began at {F.layer(origin[0])}: {origin[1]}"
                 + ("" if loss_made else "; look there"))
    return text


def _large_loss(session: Session) -> float | None:
    """The median |loss| over the recorded steps when at least :data:`LARGE_LOSS`."""
    mid = median_loss(session)
    return mid if mid is not None and mid >= LARGE_LOSS else None


def _large_loss_text(session: Session) -> str:
    mid = _large_loss(session)
    if mid is None:
        return ""
    return (f" The loss itself is large (median {F.num(mid)} over the recorded steps): every "
            "gradient starts from it, and the loss scale multiplies it further; a loss "
            "summed over tokens or a batch instead of averaged is the likely cause.")


def _net_backoffs(sc: ScalerTimeline, backoffs: int, growths: int) -> float:
    """Backoffs not made up for by growths, in backoffs: the scale's fall over the stretch
    (log2 of the factors; the defaults 0.5 and 2 make one growth repay one backoff)."""
    backoff, growth = sc.backoff_factor or 0.5, sc.growth_factor or 2.0
    down = -math.log2(backoff) if 0 < backoff < 1 else 1.0
    up = math.log2(growth) if growth > 1 else 0.0
    return max(0.0, backoffs - growths * up / down)


def _scaler_events(session: Session) -> tuple[list[ScalerEvent], list[ScalerEvent]]:
    """The run's backoffs and growths, in step order (none without an enabled scaler)."""
    sc = session.scaler
    if sc is None or not sc.enabled:
        return [], []
    return (sorted((e for e in sc.events if e.kind == "backoff"), key=lambda e: e.step),
            sorted((e for e in sc.events if e.kind == "growth"), key=lambda e: e.step))


def _classified(session: Session, backoffs: list[ScalerEvent], growths: list[ScalerEvent]
                ) -> list[tuple[str | None, list[ScalerEvent]]]:
    """The backoff episodes in order, each with why it is GradScaler working as designed
    (:func:`_normal_backoff`), or None for a finding. Settling episodes that a finding
    follows with no growth in between are part of its fall (a scale halving now and then
    and never growing back, until it is low): they are the finding's too. Not before an
    episode of a failed forward pass (a NaN loss): that is no fall of the scale."""
    floor = _settled_floor(session)
    loss = _loss_counts(session)
    starts = [0, *restarts(session.scaler)] if session.scaler is not None else [0]
    out: list[tuple[str | None, list[ScalerEvent]]] = []
    # Each scaler's episodes on their own: one replaced by a new scaler ends there, and
    # the new one calibrates from its own start ("recalibration": the old one's scale
    # thrown away), which is no collapse of the old one's scale.
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else math.inf
        groups = F.consecutive_runs([e for e in backoffs if start <= e.step < end])
        for i, g in enumerate(groups):
            why = _normal_backoff(i, groups, growths, session.steps - 1, floor, loss, start)
            if k and (why == "calibration" or i == 0 and _restart_startup(
                    g, start, _start_scale(session.scaler, start), loss)):
                # Judged as the first scaler's start-up is (a long one is the scaler_backoff
                # warning, not a collapse), from its own start: a new scaler cut short by
                # the next one or the run's end never finished (scaler_recreated's error).
                why = "recalibration"
            out.append((why, g))
    grown = {e.step for e in growths}
    for i in range(len(out) - 1, 0, -1):
        if out[i][0] is not None or any(e.forward_origin or (e.loss_nonfinite and loss)
                                        for e in out[i][1]):
            continue  # settled, or a forward pass that failed: no fall of the scale
        j = i - 1
        while (j >= 0 and out[j][0] == "settling"
               and not any(out[j][1][-1].step < s < out[j + 1][1][0].step for s in grown)
               # A new scaler between them started again: no fall of one scale.
               and not any(out[j][1][-1].step < s <= out[j + 1][1][0].step
                           for s in starts)):
            out[j] = (None, out[j][1])
            j -= 1
    return out


def _deep_fall(init_scale: float | None) -> float:
    """Below this a scaler's first run of backoffs is no calibration, however early: it
    fell this far from where it started (at most the default scale: a higher init_scale
    has further to fall before it fits)."""
    start = init_scale if init_scale is not None and not math.isnan(init_scale) \
        else DEFAULT_INIT_SCALE
    return min(start, DEFAULT_INIT_SCALE) / 2 ** (2 * BACKOFF_RUN_COLLAPSE)


def _start_scale(sc: ScalerTimeline | None, start: int) -> float | None:
    """The scale the scaler that began at step ``start`` was built with."""
    if sc is None:
        return None
    if start == 0:
        return sc.init_scale
    return next((r.scale_after for r in sc.resets if r.step == start), None)


def _restart_startup(g: list[ScalerEvent], start: int, init_scale: float | None,
                     loss_counts: bool) -> bool:
    """Whether ``g``, the first backoffs of a scaler that began at step ``start``, is its
    start-up as the collapse's run rule judges the first scaler's (see
    :func:`_one_scaler_findings`): begun within :data:`CALIBRATION_STEPS` of its start,
    in a forward pass that did not fail, and not fallen below :func:`_deep_fall`."""
    if any(e.forward_origin or (e.loss_nonfinite and loss_counts) for e in g):
        return False
    return (g[0].step - start < CALIBRATION_STEPS
            and not g[-1].scale_after < _deep_fall(init_scale))


def restarts(sc: ScalerTimeline) -> list[int]:
    """The steps where a new scaler replaced the old one and started above the scale the
    old one had reached (its init_scale, not the old one's state): it calibrates again.
    A new scaler that loaded the old one's state (a resumed run) starts where the old
    one was and is no restart. An unknown scale (on the device) counts as one."""
    return [r.step for r in sc.resets if not r.scale_after <= r.scale_before]


def _all_loss_nonfinite(session: Session, backoffs: list[ScalerEvent]) -> bool:
    """Whether every backoff of ``backoffs`` that was not GradScaler working as designed
    came in a step whose loss was NaN/inf (and some did)."""
    normal = normal_backoff_steps(session)
    rest = [e for e in backoffs if e.step not in normal]
    return bool(rest) and all(e.loss_nonfinite for e in rest) and _loss_counts(session)


def loss_bad_steps(session: Session) -> list[int]:
    """The steps whose loss was NaN/inf (the first ones, as the loss's event keeps them)."""
    return next((e.data.get("bad_steps") or [] for e in session.events
                 if e.kind == "nonfinite_loss"), [])


def loss_steps_not_skipped(session: Session) -> list[int]:
    """Steps whose loss was NaN/inf that an enabled GradScaler did not skip: their
    gradients were finite (an inf term whose gradient is finite), so a NaN loss does not
    explain a backoff in this run."""
    sc = session.scaler
    if sc is None or not sc.enabled:
        return []
    bad = loss_bad_steps(session)
    # A backoff with no skip found inf in the gradients all the same (unscale_ then
    # optimizer.step(), outside the scaler).
    skipped = set(sc.skipped_steps) | set(sc.backoff_steps)
    return [s for s in bad if s not in skipped]


def _loss_counts(session: Session) -> bool:
    """Whether a NaN/inf loss explains a backoff in this run: not when the scaler let
    steps with a NaN/inf loss through (finite gradients: :func:`loss_steps_not_skipped`)."""
    return not loss_steps_not_skipped(session)


def normal_backoff_steps(session: Session) -> set[int]:
    """Steps whose backoff was GradScaler working as designed (calibration, a probe):
    a scaled gradient overflowing there is the scaler's business, not a finding's."""
    backoffs, growths = _scaler_events(session)
    return {e.step for why, g in _classified(session, backoffs, growths) if why is not None
            for e in g}


def scaler_findings(session: Session) -> Iterable[Finding]:
    """The first scaler's findings, then each other scaler's (a GAN with one per network),
    judged alike on its own timeline; their messages name the optimizers it steps."""
    if not session.other_scalers or session.scaler is None:
        yield from _one_scaler_findings(session)
        return
    for i, sc in enumerate([session.scaler, *session.other_scalers]):
        view = session if i == 0 else replace(session, scaler=sc, other_scalers=[])
        name = sc.name or ("the first" if i == 0 else f"another ({i})")
        whose = f"The GradScaler of {sc.label or name}"
        for f in _one_scaler_findings(view):
            msg = (f.message.replace("GradScaler", whose, 1)
                   if f.message.startswith("GradScaler ") else f"{whose}: {f.message}")
            yield replace(f, message=msg, data={**f.data, "scaler": name})


def _split_at_new_origins(g: list[ScalerEvent], known: dict[int, tuple[str, str]]
                          ) -> list[list[ScalerEvent]]:
    """An episode cut where a step's known origin differs from the one before it: each
    part is its origin's (review 59a: backoffs at 31 and 32 made by two blocks were one
    episode charged to the first, and step 32 was missing from the other's finding,
    which the loss-scale collapse counted as its own). A step of no known origin stays
    with the part before it."""
    parts: list[list[ScalerEvent]] = []
    origin: str | None = None
    for e in g:
        now = known[e.step][0] if e.step in known else None
        if not parts or (now is not None and origin is not None and now != origin):
            parts.append([])
        parts[-1].append(e)
        origin = now or origin
    return parts


def _one_scaler_findings(session: Session) -> Iterable[Finding]:
    sc = session.scaler
    if sc is None or not sc.enabled:
        return
    backoffs, growths = _scaler_events(session)
    last_step = session.steps - 1
    floor = _settled_floor(session)
    classified = _classified(session, backoffs, growths)
    groups = [g for _, g in classified]
    origins = _origins_by_step(session)
    arrivals = _arrivals_by_step(session)
    normal: list[tuple[str, list[ScalerEvent]]] = []
    # The start-up backoffs of each new scaler that replaced the old one: its finding's.
    recal = [g for why, g in classified if why == "recalibration"]
    recal_steps = {e.step for g in recal for e in g}
    yield from _recreated_findings(session, recal)
    # Episodes with the same culprits are one finding: a recurring overflow
    # in the same layer is one problem, however often it strikes.
    by_culprits: dict[tuple[str, ...], list[list[ScalerEvent]]] = {}
    known = _backoff_origins(session, backoffs, origins)
    with_params = {lay.name for lay in session.layers if lay.param_dtypes}
    for why, g in classified:
        if why == "recalibration":
            continue
        if why is not None:
            normal.append((why, g))
            continue
        # Episodes are one problem when they began at the same place: the same origin,
        # or else the same first culprit (recorded and unrecorded steps alike).
        for part in _split_at_new_origins(g, known):
            began = next((known[e.step][0] for e in part if e.step in known), None)
            key = ("origin", began) if began else ("lead", _top_lead(part, with_params)[0]
                                                   or "")
            by_culprits.setdefault(key, []).append(part)
    for episodes in by_culprits.values():
        evs = [e for g in episodes for e in g]
        culprits = _culprits_of(evs)
        first, last = evs[0], evs[-1]
        steps = [e.step for e in evs]
        if len(episodes) == 1:
            span = f"step {first.step}" if len(evs) == 1 else f"steps {first.step}-{last.step}"
            head = (f"GradScaler backed off {_backoffs(evs)} at {span}: the scale fell from "
                    f"{_scale(first.scale_before)} to {_scale(last.scale_after)}")
        else:
            # Not first-to-last: the scale may have grown back between the episodes.
            lowest = min((e.scale_after for e in evs if not math.isnan(e.scale_after)),
                         default=math.nan)
            head = (f"GradScaler backed off {_backoffs(evs)} in {len(episodes)} separate episodes "
                    f"(steps {F.steps_list(steps)}): the scale fell as low as "
                    f"{_scale(lowest)} (from {_scale(first.scale_before)} before step "
                    f"{first.step}), and was {_scale(sc.scale[-1][1] if sc.scale else None)} "
                    "at the end")
        origin = _origin_of(evs, origins)
        # The origin a backward op given a scaled gradient already near the max: the loss
        # times the scale made the overflow, no layer (review 57g).
        at = next((e.step for e in evs if e.step in origins), None)
        arrival = arrivals.get(at) if at is not None else None
        top_lead, n_lead = _top_lead(evs, with_params)
        loss_bad = all(e.loss_nonfinite for e in evs) and _loss_counts(session)
        lead = top_lead or (culprits[0] if culprits else None)
        outside = not origin and lead is not None and made_outside(session, lead, evs)
        yield Finding(
            kind="scaler_backoff", severity="warning",
            # Where the non-finite values began, when known, is where to look.
            module=origin[0] if origin else blamed(session, top_lead or (
                culprits[0] if culprits else None)),
            op=None,
            step=first.step,
            message=(f"{head}{_skips_per_optimizer(session, steps)}"
                     + ("" if not culprits and _unskipped(session, steps) == set(steps)
                        else _culprit_text(culprits, origin, (top_lead, n_lead, len(evs)),
                                           loss_bad, session.run.every,
                                           unplaced_culprits(session, culprits),
                                           functools.partial(made_in, session, evs=evs),
                                           session.run.models,
                                           recorded=any(e.recorded for e in evs),
                                           loss_made=arrival is not None))
                     + "." + _large_loss_text(session)),
            advice=(loss_code_advice(session, evs) if outside and not loss_bad
                    and _unskipped(session, steps) != set(steps) else
                    ADVICE["scaler_backoff_unskipped" if _unskipped(session, steps) == set(steps)
                           else "nonfinite_loss" if loss_bad and not origin
                           else "scale_collapse_loss_gradient" if outside
                           else "scaled_grad_near_max" if arrival is not None
                           else "scale_collapse_large_loss" if _large_loss(session)
                           else "scaler_backoff"]),
            steps=steps[:MAX_STEPS_KEPT],
            data={"culprits": culprits, "scale_before": first.scale_before,
                  "scale_after": last.scale_after, "backoffs": sum(e.count for e in evs),
                  "episodes": [[g[0].step, g[-1].step] for g in episodes][:MAX_STEPS_KEPT],
                  "forward_origin": origin[0] if origin else None,
                  "loss_nonfinite": loss_bad,
                  # Made by the code after the model, or the scaled loss gradient
                  # overflowing in the first backward op it met: no layer to run in float32.
                  "loss_too_large": outside or arrival is not None},
        )
    if normal:
        steps = [e.step for _, g in normal for e in g]
        culprits = _culprits_of([e for _, g in normal for e in g])
        evs_n = sorted((e for _, g in normal for e in g), key=lambda e: e.step)
        cal = [g for why, g in normal if why == "calibration"]
        probes = [g for why, g in normal if why == "probe"]
        settling = [g for why, g in normal if why == "settling"]
        parts = []
        if cal:
            g = cal[0]
            span = f"step {g[0].step}" if len(g) == 1 else f"steps {g[0].step}-{g[-1].step}"
            parts.append(f"{len(g)} while calibrating at the start ("
                         f"{span}, scale {_scale(g[0].scale_before)} -> "
                         f"{_scale(g[-1].scale_after)})")
            if g[-1].step >= last_step:
                parts.append("the calibration was still under way when the run ended" + (
                    ": every optimizer step was skipped, so the model has not trained yet "
                    "(a longer run, or a lower `init_scale`, trains)"
                    if len(g) >= session.steps else ""))
            for c in cal[1:]:
                # Not at the start: steps later, before any growth (_normal_backoff).
                parts.append(f"1 more at step {c[0].step}, before the scale ever grew: the "
                             "calibrated scale was just too high for a later batch (scale "
                             f"{_scale(c[0].scale_before)} -> {_scale(c[-1].scale_after)})")
        if probes:
            parts.append(f"{len(probes)} each undoing the growth before it ("
                         f"{'step' if len(probes) == 1 else 'steps'} "
                         f"{F.steps_list([g[0].step for g in probes])})")
        if settling:
            n = sum(len(g) for g in settling)
            parts.append(f"{n} in {len(settling)} short episode(s) of at most "
                         f"{SETTLING_BACKOFFS} that left the scale at or above {_scale(floor)}, "
                         "settling where the gradients fit ("
                         f"{'step' if n == 1 else 'steps'} "
                         f"{F.steps_list([e.step for g in settling for e in g])})")
        yield Finding(
            kind="scaler_backoff", severity="info",
            module=culprits[0] if culprits else None, op=None, step=steps[0],
            message=(f"GradScaler backed off {_backoffs(evs_n)} as designed: "
                     + "; ".join(parts)
                     + (". Each skipped one optimizer step"
                        if sum(_skipped_in(session, steps).values()) in (0, len(steps))
                        else _skips_per_optimizer(session, steps).replace(", and", ". In all,"))
                     + (f"; layers with non-finite gradients then, in backward order: "
                        f"{', '.join(culprits[:6])}" if culprits else "") + "."),
            advice=("Nothing to fix: GradScaler searches for the largest scale that does not "
                    "overflow. If the start matters, pass a lower `init_scale` to "
                    "`torch.amp.GradScaler(device_type, init_scale=...)`."),
            steps=steps[:MAX_STEPS_KEPT],
            data={"culprits": culprits, "calibration": sum(len(g) for g in cal),
                  "probes": len(probes), "settling": sum(len(g) for g in settling),
                  # as the warning's: a finding this folds into names the fall
                  "backoffs": sum(e.count for e in evs_n), "scale_before": evs_n[0].scale_before,
                  "scale_after": evs_n[-1].scale_after},
        )
    # Collapse: below 1, or too many backoffs after calibration, or long runs of them.
    final = sc.scale[-1][1] if sc.scale else None
    min_scale = min((s for _, s in sc.scale), default=None)
    for e in backoffs:  # the timeline may be thinned; events are not
        if not math.isnan(e.scale_after):
            min_scale = e.scale_after if min_scale is None else min(min_scale, e.scale_after)
    # A new scaler's calibration is no backoff of the scale it replaced, nor a step that
    # could have backed off: neither side of the share counts it.
    # Each new scaler's first steps are left out as the first scaler's are: a run with
    # recreated scalers is judged no harsher than the same run with one.
    start_up = {s for st in [0, *restarts(sc)]
                for s in range(st, min(st + CALIBRATION_STEPS, session.steps))}
    post = [e for e in backoffs if e.step not in start_up and e.step not in recal_steps]
    eligible = max(session.steps - len(start_up)
                   - sum(s not in start_up for s in recal_steps), 0)
    # A first run that fell this far is no calibration, however early.
    deep = _deep_fall(sc.init_scale)
    runs = [g for i, g in enumerate(groups) if len(g) >= BACKOFF_RUN_COLLAPSE
            and g[0].step not in recal_steps and (
        i > 0 or g[0].step >= CALIBRATION_STEPS
        or g[-1].step >= last_step and not g[-1].scale_after >= DEFAULT_INIT_SCALE
        or g[-1].scale_after < deep)]
    reasons = []
    if min_scale is not None and min_scale < SCALE_COLLAPSE_MIN:
        below = next((e.step for e in backoffs if e.scale_after < SCALE_COLLAPSE_MIN), None)
        reasons.append(f"the scale fell to {_scale(min_scale)} (below "
                       f"{SCALE_COLLAPSE_MIN:g}" + (f", first at step {below}" if below is not
                                                    None else "") + ")")
    # A backoff that a growth made up for is the scaler probing, not falling: with a short
    # growth_interval it grows every few steps and backs off as often, at a steady scale.
    post_growths = [g for g in growths if g.step not in start_up]
    if eligible >= 10 and _net_backoffs(sc, len(post), len(post_growths)) / eligible > \
            BACKOFF_SHARE_COLLAPSE:
        reasons.append(f"{len(post)} backoffs"
                       + (f" (and {len(post_growths)} growths)" if post_growths else "")
                       + f" in the {eligible} steps after "
                       + ("each new GradScaler's " if restarts(sc) else "the ")
                       + f"first {CALIBRATION_STEPS} ({100 * len(post) / eligible:.0f}%)")
    if runs:
        g = max(runs, key=len)
        reasons.append(f"{len(g)} backoffs in a row at steps {g[0].step}-{g[-1].step} (scale "
                       f"{_scale(g[0].scale_before)} -> {_scale(g[-1].scale_after)})")
    if reasons:
        traced = [known[e.step][0] for e in backoffs if e.step in known]
        top: str | None = None
        collapse_arrival: ScaledGradArrival | None = None
        loss_nonfinite = _all_loss_nonfinite(session, backoffs)
        if traced:
            top = max(dict.fromkeys(traced), key=traced.count)
            hows = [known[e.step][1] for e in backoffs if e.step in known
                    and known[e.step][0] == top]
            seen_n = sum(h != "inferred" for h in hows)
            where = (f"; the non-finite values started at {top} in {len(hows)} of "
                     f"{len(backoffs)} backoffs ({seen_n} seen in that step"
                     + (f", {len(hows) - seen_n} inferred for "
                        + ("other" if session.run.every == 1 else "unrecorded")
                        + " steps whose gradients went non-finite in the same layers"
                        if len(hows) > seen_n
                        else "") + ")")
            seen = [arrivals.get(e.step) for e in backoffs if e.step in known
                    and known[e.step] == (top, "anomaly")]
            if seen and all(seen):
                # Each step it was seen in, the scaled loss gradient reached it near the
                # max already: the loss's doing, as the backoff finding says (review 57g).
                assert seen[0] is not None
                collapse_arrival = seen[0]
                where += ", but only because " + scaled_grad_text(
                    collapse_arrival, top, loss=_large_loss(session) is None)
            where += _untraced_text(backoffs, known)
        elif loss_nonfinite:
            # The layer the NaN loss is computed from, which tells one loss term from
            # another (a second head's), not a culprit to run in float32 (review 45c).
            lead = _top_lead(backoffs, with_params)[0]
            top = blamed(session, lead)
            # "but GradScaler's own search" only where some backoff was that (review
            # 55b: said of a CTC loss inf in all 10 backoffs).
            searched = any(e.step in normal_backoff_steps(session) for e in backoffs)
            where = ("; the loss itself was NaN/inf in every backoff"
                     + (" but GradScaler's own search for its scale" if searched else "")
                     + ", so the gradients of every layer were too" + (
                         f" ({lead}, the first in backward order, only says where the "
                         "backward pass met it, not where it began)" if lead else ""))
        from_loss = None if traced else _loss_gradient_overflow(session, backoffs)
        outside = False
        if not traced and not loss_nonfinite:
            top, n_top = _top_lead(backoffs, with_params)
            outside = top is not None and made_outside(session, top, backoffs)
            where = (f"; the first layer with non-finite gradients was {top} in "
                     f"{n_top} of {len(backoffs)} backoffs"
                     + ("" if from_loss else made_in(session, top, backoffs)) if top else "")
            top = blamed(session, top)
        if from_loss is not None:
            top, where = from_loss[0], where + from_loss[1]
        yield Finding(
            kind="scale_collapse", severity="error", module=top, op=None,
            # Where the collapse began: its longest run of backoffs, else the first after the
            # scaler's start-up (a backoff at step 0 is its calibration).
            step=(max(runs, key=len)[0].step if runs else post[0].step if post
                  else backoffs[0].step if backoffs else None),
            message=(f"Loss scale collapsed: {'; '.join(reasons)}. "
                     f"{_skipped_of_steps(session)}; final scale {_scale(final)}{where}."
                     + ("" if from_loss else _large_loss_text(session))),
            advice=(ADVICE["scaler_backoff_unskipped"] if backoffs and not sc.skipped_steps
                    else loss_code_advice(session, backoffs) if from_loss or outside
                    else ADVICE["nonfinite_loss"] if loss_nonfinite and not traced
                    else ADVICE["scaled_grad_near_max"] if collapse_arrival is not None
                    else ADVICE["scale_collapse_large_loss"] if _large_loss(session)
                    else ADVICE["scale_collapse"]),
            steps=[e.step for e in backoffs][:MAX_STEPS_KEPT],
            data={"min_scale": min_scale, "final_scale": final, "backoffs": len(backoffs),
                  "skipped": len(sc.skipped_steps), "culprit": top,
                  "origin": top if traced else None,
                  # The loss is too large (or the code after the model overflowed in
                  # backward), not the culprit layer: no layer to run in float32.
                  "loss_too_large": (from_loss is not None or outside
                                     or collapse_arrival is not None),
                  # Every backoff but GradScaler's own (calibration, probes) in a step whose
                  # loss was NaN/inf: the loss's doing.
                  "loss_nonfinite": loss_nonfinite},
        )
    gi = sc.growth_interval or DEFAULT_GROWTH_INTERVAL
    if reasons or (sc.growth_factor is not None and sc.growth_factor <= 1):
        return
    last_growth = growths[-1].step if growths else -1
    # A new scaler counts its clean steps from its own start.
    taken_over = max((s for s in restarts(sc) if s > last_growth), default=None)
    if taken_over is not None:
        last_growth = taken_over - 1
    stretch = session.steps - (last_growth + 1)
    since = [e for e in backoffs if e.step > last_growth]
    if stretch >= STUCK_INTERVALS * gi and since:
        worst = _least_grad_headroom(session, final)
        culprits = [e.culprits[0] for e in since if e.culprits]
        top = max(dict.fromkeys(culprits), key=culprits.count) if culprits else None
        why = (f" The scaled gradients come closest to {low_format(session)}'s max in {worst[0]}: "
               f"{worst[1]:.2f} bits of headroom, so doubling the scale leaves "
               f"{worst[1] - 1:.2f}." if worst else "")
        yield Finding(
            kind="scale_stuck", severity="warning", module=top or (worst[0] if worst else None),
            op=None, step=since[0].step,
            message=(f"The loss scale did not grow in the last {stretch} steps "
                     f"({stretch / gi:.1f} growth intervals of {gi}"
                     + (f", since the new GradScaler took over at step {taken_over}"
                        if taken_over is not None
                        else ", since the growth at step " + str(last_growth) if growths
                        else ", i.e. never") + f"); it is {_scale(final)}. {len(since)} "
                     f"backoff(s) (steps {F.steps_list([e.step for e in since])}) each reset "
                     f"GradScaler's count of clean steps before it reached {gi}"
                     + (f"; the first culprit was {top}" if top else "") + "." + why),
            advice=ADVICE["scale_stuck"],
            steps=[e.step for e in since][:MAX_STEPS_KEPT],
            data={"steps_without_growth": stretch, "growth_interval": gi,
                  "backoffs": len(since), "scale": final,
                  "least_headroom_layer": worst[0] if worst else None,
                  "least_headroom_bits": worst[1] if worst else None},
        )


def _recreated_findings(session: Session, recal: list[list[ScalerEvent]]
                        ) -> Iterable[Finding]:
    """``scaler_recreated``: new GradScalers replaced the old one and calibrated again
    from their init_scale (``recal``: their start-up backoffs, see :func:`_classified`),
    skipping optimizer steps the old one's calibrated scale would have trained. A
    warning; an error when no new scaler ever finished calibrating (each was replaced,
    or the run ended, while it still skipped every step: nothing trained after the
    first replacement)."""
    sc = session.scaler
    if sc is None or not recal:
        return
    starts = restarts(sc)
    resets = [r for r in sc.resets if r.step in starts]
    evs = [e for g in recal for e in g]
    steps = [e.step for e in evs]
    skipped = sum(_skipped_in(session, steps).values()) or len(steps)
    ends = [*starts[1:], session.steps]
    # A new scaler that backed off in every step it had: one run of backoffs from its
    # start to the next one's start (or the run's end). A later halving after steps that
    # trained (a calibrated scale just too high for one batch) is no unfinished start-up.
    unfinished = [st for st, end in zip(starts, ends, strict=True)
                  if any(g[0].step == st and g[-1].step == end - 1 for g in recal)]
    n = len(resets)
    one = n == 1
    at = (f"at step {resets[0].step}" if one else
          f"{n} times (at steps {F.steps_list([r.step for r in resets])})")
    began = ", ".join(dict.fromkeys(_scale(r.scale_after) for r in resets))
    had = ", ".join(dict.fromkeys(_scale(r.scale_before) for r in resets))
    message = (
        f"A new GradScaler replaced the previous one {at}, and the old one was not used "
        f"again: {'it' if one else 'each'} started over from the scale it was built with "
        f"({began}), throwing away the scale the old one had calibrated ({had}), and backed "
        f"off {_backoffs(evs)} to calibrate again, so {skipped} optimizer steps were "
        f"skipped (steps {F.steps_list(steps)})"
        + ("" if one else f", about {skipped / n:.0f} per new scaler")
        + ". These backoffs are each new scaler's start-up, not the loss scale collapsing: "
        "a GradScaler built inside the epoch loop (in `train_one_epoch()`) does this "
        "every epoch"
        + (f". The new scaler{'' if len(unfinished) == 1 else 's'} at step"
           f"{'' if len(unfinished) == 1 else 's'} {F.steps_list(unfinished)} never "
           "finished calibrating before the next one replaced it or the run ended: none of "
           "its optimizer steps trained" if unfinished else "")
        + ".")
    yield Finding(
        kind="scaler_recreated",
        severity="error" if len(unfinished) == n else "warning",
        module=None, op=None, step=resets[0].step, message=message,
        advice=ADVICE["scaler_recreated"], steps=steps[:MAX_STEPS_KEPT],
        data={"resets": [r.step for r in resets][:MAX_STEPS_KEPT],
              "recalibration_steps": steps[:MAX_STEPS_KEPT], "skipped": skipped,
              "backoffs": sum(e.count for e in evs),
              # nan (a scale on the device, unknown) is no JSON number: None.
              "scale_before": [_known(r.scale_before) for r in resets][:MAX_STEPS_KEPT],
              "scale_after": [_known(r.scale_after) for r in resets][:MAX_STEPS_KEPT],
              "unfinished": unfinished[:MAX_STEPS_KEPT]},
    )


def _known(x: float) -> float | None:
    return None if math.isnan(x) else x


def _least_grad_headroom(session: Session, scale: float | None) -> tuple[str, float] | None:
    """The layer whose scaled gradients come closest to the format's max, in bits.

    Output gradients are recorded as they ran (scaled). Parameter gradients are
    recorded unscaled; under autocast the weight gradient is computed in the
    low-precision format before it reaches the float32 ``.grad``, so it is
    judged at the current scale.
    """
    fmax = FORMAT_MAX.get(low_format(session), 65504.0)
    best: tuple[str, float] | None = None
    for lay in session.layers:
        cands = []
        if lay.grad_headroom is not None and math.isfinite(lay.grad_headroom):
            cands.append(lay.grad_headroom)
        pg = lay.param_grad_absmax
        if (lay.ran_low_precision and pg and math.isfinite(pg) and scale
                and math.isfinite(scale) and scale > 0):
            cands.append(math.log2(fmax / (pg * scale)))
        for h in cands:
            if best is None or h < best[1]:
                best = (lay.name, h)
    return best
