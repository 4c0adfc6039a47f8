"""The batches given to the watched models, checked for NaN/inf at every training forward.

A corrupt sample (a NaN in a feature, an inf from a division in the data code) is the
commonest cause of a NaN loss, and it strikes in any step, mostly in the nine of ten
that nobody records. A recorded step's batch check told it only when it fell on a
recorded step: otherwise the report said "the loss was NaN at step 7, where it
appeared is unknown", and without a GradScaler (bfloat16) the update had poisoned every
weight by the next recorded step (review 48c).

:class:`BatchChecks` owns the check. Per training forward of a watched model, one
``aminmax`` pass over each floating tensor it is given, with no temporary as large as
the batch, leaves the (min, max) rows on the device. At the step's end they are read as
:func:`~amp_doctor.device.stats.bad_batch` reads a batch (NaN, +inf, or -inf beside a
max other than 0: an additive attention mask's -inf is none), on the device and without a
sync:

- a recorded step hands its flags to the step's host copy (the step folder's finding),
  with the model its first bad tensor was given to;
- an unrecorded step waits in a chunk of :data:`CHUNK_STEPS` steps, evaluated at once:
  per input (a model's floating argument, by its position or keyword), the steps whose
  tensor was bad and whose loss (or an output the loop dropped before backward) went
  NaN/inf with it or that a GradScaler skipped, and the steps whose loss stayed finite.
  An input bad in a step whose loss stayed finite is one the model handles (missing
  values it replaces); the culprit is an input whose every bad step went bad with it.

Under a float16 autocast, the same rows also tell a finite value beyond float16's max (an
un-normalised outlier: a raw count, a price), which autocast's cast for the first layer
makes inf: per input, the unrecorded steps whose batch held one and whose loss went
NaN/inf with it, and those whose loss stayed finite (a model that clamps or normalises in
float32 first takes such values in its stride). A recorded step's batch is judged by the
step folder, from the batch's largest |value| in the step's host copy.

The totals are read once, at the end of the run (``LoopSignals.run_totals``). The check
runs on the batch *before* the forward, so a buffer the loop reuses (``buf.copy_(x)``) is
checked as the model saw it. Integer batches (token ids) cost nothing. What a watched
model made is not data: a tensor with a ``grad_fn`` (another model's output, code on the
weights), or one sharing the storage of a live tensor a watched model returned in this
step (a generator's samples given detached to the discriminator). An input that first
went bad after the loss did carries the run's own NaN (a recurrent state carried over
detached), and is no cause. A watched model called under ``no_grad`` in a training step
(a frozen backbone, a distillation teacher) has its output checked too: a tensor made
from it (``F.normalize(backbone(x))``, new storage, no ``grad_fn``) given to the next
model after it went bad is that model's work, not data (review 49b).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from amp_doctor.device.stats import upload
from amp_doctor.devicework import cast_limit, iter_tensors, own_ops
from amp_doctor.hooks.tensorkinds import given_data, given_data_keyed

__all__ = ["BatchChecks", "BatchTotals", "StepBatch", "CHUNK_STEPS", "OUTPUT_KEY",
           "MASK_CODES", "mask_codes"]

# Unrecorded steps whose batch rows wait on the device, as references, before one
# evaluation of them all: a step pays for its ``aminmax`` and one ``stack`` per forward,
# and about forty ops serve the whole chunk (a per-step evaluation was 130 more aten ops
# a step on the benchmark CNN, about 2% of its step on one CPU thread).
CHUNK_STEPS = 64
# Columns of the run's device totals, one row per input (a model's floating argument, by
# its key): counts of steps, then the first such step (-1: none). BEYOND: finite values
# beyond the cast format's max, in steps whose loss went bad with them / stayed finite.
(_HARMFUL, _HARMLESS, _DROPPED, _NAN_HARMFUL, _INF_HARMFUL, _NAN_HARMLESS, _INF_HARMLESS,
 _BEYOND_HARMFUL, _BEYOND_CALM, _FIRST_HARMFUL, _FIRST_HARMLESS, _FIRST_BEYOND) = range(12)
_COUNTS = _FIRST_HARMFUL
_COLUMNS = _FIRST_BEYOND + 1
# Steps listed (the first ones) whose batch held a value beyond the cast format's max and
# whose loss went NaN/inf: a finding's steps, which the NaN loss's folds into.
MAX_BEYOND_STEPS = 50
_F32_MAX = torch.finfo(torch.float32).max
# Larger than any step a run counts.
_NONE = 1 << 62
# The key that stands for a model's output among its inputs' (see check_output); no
# input's key (``given_data_keyed``) can be it.
OUTPUT_KEY = "\0output"


@dataclass(frozen=True)
class BatchTotals:
    """The unrecorded steps' bad batches, over the run."""

    # Steps whose batch held NaN/inf and whose loss (or a forward the loop dropped) was
    # NaN/inf too; of them, the steps where the loop dropped the forward.
    harmful: int
    dropped: int
    # Steps whose batch held NaN/inf while the loss and the outputs stayed finite.
    harmless: int
    # What the harmful steps' batches held (the harmless ones' if none was harmful).
    nan: bool
    inf: bool
    first_harmful: int  # -1: none
    first_harmless: int
    # The model given the bad tensor (a harmful one, if any), which of its inputs it was
    # (its key: ``hooks.tensorkinds.given_data_keyed``), and how many it was given.
    module: str | None
    input_key: str = "#0"
    inputs: int = 1
    # The run's first step whose loss was NaN/inf (-1: none, or not known).
    first_loss_bad: int = -1
    # A model called under no_grad whose output went NaN/inf from a finite batch in steps
    # whose loss did too (a frozen backbone's overflow), the first such step and how many.
    made_by: str | None = None
    made_first: int = -1
    made_steps: int = 0
    # An input that held finite values beyond the cast format's max (float16's) in steps
    # whose loss went NaN/inf, and in no step whose loss stayed finite: its model and key,
    # how many such steps, the first of them listed, and the largest |value|.
    beyond_module: str | None = None
    beyond_key: str = "#0"
    beyond_steps: int = 0
    beyond_listed: tuple[int, ...] = ()
    beyond_absmax: float = 0.0

    @property
    def data_bad(self) -> bool:
        """Some batch held NaN/inf (not only a model's output)."""
        return bool(self.harmful or self.harmless)


# Input codes a recorded step's bad-input mask tells apart (bit i: code i); a code above
# them sets the last bit, which stands for "another input". A float64 host copy keeps 53
# bits exact.
MASK_CODES = 52


@dataclass(frozen=True)
class StepBatch:
    """A recorded step's batch flags (device 0-d bools), for its host copy, the input
    code of its first bad tensor (device int64, -1: none; :meth:`BatchChecks.module_of`),
    the mask of every bad input's code (device int64; :func:`mask_codes`) and whether an
    additive attention mask (-inf beside a max of 0) was given (device 0-d bool)."""

    nan: torch.Tensor
    inf: torch.Tensor
    code: torch.Tensor
    codes: torch.Tensor
    attn_mask: torch.Tensor


def mask_codes(mask: float) -> frozenset[int]:
    """The input codes a :class:`StepBatch` mask (read on the host) holds; MASK_CODES
    stands for any code beyond the others."""
    m = int(mask)
    return frozenset(i for i in range(MASK_CODES + 1) if m >> i & 1)


def _bad_rows(ext: torch.Tensor) -> torch.Tensor:
    """:func:`~amp_doctor.device.stats.bad_batch`, in fewer ops: NaN or +inf; or -inf
    beside a max other than 0 (a mask's)."""
    odd = (ext * 0).ne(0)  # NaN, +inf or -inf
    return odd[:, 1] | (odd[:, 0] & (ext[:, 1] != 0))


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:
        return -1


def _cat(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of several forwards as one ``[n, 2]`` tensor on the first one's device (models
    on two GPUs: a device-to-device copy, no sync)."""
    dev = rows[0].device
    return rows[0] if len(rows) == 1 else torch.cat([r.to(dev) for r in rows])


@dataclass
class _Step:
    """An unrecorded step waiting in the chunk: its loss and dropped-forward flags (device
    bools, None: not seen)."""

    step: int
    loss_bad: torch.Tensor | None
    dropped_bad: torch.Tensor | None
    skipped: bool


class BatchChecks:
    """The batch rows of the current step and of the unrecorded steps waiting for their
    evaluation, and the run's totals."""

    def __init__(self) -> None:
        # Rows ([n, 2] (min, max) per forward) of the current step, with their model's code
        # and the max of the format autocast casts them to (inf: none, or not float16).
        self._rows: list[torch.Tensor] = []
        self._codes: list[int] = []
        self._limits: list[float] = []
        # The chunk: rows of ended unrecorded steps, their steps' index in it and codes.
        self._chunk_rows: list[torch.Tensor] = []
        self._chunk_at: list[int] = []  # per row: its step's index in _steps
        self._chunk_codes: list[int] = []  # per row
        self._chunk_limits: list[float] = []  # per row
        self._steps: list[_Step] = []
        # Each input's code: (model, the input's key) -> row of the totals; and the keys
        # each model was given (an optional input comes and goes: its key stays its own).
        self._inputs: dict[tuple[str, str], int] = {}
        self._keys: dict[str, set[str]] = {}
        # The codes that stand for a model's output (OUTPUT_KEY), not one of its inputs.
        self._outputs: set[int] = set()
        self._totals: torch.Tensor | None = None
        # Per input (float64), the largest |value| beyond the cast format's max in a step
        # whose loss went bad; the first such steps of any input (_NONE-padded int64).
        self._beyond_top: torch.Tensor | None = None
        self._beyond_steps: torch.Tensor | None = None
        # The first step whose loss was NaN/inf (device int64; _NONE: none yet).
        self._first_loss: torch.Tensor | None = None
        # What the watched models returned in this step (weak references, with their
        # storage's address): a generator's samples given detached to the discriminator
        # share its storage, and are not data. A live tensor's storage cannot be another's
        # (a freed one's address is reused: review 49b saw a new batch skipped so).
        self._made: list[tuple[weakref.ref[torch.Tensor], int]] = []
        # The storages of the data given in this step: a model that returns its input (a
        # VAE's ``[recon, input, mu, logvar]``) does not make that input its own work.
        self._given: set[int] = set()

    def note_output(self, output: Any) -> None:
        """A watched model returned ``output`` in this step: what it holds is the model's
        work, not data, should the loop give it to a model again. Metadata only."""
        for t in iter_tensors(output):
            if t.is_floating_point():
                ptr = _storage(t)
                if ptr not in self._given and ptr != -1:
                    try:
                        self._made.append((weakref.ref(t), ptr))
                    except TypeError:  # not weakly referenceable: never data here
                        continue

    def _model_made(self, t: torch.Tensor) -> bool:
        ptr = _storage(t)
        return any(p == ptr and (m := ref()) is not None and _storage(m) == ptr
                   for ref, p in self._made)

    def check(self, args: Any, module: str) -> torch.Tensor | None:
        """A training forward of ``module`` is given ``args``: its floating tensors'
        ``[n, 2]`` (min, max) rows, on the device (None: no floating tensor)."""
        given = given_data_keyed(args)
        if given and self._made:
            given = [(k, t) for k, t in given if not self._model_made(t)]
        self._given.update(_storage(t) for _, t in given)
        if not given:
            return None
        with own_ops:
            try:
                ext = torch.stack([v for _, t in given for v in torch.aminmax(t.detach())]
                                  ).view(-1, 2)
            except Exception:  # odd tensors (nested, float8): not checked
                return None
        self._keys.setdefault(module, set()).update(k for k, _ in given)
        self._rows.append(ext)
        self._codes.extend(self._inputs.setdefault((module, k), len(self._inputs))
                           for k, _ in given)
        self._limits.extend([cast_limit(given[0][1].device.type)] * len(given))
        return ext

    def check_output(self, output: Any, module: str) -> torch.Tensor | None:
        """A watched model called under no_grad in a training step (a frozen backbone, a
        teacher) returned ``output``: its floating tensors' ``[n, 2]`` rows join the step's
        after its batch's (None: none to check). A tensor given to a model after them, when
        they went bad first, is made from them: not data. One ``aminmax`` per tensor."""
        made = given_data(output)
        if not made:
            return None
        with own_ops:
            try:
                ext = torch.stack([v for t in made for v in torch.aminmax(t.detach())]
                                  ).view(-1, 2)
            except Exception:  # odd tensors (nested, float8): not checked
                return None
        code = self._inputs.setdefault((module, OUTPUT_KEY), len(self._inputs))
        self._outputs.add(code)
        self._rows.append(ext)
        self._codes.extend([code] * len(made))
        self._limits.extend([math.inf] * len(made))  # not cast as a batch is
        return ext

    def _derived(self, codes: list[int], bad: torch.Tensor, row_at: torch.Tensor | None = None,
                 steps: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per row, whether it is made from something that went bad before it in its step
        (a tensor given after a model's output went bad; a model's output after a bad
        batch), and whether it is a model's output; None when no row is an output's.
        ``row_at``: each row's step among ``steps`` (default: all in one step)."""
        if not self._outputs.intersection(codes):
            return None
        dev = bad.device
        n = len(codes)
        out = upload([int(c in self._outputs) for c in codes], dev).bool()
        idx = torch.arange(n, device=dev)
        firsts = []
        for hit in (torch.where(bad & out, idx, n), torch.where(bad, idx, n)):
            if row_at is None:
                firsts.append(hit.min())
            else:
                firsts.append(torch.full((steps,), n, dtype=idx.dtype, device=dev)
                              .scatter_reduce_(0, row_at, hit, "amin")[row_at])
        after_out, after_any = (idx > f for f in firsts)
        return torch.where(out, after_any, after_out), out

    def step_bad(self) -> torch.Tensor | None:
        """Whether the current step's batch held NaN/inf (a device bool; None: no floating
        batch). A few ops: for a step that needs it now (a dropped forward)."""
        if not self._rows:
            return None
        with own_ops:
            bad = _bad_rows(_cat(self._rows))
            made = self._derived(self._codes, bad)
            if made is not None:
                bad = bad & ~made[0] & ~made[1]
            return bad.any()

    def end_step(self, step: int, recorded: bool, loss_bad: torch.Tensor | None,
                 dropped_bad: torch.Tensor | None, skipped: bool = False) -> StepBatch | None:
        """End the step. A recorded one: its flags, for its host copy (None: no floating
        batch). An unrecorded one waits in the chunk, with whether its loss or a dropped
        forward's output (``loss_bad``, ``dropped_bad``: device bools) went NaN/inf, or a
        GradScaler skipped it (a NaN sample the loss leaves out still makes NaN
        gradients: 0 * NaN): no op until the chunk is full."""
        rows, self._rows = self._rows, []
        codes, self._codes = self._codes, []
        limits, self._limits = self._limits, []
        self._made, self._given = [], set()
        if not rows:
            return None
        if loss_bad is not None and recorded:
            self._note_first_loss(torch.where(loss_bad, step, _NONE))
        if recorded:
            with own_ops:
                ext = _cat(rows)
                row_nan = ext.isnan().any(1)
                bad = _bad_rows(ext)
                made = self._derived(codes, bad)
                if made is not None:
                    # Data is what came before a model's output went bad; an output is
                    # no data (its layers, recorded, show where it went bad).
                    derived, out = made
                    data = ~derived & ~out
                    bad, row_nan = bad & data, row_nan & data
                # The model given the bad tensor (a GAN's discriminator's real batch, not
                # the generator called first on finite noise; review 49a).
                code_t = upload(codes, ext.device)
                first = torch.where(bad, code_t, _NONE).min()
                slot = code_t.clamp(max=MASK_CODES)
                per_code = torch.zeros(MASK_CODES + 1, dtype=torch.long, device=ext.device
                                       ).scatter_reduce_(0, slot, bad.long(), "amax")
                mask = (per_code << torch.arange(MASK_CODES + 1, device=ext.device)).sum()
                # A row the mask covers whole is softmax's 0/0 in any precision.
                attn_mask = ((ext[:, 0] == -math.inf) & (ext[:, 1] == 0)).any()
                return StepBatch(nan=row_nan.any(), inf=(bad & ~row_nan).any(),
                                 code=torch.where(first < _NONE, first, -1), codes=mask,
                                 attn_mask=attn_mask)
        at = len(self._steps)
        self._steps.append(_Step(step, loss_bad, dropped_bad, skipped))
        self._chunk_rows.extend(rows)
        self._chunk_codes.extend(codes)
        self._chunk_limits.extend(limits)
        self._chunk_at.extend([at] * len(codes))
        if len(self._steps) >= CHUNK_STEPS:
            self._evaluate()
        return None

    def _note_first_loss(self, first: torch.Tensor) -> None:
        with own_ops:
            first = first.reshape(()).long()
            self._first_loss = first if self._first_loss is None else torch.minimum(
                self._first_loss, first.to(self._first_loss.device))

    def _evaluate(self) -> None:
        """Fold the chunk's steps into the run's totals, per input: device ops, no sync."""
        steps, self._steps = self._steps, []
        rows, self._chunk_rows = self._chunk_rows, []
        at, self._chunk_at = self._chunk_at, []
        codes, self._chunk_codes = self._chunk_codes, []
        limits, self._chunk_limits = self._chunk_limits, []
        if not steps:
            return
        with own_ops:
            ext = _cat(rows)
            dev = ext.device
            bad_rows = _bad_rows(ext)
            nan_rows = ext.isnan().any(1)
            n, p = len(steps), len(self._inputs)
            row_at = upload(at, dev)
            # A loss or a dropped forward that went NaN/inf with the batch, or a skip.
            # Neither a loss nor a dropped forward seen: what the batch did is not known,
            # and a NaN batch is taken for what it usually is, the loss's poison.
            harm = torch.zeros(n, dtype=torch.bool, device=dev)
            dropped = torch.zeros(n, dtype=torch.bool, device=dev)
            lost = torch.zeros(n, dtype=torch.bool, device=dev)
            for pick, out in ((lambda s: s.loss_bad, lost), (lambda s: s.dropped_bad, dropped)):
                known = [i for i, s in enumerate(steps) if pick(s) is not None]
                if known:
                    out[upload(known, dev)] = torch.stack(
                        [pick(steps[i]).reshape(()).to(dev) for i in known])
            unseen = [i for i, s in enumerate(steps) if s.skipped or (
                s.loss_bad is None and s.dropped_bad is None)]
            step_no = upload([s.step for s in steps], dev)
            self._note_first_loss(torch.where(lost, step_no, _NONE).min())
            finite_loss = ~(lost | dropped)
            if unseen:
                # (A skip's loss, or one not seen: no step whose loss stayed finite.)
                finite_loss[upload(unseen, dev)] = False
            harm |= lost | dropped
            if unseen:
                harm[upload(unseen, dev)] = True
            beyond = None
            if any(lim < math.inf for lim in limits):
                beyond = self._beyond_rows(ext, limits, bad_rows | nan_rows)
            made = self._derived(codes, bad_rows, row_at, n)
            if made is not None:
                bad_rows = bad_rows & ~made[0]  # made from what went bad before it
                if beyond is not None:
                    beyond = beyond & ~made[0] & ~made[1]
            harmful, harmless = bad_rows & harm[row_at], bad_rows & ~harm[row_at]
            # Per (input, step): an input given twice in a step (accumulation) counts once.
            code_t = upload(codes, dev)
            cell = code_t * n + row_at

            def per_cell(flags: torch.Tensor) -> torch.Tensor:
                return (torch.zeros(p * n, dtype=torch.long, device=dev).index_add_(
                    0, cell, flags.long()) > 0).view(p, n)

            cells = [per_cell(f) for f in (
                harmful, harmless, harmful & dropped[row_at], nan_rows & harmful,
                harmful & ~nan_rows, nan_rows & harmless, harmless & ~nan_rows)]
            if beyond is not None:
                # A step whose batch held NaN/inf too is that one's; the cast's inf goes
                # into the forward, so a skip with a finite loss is not its doing.
                nonfinite_step = torch.zeros(n, dtype=torch.long, device=dev).index_add_(
                    0, row_at, bad_rows.long()) > 0
                b_harm = beyond & ((lost | dropped) & ~nonfinite_step)[row_at]
                cells += [per_cell(b_harm), per_cell(beyond & finite_loss[row_at])]
            else:
                none = torch.zeros(p, n, dtype=torch.bool, device=dev)
                cells += [none, none]
            firsts = [torch.where(c, step_no, _NONE).amin(1) for c in (cells[0], cells[1],
                                                                        cells[7])]
            counts = torch.stack([c.sum(1) for c in cells], 1)
            if self._totals is None:
                self._totals = torch.zeros(0, _COLUMNS, dtype=torch.long, device=dev)
                self._beyond_top = torch.zeros(0, dtype=torch.float64, device=dev)
            t = self._totals
            if t.shape[0] < p:  # inputs first seen in this chunk
                more = torch.zeros(p - t.shape[0], _COLUMNS, dtype=torch.long, device=dev)
                more[:, _COUNTS:] = -1
                t = self._totals = torch.cat((t, more))
                assert self._beyond_top is not None
                self._beyond_top = torch.cat((self._beyond_top, torch.zeros(
                    p - self._beyond_top.shape[0], dtype=torch.float64, device=dev)))
            t[:, :_COUNTS] += counts
            now = torch.stack(firsts, 1)
            old = t[:, _COUNTS:]
            t[:, _COUNTS:] = torch.where((old < 0) & (now < _NONE), now, old)
            if beyond is not None:
                self._note_beyond(ext, b_harm, code_t, row_at, step_no, p)

    @staticmethod
    def _beyond_rows(ext: torch.Tensor, limits: list[float], odd: torch.Tensor
                     ) -> torch.Tensor:
        """Per row, finite values beyond its cast format's max: above it, or below minus
        it beside a max other than 0 (an additive mask of float32's lowest value is none)."""
        lim = upload(limits, ext.device, torch.float64)
        lo, hi = ext[:, 0].double(), ext[:, 1].double()
        return ~odd & ((hi > lim) | ((lo < -lim) & (hi != 0)))

    def _note_beyond(self, ext: torch.Tensor, harm: torch.Tensor, code_t: torch.Tensor,
                     row_at: torch.Tensor, step_no: torch.Tensor, p: int) -> None:
        """Keep, per input, the largest |value| of its harmful rows beyond the max, and the
        first steps with such a row."""
        dev = ext.device
        # (Clamped: the run's end reads it in float32, where float64 data could be inf.)
        top = torch.where(harm, ext.double().abs().amax(1), 0.0).clamp(max=_F32_MAX)
        assert self._beyond_top is not None
        self._beyond_top = torch.maximum(self._beyond_top, torch.zeros(
            p, dtype=torch.float64, device=dev).scatter_reduce_(0, code_t, top, "amax"))
        at = torch.zeros(step_no.shape[0], dtype=torch.long, device=dev).index_add_(
            0, row_at, harm.long()) > 0
        listed = torch.where(at, step_no, _NONE)
        if self._beyond_steps is not None:
            listed = torch.cat((self._beyond_steps, listed))
        if listed.shape[0] < MAX_BEYOND_STEPS:
            listed = torch.cat((listed, torch.full((MAX_BEYOND_STEPS - listed.shape[0],),
                                                   _NONE, dtype=torch.long, device=dev)))
        self._beyond_steps = listed.sort().values[:MAX_BEYOND_STEPS]

    def module_of(self, code: float | None) -> str | None:
        """The model an input code (:class:`StepBatch`'s, read on the host) belongs to."""
        if code is None or code < 0:
            return None
        return next((m for (m, _), c in self._inputs.items() if c == int(code)), None)

    def keys_of(self, module: str) -> set[str]:
        """The keys of the inputs ``module`` was given in the run."""
        return self._keys.get(module, set())

    def describe(self, codes: frozenset[int]) -> dict[int, tuple[str, str, int]]:
        """Per input code: its model, its key and how many inputs that model was given
        (codes of a :func:`mask_codes`; the catch-all MASK_CODES is left out)."""
        out = {}
        for (m, k), c in self._inputs.items():
            if c in codes and c < MASK_CODES and k != OUTPUT_KEY:
                out[c] = (m, k, len(self._keys.get(m, ())))
        return out

    def device_totals(self) -> torch.Tensor | None:
        """The run's totals on the device, flat, for the run's one read at its end (None:
        no floating batch was checked in an unrecorded step). Call :meth:`release` first."""
        if self._totals is None:
            return None
        dev = self._totals.device
        first = self._first_loss if self._first_loss is not None else torch.tensor(_NONE)
        listed = (self._beyond_steps if self._beyond_steps is not None
                  else torch.full((MAX_BEYOND_STEPS,), _NONE, dtype=torch.long))
        assert self._beyond_top is not None
        # (float64 for the |values|: the counts and steps stay exact in it.)
        return torch.cat((self._totals.reshape(-1).double(), first.reshape(1).to(dev),
                          self._beyond_top, listed.to(dev)))

    def totals_from(self, n: list[int]) -> BatchTotals | None:
        """The run's totals from their host copy (the device totals, flat), or None when
        no batch was bad. An input that was bad in a step whose loss stayed finite is
        handled by the model (missing values replaced): its bad steps are harmless, and a
        NaN loss beside one is another cause's. The culprit is an input whose every bad
        step went NaN/inf with it (review 49a: a second input the model does not clean)."""
        p = (len(n) - 1 - MAX_BEYOND_STEPS) // (_COLUMNS + 1)
        first_loss = int(n[p * _COLUMNS]) if n[p * _COLUMNS] < _NONE else -1
        tops = [float(x) for x in n[p * _COLUMNS + 1 : p * _COLUMNS + 1 + p]]
        listed = tuple(int(s) for s in n[len(n) - MAX_BEYOND_STEPS:] if s < _NONE)
        flat = [int(x) for x in n[: p * _COLUMNS]]
        rows = [flat[i : i + _COLUMNS] for i in range(0, len(flat), _COLUMNS)]
        beyond = self._beyond_from(rows, tops, listed, first_loss)
        # An input that first went bad after the loss did carries the run's own NaN (a
        # recurrent state carried over detached, fed back after the model made it).
        late = {i for i, r in enumerate(rows) if r[_HARMFUL] and not r[_HARMLESS]
                and 0 <= first_loss < r[_FIRST_HARMFUL]}
        made = [i for i in self._outputs if i < len(rows) and rows[i][_HARMFUL]]
        made_by, made_first, made_steps = None, -1, 0
        if made:
            first_made = min(made, key=lambda i: rows[i][_FIRST_HARMFUL])
            made_by = next(m for (m, _), c in self._inputs.items() if c == first_made)
            made_first = rows[first_made][_FIRST_HARMFUL]
            made_steps = rows[first_made][_HARMFUL]
        bad = [i for i, r in enumerate(rows) if (r[_HARMFUL] or r[_HARMLESS])
               and i not in late and i not in self._outputs]
        if not bad:
            if made_by is None and not beyond:
                return None
            return BatchTotals(harmful=0, dropped=0, harmless=0, nan=False, inf=False,
                               first_harmful=-1, first_harmless=-1, module=None,
                               first_loss_bad=first_loss, made_by=made_by,
                               made_first=made_first, made_steps=made_steps, **beyond)
        culprits = [i for i in bad if not rows[i][_HARMLESS]]
        if culprits:
            # The input bad in the most such steps (a NaN in a handled input that fell in
            # the same step as the culprit's is not it; review 49b), then the first.
            code = min(culprits, key=lambda i: (-rows[i][_HARMFUL], rows[i][_FIRST_HARMFUL]))
            r = rows[code]
            harmful, dropped, harmless = r[_HARMFUL], r[_DROPPED], 0
            nan, inf = r[_NAN_HARMFUL], r[_INF_HARMFUL]
            first, first_harmless = r[_FIRST_HARMFUL], -1
        else:
            code = min(bad, key=lambda i: min(s for s in (rows[i][_FIRST_HARMFUL],
                                                          rows[i][_FIRST_HARMLESS]) if s >= 0))
            r = rows[code]
            harmful = dropped = 0
            harmless = r[_HARMLESS] + r[_HARMFUL]
            nan = r[_NAN_HARMLESS] + r[_NAN_HARMFUL]
            inf = r[_INF_HARMLESS] + r[_INF_HARMFUL]
            first = -1
            first_harmless = min(s for s in (r[_FIRST_HARMLESS], r[_FIRST_HARMFUL]) if s >= 0)
        module, at = next(key for key, c in self._inputs.items() if c == code)
        return BatchTotals(
            harmful=harmful, dropped=dropped, harmless=harmless, nan=bool(nan),
            inf=bool(inf), first_harmful=first,
            first_harmless=first_harmless, module=module, input_key=at,
            inputs=len(self._keys.get(module, ())), first_loss_bad=first_loss,
            made_by=made_by, made_first=made_first, made_steps=made_steps, **beyond)

    def _beyond_from(self, rows: list[list[int]], tops: list[float], listed: tuple[int, ...],
                     first_loss: int) -> dict[str, Any]:
        """The :class:`BatchTotals` fields of the input whose finite values beyond the cast
        format's max went with a NaN/inf loss in every step it held them ({}: none). Not
        one the model took in its stride in another step (it clamps or normalises them in
        float32 first), nor one first beyond after the loss first went bad (the run's own
        NaN did it: weights an update made NaN)."""
        cands = [i for i, r in enumerate(rows) if r[_BEYOND_HARMFUL] and not r[_BEYOND_CALM]
                 and i not in self._outputs and not 0 <= first_loss < r[_FIRST_BEYOND]]
        if not cands:
            return {}
        code = min(cands, key=lambda i: (-rows[i][_BEYOND_HARMFUL], rows[i][_FIRST_BEYOND]))
        module, key = next(k for k, c in self._inputs.items() if c == code)
        return {"beyond_module": module, "beyond_key": key,
                "beyond_steps": rows[code][_BEYOND_HARMFUL], "beyond_listed": listed,
                "beyond_absmax": tops[code] if code < len(tops) else 0.0}

    def release(self) -> None:
        """Fold the waiting steps into the totals and leave no device rows of the user's
        batches behind (the totals stay)."""
        try:
            self._evaluate()
        finally:
            self._rows = []
            self._codes = []
            self._limits = []
            self._made = []
            self._given = set()
            self._steps = []
            self._chunk_rows = []
            self._chunk_at = []
            self._chunk_codes = []
            self._chunk_limits = []
