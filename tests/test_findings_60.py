"""Session 60: review 60a's torch.func and actor-critic scripts, and every layer's heatmaps.

A DP-SGD-style loop took per-sample gradients with ``vmap(grad(...))``: the patched
``torch.autograd.grad`` that ``torch.func.grad`` calls noted the vmapped loss, whose flag
raised "tensor may have escaped from inside a function being vmapped" at the step's end
(an internal error), which lost the step's record, and the run whose weights went NaN at
step 0 had no error. An actor-critic loop called ``model.actor(obs)`` and
``model.critic(obs)``, never ``model(...)``: the CLI found the parts as models of their
own, named ``Linear1`` and ``Sequential.0``, and mixed their target pass under no_grad
into their figures. And on a model with more than 32 layers the heatmaps were mostly grey
(the history keeps each step's worst 32 layers): every layer's cells are kept now.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import amp_doctor
from amp_doctor.dtypes import limits
from amp_doctor.records import HEATMAP_FIGURES, Session
from amp_doctor.sinks.heatmap import MISSING_RGB, fit_columns, geometry, merged_columns
from amp_doctor.sinks.tb_session import heatmap_grids, heatmap_legend
from amp_doctor.steps.heatmaps import HeatmapTrack, decode_cells
from amp_doctor.steps.table import ACT, GRAD, HEAD, NONFINITE, NUMEL, OVER, TS_FIELDS, UNDER, ZERO
from tests.helpers import diagnose_pair

_FUNC_SCRIPT = '''
import os, sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.func import functional_call, grad, vmap
torch.manual_seed(0)
torch.set_num_threads(1)
XS = float(sys.argv[1])
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_one(params, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        out = functional_call(model, params, (x.unsqueeze(0) * XS,))
    return F.cross_entropy(out.float(), y.unsqueeze(0))
for step in range(6):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)
    y = torch.randint(0, 3, (4,), generator=g)
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)  # the loss logged
    opt.zero_grad()
    for k, p in model.named_parameters():
        p.grad = per_sample[k].mean(0)  # DP-SGD would clip each sample's first
    opt.step()
print("finite", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
print("params", sum(float(p.detach().double().sum()) for p in model.parameters()))
'''

# The loop calls the model's parts by its methods; v_next is a target under no_grad.
_AC_SCRIPT = '''
import json, sys
import torch, torch.nn as nn
torch.manual_seed(0)
torch.set_num_threads(1)
class AC(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.pi = nn.Linear(16, 3)
        self.v = nn.Linear(16, 1)
    def actor(self, o):
        return self.pi(self.trunk(o))
    def critic(self, o):
        return self.v(self.trunk(o)).squeeze(-1)
model = AC()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
trained_v = 0.0  # the largest |output| of v in the training calls
for step in range(4):
    g = torch.Generator().manual_seed(step)
    obs = torch.randn(8, 6, generator=g)
    nxt = torch.randn(8, 6, generator=g) * 50  # the target pass sees larger values
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model.actor(obs)
        v = model.critic(obs)
        trained_v = max(trained_v, float(v.detach().abs().max()))
        with torch.no_grad():
            v_next = model.critic(nxt)
        loss = (v.float() - v_next.float()).pow(2).mean() + logits.float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(json.dumps({"trained_v": trained_v,
                  "params": sum(float(p.double().sum()) for p in model.parameters())}))
'''


def test_a_torch_func_transform_in_the_loop_loses_no_step_and_hides_no_nan(
        tmp_path: Path) -> None:
    # Healthy: every step recorded, the run's numbers as without amp-doctor.
    plain, r, report = diagnose_pair(tmp_path, "dpsgd.py", _FUNC_SCRIPT, ["1"], "--every", "1")
    assert "finite True" in plain and r.stdout.startswith(plain)
    assert report["steps"] == 6 and report["recorded_steps"] == 6
    assert not [f for f in report["findings"] if f["severity"] == "error"]
    # x * 1e5 overflows float16 inside the vmapped forward: the per-sample gradients are
    # NaN from step 0, and the update takes them.
    plain, r, report = diagnose_pair(tmp_path, "dpsgd.py", _FUNC_SCRIPT, ["1e5"], "--every", "1")
    assert "finite False" in plain and r.stdout.startswith(plain)
    assert report["recorded_steps"] == 6
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert errors and errors[0]["kind"] == "nonfinite_grads_applied", errors
    assert errors[0]["step"] == 0
    # Review 60b: not "the forward pass and the loss were finite": that forward was not seen.
    assert "torch.func" in errors[0]["message"]
    assert "forward pass and the loss" not in errors[0]["message"]


def test_a_model_the_loop_calls_by_its_parts_is_named_and_measured_as_its_own(
        tmp_path: Path) -> None:
    plain, r, report = diagnose_pair(tmp_path, "ac.py", _AC_SCRIPT, [], "--every", "1")
    assert r.stdout.startswith(plain)
    truth = json.loads(plain)
    names = {lay["name"] for lay in report["layers"]}
    assert {"trunk", "trunk.0", "trunk.1", "pi", "v"} <= names, names
    assert not any(n.startswith(("Linear", "Sequential")) for n in names), names
    # The training calls only: the target pass under no_grad (inputs 50x larger) is not
    # a training forward.
    v = next(lay for lay in report["layers"] if lay["name"] == "v")
    assert v["recorded_steps"] == 4
    assert math.isclose(v["absmax"], truth["trained_v"], rel_tol=0, abs_tol=0), (v, truth)


# A frozen backbone, part of the model, called under no_grad; its features overflow at 3.
_FROZEN_SCRIPT = '''
import torch, torch.nn as nn
torch.manual_seed(0)
torch.set_num_threads(1)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32))
        self.head = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
model = Net()
for p in model.backbone.parameters():
    p.requires_grad_(False)
with torch.no_grad():
    model.backbone[2].weight.mul_(40.0)
opt = torch.optim.SGD(model.head.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 8, generator=g) * (5000.0 if step == 3 else 1.0)  # finite in float16
    y = torch.randint(0, 4, (8,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            feats = model.backbone(x)
        loss = nn.functional.cross_entropy(model.head(feats).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("feats3 finite", bool(torch.isfinite(feats).all()))
'''


def test_a_frozen_part_the_loop_calls_under_no_grad_is_recorded_as_the_steps_work(
        tmp_path: Path) -> None:
    # Review 60b: with the model watched whole, its frozen backbone's no_grad call was
    # neither recorded nor checked, and its float16 overflow at step 3 read "the batch
    # given to head already held inf ... check the data pipeline".
    plain, r, report = diagnose_pair(tmp_path, "frozen.py", _FROZEN_SCRIPT, [], "--every", "1")
    assert r.stdout.startswith(plain)
    layers = {lay["name"]: lay for lay in report["layers"]}
    assert layers["backbone.2"]["recorded_steps"] == 6 and layers["backbone.2"]["calls"] == 6
    assert layers["backbone.2"]["nonfinite_steps"] == 1
    errors = [(f["kind"], f["module"]) for f in report["findings"] if f["severity"] == "error"]
    assert errors == [("activation_overflow", "backbone.2")], errors
    assert not [f for f in report["findings"] if f["kind"] == "nonfinite_input"]


# A DQN whose methods name their self ``s``; the target network is called by a method.
_DQN_SCRIPT = '''
import copy
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
class QNet(nn.Module):
    def __init__(s):
        super().__init__()
        s.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        s.q = nn.Linear(16, 3)
    def forward(s, x):
        return s.q(s.body(x))
    def value(s, x):
        return s.forward(x).max(-1).values
qnet = QNet()
target = copy.deepcopy(qnet)
opt = torch.optim.Adam(qnet.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(3):
    obs, nxt = torch.randn(8, 6), torch.randn(8, 6)
    with torch.autocast("cpu", dtype=torch.float16):
        q = qnet(obs).max(-1).values
        with torch.no_grad():
            tq = 0.99 * target.value(nxt)
        loss = F.smooth_l1_loss(q.float(), tq.float())
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
'''


def test_a_method_names_its_self_as_it_likes(tmp_path: Path) -> None:
    # Review 60b: ``def forward(s, x)`` made the target network's layers ``s.q``.
    _, _, report = diagnose_pair(tmp_path, "dqn.py", _DQN_SCRIPT, [], "--every", "1")
    names = {lay["name"] for lay in report["layers"]}
    assert {"target.q", "target.body.0", "qnet.q", "qnet.body.0"} <= names, names
    assert not any(n.startswith("s.") for n in names), names


# -- every layer's heatmap cells ------------------------------------------------------------

_W = len(TS_FIELDS)


def _table(rows: list[dict[str, float]]) -> np.ndarray:
    """A step table's filled figures ``[n, slots * fields]``: NaN but what ``rows`` give
    as ``"<act|grad>_<field>"``."""
    out = np.full((len(rows), 5 * _W), math.nan)
    cols = {"numel": NUMEL, "head": HEAD, "under": UNDER, "zero": ZERO, "nonfinite": NONFINITE,
            "over": OVER, "absmax": 3}
    for i, row in enumerate(rows):
        for key, value in row.items():
            slot, fld = key.split("_")
            out[i, (ACT if slot == "act" else GRAD) * _W + cols[fld]] = value
    return out


def _cell(head: float, under: float, **more: float) -> dict[str, float]:
    return {"act_numel": 10.0, "act_head": head, "act_under": under, "act_zero": 0.0,
            "act_nonfinite": 0.0, "act_over": 0.0, "act_absmax": 1.0, **more}


def test_heatmap_columns_keep_the_worst_of_their_steps_and_span_the_run() -> None:
    track = HeatmapTrack(columns=4)
    track.grow(2)
    # Layer 0 every step; layer 1 only in steps 1 and 4. Six steps into four columns:
    # halved after four, each column then the worst of two steps.
    heads = [9.0, 3.0, 7.0, 5.0, 8.0, 6.0]
    for step, h in enumerate(heads):
        rows = [0, 1] if step in (1, 4) else [0]
        cells = [_cell(h, step / 10)] + ([_cell(1.0 + step, 0.9, grad_numel=4.0,
                                                grad_head=2.0, grad_under=0.0,
                                                grad_zero=1.0, grad_nonfinite=0.0,
                                                grad_over=0.0, grad_absmax=0.0)]
                                         if len(rows) == 2 else [])
        track.add(np.array(rows), _table(cells), step)
    assert track.steps == [0, 2, 4] and track.span == 2
    h = track.export({"a": 0, "b": 1})
    assert h is not None and h.layers == ["a", "b"] and h.steps == [0, 2, 4] and h.span == 2
    vals, flags = decode_cells(h)
    head, under = HEATMAP_FIGURES.index("headroom"), HEATMAP_FIGURES.index("underflow")
    assert vals[0, :, head].tolist() == [3.0, 5.0, 6.0]  # least of (9, 3), (7, 5), (8, 6)
    assert vals[0, :, under].tolist() == [0.1, 0.3, 0.5]  # greatest, in 1/250 steps
    # Layer 1: its one step in each of the first and last column; none in the middle.
    assert vals[1, 0, head] == 2.0 and math.isnan(vals[1, 1, head]) and vals[1, 2, head] == 5.0
    g_zero = HEATMAP_FIGURES.index("grad_zero")
    assert vals[1, 0, g_zero] == 1.0 and math.isnan(vals[0, 0, g_zero])
    assert not flags.any()


def test_heatmap_cells_mark_nan_overflow_and_all_zero_tensors() -> None:
    track = HeatmapTrack()
    track.grow(3)
    track.add(np.array([0, 1, 2]), _table([
        _cell(math.nan, 0.0, act_nonfinite=0.5, act_absmax=math.nan),
        _cell(-1.5, 0.0, act_over=0.25, act_absmax=9e4),
        _cell(math.inf, 0.0, act_absmax=0.0),
    ]), 0)
    h = track.export({"nan": 0, "over": 1, "zero": 2})
    assert h is not None
    vals, flags = decode_cells(h)
    assert flags[:, 0].tolist() == [1, 2, 0]
    # No headroom left for the NaN and the overflowing output; +inf for the all-zero one.
    assert vals[:, 0, 0].tolist() == [0.0, 0.0, math.inf]
    s = Session.from_json(_session_with(h).to_json())
    assert s.heatmaps == h


def _session_with(h: Any) -> Session:
    from amp_doctor.records import AmpConfig, RunInfo
    return Session(version=amp_doctor.__version__,
                   amp=AmpConfig(device_type="cpu", dtype="float16", scaler=False),
                   steps=1, recorded_steps=1, layers=[], scaler=None, history=[], events=[],
                   findings=[], run=RunInfo(torch_version=torch.__version__, started="",
                                            duration_s=0.0, every=1, models=[]),
                   heatmaps=h)


def test_a_wide_models_heatmap_images_have_no_grey_cell(tmp_path: Path) -> None:
    # 48 layers (the history keeps 32 a step), recorded every step: the TensorBoard image,
    # read back, has no "not recorded" cell. (Merged columns: the test above.)
    from PIL import Image
    from tensorboard.backend.event_processing import event_accumulator

    model = nn.Sequential(*[m for _ in range(24) for m in (nn.Linear(8, 8), nn.Tanh())])
    steps = 12
    with amp_doctor.watch(model, every=1, logdir=str(tmp_path)) as doctor:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s is not None and s.heatmaps is not None and s.heatmaps.span == 1
    assert s.heatmaps.steps == list(range(steps)) and len(s.heatmaps.layers) == 49
    grid = heatmap_grids(s, limits(torch.float16))["heatmap/headroom"]
    assert len(grid.names) == 48 and all(v is not None for row in grid.values for v in row)
    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    img = Image.open(io.BytesIO(acc.Images("heatmap/headroom")[-1].encoded_image_string))
    geo = geometry(fit_columns(grid))
    cols = len(fit_columns(grid).steps)
    plot = img.convert("RGB").crop((geo.x0, geo.y0, geo.x0 + cols * geo.cw,
                                    geo.y0 + len(grid.names) * geo.ch))
    colours = {c for _, c in plot.getcolors(maxcolors=1 << 16)}
    assert MISSING_RGB not in colours and len(colours) > 3
    # The legend counts the columns as drawn (review 60b: "160, each the worst of 2" beside
    # a picture of 80 columns of 4).
    assert "Columns: 12 recorded steps, step 0 (left) to 11 (right)." in heatmap_legend(
        s, limits(torch.float16))
    long_run = dataclasses.replace(s, heatmaps=dataclasses.replace(s.heatmaps, span=4))
    assert ("Columns: 12, each the worst of 4 consecutive recorded steps"
            in heatmap_legend(long_run, limits(torch.float16)))
    # Long names leave the steps fewer pixels: the picture merges its columns again.
    cols = 300
    named = dataclasses.replace(
        grid, names=[f"encoder.layers.{i}.mlp.fc" for i in range(48)], steps=list(range(cols)),
        values=[[1.0] * cols for _ in range(48)], nonfinite=[[False] * cols] * 48,
        overflow=[[False] * cols] * 48)
    k = merged_columns(named)
    assert k > merged_columns(dataclasses.replace(named, names=grid.names)) >= 1
    assert len(fit_columns(named).steps) == -(-cols // k)


# -- a float32 output that went inf: no what-if ------------------------------------------------

class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Linear(16, 16)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ff(x) * self.gain  # float16 under autocast
        return x + 0.5 * (y * y)  # the square overflows float16; x is float32: so is the sum


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.block = _Block()
        self.head = nn.Linear(16, 20)
        self.head_gain = 1.0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(idx)) * self.head_gain)


def test_a_float32_output_that_went_inf_first_is_an_origin_not_a_what_if() -> None:
    # Review 60a: a block returning float32 (x + 0.5 * z, x float32) whose float16 square
    # overflowed inside it was "stayed in float32; cast to float16 its output would
    # overflow (0.011%)", an info, and its step's backoff was charged to the head. And the
    # head's own overflow at another step, another cause with another fix, hid it in one
    # group of the text report.
    from amp_doctor.sinks.text import render_text

    torch.manual_seed(0)
    model = _LM()
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        for step in range(10):
            model.block.gain = 1e4 if step == 3 else 1.0  # the square: up to ~1e8
            model.head_gain = 1e5 if step == 6 else 1.0  # the head's matmul, from finite input
            idx = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(idx).float().reshape(-1, 20),
                                                   idx.reshape(-1))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s is not None and s.scaler is not None
    assert s.scaler.backoff_steps == [3, 6]
    block = s.layer("block")
    assert block.output_dtypes == ["float32"] and block.nonfinite_steps == 1
    errors = {f.module: f for f in s.findings if f.severity == "error"}
    assert set(errors) == {"block", "head"}, [(f.kind, f.module) for f in s.findings]
    assert errors["block"].kind == "activation_overflow" and "float32" in errors["block"].message
    assert "would overflow" not in errors["block"].message
    assert "scale 256 -> 128" in errors["block"].message  # step 3's backoff is its
    assert "scale 128 -> 64" in errors["head"].message
    text = render_text(s)
    assert "ERROR  activation_overflow  block" in text
    assert "ERROR  activation_overflow  head" in text
