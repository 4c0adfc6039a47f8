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

from .. import format as F
from ..dtypes import FormatLimits

if TYPE_CHECKING:
    from PIL.ImageFont import FreeTypeFont, ImageFont

    _Font = FreeTypeFont | ImageFont

__all__ = [
    "HeatmapGrid",
    "PlotGeometry",
    "geometry",
    "render_heatmap",
    "ramp",
    "HEATMAP_MAX_BITS",
    "NONFINITE_RGB",
    "OVERFLOW_RGB",
    "MISSING_RGB",
    "ORIGIN_RGB",
    "ROW_HEIGHT",
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

# Pixel sizes. A row is tall enough for one line of 12 px text; past _MAX_LABELLED_ROWS
# rows shrink and only every n-th is labelled.
ROW_HEIGHT = 16
_MAX_LABELLED_ROWS = 64
_MIN_ROW = 3
_MAX_PLOT_HEIGHT = ROW_HEIGHT * _MAX_LABELLED_ROWS
# The step axis fits in this many pixels (TensorBoard's card shows ~1000 px unscaled).
MAX_PLOT_WIDTH = 560
_MAX_COL = 48
_PAD = 10
_FONT_SIZE = 12
_SMALL_SIZE = 11
_BAR_W = 14
_BAR_H = 150
_TICK_GAP = 36  # minimum pixels between step labels


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


def geometry(grid: HeatmapGrid) -> PlotGeometry:
    """The plot's place and cell size in :func:`render_heatmap`'s image."""
    rows, cols = len(grid.names), len(grid.steps)
    ch = ROW_HEIGHT if rows <= _MAX_LABELLED_ROWS else max(_MIN_ROW, _MAX_PLOT_HEIGHT // rows)
    cw = max(1, min(_MAX_COL, MAX_PLOT_WIDTH // max(cols, 1)))
    labels = [_label(n, grid.origin_rows.get(r), r in grid.origin_rows)
              for r, n in enumerate(grid.names)]
    marker_w = 12
    label_w = max([_measure(t) for t in labels] + [_measure("layer")]) + marker_w + 6
    title_h = 2 * (_FONT_SIZE + 5) + 4
    return PlotGeometry(x0=_PAD + label_w, y0=_PAD + title_h, cw=cw, ch=ch, labels=labels)


def render_heatmap(grid: HeatmapGrid, fmt: FormatLimits) -> torch.Tensor:
    """Draw ``grid`` as a uint8 ``[H, W, 3]`` image (HWC), labels and key included."""
    from PIL import Image, ImageDraw

    font, small = _fonts()
    rows, cols = len(grid.names), len(grid.steps)
    bits = min(HEATMAP_MAX_BITS, float(fmt.max_exponent - fmt.normal_exponent))
    geo = geometry(grid)
    x0, y0, cw, ch = geo.x0, geo.y0, geo.cw, geo.ch
    label_every = max(1, math.ceil(ROW_HEIGHT / ch)) if ch < ROW_HEIGHT else 1
    width = _measure
    labels = geo.labels
    title_lines = [grid.title,
                   "rows: layers in model order (first to run at the top); "
                   "columns: recorded steps"]
    plot_w, plot_h = cols * cw, rows * ch
    key_x = x0 + plot_w + 24
    if grid.figure == "headroom":
        ticks = [(0.0, f"0 bits: at the max, {F.limit(fmt.max)}")] + [
            (b, f"{b:g}") for b in range(8, int(bits), 8)] + [(bits, f">= {bits:g} bits")]
        bar_title = "headroom (bits)"
    else:
        ticks = [(v / 100, f"{v}%") for v in (0, 25, 50, 75, 100)]
        bar_title = "% below smallest normal"
    swatches: list[tuple[_RGB | None, str]] = [
        (NONFINITE_RGB, "inf / NaN in it"), (OVERFLOW_RGB, "beyond max (overflow)"),
        (MISSING_RGB, "not recorded"), (None, "origin: where inf/NaN started")]
    key_w = max([width(t, small) for _, t in ticks] + [width(bar_title, small)]
                + [width(t, small) + 22 for _, t in swatches]) + _BAR_W + 10
    key_h = 24 + _BAR_H + 12 + len(swatches) * 16
    W = key_x + key_w + _PAD
    W = max(W, _PAD * 2 + max(width(t) for t in title_lines))
    H = y0 + max(plot_h + 34, key_h) + _PAD

    img = Image.new("RGB", (W, H), _BG)
    d = ImageDraw.Draw(img)
    d.text((_PAD, _PAD), title_lines[0], fill=_INK, font=font)
    d.text((_PAD, _PAD + _FONT_SIZE + 5), title_lines[1], fill=_MUTED, font=small)

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
    for r, text in enumerate(labels):
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
    ya = y0 + plot_h + 3
    gap = max(_TICK_GAP, max(width(str(st), small) for st in grid.steps) + 12)
    stride = max(1, math.ceil(gap / cw))
    shown = list(range(0, cols, stride))
    if cols - 1 not in shown and (not shown or (cols - 1 - shown[-1]) * cw >= gap):
        shown.append(cols - 1)
    for c in shown:
        xc = x0 + c * cw + cw // 2
        d.line([xc, ya, xc, ya + 3], fill=_INK)
        t = str(grid.steps[c])
        d.text((xc - width(t, small) // 2, ya + 4), t, fill=_INK, font=small)
    axis = "step"
    d.text((x0 + plot_w - width(axis, small), ya + 18), axis, fill=_MUTED, font=small)

    # Colour bar: danger (bright) at the top, with the unit and the format's limit.
    d.text((key_x, y0), bar_title, fill=_INK, font=small)
    by = y0 + 24
    for i in range(_BAR_H):
        d.line([key_x, by + i, key_x + _BAR_W - 1, by + i], fill=ramp(1.0 - i / (_BAR_H - 1)))
    d.rectangle([key_x, by, key_x + _BAR_W - 1, by + _BAR_H - 1], outline=_INK)
    for value, text in ticks:
        pos = _position(grid.figure, value, bits)
        yy = by + round((1.0 - pos) * (_BAR_H - 1))
        d.line([key_x + _BAR_W, yy, key_x + _BAR_W + 3, yy], fill=_INK)
        d.text((key_x + _BAR_W + 6, yy - 7), text, fill=_INK, font=small)
    sy = by + _BAR_H + 12
    for swatch, text in swatches:
        if swatch is None:
            d.rectangle([key_x, sy, key_x + _BAR_W - 1, sy + 11], outline=ORIGIN_RGB, width=2)
        else:
            d.rectangle([key_x, sy, key_x + _BAR_W - 1, sy + 11], fill=swatch)
        d.text((key_x + _BAR_W + 6, sy - 1), text, fill=_INK, font=small)
        sy += 16

    data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return data.reshape(H, W, 3)

