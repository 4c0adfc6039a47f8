"""A layer with weights whose output was exactly zero in every recorded step, from a
non-zero input.

Nothing flows back through zeros: its weights and every layer before it get exactly
zero gradient and do not train, and the layers after it see a constant. In a float16
forward this is the mark of an op inside the layer that overflowed to inf and was then
divided by (a hand-written norm: ``x / sqrt(x.pow(2).mean())`` is 0 once ``x ** 2``
passes 65504, that is |x| > 256). No value is non-finite in the layer's output, so no
overflow finding sees it; the layers after it report only what follows from it (the
model's output on one value: ``output_resolution``), and anomaly mode's op, whose inf
a later op dropped, read as harmless (``nonfinite_discarded``). Those are folded into
this finding (:func:`fold_zeroed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from amp_doctor import format as F
from amp_doctor.analysis.advice import ADVICE
from amp_doctor.analysis.dataflow import layers_after, layers_before, producers
from amp_doctor.analysis.thresholds import (
    PARTLY_ZEROED_FRAC,
    STARVED_ZERO_FRAC,
    ZEROS_OF_INPUT_RATIO,
)
from amp_doctor.dtypes import FORMAT_MAX, LOW_PRECISION_NAMES
from amp_doctor.records import Finding, LayerSummary, Session

__all__ = ["zeroed_findings", "fold_zeroed"]

# Layers that make zeros of negative values by design: all-zero output from an input
# with no positive value is a dead unit, not an op that overflowed.
_RECTIFIERS = frozenset({"ReLU", "ReLU6", "Threshold", "Hardtanh"})
# The layers a partly zeroed finding's `--fp32` hint names, at most.
MAX_NAMED_FP32 = 4
# One recorded step's zeros may be a zero-initialised layer's first step.
MIN_RECORDED = 2
# Findings of the layers after it that only follow from the constant it fed them.
_DOWNSTREAM_KINDS = frozenset({"output_resolution"})


def _zeroed(session: Session, lay: LayerSummary) -> list[LayerSummary] | None:
    """Its non-zero inputs (the layers that fed it), when its output was exactly zero in
    every recorded step; None for any other layer."""
    if (lay.recorded_steps < MIN_RECORDED or lay.passthrough or lay.nonfinite_steps
            or lay.absmax != 0 or lay.zero_frac < 1.0):
        return None
    if not lay.param_dtypes or (lay.param_grad_zero_frac or 0.0) < STARVED_ZERO_FRAC:
        # Its weights get a gradient: a zero-initialised layer (LoRA's B, a DiT's final
        # projection) trains out of its zeros. Or it has none: a disabled branch
        # (Dropout(p=1)), a modality's mask, a dead unit put out zeros by design, in
        # float32 too (review 47c); a norm whose square overflowed has a weight.
        return None
    fed = [p for p in producers(session, lay) if p.recorded_steps and p.absmax > 0]
    if lay.type in _RECTIFIERS:
        fed = [p for p in fed if p.max > 0]
    return fed or None


def _partly_zeroed(session: Session, lay: LayerSummary) -> list[LayerSummary] | None:
    """Its float16 inputs (the layers that fed it), when its output held many more exact
    zeros than any of them and one of them was large enough that its square overflows
    float16; None for any other layer. A hand-written norm's ``x.pow(2).mean()`` is inf
    for the rows with an |x| > 256, and ``x * rsqrt(inf)`` zeroes those rows only
    (review 52a: two thirds of every RMSNorm's rows, the loss finite and no backoff)."""
    if (lay.recorded_steps < MIN_RECORDED or lay.passthrough or lay.nonfinite_steps
            or not lay.param_dtypes or lay.type in _RECTIFIERS
            or "float16" not in lay.input_dtypes
            or not PARTLY_ZEROED_FRAC <= lay.zero_frac < 1.0):
        return None
    fed = [p for p in producers(session, lay) if p.recorded_steps]
    if not fed or any(p.zero_frac > lay.zero_frac * ZEROS_OF_INPUT_RATIO for p in fed):
        return None  # the zeros may be the input's own (a ReLU before it)
    if max(p.absmax for p in fed) ** 2 <= FORMAT_MAX["float16"]:
        return None
    return fed


def _partly_zeroed_findings(session: Session) -> Iterable[Finding]:
    """One finding per layer type (its instances share the code that overflows)."""
    by_type: dict[str, list[tuple[LayerSummary, list[LayerSummary]]]] = {}
    for lay in session.layers:
        fed = _partly_zeroed(session, lay)
        if fed is not None:
            by_type.setdefault(lay.type, []).append((lay, fed))
    for found in by_type.values():
        lay, fed = found[0]
        src = max(fed, key=lambda p: p.absmax)
        also = [x.name for x, _ in found[1:]]
        same = (f" So were {F.counted(len(also), 'other layer')} of its type, fed alike: "
                f"{', '.join(F.layer(n) for n in also[:6])}" + (", ..." if len(also) > 6 else "")
                + "." if also else "")
        why = (" In float16 that is the mark of an op inside it that overflowed to inf and was "
               "then divided by: a hand-written norm's `x.pow(2).mean()` is inf for every row "
               f"with an |x| > 256 (its input reached {F.num(src.absmax)}), and "
               "`x * torch.rsqrt(inf)` is 0. Those rows (samples, tokens) are zeroed silently: "
               "the loss stays finite, no GradScaler backoff shows it, and they give the "
               "layers before it no gradient. `"
               + " ".join(f"--fp32 {n}" for n in [lay.name, *also][:MAX_NAMED_FP32])
               + f"` runs {'them' if also else 'it'} in float32 without editing the code; "
               "anomaly mode (`--anomaly`) names the op and its line.")
        yield Finding(
            kind="zeroed_output", severity="error",
            module=lay.name, op=None, step=None,
            message=(f"{F.layer(lay.name)} ({lay.type})'s output was exactly zero in "
                     f"{F.pct(lay.zero_frac)} of its values over {lay.recorded_steps} recorded "
                     f"steps, though its float16 input had almost none ({F.layer(src.name)}'s "
                     f"output: {F.pct(src.zero_frac)} zeros, absmax {F.num(src.absmax)})."
                     + same + why),
            advice=ADVICE["zeroed_output_partly"],
            data={"input_absmax": src.absmax, "input_from": src.name, "partly": True,
                  "zero_frac": lay.zero_frac, "also": also, "starved_layers": [],
                  "own_weights_starved": False, "after": [], "dtype": "float16",
                  "hint": why},
        )


def zeroed_findings(session: Session) -> Iterable[Finding]:
    yield from _partly_zeroed_findings(session)
    for lay in session.layers:
        fed = _zeroed(session, lay)
        if fed is None:
            continue
        before = [p for p in layers_before(session, lay)
                  if p.param_dtypes and (p.param_grad_zero_frac or 0.0) >= STARVED_ZERO_FRAC]
        after = [x.name for x in layers_after(session, lay) if not x.passthrough]
        low = next((d for d in [*lay.input_dtypes, *lay.output_dtypes]
                    if d in LOW_PRECISION_NAMES), None)
        src = max(fed, key=lambda p: p.absmax)
        # Its own weights got none (see _zeroed): the finding is an error.
        starved = [f"{F.layer(lay.name)}'s weights"] + (
            [f"the {F.counted(len(before), 'layer')} before it "
             f"({', '.join(F.layer(p.name) for p in before[:6])}"
             + (", ..." if len(before) > 6 else "") + ")"] if before else [])
        trains = (f" Nothing flows back through zeros: {F.and_list(starved)} got exactly zero "
                  "gradient in every recorded step and did not train.")
        try_it = (f" `--fp32 {lay.name}` runs it in float32 without editing the code; anomaly "
                  "mode (`--anomaly`) names the op and its line.")
        why = (" In float16, that can be the mark of an op inside it that overflowed to inf and "
               "was then divided by: `x / sqrt(x.pow(2).mean())` is 0 once `x ** 2` passes "
               "float16's max 65504 (|x| > 256)." + try_it if low == "float16" else
               f" It ran in {low}: an op inside it may have made inf or 0 that a later op turned "
               "into these zeros." + try_it if low else "")
        yield Finding(
            kind="zeroed_output", severity="error",
            module=lay.name, op=None, step=None,
            message=(f"{F.layer(lay.name)} ({lay.type})'s output was exactly zero in every "
                     f"recorded step ({lay.recorded_steps}), though its input was not "
                     f"({F.layer(src.name)}'s output, absmax {F.num(src.absmax)})."
                     + trains
                     + (f" The layers after it ({', '.join(F.layer(n) for n in after[:4])}"
                        + (", ..." if len(after) > 4 else "") + ") saw a constant input."
                        if after else "") + why),
            advice=ADVICE["zeroed_output"],
            data={"input_absmax": src.absmax, "input_from": src.name,
                  "starved_layers": [p.name for p in before], "own_weights_starved": True,
                  "after": after, "dtype": low, "hint": why},
        )


def fold_zeroed(session: Session, out: list[Finding]) -> list[Finding]:
    """The findings that follow from a zeroed output become its consequences: the model's
    output on one value after it, and anomaly mode's op inside it whose inf a later op
    turned into the zeros (then this finding names that op and its line)."""
    roots = [f for f in out if f.kind == "zeroed_output"]
    if not roots:
        return out
    result: list[Finding] = []
    named: dict[int, Finding] = {}
    for f in out:
        root = next((r for r in roots if (
            f.kind in _DOWNSTREAM_KINDS and f.module in r.data["after"]) or (
            f.kind in ("nonfinite_discarded", "activation_overflow") and f.op
            and (f.kind == "nonfinite_discarded" or f.data.get("hidden"))
            and f.module in (r.module, *r.data.get("also", ())))), None)
        if root is None:
            result.append(f)
        elif f.kind in ("nonfinite_discarded", "activation_overflow") and id(root) not in named:
            named[id(root)] = f  # its op names the cause: said in the root's message
        else:
            result.append(dataclasses.replace(
                f, severity="info", data={**f.data, "follow_on_of": root.module}))
    if not named:
        return result
    return [_with_op(f, named[id(f)]) if id(f) in named else f for f in result]


def _with_op(root: Finding, op: Finding) -> Finding:
    d = op.data
    made = ("+inf" if d.get("pos_inf") else "-inf" if d.get("neg_inf") else "NaN")
    hint = str(root.data.get("hint") or "")
    head = root.message[: len(root.message) - len(hint)] if hint else root.message
    return dataclasses.replace(
        root, op=op.op, step=op.step, frame=op.frame,
        message=(head + f" Anomaly mode saw {op.op} in it make {made} from finite "
                 f"{d.get('dtype')} inputs (absmax {F.num(d.get('input_absmax'))}) at step "
                 f"{op.step}, at {op.frame}; a later op in {F.layer(root.module or '')} turned "
                 "the inf into these zeros. Compute that op in float32 (`x.float()` before "
                 f"it), or run the layer in float32 (`--fp32 {root.module}`)."),
        data={**root.data, "op": op.op, "op_step": op.step, "op_frame": op.frame})
