"""'Worst first': the order of layers in the text report and TensorBoard's top-k.

One ordering, so the report's table, its grouped findings and the dashboards'
``headroom/*`` scalars all name the same layers first.
"""

from __future__ import annotations

import math

from amp_doctor.analysis.thresholds import RISK_HEADROOM_BITS
from amp_doctor.records import LayerSummary

__all__ = ["risk_order"]


def risk_order(layers: list[LayerSummary]) -> list[LayerSummary]:
    """Worst layers first: the order of the text report and TensorBoard's top-k.

    Non-finite outputs or gradients (the layers where they began first), then outputs
    beyond the format's max, then
    the layers closest to the max (within ``RISK_HEADROOM_BITS``, least headroom
    first), then underflow (largest share first), then the remaining headroom.
    """

    def key(lay: LayerSummary) -> tuple[float, ...]:
        nonfinite = lay.nonfinite_steps + lay.grad_nonfinite_steps + lay.param_grad_nonfinite_steps
        head = lay.headroom if not math.isnan(lay.headroom) else math.inf
        gu = max(v for v in (lay.grad_underflow_frac, lay.param_grad_underflow_frac, 0.0)
                 if v is not None)
        close = head < RISK_HEADROOM_BITS
        return (
            -float(nonfinite > 0),
            # Of those, the layers whose output went non-finite first in a step: where it
            # began, before the layers that carried it on (review 61a: the origin 8th).
            -float(lay.overflow_origin_steps > 0),
            -float(lay.ran_low_precision and lay.overflow_frac > 0),
            0.0 if close else 1.0,
            head if close else -max(lay.underflow_frac, gu),
            head,
            lay.order,
        )

    return sorted(layers, key=key)
