"""Non-finite gradients the optimizer applied: the origin from the failing step's layers.

Without a GradScaler nothing skips a step whose gradients hold NaN/inf: the
optimizer writes them into the parameters, and from then on every layer that
uses those parameters is non-finite. Anomaly mode's op-level search, armed on
the steps after its per-step check saw the first non-finite gradient, then sees
non-finite weights going into every op, and cannot name one
(``nonfinite_unlocated`` with ``weights_nonfinite_at``). The later recorded
steps mislead in the same way: their first non-finite layer is merely the first
one to use a corrupted weight.

The failing step itself still started from finite weights. When it was
recorded, its per-layer flags name the first layer, in forward order, whose
output went non-finite: that layer's finding (or, if the layer figures made
none, a ``nonfinite_forward`` finding for it) becomes the one error for the root
cause, and says that the optimizer step then corrupted the parameters. The
unlocated finding, the NaN loss and the layers that only went non-finite after
the corruption are folded into it. When the failing step was not recorded, the
unlocated finding itself is the error, and says what would name the layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from amp_doctor import format as F
from amp_doctor.analysis.advice import ADVICE, ADVICE_BF16
from amp_doctor.dtypes import LOW_PRECISION_NAMES
from amp_doctor.records import Finding, LayerStep, Session, StepRecord

__all__ = ["fold_corrupted_weights", "failing_step_origin", "corruption_of",
           "Corruption"]

# Ops autocast inserts to cast a layer's inputs: never where a value overflows.
_INPUT_COPIES = frozenset({"aten._to_copy", "aten.to", "aten.clone", "aten.copy_"})
# Layer-level findings that say a layer's output overflowed or went non-finite.
_LAYER_KINDS = ("activation_overflow", "nonfinite_forward")
# Root findings that a layer named by the failing step's flags may already have.
_ROOT_KINDS = ("activation_overflow", "nonfinite_forward", "nonfinite_backward")


class Corruption(NamedTuple):
    """What an unlocated finding says about weights the optimizer made non-finite."""

    finding: Finding
    first: int  # the first step whose gradients were non-finite
    found_at: int  # the step anomaly mode found the weights non-finite


def corruption_of(f: Finding) -> Corruption | None:
    """The corruption an unlocated finding reports, if the weights were non-finite."""
    at = f.data.get("weights_nonfinite_at")
    if f.kind != "nonfinite_unlocated" or not isinstance(at, int) or f.step is None:
        return None
    return Corruption(f, f.step, at)


def _flagged(ls: LayerStep, low: bool) -> bool:
    a = ls.act
    return a is not None and (a.nonfinite_frac > 0 or (low and a.overflow_frac > 0))


def failing_step_origin(session: Session, step: int) -> str | None:
    """The first layer, in forward order, whose output overflowed or went non-finite
    in recorded step ``step`` (None: the step was not recorded, or no layer was).

    The NaN loss event computed it from all the step's layers when the loss was bad
    then; otherwise the step's history row (its worst layers, non-finite first).
    """
    for e in session.events:
        if (e.kind == "nonfinite_loss" and e.data.get("recorded_at") == step
                and isinstance(e.data.get("origin"), str)):
            return str(e.data["origin"])
    rec: StepRecord | None = next((r for r in session.history if r.step == step), None)
    if rec is None:
        return None
    lays = {lay.name: lay for lay in session.layers}
    bad = [n for n, ls in rec.layers.items() if n in lays and _flagged(
        ls, bool(LOW_PRECISION_NAMES.intersection(lays[n].output_dtypes)))]
    return min(bad, key=lambda n: lays[n].order) if bad else None


def _ops_hint(session: Session, module: str) -> list[str]:
    """The ops that ran in ``module`` in the first step (anomaly mode's op record)."""
    lay = next((x for x in session.layers if x.name == module), None)
    if lay is None:
        return []
    return [f"{op} ({'/'.join(sorted(dts))})" for op, dts in lay.ops.items()
            if op not in _INPUT_COPIES]


def _recorded(session: Session, step: int) -> bool:
    return any(r.step == step for r in session.history)


def _corruption_text(c: Corruption, scaled: bool) -> str:
    skip = (f"The GradScaler did not skip step {c.first} for every optimizer: one whose "
            "gradients were finite when the scaler checked them (at `unscale_`) stepped on "
            "gradients made non-finite after that (a `clip_grad_norm_` over several "
            "optimizers' parameters whose total norm was NaN/inf multiplies every gradient "
            "by NaN; clip each optimizer's parameters apart), so an optimizer step "
            if scaled else f"With no GradScaler to skip step {c.first}, its optimizer step ")
    return (f"{skip}applied the non-finite gradients: the parameters were non-finite from "
            f"then on (anomaly mode found them so at step {c.found_at}), so every later "
            "step is NaN/inf too, and anomaly mode's op-level search, which needs finite "
            "inputs, could not name the op")


def _loss_note(f: Finding, c: Corruption) -> Finding:
    """A NaN loss first checked after the corruption: its 'origin' is only the first
    layer to use a corrupted weight."""
    d = f.data
    shown = f.module or d.get("shown_in")
    msg = (f"The loss was NaN/inf in {d.get('steps_bad')} of the {d.get('checked')} "
           f"step(s) whose loss was checked ({d.get('steps')} steps in all), first checked "
           f"at step {f.step}; it began after step {c.first}'s update. By then the "
           f"parameters were already non-finite (the optimizer applied step {c.first}'s "
           "non-finite gradients), so "
           + (f"{F.layer(shown)}, the first layer to use them, is where it showed, not where it "
              "began." if shown else "where it showed says nothing of where it began."))
    return replace(f, module=None, message=msg,
                   data={**d, "origin": None,
                         "origin_after_corruption": d.get("origin") or d.get("shown_in")})


def fold_corrupted_weights(session: Session, out: list[Finding]) -> list[Finding]:
    """One error for a non-finite step whose update corrupted the weights (see module doc).

    Runs before :func:`~amp_doctor.analysis.folding.fold_follow_ons`, which then folds
    the NaN loss and the layers that only carried it on into the origin's finding.
    """
    c = next((x for f in out if (x := corruption_of(f)) is not None), None)
    if c is None:
        return out
    bf16 = session.amp.dtype == "bfloat16"
    origin = failing_step_origin(session, c.first)
    consequences: list[str] = []
    kept: list[Finding] = []
    for f in out:
        if f.kind == "nonfinite_loss" and isinstance(f.data.get("recorded_at"), int) \
                and f.data["recorded_at"] > c.first:
            f = _loss_note(f, c)
            consequences.append(f"the loss was NaN/inf in {f.data.get('steps_bad')} of "
                                f"the {f.data.get('checked')} steps checked")
            if origin is not None:
                continue  # the origin's finding below says it
            f = replace(f, severity="info", data={**f.data, "follow_on_of": c.finding.kind})
        kept.append(f)
    out = kept
    if origin is None:
        return [_unlocated_error(session, f, c, consequences) if f is c.finding else f
                for f in out]
    # Layers whose output went non-finite only once the weights were: not causes.
    rec = next((r for r in session.history if r.step == c.first), None)
    after: list[str] = []
    root: Finding | None = None
    kept = []
    for f in out:
        if f is c.finding:
            continue
        if f.severity == "error" and f.kind in _ROOT_KINDS and f.module == origin \
                and root is None:
            root = f
        elif (rec is not None and f.kind in _LAYER_KINDS and f.op is None
              and f.severity == "error" and f.module is not None and f.module != origin
              and not (f.module in rec.layers and rec.layers[f.module].act is not None
                       and _flagged(rec.layers[f.module], True))):
            after.append(f.module)
            continue
        kept.append(f)
    ops = _ops_hint(session, origin)
    text = (f"NaN/inf first appeared at step {c.first} in {F.layer(origin)}'s output (the first "
            f"layer, in forward order, to go non-finite in that recorded step). "
            + _corruption_text(c, session.amp.scaler)
            + (f"; the ops that ran in {origin}: {', '.join(ops[:6])}" if ops else "") + "."
            + (f" Layers that went non-finite only after that, from the corrupted weights: "
               f"{', '.join(after[:8])}." if after else ""))
    if consequences:
        text += " Consequences: " + "; ".join(consequences) + "."
    data = {"first_nonfinite_step": c.first, "weights_nonfinite_at": c.found_at,
            "origin_from": f"recorded step {c.first}", "ops_in_module": ops,
            "after_corruption": after, "unlocated_steps": c.finding.steps}
    if root is None:
        advice = (ADVICE_BF16 if bf16 else ADVICE).get(
            "nonfinite_forward" if bf16 else "activation_nonfinite", "")
        new = Finding(kind="nonfinite_forward", severity="error", module=origin, op=None,
                      step=c.first, message=text, advice=advice, frame=None, count=1,
                      steps=[c.first], data=data)
        return [new, *kept]
    grown = replace(root, step=root.step if root.step is not None else c.first,
                    message=f"{root.message} {text}", data={**root.data, **data})
    return [grown if f is root else f for f in kept]


def _unlocated_error(session: Session, f: Finding, c: Corruption,
                     consequences: list[str]) -> Finding:
    """The failing step's layers are unknown: the unlocated finding is the error."""
    every = session.run.every
    why = (f"step {c.first} was not a recorded step (every={every}), so its layer figures "
           "were not kept" if not _recorded(session, c.first) else
           f"in step {c.first} every watched layer's output was finite: it appeared in "
           "backward, or outside the watched layers")
    msg = (f"NaN/inf first appeared at step {c.first}, and anomaly mode could not say "
           f"where: {why}. " + _corruption_text(c, session.amp.scaler) + ".")
    if consequences:
        msg += " Consequences: " + "; ".join(consequences) + "."
    return replace(f, severity="error", message=msg, data={
        **f.data, "first_nonfinite_step": c.first, "consequences": consequences,
        "failing_step_recorded": _recorded(session, c.first)})
