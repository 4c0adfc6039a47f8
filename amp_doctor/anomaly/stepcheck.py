"""Anomaly mode's per-step check: on the device, on every step, without a sync.

One (min, max) reduction of the batch given to each root model, and a
``_foreach_norm`` over the gradients each optimizer step is given (NaN/Inf
anywhere in forward or backward ends up there). A GradScaler's ``unscale_`` has
checked those same gradients already: its ``found_inf`` is taken instead, two
ops on a one-value tensor where the norms read every gradient again (one tensor at
a time on the CPU: 5% of a 646-parameter GPT's float16 step). In a step without an optimizer
that amp-doctor sees (a manual update), over the watched parameters' gradients
at the step boundary. Gradients no optimizer takes are not checked: a GAN's
generator step writes discriminator gradients that the next
``zero_grad()`` drops, and their overflow harms nothing. The flags wait on the
device for the next recorded step's single host copy.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from amp_doctor.anomaly.userframes import Frame
from amp_doctor.device.stats import merged_extremes
from amp_doctor.devicework import own_ops
from amp_doctor.dtypes import dtype_name
from amp_doctor.hooks.tensorkinds import values_of

__all__ = ["RootCall", "StepFlag", "StepCheck", "norm_sums", "batch_row", "tensor_rows"]


@dataclass(slots=True)
class RootCall:
    """One call of a root model with grad on: its batch's (min, max), on the device."""

    step: int
    module: str
    dtype: str
    frames: tuple[Frame, ...]
    row: torch.Tensor  # [2] float32 (min, max) over the floating inputs
    # The max of the format autocast casts the batch to (float16's), else inf: a finite
    # value beyond it is inf after the first layer's cast.
    limit: float = math.inf
    # Not a batch: the output of a model called under no_grad in the step (a frozen
    # backbone, a teacher). A batch given after it went bad is made from it.
    made: bool = False
    # Each input's key (``hooks.tensorkinds.given_data_keyed``) and [n, 2] (min, max) row:
    # read when the call was bad, to tell which input (one the model handles in other
    # steps is not the cause).
    keys: tuple[str, ...] = ()
    per: torch.Tensor | None = None


@dataclass(slots=True)
class StepFlag:
    """A step's device scalar: non-finite iff something it covers is."""

    step: int
    value: torch.Tensor
    # The flag of a forward the loop dropped before backward (its output went NaN/inf):
    # a bad step, whose loss and gradients may still have been finite.
    dropped: bool = False


def norm_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per device, a float64 scalar that is non-finite iff some value of ``tensors`` is
    NaN/Inf.

    A few launches per device, whatever the number of tensors: one ``_foreach_norm``
    per kind, then the largest norm. The 2-norms are accumulated in float64, where the
    square of any finite float32, bfloat16 or float16 value cannot overflow: a float32
    2-norm overflows at values of 1.8e19, and took a large but finite gradient for an
    Inf. float64 tensors, whose squares could overflow float64, take the inf-norm. The
    largest norm rather than their sum, which two finite float64 norms could overflow.
    On the CPU the float64 2-norm is cheaper than the inf-norm.
    """
    strided = torch.strided
    f64 = torch.float64
    by_dev: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for g in tensors:
        g = values_of(g)
        if g.layout is strided and g.is_floating_point() and not g.is_meta:
            wide, narrow = by_dev.setdefault(g.device, ([], []))
            (wide if g.dtype == f64 else narrow).append(g)
    out = []
    with torch.no_grad():
        for wide, narrow in by_dev.values():
            norms = list(torch._foreach_norm(narrow, 2, dtype=f64)) if narrow else []
            if wide:
                norms.extend(torch._foreach_norm(wide, math.inf))
            out.append(torch.stack(norms).amax())
    return out


def _row_dtype(t: torch.Tensor) -> torch.dtype:
    # float64 data beyond float32's max is finite: float32 would make it inf.
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def tensor_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[n, 2] float32 (float64 for float64 data): each tensor's (min, max), on the device.
    No sync."""
    return torch.stack([torch.stack(torch.aminmax(t)).to(_row_dtype(t)) for t in tensors])


def batch_row(rows: torch.Tensor) -> torch.Tensor:
    """[2]: the (min, max) over all of :func:`tensor_rows` ``rows`` but an attention mask's
    -inf (:func:`~amp_doctor.device.stats.merged_extremes`), on the device. No sync."""
    return rows[0] if rows.shape[0] == 1 else merged_extremes(rows)


class StepCheck:
    """The per-step flags of the watched root models, kept until the next check."""

    def __init__(self) -> None:
        self._roots: dict[int, weakref.ref[nn.Module]] = {}
        self._params: list[torch.Tensor] | None = None
        self.calls: list[RootCall] = []
        self.grads: list[StepFlag] = []
        # This step's flags of the gradients its optimizer steps took, until end_step.
        self._stepped: list[torch.Tensor] = []
        # Parameters a GradScaler is unscaling: their flag is its found_inf
        # (note_found_inf); checked by norms at end_step if none came (unscale_ raised;
        # a fused optimizer, which unscales inside its own step).
        self._awaited: list[torch.Tensor] = []
        self.weights: list[StepFlag] = []
        # Per step, whether its loss was NaN/inf (bool): read only when a window is
        # flagged, to tell an origin whose values reached the loss from one they did not.
        self.losses: list[StepFlag] = []
        self.light_steps = 0  # steps whose flags wait for a host copy

    def add_root(self, root: nn.Module) -> None:
        if id(root) not in self._roots:
            self._roots[id(root)] = weakref.ref(root)
            self._params = None

    def watched_params(self) -> list[torch.Tensor]:
        if self._params is None:
            # Built once per set of roots (a model found later resets it).
            seen: set[int] = set()
            params: list[torch.Tensor] = []
            for ref in self._roots.values():
                m = ref()
                if m is None:
                    continue
                for p in m.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            self._params = params
        return self._params

    def note_weights(self, step: int) -> None:
        """Whether the weights are finite now (a search is about to start)."""
        with own_ops:
            self.weights.extend(StepFlag(step, f) for f in norm_sums(self.watched_params()))

    def note_batch(self, step: int, module: str, tensors: list[torch.Tensor],
                   frames: tuple[Frame, ...], limit: float = math.inf,
                   rows: torch.Tensor | None = None, keys: tuple[str, ...] = ()) -> None:
        """The batch given to a root model: its (min, max), from ``rows`` (the watch's
        batch check of these tensors, one row each) or by a pass of its own; ``keys``:
        each tensor's key."""
        with own_ops:
            per = tensor_rows(tensors) if rows is None else rows.to(
                torch.float64 if rows.dtype == torch.float64 else torch.float32)
            self.calls.append(RootCall(step, module, dtype_name(tensors[0].dtype), frames,
                                       batch_row(per), limit, keys=keys, per=per))

    def note_made(self, step: int, module: str, rows: torch.Tensor) -> None:
        """A model called under no_grad returned tensors whose (min, max) rows are
        ``rows`` (the watch's check of them): a batch given after they went bad is no
        data."""
        with own_ops:
            row = merged_extremes(
                rows.to(torch.float64 if rows.dtype == torch.float64 else torch.float32))
            self.calls.append(RootCall(step, module, "", (), row, made=True))

    def note_stepped(self, params: list[torch.Tensor], scaled: bool = False) -> None:
        """An optimizer is about to step ``params``: flag their gradients as it takes them
        (a later backward may overwrite them before the step ends). ``scaled``: a
        GradScaler is about to unscale them, and its check will do (note_found_inf)."""
        if scaled:
            self._awaited.extend(params)
            return
        grads = [g for p in params if (g := p.grad) is not None]
        with own_ops:
            self._stepped.extend(norm_sums(grads))

    def note_found_inf(self, found: list[torch.Tensor]) -> None:
        """A GradScaler's ``unscale_`` checked the awaited gradients: ``found``, its
        ``found_inf_per_device`` (1.0 where a gradient held NaN/Inf), is their flag.
        Converted now: ``update()`` adds another optimizer's into the first in place."""
        with own_ops:
            self._stepped.extend(torch.where(f > 0, math.inf, 0.0).to(torch.float64)
                                 for f in found)
        self._awaited = []

    def _check_awaited(self) -> None:
        if self._awaited:
            params, self._awaited = self._awaited, []
            self.note_stepped(params)

    def end_step(self, step: int, loss_bad: torch.Tensor | None = None,
                 dropped_bad: torch.Tensor | None = None) -> None:
        """The step's gradient flag: per device, non-finite iff a gradient an optimizer
        took is (without one, a watched gradient); and ``loss_bad``, the step's loss
        check (a device bool), when it had one. ``dropped_bad``: a forward the loop
        dropped before backward had a NaN/inf output (its loss never reached backward):
        flagged as a bad step, and as a bad loss."""
        if loss_bad is not None:
            self.losses.append(StepFlag(step, loss_bad))
        if dropped_bad is not None:
            self.losses.append(StepFlag(step, dropped_bad, dropped=True))
        self._check_awaited()
        if self._stepped:
            flags, self._stepped = self._stepped, []
        else:
            grads = [g for p in self.watched_params() if (g := p.grad) is not None]
            with own_ops:
                flags = norm_sums(grads)
        self.grads.extend(StepFlag(step, f) for f in flags)
        if dropped_bad is not None:
            with own_ops:
                self.grads.append(StepFlag(step, torch.where(dropped_bad, math.inf, 0.0).double(),
                                           dropped=True))
        self.light_steps += 1

    def take(self) -> tuple[list[RootCall], list[StepFlag], list[StepFlag], list[StepFlag]]:
        """(root calls, gradient flags, weight flags, loss flags) so far; the next ones
        start empty."""
        out = (self.calls, self.grads, self.weights, self.losses)
        self.calls, self.grads, self.weights, self.losses = [], [], [], []
        self.light_steps = 0
        return out

    def clear(self) -> None:
        """Drop every tensor and model reference."""
        self.take()
        self._stepped = []
        self._awaited = []
        self._params = None
        self._roots = {}

