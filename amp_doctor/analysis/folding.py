"""One error per independent root cause: follow-on effects go into the origin's finding.

The detectors judge each symptom on its own; this module connects them. A layer
that only carried an earlier layer's inf/NaN on, the GradScaler's backoffs and
collapse, a NaN loss, gradients that underflow because the scale collapsed, and a
run that stopped because of an error become part of (or info beside) the finding
of their origin, instead of errors and warnings with advice of their own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

from amp_doctor import format as F
from amp_doctor.analysis.advice import ADVICE
from amp_doctor.analysis.dataflow import layers_before
from amp_doctor.analysis.detect_layers import frozen_output
from amp_doctor.analysis.detect_scaler import normal_backoff_steps
from amp_doctor.analysis.messages import (
    CAST_OPS,
    batch_poisoned_weights,
    dropped_cause,
    inputs_held_inf,
    loss_origin_named,
)
from amp_doctor.analysis.thresholds import MAX_PER_KIND, SHRUNK_GRAD_BITS
from amp_doctor.records import SEVERITY_RANK, Finding, Session, Severity

__all__ = ["fold_follow_ons", "steps_of", "fold_early_end", "cap_per_kind", "EARLY_END_KINDS",
           "ROOT_KINDS"]


def _scale(x: object) -> str:
    return F.scale(x if isinstance(x, (int, float)) else None, unknown="?")


# Findings that only say the run stopped short: when an error names why it stopped
# (fp16_params: scaler.step raised), they are that error's consequence, not a cause.
EARLY_END_KINDS = ("run_ended_early", "no_step_boundary")


def fold_early_end(out: list[Finding]) -> list[Finding]:
    if any(f.kind in ("run_ended_early", "constant_overflow", "clip_error_if_nonfinite")
           for f in out):
        # No step ended because the run did, not because the loop lacks a boundary: no
        # advice to call doctor.step() (one that steps another model's optimizer stays).
        # Nor is "no layer ran in low precision" a finding of a forward that died in its
        # first low-precision op (an LSTM without a float16 kernel on the CPU).
        out = [f for f in out if (f.kind != "no_step_boundary"
                                  or f.data.get("foreign_optimizers"))
               and f.kind != "autocast_inactive"]
    causes = [f for f in out if f.severity == "error" and f.kind not in EARLY_END_KINDS]
    if not causes:
        return out
    return [dataclasses.replace(f, severity="info", data={**f.data,
                                                          "follow_on_of": causes[0].kind})
            if f.kind in EARLY_END_KINDS else f for f in out]


def _with(f: Finding, severity: Severity | None = None, extra: str = "",
          **data: object) -> Finding:
    msg = f.message + (" " + extra if extra else "")
    return replace(f, severity=severity or f.severity, message=msg, data={**f.data, **data})


ROOT_KINDS = ("activation_overflow", "nonfinite_input", "nonfinite_forward",
               "nonfinite_backward", "input_beyond_format")
# Root causes that make a forward pass non-finite from a finite batch.
FORWARD_MADE_KINDS = ("activation_overflow", "nonfinite_forward", "input_beyond_format")


def fold_follow_ons(session: Session, out: list[Finding]) -> list[Finding]:
    """One error per independent root cause; its consequences go into its finding.

    * a layer whose output only carried an earlier layer's inf/NaN on (never the
      first non-finite layer in any recorded step) is listed in that origin's finding;
    * GradScaler backoffs, a collapsed scale and NaN losses that began at an origin
      become info, and the origin's finding says what they cost;
    * gradients underflowing because the scale collapsed, or because the gradients
      were clipped while still scaled, are listed in that finding, not advised on;
    * backoffs and a collapse that began where a NaN loss with no origin finding of
      its own began are that loss's consequences;
    * a backward op that went non-finite in a step whose forward pass had already
      made inf/NaN (anomaly mode's first forward op, or the batch) is that origin's
      consequence: the backward of a non-finite value is non-finite.
    """
    out = _one_error_per_op(out)
    out = _discarded_backward_of_an_origin(out)
    out = _gradients_a_small_gain_shrank(session, out)
    out = _batch_made_by_an_op(out)
    out = _after_a_bad_update(out)
    out = _batch_before_poisoned_weights(session, out)
    out = _backward_op_of_the_collapse(session, out)
    lay_by = {lay.name: lay for lay in session.layers}
    origin_layers = sorted((lay for lay in session.layers if lay.overflow_origin_steps > 0),
                           key=lambda x: x.order)
    backward_of = _backward_follow_ons(out)
    errors = [f for f in out if f.severity == "error" and f.kind in ROOT_KINDS
              and id(f) not in backward_of]

    # Layers whose non-finite output anomaly mode saw come from an op that ran before
    # them (an op in their parent's own code: ``self.proj(h * scale)``), in the step it
    # searched: the op's finding holds them, however their statistics rank them.
    carried_from: dict[str, Finding] = {}
    for e in sorted(errors, key=_first_step):
        if e.kind == "nonfinite_forward" and e.op:
            for name in e.data.get("carriers") or ():
                carried_from.setdefault(name, e)  # the earliest op that reached it

    def root_for_module(module: str | None) -> Finding | None:
        if module is None:
            return None
        if module in carried_from:
            return carried_from[module]
        # Of a module's errors (two ops of a VAE's own code), the earliest: the loss that
        # was NaN from step 0 began at the step-0 op, not at one found at step 17.
        own = [f for f in errors if f.module == module]
        if own:
            return min(own, key=_first_step)
        # An op anomaly mode found in a module's own code (attention's q @ k^T) shows
        # first in the output of a child called after it (attention's output projection):
        # the loss and the scaler name that child, the op names its parent.
        ancestors = [f for f in errors if f.op is not None and f.module
                     and module.startswith(f.module + ".")]
        return max(ancestors, key=lambda f: len(f.module or "")) if ancestors else None

    carried: dict[int, list[str]] = {}
    consequences: dict[int, list[Finding]] = {}
    kept: list[Finding] = []
    for f in out:
        lay = lay_by.get(f.module or "")
        # A headroom warning on a layer that carried the NaN on is one too: its absmax
        # was read off the histogram of a NaN-laden output (the top bin's upper edge).
        if (f.kind == "activation_overflow" and f.op is None and lay is not None
                and (lay.overflow_origin_steps == 0 or lay.name in carried_from) and (
                    f.severity == "error"
                    or (f.severity == "warning" and lay.nonfinite_steps > 0))):
            before = [o for o in origin_layers if o.order < lay.order]
            if not before and lay.calls > lay.recorded_steps:
                # Called again later in its step (a projection shared across depth): its
                # first call came before the origin, its later one carried the inf on
                # (review 46a). The origin it ran after is one placed after its first.
                before = [o for o in origin_layers if o.order > lay.order][:1]
            root = carried_from.get(lay.name) or (
                root_for_module(before[-1].name) if before else None)
            if root is None:
                root = next((e for e in errors if e.kind in ("nonfinite_input",
                                                             "nonfinite_forward")), None)
            if root is not None and root is not f:
                carried.setdefault(id(root), []).append(lay.name)
                continue
        kept.append(f)
    out = kept
    # A NaN loss no watched output showed, in the step anomaly mode found an op of a
    # watched module overflow while the module's output stayed finite: the inf went to the
    # loss aside (a router z-loss kept on the module). The op is its cause.
    aside = _loss_made_aside(out)
    if aside is not None:
        loss, op = aside
        errors.append(op)
        out = [_with(op, "error") if f is op else f for f in out]
        errors[-1] = next(f for f in out if f.kind == op.kind and f.module == op.module
                          and f.op == op.op and f.step == op.step)
        out = [_with(f, "info", follow_on_of=op.module,
                     extra=f"It began at {op.op} in {F.layer(op.module)} (see that finding).")
               if f is loss else f for f in out]
        consequences.setdefault(id(errors[-1]), []).append(loss)
    # The scaler and the loss: consequences of the origin they name.
    collapse = next((f for f in out if f.kind == "scale_collapse"), None)
    # (Not a measurement with max_norm=inf: it clipped nothing, so no gradient of it.)
    clip = next((f for f in out if f.kind == "clip_before_unscale"
                 and not f.data.get("measured_only")), None)
    # A NaN loss with no origin finding of its own (NaN made by code between the layers)
    # is the root of the backoffs that began where it did.
    loss_root = next((f for f in out if f.kind == "nonfinite_loss" and f.severity == "error"
                      and isinstance(f.data.get("origin"), str)
                      and root_for_module(f.data["origin"]) is None
                      and not any(e.kind == "nonfinite_input" for e in errors)), None)
    kept = []
    # A finding folded into another (its original's id -> that root): what was folded into
    # it goes on to its root (a backoff of the NaN loss's step, when that loss's origin
    # is a finding of its own).
    folded_into: dict[int, Finding] = {}
    for f in out:
        origin = None
        if f.kind == "scaler_backoff" and f.severity == "warning":
            origin = f.data.get("forward_origin")
        elif f.kind == "scale_collapse":
            origin = f.data.get("origin")
        elif f.kind == "nonfinite_loss":
            origin = f.data.get("origin")
        root = root_for_module(origin) if isinstance(origin, str) else None
        if root is None and f.kind in ("scaler_backoff", "scale_collapse", "nonfinite_loss"):
            # Gradients that went non-finite where the batch's cast did (no forward origin).
            root = next((e for e in errors if e.module == f.module and (
                e.kind == "input_beyond_format" or e.op in CAST_OPS)), None)
        if id(f) in backward_of:
            root = backward_of[id(f)]
        if (root is None and loss_root is not None and f is not loss_root
                and f.kind in ("scaler_backoff", "scale_collapse")
                and origin == loss_root.data["origin"]):
            root = loss_root
        if (root is None and f.kind in ("scaler_backoff", "scale_collapse")
                and f.data.get("loss_nonfinite")):
            # Backoffs of steps whose loss was NaN/inf: the NaN loss's consequences,
            # wherever it began (its own finding says where, or that it is not known).
            root = next((x for x in out if x.kind == "nonfinite_loss" and x is not f
                         and x.severity == "error"), None)
        if root is None and f.kind == "nonfinite_loss":
            root = next((e for e in errors if e.kind == "nonfinite_input"), None)
        loss_code = None
        if root is None and f.kind == "nonfinite_loss" and _made_in_loss_code(f):
            # Every watched output finite at a NaN loss: the code after the model made it,
            # where the collapse's large gradients were made too (review 51: a focal loss's
            # log of a float16 probability, -inf in forward, 1/p in backward). One root.
            loss_code = root = next((e for e in errors if e.kind in (
                "nonfinite_forward", "nonfinite_backward") and not e.module), None) or (
                collapse if collapse is not None and collapse.severity == "error"
                and collapse.data.get("loss_too_large")
                and not collapse.data.get("loss_nonfinite") else None)
        if root is None and f.kind == "nonfinite_loss" and _made_in_loss_code(f):
            # A frozen model's output (a teacher's logits) overflowed: it feeds the loss
            # only, and the step that showed the loss NaN may not have recorded it (review
            # 61c: "every watched layer's output was finite" beside the teacher's error).
            root = next((e for e in errors if e.kind == "activation_overflow" and e.module
                         and e.module in lay_by and frozen_output(lay_by[e.module])), None)
        if root is None and f.kind == "nonfinite_loss" and isinstance(origin, str):
            # It first showed in a layer fed by an origin whose only non-finite values
            # were -inf (a log of 0 in a weightless front end): the loss's origin skips
            # -inf-only outputs, as a mask's are.
            root = next((e for e in errors if e.module and e.kind == "activation_overflow"
                         and origin in (lay_by[e.module].consumers
                                        if e.module in lay_by else ())), None)
        if root is None and f.kind in ("nonfinite_loss", "scaler_backoff", "scale_collapse"):
            # A batch beyond the format's max, seen by anomaly mode's per-step check in
            # every step that went bad: the cast made the inf (review 46a).
            bad = set(steps_of(f))
            root = next((e for e in errors if e.kind == "input_beyond_format"
                         and bad and bad <= set(e.data.get("batch_steps") or ())), None)
        if root is None and f.kind in ("scaler_backoff", "scale_collapse"):
            # Backoffs no forward origin explains, in steps where a backward op made the
            # gradients non-finite (the backward of sqrt at 0): that op is their cause.
            steps = set(steps_of(f))
            root = next((e for e in errors if e.kind == "nonfinite_backward"
                         and e.step in steps), None)
            if root is None:
                # Or a forward op the search found make inf/NaN in one of them, the loss
                # finite all the same (an exp under a tanh: its backward is 0 x inf), where
                # the culprit layer named only met the gradients first (review 60b: a
                # collapse below 1 charged to a critic's Linear, an actor's exp beside it).
                root = next((e for e in errors if e.kind == "nonfinite_forward"
                             and e.step in steps), None)
        if root is None and f.kind == "nonfinite_loss" and f.data.get("began_unrecorded"):
            # It began in steps nobody recorded: an origin found in a step before the first
            # recorded one that shows it (the batch an op made NaN, anomaly mode's op).
            seen_at = f.data.get("recorded_at")
            root = next((e for e in errors if isinstance(seen_at, int) and any(
                s < seen_at for s in steps_of(e) + list(e.data.get("batch_steps") or ()))),
                None)
        if root is None and f.kind == "nonfinite_loss":
            # No recorded step showed where it began, or only a layer downstream of the op
            # anomaly mode's search named in one of its steps (an op whose output no
            # layer's statistics cover, such as a complex FFT's): the op is the cause.
            bad = set(f.data.get("bad_steps") or steps_of(f))
            root = next((e for e in errors if e.kind == "nonfinite_forward"
                         and e.step in bad), None)
        if (root is None and f.kind == "scaler_backoff" and f.module
                and not f.data.get("loss_too_large")):
            # Backoffs whose first culprit is a layer whose output overflowed the format
            # (an error of its own): that layer, not a second warning beside it (review
            # 48b: a regression head that must pass 65504 to fit its targets).
            root = next((e for e in errors if e.kind == "activation_overflow"
                         and e.module == f.module and e.op is None), None)
        if root is None and f.kind == "nonfinite_forward" and inputs_held_inf(f.data):
            # An op that made NaN of an inf that came in, in a step whose batch held inf
            # (log features of zero-padded frames given to a Linear): the data's inf, not
            # a mask's the op mishandled.
            root = next((e for e in errors if e.kind == "nonfinite_input" and e is not f
                         and any(e.data.get(k) for k in ("inf", "pos_inf", "neg_inf"))
                         and f.step in steps_of(e)), None)
        if root is None and f.kind == "nonfinite_unlocated" and not f.data.get("raise_mode"):
            # NaN/inf again in steps the op-level search did not see, beside an origin it
            # did find (review 61a: "did not recur", below the masked softmax it named): most
            # likely the same cause, sporadic (an empty document now and then).
            root = next((e for e in errors if e.kind in ("nonfinite_forward",
                                                         "nonfinite_input")
                         and e.step is not None and f.step is not None
                         and e.step <= f.step), None)
        if (root is None and f.kind == "nonfinite_output_dropped"
                and dropped_cause(f.data) == "model"):
            # The steps the loop dropped went NaN where a found forward origin makes it.
            root = next((e for e in errors if e.kind in FORWARD_MADE_KINDS), None)
        if root is not None:
            consequences.setdefault(id(root), []).append(f)
            folded_into[id(f)] = root
            if f.severity != "info" and f.kind in ("scaler_backoff", "scale_collapse",
                                                   "nonfinite_loss"):
                # Its own advice is for a cause of its own (the culprit layer in float32):
                # the root's is the fix (review 51: a backoff of a NaN batch).
                f = replace(f, advice=_follow_advice(root))
            elif f.kind == "nonfinite_unlocated":
                f = replace(f, advice=_follow_advice(root))
            f = _with(f, "info", follow_on_of=root.module)
            if f.kind == "nonfinite_loss":
                # Not "unknown" beside the finding that names where it began.
                at = f"{root.op} in {F.layer(root.module)}" if root.op and root.module else (
                    root.op or root.module or root.kind)
                if root.kind == "nonfinite_input":
                    at = f"the batch given to {F.layer(root.module)} at step {root.step}"
                named = loss_origin_named(f.message, at)
                if loss_code is not None:
                    named = f"{f.message} " + (
                        f"The op-level search found {root.op} (the backward of "
                        f"{root.data.get('forward_op')}) overflow in that code (see that "
                        "finding): one root cause." if root.kind == "nonfinite_backward" else
                        f"The op-level search found {root.op} make NaN/inf in that code at "
                        f"step {root.step} (see that finding): one root cause."
                        if root.kind == "nonfinite_forward" else
                        "The loss scale's collapse began in that code too (see that "
                        "finding): one root cause.")
                if named == f.message and root.op and root.module != origin:
                    # The layer it first showed in is downstream of the op that made it.
                    named = f"{f.message} It began at {at} (see that finding)."
                f = replace(f, message=named)
                if f.data.get("began_unrecorded") and root.kind == "nonfinite_input":
                    # Not how to see where it began: the batch's finding says it.
                    f = replace(f, advice=ADVICE["nonfinite_loss_poisoned_weights"])
        if f.kind == "gradient_underflow" and (collapse is not None or clip is not None):
            host = collapse if collapse is not None else clip
            assert host is not None
            carried.setdefault(id(host), []).append(f.module or "?")
            continue
        kept.append(f)
    for key in list(consequences):
        final, hops = key, 0
        while final in folded_into and hops < len(folded_into):
            final, hops = id(folded_into[final]), hops + 1
        if final != key:
            consequences.setdefault(final, []).extend(consequences.pop(key))
    result = []
    for f in kept:
        key = id(f)  # before the collapse's finding below is replaced
        if f.kind == "scale_collapse" and collapse is not None and id(collapse) in carried:
            names = carried.pop(id(collapse))
            f = _with(f, extra=(f"The gradients of {len(names)} layer(s) underflow float16 at "
                                f"the collapsed scale ({', '.join(names[:6])}): a consequence "
                                "of the collapse, not a reason to raise `init_scale`."),
                      underflow_follow_ons=names)
            collapse = f
        elif f.kind == "clip_before_unscale" and clip is not None and id(clip) in carried:
            names = carried.pop(id(clip))
            f = _with(f, extra=(f"The gradients of {len(names)} layer(s) look underflowed "
                                f"({', '.join(names[:6])}) only because they were clipped "
                                "while scaled; unscale before clipping and look again."),
                      underflow_follow_ons=names)
        if key in carried or key in consequences:
            names = carried.pop(key, [])
            cons = [_consequence(x) for x in _merged_backoffs(consequences.pop(key, []))]
            extra = ""
            if names:
                extra += (f"{len(names)} later layer(s) only carried its inf/NaN on and are "
                          f"not separate problems: {', '.join(names[:8])}"
                          + ("..." if len(names) > 8 else "") + ".")
            if cons:
                extra += (" " if extra else "") + "Consequences: " + "; ".join(cons) + "."
            f = _with(f, extra=extra, also_affected=names, consequences=cons)
        result.append(f)
    return _unlocated_dropped_forward(_backoffs_of_the_collapse(result))


def _made_in_loss_code(f: Finding) -> bool:
    """A NaN loss that a recorded step saw with every watched output finite, from a
    finite batch: the code between the model and the loss made it."""
    d = f.data
    return (d.get("origin") is None and d.get("recorded_at") is not None
            and not d.get("input_bad") and not d.get("masks_beside_finite_loss"))


def _backward_op_of_the_collapse(session: Session, out: list[Finding]) -> list[Finding]:
    """A backward op the op-level search saw overflow on scaled gradients at a backoff of
    a collapsing scale that was no calibration or probe of the GradScaler's is how the
    scale collapsed, not the scaler's search (review 51: a focal loss's LogBackward0
    dividing by a float16 probability near 0, until the scale fell below 1): the error,
    which the collapse folds into."""
    collapse = next((f for f in out if f.kind == "scale_collapse" and f.severity == "error"
                     and not f.data.get("origin") and not f.data.get("loss_nonfinite")),
                    None)
    if collapse is None or any(f.kind == "nonfinite_backward" and f.severity == "error"
                               for f in out):
        return out
    steps = set(steps_of(collapse)) - normal_backoff_steps(session)
    op = min((f for f in out if f.kind == "nonfinite_backward" and f.step in steps),
             key=_first_step, default=None)
    if op is None:
        return out
    advice = (collapse.advice if collapse.data.get("loss_too_large") and not op.module
              else op.advice)
    return [replace(f, severity="error", advice=advice,
                    data={**f.data, "collapse_made": True}) if f is op else f for f in out]


def _unlocated_dropped_forward(out: list[Finding]) -> list[Finding]:
    """Anomaly mode's "not located" beginning where a forward the loop dropped went NaN
    is that forward's: the dropped-forward finding (or the origin it folded into) holds
    it, rather than a second warning about the same step."""
    dropped = next((f for f in out if f.kind == "nonfinite_output_dropped"), None)
    if dropped is None:
        return out
    owner = dropped.data.get("follow_on_of") or dropped.module
    return [_with(f, "info", follow_on_of=owner,
                  extra=f"It is the forward the loop dropped at step {f.step} (see that "
                        "finding).")
            if f.kind == "nonfinite_unlocated" and f.step == dropped.step
            and f.severity != "info" else f for f in out]


def _gradients_a_small_gain_shrank(session: Session, out: list[Finding]) -> list[Finding]:
    """``gradient_underflow`` in the layers before a layer whose outputs underflow: a
    small gain (a LayerScale at 1e-6) multiplies the gradient on its way back as it does
    the output, so their gradients sit :data:`SHRUNK_GRAD_BITS` or more below its own.
    One cause: the underflowing layer's finding lists them, and they become info (the
    activation_underflow sample said "raise init_scale" eight times beside it)."""
    lays = {lay.name: lay for lay in session.layers}
    roots = sorted((f for f in out if f.kind == "activation_underflow" and f.module in lays
                    and lays[f.module].grad_absmax), key=lambda f: lays[str(f.module)].order)
    if not roots:
        return out
    before = {id(r): {p.name for p in layers_before(session, lays[str(r.module)])}
              for r in roots}
    shrunk: dict[int, Finding] = {}
    for f in out:
        lay = lays.get(f.module or "")
        if f.kind != "gradient_underflow" or lay is None or lay.grad_absmax is None:
            continue
        # The first underflowing layer after it: its gain is the one the gradient met.
        root = next((r for r in roots if lay.name in before[id(r)]), None)
        if root is not None and lay.grad_absmax <= float(
                lays[str(root.module)].grad_absmax or 0.0) * 2.0 ** -SHRUNK_GRAD_BITS:
            shrunk[id(f)] = root
    if not shrunk:
        return out
    listed: dict[int, list[Finding]] = {}
    for f in out:
        if id(f) in shrunk:
            listed.setdefault(id(shrunk[id(f)]), []).append(f)
    result: list[Finding] = []
    for f in out:
        if id(f) in shrunk:
            result.append(_with(f, "info", follow_on_of=shrunk[id(f)].module))
        elif id(f) in listed:
            fs = sorted(listed[id(f)], key=lambda x: -float(x.data.get("grad_underflow_frac")
                                                            or 0.0))
            u = lays[str(f.module)]
            worst = fs[0]
            result.append(_with(
                f, extra=(f"Its small gain shrinks the gradient on its way back as well "
                          f"(largest |output gradient| {F.num(u.grad_absmax)} at "
                          f"{F.layer(f.module)}, {F.num(lays[str(worst.module)].grad_absmax)} "
                          f"at {F.layer(worst.module)}): the output gradients of the "
                          f"{F.counted(len(fs), 'layer')} before it underflow too "
                          f"({', '.join(F.layer(x.module) for x in fs[:6])}"
                          + (", ..." if len(fs) > 6 else "") + "; worst "
                          f"{F.pct(worst.data.get('grad_underflow_frac'))} below the "
                          "smallest normal). A larger gain at the start (LayerScale's "
                          "`init_values` of 1e-4 or more, or the layer's product in "
                          "float32) fixes both."),
                shrinks_gradients_of=[str(x.module) for x in fs]))
        else:
            result.append(f)
    return result


def _backoffs_of_the_collapse(out: list[Finding]) -> list[Finding]:
    """A backoff finding whose steps are all the collapse's is that error's detail (its
    culprits in backward order, per optimizer), not a second warning: info."""
    collapse = next((f for f in out if f.kind == "scale_collapse" and f.severity == "error"),
                    None)
    if collapse is None:
        return out
    steps = set(steps_of(collapse))
    too_large = bool(collapse.data.get("loss_too_large"))
    out = [_with(f, "info", follow_on_of=collapse.module or collapse.kind)
           if f.kind == "scaler_backoff" and f.severity in ("error", "warning")
           and set(steps_of(f)) <= steps else f for f in out]
    if not too_large:
        return out
    # The loss is too large: its backoffs' layer is no layer to keep in float32 either.
    return [replace(f, advice=collapse.advice) if f.kind == "scaler_backoff"
            and f.data.get("follow_on_of") == (collapse.module or collapse.kind) else f
            for f in out]


# What a NaN in the weights makes next: outputs, loss, gradients, skipped steps.
_AFTER_NAN_WEIGHTS = ("nonfinite_loss", "activation_overflow", "nonfinite_unlocated",
                      "nonfinite_forward", "nonfinite_backward", "scaler_backoff",
                      "scale_collapse", "input_beyond_format",
                      # A batch one model made for another (a GAN's fakes for its
                      # discriminator), NaN from the next step on (review 61c).
                      "nonfinite_input")


# An optimizer step that applied what it should not have: scaled gradients, inf/NaN ones
# nothing skipped, or the same update twice.
_BAD_STEPS = ("scaled_grads_stepped", "step_after_unscale", "stepped_twice",
              "nonfinite_grads_applied")


def _after_a_bad_update(out: list[Finding]) -> list[Finding]:
    """The optimizer's update made the weights NaN (float16 Adam state), stepped on
    gradients still multiplied by the loss scale (every update 65536x too large), or took
    NaN/inf gradients that nothing skipped: what went non-finite from the next step on is
    its consequence, said in its finding."""
    root = next((f for f in out if f.kind == "lowp_update_nonfinite"), None) or next(
        (f for f in out if f.kind in _BAD_STEPS and f.severity == "error"), None)
    if root is None or root.step is None:
        return out
    later = [f for f in out if f.kind in _AFTER_NAN_WEIGHTS and f.severity != "info"
             and f is not root and _follows_bad_update(f, root, root.step)]
    if not later:
        return out
    cons = [f"{f.kind}" + (f" in {F.layer(f.module)}" if f.module else "")
            + (f" from step {f.step}" if f.step is not None else "") for f in later]
    result = []
    for f in out:
        if f is root:
            f = _with(f, extra="Consequences: " + "; ".join(cons) + ".", consequences=cons)
        elif any(f is x for x in later):
            # Its own fix (the layer its NaN first showed in, in float32) would not help:
            # the update made that layer's weights NaN (review 56b: `stepped_twice`).
            f = replace(_with(f, "info", extra=(
                f"It follows from the {root.kind} error (see that finding), whose updates "
                "changed the weights from then on."), follow_on_of=root.module),
                advice=_follow_advice(root))
        result.append(f)
    return result


def _follows_bad_update(f: Finding, root: Finding, at: int) -> bool:
    """Whether ``f`` is a consequence of the bad update ``root`` made at step ``at``."""
    # A layer's finding (no step: the run's aggregate) goes too: from the next step on
    # the NaN weights make their layer's output NaN, and the next update every other's.
    if f.step is None or f.step > at:
        return True
    scaler_kinds = ("scaler_backoff", "scale_collapse")
    if root.kind in _BAD_STEPS[:3] and f.step == at and f.kind in (
            *scaler_kinds, "nonfinite_backward"):
        # A step taken outside the scaler is the loop's doing from its first step on: the
        # backoffs of that very step, and the scaled gradients' overflow in its backward
        # (what the scaler would have skipped, applied), are its too.
        return True
    if root.data.get("after_unscale") and f.kind in scaler_kinds:
        # Gradients the loop made NaN after unscale_: a collapse that runs on after that
        # step is the NaN weights' skips, wherever its run of backoffs began (review 61c:
        # one that began at the scaler's start-up, or at the very step).
        return max(steps_of(f), default=-1) > at
    # The op-level search that found the weights NaN after that update.
    return f.kind == "nonfinite_unlocated" and (f.data.get("weights_nonfinite_at") or -1) > at


def _loss_made_aside(out: list[Finding]) -> tuple[Finding, Finding] | None:
    """(the NaN-loss error with no origin, the op-level hidden overflow of its first step)."""
    loss = next((f for f in out if f.kind == "nonfinite_loss" and f.severity == "error"
                 and f.module is None and f.data.get("origin") is None), None)
    if loss is None:
        return None
    op = next((f for f in out if f.kind == "activation_overflow" and f.op is not None
               and f.data.get("hidden") and f.step == loss.step), None)
    return (loss, op) if op is not None else None


def _batch_made_by_an_op(out: list[Finding]) -> list[Finding]:
    """A non-finite batch, and anomaly mode's op outside the model that made NaN/inf in
    steps where the batch was non-finite (``x / x.std()`` of a blank image in the data
    code): one cause. The op names its line; the batch's finding is its consequence
    (review 44b: two errors)."""
    batch = next((f for f in out if f.kind == "nonfinite_input" and f.severity == "error"),
                 None)
    if batch is None:
        return out
    bad = set(steps_of(batch))
    op = next((f for f in out if f.kind == "nonfinite_forward" and f.severity == "error"
               and f.op and not f.module and set(steps_of(f)) <= bad), None)
    if op is None:
        return out
    said = (f"It made the batch given to {F.layer(batch.module)} non-finite"
            if batch.module else "It made the batch non-finite")
    said += f" (in {batch.count} step(s), first at step {batch.step})."
    return [_with(f, extra=said, batch_made=batch.count, batch_steps=steps_of(batch))
            if f is op else
            _with(f, "info", follow_on_of=op.op,
                  extra=f"It was made by {op.op} (see that finding).") if f is batch else f
            for f in out]


def _batch_before_poisoned_weights(session: Session, out: list[Finding]) -> list[Finding]:
    """Without a GradScaler, a batch that held NaN in an unrecorded step whose loss stayed
    finite, and a loss that went NaN in the very next step and stayed so (its finding
    says it began in unrecorded steps): the batch is the cause. A NaN the loss leaves out
    (``ce[valid].mean()``) still makes NaN gradients in the backward (0 * NaN), which
    nothing skipped: that step's update poisoned the weights (review 49a). It was "info:
    the model handles such values"."""
    if session.amp.scaler:
        return out
    batch = next((f for f in out if f.kind == "nonfinite_input" and f.severity == "info"
                  and f.data.get("detected") == "unrecorded step"
                  and not f.data.get("unrecorded_steps")), None)
    loss = next((f for f in out if f.kind == "nonfinite_loss" and f.severity == "error"
                 and f.data.get("began_unrecorded")), None)
    if batch is None or loss is None or batch.step is None:
        return out
    seen = loss.data.get("recorded_at")
    if batch.data.get("loss_first_bad") != batch.step + 1 or not isinstance(seen, int):
        return out  # the loss stayed finite in the step after it: the batch poisoned nothing
    promoted = replace(
        _with(batch, "error", poisoned_weights=True),
        message=batch_poisoned_weights(batch.module, batch.data, batch.step, seen),
        advice=ADVICE["nonfinite_input"] + " " + ADVICE["nonfinite_loss_poisoned_weights"])
    return [promoted if f is batch else f for f in out]


def _one_error_per_op(out: list[Finding]) -> list[Finding]:
    """Anomaly mode's forward errors for one op of one module are one cause: an op that
    overflowed where a mask hid it (``activation_overflow`` with an op) and later made
    NaN/inf that reached the output (``nonfinite_forward``). The first keeps the error;
    the others are info beside it, and it says when the op did it again."""
    first: dict[tuple[str, str], Finding] = {}
    again: dict[int, list[Finding]] = {}
    for f in sorted((f for f in out if f.severity == "error" and f.op is not None
                     and f.module and f.kind in ("activation_overflow", "nonfinite_forward")),
                    key=lambda f: f.step if f.step is not None else 0):
        key = (f.module or "", f.op or "")
        if key in first:
            again.setdefault(id(first[key]), []).append(f)
        else:
            first[key] = f
    if not again:
        return out
    later = {id(f) for fs in again.values() for f in fs}
    result = []
    for f in out:
        if id(f) in again:
            fs = again[id(f)]
            said = "; ".join(f"{g.kind} at step {g.step}" for g in fs)
            f = _with(f, extra=f"The same op again later: {said}.",
                      same_op_later=[g.kind for g in fs])
        elif id(f) in later:
            f = _with(f, "info", follow_on_of=f.module)
        result.append(f)
    return result


def _discarded_backward_of_an_origin(out: list[Finding]) -> list[Finding]:
    """The backward of an op that is a forward error, on the same line in the same step,
    made inf that no optimizer took (the gradient of ``0 / count`` at a count of 0 goes to
    no element): nothing beside that error to tell (review 55: an info finding for the
    0/0 that the error names)."""
    origins = {(f.op, f.module, f.step, tuple(f.data.get("frames") or ()))
               for f in out if f.severity == "error" and f.kind == "nonfinite_forward"}
    return [f for f in out if not (
        f.kind == "nonfinite_discarded" and f.data.get("made") == "nonfinite_backward"
        and (f.data.get("forward_op"), f.module, f.step,
             tuple(f.data.get("frames") or ())) in origins)]


# Where NaN/inf is made in the forward pass: the backward of the step only carries it on.
FORWARD_ORIGIN_KINDS = ("nonfinite_input", "nonfinite_forward")


def steps_of(f: Finding) -> list[int]:
    """The steps a finding covers: its list, else its one step."""
    return f.steps or ([f.step] if f.step is not None else [])


def _first_step(f: Finding) -> float:
    """Sort key: the finding's step, a finding without one last."""
    return math.inf if f.step is None else f.step


def _backward_follow_ons(out: list[Finding]) -> dict[int, Finding]:
    """Backward errors (by ``id``) that follow from a forward origin, with that origin.

    The origin must be seen in the backward's own step, and be in the same module or
    have made that step's loss non-finite: a forward -inf that a mask swallowed
    (the loss stayed finite) does not explain a NaN in backward elsewhere.
    """
    roots = [f for f in out if f.severity == "error" and f.kind in FORWARD_ORIGIN_KINDS]
    losses = [f for f in out if f.kind == "nonfinite_loss"]
    found: dict[int, Finding] = {}
    for b in out:
        if b.kind != "nonfinite_backward" or b.severity != "error" or b.step is None:
            continue
        same_step = [r for r in roots if b.step in steps_of(r)]
        loss_bad = any(b.step in steps_of(x) for x in losses)
        root = next((r for r in same_step if r.module == b.module), None)
        if root is None and loss_bad and same_step:
            root = same_step[0]
        if root is not None:
            found[id(b)] = root
    return found


def _follow_advice(root: Finding) -> str:
    """The fix of a finding folded into ``root``: the root's."""
    at = " in ".join(x for x in (root.op, F.layer(root.module) if root.module else None) if x)
    return (f"Nothing of its own to fix: it follows from the {root.kind} error"
            + (f" ({at})" if at else "") + "; fix that one (see its finding).")


def _merged_backoffs(fs: list[Finding]) -> list[Finding]:
    """One backoff consequence per GradScaler: backoff findings folded into one root were
    told apart by the layers their gradients went non-finite in, and their interleaved
    scale ranges read as two overlapping falls (review 52a: "142x (65536 -> 2^-134)"
    beside "8x (0.0625 -> 2^-12)")."""
    out: list[Finding] = []
    first: dict[object, int] = {}
    for f in fs:
        if f.kind != "scaler_backoff":
            out.append(f)
            continue
        who = f.data.get("scaler")
        if who not in first:
            first[who] = len(out)
            out.append(f)
            continue
        g = out[first[who]]
        a, b = (g, f) if (g.step or 0) <= (f.step or 0) else (f, g)
        lows = [x for x in (g.data.get("scale_after"), f.data.get("scale_after"))
                if isinstance(x, (int, float))]
        out[first[who]] = replace(a, data={
            **a.data, "backoffs": int(a.data.get("backoffs", a.count))
            + int(b.data.get("backoffs", b.count)),
            "scale_after": min(lows) if lows else None})
    return out


def _consequence(f: Finding) -> str:
    d = f.data
    if f.kind == "nonfinite_backward":
        return (f"in the backward pass {f.op} ({d.get('node')}, the backward of "
                f"{d.get('forward_op')}) then produced NaN/inf from it")
    if f.kind == "scaler_backoff":
        return (f"GradScaler backed off {d.get('backoffs', f.count)}x and skipped that many "
                f"optimizer steps (scale {_scale(d.get('scale_before'))} -> "
                f"{_scale(d.get('scale_after'))})")
    if f.kind == "scale_collapse":
        return (f"the loss scale collapsed to {_scale(d.get('final_scale'))} "
                f"({d.get('skipped')} optimizer steps skipped)")
    if f.kind == "nonfinite_loss":
        said = (f"the loss was NaN/inf in {d.get('steps_bad')} of the {d.get('checked')} "
                "steps checked")
        if d.get("began_unrecorded") or d.get("after_grads_applied") is not None:
            said += (" (the updates that took its NaN/inf gradients made the weights "
                     "non-finite: no GradScaler skipped them)")
        return said
    if f.kind == "nonfinite_forward":
        where = f" in {F.layer(f.module)}" if f.module else ""
        return f"{f.op}{where} made NaN of that inf at step {f.step} (the first op to make NaN)"
    if f.kind == "nonfinite_output_dropped":
        return (f"the model's output was NaN/inf in {d.get('steps_bad')} more step(s), "
                "which the loop dropped before backward")
    if f.kind == "nonfinite_unlocated":
        return (f"NaN/inf again from step {f.step}, in steps the op-level search did not "
                "look at (most likely the same cause, recurring)")
    return f.kind


def cap_per_kind(findings: list[Finding]) -> list[Finding]:
    """At most MAX_PER_KIND findings of a kind, the last saying how many more: the most
    severe kept (review 56b: the error at the layer where a flush began, listing the 13
    layers it starved, was cut as the 14th finding of its kind, behind their infos)."""
    by_kind: dict[str, list[Finding]] = {}
    for f in findings:
        by_kind.setdefault(f.kind, []).append(f)
    out: list[Finding] = []
    for fs in by_kind.values():
        fs = sorted(fs, key=lambda f: SEVERITY_RANK[f.severity])  # stable: in order within
        out.extend(fs[:MAX_PER_KIND])
        if len(fs) > MAX_PER_KIND:
            last = fs[MAX_PER_KIND - 1]
            rest = len(fs) - MAX_PER_KIND + 1
            # The layers cut are named in the data: a JSON reader sees every one (review
            # 61a: 16 layers in the text, 8 findings in the JSON).
            cut = [f.module for f in fs[MAX_PER_KIND:] if f.module]
            out[-1] = Finding(**{**last.__dict__, "count": rest,
                                  "message": last.message + f" (and {rest - 1} more like it)",
                                  "data": {**last.data, "more_like_it": rest - 1,
                                           "more_modules": cut}})
    return out
