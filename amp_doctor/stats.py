"""Pure tensor -> tensor reductions: the on-device summary of one tensor.

A summary is a 1-D float64 tensor on the tensor's own device. Nothing here
ever copies to the host: callers stack many summaries and copy them once per
recorded step (see :mod:`amp_doctor.recorder`).

The summary does not depend on which low-precision format the run uses. It
holds the tensor's exact min and max, and a histogram of the binary exponent
of ``|x|`` (read straight from the float32 bit pattern: one integer shift per
element) with exact zero and NaN counts. Overflow, underflow, headroom and
"what-if" figures for float16 and bfloat16 are all derived from it on the
host by :func:`decode`. That is why a layer that ran in float32 gets its
what-if figures at no extra cost.

Bounded cost per tensor: min and max always come from the whole tensor (one
multi-threaded ``aminmax`` pass, no temporary), so the extremes, and whether
any NaN, Inf or overflowing value is present, are exact. The histogram and
counts come from an evenly strided sample of at most :data:`SAMPLE_LIMIT`
elements and are scaled to the whole tensor; fractions of larger tensors are
estimates (standard error below 0.4 percentage points). The stride is a
prime that divides none of the tensor's dimensions, so the sample walks
across every dimension instead of aliasing with one (always channel 0,
say). The cost of a summary is therefore about ten small ops, whatever the
tensor's size, and its temporary memory is bounded by the sample.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .dtypes import FormatLimits

__all__ = [
    "SUMMARY_LEN",
    "DEVICE_LEN",
    "N_EXP_BINS",
    "SAMPLE_LIMIT",
    "Summary",
    "summarize",
    "stack_rows",
    "host_rows",
    "summary_row",
    "Decoded",
    "decode",
    "decode_many",
    "exponent_of_bin",
]

# Layout of a summary row. NUMEL is known on the host (it is the tensor's
# shape), so the device part starts at MIN; see :func:`host_rows`.
NUMEL, MIN, MAX, ZEROS, NANS = range(5)
HIST = 5
N_EXP_BINS = 256  # one per float32 biased exponent; bin 0 holds zero and fp32 subnormals
SUMMARY_LEN = HIST + N_EXP_BINS
DEVICE_LEN = SUMMARY_LEN - 1

# Histogram and counts come from at most this many elements per tensor. The
# histogram (``bincount``) is serial and the slowest part of a summary; 2**14
# samples keep it at a few tens of microseconds and a fraction's standard
# error at or below sqrt(0.25 / 2**14) = 0.4 percentage points.
SAMPLE_LIMIT = 1 << 14

_F32_BIAS = 127
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000  # float32 +inf; larger patterns of |x| are NaN


def exponent_of_bin(b: int) -> int:
    """Bin ``b`` (1..254) holds |x| in [2**e, 2**(e+1)) with e returned here."""
    return b - _F32_BIAS


def _is_prime(p: int) -> bool:
    if p < 2:
        return False
    i = 2
    while i * i <= p:
        if p % i == 0:
            return False
        i += 1
    return True


@functools.lru_cache(maxsize=4096)
def sample_stride(numel: int, shape: tuple[int, ...]) -> int:
    """1 for small tensors; else the smallest prime that keeps the sample within
    :data:`SAMPLE_LIMIT` and divides none of ``shape``'s dimensions."""
    if numel <= SAMPLE_LIMIT:
        return 1
    p = -(-numel // SAMPLE_LIMIT)
    while not _is_prime(p) or any(s % p == 0 for s in shape if s > 1):
        p += 1
    return p


def _flat(x: torch.Tensor) -> torch.Tensor:
    """A 1-D view of every element, without a copy when the memory is dense.

    channels_last and other permuted layouts are dense too: walk their storage
    in memory order rather than paying a full copy to get logical order (the
    sample does not care about order).
    """
    if x.is_contiguous():
        return x.view(-1)
    order = sorted(range(x.dim()), key=lambda d: x.stride(d))
    expected = 1
    for d in order:
        if x.size(d) != 1 and x.stride(d) != expected:
            return x.reshape(-1)  # overlapping or gapped: rare, pay the copy
        expected *= x.size(d)
    return x.as_strided((x.numel(),), (1,))


class Summary(NamedTuple):
    """The device part of one tensor's summary: five small tensors, no host copy.

    They are kept apart, not packed into one vector per tensor: packing costs
    several small ops per tensor, while :func:`stack_rows` packs a whole step's
    summaries with a handful of ops. ``numel`` and ``sampled`` are host facts.
    """

    min: torch.Tensor  # 0-d, the tensor's dtype
    max: torch.Tensor
    nonzero: torch.Tensor  # 0-d int64, within the sample
    nans: torch.Tensor
    hist: torch.Tensor  # [N_EXP_BINS] int64, within the sample
    numel: int
    sampled: int


def summarize(x: torch.Tensor) -> Summary:
    """Summary of a floating-point tensor, computed on its device without a sync.

    The caller guarantees ``x`` is floating point and non-empty.
    """
    x = x.detach()
    n = x.numel()
    flat = _flat(x)
    stride = sample_stride(n, tuple(x.shape))
    if stride > 1:
        flat = flat[::stride]
    if flat.dtype != torch.float32:
        # float64 beyond float32's range becomes inf here, which is what a
        # cast to any low-precision format would do too.
        flat = flat.float()
    # For non-negative floats the int32 bit pattern orders like the value.
    bits = flat.view(torch.int32) & _ABS_MASK
    if bits.device.type == "cpu":
        hist = torch.bincount(bits >> 23, minlength=N_EXP_BINS)
    else:
        # torch.bincount reads max() back to size its output: a host sync per
        # tensor on CUDA. histc with a fixed range does not.
        hist = torch.histc((bits >> 23).float(), bins=N_EXP_BINS, min=-0.5,
                           max=N_EXP_BINS - 0.5).long()
    mn, mx = torch.aminmax(x)
    return Summary(mn, mx, torch.count_nonzero(bits), torch.count_nonzero(bits > _INF_BITS),
                   hist, n, bits.numel())


def stack_rows(summaries: list[Summary]) -> torch.Tensor:
    """``[R, DEVICE_LEN]`` float64 on the summaries' (common) device: a step's
    summaries packed by a handful of ops. Counts are still within each sample."""
    cols = [torch.stack([getattr(s, f) for s in summaries]).to(torch.float64).reshape(
        len(summaries), -1) for f in ("min", "max", "nonzero", "nans", "hist")]
    return torch.cat(cols, dim=1)


def host_rows(device_rows: torch.Tensor, summaries: list[Summary]) -> torch.Tensor:
    """Host copies of :func:`stack_rows` -> whole summary rows (``SUMMARY_LEN``):
    NUMEL added, sample counts scaled to the whole tensor, zeros from non-zeros."""
    numel = torch.tensor([float(s.numel) for s in summaries], dtype=torch.float64)
    scale = numel / torch.tensor([float(s.sampled) for s in summaries], dtype=torch.float64)
    counts = device_rows[:, 2:] * scale.unsqueeze(1)
    zeros = (numel - counts[:, 0]).unsqueeze(1)
    return torch.cat([numel.unsqueeze(1), device_rows[:, :2], zeros, counts[:, 1:]], dim=1)


def summary_row(x: torch.Tensor) -> torch.Tensor:
    """A whole summary row of ``x`` on the host; for tests and tools (it syncs)."""
    s = summarize(x)
    return host_rows(stack_rows([s]).cpu(), [s])[0]


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
    over_count: float = 0.0  # values beyond the max, inf included (scaled if sampled)


def decode(v: list[float], fmt: FormatLimits, scale_log2: int = 0) -> Decoded:
    """Interpret one host summary row against ``fmt``; see :func:`decode_many`."""
    return decode_many(torch.tensor([v], dtype=torch.float64), fmt, [scale_log2])[0]


def decode_many(rows: torch.Tensor, fmt: FormatLimits, shifts: list[int]) -> list[Decoded]:
    """Interpret host summary rows ``[K, SUMMARY_LEN]`` against ``fmt``, all at once.

    ``shifts[k]`` > 0 gives the unscaled-equivalent view of a gradient that a
    GradScaler multiplied by ``2**shifts[k]``: underflow and overflow are
    judged as if the values were divided by the scale first.

    Overflow counts values beyond the format max, inf included. That is exact
    for float16 and bfloat16 tensors: neither holds a finite value between
    the format max and the next power of two. A float32 value in that band
    (65504 < |x| < 65536 for float16) shares a histogram bin with values that
    fit, and is counted only through the exact max, as "at least one".

    The bin sums are one cumulative sum over the whole matrix and a single
    ``tolist``: a recorded step decodes a hundred rows in well under a millisecond.
    """
    k = rows.shape[0]
    if k == 0:
        return []
    rows = rows.to(torch.float64)
    hist = rows[:, HIST:]
    # below[:, b] = sum(hist[:, :b])
    below = torch.cat([torch.zeros(k, 1, dtype=torch.float64), hist.cumsum(1)], dim=1)
    sh = torch.tensor(shifts, dtype=torch.long).reshape(k, 1)
    # Bin b holds [2**(b-127), 2**(b-126)): it underflows when its top edge,
    # after the shift, is at or below the smallest normal.
    under_bin = (sh + fmt.normal_exponent + _F32_BIAS).clamp(0, N_EXP_BINS - 1)
    # fmt.max_exponent is the top edge of the bin holding the max.
    over_bin = (sh + fmt.max_exponent + _F32_BIAS).clamp(0, N_EXP_BINS - 1)
    finite_over = below[:, N_EXP_BINS - 1 : N_EXP_BINS] - below.gather(1, over_bin)
    cols = torch.cat([rows[:, :HIST], hist[:, N_EXP_BINS - 1 :], below.gather(1, under_bin),
                      finite_over], dim=1)
    out: list[Decoded] = []
    for i, (numel_f, mn, mx, zeros, nans, top, under_all, over_fin) in enumerate(cols.tolist()):
        numel = int(numel_f)
        infs = max(top - nans, 0.0)
        # A sampled histogram can miss a lone NaN or inf; the exact min/max
        # never do (aminmax propagates NaN, and an inf is an extreme).
        if (math.isnan(mn) or math.isnan(mx)) and nans < 1:
            nans = 1.0
        if (mx == math.inf or mn == -math.inf) and infs < 1:
            infs = 1.0
        div = 2.0 ** shifts[i]
        absmax = max(abs(mn), abs(mx)) if numel else 0.0
        over = over_fin + infs
        if over < 1 and numel and absmax / div > fmt.max:
            over = 1.0
        if infs:
            absmax = math.inf
        elif nans:
            # aminmax propagates NaN; fall back to the top populated finite bin.
            absmax = _absmax_from_hist(hist[i].tolist())
        if absmax == 0 or math.isnan(absmax):
            headroom = math.inf if absmax == 0 else math.nan
        elif math.isinf(absmax):
            headroom = -math.inf
        else:
            headroom = math.log2(fmt.max / (absmax / div))
        n = max(numel, 1)
        out.append(Decoded(
            numel=numel,
            min=mn / div,
            max=mx / div,
            absmax=absmax / div,
            zero_frac=min(zeros / n, 1.0),
            nonfinite_frac=min((nans + infs) / n, 1.0),
            nan_count=round(nans),
            inf_count=round(infs),
            overflow_frac=min(over / n, 1.0),
            underflow_frac=min(max(under_all - zeros, 0.0) / n, 1.0),
            headroom=headroom,
            over_count=over,
        ))
    return out


def _absmax_from_hist(hist: list[float]) -> float:
    for b in range(N_EXP_BINS - 2, -1, -1):
        if hist[b]:
            return 2.0 ** (exponent_of_bin(b) + 1)
    return 0.0
