"""Pure tensor -> tensor reductions: the on-device summary of one tensor.

A summary is a 1-D float64 tensor on the tensor's own device. Nothing here
ever copies to the host: callers stack many summaries and copy them once per
recorded step (see :mod:`amp_doctor.device.recorder`).

The summary does not depend on which low-precision format the run uses. It
holds the tensor's exact min and max, and a histogram of the binary exponent
of ``|x|`` (read straight from the float32 bit pattern: one integer shift per
element) with exact zero and NaN counts. Overflow, underflow, headroom and
"what-if" figures for float16 and bfloat16 are all derived from it on the
host by :func:`decode`. That is why a layer that ran in float32 gets its
what-if figures at no extra cost.

Bounded cost per tensor, batched across tensors. A hook pays for
:func:`summarize` (the exact min and max over the whole tensor, one
``aminmax`` pass with no temporary, and the non-zero count of a sample) and
:meth:`Batch.add` (the sample's histogram codes, ``bits >> shift`` plus the
row's offset, written into a staging buffer). The histogram itself is one
pass over the staging buffer for many tensors at once, and the step's rows
are packed by a handful of ops (:meth:`Batch.finish`). So the extremes, and
whether any NaN, Inf or overflowing value is present, are exact; histogram
and counts come from an evenly strided sample of at most
:data:`SAMPLE_LIMIT` elements, scaled to the whole tensor (fractions of
larger tensors are estimates, standard error below 0.4 percentage points).
The stride is a prime that divides none of the tensor's dimensions, so the
sample walks across every dimension instead of aliasing with one (always
channel 0, say). A hook keeps no reference to the tensor after ``add``; the
memory held per step is the staging buffer plus 2 KB per summarised tensor.

NaN and inf share the top exponent bin; the top mantissa bit tells them
apart (set for a quiet NaN, clear for inf). Every NaN that arithmetic
produces is quiet; a hand-made signalling NaN would be counted as an inf.

Why not ``torch._foreach_*`` reductions: ``_foreach_norm(ord=inf)`` gives only
|x|max, but min and max must be exact and signed; ``_foreach_max`` of the tensors
and of their negations gives both, but the negation copies every tensor. On the
CPU (``benchmarks/bench_foreach.py``, one thread) neither pays: for 500-2,000
tensors of 256 values they are within 0.7-1.2x of per-tensor ``aminmax``, and for
200 tensors of 65,536 values 2.4-9x slower. And a hook may not keep the tensor
until a later batched call, so only the parameters' gradients could be batched at
all. On CUDA they would save kernel launches; that is left to a measurement there.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from amp_doctor.dtypes import FormatLimits

__all__ = [
    "SUMMARY_LEN",
    "DEVICE_LEN",
    "N_EXP_BINS",
    "SAMPLE_LIMIT",
    "Summary",
    "summarize",
    "Batch",
    "exp_histogram",
    "stack_rows",
    "host_rows",
    "summary_row",
    "Decoded",
    "decode",
    "decode_many",
    "decode_table",
    "DECODED_FIELDS",
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
    """What a hook takes from one tensor: the exact extremes, and a bounded sample.

    ``sample`` is a view of (or, for float16/float64, a small copy from) the
    tensor. It must be handed to :meth:`Batch.add` (``buf.add(summarize(t))``)
    right away: ``add`` turns it into histogram codes in a staging buffer and
    drops it, so a hook never keeps the user's activation alive. Everything
    else is a 0-d device tensor; ``numel`` and ``sampled`` are host facts.
    """

    min: torch.Tensor  # 0-d, the tensor's dtype
    max: torch.Tensor
    nonzero: torch.Tensor  # 0-d int64, within the sample
    sample: torch.Tensor | None  # 1-D, float32/bfloat16; None once consumed
    numel: int
    sampled: int


def summarize(x: torch.Tensor) -> Summary:
    """The per-tensor part of a summary: three small ops, no host sync.

    The caller guarantees ``x`` is floating point and non-empty. Histogram
    and NaN counts come later, batched over many tensors (:class:`Batch`).
    """
    x = x.detach()
    n = x.numel()
    flat = _flat(x)
    stride = sample_stride(n, tuple(x.shape))
    if stride > 1:
        flat = flat[::stride]
    if flat.dtype not in _CODE_SHIFTS:
        # float64 beyond float32's range becomes inf here, which is what a
        # cast to any low-precision format would do too.
        flat = flat.float()
    mn, mx = torch.aminmax(x)
    return Summary(mn, mx, torch.count_nonzero(flat), flat, n, flat.numel())


# How far to shift a sample's bit pattern (viewed as a same-width integer) so
# that sign, the 8-bit float32 exponent and the top mantissa bit remain: the
# same 10-bit code for float32 and bfloat16 (a truncated float32). The top
# mantissa bit tells a quiet NaN (set) from an inf (clear) in exponent 255.
_CODE_SHIFTS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 22),
    torch.bfloat16: (torch.int16, 6),
}
_CODE_BIAS = 512  # codes are in [-512, 512): shifted to [0, 1024)
CODES_PER_ROW = 2 * _CODE_BIAS
# Codes staged per device before one batched histogram pass: bounded memory
# (256 KB of int32) and a few passes per step. It holds at least one sample.
STAGE_LIMIT = 4 * SAMPLE_LIMIT
# Rows per pass, so that every code (row * 1024 + code) is exact in float32
# for the histc path (< 2**24).
ROWS_PER_PASS = 4096


def exp_histogram(codes: torch.Tensor, nbins: int, device_path: bool | None = None) -> torch.Tensor:
    """Counts of ``codes`` in ``[0, nbins)``, int64, without a host sync.

    ``torch.bincount`` reads its input's max back to size the output: a host
    sync on CUDA. There, ``histc`` with a fixed range does the same count
    asynchronously. ``device_path`` forces a path (tests run both on CPU).
    """
    if device_path is None:
        device_path = codes.device.type != "cpu"
    if not device_path:
        return torch.bincount(codes, minlength=nbins)
    return torch.histc(codes.float(), bins=nbins, min=-0.5, max=nbins - 0.5).long()


class Batch:
    """Summaries of one device, made into rows with a few batched ops.

    :meth:`add` writes each sample's codes (``bits >> shift`` plus the row's
    offset: two ops) into a staging buffer; whenever it is full, and at
    :meth:`finish`, one histogram pass counts every staged code of many rows
    at once. Memory is bounded by the staging buffer and 2 KB per row,
    whatever the tensors' sizes; no sample outlives its ``add`` call.
    """

    def __init__(self, device_path: bool | None = None) -> None:
        self._device_path = device_path
        self._summaries: list[Summary] = []
        self._stage: torch.Tensor | None = None
        self._used = 0
        self._row0 = 0  # first row in the stage
        self._hists: list[torch.Tensor] = []  # [rows, 256, 2] per pass

    def __len__(self) -> int:
        return len(self._summaries)

    def add(self, s: Summary) -> int:
        """File one summary; returns its row index in this batch."""
        sample = s.sample
        assert sample is not None, "a Summary can be added once"
        k = sample.numel()
        row = len(self._summaries)
        if self._stage is None:
            self._stage = torch.empty(max(STAGE_LIMIT, k), dtype=torch.int32,
                                      device=sample.device)
        elif self._used + k > self._stage.numel() or row - self._row0 >= ROWS_PER_PASS:
            self._pass()
            if k > self._stage.numel():
                self._stage = torch.empty(k, dtype=torch.int32, device=sample.device)
        itype, shift = _CODE_SHIFTS[sample.dtype]
        dst = self._stage[self._used : self._used + k]
        torch.bitwise_right_shift(sample.view(itype), shift, out=dst)
        dst.add_(_CODE_BIAS + CODES_PER_ROW * (row - self._row0))
        self._used += k
        self._summaries.append(Summary(s.min, s.max, s.nonzero, None, s.numel, s.sampled))
        return row

    def _pass(self) -> None:
        rows = len(self._summaries) - self._row0
        if rows:
            assert self._stage is not None
            h = exp_histogram(self._stage[: self._used], CODES_PER_ROW * rows, self._device_path)
            # [rows, sign, exponent, top mantissa bit] -> fold the sign.
            self._hists.append(h.view(rows, 2, N_EXP_BINS, 2).sum(1))
        self._used = 0
        self._row0 = len(self._summaries)

    @property
    def summaries(self) -> list[Summary]:
        return self._summaries

    def finish(self) -> torch.Tensor:
        """``[R, DEVICE_LEN]`` float64 on the device: min, max, non-zeros, NaNs and the
        exponent histogram (NaNs in bin 255, as in a float32 exponent histogram)."""
        self._pass()
        self._stage = None
        ss = self._summaries
        if not ss:
            return torch.zeros(0, DEVICE_LEN, dtype=torch.float64)
        h = torch.cat(self._hists) if len(self._hists) > 1 else self._hists[0]
        self._hists = []
        scal = torch.stack([torch.stack([s.min for s in ss]).to(torch.float64),
                            torch.stack([s.max for s in ss]).to(torch.float64),
                            torch.stack([s.nonzero for s in ss]).to(torch.float64),
                            h[:, N_EXP_BINS - 1, 1].to(torch.float64)], dim=1)
        return torch.cat([scal, h.sum(2).to(torch.float64)], dim=1)


def stack_rows(summaries: list[Summary], device_path: bool | None = None) -> torch.Tensor:
    """``[R, DEVICE_LEN]`` float64 on the summaries' (common) device."""
    b = Batch(device_path)
    for s in summaries:
        b.add(s)
    return b.finish()


def host_rows(device_rows: torch.Tensor, summaries: list[Summary]) -> torch.Tensor:
    """Host copies of :meth:`Batch.finish` -> whole summary rows (``SUMMARY_LEN``):
    NUMEL added, sample counts scaled to the whole tensor, zeros from non-zeros."""
    numel = torch.tensor([float(s.numel) for s in summaries], dtype=torch.float64)
    scale = numel / torch.tensor([float(s.sampled) for s in summaries], dtype=torch.float64)
    counts = device_rows[:, 2:] * scale.unsqueeze(1)
    zeros = (numel - counts[:, 0]).unsqueeze(1)
    return torch.cat([numel.unsqueeze(1), device_rows[:, :2], zeros, counts[:, 1:]], dim=1)


def summary_row(x: torch.Tensor, device_path: bool | None = None) -> torch.Tensor:
    """A whole summary row of ``x`` on the host; for tests and tools (it syncs)."""
    s = summarize(x)
    meta = [s._replace(sample=None)]
    return host_rows(stack_rows([s], device_path).cpu(), meta)[0]


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
    table = decode_table(rows, fmt, shifts)
    out: list[Decoded] = []
    for (numel, mn, mx, absmax, zero, nonfinite, nan_c, inf_c, over, under, head,
         over_c) in table.tolist():
        out.append(Decoded(int(numel), mn, mx, absmax, zero, nonfinite, int(nan_c), int(inf_c),
                           over, under, head, over_c))
    return out


# Rows decoded at once by :func:`decode_table`: its whole-matrix ops hold several
# [rows, 256] float64 temporaries, 512 KB each at this size.
DECODE_CHUNK_ROWS = 256

# Columns of :func:`decode_table`, in :class:`Decoded`'s field order.
DECODED_FIELDS = ("numel", "min", "max", "absmax", "zero_frac", "nonfinite_frac", "nan_count",
                  "inf_count", "overflow_frac", "underflow_frac", "headroom", "over_count")


def decode_table(rows: torch.Tensor, fmt: FormatLimits, shifts: list[int]) -> torch.Tensor:
    """:func:`decode_many` as a ``[K, len(DECODED_FIELDS)]`` float64 table: whole-matrix
    ops, no per-row Python (a 2,000-layer step decodes in a few milliseconds)."""
    k = rows.shape[0]
    f64 = torch.float64
    if k == 0:
        return torch.zeros(0, len(DECODED_FIELDS), dtype=f64)
    if k > DECODE_CHUNK_ROWS:
        # Row by row independent: chunks bound the transient [K, 256] float64 tensors
        # (a few MB each on a 1,000-tensor step) without changing a value.
        return torch.cat([decode_table(rows[i : i + DECODE_CHUNK_ROWS], fmt,
                                       shifts[i : i + DECODE_CHUNK_ROWS])
                          for i in range(0, k, DECODE_CHUNK_ROWS)])
    rows = rows.to(f64)
    hist = rows[:, HIST:]
    # below[:, b] = sum(hist[:, :b])
    below = torch.cat([torch.zeros(k, 1, dtype=f64), hist.cumsum(1)], dim=1)
    sh = torch.tensor(shifts, dtype=torch.long).reshape(k, 1)
    # Bin b holds [2**(b-127), 2**(b-126)): it underflows when its top edge,
    # after the shift, is at or below the smallest normal.
    under_bin = (sh + fmt.normal_exponent + _F32_BIAS).clamp(0, N_EXP_BINS - 1)
    # fmt.max_exponent is the top edge of the bin holding the max.
    over_bin = (sh + fmt.max_exponent + _F32_BIAS).clamp(0, N_EXP_BINS - 1)
    over_fin = (below[:, N_EXP_BINS - 1 : N_EXP_BINS] - below.gather(1, over_bin)).squeeze(1)
    under_all = below.gather(1, under_bin).squeeze(1)
    numel, mn, mx, zeros, nans = rows[:, :HIST].unbind(1)
    infs = (hist[:, N_EXP_BINS - 1] - nans).clamp(min=0)
    # A sampled histogram can miss a lone NaN or inf; the exact min/max
    # never do (aminmax propagates NaN, and an inf is an extreme).
    nans = torch.where((mn.isnan() | mx.isnan()) & (nans < 1), 1.0, nans)
    infs = torch.where(((mx == math.inf) | (mn == -math.inf)) & (infs < 1), 1.0, infs)
    div = torch.exp2(sh.squeeze(1).to(f64))
    has = numel > 0
    absmax = torch.where(has, torch.maximum(mn.abs(), mx.abs()), 0.0)
    over = over_fin + infs
    over = torch.where((over < 1) & has & (absmax / div > fmt.max), 1.0, over)
    # aminmax propagates NaN; fall back to the top populated finite bin.
    populated = hist[:, : N_EXP_BINS - 1] > 0
    top_bin = torch.where(populated, torch.arange(N_EXP_BINS - 1, dtype=f64), -math.inf).amax(1)
    from_hist = torch.where(top_bin >= 0, torch.exp2(top_bin - _F32_BIAS + 1), 0.0)
    absmax = torch.where(infs > 0, math.inf, torch.where(nans > 0, from_hist, absmax))
    # log2(max / 0) = inf (all zeros), log2(max / inf) = -inf, NaN stays NaN.
    headroom = torch.log2(fmt.max / (absmax / div))
    n = numel.clamp(min=1)
    return torch.stack([
        numel, mn / div, mx / div, absmax / div,
        (zeros / n).clamp(max=1.0),
        ((nans + infs) / n).clamp(max=1.0),
        nans.round(), infs.round(),
        (over / n).clamp(max=1.0),
        ((under_all - zeros).clamp(min=0) / n).clamp(max=1.0),
        headroom, over,
    ], dim=1)


def _absmax_from_hist(hist: list[float]) -> float:
    for b in range(N_EXP_BINS - 2, -1, -1):
        if hist[b]:
            return 2.0 ** (exponent_of_bin(b) + 1)
    return 0.0
