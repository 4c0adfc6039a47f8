"""A NaN/inf that starts mid-run in a loop without a GradScaler, under anomaly mode.

Nothing skips the failing step, so its optimizer step writes the non-finite
gradients into the parameters: the op-level search, armed for the next step, sees
non-finite weights in every op. The failing step's own layer figures still name the
first layer that went non-finite; the report must name it, say that the parameters
were corrupted by the update (one error, not two), and not blame the first layer to
use a corrupted weight.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_doctor
from amp_doctor.records import Finding, Session
from tests.helpers import console_script

AMP_DOCTOR = console_script()
BAD_STEP = 4
STEPS = 9


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x  # overflows float16 once |x| > 256


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.sq = Square()
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.sq(self.fc1(x))))


# Batch gain at the bad step: fc1 stays finite, sq's square overflows the format.
GAIN = {torch.float16: 1e3, torch.bfloat16: 1e21}


def _run(dtype: torch.dtype, watch_kw: dict | None) -> tuple[list[float], Session | None]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []

    def loop() -> None:
        for step in range(STEPS):
            x = torch.randn(32, 8, generator=g)
            if step == BAD_STEP:
                x = x * GAIN[dtype]
            y = torch.randn(32, 1, generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()  # no GradScaler: a NaN gradient is applied
            losses.append(float(loss.detach()))

    if watch_kw is None:
        loop()
        return losses, None
    with amp_doctor.watch(model, anomaly=True, **watch_kw) as doctor:
        loop()
    return losses, doctor.session


def _same(a: list[float], b: list[float]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def _errors(s: Session) -> list[Finding]:
    return [f for f in s.findings if f.severity == "error"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_recorded_failing_step_names_the_layer_and_the_corruption(dtype: torch.dtype) -> None:
    plain, _ = _run(dtype, None)
    losses, s = _run(dtype, {"every": 1})
    assert s is not None
    assert _same(plain, losses), (plain, losses)  # numerics untouched
    assert all(math.isfinite(x) for x in losses[:BAD_STEP]) and math.isnan(losses[-1])
    errors = _errors(s)
    assert len(errors) == 1, [(f.kind, f.module, f.message) for f in s.findings]
    f = errors[0]
    # The layer whose output went non-finite at the failing step, not fc1 (the first
    # layer to use a corrupted weight on every later step).
    assert f.module == "sq" and f.step == BAD_STEP
    assert f.data["first_nonfinite_step"] == BAD_STEP
    assert f.data["weights_nonfinite_at"] == BAD_STEP + 1
    assert f.data["ops_in_module"] == [f"aten.mul ({str(dtype).split('.')[1]})"]
    assert f"step {BAD_STEP}, its optimizer step applied the non-finite gradients" in f.message
    assert "aten.mul" in f.message
    # Folded into it: the search that could not name the op, and the NaN loss.
    assert not [x for x in s.findings if x.kind == "nonfinite_unlocated"]
    loss = [x for x in s.findings if x.kind == "nonfinite_loss"]
    assert loss and loss[0].severity == "info" and loss[0].module == "sq"
    assert not [x for x in s.findings if x.module == "fc1" and x.severity != "info"]


def test_unrecorded_failing_step_is_one_error_that_blames_no_layer() -> None:
    """every=10: step 4 is not recorded; the first recorded NaN (step 5 onwards) is
    fc1's, only because fc1 is the first layer to use a corrupted weight."""
    _, s = _run(torch.float16, {"every": 5})
    assert s is not None
    errors = _errors(s)
    assert [(f.kind, f.module, f.step) for f in errors] == [
        ("nonfinite_unlocated", None, BAD_STEP)], [(f.kind, f.module) for f in s.findings]
    f = errors[0]
    assert f.data["failing_step_recorded"] is False
    assert f"step {BAD_STEP} was not a recorded step (every=5)" in f.message
    assert "every=1" in f.advice and "on_nonfinite='raise'" in f.advice
    loss = [x for x in s.findings if x.kind == "nonfinite_loss"]
    assert loss and loss[0].severity == "info" and loss[0].module is None
    assert loss[0].data["origin_after_corruption"] == "fc1"
    assert "fc1, the first layer to use them, is where it showed" in loss[0].message


SCRIPT = f'''
import torch
from torch import nn
import sys
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
from tests.test_anomaly_corrupted import _run
_run(torch.float16, None)
'''


def test_cli_diagnose_anomaly_names_the_layer(tmp_path: Path) -> None:
    script = tmp_path / "midrun.py"
    script.write_text(SCRIPT)
    out = tmp_path / "r.json"
    subprocess.run([AMP_DOCTOR, "diagnose", "-q", "--anomaly", "--every", "1",
                    "--no-tensorboard", "--logdir", str(tmp_path / "run"), "--json", str(out),
                    str(script)], check=True, capture_output=True, text=True, timeout=600,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    d = json.loads(out.read_text())
    errors = [f for f in d["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["module"], f["step"]) for f in errors] == [
        ("activation_overflow", "sq", BAD_STEP)]
    assert errors[0]["data"]["weights_nonfinite_at"] == BAD_STEP + 1
