"""Pure tensor -> tensor reductions: the on-device summaries of a step's tensors.

A summary is one float64 row (:data:`SUMMARY_LEN` values) of a matrix on the
tensors' own device. Nothing here ever copies to the host: the step's rows are
one matrix, copied once per recorded step (see :mod:`amp_doctor.device.recorder`).

The summary does not depend on which low-precision format the run uses. It
holds the tensor's exact min and max, and a histogram of the binary exponent
of ``|x|`` (read straight from the float32 bit pattern: one integer shift per
element) with exact zero and NaN counts. Overflow, underflow, headroom and
"what-if" figures for float16 and bfloat16 are all derived from it on the
host by :func:`decode`. That is why a layer that ran in float32 gets its
what-if figures at no extra cost.

Bounded cost per tensor, batched across tensors. A hook pays for
:meth:`Batch.add`: a copy of a bounded sample into a staging buffer and, when
that sample is not the whole tensor, the exact min and max over the whole tensor
(one ``aminmax`` pass with no temporary). Everything else is batched: one pass
over the staging buffer takes the min and max of the tensors it holds whole, then
turns the staged values of many tensors into histogram codes (exponent and top
mantissa bit of the float32 bit pattern, or a code of its own for an exact zero,
offset by the row) and counts them with one histogram, and the step's rows are
packed by a handful of ops (:meth:`Batch.finish`). So
the extremes, and whether any NaN, Inf or overflowing value is present, are
exact; histogram and counts come from an evenly strided sample of at most
:data:`SAMPLE_LIMIT` elements, scaled to the whole tensor (fractions of larger
tensors are estimates, standard error below 0.8 percentage points in one step). The
stride is a prime that divides none of the tensor's dimensions, so the sample walks
across every dimension instead of aliasing with one (always channel 0, say). A
hook keeps no reference to the tensor after ``add``; the memory held per step
is the staging buffer plus about 0.5 KB per summarised tensor.

NaN and inf share the top exponent bin; the top mantissa bit tells them apart
(set for a quiet NaN, clear for inf). Every NaN that arithmetic produces is
quiet; a hand-made signalling NaN would be counted as an inf.

Why per-tensor ops cost what they do: on small tensors (most layers of most
models) a torch op costs a few microseconds of dispatch whatever its size, so
the work per tensor is cut to the ops above; the per-element work (codes,
histogram) runs once per pass over up to :data:`STAGE_LIMIT` values.

Why not ``torch._foreach_*`` reductions: ``_foreach_norm(ord=inf)`` gives only
|x|max, but min and max must be exact and signed; ``_foreach_max`` of the tensors
and of their negations gives both, but the negation copies every tensor. On the
CPU (``benchmarks/bench_foreach.py``, one thread) neither pays: for 500-2,000
tensors of 256 values they are within 0.7-1.2x of per-tensor ``aminmax``, and for
200 tensors of 65,536 values 2.4-9x slower. And a hook may not keep the tensor
until a later batched call: an in-place op after the layer (``ReLU(inplace=True)``)
would change what it summarises. Only the parameters' gradients are in hand all at
once (:meth:`Batch.add_many`): the small ones are copied into the stage by one
``cat`` per shape and reduced there with the other whole ones, by their pass.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from amp_doctor.devicework import own_ops
from amp_doctor.dtypes import FormatLimits

__all__ = [
    "SUMMARY_LEN",
    "bad_batch",
    "merged_extremes",
    "nonfinite_since_check",
    "N_EXP_BINS",
    "SAMPLE_LIMIT",
    "STAGE_MIN",
    "upload",
    "Batch",
    "stage_size",
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
# shape): the host fills it in, see :func:`host_rows`.
NUMEL, MIN, MAX, ZEROS, NANS = range(5)
HIST = 5
N_EXP_BINS = 256  # one per float32 biased exponent; bin 0 holds zero and fp32 subnormals
SUMMARY_LEN = HIST + N_EXP_BINS

# A tensor of more elements than this is summarised from an evenly strided sample of
# at most this many (its min and max stay exact). A fraction's standard error is then at
# most sqrt(0.25 / 2**12) = 0.8 percentage points in one step, and a layer's figure is
# a mean over its recorded steps; the thresholds judged by it are 5-10%. With 2**14 a
# small model's stage (a sixteenth of the bytes its step files) held one or two samples,
# and each histogram pass (about ten ops) served a tensor or two: the transformer paid 31
# passes a recorded step. With 2**12 a pass serves four to eight.
SAMPLE_LIMIT = 1 << 12
assert SAMPLE_LIMIT <= torch.iinfo(torch.int16).max  # a pass's counts are int16

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


def _sample(x: torch.Tensor) -> torch.Tensor:
    """A 1-D view of at most :data:`SAMPLE_LIMIT` evenly strided elements of ``x``."""
    n = x.numel()
    if n <= SAMPLE_LIMIT:
        return _flat(x)
    return _flat(x)[:: sample_stride(n, tuple(x.shape))]


# Codes of the batched histogram: the float32 bit pattern without its sign, shifted
# right by 22, keeps the 8-bit exponent and the top mantissa bit, which tells a quiet
# NaN (set) from an inf (clear) in exponent 255: codes 0-511. An exact zero (either
# sign) gets a code of its own past them, _ZERO_CODE: the pass counts every row's zeros
# with the histogram, where a ``count_nonzero`` per tensor (per size of parameter
# gradient) was one more op each (review of issue 15: a tenth of a recorded step's
# device ops on a bfloat16 transformer). Each row's codes are offset by
# ``row * CODES_PER_ROW`` so that one histogram counts a whole pass. (A float64 value
# below float32's least subnormal is staged as 0 and so counted as a zero; it is far
# below every format's range.)
#
# How the pass makes them, in four cheap integer ops (session 62: 54 us a full stage
# against 112 us, one CPU thread): clear the sign; ``nonzero``, 1 or 0, a byte each;
# shift; subtract _CODE_BIAS from every non-zero value, which leaves a zero at 0 and
# every other code in [-_CODE_BIAS, 0). The row offset then adds _CODE_BIAS back. The
# code this replaced kept the sign (twice the bins) and marked the zeros with a
# ``masked_fill_``, the slowest op of the pass on the CPU.
_CODE_BIAS = 2 * N_EXP_BINS  # the codes of non-zero values are 0-511
_ZERO_CODE = 2 * N_EXP_BINS
CODES_PER_ROW = 2 * N_EXP_BINS + 1
_CODE_SHIFT = 22
_NO_SIGN = 0x7FFFFFFF
# Values staged per device before one batched pass (float32: 256 KB).
STAGE_LIMIT = 1 << 16
# The stage's least size (float32: 64 KB): four samples, so that a small model's pass
# serves several tensors (a pass is about ten ops, whatever it holds).
STAGE_MIN = 1 << 14
assert SAMPLE_LIMIT <= STAGE_MIN <= STAGE_LIMIT  # a pass holds at least one row
# The stage is at most this fraction of the bytes the step has filed so far (but
# at least STAGE_MIN): on a small model a fixed 256 KB stage was +18% of the
# whole run's peak memory. A smaller stage only means more passes, each a few ops.
STAGE_SHARE = 1 / 16
# A recorded step's stage starts as if this share of the bytes the previous recorded
# step filed were filed already: a large model (a GPT files tens of MB a step) gets
# its full stage at once instead of about fifty early passes through a growing one,
# while a small model's stage stays at STAGE_MIN (its peak memory is the constraint).
STAGE_HEAD_START = 1 / 4
# Rows per pass: bounds the pass's transient histogram (CODES_PER_ROW int64
# counts per row, 2 MB at 512 rows) and keeps every code exact in float32 for
# ``histc`` (< 2**24).
ROWS_PER_PASS = 512
# A pass's folded histogram row: the N_EXP_BINS exponent bins, then NaNs, the code-0
# count (float32 subnormals below 2**-127) and the exact zeros. Each code goes to one
# column, so a NaN is in _H_NANS and not in the top exponent bin, and code 0 and the
# zeros are not in bin 0: :meth:`Batch.finish` adds them back, once for every row.
_H_NANS = N_EXP_BINS
_H_CODE0 = N_EXP_BINS + 1
_H_ZEROS = N_EXP_BINS + 2
_HIST_COLS = N_EXP_BINS + 3


@functools.cache
def _fold_index(device: torch.device) -> torch.Tensor:
    """The column of a pass's folded row for each of a row's CODES_PER_ROW counts."""
    code = torch.arange(CODES_PER_ROW, device="cpu")  # not the user's default device
    exp, top_bit = code // 2, code % 2
    col = exp.clone()
    col[(exp == N_EXP_BINS - 1) & (top_bit == 1)] = _H_NANS
    col[(exp == 0) & (top_bit == 0)] = _H_CODE0
    col[_ZERO_CODE] = _H_ZEROS
    return col.to(device)
@functools.cache
def _row_offsets(device: torch.device) -> torch.Tensor:
    """``[ROWS_PER_PASS, 1]`` int32: each row's code offset, as a column to add to a 2-D
    view of several rows' codes."""
    r = torch.arange(ROWS_PER_PASS, dtype=torch.int32, device="cpu")
    return (_CODE_BIAS + r * CODES_PER_ROW).unsqueeze(1).to(device)


def _equal_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """``lengths`` as (length, count) runs of equal consecutive values."""
    return [(k, len(list(g))) for k, g in itertools.groupby(lengths)]


# Offsetting a pass's rows: one in-place add per run of equal rows, or the summed row-start
# steps (a zeroed buffer, a cumsum and an add over every staged value). Costs in
# place, on a stage gone cold in the cache, tuned on the benchmark models' passes
# (one CPU thread; on CUDA both are a few launches): the per-row adds win below
# about 30 rows of a full stage.
_ROW_OP_NS = 3_000
_STEPS_FIXED_NS = 55_000
_STEPS_NS_PER_VALUE = 0.5


_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = 2.0**-149  # float32's least subnormal

# Formats whose every value is exact in the float32 stage (see Batch.add_many).
_STAGED_EXACT = (torch.float16, torch.bfloat16, torch.float32)


# A batch's per-tensor results (0-d tensors) are stacked into one tensor every this
# many rows. Thousands of small tensor objects kept through a whole step survive
# Python's young-generation collections and make the cyclic GC sweep the whole heap
# (about 0.1 s with torch imported) every few recorded steps.
COMPACT_ROWS = 64


class _Column:
    """0-d device tensors appended one at a time, held as a few stacked chunks.

    ``torch.stack`` and ``torch.cat`` promote mixed dtypes exactly (float16 and
    bfloat16 into float32), as one stack of every value would.
    """

    __slots__ = ("_pending", "_chunks")

    def __init__(self) -> None:
        self._pending: list[torch.Tensor] = []
        self._chunks: list[torch.Tensor] = []

    def append(self, t: torch.Tensor) -> None:
        self._pending.append(t)
        if len(self._pending) >= COMPACT_ROWS:
            with own_ops:  # stack promotes under autocast: float16 with bfloat16 raises
                self._chunks.append(torch.stack(self._pending))
            self._pending = []

    def extend(self, values: torch.Tensor) -> None:
        """Append the values of a 1-D tensor, after every value appended so far."""
        if self._pending:
            with own_ops:
                self._chunks.append(torch.stack(self._pending))
            self._pending = []
        self._chunks.append(values)

    def stacked(self) -> torch.Tensor:
        """Every value in order, as one 1-D tensor (the column must not be empty)."""
        parts = self._chunks + ([torch.stack(self._pending)] if self._pending else [])
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def exp_histogram(codes: torch.Tensor, nbins: int, device_path: bool | None = None) -> torch.Tensor:
    """Counts of ``codes`` in ``[0, nbins)``, int64, without a host sync.

    ``torch.bincount`` reads its input's max back to size the output: a host
    sync on CUDA. There, ``histc`` with a fixed range does the same count
    asynchronously, unless the user's run has
    ``torch.use_deterministic_algorithms(True)``: ``histc`` has no deterministic
    CUDA kernel and would raise (or warn) inside the user's step, so an
    ``index_add`` of ones counts instead (deterministic there, and integer sums are
    exact). ``device_path`` forces a path (tests run every path on CPU).
    """
    if device_path is None:
        device_path = codes.device.type != "cpu"
    if not device_path:
        return torch.bincount(codes, minlength=nbins)
    if torch.are_deterministic_algorithms_enabled():
        ones = torch.ones(1, dtype=torch.int64, device=codes.device).expand(codes.numel())
        counts = torch.zeros(nbins, dtype=torch.int64, device=codes.device)
        return counts.index_add_(0, codes, ones)
    return torch.histc(codes.float(), bins=nbins, min=-0.5, max=nbins - 0.5).long()


def bad_batch(extremes: torch.Tensor, outputs: bool = False) -> torch.Tensor:
    """Which rows of (min, max) describe a tensor given to a model that is bad data: a
    NaN, +inf, or -inf beside anything but a zero max. An additive attention mask is
    -inf beside zeros and other non-positive biases (``generate_square_subsequent_mask``,
    ``masked_fill(mask, -inf)``, ALiBi): its max is exactly 0, where a position attends
    unbiased. Log-probabilities with a log(0) are -inf among negatives only (review 49a:
    a model's features): their max is below 0. ``outputs``: rows of what a model
    returned, where -inf among non-positive values is its own (masked log-probabilities).
    On the device, no sync."""
    lo, hi = extremes[:, 0], extremes[:, 1]
    return (lo.isnan() | hi.isnan() | (hi == math.inf)
            | ((lo == -math.inf) & ((hi > 0) if outputs else (hi != 0))))


def merged_extremes(extremes: torch.Tensor) -> torch.Tensor:
    """[2]: the (min, max) of several tensors given to a model, from their [n, 2] rows,
    leaving out an attention mask's -inf (see :func:`bad_batch`): the data's range."""
    lo, hi = extremes[:, 0], extremes[:, 1]
    # A mask's row is left out whole: its max 0 beside a row of -inf data would make
    # the merged row read as a mask's.
    mask = (lo == -math.inf) & (hi == 0)
    out = torch.stack((torch.where(mask, math.inf, lo).min(),
                       torch.where(mask, -math.inf, hi).max()))
    return torch.where(mask.all(), 0.0, out)


def nonfinite_since_check(grads: list[torch.Tensor], found: list[torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(how many of ``grads`` hold NaN/inf, the index of the first) where the check that
    ``found`` holds (a GradScaler's ``found_inf_per_device``) found none, else (0, ...):
    gradients the loop made non-finite after the scaler looked, which its step applies.

    One ``_foreach_norm`` per device (one launch for many tensors on CUDA); the grads are
    only read. On the device of the first gradient, no sync."""
    # Runs of one device in the given order, so that the index counts ``grads`` as given.
    runs = [list(gs) for _, gs in itertools.groupby(grads, key=lambda g: g.device)]
    dev0 = grads[0].device
    flags = torch.cat([(~torch.stack(torch._foreach_norm(gs, math.inf)).isfinite()).to(
        dev0, non_blocking=True) for gs in runs])
    clean = torch.stack([f.to(dev0, non_blocking=True).float().sum() for f in found]
                        ).sum() == 0 if found else torch.ones((), dtype=torch.bool,
                                                               device=dev0)
    return flags.sum() * clean, flags.int().argmax()


def upload(values: list[int] | list[float], device: torch.device,
           dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small host list on ``device`` (int64 unless ``dtype``) without a host sync.

    A blocking host->device copy synchronizes the stream on CUDA; a pinned
    source copied with ``non_blocking`` does not (the caching host allocator
    keeps the pinned block alive until the copy has run).
    """
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def stage_size(filed_bytes: int) -> int:
    """Values of a stage for a step that has filed ``filed_bytes`` so far: a
    :data:`STAGE_SHARE` of them, between :data:`STAGE_MIN` and :data:`STAGE_LIMIT`."""
    share = int(filed_bytes * STAGE_SHARE) // 4  # float32 values
    return min(STAGE_LIMIT, max(STAGE_MIN, share))


class Batch:
    """The summaries of one device's tensors in one step, made with batched ops.

    Per tensor, :meth:`add` pays one or two small ops: a copy of a bounded sample
    into a float32 staging buffer (a bfloat16 or float16 value is exact in
    float32) and, for a sampled tensor, its exact min and max over the whole of it
    (one ``aminmax`` pass, no temporary). Whenever the stage is full, and at
    :meth:`finish`, one pass of a few ops takes the min and max of every row the
    stage holds whole (one ``amin`` and ``amax`` per run of rows of one length), then
    turns every staged value of many rows into a histogram code offset by its row
    and counts them all at once. Memory is bounded by the stage and about
    0.5 KB per row, whatever the tensors' sizes; no tensor outlives its ``add``
    call.
    """

    def __init__(self, device_path: bool | None = None, head_start_bytes: int = 0) -> None:
        self._device_path = device_path
        # Bytes counted as filed before the first add, for the stage's size only.
        self._head_start = head_start_bytes
        self.numel: list[int] = []
        self.sampled: list[int] = []
        # The exact min and max of a sampled tensor (or one whose stage copy is not
        # exact), from its own ``aminmax``, and the rows they belong to; a whole-sampled
        # tensor's come from the stage, by its pass (``_stage_extremes``).
        self._mins = _Column()
        self._maxs = _Column()
        self._own_rows: list[int] = []
        self._own_in_stage: list[bool] = []  # per row in the stage: its own aminmax
        # The min and max the passes took from the stage, and the rows they are of.
        self._stage_rows: list[int] = []
        self._stage_mins: list[torch.Tensor] = []
        self._stage_maxs: list[torch.Tensor] = []
        self._stage: torch.Tensor | None = None
        self._used = 0
        self._filed_bytes = 0  # of every tensor filed in this batch, for the stage's size
        self._lengths: list[int] = []  # sample lengths of the rows in the stage
        self._hists: list[torch.Tensor] = []  # [rows, _HIST_COLS] int16 per pass

    def __len__(self) -> int:
        return len(self.numel)

    @property
    def filed_bytes(self) -> int:
        """Bytes of every tensor filed so far (not of their samples)."""
        return self._filed_bytes

    def add(self, x: torch.Tensor) -> int:
        """File ``x`` (floating point, non-empty, strided); returns its row in this batch.

        Safe from anywhere, also inside the user's forward (autocast, a default
        device, a tensor subclass, a dispatch mode): what needs :data:`own_ops`
        enters it, and the usual plain tensor's few ops do not pay for it.
        """
        if own_ops.needed_for(x):
            with own_ops:
                return self._add(x)
        return self._add(x)

    def _add(self, x: torch.Tensor) -> int:
        x = x.detach()
        sample = _sample(x)
        k = sample.numel()
        self._filed_bytes += x.numel() * x.element_size()
        stage = self._stage
        if stage is None or (self._used + k > stage.numel()
                             or len(self._lengths) >= ROWS_PER_PASS):
            with own_ops:  # the pass and a new stage make tensors: the default device
                self._make_room(x.device)
        own = k != x.numel() or x.dtype not in _STAGED_EXACT
        if own:
            mn, mx = torch.aminmax(x)
            self._mins.append(mn)
            self._maxs.append(mx)
            self._own_rows.append(len(self.numel))
        self._own_in_stage.append(own)
        if x.dtype is torch.float64:
            # Beyond float32's range a float64 value would be staged as inf, and counted
            # as one: the largest finite float32 keeps it finite, and beyond every
            # low-precision format's max (its exact min and max are kept above). Below
            # its least subnormal it would be staged as 0, and counted as a zero: that
            # subnormal keeps it non-zero, and below every format's range.
            with own_ops:
                sample = torch.where(sample.isinf(), sample, sample.clamp(-_F32_MAX, _F32_MAX))
                sample = torch.where((sample != 0) & (sample.abs() < _F32_TINY),
                                     torch.copysign(torch.full_like(sample, _F32_TINY), sample),
                                     sample)
        assert self._stage is not None
        self._stage[self._used : self._used + k].copy_(sample)
        self._used += k
        self._lengths.append(k)
        self.numel.append(x.numel())
        self.sampled.append(k)
        return len(self.numel) - 1

    def add_many(self, xs: list[torch.Tensor]) -> list[int]:
        """File every tensor of ``xs`` (as :meth:`add` takes them); returns each one's row
        in this batch, in the order of ``xs``. For tensors the caller holds all at once
        (the parameters' gradients): a small one is filed with no op of its own.

        Whole-sampled tensors (at most :data:`SAMPLE_LIMIT` values, float16, bfloat16 or
        float32: exact in the float32 stage) are filed by shape and dtype, on consecutive
        rows: the tensors of one shape are joined by one ``cat`` (no view per tensor, in
        their own dtype), copied into the stage and reduced there as the lines of a 2-D
        view by their pass (as every whole-sampled tensor is), so their exact min and
        max cost a few ops for all of them. A model repeats a few parameter shapes (a
        GPT's 646 are of seven). Others are filed by :meth:`add`.

        Why the ``cat`` is not written straight into the stage: on the CPU a ``cat`` of
        float16 or bfloat16 tensors into a float32 ``out`` takes a slow path, about ten
        times a same-dtype ``cat`` and a ``copy_`` (review of issue 15, session 59).
        """
        rows = [0] * len(xs)
        by_shape: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
        with own_ops, torch.no_grad():  # a create_graph gradient: no graph for the cat
            for i, x in enumerate(xs):
                if x.numel() <= SAMPLE_LIMIT and x.dtype in _STAGED_EXACT:
                    by_shape.setdefault((x.shape, x.dtype), []).append(i)
                else:
                    rows[i] = self._add(x)
            for (shape, _), group in by_shape.items():
                first = len(self.numel)
                self._file_equal([xs[i] for i in group], shape)
                for r, i in enumerate(group, start=first):
                    rows[i] = r
        return rows

    def _file_equal(self, ts: list[torch.Tensor], shape: tuple[int, ...]) -> None:
        """File whole-sampled tensors of one ``shape`` and dtype, as many per ``cat`` as
        the stage takes, reduced as the ``[n, k]`` lines of their part of the stage."""
        k = math.prod(shape)
        join = torch.stack if len(shape) == 0 else torch.cat  # cat needs a dimension
        nbytes = k * ts[0].element_size()
        i = 0
        while i < len(ts):
            stage = self._stage
            if stage is None or (self._used + k > stage.numel()
                                 or len(self._lengths) >= ROWS_PER_PASS):
                self._make_room(ts[i].device)
                stage = self._stage
                assert stage is not None
            n = min(len(ts) - i, (stage.numel() - self._used) // k,
                    ROWS_PER_PASS - len(self._lengths))
            seg = stage.narrow(0, self._used, n * k)
            # Joined along the first dimension, each tensor is one block of k values in
            # logical order (``reshape`` copies a channels_last join): a line each.
            # (Their min and max are the pass's, as for every whole-sampled tensor.)
            seg.copy_(join(ts[i : i + n]).reshape(-1))
            self._own_in_stage.extend([False] * n)
            self._filed_bytes += n * nbytes
            self._used += n * k
            self._lengths.extend([k] * n)
            self.numel.extend([k] * n)
            self.sampled.extend([k] * n)
            i += n

    def _make_room(self, device: torch.device) -> None:
        """Count a full stage, and make a new one if there is none or it is too small."""
        if self._stage is not None:
            self._pass()
            if self._stage.numel() < stage_size(self._filed_bytes):
                self._stage = None  # grown: the step has filed more since it was made
        if self._stage is None:
            size = stage_size(max(self._filed_bytes, self._head_start))
            self._stage = torch.empty(size, dtype=torch.float32, device=device)

    def _pass(self) -> None:
        rows = len(self._lengths)
        if not rows:
            return
        assert self._stage is not None
        dev = self._stage.device
        runs = _equal_runs(self._lengths)
        self._extremes_of_stage(runs)
        # The staged values are not needed once coded: code them in place (fresh
        # 256 KB temporaries would each be a new mmap, page-faulted on first touch),
        # in as few sweeps as possible: the stage has gone cold in the cache since.
        # (See _CODE_BIAS for the steps. ``nonzero`` is a byte per value, 1 or 0: a
        # quarter of the stage, for this pass only. Bools viewed as int8, because
        # ``sub_`` refuses bools, and an ``add_`` of bools or a ``clamp`` makes a
        # temporary the size of the stage, which the CPU allocator often maps afresh:
        # a GPT step's batch page-faulted 300 times more than before with the clamp,
        # 165 with the bytes, session 62.)
        codes = self._stage[: self._used].view(torch.int32)
        codes.bitwise_and_(_NO_SIGN)
        nonzero = codes.to(torch.bool).view(torch.int8)
        codes >>= _CODE_SHIFT
        codes.sub_(nonzero, alpha=_CODE_BIAS)
        del nonzero
        if len(runs) * _ROW_OP_NS <= _STEPS_FIXED_NS + self._used * _STEPS_NS_PER_VALUE:
            # Few runs of rows of one length (a model's blocks repeat their shapes): one
            # in-place add per run, a row's offset per line of a 2-D view; no buffer.
            start = r = 0
            for k, n in runs:
                span = codes.narrow(0, start, k * n)
                if n == 1:
                    span.add_(_CODE_BIAS + r * CODES_PER_ROW)
                else:
                    span.view(n, k).add_(_row_offsets(dev).narrow(0, r, n))
                start += k * n
                r += n
        else:
            # Many short rows: a step of CODES_PER_ROW at every row start, summed.
            # The buffer lives for this pass only, so that it is not part of the
            # step's peak memory while the model's activations are.
            steps = torch.zeros(self._used, dtype=torch.int32, device=dev)
            steps[0] = _CODE_BIAS
            starts = list(itertools.accumulate(self._lengths[:-1]))
            steps.index_fill_(0, upload(starts, dev), CODES_PER_ROW)
            codes += steps.cumsum_(0)
            del steps  # before the histogram's own transient
        h = exp_histogram(codes, CODES_PER_ROW * rows, self._device_path)
        # Folded now, while small (these live until finish, through the backward),
        # with one index_add (a few ops, however many rows: a pass may hold only one):
        # per row the exponent bins, then the two counts that need the top mantissa
        # bit, NaNs (bin 255 with it set) and code 0 (bin 0 with it clear). int16 holds
        # any count, a row being one sample of at most SAMPLE_LIMIT values.
        folded = torch.zeros(rows, _HIST_COLS, dtype=h.dtype, device=dev)
        folded.index_add_(1, _fold_index(dev), h.view(rows, CODES_PER_ROW))
        self._hists.append(folded.to(torch.int16))
        self._used = 0
        self._lengths = []
        self._own_in_stage = []

    def _extremes_of_stage(self, runs: list[tuple[int, int]]) -> None:
        """The min and max of the staged rows that have no ``aminmax`` of their own,
        taken from the stage before it is coded: exact, as the stage holds such a row's
        every value exactly. One ``amin`` and one ``amax`` along a dim per run of rows of
        one length that holds one (:meth:`finish` then puts the others' own over theirs). It
        replaced an ``aminmax`` and two appends per tensor (session 62)."""
        assert self._stage is not None
        first = len(self.numel) - len(self._lengths)  # the stage's first row
        mins: list[torch.Tensor] = []
        maxs: list[torch.Tensor] = []
        start = r = 0
        for k, n in runs:
            if not all(self._own_in_stage[r : r + n]):
                # (``amin`` and ``amax``, not ``aminmax(dim=1)``: a sixth of its time on
                # the CPU for 16 rows of 4,096; both propagate NaN. ``segment_reduce``
                # over every run at once took 2.5 times as long, for 21 runs.)
                lines = self._stage.narrow(0, start, k * n).view(n, k)
                mins.append(lines.amin(1))
                maxs.append(lines.amax(1))
                self._stage_rows.extend(range(first + r, first + r + n))
            start += k * n
            r += n
        if mins:
            # One tensor per pass, whatever its runs (rows of alternating lengths make
            # a run each): see COMPACT_ROWS.
            self._stage_mins.append(mins[0] if len(mins) == 1 else torch.cat(mins))
            self._stage_maxs.append(maxs[0] if len(maxs) == 1 else torch.cat(maxs))

    def release(self) -> None:
        """Count what is staged and free the stage; a later :meth:`add` makes a new one.

        For a pause in filing that is followed by the user's own allocations (the
        optimizer step after the parameter gradients): the stage is not held then.
        """
        with own_ops:
            self._pass()
        self._stage = None

    def finish(self, extra_rows: int = 0) -> torch.Tensor:
        """``[R + extra_rows, SUMMARY_LEN]`` float64 on the device, one row per tensor
        as :func:`host_rows` wants it: NUMEL left to the host, min, max, the sample's
        non-zero count in the ZEROS column, NaNs and the exponent histogram (zeros
        and float32 subnormals in bin 0, NaNs with infs in bin 255, as in a float32
        exponent histogram). The extra rows are zeros, for the caller's use.

        One allocation: every column is written in place, because on the CPU this
        matrix *is* the step's host copy.
        """
        self.release()
        r = len(self.numel)
        f64 = torch.float64
        dev = self._hists[0].device if self._hists else torch.device("cpu")
        out = torch.zeros(r + extra_rows, SUMMARY_LEN, dtype=f64, device=dev)
        if not r:
            return out
        rows = out[:r]
        # Each row's min and max: from the stage, then a row's own over it (a run
        # that held both kinds took both from the stage).
        for where, mins, maxs in (
                (self._stage_rows, self._stage_mins, self._stage_maxs),
                (self._own_rows, [self._mins.stacked()] if self._own_rows else [],
                 [self._maxs.stacked()] if self._own_rows else [])):
            if not where:
                continue
            mn = mins[0] if len(mins) == 1 else torch.cat(mins)
            mx = maxs[0] if len(maxs) == 1 else torch.cat(maxs)
            if len(where) == r:  # every row, in order
                rows[:, MIN].copy_(mn)
                rows[:, MAX].copy_(mx)
            else:
                idx = upload(where, dev)
                rows[:, MIN].index_copy_(0, idx, mn.to(f64))
                rows[:, MAX].index_copy_(0, idx, mx.to(f64))
        h = torch.cat(self._hists) if len(self._hists) > 1 else self._hists[0]
        rows[:, HIST:].copy_(h[:, :N_EXP_BINS])
        rows[:, NANS].copy_(h[:, _H_NANS])
        rows[:, HIST + N_EXP_BINS - 1] += rows[:, NANS]
        rows[:, HIST] += h[:, _H_CODE0] + h[:, _H_ZEROS]
        # Non-zeros: every sampled value but the exact zeros.
        torch.sub(upload(self.sampled, dev), h[:, _H_ZEROS], out=rows[:, ZEROS])
        self._hists = []
        self._mins, self._maxs = _Column(), _Column()
        self._own_rows, self._stage_rows = [], []
        self._stage_mins, self._stage_maxs = [], []
        return out


def stack_rows(tensors: list[torch.Tensor], device_path: bool | None = None
               ) -> tuple[torch.Tensor, list[int], list[int]]:
    """:meth:`Batch.finish` of ``tensors``, with their element and sample counts."""
    b = Batch(device_path)
    for t in tensors:
        b.add(t)
    return b.finish(), b.numel, b.sampled


def host_rows(rows: torch.Tensor, numel: list[int], sampled: list[int]) -> torch.Tensor:
    """Host copies of :meth:`Batch.finish` -> whole summary rows, in place: NUMEL
    filled in, sample counts scaled to the whole tensor, zeros from non-zeros."""
    n = torch.tensor(numel, dtype=torch.float64)
    rows[:, NUMEL] = n
    rows[:, ZEROS:] *= (n / torch.tensor(sampled, dtype=torch.float64)).unsqueeze(1)
    torch.sub(n, rows[:, ZEROS], out=rows[:, ZEROS])
    # A count: a sample with no zero, scaled by n / sampled, left 1e-12 of one behind
    # (a zero share of 1e-16 in the charts' axis and the JSON). Bin 0 holds the zeros
    # too: it moves with them, so that what it holds beside them stays as sampled (the
    # rounding read as up to half a subnormal value: review 54, an absmax of 2**-126).
    rounded = rows[:, ZEROS].round()
    rows[:, HIST] += rounded - rows[:, ZEROS]
    rows[:, ZEROS] = rounded
    return rows


def summary_row(x: torch.Tensor, device_path: bool | None = None) -> torch.Tensor:
    """A whole summary row of ``x`` on the host; for tests and tools (it syncs)."""
    rows, numel, sampled = stack_rows([x], device_path)
    return host_rows(rows.cpu(), numel, sampled)[0]


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


# Columns of :func:`decode_table`, in :class:`Decoded`'s field order.
DECODED_FIELDS = ("numel", "min", "max", "absmax", "zero_frac", "nonfinite_frac", "nan_count",
                  "inf_count", "overflow_frac", "underflow_frac", "headroom", "over_count")

_BINS = np.arange(N_EXP_BINS - 1, dtype=np.float64)
# Counts below this are no value: the float rounding of a difference of scaled counts.
_HALF_VALUE = 0.5


def _band_sums(hist: np.ndarray, index: np.ndarray, shifts: np.ndarray,
               fmt: FormatLimits) -> tuple[np.ndarray, np.ndarray]:
    """For each ``(index[k], shifts[k])``, the counts of row ``index[k]`` of ``hist`` at
    or below the format's smallest normal, and above its max, after the shift.

    The bands depend on the shift only, and a step has one to three distinct shifts
    (none, the loss scale): one matrix product of the histograms with a band mask
    per shift, then a gather. No copy of the rows.
    """
    distinct, which = np.unique(shifts, return_inverse=True)
    masks = np.zeros((N_EXP_BINS, 2 * len(distinct)))
    for j, sh in enumerate(distinct.tolist()):
        # Bin b holds [2**(b-127), 2**(b-126)): it underflows when its top edge,
        # after the shift, is at or below the smallest normal; fmt.max_exponent is
        # the top edge of the bin holding the max. Bin 255 (inf, NaN) is neither.
        under_bin = min(max(sh + fmt.normal_exponent + _F32_BIAS, 0), N_EXP_BINS - 1)
        over_bin = min(max(sh + fmt.max_exponent + _F32_BIAS, 0), N_EXP_BINS - 1)
        masks[:under_bin, 2 * j] = 1.0
        masks[over_bin : N_EXP_BINS - 1, 2 * j + 1] = 1.0
    # torch's product, as the sums' order (their last bit) was before numpy's ops.
    bands = (torch.from_numpy(hist) @ torch.from_numpy(masks)).numpy()  # [rows, 2 * distinct]
    col = 2 * which.reshape(-1)
    return bands[index, col], bands[index, col + 1]


def decode_table(rows: torch.Tensor, fmt: FormatLimits, shifts: list[int],
                 index: list[int] | None = None) -> torch.Tensor:
    """:func:`decode_many` as a ``[K, len(DECODED_FIELDS)]`` float64 table: whole-matrix
    ops, no per-row Python, and no temporary as large as the rows (a 2,000-layer
    step decodes in a few milliseconds).

    With ``index``, output row ``k`` decodes ``rows[index[k]]`` with ``shifts[k]``
    (one row may be read under several shifts), without copying the rows.

    Host data, in numpy (a zero-copy view of the host rows): each of its thirty-odd
    whole-table ops on a step's few hundred rows costs about a microsecond, where a
    torch op costs several (a decode of the transformer's step took 0.44 ms in torch,
    0.13 ms here). The headroom's ``log2`` stays torch's, whose last bit numpy's does
    not always match, and so is the band sums' matrix product (its order of sums):
    a figure does not change with the library that computes it.
    """
    idx = np.asarray(index if index is not None else range(rows.shape[0]), dtype=np.int64)
    if idx.size == 0:
        return torch.zeros(0, len(DECODED_FIELDS), dtype=torch.float64)
    r = rows.detach().to("cpu", torch.float64).numpy()
    hist = r[:, HIST:]
    sh = np.asarray(shifts, dtype=np.int64)
    under_all, over_fin = _band_sums(hist, idx, sh, fmt)
    numel, mn, mx, zeros, nans = r[idx, :HIST].T
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        infs = np.maximum(hist[idx, N_EXP_BINS - 1] - nans, 0.0)
        # A sampled histogram can miss a lone NaN or inf; the exact min/max
        # never do (aminmax propagates NaN, and an inf is an extreme).
        nans = np.where((np.isnan(mn) | np.isnan(mx)) & (nans < 1), 1.0, nans)
        infs = np.where(((mx == math.inf) | (mn == -math.inf)) & (infs < 1), 1.0, infs)
        div = np.exp2(sh.astype(np.float64))
        has = numel > 0
        absmax = np.where(has, np.maximum(np.abs(mn), np.abs(mx)), 0.0)
        over = over_fin + infs
        over = np.where((over < 1) & has & (absmax / div > fmt.max), 1.0, over)
        absmax = np.where(infs > 0, math.inf, absmax)
        with_nan = (nans > 0) & (infs == 0)
        if with_nan.any():
            # aminmax propagates NaN; fall back to the top populated finite bin.
            sel = with_nan.nonzero()[0]
            populated = hist[idx[sel], : N_EXP_BINS - 1] > 0
            # Bin 0 holds the zeros too: populated only by values besides them
            # (subnormals), at least one (a sampled count is at least n / sampled;
            # below half a value the difference is the float rounding of two scaled
            # counts).
            populated[:, 0] = hist[idx[sel], 0] - zeros[sel] >= _HALF_VALUE
            top_bin = np.where(populated, _BINS, -math.inf).max(1)
            absmax[sel] = np.where(top_bin >= 0, np.exp2(top_bin - _F32_BIAS + 1), 0.0)
        n = np.maximum(numel, 1.0)
        under = under_all - zeros
        table = np.stack([
            numel, mn / div, mx / div, absmax / div,
            np.minimum(zeros / n, 1.0),
            np.minimum((nans + infs) / n, 1.0),
            np.round(nans), np.round(infs),
            np.minimum(over / n, 1.0),
            np.minimum(np.where(under >= _HALF_VALUE, under, 0.0) / n, 1.0),
            # log2(max / 0) = inf (all zeros), log2(max / inf) = -inf, NaN stays NaN.
            # (torch's ``max / t`` is ``t.reciprocal() * max``: its rounding, as before.)
            torch.from_numpy(np.reciprocal(absmax / div) * fmt.max).log2_().numpy(), over,
        ], axis=1)
    return torch.from_numpy(table)


def _absmax_from_hist(hist: list[float]) -> float:
    for b in range(N_EXP_BINS - 2, -1, -1):
        if hist[b]:
            return 2.0 ** (exponent_of_bin(b) + 1)
    return 0.0
