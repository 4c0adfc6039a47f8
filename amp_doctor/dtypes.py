"""Limits of the low-precision floating-point formats AMP runs in.

Everything amp-doctor says about overflow and underflow is measured against
these limits. They come from ``torch.finfo`` so they are right for whatever
torch the user brings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FormatLimits", "limits", "LOW_PRECISION_DTYPES", "dtype_name", "parse_dtype"]

LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


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
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; expected e.g. 'float16' or 'bfloat16'")
    return dtype
