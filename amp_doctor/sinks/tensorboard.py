"""TensorBoard dashboards of a watched run, written with ``torch.utils.tensorboard``.

What goes where (tags are stable; see the README section "TensorBoard dashboards"):

* **Per recorded step, live** (:meth:`TensorBoardSink.on_step`, right after the step's
  single host copy; everything it reads is already a host float or a host tensor):
  per-layer scalars ``overflow/``, ``underflow/``, ``headroom/``, ``absmax/``,
  ``nonfinite/``, ``grad_underflow/``, ``grad_headroom/``, ``grad_nonfinite/``
  ``<layer>``, and exponent histograms ``act_exp/<layer>`` and ``grad_exp/<layer>``.
* **At the end** (:meth:`TensorBoardSink.finish`, called by ``Watch.close`` on every exit
  path): the loss-scaler timeline ``scaler/scale``, ``scaler/skipped``,
  ``scaler/backoffs`` (it covers every training step, not only recorded ones, and only
  the finished session knows the steps that were not recorded); for models with more
  layers than ``top_k``, the per-layer scalars of the ``top_k`` riskiest layers; the
  layer x step images ``heatmap/headroom``, ``heatmap/underflow``,
  ``heatmap/grad_headroom`` with their key in text ``heatmap_legend``; text ``findings``
  (the markdown report) and one text ``backoffs`` note per run of consecutive backoffs.
  (torch's ``add_text`` stores text tag ``X`` as ``X/text_summary``.)
* **At start**: the custom-scalars layout (tab "CUSTOM SCALARS": Scaler / Overflow
  risk / Underflow / Gradients), so the dashboard is arranged while the run is live.

Which layers get per-layer scalars. While the model has at most ``top_k`` layers (the
usual case: the count is known at the first recorded step) every layer is written live
at full resolution. With more layers, writing every layer would bloat the event file
(layers x steps x 8 points), and "riskiest so far" changes during a run, which would
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
normal, are bucket edges. Nothing is dropped: four edge buckets hold what a log axis
cannot place (``m = min_exponent``, ``M = max_exponent``):

====================  ===============================================================
bucket [m-2, m-1)     exact zeros
bucket [m-1, m)       non-zero values below the smallest subnormal (they flush to 0)
bucket [e, e+1)       ``2**e <= |x| < 2**(e+1)`` for ``m <= e < M`` (values at or above
                      the format's max are moved out of the top one, into:)
bucket [M, M+1)       finite values beyond the format's max: overflow on a cast
bucket [M+1, M+2)     inf and NaN
====================  ===============================================================

The on-device summary bins ``|x|`` by its float32 exponent, so float32 subnormals
(``|x| < 2**-126``) are one bin. For float16 they are all below its smallest subnormal;
for bfloat16 (whose subnormals reach ``2**-133``) they are counted in bucket
``[-127, -126)``. ``nonfinite/<layer>`` and ``grad_nonfinite/<layer>`` repeat the
inf/NaN counts as scalars.

Histogram ``min``/``max`` are the layout's outer edges, so TensorBoard's default (fast,
Rust) loader draws every step on one fixed axis, empty buckets included. TensorBoard's
legacy Python loader (``--load_fast=false``) drops empty end buckets and stretches the
outermost non-empty ones to ``min``/``max``; the counts stay right, only those two
buckets look wider.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

from .. import stats as S
from ..dtypes import LOW_PRECISION_DTYPES, FormatLimits, limits, parse_dtype
from ..recorder import HostStep
from ..records import LayerStep, Session, StepRecord, TensorStats
from .text import render_markdown, risk_order

__all__ = [
    "TensorBoardSink",
    "ExpBuckets",
    "exp_buckets",
    "exp_counts",
    "infer_format",
    "layer_scalars",
    "scaler_series",
    "heatmap_images",
    "heatmap_legend",
    "backoff_groups",
    "LAYOUT",
    "LAYER_GROUPS",
    "FLUSH_SECS",
    "HEATMAP_MAX_BITS",
    "FALLBACK_DTYPE",
]

# SummaryWriter's own background thread flushes this often, so a live dashboard trails
# the run by at most this much without a flush (a file sync) in the training loop.
FLUSH_SECS = 20
# Events queued before an ``add_*`` call hands them to the writer thread. A recorded
# step of a 16-layer model makes ~160 events; a larger queue means fewer wake-ups.
MAX_QUEUE = 1000
# Judge against float16 when the run's format is unknown: it is what watch() uses for
# what-if figures when autocast never ran (see watch.WHAT_IF_DTYPE).
FALLBACK_DTYPE = "float16"
# Headroom colours saturate here: beyond ~32 bits a layer is nowhere near overflow, and a
# wider ramp would wash out the 0-16 bits where float16 runs live.
HEATMAP_MAX_BITS = 32.0
# Pixels per heatmap cell, shrunk for big models/long runs to keep the image ~1k pixels.
_CELL_MAX = 16
_IMAGE_TARGET = 1024

# Per-layer scalar groups, in the order the README documents them.
LAYER_GROUPS: tuple[str, ...] = (
    "overflow", "underflow", "headroom", "absmax", "nonfinite",
    "grad_underflow", "grad_headroom", "grad_nonfinite",
)

# The custom-scalars tab. Regexes are anchored: the plugin's backend uses re.match, and
# the anchors keep e.g. "underflow/" from also matching "grad_underflow/" anywhere.
LAYOUT: dict[str, dict[str, list[Any]]] = {
    "Scaler": {
        "loss scale (after each update)": ["Multiline", [r"^scaler/scale$"]],
        "skipped optimizer steps (cumulative)": ["Multiline", [r"^scaler/skipped$"]],
        "scale backoffs (cumulative)": ["Multiline", [r"^scaler/backoffs$"]],
    },
    "Overflow risk": {
        "headroom to the format's max (bits; < 0 = overflow)": ["Multiline", [r"^headroom/"]],
        "share of outputs >= format max": ["Multiline", [r"^overflow/"]],
        "inf/NaN outputs (count)": ["Multiline", [r"^nonfinite/"]],
        "max |output|": ["Multiline", [r"^absmax/"]],
    },
    "Underflow": {
        "share of non-zero outputs below the smallest normal": ["Multiline", [r"^underflow/"]],
    },
    "Gradients": {
        "share of (scaled) output grads below the smallest normal": [
            "Multiline", [r"^grad_underflow/"]],
        "headroom of (scaled) output grads (bits)": ["Multiline", [r"^grad_headroom/"]],
        "inf/NaN output grads (count)": ["Multiline", [r"^grad_nonfinite/"]],
    },
}

_RGB = tuple[int, int, int]
# viridis at 0, .25, .5, .75, 1: perceptually even and readable by colour-blind users.
_VIRIDIS: tuple[_RGB, ...] = (
    (68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
# Marks that are not on the ramp, so they cannot be mistaken for a value.
_NONFINITE_RGB: _RGB = (255, 0, 0)
_OVERFLOW_RGB: _RGB = (255, 0, 255)
_MISSING_RGB: _RGB = (128, 128, 128)
_GRID = 24


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
    (up to :func:`~amp_doctor.stats.decode_many`'s "at least one" beyond the max).
    """
    r = row.to(torch.float64)
    counts = torch.zeros(len(eb), dtype=torch.float64)
    counts.index_add_(0, eb.index, r[S.HIST:])
    out = counts.tolist()
    zeros = float(r[S.ZEROS])
    out[eb.sub_bucket] -= zeros
    out[eb.zero] += zeros
    # Values beyond the max that share the top bucket's float32 exponent (a float32
    # 65510 for float16) are known only through the exact max: move them up.
    infs = out[eb.nonfinite] - float(r[S.NANS])
    finite_over = S.decode_many(r.reshape(1, -1), eb.fmt, [0])[0].over_count - max(infs, 0.0)
    moved = min(max(finite_over - out[eb.overflow], 0.0), out[eb.top])
    out[eb.top] -= moved
    out[eb.overflow] += moved
    return out


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


# -- scalars -----------------------------------------------------------------------------

def _clamp_headroom(h: float, span: float) -> float | None:
    # +inf (an all-zero output) and -inf (inf in the output) would wreck the chart's
    # y-range; clamp to the format's whole range in bits. NaN is "no data": no point.
    if math.isnan(h):
        return None
    return max(-span, min(span, h))


def _count(ts: TensorStats, frac: float) -> float:
    return float(round(frac * ts.numel))


def layer_scalars(ls: LayerStep, fmt: FormatLimits) -> dict[str, float]:
    """Per-layer scalar group -> value for one step (groups missing = no data)."""
    span = float(fmt.max_exponent - fmt.min_exponent)
    out: dict[str, float] = {}
    if (a := ls.act) is not None and a.numel:
        out["overflow"] = a.overflow_frac
        out["underflow"] = a.underflow_frac
        if (h := _clamp_headroom(a.headroom, span)) is not None:
            out["headroom"] = h
        if math.isfinite(a.absmax):  # inf is counted in nonfinite/ instead
            out["absmax"] = a.absmax
        out["nonfinite"] = _count(a, a.nonfinite_frac)
    if (g := ls.grad) is not None and g.numel:
        # As autograd produced them, i.e. scaled: that is what lives in the format.
        out["grad_underflow"] = g.underflow_frac
        if (h := _clamp_headroom(g.headroom, span)) is not None:
            out["grad_headroom"] = h
        out["grad_nonfinite"] = _count(g, g.nonfinite_frac)
    return out


def scaler_series(session: Session) -> dict[str, list[tuple[int, float]]]:
    """``scaler/*`` points in step order, exactly as the session's timeline has them.

    ``scaler/skipped`` and ``scaler/backoffs`` are cumulative counts (a rise is an
    event; thinning of the timeline cannot hide one), sampled at every step of the scale
    timeline and at every skip/backoff.
    """
    sc = session.scaler
    if sc is None or not sc.enabled:
        return {}
    out: dict[str, list[tuple[int, float]]] = {
        "scaler/scale": [(int(st), float(v)) for st, v in sc.scale if math.isfinite(v)]}
    steps = sorted({st for st, _ in sc.scale} | set(sc.skipped_steps) | set(sc.backoff_steps))
    for tag, events in (("scaler/skipped", sorted(sc.skipped_steps)),
                        ("scaler/backoffs", sorted(sc.backoff_steps))):
        pts, i = [], 0
        for st in steps:
            while i < len(events) and events[i] <= st:
                i += 1
            pts.append((int(st), float(i)))
        out[tag] = pts
    return out


# -- heatmaps ----------------------------------------------------------------------------

def _ramp(t: torch.Tensor) -> torch.Tensor:
    """[H, W] values in [0, 1] -> [3, H, W] float RGB along viridis."""
    anchors = torch.tensor(_VIRIDIS, dtype=torch.float64)  # [5, 3]
    pos = t.clamp(0, 1) * (len(_VIRIDIS) - 1)
    lo = pos.floor().long().clamp(max=len(_VIRIDIS) - 2)
    frac = (pos - lo).unsqueeze(-1)
    rgb = anchors[lo] * (1 - frac) + anchors[lo + 1] * frac  # [H, W, 3]
    return rgb.permute(2, 0, 1)


def _paint(rgb: torch.Tensor, mask: torch.Tensor, colour: _RGB) -> None:
    for c in range(3):
        rgb[c][mask] = colour[c]


def _cell(n: int) -> int:
    return max(1, min(_CELL_MAX, _IMAGE_TARGET // max(n, 1)))


def _upscale(img: torch.Tensor, ch: int, cw: int) -> torch.Tensor:
    big = img.repeat_interleave(ch, dim=1).repeat_interleave(cw, dim=2)
    # A dark line between cells keeps neighbouring rows (layers) and columns (steps)
    # apart when they have the same colour; only where cells are big enough to spare it.
    if ch >= 4:
        big[:, ch - 1 :: ch, :] = _GRID
    if cw >= 4:
        big[:, :, cw - 1 :: cw] = _GRID
    return big


# The heatmaps: (tag, LayerStep field, figure). Headroom ramps from "no bits left"
# (bright) to plenty (dark); underflow from none (dark) to all values (bright).
_HEATMAPS: tuple[tuple[str, str, str], ...] = (
    ("heatmap/headroom", "act", "headroom"),
    ("heatmap/underflow", "act", "underflow"),
    ("heatmap/grad_headroom", "grad", "headroom"),
)


def heatmap_images(session: Session, fmt: FormatLimits) -> dict[str, torch.Tensor]:
    """Layer x step pictures as uint8 [3, H, W] images, keyed by tag.

    Rows are every layer in forward order (``session.layers``), columns the recorded
    steps of ``session.history``. ``heatmap/headroom`` (outputs) and
    ``heatmap/grad_headroom`` (output gradients, scaled): yellow = no headroom left,
    purple = ``HEATMAP_MAX_BITS`` or more. ``heatmap/underflow``: purple = none, yellow =
    every non-zero output below the smallest normal. In all of them, red = inf/NaN,
    magenta = values beyond the format's max (overflow; what-if for a float32
    layer), grey = no data for that layer in that step.
    """
    names = [lay.name for lay in session.layers]
    steps = session.history
    rows, cols = len(names), len(steps)
    if not rows or not cols:
        return {}
    bits = min(HEATMAP_MAX_BITS, float(fmt.max_exponent - fmt.normal_exponent))
    ch, cw = _cell(rows), _cell(cols)
    out: dict[str, torch.Tensor] = {}
    for tag, fld, figure in _HEATMAPS:
        val = torch.full((rows, cols), math.nan, dtype=torch.float64)
        nonfinite = torch.zeros(rows, cols, dtype=torch.bool)
        overflow = torch.zeros(rows, cols, dtype=torch.bool)
        for c, rec in enumerate(steps):
            for r, name in enumerate(names):
                ls = rec.layers.get(name)
                ts: TensorStats | None = getattr(ls, fld) if ls is not None else None
                if ts is None or not ts.numel:
                    continue
                v = ts.headroom if figure == "headroom" else ts.underflow_frac
                # NaN headroom (NaN-only output) is still data: the red mark covers it.
                val[r, c] = v if not math.isnan(v) else 0.0
                nonfinite[r, c] = ts.nonfinite_frac > 0
                overflow[r, c] = ts.overflow_frac > 0
        missing = val.isnan()
        if figure == "headroom":
            t = 1.0 - torch.nan_to_num(val, nan=bits, posinf=bits, neginf=0.0) / bits
        else:
            t = torch.nan_to_num(val, nan=0.0)
        img = _ramp(t)
        _paint(img, missing, _MISSING_RGB)
        _paint(img, overflow & ~nonfinite, _OVERFLOW_RGB)
        _paint(img, nonfinite, _NONFINITE_RGB)
        out[tag] = _upscale(img.round().clamp(0, 255).to(torch.uint8), ch, cw)
    return out


def heatmap_legend(session: Session, fmt: FormatLimits) -> str:
    """Markdown key for the heatmaps: colours, rows (layers) and columns (steps)."""
    names = [lay.name for lay in session.layers]
    steps = [rec.step for rec in session.history]
    bits = min(HEATMAP_MAX_BITS, float(fmt.max_exponent - fmt.normal_exponent))
    lines = [
        f"**Heatmaps: layers (rows, forward order) x recorded steps (columns), "
        f"judged against {fmt.name}.**",
        "",
        f"* `heatmap/headroom`: bits between max\\|output\\| and {fmt.name}'s max "
        f"({fmt.max:g}). Yellow = 0 bits left, purple = {bits:g} bits or more.",
        "* `heatmap/grad_headroom`: the same for the layer's output gradients, as scaled "
        "by the GradScaler (what the backward pass holds).",
        "* `heatmap/underflow`: share of non-zero outputs below the smallest normal "
        f"({fmt.smallest_normal:g}). Purple = none, yellow = all.",
        "* red = inf/NaN; magenta = values beyond the max (overflow, or "
        "would-overflow for a float32 layer); grey = not recorded.",
        "",
        f"Columns: {len(steps)} recorded steps"
        + (f", step {steps[0]} (left) to {steps[-1]} (right)." if steps else "."),
        "",
        "| row | layer |",
        "|---|---|",
    ]
    lines += [f"| {i} | {n} |" for i, n in enumerate(names)]
    return "\n".join(lines) + "\n"


# -- text --------------------------------------------------------------------------------

def backoff_groups(session: Session) -> list[tuple[int, str]]:
    """One markdown note per run of consecutive backoffs: (first step, text)."""
    sc = session.scaler
    if sc is None:
        return []
    evs = sorted((e for e in sc.events if e.kind == "backoff"), key=lambda e: e.step)
    groups: list[list[Any]] = []
    for e in evs:
        if groups and e.step - groups[-1][-1].step <= 1:
            groups[-1].append(e)
        else:
            groups.append([e])
    out = []
    for g in groups:
        first, last = g[0], g[-1]
        span = f"step {first.step}" if len(g) == 1 else f"steps {first.step}-{last.step}"
        lines = [f"**Scale backoff, {span}**: {len(g)} skipped update(s), scale "
                 f"{first.scale_before:.7g} -> {last.scale_after:.7g}."]
        origins = sorted({e.forward_origin for e in g if e.forward_origin})
        if origins:
            lines.append(f"* forward pass overflowed first in: {', '.join(origins)}")
        culprits: dict[str, None] = {}
        for e in g:
            culprits.update(dict.fromkeys(e.culprits))
        if culprits:
            shown = list(culprits)[:10]
            more = len(culprits) - len(shown)
            lines.append("* non-finite gradients in (backward order): " + ", ".join(shown)
                         + (f" and {more} more" if more else ""))
        out.append((first.step, "\n".join(lines) + "\n"))
    return out


# -- the sink ----------------------------------------------------------------------------

class TensorBoardSink:
    """Writes one run's TensorBoard event files into ``logdir`` (never elsewhere).

    ``Watch`` calls :meth:`on_step` after each recorded step's host copy and
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
        self._deferred = False  # more layers than top_k: pick the worst at finish
        self._totals: dict[tuple[str, str], torch.Tensor] = {}  # deferred: summed raw rows
        self._last_step: int | None = None
        self._finished = False
        self._writer: SummaryWriter | None = SummaryWriter(
            log_dir=str(self.logdir), flush_secs=flush_secs, max_queue=MAX_QUEUE)
        self._writer.add_custom_scalars(LAYOUT)

    # -- live ------------------------------------------------------------------------
    @property
    def live_layers(self) -> list[str]:
        return list(self._live)

    @property
    def deferred(self) -> bool:
        return self._deferred

    def on_step(self, rec: StepRecord, hs: HostStep) -> None:
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
        new = [n for n in rec.layers if n not in self._seen]
        self._seen.update(dict.fromkeys(new))
        if new and not self._deferred:
            if len(self._seen) <= self.top_k:
                self._live.update(dict.fromkeys(new))
            else:
                self._deferred = True
        step = rec.step
        self._last_step = step
        for name, ls in rec.layers.items():
            if name in self._live:
                self._write_layer_scalars(w, name, ls, step)
                for fld, group in (("act", "act_exp"), ("grad", "grad_exp")):
                    row = hs.merged(name, fld)
                    if row is not None:
                        self._write_hist(w, f"{group}/{name}", exp_counts(row, eb), step)
            else:
                # Summed raw rows are enough for exact whole-run counts (exp_counts is
                # linear), at constant memory per layer.
                for fld in ("act", "grad"):
                    row = hs.merged(name, fld)
                    if row is None:
                        continue
                    acc = self._totals.get((name, fld))
                    self._totals[(name, fld)] = (
                        row.to(torch.float64).clone() if acc is None else acc.add_(row))

    def _write_layer_scalars(self, w: SummaryWriter, name: str, ls: LayerStep,
                             step: int) -> None:
        assert self._fmt is not None
        for group, value in layer_scalars(ls, self._fmt).items():
            w.add_scalar(f"{group}/{name}", value, global_step=step)

    def _write_hist(self, w: SummaryWriter, tag: str, counts: list[float], step: int,
                    eb: ExpBuckets | None = None) -> None:
        eb = eb or self._buckets
        assert eb is not None
        if not any(c > 0 for c in counts):
            return
        lefts = eb.lefts
        mids = [(lo + hi) / 2 for lo, hi in zip(lefts, eb.limits, strict=True)]
        # TensorBoard's data server draws bucket i from bucket_limit[i-1] (the first one
        # from `min`) to bucket_limit[i] (the last one to `max`), empty ones included. So
        # min/max are the layout's outer edges: every step shares one fixed x-axis that
        # runs from the zero bucket to the inf/NaN bucket, with the format's limits on it.
        w.add_histogram_raw(
            tag,
            min=lefts[0],
            max=eb.limits[-1],
            num=sum(counts),
            sum=sum(c * x for c, x in zip(counts, mids, strict=True)),
            sum_squares=sum(c * x * x for c, x in zip(counts, mids, strict=True)),
            bucket_limits=list(eb.limits),
            bucket_counts=counts,
            global_step=step,
        )

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

    def close(self) -> None:
        """Flush and close the event file (idempotent). ``finish`` calls it."""
        w, self._writer = self._writer, None
        self._finished = True
        if w is not None:
            try:
                w.flush()
            finally:
                w.close()

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
        for tag, pts in scaler_series(session).items():
            for step, value in pts:
                w.add_scalar(tag, value, global_step=step)

    def chosen_layers(self, session: Session) -> list[str]:
        """Layers with per-layer scalars: all live ones, else the ``top_k`` riskiest."""
        if not self._deferred:
            return list(self._live)
        ranked = risk_order([lay for lay in session.layers if lay.recorded_steps])
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
                acc = self._totals.get((name, fld))
                if acc is not None:
                    self._write_hist(w, f"{group}/{name}", exp_counts(acc, eb),
                                     self._final_step(session), eb)

    def _write_heatmaps(self, w: SummaryWriter, session: Session, fmt: FormatLimits) -> None:
        step = self._final_step(session)
        images = heatmap_images(session, fmt)
        for tag, img in images.items():
            w.add_image(tag, img, global_step=step, dataformats="CHW")
        if images:
            w.add_text("heatmap_legend", heatmap_legend(session, fmt), global_step=step)

    def _write_text(self, w: SummaryWriter, session: Session) -> None:
        for step, md in backoff_groups(session):
            w.add_text("backoffs", md, global_step=step)
        w.add_text("findings", render_markdown(session), global_step=self._final_step(session))
