"""Every layer's figures over the whole run: constant size per layer, one update per step.

The run-long aggregates behind each :class:`~amp_doctor.records.LayerSummary`
(extremes, least headroom, mean fractions, non-finite step counts) are a few
host arrays with one row per layer. A recorded step updates them all with a
handful of whole-table ops over its :class:`~amp_doctor.steps.table.StepTable`,
whatever the number of layers (an update object per layer cost about 5 us a layer:
3 ms a recorded step on the benchmark GPT). Host data only, in numpy: on a step's
few hundred rows each op costs about a microsecond, a torch op several (0.34 ms a
recorded transformer step in torch).

A figure that is NaN in a step (an absent tensor, an all-NaN output's headroom)
is left out of that figure's mean and extremes, as if the step had not had it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from amp_doctor.dtypes import LOW_PRECISION_NAMES
from amp_doctor.records import LayerHeatmaps, LayerSummary
from amp_doctor.steps.amaxes import AmaxTracks
from amp_doctor.steps.heatmaps import HeatmapTrack
from amp_doctor.steps.table import (
    ABSMAX,
    ACT,
    GRAD,
    GRAD_U,
    HEAD,
    MAX,
    MIN,
    NONFINITE,
    NUMEL,
    OVER,
    PG,
    PG_U,
    TS_FIELDS,
    UNDER,
    ZERO,
    StepTable,
)

__all__ = ["LayerAggregates"]

_W = len(TS_FIELDS)
# A step's figures read, as (slot, field): the slots' unscaled views fall back to the
# scaled slot where the step had no loss scale (see StepTable.filled).
_MEANS = ((ACT, ZERO), (ACT, UNDER), (GRAD, ZERO), (GRAD, UNDER), (GRAD_U, UNDER),
          (PG, ZERO), (PG, UNDER), (PG_U, UNDER))
M_ZERO, M_UNDER, M_GZERO, M_GUNDER, M_GUNDER_U, M_PZERO, M_PUNDER, M_PUNDER_U = range(len(_MEANS))
# Greatest values: the outputs' absmax starts at 0 (an all-NaN layer reports 0, as its
# histogram does); the gradients' absmax counts finite values only (an inf gradient is
# a skipped step, not a range).
_HIS = ((ACT, ABSMAX), (ACT, MAX), (ACT, OVER), (GRAD, ABSMAX), (PG_U, ABSMAX))
H_ABSMAX, H_MAX, H_OVER, H_GABS, H_PABS = range(len(_HIS))
_HI_START = (0.0, -math.inf, -math.inf, -math.inf, -math.inf)
_FINITE_ONLY = slice(H_GABS, H_PABS + 1)
# Least values (kept negated, so that one maximum updates every extreme).
_LOS = ((ACT, MIN), (ACT, HEAD), (GRAD, HEAD))
L_MIN, L_HEAD, L_GHEAD = range(len(_LOS))
# Steps with a non-finite output / gradient / parameter gradient.
_NFS = ((ACT, NONFINITE), (GRAD, NONFINITE), (PG, NONFINITE))
# Extremes (columns of the greatest and negated least block) that a tensor holding a NaN
# only bounds: the outputs' and their gradients' absmax and headroom; with the (min, max)
# columns of their slot, which are NaN in such a step.
_ESTIMATED = np.array([H_ABSMAX, len(_HIS) + L_HEAD, H_GABS, len(_HIS) + L_GHEAD])
_EST_SLOT_COLS = np.array([[s * _W + MIN, s * _W + MAX] for s in (ACT, ACT, GRAD, GRAD)])
# An exact figure of theirs is above this: a non-zero absmax (an all-zero step's 0 beside
# a NaN step's bound would read as "absmax 0" with the bound's headroom), a headroom.
_EXACT_ABOVE = np.array([0.0, -math.inf, 0.0, -math.inf])
_COLS = np.array([s * _W + f for s, f in (*_MEANS, *_HIS, *_LOS, *_NFS)])
_SPLIT_AT = np.cumsum((len(_MEANS), len(_HIS), len(_LOS)))
# The summed block: the means' sums and counts, the non-finite step counts, steps with
# a gradient headroom, steps seen, steps whose output's only non-finite values were -inf.
_N_SUMS = 2 * len(_MEANS) + len(_NFS) + 3
C_COUNTS, C_NONFIN = len(_MEANS), 2 * len(_MEANS)
C_GNONFIN, C_PNONFIN = C_NONFIN + 1, C_NONFIN + 2
C_GHEAD, C_STEPS = C_NONFIN + len(_NFS), C_NONFIN + len(_NFS) + 1
C_NEGINF = C_STEPS + 1
_EXT_START = (*_HI_START, *([-math.inf] * len(_LOS)))

# One layer's aggregates, by LayerSummary field name.
LayerFigures = dict[str, Any]


class LayerAggregates:
    """Run-long per-layer aggregates, one row per layer seen."""

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._sums = np.zeros((0, _N_SUMS))
        self._ext = np.zeros((0, len(_EXT_START)))  # greatest, -least
        # Per layer: the sum and count of its output's relative range, over the steps its
        # output kept one sign (see add).
        self._rel = np.zeros((0, 2))
        # The extremes of _ESTIMATED from steps whose tensor held a NaN, and how many steps
        # gave an exact one (see add).
        self._est = np.zeros((0, len(_ESTIMATED)))
        self._exact = np.zeros((0, len(_ESTIMATED)), dtype=np.int64)
        # Per layer: its first recorded step with an output beyond its format (-1: none).
        self._first_over = np.zeros(0, dtype=np.int64)
        self._amaxes = AmaxTracks()
        self._heatmaps = HeatmapTrack()
        self._step = -1
        self._origin_steps: dict[str, int] = {}
        self._cache: dict[str, LayerFigures] | None = None

    def __contains__(self, name: object) -> bool:
        return name in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def add(self, table: StepTable, step: int | None = None) -> None:
        """Fold one recorded step's figures in: about twenty whole-table ops, no
        per-layer Python beyond finding each layer's row. ``step``: its number (default:
        one more than the last), for the amaxes' windows."""
        self._step = step if step is not None else self._step + 1
        n = len(table)
        if not n:
            return
        self._cache = None
        # A layer is in a step's table once: each row of ``idx`` is a distinct layer, so
        # fancy-indexed ``+=`` adds every value (as index_add would, in the same order).
        idx = np.asarray(self._rows(table.names))
        filled = table.filled().view(n, -1).numpy()
        got = filled[:, _COLS]
        means, hi, lo, nonfinite = np.split(got, _SPLIT_AT, axis=1)
        seen = means == means  # not NaN
        g_head = lo[:, L_GHEAD : L_GHEAD + 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            # min and max are NaN when the output held a NaN (aminmax propagates it).
            neg_inf = ((lo[:, L_MIN : L_MIN + 1] == -math.inf)
                       & (hi[:, H_MAX : H_MAX + 1] < math.inf))
            self._sums[idx] += np.concatenate([
                np.nan_to_num(means, nan=0.0), seen, nonfinite > 0, g_head == g_head,
                np.ones((n, 1)), neg_inf], axis=1)
            # The output's range relative to its size, (max - min) / absmax, in a step
            # where it kept one sign: how many of a format's steps it spans. An output on
            # a large offset (a regression head near 300) spans a few bfloat16 steps
            # (review 46b).
            mn, mx = filled[:, ACT * _W + MIN], filled[:, ACT * _W + MAX]
            # A constant output of several values counts (rounded to one value: range 0).
            one_sign = (((mn > 0) | (mx < 0)) & np.isfinite(mn) & np.isfinite(mx)
                        & (filled[:, ACT * _W + NUMEL] > 1))
            rel = np.where(one_sign, (mx - mn) / np.maximum(np.abs(mn), np.abs(mx)), 0.0)
        self._rel[idx] += np.stack([rel, one_sign], axis=1)
        ext = np.concatenate([hi, -lo], axis=1)
        fin = ext[:, _FINITE_ONLY]
        fin[np.isinf(fin)] = math.nan
        # NaN: not a candidate.
        np.nan_to_num(ext, copy=False, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        # A tensor that held a NaN has no exact extremes (aminmax propagates NaN): its
        # absmax, and the headroom from it, are its histogram's top bin's upper edge, up to
        # twice the finite values' (review 59a: 4.0 for outputs up to 2.42, shown as the
        # layer's absmax). Kept apart: they stand only for a layer with no exact one.
        slots = filled[:, _EST_SLOT_COLS]
        est_rows = np.isnan(slots[:, :, 0]) | np.isnan(slots[:, :, 1])  # [n, estimated]
        est = np.where(est_rows, ext[:, _ESTIMATED], -math.inf)
        ext[:, _ESTIMATED] = np.where(est_rows, -math.inf, ext[:, _ESTIMATED])
        self._ext[idx] = np.maximum(self._ext[idx], ext)
        self._amaxes.add(idx, filled, self._step)
        self._heatmaps.add(idx, filled, self._step)
        self._est[idx] = np.maximum(self._est[idx], est)
        self._exact[idx] += ~est_rows & (ext[:, _ESTIMATED] > _EXACT_ABOVE)
        over = (hi[:, H_OVER] > 0) | (nonfinite[:, 0] > 0)
        first = idx[over & (self._first_over[idx] < 0)]
        self._first_over[first] = self._step

    def note_origin(self, name: str) -> None:
        """``name`` was the first layer to overflow in a recorded step's forward."""
        self._cache = None
        self._origin_steps[name] = self._origin_steps.get(name, 0) + 1

    def _rows(self, names: Iterable[str]) -> list[int]:
        slot = self._slot
        rows = [slot.setdefault(n, len(slot)) for n in names]
        n = self._sums.shape[0]
        if len(slot) > n:
            grow = max(len(slot), 2 * n) - n
            self._sums = np.concatenate([self._sums, np.zeros((grow, _N_SUMS))])
            self._ext = np.concatenate([self._ext, np.array([_EXT_START] * grow)])
            self._rel = np.concatenate([self._rel, np.zeros((grow, 2))])
            self._est = np.concatenate([self._est, np.full((grow, len(_ESTIMATED)), -math.inf)])
            self._exact = np.concatenate([self._exact, np.zeros((grow, len(_ESTIMATED)),
                                                                dtype=np.int64)])
            self._first_over = np.concatenate([self._first_over,
                                               np.full(grow, -1, dtype=np.int64)])
            self._amaxes.grow(self._sums.shape[0])
            self._heatmaps.grow(self._sums.shape[0])
        return rows

    def heatmaps(self) -> LayerHeatmaps | None:
        """Every layer's heatmap cells (None: nothing recorded)."""
        return self._heatmaps.export(self._slot)

    def figures(self, name: str) -> LayerFigures | None:
        """The layer's aggregates as :class:`LayerSummary` fields (None: never recorded)."""
        if self._cache is None:
            self._cache = self._all()
        return self._cache.get(name)

    def _all(self) -> dict[str, LayerFigures]:
        n = len(self._slot)
        ext = self._ext[:n].copy()
        # A layer whose every such figure came from a step with a NaN: the estimate.
        ext[:, _ESTIMATED] = np.where(self._exact[:n] > 0, ext[:, _ESTIMATED],
                                      np.maximum(ext[:, _ESTIMATED], self._est[:n]))
        sums, exts = self._sums[:n].tolist(), ext.tolist()
        rels = self._rel[:n].tolist()
        firsts = self._first_over[:n].tolist()
        out: dict[str, LayerFigures] = {}
        for name, i in self._slot.items():
            s, hi = sums[i], exts[i]
            lo = [-v for v in hi[len(_HIS):]]

            def mean(col: int, s: list[float] = s) -> float | None:
                return s[col] / s[C_COUNTS + col] if s[C_COUNTS + col] else None

            def top(col: int, hi: list[float] = hi) -> float | None:
                return max(hi[col], 0.0) if hi[col] > -math.inf else None

            steps = int(s[C_STEPS])
            # The steps it ran in: those with an output. A layer that got no input in a
            # step (an MoE expert no token chose) files no output, only its weights' zero
            # gradients, and "non-finite in 3 of 16 recorded steps" would undercount.
            ran = int(s[C_COUNTS + M_ZERO])
            out[name] = dict(
                recorded_steps=ran or steps,
                absmax=hi[H_ABSMAX],
                min=lo[L_MIN] if steps else math.nan,
                max=hi[H_MAX] if steps else math.nan,
                headroom=lo[L_HEAD],
                zero_frac=mean(M_ZERO) or 0.0,
                overflow_frac=max(hi[H_OVER], 0.0),
                underflow_frac=mean(M_UNDER) or 0.0,
                nonfinite_steps=int(s[C_NONFIN]),
                neg_inf_steps=int(s[C_NEGINF]),
                overflow_origin_steps=self._origin_steps.get(name, 0),
                grad_absmax=top(H_GABS),
                grad_headroom=lo[L_GHEAD] if s[C_GHEAD] else None,
                grad_zero_frac=mean(M_GZERO),
                grad_underflow_frac=mean(M_GUNDER),
                grad_underflow_frac_unscaled=mean(M_GUNDER_U),
                grad_nonfinite_steps=int(s[C_GNONFIN]),
                param_grad_absmax=top(H_PABS),
                param_grad_zero_frac=mean(M_PZERO),
                param_grad_underflow_frac=mean(M_PUNDER),
                param_grad_underflow_frac_unscaled=mean(M_PUNDER_U),
                param_grad_nonfinite_steps=int(s[C_PNONFIN]),
                # Only when every step it ran in kept one sign: else some step spread it.
                range_rel=(rels[i][0] / rels[i][1] if rels[i][1] and rels[i][1] >= (ran or steps)
                           else None),
                first_overflow_step=firsts[i] if firsts[i] >= 0 else None,
                **self._amaxes.figures(i),
            )
        return out

    def summary(self, name: str, meta_type: str, order: int, calls: int,
                input_dtypes: set[str], output_dtypes: set[str], param_dtypes: set[str],
                ops: dict[str, dict[str, int]], hists: tuple[list[int], list[int]],
                passthrough: bool = False, model_output: bool = False,
                consumers: list[str] | None = None, inputs_known: bool = False
                ) -> LayerSummary:
        """The layer's :class:`LayerSummary`: its aggregates and what the hooks saw."""
        figs = self.figures(name) or _NEVER
        ran_low = bool(output_dtypes & LOW_PRECISION_NAMES)
        floats = {d for d in output_dtypes if d.startswith(("float", "bfloat"))}
        return LayerSummary(
            name=name, type=meta_type, order=order, calls=calls,
            input_dtypes=sorted(input_dtypes), output_dtypes=sorted(output_dtypes),
            param_dtypes=sorted(param_dtypes), ran_low_precision=ran_low,
            what_if=bool(floats) and not ran_low, passthrough=passthrough,
            model_output=model_output, consumers=list(consumers or ()),
            inputs_known=inputs_known, ops=ops,
            # Sampled tensors give scaled, fractional counts.
            act_exp_hist=hists[0], grad_exp_hist=hists[1],
            **figs,
        )

    def rename(self, mapping: dict[str, str]) -> None:
        """Layers were renamed (a second model prefixes the first's names)."""
        self._cache = None
        self._slot = {mapping.get(k, k): v for k, v in self._slot.items()}
        self._origin_steps = {mapping.get(k, k): v for k, v in self._origin_steps.items()}


# A layer that ran but was never recorded (only unrecorded steps, or no tensor filed).
_NEVER: LayerFigures = dict(
    recorded_steps=0, absmax=0.0, min=math.nan, max=math.nan, headroom=math.inf,
    zero_frac=0.0, overflow_frac=0.0, underflow_frac=0.0, nonfinite_steps=0,
    overflow_origin_steps=0, grad_absmax=None, grad_headroom=None, grad_zero_frac=None,
    grad_underflow_frac=None, grad_underflow_frac_unscaled=None, grad_nonfinite_steps=0,
    param_grad_absmax=None, param_grad_zero_frac=None, param_grad_underflow_frac=None,
    param_grad_underflow_frac_unscaled=None, param_grad_nonfinite_steps=0, range_rel=None,
)
