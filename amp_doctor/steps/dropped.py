"""Training forwards that no backward followed.

A loop that guards itself (``if not torch.isfinite(loss): continue``) never hands
a NaN loss to ``backward`` or to the GradScaler: no backoff, no skipped step, no
loss check of amp-doctor's sees it, and the run's report said nothing about the
NaN the user's own loop printed (review 47a). :class:`DroppedForwards` watches
the model's training forwards instead:

- at the end of each one, one ``aminmax`` pass over each floating tensor the model
  returned leaves its (min, max) on the device, and a gradient hook on each of them
  says whether a backward reached it: nothing more in a step whose forwards were all
  reached;
- at the step's end, a forward that no backward reached is dropped: only then are
  its outputs judged (NaN or inf, as :func:`bad_batch` reads a batch: an additive
  mask's -inf is none). Two views of a contrastive loss, or a generator's output that
  the discriminator's backward does not reach but the generator's does, are reached
  within the step;
- on the device and without a sync, a step with a non-finite dropped forward counts,
  unless its loss was NaN/inf too (that loss's own finding covers it), apart by whether
  the step's batch was bad (:mod:`amp_doctor.steps.batches` checks every batch, and a
  bad one is its finding's, unless the model handles such batches).

The run's counts are read once, at the end, and only in a run that dropped a NaN/inf
forward (``LoopSignals.run_totals``). Dropped iterations are not steps of their own:
amp-doctor counts steps at the optimizer, so such an iteration is part of the step it ran
in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from amp_doctor.device.stats import bad_batch
from amp_doctor.devicework import iter_tensors, own_ops
from amp_doctor.hooks.tensorkinds import unsummarizable

__all__ = ["DroppedForwards", "DroppedTotals", "MAX_OUTPUTS_CHECKED", "MAX_FORWARDS_HELD"]

# Floating tensors of a model's output checked per forward, at most (the logits, a
# returned loss, features: not every hidden state a model may return as well).
MAX_OUTPUTS_CHECKED = 8
# Forwards of one step held until its end, at most (gradient accumulation over many
# micro-batches): the oldest is judged early beyond that.
MAX_FORWARDS_HELD = 64

# Rows of the run's device counts.
_BAD, _GIVEN, _LOSS_ONLY, _NEG_INF_ONLY, _FIRST_GIVEN, _FIRST_MADE = range(6)


@dataclass(frozen=True)
class DroppedTotals:
    """What the dropped forwards held, over the run."""

    # Steps with a dropped forward whose output was NaN/inf and a finite (or no) loss.
    steps_bad: int
    # Of those: the steps whose batch already held NaN/inf, ...
    input_bad: int
    # ... and where only a loss the model returned was bad, its other outputs finite.
    loss_only: int
    # ... and where the only non-finite values were -inf beside positive ones.
    neg_inf_only: int
    # The first step with a bad batch, and the first with another cause (-1: none).
    first_input_bad: int
    first_made: int
    # Forwards no backward reached (host count; most are harmless: a validation
    # forward with grad on).
    dropped: int
    # The model they were forwards of.
    module: str | None


def _summable(obj: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(obj) if t.is_floating_point() and t.numel() > 0
            and unsummarizable(t) is None]


class _Forward:
    """One training forward until its step ends: its outputs' (min, max) on the device,
    and the hooks that tell it was reached."""

    __slots__ = ("owner", "extremes", "scalar", "reached", "handles")

    def __init__(self, owner: int) -> None:
        self.owner = owner
        # Per output tensor: its aminmax (0-d device tensors), and whether it is a scalar.
        self.extremes: list[torch.Tensor] = []
        self.scalar: list[bool] = []
        self.reached = False
        self.handles: list[RemovableHandle] = []

    def reach(self, _grad: torch.Tensor) -> None:
        # A backward computes this output's gradient: the forward was used.
        self.reached = True
        self.extremes = []

    def let_go(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.extremes = []


class DroppedForwards:
    """The lead model's training forwards that no backward reached (see the module doc)."""

    def __init__(self) -> None:
        self._forwards: list[_Forward] = []
        # The current step's flags (device, 0-d bool), from its dropped forwards.
        self._step: dict[str, torch.Tensor] = {}
        # The run's counts so far (device int64, rows as _BAD.._FIRST_MADE; first steps
        # -1: none).
        self._totals: torch.Tensor | None = None
        self.dropped = 0
        self.module: str | None = None

    # -- the forward's life ---------------------------------------------------------
    def started(self, owner: int, name: str | None) -> None:
        """A training forward of the lead model (``id`` ``owner``, called ``name``)."""
        self.module = name
        if len(self._forwards) >= MAX_FORWARDS_HELD:
            self._judge(self._forwards.pop(0))
        self._forwards.append(_Forward(owner))

    def ended(self, output: Any, owner: int) -> None:
        """Its output: each tensor's (min, max) on the device (one ``aminmax`` pass; read
        only if no backward reaches it), and a gradient hook on each."""
        f = next((f for f in reversed(self._forwards) if f.owner == owner), None)
        if f is None or f.extremes or f.reached:
            return
        ts = _summable(output)[:MAX_OUTPUTS_CHECKED]
        grads = [t for t in ts if t.requires_grad]
        if not grads:
            # Nothing a backward could reach (a frozen model run with grad on): no
            # training forward to drop.
            self._forwards.remove(f)
            f.let_go()
            return
        with own_ops:
            try:
                f.extremes = [v for t in ts for v in torch.aminmax(t.detach())]
                for t in grads:
                    f.handles.append(t.register_hook(f.reach))
            except Exception:  # odd tensors (nested, float8): not judged
                self._forwards.remove(f)
                f.let_go()
                return
        f.scalar = [t.numel() == 1 for t in ts]

    def resolve(self) -> None:
        """Judge the step's forwards: the ones no backward reached were dropped."""
        fs, self._forwards = self._forwards, []
        for f in fs:
            self._judge(f)

    def _judge(self, f: _Forward) -> None:
        try:
            if f.reached or not f.extremes:
                return
            self.dropped += 1
            with own_ops:
                ext = torch.stack(f.extremes).view(-1, 2).float()
                rows = bad_batch(ext, outputs=True)
                bad = rows.any()
                self._or("bad", bad)
                # NaN or +inf, not only a -inf beside positive values (a mask's, or an
                # overflow's: told apart by how often it comes, at the end).
                self._or("strict", (ext.isnan().any(1) | (ext[:, 1] == math.inf)).any())
                if any(f.scalar) and not all(f.scalar):
                    # A loss the model returns (HF's ``.loss``) bad beside finite logits:
                    # the loss computation made it (an all-ignored batch: 0/0), not a layer.
                    mask = torch.tensor(f.scalar, device=bad.device)
                    self._or("loss_only", (rows & mask).any() & ~(rows & ~mask).any())
        finally:
            f.let_go()

    def _or(self, key: str, flag: torch.Tensor) -> None:
        prev = self._step.get(key)
        self._step[key] = flag if prev is None else prev | flag

    # -- steps and the run -----------------------------------------------------------
    def step_flag(self) -> torch.Tensor | None:
        """The current step's flag (device), once :meth:`resolve` judged it: a forward
        it dropped was NaN/inf."""
        return self._step.get("bad")

    def end_step(self, step: int, loss_bad: torch.Tensor | None,
                 batch_bad: torch.Tensor | None = None, recorded: bool = False) -> None:
        """Judge the step's forwards and fold its flags into the run's counts (device ops
        only, and only in a step that dropped a NaN/inf forward). A NaN loss that went on
        to backward is the loss check's. ``batch_bad``: the step's batch check (a device
        bool); a step whose batch was bad counts apart. A recorded step's bad batch is
        its ``nonfinite_input``; the rest of it counts as made by the model (a 0/0, a
        float32 layer's NaN: no layer finding may show those; review 48c)."""
        self.resolve()
        flags, self._step = self._step, {}
        bad = flags.get("bad")
        if bad is None:
            return
        with own_ops:
            if loss_bad is not None:
                bad = bad & ~loss_bad.to(bad.device)
            no = torch.zeros((), dtype=torch.bool, device=bad.device)
            given = bad & batch_bad.to(bad.device) if batch_bad is not None else no
            if recorded:
                bad, given = bad & ~given, no
            neg_inf_only = bad & ~flags.get("strict", no)
            loss_only = bad & flags.get("loss_only", no)
            row = torch.stack((bad, given, loss_only, neg_inf_only)).long()
            if self._totals is None:
                self._totals = torch.cat((row, torch.full((2,), -1, device=bad.device)))
            else:
                self._totals[:_FIRST_GIVEN] += row
            firsts = self._totals[_FIRST_GIVEN:]
            now = torch.stack((given, bad & ~given)) & (firsts < 0)
            self._totals[_FIRST_GIVEN:] = torch.where(now, step, firsts)

    def device_totals(self) -> torch.Tensor | None:
        """The run's counts on the device, for the run's one read at its end (None: no
        NaN/inf forward was dropped)."""
        return self._totals

    def totals_from(self, n: list[int]) -> DroppedTotals:
        """The run's counts from their host copy."""
        return DroppedTotals(
            steps_bad=n[_BAD], input_bad=n[_GIVEN], loss_only=n[_LOSS_ONLY],
            neg_inf_only=n[_NEG_INF_ONLY], first_input_bad=n[_FIRST_GIVEN],
            first_made=n[_FIRST_MADE], dropped=self.dropped, module=self.module)

    def release(self) -> None:
        """Leave no reference to the user's tensors behind, and no hook (the counts stay)."""
        fs, self._forwards = self._forwards, []
        for f in fs:
            f.let_go()
        self._step = {}
