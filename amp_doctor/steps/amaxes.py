"""Every layer's amax over the run, as FP8 delayed scaling would follow it.

Per layer and tensor (its output, its output gradient as if unscaled), over the recorded
steps whose tensor was finite: how many had a non-zero amax, its spread in bits, and how
often a step's amax outran the scale that delayed scaling (TransformerEngine's: the
largest amax of the last :data:`FP8_AMAX_WINDOW` steps) would have set for it by more
than :data:`AMAX_OUTRUN_FACTOR`. Every layer of every recorded step is folded in: the
step history keeps only each step's worst layers (review 59a: a T5's FP8 table showed
"-" and "0/1" for layers recorded every step). Constant size per layer (a window of
amaxes), a few whole-table numpy ops per step. Host data only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from amp_doctor.records import AMAX_OUTRUN_FACTOR, FP8_AMAX_WINDOW
from amp_doctor.steps.table import ABSMAX, ACT, GRAD, GRAD_U, MAX, MIN, TS_FIELDS

__all__ = ["AmaxTracks"]

_W = len(TS_FIELDS)
# The tensors followed: a layer's output, and its output gradient as FP8 training would
# hold it (unscaled; filled() gives the scaled one where the step had no scale).
_TRACKED = (ACT, GRAD_U)
# Their amax as the step ran it (the output's; the gradient as scaled), for the count of
# steps that had one.
_AS_RUN = (ACT, GRAD)
_NEVER = -1e18  # a step long before any window


class AmaxTracks:
    """Per layer, rows as :class:`~amp_doctor.steps.aggregates.LayerAggregates` numbers
    them: the amax figures of its outputs and output gradients."""

    def __init__(self) -> None:
        k = len(_TRACKED)
        self._steps = np.zeros((0, k), dtype=np.int64)  # recorded steps with an amax
        self._own = np.zeros((0, k), dtype=np.int64)  # ... of the tensor followed
        self._run_hi = np.zeros((0, k))  # the largest amax as the step ran it
        self._beyond = np.zeros((0, k), dtype=np.int64)
        self._compared = np.zeros((0, k), dtype=np.int64)
        self._lo = np.zeros((0, k))
        self._hi = np.zeros((0, k))
        self._last = np.zeros((0, k))  # the last step with an amax
        self._win_step = np.zeros((0, k, FP8_AMAX_WINDOW))
        self._win_amax = np.zeros((0, k, FP8_AMAX_WINDOW))

    def grow(self, n: int) -> None:
        """Room for ``n`` rows (layers) in all."""
        add = n - self._steps.shape[0]
        if add <= 0:
            return
        k = len(_TRACKED)

        def more(a: np.ndarray, fill: float) -> np.ndarray:
            return np.concatenate([a, np.full((add, *a.shape[1:]), fill, dtype=a.dtype)])

        self._steps, self._beyond = more(self._steps, 0), more(self._beyond, 0)
        self._own = more(self._own, 0)
        self._run_hi = more(self._run_hi, -math.inf)
        self._compared = more(self._compared, 0)
        self._lo, self._hi = more(self._lo, math.inf), more(self._hi, -math.inf)
        self._last = more(self._last, _NEVER)
        self._win_step = more(self._win_step, _NEVER)
        self._win_amax = more(self._win_amax, 0.0)
        assert self._steps.shape[1] == k

    def add(self, idx: np.ndarray, filled: np.ndarray, step: int) -> None:
        """Fold in one recorded step: ``filled`` is its table's ``[n, slots * fields]``
        figures (:meth:`StepTable.filled`), row ``i`` the layer of row ``idx[i]``."""
        def of(slots: tuple[int, ...], fld: int) -> np.ndarray:
            return filled[:, [s * _W + fld for s in slots]]

        finite = np.isfinite(of(_TRACKED, MIN)) & np.isfinite(of(_TRACKED, MAX))
        amax = of(_TRACKED, ABSMAX)
        with np.errstate(invalid="ignore"):
            has = finite & (amax > 0)
            run = of(_AS_RUN, ABSMAX)
            ran = (np.isfinite(of(_AS_RUN, MIN)) & np.isfinite(of(_AS_RUN, MAX)) & (run > 0))
        self._steps[idx] += ran
        self._run_hi[idx] = np.where(ran, np.maximum(self._run_hi[idx], run), self._run_hi[idx])
        self._own[idx] += has
        # A step right after the last one with an amax: the delayed scale followed it.
        consecutive = has & (step - self._last[idx] == 1)
        win_step, win_amax = self._win_step[idx], self._win_amax[idx]
        in_window = win_step >= step - FP8_AMAX_WINDOW
        scale_amax = np.where(in_window, win_amax, 0.0).max(axis=2)
        self._compared[idx] += consecutive
        self._beyond[idx] += consecutive & (amax > AMAX_OUTRUN_FACTOR * scale_amax)
        self._lo[idx] = np.where(has, np.minimum(self._lo[idx], amax), self._lo[idx])
        self._hi[idx] = np.where(has, np.maximum(self._hi[idx], amax), self._hi[idx])
        self._last[idx] = np.where(has, step, self._last[idx])
        # The window slides by one entry where the step had an amax.
        keep = has[:, :, None]
        self._win_step[idx] = np.where(
            keep, np.concatenate([win_step[:, :, 1:], np.full_like(amax, step)[:, :, None]], 2),
            win_step)
        self._win_amax[idx] = np.where(
            keep, np.concatenate([win_amax[:, :, 1:], np.nan_to_num(amax)[:, :, None]], 2),
            win_amax)

    def figures(self, row: int) -> dict[str, Any]:
        """The row's :class:`~amp_doctor.records.LayerSummary` fields."""
        out: dict[str, Any] = {}
        for k, prefix in enumerate(("fp8_act", "fp8_grad")):
            lo, hi = float(self._lo[row, k]), float(self._hi[row, k])
            out[f"{prefix}_amax_steps"] = int(self._steps[row, k])
            out[f"{prefix}_amax_max"] = (float(self._run_hi[row, k]) if self._steps[row, k]
                                         else None)
            out[f"{prefix}_amax_spread_bits"] = (math.log2(hi / lo)
                                                 if self._own[row, k] >= 2 else None)
            out[f"{prefix}_amax_beyond"] = int(self._beyond[row, k])
            out[f"{prefix}_amax_compared"] = int(self._compared[row, k])
        return out

