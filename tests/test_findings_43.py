"""Session 43: one error per cause when anomaly mode finds the op in a parent's own code.

An op in a module's own forward (``self.B(h * 1e5)``) that overflows float16 first
shows in the output of the child called after it. Anomaly mode names the op, and the
child's activation statistics name the child: two errors for one cause, unless the op
search saw that the child only carried the op's inf on. A child that overflowed by
itself after the op (its own op made inf from finite inputs) stays an error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor


class Parent(nn.Module):
    """``B(A(x) * k)``: the multiply in the parent's own code overflows float16 from
    step 2 (``k`` large). With ``b_overflows`` the multiply's inf goes to a branch B
    never sees, and from step 2 B's own weights overflow it from finite inputs."""

    def __init__(self, b_overflows: bool) -> None:
        super().__init__()
        self.A = nn.Linear(8, 16)
        self.B = nn.Linear(16, 16)
        self.D = nn.Linear(16, 3)
        self.k = 1.0
        self.b_overflows = b_overflows

    def break_at_step_2(self) -> None:
        self.k = 1e5
        if self.b_overflows:
            with torch.no_grad():
                self.B.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.A(x))
        if self.b_overflows:
            aside = (h * self.k).sum()  # the multiply's inf: into the loss, not into B
            return self.D(self.B(h)) + aside
        return self.D(self.B(h * self.k))


def _train(model: Parent, steps: int = 5, **watch: Any) -> amp_doctor.Session:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, **watch) as doctor:
        for step in range(steps):
            if step == 2:
                model.break_at_step_2()
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def _errors(s: amp_doctor.Session) -> list[tuple[str, str | None, str | None]]:
    return [(f.kind, f.module, f.op) for f in s.findings if f.severity == "error"]


def test_a_child_that_only_carried_its_parents_op_overflow_is_not_a_second_error() -> None:
    torch.manual_seed(0)
    s = _train(Parent(b_overflows=False), anomaly=True, every=1)
    assert _errors(s) == [("nonfinite_forward", "Parent", "aten.mul")]
    err = s.findings_of("nonfinite_forward")[0]
    assert "B" in err.data["carriers"]
    assert err.data["also_affected"][0] == "B"
    assert "only carried its inf/NaN on" in err.message and ": B" in err.message
    # The child's statistics still say it was the first watched output to show it.
    assert s.layer("B").overflow_origin_steps == 3
    assert s.layer("B").nonfinite_steps == 3


def test_a_child_that_overflowed_by_itself_after_the_op_stays_an_error() -> None:
    torch.manual_seed(0)
    s = _train(Parent(b_overflows=True), anomaly=True, every=1)
    errors = _errors(s)
    assert ("activation_overflow", "B", None) in errors
    assert ("nonfinite_forward", "Parent", "aten.mul") in errors
    err = s.findings_of("nonfinite_forward")[0]
    assert "B" not in err.data.get("carriers", [])
    assert err.data["later_origins"] == ["B"]
    assert "later in that step an op in B made NaN/inf from finite inputs too" in err.message
    assert "every op after it only passed it on" not in err.message
    # D carried B's inf, not the multiply's.
    assert s.findings_of("activation_overflow")[0].data["also_affected"] == ["D"]
