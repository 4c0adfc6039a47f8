"""Session -> findings, each with a message carrying the numbers and advice naming the fix.

Every threshold is a named constant below. Analysis reads only the
session's records, so a saved JSON file analyses the same way again.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import replace

from .records import Event, Finding, LayerSummary, ScalerEvent, Session, Severity

__all__ = [
    "analyze",
    "event_advice",
    "risk_order",
    "RISK_HEADROOM_BITS",
    "LOWP_UNCHANGED_WARN",
    "ADVICE",
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

# Any value beyond the format's max in a layer that ran in low precision is
# an inf in the user's forward pass.
OVERFLOW_FRAC_ERROR = 0.0
# Less than one bit of exponent left: the next larger batch can overflow.
HEADROOM_WARN_BITS = 1.0
# Share of an activation's values that flush to zero / lose precision.
ACT_UNDERFLOW_WARN = 0.05
# Share of a layer's gradient values that flush to zero in the low-precision format.
GRAD_UNDERFLOW_WARN = 0.10
# Share of exact zeros in the output gradient of a layer that runs before (in
# forward order) one whose gradients underflow: they arrived flushed to zero.
GRAD_FLUSHED_WARN = 0.90
# The scale has no business below 1: the loss is then scaled *down*.
SCALE_COLLAPSE_MIN = 1.0
# Backoffs in more than this share of steps (after calibration) is a collapse.
BACKOFF_SHARE_COLLAPSE = 0.2
# Or this many backoffs in a row.
BACKOFF_RUN_COLLAPSE = 5
# GradScaler starts at 2**16 and backs off until the scale fits: a short run of
# backoffs that starts in the first few steps is normal calibration, not a problem.
CALIBRATION_START = 3
# Backoffs in the first steps are not counted in the share of backoffs below.
CALIBRATION_STEPS = 20
# No growth across this many growth intervals means the scale is stuck.
STUCK_INTERVALS = 3
# Anomaly mode: a backward op whose float16 output overflowed to inf (no NaN)
# while a GradScaler was on is the scaler's own business, as long as it
# happens in at most this many steps (calibration); more is a warning.
SCALED_GRAD_OVERFLOW_INFO_STEPS = 3
# At most this many findings of one kind are itemised; the rest are counted.
MAX_PER_KIND = 8
# "Worst first": a layer within this many bits of the format's max ranks by its
# headroom, ahead of every layer that only has some underflow.
RISK_HEADROOM_BITS = 8.0
# Pure float16/bfloat16 training: when more than this share of the sampled weight
# elements that had a non-zero gradient did not change in the optimizer step, the
# updates are below the format's resolution.
LOWP_UNCHANGED_WARN = 0.5

SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}

ADVICE: dict[str, str] = {
    "activation_overflow": (
        "Keep this layer in float32: wrap its call in "
        "`with torch.autocast(device_type, enabled=False): out = layer(x.float())`, "
        "or train with `dtype=torch.bfloat16`, which has float32's range. If the "
        "weights grew large, add weight decay or normalisation before it."
    ),
    "activation_headroom": (
        "Values are within 2x of the format's max: rescale the input (normalise it), "
        "or run this layer in float32 with `torch.autocast(device_type, enabled=False)`."
    ),
    "activation_underflow": (
        "Small values flush to zero in this format: use `dtype=torch.bfloat16` (same range "
        "as float32), or compute this layer in float32 with "
        "`torch.autocast(device_type, enabled=False)`; avoid tiny constants such as eps=1e-8 "
        "(use >= 1e-5 in float16)."
    ),
    "gradient_underflow": (
        "Gradients flush to zero in float16: use `torch.amp.GradScaler(device_type)` and "
        "call `scaler.scale(loss).backward()`; if a scaler is in use, raise `init_scale` "
        "or lower `growth_interval` so the scale can grow; or switch to bfloat16."
    ),
    "missing_scaler": (
        "float16 autocast without a GradScaler lets small gradients flush to zero. Create "
        "`scaler = torch.amp.GradScaler(device_type)` and use `scaler.scale(loss).backward()`, "
        "`scaler.step(optimizer)`, `scaler.update()`; or use `dtype=torch.bfloat16`."
    ),
    "autocast_inactive": (
        "Nothing ran in float16/bfloat16. Wrap the forward pass and loss in "
        "`with torch.autocast(device_type='cuda' or 'cpu', dtype=torch.float16):` and check "
        "that `enabled=` is True and the device_type matches where the model lives."
    ),
    "scaler_backoff": (
        "Each backoff is a skipped optimizer step caused by inf/NaN gradients. Look at the "
        "first culprit layer: keep it in float32 with `torch.autocast(device_type, "
        "enabled=False)`, add normalisation, lower the learning rate, or use bfloat16."
    ),
    "scale_collapse": (
        "The loss scale keeps falling because gradients keep overflowing; the optimizer is "
        "skipping steps. Fix the culprit layer named in the backoffs (run it in float32 or "
        "use bfloat16); do not just lower `init_scale`. If the model was trained in bf16, "
        "fine-tune it in bf16 (`dtype=torch.bfloat16`) rather than float16."
    ),
    "scale_stuck": (
        "The scale cannot grow because some scaled gradient keeps reaching float16's max. "
        "Look at the layer named in the message (least gradient headroom, or first culprit): "
        "run it in float32 with `with torch.autocast(device_type, enabled=False): "
        "y = layer(x.float())`, normalise its input, or train in bfloat16 "
        "(`dtype=torch.bfloat16`). Harmless if no gradient underflows at the current scale."
    ),
    "clip_before_unscale": (
        "Call `scaler.unscale_(optimizer)` before `torch.nn.utils.clip_grad_norm_(...)`: "
        "clipping scaled gradients clips at max_norm * scale, so the clip does nothing "
        "(or everything)."
    ),
    "missing_update": (
        "Call `scaler.update()` once per iteration, after `scaler.step(optimizer)` for every "
        "optimizer (with gradient accumulation: after the last micro-step's `scaler.step`). "
        "Without it the scale never adapts and the next `scaler.step` raises."
    ),
    "scaler_with_bf16": (
        "bfloat16 has float32's exponent range, so a GradScaler is not needed: remove it, or "
        "construct it with `enabled=False` (`torch.amp.GradScaler(device_type, enabled=False)`)."
    ),
    "fp16_params": (
        "Keep parameters in float32 and let autocast cast them: remove `model.half()` (or "
        "`.to(torch.float16)`; use `model.float()`), keep `torch.autocast(device_type, "
        "dtype=torch.float16)` around the forward pass and the GradScaler as is. GradScaler's "
        "`unscale_` refuses float16 gradients ('Attempting to unscale FP16 gradients') because "
        "unscaling in float16 would itself underflow/overflow. For pure-float16 weights keep a "
        "float32 master copy, or use bfloat16 without a scaler."
    ),
    "scheduler_on_skipped_step": (
        "Step the scheduler only when the optimizer stepped: `scale = scaler.get_scale(); "
        "scaler.update(); if scaler.get_scale() >= scale: scheduler.step()`. Usually harmless "
        "for a few skips during calibration."
    ),
    "loss_not_scaled": (
        "Call `scaler.scale(loss).backward()`, not `loss.backward()`, while a GradScaler is "
        "enabled; otherwise `scaler.step` unscales gradients that were never scaled and "
        "divides them by the scale."
    ),
    "backward_in_autocast": (
        "Call backward outside the autocast block: `with torch.autocast(device_type, "
        "dtype=...): loss = loss_fn(model(x), y)` and then, dedented, "
        "`scaler.scale(loss).backward()`. Autocast should wrap only the forward pass and the "
        "loss; backward ops already run in the dtype their forward used."
    ),
    "nonfinite_forward": (
        "Keep this op in float32: wrap it in `with torch.autocast(device_type, "
        "enabled=False):` and cast its input with `.float()`; or use bfloat16. For "
        "log(softmax) use `torch.log_softmax`; for divisions add an epsilon representable "
        "in float16 (>= 1e-5) or clamp the denominator."
    ),
    "nonfinite_backward": (
        "The backward of this op produced NaN/Inf: run the forward op in float32 with "
        "`torch.autocast(device_type, enabled=False)`, clamp its input, or use bfloat16."
    ),
    "nonfinite_input": (
        "The batch itself contains NaN/Inf: check the data pipeline "
        "(`torch.isfinite(x).all()` on each batch) before blaming the model."
    ),
    "scaled_grads_stepped": (
        "Let the scaler step the optimizer: `scaler.scale(loss).backward(); "
        "scaler.step(optimizer); scaler.update()`. If you need the gradients first (clipping), "
        "call `scaler.unscale_(optimizer)` before using them. `optimizer.step()` on scaled "
        "gradients makes every update `scale` times too large and never skips inf/NaN steps."
    ),
    "nonfinite_loss": (
        "A NaN/inf loss poisons every gradient. Look where it first appeared: a layer's "
        "output (run it in float32 with `torch.autocast(device_type, enabled=False)`), or the "
        "loss computation itself (a fully masked attention row or an all-ignored batch gives "
        "0/0: mask with a large negative number instead of -inf, or skip empty batches; "
        "compute the loss in float32 with `loss_fn(out.float(), y)`)."
    ),
    "no_step_boundary": (
        "amp-doctor ends a step at `scaler.update()`, at `optimizer.step()`, or at the next "
        "forward after a backward once the weights changed. None of these happened: call "
        "`doctor.step()` at the end of each iteration (with `doctor = amp_doctor.watch(model)`)."
    ),
    "steps_from_backward": (
        "No optimizer or GradScaler was seen, so each step was taken to end when the loop "
        "updated the weights (or reset the gradients) after a backward. If your loop differs, "
        "call `doctor.step()` at the end of each iteration."
    ),
    "lowp_updates_lost": (
        "Keep float32 master weights: remove `model.half()` / `.to(torch.float16)`, keep the "
        "model in float32 and run the forward under `torch.autocast(device_type, "
        "dtype=torch.float16)` with a `torch.amp.GradScaler`; the optimizer then updates the "
        "float32 weights, where small updates are not rounded away."
    ),
    "run_ended_early": (
        "Fix the error that stopped the script (see the outcome above), then run again: "
        "amp-doctor judges training steps, and none finished."
    ),
}

# The same advice for a run that already trains in bfloat16: never "use bfloat16".
ADVICE_BF16: dict[str, str] = {
    "activation_overflow": (
        "bfloat16 has float32's range, so this is not the format overflowing: an op made "
        "inf/NaN (log(0), x/0, exp of a large value) or the weights diverged. Find the op "
        "with anomaly mode (`amp-doctor diagnose --anomaly` or `watch(model, anomaly=True)`) "
        "and keep it in float32 with `torch.autocast(device_type, enabled=False)`; lower the "
        "learning rate or add weight decay if the weights grew."
    ),
    "activation_underflow": (
        "Compute this layer in float32 with `torch.autocast(device_type, enabled=False)`, "
        "and avoid constants below bfloat16's resolution."
    ),
    "scaler_backoff": (
        "Each backoff is a skipped optimizer step caused by inf/NaN gradients. Look at the "
        "first culprit layer: keep it in float32 with `torch.autocast(device_type, "
        "enabled=False)`, add normalisation, or lower the learning rate."
    ),
    "scale_collapse": (
        "The loss scale keeps falling because gradients keep becoming inf/NaN; the optimizer "
        "is skipping steps. Fix the culprit layer named in the backoffs (run it in float32); "
        "under bfloat16 the GradScaler itself is not needed."
    ),
    "scale_stuck": (
        "The scale cannot grow because some scaled gradient keeps becoming inf/NaN; under "
        "bfloat16 the GradScaler is not needed (`GradScaler(device_type, enabled=False)`)."
    ),
    "nonfinite_forward": (
        "Keep this op in float32: wrap it in `with torch.autocast(device_type, "
        "enabled=False):` and cast its input with `.float()`. For log(softmax) use "
        "`torch.log_softmax`; for divisions add an epsilon or clamp the denominator."
    ),
    "nonfinite_backward": (
        "The backward of this op produced NaN/Inf: run the forward op in float32 with "
        "`torch.autocast(device_type, enabled=False)` or clamp its input."
    ),
}


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def risk_order(layers: list[LayerSummary]) -> list[LayerSummary]:
    """Worst layers first: the order of the text report and TensorBoard's top-k.

    Non-finite outputs or gradients, then outputs beyond the format's max, then
    the layers closest to the max (within ``RISK_HEADROOM_BITS``, least headroom
    first), then underflow (largest share first), then the remaining headroom.
    """

    def key(lay: LayerSummary) -> tuple[float, ...]:
        nonfinite = lay.nonfinite_steps + lay.grad_nonfinite_steps + lay.param_grad_nonfinite_steps
        head = lay.headroom if not math.isnan(lay.headroom) else math.inf
        gu = max(v for v in (lay.grad_underflow_frac, lay.param_grad_underflow_frac, 0.0)
                 if v is not None)
        close = head < RISK_HEADROOM_BITS
        return (
            -float(nonfinite > 0),
            -float(lay.ran_low_precision and lay.overflow_frac > 0),
            0.0 if close else 1.0,
            head if close else -max(lay.underflow_frac, gu),
            head,
            lay.order,
        )

    return sorted(layers, key=key)


def analyze(session: Session) -> list[Finding]:
    out: list[Finding] = []
    for fn in _RULES:
        out.extend(fn(session))
    out = _fold_follow_ons(session, out)
    out = _fold_early_end(out)
    if session.amp.dtype == "bfloat16":
        out = [_bf16_advice(f) for f in out]
    out = _cap(out)
    # Same severity and step: causes before their consequences on the loss scale.
    out.sort(key=lambda f: (SEVERITY_RANK[f.severity], f.step if f.step is not None else 0,
                            f.kind in ("scale_collapse", "scaler_backoff", "scale_stuck")))
    return out


# Findings that only say the run stopped short: when an error names why it stopped
# (fp16_params: scaler.step raised), they are that error's consequence, not a cause.
EARLY_END_KINDS = ("run_ended_early", "no_step_boundary")


def _fold_early_end(out: list[Finding]) -> list[Finding]:
    causes = [f for f in out if f.severity == "error" and f.kind not in EARLY_END_KINDS]
    if not causes:
        return out
    return [dataclasses.replace(f, severity="info", data={**f.data,
                                                          "follow_on_of": causes[0].kind})
            if f.kind in EARLY_END_KINDS else f for f in out]


def _bf16_advice(f: Finding) -> Finding:
    """A bfloat16 run is never told to train in bfloat16."""
    if "bfloat16" not in f.advice or f.kind == "scaler_with_bf16":
        return f
    adv = ADVICE_BF16.get(f.kind)
    if adv is None or f.op:
        # Op-specific advice: drop the sentence that proposes bfloat16.
        adv = " ".join(x for x in re.split(r"(?<=[.])\s+", f.advice)
                       if "bfloat16" not in x) or (adv or "")
    return replace(f, advice=adv)


def _with(f: Finding, severity: Severity | None = None, extra: str = "",
          **data: object) -> Finding:
    msg = f.message + (" " + extra if extra else "")
    return replace(f, severity=severity or f.severity, message=msg, data={**f.data, **data})


_ROOT_KINDS = ("activation_overflow", "nonfinite_input", "nonfinite_forward",
               "nonfinite_backward")


def _fold_follow_ons(session: Session, out: list[Finding]) -> list[Finding]:
    """One error per independent root cause; its consequences go into its finding.

    * a layer whose output only carried an earlier layer's inf/NaN on (never the
      first non-finite layer in any recorded step) is listed in that origin's finding;
    * GradScaler backoffs, a collapsed scale and NaN losses that began at an origin
      become info, and the origin's finding says what they cost;
    * gradients underflowing because the scale collapsed, or because the gradients
      were clipped while still scaled, are listed in that finding, not advised on.
    """
    lay_by = {lay.name: lay for lay in session.layers}
    origin_layers = sorted((lay for lay in session.layers if lay.overflow_origin_steps > 0),
                           key=lambda x: x.order)
    errors = [f for f in out if f.severity == "error" and f.kind in _ROOT_KINDS]

    def root_for_module(module: str | None) -> Finding | None:
        for f in errors:
            if module is not None and f.module == module:
                return f
        return None

    carried: dict[int, list[str]] = {}
    consequences: dict[int, list[str]] = {}
    kept: list[Finding] = []
    for f in out:
        lay = lay_by.get(f.module or "")
        if (f.kind == "activation_overflow" and f.severity == "error" and f.op is None
                and lay is not None and lay.overflow_origin_steps == 0):
            before = [o for o in origin_layers if o.order < lay.order]
            root = root_for_module(before[-1].name) if before else None
            if root is None:
                root = next((e for e in errors if e.kind in ("nonfinite_input",
                                                             "nonfinite_forward")), None)
            if root is not None and root is not f:
                carried.setdefault(id(root), []).append(lay.name)
                continue
        kept.append(f)
    out = kept
    # The scaler and the loss: consequences of the origin they name.
    collapse = next((f for f in out if f.kind == "scale_collapse"), None)
    clip = next((f for f in out if f.kind == "clip_before_unscale"), None)
    kept = []
    for f in out:
        origin = None
        if f.kind == "scaler_backoff" and f.severity == "warning":
            origin = f.data.get("forward_origin")
        elif f.kind == "scale_collapse":
            origin = f.data.get("origin")
        elif f.kind == "nonfinite_loss":
            origin = f.data.get("origin")
        root = root_for_module(origin) if isinstance(origin, str) else None
        if root is None and f.kind == "nonfinite_loss":
            root = next((e for e in errors if e.kind == "nonfinite_input"), None)
        if root is not None:
            consequences.setdefault(id(root), []).append(_consequence(f))
            f = _with(f, "info", follow_on_of=root.module)
        if f.kind == "gradient_underflow" and (collapse is not None or clip is not None):
            host = collapse if collapse is not None else clip
            assert host is not None
            carried.setdefault(id(host), []).append(f.module or "?")
            continue
        kept.append(f)
    result = []
    for f in kept:
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
        if id(f) in carried or id(f) in consequences:
            names = carried.pop(id(f), [])
            cons = consequences.pop(id(f), [])
            extra = ""
            if names:
                extra += (f"{len(names)} later layer(s) only carried its inf/NaN on and are "
                          f"not separate problems: {', '.join(names[:8])}"
                          + ("..." if len(names) > 8 else "") + ".")
            if cons:
                extra += (" " if extra else "") + "Consequences: " + "; ".join(cons) + "."
            f = _with(f, extra=extra, also_affected=names, consequences=cons)
        result.append(f)
    return result


def _consequence(f: Finding) -> str:
    d = f.data
    if f.kind == "scaler_backoff":
        return (f"GradScaler backed off {d.get('backoffs', f.count)}x and skipped that many "
                f"optimizer steps (scale {_scale_str(d.get('scale_before'))} -> "
                f"{_scale_str(d.get('scale_after'))})")
    if f.kind == "scale_collapse":
        return (f"the loss scale collapsed to {_scale_str(d.get('final_scale'))} "
                f"({d.get('skipped')} optimizer steps skipped)")
    if f.kind == "nonfinite_loss":
        return (f"the loss was NaN/inf in {d.get('steps_bad')} of the {d.get('checked')} "
                "steps checked")
    return f.kind


def _cap(findings: list[Finding]) -> list[Finding]:
    by_kind: dict[str, list[Finding]] = {}
    for f in findings:
        by_kind.setdefault(f.kind, []).append(f)
    out: list[Finding] = []
    for fs in by_kind.values():
        out.extend(fs[:MAX_PER_KIND])
        if len(fs) > MAX_PER_KIND:
            last = fs[MAX_PER_KIND - 1]
            rest = len(fs) - MAX_PER_KIND + 1
            out[-1] = Finding(**{**last.__dict__, "count": rest,
                                  "message": last.message + f" (and {rest - 1} more like it)"})
    return out


def _low(session: Session) -> str:
    return session.amp.dtype or "float16"


def _layers_rules(session: Session) -> Iterable[Finding]:
    fmt = _low(session)
    # Gradients that underflowed in one layer reach the layers before it as
    # exact zeros: those layers are flushed, not merely subnormal.
    under = [lay for lay in session.layers if lay.recorded_steps and
             (_grad_under(lay) or 0.0) > GRAD_UNDERFLOW_WARN]

    def same_output(a: LayerSummary, b: LayerSummary) -> bool:
        # A container returning its last child's output is credited the same tensor.
        return (a.absmax, a.grad_absmax, a.grad_underflow_frac) == (
            b.absmax, b.grad_absmax, b.grad_underflow_frac)

    leaves = [c for c in under
              if not any(u.order < c.order and same_output(u, c) for u in under)]
    source = max(leaves, key=lambda x: x.order) if leaves else None
    for lay in session.layers:
        yield from _layer_findings(session, lay, fmt, source)


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
    if explained:
        pass
    elif lay.ran_low_precision and lay.overflow_frac > OVERFLOW_FRAC_ERROR and fmt == "bfloat16":
        # bfloat16's max is float32's: these values are inf/NaN an op made (log(0), x/0)
        # or diverged weights, not values beyond the format's range.
        yield Finding(
            kind="activation_overflow", severity="error", module=lay.name, op=None, step=None,
            message=(f"{lay.name} ({lay.type}) output went non-finite (inf/NaN) in "
                     f"{lay.nonfinite_steps} of {lay.recorded_steps} recorded steps "
                     f"({_pct(lay.overflow_frac)} of values in the worst step). bfloat16 has "
                     "float32's range, so this is not an overflow of the format: an op in it "
                     "made inf/NaN, or its weights diverged."),
            advice=ADVICE_BF16["activation_overflow"],
            data={"overflow_frac": lay.overflow_frac, "absmax": lay.absmax, "dtype": fmt},
        )
    elif lay.ran_low_precision and lay.overflow_frac > OVERFLOW_FRAC_ERROR:
        yield Finding(
            kind="activation_overflow", severity="error", module=lay.name, op=None, step=None,
            message=(f"{lay.name} ({lay.type}) output overflows {fmt}: "
                     f"{_pct(lay.overflow_frac)} of values beyond the format's max "
                     f"(worst step), non-finite in {lay.nonfinite_steps} of "
                     f"{lay.recorded_steps} recorded steps."),
            advice=ADVICE["activation_overflow"],
            data={"overflow_frac": lay.overflow_frac, "absmax": lay.absmax, "dtype": fmt},
        )
    elif lay.ran_low_precision and lay.headroom < HEADROOM_WARN_BITS and math.isfinite(
            lay.absmax) and lay.absmax > 0:
        yield Finding(
            kind="activation_overflow", severity="warning", module=lay.name, op=None,
            step=None,
            message=(f"{lay.name} ({lay.type}) output comes within {lay.headroom:.2f} bits of "
                     f"{fmt}'s max (absmax {_fmt(lay.absmax)})."),
            advice=ADVICE["activation_headroom"],
            data={"headroom": lay.headroom, "absmax": lay.absmax, "dtype": fmt},
        )
    elif lay.what_if and fmt == "float16" and lay.overflow_frac > 0 and session.amp.dtype:
        yield Finding(
            kind="activation_overflow", severity="info", module=lay.name, op=None, step=None,
            message=(f"{lay.name} ({lay.type}) stayed in float32; cast to {fmt} its output "
                     f"would overflow ({_pct(lay.overflow_frac)} of values). Keep it in "
                     "float32."),
            advice=ADVICE["activation_overflow"],
            data={"overflow_frac": lay.overflow_frac, "what_if": True},
        )
    if lay.ran_low_precision and lay.underflow_frac > ACT_UNDERFLOW_WARN:
        yield Finding(
            kind="activation_underflow", severity="warning", module=lay.name, op=None,
            step=None,
            message=(f"{lay.name} ({lay.type}): {_pct(lay.underflow_frac)} of output values "
                     f"are below {fmt}'s smallest normal (subnormal or flushed)."),
            advice=ADVICE["activation_underflow"],
            data={"underflow_frac": lay.underflow_frac, "dtype": fmt},
        )
    gu = _grad_under(lay)
    flushed = (source is not None and source is not lay and lay.order < source.order
               and lay.ran_low_precision and bool(lay.param_dtypes)
               and (lay.grad_zero_frac or 0.0) > GRAD_FLUSHED_WARN)
    if session.amp.dtype == "float16" and (
            (gu is not None and gu > GRAD_UNDERFLOW_WARN) or flushed):
        scaled = session.amp.scaler
        kind = "missing_scaler" if not scaled else "gradient_underflow"
        big = max((v for v in (lay.grad_absmax, lay.param_grad_absmax)
                   if v is not None and math.isfinite(v)), default=None)
        top = max((v for _, v in session.scaler.scale), default=None) if (
            scaled and session.scaler) else None
        if scaled and top is not None and top <= 1.0:
            # A scale that never rose above 1 lifts nothing: "with" and "without" coincide.
            tail = (f" although a GradScaler is on: its scale never rose above "
                    f"{_scale_str(top)}, so it lifts nothing (raise `init_scale`, e.g. "
                    "`torch.amp.GradScaler(device_type, init_scale=2.0**16)`)")
        elif scaled:
            gu_u = _grad_under_unscaled(lay)
            tail = (f" even with the loss scale ({_pct(gu_u)} would without it)"
                    if gu_u is not None else " even with the loss scale")
        else:
            sc = session.scaler
            tail = (", and the GradScaler is disabled (enabled=False"
                    + ("; torch.cuda.amp.GradScaler disables itself without CUDA"
                       if session.amp.device_type != "cuda" else "") + ")"
                    if sc is not None and not sc.enabled else ", and no GradScaler is in use")
        if gu is not None and gu > GRAD_UNDERFLOW_WARN:
            what = (f"{_pct(gu)} of its gradient values are below float16's smallest normal "
                    f"({_fmt(_F16_TINY)}) and lose precision or flush to zero{tail}"
                    + (f"; its largest |gradient| is {_fmt(big)}" if big else ""))
        else:
            assert source is not None
            what = (f"{_pct(lay.grad_zero_frac)} of its output-gradient values are exactly "
                    f"zero: the gradient had already underflowed float16 in {source.name} "
                    f"({_pct(_grad_under(source))} below the smallest normal), which runs "
                    f"before it in backward, and reached this layer flushed to zero{tail}")
        yield Finding(
            kind=kind, severity="warning", module=lay.name, op=None, step=None,
            message=f"{lay.name} ({lay.type}): {what}.",
            advice=ADVICE[kind],
            data={"grad_underflow_frac": gu, "grad_zero_frac": lay.grad_zero_frac,
                  "flushed_after": source.name if flushed and source else None,
                  "scaled": scaled, "grad_absmax": big},
        )


_F16_TINY = 2.0 ** -14


def _grad_under_unscaled(lay: LayerSummary) -> float | None:
    vals = [v for v in (lay.grad_underflow_frac_unscaled if lay.ran_low_precision else None,
                        lay.param_grad_underflow_frac_unscaled) if v is not None]
    return max(vals) if vals else None


def _grad_under(lay: LayerSummary) -> float | None:
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


def _run_rule(session: Session) -> Iterable[Finding]:
    """A run that died before its first step finished is never "healthy"."""
    if session.steps == 0 and session.run.outcome in ("exception", "interrupted", "exit") and (
            session.run.outcome != "exit" or session.run.exit_code not in (None, 0)):
        yield Finding(
            kind="run_ended_early", severity="error", module=None, op=None, step=None,
            message=(f"The run ended ({session.run.outcome}"
                     + (f": {session.run.error}" if session.run.error else "")
                     + f") before its first training step finished; "
                     f"{session.recorded_steps} partial step(s) recorded. There is nothing "
                     "to judge AMP by yet."),
            advice=ADVICE["run_ended_early"],
        )


def _autocast_rule(session: Session) -> Iterable[Finding]:
    lows = any(lay.ran_low_precision for lay in session.layers)
    if session.recorded_steps and not session.amp.autocast_seen and not lows:
        yield Finding(
            kind="autocast_inactive", severity="warning", module=None, op=None, step=None,
            message=(f"No layer ran in float16 or bfloat16 in {session.recorded_steps} recorded "
                     "steps: autocast was not active during the forward pass."),
            advice=ADVICE["autocast_inactive"],
        )


def _scale_str(x: float | None) -> str:
    """Loss scales are powers of two in practice: print 65536 as 65536, not 6.55e+04."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "?"
    if math.isinf(x):
        return "inf"
    if x >= 1 and x == int(x) and x < 1e12:
        return str(int(x))
    return f"{x:.4g}"


def _steps_str(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def _group_backoffs(backoffs: list[ScalerEvent]) -> list[list[ScalerEvent]]:
    """Backoffs in consecutive steps form one group (one episode of overflow)."""
    groups: list[list[ScalerEvent]] = []
    for e in backoffs:
        if groups and e.step - groups[-1][-1].step <= 1:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups


def _culprits_of(group: list[ScalerEvent]) -> list[str]:
    out: list[str] = []
    for e in group:
        for c in e.culprits:
            if c not in out:
                out.append(c)
    return out


def _normal_backoff(i: int, g: list[ScalerEvent], growths: list[ScalerEvent],
                    last_step: int) -> str | None:
    """Why a group of backoffs is GradScaler working as designed, or None.

    * calibration: the scale starts high (2**16) and halves in the first steps
      until the gradients fit: a short run, starting at once, that ends and
      leaves the scale >= 1;
    * probe: the scale grew, the next step overflowed, and one backoff put the
      scale back where it was before the growth.
    """
    if any(e.forward_origin or e.loss_nonfinite for e in g):
        # The loss itself was NaN/inf: the forward pass failed, whatever the scale.
        return None
    after = g[-1].scale_after
    prev = [x for x in growths if x.step < g[0].step]
    if (i == 0 and not prev and g[0].step < CALIBRATION_START
            and len(g) < BACKOFF_RUN_COLLAPSE and g[-1].step < last_step
            and not (after < SCALE_COLLAPSE_MIN)):
        return "calibration"
    if len(g) == 1 and prev and not (after < prev[-1].scale_before):
        return "probe"
    return None


def _skips_per_optimizer(session: Session, steps: list[int]) -> str:
    sc = session.scaler
    if sc is None:
        return ""
    want = set(steps)
    parts = [f"{name} {len(want.intersection(v))}"
             for name, v in sc.skipped_by_optimizer.items() if want.intersection(v)]
    return f" (skipped per optimizer: {', '.join(parts)})" if parts else ""


# Anomaly-mode origins, in the order they happen within a step.
_ORIGIN_RANK = {"nonfinite_input": 0, "nonfinite_forward": 1, "activation_overflow": 2,
                "nonfinite_backward": 3}


def _origins_by_step(session: Session) -> dict[int, tuple[str, str]]:
    """Per step, where anomaly mode saw the NaN/Inf begin: (module, how, in words)."""
    best: dict[int, tuple[int, str, str]] = {}
    for e in session.events:
        rank = _ORIGIN_RANK.get(e.kind)
        if rank is None or not e.module or (
                e.kind == "activation_overflow" and not e.data.get("hidden")):
            continue
        if e.kind == "nonfinite_input":
            how = f"the batch given to {e.module} already held NaN/Inf"
        elif e.kind == "nonfinite_backward":
            how = (f"the backward of {e.data.get('forward_op')} in {e.module} ({e.op}) was "
                   "the first op to go non-finite")
        elif e.kind == "activation_overflow":
            how = f"{e.op} overflowed inside {e.module} in the forward pass"
        else:
            how = f"{e.op} in {e.module} was the first op to produce NaN/Inf"
        if e.step not in best or rank < best[e.step][0]:
            best[e.step] = (rank, e.module, how)
    return {step: (m, how) for step, (_, m, how) in best.items()}


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
    for e in backoffs:
        if e.step in origins:
            known[e.step] = (origins[e.step][0], "anomaly")
        elif e.forward_origin:
            known[e.step] = (e.forward_origin, "recorded")
    with_params = {lay.name for lay in session.layers if lay.param_dtypes}
    refs = [(set(e.culprits), known[e.step][0]) for e in backoffs
            if e.step in known and e.culprits]
    for e in backoffs:
        if e.step in known or not e.culprits:
            continue
        mine = set(e.culprits)
        for theirs, where in refs:
            if mine <= theirs and 2 * len(mine) >= len(theirs & with_params):
                known[e.step] = (where, "inferred")
                break
    return known


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
            return (e.forward_origin, f"{e.forward_origin}'s output went non-finite first, "
                    "in the forward pass")
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


def _culprit_text(culprits: list[str], origin: tuple[str, str] | None,
                  lead: tuple[str | None, int, int] = (None, 0, 0)) -> str:
    if not culprits:
        text = ("; no watched layer had non-finite gradients (the inf/NaN was in parameters "
                "outside the watched model(s), or the optimizer checks for inf on the device, "
                "e.g. fused=True, so the gradients were not inspected)")
    else:
        shown = ", ".join(culprits[:6]) + ("..." if len(culprits) > 6 else "")
        text = (f"; non-finite gradients in {len(culprits)} layer(s), in backward order: "
                f"{shown}")
        top, n, total = lead
        if not origin and (top is None or top == culprits[0]):
            text += f". The first, {culprits[0]}, is where they appeared: look there"
        elif not origin:
            text += (f". {top} came first in {n} of {total} of these backoffs (the layers "
                     "before it stopped overflowing as the scale fell): look there")
    if origin:
        text += f". They began at {origin[0]}: {origin[1]}; look there"
    return text


def _scaler_rules(session: Session) -> Iterable[Finding]:
    sc = session.scaler
    if sc is None or not sc.enabled:
        return
    backoffs = sorted((e for e in sc.events if e.kind == "backoff"), key=lambda e: e.step)
    growths = sorted((e for e in sc.events if e.kind == "growth"), key=lambda e: e.step)
    groups = _group_backoffs(backoffs)
    last_step = session.steps - 1
    origins = _origins_by_step(session)
    normal: list[tuple[str, list[ScalerEvent]]] = []
    # Episodes with the same culprits are one finding: a recurring overflow
    # in the same layer is one problem, however often it strikes.
    by_culprits: dict[tuple[str, ...], list[list[ScalerEvent]]] = {}
    known = _backoff_origins(session, backoffs, origins)
    with_params = {lay.name for lay in session.layers if lay.param_dtypes}
    for i, g in enumerate(groups):
        why = _normal_backoff(i, g, growths, last_step)
        if why is not None:
            normal.append((why, g))
            continue
        # Episodes are one problem when they began at the same place: the same origin,
        # or else the same first culprit (recorded and unrecorded steps alike).
        # (A group spanning several origins is keyed by its first.)
        began = next((known[e.step][0] for e in g if e.step in known), None)
        key = ("origin", began) if began else ("lead", _top_lead(g, with_params)[0] or "")
        by_culprits.setdefault(key, []).append(g)
    for episodes in by_culprits.values():
        evs = [e for g in episodes for e in g]
        culprits = _culprits_of(evs)
        first, last = evs[0], evs[-1]
        steps = [e.step for e in evs]
        if len(episodes) == 1:
            span = f"step {first.step}" if len(evs) == 1 else f"steps {first.step}-{last.step}"
            head = (f"GradScaler backed off {len(evs)}x at {span}: the scale fell from "
                    f"{_scale_str(first.scale_before)} to {_scale_str(last.scale_after)}")
        else:
            head = (f"GradScaler backed off {len(evs)}x in {len(episodes)} separate episodes "
                    f"(steps {_steps_str(steps)}): the scale went from "
                    f"{_scale_str(first.scale_before)} before step {first.step} to "
                    f"{_scale_str(last.scale_after)} after step {last.step}")
        origin = _origin_of(evs, origins)
        top_lead, n_lead = _top_lead(evs, with_params)
        yield Finding(
            kind="scaler_backoff", severity="warning",
            # Where the non-finite values began, when known, is where to look.
            module=origin[0] if origin else (top_lead or (culprits[0] if culprits else None)),
            op=None,
            step=first.step,
            message=(f"{head}, and {len(evs)} optimizer step(s) were skipped"
                     f"{_skips_per_optimizer(session, steps)}"
                     f"{_culprit_text(culprits, origin, (top_lead, n_lead, len(evs)))}."),
            advice=ADVICE["scaler_backoff"],
            steps=steps[:50],
            data={"culprits": culprits, "scale_before": first.scale_before,
                  "scale_after": last.scale_after, "backoffs": len(evs),
                  "episodes": [[g[0].step, g[-1].step] for g in episodes][:50],
                  "forward_origin": origin[0] if origin else None},
        )
    if normal:
        steps = [e.step for _, g in normal for e in g]
        culprits = _culprits_of([e for _, g in normal for e in g])
        cal = [g for why, g in normal if why == "calibration"]
        probes = [g for why, g in normal if why == "probe"]
        parts = []
        if cal:
            g = cal[0]
            parts.append(f"{len(g)} while calibrating at the start (steps {g[0].step}-"
                         f"{g[-1].step}, scale {_scale_str(g[0].scale_before)} -> "
                         f"{_scale_str(g[-1].scale_after)})")
        if probes:
            parts.append(f"{len(probes)} right after a growth, each undoing it (steps "
                         f"{_steps_str([g[0].step for g in probes])})")
        yield Finding(
            kind="scaler_backoff", severity="info",
            module=culprits[0] if culprits else None, op=None, step=steps[0],
            message=(f"GradScaler backed off {len(steps)}x as designed: " + "; ".join(parts)
                     + ". Each skipped one optimizer step"
                     + (f"; layers with non-finite gradients then, in backward order: "
                        f"{', '.join(culprits[:6])}" if culprits else "") + "."),
            advice=("Nothing to fix: GradScaler searches for the largest scale that does not "
                    "overflow. If the start matters, pass a lower `init_scale` to "
                    "`torch.amp.GradScaler(device_type, init_scale=...)`."),
            steps=steps[:50],
            data={"culprits": culprits, "calibration": sum(len(g) for g in cal),
                  "probes": len(probes)},
        )
    # Collapse: below 1, or too many backoffs after calibration, or long runs of them.
    final = sc.scale[-1][1] if sc.scale else None
    min_scale = min((s for _, s in sc.scale), default=None)
    for e in backoffs:  # the timeline may be thinned; events are not
        if not math.isnan(e.scale_after):
            min_scale = e.scale_after if min_scale is None else min(min_scale, e.scale_after)
    post = [e for e in backoffs if e.step >= CALIBRATION_STEPS]
    eligible = max(session.steps - CALIBRATION_STEPS, 0)
    runs = [g for i, g in enumerate(groups) if len(g) >= BACKOFF_RUN_COLLAPSE and (
        i > 0 or g[0].step >= CALIBRATION_STEPS or g[-1].step >= last_step
        or g[-1].scale_after < (sc.init_scale or 65536.0) / 2 ** (2 * BACKOFF_RUN_COLLAPSE))]
    reasons = []
    if min_scale is not None and min_scale < SCALE_COLLAPSE_MIN:
        below = next((e.step for e in backoffs if e.scale_after < SCALE_COLLAPSE_MIN), None)
        reasons.append(f"the scale fell to {_scale_str(min_scale)} (below "
                       f"{SCALE_COLLAPSE_MIN:g}" + (f", first at step {below}" if below is not
                                                    None else "") + ")")
    if eligible >= 10 and len(post) / eligible > BACKOFF_SHARE_COLLAPSE:
        reasons.append(f"{len(post)} backoffs in the {eligible} steps after the first "
                       f"{CALIBRATION_STEPS} ({100 * len(post) / eligible:.0f}%)")
    if runs:
        g = max(runs, key=len)
        reasons.append(f"{len(g)} backoffs in a row at steps {g[0].step}-{g[-1].step} (scale "
                       f"{_scale_str(g[0].scale_before)} -> {_scale_str(g[-1].scale_after)})")
    if reasons:
        traced = [known[e.step][0] for e in backoffs if e.step in known]
        top: str | None = None
        if traced:
            top = max(dict.fromkeys(traced), key=traced.count)
            hows = [known[e.step][1] for e in backoffs if e.step in known
                    and known[e.step][0] == top]
            seen_n = sum(h != "inferred" for h in hows)
            untraced = len(backoffs) - len(traced)
            where = (f"; the non-finite values started at {top} in {len(hows)} of "
                     f"{len(backoffs)} backoffs ({seen_n} seen in that step"
                     + (f", {len(hows) - seen_n} inferred for unrecorded steps whose "
                        "gradients went non-finite in the same layers" if len(hows) > seen_n
                        else "") + ")"
                     + (f"; {untraced} backoff(s) on unrecorded steps could not be traced "
                        "(record every step with `every=1` to see them)" if untraced else ""))
        else:
            top, n_top = _top_lead(backoffs, with_params)
            where = (f"; the first layer with non-finite gradients was {top} in "
                     f"{n_top} of {len(backoffs)} backoffs" if top else "")
        yield Finding(
            kind="scale_collapse", severity="error", module=top, op=None,
            step=backoffs[0].step if backoffs else None,
            message=(f"Loss scale collapsed: {'; '.join(reasons)}. {len(sc.skipped_steps)} of "
                     f"{session.steps} optimizer steps were skipped; final scale "
                     f"{_scale_str(final)}{where}."),
            advice=ADVICE["scale_collapse"],
            steps=[e.step for e in backoffs][:50],
            data={"min_scale": min_scale, "final_scale": final, "backoffs": len(backoffs),
                  "skipped": len(sc.skipped_steps), "culprit": top,
                  "origin": top if traced else None},
        )
    gi = sc.growth_interval or 2000
    if reasons or (sc.growth_factor is not None and sc.growth_factor <= 1):
        return
    last_growth = growths[-1].step if growths else -1
    stretch = session.steps - (last_growth + 1)
    since = [e for e in backoffs if e.step > last_growth]
    if stretch >= STUCK_INTERVALS * gi and since:
        worst = _least_grad_headroom(session, final)
        culprits = [e.culprits[0] for e in since if e.culprits]
        top = max(dict.fromkeys(culprits), key=culprits.count) if culprits else None
        why = (f" The scaled gradients come closest to {_low(session)}'s max in {worst[0]}: "
               f"{worst[1]:.2f} bits of headroom, so doubling the scale leaves "
               f"{worst[1] - 1:.2f}." if worst else "")
        yield Finding(
            kind="scale_stuck", severity="warning", module=top or (worst[0] if worst else None),
            op=None, step=since[0].step,
            message=(f"The loss scale did not grow in the last {stretch} steps "
                     f"({stretch / gi:.1f} growth intervals of {gi}"
                     + (", since the growth at step " + str(last_growth) if growths else
                        ", i.e. never") + f"); it is {_scale_str(final)}. {len(since)} "
                     f"backoff(s) (steps {_steps_str([e.step for e in since])}) each reset "
                     f"GradScaler's count of clean steps before it reached {gi}"
                     + (f"; the first culprit was {top}" if top else "") + "." + why),
            advice=ADVICE["scale_stuck"],
            steps=[e.step for e in since][:50],
            data={"steps_without_growth": stretch, "growth_interval": gi,
                  "backoffs": len(since), "scale": final,
                  "least_headroom_layer": worst[0] if worst else None,
                  "least_headroom_bits": worst[1] if worst else None},
        )


def _least_grad_headroom(session: Session, scale: float | None) -> tuple[str, float] | None:
    """The layer whose scaled gradients come closest to the format's max, in bits.

    Output gradients are recorded as they ran (scaled). Parameter gradients are
    recorded unscaled; under autocast the weight gradient is computed in the
    low-precision format before it reaches the float32 ``.grad``, so it is
    judged at the current scale.
    """
    fmax = _FMT_MAX.get(_low(session), 65504.0)
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


_FMT_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}


_EVENT_SEVERITY: dict[str, Severity] = {
    "clip_before_unscale": "error",
    "missing_update": "error",
    "scaler_with_bf16": "info",
    "fp16_params": "error",
    "scheduler_on_skipped_step": "info",
    "loss_not_scaled": "error",
    "backward_in_autocast": "warning",
    "nonfinite_forward": "error",
    "nonfinite_backward": "error",
    "nonfinite_input": "error",
    "activation_overflow": "warning",
    "scaled_grads_stepped": "error",
    "nonfinite_loss": "error",
    "no_step_boundary": "warning",
    "steps_from_backward": "info",
    "lowp_updates_lost": "error",
    # Not recorded, and why: a compiled model's inner layers, tensors that cannot be summarised.
    "compiled_model": "info",
    "unsummarized": "info",
    "nonfinite_unlocated": "warning",
}


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _event_message(e: Event, n: int, steps: list[int] | None = None) -> str:
    d = e.data
    at = f"first at step {e.step}" if n > 1 else f"at step {e.step}"
    if e.kind == "clip_before_unscale":
        func = d.get("func", "clip_grad_norm_")
        scale = d.get("scale")
        msg = (f"{func} ran on gradients still multiplied by the loss scale "
               f"({_scale_str(scale)}): {_times(n)}, {at}, with no "
               "scaler.unscale_(optimizer) before it.")
        mx, tn = d.get("max_norm"), d.get("total_norm")
        if mx is not None and tn is not None and scale and math.isfinite(tn):
            msg += (f" The total norm it saw was {_fmt(tn)} (scaled; {_fmt(tn / scale)} "
                    f"unscaled) against max_norm={_fmt(mx)}")
            msg += (f", so the gradients were cut to norm {_fmt(mx / scale)} instead of "
                    f"{_fmt(mx)}." if tn > mx else
                    f": clipping would start only at an unscaled norm of {_fmt(mx / scale)}.")
        elif mx is not None and scale:
            msg += (f" max_norm={_fmt(mx)} applied to scaled gradients means an unscaled "
                    f"max_norm of {_fmt(mx / scale)}.")
        elif d.get("clip_value") is not None and scale:
            cv = d["clip_value"]
            msg += (f" clip_value={_fmt(cv)} applied to scaled gradients means the unscaled "
                    f"gradients were clipped at {_fmt(cv / scale)}.")
        return msg
    if e.kind == "scaler_with_bf16":
        return (f"A GradScaler (scale {_scale_str(d.get('scale'))}) is enabled while autocast "
                "runs in bfloat16, whose range equals float32's: the scaler only costs a "
                "host sync per step.")
    if e.kind == "fp16_params":
        numel = d.get("numel")
        size = f" ({numel:,} values)" if isinstance(numel, int) else ""
        return (f"{d.get('count', '?')} of the {d.get('total', '?')} parameters of "
                f"{d.get('optimizer', 'the optimizer')}{size} have float16 gradients (the "
                "parameters are float16, e.g. after model.half()) while a GradScaler is "
                "enabled: scaler.unscale_ (which scaler.step calls) raises 'Attempting to "
                f"unscale FP16 gradients.' ({at}). GradScaler refuses them because unscaling "
                "in float16 would underflow or overflow, and float16 weights lose the small "
                "updates anyway.")
    if e.kind == "scheduler_on_skipped_step":
        steps = steps or [e.step]
        sk = d.get("skipped_step")
        scale = ""
        if d.get("scale_before") is not None:
            scale = f" (scale {_scale_str(d.get('scale_before'))}"
            scale += (f" -> {_scale_str(d.get('scale_after'))})" if d.get("scale_after")
                      is not None else ")")
        return (f"{d.get('scheduler', 'LR scheduler')}.step() ran for "
                f"{d.get('optimizer', 'the optimizer')} after GradScaler skipped its optimizer "
                f"step: {_times(n)}, first for the skipped step {sk}{scale}. The learning-rate "
                "schedule advanced although the parameters did not change.")
    if e.kind == "loss_not_scaled":
        scale = d.get("scale")
        return (f"backward() ran on a loss that did not go through scaler.scale() while "
                f"GradScaler was enabled (scale {_scale_str(scale)}): in {n} step(s), {at}. "
                f"scaler.step then divides those gradients by {_scale_str(scale)}, so the "
                "update is that many times too small"
                + (" (the step mixed scaled and unscaled gradients)" if d.get("scaled_too")
                   else "") + ".")
    if e.kind == "backward_in_autocast":
        return (f"backward() was called inside an enabled torch.autocast region "
                f"(device {d.get('device')}, dtype {d.get('dtype')}) in {n} step(s), {at}.")
    if e.kind == "missing_update":
        reason = d.get("reason")
        opt = d.get("optimizer", "the optimizer")
        if reason == "never updated":
            return (f"scaler.step() ran {d.get('steps_total')} time(s) but scaler.update() "
                    f"never ran: the scale stayed at {_scale_str(d.get('scale'))} and never "
                    "adapted; the next scaler.step would raise 'step() has already been called "
                    "since the last update()'.")
        if reason == "step twice":
            return (f"scaler.step({opt}) was called again at step {e.step} without "
                    "scaler.update() since the previous scaler.step: torch raises 'step() has "
                    "already been called since the last update()'"
                    + (f" ({n} times)" if n > 1 else "") + ".")
        if reason == "unscale_ after step":
            return (f"scaler.unscale_({opt}) was called at step {e.step} after "
                    "scaler.step() without scaler.update() in between: torch raises "
                    "'unscale_() is being called after step()'.")
        return (f"scaler.unscale_({opt}) was called twice at step {e.step} without "
                "scaler.update() in between (e.g. in every micro-step of gradient "
                "accumulation): torch raises 'unscale_() has already been called on this "
                "optimizer since the last update()'. Call unscale_ once, right before "
                "clipping and scaler.step.")
    if e.kind == "scaled_grads_stepped":
        return (f"{d.get('optimizer', 'The optimizer')}.step() ran on gradients still "
                f"multiplied by the loss scale ({_scale_str(d.get('scale'))}): "
                "scaler.scale(loss).backward() was followed by optimizer.step() with neither "
                f"scaler.unscale_ nor scaler.step ({_times(n)}, {at}). Every update is "
                f"{_scale_str(d.get('scale'))} times too large, steps with inf/NaN gradients "
                "are not skipped, and the scale never adapts.")
    if e.kind == "nonfinite_loss":
        where = (f"It first appeared in {e.module}'s output, the first watched layer to go "
                 f"non-finite (seen on recorded step {d.get('recorded_at')})"
                 if e.module else
                 ("Every watched layer's output was finite when it was NaN/inf (recorded "
                  f"step {d.get('recorded_at')}): it appeared outside the watched modules, "
                  "in the loss computation or in code between the model and the loss"
                  if d.get("recorded_at") is not None else
                  "No recorded step had it, so where it appeared is unknown (record every "
                  "step with `every=1`, or use anomaly mode)"))
        return (f"The loss was NaN/inf in {d.get('steps_bad')} of the {d.get('checked')} "
                f"step(s) whose loss was checked (recorded or skipped steps; "
                f"{d.get('steps')} steps in all), first at step {e.step}. {where}.")
    if e.kind == "no_step_boundary":
        return ("No training step was seen to end: no optimizer.step(), no scaler.update(), "
                "no doctor.step()" + (", although backward ran" if d.get("backward") else "")
                + ". The figures below cover everything as one unfinished step.")
    if e.kind == "steps_from_backward":
        return (f"No optimizer or GradScaler was seen: {d.get('steps')} step(s) were counted "
                "from the loop itself (a backward reaching the watched parameters, then the "
                "weights updated or the gradients reset before the next forward).")
    if e.kind == "lowp_updates_lost":
        dts = "/".join(d.get("dtypes") or ["float16"])
        return (f"The weights are {dts} and the optimizer updates them in place: "
                f"{_pct(d.get('frac'))} of the sampled weight values with a non-zero gradient "
                f"did not change at all in the recorded optimizer steps "
                f"({d.get('unchanged')} of {d.get('sampled')}). The updates are below "
                f"{dts}'s resolution next to the weights, so most of the model does not train.")
    if e.kind == "nonfinite_input" and d.get("detected") == "recorded step":
        return (f"The batch given to {e.module} already held {_what(d)} ({at}"
                + (f", in {n} recorded steps" if n > 1 else "") + "): the data was "
                "non-finite before any layer ran, so the layers' NaN/inf outputs only carried "
                "it on.")
    if e.kind in ("nonfinite_forward", "nonfinite_backward", "nonfinite_input") or (
            e.kind == "activation_overflow" and d.get("hidden")):
        return _anomaly_message(e, n, at)
    if e.kind == "nonfinite_unlocated":
        return (f"NaN/Inf was seen in {d.get('count', n)} step(s) (first at step {e.step}) but "
                f"anomaly mode could not locate the op that produced it: {d.get('reason')}.")
    text = d.get("message")
    if text:
        return str(text) + (f" ({n - 1} more like it)" if n > 1 else "")
    return f"{e.kind} at step {e.step}"


def _what(d: dict[str, object]) -> str:
    parts = [w for w, k in (("NaN", "nan"), ("+inf", "pos_inf"), ("-inf", "neg_inf"),
                            ("inf", "inf")) if d.get(k)]
    return "/".join(parts) or "non-finite values"


def _anomaly_message(e: Event, n: int, at: str) -> str:
    """Op-level origins from anomaly mode: what the op made, from what, and where."""
    d = e.data
    where = f"in {e.module}" if e.module else "outside the watched model (in the training loop)"
    rng = ""
    if d.get("input_absmax") is not None:
        rng = (f" from finite {d.get('dtype')} inputs (min {_fmt(d.get('input_min'))}, "
               f"max {_fmt(d.get('input_max'))}, absmax {_fmt(d.get('input_absmax'))})")
    steps = f"in {n} step(s), {at}" if n > 1 else at
    if e.kind == "nonfinite_input":
        return (f"The batch passed to {e.module} already holds {_what(d)} ({steps}): it came "
                "from the data, not from a layer.")
    if e.kind == "nonfinite_backward":
        return (f"In the backward pass, {e.op} (part of {d.get('node')}, the backward of "
                f"{d.get('forward_op')} {where}) produced {_what(d)}{rng}, {steps}. This is "
                "the first backward op to go non-finite; the layers before it in backward "
                "order only passed it on.")
    if e.kind == "activation_overflow":
        return (f"{e.op} {where} overflowed to {_what(d)}{rng}, {steps}, while {e.module}'s "
                "output stayed finite: a later op saturated it, so module-level stats miss "
                "it. The backward of this op is where NaN usually appears next.")
    tail = ""
    if d.get("module_output_finite"):
        tail = f" {e.module}'s output stayed finite."
    return (f"{e.op} {where} was the first op to produce {_what(d)}{rng}, {steps}; every op "
            f"after it only passed it on.{tail}")


# Op-specific fixes for an op that produced NaN/Inf in the forward pass.
_OP_ADVICE: dict[str, str] = {
    "aten.log": "use `torch.log_softmax` instead of `log(softmax(x))`, or "
                "`torch.log(p.float().clamp_min(1e-12))`",
    "aten.div": "add an epsilon that float16 can hold (>= 1e-5; 1e-8 rounds to 0) or compute "
                "the denominator in float32: `x / torch.sqrt(var.float() + eps)`",
    "aten.rsqrt": "add an epsilon that float16 can hold (>= 1e-5) before rsqrt, or compute it "
                  "in float32",
    "aten.pow": "compute the power in float32: `torch.pow(x.float(), p)` inside "
                "`with torch.autocast(device_type, enabled=False):`",
    "aten.exp": "subtract the max before exp (or use `torch.softmax`/`logsumexp`), or compute "
                "it in float32",
}


def event_advice(e: Event, dtype: str | None = None) -> str:
    """The fix for one run-time event (also used for anomaly mode's exception).

    ``dtype`` is the run's low-precision format: a bfloat16 run is never told
    to train in bfloat16.
    """
    op_fix = _OP_ADVICE.get(e.op or "")
    bf16 = dtype == "bfloat16"
    if e.kind in ("nonfinite_forward", "activation_overflow") and e.op and op_fix:
        where = f" in {e.module}" if e.module else ""
        f32 = ("" if "autocast" in op_fix else " Or keep the op in float32 with `with "
               "torch.autocast(device_type, enabled=False):` around it and `.float()` inputs.")
        return (f"For {e.op}{where}: {op_fix}.{f32}"
                + ("" if bf16 else " Or train with `dtype=torch.bfloat16`."))
    if e.kind == "nonfinite_backward" and not e.module:
        return ("The gradient went non-finite where the loss is computed, outside the model: "
                "keep the loss O(1) (a mean rather than a sum reduction, targets normalised "
                "to unit scale), compute it in float32 (`loss_fn(out.float(), y.float())`), "
                "or start the GradScaler lower (`init_scale=...`).")
    if e.kind == "activation_overflow" and e.data.get("hidden"):
        return (f"Compute {e.op} in float32: wrap it in `with torch.autocast(device_type, "
                "enabled=False):` and cast its input with `.float()`"
                + (", or train with `dtype=torch.bfloat16`." if not bf16 else "."))
    if bf16 and e.kind in ADVICE_BF16:
        return ADVICE_BF16[e.kind]
    return ADVICE.get(e.kind, "")


def _events_rule(session: Session) -> Iterable[Finding]:
    grouped: dict[tuple[str, str | None, str | None], list[Event]] = {}
    for e in session.events:
        if e.kind not in _EVENT_SEVERITY:
            continue
        grouped.setdefault((e.kind, e.module, e.op), []).append(e)
    for (kind, module, op), es in grouped.items():
        first = es[0]
        if kind == "lowp_updates_lost" and not (first.data.get("frac") or 0) > \
                LOWP_UNCHANGED_WARN:
            continue
        n = max(len(es), int(first.data.get("occurrences") or 0))
        sev: Severity = first.data.get("severity") or _EVENT_SEVERITY[kind]
        skipped = set(session.scaler.skipped_steps) if session.scaler else set()
        if kind == "activation_overflow" and first.data.get("hidden") and (
                skipped.intersection(e.step for e in es)
                or any(x.kind == "nonfinite_backward" for x in session.events)):
            # The hidden overflow did harm (skipped steps, NaN in backward): it is the cause.
            sev = "error"
        if kind == "nonfinite_unlocated" and first.data.get("scaler_skipped_only"):
            sev = "info"  # only steps the GradScaler skipped: the backoff findings cover them
        if kind == "nonfinite_backward" and session.amp.scaler and not any(
                e.data.get("nan") for e in es):
            # Scaled gradients overflowing is what GradScaler detects and skips.
            sev = "info" if n <= SCALED_GRAD_OVERFLOW_INFO_STEPS else "warning"
        steps = [e.step for e in es]
        yield Finding(
            kind=kind, severity=sev, module=module, op=op, step=first.step,
            message=_event_message(first, n, steps),
            advice=first.data.get("advice") or event_advice(first, session.amp.dtype),
            frame=first.frame, count=n, steps=steps[:50],
            data={k: v for k, v in first.data.items() if k not in ("message", "advice")},
        )


def _whatif_rule(session: Session) -> Iterable[Finding]:
    from .whatif import whatif_findings

    return whatif_findings(session, session.run.target_dtype)


_RULES: list[Callable[[Session], Iterable[Finding]]] = [
    _run_rule,
    _autocast_rule,
    _layers_rules,
    _scaler_rules,
    _events_rule,
    _whatif_rule,
]
