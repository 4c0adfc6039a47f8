"""Session -> findings, each with a message carrying the numbers and advice naming the fix.

Every threshold is a named constant below. Analysis reads only the
session's records, so a saved JSON file analyses the same way again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from .records import Event, Finding, LayerSummary, Session

__all__ = [
    "analyze",
    "ADVICE",
    "OVERFLOW_FRAC_ERROR",
    "HEADROOM_WARN_BITS",
    "ACT_UNDERFLOW_WARN",
    "GRAD_UNDERFLOW_WARN",
    "SCALE_COLLAPSE_MIN",
    "BACKOFF_SHARE_COLLAPSE",
    "BACKOFF_RUN_COLLAPSE",
    "CALIBRATION_STEPS",
    "STUCK_INTERVALS",
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
# The scale has no business below 1: the loss is then scaled *down*.
SCALE_COLLAPSE_MIN = 1.0
# Backoffs in more than this share of steps (after calibration) is a collapse.
BACKOFF_SHARE_COLLAPSE = 0.2
# Or this many backoffs in a row.
BACKOFF_RUN_COLLAPSE = 5
# GradScaler starts at 2**16 and backs off until the scale fits: backoffs in
# the first steps are normal calibration, not a problem.
CALIBRATION_STEPS = 20
# No growth across this many growth intervals means the scale is stuck.
STUCK_INTERVALS = 3
# At most this many findings of one kind are itemised; the rest are counted.
MAX_PER_KIND = 8

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
        "The scale never grows: some gradient always sits near float16's max. Find the "
        "layer with the smallest grad headroom in the table; lower `growth_interval` only "
        "if gradients underflow as well."
    ),
    "clip_before_unscale": (
        "Call `scaler.unscale_(optimizer)` before `torch.nn.utils.clip_grad_norm_(...)`: "
        "clipping scaled gradients clips at max_norm * scale, so the clip does nothing "
        "(or everything)."
    ),
    "missing_update": (
        "Call `scaler.update()` once per iteration after `scaler.step(optimizer)`; without "
        "it the scale never adapts and the next `scaler.step` raises."
    ),
    "scaler_with_bf16": (
        "bfloat16 has float32's exponent range, so a GradScaler is not needed: remove it, or "
        "construct it with `enabled=False` (`torch.amp.GradScaler(device_type, enabled=False)`)."
    ),
    "fp16_params": (
        "Keep parameters in float32 and let autocast cast them: remove `model.half()` "
        "(or `.to(torch.float16)`). GradScaler's `unscale_` refuses float16 gradients "
        "('Attempting to unscale FP16 gradients') because unscaling in float16 would "
        "itself underflow/overflow. For pure-fp16 training keep an fp32 master copy."
    ),
    "scheduler_on_skipped_step": (
        "The LR scheduler stepped although GradScaler skipped the optimizer step. Usually "
        "harmless after calibration; if it matters, step the scheduler only when "
        "`scaler.get_scale()` did not decrease in `scaler.update()`."
    ),
    "loss_not_scaled": (
        "Call `scaler.scale(loss).backward()`, not `loss.backward()`, while a GradScaler is "
        "enabled; otherwise `scaler.step` unscales gradients that were never scaled and "
        "divides them by the scale."
    ),
    "backward_in_autocast": (
        "Call `backward()` outside the `torch.autocast` block: autocast should wrap only the "
        "forward pass and the loss; backward ops run in the dtype chosen in forward."
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


def analyze(session: Session) -> list[Finding]:
    out: list[Finding] = []
    for fn in _RULES:
        out.extend(fn(session))
    out = _cap(out)
    out.sort(key=lambda f: (SEVERITY_RANK[f.severity], f.step if f.step is not None else 0))
    return out


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
    for lay in session.layers:
        yield from _layer_findings(session, lay, fmt)


def _layer_findings(session: Session, lay: LayerSummary, fmt: str) -> Iterable[Finding]:
    if lay.recorded_steps == 0:
        return
    if lay.ran_low_precision and lay.overflow_frac > OVERFLOW_FRAC_ERROR:
        yield Finding(
            kind="activation_overflow", severity="error", module=lay.name, op=None, step=None,
            message=(f"{lay.name} ({lay.type}) output overflows {fmt}: "
                     f"{_pct(lay.overflow_frac)} of values at or beyond the format's max "
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
    if gu is not None and gu > GRAD_UNDERFLOW_WARN and fmt == "float16":
        kind = "missing_scaler" if not session.amp.scaler else "gradient_underflow"
        yield Finding(
            kind=kind, severity="warning", module=lay.name, op=None, step=None,
            message=(f"{lay.name} ({lay.type}): {_pct(gu)} of its gradient values are below "
                     f"float16's smallest normal"
                     + ("" if session.amp.scaler else ", and no GradScaler is in use") + "."),
            advice=ADVICE[kind],
            data={"grad_underflow_frac": gu, "scaled": session.amp.scaler},
        )


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


def _autocast_rule(session: Session) -> Iterable[Finding]:
    lows = any(lay.ran_low_precision for lay in session.layers)
    if session.recorded_steps and not session.amp.autocast_seen and not lows:
        yield Finding(
            kind="autocast_inactive", severity="warning", module=None, op=None, step=None,
            message=(f"No layer ran in float16 or bfloat16 in {session.recorded_steps} recorded "
                     "steps: autocast was not active during the forward pass."),
            advice=ADVICE["autocast_inactive"],
        )


def _scaler_rules(session: Session) -> Iterable[Finding]:
    sc = session.scaler
    if sc is None or not sc.enabled:
        return
    backoffs = [e for e in sc.events if e.kind == "backoff"]
    groups: list[list] = []
    for e in backoffs:
        if groups and e.step - groups[-1][-1].step <= 1:
            groups[-1].append(e)
        else:
            groups.append([e])
    for g in groups:
        culprits: list[str] = []
        for e in g:
            for c in e.culprits:
                if c not in culprits:
                    culprits.append(c)
        calibrating = g[0].step < CALIBRATION_STEPS and len(backoffs) <= 3 * 1
        first, last = g[0], g[-1]
        where = (f"; first culprit {culprits[0]} (of {len(culprits)} layers with non-finite "
                 f"gradients: {', '.join(culprits[:5])}{'...' if len(culprits) > 5 else ''})"
                 if culprits else "")
        span = f"step {first.step}" if len(g) == 1 else f"steps {first.step}-{last.step}"
        yield Finding(
            kind="scaler_backoff", severity="info" if calibrating and not culprits else "warning",
            module=culprits[0] if culprits else None, op=None, step=first.step,
            message=(f"GradScaler backed off {len(g)}x at {span} (scale "
                     f"{_fmt(first.scale_before)} -> {_fmt(last.scale_after)}), skipping "
                     f"{len(g)} optimizer step(s){where}."),
            advice=ADVICE["scaler_backoff"],
            steps=[e.step for e in g],
            data={"culprits": culprits, "scale_before": first.scale_before,
                  "scale_after": last.scale_after},
        )
    # Collapse: below 1, or too many backoffs after calibration, or long runs of them.
    final = sc.scale[-1][1] if sc.scale else None
    min_scale = min((s for _, s in sc.scale), default=None)
    post = [e for e in backoffs if e.step >= CALIBRATION_STEPS]
    eligible = max(session.steps - CALIBRATION_STEPS, 0)
    longest = max((len(g) for g in groups), default=0)
    reasons = []
    if min_scale is not None and min_scale < SCALE_COLLAPSE_MIN:
        reasons.append(f"the scale fell to {_fmt(min_scale)} (< {SCALE_COLLAPSE_MIN:g})")
    if eligible >= 10 and len(post) / eligible > BACKOFF_SHARE_COLLAPSE:
        reasons.append(f"{len(post)} backoffs in {eligible} steps after calibration")
    if longest >= BACKOFF_RUN_COLLAPSE and (min_scale is None or min_scale < (
            sc.init_scale or 65536.0) / 2 ** BACKOFF_RUN_COLLAPSE):
        reasons.append(f"{longest} backoffs in a row")
    if reasons:
        culprits = [c for e in backoffs for c in e.culprits]
        top = max(set(culprits), key=culprits.count) if culprits else None
        yield Finding(
            kind="scale_collapse", severity="error", module=top, op=None,
            step=backoffs[0].step if backoffs else None,
            message=(f"Loss scale collapsed: {'; '.join(reasons)}; {len(sc.skipped_steps)} of "
                     f"{session.steps} optimizer steps skipped; final scale {_fmt(final)}"
                     + (f"; most frequent culprit {top}" if top else "") + "."),
            advice=ADVICE["scale_collapse"],
            steps=[e.step for e in backoffs][:50],
            data={"min_scale": min_scale, "final_scale": final, "backoffs": len(backoffs)},
        )
    gi = sc.growth_interval or 2000
    if not sc.growth_steps and session.steps >= STUCK_INTERVALS * gi and not reasons:
        yield Finding(
            kind="scale_stuck", severity="warning", module=None, op=None, step=None,
            message=(f"The loss scale never grew in {session.steps} steps "
                     f"({session.steps / gi:.1f} growth intervals of {gi}); it stayed at "
                     f"{_fmt(final)}."),
            advice=ADVICE["scale_stuck"],
        )


_EVENT_SEVERITY = {
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
}


def _event_message(e: Event, n: int) -> str:
    d = e.data
    if e.kind == "clip_before_unscale":
        return (f"{d.get('func', 'clip_grad_norm_')} ran on gradients still multiplied by the "
                f"loss scale ({_fmt(d.get('scale'))}) in {n} step(s), first at step {e.step}.")
    if e.kind == "scaler_with_bf16":
        return "A GradScaler is enabled while autocast runs in bfloat16."
    if e.kind == "fp16_params":
        return (f"{d.get('count', '?')} parameters are float16 while a GradScaler is in use; "
                "unscale_ raises 'Attempting to unscale FP16 gradients'.")
    if e.kind == "scheduler_on_skipped_step":
        return (f"{d.get('scheduler', 'LR scheduler')}.step() ran after GradScaler skipped the "
                f"optimizer step {d.get('skipped_step')} ({n} time(s)).")
    if e.kind == "loss_not_scaled":
        return "backward() was called on a loss that was not passed through scaler.scale()."
    if e.kind == "backward_in_autocast":
        return f"backward() was called inside an autocast region ({d.get('device')})."
    if e.kind == "missing_update":
        return (f"scaler.step() ran {d.get('count', 2)} times for the same optimizer without "
                "scaler.update() in between.")
    msg = d.get("message")
    if msg:
        return str(msg) + (f" ({n - 1} more like it)" if n > 1 else "")
    return f"{e.kind} at step {e.step}"


def _events_rule(session: Session) -> Iterable[Finding]:
    grouped: dict[tuple[str, str | None, str | None], list[Event]] = {}
    for e in session.events:
        if e.kind not in _EVENT_SEVERITY:
            continue
        grouped.setdefault((e.kind, e.module, e.op), []).append(e)
    for (kind, module, op), es in grouped.items():
        first = es[0]
        sev = first.data.get("severity") or _EVENT_SEVERITY[kind]
        yield Finding(
            kind=kind, severity=sev, module=module, op=op, step=first.step,
            message=_event_message(first, len(es)),
            advice=first.data.get("advice") or ADVICE.get(kind, ""),
            frame=first.frame, count=len(es), steps=[e.step for e in es][:50],
            data={k: v for k, v in first.data.items() if k not in ("message", "advice")},
        )


_RULES: list[Callable[[Session], Iterable[Finding]]] = [
    _autocast_rule,
    _layers_rules,
    _scaler_rules,
    _events_rule,
]
