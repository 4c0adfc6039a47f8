"""Names of aten ops that both the recording (anomaly mode) and the analysis single out.

Torch-free, so that the analysis (``amp-doctor report``) reads them without importing
torch.
"""

from __future__ import annotations

__all__ = ["DIVISION_OPS"]

# Ops whose second input divides the first: anomaly mode keeps each input's range for
# them (a denominator of exactly 0 is told from a value grown past the format's max).
DIVISION_OPS: tuple[str, ...] = ("aten.div", "aten.div_", "aten.true_divide")
