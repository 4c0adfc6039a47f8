"""Review 51, left open: one root cause, one error, in the loss code.

A hand-written focal loss takes ``torch.log`` of a float16 softmax probability. Once the
model is confident, a mislabelled sample's probability is near 0: the backward of log
(a division by it) overflows float16 every few steps, and the scale collapses below 1;
where it underflows to exactly 0, the forward's log is -inf and the loss inf. The report
said two errors, the NaN loss and the collapse, both made by the same line; anomaly
mode's op-level search found that line's LogBackward0 and called it the scaler's own
search ("nothing to fix").
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import console_script

_FOCAL = '''
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
N_FEAT, N_CLS = 32, 8
centres = 3.0 * torch.randn(N_CLS, N_FEAT)
def make_batch(bs=64):
    y = torch.randint(0, N_CLS, (bs,))
    x = centres[y] + torch.randn(bs, N_FEAT)
    noisy = torch.rand(bs) < 0.02
    return x, torch.where(noisy, torch.randint(0, N_CLS, (bs,)), y)
def focal_loss(logits, target, gamma=2.0):
    probs = F.softmax(logits, dim=-1)
    pt = probs.gather(1, target[:, None]).squeeze(1)
    return (-(1 - pt) ** gamma * torch.log(pt)).mean()
model = nn.Sequential(nn.Linear(N_FEAT, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                      nn.Linear(128, N_CLS))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(40):
    x, y = make_batch()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = focal_loss(model(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(step, loss.item(), scaler.get_scale())
'''


@pytest.fixture(scope="module")
def focal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    d = tmp_path_factory.mktemp("focal")
    (d / "focal.py").write_text(_FOCAL)
    plain = subprocess.run([sys.executable, "focal.py"], cwd=d, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    return d, [line.split() for line in plain.stdout.splitlines()]


def _diagnose(d: Path, rows: list[list[str]], *args: str) -> tuple[str, list[dict]]:
    out = d / ("out" + "".join(args).replace("-", "_"))
    r = subprocess.run([console_script(), "diagnose", "--no-tensorboard", "--logdir", str(out),
                        *args, "focal.py"], cwd=d, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [line.split() for line in r.stdout.splitlines()] == rows  # numerics unchanged
    findings = json.loads((out / "amp_doctor.json").read_text())["findings"]
    return " ".join(r.stderr.split()), findings


def test_the_run_has_both_symptoms(focal: tuple[Path, list[list[str]]]) -> None:
    _, rows = focal
    bad = [int(s) for s, loss, _ in rows if loss in ("inf", "nan")]
    assert len(bad) >= 3
    assert float(rows[-1][2]) < 1.0  # the scale collapsed below 1
    # More backoffs than NaN losses: the backward of log overflowed with a finite loss too.
    backoffs = [int(s) for (s, _, sc), (_, _, prev) in zip(rows[1:], rows, strict=False)
                if float(sc) < float(prev)]
    assert len(backoffs) > len(bad) + 3


def test_default_the_nan_loss_is_the_collapses_consequence(
        focal: tuple[Path, list[list[str]]]) -> None:
    d, rows = focal
    text, findings = _diagnose(d, rows)
    errors = [f for f in findings if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["scale_collapse"]
    assert "log_softmax" in errors[0]["advice"]
    bad = sum(loss in ("inf", "nan") for _, loss, _ in rows)
    assert f"Consequences: the loss was NaN/inf in {bad} of the 40 steps checked" in text
    loss = next(f for f in findings if f["kind"] == "nonfinite_loss")
    assert loss["severity"] == "info"
    assert "The loss scale's collapse began in that code too" in loss["message"]


def test_anomaly_names_the_backward_of_log_in_the_loss_code_as_the_one_error(
        focal: tuple[Path, list[list[str]]]) -> None:
    d, rows = focal
    text, findings = _diagnose(d, rows, "--anomaly")
    errors = [f for f in findings if f["severity"] == "error"]
    assert [(f["kind"], f["op"]) for f in errors] == [("nonfinite_backward", "aten.div")]
    e = errors[0]
    assert e["data"]["forward_op"] == "aten.log" and e["data"]["node"] == "LogBackward0"
    assert e["frame"].endswith("focal.py:14 in focal_loss")
    assert "Nothing to fix" not in e["advice"] and "log_softmax" in e["advice"]
    assert "the loss scale collapsed to 0.125 (19 optimizer steps skipped)" in text
    assert "the loss was NaN/inf in" in text
    kinds = {f["kind"]: f["severity"] for f in findings if f["kind"] != "nonfinite_backward"}
    assert kinds["nonfinite_loss"] == "info" and kinds["scale_collapse"] == "info"


def test_a_backoff_of_a_nan_batch_points_at_the_batch_not_at_a_layer_in_float32() -> None:
    """Review 51 (accumulation with a NaN feature in one micro-batch): the backoff, folded
    into the batch's error, kept its own fix, "keep the first culprit layer in float32"."""
    import torch
    from torch import nn

    import amp_doctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for step in range(16):
            opt.zero_grad()
            for micro in range(4):
                x = torch.randn(16, 12)
                y = x[:, :4].argmax(-1)
                if step == 13 and micro == 2:
                    x[3, 7] = float("nan")
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x), y) / 4
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    errors = [f for f in doctor.session.findings if f.severity == "error"]
    assert [(f.kind, f.step) for f in errors] == [("nonfinite_input", 13)]
    (backoff,) = doctor.session.findings_of("scaler_backoff")
    assert backoff.severity == "info" and backoff.step == 13
    assert backoff.advice == ("Nothing of its own to fix: it follows from the nonfinite_input "
                              "error (Sequential); fix that one (see its finding).")
    assert "float32" not in backoff.advice


def _val_loop(val_nan: set[int], train_nan: set[int] = frozenset(),  # type: ignore[assignment]
              raise_on_nan: bool = False, mode: str = "anomaly") -> tuple[Any, list[str]]:
    """Training on clean batches; every 4th iteration, and at ``val_nan``, a validation
    forward with grad on (no ``no_grad``) whose loss is only printed. ``mode``: "anomaly",
    "default" (watched), or "plain" (no watch: the session is None)."""
    import contextlib

    import torch
    from torch import nn

    import amp_doctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    xv_all, yv = torch.randn(40, 8, 16), torch.randint(0, 4, (8,))
    printed: list[str] = []
    try:
        with (contextlib.nullcontext() if mode == "plain" else
              amp_doctor.watch(model, anomaly=mode == "anomaly", tensorboard=False)) as doctor:
            for it in range(40):
                x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
                if it in train_nan:
                    x[0, 0] = float("nan")
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if it in val_nan or it % 4 == 3:
                    xv = xv_all[it].clone()
                    if it in val_nan:
                        xv[0, 0] = float("nan")
                    with torch.autocast("cpu", dtype=torch.float16):
                        vl = nn.functional.cross_entropy(model(xv), yv)
                    if raise_on_nan and not torch.isfinite(vl):
                        raise FloatingPointError(f"val loss {vl.item()}")
                    printed.append(f"{it} {vl.item():.6f}")
            printed.append(repr(sum(p.double().sum().item() for p in model.parameters())))
    except FloatingPointError:
        pass  # the run ended on it, as a script's would
    return (doctor.session if doctor is not None else None), printed


def test_anomaly_mode_a_nan_batch_only_an_evaluation_forward_took_is_a_warning() -> None:
    """Review 49a (c11), left open in anomaly mode: a validation forward run with grad on
    whose batch held NaN, in a run whose training stayed finite, was an ERROR in anomaly
    mode ("it came from the data") while the default mode says training took none of it."""
    session, printed = _val_loop({7, 9})
    errors = [f for f in session.findings if f.severity in ("error", "warning")]
    assert [(f.kind, f.severity, f.step) for f in errors] == [
        ("nonfinite_input", "warning", 8)]
    f = errors[0]
    assert f.data["dropped_only"] is True and f.data["occurrences"] == 2
    assert "training took none of it" in f.message and "in 2 steps" in f.message
    assert "no_grad" in f.advice
    assert f.frame is not None and "_val_loop" in f.frame
    # The same as the default mode says, and the run's numbers unchanged by either.
    default, printed_default = _val_loop({7, 9}, mode="default")
    assert [(f.kind, f.severity) for f in default.findings if f.severity != "info"] == [
        ("nonfinite_input", "warning")]
    _, plain = _val_loop({7, 9}, mode="plain")
    assert printed == printed_default == plain


def test_anomaly_mode_a_nan_batch_stays_the_error_when_training_took_one_too() -> None:
    session, _ = _val_loop({7}, train_nan={20})
    errors = [f for f in session.findings if f.severity == "error"]
    assert [(f.kind, f.step) for f in errors] == [("nonfinite_input", 8)]
    assert not errors[0].data.get("dropped_only")


def test_anomaly_mode_a_nan_batch_stays_the_error_when_the_loop_raised_on_it() -> None:
    session, printed = _val_loop({7}, raise_on_nan=True)
    assert printed[-1] == "3 " + printed[-1].split()[1] and len(printed) == 1
    errors = [f for f in session.findings if f.severity == "error"]
    assert ("nonfinite_input", 8) in [(f.kind, f.step) for f in errors]


def test_a_layer_output_nan_whole_gets_no_absmax_point_but_a_zero_output_does() -> None:
    """Review 52b: an output NaN whole was charted with absmax 0.0 (a dead layer's look);
    the README says such a step has no point there."""
    import math

    import torch

    from amp_doctor.dtypes import limits
    from amp_doctor.records import LayerStep, TensorStats
    from amp_doctor.sinks.tensorboard import layer_scalars

    nan = math.nan
    all_nan = TensorStats(numel=64, min=nan, max=nan, absmax=0.0, zero_frac=0.0,
                          nonfinite_frac=1.0, overflow_frac=0.0, underflow_frac=0.0,
                          headroom=math.inf)
    got = layer_scalars(LayerStep(act=all_nan), limits(torch.float16))
    assert "absmax" not in got and "headroom" not in got and got["nonfinite"] == 64
    zeros = TensorStats(numel=64, min=0.0, max=0.0, absmax=0.0, zero_frac=1.0,
                        nonfinite_frac=0.0, overflow_frac=0.0, underflow_frac=0.0,
                        headroom=math.inf)
    assert layer_scalars(LayerStep(act=zeros), limits(torch.float16))["absmax"] == 0.0


def _forecaster(float32_stat: bool) -> tuple[object, list[float]]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    import amp_doctor

    class RMSNorm(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if float32_stat:
                var = x.float().pow(2).mean(-1, keepdim=True)
                return (x.float() * torch.rsqrt(var + 1e-6)).type_as(x) * self.weight
            var = x.pow(2).mean(-1, keepdim=True)  # inf in float16 once |x| > 256
            return x * torch.rsqrt(var + 1e-6) * self.weight

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.norm = RMSNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(self.norm(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, 32)
            self.blocks = nn.ModuleList([Block(32) for _ in range(2)])
            self.norm_f = RMSNorm(32)
            self.head = nn.Linear(32, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.head(self.norm_f(h))

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    # Raw station features (irradiance in W/m^2, degrees, %): not standardised.
    X = torch.rand(2048, 6, generator=g) * torch.tensor([1000.0, 360, 100, 8, 24, 20])
    y = (X[:, :1] / 1000 - X[:, 2:3] / 300)
    y = (y - y.mean()) / y.std()
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    with amp_doctor.watch(model, every=5, tensorboard=False) as doctor:
        for _ in range(30):
            idx = torch.randint(0, len(X), (128,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(X[idx]).float(), y[idx])
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return doctor.session, losses


def test_a_hand_written_rmsnorm_whose_square_overflows_zeroes_rows_silently() -> None:
    """Review 52a (s4): `x.pow(2).mean()` in float16 is inf for the rows with an |x| > 256,
    and `x * rsqrt(inf)` zeroes them: two thirds of every norm's rows, the loss finite, no
    backoff beyond the start-up. The report said nothing (0 errors), and the norms read as
    float32 layers (their `* weight` returns float32)."""
    session, losses = _forecaster(float32_stat=False)
    assert all(math.isfinite(v) for v in losses)
    norms = [lay for lay in session.layers if lay.type == "RMSNorm"]  # type: ignore[attr-defined]
    assert [lay.name for lay in norms] == ["blocks.0.norm", "blocks.1.norm", "norm_f"]
    assert all(lay.zero_frac > 0.3 for lay in norms)
    errors = [f for f in session.findings if f.severity == "error"]  # type: ignore[attr-defined]
    assert [(f.kind, f.module) for f in errors] == [("zeroed_output", "blocks.0.norm")]
    e = errors[0]
    assert e.data["partly"] and e.data["also"] == ["blocks.1.norm", "norm_f"]
    assert e.data["input_from"] == "inp" and e.data["input_absmax"] > 256
    assert "x.float().pow(2).mean(-1, keepdim=True)" in e.advice
    assert "--fp32 blocks.0.norm --fp32 blocks.1.norm --fp32 norm_f" in e.message


def test_the_rmsnorm_with_its_statistic_in_float32_has_no_zeroed_rows() -> None:
    session, _ = _forecaster(float32_stat=True)
    norms = [lay for lay in session.layers if lay.type == "RMSNorm"]  # type: ignore[attr-defined]
    assert norms and all(lay.zero_frac < 0.01 for lay in norms)
    assert not session.findings_of("zeroed_output")  # type: ignore[attr-defined]


def test_anomaly_modes_overflow_of_a_regression_head_says_to_standardise_the_targets() -> None:
    """Review 52a (s2): a price regressor on raw targets; the default mode's error on the
    head said to standardise them, anomaly mode's op (aten.addmm in it) to scale an
    attention score down (`q * d**-0.5`)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    import amp_doctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].bias.fill_(6.3e4)  # started near the prices' mean, in raw dollars
        model[2].weight.mul_(1e5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
        for _ in range(6):
            x = torch.randn(16, 8)
            y = 7e4 + 1e4 * torch.randn(16, 1)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    errors = [f for f in doctor.session.findings if f.severity == "error"]
    assert [(f.kind, f.module, f.op) for f in errors] == [
        ("nonfinite_forward", "2", "aten.addmm")]
    assert errors[0].advice.startswith("This layer returns the model's output")
    assert "Standardise the targets" in errors[0].advice and "d**-0.5" not in errors[0].advice
