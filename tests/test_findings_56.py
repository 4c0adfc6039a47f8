"""Session 56: a 0/0 loss term with finite gradients arms anomaly mode's search, which
names the division in the loop's code as the one root cause (review 55, item 5)."""

from __future__ import annotations

import torch
from torch import nn

import amp_doctor
from amp_doctor.records import Session
from amp_doctor.sinks.text import render_text


def _count_div_run(steps: int = 30) -> tuple[Session, list[float]]:
    """A detector-style loss: a box term summed over the positive samples and divided by
    their count, which is 0 every 7th step (3, 10, 17, 24): 0/0 = NaN in the loss, while
    the gradients stay finite (the sum is over no elements), so the GradScaler skips
    nothing and no gradient flag shows the bad step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    losses: list[float] = []
    with amp_doctor.watch(model, anomaly=True) as doctor:
        for step in range(steps):
            x = torch.randn(64, 16)
            labels = torch.randint(0, 2, (64,))
            if step % 7 == 3:
                labels.zero_()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                cls = nn.functional.cross_entropy(out[:, :2].float(), labels)
                pos = labels > 0
                box = (out[pos, 2:].float() ** 2).sum() / pos.sum()  # DIVISION LINE
                loss = cls + box
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    assert doctor.session is not None
    return doctor.session, losses


def test_a_nan_loss_with_finite_gradients_arms_the_search() -> None:
    # Review 55: the search never armed (only the gradients' flags armed it), so the report
    # said "the op search ran after the NaN and did not see it again" and named no op,
    # where `--on-nonfinite raise` found the division at once.
    s, losses = _count_div_run()
    assert [i for i, v in enumerate(losses) if v != v] == [3, 10, 17, 24]
    assert s.scaler is not None and s.scaler.skipped_steps == []
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.op, f.module) for f in errors] == [("nonfinite_forward", "aten.div", None)]
    (err,) = errors
    # Found by the search aimed at the recurrence (every 7 steps), with the line.
    assert err.step == 17
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), start=1)
                if text.rstrip().endswith("# DIVISION LINE"))
    assert err.data["frames"][0].startswith(f"{__file__}:{line} ")
    assert "computed 0/0" in err.advice and "clamp_min(1)" in err.advice
    # The NaN loss is its consequence, not a second error.
    (loss,) = [f for f in s.findings if f.kind == "nonfinite_loss"]
    assert loss.severity == "info"
    assert "The op-level search found aten.div make NaN/inf in that code at step 17" in (
        loss.message)
    # The division's backward made inf that went nowhere: part of the same error, not an
    # info finding of its own.
    assert not [f for f in s.findings if f.kind == "nonfinite_discarded"]
    text = render_text(s)
    assert "Consequences: the loss was NaN/inf in 4 of the 30 steps checked." in " ".join(
        text.split())
