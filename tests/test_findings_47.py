"""Session 47's fixes: findings that were wrong on real-style runs."""

from __future__ import annotations

import torch
from torch import nn

import amp_doctor


def test_a_batch_beyond_the_max_is_not_blamed_for_a_calibrating_scalers_backoffs() -> None:
    """Raw sensor counts past float16's max, normalised by a float32 LayerNorm first: no
    cast makes inf. A calibrating GradScaler backs off in the first steps (a large loss),
    and those steps had such a batch, but so did every later, finite step. That was an
    ERROR input_beyond_format, whose consequence read "(scale ? -> ?)"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(12):
            x = torch.randn(64, 16) * 3e4
            y = torch.randn(64, 1) * 50
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert [e.step for e in s.scaler.events if e.kind == "backoff"][:4] == [0, 1, 2, 3]
    assert not s.findings_of("input_beyond_format")
    assert not [f for f in s.findings if f.severity == "error"]
    (b,) = s.findings_of("scaler_backoff")
    assert b.severity == "info" and b.data["calibration"] == 4
    assert (b.data["scale_before"], b.data["backoffs"]) == (65536.0, len(b.steps))


def test_backoffs_after_unscale_then_optimizer_step_are_counted() -> None:
    """``scaler.unscale_(opt); clip; opt.step(); scaler.update()``: the update backs off on
    the unscale's inf checks though nothing was skipped. The report said "0 backoffs"
    beside a scale that fell from 65536 to 2^-14, and the loss's finding said the
    gradients "stayed finite"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(12):
            x, y = torch.randn(64, 16), torch.randn(64, 1) * 200
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            scaler.update()
    s = doctor.session
    assert s.scaler is not None
    assert s.scaler.backoff_steps == list(range(12))
    assert s.scaler.skipped_steps == []
    assert s.scaler.scale[-1][1] == scaler.get_scale() == 65536 * 0.5 ** 12
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert err.kind == "step_after_unscale"
    (b,) = s.findings_of("scaler_backoff")
    assert b.data["backoffs"] == 12 and b.severity == "info"
    assert "and no optimizer step was skipped" in b.message
    assert all("stayed finite" not in f.message for f in s.findings)
