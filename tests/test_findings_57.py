"""Session 57: an in-code watch whose model the loop replaces mid-run.

``watch(model)`` hooks one object. ``model = torch.load(path, weights_only=False)``
or ``copy.deepcopy(model)`` in the loop trained an object nobody hooked: every later
step was "recorded" with no layer in it, and the report said "AMP looks healthy".
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod

import amp_doctor
from amp_doctor.hooks.replacement import SEARCH_STEPS
from amp_doctor.records import Session

STEPS = 12
SWAP = 5


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _wider() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def _reload(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _rebuild_wider(model: nn.Module) -> nn.Module:
    torch.manual_seed(3)
    return _wider()


def _loop(swap: Callable[[nn.Module], nn.Module] | None, watched: bool,
          every: int = 1) -> tuple[list[float], list[float], Session | None]:
    """A float16 loop with a GradScaler whose model is replaced at step SWAP; returns the
    losses, a checksum of the final parameters, and the session."""
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    losses: list[float] = []
    w = amp_doctor.watch(model, every=every, tensorboard=False) if watched else None
    try:
        for step in range(STEPS):
            if step == SWAP and swap is not None:
                model = swap(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(step)
            x = torch.randn(16, 8, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    finally:
        if w is not None:
            w.close()
    sums = [float(p.detach().double().sum()) for p in model.parameters()]
    return losses, sums, (w.session if w is not None else None)


@pytest.mark.parametrize("swap", [_reload, copy.deepcopy])
def test_a_replaced_model_is_followed_from_the_next_step(
        swap: Callable[[nn.Module], nn.Module]) -> None:
    losses, sums, s = _loop(swap, watched=True)
    assert s is not None
    # Its layers are recorded again from the step after the swap on.
    with_layers = [r.step for r in s.history if {"0", "2"} <= set(r.layers)]
    assert with_layers == [st for st in range(STEPS) if st != SWAP]
    assert sorted(lay.name for lay in s.layers) == ["0", "1", "2", "Sequential"]
    (note,) = [f for f in s.findings if f.kind == "model_replaced"]
    assert note.severity == "info" and note.step == SWAP
    assert note.message.startswith(f"`model` (Sequential) was replaced at step {SWAP} ")
    assert (f"found the new object by its class and architecture in step {SWAP + 1}; "
            f"step {SWAP} trained it before that" in note.message)
    assert not [f for f in s.findings if f.severity != "info"]
    # The recorded figures after the swap are the new object's: its last layer's calls.
    lay2 = next(lay for lay in s.layers if lay.name == "2")
    assert lay2.calls == STEPS - 1
    # Nothing of the search is left behind, and the numerics are the loop's own.
    assert not module_mod._global_forward_pre_hooks
    assert not module_mod._global_forward_hooks
    plain_losses, plain_sums, _ = _loop(swap, watched=False)
    assert losses == plain_losses and sums == plain_sums


def test_a_model_rebuilt_with_another_architecture_is_a_warning() -> None:
    losses, sums, s = _loop(_rebuild_wider, watched=True)
    assert s is not None
    assert [r.step for r in s.history if r.layers] == list(range(SWAP))
    (f,) = [f for f in s.findings if f.kind == "model_stopped"]
    assert f.severity == "warning" and f.step == SWAP
    assert f.message.startswith(
        f"The watched model ran no training forward in the run's last {STEPS - SWAP} steps "
        f"(steps {SWAP}-{STEPS - 1} of {STEPS}), while backward and the optimizer steps went on")
    assert "No module of its class and architecture was called after it" in f.message
    assert "amp-doctor diagnose" in f.advice
    assert not [x for x in s.findings if x.kind == "model_replaced"]
    assert not module_mod._global_forward_pre_hooks
    plain_losses, plain_sums, _ = _loop(_rebuild_wider, watched=False)
    assert losses == plain_losses and sums == plain_sums


def test_the_search_is_installed_for_a_few_steps_only() -> None:
    torch.manual_seed(0)
    model, other = _net(), _wider()
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.05)
    installed: list[bool] = []
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(10):
            net = model if step < 2 else other
            loss = net(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            installed.append(bool(module_mod._global_forward_pre_hooks))
    # Installed after the first step the watched model did not train (step 2), for
    # SEARCH_STEPS steps, then gone for good.
    assert installed == [False, False] + [True] * SEARCH_STEPS + [False] * (8 - SEARCH_STEPS)
    assert not module_mod._global_forward_pre_hooks
    s = w.session
    (f,) = [f for f in s.findings if f.kind == "model_stopped"]
    assert f.step == 2 and "last 8 steps (steps 2-9 of 10)" in f.message


def test_a_model_that_trains_every_other_step_is_no_warning() -> None:
    # Only one of two alternately trained models is watched: its idle steps end when it
    # trains again, so no "stopped" warning, and no object is taken for it.
    torch.manual_seed(0)
    a, b = _net(), _net()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.05)
    with amp_doctor.watch(a, every=1, tensorboard=False) as w:
        for step in range(8):
            net, opt = (a, opt_a) if step % 2 == 0 else (b, opt_b)
            loss = net(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = w.session
    assert not [f for f in s.findings if f.kind in ("model_stopped", "model_replaced")]
    assert not module_mod._global_forward_pre_hooks
    # b has a's architecture, but a is never idle when b is called right after a trained.
    assert sorted(lay.name for lay in s.layers) == ["0", "1", "2", "Sequential"]
    assert all(math.isfinite(r.loss) for r in s.history if r.loss is not None)


def test_the_search_is_removed_when_the_run_raises() -> None:
    torch.manual_seed(0)
    model, other = _net(), _wider()
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.05)
    with pytest.raises(RuntimeError, match="boom"):
        with amp_doctor.watch(model, every=1, tensorboard=False):
            for step in range(4):
                net = model if step < 1 else other
                loss = net(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            assert module_mod._global_forward_pre_hooks  # searching when it raised
            raise RuntimeError("boom")
    assert not module_mod._global_forward_pre_hooks
    assert not module_mod._global_forward_hooks
