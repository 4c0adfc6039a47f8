"""Session -> findings: run the detectors, fold follow-on effects, order the result.

The stage is split by concern; a newcomer reads it in this order:

* :mod:`~amp_doctor.analysis.detect_layers`: layer figures and the run's outcome;
* :mod:`~amp_doctor.analysis.detect_scaler`: the GradScaler's timeline;
* :mod:`~amp_doctor.analysis.detect_events`: run-time events (misuse, NaN loss, anomaly mode's
  ops), worded by :mod:`~amp_doctor.analysis.messages`;
* :mod:`~amp_doctor.analysis.whatif`: what another format would do;
* :mod:`~amp_doctor.analysis.corrupted`: a non-finite step whose update corrupted the
  weights (no GradScaler), named from that step's layers;
* :mod:`~amp_doctor.analysis.folding`: one error per root cause;
* :mod:`~amp_doctor.analysis.divergence`: a run that diverged before it overflowed;
* :mod:`~amp_doctor.analysis.advice`: the fix for each kind;
* :mod:`~amp_doctor.analysis.thresholds`: the named thresholds;
* :mod:`~amp_doctor.analysis.risk`: "worst first" for the layers.

Analysis reads only the session's records, so a saved JSON file analyses the
same way again. The names other modules import from here stay importable here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from amp_doctor.analysis.advice import ADVICE, ADVICE_BF16, bf16_advice, event_advice
from amp_doctor.analysis.corrupted import fold_corrupted_weights
from amp_doctor.analysis.detect_events import event_findings
from amp_doctor.analysis.detect_layers import (
    autocast_findings,
    layer_findings,
    low_format,
    neg_inf_alone,
    neg_inf_mask,
    run_findings,
)
from amp_doctor.analysis.detect_scaler import scaler_findings
from amp_doctor.analysis.divergence import note_divergence
from amp_doctor.analysis.folding import cap_per_kind, fold_early_end, fold_follow_ons
from amp_doctor.analysis.risk import risk_order
from amp_doctor.analysis.thresholds import (
    ACT_UNDERFLOW_WARN,
    BACKOFF_RUN_COLLAPSE,
    BACKOFF_SHARE_COLLAPSE,
    CALIBRATION_START,
    CALIBRATION_STEPS,
    GRAD_FLUSHED_WARN,
    GRAD_UNDERFLOW_WARN,
    HEADROOM_WARN_BITS,
    LOWP_UNCHANGED_WARN,
    OVERFLOW_FRAC_ERROR,
    RISK_HEADROOM_BITS,
    SCALE_COLLAPSE_MIN,
    SCALED_GRAD_OVERFLOW_INFO_STEPS,
    STUCK_INTERVALS,
)
from amp_doctor.analysis.zeroed import fold_zeroed, zeroed_findings
from amp_doctor.records import (
    SEVERITY_RANK,
    Event,
    Finding,
    ScalerEvent,
    ScalerTimeline,
    Session,
)

__all__ = [
    "analyze",
    "DETECTORS",
    "event_advice",
    "risk_order",
    "RISK_HEADROOM_BITS",
    "LOWP_UNCHANGED_WARN",
    "ADVICE",
    "ADVICE_BF16",
    "OVERFLOW_FRAC_ERROR",
    "HEADROOM_WARN_BITS",
    "ACT_UNDERFLOW_WARN",
    "GRAD_UNDERFLOW_WARN",
    "GRAD_FLUSHED_WARN",
    "SCALE_COLLAPSE_MIN",
    "BACKOFF_SHARE_COLLAPSE",
    "BACKOFF_RUN_COLLAPSE",
    "CALIBRATION_START",
    "CALIBRATION_STEPS",
    "STUCK_INTERVALS",
    "SCALED_GRAD_OVERFLOW_INFO_STEPS",
]

# Kept for callers of the old private name; new code uses amp_doctor.format.num.

# Findings about the loss scale: at the same severity and step, their causes come first.
_SCALE_KINDS = ("scale_collapse", "scaler_backoff", "scale_stuck")


def _whatif_findings(session: Session) -> Iterable[Finding]:
    # whatif imports tabulate for its table: loaded only when a session is analysed.
    from amp_doctor.analysis.whatif import whatif_findings

    return whatif_findings(session, session.run.target_dtype)


DETECTORS: list[Callable[[Session], Iterable[Finding]]] = [
    run_findings,
    autocast_findings,
    layer_findings,
    zeroed_findings,
    scaler_findings,
    event_findings,
    _whatif_findings,
]


def _masks_are_no_origin(session: Session) -> Session:
    """The session with no GradScaler backoff, and no NaN/inf loss
    (:func:`_loss_not_from_a_mask`), traced to a layer whose only non-finite output is a
    -inf mask (``neg_inf_mask``): a step's first layer to go non-finite in the forward
    pass is read while recording, before a mask can be told from an overflow; the
    backoff is then the gradients' to explain (its culprits)."""
    session = _origins_that_reached_the_gradients(_loss_not_from_a_mask(session))
    fmt = low_format(session)
    masks = {lay.name for lay in session.layers
             if lay.recorded_steps and neg_inf_mask(lay, fmt, session) is not None}
    if not masks:
        return session

    def clear(sc: ScalerTimeline) -> ScalerTimeline:
        return replace(sc, events=[replace(e, forward_origin=None)
                                   if e.forward_origin in masks else e for e in sc.events])

    return replace(session, scaler=clear(session.scaler) if session.scaler else None,
                   other_scalers=[clear(sc) for sc in session.other_scalers])


def _origins_that_reached_the_gradients(session: Session) -> Session:
    """The session with no backoff traced to a layer whose non-finite output reached
    neither the loss nor the gradients: in that step the loss was finite and the layers
    with non-finite gradients were others (``tanh(inf)`` is 1, its gradient 0). The inf
    is the layer's overflow finding; the backoff is its gradients' business (review 47a:
    a shared layer's second call overflowed into a tanh, and the scaler's calibration
    backoffs were called its consequences)."""
    lays = {lay.name: lay for lay in session.layers}
    recs = {r.step: r for r in session.history}

    def made_by_its_backward(e: ScalerEvent, o: str) -> bool:
        # A culprit that fed it, whose output gradient went non-finite in that step: the
        # origin's own backward made it (exp's 0 * inf where a torch.where dropped the inf,
        # review 47c). A step the history left out is taken as reached.
        rec = recs.get(e.step)
        if rec is None:
            return True
        for c in e.culprits:
            ls = rec.layers.get(c)
            if (c in lays and o in lays[c].consumers and ls is not None
                    and ls.grad is not None and ls.grad.nonfinite_frac > 0):
                return True
        return False

    def reached(e: ScalerEvent) -> bool:
        o = e.forward_origin
        return (o is None or e.loss_nonfinite is not False or not e.culprits or any(
            c == o or c.startswith(o + ".") or o.startswith(c + ".") for c in e.culprits)
            or made_by_its_backward(e, o))

    def clear(sc: ScalerTimeline) -> ScalerTimeline:
        return replace(sc, events=[e if reached(e) else replace(e, forward_origin=None)
                                   for e in sc.events])

    if all(reached(e) for sc in [session.scaler, *session.other_scalers] if sc is not None
           for e in sc.events):
        return session
    return replace(session, scaler=clear(session.scaler) if session.scaler else None,
                   other_scalers=[clear(sc) for sc in session.other_scalers])


def _loss_not_from_a_mask(session: Session) -> Session:
    """The session with its NaN/inf loss traced past a -inf mask, the first layer to
    hold a non-finite value but not where the loss went non-finite: a layer whose output
    held -inf alone in a step whose loss was finite (an attention or action mask; then
    the first layer after it that overflowed is the origin, or none: it began outside
    them), or one followed in the loss's step by a layer that overflowed (+inf: no mask
    makes that; a model overflowing from its first step gives no finite loss to see the
    mask beside)."""
    def past(e: Event) -> Event:
        if e.kind != "nonfinite_loss" or e.module is None:
            return e
        to = e.data.get("origin_past_masks")
        if e.module in (e.data.get("masks_beside_finite_loss") or []) or (
                to is not None and to != e.module and any(
                    lay.name == e.module and neg_inf_alone(lay) for lay in session.layers)):
            return replace(e, module=to, data={**e.data, "origin": to,
                                               "mask_before": e.module})
        return e

    events = [past(e) for e in session.events]
    if all(a is b for a, b in zip(events, session.events, strict=True)):
        return session
    return replace(session, events=events)


def analyze(session: Session) -> list[Finding]:
    """Every finding of the session: most severe first, causes before consequences."""
    session = _masks_are_no_origin(session)
    out: list[Finding] = []
    for detect in DETECTORS:
        out.extend(detect(session))
    out = fold_zeroed(session, out)
    out = fold_corrupted_weights(session, out)
    out = fold_follow_ons(session, out)
    out = note_divergence(session, out)
    out = fold_early_end(out)
    if session.amp.dtype == "bfloat16":
        # A float16 layer's finding in a run that also trains in bfloat16 keeps its
        # advice (see dtypes.judged_format).
        out = [bf16_advice(f) if f.data.get("dtype") != "float16" else f for f in out]
    out = cap_per_kind(out)
    out.sort(key=lambda f: (SEVERITY_RANK[f.severity], f.step if f.step is not None else 0,
                            f.kind in _SCALE_KINDS))
    return out
