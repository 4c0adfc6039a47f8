"""Every layer's heatmap cells over the run: bounded columns, each the worst of its steps.

The step history keeps each step's :data:`~amp_doctor.steps.history.HISTORY_LAYERS` worst
layers, so on a model with more layers the heatmaps drawn from it were mostly grey: on
the 524-layer benchmark GPT a healthy block's row showed one coloured cell in twenty.
Here every layer of every recorded step is folded in, a few whole-table numpy ops per
step. At most :data:`HEATMAP_COLUMNS` columns: when they are full, neighbouring columns
are merged (the worst of the two, as the heatmap itself merges columns too narrow to
draw), so the heatmaps still span the whole run. Host data only.
"""

from __future__ import annotations

import base64
import math

import numpy as np

from amp_doctor.records import HEATMAP_FIGURES, LayerHeatmaps
from amp_doctor.steps.table import (
    ABSMAX,
    ACT,
    GRAD,
    HEAD,
    NONFINITE,
    NUMEL,
    OVER,
    TS_FIELDS,
    UNDER,
    ZERO,
)

__all__ = ["HeatmapTrack", "HEATMAP_COLUMNS", "decode_cells", "MISSING", "INF_HEADROOM",
           "ACT_NONFINITE", "ACT_OVERFLOW", "GRAD_NONFINITE", "GRAD_OVERFLOW"]

# Columns kept: a heatmap draws at most about 200 (two pixels each in its 400-pixel plot).
# Even, so that halving leaves the last column full. Held as float16 (finer than what is
# drawn, or written: see LayerHeatmaps), 2.8 KB a layer: 1.7 MB for the 605 of a GPT.
HEATMAP_COLUMNS = 256
assert HEATMAP_COLUMNS % 2 == 0

_W = len(TS_FIELDS)
_F = len(HEATMAP_FIGURES)
# Per figure (HEATMAP_FIGURES' order): its table column. A headroom's worst is its least,
# a share's its greatest.
_SOURCES = ((ACT, HEAD), (ACT, UNDER), (GRAD, HEAD), (GRAD, UNDER), (GRAD, ZERO))
_IS_HEAD = np.array([fld == HEAD for _, fld in _SOURCES])
# The flag byte's bits.
ACT_NONFINITE, ACT_OVERFLOW, GRAD_NONFINITE, GRAD_OVERFLOW = 1, 2, 4, 8
# The encoded bytes: no tensor; +inf headroom (an all-zero tensor, as safe as it gets).
MISSING = 255
INF_HEADROOM = 254
_HEAD_QUANT = 4  # quarter bits: 0 to 63 bits, far finer than the colour ramp
_SHARE_QUANT = 250


class HeatmapTrack:
    """Per layer (rows as :class:`~amp_doctor.steps.aggregates.LayerAggregates` numbers
    them), the heatmap figures of up to :data:`HEATMAP_COLUMNS` columns of steps."""

    def __init__(self, columns: int = HEATMAP_COLUMNS) -> None:
        self._cap = columns
        # NaN: no such tensor in the column's steps.
        self._vals = np.full((0, columns, _F), math.nan, dtype=np.float16)
        self._flags = np.zeros((0, columns), dtype=np.uint8)
        self.steps: list[int] = []  # each column's first step
        self.span = 1  # recorded steps a full column holds
        self._in_last = 0

    def grow(self, n: int) -> None:
        """Room for ``n`` rows (layers) in all."""
        add = n - self._vals.shape[0]
        if add > 0:
            self._vals = np.concatenate(
                [self._vals, np.full((add, self._cap, _F), math.nan, dtype=np.float16)])
            self._flags = np.concatenate(
                [self._flags, np.zeros((add, self._cap), dtype=np.uint8)])

    def add(self, idx: np.ndarray, filled: np.ndarray, step: int) -> None:
        """Fold in one recorded step: ``filled`` is its table's ``[n, slots * fields]``
        figures (:meth:`StepTable.filled`), row ``i`` the layer of row ``idx[i]``."""
        if not self.steps or self._in_last >= self.span:
            if len(self.steps) == self._cap:
                self._halve()
            self.steps.append(step)
            self._in_last = 0
        c = len(self.steps) - 1
        vals = np.empty((len(idx), _F), dtype=np.float64)
        with np.errstate(invalid="ignore"):
            for k, (slot, fld) in enumerate(_SOURCES):
                numel = filled[:, slot * _W + NUMEL]
                v = filled[:, slot * _W + fld]
                if fld == HEAD:
                    # An all-NaN output's headroom is NaN: none left, as the history's cells.
                    v = np.where(np.isnan(v) | (v == -math.inf), 0.0, v)
                else:
                    v = np.nan_to_num(v, nan=0.0)
                vals[:, k] = np.where(numel > 0, v, math.nan)  # NaN > 0 is False: absent
            flags = np.zeros(len(idx), dtype=np.uint8)
            for slot, bad, over in ((ACT, ACT_NONFINITE, ACT_OVERFLOW),
                                    (GRAD, GRAD_NONFINITE, GRAD_OVERFLOW)):
                present = filled[:, slot * _W + NUMEL] > 0
                nonfinite = present & ((filled[:, slot * _W + NONFINITE] > 0)
                                       | ~np.isfinite(filled[:, slot * _W + ABSMAX]))
                flags |= np.where(nonfinite, bad, 0).astype(np.uint8)
                flags |= np.where(present & (filled[:, slot * _W + OVER] > 0), over,
                                  0).astype(np.uint8)
        col = self._vals[idx, c]
        # fmin/fmax skip a NaN: a layer absent from one of the column's steps shows the rest.
        self._vals[idx, c] = np.where(_IS_HEAD, np.fmin(col, vals), np.fmax(col, vals))
        self._flags[idx, c] |= flags
        self._in_last += 1

    def _halve(self) -> None:
        """Merge neighbouring columns: half as many, each the worst of twice the steps."""
        a, b = self._vals[:, 0::2], self._vals[:, 1::2]
        half = np.where(_IS_HEAD, np.fmin(a, b), np.fmax(a, b))
        self._vals = np.concatenate([half, np.full_like(half, math.nan)], axis=1)
        flags = self._flags[:, 0::2] | self._flags[:, 1::2]
        self._flags = np.concatenate([flags, np.zeros_like(flags)], axis=1)
        self.steps = self.steps[0::2]
        self.span *= 2
        self._in_last = self.span  # the last merged column is full

    def export(self, rows: dict[str, int]) -> LayerHeatmaps | None:
        """The record of the layers ``rows`` (name -> row), quantized (see
        :class:`~amp_doctor.records.LayerHeatmaps`); None before any recorded step."""
        if not self.steps or not rows:
            return None
        names = list(rows)
        at = np.array([rows[n] for n in names], dtype=np.int64)
        cols = len(self.steps)
        v = self._vals[at, :cols].astype(np.float64)
        q = np.full(v.shape, MISSING, dtype=np.uint8)
        head = v[..., _IS_HEAD]
        share = v[..., ~_IS_HEAD]
        with np.errstate(invalid="ignore"):
            hq = np.where(head == math.inf, INF_HEADROOM,
                          np.clip(np.round(np.maximum(head, 0.0) * _HEAD_QUANT), 0,
                                  INF_HEADROOM - 1))
            sq = np.clip(np.round(share * _SHARE_QUANT), 0, _SHARE_QUANT)
        q[..., _IS_HEAD] = np.where(np.isnan(head), MISSING, np.nan_to_num(hq)).astype(np.uint8)
        q[..., ~_IS_HEAD] = np.where(np.isnan(share), MISSING, np.nan_to_num(sq)).astype(
            np.uint8)
        cells = np.concatenate([q, self._flags[at, :cols, None]], axis=2)
        return LayerHeatmaps(layers=names, steps=list(self.steps), span=self.span,
                             cells=base64.b64encode(cells.tobytes()).decode("ascii"))


def decode_cells(h: LayerHeatmaps) -> tuple[np.ndarray, np.ndarray]:
    """``h``'s cells as ``[layers, columns, figures]`` float64 (NaN: no such tensor; inf:
    the headroom of an all-zero tensor) and ``[layers, columns]`` flag bytes."""
    raw = np.frombuffer(base64.b64decode(h.cells, validate=True), dtype=np.uint8)
    shape = (len(h.layers), len(h.steps), _F + 1)
    if raw.size != math.prod(shape):
        raise ValueError(f"heatmaps.cells holds {raw.size} bytes, not {math.prod(shape)} "
                         f"({shape[0]} layers x {shape[1]} columns x {shape[2]})")
    cells = raw.reshape(shape)
    q = cells[..., :_F].astype(np.float64)
    vals = np.where(_IS_HEAD, q / _HEAD_QUANT, q / _SHARE_QUANT)
    vals[..., _IS_HEAD] = np.where(q[..., _IS_HEAD] == INF_HEADROOM, math.inf,
                                   vals[..., _IS_HEAD])
    vals[q == MISSING] = math.nan
    return vals, cells[..., _F].copy()
