"""Step folding: a recorded step's host copy -> a :class:`StepRecord`, returned.

:class:`StepFolder` owns what the recorded steps add up to: the per-layer
aggregates, the bounded history, which steps had a NaN/inf loss or batch,
and the sampled low-precision weight updates. :meth:`StepFolder.fold` takes
one flushed :class:`~amp_doctor.device.recorder.StepBuffer` (a host copy, no device
tensor) and returns the :class:`FoldedStep`; the watch passes it on to the
listeners and the scale timeline. Nothing here calls back into the watch.

Listeners (the sinks) receive ``(StepRecord, StepRows)``, see
:mod:`amp_doctor.steps.listeners`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from amp_doctor.device.recorder import (
    AFTER_UNSCALE_BAD_KEY,
    AFTER_UNSCALE_FIRST_KEY,
    HistSums,
    HostCopy,
)
from amp_doctor.devicework import count_sync
from amp_doctor.dtypes import LOW_PRECISION_NAMES, FormatLimits
from amp_doctor.hooks.tensorkinds import input_label, values_of
from amp_doctor.records import Event, LayerSummary, StepRecord
from amp_doctor.steps.aggregates import LayerAggregates
from amp_doctor.steps.history import History
from amp_doctor.steps.listeners import StepListener, StepRows
from amp_doctor.steps.loop import (
    APPLIED_FIRST_KEY,
    INPUT_ABSMAX,
    INPUT_ATTN_MASK,
    LOSS_BAD_FIRST_KEY,
    LOSS_BAD_TOTAL_KEY,
    PLAIN_LOSS_KEY,
)
from amp_doctor.steps.table import (
    ACT,
    GRAD,
    MAX,
    MIN,
    NONFINITE,
    PG,
    StepTable,
    decode_step,
    first_nonfinite,
)

__all__ = ["StepRows", "StepListener", "FoldedStep", "StepFolder", "skip_culprits",
           "GRAD_SCALE_KEY"]

# The first steps with a NaN/inf loss kept in its event (whether the scaler skipped them).
MAX_BAD_STEPS_KEPT = 256
# Layers named in the NaN/inf loss's event as holding -inf beside a finite loss, at most.
MAX_MASKS_KEPT = 64
# Layers named in a step's non-finite gradients event, at most.
MAX_CULPRITS_KEPT = 16
# The step scalar that holds the scale the loss was multiplied by.
GRAD_SCALE_KEY = "grad_scale"


class LayerMetaView(Protocol):
    """What folding needs to know of a hooked layer (the probes' layer metadata)."""

    order: int
    output_dtypes: set[str]
    calls: int
    passthrough_calls: int
    # The layers that took its output directly, with how many calls' outputs they took.
    consumer_calls: dict[str, int]

    def producers_known(self) -> bool: ...


class FoldedStep(NamedTuple):
    record: StepRecord
    # The first layer whose forward overflowed or went non-finite (None: the batch did).
    forward_origin: str | None
    # Layers with non-finite gradients, backward order (only for a skipped step).
    culprits: list[str]
    # The loss was NaN/inf (None: not checked on this step).
    loss_bad: bool | None


class StepFolder:
    """Folds recorded steps into per-layer aggregates, a bounded history and loop facts."""

    def __init__(self, layers: Callable[[], Mapping[str, LayerMetaView]],
                 model_label: Callable[[], str], events: list[Event]) -> None:
        self._layers = layers
        self._model_label = model_label
        self.aggregates = LayerAggregates()
        self.hists = HistSums()
        self.history = History()
        # The watch's event list, in the order things happened (shared with the probes).
        self._events = events
        # Steps whose loss was checked on the host (recorded steps, and skipped steps
        # in the skip's one sync), and those of them where it was NaN/inf.
        self._loss_checked: set[int] = set()
        self._loss_bad: set[int] = set()
        self._loss_bad_skipped: set[int] = set()
        # NaN/inf losses counted on the device up to the last recorded step.
        self.loss_bad_so_far = 0
        # The first recorded step with a bad loss: its forward origin, and whether the
        # batch itself was non-finite there (a later one's may be the first's doing:
        # weights the bad update made NaN).
        self._loss_origin: tuple[int, str | None, bool] | None = None
        # The model was given an additive attention mask in that step.
        self._loss_origin_attn_mask = False
        # ... and that step's first layer to overflow (+inf, or values past the max),
        # other than with -inf alone: for when the first is a mask (below).
        self._loss_origin_past_masks: str | None = None
        # Layers whose output held -inf alone in a recorded step whose loss was finite:
        # masks, whatever else their figures say; not where a NaN/inf loss came from.
        self._neg_inf_beside_finite_loss: set[str] = set()
        self._lp_counts = [0.0, 0.0]  # sampled elements with a gradient, unchanged of those
        # The last recorded step folded, and the NaN/inf losses counted before the first
        # recorded step with one that no host check saw (unrecorded, unskipped steps):
        # (that count, the last recorded step before them).
        self._last_recorded: int | None = None
        # A recorded step stayed finite with a batch beyond the format's max.
        self._input_beyond_harmless = False
        # The first recorded step whose batch held NaN/inf while every layer's output and
        # the loss stayed finite: the model handles such values (missing data as NaN).
        self.bad_input_harmless: int | None = None
        # The input codes seen bad in recorded steps whose outputs and loss stayed finite:
        # inputs the model handles.
        self._handled_codes: set[int] = set()
        self._bad_before_unseen: tuple[int, int | None] | None = None
        # The first step whose loss was NaN/inf, from the device's record (None: not read).
        self.loss_first: int | None = None

    @property
    def any_loss_bad(self) -> bool:
        """A NaN/inf loss was seen, in a checked step or in the device count so far."""
        return bool(self._loss_bad) or self.loss_bad_so_far > 0

    def note_loss(self, step: int, bad: bool, skipped: bool = False) -> None:
        # Host flags only, from copies made anyway: no sync of its own.
        self._loss_checked.add(step)
        if bad:
            self._loss_bad.add(step)
            if skipped:
                self._loss_bad_skipped.add(step)

    def fold(self, hs: HostCopy, *, fmt: FormatLimits, param_grads_scaled: bool,
             skipped: bool, scale: float | None, check_input: bool,
             input_module: str | None = None,
             input_codes: Mapping[int, tuple[str, str, int]] | None = None,
             formats: Mapping[str, FormatLimits] | None = None,
             lp_param: Callable[[int], tuple[str | None, str]] | None = None,
             update_dropped: bool = False,
             after_unscale_layers: Sequence[str] = ()) -> FoldedStep:
        """One recorded step's host copy -> its record, folded into the run's aggregates.

        ``fmt``: the run's low-precision format; ``formats``: the layers judged against
        another (see ``dtypes.judged_format``).

        ``check_input``: report a NaN/inf batch here (anomaly mode reports it otherwise),
        as given to ``input_module`` (default: the model). ``input_codes``: the inputs that
        held NaN/inf, by code: (model, key, how many inputs it takes); None if not known.
        ``update_dropped``: the loop took no update in this step (it skipped the optimizer
        on a non-finite norm). ``after_unscale_layers``: see
        ``StepBuffer.after_unscale_layers``.
        """
        step = hs.step
        grad_scale = hs.scalars.get(GRAD_SCALE_KEY)
        layers, hists = decode_step(hs, fmt, grad_scale,
                                    grad_scale if param_grads_scaled else None, formats)
        self.aggregates.add(layers, step)
        for h in hists:
            self.hists.add(h)
        bad_outputs = self._bad_outputs(hs, layers, fmt, formats)
        origin = bad_outputs[0] if bad_outputs else None
        input_bad = bool(hs.scalars.get("input_nan") or hs.scalars.get("input_inf"))
        codes = dict(input_codes) if input_codes else {}
        finite_after = not skipped and not hs.scalars.get("loss_bad")
        if input_bad and codes and set(codes) <= self._handled_codes:
            # Only inputs the model took in its stride in an earlier recorded step: not
            # this step's cause, which its layers show (a layer's overflow, a GradScaler
            # calibrating; review 49a: an unrelated overflow was "the batch").
            input_bad = False
            if check_input:
                m, _, _ = codes[min(codes)]
                self._note_bad_input(step, hs.scalars, m, True,
                                     beside=bool(bad_outputs) or not finite_after)
        if input_bad:
            # The batch was already non-finite: no layer is the origin.
            origin = None
            if codes and (new := sorted(set(codes) - self._handled_codes)):
                # The input the model does not handle, beside those it does.
                input_module, key, n = codes[new[0]]
            if check_input:
                harmless = not bad_outputs and finite_after
                # Outputs that went bad with it, but no backward reached them: the loss (it
                # was checked) and every gradient stayed finite. A forward the loop dropped,
                # or an evaluation with grad on (review 49a): training took none of it.
                dropped = (bool(bad_outputs) and finite_after and "loss_bad" in hs.scalars
                           and not layers.where((layers.column(GRAD, NONFINITE) > 0)
                                                | (layers.column(PG, NONFINITE) > 0)))
                if harmless and self.bad_input_harmless is None:
                    self.bad_input_harmless = step
                if harmless:
                    # (Not a dropped forward's: the loop kept it from training, not the model.)
                    self._handled_codes.update(codes)
                which = (input_label(key), n) if codes and new and n > 1 else None
                self._note_bad_input(step, hs.scalars, input_module or self._model_label(),
                                     harmless or dropped, dropped, which=which)
        culprits = self._culprits(hs, layers) if skipped else []
        if not input_bad and (first_bad := origin or next(iter(culprits), None)):
            # The batch's cast can make inf where no layer's output shows it: a GRU's
            # gate matmuls run in float16 inside it, its output stays float32 and finite,
            # and its gradients go NaN.
            self._note_input_beyond(step, hs.scalars, (formats or {}).get(first_bad, fmt),
                                    first_bad, in_output=origin is not None)
        elif (not input_bad and not skipped and not hs.scalars.get("loss_bad")
              and _beyond(hs.scalars, fmt)  # first: no table ops in the usual step
              and not layers.where((layers.column(GRAD, NONFINITE) > 0)
                                   | (layers.column(PG, NONFINITE) > 0))):
            # A batch beyond the max in a step that stayed finite: nothing casts it (a
            # float32 LayerNorm first), so the steps whose *gradients* alone went
            # non-finite beside such a batch did so for another reason (a calibrating
            # scaler's backoffs). A step whose forward went inf in a layer keeps its blame:
            # another column of the batch may be the one cast (review 47c).
            self._input_beyond_harmless = True
            self._events[:] = [e for e in self._events if e.kind != "input_beyond_format"
                               or e.data.get("in_output_layers")]
            for e in self._events:
                if e.kind == "input_beyond_format":
                    _keep_forward_blame(e)
        if origin is not None:
            self.aggregates.note_origin(origin)
            for other in self._independent_origins(bad_outputs, layers):
                self.aggregates.note_origin(other)
        loss_bad: bool | None = None
        total_bad = int(hs.scalars.get(LOSS_BAD_TOTAL_KEY, 0))
        self.loss_bad_so_far = max(self.loss_bad_so_far, total_bad)
        if total_bad and self.loss_first is None and LOSS_BAD_FIRST_KEY in hs.scalars:
            self.loss_first = int(hs.scalars[LOSS_BAD_FIRST_KEY])
        if "loss_bad" in hs.scalars:
            loss_bad = bool(hs.scalars["loss_bad"])
            if loss_bad and self._loss_origin is None:
                self._note_bad_before(step, total_bad - 1, scaled=grad_scale is not None)
            self.note_loss(step, loss_bad, skipped)
            neg_inf_only = set(layers.where((layers.column(ACT, MIN) == -math.inf)
                                            & (layers.column(ACT, MAX) < math.inf)))
            if not loss_bad:
                self._neg_inf_beside_finite_loss.update(neg_inf_only)
            elif self._loss_origin is None:
                self._loss_origin = (step, origin, input_bad)
                self._loss_origin_attn_mask = bool(hs.scalars.get(INPUT_ATTN_MASK))
                if not input_bad:
                    self._loss_origin_past_masks = self._forward_origin(
                        hs, layers, fmt, formats, neg_inf_only, overflowed=True)
        if "lp_with_grad" in hs.scalars:
            self._lp_counts[0] += hs.scalars["lp_with_grad"]
            self._lp_counts[1] += hs.scalars.get("lp_unchanged", 0.0)
            self._note_update_nonfinite(step, hs.scalars, lp_param)
        loss = hs.scalars.get("loss", hs.scalars.get(PLAIN_LOSS_KEY))
        if (check_input and not skipped and not update_dropped and grad_scale is None
                and origin is None and not input_bad and not loss_bad):
            # No loss scale: a GradScaler would skip such a step (or raise in it), and
            # optimizer.step() on scaled gradients is a misuse with a finding of its own.
            self._note_grads_applied(step, hs, layers, loss)
        first_applied = int(hs.scalars.get(APPLIED_FIRST_KEY, -1))
        if 0 <= first_applied < step:
            self.note_applied_first(first_applied)  # in a step nobody recorded
        # (Not ``skipped``: the device count is of the optimizers the scaler did not skip.)
        if hs.scalars.get(AFTER_UNSCALE_BAD_KEY) and not update_dropped:
            self._note_changed_after_unscale(step, hs.scalars, after_unscale_layers, loss)
        self._last_recorded = step
        rec = StepRecord(step=step, loss=loss, scale=scale, skipped=skipped,
                         layers=layers)
        self.history.add(rec)
        return FoldedStep(rec, origin, culprits, loss_bad)

    def _note_bad_before(self, step: int, earlier: int, scaled: bool) -> None:
        """The first recorded step with a NaN/inf loss: were there ``earlier`` bad losses
        (the device's count) that no host check saw? Those steps were neither recorded nor
        skipped (a skip's sync checks its loss): with nothing to skip them, their updates
        may have made the weights NaN, and this step only shows where that surfaces.
        Not under an enabled GradScaler (``scaled``): it skips every step whose gradients
        are NaN/inf, so the ones it let through had finite gradients and left the weights
        finite (review 55: a 0/0 loss term whose gradient is finite)."""
        unseen = earlier - sum(s < step for s in self._loss_bad)
        if unseen > 0 and not scaled:
            self._bad_before_unseen = (unseen, self._last_recorded)

    def _note_grads_applied(self, step: int, hs: HostCopy, layers: StepTable,
                            loss: float | None) -> None:
        """A recorded step that nothing skipped, whose forward and loss were finite, but
        whose gradients went NaN/inf in backward: the update took them (no GradScaler,
        or a disabled one), unless the loop drops them itself. One event per run, its
        layers in the order their gradients went non-finite; later steps are counted."""
        # Host figures read through the table (its own host-side reads, no tensor truth
        # values here): the usual step has no non-finite gradient and stops at once.
        pg = layers.column(PG, NONFINITE)
        if not layers.where((layers.column(GRAD, NONFINITE) > 0) | (pg > 0)):
            return
        if layers.where(pg == pg) and not layers.where(pg > 0):
            # The gradients the optimizer stepped on were finite (the loop skipped the
            # update of the iteration whose gradients were not, or cleaned them first):
            # the non-finite ones never reached the weights.
            return
        metas = self._layers()
        # Not a container that only returned its child's output: the child is the layer.
        culprits = [n for n in self._culprits(hs, layers) if n not in metas
                    or not 0 < metas[n].calls <= metas[n].passthrough_calls]
        if not culprits:
            return
        e = next((e for e in self._events if e.kind == "nonfinite_grads_applied"), None)
        if e is not None:
            e.data["occurrences"] = int(e.data["occurrences"]) + 1
            return
        # Every output gradient finite, only the weights' went bad: a weight-gradient op,
        # or the loop's own code between backward and the update (review 61b: NaN noise
        # read as "went NaN/inf in the backward pass").
        weights_only = not layers.where(layers.column(GRAD, NONFINITE) > 0)
        self._events.append(Event(kind="nonfinite_grads_applied", step=step,
                                  module=culprits[0], data={
                                      "culprits": culprits[:MAX_CULPRITS_KEPT], "loss": loss,
                                      "occurrences": 1, "weights_only": weights_only}))

    def _note_changed_after_unscale(self, step: int, scalars: Mapping[str, float],
                                    layers: Sequence[str], loss: float | None) -> None:
        """The loop's own ``scaler.unscale_`` found the gradients finite, then code before
        ``scaler.step`` (noise, a custom clip) made some NaN/inf: the scaler, which does
        not look again, applied them. A ``nonfinite_grads_applied`` of its own kind of
        cause; the gradients' summaries, taken at unscale_, were finite."""
        first = int(scalars.get(AFTER_UNSCALE_FIRST_KEY, 0))
        module = layers[first] if 0 <= first < len(layers) else None
        e = next((e for e in self._events if e.kind == "nonfinite_grads_applied"), None)
        if e is not None:
            e.data["occurrences"] = int(e.data["occurrences"]) + 1
            return
        self._applied_after_unscale(step, module, loss=loss,
                                    grads_bad=int(scalars[AFTER_UNSCALE_BAD_KEY]))

    def note_applied_first(self, step: int) -> None:
        """An unrecorded ``step``'s update took gradients the loop made NaN/inf after its
        own unscale_ (the loop's device record of the first such step): its event, no
        layer known, unless a recorded step's is there already."""
        if not any(e.kind == "nonfinite_grads_applied" for e in self._events):
            self._applied_after_unscale(step, None, loss=None, unrecorded=True)

    def _applied_after_unscale(self, step: int, module: str | None, **data: Any) -> None:
        self._events.append(Event(kind="nonfinite_grads_applied", step=step, module=module,
                                  data={"after_unscale": True, **data,
                                        "culprits": [module] if module else [],
                                        "occurrences": 1}))

    def _note_input_beyond(self, step: int, scalars: dict[str, float], fmt: FormatLimits,
                           origin: str, in_output: bool) -> None:
        """A layer's output (``in_output``), or else its gradients, went non-finite first
        in a step whose batch held finite values beyond the format's max: autocast's cast
        of them is inf. One event per run; its ``first_bad_layer`` is the layer that came
        first in most such steps (a calibrating scaler's first backoffs overflow another
        layer's scaled gradients first)."""
        given = _beyond(scalars, fmt)
        if not given or (self._input_beyond_harmless and not in_output):
            return
        top, module = max(given)
        e = next((e for e in self._events if e.kind == "input_beyond_format"), None)
        if e is None:
            e = Event(kind="input_beyond_format", step=step, module=module,
                      data={"absmax": top, "dtype": fmt.name, "max": fmt.max,
                            "occurrences": 0, "first_bad": {}, "in_output_layers": []})
            self._events.append(e)
        d = e.data
        d["occurrences"] = int(d["occurrences"]) + 1
        d["absmax"] = max(float(d["absmax"]), top)
        d["first_bad"][origin] = d["first_bad"].get(origin, 0) + 1
        if in_output and origin not in d["in_output_layers"]:
            d["in_output_layers"].append(origin)
        # dicts keep insertion order: the earliest layer wins a tie
        d["first_bad_layer"] = max(d["first_bad"], key=d["first_bad"].get)
        d["in_output"] = d["first_bad_layer"] in d["in_output_layers"]

    def _note_update_nonfinite(self, step: int, scalars: dict[str, float],
                               lp_param: Callable[[int], tuple[str | None, str]] | None
                               ) -> None:
        """The optimizer's update made sampled low-precision weights non-finite from finite
        values and finite gradients (once per run: what follows is its doing)."""
        made = int(scalars.get("lp_made_nonfinite", 0))
        at = int(scalars.get("lp_nonfinite_param", -1))
        if made <= 0 or any(e.kind == "lowp_update_nonfinite" for e in self._events):
            return
        layer, dtype = lp_param(at) if lp_param is not None and at >= 0 else (None, "")
        self._events.append(Event(kind="lowp_update_nonfinite", step=step, module=layer,
                                  data={"count": made, "dtype": dtype}))

    def _note_bad_input(self, step: int, scalars: dict[str, float], module: str,
                        harmless: bool, dropped: bool = False, beside: bool = False,
                        which: tuple[str, int] | None = None) -> None:
        """A recorded step's batch held NaN/inf. One event per run: an error once such a
        batch made a layer's output or the loss non-finite (or the step was skipped), info
        while the model took every such batch in its stride (it masks missing values), a
        warning while the only outputs it made non-finite reached no backward
        (``dropped``). ``beside``: a step that went wrong for another reason, beside an
        input the model handles. ``which``: the bad input's label and how many the model
        takes, when it takes several."""
        e = next((e for e in self._events if e.kind == "nonfinite_input"
                  and e.data.get("detected") == "recorded step"), None)
        if e is None:
            e = Event(kind="nonfinite_input", step=step, module=module, data={
                "nan": False, "inf": False, "detected": "recorded step",
                "occurrences": 0, "harmful": 0})
            self._events.append(e)
        d = e.data
        d["occurrences"] = int(d["occurrences"]) + 1
        d["nan"] = bool(d["nan"] or scalars.get("input_nan"))
        d["inf"] = bool(d["inf"] or scalars.get("input_inf"))
        if not harmless:
            if not d["harmful"] and e.step != step:
                # Where it first did harm.
                self._events[self._events.index(e)] = dataclasses.replace(e, step=step)
            d["harmful"] = int(d["harmful"]) + 1
        if dropped:
            d["outputs_dropped"] = int(d.get("outputs_dropped", 0)) + 1
        if beside:
            d["beside"] = int(d.get("beside", 0)) + 1
        if which is not None and not harmless and "input" not in d:
            d["input"], d["inputs"] = which
        if d["harmful"]:
            d.pop("severity", None)
        else:
            d["severity"] = "warning" if d.get("outputs_dropped") else "info"

    def _forward_origin(self, hs: HostCopy, layers: StepTable, fmt: FormatLimits,
                        formats: Mapping[str, FormatLimits] | None = None,
                        leave_out: set[str] | None = None, overflowed: bool = False
                        ) -> str | None:
        """The first layer to finish its forward with an overflowed or non-finite output
        (see :meth:`_bad_outputs`), or None."""
        got = self._bad_outputs(hs, layers, fmt, formats, leave_out, overflowed)
        return got[0] if got else None

    def _bad_outputs(self, hs: HostCopy, layers: StepTable, fmt: FormatLimits,
                     formats: Mapping[str, FormatLimits] | None = None,
                     leave_out: set[str] | None = None, overflowed: bool = False
                     ) -> list[str]:
        """The layers that finished their forward with an overflowed or non-finite output
        (not one of ``leave_out``; ``overflowed``: one with +inf or finite values beyond
        its format's max, not only NaN), the first to finish first.

        Hooks run in completion order (children before parents), so the first
        such output produced the problem; the ones after it only passed it on. A layer
        called several times in the step (a shared activation) is placed by its first
        call whose output was bad, not by its first call: its second call may only
        carry on the inf of a layer that ran between the two.
        """
        metas = self._layers()
        nonfinite = layers.column(ACT, NONFINITE) > 0
        went_bad = set(layers.where(nonfinite))
        bad = [
            n for n in layers.where(layers.flagged((ACT,)))
            if n in metas and (n in went_bad or metas[n].output_dtypes & LOW_PRECISION_NAMES)
            and not (leave_out and n in leave_out)
        ]
        if not bad:
            return []
        # Each candidate's output rows (one per call; a container shares its child's),
        # less those of the layers left out (a mask's row, shared by the model's output).
        masked = {r for n in leave_out or () for r in hs.act_rows.get(n, [])}
        cells = [(r, n) for n in bad for r in hs.act_rows.get(n, []) if r not in masked]
        ext = hs.matrix.index_select(0, torch.tensor([r for r, _ in cells], dtype=torch.long))
        lo_hi = ext[:, MIN:MAX + 1]
        fmax = torch.tensor([(formats or {}).get(n, fmt).max for _, n in cells],
                            dtype=torch.float64)
        beyond = lo_hi.isfinite() & (lo_hi.abs() > fmax[:, None])
        hit = ((lo_hi[:, 1] == math.inf) | beyond.any(1) if overflowed
               else (~lo_hi.isfinite() | beyond).any(1)).tolist()
        # The earliest bad output, and of the layers it is, the first to finish (the
        # child, not the container that returned it); without rows, forward order.
        found = [(r, metas[n].order, n) for (r, n), h in zip(cells, hit, strict=True) if h]
        if not found:
            return [min(bad, key=lambda n: metas[n].order)]
        return list(dict.fromkeys(n for _, _, n in sorted(found)))

    def _independent_origins(self, ordered: list[str], layers: StepTable) -> list[str]:
        """The layers after the step's first origin (``ordered[0]``) that overflowed on
        their own: every input they took was a watched layer's output, and none of those
        was non-finite or beyond its format in this step (two towers whose last layers
        overflow apart). The order of completion alone would make the second one a
        carrier of the first's inf."""
        if len(ordered) < 2:
            return []
        metas = self._layers()
        bad = set(layers.where(layers.flagged((ACT,)))) | set(
            layers.where(layers.column(ACT, NONFINITE) > 0))
        producers: dict[str, list[str]] = {}
        for x, m in metas.items():
            for y in m.consumer_calls:
                producers.setdefault(y, []).append(x)
        found = [ordered[0]]
        for y in ordered[1:]:
            meta = metas.get(y)
            if (meta is None or not meta.producers_known() or not producers.get(y)
                    or any(p in bad for p in producers[y])
                    # A container returns its child's output: the child is the origin.
                    or any(o.startswith(y + ".") or y.startswith(o + ".") for o in found)):
                continue
            found.append(y)
        return found[1:]

    def _culprits(self, hs: HostCopy, layers: StepTable) -> list[str]:
        """The step's layers with non-finite gradients, in the order the non-finite ones
        arrived: by each layer's first non-finite output-gradient row (with two
        backward calls, a layer whose first, finite gradient came early is not first).
        A layer whose weights' gradients alone went non-finite (its output gradient
        stayed finite) made them in its own backward, which ran as its output gradient
        arrived: just after that row (parameter gradients are filed at the step's end,
        after every output gradient). With several output gradients (two backward calls,
        a module called twice) which backward made them is not known: such a layer comes
        after those whose output gradients went non-finite.
        Then by first arrival of any gradient."""
        pg_bad = set(layers.where(layers.column(PG, NONFINITE) > 0))
        bad = layers.where((layers.column(GRAD, NONFINITE) > 0)
                           | (layers.column(PG, NONFINITE) > 0))
        seen: dict[str, int] = {}
        for i, n in enumerate(hs.backward_order):
            seen.setdefault(n, i)
        first_bad: dict[str, float] = {}
        for n in bad:
            rows = hs.grad_rows.get(n)
            row = first_nonfinite(hs, rows) if rows else None
            if row is not None:
                first_bad[n] = row
            elif n in pg_bad and rows and len(rows) == 1:
                first_bad[n] = rows[0] + 0.5
        metas = self._layers()
        big = len(hs.backward_order) + len(hs.matrix) + 1
        return sorted(bad, key=lambda n: (first_bad.get(n, big), seen.get(n, big),
                                          -metas[n].order if n in metas else 0))

    def rename(self, mapping: dict[str, str]) -> None:
        """Layers were renamed (a second model prefixes the first's names)."""
        self.aggregates.rename(mapping)
        self.hists.rename(mapping)
        self.history.records = [
            StepRecord(**{**r.__dict__, "layers": {mapping.get(k, k): v
                                                   for k, v in r.layers.items()}})
            for r in self.history.records
        ]

    def summaries(self, metas: Mapping[str, Any],
                  ops: Mapping[str, dict[str, dict[str, int]]]) -> list[LayerSummary]:
        """Every layer that ran, summarised over the run, in forward order."""
        out = []
        for name, meta in metas.items():
            if name not in self.aggregates and meta.calls == 0:
                continue
            out.append(self.aggregates.summary(
                name, meta.type, meta.order, meta.calls, meta.input_dtypes,
                meta.output_dtypes, meta.param_dtypes, ops.get(name, {}), self.hists.of(name),
                passthrough=meta.calls > 0 and meta.passthrough_calls >= meta.calls,
                model_output=meta.model_output, consumers=meta.consumers(),
                inputs_known=meta.calls > 0 and meta.producers_known()))
        return sorted(out, key=lambda x: (x.order < 0, x.order))

    def loss_events(self, steps: int, anomaly: bool = False,
                    counted: tuple[int, int] | None = None) -> list[Event]:
        """The steps whose loss was NaN/inf, over the whole run (``anomaly``: anomaly
        mode was on, so the message does not propose it). ``counted``: (NaN/inf losses,
        steps with a loss) over every step, from the device count."""
        if not self._loss_bad and not (counted and counted[0]):
            return []
        seen = self._loss_origin
        bad, checked = len(self._loss_bad), len(self._loss_checked)
        every = counted is not None and counted[0] >= bad and counted[1] >= checked
        if every and counted is not None:
            bad, checked = counted
        known = set(self._loss_bad)
        if self.loss_first is not None:
            known.add(self.loss_first)  # the device's record of the first, seen or not
        first = min(known) if known else None
        module = seen[1] if seen else None
        # Where a recorded step showed it, when it began before: in a step whose update
        # took NaN/inf gradients, or in steps nobody checked. Weights it made NaN show it
        # in the first layer that uses them, which is not its origin.
        applied = next((e for e in self._events if e.kind == "nonfinite_grads_applied"
                        and seen is not None and e.step < seen[0]), None)
        before: dict[str, Any] = {}
        if applied is not None:
            before = {"after_grads_applied": applied.step, "shown_in": module}
            module = None
        elif seen is not None and self._bad_before_unseen is not None:
            unseen, last = self._bad_before_unseen
            before = {"began_unrecorded": unseen, "last_recorded_before": last,
                      "shown_in": module}
            module = None
        return [Event(kind="nonfinite_loss", step=first if first is not None else 0,
                      module=module, data={**before,
                          "steps_bad": bad, "checked": checked, "steps": steps,
                          # Every step's loss was counted: the steps named are the ones seen
                          # (recorded or skipped), and that many of the bad ones were skipped.
                          "every_step": every, "first_known": first is not None,
                          "bad_skipped": len(self._loss_bad_skipped),
                          "recorded_at": seen[0] if seen else None,
                          "origin": module,
                          "origin_past_masks": self._loss_origin_past_masks,
                          "masks_beside_finite_loss": sorted(
                              self._neg_inf_beside_finite_loss)[:MAX_MASKS_KEPT],
                          "input_bad": seen[2] if seen else False,
                          "attn_mask_given": self._loss_origin_attn_mask,
                          "anomaly": anomaly,
                          # Bounded: a run-long NaN loss is one finding, not a list.
                          "bad_steps": sorted(known)[:MAX_BAD_STEPS_KEPT]})]

    def lowp_events(self, param_dtypes: Iterable[str]) -> list[Event]:
        """Sampled low-precision weights that the optimizer's update did not move."""
        with_grad, unchanged = self._lp_counts
        if with_grad <= 0:
            return []
        return [Event(kind="lowp_updates_lost", step=0, data={
            "sampled": int(with_grad), "unchanged": int(unchanged),
            "frac": unchanged / with_grad,
            "dtypes": sorted({d for d in param_dtypes if d in LOW_PRECISION_NAMES})})]


def skip_culprits(params: list[torch.Tensor], param_owner: Mapping[int, str],
                  order: Callable[[str], int], loss_flag: torch.Tensor | None,
                  clip_norms: list[torch.Tensor] | None = None
                  ) -> tuple[list[str], bool | None] | None:
    """A skipped step that was not recorded: its layers with non-finite gradients.

    One host copy (the skip's one sync) for every layer's flag and the loss's.
    Returns (culprits, the loss was NaN/inf or None), or None when nothing to check.
    A ``clip_grad_norm_`` of the step whose total norm was NaN (``clip_norms``) multiplied
    every gradient it clipped by NaN before this check: unless the loss was NaN/inf (then
    every gradient was anyway), which layers overflowed is not known, and no culprit is
    named (review 44d: every layer, the last first).
    """
    by_layer: dict[str, list[torch.Tensor]] = {}
    for p in params:
        name = param_owner.get(id(p))
        if name is not None and p.grad is not None:
            by_layer.setdefault(name, []).append(values_of(p.grad))
    if not by_layer and loss_flag is None:
        return None
    names = list(by_layer)
    parts = [torch.stack([~torch.isfinite(g).all() for g in gs]).any()
             for gs in by_layer.values()]
    if loss_flag is not None:
        dev = parts[0].device if parts else loss_flag.device
        parts.append(loss_flag.to(dev))
    norms = clip_norms or []
    if norms:
        dev = parts[0].device if parts else norms[0].device
        parts.append(torch.stack([n.to(dev).isnan().reshape(()) for n in norms]).any())
    bad = torch.stack(parts).tolist()  # the one sync of an unrecorded skipped step
    count_sync()
    poisoned = bool(bad.pop()) if norms else False
    loss_bad = bool(bad.pop()) if loss_flag is not None else None
    if poisoned and not loss_bad:
        # (A NaN/inf loss makes every gradient non-finite anyway: the list stands.)
        return [], loss_bad
    ranks = {n: order(n) for n in names}
    culprits = sorted((n for n, b in zip(names, bad, strict=True) if b), key=lambda n: -ranks[n])
    return culprits, loss_bad


def _beyond(scalars: Mapping[str, float], fmt: FormatLimits) -> list[tuple[float, str]]:
    """The batches (absmax, the module given them) that held finite values beyond
    ``fmt``'s max in this step."""
    return [(v, k[len(INPUT_ABSMAX):]) for k, v in scalars.items()
            if k.startswith(INPUT_ABSMAX) and math.isfinite(v) and v > fmt.max]


def _keep_forward_blame(e: Event) -> None:
    """An ``input_beyond_format`` event with only the steps whose forward went non-finite
    (the layers in ``in_output_layers``) left."""
    d = e.data
    kept = {k: v for k, v in d["first_bad"].items() if k in d["in_output_layers"]}
    d["occurrences"] = sum(kept.values())
    d["first_bad"] = kept
    d["first_bad_layer"] = max(kept, key=lambda k: kept[k])
    d["in_output"] = True
