"""A run that diverged before it overflowed: the loss climbed, then values left float16.

A learning rate that is too high (a warmup that never stops) grows the weights and the
loss in every format; float16 overflows first, and its overflow is what the layer
findings see. Advising float32 or bfloat16 for that layer only delays the NaN (the
review's run went NaN in float32 too). So when the recorded loss rose far above its own
running minimum before the first non-finite loss, the overflow and non-finite-loss
errors say so, and their advice starts with the learning rate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from amp_doctor import format as F
from amp_doctor.analysis.thresholds import DIVERGED_LOSS_RISE
from amp_doctor.records import Finding, Session

__all__ = ["Divergence", "divergence", "note_divergence"]

# The errors whose cause a divergence would be.
_KINDS = ("activation_overflow", "nonfinite_loss")


@dataclass(frozen=True)
class Divergence:
    """The recorded loss at its lowest, and at its highest after that, before it went
    non-finite."""

    low_step: int
    low: float
    high_step: int
    high: float


def divergence(session: Session) -> Divergence | None:
    """The climb of the recorded loss before its first non-finite value, if it rose more
    than :data:`DIVERGED_LOSS_RISE` times above its running minimum, and above where it
    started; None otherwise. A loss that fell near zero and then read 3000x higher on one
    noisy batch, still below its first value, is no divergence (review 51: a focal loss
    at 1.4e-4, then 0.41, from 1.61 at the start)."""
    best: tuple[int, float] | None = None
    start: float | None = None
    found: Divergence | None = None
    for r in session.history:
        if r.loss is None:
            continue
        if not math.isfinite(r.loss):
            break
        loss = abs(r.loss)
        if start is None:
            start = loss
        if best is None or loss < best[1]:
            best = (r.step, loss)
        elif best[1] > 0 and loss > DIVERGED_LOSS_RISE * best[1] and loss > start and (
                found is None or loss > found.high):
            found = Divergence(best[0], best[1], r.step, loss)
    return found


def note_divergence(session: Session, findings: list[Finding]) -> list[Finding]:
    """The overflow and non-finite-loss errors of a run that diverged first, told so."""
    d = divergence(session)
    if d is None:
        return findings
    said = (f" Before it, the loss rose from {F.num(d.low)} (step {d.low_step}) to "
            f"{F.num(d.high)} (step {d.high_step}): the run was diverging, and the overflow "
            "may be its end rather than its cause.")
    advice = ("The loss climbed before any overflow: lower the learning rate (or end its "
              "warmup, add gradient clipping) first; float32 or bfloat16 for a layer would "
              "only delay the NaN of a run that diverges. Then, if it still overflows: ")
    out = []
    for f in findings:
        if f.kind in _KINDS and f.severity == "error":
            f = dataclasses.replace(
                f, message=f.message + said, advice=advice + f.advice,
                data={**f.data, "diverged": dataclasses.asdict(d)})
        out.append(f)
    return out
