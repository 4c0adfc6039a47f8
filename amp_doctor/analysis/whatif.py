"""What another format would do: float16 for a bfloat16 run, and FP8 readiness.

Everything here is a **simulation from the recorded histograms**, not a run
in that format: each layer's float32-exponent histogram (summed over the
recorded steps) says how many values fall below or beyond a format's limits,
and the per-step absolute maxima say how a per-tensor scale would move.

FP8 follows TransformerEngine's delayed per-tensor scaling: before a cast,
values are multiplied by ``scale = format max / amax``, with ``amax`` the
largest absolute value over a window of recent steps (:data:`FP8_AMAX_WINDOW`).
Activations and weights use e4m3, gradients e5m2. What the table shows per
layer: the share of values that would flush to zero after scaling, the share
that would be subnormal (precision lost), how far the amax moved over the run
(the spread, in bits), and in how many steps the amax outran the delayed
scale (values that would saturate).

Pure Python on a :class:`~amp_doctor.records.Session`; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from amp_doctor import format as F
from amp_doctor.records import (
    AMAX_OUTRUN_FACTOR,
    FP8_AMAX_WINDOW,
    Finding,
    LayerSummary,
    Session,
    Severity,
)

__all__ = ["Format", "FORMATS", "Fp8Row", "fp8_rows", "float16_rows", "render_fp8_table",
           "whatif_findings", "TARGET_DTYPES"]

F32_BIAS = 127
N_BINS = 256
# A layer is listed when at least this share of its values overflows, flushes to zero
# (FP8), or falls below the smallest normal (float16; small outputs are common, so
# the bar is higher).
AFFECTED_SHARE = 0.001
UNDERFLOW_SHARE = 0.01
# A float16 run would scale its gradients with a GradScaler; judge them at its default
# init_scale (2**16), not unscaled as a bfloat16 run holds them.
FP16_GRAD_SCALE_LOG2 = 16
# The listed layers in a finding's message; the rest are in its data.
MAX_LISTED = 8
TARGET_DTYPES = ("float16", "float8")


@dataclass(frozen=True)
class Format:
    name: str
    max: float
    normal_exp: int  # log2 of the smallest normal
    subnormal_exp: int  # log2 of the smallest subnormal


FORMATS: dict[str, Format] = {
    "float16": Format("float16", 65504.0, -14, -24),
    "bfloat16": Format("bfloat16", 3.3895313892515355e38, -126, -133),
    "e4m3": Format("e4m3", 448.0, -6, -9),
    "e5m2": Format("e5m2", 57344.0, -14, -16),
}


def _shares(hist: list[int], fmt: Format, shift: float = 0.0) -> tuple[float, float, float]:
    """(below smallest subnormal/2 -> zero, subnormal, beyond max) shares of the non-zero values.

    Bin ``b`` holds ``|x|`` in ``[2**(b-127), 2**(b-126))``; after multiplying by
    ``2**shift`` a bin counts as flushed when its top edge is at most half the
    smallest subnormal, as subnormal when its top edge is at most the smallest
    normal, and as beyond the max when its bottom edge is at least the max.
    Bin 0 (zeros and float32 subnormals) and bin 255 (inf/NaN) are left out.
    """
    total = sum(hist[1:N_BINS - 1])
    if total <= 0:
        return 0.0, 0.0, 0.0
    zero = sub = over = 0.0
    log_max = math.log2(fmt.max)
    for b in range(1, N_BINS - 1):
        n = hist[b]
        if not n:
            continue
        lo = b - F32_BIAS + shift
        hi = lo + 1
        if hi <= fmt.subnormal_exp - 1:
            zero += n
        elif hi <= fmt.normal_exp:
            sub += n
        elif lo >= log_max:
            over += n
    return zero / total, sub / total, over / total


@dataclass(frozen=True)
class Fp8Row:
    layer: str
    tensor: str  # activation | gradient
    format: str  # e4m3 | e5m2
    zero_share: float  # flushed to zero after per-tensor scaling
    subnormal_share: float
    amax_spread_bits: float | None  # log2(max amax / min amax) over recorded steps
    steps_amax_beyond_scale: int  # steps whose amax outran the delayed window's
    recorded: int
    # Recorded steps right after another recorded step: only there is the amax compared
    # with the delayed scale (it updates every step; `every=10` records one step in ten).
    compared: int = 0
    # Recorded steps whose tensor held inf/NaN: left out of the simulation, since the
    # magnitudes of the values that overflowed are not known (review 52a: a layer 13 of
    # 20 steps inf read as an ordinary row, and "nothing to fix for FP8").
    nonfinite_steps: int = 0
    steps: int = 0  # recorded steps the layer ran in


def _amaxes(s: Session, name: str, grad: bool, unscaled: bool = False
            ) -> list[tuple[int, float]]:
    """(step, amax) of the layer's recorded steps; ``unscaled``: a gradient's amax as if
    no GradScaler had scaled it (where the step has that view), as FP8 training would
    hold it."""
    out = []
    for r in s.history:
        ls = r.layers.get(name)
        st = None
        if ls is not None:
            st = ls.act if not grad else (
                ls.grad_unscaled if unscaled and ls.grad_unscaled is not None else ls.grad)
        if st is not None and math.isfinite(st.absmax) and st.absmax > 0:
            out.append((r.step, st.absmax))
    return out


def _outran(steps: list[tuple[int, float]]) -> tuple[int, int]:
    """(steps whose amax outran the delayed scale, steps compared). A step is compared
    only right after a recorded step: the delayed scale follows every step's amax, and
    an amax that doubled over ten unrecorded steps outran nothing."""
    beyond = compared = 0
    for i in range(1, len(steps)):
        step, amax = steps[i]
        if step - steps[i - 1][0] != 1:
            continue
        window = [a for st, a in steps[:i] if step - FP8_AMAX_WINDOW <= st < step]
        compared += 1
        beyond += amax > AMAX_OUTRUN_FACTOR * max(window)
    return beyond, compared


def _fp8_row(s: Session, lay: LayerSummary, grad: bool) -> Fp8Row | None:
    hist = lay.grad_exp_hist if grad else lay.act_exp_hist
    if not hist or sum(hist[1:N_BINS - 1]) <= 0:
        return None
    fmt = FORMATS["e5m2" if grad else "e4m3"]
    # The amaxes in the histogram's terms (a gradient's as the GradScaler scaled it), for
    # the scale against it; and as FP8 training would see them, for how they move: a loss
    # scale that fell 2^150 is no spread of the gradients' own.
    tracked = lay.fp8_grad_amax_steps if grad else lay.fp8_act_amax_steps
    if tracked is not None:
        # Every layer's amaxes over every recorded step (steps.amaxes).
        n_amaxes = tracked
        amax = ((lay.fp8_grad_amax_max if grad else lay.fp8_act_amax_max) if tracked
                else lay.grad_absmax if grad else lay.absmax)
        spread = lay.fp8_grad_amax_spread_bits if grad else lay.fp8_act_amax_spread_bits
        beyond, compared = ((lay.fp8_grad_amax_beyond, lay.fp8_grad_amax_compared) if grad
                            else (lay.fp8_act_amax_beyond, lay.fp8_act_amax_compared))
    else:
        # A report written before they were: from the step history, its kept layers only.
        stepped = _amaxes(s, lay.name, grad)
        own = _amaxes(s, lay.name, grad, unscaled=True) if grad else stepped
        amaxes = [a for _, a in stepped]
        n_amaxes = len(amaxes)
        amax = max(amaxes) if amaxes else (lay.grad_absmax if grad else lay.absmax)
        beyond, compared = _outran(own)
        moved = [a for _, a in own]
        spread = math.log2(max(moved) / min(moved)) if len(moved) >= 2 else None
    if amax is None or not math.isfinite(amax) or amax <= 0:
        return None
    # The most conservative scale the window ever had: the run's largest amax.
    shift = math.log2(fmt.max / amax)
    zero, sub, _ = _shares(hist, fmt, shift)
    return Fp8Row(lay.name, "gradient" if grad else "activation", fmt.name, zero, sub,
                  spread, beyond, n_amaxes, compared,
                  lay.grad_nonfinite_steps if grad else lay.nonfinite_steps, lay.recorded_steps)


def fp8_rows(s: Session) -> list[Fp8Row]:
    """FP8 readiness of every layer autocast ran in low precision."""
    rows = []
    for lay in s.layers:
        if not lay.ran_low_precision or lay.passthrough:
            continue
        for grad in (False, True):
            row = _fp8_row(s, lay, grad)
            if row is not None:
                rows.append(row)
    return rows


@dataclass(frozen=True)
class Fp16Row:
    layer: str
    tensor: str
    overflow_share: float
    underflow_share: float  # below float16's smallest normal (flushed or subnormal)


def _applied_scale_log2(s: Session) -> int:
    """log2 of the scale a GradScaler of the run already put in the recorded gradients.

    The gradient histograms hold the values the backward saw: scaled, when the run
    has an enabled GradScaler. The median of the scale timeline stands for the scale
    of every recorded step: exact while the scale holds (a bfloat16 run rarely backs
    off), an estimate of a bit or two once it has grown.
    """
    tl = s.scaler
    if tl is None or not tl.enabled:
        return 0
    logs = sorted(math.log2(v) for _, v in tl.scale if v > 0 and math.isfinite(v))
    if not logs:
        return round(math.log2(tl.init_scale)) if tl.init_scale else 0
    return round(logs[len(logs) // 2])


def float16_rows(s: Session) -> list[Fp16Row]:
    """Layers of a bfloat16 run whose values would leave float16's range."""
    fmt = FORMATS["float16"]
    # Gradients as a float16 run's GradScaler would hold them, from the scale they have.
    grad_shift = FP16_GRAD_SCALE_LOG2 - _applied_scale_log2(s)
    rows = []
    for lay in s.layers:
        if not lay.ran_low_precision or lay.passthrough:
            continue
        for tensor, hist in (("activation", lay.act_exp_hist), ("gradient", lay.grad_exp_hist)):
            if not hist:
                continue
            shift = grad_shift if tensor == "gradient" else 0
            zero, sub, over = _shares(hist, fmt, shift)
            if over >= AFFECTED_SHARE or zero + sub >= UNDERFLOW_SHARE:
                rows.append(Fp16Row(lay.name, tensor, over, zero + sub))
    return rows


def render_fp8_table(s: Session, max_rows: int = 24) -> str:
    """The FP8 readiness table for the text report (worst first); empty if nothing ran low."""
    from tabulate import tabulate

    rows = sorted(fp8_rows(s), key=lambda r: (-r.zero_share, -r.steps_amax_beyond_scale))
    if not rows:
        return ""
    body = [[r.layer, r.tensor, r.format, F.pct(r.zero_share), F.pct(r.subnormal_share),
             "-" if r.amax_spread_bits is None else f"{r.amax_spread_bits:.1f}",
             f"{r.steps_amax_beyond_scale}/{r.compared}" if r.compared else "-"]
            for r in rows[:max_rows]]
    table = tabulate(body, headers=["layer", "tensor", "format", "to zero", "subnormal",
                                    "amax spread (bits)", "amax > 2x scale"],
                     tablefmt="simple", disable_numparse=True)
    more = f"\n... {len(rows) - max_rows} more in the JSON report" if len(rows) > max_rows else ""
    unmeasured = ("\namax > 2x scale: measured only on a recorded step right after "
                  "another ('-': none here; `--every 1` records every step)"
                  if not any(r.compared for r in rows) else "")
    return ("FP8 readiness, simulated from the recorded histograms (per-tensor delayed "
            f"scaling, amax window {FP8_AMAX_WINDOW} steps; not FP8 training):\n"
            + table + more + unmeasured + _nonfinite_note(rows, "\n"))


def _nonfinite_note(rows: list[Fp8Row], lead: str) -> str:
    """What the simulation left out: the steps of tensors that held inf/NaN."""
    hit = [r for r in rows if r.nonfinite_steps]
    if not hit:
        return ""
    listed = _listed(f"{F.layer(r.layer)} {r.tensor}s (in {r.nonfinite_steps} of "
                     f"{max(r.steps, r.nonfinite_steps)} recorded steps)" for r in hit)
    return (f"{lead}Left out of the simulation: the inf/NaN values of {listed}; their "
            "magnitudes are not known. Fix those first (see their findings): FP8 would not "
            "mend them.")


def _listed(items: Iterable[str]) -> str:
    items = list(items)
    more = f", and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return ", ".join(items[:MAX_LISTED]) + more


# The simulation's blind spot, in every float16 what-if: it reads layers' outputs only.
_FP16_UNSEEN = (
    "Values made inside a layer's own forward code, between its sub-layers, are not "
    "simulated (hand-written attention scores `q @ k.transpose(-2, -1)`, an `exp`, a "
    "variance): they can overflow float16 while every layer's output fits. Before "
    "switching, run a few steps in float16 under `amp-doctor diagnose --anomaly`: it "
    "names such an op and its line.")


def _fp16_advice(over: bool, under: bool) -> str:
    """What to do before moving to float16, for what the simulation found."""
    parts = ["Stay on bfloat16, or before moving to float16"]
    if over:
        parts.append(" keep the overflowing layers in float32")
    if under:
        parts.append((" and" if over else "") + " use a GradScaler for the gradients (its "
                     "scale grows past 2^16 while they stay small, which this simulation "
                     "does not model) and keep layers whose outputs fall below float16's "
                     "normal range in float32 or normalise them")
    elif over:
        parts.append(" and use a GradScaler for the gradients")
    return "".join(parts) + "."


def whatif_findings(s: Session, target: str | None = None) -> list[Finding]:
    """``info`` findings for float16 (bfloat16 runs) and FP8; ``warning`` for ``target``."""
    out: list[Finding] = []
    if s.amp.dtype == "bfloat16":
        rows = float16_rows(s)
        if rows:
            sev: Severity = "warning" if target == "float16" else "info"
            over = [r for r in rows if r.overflow_share >= AFFECTED_SHARE]
            under = [r for r in rows if r.underflow_share >= UNDERFLOW_SHARE]
            parts = []
            if over:
                # "layer (tensors: share)": a Sequential's layer "0" read as a count in
                # "0 gradients 3%".
                parts.append("beyond float16's max (65504): " + _listed(
                    f"{F.layer(r.layer)} ({r.tensor}s: {F.pct(r.overflow_share)})" for r in over))
            if under:
                parts.append("below float16's smallest normal (6.1e-05): " + _listed(
                    f"{F.layer(r.layer)} ({r.tensor}s: {F.pct(r.underflow_share)})" for r in under))
            # A run that switched format midway (float16 with a GradScaler, then
            # bfloat16) is bfloat16 by most steps, but not "a bfloat16 run".
            run = ("run (bfloat16 in most steps, float16 in the others)"
                   if "float16" in s.amp.other_dtypes else "bfloat16 run")
            out.append(Finding(
                kind="whatif_float16", severity=sev, module=rows[0].layer, op=None, step=None,
                message=("Simulated from the recorded histograms (gradients as a GradScaler at "
                         f"2^{FP16_GRAD_SCALE_LOG2} would hold them), in float16 this {run} "
                         "would put values " + "; ".join(parts) + "."),
                advice=_fp16_advice(bool(over), bool(under)) + " " + _FP16_UNSEEN,
                data={"rows": [asdict(r) for r in rows]},
            ))
        elif target == "float16":
            # Asked, and nothing found: say so, and what the simulation cannot see.
            out.append(Finding(
                kind="whatif_float16", severity="info", module=None, op=None, step=None,
                message=("Simulated from the recorded histograms (gradients as a GradScaler at "
                         f"2^{FP16_GRAD_SCALE_LOG2} would hold them), no watched layer's "
                         "outputs or output gradients would leave float16's range."),
                advice=_FP16_UNSEEN,
                data={"rows": []},
            ))
    rows8 = fp8_rows(s)
    bad = [r for r in rows8 if r.zero_share >= AFFECTED_SHARE or r.steps_amax_beyond_scale > 0]
    # The table itself renders with every report; a finding only when it says something.
    if rows8 and (bad or target == "float8"):
        sev8: Severity = "warning" if target == "float8" else "info"
        if bad:
            listed = _listed(
                f"{F.layer(r.layer)} ({r.tensor}s, {r.format}: " + ", ".join(_fp8_losses(r)) + ")"
                for r in bad)
            msg = (f"FP8 simulation (per-tensor delayed scaling, amax window "
                   f"{FP8_AMAX_WINDOW} steps; not FP8 training): {len(bad)} of "
                   f"{len(rows8)} tensors would lose values (to zero, or beyond the format's "
                   f"max in steps whose amax outran the delayed scale): {listed}.")
        else:
            msg = (f"FP8 simulation (per-tensor delayed scaling; not FP8 training): all "
                   f"{len(rows8)} low-precision tensors keep at least "
                   f"{100 - AFFECTED_SHARE * 100:g}% of their values after scaling.")
            sev8 = "info"
        msg += _nonfinite_note(rows8, " ")
        out.append(Finding(
            kind="fp8_readiness", severity=sev8, module=bad[0].layer if bad else None, op=None,
            step=None, message=msg,
            advice=("Layers that lose values to zero need a finer scale (per-channel or "
                    "per-block scaling) or must stay in 16-bit; a large amax spread or an "
                    "amax that outruns the scale needs a shorter amax window." if bad else
                    # (Review 52a: the all-fine note kept the remedy for losses it had none of.)
                    "Nothing to fix for FP8 in the recorded steps: per-tensor delayed "
                    "scaling would keep these tensors' values." if not any(
                        r.nonfinite_steps for r in rows8) else
                    "Nothing to fix for FP8 in the finite recorded steps: per-tensor "
                    "delayed scaling would keep those values. The inf/NaN come first."),
            data={"rows": [asdict(r) for r in rows8], "window": FP8_AMAX_WINDOW},
        ))
    return out


def _fp8_losses(r: Fp8Row) -> list[str]:
    """How a tensor would lose values in FP8: flushed to zero, or beyond the format's max
    in the steps whose amax outran the delayed scale (only what applies: "0% to zero"
    beside a loss at the top read as a contradiction)."""
    out = []
    if r.zero_share >= AFFECTED_SHARE:
        out.append(f"{F.pct(r.zero_share)} to zero")
    if r.steps_amax_beyond_scale:
        out.append(f"beyond the max in {F.counted(r.steps_amax_beyond_scale, 'step')}")
    return out
