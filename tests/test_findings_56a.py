"""Review 56a: a model whose object the script replaces mid-run stays one model, and the
steps after the swap keep their numbers.

A resume from a full-model checkpoint (``model = torch.load(buf, weights_only=False)``)
or ``model = copy.deepcopy(model)``, with a new optimizer, at step 4. Discovery (the
``diagnose`` CLI) found the new object as a second model and renamed the first one
``model1``; the step boundaries waited for the old object, the step's first model, to run
again, so every step from 5 on ended one ``scaler.update()`` late: a NaN batch at step 12
was reported at step 11, step 5 was lost and the last step had no loss.
"""

from __future__ import annotations

import copy
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_doctor
from amp_doctor.records import Session
from tests.helpers import console_script

STEPS = 20
SWAP_STEP = 4  # the script replaces the model after this step's update
NAN_STEP = 12  # one NaN in this step's batch


def _swap_run(how: str, every: int = 1) -> tuple[Session, list[float]]:
    """The review's minimal repro, watched as the CLI watches: by discovery. ``how``:
    "reload", "deepcopy" (the model replaced, and a new optimizer) or "newopt" (only a new
    optimizer, which was always fine)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    losses: list[float] = []
    with amp_doctor.watch(None, discover=True, every=every, tensorboard=False) as doctor:
        for step in range(STEPS):
            x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
            if step == NAN_STEP:
                x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if step == SWAP_STEP:
                if how == "reload":
                    buf = io.BytesIO()
                    torch.save(model, buf)
                    buf.seek(0)
                    model = torch.load(buf, weights_only=False)
                elif how == "deepcopy":
                    model = copy.deepcopy(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses.append(loss.item())
    assert doctor.session is not None
    return doctor.session, losses


def _same(a: float | None, b: float) -> bool:
    return a is not None and (a == b or (math.isnan(a) and math.isnan(b)))


@pytest.mark.parametrize("how", ["reload", "deepcopy", "newopt"])
def test_steps_after_the_model_is_replaced_keep_their_numbers(how: str) -> None:
    s, losses = _swap_run(how)
    assert [i for i, v in enumerate(losses) if v != v] == [NAN_STEP]
    assert s.steps == STEPS and s.recorded_steps == STEPS
    # Every step's recorded loss is the loop's own of that step, bit for bit.
    assert [r.step for r in s.history] == list(range(STEPS))
    assert all(_same(r.loss, v) for r, v in zip(s.history, losses, strict=True)), \
        [(r.step, r.loss, v) for r, v in zip(s.history, losses, strict=True)]
    assert s.scaler is not None
    assert s.scaler.skipped_steps == [NAN_STEP]
    assert s.scaler.backoff_steps == [NAN_STEP]
    assert [e.step for e in s.scaler.events if e.kind == "backoff"] == [NAN_STEP]
    by_kind = {f.kind: f for f in s.findings}
    assert by_kind["nonfinite_input"].step == NAN_STEP
    assert by_kind["nonfinite_input"].severity == "error"
    assert by_kind["nonfinite_loss"].step == NAN_STEP
    assert "in 1 of the 20 steps" in by_kind["nonfinite_loss"].message
    assert by_kind["scaler_backoff"].step == NAN_STEP


@pytest.mark.parametrize("how", ["reload", "deepcopy"])
def test_a_replaced_model_is_one_model_with_a_note(how: str) -> None:
    s, _ = _swap_run(how)
    # One model, named as without the swap: no "model1" the script never had.
    assert s.run.models == ["Sequential"]
    assert sorted(lay.name for lay in s.layers) == ["0", "1", "2", "Sequential"]
    # Its layers' figures run on over the swap: every step's row has them.
    assert all({"0", "2"} <= set(r.layers) for r in s.history)
    (note,) = [f for f in s.findings if f.kind == "model_replaced"]
    assert note.severity == "info" and note.step == SWAP_STEP + 1
    assert note.message.startswith("`model` (Sequential) was replaced at step 5 ")
    assert not [f for f in s.findings if f.severity == "warning"]


def test_only_a_new_optimizer_is_no_replacement() -> None:
    s, _ = _swap_run("newopt")
    assert s.run.models == ["Sequential"]
    assert not [f for f in s.findings if f.kind == "model_replaced"]


def test_two_models_of_one_architecture_trained_together_stay_two() -> None:
    # Two same-class models called by the same name in each iteration: both train in every
    # step, so neither replaces the other.
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)) for _ in range(2)]
    opt = torch.optim.SGD([p for n in nets for p in n.parameters()], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(None, discover=True, every=1, tensorboard=False) as doctor:
        for _ in range(6):
            x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.zeros(())
                for model in nets:
                    loss = loss + nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s is not None
    assert s.steps == 6 and len(s.run.models) == 2
    assert not [f for f in s.findings if f.kind == "model_replaced"]


_SCRIPT = '''
import io, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(20):
    x = torch.randn(16, 8); y = torch.randint(0, 4, (16,))
    if step == 12:
        x[0, 0] = float("nan")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    if step == 4:
        buf = io.BytesIO(); torch.save(model, buf); buf.seek(0)
        model = torch.load(buf, weights_only=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    print(f"step {step} loss {loss.item()!r} scale {scaler.get_scale()!r}")
print("checksum", repr(sum(p.double().sum() for p in model.parameters()).item()))
'''


def test_cli_reports_the_nan_batch_at_its_step_after_a_reload(tmp_path: Path) -> None:
    (tmp_path / "reload.py").write_text(_SCRIPT)
    plain = subprocess.run([sys.executable, "reload.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / "out"
    r = subprocess.run([console_script(), "diagnose", "--no-tensorboard", "--every", "1",
                        "--logdir", str(out), "reload.py"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout  # the script's numerics, bit for bit
    assert "step 12 loss nan" in plain.stdout
    text = " ".join(r.stderr.split())
    assert "nonfinite_input Sequential step 12" in text
    assert "1 backoff (step 12)" in text
    assert "`model` (Sequential) was replaced at step 5" in text
    report = json.loads((out / "amp_doctor.json").read_text())
    assert report["steps"] == STEPS
    assert report["run"]["models"] == ["Sequential"]
    losses = {int(w[1]): float(w[3]) for w in map(str.split, plain.stdout.splitlines())
              if w[0] == "step"}
    hist = {h["step"]: h["loss"] for h in report["history"]}
    assert sorted(hist) == list(range(STEPS))
    assert all(_same(hist[k], v) for k, v in losses.items() if k != NAN_STEP)
    assert hist[NAN_STEP] == "nan"  # the JSON report's spelling of a NaN loss
