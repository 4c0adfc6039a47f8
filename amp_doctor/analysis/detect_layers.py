"""Layer and run figures -> findings: overflow, headroom, underflow, a run with no steps.

These detectors read the per-layer summaries (absmax, headroom, the shares beyond
the format's max or below its smallest normal) and the run's outcome; none of
them looks at events or the scaler's timeline.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

from amp_doctor import format as F
from amp_doctor.analysis.advice import ADVICE, ADVICE_BF16
from amp_doctor.analysis.messages import CAST_OPS
from amp_doctor.analysis.thresholds import (
    ACT_RELEVANT_BITS,
    ACT_UNDERFLOW_WARN,
    CALIBRATION_START,
    F16_SMALLEST_NORMAL,
    GRAD_FLUSHED_WARN,
    GRAD_RELEVANT_BITS,
    GRAD_UNDERFLOW_WARN,
    GRAD_ZEROS_SAID,
    HEADROOM_WARN_BITS,
    MADE_INF_HEADROOM_BITS,
    OUTPUT_LEVELS_ERROR,
    OUTPUT_LEVELS_WARN,
    OUTPUT_SPACING_MIN,
    OVERFLOW_FRAC_ERROR,
    STARVED_ZERO_FRAC,
    TINY_LOSS,
    TREND_MIN_STEPS,
    WHOLLY_NONFINITE_FRAC,
)
from amp_doctor.dtypes import FORMAT_MAX, MANTISSA_BITS, judged_format
from amp_doctor.records import Event, Finding, LayerSummary, Session

__all__ = ["layer_findings", "run_findings", "autocast_findings", "low_format", "input_cast",
           "median_loss",
           "grad_underflow", "largest_finite", "all_nonfinite", "shown_grad_underflow",
           "code_before"]


def _scale(x: float | None) -> str:
    return F.scale(x, unknown="?")


# The layout of ``LayerSummary.act_exp_hist`` (see ``stats.exponent_of_bin``): bin b in
# 1..254 holds |x| in [2**(b - 127), 2**(b - 126)); bin 0 zeros, the last bin inf/NaN.
_HIST_BINS = 256
_F32_BIAS = 127


def all_nonfinite(lay: LayerSummary) -> bool:
    """Non-finite outputs and no finite non-zero value in any step: its absmax 0 (or NaN)
    would read as "tiny", but the layer put out nothing but inf/NaN (and zeros)."""
    return lay.nonfinite_steps > 0 and (math.isnan(lay.absmax) or lay.absmax == 0)


def shown_grad_underflow(lay: LayerSummary) -> float | None:
    """The layer table's 'grad underflow': its output gradients' share when it ran in low
    precision, its weight gradients' for a float32 layer."""
    return lay.grad_underflow_frac if lay.ran_low_precision else lay.param_grad_underflow_frac


def largest_finite(lay: LayerSummary) -> float | None:
    """The top edge of the largest finite |output| the histograms saw (0: only zeros)."""
    hist = lay.act_exp_hist
    if len(hist) != _HIST_BINS or not any(hist[:-1]):
        return None  # no histogram, or not a single finite value in it
    top = next((b for b in range(_HIST_BINS - 2, 0, -1) if hist[b]), 0)
    return 2.0 ** (top - _F32_BIAS + 1) if top else 0.0


def _inf_made_by_an_op(lay: LayerSummary, fmt: str) -> float | None:
    """The largest finite |output| when the layer's infs cannot be values past the max."""
    big = largest_finite(lay)
    fmax = FORMAT_MAX.get(fmt)
    if big is None or fmax is None or not math.isinf(lay.absmax):
        return None
    return big if big * 2.0 ** MADE_INF_HEADROOM_BITS <= fmax else None


def _grads_only_skipped(session: Session, lay: LayerSummary) -> bool:
    """Its output gradients were non-finite only in steps a GradScaler skipped, and its
    parameters' never: what a calibrating scaler and the layers after it make of any
    layer's output gradient, where log(0)'s 1/0 would reach its own weights."""
    skips = sum(len(sc.skipped_steps) for sc in ([session.scaler] if session.scaler else [])
                + session.other_scalers)
    return lay.param_grad_nonfinite_steps == 0 and lay.grad_nonfinite_steps <= skips


def neg_inf_alone(lay: LayerSummary) -> bool:
    """Whether the layer's output went non-finite, and with -inf alone (no +inf, no NaN),
    in every recorded step it did."""
    return 0 < lay.nonfinite_steps == lay.neg_inf_steps


def neg_inf_mask(lay: LayerSummary, fmt: str, session: Session | None = None) -> float | None:
    """The largest finite |output| of a layer whose only non-finite values are a mask's
    -inf, written on purpose (``masked_fill(~legal, -inf)``); None for any other layer.

    A mask: in every recorded step with a non-finite output, -inf and neither +inf nor
    NaN; its gradients finite (a mask's gradient is 0 where it wrote -inf, where the
    backward of log(0) makes 1/0), or non-finite only as the GradScaler's skipped steps
    brought them from the layers after it (``session``); and its finite values far
    below the format's max, as :func:`_inf_made_by_an_op` asks (values do not jump from
    256x below the max to beyond it), so that an output overflowing to -inf alone is
    not one.
    """
    if not neg_inf_alone(lay):
        return None
    if lay.grad_nonfinite_steps and not (
            session is not None and _grads_only_skipped(session, lay)):
        return None
    if session is not None and _fed_to_weights(session, lay):
        return None
    return _inf_made_by_an_op(lay, fmt)


def _pooled_calls(lay: LayerSummary) -> str:
    """", over its N calls a step": a layer called several times a step (a block shared
    across depth) has its calls' values pooled, and the share of one call's may be up to
    N times the pooled one (review 47a: 31% pooled, where the second call had 62%)."""
    n = round(lay.calls / lay.recorded_steps) if lay.recorded_steps else 0
    return f", pooled over its {n} calls a step" if n > 1 else ""


def _fed_to_weights(session: Session, lay: LayerSummary) -> bool:
    """A layer with weights took its output and made NaN (or +inf) of it: a mask's -inf goes to a
    softmax, a max or the loss, not through a convolution or a matmul. Without a gradient
    of its own (a frontend given no-grad audio), nothing else tells a log of 0 from a mask
    (review 48b: ``torch.log(mel + 1e-10)``, whose 1e-10 is 0 in float16)."""
    by = {x.name: x for x in session.layers}
    return any(c in by and by[c].param_dtypes and by[c].nonfinite_steps > by[c].neg_inf_steps
               for c in lay.consumers)


def loss_reaching_mask(session: Session, module: str) -> LayerSummary | None:
    """The layer ``module`` if its only non-finite values are -inf, as a mask's
    (:func:`neg_inf_mask`), and it is where the run's NaN/inf loss first showed: then
    the -inf is no harmless mask, but a log of values that underflowed to 0, or a mask
    that reached the loss. The loss's finding says so; no mask finding beside it."""
    if not any(e.kind == "nonfinite_loss" and e.module == module
               and module not in (e.data.get("masks_beside_finite_loss") or [])
               for e in session.events):
        return None
    lay = next((x for x in session.layers if x.name == module), None)
    if lay is None or not lay.recorded_steps:
        return None
    return lay if neg_inf_mask(lay, low_format(session), session) is not None else None


def input_cast(session: Session, lay: LayerSummary) -> Event | None:
    """The run's note that the batch held finite values beyond the format's max in a
    step whose first layer to go non-finite was ``lay`` (see ``StepFolder``)."""
    return next((e for e in session.events if e.kind == "input_beyond_format"
                 and e.data.get("first_bad_layer") == lay.name), None)


def low_format(session: Session) -> str:
    """The run's low-precision format; float16 when none was seen."""
    return session.amp.dtype or "float16"


def layer_findings(session: Session) -> Iterable[Finding]:
    fmt = low_format(session)
    flushed = _no_gradient_reached_the_weights(session, fmt)
    if flushed is not None:
        # Every gradient is zero: no layer's underflow share can say so (zeros are not
        # subnormals).
        yield flushed
    # Gradients that underflowed in one layer reach the layers before it as
    # exact zeros: those layers are flushed, not merely subnormal.
    under = [lay for lay in session.layers if lay.recorded_steps and
             (_grad_underflow_that_counts(lay) or 0.0) > GRAD_UNDERFLOW_WARN]

    def same_output(a: LayerSummary, b: LayerSummary) -> bool:
        # A container returning its last child's output is credited the same tensor.
        return (a.absmax, a.grad_absmax, a.grad_underflow_frac) == (
            b.absmax, b.grad_absmax, b.grad_underflow_frac)

    leaves = [c for c in under
              if not any(u.order < c.order and same_output(u, c) for u in under)]
    source = max(leaves, key=lambda x: x.order) if leaves else None
    told: set[str] = set()
    found: list[Finding] = []
    for lay in session.layers:
        for f in _layer_findings(session, lay, judged_format(lay.output_dtypes, fmt), source):
            if "input_absmax" in f.data:
                told.add(lay.name)
            found.append(f)
    yield from _starved_by_the_flush(session, found, flushed is not None)
    yield from _input_beyond_format(session, told)


def _starved_by_the_flush(session: Session, found: list[Finding],
                          all_flushed: bool) -> list[Finding]:
    """Layers whose weights got exactly zero gradient in every recorded step, because the
    gradient had flushed to zero in a layer after them (in forward order): they do not
    train, which breaks the run. That is one error, at the layer where the flush began,
    listing them; their own warnings become its consequences, as info (review 45b: seven
    layers of a deep MLP without a GradScaler never moved, and each got a warning)."""
    if all_flushed:
        return found
    lays = {lay.name: lay for lay in session.layers}
    starved = [f for f in found if f.data.get("flushed_after") and f.module in lays and (
        lays[f.module].param_grad_zero_frac or 0.0) >= STARVED_ZERO_FRAC]
    if not starved:
        return found
    source = str(starved[0].data["flushed_after"])
    names = [str(f.module) for f in sorted(starved, key=lambda f: lays[str(f.module)].order)]
    gone = {id(f) for f in starved}
    out: list[Finding] = []
    at_source = False
    for f in found:
        if id(f) in gone:
            # Its consequence: kept, as info, for the layer's own figures.
            out.append(dataclasses.replace(f, severity="info",
                                           data={**f.data, "follow_on_of": source}))
            continue
        if f.module == source and f.kind in ("missing_scaler", "gradient_underflow"):
            at_source = True
            f = dataclasses.replace(
                f, severity="error",
                message=(f.message + f" On its way back, the gradient reached the "
                         f"{F.counted(len(names), 'layer')} before it flushed to exactly zero in "
                         f"every recorded step ({', '.join(F.layer(n) for n in names[:8])}"
                         + (", ..." if len(names) > 8 else "") + "): their weights get no "
                         "gradient and do not train."),
                data={**f.data, "starved_layers": names})
        out.append(f)
    if not at_source:
        return found  # no finding at the source to hold them: each keeps its own
    return out


def _input_beyond_format(session: Session, told: set[str]) -> Iterable[Finding]:
    """The batch held values beyond the format's max in steps that went non-finite, and
    no layer's overflow finding (``told``) said so: the first bad layer's output was NaN
    rather than past the max, or it stayed finite while the cast happened inside it (a
    GRU's float16 gate matmuls under a float32 output) and its gradients went NaN."""
    for e in session.events:
        if e.kind != "input_beyond_format":
            continue
        d, layer = e.data, str(e.data.get("first_bad_layer"))
        if d.get("from_step_check"):
            # Anomaly mode's per-step check of the batch, in unrecorded steps: said once,
            # when no recorded step said it.
            if not any(x.kind == e.kind and x is not e for x in session.events):
                yield _batch_beyond_in_step_check(e)
            continue
        if layer in told or any(x.module == layer and x.op in CAST_OPS for x in session.events):
            continue  # said by its overflow finding, or by anomaly mode's cast with its line
        n = int(d.get("occurrences", 1))
        led = int((d.get("first_bad") or {}).get(layer, n))
        dtype = d.get("dtype")
        if d.get("in_output", True):
            what = (f"that went non-finite (first at step {e.step}); {F.layer(layer)}'s output "
                    f"was the first to go non-finite in {led} of them")
            where = ""
        else:
            what = (f"whose gradients went non-finite (first at step {e.step}); {layer} was "
                    f"the first layer with non-finite gradients in {led} of them")
            where = (f": an op in {layer} ran in {dtype} (an RNN's gates, a matmul) while its "
                     "output stayed finite")
        yield Finding(
            kind="input_beyond_format", severity="error", module=layer, op=None, step=e.step,
            message=(f"The batch given to {F.layer(e.module)} held values up to "
                     f"{F.num(d.get('absmax'))}, beyond {dtype}'s max "
                     f"{float(d.get('max') or 0):g}, in {n} recorded step(s) {what}. "
                     f"Autocast's cast of such values to {dtype} is inf{where}."),
            advice=ADVICE["input_beyond_format"],
            data={"input_absmax": d.get("absmax"), "dtype": dtype,
                  "occurrences": n, "first_bad_layer": layer},
        )


def _batch_beyond_in_step_check(e: Event) -> Finding:
    """Anomaly mode's per-step check, or the check of every step's batch (its
    ``detected``: "unrecorded step"), saw the batch beyond the format's max in steps
    that went non-finite."""
    d = e.data
    steps = [int(x) for x in d.get("steps") or [e.step]]
    n = max(int(d.get("occurrences") or 0), len(steps))
    dtype = d.get("dtype")
    listed = ("step " if len(steps) == 1 else "steps ") + F.steps_list(steps) + (
        ", ..." if n > len(steps) else "")
    if d.get("detected") == "unrecorded step":
        what, how = "loss", ("not a recorded step: the check of every step's batch"
                             if n == 1 else "the check of every step's batch")
    else:
        what, how = "gradients", "anomaly mode's check of every step's batch" + (
            f", the model called at {e.frame}" if e.frame else "")
    which = f" (in its argument `{d['input']}`)" if d.get("input") else ""
    return Finding(
        kind="input_beyond_format", severity="error", module=e.module, op=None, step=e.step,
        message=(f"The batch given to {F.layer(e.module)}{which} held values up to "
                 f"{F.num(d.get('absmax'))}, beyond {dtype}'s max "
                 f"{float(d.get('max') or 0):g}, in {F.counted(n, 'step')} whose "
                 f"{what} went non-finite ({listed}; {how}). Autocast's cast of such "
                 f"values to {dtype} is inf."),
        advice=ADVICE["input_beyond_format"],
        steps=steps,
        data={"input_absmax": d.get("absmax"), "dtype": dtype, "occurrences": n,
              "first_bad_layer": None, "batch_steps": steps},
    )


# Containers whose forward only chains their children: no code of their own runs before
# their first child.
_CHAINING = frozenset({"Sequential"})


def predicts(session: Session, lay: LayerSummary) -> bool:
    """``lay`` returns its model's output, and that output is what the loop predicts
    with: not a frozen feature extractor's, which another watched model takes as its
    input (review 60b: a backbone's overflow advised to standardise regression targets)."""
    if not lay.model_output or frozen_output(lay):
        return False
    own = _model_of(session, lay.name)
    return not any(_model_of(session, c) != own for c in lay.consumers)


def frozen_output(lay: LayerSummary) -> bool:
    """A model's output layer that never got a gradient: a frozen model's (a distillation
    teacher's, run under no_grad), whose output feeds the loss but is not trained."""
    return (lay.model_output and lay.recorded_steps > 0 and lay.grad_absmax is None
            and lay.grad_nonfinite_steps == 0 and lay.param_grad_absmax is None
            and lay.param_grad_nonfinite_steps == 0)


def _model_of(session: Session, name: str) -> str | None:
    """The watched model ``name`` belongs to (None with one model: its names have no
    prefix)."""
    if len(session.run.models) < 2:
        return None
    return max((m for m in session.run.models if name == m or name.startswith(m + ".")),
               key=len, default=None)


def code_before(session: Session, name: str) -> str:
    """Whose forward code runs just before layer ``name`` gets its input: the nearest
    ancestor that is a layer with code of its own ("x's"), or "the model's". A
    ``Sequential`` runs none (the op is in the code that calls it), and a ``ModuleList``
    is never called (the code that loops over it is its parent's)."""
    types = {lay.name: lay.type for lay in session.layers}
    while "." in name:
        name = name.rsplit(".", 1)[0]
        if name in types and types[name] not in _CHAINING:
            return f"{name}'s"
    return "the model's"


def _unconfirmed(session: Session, lay: LayerSummary) -> str:
    """What anomaly mode could not say about a layer's overflow: its op search ran in the
    steps after and saw no op make NaN/Inf (a one-off), so the input, which is not
    checked, may have brought the inf (made in its parent's own code)."""
    if not any(e.kind == "nonfinite_unlocated" for e in session.events) or any(
            e.kind in ("nonfinite_forward", "activation_overflow") and e.module
            and (e.module == lay.name or e.module.startswith(lay.name + "."))
            for e in session.events):
        return ""
    parent = code_before(session, lay.name)
    return (" Anomaly mode's op search ran in the steps after and did not see it recur, so "
            "whether it began here or came in with the layer's input (made in "
            f"{parent} own forward code before it, such as attention scores without the "
            "1/sqrt(d) scale) is not known: `--anomaly --on-nonfinite raise` stops at the op "
            "that made it.")


def _input_unseen(session: Session, lay: LayerSummary) -> str:
    """What the figures cannot say of a layer whose input no watched layer put out (made
    by its parent's own code: a VAE's ``mu + std * eps`` before its decoder): whether the
    inf came in with it. Anomaly mode's op-level findings say it when they ran."""
    if lay.inputs_known or any(e.module and e.op and (
            e.module == lay.name or lay.name.startswith(e.module + "."))
            for e in session.events):
        return ""
    if _batch_was_fine(session, lay):
        return (f" Its input is the batch, which amp-doctor checks at every step: it held "
                f"no NaN/inf and no value beyond the format's max, so the inf was made in "
                f"{F.layer(lay.name)}'s own forward code, between its layers or on its "
                "parameters (a product, the exp of a learned scale or temperature): anomaly "
                "mode (`--anomaly`) names the op and its line.")
    owner = code_before(session, lay.name)
    return (f" Its input was not a watched layer's output (made by {owner} own forward "
            "code, or the batch), so whether the inf came in with it is not known: anomaly "
            "mode (`--anomaly`) names the op that made it.")


def _first_at(session: Session, lay: LayerSummary) -> str:
    """", first at step N": when a layer's run-long figures began, for a finding that
    stands for the whole run (no step of its own)."""
    first = lay.first_overflow_step
    if first is None or lay.recorded_steps < 2:
        return ""
    # With steps between the recorded ones, it may have begun in one of those (review 61b).
    return (f", first at step {first}" if session.run.every == 1
            else f", first recorded at step {first}")


def _batch_was_fine(session: Session, lay: LayerSummary) -> bool:
    """``lay`` is a watched model given the batch, whose every step's check found it
    neither non-finite nor beyond the format's max (review 51: a CLIP model's logits
    overflowed by its exp(logit_scale) and were said to be its input's cast)."""
    return lay.name in session.run.models and not any(
        e.kind in ("nonfinite_input", "input_beyond_format") for e in session.events)


def _wholly_nonfinite(session: Session, lay: LayerSummary) -> bool:
    """In every kept step where its output went non-finite, (nearly) all of it did: its
    finite values then come from other steps, and say nothing of how near the max the
    failing step's values were (a matmul spreads one inf in its input to every output)."""
    fracs = [ls.act.nonfinite_frac for r in session.history
             if (ls := r.layers.get(lay.name)) is not None and ls.act is not None
             and ls.act.nonfinite_frac > 0]
    return bool(fracs) and min(fracs) >= WHOLLY_NONFINITE_FRAC


def _cast_input(session: Session, lay: LayerSummary, fmt: str) -> str:
    """A layer that autocast fed a float32 input: values of it past the format's max are
    inf once cast, before the layer computes anything (review 44a: a float32 LayerNorm
    output past 65504 into a Linear)."""
    if ("float32" not in lay.input_dtypes or not _wholly_nonfinite(session, lay)
            or _batch_was_fine(session, lay)):
        return ""
    return (f" Its input came in float32 and autocast casts it to {fmt}: input values past "
            f"{fmt}'s max are inf before the layer computes anything (a float32 residual "
            "stream or LayerNorm output that grew too large), and one inf in a matmul's input "
            "makes its whole output row inf/NaN, as here. Anomaly mode (`--anomaly`) names the "
            "op: the cast, or one in the layer.")


def _underflow_trend(session: Session, name: str) -> tuple[float, float] | None:
    """The layer's mean share of outputs below the smallest normal in the first and the
    last third of its recorded steps, when it has enough of them to tell."""
    fracs = [ls.act.underflow_frac for r in session.history
             if (ls := r.layers.get(name)) is not None and ls.act is not None and ls.act.numel]
    n = len(fracs) // 3
    if n < TREND_MIN_STEPS:
        return None
    return sum(fracs[:n]) / n, sum(fracs[-n:]) / n


def _zeros_made_by_a_consumer(session: Session, lay: LayerSummary,
                              source: LayerSummary) -> bool:
    """``lay``'s output gradient is mostly exact zeros, but the layers that took its output
    got gradients that were neither zero nor underflowing: their own backward made the
    zeros from normal values (a saturated Tanh's ``1 - y**2`` at y = 1), which no loss
    scale changes; a flushed gradient arrives at them as zeros already (review 56b: "flushed
    to zero even with the loss scale" for a Tanh that saturated in float32 too)."""
    by_name = {x.name: x for x in session.layers}
    took = [by_name[c] for c in lay.consumers if c in by_name and by_name[c].recorded_steps]
    return bool(took) and all(
        c is not source and (c.grad_zero_frac or 0.0) <= GRAD_FLUSHED_WARN
        and (c.grad_underflow_frac or 0.0) <= GRAD_UNDERFLOW_WARN for c in took)


# Anomaly mode's events that name the op inside a layer: its finding explains the layer.
_OP_FOUND = ("nonfinite_forward", "nonfinite_backward", "nonfinite_discarded")


def _layer_findings(session: Session, lay: LayerSummary, fmt: str,
                    source: LayerSummary | None = None) -> Iterable[Finding]:
    if lay.recorded_steps == 0:
        return
    # Its output is a sublayer's tensor (a container), and that sublayer is reported; or
    # anomaly mode found the op in it that made NaN/-inf from finite inputs (log(0),
    # 0/0), which that finding explains better than "overflow".
    # An op anomaly mode placed outside every module (module None) that made NaN/-inf
    # from finite inputs explains the first layer to show it: log(0) is not an overflow.
    explained = lay.passthrough or any(
        e.kind == "nonfinite_forward" and (e.module == lay.name or (
            not e.module and lay.overflow_origin_steps > 0)) for e in session.events)
    mask_max = None if explained else neg_inf_mask(lay, fmt, session)
    if explained or (mask_max is not None and loss_reaching_mask(session, lay.name)):
        pass
    elif mask_max is not None:
        yield Finding(
            kind="neg_inf_mask", severity="info", module=lay.name, op=None, step=None,
            message=(f"{F.layer(lay.name)} ({lay.type}) output holds -inf in "
                     f"{lay.nonfinite_steps} of {lay.recorded_steps} recorded steps "
                     f"({F.pct(lay.overflow_frac)} of values in the worst step) and never "
                     "+inf or NaN, while its finite "
                     f"values stayed below {F.num(mask_max)} and its gradients were "
                     + ("finite" if not lay.grad_nonfinite_steps else
                        "non-finite only in steps the GradScaler skipped, its weights' never")
                     + ": a mask written on purpose (masked_fill with -inf), not an overflow."),
            advice=ADVICE["neg_inf_mask"],
            data={"neg_inf_frac": lay.overflow_frac, "largest_finite": mask_max,
                  "dtype": fmt},
        )
    elif lay.ran_low_precision and lay.overflow_frac > OVERFLOW_FRAC_ERROR and fmt == "bfloat16":
        # bfloat16's max is float32's: these values are inf/NaN an op made (log(0), x/0)
        # or diverged weights, not values beyond the format's range.
        yield Finding(
            kind="activation_overflow", severity="error", module=lay.name, op=None, step=None,
            message=(f"{F.layer(lay.name)} ({lay.type}) output went non-finite (inf/NaN) in "
                     f"{lay.nonfinite_steps} of {lay.recorded_steps} recorded steps"
                     f"{_first_at(session, lay)} "
                     f"({F.pct(lay.overflow_frac)} of values in the worst step). bfloat16 has "
                     "float32's range, so this is not an overflow of the format: an op in it "
                     "made inf/NaN, or its weights diverged."),
            advice=ADVICE_BF16["activation_overflow"],
            data={"overflow_frac": lay.overflow_frac, "absmax": lay.absmax, "dtype": fmt},
        )
    elif lay.ran_low_precision and lay.overflow_frac > OVERFLOW_FRAC_ERROR and (
            cast := input_cast(session, lay)) is not None:
        d = cast.data
        yield Finding(
            kind="activation_overflow", severity="error", module=lay.name, op=None,
            step=cast.step,
            message=(f"{F.layer(lay.name)} ({lay.type}) output went non-finite (inf/NaN) in "
                     f"{lay.nonfinite_steps} of {lay.recorded_steps} recorded steps "
                     f"({F.pct(lay.overflow_frac)} of values in the worst step): the batch "
                     f"given to {cast.module} held values up to {F.num(d.get('absmax'))} "
                     f"(first at step {cast.step}), beyond {d.get('dtype')}'s max "
                     f"{float(d.get('max') or 0):g}, and autocast's cast of them to "
                     f"{d.get('dtype')} is inf before {F.layer(lay.name)} computes anything."),
            advice=ADVICE["input_beyond_format"],
            data={"overflow_frac": lay.overflow_frac, "absmax": lay.absmax, "dtype": fmt,
                  "input_absmax": d.get("absmax")},
        )
    elif lay.ran_low_precision and lay.overflow_frac > OVERFLOW_FRAC_ERROR and (
            made := _inf_made_by_an_op(lay, fmt)) is not None and not _wholly_nonfinite(
                session, lay):
        yield Finding(
            kind="activation_overflow", severity="error", module=lay.name, op=None, step=None,
            message=(f"{F.layer(lay.name)} ({lay.type}) output went non-finite (inf/NaN) in "
                     f"{lay.nonfinite_steps} of {lay.recorded_steps} recorded steps"
                     f"{_first_at(session, lay)} "
                     f"({F.pct(lay.overflow_frac)} of values in the worst step), while its "
                     + ("finite values were all 0" if made == 0 else
                        f"finite values stayed below {F.num(made)}")
                     + f", far from {fmt}'s max: not "
                     "values growing past the max, but an op "
                     + ("in it" if lay.inputs_known else
                        f"in it, or in {code_before(session, lay.name)} own forward code "
                        "before it (its input was not a watched layer's output),")
                     + " that made inf/NaN (log(0), x/0, exp of a large value)."),
            advice=ADVICE["activation_nonfinite"],
            data={"overflow_frac": lay.overflow_frac, "absmax": lay.absmax, "dtype": fmt,
                  "largest_finite": made},
        )
    elif lay.ran_low_precision and lay.overflow_frac > OVERFLOW_FRAC_ERROR:
        yield Finding(
            kind="activation_overflow", severity="error", module=lay.name, op=None, step=None,
            message=(f"{F.layer(lay.name)} ({lay.type}) output overflows {fmt}: "
                     f"{F.pct(lay.overflow_frac)} of values beyond the format's max "
                     f"(worst step{_pooled_calls(lay)}), non-finite in {lay.nonfinite_steps} of "
                     f"{lay.recorded_steps} recorded steps{_first_at(session, lay)}." + (
                         _unconfirmed(session, lay) or _input_unseen(session, lay))
                     + _cast_input(session, lay, fmt)),
            # The model's output past the max: what it predicts is that large. Unless the
            # model's own code made it from a fine batch: there, the op is to be found.
            advice=ADVICE["activation_overflow_own_code" if _batch_was_fine(session, lay)
                          and not lay.inputs_known
                          else "activation_overflow_output" if predicts(session, lay)
                          else "activation_overflow"],
            data={"overflow_frac": lay.overflow_frac, "absmax": lay.absmax, "dtype": fmt},
        )
    elif lay.ran_low_precision and lay.headroom < HEADROOM_WARN_BITS and math.isfinite(
            lay.absmax) and lay.absmax > 0:
        yield Finding(
            kind="activation_overflow", severity="warning", module=lay.name, op=None,
            step=None,
            message=(f"{F.layer(lay.name)} ({lay.type}) output comes within "
                     f"{lay.headroom:.2f} bits of {fmt}'s max (absmax {F.num(lay.absmax)})."),
            advice=ADVICE["activation_headroom"],
            data={"headroom": lay.headroom, "absmax": lay.absmax, "dtype": fmt},
        )
    elif (not lay.ran_low_precision and lay.nonfinite_steps
          # First to go non-finite in a step beyond those it held only -inf (a mask added
          # to the logits: ``out.float() + mask``).
          and lay.overflow_origin_steps > (lay.neg_inf_steps or 0)
          and lay.overflow_frac > 0 and session.amp.dtype and not any(
              e.module == lay.name and e.kind in _OP_FOUND for e in session.events)):
        # A float32 output that went inf/NaN first (review 60a: a block whose float16
        # ``y * y`` overflowed inside it, returned as ``x + 0.5 * z`` in float32): real
        # non-finite values, not what a cast to float16 would do to it.
        yield Finding(
            kind="activation_overflow", severity="error", module=lay.name, op=None, step=None,
            message=(f"{F.layer(lay.name)} ({lay.type}) output went non-finite (inf/NaN) in "
                     f"{lay.nonfinite_steps} of {lay.recorded_steps} recorded steps (the first "
                     f"of the watched layers in {lay.overflow_origin_steps}), "
                     f"though it returns {'/'.join(lay.output_dtypes)}: an op in its own "
                     f"forward code ran in {fmt} under autocast (its layers' outputs stayed "
                     f"finite) and made inf/NaN, a product or a square past {fmt}'s max, "
                     "an exp, a log(0) or a division by 0."),
            advice=ADVICE["activation_overflow_own_code"],
            data={"overflow_frac": lay.overflow_frac, "absmax": lay.absmax, "dtype": fmt,
                  "output_dtypes": list(lay.output_dtypes)},
        )
    elif lay.what_if and fmt == "float16" and lay.overflow_frac > 0 and session.amp.dtype:
        # Itself, or inside a module --fp32 forced (a whole model: every layer).
        forced = any(lay.name == m or lay.name.startswith(m + ".")
                     or m in session.run.models for m in session.run.fp32_modules)
        yield Finding(
            kind="activation_overflow", severity="info", module=lay.name, op=None, step=None,
            message=(f"{F.layer(lay.name)} ({lay.type}) "
                     + ("ran in float32 by --fp32" if forced else "stayed in float32")
                     + f"; cast to {fmt} its output would overflow "
                     f"({F.pct(lay.overflow_frac)} of values). Keep it in float32."),
            advice=ADVICE["fp32_kept" if forced else "activation_overflow"],
            data={"overflow_frac": lay.overflow_frac, "what_if": True},
        )
    if lay.passthrough:
        # Its output and output gradient are a child's tensors: the child's findings say it
        # (a Sequential, or the LightningModule around it, repeated its last layer's).
        return
    coarse = _coarse_output(lay, fmt)
    if coarse is not None:
        yield coarse
    au = _act_underflow_that_counts(lay, fmt)
    if lay.ran_low_precision and au > ACT_UNDERFLOW_WARN:
        trend = _underflow_trend(session, lay.name)
        gone = trend is not None and trend[1] <= ACT_UNDERFLOW_WARN < trend[0]
        yield Finding(
            kind="activation_underflow", severity="info" if gone else "warning",
            module=lay.name, op=None, step=None,
            message=(f"{F.layer(lay.name)} ({lay.type}): "
                     + _act_underflow_text(session, lay, au,
                                           f"below {fmt}'s smallest normal (subnormal or "
                                           "flushed)") + "."
                     + (f" Only at the start: {F.pct(trend[0])} in the first third of its "
                        f"recorded steps, {F.pct(trend[1])} in the last, as a layer grows "
                        "out of a zero or tiny initialisation (LoRA's B)." if gone and trend
                        else "")),
            advice=ADVICE["activation_underflow_transient" if gone else "activation_underflow"],
            data={"underflow_frac": au, "dtype": fmt,
                  "underflow_first_third": trend[0] if trend else None,
                  "underflow_last_third": trend[1] if trend else None},
        )
    gu = _grad_underflow_that_counts(lay)
    flushed = (source is not None and source is not lay and lay.order < source.order
               and lay.ran_low_precision and bool(lay.param_dtypes)
               and (lay.grad_zero_frac or 0.0) > GRAD_FLUSHED_WARN
               and not _zeros_made_by_a_consumer(session, lay, source))
    # A layer that ran in float32 (a LayerNorm under autocast) computes its gradients in
    # float32: its figures are a what-if, and nothing of them flushed (review 44d).
    if session.amp.dtype and fmt == "float16" and lay.ran_low_precision and (
            (gu is not None and gu > GRAD_UNDERFLOW_WARN) or flushed):
        scaled = session.amp.scaler
        kind = "missing_scaler" if not scaled else "gradient_underflow"
        # The figures of the one tensor the share is of: the layer's weight gradient (a
        # float32 layer's, or the larger share) or its output gradient, never a mix.
        weight = lay.param_grad_underflow_frac is not None and gu is not None and (
            not lay.ran_low_precision or lay.param_grad_underflow_frac >= gu)
        which = "weight" if weight else "output"
        big_of = lay.param_grad_absmax if weight else lay.grad_absmax
        big = big_of if big_of is not None and math.isfinite(big_of) else None
        top = max((v for _, v in session.scaler.scale), default=None) if (
            scaled and session.scaler) else None
        if scaled and top is not None and top <= 1.0:
            # A scale that never rose above 1 lifts nothing: "with" and "without" coincide.
            tail = (f" although a GradScaler is on: its scale never rose above "
                    f"{_scale(top)}, so it lifts nothing (raise `init_scale`, e.g. "
                    "`torch.amp.GradScaler(device_type, init_scale=2.0**16)`)")
        elif scaled and (dropped := scaler_dropped_after(session)) is not None:
            # The figures mix the scaled steps with those after the scaler was dropped.
            tail = (f", with the loss scale only up to step {dropped}: the steps after it "
                    "ran without a GradScaler, so their gradients had no loss scale")
        elif scaled:
            gu_u = _grad_under_unscaled(lay)
            tail = (f" even with the loss scale ({F.pct(gu_u)} would without it)"
                    if gu_u is not None else " even with the loss scale")
        else:
            sc = session.scaler
            tail = (", and the GradScaler is disabled (enabled=False"
                    + ("; torch.cuda.amp.GradScaler disables itself without CUDA"
                       if session.amp.device_type != "cuda" else "") + ")"
                    if sc is not None and not sc.enabled else ", and no GradScaler is in use")
        if gu is not None and gu > GRAD_UNDERFLOW_WARN:
            # The share counts float16 subnormals: a value that flushed to zero cannot be
            # told from a true zero (a ReLU's), so the zeros are said apart.
            zeros = (lay.param_grad_zero_frac if weight else lay.grad_zero_frac) or 0.0
            what = (f"{F.pct(gu)} of its {which}-gradient values are float16 subnormals (below "
                    f"the smallest normal, {F.num(F16_SMALLEST_NORMAL)}), which lose precision"
                    + (f"; another {F.pct(zeros)} are exactly zero (flushed, or zero "
                       "already)" if zeros >= GRAD_ZEROS_SAID else "")
                    + tail
                    + (f"; its largest |{which} gradient| is {F.num(big)}" if big else ""))
        else:
            assert source is not None
            what = (f"{F.pct(lay.grad_zero_frac)} of its output-gradient values are exactly "
                    f"zero: the gradient had already underflowed float16 in {source.name} "
                    f"({F.pct(grad_underflow(source))} below the smallest normal), which runs "
                    f"before it in backward, and reached this layer flushed to zero{tail}")
        half = kind == "missing_scaler" and "float16" in lay.param_dtypes
        tiny = _tiny_loss(session)
        if tiny is not None:
            what += (f". The loss itself is tiny (median {F.num(tiny)} over the recorded "
                     "steps), and every gradient starts from it: a loss averaged over the "
                     "dataset's size, or weighted by a tiny factor, is the likely cause")
        yield Finding(
            kind=kind, severity="warning", module=lay.name, op=None, step=None,
            message=f"{F.layer(lay.name)} ({lay.type}): {what}.",
            advice=ADVICE["missing_scaler_half_params" if half else
                          "gradient_underflow_tiny_loss" if tiny is not None and scaled
                          else "missing_scaler_disabled" if kind == "missing_scaler"
                          and session.scaler is not None and not session.scaler.enabled
                          else kind],
            # The figures the message gives, of the one gradient it names (``gradient``):
            # a weight gradient's absmax is as the optimizer gets it, unscaled.
            data={"grad_underflow_frac": gu,
                  "grad_zero_frac": (lay.param_grad_zero_frac if weight
                                     else lay.grad_zero_frac),
                  "gradient": which,
                  "flushed_after": source.name if flushed and source else None,
                  "scaled": scaled, "grad_absmax": big,
                  "grad_absmax_scaled": big if not weight and scaled else None},
        )


def median_loss(session: Session) -> float | None:
    """The median |loss| over the recorded steps (as the loop computed it, before the loss
    scale), or None."""
    losses = sorted(abs(r.loss) for r in session.history
                    if r.loss is not None and math.isfinite(r.loss))
    return losses[len(losses) // 2] if losses else None


def _tiny_loss(session: Session) -> float | None:
    """:func:`median_loss` when below :data:`TINY_LOSS`, else None."""
    mid = median_loss(session)
    return mid if mid is not None and mid < TINY_LOSS else None


def _coarse_output(lay: LayerSummary, fmt: str) -> Finding | None:
    """The model's output ran in a low-precision format on a large offset: its values
    kept one sign and spanned only a few of the format's steps (a regression head whose
    predictions sit near 300, where bfloat16's spacing is 2: review 46b). The model can
    then not express its function; nothing overflows or underflows."""
    if not (lay.model_output and lay.ran_low_precision and lay.range_rel is not None
            and math.isfinite(lay.absmax) and lay.absmax > 0):
        return None
    bits = MANTISSA_BITS.get(fmt)
    if bits is None:
        return None
    levels = lay.range_rel * 2**bits
    if levels >= OUTPUT_LEVELS_WARN:
        return None
    spacing = 2.0 ** (math.floor(math.log2(lay.absmax)) - bits)
    if spacing < OUTPUT_SPACING_MIN:
        return None
    return Finding(
        kind="output_resolution", module=lay.name, op=None, step=None,
        severity="error" if levels < OUTPUT_LEVELS_ERROR else "warning",
        message=(f"{F.layer(lay.name)} ({lay.type}) is the model's output and ran in {fmt}: "
                 f"its values kept one sign and spanned {F.pct(lay.range_rel)} of their size "
                 f"(mean over the recorded steps), about {levels:.1f} of {fmt}'s steps ("
                 f"{bits + 1} significant bits: a spacing of {F.num(spacing)} "
                 f"near {F.num(lay.absmax)}). Its outputs are rounded to a few values, so "
                 "the loss cannot resolve what it must learn (a regression target on a "
                 f"large offset, logits with a large shared bias). `--fp32 {lay.name}` runs "
                 "it in float32 without editing the code."),
        advice=ADVICE["output_resolution"],
        data={"range_rel": lay.range_rel, "levels": levels, "spacing": spacing,
              "dtype": fmt},
    )


def _no_gradient_reached_the_weights(session: Session, fmt: str) -> Finding | None:
    """A float16 run in which every recorded parameter gradient was exactly zero, though
    the loss was not: the loss's gradient flushed to zero on its way back (a tiny loss
    weight, no GradScaler), so the model does not train."""
    with_params = [lay for lay in session.layers
                   if lay.recorded_steps and lay.param_grad_zero_frac is not None]
    if (not with_params or any(lay.param_grad_zero_frac != 1.0 for lay in with_params)
            or not any(judged_format(lay.output_dtypes, fmt) == "float16"
                       for lay in session.layers if lay.ran_low_precision)
            or not session.amp.dtype):
        return None
    losses = [r.loss for r in session.history if r.loss is not None]
    if losses and not any(math.isfinite(v) and v != 0 for v in losses):
        return None  # a zero (or non-finite) loss: nothing to flush
    last = max(with_params, key=lambda lay: lay.order)
    scaled = session.amp.scaler
    loss = next((v for v in losses if math.isfinite(v) and v != 0), None)
    tail = ("the GradScaler's scale did not lift it above float16's smallest subnormal"
            if scaled else "no GradScaler lifts it")
    return Finding(
        kind="gradient_underflow" if scaled else "missing_scaler", severity="error",
        module=last.name, op=None, step=None,
        message=(f"Every parameter gradient was exactly zero in all "
                 f"{session.recorded_steps} recorded step(s)"
                 + (f", while the loss was {F.num(loss)}" if loss is not None else "")
                 + ": the loss's gradient flushed to zero in float16 before it reached "
                 f"any weight ({last.name} is the first layer it meets), so the model does "
                 f"not train; {tail}."),
        advice=ADVICE["gradient_underflow" if scaled else "missing_scaler"],
        data={"param_grad_zero_frac": 1.0, "scaled": scaled, "loss": loss,
              "dtype": "float16", "all_flushed": True},
    )


def scaler_dropped_after(session: Session) -> int | None:
    """The last step a GradScaler worked in, when finished steps after it had none (a
    loop that dropped its scaler for ``model.half()`` and a plain optimizer step): those
    steps' gradients had no loss scale. None when the scaler worked to the end."""
    sc = session.scaler
    if not session.amp.scaler or sc is None or not sc.enabled:
        return None
    if sc.last_step is not None:
        # Known for every step, recorded or not (the monitor sees each optimizer step).
        return sc.last_step if sc.last_step < session.steps - 1 else None
    # An older report: the last recorded step with a scale, if recorded steps followed it.
    # Not a step the run ended in before it finished (recorded without its update).
    done = [r for r in session.history if r.step < session.steps]
    scaled = [r.step for r in done if r.scale is not None]
    if not scaled or not any(r.step > scaled[-1] for r in done):
        return None
    return scaled[-1]


def _grad_under_unscaled(lay: LayerSummary) -> float | None:
    vals = [v for v in (lay.grad_underflow_frac_unscaled if lay.ran_low_precision else None,
                        lay.param_grad_underflow_frac_unscaled) if v is not None]
    return max(vals) if vals else None


# float16's subnormals, 2**-24 <= |x| < 2**-14, in the float32-exponent bins.
_F16_SUBNORMAL_BINS = range(-24 + _F32_BIAS, -14 + _F32_BIAS)


def _act_underflow_text(session: Session, lay: LayerSummary, counted: float,
                        what: str) -> str:
    """'34.4% of its output values over 3 recorded steps were <what> (90.2% at step 0;
    5.4% counting only those within 16 bits of its largest output ...)': the share the
    layer table shows, its worst step, and the share that counts when it differs (review
    55b: three figures for one metric, none of them the table's)."""
    steps = [(ls.act.underflow_frac, r.step) for r in session.history
             if (ls := r.layers.get(lay.name)) is not None and ls.act is not None
             and ls.act.numel]
    n = lay.recorded_steps
    text = (f"{F.pct(lay.underflow_frac)} of its output values"
            + (f" over {n} recorded steps" if n > 1 else "") + f" were {what}")
    extra = []
    if len(steps) > 1:
        worst, at = max(steps)
        if worst > lay.underflow_frac + 0.01:
            extra.append(f"{F.pct(worst)} at step {at}")
    if abs(counted - lay.underflow_frac) > 0.01:
        extra.append(f"{F.pct(counted)} counting only those within {ACT_RELEVANT_BITS} bits "
                     f"of its largest output over the run, {F.num(lay.absmax)}")
    return text + (f"; {'; '.join(extra)}" if extra else "")


def _act_underflow_that_counts(lay: LayerSummary, fmt: str) -> float:
    """The layer's output underflow share, with the float16 subnormals that lie more than
    :data:`ACT_RELEVANT_BITS` below its largest |value| left out (they move no float16
    result they feed). Other formats: the share as recorded."""
    hist, top = lay.act_exp_hist, lay.absmax
    if fmt != "float16" or not hist or not top or not math.isfinite(top):
        return lay.underflow_frac
    lowest = math.floor(math.log2(top)) + _F32_BIAS - ACT_RELEVANT_BITS
    sub = sum(hist[b] for b in _F16_SUBNORMAL_BINS)
    counted = sum(hist[b] for b in _F16_SUBNORMAL_BINS if b >= lowest)
    return lay.underflow_frac * (counted / sub) if sub else lay.underflow_frac


def _grad_underflow_that_counts(lay: LayerSummary) -> float | None:
    """:func:`grad_underflow`, with the output gradient's subnormals that lie more than
    :data:`GRAD_RELEVANT_BITS` below its largest value left out (they change no sum they
    are in); a parameter gradient's count as they are."""
    gu = grad_underflow(lay)
    hist, top = lay.grad_exp_hist, lay.grad_absmax
    if gu is None or not hist or not top or not math.isfinite(top) or \
            lay.grad_underflow_frac is None:
        return gu
    lowest = math.floor(math.log2(top)) + _F32_BIAS - GRAD_RELEVANT_BITS
    total = sum(hist)
    counted = sum(hist[b] for b in _F16_SUBNORMAL_BINS if b >= lowest)
    # The mean share over the recorded steps, scaled down by what is left out of it.
    share = lay.grad_underflow_frac * (counted / max(
        sum(hist[b] for b in _F16_SUBNORMAL_BINS), 1e-300)) if total else 0.0
    if not lay.ran_low_precision and lay.param_grad_underflow_frac is not None:
        return grad_underflow(lay)  # a float32 layer is judged by its parameters' gradient
    params = lay.param_grad_underflow_frac
    return max(share, params) if params is not None else share


def grad_underflow(lay: LayerSummary) -> float | None:
    """Underflow of the gradients as they ran (scaled, when a scaler was in use)."""
    vals = [v for v in (lay.grad_underflow_frac, lay.param_grad_underflow_frac) if v is not None]
    if not vals:
        return None
    if lay.grad_underflow_frac is not None and not lay.ran_low_precision:
        # An fp32 layer's output gradient is fp32 too; what matters is the
        # gradient that flowed through low precision, i.e. its params'.
        vals = [lay.param_grad_underflow_frac] if lay.param_grad_underflow_frac is not None \
            else []
        return vals[0] if vals else None
    return max(vals)


# The end of the message torch raises when a Python number meets a float16 (or bfloat16)
# tensor it does not fit: ``scores.masked_fill(mask, -1e9)`` on an autocast output.
_CONSTANT_OVERFLOW = re.compile(r"cannot be converted to type c10::(Half|BFloat16) without "
                                r"overflow")


# The message of ``clip_grad_norm_(..., error_if_nonfinite=True)`` on inf/NaN gradients.
_CLIP_NONFINITE = re.compile(r"The total norm of order \S+ for gradients from `parameters` "
                             r"is non-finite, so it cannot be clipped")


def run_findings(session: Session) -> Iterable[Finding]:
    """A run that died before its first step finished is never "healthy"; a run that died
    of a constant float16 cannot hold is told why."""
    err = session.run.error or ""
    hit = _CONSTANT_OVERFLOW.search(err) if session.run.outcome == "exception" else None
    if hit is not None:
        fmt = "float16" if hit.group(1) == "Half" else "bfloat16"
        where = f" at {session.run.error_at}" if session.run.error_at else ""
        yield Finding(
            kind="constant_overflow", severity="error", module=None, op=None, step=None,
            message=(f"The run raised {err!r}{where} after {F.counted(session.steps, 'step')}: a "
                     f"Python number too large for {fmt} (its max is "
                     f"{FORMAT_MAX.get(fmt, 0):g}) was written into a {fmt} tensor, "
                     "typically a mask value such as `scores.masked_fill(mask, -1e9)` on "
                     "attention scores that autocast computed in " + fmt + "."),
            advice=ADVICE["constant_overflow"],
            data={"dtype": fmt, "error": err, "at": session.run.error_at},
        )
        return  # the run's end is this finding's: not a second error for it
    clip = _CLIP_NONFINITE.search(err) if session.run.outcome == "exception" else None
    if clip is not None and session.amp.scaler:
        where = f" at {session.run.error_at}" if session.run.error_at else ""
        grew = session.scaler is not None and session.steps - 1 in session.scaler.growth_steps
        # The scaler's own probes: its first steps, or the step after a growth. Elsewhere
        # the inf/NaN is the run's own (review 46c: a sqrt of a negative at step 12).
        probe = session.steps < CALIBRATION_START or grew
        yield Finding(
            kind="clip_error_if_nonfinite", severity="error", module=None, op=None,
            step=session.steps,
            message=(f"The run raised{where} at step {session.steps}: "
                     "clip_grad_norm_(..., error_if_nonfinite=True) met inf/NaN gradients. "
                     + ("With a GradScaler they are expected now and then: at its start "
                        "(init_scale) and after each growth it tries a scale too large for the "
                        "gradients, and scaler.step skips that step and lowers the scale. The "
                        "error stopped the run at the first of them" + (
                            " (the scale had grown at the step before)" if grew else "")
                        if probe else
                        "Not at the GradScaler's start nor after a growth of its scale: the "
                        "inf/NaN is the run's own (an op that made it in the forward or "
                        "backward pass, or a bad batch)") + "."),
            advice=ADVICE["clip_error_if_nonfinite" if probe else "clip_error_real_nonfinite"],
            data={"error": err, "at": session.run.error_at, "scaler_probe": probe},
        )
        return
    if session.steps == 0 and session.run.outcome in ("exception", "interrupted", "exit") and (
            session.run.outcome != "exit" or session.run.exit_code not in (None, 0)):
        yield Finding(
            kind="run_ended_early", severity="error", module=None, op=None, step=None,
            message=(f"The run ended ({session.run.outcome}"
                     + (f": {session.run.error}" if session.run.error else "")
                     + f") before its first training step finished; "
                     f"{session.recorded_steps} partial step(s) recorded. There is nothing "
                     "to judge AMP by yet."),
            advice=ADVICE["run_ended_early_interrupted" if session.run.outcome == "interrupted"
                          else "run_ended_early"],
        )


def autocast_findings(session: Session) -> Iterable[Finding]:
    lows = any(lay.ran_low_precision for lay in session.layers)
    if not session.recorded_steps or any(
            e.kind == "model_not_run" or (e.kind == "scripted_module"
                                          and e.data.get("severity") == "warning")
            for e in session.events):
        return  # (no forward of the model was seen: model_not_run, or its TorchScript, says so)
    n = session.recorded_steps
    recorded = f"{n} recorded step{'' if n == 1 else 's'}"
    if lows and not session.amp.autocast_seen:
        # Layers low by their own weights (a frozen .half() encoder) beside float32 ones
        # with weights: autocast is off for the rest (torch.cuda.amp.autocast on a machine
        # without CUDA disables itself), which "healthy" would hide. All of them low is
        # pure low-precision training, on purpose.
        own = [lay.name for lay in session.layers if lay.ran_low_precision]
        wide = [lay.name for lay in session.layers if not lay.ran_low_precision
                and lay.param_dtypes and lay.output_dtypes and not lay.passthrough]
        if own and wide:
            yield Finding(
                kind="autocast_inactive", severity="warning", module=None, op=None, step=None,
                message=(f"Autocast was not active during the forward pass in {recorded}: "
                         f"only {F.counted(len(own), 'layer')} with low-precision weights "
                         f"ran in low precision ({', '.join(own[:4])}"
                         + (", ..." if len(own) > 4 else "") + f"), and the other "
                         f"{F.counted(len(wide), 'layer')} with weights ran in float32 "
                         f"({', '.join(wide[:4])}" + (", ..." if len(wide) > 4 else "") + ")."),
                advice=ADVICE["autocast_inactive"],
                data={"low_by_weights": own},
            )
        return
    if lows:
        return
    if not session.amp.autocast_seen:
        yield Finding(
            kind="autocast_inactive", severity="warning", module=None, op=None, step=None,
            message=(f"No layer ran in float16 or bfloat16 in {recorded}: autocast was not "
                     "active during the forward pass."),
            advice=ADVICE["autocast_inactive"],
        )
        return
    # Autocast was on, yet every recorded layer's output stayed wide: the run pays for
    # AMP's machinery and gets none of its savings, which "healthy" would hide.
    ran = [lay for lay in session.layers if lay.output_dtypes]
    if not ran:
        return  # nothing recorded to judge by (e.g. the whole model compiled)
    forced = session.run.fp32_modules
    if forced and (set(forced) & set(session.run.models) or all(
            any(lay.name == m or lay.name.startswith(m + ".") for m in forced)
            # A layer without weights follows its input's dtype: float32 after them.
            or not lay.param_dtypes for lay in ran)):
        return  # `--fp32` put every layer with weights in float32, as asked
    wide = sorted({d for lay in ran for d in lay.output_dtypes})
    f64 = any("float64" in lay.input_dtypes for lay in ran)
    low = session.amp.dtype or "low precision"
    why = ("the layers ran in float64, which autocast never casts" if f64 else
           f"every op these layers ran stays {'/'.join(wide)} under autocast on "
           f"{session.amp.device_type or 'this device'}")
    yield Finding(
        kind="autocast_inactive", severity="warning", module=None, op=None, step=None,
        message=(f"Autocast ({low}) was on, yet no layer ran in {low} in "
                 f"{recorded}: {why}."),
        advice=ADVICE["autocast_float64" if f64 else "autocast_no_low_ops"],
        data={"autocast_on": True, "output_dtypes": wide},
    )
