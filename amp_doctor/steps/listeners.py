"""The public listener type: what a sink receives after each recorded step.

A listener is called as ``fn(record, rows)``: the step's
:class:`~amp_doctor.records.StepRecord` and its :class:`StepRows`, the host
copy of the step's per-layer summaries. Sinks depend on this module only, not
on how the recorder stores the copy. A leaf module (torch and records only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from amp_doctor.records import StepRecord

__all__ = ["StepRows", "StepListener"]


class StepRows(Protocol):
    """One recorded step on the host, as a listener sees it."""

    step: int
    scalars: dict[str, float]  # loss, scale, ... (host floats)

    # (layer, field) -> its row of ``block``: the tensor's own summary row, or the
    # merge of the field's calls. Every row at once, for whole-step sums.
    row_of: dict[tuple[str, str], int]
    block: torch.Tensor

    def merged(self, layer: str, fld: str) -> torch.Tensor | None:
        """The layer's summary row for ``fld`` ("act", "grad", "param_grad"), calls merged."""
        ...


# Called once per recorded step, after the step was folded.
StepListener = Callable[[StepRecord, StepRows], None]
