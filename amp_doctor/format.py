"""How amp-doctor prints numbers: the one place the reports and dashboards format them.

Every sink (text, markdown, TensorBoard) and the analysis messages print numbers
through these functions, so a share reads the same everywhere: ``"<0.001%"``, not
``"4.9e-15%"``, and a loss scale reads ``65536``, not ``6.55e+04``. Lists of steps
(``0, 1, 2, ... (40 in all)``) and runs of consecutive steps (one backoff episode)
are spelled here too, for the same reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol, TypeVar

__all__ = [
    "num",
    "pct",
    "scale",
    "bits",
    "limit",
    "times",
    "steps_list",
    "consecutive_runs",
    "error_line",
    "and_list",
    "counted",
    "layer",
    "ERROR_CHARS",
    "AtStep",
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
# An exception's message in a report is cut to its first line and this many characters:
# torch's dispatcher errors run to 8 KB and buried the findings (the traceback has it all).
ERROR_CHARS = 300
# Whole loss scales print in full up to here (2**39); beyond, scientific notation.
WHOLE_MAX = 1e12
# A list of steps names at most this many.
STEPS_SHOWN = 8


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


def scale(x: float | None, unknown: str | None = None) -> str:
    """A loss scale: powers of two print whole (``65536``), however large or small.

    ``unknown``, when given, is printed for a scale that is not known (``None`` or
    NaN): the findings' sentences say ``"?"`` where a table cell says ``"-"``.
    """
    if unknown is not None and (x is None or math.isnan(x)):
        return unknown
    if x is None:
        return MISSING
    if not math.isfinite(x):
        return _nonfinite(x)
    if 1 <= x < WHOLE_MAX and x == int(x):
        return str(int(x))
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


def times(n: int) -> str:
    """``once``, ``3 times``."""
    return "once" if n == 1 else f"{n} times"


def steps_list(steps: list[int], limit: int = STEPS_SHOWN) -> str:
    """The first ``limit`` steps, and how many there were in all when more."""
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


class AtStep(Protocol):
    """Anything that happened at a step (a scaler event, a finding's event)."""

    @property
    def step(self) -> int: ...


T = TypeVar("T", bound=AtStep)


def consecutive_runs(items: Iterable[T]) -> list[list[T]]:
    """Items (sorted by step) in consecutive steps form one run: one backoff episode."""
    runs: list[list[T]] = []
    for e in items:
        if runs and e.step - runs[-1][-1].step <= 1:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def error_line(exc: BaseException) -> str:
    """``"TypeError: first line of the message"``, at most :data:`ERROR_CHARS` of it."""
    try:
        text = str(exc)
    except Exception:  # as the traceback module says it
        text = "<exception str() failed>"
    lines = text.strip().splitlines()
    msg = lines[0] if lines else ""
    more = len(lines) > 1
    if len(msg) > ERROR_CHARS:
        msg, more = msg[:ERROR_CHARS].rstrip(), True
    if not msg:
        return type(exc).__name__
    return f"{type(exc).__name__}: {msg}" + (" ... (see the traceback)" if more else "")


def and_list(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def counted(n: int, noun: str) -> str:
    """``"1 backoff"``, ``"2 backoffs"``: a count with its noun in the right number."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def layer(name: str | None) -> str:
    """A layer's name where it stands alone in a sentence or a finding's header: a
    ``Sequential``'s child ``"1"`` reads as ``"layer 1"``, not as a count."""
    if name is None:
        return "an unnamed layer"
    return f"layer {name}" if name[:1].isdigit() else name
