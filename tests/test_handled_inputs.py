"""An input the model handles (missing values as NaN, replaced in its forward) is no
cause, in every mode: not when it falls in a step that went wrong for another reason
(a layer's overflow, a GradScaler calibrating), nor after a NaN update poisoned the
weights. A second input the model does not clean still is (review 49a/49b, recorded
steps and anomaly mode; ``test_batches_every_step.py`` has the unrecorded steps).
A batch whose NaN only reached forwards no backward took (an evaluation run with grad
on) is a warning: training took none of it.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import amp_doctor
from tests.helpers import console_script


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(4, 32)
        self.big, self.head = nn.Linear(32, 32), nn.Linear(32, 4)
        self.gain = 1.0

    def forward(self, feat: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(torch.nan_to_num(feat)) + self.b(aux))
        return self.head(torch.relu(self.big(h * self.gain)))


def _run(doctor_kw: dict | None, mode: str) -> tuple[list[float], amp_doctor.Session | None]:
    """float16 with a GradScaler; ``feat`` holds NaN in every step (handled). ``mode``:
    "overflow", the hidden layer ``big`` overflows at step 13 (a gain of 1e6; the batch
    is irrelevant); "other", ``aux`` (not cleaned) holds a NaN at step 7."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    doctor = (amp_doctor.watch(model, tensorboard=False, **doctor_kw)
              if doctor_kw is not None else None)
    losses: list[float] = []
    try:
        for step in range(30):
            feat, aux = torch.randn(8, 16), torch.randn(8, 4)
            feat[torch.rand(8, 16) < 0.1] = math.nan
            model.gain = 1e6 if mode == "overflow" and step == 13 else 1.0
            if mode == "other" and step == 7:
                aux[1, 2] = math.nan
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(feat, aux), torch.randint(0, 4, (8,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    finally:
        session = doctor.close() if doctor is not None else None
    return losses, session


def _same(a: list[float], b: list[float]) -> bool:
    return all((x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


MODES = [pytest.param({"every": 1}, id="every1"), pytest.param({"anomaly": True}, id="anomaly")]


@pytest.mark.parametrize("kw", MODES)
def test_a_handled_input_beside_a_layers_overflow_is_not_the_cause(kw: dict) -> None:
    plain, _ = _run(None, "overflow")
    losses, s = _run(kw, "overflow")
    assert _same(losses, plain) and not math.isfinite(losses[13])
    assert s is not None
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert err.kind == "nonfinite_loss" and err.step == 13
    if "every" in kw:
        assert err.module == "big"  # its recorded output went inf first
    (info,) = s.findings_of("nonfinite_input")
    assert info.severity == "info" and info.step == 0
    assert "the other 1 step(s) went wrong for another reason" in info.message


@pytest.mark.parametrize("kw", MODES)
def test_the_input_the_model_does_not_clean_is_still_named(kw: dict) -> None:
    plain, _ = _run(None, "other")
    losses, s = _run(kw, "other")
    assert _same(losses, plain) and math.isnan(losses[7])
    assert s is not None
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert (err.kind, err.step) == ("nonfinite_input", 7)
    assert (err.data["input"], err.data["inputs"]) == ("positional argument 2", 2)
    assert "(in its positional argument 2, one of 2 floating inputs)" in err.message


def test_anomaly_mode_does_not_blame_a_handled_input_once_the_weights_are_nan() -> None:
    """bfloat16, no GradScaler: missing values at steps 11 and 25 (handled); a layer
    overflows at step 13 and its update makes the weights NaN. Step 25's batch was "the
    data, not a layer" (review 49b)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    class Clean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.gain = model, 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(torch.nan_to_num(x) * self.gain)

    net = Clean()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with amp_doctor.watch(net, tensorboard=False, anomaly=True) as doctor:
        for step in range(30):
            x = torch.randn(8, 16)
            if step in (11, 25):
                x[0, 0] = math.nan
            net.gain = 1e38 if step == 13 else 1.0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(x), torch.randint(0, 4, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert not [f for f in s.findings_of("nonfinite_input") if f.severity == "error"]
    (info,) = s.findings_of("nonfinite_input")
    assert info.step == 11


def _val_grad_on_script(tmp_path: Path) -> Path:
    """Training is healthy; every 4 iterations a "validation" forward runs in train mode
    with grad on (no ``no_grad``) and prints its loss; one validation batch holds a NaN
    (review 49a)."""
    script = tmp_path / "val_grad_on.py"
    script.write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "scaler = torch.amp.GradScaler('cpu')\n"
        "xv_all = torch.randn(40, 8, 16); yv = torch.randint(0, 4, (8,))\n"
        "for it in range(40):\n"
        "    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))\n"
        "    with torch.autocast('cpu', dtype=torch.float16):\n"
        "        loss = F.cross_entropy(model(x), y)\n"
        "    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()\n"
        "    if it % 4 == 3 or it == 7:\n"
        "        xv = xv_all[it].clone()\n"
        "        if it == 7:\n"
        "            xv[0, 0] = float('nan')\n"
        "        with torch.autocast('cpu', dtype=torch.float16):\n"
        "            vl = F.cross_entropy(model(xv), yv)\n"
        "        print(f'it {it} val loss {vl.item():.4f}')\n"
        "psum = sum(p.sum().item() for p in model.parameters())\n"
        "print('FINAL', repr(loss.item()), repr(psum))\n")
    return script


@pytest.mark.parametrize("every", ["10", "1"])
def test_a_nan_batch_only_an_evaluation_with_grad_on_took_is_a_warning(tmp_path: Path,
                                                                       every: str) -> None:
    script = _val_grad_on_script(tmp_path)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           cwd=tmp_path, timeout=300)
    r = subprocess.run([console_script(), "diagnose", "--no-tensorboard", "--every", every,
                        "--logdir", str(tmp_path / "runs"), str(script)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout  # the same losses, the same weights
    text = " ".join(r.stderr.split())
    assert "Findings: 0 error(s), 1 warning(s)" in text
    assert "WARN nonfinite_input Sequential step 8" in text
    assert "training took none of it" in text
    assert "If that forward was an evaluation, run it under `torch.no_grad()`" in text


def test_a_nan_batch_the_loop_raises_on_before_backward_is_still_an_error(tmp_path: Path
                                                                          ) -> None:
    """The loop raises as soon as the loss is NaN, before backward: no backward took that
    forward, but the run ended on it (review 49a's c13)."""
    script = tmp_path / "raise_now.py"
    script.write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "scaler = torch.amp.GradScaler('cpu')\n"
        "for it in range(20):\n"
        "    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))\n"
        "    if it == 7:\n"
        "        x[0, 0] = float('nan')\n"
        "    with torch.autocast('cpu', dtype=torch.float16):\n"
        "        loss = F.cross_entropy(model(x), y)\n"
        "    if torch.isnan(loss):\n"
        "        raise RuntimeError(f'NaN loss at iteration {it}')\n"
        "    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()\n")
    r = subprocess.run([console_script(), "diagnose", "--no-tensorboard",
                        "--logdir", str(tmp_path / "runs"), str(script)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 1
    assert "RuntimeError: NaN loss at iteration 7" in r.stderr
    assert "ERROR  nonfinite_input  Sequential step 7" in r.stderr


def test_a_nan_batch_the_loop_once_dropped_is_still_the_cause_when_it_reaches_backward(
        ) -> None:
    """Recorded every step: the loop drops the NaN loss of step 7 itself, but not step
    15's (a GradScaler skip). The loop, not the model, kept step 7 from training: that
    input is no "handled" one, and step 15's batch is the error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for it in range(20):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            if it in (7, 15):
                x[0, 0] = math.nan
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            if it == 7:
                continue  # the loop's own guard, this once
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (f,) = doctor.session.findings_of("nonfinite_input")
    # (Iteration 7, which no optimizer step ended, is counted into the step after it.)
    assert f.severity == "error" and f.step == 14


def test_anomaly_mode_keeps_bounded_rows_when_every_step_goes_wrong() -> None:
    """bfloat16, no GradScaler: missing values in every batch (handled), and a layer's
    overflow at step 3 makes the weights NaN for good: every later step goes wrong beside
    a bad batch. The batch is still info, and anomaly mode keeps device rows for the first
    calls only (a long broken run does not grow them per step)."""
    from amp_doctor.anomaly.events import MAX_EVENTS_PER_KEY

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    class Clean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.gain = body, 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(torch.nan_to_num(x) * self.gain)

    net = Clean()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    steps = MAX_EVENTS_PER_KEY + 40
    with amp_doctor.watch(net, tensorboard=False, anomaly=True) as doctor:
        for step in range(steps):
            x = torch.randn(8, 16)
            x[0, 0] = math.nan
            net.gain = 1e38 if step == 3 else 1.0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(x), torch.randint(0, 4, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    (info,) = s.findings_of("nonfinite_input")
    assert info.severity == "info" and info.step == 0
    mode = doctor._anomaly
    assert mode is not None
    calls = mode._bad_calls
    assert len(calls) > MAX_EVENTS_PER_KEY  # every step after the overflow went wrong
    assert sum(1 for c, r, _ in calls if c.per is not None or r.numel()) == MAX_EVENTS_PER_KEY
