"""How amp-doctor prints numbers: the one place the reports and dashboards format them.

Every sink (text, markdown, TensorBoard) and the analysis messages print numbers
through these functions, so a share reads the same everywhere: ``"<0.001%"``, not
``"4.9e-15%"``, and a loss scale reads ``65536``, not ``6.55e+04``.
"""

from __future__ import annotations

import math

__all__ = [
    "num",
    "pct",
    "scale",
    "bits",
    "limit",
    "MISSING",
    "PCT_FLOOR",
    "SCI_HIGH",
    "SCI_LOW",
]

# Printed for "no data".
MISSING = "-"
# Shares below this many percent print as "<0.001%": more digits are noise to a reader,
# and a rounded "0%" would hide that something did go wrong.
PCT_FLOOR = 0.001
# Plain numbers outside [SCI_LOW, SCI_HIGH) switch to scientific notation.
SCI_HIGH = 1e5
SCI_LOW = 1e-3


def _nonfinite(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    return "inf" if x > 0 else "-inf"


def num(x: float | None, digits: int = 3) -> str:
    """A measured value (absmax, a norm, an eps) in ``digits`` significant digits."""
    if x is None:
        return MISSING
    if not math.isfinite(x):
        return _nonfinite(x)
    if x != 0 and (abs(x) >= SCI_HIGH or abs(x) < SCI_LOW):
        return f"{x:.{max(digits - 1, 0)}e}"
    return f"{x:.{digits}g}"


def pct(x: float | None) -> str:
    """A share in [0, 1] as a percentage a person reads at a glance.

    Exact 0 and 1 print as ``0%`` and ``100%``; a share that is not exactly 0 never
    rounds to ``0%`` (``<0.001%``), and one that is not exactly 1 never rounds to
    ``100%`` (``>99.9%``).
    """
    if x is None:
        return MISSING
    if not math.isfinite(x):
        return _nonfinite(x)
    if x == 0:
        return "0%"
    if x == 1:
        return "100%"
    p = 100.0 * x
    if 0 < p < PCT_FLOOR:
        return f"<{PCT_FLOOR:g}%"
    if 99.9 < p < 100:
        return ">99.9%"
    if abs(p) < 1:
        return f"{p:.2g}%"
    return f"{p:.3g}%"


def scale(x: float | None) -> str:
    """A loss scale: powers of two print whole (``65536``), however large or small."""
    if x is None:
        return MISSING
    if not math.isfinite(x):
        return _nonfinite(x)
    if x != 0 and abs(x) < SCI_LOW:
        m, e = math.frexp(x)
        if m == 0.5:
            return f"2^{e - 1}"
    return f"{x:.7g}"


def bits(x: float | None, digits: int = 2) -> str:
    """A headroom or exponent in bits (``log2``), with its sign."""
    if x is None:
        return MISSING
    if not math.isfinite(x):
        return _nonfinite(x)
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"


def limit(x: float) -> str:
    """A format's limit, as people know it: ``65504``, ``6.10352e-05``, ``3.38953e+38``."""
    return f"{x:.6g}" if math.isfinite(x) else _nonfinite(x)
