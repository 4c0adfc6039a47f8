"""The text report: summary line, findings (most severe first), then the layer table.

Readable in 100 columns (the layer table may run wider to keep names whole). Tables
are drawn by tabulate; numbers are printed by :mod:`amp_doctor.format`.

Findings of one kind on many layers (``gradient_underflow`` on eight layers) are
rendered as one group that lists the layers, worst first, instead of eight copies of the
same advice. The grouping is a rendering choice: the JSON report keeps every finding.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

from tabulate import tabulate

from amp_doctor import format as F
from amp_doctor.analysis.detect_layers import (
    all_nonfinite,
    low_format,
    neg_inf_mask,
    scaler_dropped_after,
    shown_grad_underflow,
)
from amp_doctor.analysis.next_steps import next_commands
from amp_doctor.analysis.risk import risk_order
from amp_doctor.analysis.thresholds import ALL_ZERO_SHOWN, RISK_HEADROOM_BITS
from amp_doctor.dtypes import FORMAT_MAX
from amp_doctor.records import SEVERITIES, Finding, LayerSummary, ScalerTimeline, Session

__all__ = [
    "render_text",
    "render_markdown",
    "render_verdict",
    "risk_order",
    "group_findings",
    "FindingGroup",
    "layer_table",
    "summary_line",
    "WIDTH",
    "MAX_LAYERS",
    "MAX_LISTED",
    "NONFINITE_HEADER",
]

WIDTH = 100
MAX_LAYERS = 25
# A group lists at most this many layers by name; the rest are counted.
MAX_LISTED = 12
# The layer table's column of recorded steps with inf/NaN outputs / gradients.
NONFINITE_HEADER = "inf/NaN out/grad"
_SEV_LABEL = {"error": "ERROR", "warning": "WARN", "info": "info"}


def summary_line(s: Session) -> str:
    amp = s.amp
    also = f" (also {', '.join(amp.other_dtypes)})" if amp.other_dtypes else ""
    dtype = f"{amp.dtype} autocast{also}" if amp.autocast_seen else (
        f"{amp.dtype} (no autocast)" if amp.dtype else "no low precision")
    # A run that ended before its first step (raise mode stopping at step 0) may have
    # made a GradScaler it never got to call: none was seen, which is not "none".
    dropped = scaler_dropped_after(s)
    scaler = ("GradScaler on" + (f" until step {dropped}, then none" if dropped is not None
                                 else "")) if amp.scaler else (
        # A scaler that scales the loss but never steps: the header must not deny it.
        "GradScaler scales but never steps" if any(
            e.kind == "scaled_grads_stepped" for e in s.events)
        # (Review 54: "no GradScaler" above "Scaler: GradScaler present but disabled".)
        else "GradScaler disabled" if s.scaler is not None and not s.scaler.enabled
        else "no GradScaler" if s.steps else "no GradScaler used before the end")
    # The step a run ended in is recorded, though it never finished: say so, rather than
    # count more recorded steps than steps.
    partial = ", the last unfinished" if s.recorded_steps > s.steps else ""
    steps = (f"{F.counted(s.steps, 'step')} ({s.recorded_steps} recorded{partial}, "
             f"every {s.run.every})")
    outcome = ("stopped by amp-doctor (--stop-after)" if s.run.outcome == "stopped"
               else s.run.outcome)
    parts = [amp.device_type or "device ?", dtype, scaler, steps, outcome]
    if not s.run.every:
        # every 0: nothing was watched (the script never imported torch, or torch's
        # import failed): there is no device, format, scaler or step to speak of.
        parts = ["nothing watched", outcome]
    if s.run.exit_code not in (None, 0):
        parts.append(f"exit code {s.run.exit_code}")
    return f"amp-doctor {s.version}: " + " | ".join(parts)


def _grad_cell(lay: LayerSummary, gu: float | None) -> str:
    """'grad underflow', or how many of its gradient values were exactly zero when nearly
    all were: a gradient flushed whole (no GradScaler) has no subnormal left to count,
    and "0%" read as healthy (review 45b)."""
    zero = lay.grad_zero_frac if lay.ran_low_precision else lay.param_grad_zero_frac
    if zero is not None and zero >= ALL_ZERO_SHOWN:
        return f"{F.pct(zero)} zero"
    return F.pct(gu)


def _wrap(text: str, indent: int) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=" " * indent,
                         subsequent_indent=" " * indent, break_on_hyphens=False)


# -- grouping ------------------------------------------------------------------------------

@dataclass(frozen=True)
class FindingGroup:
    """Findings of one kind and severity; ``lead`` is the first (most severe) of them."""

    findings: tuple[Finding, ...]

    @property
    def lead(self) -> Finding:
        return self.findings[0]

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys(f.module for f in self.findings if f.module))

    @property
    def unlisted(self) -> int:
        """Layers with the same finding that the cap per kind left out of the report."""
        return sum(int(f.data.get("more_like_it") or 0) for f in self.findings)

    @property
    def worst_message(self) -> str:
        """The lead's message without the cap's "(and N more like it)": a group's block
        counts those layers in its list of layers already."""
        f = self.lead
        n = int(f.data.get("more_like_it") or 0)
        suffix = f" (and {n} more like it)"
        return f.message[: -len(suffix)] if n and f.message.endswith(suffix) else f.message


def group_findings(findings: list[Finding],
                   layers: list[LayerSummary] | None = None) -> list[FindingGroup]:
    """Same kind and severity on several layers -> one group, at the first one's place
    (a second GradScaler's findings apart from the first's).

    Findings without a module (run-wide ones) are never merged: each says something
    different. Within a group, layers are worst first by :func:`risk_order` of
    ``layers`` (the layer table's order), else in the analysis order.
    """
    groups: list[list[Finding]] = []
    index: dict[tuple[str, str, str, str], int] = {}
    for f in findings:
        # Another GradScaler's findings are its own group: a group shows one message. So
        # are errors with another fix (review 60a: a head's overflow and a block's own
        # float16 square, two causes, showed the head's fix alone).
        key = (f.kind, f.severity, str(f.data.get("scaler", "")),
               (f.advice or "") if f.severity == "error" else "")
        # A group lists layers and shows one message: a second finding on a layer already
        # in it (another op of the same module, at another step) would be hidden there.
        if f.module is None or key not in index or any(
                g.module == f.module for g in groups[index[key]]):
            if f.module is not None and key not in index:
                index[key] = len(groups)
            groups.append([f])
        else:
            groups[index[key]].append(f)
    if layers:
        rank = {lay.name: i for i, lay in enumerate(risk_order(list(layers)))}
        big = len(rank)
        groups = [sorted(g, key=lambda f: (-_lost_share(f), rank.get(f.module or "", big)))
                  if len(g) > 1 else g for g in groups]
    return [FindingGroup(tuple(g)) for g in groups]


def _lost_share(f: Finding) -> float:
    """A gradient finding's share of values lost to float16: a value flushed to zero
    whole, a subnormal half (it keeps some of its bits). Review 47a: ranked by the
    subnormals alone, a layer 0.6% zero led one 75% zero. 0 for other kinds, which keep
    the layer table's order."""
    if f.kind not in ("gradient_underflow", "missing_scaler"):
        return 0.0
    return float(f.data.get("grad_zero_frac") or 0.0) + 0.5 * float(
        f.data.get("grad_underflow_frac") or 0.0)


def _listed(names: list[str], code: bool = False) -> str:
    shown = names[:MAX_LISTED]
    more = len(names) - len(shown)
    q = (lambda n: f"`{n}`") if code else (lambda n: n)
    return ", ".join(q(n) for n in shown) + (f" and {more} more" if more else "")


def _where(f: Finding) -> str:
    return " ".join(x for x in (F.layer(f.module) if f.module else "",
                                f"[{f.op}]" if f.op else "",
                                f"step {f.step}" if f.step is not None else "") if x)


def _group_block(g: FindingGroup) -> str:
    f = g.lead
    mods = g.modules
    if len(g.findings) == 1:
        where = _where(f)
        lines = [f"{_SEV_LABEL[f.severity]:<6} {f.kind}" + (f"  {where}" if where else "")]
        lines.append(_wrap(f.message, 7))
    else:
        more = g.unlisted
        lines = [f"{_SEV_LABEL[f.severity]:<6} {f.kind}  on {len(mods) + more} layers"]
        lines.append(_wrap(f"layers (worst first): {_listed(mods)}"
                           + (f", and {more} more not listed" if more else ""), 7))
        lines.append(_wrap(f"worst: {g.worst_message}", 7))
    if f.frame:
        lines.append(_wrap(f"at {f.frame}", 7))
    if f.advice:  # an info finding may have nothing to advise
        lines.append(_wrap(f"fix: {f.advice}", 7))
    return "\n".join(lines)


# -- scaler and layer table -----------------------------------------------------------------

def _scaler_line(s: Session) -> str | None:
    sc = s.scaler
    if sc is None:
        return None
    if not sc.enabled:
        return ("Scaler: GradScaler present but disabled (enabled=False, or a "
                "torch.cuda.amp.GradScaler on a machine without CUDA, which disables itself).")
    # With several scalers, each line says whose it is (the optimizers it steps).
    several = bool(s.other_scalers)
    return "\n".join(_one_scaler_line(f"Scaler of {t.label}" if several and t.name
                                       else "Scaler", t) for t in [sc, *s.other_scalers])


def _one_scaler_line(label: str, sc: ScalerTimeline) -> str:
    first = sc.init_scale if sc.init_scale is not None else (sc.scale[0][1] if sc.scale else None)
    last = sc.scale[-1][1] if sc.scale else sc.init_scale
    bo = sc.backoff_steps
    shown = ", ".join(str(x) for x in bo[:8]) + ("..." if len(bo) > 8 else "")
    # A loop that updates the scaler after each of two optimizers can back off twice in
    # one step, and a step skips each optimizer it steps: counted as they happened.
    backoffs = len(bo) + sum(e.count - 1 for e in sc.events if e.kind == "backoff")
    skips = sc.skipped_steps
    per = {k: len(v) for k, v in sc.skipped_by_optimizer.items() if v}
    n_opt = sum(per.values())
    skipped = (F.counted(len(skips), "skipped optimizer step") if n_opt in (0, len(skips))
               else f"{F.counted(n_opt, 'skipped optimizer step')} in "
               f"{F.counted(len(skips), 'step')} ("
               + ", ".join(f"{k} {n}" for k, n in per.items()) + ")")
    # A new scaler's start is no growth of the old one's scale: said apart.
    resets = sc.resets
    started = ", ".join(dict.fromkeys(F.scale(r.scale_after, unknown="?") for r in resets))
    replaced = (f"; {F.counted(len(resets), 'new GradScaler')} took over ("
                f"{'step' if len(resets) == 1 else 'steps'} "
                f"{F.steps_list([r.step for r in resets])}), starting at {started}"
                if resets else "")
    return (f"{label}: scale {F.scale(first)} -> {F.scale(last)}{replaced}; "
            f"{F.counted(backoffs, 'backoff')}"
            + (f" in {F.counted(len(bo), 'step')}" if backoffs != len(bo) else "")
            + (f" ({'step' if len(bo) == 1 else 'steps'} {shown})" if bo else "")
            + f"; {F.counted(len(sc.growth_steps), 'growth')}; {skipped}.")


def _dtype_cell(lay: LayerSummary) -> str:
    ins = "/".join(d.replace("float", "f") for d in lay.input_dtypes) or "-"
    outs = "/".join(d.replace("float", "f") for d in lay.output_dtypes) or "-"
    return f"{ins}>{outs}"


def layer_table(s: Session, max_layers: int = MAX_LAYERS, fmt: str = "simple") -> str:
    rows = []
    ordered = risk_order([lay for lay in s.layers if lay.recorded_steps])
    low = low_format(s)
    for lay in ordered[:max_layers]:
        name = lay.name if len(lay.name) <= 40 else "..." + lay.name[-37:]
        nonfinite = f"{lay.nonfinite_steps}/" + str(
            max(lay.grad_nonfinite_steps, lay.param_grad_nonfinite_steps))
        gu = shown_grad_underflow(lay)
        star = "*" if lay.what_if else ""
        # A float32 output that held inf/NaN itself overflowed for real (review 60b).
        over_star = star if not lay.nonfinite_steps else ""
        over, under = F.pct(lay.overflow_frac) + over_star, F.pct(lay.underflow_frac) + star
        mask_max = neg_inf_mask(lay, low, s)
        if mask_max is not None:
            over = "-inf mask"
        if not lay.output_dtypes:
            # No output of it was seen (inside a compiled graph): only its parameters'
            # gradients were recorded, not a zero output with infinite headroom.
            absmax = head = over = under = "-"
        elif all_nonfinite(lay):
            absmax, head = "NaN", "NaN"
        elif mask_max is not None:
            fmax = FORMAT_MAX.get(low)
            absmax = F.num(mask_max)
            head = F.bits(math.log2(fmax / mask_max)) if fmax and mask_max > 0 else "inf"
        else:
            absmax, head = F.num(lay.absmax), F.bits(lay.headroom)
        rows.append([
            name, lay.type, _dtype_cell(lay), absmax, head, over, under, _grad_cell(lay, gu),
            nonfinite,
        ])
    headers = ["layer", "type", "in>out", "absmax", "headroom", "overflow", "underflow",
               "grad underflow", NONFINITE_HEADER]
    table = tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)
    hidden = len(ordered) - min(len(ordered), max_layers)
    if hidden:
        table += f"\n... {hidden} more layers not shown (all are in the JSON report)"
    return table


_TABLE_KEY = (
    "Layers, worst first: non-finite values, then overflow, then headroom under "
    f"{RISK_HEADROOM_BITS:g} bits (least first), then the largest underflow share (of "
    "outputs or gradients). headroom: bits between the largest |output| and the format's "
    "max (< 0 = overflow). overflow / underflow: share of output values beyond the max / "
    "below the smallest normal (* = what-if for a float32 layer; no * on the overflow of "
    "one whose output held inf/NaN itself). grad underflow: the same for its output "
    "gradients, as scaled (a float32 layer: for its weight gradients; - if it "
    "has none; 'N% zero' when nearly all were exactly zero, flushed or zero already). "
    f"{NONFINITE_HEADER}: how many recorded steps had inf or "
    "NaN in the outputs / in the gradients."
)
_MASK_KEY = (" -inf mask: the output held -inf written on purpose (masked_fill), and no "
             "+inf or NaN; its absmax and headroom are those of its finite values.")


def _table_key(s: Session) -> str:
    low = low_format(s)
    masked = any(lay.recorded_steps and neg_inf_mask(lay, low, s) is not None
                 for lay in s.layers)
    return _TABLE_KEY + (_MASK_KEY if masked else "")


def _counts_line(s: Session) -> str:
    n = {sev: sum(f.severity == sev for f in s.findings) for sev in SEVERITIES}
    return (f"Findings: {n['error']} error(s), {n['warning']} warning(s), {n['info']} info")


def render_text(s: Session, max_layers: int = MAX_LAYERS) -> str:
    out = [summary_line(s)]
    if s.run.fp32_modules:
        out.append(_wrap("Run in float32 under autocast (--fp32): "
                         + ", ".join(s.run.fp32_modules), 0))
    for box, kids in s.run.fp32_containers.items():
        # Review 56b: `--fp32 blocks` on a ModuleList read as forced, and changed nothing.
        out.append(_wrap(f"{box} is a container, iterated and never called: --fp32 ran its "
                         f"members instead ({', '.join(kids) or 'none'}).", 2))
    if s.run.fp32_not_run:
        out.append(_wrap("Forced but never ran a forward, so unchanged: "
                         + ", ".join(s.run.fp32_not_run), 2))
    if s.run.error:
        at = f" (at {s.run.error_at})" if s.run.error_at else ""
        out.append(_wrap(f"The run ended with {s.run.error}{at}", 0))
    out.append("")
    if s.findings:
        groups = group_findings(s.findings, s.layers)
        merged = len(s.findings) - len(groups)
        out.append(_counts_line(s) + (f" ({len(groups)} groups)" if merged else ""))
        for g in groups:
            out.append("")
            out.append(_group_block(g))
    elif s.recorded_steps == 0 or not s.layers:
        out.append(_wrap("Findings: none, because nothing was recorded: no watched model ran "
                         "a training step (forward with grad, then backward and an optimizer "
                         "step). Check that the script trains, or pass the model to "
                         "amp_doctor.watch().", 0))
    else:
        out.append("Findings: none. AMP looks healthy in the recorded steps.")
    sl = _scaler_line(s)
    if sl:
        out.extend(["", *(_wrap(line, 0) for line in sl.split("\n"))])
    if s.layers:
        out.extend(["", _wrap(_table_key(s), 0), ""])
        out.append(layer_table(s, max_layers))
        from amp_doctor.analysis.whatif import render_fp8_table

        fp8 = render_fp8_table(s)
        if fp8 and any(f.severity == "error" for f in s.findings):
            # Review 60a: a what-if for the next format, beside errors of this one, is
            # noise: its figures are of a run that does not train as it is.
            out.extend(["", _wrap("FP8 readiness (simulated) is left out while the run has "
                                  "errors: fix them first, and the next run's report shows "
                                  "it.", 0)])
        elif fp8:
            out.extend(["", fp8])
    return "\n".join(out) + "\n"


# -- markdown (TensorBoard's TEXT tab) ------------------------------------------------------

def _md(text: str) -> str:
    # TensorBoard renders markdown; keep user strings from turning into markup. Not inside
    # a code span, where a backslash shows as one (review 56d: code with `init\\_scale`).
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code span to keep
        parts = [text]
    for i in range(0, len(parts), 2):  # outside the spans
        parts[i] = parts[i].replace("|", "\\|").replace("*", "\\*").replace("_", "\\_")
    return "`".join(parts)


def render_verdict(s: Session) -> str:
    """The one-paragraph answer: culprit, op, ``file:line`` and fix of the top finding."""
    if not s.findings:
        if s.recorded_steps == 0 or not s.layers:
            return "**Verdict: nothing recorded.** No watched model ran a training step."
        return "**Verdict: healthy.** No AMP problem in the recorded steps."
    # The top group's worst finding: the one its block shows as "worst" (review 44d: the
    # verdict named another layer of a group than the one the group put first).
    f = group_findings(s.findings, s.layers)[0].lead
    # An op outside every module (the loop's loss code) has no culprit layer: another
    # finding's layer would contradict it (review 56a: a backoff's first layer named).
    culprit = f.module or (None if f.op else next((x.module for x in s.findings if x.module),
                                                   None))
    bits = [f"**Verdict: {_SEV_LABEL[f.severity]} `{f.kind}`**"]
    if culprit:
        bits.append(f"**culprit** `{culprit}`")
    elif f.op:
        bits.append("**culprit** the loop's own code (outside the watched model)")
    op = f.op or next((x.op for x in s.findings if x.op and x.module == culprit), None)
    if op:
        bits.append(f"**op** `{op}`")
    frame = f.frame or next((x.frame for x in s.findings if x.frame and x.module == culprit),
                            None)
    if frame:
        bits.append(f"**at** `{frame}`")
    step = f.step
    if step is not None:
        bits.append(f"**first at step** {step}")
    return " · ".join(bits) + "\n\n**Fix:** " + f.advice


def _md_group(g: FindingGroup) -> str:
    f = g.lead
    mods = g.modules
    head = f"#### {_SEV_LABEL[f.severity]} · `{f.kind}`"
    if len(g.findings) > 1:
        head += f" · on {len(mods) + g.unlisted} layers"
    else:
        if f.module:
            head += f" · `{f.module}`"
        if f.op:
            head += f" · op `{f.op}`"
        if f.step is not None:
            head += f" · step {f.step}"
    lines = [head, ""]
    if len(g.findings) > 1:
        lines += [f"Layers, worst first: {_listed(mods, code=True)}"
                  + (f", and {g.unlisted} more not listed" if g.unlisted else "") + ".", "",
                  f"Worst: {_md(g.worst_message)}", ""]
    else:
        lines += [_md(f.message), ""]
    if f.frame:
        lines += [f"At `{f.frame}`", ""]
    lines += [f"**Fix:** {f.advice}", ""] if f.advice else [""]
    return "\n".join(lines)


def render_markdown(s: Session, max_layers: int = MAX_LAYERS) -> str:
    """Markdown for TensorBoard's TEXT tab: verdict first, then one block per finding."""
    out = [render_verdict(s), ""]
    nxt = next_commands(s)
    if nxt:
        # The report file's Next: section, here under the verdict: the card scrolls, and
        # below the findings it was out of sight (review 52b).
        out.extend(["**Next**", ""])
        for line in nxt:
            said, sep, cmd = line.rpartition(": amp-doctor ")
            out.append(f"- {_md(said)}: `amp-doctor {cmd}`" if sep else f"- {_md(line)}")
        out.append("")
    out.extend([f"*{summary_line(s)}*", ""])
    if s.findings:
        groups = group_findings(s.findings, s.layers)
        out += [_counts_line(s), "", "---", ""]
        for g in groups:
            out.append(_md_group(g))
    sl = _scaler_line(s)
    if sl:
        out.extend(["---", "", sl])
    if s.layers:
        out.extend(["", _md(_table_key(s)), "", layer_table(s, max_layers, fmt="github")])
    return "\n".join(out) + "\n"
