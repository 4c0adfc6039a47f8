"""The text report: summary line, findings (most severe first), then the layer table.

Readable in 100 columns. Tables are drawn by tabulate.
"""

from __future__ import annotations

import math
import textwrap

from tabulate import tabulate

from ..records import Finding, LayerSummary, Session

__all__ = ["render_text", "render_markdown", "risk_order", "WIDTH", "MAX_LAYERS"]

WIDTH = 100
MAX_LAYERS = 25
_SEV_LABEL = {"error": "ERROR", "warning": "WARN", "info": "info"}


def _num(x: float | None, digits: int = 3) -> str:
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
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{100 * x:.2g}%" if x < 0.01 else f"{100 * x:.1f}%"


def risk_order(layers: list[LayerSummary]) -> list[LayerSummary]:
    """Worst layers first: non-finite, then overflow, then least headroom, then underflow."""

    def key(lay: LayerSummary) -> tuple[float, ...]:
        nonfinite = lay.nonfinite_steps + lay.grad_nonfinite_steps + lay.param_grad_nonfinite_steps
        head = lay.headroom if not math.isnan(lay.headroom) else math.inf
        gu = max(v for v in (lay.grad_underflow_frac, lay.param_grad_underflow_frac, 0.0)
                 if v is not None)
        return (
            -float(nonfinite > 0),
            -float(lay.ran_low_precision and lay.overflow_frac > 0),
            -max(lay.underflow_frac, gu) if head > 8 else 0.0,
            head,
            lay.order,
        )

    return sorted(layers, key=key)


def summary_line(s: Session) -> str:
    amp = s.amp
    dtype = f"{amp.dtype} autocast" if amp.autocast_seen else (
        f"{amp.dtype} (no autocast)" if amp.dtype else "no low precision")
    scaler = "GradScaler on" if amp.scaler else "no GradScaler"
    steps = f"{s.steps} steps ({s.recorded_steps} recorded, every {s.run.every})"
    parts = [amp.device_type or "device ?", dtype, scaler, steps, s.run.outcome]
    if s.run.exit_code not in (None, 0):
        parts.append(f"exit code {s.run.exit_code}")
    return f"amp-doctor {s.version}: " + " | ".join(parts)


def _wrap(text: str, indent: int) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=" " * indent,
                         subsequent_indent=" " * indent, break_on_hyphens=False)


def _finding_block(f: Finding) -> str:
    where = " ".join(x for x in (f.module or "", f"[{f.op}]" if f.op else "",
                                 f"step {f.step}" if f.step is not None else "") if x)
    head = f"{_SEV_LABEL[f.severity]:<6} {f.kind}" + (f"  {where}" if where else "")
    lines = [head, _wrap(f.message, 7)]
    if f.frame:
        lines.append(_wrap(f"at {f.frame}", 7))
    lines.append(_wrap(f"fix: {f.advice}", 7))
    return "\n".join(lines)


def _scaler_line(s: Session) -> str | None:
    sc = s.scaler
    if sc is None:
        return None
    if not sc.enabled:
        return "Scaler: GradScaler present but disabled (enabled=False)."
    first = sc.init_scale if sc.init_scale is not None else (sc.scale[0][1] if sc.scale else None)
    last = sc.scale[-1][1] if sc.scale else sc.init_scale
    bo = sc.backoff_steps
    shown = ", ".join(str(x) for x in bo[:8]) + ("..." if len(bo) > 8 else "")
    return (f"Scaler: scale {_scale(first)} -> {_scale(last)}; {len(bo)} backoffs"
            + (f" (steps {shown})" if bo else "") + f"; {len(sc.growth_steps)} growths; "
            f"{len(sc.skipped_steps)} skipped optimizer steps.")


def _scale(x: float | None) -> str:
    # Scales are powers of two; print them whole so 65536 reads as 65536.
    return "-" if x is None else f"{x:.7g}"


def _dtype_cell(lay: LayerSummary) -> str:
    ins = "/".join(d.replace("float", "f").replace("bf", "bf") for d in lay.input_dtypes) or "-"
    outs = "/".join(d.replace("float", "f") for d in lay.output_dtypes) or "-"
    return f"{ins}>{outs}"


def layer_table(s: Session, max_layers: int = MAX_LAYERS, fmt: str = "simple") -> str:
    rows = []
    ordered = risk_order([lay for lay in s.layers if lay.recorded_steps])
    for lay in ordered[:max_layers]:
        name = lay.name if len(lay.name) <= 28 else "..." + lay.name[-25:]
        nonfinite = f"{lay.nonfinite_steps}/" + str(
            max(lay.grad_nonfinite_steps, lay.param_grad_nonfinite_steps))
        gu = lay.grad_underflow_frac if lay.ran_low_precision else lay.param_grad_underflow_frac
        rows.append([
            name, lay.type[:14], _dtype_cell(lay), _num(lay.absmax),
            _num(lay.headroom, 2), _pct(lay.overflow_frac) + ("*" if lay.what_if else ""),
            _pct(lay.underflow_frac) + ("*" if lay.what_if else ""), _pct(gu), nonfinite,
        ])
    headers = ["layer", "type", "in>out", "absmax", "headroom", "ovf", "unf", "grad unf", "nf a/g"]
    table = tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)
    hidden = len(ordered) - min(len(ordered), max_layers)
    if hidden:
        table += f"\n... {hidden} more layers not shown (all are in the JSON report)"
    return table


def render_text(s: Session, max_layers: int = MAX_LAYERS) -> str:
    out = [summary_line(s)]
    if s.run.fp32_modules:
        out.append(_wrap("Run in float32 under autocast (--fp32): "
                         + ", ".join(s.run.fp32_modules), 0))
    if s.run.error:
        out.append(_wrap(f"The run ended with {s.run.error}", 0))
    n = {sev: sum(f.severity == sev for f in s.findings) for sev in ("error", "warning", "info")}
    out.append("")
    if s.findings:
        out.append(f"Findings: {n['error']} error(s), {n['warning']} warning(s), "
                   f"{n['info']} info")
        for f in s.findings:
            out.append("")
            out.append(_finding_block(f))
    elif s.recorded_steps == 0 or not s.layers:
        out.append(_wrap("Findings: none, because nothing was recorded: no watched model ran "
                         "a training step (forward with grad, then backward and an optimizer "
                         "step). Check that the script trains, or pass the model to "
                         "amp_doctor.watch().", 0))
    else:
        out.append("Findings: none. AMP looks healthy in the recorded steps.")
    sl = _scaler_line(s)
    if sl:
        out.extend(["", _wrap(sl, 0)])
    if s.layers:
        out.extend(["", "Layers, worst first (headroom in bits to the format's max; ovf/unf: "
                    "share of output values", "beyond max / below smallest normal; "
                    "* = what-if for a float32 layer; nf a/g: non-finite steps)", ""])
        out.append(layer_table(s, max_layers))
    return "\n".join(out) + "\n"


def render_markdown(s: Session, max_layers: int = MAX_LAYERS) -> str:
    out = [f"**{summary_line(s)}**", ""]
    if s.findings:
        out.append("| severity | kind | module | op | step | message | advice |")
        out.append("|---|---|---|---|---|---|---|")
        for f in s.findings:
            cells = [f.severity, f.kind, f.module or "", f.op or "",
                     "" if f.step is None else str(f.step), f.message, f.advice]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    else:
        out.append("No findings.")
    sl = _scaler_line(s)
    if sl:
        out.extend(["", sl])
    if s.layers:
        out.extend(["", layer_table(s, max_layers, fmt="github")])
    return "\n".join(out) + "\n"
