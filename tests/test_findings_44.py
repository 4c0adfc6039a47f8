"""Session 44: a NaN that began in a step whose update nothing skipped.

Without a GradScaler (float16 without one, or bfloat16, which needs none) nothing skips
an update whose gradients are NaN/inf: the optimizer writes them into the weights, and
from the next step on every forward is NaN from the first layer that uses them. That
layer is where the NaN shows, not where it began (review 44b: a DDPM in bfloat16 was
told to run its first layer in float32).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import amp_doctor

BAD_STEP = 12


def _train(dtype: torch.dtype, every: int, model: nn.Module, spike: float = 1e6,
           steps: int = 30) -> tuple[amp_doctor.Session, list[float]]:
    """Adam, no GradScaler; the loss is multiplied by ``spike`` at BAD_STEP (a loss term
    that blows up once): its gradient overflows float16 in backward."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    with amp_doctor.watch(model, every=every, tensorboard=False) as doctor:
        for step in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with torch.autocast("cpu", dtype=dtype):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y) * (spike if step == BAD_STEP else 1.0)
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return doctor.session, losses


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _errors(s: amp_doctor.Session) -> list[tuple[str, str | None, int | None]]:
    return [(f.kind, f.module, f.step) for f in s.findings if f.severity == "error"]


def test_a_recorded_step_whose_update_took_overflowed_gradients_is_the_one_error() -> None:
    s, losses = _train(torch.float16, 1, _mlp())
    # The run really is this: finite up to the spike (finite too), NaN from the next step.
    assert all(math.isfinite(v) for v in losses[: BAD_STEP + 1]) and losses[BAD_STEP] > 1e5
    assert all(math.isnan(v) for v in losses[BAD_STEP + 1:])
    # Layer 2's output gradient is the loss's own: the first to overflow in backward. Not
    # "layer 0's output went NaN at step 13: run it in float32".
    assert _errors(s) == [("nonfinite_grads_applied", "2", BAD_STEP)], s.findings
    f = s.findings_of("nonfinite_grads_applied")[0]
    assert f.data["culprits"][0] == "2" and "Sequential" not in f.data["culprits"]
    assert f.data["loss"] > 1e5
    assert "GradScaler" in f.advice and "isfinite(norm)" in f.advice
    assert "nonfinite_loss from step 13" in f.message
    loss = s.findings_of("nonfinite_loss")[0]
    assert loss.severity == "info" and loss.module is None
    assert loss.data["after_grads_applied"] == BAD_STEP and loss.data["shown_in"] == "0"
    assert "only where it showed" in loss.message


def test_an_unrecorded_step_that_made_the_weights_nan_blames_no_layer() -> None:
    s, losses = _train(torch.float16, 10, _mlp())
    assert math.isnan(losses[20])
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module) for f in errors] == [("nonfinite_loss", None)], s.findings
    f = errors[0]
    # Recorded steps 0, 10, 20: steps 13..19 had NaN losses that nothing checked.
    assert f.data["began_unrecorded"] == 7 and f.data["last_recorded_before"] == 10
    assert f.data["shown_in"] == "0" and f.data["origin"] is None
    assert "may not be where it began" in f.message
    assert "watch(model, every=1)" in f.advice and "in float32" not in f.advice
    assert not s.findings_of("nonfinite_grads_applied")


class ZeroNorm(nn.Module):
    """``h / (|h| + 1)``: finite forward, but the backward of ``sqrt`` at 0 is inf, and
    0 * inf is NaN, when a row of ``h`` is all zeros (set at BAD_STEP)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.zero = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x) * (0.0 if self.zero else 1.0)
        n = h.float().pow(2).sum(-1, keepdim=True).sqrt()
        return self.fc2(h / (n + 1))


def test_bfloat16_gradients_that_a_backward_op_made_nan_are_named_without_a_scaler() -> None:
    torch.manual_seed(0)
    model = ZeroNorm()
    orig = model.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        model.zero = forward.calls == BAD_STEP
        forward.calls += 1
        return orig(x)

    forward.calls = 0  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]
    s, losses = _train(torch.bfloat16, 1, model, spike=1.0, steps=16)
    assert math.isfinite(losses[BAD_STEP]) and math.isnan(losses[BAD_STEP + 1])
    assert [k for k, _, _ in _errors(s)] == ["nonfinite_grads_applied"], s.findings
    f = s.findings_of("nonfinite_grads_applied")[0]
    assert f.step == BAD_STEP and f.module == "fc1"
    # bfloat16 does not overflow there: the advice is the op, not a GradScaler.
    assert "GradScaler" not in f.advice and "sqrt" in f.advice
    assert s.findings_of("nonfinite_loss")[0].severity == "info"
