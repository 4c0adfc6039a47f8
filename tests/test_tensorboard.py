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
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator as ea_mod
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn

import amp_doctor
from amp_doctor import Session
from amp_doctor import stats as S
from amp_doctor.dtypes import FormatLimits, limits
from amp_doctor.records import TensorStats
from amp_doctor.sinks import tensorboard as tbs
from amp_doctor.sinks.tensorboard import TensorBoardSink, exp_buckets, exp_counts
from amp_doctor.sinks.text import risk_order
from tests.helpers import MLP, train

CATEGORIES = ["Scaler", "Overflow risk", "Underflow", "Gradients"]
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


def _text(acc: ea_mod.EventAccumulator, tag: str) -> list[str]:
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")]


def _expected_layer(a: TensorStats | None, g: TensorStats | None,
                    fmt: FormatLimits) -> dict[str, float]:
    """What the sink must write for one layer-step, derived here from the record."""
    span = fmt.max_exponent - fmt.min_exponent
    out: dict[str, float] = {}
    if a is not None:
        out.update(overflow=a.overflow_frac, underflow=a.underflow_frac,
                   nonfinite=round(a.nonfinite_frac * a.numel))
        if not math.isnan(a.headroom):
            out["headroom"] = max(-span, min(span, a.headroom))
        if math.isfinite(a.absmax):
            out["absmax"] = a.absmax
    if g is not None:
        out.update(grad_underflow=g.underflow_frac,
                   grad_nonfinite=round(g.nonfinite_frac * g.numel))
        if not math.isnan(g.headroom):
            out["grad_headroom"] = max(-span, min(span, g.headroom))
    return out


def _per_layer_tags(acc: ea_mod.EventAccumulator) -> dict[str, set[str]]:
    by_layer: dict[str, set[str]] = {}
    for tag in acc.Tags()["scalars"]:
        group, _, layer = tag.partition("/")
        if group != "scaler":
            by_layer.setdefault(layer, set()).add(group)
    return by_layer


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
    assert _scalars(acc, "scaler/scale") == [(st, _f32(v)) for st, v in s.scaler.scale]
    steps = [st for st, _ in s.scaler.scale]
    assert _scalars(acc, "scaler/backoffs") == [
        (st, float(sum(b <= st for b in s.scaler.backoff_steps))) for st in steps]
    assert _scalars(acc, "scaler/skipped") == [
        (st, float(sum(b <= st for b in s.scaler.skipped_steps))) for st in steps]

    # 4 layers <= top_k: every layer, every recorded step, written live.
    names = [lay.name for lay in s.layers]
    assert set(_per_layer_tags(acc)) == set(names)
    for name in names:
        want: dict[str, list[tuple[int, float]]] = {}
        for rec in s.history:
            ls = rec.layers[name]
            for group, v in _expected_layer(ls.act, ls.grad, F16).items():
                want.setdefault(group, []).append((rec.step, _f32(v)))
        for group, pts in want.items():
            assert _scalars(acc, f"{group}/{name}") == pts, (group, name)
    # The spike: fc1 overflowed to inf at step 3, visible as a count and as headroom < 0.
    assert dict(_scalars(acc, "nonfinite/fc1"))[3] > 0
    assert dict(_scalars(acc, "headroom/fc1"))[3] == -(F16.max_exponent - F16.min_exponent)
    assert 3 not in dict(_scalars(acc, "absmax/fc1"))  # inf is counted, not plotted


def test_exponent_histograms_span_the_format_and_count_everything(
        run: tuple[Path, Session]) -> None:
    logdir, s = run
    acc = _load(logdir)
    m, big = F16.min_exponent, F16.max_exponent
    for name in ("fc1", "fc2"):
        for fld in ("act", "grad"):
            events = acc.Histograms(f"{fld}_exp/{name}")
            assert [e.step for e in events] == [rec.step for rec in s.history]
            for e, rec in zip(events, s.history, strict=True):
                h = e.histogram_value
                limits_ = list(h.bucket_limit)
                # Fixed buckets of one bit; the format's limits are edges.
                assert limits_ == [float(x) for x in range(m - 1, big + 3)]
                assert {m, F16.normal_exponent, big} <= set(limits_)
                assert (h.min, h.max) == (m - 2, big + 2)
                ts = getattr(rec.layers[name], fld)
                assert h.num == sum(h.bucket) == ts.numel  # nothing dropped
                # Top bucket [M+1, M+2) is inf/NaN; [M, M+1) finite >= max.
                assert h.bucket[-1] == round(ts.nonfinite_frac * ts.numel)
                assert h.bucket[-1] + h.bucket[-2] >= round(ts.overflow_frac * ts.numel)
                assert h.bucket[0] == round(ts.zero_frac * ts.numel)
    spike = acc.Histograms("act_exp/fc1")[3].histogram_value
    assert spike.bucket[-1] > 0


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


def test_heatmaps_text_and_layout_are_in_the_event_files(run: tuple[Path, Session]) -> None:
    logdir, s = run
    acc = _load(logdir)
    rows, cols = len(s.layers), len(s.history)
    cell_h, cell_w = min(16, 1024 // rows), min(16, 1024 // cols)
    for tag in ("heatmap/headroom", "heatmap/underflow", "heatmap/grad_headroom"):
        (ev,) = acc.Images(tag)
        assert (ev.height, ev.width) == (rows * cell_h, cols * cell_w)
        img = Image.open(io.BytesIO(ev.encoded_image_string)).convert("RGB")
        assert img.size == (cols * cell_w, rows * cell_h)
    # fc1 (row 0) at the spike (column 3) is marked red: inf in its output.
    img = Image.open(io.BytesIO(acc.Images("heatmap/headroom")[0].encoded_image_string))
    assert img.convert("RGB").getpixel((3 * cell_w + 1, 1)) == (255, 0, 0)
    assert img.convert("RGB").getpixel((0 * cell_w + 1, 1)) != (255, 0, 0)

    (findings,) = _text(acc, "findings")
    for f in s.findings:
        assert f.kind in findings
    assert "GradScaler on" in findings
    (backoff,) = _text(acc, "backoffs")
    assert "step 3" in backoff and "fc1" in backoff
    (legend,) = _text(acc, "heatmap_legend")
    assert all(f"| {i} | {lay.name} |" in legend for i, lay in enumerate(s.layers))

    (cfg,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(cfg.tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == CATEGORIES


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
    worst = [lay.name for lay in risk_order([x for x in s.layers if x.recorded_steps])][:4]
    assert "1.0" in worst
    per_layer = _per_layer_tags(acc)
    assert set(per_layer) == set(worst) and len(s.layers) > 4
    for name in worst:
        assert [st for st, _ in _scalars(acc, f"overflow/{name}")] == [r.step for r in s.history]
        # Whole-run exponent histograms for the chosen layers: one event, every value.
        (h,) = acc.Histograms(f"act_exp_total/{name}")
        acts = [a for r in s.history if (a := r.layers[name].act) is not None]
        assert h.histogram_value.num == sum(a.numel for a in acts)
    assert not [t for t in acc.Tags()["histograms"] if t.startswith("act_exp/")]
    rows = len(s.layers)
    (img,) = acc.Images("heatmap/headroom")
    assert img.height == rows * min(16, 1024 // rows)


def test_unrecorded_steps_still_reach_the_scaler_charts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    with amp_doctor.watch(model, every=3, logdir=tmp_path) as doctor:
        train(model, steps=8, scaler=scaler, batch=_spiky_batches(4))  # 4: not recorded
    s = doctor.session
    acc = _load(tmp_path)
    assert s.scaler is not None and 4 in s.scaler.backoff_steps
    assert _scalars(acc, "scaler/scale") == [(st, _f32(v)) for st, v in s.scaler.scale]
    assert (4, 1.0) in _scalars(acc, "scaler/backoffs")
    assert [st for st, _ in _scalars(acc, "overflow/fc1")] == [0, 3, 6]


def test_bfloat16_histograms_span_bfloat16(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=1, logdir=tmp_path):
        train(model, steps=2, dtype=torch.bfloat16, scaler=False)
    bf = limits(torch.bfloat16)
    h = _load(tmp_path).Histograms("act_exp/fc1")[0].histogram_value
    assert (h.bucket_limit[0], h.bucket_limit[-1]) == (bf.min_exponent - 1, bf.max_exponent + 2)
    assert {bf.min_exponent, bf.normal_exponent, bf.max_exponent} <= set(h.bucket_limit)


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
    assert {"scaler/scale", "scaler/skipped", "scaler/backoffs"} <= set(tags)
    for lay in s.layers:
        assert {f"overflow/{lay.name}", f"headroom/{lay.name}",
                f"grad_underflow/{lay.name}"} <= set(tags)
    assert s.scaler is not None
    served = _get(port, "/data/plugin/scalars/scalars", run=run_name, tag="scaler/scale")
    assert [(p[1], p[2]) for p in served] == [(st, _f32(v)) for st, v in s.scaler.scale]

    layout = _get(port, "/data/plugin/custom_scalars/layout")
    assert [c["title"] for c in layout["category"]] == CATEGORIES
    charts = {t for c in layout["category"] for ch in c["chart"] for t in ch["multiline"]["tag"]}
    assert r"^scaler/scale$" in charts and r"^grad_underflow/" in charts
    # The charts' regexes select the right tags through the plugin itself.
    picked = _get(port, "/data/plugin/custom_scalars/scalars", run=run_name, tag=r"^underflow/")
    assert picked["regex_valid"] and set(picked["tag_to_events"]) == {
        f"underflow/{lay.name}" for lay in s.layers}

    text_tags = _get(port, "/data/plugin/text/tags")[run_name]
    assert "findings/text_summary" in text_tags
    (doc,) = _get(port, "/data/plugin/text/text", run=run_name, tag="findings/text_summary")
    for f in s.findings:
        assert f.kind in doc["text"]

    images = _get(port, "/data/plugin/images/tags")[run_name]
    assert {"heatmap/headroom", "heatmap/underflow", "heatmap/grad_headroom"} <= set(images)
    hist = _get(port, "/data/plugin/histograms/histograms", run=run_name, tag="act_exp/fc1")
    buckets = hist[0][2]
    assert (buckets[0][0], buckets[-1][1]) == (F16.min_exponent - 2, F16.max_exponent + 2)
