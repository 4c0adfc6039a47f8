"""What one anomaly check reads: op entries, root-model batches and per-step flags.

Everything since the last check is gathered into one device bool vector, so a
recorded step carries it in its single host copy (its sum), and a healthy
window costs no sync of its own. Only a flagged window is read in full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from amp_doctor.anomaly.origins import OpWindow, origin_flags, stack_rows
from amp_doctor.anomaly.stepcheck import RootCall, StepFlag
from amp_doctor.anomaly.userframes import format_frames
from amp_doctor.device.stats import bad_batch, upload
from amp_doctor.devicework import count_sync
from amp_doctor.records import Event

__all__ = ["CheckWindow", "gather", "input_event"]


@dataclass
class CheckWindow:
    """Everything checked together: op entries, root calls, per-step gradient flags.

    ``flags`` is one device bool vector over the three, in that order (then the
    weight flags, then the loss flags); ``call_rows`` the root calls' (min, max) rows,
    fetched with the flags when anything was flagged.
    """

    ops: OpWindow
    calls: list[RootCall]
    grads: list[StepFlag]
    flags: torch.Tensor
    op_rows: torch.Tensor | None
    call_rows: torch.Tensor | None
    weights: list[StepFlag] = field(default_factory=list)
    # Each step's loss check (device bools, the end of ``flags``).
    losses: list[StepFlag] = field(default_factory=list)
    # Per root call: a finite batch beyond the max of the format autocast casts it to
    # (device bools, not in ``flags``: large inputs that a float32 first layer takes are
    # no anomaly; read when a step's gradients are flagged).
    beyond: torch.Tensor | None = None

    # The loss flags on the host, read once (see :meth:`_losses_bad`).
    _loss_bad: list[bool] | None = field(default=None, repr=False)

    def note_host_flags(self, host: list[bool]) -> None:
        """``flags`` on the host, read by the caller: the loss flags need no sync of their
        own."""
        if self.losses:
            self._loss_bad = host[len(host) - len(self.losses):]

    def _losses_bad(self) -> list[bool]:
        """Each of :attr:`losses`' flags on the host: one sync, the first time only."""
        if self._loss_bad is None:
            home = self.losses[0].value.device
            self._loss_bad = torch.stack([s.value.to(home) for s in self.losses]).tolist()
            count_sync()
        return self._loss_bad

    def finite_loss_steps(self) -> frozenset[int]:
        """The steps whose loss was checked and finite (syncs: an abnormal window only)."""
        if not self.losses:
            return frozenset()
        bad = self._losses_bad()
        bad_steps = {s.step for s, b in zip(self.losses, bad, strict=True) if b}
        return frozenset(s.step for s in self.losses if s.step not in bad_steps)

    def dropped_only_steps(self, grad_flags: list[bool]) -> frozenset[int]:
        """The steps that went bad only in a forward the loop dropped before backward:
        its output was NaN/inf while the step's own loss and gradients stayed finite
        (``grad_flags``: :attr:`grads`' flags, read already). Syncs: abnormal window only."""
        if not any(s.dropped for s in self.losses):
            return frozenset()
        bad = self._losses_bad()
        dropped = {s.step for s, b in zip(self.losses, bad, strict=True) if b and s.dropped}
        own_bad = {s.step for s, b in zip(self.losses, bad, strict=True) if b and not s.dropped}
        own_bad |= {g.step for g, b in zip(self.grads, grad_flags, strict=True)
                    if b and not g.dropped}
        return frozenset(dropped - own_bad)


def gather(p: OpWindow, calls: list[RootCall], grads: list[StepFlag],
           weights: list[StepFlag], losses: list[StepFlag] | None = None
           ) -> CheckWindow | None:
    """One window's flags on the device (no sync); None if there is nothing to check."""
    parts: list[torch.Tensor] = []
    op_rows = call_rows = None
    if p.entries:
        op_flags, op_rows = origin_flags(p, p.entries)
        parts.append(op_flags)
    beyond = None
    if calls:
        call_rows = stack_rows([c.row for c in calls])
        bad = bad_batch(call_rows)
        parts.append(bad)
        finite = [math.isfinite(c.limit) for c in calls]
        if any(finite):
            # Every finite limit is float16's: one compare, masked where autocast was off.
            limit = min(c.limit for c in calls)
            # Finite values past the max: a -inf mask's is no value that a cast makes inf.
            top = call_rows.abs().amax(1)
            beyond = (top > limit) & top.isfinite() & ~bad
            if not all(finite):
                beyond &= upload([int(x) for x in finite], call_rows.device).bool()
    sums = [g.value for g in grads] + [g.value for g in weights]
    if not parts and not sums:
        return None
    # Gather on an accelerator if there is one: a copy to the CPU would sync.
    home = next((x.device for x in parts + sums if x.device.type != "cpu"),
                (parts + sums)[0].device)
    if sums:
        parts.append(~torch.isfinite(torch.stack([s.to(home) for s in sums])))
    if losses:
        # A NaN loss with finite gradients (a 0/0 term over no elements) is a bad step
        # too, which no gradient flag shows: it arms the search (review 55).
        parts.append(torch.stack([s.value.to(home) for s in losses]))
    flags = torch.cat([x.to(home) for x in parts])
    return CheckWindow(p, calls, grads, flags, op_rows, call_rows, weights, losses or [],
                       beyond)


def input_event(c: RootCall, row: torch.Tensor) -> Event:
    """The ``nonfinite_input`` event for a root call whose batch (host ``row``) was bad."""
    lo, hi = float(row[0]), float(row[1])
    nan = math.isnan(lo) or math.isnan(hi)
    data: dict[str, Any] = {
        "dtype": c.dtype, "nan": nan, "pos_inf": hi == math.inf, "neg_inf": lo == -math.inf,
        "frames": format_frames(c.frames),
        "output_min": lo, "output_max": hi,
    }
    frame = data["frames"][0] if data["frames"] else None
    return Event(kind="nonfinite_input", step=c.step, module=c.module, frame=frame, data=data)
