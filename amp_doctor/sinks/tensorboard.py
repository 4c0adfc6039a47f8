"""TensorBoard dashboards of a watched run, written with ``torch.utils.tensorboard``.

(Longer than 500 lines by its tag reference below; the code is ~490 lines. What is drawn
from the finished session lives in :mod:`amp_doctor.sinks.tb_session`.)

Where the files go: the event file is written straight into the run's ``logdir`` (next
to ``amp_doctor.json``), and nowhere else. TensorBoard names a run after its folder
relative to ``--logdir``, so point TensorBoard at the folder that *holds* the runs
(``tensorboard --logdir runs/amp-doctor``, the CLI's default parent) and each run, and
each ``rank<k>/`` of a multi-process run, shows as its own run side by side. Pointing
at one run folder itself names that run ".".

What goes where (tags are stable; see the README section "TensorBoard dashboards"):

* **Per training step, live** (:meth:`TensorBoardSink.on_scaler_step`, called from the
  watch's per-step scaler bookkeeping with the host mirror of the scale; no sync):
  ``scaler/scale``, ``scaler/log2_scale`` (a collapse is a straight line on it),
  ``scaler/skipped``, ``scaler/backoffs`` and ``scaler/resets`` (cumulative counts; a
  reset is a new GradScaler taking over, its scale back at its ``init_scale``). Steps the watch did
  not report live are written from the finished session's timeline at the end.
* **Per recorded step, live** (:meth:`TensorBoardSink.on_step`, right after the step's
  single host copy; everything it reads is already a host float or a host tensor):
  ``loss`` (the step's loss before the loss scale; no point where it was inf/NaN),
  per-layer scalars ``overflow/``, ``underflow/``, ``zeros/``, ``headroom/``,
  ``absmax/``, ``nonfinite/``, ``grad_underflow/``, ``grad_zeros/``,
  ``grad_headroom/``, ``grad_nonfinite/``, ``param_grad_nonfinite/`` (inf/NaN in the
  layer's weight gradients, what a GradScaler skips on) ``<layer>``, and exponent histograms
  ``act_exp/<layer>`` and ``grad_exp/<layer>``. A figure is written only where it is
  a real number: an infinite headroom or absmax (an all-zero output, or inf in it) gets
  no point; the inf/NaN values are counted in ``nonfinite/`` instead. Layers whose
  output and gradient are exactly another layer's (a container returning its last
  child's output) are written once, under the first (innermost) name. A long run's
  live series thin out after :data:`LIVE_FULL_POINTS` recorded steps (see there).
* **At the end** (:meth:`TensorBoardSink.finish`, called by ``Watch.close`` on every exit
  path): ``culprits/<layer>/<figure>``, the per-layer figures of the layers the findings
  name as where inf/NaN or overflow started, in their own section and custom-scalars
  group. One exception to "only where it is a real number" above: their ``headroom`` is
  clipped at minus the format's exponent range (``tb_session.headroom_floor``: -40
  bits in float16, -261 in bfloat16), so a step whose output overflowed to inf
  (headroom -inf) is drawn at that floor instead of leaving the culprit headroom chart
  empty exactly where the culprit overflowed; the chart's title says so. An all-zero
  or all-NaN output (+inf, NaN) still gets no point. For models with more layers than
  ``top_k``, the per-layer scalars of the ``top_k`` riskiest layers; the labelled
  layer x step images ``heatmap/headroom``, ``heatmap/underflow``,
  ``heatmap/grad_headroom`` with their key in text
  ``heatmap_legend``; text ``findings`` (verdict first, then one block per finding) and
  one text ``backoffs`` note per run of consecutive backoffs (a new GradScaler's start a
  run of their own), and one text
  ``scaler_resets`` note listing where a new GradScaler took over. (torch's ``add_text``
  stores text tag ``X`` as ``X/text_summary``.)
* **At start**: the custom-scalars layout (tab "CUSTOM SCALARS": Culprits / Scaler /
  Overflow risk / Underflow / Gradients), so the dashboard is arranged while the run is
  live.

Which layers get per-layer scalars. While the model has at most ``top_k`` layers (the
usual case: the count is known at the first recorded step) every layer is written live
at full resolution. With more layers, writing every layer would bloat the event file
(layers x steps x 10 points), and "riskiest so far" changes during a run, which would
leave charts with holes. So the choice is made once, at the end, from the whole-run
risk order (:func:`~amp_doctor.sinks.text.risk_order`, the same order as the text
report), and those layers' scalars are written from ``session.history`` (every recorded
step in short runs; evenly thinned past 512 records, skipped steps always kept). Their
exponent histograms are the whole-run totals, tagged ``act_exp_total/<layer>`` and
``grad_exp_total/<layer>``, summed live from the raw summaries at constant memory.
Every layer is always in the heatmaps.

Exponent histograms. The x-axis is ``log2|x|`` in bits, one bucket per power of two,
spanning the low-precision format from its smallest subnormal (``2**min_exponent``) to
the power of two above its max (``2**max_exponent``); those two, and the smallest
normal, are bucket edges, and each histogram's description (the card's info icon) names
them. Exact zeros have no place on a log axis: they are the scalar ``zeros/<layer>``,
and their bucket is left empty (so ReLU's zeros no longer look like values at
``2**(m-2)``). Three edge buckets hold what the axis cannot place (``m =
min_exponent``, ``M = max_exponent``):

====================  ===============================================================
bucket [m-2, m-1)     exact zeros: always empty (see ``zeros/<layer>``)
bucket [m-1, m)       non-zero values below the smallest subnormal (they flush to 0)
bucket [e, e+1)       ``2**e <= |x| < 2**(e+1)`` for ``m <= e < M`` (values at or above
                      the format's max are moved out of the top one, into:)
bucket [M, M+1)       finite values beyond the format's max: overflow on a cast
bucket [M+1, M+2)     inf and NaN
====================  ===============================================================

With zeros out, TensorBoard's DISTRIBUTIONS view of these histograms is meaningful: its
bands are percentiles of ``log2|x|`` of the non-zero values, i.e. how many bits the
values span over time, on the same axis as the format's limits.

The on-device summary bins ``|x|`` by its float32 exponent, so float32 subnormals
(``|x| < 2**-126``) are one bin. For float16 they are all below its smallest subnormal;
for bfloat16 (whose subnormals reach ``2**-133``) they are counted in bucket
``[-127, -126)``. ``nonfinite/<layer>`` and ``grad_nonfinite/<layer>`` repeat the
inf/NaN counts as scalars.

Each histogram is written as TensorBoard's own histogram tensor (rows of left edge,
right edge, count), from its first to its last non-empty bucket: the DISTRIBUTIONS
bands then run from the smallest to the largest value there is (TensorBoard takes the
outermost percentiles from the outer edges, so empty end buckets would invent values).
The edges stay the fixed one-bit buckets above, so every step shares one axis.

Steps are written in increasing order per tag: TensorBoard's loader treats a step that
goes back as a restart and drops the later points.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.util import tensor_util
from torch.utils.tensorboard import SummaryWriter

from amp_doctor import format as F
from amp_doctor.device import stats as S
from amp_doctor.dtypes import LOW_PRECISION_DTYPES, FormatLimits, limits, parse_dtype
from amp_doctor.records import LayerStep, Session, StepRecord, TensorStats
from amp_doctor.sinks.tb_session import (
    CULPRIT_GROUPS,
    LAYOUT,
    LOSS_TAG,
    backoff_groups,
    culprit_headroom,
    culprit_layers,
    heatmap_images,
    heatmap_legend,
    layout_with_scalers,
    scaler_resets_note,
    scaler_series,
    scaler_tag_prefix,
)
from amp_doctor.sinks.tbfile import ThreadlessSummaryWriter
from amp_doctor.sinks.text import render_markdown, risk_order
from amp_doctor.steps.listeners import StepRows
from amp_doctor.steps.table import ACT, GRAD, StepTable

__all__ = [
    "TensorBoardSink",
    "ExpBuckets",
    "exp_buckets",
    "exp_counts",
    "exp_counts_many",
    "hist_description",
    "infer_format",
    "layer_scalars",
    "LAYER_GROUPS",
    "FLUSH_SECS",
    "FALLBACK_DTYPE",
    "LIVE_FULL_POINTS",
    "live_stride",
]

# The event file is written at least this often (buffered on the training thread, see
# sinks.tbfile), so a live dashboard trails the run by at most this much.
FLUSH_SECS = 20
# SummaryWriter's queue size (unused by the threadless event file, which buffers by size).
MAX_QUEUE = 1000
# Judge against float16 when the run's format is unknown: it is what watch() uses for
# what-if figures when autocast never ran (see watch.WHAT_IF_DTYPE).
FALLBACK_DTYPE = "float16"
# Live per-layer series (scalars and histograms) get every recorded step for this many
# recorded steps, then one step in 2, 4, 8, ...: each doubling of the run adds half as
# many points again, so 10,000 recorded steps write about 1,600 points per series
# rather than 10,000 (a 20-layer model at every=1: 4.6 MB of events, measured by
# benchmarks/bench_output_size.py). TensorBoard shows a 1,000-point reservoir sample
# of a scalar series anyway. A step with a
# non-finite value or an overflow anywhere, or a skipped optimizer step, is always
# written.
LIVE_FULL_POINTS = 512


def live_stride(i: int) -> int:
    """The stride of the live series at the ``i``-th (0-based) recorded step: the step
    is written when ``i % live_stride(i) == 0``."""
    if i < LIVE_FULL_POINTS:
        return 1
    return 1 << ((i // (LIVE_FULL_POINTS // 2)).bit_length() - 1)


def _notable(rec: StepRecord) -> bool:
    return rec.skipped or bool(StepTable.from_layers(rec.layers).flagged((ACT, GRAD)).any())


# Per-layer scalar groups, in the order the README documents them.
LAYER_GROUPS: tuple[str, ...] = (
    "overflow", "underflow", "zeros", "headroom", "absmax", "nonfinite",
    "grad_underflow", "grad_zeros", "grad_headroom", "grad_nonfinite", "param_grad_nonfinite",
)

# -- exponent histograms ---------------------------------------------------------------

@dataclass(frozen=True)
class ExpBuckets:
    """The fixed log2|x| buckets of one format, and where each float32-exponent bin goes."""

    fmt: FormatLimits
    limits: tuple[float, ...]  # right edge of each bucket (HistogramProto.bucket_limit)
    index: torch.Tensor  # [N_EXP_BINS] long: float32 exponent bin -> bucket
    sub_bucket: int  # where float32 subnormals (and zeros, before correction) land
    top: int  # [max_exponent - 1, max_exponent): holds values just at/above the max
    overflow: int
    nonfinite: int
    zero: int = 0
    flush: int = 1

    @property
    def lefts(self) -> tuple[float, ...]:
        return (self.limits[0] - 1.0, *self.limits[:-1])

    def __len__(self) -> int:
        return len(self.limits)


def exp_buckets(fmt: FormatLimits) -> ExpBuckets:
    """Bucket layout for ``fmt``: see the module docstring for the edge buckets."""
    m, big = fmt.min_exponent, fmt.max_exponent
    n_exp = big - m
    overflow, nonfinite = 2 + n_exp, 3 + n_exp
    limits_ = tuple(float(x) for x in range(m - 1, big + 3))

    def bucket_of_exponent(e: int) -> int:
        if e < m:
            return 1
        if e >= big:
            return overflow
        return 2 + (e - m)

    # float32 subnormals are < 2**-126: below the format's smallest subnormal when that is
    # >= 2**-126 (float16); otherwise put them in [-127, -126), the closest we can resolve.
    sub = 1 if m >= -126 else bucket_of_exponent(-127)
    idx = [sub] + [bucket_of_exponent(S.exponent_of_bin(b)) for b in range(1, S.N_EXP_BINS - 1)]
    idx.append(nonfinite)
    return ExpBuckets(fmt=fmt, limits=limits_, index=torch.tensor(idx, dtype=torch.long),
                      sub_bucket=sub, top=1 + n_exp, overflow=overflow, nonfinite=nonfinite)


def exp_counts(row: torch.Tensor, eb: ExpBuckets) -> list[float]:
    """Bucket counts of one raw host summary row (or a sum of rows) for ``eb``.

    Linear in ``row``, so the counts of a sum of rows are the sum of the counts
    (up to :func:`~amp_doctor.device.stats.decode_many`'s "at least one" beyond the max).
    """
    return exp_counts_many(row.reshape(1, -1), eb)[0]


def exp_counts_many(rows: torch.Tensor, eb: ExpBuckets) -> list[list[float]]:
    """:func:`exp_counts` of each of the raw host rows ``[K, SUMMARY_LEN]``, at once: a
    step's histograms in a few whole-matrix ops (one row at a time, the decode below
    cost about half a millisecond a row, 16 ms a step with 16 live layers)."""
    r = rows.to(torch.float64)
    counts = torch.zeros(r.shape[0], len(eb), dtype=torch.float64)
    counts.index_add_(1, eb.index, r[:, S.HIST:])
    zeros = r[:, S.ZEROS]
    counts[:, eb.sub_bucket] -= zeros
    counts[:, eb.zero] += zeros
    # Values beyond the max that share the top bucket's float32 exponent (a float32
    # 65510 for float16) are known only through the exact max: move them up.
    infs = (counts[:, eb.nonfinite] - r[:, S.NANS]).clamp(min=0.0)
    over = S.decode_table(r, eb.fmt, [0] * r.shape[0])[:, S.DECODED_FIELDS.index("over_count")]
    moved = torch.minimum((over - infs - counts[:, eb.overflow]).clamp(min=0.0),
                          counts[:, eb.top])
    counts[:, eb.top] -= moved
    counts[:, eb.overflow] += moved
    return counts.tolist()


def infer_format(layers: Iterable[LayerStep]) -> FormatLimits | None:
    """The format a step record was judged against, read back from its own numbers.

    watch() decodes every summary with ``headroom = log2(fmt.max / absmax)``, so any
    finite, non-zero figure gives ``log2(fmt.max)`` back. None when no figure does.
    """
    cands = [limits(d) for d in LOW_PRECISION_DTYPES]
    for ls in layers:
        for ts in (ls.act, ls.grad, ls.param_grad):
            if ts is None or not (math.isfinite(ts.absmax) and ts.absmax > 0
                                  and math.isfinite(ts.headroom)):
                continue
            log2max = ts.headroom + math.log2(ts.absmax)
            best = min(cands, key=lambda f: abs(math.log2(f.max) - log2max))
            if abs(math.log2(best.max) - log2max) < 0.5:
                return best
    return None


def hist_description(fmt: FormatLimits) -> str:
    """Markdown for an exponent histogram's card: the axis and the format's limits on it."""
    m, big, n = fmt.min_exponent, fmt.max_exponent, fmt.normal_exponent
    return (
        f"x = log2\\|value\\| in bits, one bar per power of two, judged against {fmt.name}: "
        f"smallest subnormal 2^{m} (x = {m}), smallest normal {F.limit(fmt.smallest_normal)} "
        f"(x = {n}), max {F.limit(fmt.max)} (just below x = {big}). Bar [{m - 1}, {m}): "
        f"non-zero values that flush to 0; [{big}, {big + 1}): finite values beyond the max "
        f"(overflow); [{big + 1}, {big + 2}): inf and NaN. Exact zeros are not drawn: see "
        f"the scalar zeros/<layer>. Values left of x = {n} are subnormal in {fmt.name}."
    )


# -- scalars -----------------------------------------------------------------------------

def _count(ts: TensorStats, frac: float) -> float:
    return float(round(frac * ts.numel))


def layer_scalars(ls: LayerStep, fmt: FormatLimits) -> dict[str, float]:
    """Per-layer scalar group -> value for one step (groups missing = no data).

    Never a stand-in: an infinite headroom (all-zero output: +inf; inf in it: -inf) or
    absmax has no point; the inf/NaN values are counted in ``nonfinite`` instead. Nor
    has the headroom of a tensor with NaN in it: measured on its finite values alone it
    read 21-33 bits of room beside 2016 NaN gradients of 2048 (review 47b).
    """
    del fmt  # the figures are already judged against it; kept for a stable signature
    out: dict[str, float] = {}
    if (a := ls.act) is not None and a.numel:
        out["overflow"] = a.overflow_frac
        out["underflow"] = a.underflow_frac
        out["zeros"] = a.zero_frac
        if math.isfinite(a.headroom) and not a.nonfinite_frac:
            out["headroom"] = a.headroom
        if math.isfinite(a.absmax) and not a.nonfinite_frac:
            # With NaN in it, the absmax is the top of its histogram's bin, up to 2x the
            # true one: a false spike at 32768 or 65536 on the backoff steps (review 56d);
            # an output NaN whole has no finite value at all.
            out["absmax"] = a.absmax
        out["nonfinite"] = _count(a, a.nonfinite_frac)
    if (g := ls.grad) is not None and g.numel:
        # As autograd produced them, i.e. scaled: that is what lives in the format.
        out["grad_underflow"] = g.underflow_frac
        out["grad_zeros"] = g.zero_frac
        if math.isfinite(g.headroom) and not g.nonfinite_frac:
            out["grad_headroom"] = g.headroom
        out["grad_nonfinite"] = _count(g, g.nonfinite_frac)
    if (p := ls.param_grad) is not None and p.numel:
        # The weights' gradients are what GradScaler's skip checks, and what the backoff
        # notes name their layers by; an output gradient can be finite beside them (a
        # float32 layer's, an embedding's) (review 52b).
        out["param_grad_nonfinite"] = _count(p, p.nonfinite_frac)
    return out


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v > 0


# -- the sink ----------------------------------------------------------------------------

class TensorBoardSink:
    """Writes one run's TensorBoard event files into ``logdir`` (never elsewhere).

    ``Watch`` calls :meth:`on_step` after each recorded step's host copy,
    :meth:`on_scaler_step` after every training step's scaler bookkeeping, and
    :meth:`finish` from ``close()``. Several models share one writer (their layer names
    already carry the model prefix); ranks each get their own ``logdir``.
    """

    def __init__(self, logdir: str | Path, top_k: int = 16, dtype: str | None = None,
                 flush_secs: int = FLUSH_SECS) -> None:
        self.logdir = Path(logdir)
        self.top_k = max(0, int(top_k))
        # Known up front only if the caller says; otherwise read from the first record.
        self._fmt: FormatLimits | None = limits(parse_dtype(dtype)) if dtype else None
        self._buckets: ExpBuckets | None = None
        self._seen: dict[str, None] = {}
        self._live: dict[str, None] = {}  # layers written live, every recorded step
        # Layers whose output and gradient were exactly an earlier layer's when first
        # seen (a container returning its last child's output) -> that layer.
        self._dupe_of: dict[str, str] = {}
        self._deferred = False  # more layers than top_k: pick the worst at finish
        # Deferred layers' summed raw rows: (layer, field) -> row of _total_rows.
        self._total_slot: dict[tuple[str, str], int] = {}
        self._total_rows = torch.zeros(0, S.SUMMARY_LEN, dtype=torch.float64)
        self._last_step: int | None = None
        self._recorded = 0  # recorded steps seen by on_step, for live_stride
        # The scaler charts: last step written live, and the live cumulative counts.
        self._scaler_last = -1
        self._skips = 0
        self._backoffs = 0
        self._resets = 0
        self._finished = False
        # Why the event file could not be written (a full disk, the folder deleted by the
        # script), said once at the end instead of a traceback in the user's output.
        self._error: str | None = None
        files = set(self.logdir.glob("events.out.tfevents.*"))
        try:
            # No writer thread: the script would see it (threading.active_count()).
            self._writer: ThreadlessSummaryWriter | None = ThreadlessSummaryWriter(
                log_dir=str(self.logdir), flush_secs=flush_secs, max_queue=MAX_QUEUE)
        except BaseException:
            for f in set(self.logdir.glob("events.out.tfevents.*")) - files:
                with contextlib.suppress(OSError):
                    if f.stat().st_size == 0:
                        f.unlink()  # nothing in it: no empty run for TensorBoard to list
            raise
        self._files = set(self.logdir.glob("events.out.tfevents.*")) - files  # its own
        self._writer.add_custom_scalars(LAYOUT)

    # -- live ------------------------------------------------------------------------
    @property
    def live_layers(self) -> list[str]:
        return list(self._live)

    @property
    def duplicates(self) -> dict[str, str]:
        """Layers left out of the per-layer tags -> the layer whose figures they repeat."""
        return dict(self._dupe_of)

    @property
    def deferred(self) -> bool:
        return self._deferred

    def on_scaler_step(self, step: int, outcome: Any) -> None:
        """Write the loss scaler's state after training step ``step``, as it happens.

        ``outcome`` is the watch's per-step :class:`~amp_doctor.steps.scaler.StepOutcome`
        (``scale_after``, ``skipped``, ``backoff``): the host mirror of the scale, known
        after ``GradScaler.update`` without a sync. A step whose scale is not known yet
        (fused optimizers defer the inf check) is left to :meth:`finish`, which writes
        the steps after the last live one from the session's timeline.
        """
        w = self._writer
        scale = getattr(outcome, "scale_after", None)
        if (self._finished or w is None or step <= self._scaler_last
                or not _finite(scale)):
            return
        assert scale is not None
        self._skips += bool(getattr(outcome, "skipped", False))
        if getattr(outcome, "backoff", False):
            # Two for a step whose scaler.update() ran twice and backed off twice.
            self._backoffs += max(1, int(getattr(outcome, "backoffs", 1)))
        self._resets += int(getattr(outcome, "resets", 0))
        w.add_scalar("scaler/scale", scale, global_step=step)
        w.add_scalar("scaler/log2_scale", math.log2(scale), global_step=step)
        w.add_scalar("scaler/skipped", float(self._skips), global_step=step)
        w.add_scalar("scaler/backoffs", float(self._backoffs), global_step=step)
        w.add_scalar("scaler/resets", float(self._resets), global_step=step)
        self._scaler_last = step

    def on_step(self, rec: StepRecord, hs: StepRows) -> None:
        """Write one recorded step. Reads only host data: no device sync."""
        w = self._writer
        if self._finished or w is None:
            return
        if self._buckets is None:
            fmt = self._fmt or infer_format(rec.layers.values())
            if fmt is None:
                fmt = limits(parse_dtype(FALLBACK_DTYPE))
            self._fmt = fmt
            self._buckets = exp_buckets(fmt)
        eb = self._buckets
        order = list(rec.layers)
        new = [n for n in order if n not in self._seen]
        root = order[-1] if order else None  # hooks run in completion order: root last
        for n in new:
            # A container (a dotted prefix of the layer, or the root) whose output and
            # gradient are exactly a sublayer's: its tags would be exact copies. Only
            # containers: two unrelated layers can both be all-NaN.
            ls = rec.layers[n]
            if ls.act is not None:
                twin = next((m for m in self._seen if m not in self._dupe_of
                             and (m.startswith(n + ".") or n == root)
                             and _same_output(rec.layers.get(m), ls)), None)
                if twin is not None:
                    self._dupe_of[n] = twin
            self._seen[n] = None
        fresh = [n for n in new if n not in self._dupe_of]
        if fresh and not self._deferred:
            if len(self._seen) - len(self._dupe_of) <= self.top_k:
                self._live.update(dict.fromkeys(fresh))
            else:
                self._deferred = True
        step = rec.step
        self._last_step = step
        if rec.loss is not None and math.isfinite(rec.loss):
            w.add_scalar(LOSS_TAG, rec.loss, global_step=step)
        i = self._recorded
        self._recorded += 1
        # Only live layers are thinned; a model with none needs no look at the step.
        write_live = not self._live or i % live_stride(i) == 0 or _notable(rec)
        deferred: list[tuple[str, str]] = []
        hists: list[tuple[str, torch.Tensor]] = []
        for name in rec.layers:
            if name in self._dupe_of:
                continue
            if name not in self._live:
                deferred += [(name, "act"), (name, "grad")]
                continue
            if not write_live:
                continue
            self._write_layer_scalars(w, name, rec.layers[name], step)
            for fld, group in (("act", "act_exp"), ("grad", "grad_exp")):
                row = hs.merged(name, fld)
                if row is not None:
                    hists.append((f"{group}/{name}", row))
        if hists:
            rows = torch.stack([row for _, row in hists])
            for (tag, _), counts in zip(hists, exp_counts_many(rows, eb), strict=True):
                self._write_hist(w, tag, counts, step)
        self._add_totals(hs, deferred)

    def _add_totals(self, hs: StepRows, keys: list[tuple[str, str]]) -> None:
        """Sum the step's rows of ``keys`` into their run totals: summed raw rows are
        enough for exact whole-run counts (exp_counts is linear), at constant memory
        per layer, with one ``index_add_`` a step."""
        keys = [k for k in keys if k in hs.row_of]
        if not keys:
            return
        slot = self._total_slot
        at = [slot.setdefault(k, len(slot)) for k in keys]
        n = self._total_rows.shape[0]
        if len(slot) > n:
            grow = torch.zeros(max(len(slot), 2 * n) - n, S.SUMMARY_LEN, dtype=torch.float64)
            self._total_rows = torch.cat([self._total_rows, grow])
        rows = hs.block.index_select(0, torch.tensor([hs.row_of[k] for k in keys]))
        self._total_rows.index_add_(0, torch.tensor(at), rows.to(torch.float64))

    def _write_layer_scalars(self, w: SummaryWriter, name: str, ls: LayerStep,
                             step: int, prefix: str = "",
                             groups: tuple[str, ...] = LAYER_GROUPS) -> None:
        assert self._fmt is not None
        for group, value in layer_scalars(ls, self._fmt).items():
            if group in groups:
                tag = f"{prefix}{name}/{group}" if prefix else f"{group}/{name}"
                w.add_scalar(tag, value, global_step=step)

    def _write_hist(self, w: SummaryWriter, tag: str, counts: list[float], step: int,
                    eb: ExpBuckets | None = None) -> None:
        eb = eb or self._buckets
        assert eb is not None
        counts = list(counts)
        # Exact zeros have no place on a log axis: they are the zeros/ scalar.
        counts[eb.zero] = 0.0
        if not any(c > 0 for c in counts):
            return
        # Written as TensorBoard's own histogram tensor ([k, 3]: left edge, right edge,
        # count), as tf.summary.histogram does, from the first to the last non-empty
        # bucket: TensorBoard's DISTRIBUTIONS take the lowest and highest percentiles
        # from the outer edges, so empty end buckets would draw values that do not
        # exist. The card's description (its info icon) names the format's limits on
        # the axis, which TensorBoard cannot draw as lines.
        nonzero = [i for i, c in enumerate(counts) if c > 0]
        rows = [[lo, hi, c] for lo, hi, c in zip(eb.lefts, eb.limits, counts, strict=True)]
        rows = rows[nonzero[0]: nonzero[-1] + 1]
        value = summary_pb2.Summary.Value(
            tag=tag,
            metadata=histogram_metadata.create_summary_metadata(
                display_name=tag, description=hist_description(eb.fmt)),
            tensor=tensor_util.make_tensor_proto(np.asarray(rows, dtype=np.float64)))
        w._get_file_writer().add_summary(summary_pb2.Summary(value=[value]), step)

    # -- end of run ----------------------------------------------------------------------
    def finish(self, session: Session) -> None:
        """Write the end-of-run parts, flush and close. Idempotent; never raises.

        Each part is independent: one failing (it is reported as a warning, since this
        runs while ``watch`` exits, possibly on the user's own exception) does not keep
        the others, or the flush, from happening.
        """
        if self._finished:
            return
        self._finished = True
        failed: list[str] = []
        try:
            w = self._writer
            if w is None:
                return
            fmt = self._session_format(session)
            parts: list[tuple[str, Callable[[], None]]] = [
                ("scaler", lambda: self._write_scaler(w, session)),
                ("culprits", lambda: self._write_culprits(w, session)),
                ("top-k layers", lambda: self._write_deferred(w, session)),
                ("heatmaps", lambda: self._write_heatmaps(w, session, fmt)),
                ("text", lambda: self._write_text(w, session)),
            ]
            for what, part in parts:
                try:
                    part()
                except Exception as e:  # noqa: BLE001 - reported below, never fatal
                    failed.append(f"{what}: {e!r}")
        finally:
            self.close()
        if failed:
            warnings.warn("amp-doctor: some TensorBoard output was not written: "
                          + "; ".join(failed), RuntimeWarning, stacklevel=2)

    @property
    def error(self) -> str | None:
        """Why the event file could not be written, if it could not (said once, at the
        end, by the caller)."""
        w = self._writer
        return self._error or (w.error if w is not None else None)

    def close(self) -> None:
        """Flush and close the event file (idempotent). ``finish`` calls it. A write that
        fails is kept in :attr:`error`, not raised."""
        w, self._writer = self._writer, None
        self._finished = True
        if w is not None:
            try:
                try:
                    w.flush()
                finally:
                    w.close()
            except Exception as e:  # noqa: BLE001 - said by the caller, from self.error
                self._error = self._error or f"{type(e).__name__}: {e}"
            self._error = self._error or w.error

    def discard(self) -> None:
        """Close, and remove the event files this writer made: a run with nothing to
        show (a script that printed its help) leaves no empty run for TensorBoard."""
        self.close()
        for f in self._files:
            with contextlib.suppress(OSError):
                f.unlink()

    def _session_format(self, session: Session) -> FormatLimits:
        if session.amp.dtype:
            try:
                return limits(parse_dtype(session.amp.dtype))
            except ValueError:
                pass
        return self._fmt or limits(parse_dtype(FALLBACK_DTYPE))

    def _final_step(self, session: Session) -> int:
        return max(session.steps - 1, self._last_step or 0, 0)

    def _write_scaler(self, w: SummaryWriter, session: Session) -> None:
        # Only after the last live point: a step that goes back would make TensorBoard
        # drop the later points as if the run had restarted.
        for tag, pts in scaler_series(session, after=self._scaler_last).items():
            for step, value in pts:
                w.add_scalar(tag, value, global_step=step)
        for other in session.other_scalers:  # not written live: all at once, here
            prefix = scaler_tag_prefix(other)
            for tag, pts in scaler_series(session, sc=other, prefix=prefix).items():
                for step, value in pts:
                    w.add_scalar(tag, value, global_step=step)
        w.add_custom_scalars(layout_with_scalers(session))

    def _write_culprits(self, w: SummaryWriter, session: Session) -> None:
        self._fmt = self._fmt or self._session_format(session)
        known = {lay.name for lay in session.layers}
        for name in culprit_layers(session):
            if name not in known:
                continue
            for rec in session.history:  # step order
                ls = rec.layers.get(name)
                if ls is None:
                    continue
                self._write_layer_scalars(w, name, ls, rec.step, prefix="culprits/",
                                          groups=_CULPRIT_PLAIN)
                # Its headrooms, clipped: inf/NaN in it is drawn at the floor.
                for tag, ts in (("headroom", ls.act), ("grad_headroom", ls.grad)):
                    if ts is None or not ts.numel:
                        continue
                    h = culprit_headroom(-math.inf if ts.nonfinite_frac else ts.headroom,
                                         self._fmt)
                    if h is not None:
                        w.add_scalar(f"culprits/{name}/{tag}", h, global_step=rec.step)

    def chosen_layers(self, session: Session) -> list[str]:
        """Layers with per-layer scalars: all live ones, else the ``top_k`` riskiest."""
        if not self._deferred:
            return list(self._live)
        ranked = risk_order([lay for lay in session.layers if lay.recorded_steps
                             and not lay.passthrough and lay.name not in self._dupe_of])
        worst = [lay.name for lay in ranked[: self.top_k]]
        return list(dict.fromkeys([*self._live, *worst]))

    def _write_deferred(self, w: SummaryWriter, session: Session) -> None:
        if not self._deferred:
            return
        self._fmt = self._fmt or self._session_format(session)
        eb = self._buckets or exp_buckets(self._fmt)
        extra = [n for n in self.chosen_layers(session) if n not in self._live]
        for name in extra:
            for rec in session.history:  # step order
                ls = rec.layers.get(name)
                if ls is not None:
                    self._write_layer_scalars(w, name, ls, rec.step)
            for fld, group in (("act", "act_exp_total"), ("grad", "grad_exp_total")):
                at = self._total_slot.get((name, fld))
                if at is not None:
                    acc = self._total_rows[at]
                    self._write_hist(w, f"{group}/{name}", exp_counts(acc, eb),
                                     self._final_step(session), eb)

    def _write_heatmaps(self, w: SummaryWriter, session: Session, fmt: FormatLimits) -> None:
        step = self._final_step(session)
        images = heatmap_images(session, fmt)
        for tag, img in images.items():
            w.add_image(tag, img, global_step=step, dataformats="HWC")
        if images:
            w.add_text("heatmap_legend", heatmap_legend(session, fmt), global_step=step)

    def _write_text(self, w: SummaryWriter, session: Session) -> None:
        for step, md in backoff_groups(session):
            w.add_text("backoffs", md, global_step=step)
        resets = scaler_resets_note(session)
        if resets is not None:
            w.add_text("scaler_resets", resets[1], global_step=resets[0])
        w.add_text("findings", render_markdown(session), global_step=self._final_step(session))


# The culprit figures written as they are; their headroom is written clipped.
_CULPRIT_PLAIN = tuple(g for g in CULPRIT_GROUPS if g not in ("headroom", "grad_headroom"))


def _same_stats(a: TensorStats | None, b: TensorStats | None) -> bool:
    if a is None or b is None:
        return a is b
    # Field by field, with NaN equal to NaN: an all-NaN output is still the same output.
    return all(x == y or (isinstance(x, float) and isinstance(y, float)
                          and math.isnan(x) and math.isnan(y))
               for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True))


def _same_output(a: LayerStep | None, b: LayerStep) -> bool:
    return (a is not None and a.act is not None and _same_stats(a.act, b.act)
            and _same_stats(a.grad, b.grad))
