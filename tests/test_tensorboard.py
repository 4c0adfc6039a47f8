"""TensorBoard dashboards (issue 6).

Event files are read back with TensorBoard's own loader (``EventAccumulator``) and
compared with the Session step for step; then a real ``tensorboard`` server is started on
the run, on loopback only, and its HTTP data API is asked for what a user's browser asks.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator as ea_mod
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util
from torch import nn

import amp_doctor
from amp_doctor import Session
from amp_doctor.device import stats as S
from amp_doctor.dtypes import limits
from amp_doctor.records import TensorStats
from amp_doctor.sinks import heatmap as hm
from amp_doctor.sinks import tb_session as tbv
from amp_doctor.sinks import tensorboard as tbs
from amp_doctor.sinks.tensorboard import TensorBoardSink, exp_buckets, exp_counts
from amp_doctor.sinks.text import risk_order
from tests.helpers import MLP, train, train_gan_two_scalers

CATEGORIES = ["Culprits (where inf/NaN or overflow started)", "Scaler", "Overflow risk",
              "Underflow", "Gradients"]
F16 = limits(torch.float16)


def _load(logdir: Path) -> ea_mod.EventAccumulator:
    guidance = {k: 0 for k in (ea_mod.SCALARS, ea_mod.HISTOGRAMS, ea_mod.IMAGES,
                               ea_mod.TENSORS, ea_mod.COMPRESSED_HISTOGRAMS)}
    return ea_mod.EventAccumulator(str(logdir), size_guidance=guidance).Reload()


def _f32(x: float) -> float:
    # Scalar events store float32 (Summary.Value.simple_value).
    return float(torch.tensor(x, dtype=torch.float32))


def _scalars(acc: ea_mod.EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@dataclass(frozen=True)
class _Hist:
    """One histogram event as TensorBoard's histogram tensor holds it ([k, 3] rows)."""

    step: int
    lefts: list[float]
    bucket_limit: list[float]  # right edges
    bucket: list[float]

    @property
    def min(self) -> float:
        return self.lefts[0]

    @property
    def max(self) -> float:
        return self.bucket_limit[-1]

    @property
    def num(self) -> float:
        return sum(self.bucket)


def _hists(acc: ea_mod.EventAccumulator, tag: str) -> list[_Hist]:
    out = []
    for e in acc.Tensors(tag):
        rows = tensor_util.make_ndarray(e.tensor_proto).tolist()
        out.append(_Hist(e.step, [r[0] for r in rows], [r[1] for r in rows],
                         [r[2] for r in rows]))
    assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "histograms"
    return out


def _text(acc: ea_mod.EventAccumulator, tag: str) -> list[str]:
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")]


def _expected_layer(a: TensorStats | None, g: TensorStats | None,
                    p: TensorStats | None = None) -> dict[str, float]:
    """What the sink must write for one layer-step, derived here from the record.

    Only real numbers: an infinite headroom or absmax has no point at all.
    """
    out: dict[str, float] = {}
    if a is not None:
        out.update(overflow=a.overflow_frac, underflow=a.underflow_frac, zeros=a.zero_frac,
                   nonfinite=round(a.nonfinite_frac * a.numel))
        if math.isfinite(a.headroom) and not a.nonfinite_frac:
            out["headroom"] = a.headroom
        if math.isfinite(a.absmax) and not a.nonfinite_frac:
            # Beside NaN the absmax is a histogram bin's top, not a value (review 56d).
            out["absmax"] = a.absmax
    if g is not None:
        out.update(grad_underflow=g.underflow_frac, grad_zeros=g.zero_frac,
                   grad_nonfinite=round(g.nonfinite_frac * g.numel))
        if math.isfinite(g.headroom) and not g.nonfinite_frac:
            out["grad_headroom"] = g.headroom
    if p is not None:
        out["param_grad_nonfinite"] = round(p.nonfinite_frac * p.numel)
    return out


def _per_layer_tags(acc: ea_mod.EventAccumulator) -> dict[str, set[str]]:
    by_layer: dict[str, set[str]] = {}
    for tag in acc.Tags()["scalars"]:
        group, _, layer = tag.partition("/")
        if group not in ("scaler", "culprits", tbv.LOSS_TAG):
            by_layer.setdefault(layer, set()).add(group)
    return by_layer


def _distinct(s: Session) -> list[str]:
    """Layers with their own tags: not a container that returns its last child's output."""
    return [lay.name for lay in s.layers if not lay.passthrough]


def _scale_every_step(s: Session) -> list[tuple[int, float]]:
    """The scale after each step's update, at every step, from the session's timeline."""
    assert s.scaler is not None
    points = dict(s.scaler.scale)
    out, value = [], None
    for st in range(min(points), s.steps):
        value = points.get(st, value)
        assert value is not None
        out.append((st, _f32(value)))
    return out


# -- one real run shared by the tests that only read it ----------------------------------

def _spiky_batches(spike_step: int) -> Any:
    g = torch.Generator().manual_seed(1)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        # One step with huge inputs: fc1's float16 output overflows, the step is skipped
        # and the scale backs off; the other steps are healthy and the scale grows.
        return (x * 1e5 if i == spike_step else x), y

    return batch


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Session]:
    logdir = tmp_path_factory.mktemp("tb_run")
    torch.manual_seed(0)
    model = MLP()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    with amp_doctor.watch(model, every=1, logdir=logdir) as doctor:
        train(model, steps=8, scaler=scaler, batch=_spiky_batches(3))
    s = doctor.session
    # The story the dashboards must tell: growth, one backoff at the spike, findings.
    assert s.scaler is not None and s.scaler.backoff_steps == [3] and s.scaler.growth_steps
    assert {f.kind for f in s.findings} >= {"activation_overflow", "scaler_backoff"}
    return logdir, s


def test_scalars_match_the_session_step_for_step(run: tuple[Path, Session]) -> None:
    logdir, s = run
    acc = _load(logdir)
    assert s.scaler is not None
    # Every training step has its scale, and log2 of it.
    assert _scalars(acc, "scaler/scale") == _scale_every_step(s)
    assert _scalars(acc, "scaler/log2_scale") == [
        (st, _f32(math.log2(v))) for st, v in _scale_every_step(s)]
    steps = list(range(s.steps))
    assert _scalars(acc, "scaler/backoffs") == [
        (st, float(sum(b <= st for b in s.scaler.backoff_steps))) for st in steps]
    assert _scalars(acc, "scaler/skipped") == [
        (st, float(sum(b <= st for b in s.scaler.skipped_steps))) for st in steps]
    # The loss at each recorded step, before the loss scale (review 52b: no loss chart).
    # The spike's NaN loss (step 3) has no point.
    losses = {rec.step: rec.loss for rec in s.history}
    assert len(losses) == 8 and math.isnan(losses.pop(3))  # type: ignore[arg-type]
    assert _scalars(acc, tbv.LOSS_TAG) == [(st, _f32(v)) for st, v in losses.items()]  # type: ignore[arg-type]

    # 4 layers <= top_k: every layer, every recorded step, written live; the root
    # returns fc2's output, so its tags would be fc2's again: left out.
    names = _distinct(s)
    assert "MLP" not in names and s.layer("MLP").passthrough
    assert set(_per_layer_tags(acc)) == set(names)
    for name in names:
        want: dict[str, list[tuple[int, float]]] = {}
        for rec in s.history:
            ls = rec.layers[name]
            for group, v in _expected_layer(ls.act, ls.grad, ls.param_grad).items():
                want.setdefault(group, []).append((rec.step, _f32(v)))
        for group, pts in want.items():
            assert _scalars(acc, f"{group}/{name}") == pts, (group, name)
    # The spike: fc1 overflowed to inf at step 3. It is a count, never a clamped
    # stand-in: no headroom or absmax point at all where the truth is -inf / inf.
    assert s.history[3].layers["fc1"].act.headroom == -math.inf  # type: ignore[union-attr]
    assert dict(_scalars(acc, "nonfinite/fc1"))[3] > 0
    assert 3 not in dict(_scalars(acc, "headroom/fc1"))
    assert 3 not in dict(_scalars(acc, "absmax/fc1"))
    # fc2 carried it on, NaN whole: no absmax point of 0 (a dead layer's look).
    assert s.history[3].layers["fc2"].act.nonfinite_frac == 1.0  # type: ignore[union-attr]
    assert 3 not in dict(_scalars(acc, "absmax/fc2"))
    # The weights' gradients, what the GradScaler skipped step 3 on, are charted too: the
    # backoff note names layers by them (review 52b).
    assert dict(_scalars(acc, "param_grad_nonfinite/fc1"))[3] > 0
    assert dict(_scalars(acc, "param_grad_nonfinite/fc1"))[2] == 0
    assert "act" not in {t.split("/", 1)[1] for t in acc.Tags()["scalars"]
                         if t.startswith("param_grad_nonfinite/")}  # no weights, no chart
    span = F16.max_exponent - F16.min_exponent
    for tag in acc.Tags()["scalars"]:
        # The culprits' own headroom chart is the documented exception: clipped at -span.
        if "headroom" in tag and not tag.startswith("culprits/"):
            assert all(math.isfinite(v) and abs(v) != span for _, v in _scalars(acc, tag)), tag


def test_exponent_histograms_span_the_format_and_count_everything(
        run: tuple[Path, Session]) -> None:
    logdir, s = run
    acc = _load(logdir)
    m, big = F16.min_exponent, F16.max_exponent
    for name in ("fc1", "fc2"):
        for fld in ("act", "grad"):
            events = _hists(acc, f"{fld}_exp/{name}")
            assert [e.step for e in events] == [rec.step for rec in s.history]
            for h, rec in zip(events, s.history, strict=True):
                limits_ = list(h.bucket_limit)
                full = [float(x) for x in range(m - 1, big + 3)]
                # Fixed buckets of one bit, up to the inf/NaN one; from the first
                # non-empty one (so DISTRIBUTIONS start at the smallest real value).
                i = full.index(limits_[0])
                assert limits_ == full[i:i + len(limits_)]
                assert h.bucket[0] > 0 and h.bucket[-1] > 0
                assert h.lefts == [x - 1 for x in limits_]
                ts = getattr(rec.layers[name], fld)
                # Every non-zero value is drawn; exact zeros are the zeros/ scalar.
                zeros = round(ts.zero_frac * ts.numel)
                assert h.num == sum(h.bucket) == ts.numel - zeros
                # Bucket [M+1, M+2) is inf/NaN; [M, M+1) finite >= max.
                by_right = dict(zip(h.bucket_limit, h.bucket, strict=True))
                assert by_right.get(big + 2.0, 0) == round(ts.nonfinite_frac * ts.numel)
                assert by_right.get(big + 2.0, 0) + by_right.get(big + 1.0, 0) >= round(
                    ts.overflow_frac * ts.numel)
    spike = _hists(acc, "act_exp/fc1")[3]
    assert spike.bucket_limit[-1] == F16.max_exponent + 2 and spike.bucket[-1] > 0  # inf


def test_exp_counts_puts_each_value_in_its_bucket() -> None:
    x = torch.tensor([0.0, -0.0, 1e-10, 1e-6, 1.0, 3.0, -2.0, 40000.0, 65504.0, 70000.0,
                      math.inf, -math.inf, math.nan, 1e-40, 3.4e38])
    row = S.summary_row(x)
    f16 = exp_buckets(F16)
    c = exp_counts(row, f16)
    assert sum(c) == x.numel()

    def at(eb: tbs.ExpBuckets, e: int) -> float:
        return c[2 + e - eb.fmt.min_exponent]

    assert c[f16.zero] == 2
    assert c[f16.flush] == 2  # 1e-10 and the float32 subnormal 1e-40 flush to zero
    assert at(f16, -20) == 1 and at(f16, 0) == 1 and at(f16, 1) == 2
    assert at(f16, 15) == 2  # 40000 and 65504: the max itself fits
    assert c[f16.overflow] == 2  # 70000, 3.4e38
    assert c[f16.nonfinite] == 3

    bf = exp_buckets(limits(torch.bfloat16))
    c = exp_counts(row, bf)
    assert sum(c) == x.numel()
    assert c[bf.zero] == 2 and c[bf.flush] == 0
    assert at(bf, -34) == 1 and at(bf, -127) == 1  # 1e-10; 1e-40 -> documented bucket
    assert at(bf, 15) == 2 and at(bf, 16) == 1  # 65504 and 70000 fit in bfloat16
    # 3.4e38 is beyond bfloat16's max (3.39e38) but below 2**128, in float32's top bin: with
    # a NaN in the tensor neither the histogram nor min/max can place it (stats.decode_many).
    assert at(bf, 127) == 1 and c[bf.overflow] == 0 and c[bf.nonfinite] == 3


def test_exp_counts_places_a_float32_beyond_the_max_by_the_exact_extremes() -> None:
    # 65510 is beyond float16's max but shares its float32 exponent with it; min/max
    # are exact, so the summary still knows one value is beyond.
    row = S.summary_row(torch.tensor([1.0, 65000.0, 65510.0]))
    c = exp_counts(row, exp_buckets(F16))
    assert c[exp_buckets(F16).overflow] == 1 and sum(c) == 3
    assert S.decode(row.tolist(), F16).overflow_frac == pytest.approx(1 / 3)


def test_a_steps_histograms_counted_together_equal_each_row_counted_alone() -> None:
    # One decode for a step's live layers instead of one per row; each row's counts,
    # the moved-up 65510 and a sampled (scaled, non-integer) row included, are the same.
    g = torch.Generator().manual_seed(5)
    xs = [torch.tensor([1.0, 65000.0, 65510.0]), torch.tensor([0.0, math.inf, math.nan, 3.0]),
          torch.randn(3 * S.SAMPLE_LIMIT + 7, generator=g) * 1e-4,
          (torch.randn(300, generator=g) * 1e5).half().float()]
    rows = torch.stack([S.summary_row(x) for x in xs])
    for fmt in (F16, limits(torch.bfloat16)):
        eb = exp_buckets(fmt)
        together = tbs.exp_counts_many(rows, eb)
        assert together == [exp_counts(r, eb) for r in rows]
        assert together[0][eb.overflow] == (1 if fmt is F16 else 0)
        assert sum(together[2]) == pytest.approx(xs[2].numel())


def _rgb(ev: Any) -> Image.Image:
    return Image.open(io.BytesIO(ev.encoded_image_string)).convert("RGB")


def _bands(img: Image.Image, x: int, y0: int, y1: int) -> list[tuple[int, int, int]]:
    """Colours of the runs of non-white pixels down column ``x`` (one per drawn row)."""
    out: list[tuple[int, int, int]] = []
    prev_white = True
    for y in range(y0, y1):
        px = img.getpixel((x, y))
        white = px == (255, 255, 255)
        if not white and prev_white:
            out.append(px)
        prev_white = white
    return out


def test_heatmaps_text_and_layout_are_in_the_event_files(run: tuple[Path, Session]) -> None:
    logdir, s = run
    acc = _load(logdir)
    fmt = F16
    grids = tbv.heatmap_grids(s, fmt)
    names = _distinct(s)
    for tag in ("heatmap/headroom", "heatmap/underflow", "heatmap/grad_headroom",
                "heatmap/grad_underflow"):
        (ev,) = acc.Images(tag)
        img = _rgb(ev)
        assert img.size == (ev.width, ev.height)
        grid = grids[tag]
        assert grid.names == names and grid.steps == [r.step for r in s.history]
        geo = hm.geometry(grid)
        # Shown 1:1: a row is tall enough for its label, and the whole picture fits
        # TensorBoard's image card, which would otherwise shrink it.
        assert hm.fit_columns(grid) == grid  # 8 steps: one column each
        assert geo.ch == hm.ROW_HEIGHT and ev.width <= hm.CARD_WIDTH
        assert len(grid.steps) * geo.cw <= hm.plot_width(grid)
        # One band of colour per layer down the first column: rows = layers.
        bottom = geo.y0 + len(names) * geo.ch
        assert len(_bands(img, geo.x0 + geo.cw // 2, geo.y0, bottom)) == len(names)
        # Every row has its label: dark text pixels left of the plot.
        for r in range(len(names)):
            ys = range(geo.y0 + r * geo.ch, geo.y0 + (r + 1) * geo.ch)
            assert any(sum(img.getpixel((x, y))) < 200 for y in ys
                       for x in range(geo.x0 - 60, geo.x0 - 4)), (tag, names[r])
        # The colour bar is there: a continuous viridis ramp below the plot.
        bottom_of_plot = geo.y0 + len(names) * geo.ch
        ramp = {hm.ramp(i / 1000) for i in range(1001)}
        bar = {px for x in range(ev.width) for y in range(bottom_of_plot, ev.height)
               if (px := img.getpixel((x, y))) in ramp}
        assert len(bar) > 50

    grid = grids["heatmap/headroom"]
    geo = hm.geometry(grid)
    img = _rgb(acc.Images("heatmap/headroom")[0])
    fc1 = names.index("fc1")

    def centre(r: int, c: int) -> tuple[int, int]:
        return (geo.x0 + c * geo.cw + geo.cw // 2, geo.y0 + r * geo.ch + geo.ch // 2)

    # fc1 at the spike (column 3) is red, inf in its output; at step 0 it is on the ramp.
    assert img.getpixel(centre(fc1, 3)) == hm.NONFINITE_RGB
    assert img.getpixel(centre(fc1, 0)) not in (hm.NONFINITE_RGB, hm.MISSING_RGB)
    # fc1 is where the inf started (the backoff's forward origin): framed, and its label
    # highlighted; fc2 downstream (red too, if it passed the inf on) is not framed.
    assert fc1 in grid.origin_rows and (fc1, 3) in grid.origin_cells
    x, y = geo.x0 + 3 * geo.cw, geo.y0 + fc1 * geo.ch
    assert img.getpixel((x + 1, y + geo.ch // 2)) == hm.ORIGIN_RGB
    assert names.index("fc2") not in grid.origin_rows
    x2, y2 = geo.x0 + 3 * geo.cw, geo.y0 + names.index("fc2") * geo.ch
    assert img.getpixel((x2 + 1, y2 + geo.ch // 2)) != hm.ORIGIN_RGB

    (findings,) = _text(acc, "findings")
    for f in s.findings:
        assert f.kind in findings
    assert "GradScaler on" in findings
    (backoff,) = _text(acc, "backoffs")
    assert "step 3" in backoff and "fc1" in backoff
    (legend,) = _text(acc, "heatmap_legend")
    assert all(f"| {i} | {name} |" in legend for i, name in enumerate(names))
    assert "model order" in legend and "Origin: `fc1`" in legend

    # The layout written at start, and the run's own at close (TensorBoard reads the last).
    start, end = acc.Tensors("custom_scalars__config__")
    for cfg in (start, end):
        layout = layout_pb2.Layout.FromString(cfg.tensor_proto.string_val[0])
        assert [c.title for c in layout.category] == CATEGORIES

    # The culprit's own charts: fc1's figures, step for step, under culprits/fc1/.
    for group in ("overflow", "nonfinite", "grad_nonfinite"):
        assert [st for st, _ in _scalars(acc, f"culprits/fc1/{group}")] == [
            st for st, _ in _scalars(acc, f"{group}/fc1")]
    assert _scalars(acc, "culprits/fc1/nonfinite") == _scalars(acc, "nonfinite/fc1")
    # Its headroom too, and the spike, where fc1 overflowed to inf (headroom -inf, no
    # point in headroom/fc1), drawn at the float16 floor instead of left out.
    plain = dict(_scalars(acc, "headroom/fc1"))
    culprit = dict(_scalars(acc, "culprits/fc1/headroom"))
    assert 3 not in plain and culprit[3] == tbv.headroom_floor(F16) == -40.0
    assert culprit == {**plain, 3: -40.0}
    assert not [t for t in acc.Tags()["scalars"]
                if t.startswith("culprits/") and not t.startswith("culprits/fc1/")]


def test_long_runs_merge_steps_and_keep_the_worst() -> None:
    steps = list(range(0, 6000, 10))  # 600 recorded steps
    values: list[list[float | None]] = [[12.0] * 600, [20.0] * 600]
    values[0][301] = 0.5  # one step with almost no headroom left
    nonfinite = [[False] * 600, [False] * 600]
    nonfinite[1][450] = True
    grid = hm.HeatmapGrid(names=["a", "b"], steps=steps, values=values,
                          nonfinite=nonfinite, overflow=[[False] * 600] * 2,
                          figure="headroom", title="t", origin_rows={1: None},
                          origin_cells={(1, 450)})
    fitted = hm.fit_columns(grid)
    k = 600 // len(fitted.steps) + (600 % len(fitted.steps) > 0)
    assert len(fitted.steps) * 2 <= hm.plot_width(grid) < 600 and k > 1
    assert fitted.steps[0] == 0 and fitted.steps[1] == 10 * k
    assert min(v for v in fitted.values[0] if v is not None) == 0.5  # not averaged away
    assert sum(fitted.nonfinite[1]) == 1 and fitted.origin_cells == {(1, 450 // k)}
    img = hm.render_heatmap(grid, F16)
    assert img.shape[1] <= hm.CARD_WIDTH and img.dtype == torch.uint8


def test_only_the_worst_k_layers_get_scalars_and_every_layer_is_in_the_heatmap(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    linears = [nn.Linear(16, 16) for _ in range(4)]
    model = nn.Sequential(*[nn.Sequential(lin, nn.ReLU()) for lin in linears], nn.Linear(16, 4))
    with torch.no_grad():
        linears[1].weight.mul_(1e6)  # layer 1.0 overflows float16: it must be picked
    with amp_doctor.watch(model, every=1, logdir=tmp_path, top_k=4) as doctor:
        train(model, steps=3)
    s = doctor.session
    acc = _load(tmp_path)
    worst = [lay.name for lay in risk_order(
        [x for x in s.layers if x.recorded_steps and not x.passthrough])][:4]
    assert "1.0" in worst
    per_layer = _per_layer_tags(acc)
    assert set(per_layer) == set(worst) and len(s.layers) > 4
    for name in worst:
        assert [st for st, _ in _scalars(acc, f"overflow/{name}")] == [r.step for r in s.history]
        # Whole-run exponent histograms for the chosen layers: one event, every non-zero
        # value (exact zeros are the zeros/ scalar).
        (h,) = _hists(acc, f"act_exp_total/{name}")
        acts = [a for r in s.history if (a := r.layers[name].act) is not None]
        assert h.num == sum(a.numel - round(a.zero_frac * a.numel)
                                            for a in acts)
    assert not [t for t in acc.Tags()["tensors"] if t.startswith("act_exp/")]
    (img,) = acc.Images("heatmap/headroom")
    grid = tbv.heatmap_grids(s, F16)["heatmap/headroom"]
    geo = hm.geometry(grid)
    assert grid.names == _distinct(s) and len(grid.names) > 4
    bands = _bands(_rgb(img), geo.x0 + geo.cw // 2, geo.y0, geo.y0 + len(grid.names) * geo.ch)
    assert len(bands) == len(grid.names)


def test_unrecorded_steps_still_reach_the_scaler_charts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    with amp_doctor.watch(model, every=3, logdir=tmp_path) as doctor:
        train(model, steps=8, scaler=scaler, batch=_spiky_batches(4))  # 4: not recorded
    s = doctor.session
    acc = _load(tmp_path)
    assert s.scaler is not None and 4 in s.scaler.backoff_steps
    assert _scalars(acc, "scaler/scale") == _scale_every_step(s)
    assert [st for st, _ in _scalars(acc, "scaler/scale")] == list(range(8))
    assert (4, 1.0) in _scalars(acc, "scaler/backoffs")
    assert (3, 0.0) in _scalars(acc, "scaler/backoffs")
    assert [st for st, _ in _scalars(acc, "overflow/fc1")] == [0, 3, 6]


def test_a_second_gradscaler_has_its_own_scaler_charts(tmp_path: Path) -> None:
    # A GAN with a GradScaler per network: the generator's backs off at step 6. Its
    # timeline is written at close as scaler/<its optimizer>/..., in the Scaler tab's
    # charts beside the first scaler's, with no warning about the tag's characters.
    torch.manual_seed(0)
    gen, disc = MLP(16, 32, 4), MLP(4, 32, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp_doctor.watch({"gen": gen, "disc": disc}, every=5, logdir=tmp_path) as doctor:
            train_gan_two_scalers(gen, disc, iters=10, boost_at=6)
    (other,) = doctor.session.other_scalers
    prefix = "scaler/" + other.name.replace("#", "_") + "/"
    acc = _load(tmp_path)
    assert [v for _, v in _scalars(acc, prefix + "scale")] == [65536.0] * 6 + [32768.0] * 4
    assert [st for st, v in _scalars(acc, prefix + "backoffs") if v == 1.0] == [6, 7, 8, 9]
    assert _scalars(acc, prefix + "skipped")[-1] == (9, 1.0)
    assert _scalars(acc, "scaler/backoffs")[-1] == (9, 1.0)  # the first: step 0's settling
    # The layout written last (at close) has a chart set per scaler, titled with its
    # optimizers: one run's lines share a colour, so one chart could not tell them apart.
    proto = layout_pb2.Layout()
    proto.ParseFromString(acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    (cat,) = [c for c in proto.category if c.title == "Scaler"]
    charts = {ch.title: list(ch.multiline.tag) for ch in cat.chart}
    first = doctor.session.scaler
    assert first is not None
    # ... and the network its optimizer steps, as the report says it.
    assert charts["loss scale (after each update): GradScaler of Adam#0 (params of disc)"] == [
        r"^scaler/scale$"]
    (rx,) = charts[f"scale backoffs (cumulative): GradScaler of {other.name} (params of gen)"]
    assert re.match(rx, prefix + "backoffs") and not re.match(rx, "scaler/backoffs")
    # One loss chart, whatever the scalers.
    assert charts[tbv.LOSS_TITLE] == [r"^loss$"]
    assert len(charts) == 9


def test_bfloat16_histograms_span_bfloat16(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=1, logdir=tmp_path):
        train(model, steps=2, dtype=torch.bfloat16, scaler=False)
    bf = limits(torch.bfloat16)
    h = _hists(_load(tmp_path), "act_exp/fc1")[0]
    assert h.bucket[0] > 0 and h.bucket[-1] > 0
    full = [float(x) for x in range(bf.min_exponent - 1, bf.max_exponent + 3)]
    i = full.index(h.bucket_limit[0])
    assert h.bucket_limit == full[i:i + len(h.bucket_limit)]
    # The description carries bfloat16's limits, which the axis need not reach.
    desc = _load(tmp_path).SummaryMetadata("act_exp/fc1").summary_description
    assert "bfloat16" in desc and f"x = {bf.normal_exponent}" in desc


def test_event_files_are_flushed_when_the_loop_raises(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    with pytest.raises(RuntimeError, match="boom"):
        with amp_doctor.watch(model, every=1, logdir=tmp_path):
            train(model, steps=2)
            raise RuntimeError("boom")
    acc = _load(tmp_path)
    assert [st for st, _ in _scalars(acc, "overflow/fc1")] == [0, 1]
    (findings,) = _text(acc, "findings")
    assert "exception" in findings


def test_finish_is_idempotent_and_survives_a_failing_part(
        run: tuple[Path, Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, s = run
    sink = TensorBoardSink(tmp_path / "a", top_k=4)
    sink.finish(s)
    sink.finish(s)  # second call: no-op, no error
    assert len(_text(_load(tmp_path / "a"), "findings")) == 1

    def boom(_: Session) -> str:
        raise ValueError("renderer broke")

    monkeypatch.setattr(tbs, "render_markdown", boom)
    sink = TensorBoardSink(tmp_path / "b", top_k=4)
    with pytest.warns(RuntimeWarning, match="renderer broke"):
        sink.finish(s)
    acc = _load(tmp_path / "b")
    assert acc.Images("heatmap/headroom") and acc.Scalars("scaler/scale")  # the rest written
    assert not acc.Tags()["tensors"] or "findings/text_summary" not in acc.Tags()["tensors"]


def test_the_event_file_has_no_writer_thread_and_a_failed_write_is_kept_not_printed(
        run: tuple[Path, Session], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # tensorboard's writer thread was visible to the script from its `import torch` on (a
    # loop waiting for `threading.active_count() == 1` never ended), and its errors were
    # tracebacks in the user's output, held back by a patched threading.excepthook.
    _, s = run
    threads, hook = threading.enumerate(), threading.excepthook
    sink = TensorBoardSink(tmp_path / "tb", top_k=4)
    assert threading.enumerate() == threads and threading.excepthook is hook
    # The file goes bad under the writer: its descriptor now refuses writes (EBADF).
    fd = sink._writer.file_writer.event_writer._fd  # type: ignore[union-attr]
    readonly = os.open(os.devnull, os.O_RDONLY)
    os.dup2(readonly, fd)
    os.close(readonly)
    sink.finish(s)
    assert sink.error is not None and sink.error.startswith("OSError"), sink.error
    assert capfd.readouterr().err == ""


# -- the real dashboard path ---------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, no proxy


def _get(port: int, path: str, **query: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    with _HTTP.open(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.fixture
def server(run: tuple[Path, Session], tmp_path: Path) -> Iterator[int]:
    logdir, _ = run
    port = _free_port()
    log = (tmp_path / "tensorboard.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_PROXY": "127.0.0.1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tensorboard exited {proc.returncode}: "
                            + (tmp_path / "tensorboard.log").read_text()[-2000:])
            try:
                _get(port, "/data/plugins_listing")
                # Answering is not enough: wait until it has read the run.
                if _get(port, "/data/plugin/scalars/tags"):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("tensorboard did not serve the run within 60 s: "
                            + (tmp_path / "tensorboard.log").read_text()[-2000:])
            time.sleep(0.25)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_a_real_tensorboard_serves_the_dashboards(run: tuple[Path, Session],
                                                  server: int) -> None:
    _, s = run
    port = server
    plugins = _get(port, "/data/plugins_listing")
    for p in ("scalars", "custom_scalars", "text", "images", "histograms"):
        assert plugins[p]["enabled"], p

    (run_name,) = _get(port, "/data/plugin/scalars/tags")
    tags = _get(port, "/data/plugin/scalars/tags")[run_name]
    assert {"scaler/scale", "scaler/log2_scale", "scaler/skipped",
            "scaler/backoffs"} <= set(tags)
    for name in _distinct(s):
        assert {f"overflow/{name}", f"headroom/{name}", f"zeros/{name}",
                f"grad_underflow/{name}"} <= set(tags)
    assert s.scaler is not None
    served = _get(port, "/data/plugin/scalars/scalars", run=run_name, tag="scaler/scale")
    assert [(p[1], p[2]) for p in served] == _scale_every_step(s)

    layout = _get(port, "/data/plugin/custom_scalars/layout")
    assert [c["title"] for c in layout["category"]] == CATEGORIES
    charts = {t for c in layout["category"] for ch in c["chart"] for t in ch["multiline"]["tag"]}
    assert r"^scaler/scale$" in charts and r"^grad_underflow/" in charts
    # The charts' regexes select the right tags through the plugin itself.
    picked = _get(port, "/data/plugin/custom_scalars/scalars", run=run_name, tag=r"^underflow/")
    assert picked["regex_valid"] and set(picked["tag_to_events"]) == {
        f"underflow/{name}" for name in _distinct(s)}
    culprits = _get(port, "/data/plugin/custom_scalars/scalars", run=run_name,
                    tag=r"^culprits/.*/headroom$")
    assert set(culprits["tag_to_events"]) == {"culprits/fc1/headroom"}
    # One culprit: its charts carry its name (a chart's lines share their run's colour),
    # and their regexes pick its tags (review 56d).
    (group,) = [c for c in layout["category"] if c["title"].startswith("Culprits")]
    titles = {ch["title"]: ch["multiline"]["tag"][0] for ch in group["chart"]}
    assert len(titles) == 4 and all(t.startswith("fc1: ") for t in titles)
    own = _get(port, "/data/plugin/custom_scalars/scalars", run=run_name,
               tag=next(rx for t, rx in titles.items() if "headroom to" in t))
    assert set(own["tag_to_events"]) == {"culprits/fc1/headroom"}

    text_tags = _get(port, "/data/plugin/text/tags")[run_name]
    assert "findings/text_summary" in text_tags
    (doc,) = _get(port, "/data/plugin/text/text", run=run_name, tag="findings/text_summary")
    for f in s.findings:
        assert f.kind in doc["text"]

    images = _get(port, "/data/plugin/images/tags")[run_name]
    assert {"heatmap/headroom", "heatmap/underflow", "heatmap/grad_headroom",
            "heatmap/grad_underflow"} <= set(images)
    hist = _get(port, "/data/plugin/histograms/histograms", run=run_name, tag="act_exp/fc1")
    buckets = hist[0][2]
    assert buckets[0][2] > 0 and buckets[-1][2] > 0
    assert buckets[0][0] >= F16.min_exponent - 2 and buckets[-1][1] <= F16.max_exponent + 2
    # The card's info text names the format's limits on the axis.
    hist_tags = _get(port, "/data/plugin/histograms/tags")[run_name]
    assert {"act_exp/fc1", "grad_exp/fc2"} <= set(hist_tags)
    desc = hist_tags["act_exp/fc1"]["description"]
    assert "x = -14" in desc and "65504" in desc and "zeros/" in desc


# -- the scaler, live at every step ------------------------------------------------------

def test_backoff_note_names_the_op_where_inf_started() -> None:
    s = Session.load(Path(__file__).parent / "golden" / "anomaly_hidden_op.json")
    ((step, note),) = tbv.backoff_groups(s)
    assert step == 0 and "steps 0-11" in note
    assert "inf/NaN started in: mlp.act [aten.pow]" in note
    assert tbv.culprit_layers(s) == {"mlp.act": "aten.pow"}


def test_the_scale_is_written_at_every_step_as_it_happens(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    doctor = amp_doctor.watch(model, every=4, logdir=tmp_path)
    try:
        train(model, steps=7, scaler=scaler, batch=_spiky_batches(5))  # 5: not recorded
        # Before the run ends: every step so far is on disk, with the real scale.
        assert doctor._tb is not None
        doctor._tb._writer.flush()
        live = _load(tmp_path)
        assert [st for st, _ in _scalars(live, "scaler/scale")] == list(range(7))
        # The scale GradScaler itself reports now is the last point.
        assert _scalars(live, "scaler/scale")[-1] == (6, _f32(scaler.get_scale()))
        assert dict(_scalars(live, "scaler/backoffs"))[5] == 1.0
        assert dict(_scalars(live, "scaler/backoffs"))[4] == 0.0
        assert dict(_scalars(live, "scaler/skipped"))[5] == 1.0
    finally:
        doctor.close()
    s = doctor.session
    acc = _load(tmp_path)
    # Nothing written twice, nothing out of order; the same as the session's timeline.
    assert _scalars(acc, "scaler/scale") == _scale_every_step(s)
    assert _scalars(acc, "scaler/log2_scale") == [
        (st, _f32(math.log2(v))) for st, v in _scale_every_step(s)]
    assert s.scaler is not None and s.scaler.backoff_steps == [5]
