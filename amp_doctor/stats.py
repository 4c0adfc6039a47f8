"""Pure tensor -> tensor reductions: the on-device summary of one tensor.

A summary is a 1-D float64 tensor on the tensor's own device. Nothing here
ever copies to the host: callers stack many summaries and copy them once per
recorded step (see :mod:`amp_doctor.probes`).

The summary does not depend on which low-precision format the run uses. It
holds a histogram of the binary exponent of ``|x|`` (read straight from the
float32 bit pattern, so one integer shift per element) plus exact counts at
the two format maxima that are not powers of two. Overflow, underflow,
headroom and "what-if" figures for float16 and bfloat16 are all derived
from it on the host by :func:`decode`. That is why a layer that ran in
float32 gets its what-if figures at no extra cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .dtypes import FormatLimits

__all__ = [
    "SUMMARY_LEN",
    "N_EXP_BINS",
    "summarize",
    "empty_summary",
    "Decoded",
    "decode",
    "exponent_of_bin",
]

# Layout of a summary vector.
NUMEL, MIN, MAX, ZEROS, NANS, OVER_F16, OVER_BF16 = range(7)
HIST = 7
N_EXP_BINS = 256  # one per float32 biased exponent; bin 0 holds zero and fp32 subnormals
SUMMARY_LEN = HIST + N_EXP_BINS

_F32_BIAS = 127
_INF_BITS = 0x7F800000  # float32 +inf; larger patterns of |x| are NaN
_F16_MAX_BITS = 0x477FE000  # 65504.0
_BF16_MAX_BITS = 0x7F7F0000  # bfloat16 max as a float32 pattern


def exponent_of_bin(b: int) -> int:
    """Bin ``b`` (1..254) holds |x| in [2**e, 2**(e+1)) with e returned here."""
    return b - _F32_BIAS


def summarize(x: torch.Tensor) -> torch.Tensor:
    """Summary of a floating-point tensor, computed on its device without a sync.

    The caller guarantees ``x`` is floating point and non-empty.
    """
    x = x.detach()
    a = x.abs()
    if a.dtype != torch.float32:
        # float64 beyond float32's range becomes inf here, which is what a
        # cast to any low-precision format would do too.
        a = a.float()
    # For non-negative floats the int32 bit pattern orders like the value, so
    # every threshold below is one integer compare.
    bits = a.reshape(-1).view(torch.int32)
    key = bits >> 23
    if bits.device.type == "cpu":
        hist = torch.bincount(key, minlength=N_EXP_BINS)
    else:
        # torch.bincount reads max() back to size its output: a host sync per
        # tensor on CUDA. histc with a fixed range does not.
        hist = torch.histc(key.float(), bins=N_EXP_BINS, min=-0.5, max=N_EXP_BINS - 0.5)
    nans = (bits > _INF_BITS).sum()
    counts = torch.stack(
        [
            (bits == 0).sum(),
            nans,
            # Overflow counts include inf but not NaN.
            (bits >= _F16_MAX_BITS).sum() - nans,
            (bits >= _BF16_MAX_BITS).sum() - nans,
        ]
    ).to(torch.float64)
    mn, mx = torch.aminmax(x)
    head = torch.stack([mn.to(torch.float64), mx.to(torch.float64)])
    numel = torch.full((1,), float(x.numel()), dtype=torch.float64, device=x.device)
    return torch.cat([numel, head, counts, hist.to(torch.float64)])


def empty_summary(device: torch.device) -> torch.Tensor:
    out = torch.zeros(SUMMARY_LEN, dtype=torch.float64, device=device)
    out[MIN] = math.inf
    out[MAX] = -math.inf
    return out


def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combine two summaries (same device) as if of the concatenated tensors."""
    out = a + b
    out[MIN] = torch.minimum(a[MIN], b[MIN])
    out[MAX] = torch.maximum(a[MAX], b[MAX])
    return out


@dataclass(frozen=True)
class Decoded:
    """A host-side summary, interpreted against one low-precision format."""

    numel: int
    min: float
    max: float
    absmax: float
    zero_frac: float
    nonfinite_frac: float
    nan_count: int
    inf_count: int
    overflow_frac: float
    underflow_frac: float
    headroom: float  # log2(format max / absmax); inf for an all-zero tensor


def _underflow_count(hist: list[float], zeros: float, fmt: FormatLimits, shift: int) -> float:
    """Non-zero values below the format's smallest normal after dividing by 2**shift."""
    # Bin b holds [2**(b-127), 2**(b-126)); it underflows when its top edge,
    # after the shift, is at or below the smallest normal.
    top_bin = fmt.normal_exponent + _F32_BIAS + shift
    top_bin = max(0, min(top_bin, N_EXP_BINS - 1))
    return sum(hist[:top_bin]) - zeros


def decode(v: list[float], fmt: FormatLimits, scale_log2: int = 0) -> Decoded:
    """Interpret a host copy of a summary against ``fmt``.

    ``scale_log2`` > 0 gives the unscaled-equivalent view of a gradient that
    a GradScaler multiplied by ``2**scale_log2``: underflow is judged as if
    the values were divided by the scale first.
    """
    numel = int(v[NUMEL])
    hist = v[HIST:]
    zeros, nans = v[ZEROS], v[NANS]
    infs = hist[N_EXP_BINS - 1] - nans
    mn, mx = v[MIN], v[MAX]
    absmax = max(abs(mn), abs(mx)) if numel else 0.0
    if infs:
        absmax = math.inf
    elif nans:
        # aminmax propagates NaN; fall back to the top populated finite bin.
        absmax = _absmax_from_hist(hist)
    over = v[OVER_F16] if fmt.name == "float16" else v[OVER_BF16]
    if scale_log2:
        over = sum(hist[min(N_EXP_BINS - 1, fmt.max_exponent + _F32_BIAS + scale_log2) :]) - nans
    under = _underflow_count(hist, zeros, fmt, scale_log2)
    if absmax == 0 or math.isnan(absmax):
        headroom = math.inf if absmax == 0 else math.nan
    elif math.isinf(absmax):
        headroom = -math.inf
    else:
        headroom = math.log2(fmt.max / (absmax / 2.0**scale_log2))
    n = max(numel, 1)
    div = 2.0**scale_log2
    return Decoded(
        numel=numel,
        min=mn / div,
        max=mx / div,
        absmax=absmax / 2.0**scale_log2 if scale_log2 else absmax,
        zero_frac=zeros / n,
        nonfinite_frac=(nans + infs) / n,
        nan_count=int(nans),
        inf_count=int(infs),
        overflow_frac=over / n,
        underflow_frac=under / n,
        headroom=headroom,
    )


def _absmax_from_hist(hist: list[float]) -> float:
    for b in range(N_EXP_BINS - 2, -1, -1):
        if hist[b]:
            return 2.0 ** (exponent_of_bin(b) + 1)
    return 0.0
