"""Session 57e: review 57d of ``scaler_recreated`` (a GradScaler built anew every epoch).

* A new scaler's start-up is judged as the first scaler's is, from its own start: one
  that needs five or more halvings to fit is its recalibration (``scaler_recreated``),
  not a ``scale_collapse`` that the same run with one scaler never gets.
* The first step of a new scaler records the step's loss unscaled, as every other step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor
from amp_doctor.records import Session

STEPS = 40
BATCH = 8
# Multiplies the loss so that a scaler from the default init_scale (2**16) halves five
# or more times before the gradients fit: its start-up is a long run of backoffs.
LOSS_FACTOR = 100.0
# Every new scaler needs about nine halvings at this factor: one that lives five steps
# never finishes calibrating.
HUGE_LOSS_FACTOR = 1000.0
SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2}


def _run(factor: float, epoch: int | None, watched: bool
         ) -> tuple[list[float], dict[str, torch.Tensor], Session | None]:
    """``epoch``: a new default GradScaler every ``epoch`` steps (None: one for the run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    xs, ys = torch.randn(STEPS, BATCH, 16), torch.randint(0, 4, (STEPS, BATCH))
    losses: list[float] = []
    w = amp_doctor.watch(model, every=1, tensorboard=False) if watched else None
    try:
        scaler = torch.amp.GradScaler("cpu")
        for i in range(STEPS):
            if epoch is not None and i and i % epoch == 0:
                scaler = torch.amp.GradScaler("cpu")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(xs[i]), ys[i]) * factor
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    finally:
        if w is not None:
            w.close()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, params, (w.session if w is not None else None)


def _same_numerics(factor: float, epoch: int | None, losses: list[float],
                   params: dict[str, torch.Tensor]) -> None:
    plain_losses, plain_params, _ = _run(factor, epoch, watched=False)
    assert losses == plain_losses
    assert params.keys() == plain_params.keys()
    for k, v in params.items():
        assert torch.equal(v, plain_params[k]), k


def _worst(session: Session) -> int:
    return max((SEVERITY_RANK[f.severity] for f in session.findings), default=0)


def test_long_recalibration_is_scaler_recreated_not_collapse() -> None:
    losses, params, s = _run(LOSS_FACTOR, 10, watched=True)
    assert s is not None and s.scaler is not None
    _same_numerics(LOSS_FACTOR, 10, losses, params)
    # Each new scaler halves five times or more from its start before it fits.
    for start in (10, 20, 30):
        run = [e for e in s.scaler.events if e.kind == "backoff" and start <= e.step < start + 5]
        assert len(run) == 5, start
    kinds = {f.kind: f for f in s.findings}
    assert "scale_collapse" not in kinds, kinds["scale_collapse"].message
    rec = kinds["scaler_recreated"]
    assert rec.severity == "warning"
    assert rec.data["resets"] == [10, 20, 30]
    assert {10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 30, 31, 32, 33, 34} <= set(rec.steps)
    # No harsher than the same run with one scaler.
    _, _, one = _run(LOSS_FACTOR, None, watched=True)
    assert one is not None
    assert "scale_collapse" not in {f.kind for f in one.findings}
    assert _worst(s) <= max(_worst(one), SEVERITY_RANK["warning"])


def test_never_finished_recalibration_is_an_error_not_collapse() -> None:
    losses, params, s = _run(HUGE_LOSS_FACTOR, 5, watched=True)
    assert s is not None and s.scaler is not None
    _same_numerics(HUGE_LOSS_FACTOR, 5, losses, params)
    # Every step backed off: no scaler got through its start-up.
    assert s.scaler.backoff_steps == list(range(STEPS))
    kinds = {f.kind: f for f in s.findings}
    assert "scale_collapse" not in kinds, kinds["scale_collapse"].message
    rec = kinds["scaler_recreated"]
    assert rec.severity == "error"
    assert rec.data["resets"] == list(range(5, STEPS, 5))


def test_new_scalers_first_step_records_the_unscaled_loss() -> None:
    losses, params, s = _run(LOSS_FACTOR, 10, watched=True)
    assert s is not None
    _same_numerics(LOSS_FACTOR, 10, losses, params)
    recorded = {r.step: r.loss for r in s.history}
    assert sorted(recorded) == list(range(STEPS))
    for step, loss in recorded.items():
        assert isinstance(loss, float)
        # float16 autocast: the loss the loop saw, not it times the scale (2**16).
        assert math.isclose(loss, losses[step], rel_tol=1e-3), (step, loss, losses[step])


# Steps the loop trains with autocast and a GradScaler before it drops both for
# model.half() and a plain optimizer step.
SCALED_STEPS = 5
HALF_STEPS = 7
# A small loss: without a loss scale its float16 gradients fall below the smallest
# normal (gradient_underflow), which the scale lifts while the scaler is there.
SMALL_LOSS_FACTOR = 1e-3


def _run_dropping_scaler(watched: bool
                         ) -> tuple[list[float], dict[str, torch.Tensor], Session | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = SCALED_STEPS + HALF_STEPS
    xs, ys = torch.randn(n, BATCH, 16), torch.randint(0, 4, (n, BATCH))
    scaler = torch.amp.GradScaler("cpu")
    losses: list[float] = []
    w = amp_doctor.watch(model, every=1, tensorboard=False) if watched else None
    try:
        for i in range(n):
            if i < SCALED_STEPS:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(xs[i]), ys[i]) * SMALL_LOSS_FACTOR
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                if i == SCALED_STEPS:
                    model.half()
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
                loss = F.cross_entropy(model(xs[i].half()).float(), ys[i]) * SMALL_LOSS_FACTOR
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())
    finally:
        if w is not None:
            w.close()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, params, (w.session if w is not None else None)


def test_steps_after_the_scaler_was_dropped_carry_no_scale() -> None:
    from amp_doctor.sinks.text import summary_line

    losses, params, s = _run_dropping_scaler(watched=True)
    assert s is not None and s.scaler is not None
    plain_losses, plain_params, _ = _run_dropping_scaler(watched=False)
    assert losses == plain_losses
    for k, v in params.items():
        assert torch.equal(v, plain_params[k]), k
    scales = {r.step: r.scale for r in s.history}
    assert sorted(scales) == list(range(SCALED_STEPS + HALF_STEPS))
    assert all(scales[i] == 2.0 ** 16 for i in range(SCALED_STEPS))
    assert all(scales[i] is None for i in range(SCALED_STEPS, SCALED_STEPS + HALF_STEPS))
    assert max(step for step, _ in s.scaler.scale) == SCALED_STEPS - 1
    assert f"GradScaler on until step {SCALED_STEPS - 1}, then none" in summary_line(s)
    under = [f for f in s.findings if f.kind == "gradient_underflow"]
    assert under
    for f in under:
        assert "even with the loss scale" not in f.message, f.message
        assert f"with the loss scale only up to step {SCALED_STEPS - 1}" in f.message
