"""Low-precision floating-point formats: their names, and the limits AMP runs into.

The one place dtype names are spelled: reports, JSON and analysis say
``"float16"`` / ``"bfloat16"`` (:func:`dtype_name` of a ``torch.dtype``), and
compare against the constants here. The names and :data:`FORMAT_MAX` need no
torch, so the torch-free paths (``amp-doctor report``, analysis) can use them;
:func:`limits`, :func:`parse_dtype` and :data:`LOW_PRECISION_DTYPES` import
torch on first use and take their figures from ``torch.finfo``, so they are
right for whatever torch the user brings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "FLOAT16",
    "BFLOAT16",
    "FLOAT32",
    "LOW_PRECISION_NAMES",
    "FORMAT_MAX",
    "MANTISSA_BITS",
    "FormatLimits",
    "limits",
    "LOW_PRECISION_DTYPES",
    "dtype_name",
    "parse_dtype",
    "judged_format",
]

FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
FLOAT32 = "float32"
# The formats autocast runs in, by name: what "ran in low precision" means.
LOW_PRECISION_NAMES: frozenset[str] = frozenset({FLOAT16, BFLOAT16})
# torch.finfo(dtype).max, for code that must not import torch (tests check they agree).
FORMAT_MAX: dict[str, float] = {FLOAT16: 65504.0, BFLOAT16: 3.3895313892515355e38}
# Explicit significand bits: a value's spacing is 2**-bits of the power of two at or
# below it (float16: 2 near 2048..4096; bfloat16: 2 near 256..512).
MANTISSA_BITS: dict[str, int] = {FLOAT16: 10, BFLOAT16: 7}



def judged_format(output_dtypes: Iterable[str], run_format: str) -> str:
    """The format a layer's figures are judged against: the low-precision format its
    outputs had, float16 (the narrower) if both; the run's format for a layer that
    stayed in float32 (its what-if). One run may train a float16 and a bfloat16 model
    (a GAN), and a model may hold a float16 submodule in a bfloat16 run."""
    outs = set(output_dtypes)
    if FLOAT16 in outs:
        return FLOAT16
    if BFLOAT16 in outs:
        return BFLOAT16
    return run_format


if TYPE_CHECKING:
    LOW_PRECISION_DTYPES: tuple[torch.dtype, ...]


def __getattr__(name: str) -> Any:
    # LOW_PRECISION_DTYPES holds torch.dtype objects: built on first use, so that
    # importing this module does not import torch.
    if name == "LOW_PRECISION_DTYPES":
        import torch

        value = (torch.float16, torch.bfloat16)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class FormatLimits:
    """The representable range of one floating-point format."""

    name: str
    max: float
    smallest_normal: float
    smallest_subnormal: float

    @property
    def max_exponent(self) -> int:
        """log2 of the smallest power of two above ``max``: the top edge of histograms."""
        return math.ceil(math.log2(self.max))

    @property
    def min_exponent(self) -> int:
        """log2 of the smallest subnormal: the bottom edge of histograms."""
        return round(math.log2(self.smallest_subnormal))

    @property
    def normal_exponent(self) -> int:
        return round(math.log2(self.smallest_normal))


def limits(dtype: torch.dtype) -> FormatLimits:
    import torch

    info = torch.finfo(dtype)
    # finfo.eps is 2**-mantissa_bits, so tiny * eps is the smallest subnormal.
    return FormatLimits(
        name=dtype_name(dtype),
        max=float(info.max),
        smallest_normal=float(info.smallest_normal),
        smallest_subnormal=float(info.smallest_normal) * float(info.eps),
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``: the spelling used in reports and JSON."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; expected e.g. {FLOAT16!r} or {BFLOAT16!r}")
    return dtype
