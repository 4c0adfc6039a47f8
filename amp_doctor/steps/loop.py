"""What the training loop did in the current step, beyond the AMP API.

:class:`LoopSignals` keeps the step's device flags (the loss and the batch
NaN/inf, OR-ed over micro-steps; they ride in the step's one host copy, or in
a skip's one sync), whether a training forward and a backward ran, and, for
loops without an optimizer or scaler, whether the weights were updated since
the last backward. In pure low-precision training it also samples parameter
elements before the optimizer's update, to see whether the update moved them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from amp_doctor.device.recorder import StepBuffer
from amp_doctor.device.stats import merged_extremes
from amp_doctor.devicework import host_scalars, own_ops
from amp_doctor.dtypes import LOW_PRECISION_DTYPES
from amp_doctor.hooks.probes import unsummarizable
from amp_doctor.steps.batches import BatchChecks, BatchTotals
from amp_doctor.steps.dropped import DroppedForwards, DroppedTotals
from amp_doctor.steps.misuse import reaches_params

__all__ = ["LoopSignals", "RunTotals", "INPUT_BAD_CODE", "INPUT_BAD_CODES", "UPDATE_SAMPLE",
           "PLAIN_LOSS_KEY", "INPUT_ABSMAX", "INPUT_ATTN_MASK", "APPLIED_FIRST_KEY"]

# Pure low-precision training: parameter elements sampled per tensor on a recorded
# step to see whether the optimizer's update changed them at all.
UPDATE_SAMPLE = 1024
# The scalar key of the loss as backward saw it: the step's loss when scaler.scale did
# not note it (a plain loss.backward()).
PLAIN_LOSS_KEY = "loss_plain"


# The step flag of the largest |value| given to a model: this prefix, then its name.
INPUT_ABSMAX = "input_absmax:"
# The input code of a recorded step's first bad batch tensor (BatchChecks.module_of).
INPUT_BAD_CODE = "input_bad_code"
# The mask of every bad input's code (steps/batches.mask_codes).
INPUT_BAD_CODES = "input_bad_codes"
# Whether an additive attention mask (-inf beside a max of 0) was given in the step.
INPUT_ATTN_MASK = "input_attn_mask"
# The running count of NaN/inf losses, in a recorded step's scalars.
LOSS_BAD_TOTAL_KEY = "loss_bad_total"
# The first step whose loss was NaN/inf (meaningful once that count is above 0).
LOSS_BAD_FIRST_KEY = "loss_bad_first"
# The first step whose update took gradients the loop made NaN/inf after its own
# scaler.unscale_ (-1: none yet), for a recorded step's host copy.
APPLIED_FIRST_KEY = "after_unscale_first_step"


class RunTotals(NamedTuple):
    """What the run's end reads of the loop's device counts (see
    :meth:`LoopSignals.run_totals`)."""

    batches: BatchTotals | None
    dropped: DroppedTotals | None
    loss_bad: int | None  # steps whose loss was NaN/inf (None: not read, or no loss)
    loss_first: int | None = None  # the first of them (None: not read, or none bad)
    # The first step whose update took gradients made NaN/inf after unscale_ (None: not
    # read, or none did).
    applied_first: int | None = None


class LoopSignals:
    """The loop's doings in the current step (reset at each step boundary)."""

    def __init__(self) -> None:
        # Device flags of the current step: "loss_bad", "input_nan", "input_inf".
        self._flags: dict[str, torch.Tensor] = {}
        # The step's losses with a term noted since the last optimizer step, by key.
        self._loss_terms: set[str] = set()
        self.train_forward = False
        self.backward = False
        # The module given the step's first checked batch (check_input).
        self.input_module: str | None = None
        # A backward of this step reached the watched parameters.
        self.backward_reached = False
        # Steps whose loss was NaN/inf, counted on the device at every step's end (one
        # in-place add, no sync), and the steps that had a loss: read once, at the end.
        self._loss_bad_total: torch.Tensor | None = None
        # The step the count left 0 in: overwritten while the count is 0, then kept.
        self._loss_bad_first: torch.Tensor | None = None
        self.loss_steps = 0
        # APPLIED_FIRST_KEY on the device, kept over the run (see note_applied).
        self._applied_first: torch.Tensor | None = None
        # The dtypes the losses that reached backward had (a float32 loss needs no advice
        # to compute it in float32; review 55b).
        self.loss_dtypes: set[torch.dtype] = set()
        # A parameter's gradient and weight versions after the last backward (gradient
        # None: taken by torch.autograd.grad, only the weights' version tells).
        self._sentinel: tuple[torch.Tensor, int | None, int | None, int] | None = None
        # Sampled low-precision parameter elements before the update: (param, sample
        # index, values, element had a gradient, its gradient was finite).
        self._lp_snap: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]] = []
        # The sampled parameters of the last measured update, in order (host objects:
        # weak enough, as the optimizer holds them anyway), for the "made non-finite" row.
        self.lp_params: list[torch.Tensor] = []
        # The model's training forwards that no backward followed (a loop's own NaN skip).
        self.dropped = DroppedForwards()
        # The batches given to the watched models, checked at every training forward.
        self.batches = BatchChecks()

    @property
    def trained_since_boundary(self) -> bool:
        return self.train_forward or self.backward

    def new_step(self) -> None:
        self.lp_params = []
        self.backward = False
        self.input_module = None
        self._sentinel = None
        self.backward_reached = False
        self.train_forward = False

    def end_step(self, step: int, recorded: bool, skipped: bool = False
                 ) -> dict[str, torch.Tensor]:
        """The step's device flags, handed over; the step's samples dropped. With them the
        run's count of NaN/inf losses so far (:data:`LOSS_BAD_TOTAL_KEY`), for a recorded
        step's host copy. ``skipped``: a GradScaler skipped the step (its gradients were
        NaN/inf, whatever the loss was)."""
        flags, self._flags = self._flags, {}
        self._loss_terms.clear()
        self._lp_snap = []
        bad = flags.get("loss_bad")
        dropped = self.dropped.step_flag()
        # (Whether the batch was bad is needed now only in a step that dropped a forward.)
        self.dropped.end_step(step, bad, self.batches.step_bad() if dropped is not None
                              else None, recorded)
        batch = self.batches.end_step(step, recorded, bad, dropped, skipped)
        if batch is not None:
            flags["input_nan"], flags["input_inf"] = batch.nan, batch.inf
            flags[INPUT_BAD_CODE] = batch.code
            flags[INPUT_BAD_CODES] = batch.codes
            flags[INPUT_ATTN_MASK] = batch.attn_mask
        if bad is not None:
            self.loss_steps += 1
            if self._loss_bad_total is None or self._loss_bad_first is None:
                self._loss_bad_total = bad.to(torch.int64)
                self._loss_bad_first = torch.full_like(self._loss_bad_total, step)
            else:
                # Two ops a step tell the first bad step, where the count alone tells
                # only how many (review 55: "first seen at step 10" of a NaN at step 3).
                self._loss_bad_first = torch.where(self._loss_bad_total == 0, step,
                                                   self._loss_bad_first)
                self._loss_bad_total.add_(bad.to(self._loss_bad_total.device))
        if self._loss_bad_total is not None and self._loss_bad_first is not None:
            flags[LOSS_BAD_TOTAL_KEY] = self._loss_bad_total
            flags[LOSS_BAD_FIRST_KEY] = self._loss_bad_first
        if self._applied_first is not None:
            flags[APPLIED_FIRST_KEY] = self._applied_first
        return flags

    def note_applied(self, bad: torch.Tensor, step: int) -> None:
        """``bad`` (a device count) gradients of step ``step`` that the loop made NaN/inf
        after its own unscale_ are about to be applied: kept as the run's first such
        step, on the device (one op, no sync), for every step, recorded or not."""
        first = self._applied_first
        self._applied_first = (torch.where(bad > 0, step, -1) if first is None else
                               torch.where((first < 0) & (bad.to(first.device) > 0), step,
                                           first))

    def end_dangling(self, step: int) -> None:
        """At the end of the run: forwards after the last step that ended (a last
        iteration the loop dropped) count as the unrecorded step ``step``."""
        self.dropped.resolve()
        dropped = self.dropped.step_flag()
        self.dropped.end_step(step, None, self.batches.step_bad() if dropped is not None
                              else None)
        self.batches.end_step(step, False, None, dropped)

    def run_totals(self, want_loss: bool) -> RunTotals:
        """The run's end: the unrecorded steps' bad batches, the dropped forwards and
        (``want_loss``, or when read anyway) how many steps' loss was NaN/inf. One
        device->host copy for all (a sync: call it once, after :meth:`release`), and none
        in a run that checked no floating batch in an unrecorded step, dropped no forward
        and is not asked for the loss count."""
        loss = None
        if self._loss_bad_total is not None and self._loss_bad_first is not None:
            with own_ops:
                loss = torch.stack((self._loss_bad_total,
                                    self._loss_bad_first.to(self._loss_bad_total.device)))
        named = [(k, t) for k, t in (("batches", self.batches.device_totals()),
                                     ("dropped", self.dropped.device_totals()),
                                     ("loss", loss), ("applied", self._applied_first))
                 if t is not None]
        if not named or (not want_loss and all(k in ("loss", "applied") for k, _ in named)):
            return RunTotals(None, None, None)
        with own_ops:
            flat = torch.cat([t.reshape(-1).to(named[0][1].device) for _, t in named])
            n = [int(x) for x in host_scalars(list(flat))]
        got: dict[str, list[int]] = {}
        for k, t in named:
            got[k], n = n[: t.numel()], n[t.numel():]
        return RunTotals(
            self.batches.totals_from(got["batches"]) if "batches" in got else None,
            self.dropped.totals_from(got["dropped"]) if "dropped" in got else None,
            got["loss"][0] if "loss" in got else None,
            got["loss"][1] if "loss" in got and got["loss"][0] > 0 else None,
            got["applied"][0] if "applied" in got and got["applied"][0] >= 0 else None)

    def release(self) -> None:
        """Leave no reference to the user's tensors behind."""
        self._sentinel = None
        self._lp_snap = []
        self.lp_params = []
        self._flags = {}
        self._loss_terms.clear()
        self.dropped.release()
        self.batches.release()

    # -- device flags ----------------------------------------------------------
    def _or_flag(self, key: str, flag: torch.Tensor) -> None:
        prev = self._flags.get(key)
        self._flags[key] = flag if prev is None else (prev | flag.to(prev.device))

    def loss_flag(self) -> torch.Tensor | None:
        return self._flags.get("loss_bad")

    def note_loss(self, roots: list[torch.Tensor]) -> None:
        """Before a backward: note on the device whether its loss is NaN/inf."""
        losses = [t for t in roots if t.numel() == 1 and t.is_floating_point()
                  and t.grad_fn is not None]
        if not losses:
            return
        self.loss_dtypes.add(losses[0].dtype)
        # x * 0 is NaN exactly when x is NaN or inf: two ops on every step, where
        # isfinite is four on the CPU (abs, ne, eq, mul) before the reduction.
        # 0-d, as the skip check stacks it with the layers' flags.
        x = losses[0].detach().reshape(()) if len(losses) == 1 else torch.stack(
            [t.detach().reshape(()) for t in losses])
        bad = (x * 0).ne(0)
        bad = bad if len(losses) == 1 else bad.any()
        # The step's loss, for a loop without scaler.scale (which notes it unscaled): the
        # sum of the backwards' since the last optimizer step (gradient accumulation's
        # micro-batches, as under scaler.scale; a GAN's second optimizer starts anew).
        loss = (x if len(losses) == 1 else x[0]).float()
        if self.continues_loss(PLAIN_LOSS_KEY) and PLAIN_LOSS_KEY in self._flags:
            self._flags[PLAIN_LOSS_KEY] = self._flags[PLAIN_LOSS_KEY] + loss
        else:
            self._flags[PLAIN_LOSS_KEY] = loss
        scaled = self._flags.get("scaled_grads_bad")
        if scaled is not None:
            # A loss made of gradients that overflowed under the loss scale (a gradient
            # penalty) is non-finite by the scaler's doing: it skips the step, as
            # designed, and lowers the scale. Not a loss that went bad by itself.
            bad = bad & ~scaled.to(bad.device)
        self._or_flag("loss_bad", bad)

    def note_scaled_grads(self, grads: list[torch.Tensor]) -> None:
        """``torch.autograd.grad`` of a scaled output returned ``grads``: note on the
        device whether any of them overflowed (no sync)."""
        ts = [g for g in grads if g.is_floating_point() and g.numel() > 0
              and unsummarizable(g) is None]
        if not ts:
            return
        with own_ops:
            # As in check_input: one aminmax pass per gradient, no temporary as large as
            # it; x * 0 is NaN exactly where x is NaN or inf.
            ext = torch.stack([v for g in ts for v in torch.aminmax(g.detach())])
            bad = (ext * 0).ne(0).any()
        self._or_flag("scaled_grads_bad", bad)

    def check_input(self, args: tuple[Any, ...], module: str, recorded: bool
                    ) -> torch.Tensor | None:
        """A training forward of ``module`` is given ``args``: check the batch for NaN/inf
        (:class:`~amp_doctor.steps.batches.BatchChecks`, device ops only). On a recorded
        step, also the data's largest |value| per model: a finite float32 value beyond
        float16's max is inf once autocast casts it for the first layer (an un-normalised
        outlier). Per model given the batch: a GAN's generator gets noise, its
        discriminator data. Returns the batch's ``[n, 2]`` (min, max) rows on the device
        (None: no floating data), for anomaly mode's own per-step check."""
        ext = self.batches.check(args, module)
        if ext is None or not recorded:
            return ext
        if self.input_module is None:
            self.input_module = module
        key = INPUT_ABSMAX + module
        with own_ops:
            top = merged_extremes(ext).abs().max()
            prev = self._flags.get(key)
            self._flags[key] = top if prev is None else torch.maximum(prev, top.to(prev.device))
        return ext

    # -- steps without an optimizer ------------------------------------------------
    def backward_done(self, roots: list[torch.Tensor], owns: Callable[[torch.Tensor], bool],
                      first_grad: Callable[[], torch.Tensor | None]) -> None:
        """A backward ended where no optimizer or scaler ends the steps."""
        if not self.backward_reached:
            self.backward_reached = reaches_params(
                [t.grad_fn for t in roots if t.grad_fn is not None], owns)
        if self.backward_reached:
            # After every backward: accumulation changes the grads in place.
            self._set_sentinel(first_grad)

    def _set_sentinel(self, first_grad: Callable[[], torch.Tensor | None]) -> None:
        q = first_grad()
        self._sentinel = None if q is None or q.grad is None else (
            q, id(q.grad), q.grad._version, q._version)

    def backward_since_update(self, first_grad: Callable[[], torch.Tensor | None]) -> None:
        """A backward where an optimizer ends the steps: until the next optimizer step, a
        reset of the gradients before the next training forward means the loop dropped
        that iteration's update (see :meth:`dropped_update`)."""
        self._set_sentinel(first_grad)

    def dropped_update(self) -> bool:
        """Since the last backward (where an optimizer ends the steps), the gradients were
        reset while the weights stayed as they were: the loop dropped that iteration's
        update. Weights that changed without an optimizer step are something else (SAM's
        first step moves them to the perturbed point and back), not a dropped update."""
        sn = self._sentinel
        if sn is None:
            return False
        p, gid, gver, pver = sn
        g = p.grad
        return p._version == pver and (g is None or id(g) != gid or g._version != gver)

    def continues_loss(self, key: str) -> bool:
        """Whether the step's loss ``key`` has a term noted since the last optimizer step,
        which this one adds to (gradient accumulation's micro-batches; review 54: the last
        one's loss / 4 was the step's); notes this term. A GAN's second optimizer's loss
        starts anew."""
        more = key in self._loss_terms
        self._loss_terms.add(key)
        return more

    def optimizer_stepped(self) -> None:
        """An optimizer stepped: the iteration's update was taken."""
        self._sentinel = None
        self._loss_terms.clear()

    def grads_taken(self, params: list[torch.Tensor]) -> None:
        """``torch.autograd.grad`` took these watched weights' gradients: the step ends
        once the loop changed them (a hand-written ``p -= lr * g`` under no_grad)."""
        self.backward_reached = True
        self._sentinel = (params[0], None, None, params[0]._version)

    def updated(self) -> bool:
        """Since the last backward, did the loop update the weights or reset the grads?

        That is what ends a step without an optimizer. Gradient accumulation
        (several backward passes into one update) changes neither in between.
        """
        sn = self._sentinel
        if sn is None:
            return False
        p, gid, gver, pver = sn
        if gid is None:  # gradients taken by torch.autograd.grad: only the weights tell
            return p._version != pver
        g = p.grad
        return g is None or id(g) != gid or g._version != gver or p._version != pver

    # -- low-precision updates -------------------------------------------------------
    def snapshot_low_params(self, params: list[torch.Tensor]) -> None:
        """Before a plain optimizer step: sample the low-precision weights with a grad."""
        if self._lp_snap or not any(p.dtype in LOW_PRECISION_DTYPES for p in params):
            return
        snap = []
        with own_ops, torch.no_grad():
            for p in params:
                if p.dtype not in LOW_PRECISION_DTYPES or p.grad is None or p.grad.is_sparse:
                    continue
                n = p.numel()
                if n == 0:
                    continue
                step = max(1, n // UPDATE_SAMPLE)
                idx = torch.arange(0, n, step, device=p.device)[:UPDATE_SAMPLE]
                before = p.detach().reshape(-1)[idx].clone()
                g = p.grad.detach().reshape(-1)[idx]
                snap.append((p, idx, before, g != 0, g.isfinite()))
        self._lp_snap = snap

    def measure_low_params(self, buf: StepBuffer | None) -> None:
        """After the optimizer step: how many sampled elements did not move, and how many
        the update made non-finite from finite values with finite gradients (float16 Adam
        state: eps=1e-8 is 0, exp_avg_sq underflows, 0/0), with the first such parameter's
        index in :attr:`lp_params` (-1: none). Device counts, in the step's host copy."""
        snap, self._lp_snap = self._lp_snap, []
        if not snap or buf is None:
            return
        with own_ops, torch.no_grad():
            after = [p.detach().reshape(-1)[idx] for p, idx, _, _, _ in snap]
            unchanged = torch.stack([((a == before) & has_grad).sum() for a, (_, _, before,
                                     has_grad, _) in zip(after, snap, strict=True)]).sum()
            with_grad = torch.stack([h.sum() for _, _, _, h, _ in snap]).sum()
            made = torch.stack([(~a.isfinite() & before.isfinite() & ok).sum() for a, (
                _, _, before, _, ok) in zip(after, snap, strict=True)])
            at = torch.arange(len(snap), device=made.device)
            first = torch.where(made > 0, at, len(snap)).min()
        buf.put_scalar("lp_unchanged", unchanged)
        buf.put_scalar("lp_with_grad", with_grad)
        buf.put_scalar("lp_made_nonfinite", made.sum())
        buf.put_scalar("lp_nonfinite_param", torch.where(first < len(snap), first, -1))
        self.lp_params = [p for p, _, _, _, _ in snap]
