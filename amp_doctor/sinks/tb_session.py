"""What the TensorBoard dashboards show of a finished session, apart from the per-step
scalars: the custom-scalars layout, the scale timeline as ``scaler/*`` series, where
inf/NaN or overflow started (culprit layers, origin cells), the layer x step heatmaps'
grids and legend, and the notes on each run of scale backoffs.

Everything here is a pure function of a :class:`~amp_doctor.records.Session` (host
numbers only); :mod:`amp_doctor.sinks.tensorboard` writes it.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from typing import Any

import numpy as np
import torch

from amp_doctor import format as F
from amp_doctor.analysis.thresholds import ALL_ZERO_SHOWN
from amp_doctor.dtypes import FormatLimits, limits
from amp_doctor.records import (
    HEATMAP_FIGURES,
    LayerHeatmaps,
    ScalerEvent,
    ScalerTimeline,
    Session,
)
from amp_doctor.sinks.heatmap import (
    HEATMAP_MAX_BITS,
    HeatmapGrid,
    merged_columns,
    render_heatmap,
)
from amp_doctor.steps.heatmaps import (
    ACT_NONFINITE,
    ACT_OVERFLOW,
    GRAD_NONFINITE,
    GRAD_OVERFLOW,
    HeatmapTrack,
    decode_cells,
)
from amp_doctor.steps.history import HISTORY_LAYERS
from amp_doctor.steps.table import StepTable

__all__ = ["CULPRIT_GROUPS", "CULPRIT_HEADROOM_TITLE", "CULPRIT_GRAD_HEADROOM_TITLE",
           "CULPRITS_GROUP", "LAYOUT", "LOSS_TAG", "LOSS_TITLE", "culprit_headroom",
           "headroom_floor", "ORIGIN_KINDS", "SCALER_FILL_LIMIT", "backoff_groups",
           "culprit_layers", "heatmap_grids", "heatmap_images", "heatmap_layers",
           "RESETS_TITLE", "scaler_resets_note",
           "heatmap_legend", "origin_cells", "scaler_series", "scaler_tag_prefix",
           "layout_with_scalers"]

# At the end, the scale is written at every step of runs up to this many steps (a step
# line); longer runs get the timeline's points plus the step before each change, which
# draws the same staircase in far fewer points.
SCALER_FILL_LIMIT = 20_000

# The figures repeated under culprits/<layer>/ for the layers where trouble started.
CULPRIT_GROUPS: tuple[str, ...] = (
    "headroom", "overflow", "nonfinite", "absmax", "grad_headroom", "grad_nonfinite",
    "underflow", "grad_underflow",
)
# Finding and event kinds that name where inf/NaN or overflow started (not where it
# was only passed on).
ORIGIN_KINDS: tuple[str, ...] = (
    "nonfinite_input", "nonfinite_forward", "activation_overflow", "nonfinite_backward")
# Findings of these kinds name the origin layer of the backoffs in their module.
_BACKOFF_KINDS = ("scale_collapse", "scaler_backoff")


def headroom_floor(fmt: FormatLimits) -> float:
    """Where a culprit's headroom chart draws an output that overflowed to inf.

    Minus the format's whole exponent range, smallest subnormal to max (-40 bits in
    float16, -261 in bfloat16): below any headroom a finite value judged against the
    format can reach in practice, so the clipped points stand apart from real ones.
    """
    return -float(fmt.max_exponent - fmt.min_exponent)


def culprit_headroom(headroom: float, fmt: FormatLimits) -> float | None:
    """A culprit layer's headroom as its chart draws it: clipped at :func:`headroom_floor`.

    An output with inf in it has a headroom of -inf, which TensorBoard cannot draw; a
    culprit is usually there *because* it overflowed, so its chart would be empty exactly
    when it matters. +inf (an all-zero or all-NaN output: no finite value to measure)
    and NaN get no point.
    """
    if math.isnan(headroom) or headroom == math.inf:
        return None
    return max(headroom, headroom_floor(fmt))


_F16, _BF16 = limits(torch.float16), limits(torch.bfloat16)
CULPRIT_HEADROOM_TITLE = (
    "headroom to the format's max (bits; < 0 = overflow; a step with inf/NaN outputs, and "
    f"anything lower, drawn at minus the format's exponent range: {headroom_floor(_F16):g} "
    f"in float16, {headroom_floor(_BF16):g} in bfloat16)")
CULPRIT_GRAD_HEADROOM_TITLE = (
    "headroom of (scaled) output grads (bits; a step with inf/NaN grads drawn at "
    f"{headroom_floor(_F16):g} in float16, {headroom_floor(_BF16):g} in bfloat16)")
# The loss as the step computed it (before the GradScaler's scale), at recorded steps:
# beside the scale, when it went NaN/inf (no point then) or began to climb (review 52b).
LOSS_TAG = "loss"
LOSS_TITLE = "loss (recorded steps; no point where it was inf/NaN)"
# A GradScaler built anew (each epoch, a restarted training function) starts again at its
# init_scale: without this chart the scale chart's jump back up has no explanation.
RESETS_TITLE = ("GradScalers replaced (cumulative; each rise is a new scaler taking over, "
                "from its own init_scale)")
# The text note lists at most this many takeovers (a scaler built every iteration adds
# one a step); the rest are counted.
MAX_RESETS_LISTED = 20
CULPRITS_GROUP = "Culprits (where inf/NaN or overflow started)"
# Up to this many culprits get charts of their own, named; more share the four charts.
MAX_NAMED_CULPRITS = 4

# The custom-scalars tab. Regexes are anchored: the plugin's backend uses re.match, and
# the anchors keep e.g. "underflow/" from also matching "grad_underflow/" anywhere.
LAYOUT: dict[str, dict[str, list[Any]]] = {
    CULPRITS_GROUP: {
        CULPRIT_HEADROOM_TITLE: ["Multiline", [r"^culprits/.*/headroom$"]],
        "inf/NaN outputs (count)": ["Multiline", [r"^culprits/.*/nonfinite$"]],
        "share of outputs beyond the format's max": ["Multiline", [r"^culprits/.*/overflow$"]],
        CULPRIT_GRAD_HEADROOM_TITLE: ["Multiline", [r"^culprits/.*/grad_headroom$"]],
    },
    "Scaler": {
        "loss scale (after each update)": ["Multiline", [r"^scaler/scale$"]],
        "log2 of the loss scale (a collapse is a straight line down)": [
            "Multiline", [r"^scaler/log2_scale$"]],
        "skipped optimizer steps (cumulative)": ["Multiline", [r"^scaler/skipped$"]],
        "scale backoffs (cumulative)": ["Multiline", [r"^scaler/backoffs$"]],
        RESETS_TITLE: ["Multiline", [r"^scaler/resets$"]],
        LOSS_TITLE: ["Multiline", [rf"^{LOSS_TAG}$"]],
    },
    "Overflow risk": {
        "headroom to the format's max (bits; < 0 = overflow; no point in a step with inf/NaN)":
            ["Multiline", [r"^headroom/"]],
        "share of outputs beyond the format's max": ["Multiline", [r"^overflow/"]],
        "inf/NaN outputs (count)": ["Multiline", [r"^nonfinite/"]],
        "max |output| (no point on a step with inf/NaN in it)": ["Multiline", [r"^absmax/"]],
    },
    "Underflow": {
        "share of non-zero outputs below the smallest normal": ["Multiline", [r"^underflow/"]],
        "share of outputs that are exactly zero": ["Multiline", [r"^zeros/"]],
    },
    "Gradients": {
        "share of (scaled) output grads below the smallest normal": [
            "Multiline", [r"^grad_underflow/"]],
        "share of (scaled) output grads that are exactly zero": [
            "Multiline", [r"^grad_zeros/"]],
        "headroom of (scaled) output grads (bits; no point in a step with inf/NaN)": [
            "Multiline", [r"^grad_headroom/"]],
        "inf/NaN output grads (count)": ["Multiline", [r"^grad_nonfinite/"]],
        "inf/NaN weight grads (count; a GradScaler skips the step on any)": [
            "Multiline", [r"^param_grad_nonfinite/"]],
    },
}


def scaler_tag_prefix(sc: ScalerTimeline) -> str:
    """``scaler/<its optimizers>/`` for a run's other GradScaler, in TensorBoard's tag
    characters ("Adam#1, SGD#2" -> "Adam_1__SGD_2"): the writer would otherwise rename
    the tag with a warning on the user's stderr."""
    return "scaler/" + re.sub(r"[^-\w.]", "_", sc.name or "other") + "/"


def layout_with_scalers(session: Session) -> dict[str, dict[str, list[Any]]]:
    """:data:`LAYOUT` as the finished run has it: whose Scaler charts are one set per
    GradScaler when the run had several (a GAN with one per network: one run's lines in a
    chart share a colour, so two scalers in one chart could not be told apart), and
    without the Culprits group when no layer is one. Written again at close, when both
    are known (TensorBoard reads a run's last layout)."""
    layout = dict(LAYOUT)
    timelines = [sc for sc in (session.scaler, *session.other_scalers) if sc is not None]
    if not any(sc.resets for sc in timelines):
        # No scaler was replaced: a chart flat at 0 would only push the loss chart down.
        layout["Scaler"] = {t: c for t, c in LAYOUT["Scaler"].items() if t != RESETS_TITLE}
    known = {lay.name for lay in session.layers}
    named = [n for n in culprit_layers(session) if n in known]
    if not named:
        # No layer where inf/NaN or overflow started: four empty charts would head the tab
        # (an underflow run, review 47b).
        del layout[CULPRITS_GROUP]
    elif len(named) <= MAX_NAMED_CULPRITS:
        # A chart's lines share their run's colour: one set of charts per culprit, its
        # name in the titles, says which layer a line is (review 56d).
        layout[CULPRITS_GROUP] = {
            f"{n}: {title}": [kind, [rx.replace("/.*/", "/" + re.escape(n) + "/", 1)]]
            for n in named for title, (kind, (rx,)) in LAYOUT[CULPRITS_GROUP].items()}
    if not session.other_scalers or session.scaler is None:
        return layout
    charts: dict[str, list[Any]] = {}
    for i, sc in enumerate([session.scaler, *session.other_scalers]):
        prefix = "scaler/" if i == 0 else scaler_tag_prefix(sc)
        for title, (kind, (rx,)) in LAYOUT["Scaler"].items():
            if title == LOSS_TITLE or (title == RESETS_TITLE and not sc.resets):
                continue
            charts[f"{title}: GradScaler of {sc.label}"] = [
                kind, ["^" + re.escape(prefix) + rx.removeprefix("^scaler/")]]
    charts[LOSS_TITLE] = LAYOUT["Scaler"][LOSS_TITLE]  # one loss, whatever the scalers
    return {**layout, "Scaler": charts}


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def scaler_series(session: Session, after: int = -1, sc: ScalerTimeline | None = None,
                  prefix: str = "scaler/") -> dict[str, list[tuple[int, float]]]:
    """``scaler/*`` points in step order, for the steps after ``after``: of the run's first
    scaler, or of ``sc`` (another one) under ``prefix`` (``scaler/<its optimizers>/``).

    The scale after each update is a step function of the timeline (it holds every
    change), so it is written at every step up to :data:`SCALER_FILL_LIMIT` steps.
    ``scaler/skipped``, ``scaler/backoffs`` and ``scaler/resets`` are cumulative counts
    (a rise is an event; no thinning can hide one), at the same steps.
    """
    sc = session.scaler if sc is None else sc
    if sc is None or not sc.enabled or not sc.scale:
        return {}
    pts = sorted((int(st), float(v)) for st, v in sc.scale if _finite(v))
    if not pts:
        return {}
    resets = sorted(r.step for r in sc.resets)
    last = max(pts[-1][0], session.steps - 1, *sc.skipped_steps, *sc.backoff_steps, *resets)
    if last + 1 - pts[0][0] <= SCALER_FILL_LIMIT:
        steps = list(range(pts[0][0], last + 1))
    else:  # the staircase's corners only
        corners = {st for st, _ in pts} | {st - 1 for st, _ in pts[1:]}
        steps = sorted(corners | set(sc.skipped_steps) | set(sc.backoff_steps) | set(resets)
                       | {last})
    steps = [st for st in steps if st > after and st >= pts[0][0]]
    out: dict[str, list[tuple[int, float]]] = {
        f"{prefix}scale": [], f"{prefix}log2_scale": [], f"{prefix}skipped": [],
        f"{prefix}backoffs": [], f"{prefix}resets": []}
    skipped, backoffs = sorted(sc.skipped_steps), sorted(sc.backoff_steps)
    i = j = k = m = 0
    value = pts[0][1]
    for st in steps:
        while i < len(pts) and pts[i][0] <= st:
            value = pts[i][1]
            i += 1
        while j < len(skipped) and skipped[j] <= st:
            j += 1
        while k < len(backoffs) and backoffs[k] <= st:
            k += 1
        while m < len(resets) and resets[m] <= st:
            m += 1
        out[f"{prefix}scale"].append((st, value))
        out[f"{prefix}log2_scale"].append((st, math.log2(value)))
        out[f"{prefix}skipped"].append((st, float(j)))
        out[f"{prefix}backoffs"].append((st, float(k)))
        out[f"{prefix}resets"].append((st, float(m)))
    return out if steps else {}


def culprit_layers(session: Session) -> dict[str, str | None]:
    """Layers where inf/NaN or overflow started -> the op that did it (when known).

    From the findings first (their order is most severe first), then the run's events
    (anomaly mode names module and op per step) and the backoffs' forward origins.
    Layers that only passed the values on are not here.
    """
    out: dict[str, str | None] = {}
    # A layer-level overflow finding names an origin only where that layer was the first
    # to overflow in some step; the others downstream only passed the values on.
    origin_steps = {lay.name: lay.overflow_origin_steps for lay in session.layers}
    any_origin = any(origin_steps.values())

    def add(module: str | None, op: str | None) -> None:
        if module and out.get(module) is None:
            out[module] = op

    for f in session.findings:
        if f.severity == "info" or not (f.kind in ORIGIN_KINDS or f.kind in _BACKOFF_KINDS):
            continue
        if (f.kind == "activation_overflow" and f.op is None and any_origin
                and not origin_steps.get(f.module or "", 0)):
            continue
        add(f.module, f.op)
    for e in session.events:
        if e.kind in ORIGIN_KINDS:
            add(e.module, e.op)
    if session.scaler is not None:
        for ev in session.scaler.events:
            add(ev.forward_origin, None)
    return out


def origin_cells(session: Session) -> set[tuple[str, int]]:
    """(layer, step) pairs where inf/NaN or overflow started, per the events."""
    cells = {(e.module, e.step) for e in session.events
             if e.kind in ORIGIN_KINDS and e.module}
    if session.scaler is not None:
        cells |= {(ev.forward_origin, ev.step) for ev in session.scaler.events
                  if ev.forward_origin}
    return cells


# -- heatmaps ----------------------------------------------------------------------------

# The heatmaps: (tag, LayerStep field, figure, title). Headroom ramps from "no bits left"
# (bright) to plenty (dark); underflow from none (dark) to all values (bright).
_HEATMAPS: tuple[tuple[str, str, str, str], ...] = (
    ("heatmap/headroom", "act", "headroom", "Outputs: headroom to {name}'s max"),
    ("heatmap/underflow", "act", "underflow", "Outputs: underflow in {name}"),
    ("heatmap/grad_headroom", "grad", "headroom",
     "Output grads (as scaled): headroom to {name}'s max"),
    ("heatmap/grad_underflow", "grad", "underflow",
     "Grads (as scaled): underflow in {name}, all-zero = 100%"),
)


def heatmap_layers(session: Session) -> list[str]:
    """The heatmaps' rows: every layer in model order, minus exact duplicates.

    A container whose output always was its last child's (``LayerSummary.passthrough``)
    would repeat that child's row.
    """
    return [lay.name for lay in session.layers if not lay.passthrough]


# A grey cell of a step whose history row kept only its worst layers.
MISSING_KEPT = f"not recorded, or not among the step's {HISTORY_LAYERS} worst layers kept"


def heatmap_grids(session: Session, fmt: FormatLimits) -> dict[str, HeatmapGrid]:
    """What each heatmap shows, keyed by tag (empty when nothing was recorded): from
    every layer's cells (``Session.heatmaps``), or from the history in a report made
    before them (each step's worst layers only, folded into cells the same way)."""
    names = heatmap_layers(session)
    h = session.heatmaps if session.heatmaps is not None else _cells_of_history(session)
    if h is None:
        return {}
    grids = _grids_of_cells(session, h, names, fmt)
    if session.heatmaps is None and any(rec.dropped_layers for rec in session.history):
        grids = {tag: dataclasses.replace(g, missing=MISSING_KEPT) for tag, g in grids.items()}
    return grids


def _cells_of_history(session: Session) -> LayerHeatmaps | None:
    """The history's rows as heatmap cells, one column a row (no merging)."""
    recs = session.history
    track = HeatmapTrack(columns=max(2, len(recs) + len(recs) % 2))
    rows: dict[str, int] = {}
    for rec in recs:
        table = StepTable.from_layers(rec.layers)
        if not len(table):
            continue
        idx = np.array([rows.setdefault(n, len(rows)) for n in table.names])
        track.grow(len(rows))
        track.add(idx, table.filled().view(len(table), -1).numpy(), rec.step)
    return track.export(rows)


# Per heatmap (tag order of _HEATMAPS): its figure's index in HEATMAP_FIGURES, and the
# flag bits of inf/NaN and of overflow in its tensor.
_CELL_SOURCES = ((0, ACT_NONFINITE, ACT_OVERFLOW), (1, ACT_NONFINITE, ACT_OVERFLOW),
                 (2, GRAD_NONFINITE, GRAD_OVERFLOW), (3, GRAD_NONFINITE, GRAD_OVERFLOW))
_GRAD_ZERO = HEATMAP_FIGURES.index("grad_zero")


def _grids_of_cells(session: Session, h: LayerHeatmaps, names: list[str],
                    fmt: FormatLimits) -> dict[str, HeatmapGrid]:
    """The heatmaps' grids from every layer's cells (see :class:`LayerHeatmaps`)."""
    if not names or not h.steps:
        return {}
    vals, flags = decode_cells(h)
    row_in = {n: i for i, n in enumerate(h.layers)}
    at = [row_in.get(n, -1) for n in names]
    row_of = {n: r for r, n in enumerate(names)}
    culprits = culprit_layers(session)
    origin_rows = {row_of[n]: op for n, op in culprits.items() if n in row_of}
    # A column holds the steps from its own first one to the next column's (one step, in
    # a column of one: the history's rows skip steps).
    at_col = {(n, st): bisect.bisect_right(h.steps, st) - 1
              for n, st in origin_cells(session) if n in row_of and st >= h.steps[0]}
    cells = {(row_of[n], c) for (n, st), c in at_col.items()
             if h.span > 1 or h.steps[c] == st}
    cols = len(h.steps)
    none_row: list[float | None] = [None] * cols
    no_flags = [False] * cols
    out: dict[str, HeatmapGrid] = {}
    for (tag, _, figure, title), (k, bad_bit, over_bit) in zip(_HEATMAPS, _CELL_SOURCES,
                                                               strict=True):
        v = vals[:, :, k]
        if tag == "heatmap/grad_underflow":
            # Flushed all the way (the table's "100% zero"): every value lost.
            v = np.where(vals[:, :, _GRAD_ZERO] >= ALL_ZERO_SHOWN, 1.0, v)
        # An all-zero output has +inf headroom: as safe as it gets.
        v = np.where(v == math.inf, HEATMAP_MAX_BITS, v)
        shown = [[None if x != x else x for x in row] for row in v.tolist()]
        bad = ((flags & bad_bit) > 0).tolist()
        over = ((flags & over_bit) > 0).tolist()
        out[tag] = HeatmapGrid(
            names=names, steps=list(h.steps),
            values=[shown[i] if i >= 0 else list(none_row) for i in at],
            nonfinite=[bad[i] if i >= 0 else list(no_flags) for i in at],
            overflow=[over[i] if i >= 0 else list(no_flags) for i in at],
            figure=figure, title=title.format(name=fmt.name),
            origin_rows=origin_rows, origin_cells=cells, missing="not recorded")
    return out


def heatmap_images(session: Session, fmt: FormatLimits) -> dict[str, torch.Tensor]:
    """Labelled layer x step pictures as uint8 ``[H, W, 3]`` (HWC) images, keyed by tag.

    See :mod:`amp_doctor.sinks.heatmap` for what is drawn.
    """
    return {tag: render_heatmap(g, fmt) for tag, g in heatmap_grids(session, fmt).items()}


def heatmap_legend(session: Session, fmt: FormatLimits) -> str:
    """Markdown key for the heatmaps (the images carry their own key; this adds the list)."""
    names = heatmap_layers(session)
    h = session.heatmaps
    steps = h.steps if h is not None else [rec.step for rec in session.history]
    bits = min(HEATMAP_MAX_BITS, float(fmt.max_exponent - fmt.normal_exponent))
    culprits = culprit_layers(session)
    grey = ("grey = not recorded (the layer did not run, or had no such tensor, in those "
            "steps)." if h is not None else
            f"grey = not recorded, or (more than {HISTORY_LAYERS} layers) not among the "
            f"{HISTORY_LAYERS} worst layers of its step, which are all the history keeps of "
            "a step (every layer is in the totals).")
    # As drawn: a long run's columns are merged again to fit the picture (fit_columns).
    grid = next(iter(heatmap_grids(session, fmt).values()), None)
    k = merged_columns(grid) if grid is not None else 1
    span = (h.span if h is not None else 1) * k
    if span > 1:
        drawn = -(-len(steps) // k)
        columns = (f"Columns: {drawn}, each the worst of {span} consecutive "
                   + ("recorded steps" if h is not None else "history rows (recorded steps "
                      "kept)")
                   + f" (the last of up to {span}), from step {steps[0]} (left) on: a long "
                   "run's columns are merged to keep the picture bounded; the step under a "
                   "column is its first.")
    else:
        columns = (f"Columns: {len(steps)} recorded steps"
                   + (f", step {steps[0]} (left) to {steps[-1]} (right)." if steps else "."))
    lines = [
        f"**Heatmaps: layers (rows, model order: first to run at the top) x recorded "
        f"steps (columns), judged against {fmt.name}.**",
        "",
        f"* `heatmap/headroom`: bits between max\\|output\\| and {fmt.name}'s max "
        f"({F.limit(fmt.max)}). Yellow = 0 bits left, purple = {bits:g} bits or more.",
        "* `heatmap/grad_headroom`: the same for the layer's output gradients, as scaled "
        "by the GradScaler (what the backward pass holds).",
        "* `heatmap/underflow`: share of non-zero outputs below the smallest normal "
        f"({F.limit(fmt.smallest_normal)}). Purple = none, yellow = all.",
        "* `heatmap/grad_underflow`: the same for the layer's output gradients, as scaled "
        "(the values a larger loss scale would lift); a gradient that was all exact zeros "
        f"(at least {ALL_ZERO_SHOWN:.0%}: flushed, the table's 'N% zero') is yellow too.",
        "* red = inf/NaN; magenta = values beyond the max (overflow, or "
        "would-overflow for a float32 layer); " + grey,
        "* blue frame and highlighted name = where inf/NaN or overflow started (the "
        "origin); red rows without it only passed the values on.",
        "* containers whose output is their last child's are left out (same row).",
        "",
        columns,
    ]
    if culprits:
        lines += ["", "Origin: " + ", ".join(
            f"`{n}`" + (f" (op `{op}`)" if op else "") for n, op in culprits.items())]
    lines += ["", "| row | layer |", "|---|---|"]
    lines += [f"| {i} | {n} |" for i, n in enumerate(names)]
    return "\n".join(lines) + "\n"


# -- text --------------------------------------------------------------------------------

def backoff_groups(session: Session) -> list[tuple[int, str]]:
    """One markdown note per run of consecutive backoffs: (first step, text)."""
    sc = session.scaler
    if sc is None:
        return []
    evs = sorted((e for e in sc.events if e.kind == "backoff"), key=lambda e: e.step)
    # Where the findings say inf/NaN started, for backoffs whose forward pass was not
    # recorded or stayed finite (an op inside a module, found by anomaly mode).
    started = culprit_layers(session)
    # A new scaler's backoffs are its own episode, not the old one's going on: one note
    # across a takeover read "24 skipped updates, scale 2^20 -> 4096" (8 halvings).
    starts = {r.step for r in sc.resets}
    groups = [part for run in F.consecutive_runs(evs) for part in _split_at(run, starts)]
    out = []
    for g in groups:
        first, last = g[0], g[-1]
        span = f"step {first.step}" if len(g) == 1 else f"steps {first.step}-{last.step}"
        # The blank line: TensorBoard's markdown starts a list only after one (review 56d:
        # the bullets showed as literal asterisks).
        lines = [f"**Scale backoff, {span}**: {len(g)} skipped update(s), scale "
                 f"{F.scale(first.scale_before)} -> {F.scale(last.scale_after)}.", ""]
        origins = sorted({e.forward_origin for e in g if e.forward_origin})
        if origins:
            lines.append(f"* forward pass went non-finite first in: {', '.join(origins)}")
        elif started:
            lines.append("* inf/NaN started in: " + ", ".join(
                f"{n} [{op}]" if op else n for n, op in started.items()))
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


def _split_at(run: list[ScalerEvent], starts: set[int]) -> list[list[ScalerEvent]]:
    """``run`` cut before each event at one of the ``starts`` steps."""
    parts: list[list[ScalerEvent]] = []
    for e in run:
        if not parts or e.step in starts:
            parts.append([e])
        else:
            parts[-1].append(e)
    return parts


def scaler_resets_note(session: Session) -> tuple[int, str] | None:
    """The markdown note on where a new GradScaler took over from the previous one, at
    the first takeover's step; None when no scaler was replaced."""
    sc = session.scaler
    if sc is None or not sc.resets:
        return None
    resets = sorted(sc.resets, key=lambda r: r.step)
    shown = resets[:MAX_RESETS_LISTED]
    more = len(resets) - len(shown)
    # The blank line: TensorBoard's markdown starts a list only after one.
    lines = [f"**GradScaler replaced {F.counted(len(resets), 'time')}**: at each step below "
             "a new GradScaler took over from the previous one, with its own scale (its "
             "`init_scale`, unless it loaded the old one's state): the scale chart's jump "
             "there is no growth.", ""]
    lines += [f"* step {r.step}: scale {F.scale(r.scale_before, unknown='?')} -> "
              f"{F.scale(r.scale_after, unknown='?')}" for r in shown]
    if more:
        lines.append(f"* and {more} more")
    return resets[0].step, "\n".join(lines) + "\n"
