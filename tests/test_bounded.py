"""Bounded size (issues 14, 15): history rows, layers per row, JSON, TensorBoard series."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tensorboard.backend.event_processing import event_accumulator as ea_mod
from torch import nn

import amp_doctor
from amp_doctor.device import stats as S
from amp_doctor.device.recorder import HistSums, StepHists
from amp_doctor.records import LayerStep, StepRecord, TensorStats, to_jsonable
from amp_doctor.sinks.tensorboard import LIVE_FULL_POINTS, live_stride
from amp_doctor.steps.history import HISTORY_LAYERS, HISTORY_LIMIT, History

JSON_LIMIT = 20 * 2**20


def _stats(v: float) -> TensorStats:
    return TensorStats(numel=1024, min=-v, max=v, absmax=v, zero_frac=0.01,
                       nonfinite_frac=0.0, overflow_frac=0.0, underflow_frac=v / 1e4,
                       headroom=math.log2(65504 / v))


def test_history_of_a_long_run_of_a_2000_layer_model_is_bounded_in_rows_and_bytes() -> None:
    h = History()
    layers = [f"blocks.{i}.fc" for i in range(2000)]
    for step in range(10_000):
        ls = {n: LayerStep(act=_stats(1.0 + i), grad=_stats(2.0), param_grad=_stats(3.0))
              for i, n in enumerate(layers[: 40 if step % 100 else 2000])}
        h.add(StepRecord(step=step, loss=1.0, scale=None, skipped=step == 777, layers=ls))
    assert len(h.records) <= HISTORY_LIMIT
    assert all(len(r.layers) <= HISTORY_LAYERS for r in h.records)
    assert 777 in [r.step for r in h.records]
    full = [r for r in h.records if r.step % 100 == 0]
    assert full and all(r.dropped_layers == 2000 - HISTORY_LAYERS for r in full)
    # The worst layers are the ones kept: the largest values, least headroom.
    assert set(full[0].layers) == set(layers[2000 - HISTORY_LAYERS :])
    text = json.dumps(to_jsonable(h.records), separators=(",", ":"))
    assert len(text) < 12 * 2**20


def test_run_long_histograms_keep_only_the_populated_window_and_lose_no_count() -> None:
    """HistSums stores bins 0 and 255 and a window of the bins a run populates,
    grown as later steps reach further; what it gives back is the exact sum."""
    hs = HistSums()
    names = ["a", "b", "c"]
    want = {(n, f): torch.zeros(S.N_EXP_BINS, dtype=torch.float64) for n in names for f in (0, 1)}
    g = torch.Generator().manual_seed(0)
    # Steps reach further out over time (a window growing both ways), and add a layer.
    spans = [(120, 130), (118, 131), (100, 125), (126, 150), (1, 254), (128, 129)]
    for step, (lo, hi) in enumerate(spans):
        layers = names[: 2 if step < 3 else 3]
        matrix = torch.zeros(2 * len(layers) + 1, S.SUMMARY_LEN, dtype=torch.float64)
        cells = []
        for i, n in enumerate(layers):
            for f in (0, 1):
                row = 2 * i + f
                counts = torch.randint(0, 1000, (hi - lo,), generator=g).to(torch.float64)
                matrix[row, S.HIST + lo : S.HIST + hi] = counts
                matrix[row, S.HIST] = 7.0 + step  # zeros
                matrix[row, S.HIST + S.N_EXP_BINS - 1] = float(step % 2)  # inf/NaN
                want[(n, f)] += matrix[row, S.HIST:]
                cells.append((n, f, row))
        # A row no cell names (a parameter gradient's) may populate more bins.
        matrix[-1, S.HIST + 3] = 5.0
        hs.add(StepHists(matrix, cells))
        if step == 0:
            # 2 edge columns and the window (rounded out to multiples of 8 bins).
            assert hs._sums.shape[-1] < 32
    for n in names:
        act, grad = hs.of(n)
        assert act == want[(n, 0)].round().long().tolist()
        assert grad == want[(n, 1)].round().long().tolist()
    assert hs.of("unknown") == ([0] * S.N_EXP_BINS, [0] * S.N_EXP_BINS)


def test_a_601_module_model_at_every_1_writes_a_bounded_json(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(300):
        mods += [nn.Linear(4, 4), nn.Tanh()]
    model = nn.Sequential(*mods)
    assert len(list(model.modules())) == 601
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(2, 4)
    steps = 12
    with amp_doctor.watch(model, every=1, logdir=tmp_path, tensorboard=False) as w:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = w.session
    assert len(s.history) == steps
    assert all(len(r.layers) == HISTORY_LAYERS for r in s.history)
    assert all(r.dropped_layers == 601 - HISTORY_LAYERS for r in s.history)
    assert len(s.layers) == 601  # every layer keeps its aggregate
    size = (tmp_path / "amp_doctor.json").stat().st_size
    # Per history row: at most HISTORY_LAYERS layer cells; the rest is per layer.
    per_row = len(json.dumps(to_jsonable(s.history[0]), separators=(",", ":")))
    assert per_row < 40_000
    assert size < 2 * 2**20
    # Extrapolated to a full history (HISTORY_LIMIT rows): still within the target.
    assert size + HISTORY_LIMIT * per_row < JSON_LIMIT


def test_live_tensorboard_series_thin_out_geometrically() -> None:
    due = [i for i in range(10_000) if i % live_stride(i) == 0]
    assert due[:LIVE_FULL_POINTS] == list(range(LIVE_FULL_POINTS))  # full resolution first
    assert due[LIVE_FULL_POINTS : LIVE_FULL_POINTS + 3] == [512, 514, 516]
    assert 1024 in due and 1026 not in due and 1028 in due
    # Each doubling of the run adds LIVE_FULL_POINTS / 2 points: ~1,600 for 10,000 steps.
    assert 1500 < len(due) < 1700


def test_a_long_run_writes_thinned_live_series_and_keeps_every_skipped_step(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Starts far too high: the first steps back off (skipped), and must all be written.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=50)
    x = torch.randn(2, 4)
    steps = 700
    with amp_doctor.watch(model, every=1, logdir=tmp_path) as w:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert w.session.scaler is not None
    skipped = set(w.session.scaler.skipped_steps)
    assert skipped, "the scaler must have skipped steps for this test to mean anything"
    acc = ea_mod.EventAccumulator(str(tmp_path), size_guidance={ea_mod.SCALARS: 0}).Reload()
    tag = next(t for t in acc.Tags()["scalars"] if t.startswith("absmax/"))
    written = [e.step for e in acc.Scalars(tag)]
    # Every step is recorded (every=1): the i-th recorded step is training step i.
    due = {i for i in range(steps) if i % live_stride(i) == 0}
    assert due <= set(written)  # the stride's steps ...
    assert skipped <= set(written)  # ... and every skipped step
    assert set(written) <= due | skipped  # and nothing else
    assert len(written) == len(due | skipped) < steps - 90
    # The scaler's own series is per training step, never thinned.
    assert len(acc.Scalars("scaler/scale")) == steps
