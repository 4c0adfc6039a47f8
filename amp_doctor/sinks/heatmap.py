"""Labelled layer x step heatmaps, drawn with Pillow (installed with tensorboard).

One picture per figure (headroom, underflow, gradient headroom): layer names on the
rows (model order, i.e. the order the layers first finished their forward, top = first),
recorded steps on the columns, a colour bar with its unit on the right, and marks that
are not on the colour ramp for inf/NaN, overflow and "not recorded". The layer (or op)
where inf/NaN or overflow *started* is framed and its row label is highlighted, so it
stands apart from the layers downstream that only passed the values on.

Images are drawn at their display size (one image pixel per screen pixel in
TensorBoard's IMAGES tab): no stretching, text stays sharp.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from amp_doctor import format as F
from amp_doctor.dtypes import FormatLimits

if TYPE_CHECKING:
    from PIL.ImageFont import FreeTypeFont, ImageFont

    _Font = FreeTypeFont | ImageFont

__all__ = [
    "HeatmapGrid",
    "PlotGeometry",
    "geometry",
    "fit_columns",
    "merged_columns",
    "plot_width",
    "render_heatmap",
    "step_ticks",
    "ramp",
    "HEATMAP_MAX_BITS",
    "NONFINITE_RGB",
    "OVERFLOW_RGB",
    "MISSING_RGB",
    "ORIGIN_RGB",
    "ROW_HEIGHT",
    "CARD_WIDTH",
    "MIN_PLOT_WIDTH",
    "MAX_PLOT_WIDTH",
]

_RGB = tuple[int, int, int]
# Headroom colours saturate here: beyond ~32 bits a layer is nowhere near overflow, and a
# wider ramp would wash out the 0-16 bits where float16 runs live.
HEATMAP_MAX_BITS = 32.0
# viridis at 0, .25, .5, .75, 1: perceptually even and readable by colour-blind users.
_VIRIDIS: tuple[_RGB, ...] = (
    (68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
# Marks that are not on the ramp, so they cannot be mistaken for a value.
NONFINITE_RGB: _RGB = (230, 0, 0)
OVERFLOW_RGB: _RGB = (255, 0, 255)
MISSING_RGB: _RGB = (190, 190, 190)
ORIGIN_RGB: _RGB = (0, 200, 255)
_ORIGIN_LABEL_BG: _RGB = (204, 242, 255)
_BG: _RGB = (255, 255, 255)
_INK: _RGB = (20, 20, 20)
_MUTED: _RGB = (90, 90, 90)
_GRID: _RGB = (255, 255, 255)

# Pixel sizes. TensorBoard's IMAGES tab fits each image to its card (about 350 px wide
# in a 1400 px window) unless "Show actual image size" is ticked, so the picture is laid
# out to fit CARD_WIDTH when the layer names allow: then it is shown 1:1 as it is.
CARD_WIDTH = 350
# A row is tall enough for one line of 12 px text; past _MAX_LABELLED_ROWS rows shrink
# and only every n-th is labelled.
ROW_HEIGHT = 16
_MAX_LABELLED_ROWS = 64
_MIN_ROW = 3
_MAX_PLOT_HEIGHT = ROW_HEIGHT * _MAX_LABELLED_ROWS
# The step axis gets at least this many pixels, even when long names push the image
# past CARD_WIDTH; beyond MAX_PLOT_WIDTH / 2 columns, neighbouring steps share a pixel
# column showing the worst of them.
MIN_PLOT_WIDTH = 160
MAX_PLOT_WIDTH = 400
_MAX_COL = 24
_MIN_COL = 2
_PAD = 8
_FONT_SIZE = 12
_SMALL_SIZE = 11
_BAR_H = 10
_TICK_GAP = 16  # minimum pixels from one step label's centre to the next


@dataclass(frozen=True)
class HeatmapGrid:
    """What one heatmap shows: ``values[r][c]`` for layer ``names[r]`` at ``steps[c]``.

    ``figure`` is ``"headroom"`` (bits, finite) or ``"underflow"`` (share in [0, 1]);
    ``None`` is "not recorded". ``nonfinite``/``overflow`` mark cells with inf/NaN or
    values beyond the format's max. ``origin_rows`` maps a row to the op that started
    the trouble there (``None`` when only the layer is known); ``origin_cells`` are the
    (row, column) cells where it started.
    """

    names: list[str]
    steps: list[int]
    values: list[list[float | None]]
    nonfinite: list[list[bool]]
    overflow: list[list[bool]]
    figure: str
    title: str
    origin_rows: dict[int, str | None]
    origin_cells: set[tuple[int, int]]
    # What a grey cell means: a step the history kept only its worst layers of also has
    # grey cells for the layers it left out (review 56d: read as "not recorded").
    missing: str = "not recorded"


def ramp(t: float) -> _RGB:
    """A value in [0, 1] -> its viridis colour."""
    t = min(1.0, max(0.0, t)) * (len(_VIRIDIS) - 1)
    lo = min(int(t), len(_VIRIDIS) - 2)
    f = t - lo
    a, b = _VIRIDIS[lo], _VIRIDIS[lo + 1]
    return (round(a[0] + (b[0] - a[0]) * f), round(a[1] + (b[1] - a[1]) * f),
            round(a[2] + (b[2] - a[2]) * f))


def _position(figure: str, v: float, bits: float) -> float:
    """Where a value sits on the ramp: 1 (bright) = danger, 0 (dark) = safe."""
    if figure == "headroom":
        return 1.0 - min(max(v, 0.0), bits) / bits
    return v


@functools.lru_cache(maxsize=1)
def _fonts() -> tuple[_Font, _Font]:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=_FONT_SIZE), ImageFont.load_default(size=_SMALL_SIZE)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font, still readable
        f = ImageFont.load_default()
        return f, f


def _label(name: str, op: str | None, origin: bool) -> str:
    if not origin:
        return name
    return f"{name} [{op}]" if op else name


@dataclass(frozen=True)
class PlotGeometry:
    """Where the cells are in the image: cell (r, c) starts at (x0 + c*cw, y0 + r*ch)."""

    x0: int
    y0: int
    cw: int
    ch: int
    labels: list[str]


def _measure(text: str, f: _Font | None = None) -> int:
    from PIL import Image, ImageDraw

    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    box = probe.textbbox((0, 0), text, font=f if f is not None else _fonts()[0])
    return int(box[2] - box[0])


def _label_width(grid: HeatmapGrid) -> tuple[list[str], int]:
    labels = [_label(n, grid.origin_rows.get(r), r in grid.origin_rows)
              for r, n in enumerate(grid.names)]
    marker_w = 12
    return labels, max([_measure(t) for t in labels] + [_measure("layer")]) + marker_w + 6


def plot_width(grid: HeatmapGrid) -> int:
    """Pixels for the step axis: what is left of CARD_WIDTH next to the names."""
    _, label_w = _label_width(grid)
    return max(MIN_PLOT_WIDTH, min(MAX_PLOT_WIDTH, CARD_WIDTH - 2 * _PAD - label_w))


def step_ticks(cols: int, cw: int, label_px: int) -> list[int]:
    """The columns whose step is labelled: every n-th, ``label_px`` (the widest label
    and a margin) and at least :data:`_TICK_GAP` apart; the first always, the last when
    it fits. Two recorded steps in 48 pixels both get theirs (review 47b: only "0")."""
    gap = max(_TICK_GAP, label_px)
    stride = max(1, math.ceil(gap / cw))
    shown = list(range(0, cols, stride))
    if cols - 1 not in shown and (not shown or (cols - 1 - shown[-1]) * cw >= gap):
        shown.append(cols - 1)
    return shown


def geometry(grid: HeatmapGrid) -> PlotGeometry:
    """The plot's place and cell size in :func:`render_heatmap`'s image.

    ``grid`` is the one drawn: after :func:`fit_columns`.
    """
    rows, cols = len(grid.names), len(grid.steps)
    ch = ROW_HEIGHT if rows <= _MAX_LABELLED_ROWS else max(_MIN_ROW, _MAX_PLOT_HEIGHT // rows)
    cw = max(1, min(_MAX_COL, plot_width(grid) // max(cols, 1)))
    labels, label_w = _label_width(grid)
    title_h = 3 * (_FONT_SIZE + 4) + 4
    return PlotGeometry(x0=_PAD + label_w, y0=_PAD + title_h, cw=cw, ch=ch, labels=labels)


def merged_columns(grid: HeatmapGrid) -> int:
    """How many of ``grid``'s neighbouring columns :func:`fit_columns` draws as one."""
    cols = len(grid.steps)
    return max(1, math.ceil(cols * _MIN_COL / plot_width(grid))) if cols else 1


def fit_columns(grid: HeatmapGrid) -> HeatmapGrid:
    """Merge neighbouring steps until each column is at least ``_MIN_COL`` pixels wide.

    A merged cell shows the worst of its steps (least headroom, most underflow, any
    inf/NaN or overflow), so a spike is never averaged away; its step label is the first
    step of the group.
    """
    cols = len(grid.steps)
    k = merged_columns(grid)
    if k <= 1:
        return grid
    worst = min if grid.figure == "headroom" else max
    groups = [list(range(i, min(i + k, cols))) for i in range(0, cols, k)]

    def merge_v(row: list[float | None]) -> list[float | None]:
        out: list[float | None] = []
        for g in groups:
            vals = [v for c in g if (v := row[c]) is not None]
            out.append(worst(vals) if vals else None)
        return out

    return HeatmapGrid(
        names=grid.names, steps=[grid.steps[g[0]] for g in groups],
        values=[merge_v(r) for r in grid.values],
        nonfinite=[[any(r[c] for c in g) for g in groups] for r in grid.nonfinite],
        overflow=[[any(r[c] for c in g) for g in groups] for r in grid.overflow],
        figure=grid.figure, title=grid.title, origin_rows=grid.origin_rows,
        origin_cells={(r, c // k) for r, c in grid.origin_cells})


def render_heatmap(grid: HeatmapGrid, fmt: FormatLimits) -> torch.Tensor:
    """Draw ``grid`` as a uint8 ``[H, W, 3]`` image (HWC), labels and key included.

    Long runs are first narrowed with :func:`fit_columns`; :func:`geometry` of the
    narrowed grid says where the cells are.
    """
    from PIL import Image, ImageDraw

    grid = fit_columns(grid)
    font, small = _fonts()
    rows, cols = len(grid.names), len(grid.steps)
    bits = min(HEATMAP_MAX_BITS, float(fmt.max_exponent - fmt.normal_exponent))
    geo = geometry(grid)
    x0, y0, cw, ch = geo.x0, geo.y0, geo.cw, geo.ch
    label_every = max(1, math.ceil(ROW_HEIGHT / ch)) if ch < ROW_HEIGHT else 1
    width = _measure
    plot_w, plot_h = cols * cw, rows * ch
    title_lines = [(grid.title, font, _INK),
                   ("rows: layers in model order (first to run on top)", small, _MUTED),
                   ("columns: recorded steps", small, _MUTED)]

    if grid.figure == "headroom":
        bar_title = f"bits of headroom (0 = at the max, {F.limit(fmt.max)})"
        ticks = [(float(b), f"{b}") for b in range(0, int(bits), 8)] + [
            (bits, f"{bits:g}+")]
    else:
        bar_title = f"% below the smallest normal, {F.limit(fmt.smallest_normal)}"
        ticks = [(v / 100, f"{v}%") for v in (0, 25, 50, 75, 100)]
    swatches: list[tuple[_RGB | None, str]] = [
        (NONFINITE_RGB, "inf/NaN in it"), (OVERFLOW_RGB, "beyond max"),
        (MISSING_RGB, grid.missing), (None, "origin of inf/NaN")]
    sw_col = max(width(t, small) for _, t in swatches) + 26
    key_w = max(MIN_PLOT_WIDTH, 2 * sw_col, width(bar_title, small) + 4)
    axis_h = 30
    key_y = y0 + plot_h + axis_h
    key_h = 14 + _BAR_H + 16 + 2 * 16
    W = max(x0 + plot_w, _PAD + key_w, *(_PAD + width(t, f) for t, f, _ in title_lines)) + _PAD
    H = key_y + key_h + _PAD

    img = Image.new("RGB", (W, H), _BG)
    d = ImageDraw.Draw(img)
    ty = _PAD
    for text, f, colour in title_lines:
        d.text((_PAD, ty), text, fill=colour, font=f)
        ty += _FONT_SIZE + 4

    # Cells. A thin white gap between cells keeps equal neighbours apart when there is
    # room for it; it is not part of any cell's colour.
    gap_x, gap_y = (1 if cw >= 4 else 0), (1 if ch >= 4 else 0)
    for r in range(rows):
        for c in range(cols):
            v = grid.values[r][c]
            if grid.nonfinite[r][c]:
                colour = NONFINITE_RGB
            elif grid.overflow[r][c]:
                colour = OVERFLOW_RGB
            elif v is None or math.isnan(v):
                colour = MISSING_RGB
            else:
                colour = ramp(_position(grid.figure, v, bits))
            x, y = x0 + c * cw, y0 + r * ch
            d.rectangle([x, y, x + cw - 1 - gap_x, y + ch - 1 - gap_y], fill=colour)
    for r, c in grid.origin_cells:
        x, y = x0 + c * cw, y0 + r * ch
        d.rectangle([x, y, x + cw - 1 - gap_x, y + ch - 1 - gap_y], outline=ORIGIN_RGB,
                    width=2 if min(cw, ch) >= 6 else 1)

    # Row labels, right-aligned against the plot; origin rows highlighted and marked.
    for r, text in enumerate(geo.labels):
        origin = r in grid.origin_rows
        if r % label_every and not origin:
            continue
        y = y0 + r * ch + (ch - _FONT_SIZE) // 2 - 2
        tx = x0 - 6 - width(text)
        if origin:
            d.rectangle([tx - 3, y0 + r * ch, x0 - 3, y0 + (r + 1) * ch - 1],
                        fill=_ORIGIN_LABEL_BG)
            cy = y0 + r * ch + ch // 2
            d.polygon([(_PAD, cy - 5), (_PAD + 8, cy), (_PAD, cy + 5)], fill=ORIGIN_RGB,
                      outline=_INK)
        d.text((tx, y), text, fill=_INK, font=font)

    # Step axis: ticks under the columns, spaced so the labels never touch.
    ya = y0 + plot_h + 2
    gap = max(width(str(st), small) for st in grid.steps) + 8
    for c in step_ticks(cols, cw, gap):
        xc = x0 + c * cw + cw // 2
        d.line([xc, ya, xc, ya + 3], fill=_INK)
        t = str(grid.steps[c])
        d.text((xc - width(t, small) // 2, ya + 4), t, fill=_INK, font=small)
    d.text((x0 - 6 - width("step", small), ya + 4), "step", fill=_MUTED, font=small)

    # Colour key under the plot: a horizontal bar, danger (bright) on the left, with the
    # unit and the format's limit in its title; then the marks that are not on the ramp.
    bx, bw = _PAD, key_w
    d.text((bx, key_y), bar_title, fill=_INK, font=small)
    by = key_y + 14
    for i in range(bw):
        d.line([bx + i, by, bx + i, by + _BAR_H - 1], fill=ramp(1.0 - i / (bw - 1)))
    for value, text in ticks:
        xx = bx + round((1.0 - _position(grid.figure, value, bits)) * (bw - 1))
        d.line([xx, by + _BAR_H, xx, by + _BAR_H + 2], fill=_INK)
        tw = width(text, small)
        d.text((min(max(bx, xx - tw // 2), bx + bw - tw), by + _BAR_H + 2), text,
               fill=_INK, font=small)
    sy = by + _BAR_H + 18
    for i, (swatch, text) in enumerate(swatches):
        sx = bx + (i % 2) * sw_col
        yy = sy + (i // 2) * 16
        if swatch is None:
            d.rectangle([sx, yy, sx + 13, yy + 11], outline=ORIGIN_RGB, width=2)
        else:
            d.rectangle([sx, yy, sx + 13, yy + 11], fill=swatch)
        d.text((sx + 19, yy - 1), text, fill=_INK, font=small)

    data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return data.reshape(H, W, 3)
