"""Session 57c: a GradScaler created anew every epoch (built inside ``train_one_epoch()``).

Each new scaler starts again from its ``init_scale`` and halves it until the gradients
fit, skipping an optimizer step per halving. Merged into one timeline, those start-ups
read as a scale that kept collapsing, and the report said "the loss is too large for
float16". They are a scaler replaced, and the fix is to build it once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor
from amp_doctor.records import Session

STEPS = 40
EPOCH = 10
INIT_SCALE = 2.0 ** 24


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
          x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.item()


def _run(how: str, watched: bool) -> tuple[list[float], dict[str, torch.Tensor], Session | None]:
    """``how``: "function" builds the scaler inside an epoch function (it dies at the
    function's return), "reassigned" builds it in the loop (the old one lives until the
    new one is assigned), "once" builds one for the whole run."""
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs, ys = torch.randn(STEPS, 8, 16), torch.randint(0, 4, (STEPS, 8))
    losses: list[float] = []

    def train_one_epoch(epoch: int) -> None:
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        for i in range(epoch * EPOCH, (epoch + 1) * EPOCH):
            losses.append(_step(model, opt, scaler, xs[i], ys[i]))

    w = amp_doctor.watch(model, every=1, tensorboard=False) if watched else None
    try:
        if how == "function":
            for epoch in range(STEPS // EPOCH):
                train_one_epoch(epoch)
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
            for i in range(STEPS):
                if how == "reassigned" and i and i % EPOCH == 0:
                    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
                losses.append(_step(model, opt, scaler, xs[i], ys[i]))
    finally:
        if w is not None:
            w.close()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, params, (w.session if w is not None else None)


def _same_numerics(how: str, losses: list[float], params: dict[str, torch.Tensor]) -> None:
    plain_losses, plain_params, _ = _run(how, watched=False)
    assert losses == plain_losses
    assert params.keys() == plain_params.keys()
    for k, v in params.items():
        assert torch.equal(v, plain_params[k]), k


@pytest.mark.parametrize("how", ["function", "reassigned"])
def test_a_gradscaler_recreated_every_epoch_is_named_not_a_collapse(how: str) -> None:
    losses, params, s = _run(how, watched=True)
    assert s is not None and s.scaler is not None
    kinds = {f.kind for f in s.findings}
    # Each new scaler's start-up is no collapse, and the loss is not too large.
    assert "scale_collapse" not in kinds
    assert not [f for f in s.findings if f.kind == "scaler_backoff" and f.severity != "info"]
    assert not [f for f in s.findings if "too large" in f.message]
    (f,) = s.findings_of("scaler_recreated")
    assert f.severity == "warning" and f.step == EPOCH
    takeovers = [EPOCH, 2 * EPOCH, 3 * EPOCH]
    assert f.data["resets"] == takeovers
    # The steps skipped by recalibration are the backoffs from each takeover on.
    recal = f.data["recalibration_steps"]
    assert recal and all(any(t <= x < t + EPOCH for t in takeovers) for x in recal)
    assert set(recal) <= set(s.scaler.skipped_steps)
    assert f.steps == recal
    for t in takeovers:
        assert t in recal  # the first step of a scaler at 2**24 always overflows
    assert f.message.startswith(
        "A new GradScaler replaced the previous one 3 times (at steps 10, 20, 30)")
    assert f"{len(recal)} optimizer steps" in f.message
    assert "outside the epoch loop" in f.advice
    assert "load_state_dict(old.state_dict())" in f.advice
    # The timeline shows the resets, and the jump back up is no growth.
    assert [r.step for r in s.scaler.resets] == takeovers
    for r in s.scaler.resets:
        assert r.scale_after == INIT_SCALE
        assert r.scale_before == dict(s.scaler.scale)[r.step - 1]
        assert r.scale_before < INIT_SCALE
    assert s.scaler.growth_steps == []
    # The first scaler's own calibration is still GradScaler working as designed.
    (info,) = s.findings_of("scaler_backoff")
    assert info.severity == "info" and info.step == 0
    assert all(x < EPOCH for x in info.steps)
    # A saved report reloads with its resets.
    again = Session.from_json(s.to_json())
    assert again.scaler is not None and again.scaler.resets == s.scaler.resets
    assert again.findings == s.findings
    _same_numerics(how, losses, params)


def test_one_gradscaler_for_the_whole_run_is_not_recreated() -> None:
    losses, params, s = _run("once", watched=True)
    assert s is not None and s.scaler is not None
    assert not s.findings_of("scaler_recreated")
    assert s.scaler.resets == []
    assert "scale_collapse" not in {f.kind for f in s.findings}
    _same_numerics("once", losses, params)


def test_a_new_gradscaler_that_loads_the_old_state_is_no_recalibration() -> None:
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs, ys = torch.randn(STEPS, 8, 16), torch.randint(0, 4, (STEPS, 8))
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        for i in range(STEPS):
            if i and i % EPOCH == 0:
                new = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
                new.load_state_dict(scaler.state_dict())
                scaler = new
            _step(model, opt, scaler, xs[i], ys[i])
    s = w.session
    assert not s.findings_of("scaler_recreated")
    assert "scale_collapse" not in {f.kind for f in s.findings}
    assert s.scaler is not None and all(x < EPOCH for x in s.scaler.backoff_steps)


def test_two_gradscalers_used_together_are_not_a_replacement() -> None:
    """A GAN's two networks, each with its own optimizer and scaler, both every step."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"g": _net(), "d": nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                                                          nn.Linear(8, 1))})
    opt_g = torch.optim.Adam(model["g"].parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(model["d"].parameters(), lr=1e-3)
    sc_g = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    sc_d = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    xs = torch.randn(20, 8, 16)
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for i in range(20):
            with torch.autocast("cpu", dtype=torch.float16):
                fake = model["g"](xs[i])
                d_loss = model["d"](fake.detach()).float().pow(2).mean()
            opt_d.zero_grad()
            sc_d.scale(d_loss).backward()
            sc_d.step(opt_d)
            sc_d.update()
            with torch.autocast("cpu", dtype=torch.float16):
                g_loss = (1 - model["d"](model["g"](xs[i]))).float().pow(2).mean()
            opt_g.zero_grad()
            sc_g.scale(g_loss).backward()
            sc_g.step(opt_g)
            sc_g.update()
    s = w.session
    assert not s.findings_of("scaler_recreated")
    assert s.scaler is not None and s.scaler.resets == []
    assert len(s.other_scalers) == 1 and s.other_scalers[0].resets == []


def test_new_gradscalers_that_never_finish_calibrating_are_an_error() -> None:
    """Epochs shorter than the calibration: every new scaler is replaced while it still
    skips every step, so nothing trains after the first replacement."""
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs, ys = torch.randn(12, 8, 16), torch.randint(0, 4, (12, 8))
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for i in range(12):
            if i % 3 == 0:
                scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
            _step(model, opt, scaler, xs[i], ys[i])
    s = w.session
    assert s.scaler is not None and s.scaler.skipped_steps == list(range(12))
    (f,) = s.findings_of("scaler_recreated")
    assert f.severity == "error" and f.data["resets"] == [3, 6, 9]
    assert f.data["unfinished"] == [3, 6, 9]
    assert "none of its optimizer steps trained" in f.message
    assert "scale_collapse" not in {x.kind for x in s.findings}
