"""Every layer's figures over the whole run: constant size per layer, one update per step.

The run-long aggregates behind each :class:`~amp_doctor.records.LayerSummary`
(extremes, least headroom, mean fractions, non-finite step counts) are a few
host tensors with one row per layer. A recorded step updates them all with a
handful of tensor ops over its :class:`~amp_doctor.steps.table.StepTable`,
whatever the number of layers (per-layer Python cost about 5 us a layer, 3 ms a
step on the benchmark GPT). Host data only.

A figure that is NaN in a step (an absent tensor, an all-NaN output's headroom)
is left out of that figure's mean and extremes, as if the step had not had it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from amp_doctor.dtypes import LOW_PRECISION_NAMES
from amp_doctor.records import LayerSummary
from amp_doctor.steps.table import (
    ABSMAX,
    ACT,
    GRAD,
    HEAD,
    MAX,
    MIN,
    NONFINITE,
    OVER,
    PG,
    UNDER,
    ZERO,
    StepTable,
)

__all__ = ["LayerAggregates"]

_F64 = torch.float64
# Mean columns: (slot, field, the slot's unscaled view).
_MEANS = (
    (ACT, ZERO, False), (ACT, UNDER, False),
    (GRAD, ZERO, False), (GRAD, UNDER, False), (GRAD, UNDER, True),
    (PG, ZERO, False), (PG, UNDER, False), (PG, UNDER, True),
)
M_ZERO, M_UNDER, M_GZERO, M_GUNDER, M_GUNDER_U, M_PZERO, M_PUNDER, M_PUNDER_U = range(len(_MEANS))
# Greatest-value columns and their starting values: the outputs' absmax starts at 0
# (an all-NaN layer reports 0, as its histogram does); the gradients' absmax only
# counts finite values (an inf gradient is a skipped step, not a range).
H_ABSMAX, H_MAX, H_OVER, H_GABS, H_PABS = range(5)
_HI_START = (0.0, -math.inf, -math.inf, -math.inf, -math.inf)
# Least-value columns.
L_MIN, L_HEAD, L_GHEAD = range(3)
# Counted columns: steps seen, steps with a non-finite output / gradient / parameter
# gradient, steps with a gradient headroom.
T_STEPS, T_NONFIN, T_GNONFIN, T_PNONFIN, T_GHEAD = range(5)


# One layer's aggregates, by LayerSummary field name.
LayerFigures = dict[str, Any]


class LayerAggregates:
    """Run-long per-layer aggregates, one row per layer seen."""

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._sums = torch.zeros(0, len(_MEANS), dtype=_F64)
        self._counts = torch.zeros(0, len(_MEANS), dtype=_F64)
        self._hi = torch.zeros(0, len(_HI_START), dtype=_F64)
        self._lo = torch.zeros(0, 3, dtype=_F64)
        self._tally = torch.zeros(0, 5, dtype=torch.int64)
        self._origin_steps: dict[str, int] = {}
        self._cache: dict[str, LayerFigures] | None = None

    def __contains__(self, name: object) -> bool:
        return name in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def add(self, table: StepTable) -> None:
        """Fold one recorded step's figures in: whole-table ops, no per-layer Python
        beyond finding each layer's row."""
        if not len(table):
            return
        self._cache = None
        idx = torch.tensor(self._rows(table.names))
        v = table.data
        act, grad, pg = v[:, ACT], v[:, GRAD], v[:, PG]
        unscaled = {GRAD: table.unscaled(GRAD), PG: table.unscaled(PG)}
        means = torch.stack([unscaled[s][:, f] if u else v[:, s, f] for s, f, u in _MEANS], 1)
        seen = ~means.isnan()
        self._sums.index_add_(0, idx, torch.where(seen, means, 0.0))
        self._counts.index_add_(0, idx, seen.to(_F64))
        g_abs, p_abs = grad[:, ABSMAX], unscaled[PG][:, ABSMAX]
        hi = torch.stack([act[:, ABSMAX], act[:, MAX], act[:, OVER],
                          torch.where(g_abs.isfinite(), g_abs, math.nan),
                          torch.where(p_abs.isfinite(), p_abs, math.nan)], 1)
        self._hi[idx] = torch.maximum(self._hi[idx], torch.where(hi.isnan(), -math.inf, hi))
        lo = torch.stack([act[:, MIN], act[:, HEAD], grad[:, HEAD]], 1)
        self._lo[idx] = torch.minimum(self._lo[idx], torch.where(lo.isnan(), math.inf, lo))
        tally = torch.stack([torch.ones(len(table), dtype=torch.bool), act[:, NONFINITE] > 0,
                             grad[:, NONFINITE] > 0, pg[:, NONFINITE] > 0,
                             ~grad[:, HEAD].isnan()], 1)
        self._tally.index_add_(0, idx, tally.long())

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
            self._sums = torch.cat([self._sums, torch.zeros(grow, len(_MEANS), dtype=_F64)])
            self._counts = torch.cat([self._counts, torch.zeros(grow, len(_MEANS), dtype=_F64)])
            self._hi = torch.cat([self._hi, torch.tensor([_HI_START] * grow, dtype=_F64)])
            self._lo = torch.cat([self._lo, torch.full((grow, 3), math.inf, dtype=_F64)])
            self._tally = torch.cat([self._tally, torch.zeros(grow, 5, dtype=torch.int64)])
        return rows

    def figures(self, name: str) -> LayerFigures | None:
        """The layer's aggregates as :class:`LayerSummary` fields (None: never recorded)."""
        if self._cache is None:
            self._cache = self._all()
        return self._cache.get(name)

    def _all(self) -> dict[str, LayerFigures]:
        n = len(self._slot)
        sums, counts = self._sums[:n].tolist(), self._counts[:n].tolist()
        his, los, tallies = self._hi[:n].tolist(), self._lo[:n].tolist(), self._tally[:n].tolist()
        out: dict[str, LayerFigures] = {}
        for name, i in self._slot.items():
            s, c, hi, lo, t = sums[i], counts[i], his[i], los[i], tallies[i]

            def mean(col: int, s: list[float] = s, c: list[float] = c) -> float | None:
                return s[col] / c[col] if c[col] else None

            def top(col: int, hi: list[float] = hi) -> float | None:
                return max(hi[col], 0.0) if hi[col] > -math.inf else None

            steps = t[T_STEPS]
            out[name] = dict(
                recorded_steps=steps,
                absmax=hi[H_ABSMAX],
                min=lo[L_MIN] if steps else math.nan,
                max=hi[H_MAX] if steps else math.nan,
                headroom=lo[L_HEAD],
                zero_frac=mean(M_ZERO) or 0.0,
                overflow_frac=max(hi[H_OVER], 0.0),
                underflow_frac=mean(M_UNDER) or 0.0,
                nonfinite_steps=t[T_NONFIN],
                overflow_origin_steps=self._origin_steps.get(name, 0),
                grad_absmax=top(H_GABS),
                grad_headroom=lo[L_GHEAD] if t[T_GHEAD] else None,
                grad_zero_frac=mean(M_GZERO),
                grad_underflow_frac=mean(M_GUNDER),
                grad_underflow_frac_unscaled=mean(M_GUNDER_U),
                grad_nonfinite_steps=t[T_GNONFIN],
                param_grad_absmax=top(H_PABS),
                param_grad_zero_frac=mean(M_PZERO),
                param_grad_underflow_frac=mean(M_PUNDER),
                param_grad_underflow_frac_unscaled=mean(M_PUNDER_U),
                param_grad_nonfinite_steps=t[T_PNONFIN],
            )
        return out

    def summary(self, name: str, meta_type: str, order: int, calls: int,
                input_dtypes: set[str], output_dtypes: set[str], param_dtypes: set[str],
                ops: dict[str, dict[str, int]], hists: tuple[list[int], list[int]],
                passthrough: bool = False) -> LayerSummary:
        """The layer's :class:`LayerSummary`: its aggregates and what the hooks saw."""
        figs = self.figures(name) or _NEVER
        ran_low = bool(output_dtypes & LOW_PRECISION_NAMES)
        floats = {d for d in output_dtypes if d.startswith(("float", "bfloat"))}
        return LayerSummary(
            name=name, type=meta_type, order=order, calls=calls,
            input_dtypes=sorted(input_dtypes), output_dtypes=sorted(output_dtypes),
            param_dtypes=sorted(param_dtypes), ran_low_precision=ran_low,
            what_if=bool(floats) and not ran_low, passthrough=passthrough, ops=ops,
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
    param_grad_underflow_frac_unscaled=None, param_grad_nonfinite_steps=0,
)
