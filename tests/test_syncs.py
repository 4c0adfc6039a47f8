"""Host syncs counted independently of amp-doctor's own counter (tests/syncs.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import MLP
from syncs import PACKAGE_DIR, SyncCounter
from torch import nn

import amp_doctor
from amp_doctor.devicework import host_syncs


def _loop(every: int, steps: int, skip_at: int | None = None) -> tuple[list[str], int, int]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    w = amp_doctor.watch(model, every=every)
    try:
        own0 = host_syncs()
        with SyncCounter() as c:
            for i in range(steps):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                if i == skip_at:
                    model.fc1.weight.grad[0, 0] = math.inf
                scaler.step(opt)
                scaler.update()
                loss.item()  # the user's own sync: not counted
        own = host_syncs() - own0
    finally:
        w.close()
    return [call.site for call in c.calls], w.recorded, own


@pytest.mark.parametrize("every", [1, 10])
def test_one_sync_per_recorded_step_in_a_healthy_loop(every: int) -> None:
    sites, recorded, own = _loop(every, 20)
    assert recorded == 20 // every
    assert len(sites) == recorded, sites
    assert set(sites) == {s for s in sites if "recorder.py" in s and "to_host" in s}
    assert own == recorded  # amp-doctor's own counter agrees


def test_a_skipped_step_that_was_not_recorded_costs_one_more_sync() -> None:
    sites, recorded, _ = _loop(10, 20, skip_at=13)
    assert recorded == 2
    assert len(sites) == 3, sites
    assert sum("skip_culprits" in s for s in sites) == 1


def test_a_skipped_step_that_was_recorded_costs_no_extra_sync() -> None:
    sites, recorded, _ = _loop(10, 20, skip_at=10)
    assert recorded == 2 and len(sites) == 2, sites


def test_the_counter_sees_an_uncounted_sync_in_amp_doctor_code_and_restores_torch() -> None:
    # A function whose code lives in amp_doctor/ (compiled with that filename):
    # each way to the host is caught, and the user's own calls are not.
    src = ("def f(t):\n    t.item(); t.tolist(); bool(t); float(t); int(t)\n"
           "    t.cpu(); t.nonzero(); torch.nonzero(t)\n")
    ns: dict = {"torch": torch}
    exec(compile(src, str(Path(PACKAGE_DIR) / "_fake_sync.py"), "exec"), ns)
    t = torch.tensor(1.0)
    before = (torch.Tensor.item, torch.nonzero, torch.Tensor.__bool__)
    with SyncCounter() as c:
        ns["f"](t)
        t.item()
        bool(t)
    whats = [call.what for call in c.calls]
    assert whats == ["item", "tolist", "__bool__", "__float__", "__int__", "cpu", "nonzero",
                     "torch.nonzero"]
    assert all("_fake_sync.py" in call.site for call in c.calls)
    assert (torch.Tensor.item, torch.nonzero, torch.Tensor.__bool__) == before
