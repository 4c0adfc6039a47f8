"""Run-time events -> findings: misuse the patches saw, NaN losses, anomaly mode's ops.

Events of one kind at one place (module, op) become one finding that counts them.
Each kind has a default severity here; its message comes from
:mod:`amp_doctor.analysis.messages` and its fix from :mod:`amp_doctor.analysis.advice`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from amp_doctor import format as F
from amp_doctor.analysis.advice import ADVICE, event_advice, unlocated_advice
from amp_doctor.analysis.detect_layers import (
    code_before,
    input_cast,
    largest_finite,
    loss_reaching_mask,
    low_format,
    predicts,
)
from amp_doctor.analysis.detect_scaler import (
    loss_bad_steps,
    loss_steps_not_skipped,
    normal_backoff_steps,
    scaled_grad_arrival,
    scaled_grad_text,
)
from amp_doctor.analysis.messages import CAST_OPS, event_message, zero_denominator
from amp_doctor.analysis.thresholds import (
    CALIBRATION_START,
    LOWP_UNCHANGED_WARN,
    MADE_INF_HEADROOM_BITS,
    SCALED_GRAD_OVERFLOW_INFO_STEPS,
    WARMUP_EATEN_OF_PEAK,
    WARMUP_EATEN_RATIO,
)
from amp_doctor.dtypes import FORMAT_MAX, judged_format
from amp_doctor.records import Event, Finding, Session, Severity

__all__ = ["EVENT_SEVERITY", "event_findings"]

EVENT_SEVERITY: dict[str, Severity] = {
    "clip_before_unscale": "error",
    "missing_update": "error",
    "update_without_step": "error",
    "scaler_with_bf16": "info",
    "fp16_params": "error",
    "scheduler_on_skipped_step": "info",
    "loss_not_scaled": "error",
    "backward_in_autocast": "warning",
    "nonfinite_forward": "error",
    "nonfinite_discarded": "info",
    "nonfinite_backward": "error",
    "nonfinite_grads_applied": "error",
    "nonfinite_input": "error",
    "nonfinite_output_dropped": "warning",
    "activation_overflow": "warning",
    "scaled_grads_stepped": "error",
    "step_after_unscale": "error",
    "stepped_twice": "error",
    "update_between_steps": "warning",
    "nonfinite_loss": "error",
    "no_step_boundary": "warning",
    "model_not_run": "warning",
    "model_stopped": "warning",
    # Training forwards in eval mode: a model.train() forgotten after validation.
    "trains_in_eval_mode": "warning",
    "steps_from_backward": "info",
    "lowp_updates_lost": "error",
    "lowp_update_nonfinite": "error",
    # Not recorded, and why: a compiled model's inner layers, tensors that cannot be summarised.
    "compiled_model": "info",
    # The script replaced a watched model's object (a reload, a copy): one model all the same.
    "model_replaced": "info",
    "unsummarized": "info",
    "scripted_module": "info",
    "nonfinite_unlocated": "warning",
    # A thread that trained a watched model died of an uncaught exception.
    "thread_died": "warning",
}
# An optimizer stepped outside the scaler's recipe: its message names every optimizer.
_OPTIMIZER_MISUSE = ("scaled_grads_stepped", "step_after_unscale", "stepped_twice",
                     "update_between_steps")
# Findings keep at most this many of their steps.
MAX_STEPS_KEPT = 50


def _scaled_overflows(session: Session, es: list[Event]) -> bool:
    """Backward events that are scaled gradients overflowing (no NaN, no division by 0),
    in a run with a GradScaler."""
    return session.amp.scaler and not any(
        e.data.get("nan") or zero_denominator(e.op, e.data) for e in es)


def _severity(session: Session, kind: str, es: list[Event], n: int) -> Severity:
    first = es[0]
    sev: Severity = first.data.get("severity") or EVENT_SEVERITY[kind]
    skipped = set(session.scaler.skipped_steps) if session.scaler else set()
    if kind == "activation_overflow" and first.data.get("hidden"):
        # The hidden overflow did harm (skipped steps, NaN in backward): it is the cause.
        # Not by a GradScaler calibrating alone (a short run of backoffs from step 0, and
        # the ones its timeline calls normal), whose scaled gradients overflowed
        # in another op's backward from finite inputs: that says nothing of this op's
        # values (a DLRM interaction's +inf diagonal that indexing drops; review 48b).
        normal = normal_backoff_steps(session) | _start_up_skips(skipped)
        backward = [x for x in session.events if x.kind == "nonfinite_backward"]
        calibrating = {x.step for x in backward if x.step in normal
                       and _scaled_overflows(session, [x])
                       and not (x.module == first.module
                                and x.data.get("forward_op") == first.op)}
        if ((skipped - calibrating).intersection(e.step for e in es)
                or any(x.step not in calibrating for x in backward)):
            sev = "error"
    if kind == "scheduler_on_skipped_step" and first.data.get("lr_max") is not None:
        sev = "warning"  # the warmup ran while nothing trained (event_findings judged it)
    if kind == "nonfinite_unlocated" and first.data.get("scaler_skipped_only"):
        sev = "info"  # only steps the GradScaler skipped: the backoff findings cover them
    if kind == "nonfinite_backward" and _scaled_overflows(session, es):
        # Scaled gradients overflowing is what GradScaler detects and skips: at its
        # calibration and growth probes always (raise mode checks every step, so it sees
        # all of them), and at a few other steps.
        normal = normal_backoff_steps(session)
        beyond = sum(e.step not in normal for e in es)
        sev = "info" if beyond <= SCALED_GRAD_OVERFLOW_INFO_STEPS else "warning"
    return sev


def _start_up_skips(skipped: set[int]) -> set[int]:
    """The run's first skipped steps, from step 0 on, when at most
    :data:`CALIBRATION_START` in a row: a GradScaler settling from its initial scale. A
    longer run is no start-up (a cast overflow inside a GRU skipped every step)."""
    run: set[int] = set()
    while len(run) in skipped:
        run.add(len(run))
    return run if len(run) <= CALIBRATION_START else set()


def _start_lrs(es: list[Event]) -> list[float]:
    """The LRs of the skipped steps a scheduler stepped on in the run's first stretch of
    consecutive skipped steps, from its start (the scaler calibrating a high init_scale):
    later skips are growth probes at the schedule's cruising LR (review 46c)."""
    lrs: list[float] = []
    expected = 0
    for e in sorted(es, key=lambda e: e.step):
        lr = e.data.get("lr")
        if e.step > expected or not isinstance(lr, (int, float)):
            break
        lrs.append(float(lr))
        expected = e.step + 1
    return lrs


def _lr_rise(es: list[Event]) -> float:
    """How far the LR rose over the skipped steps at the run's start: the highest LR they
    would have used over the first one's (inf from an LR of 0, as a Hugging Face warmup
    starts; 1 when not known)."""
    lrs = _start_lrs(es)
    if len(lrs) < 2 or max(lrs) <= 0:
        return 1.0
    later = [float(e.data["lr"]) for e in es if isinstance(e.data.get("lr"), (int, float))]
    if max(lrs) < WARMUP_EATEN_OF_PEAK * max(later):
        return 1.0  # a small part of a long warmup
    return max(lrs) / lrs[0] if lrs[0] > 0 else math.inf


def _advice(session: Session, first: Event) -> str:
    if first.kind == "nonfinite_unlocated":
        return unlocated_advice(session.run.every, session.run.command is not None,
                                bool(first.data.get("raise_mode")), session.amp.scaler)
    return event_advice(first, session.amp.dtype)


def event_findings(session: Session) -> Iterable[Finding]:
    grouped: dict[tuple[str, str | None, str | None], list[Event]] = {}
    for e in session.events:
        if e.kind not in EVENT_SEVERITY:
            continue
        grouped.setdefault((e.kind, e.module, e.op), []).append(e)
    # An update with no scaler.step before it raised before any scaler step was seen: the
    # steps were not counted "from the loop" for want of a GradScaler; there was one.
    misused_scaler = any(k == "update_without_step" for k, _, _ in grouped)
    for (kind, module, op), es in grouped.items():
        first = es[0]
        if kind == "steps_from_backward" and misused_scaler:
            continue
        if kind == "lowp_updates_lost" and not (first.data.get("frac") or 0) > \
                LOWP_UNCHANGED_WARN:
            continue
        n = max(len(es), int(first.data.get("occurrences") or 0))
        steps = [e.step for e in es]
        if kind == "scheduler_on_skipped_step" and _lr_rise(es) >= WARMUP_EATEN_RATIO:
            lrs = _start_lrs(es)
            first = dataclasses.replace(first, data={
                **first.data, "lr_first": lrs[0], "lr_max": max(lrs)})
        if kind in _OPTIMIZER_MISUSE:
            # Each optimizer stepped so is named, not only the first one's.
            opts = list(dict.fromkeys(str(e.data.get("optimizer")) for e in es))
            first = dataclasses.replace(first, data={**first.data, "optimizers": opts})
        if kind == "nonfinite_loss" and module is not None and (
                _overflowed_itself(session, module) or _inputs_watched(session, module)):
            # The message need not say that its input may have been bad already: it
            # overflowed itself, or its inputs were watched layers' outputs, finite then
            # (review 56c: "Its input is not checked" of a gate fed by a watched Linear).
            first = dataclasses.replace(first, data={
                **first.data, "made_here": True,
                "inputs_watched": not _overflowed_itself(session, module)})
        if kind == "nonfinite_grads_applied" and _forward_in_torch_func(session):
            # Review 60b: "the forward pass and the loss were finite" of a loop whose
            # gradients came from vmap(grad(...)), a forward amp-doctor cannot read.
            first = dataclasses.replace(first, data={**first.data, "forward_unseen": True})
        if kind == "nonfinite_loss" and module is not None and module in session.run.models:
            first = dataclasses.replace(first, data={**first.data, "root": True})
        elif kind == "nonfinite_loss" and module is not None:
            first = dataclasses.replace(first, data={
                **first.data, "code_before": code_before(session, module)})
        if kind == "nonfinite_unlocated" and first.data.get("scaler_skipped_only"):
            lost = sorted(set(loss_bad_steps(session)).intersection(
                first.data.get("steps") or []))
            if lost:
                # Not scaled gradients overflowing: the loss itself was NaN/inf there. From
                # its first such step: the steps before it were the scaler's own skips (a
                # calibration's), whose loss was finite (review 51: "loss already NaN/inf,
                # first at step 1", a calibration skip, for a NaN loss at step 19).
                first = dataclasses.replace(first, step=lost[0], data={
                    **first.data, "loss_nonfinite": True, "loss_steps": lost})
        if kind == "nonfinite_loss" and module is not None and loss_reaching_mask(
                session, module) is not None:
            first = dataclasses.replace(first, data={
                **first.data, "neg_inf_only": low_format(session),
                "advice": ADVICE["nonfinite_loss_neg_inf"]})
        if (kind == "nonfinite_backward" and _scaled_overflows(session, es)
                and set(steps) <= set(normal_backoff_steps(session))):
            # Only at the GradScaler's calibration and growth probes: what it detects and
            # skips by design (its backoff finding says "nothing to fix" too).
            first = dataclasses.replace(first, data={
                **first.data, "advice": ADVICE["scaled_backward_probe"]})
        if kind == "nonfinite_backward" and _casts_the_scale(session, first):
            # The loss's gradient, 1 times the scale, cast to float16 (2^16 > 65504): the
            # GradScaler's own start, whatever else went wrong in the run (review 61a: "keep
            # the loss O(1)" here, "nothing to fix" in the healthy run, same op and line).
            first = dataclasses.replace(first, data={
                **first.data, "advice": ADVICE["scaled_backward_probe"]})
        arrival = scaled_grad_arrival(session, first) if kind == "nonfinite_backward" else None
        arrived = ""
        if arrival is not None and module is not None:
            # The gradient it was given was near the max already: the loss times the scale
            # made the overflow, not this op, whose advice (float32 for it, a clamp) would
            # send the user to the wrong place (review 57g: a summed loss, lm_head's mm).
            arrived = " But " + scaled_grad_text(arrival, module) + "."
            first = dataclasses.replace(first, data={
                **first.data, "grad_arrived_absmax": arrival.absmax,
                "loss_scale": arrival.scale, "loss": arrival.loss, "loss_too_large": True,
                "advice": first.data.get("advice") or ADVICE["scaled_grad_near_max"]})
        batch = _batch_of_the_cast(session, first) if kind == "nonfinite_forward" else None
        if batch is not None:
            # Autocast's cast of the batch for its first layer: the data's values, as the
            # default mode says (`input_beyond_format`), with the cast's line; not an op to
            # run in float32 (review 56b: `--fp32 frontend.0` moved the inf one layer on).
            yield _batch_cast_finding(session, batch, first, es, n, steps)
            continue
        if (kind == "nonfinite_forward" and module is not None and op in PRODUCT_OPS
                and first.data.get("pos_inf") and not first.data.get("nan")
                and _returns_model_output(session, module)):
            # A product in the layer that returns the model's output went past float16's
            # max: the prediction is that large, as the default mode's finding of the same
            # layer says, not an attention score to scale down (review 52a: a regression
            # head on raw prices, whose --anomaly advice was `q * d**-0.5`).
            first = dataclasses.replace(first, data={
                **first.data, "advice": ADVICE["activation_overflow_output"]})
        if kind == "nonfinite_loss" and first.data.get("began_unrecorded"):
            # Where it began was not recorded: how to see it, not a fix for where it showed.
            first = dataclasses.replace(first, data={**first.data, "advice": unlocated_advice(
                session.run.every, session.run.command is not None,
                bool(first.data.get("raise_mode")), session.amp.scaler)})
        if kind == "nonfinite_loss":
            unskipped = len(loss_steps_not_skipped(session))
            d = first.data
            if unskipped and d.get("every_step") and session.scaler is not None:
                # Every step's loss was counted: the bad ones the scaler did not skip.
                unskipped = max(unskipped, int(d.get("steps_bad") or 0)
                                - int(d.get("bad_skipped") or 0))
            if unskipped:
                seen = _bad_loss_values(session, d.get("bad_steps") or [])
                first = dataclasses.replace(first, data={
                    **first.data, "unskipped": unskipped, "loss_values": seen,
                    "advice": ADVICE["nonfinite_loss_finite_grads" if seen == "inf" else
                                     "nonfinite_loss_finite_grads_nan" if seen == "nan" else
                                     "nonfinite_loss_finite_grads_either"]})
        yield Finding(
            kind=kind, severity=_severity(session, kind, [first, *es[1:]], n), module=module,
            op=op,
            step=first.step,
            message=event_message(first, n, steps) + arrived,
            advice=first.data.get("advice") or _advice(session, first),
            frame=first.frame, count=n, steps=steps[:MAX_STEPS_KEPT],
            data={k: v for k, v in first.data.items() if k not in ("message", "advice")},
        )


# A cast's input may differ from the batch's recorded absmax by its rounding: a float32
# batch's values read as the cast's input, against their max over several steps.
_SAME_ABSMAX = 1.001


def _batch_of_the_cast(session: Session, e: Event) -> Event | None:
    """The ``input_beyond_format`` note of the batch that anomaly mode's cast op ``e``
    converted to inf: the cast ran in the layer that took the batch first (or in a step
    whose batch was beyond the format) and no input of it was larger than the batch."""
    if e.op not in CAST_OPS or e.data.get("nan") or e.data.get("casts_parameter"):
        return None
    top = e.data.get("input_absmax")
    if not isinstance(top, (int, float)) or not math.isfinite(top):
        return None
    for x in session.events:
        if x.kind != "input_beyond_format":
            continue
        big = x.data.get("absmax")
        at = x.data.get("first_bad_layer") == e.module or e.step in (x.data.get("steps") or ())
        if at and isinstance(big, (int, float)) and top <= big * _SAME_ABSMAX:
            return x
    return None


def _batch_cast_finding(session: Session, batch: Event, cast: Event, es: list[Event],
                        n: int, steps: list[int]) -> Finding:
    dtype = str(cast.data.get("dtype"))
    limit = FORMAT_MAX.get(dtype, math.inf)
    top = max(float(e.data.get("input_absmax") or 0.0) for e in es)
    root = F.layer(batch.module) if batch.module else "the model"
    return Finding(
        kind="input_beyond_format", severity="error", module=cast.module, op=cast.op,
        step=cast.step,
        message=(f"The batch given to {root} held values up to {F.num(top)}, beyond "
                 f"{dtype}'s max {limit:g}: autocast's cast of it for "
                 f"{F.layer(cast.module) if cast.module else 'the first layer'} "
                 f"({cast.op}) made +inf, in {n} step(s) the op-level search looked at, "
                 f"first at step {cast.step}. Every op after it only passed it on."),
        advice=ADVICE["input_beyond_format"], frame=cast.frame, count=n,
        steps=steps[:MAX_STEPS_KEPT],
        data={**{k: v for k, v in cast.data.items() if k not in ("message", "advice")},
              "input_absmax": top, "batch_cast": True, "first_bad_layer": cast.module,
              "occurrences": n},
    )


def _bad_loss_values(session: Session, steps: list[int]) -> str | None:
    """What the recorded losses of ``steps`` were: "nan", "inf", or None (both, or none
    recorded)."""
    want = set(steps)
    vals = [r.loss for r in session.history if r.step in want and r.loss is not None
            and not math.isfinite(r.loss)]
    nan = any(math.isnan(v) for v in vals)
    inf = any(math.isinf(v) for v in vals)
    return "nan" if nan and not inf else "inf" if inf and not nan else None


# Ops of a Linear, a matmul: what a layer that returns the model's output computes it with.
PRODUCT_OPS = frozenset({"aten.mm", "aten.addmm", "aten.matmul", "aten.linear", "aten.bmm"})


def _casts_the_scale(session: Session, e: Event) -> bool:
    """A backward cast whose every input value was the step's loss scale itself: the
    loss's gradient (1) times the scale, cast to a format the scale is beyond."""
    sc = session.scaler
    lo, hi = e.data.get("input_min"), e.data.get("input_max")
    if e.op not in CAST_OPS or sc is None or lo != hi or not isinstance(hi, (int, float)):
        return False
    return any(x.step == e.step and x.scale_before == hi for x in sc.events)


def _forward_in_torch_func(session: Session) -> bool:
    """Some watched layer ran under a torch.func transform (vmap, grad): its tensors are
    wrapped, not summarised, and a forward pass there was not seen."""
    return any(e.kind == "unsummarized" and e.data.get("tensor") == "functorch"
               for e in session.events)


def _returns_model_output(session: Session, module: str) -> bool:
    lay = next((x for x in session.layers if x.name == module), None)
    return lay is not None and predicts(session, lay) and not lay.passthrough


def _inputs_watched(session: Session, module: str) -> bool:
    """Every floating input the layer took was a watched layer's output: the first layer
    to go non-finite made it in its own forward code."""
    lay = next((x for x in session.layers if x.name == module), None)
    return lay is not None and lay.inputs_known


def _overflowed_itself(session: Session, module: str) -> bool:
    """Whether the layer's own finite outputs came near its format's max, or its input
    held finite values beyond it (autocast's cast made the inf): it overflowed by
    itself, not only passed on a non-finite input."""
    lay = next((x for x in session.layers if x.name == module), None)
    if lay is None or not lay.ran_low_precision:
        return False
    if input_cast(session, lay) is not None:
        return True
    if lay.overflow_frac <= 0:
        # NaN only, never an inf or a value past the max: an overflow of its own makes
        # inf; a NaN came in, or an op made it (a softmax of an inf it was given).
        return False
    big = largest_finite(lay)
    fmax = FORMAT_MAX.get(judged_format(lay.output_dtypes, low_format(session)))
    return big is not None and fmax is not None and big * 2.0 ** MADE_INF_HEADROOM_BITS > fmax
