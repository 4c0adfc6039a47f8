"""-inf in a batch is a mask's only beside a max of exactly 0 (review 49a #8).

An additive attention mask is 0 where a position attends and -inf (or a large negative
bias) elsewhere: its max is 0. Log-probabilities given as features (an upstream model's
``log(p)``) are negative, and a probability of 0 makes a -inf among them: that is bad
data, which the first Linear turns into +-inf sums and NaN. It was taken for a mask: "the
loss was NaN at step 7, where it appeared is unknown" by default, the first layer's
overflow with ``every=1``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import amp_doctor


class _Masked(nn.Module):
    """Features and an additive mask over the 4 classes (0: allowed, -inf: not)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.body(x).float() + mask


def _run(doctor_kw: dict | None, log_zero_at: int | None = 7, steps: int = 30,
         ) -> tuple[list[float], amp_doctor.Session | None]:
    torch.manual_seed(0)
    model = _Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    doctor = (amp_doctor.watch(model, tensorboard=False, **doctor_kw)
              if doctor_kw is not None else None)
    mask = torch.zeros(8, 4)
    mask[:, 0] = -math.inf  # class 0 is never allowed
    losses = []
    try:
        for step in range(steps):
            p = torch.softmax(torch.randn(8, 16), -1)
            if step == log_zero_at:
                p[2, 3] = 0.0
            x, y = torch.log(p), torch.randint(1, 4, (8,))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x, mask), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
    finally:
        session = doctor.close() if doctor is not None else None
    return [float(v) for v in losses], session


@pytest.mark.parametrize("kw", [{}, {"every": 1}, {"anomaly": True}])
def test_a_log_of_zero_among_log_probability_features_is_the_data(kw: dict) -> None:
    plain, _ = _run(None)
    losses, s = _run(kw)
    assert math.isnan(plain[7]) and all(math.isfinite(v) for i, v in enumerate(plain) if i != 7)
    assert [str(v) for v in losses] == [str(v) for v in plain]
    assert s is not None
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.module, f.step) == ("nonfinite_input", "_Masked", 7)
    text = " ".join(f.message.split())
    # The features (positional argument 1), not the mask.
    assert "inf (in its positional argument 1, one of 2 floating inputs)" in text


def test_the_mask_beside_finite_features_is_no_finding() -> None:
    losses, s = _run({"every": 1}, log_zero_at=None)
    assert all(math.isfinite(v) for v in losses)
    assert s is not None
    assert not any(f.kind == "nonfinite_input" for f in s.findings)
    assert [f.kind for f in s.findings if f.severity == "error"] == []
