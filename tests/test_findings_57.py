"""Session 57: an in-code watch whose model the loop replaces mid-run.

``watch(model)`` hooks one object. ``model = torch.load(path, weights_only=False)``
or ``copy.deepcopy(model)`` in the loop trained an object nobody hooked: every later
step was "recorded" with no layer in it, and the report said "AMP looks healthy".
"""

from __future__ import annotations

import copy
import io
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod

import amp_doctor
from amp_doctor.hooks.replacement import SEARCH_BACKWARDS
from amp_doctor.records import Session
from tests.helpers import console_script

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
          every: int = 1, new_scaler: bool = False
          ) -> tuple[list[float], list[float], Session | None]:
    """A float16 loop with a GradScaler whose model is replaced at step SWAP (with a new
    GradScaler too: a resume from a full checkpoint); returns the losses, a checksum of
    the final parameters, and the session."""
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
                if new_scaler:
                    state = scaler.state_dict()
                    scaler = torch.amp.GradScaler("cpu")
                    scaler.load_state_dict(state)
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


@pytest.mark.parametrize("swap", [_reload, copy.deepcopy])
def test_a_model_replaced_with_its_optimizer_and_scaler_is_followed(
        swap: Callable[[nn.Module], nn.Module]) -> None:
    # A resume from a full checkpoint: model, optimizer and GradScaler all new objects.
    # The new scaler steps parameters nobody watched yet, so no step ended after the swap
    # and the watch counted 6 steps of 12, with no finding (review 57d).
    losses, sums, s = _loop(swap, watched=True, new_scaler=True)
    assert s is not None and s.steps == STEPS
    assert [r.step for r in s.history] == list(range(STEPS))
    with_layers = [r.step for r in s.history if {"0", "2"} <= set(r.layers)]
    assert with_layers == [st for st in range(STEPS) if st != SWAP]
    (note,) = [f for f in s.findings if f.kind == "model_replaced"]
    assert note.step == SWAP and f"in step {SWAP + 1}; step {SWAP} trained it" in note.message
    assert not [f for f in s.findings if f.severity != "info"]
    assert not module_mod._global_forward_pre_hooks
    assert (losses, sums) == _loop(swap, watched=False, new_scaler=True)[:2]


def test_another_architecture_with_a_new_scaler_is_a_warning() -> None:
    # Its new optimizer and scaler step no watched parameter: no step ends after the swap,
    # and the warning says the steps were not counted either.
    losses, sums, s = _loop(_rebuild_wider, watched=True, new_scaler=True)
    assert s is not None
    (f,) = [f for f in s.findings if f.kind == "model_stopped"]
    assert f.severity == "warning" and f.step == SWAP
    text = " ".join(f.message.split())
    assert text.startswith(
        f"The watched model ran no training forward from step {SWAP} on, while backward "
        f"went on ({STEPS - SWAP} backward passes)"), text
    assert f"no step was counted after step {SWAP} either" in text
    assert not module_mod._global_forward_pre_hooks
    assert (losses, sums) == _loop(_rebuild_wider, watched=False, new_scaler=True)[:2]


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
    # Installed at the first backward without the watched model (step 2), for
    # SEARCH_BACKWARDS such passes (one a step here), then gone for good.
    n = SEARCH_BACKWARDS
    assert installed == [False, False] + [True] * n + [False] * (8 - n)
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


# -- TorchScript modules (review 57a) --------------------------------------------------
# A model holding a `torch.jit.script`ed submodule crashed the user's run under the watch
# ("register_forward_pre_hook is not supported on ScriptModules"), at its first forward or
# at the step the script assigned the scripted submodule; under `diagnose` the error
# came out of the user's own `model(x)` line.


class _Gate(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.lin(x))


def _jit_loop(watched: bool, script_at: int | None, whole: bool = False
              ) -> tuple[list[float], list[float], Session | None]:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 16), _Gate(16), nn.Linear(16, 4))
    if script_at == 0:
        model[1] = torch.jit.script(model[1])
    if whole:
        model = torch.jit.script(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    losses: list[float] = []
    w = amp_doctor.watch(model, every=1, tensorboard=False) if watched else None
    try:
        for step in range(6):
            if script_at and step == script_at:
                model[1] = torch.jit.script(model[1])
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
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


def _jit_plain(script_at: int | None, whole: bool = False) -> tuple[list[float], list[float]]:
    """The plain run's numerics. TorchScript's executor keeps process-wide state: a
    process's first run of a scripted class takes other kernels from its third call on
    than every later run (with or without amp-doctor), so the plain run compared with is
    not the process's first."""
    _jit_loop(False, script_at, whole)
    return _jit_loop(False, script_at, whole)[:2]


@pytest.mark.parametrize("script_at", [0, 3])
def test_a_scripted_submodule_runs_unhooked_with_a_note(script_at: int) -> None:
    plain = _jit_plain(script_at)
    losses, sums, s = _jit_loop(True, script_at)
    assert s is not None and s.steps == 6
    (note,) = [f for f in s.findings if f.kind == "scripted_module"]
    assert note.severity == "info" and note.module == "1" and note.step == script_at
    assert note.message.startswith("1 is a TorchScript module (torch.jit.script)")
    names = {lay.name for lay in s.layers}
    assert {"0", "2", "Sequential"} <= names
    if script_at == 0:
        assert not names & {"1", "1.lin"}
    # The layers around it are recorded in every step.
    assert all({"0", "2"} <= set(r.layers) for r in s.history)
    assert not [f for f in s.findings if f.severity != "info"]
    assert (losses, sums) == plain


def test_a_scripted_model_is_a_warning_not_a_crash() -> None:
    plain = _jit_plain(None, whole=True)
    losses, sums, s = _jit_loop(True, None, whole=True)
    assert s is not None and s.steps == 6
    (f,) = [f for f in s.findings if f.severity != "info"]
    assert f.kind == "scripted_module" and f.severity == "warning"
    assert "none of its layers can be recorded" in f.message
    assert "before `torch.jit.script`" in f.advice
    # No guess about a forward nobody saw: not "autocast was not active".
    assert not [x for x in s.findings if x.kind in ("autocast_inactive", "model_not_run")]
    assert (losses, sums) == plain


_JIT_SCRIPT = '''
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
class Gate(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
    def forward(self, x):
        return x * torch.sigmoid(self.lin(x))
model = nn.Sequential(nn.Linear(8, 16), Gate(16), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    if step == 2:
        model[1] = torch.jit.script(model[1])  # speed up the hot block
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    print("step", step, repr(loss.item()))
print("checksum", repr(sum(p.double().sum() for p in model.parameters()).item()))
'''


def test_cli_runs_a_script_that_scripts_a_submodule(tmp_path: Path) -> None:
    (tmp_path / "jit.py").write_text(_JIT_SCRIPT)
    plain = subprocess.run([sys.executable, "jit.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    r = subprocess.run([console_script(), "diagnose", "--no-tensorboard", "--every", "1",
                        "--logdir", str(tmp_path / "out"), "jit.py"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout  # the script's numerics, bit for bit
    text = " ".join(r.stderr.split())
    assert "scripted_module layer 1 step 2" in text
    assert "internal error" not in text and "Traceback" not in text
    report = json.loads((tmp_path / "out" / "amp_doctor.json").read_text())
    assert report["steps"] == 6


def test_backoffs_before_the_origin_on_unrecorded_steps_say_so() -> None:
    # A weight scaled by 1e5 at step 12 overflows its layer's output from then on; at
    # the default every=10 the first recorded step after it is 20. The backoffs of
    # steps 12-19 were not recorded, not "without a forward origin" (review 57a).
    torch.manual_seed(0)
    inp, mid, out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)
    model = nn.Sequential(inp, nn.GELU(), mid, nn.LayerNorm(64), out)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=10, tensorboard=False) as w:
        for step in range(24):
            if step == 12:
                with torch.no_grad():
                    mid.weight.mul_(1e5)
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (b,) = w.session.findings_of("scaler_backoff")
    assert b.steps[0] == 12
    text = " ".join(b.message.split())
    assert ("2's output went non-finite first, in the forward pass, at step 20 (the backoffs "
            "before it, from step 12, were on steps not recorded: `every=1` records every "
            "step)") in text, text


def test_gradient_underflow_from_a_tiny_loss_names_the_loss() -> None:
    # "Averaged over the dataset size" gone wrong: the loss is about 1e-8, and the
    # gradients underflow float16 even with the loss scale. The finding said to raise
    # init_scale and never named the loss (review 57a).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    losses: list[float] = []
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for _ in range(6):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y) * 1e-8
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    found = w.session.findings_of("gradient_underflow")
    assert found
    f = found[0]
    med = sorted(losses)[len(losses) // 2]
    assert 1e-9 < med < 1e-7
    text = " ".join(f.message.split())
    assert f"The loss itself is tiny (median {med:.2e} over the recorded steps)" in text, text
    assert f.advice.startswith("Bring the loss to order 1 first")


@pytest.mark.parametrize("max_norm", [math.inf, 1.0])
def test_a_norm_measured_before_unscale_is_a_note_not_an_error(max_norm: float) -> None:
    # The Hugging Face Trainer with max_grad_norm=0 calls clip_grad_norm_(params, inf) on
    # the scaled gradients only to log grad_norm: nothing is clipped. It was the
    # clip_before_unscale error, whose message said "an unscaled max_norm of inf" and
    # whose fix said the clip "does nothing (or everything)" (review 57f).
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8, generator=g)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(opt)
            scaler.update()
    (f,) = w.session.findings_of("clip_before_unscale")
    if max_norm == math.inf:
        assert f.severity == "info"
        text = " ".join(f.message.split())
        assert text.startswith("clip_grad_norm_ ran with no limit (max_norm=inf) on gradients "
                               "still multiplied by the loss scale (65536)"), text
        assert "it clipped nothing" in text and "unscaled" in text
        assert f.advice.startswith("Nothing to fix in training.")
    else:
        assert f.severity == "error" and "max_norm=1" in f.message


def test_a_new_scaler_that_trained_before_a_late_halving_finished_calibrating() -> None:
    # Each epoch's new GradScaler backs off a few times from init_scale, trains, then
    # halves once more at the epoch's last step (a batch too large for the scale it
    # settled at). It finished calibrating: steps in between trained. It was called
    # "never finished calibrating: none of its optimizer steps trained", an error
    # (review 57f).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    per_epoch = 10
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for _ in range(3):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
            for i in range(per_epoch):
                x = torch.randn(4, 8, generator=g)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = (model(x).float() - x.sum(1, keepdim=True) * 0.3).pow(2).mean()
                if i == per_epoch - 1:
                    loss = loss * 1e4  # one batch the settled scale cannot take
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    s = w.session
    assert s.scaler is not None
    skipped = set(s.scaler.skipped_steps)
    for e in range(3):
        epoch = set(range(e * per_epoch, (e + 1) * per_epoch))
        assert (e + 1) * per_epoch - 1 in skipped  # the late halving
        assert len(epoch - skipped) >= 2  # steps that trained before it
    (f,) = s.findings_of("scaler_recreated")
    assert f.severity == "warning", f.message
    assert "never finished calibrating" not in f.message


def test_a_named_scaler_replaced_each_epoch_is_followed() -> None:
    # watch(scaler=...) (and the Trainer and Lightning callbacks, which name theirs): a
    # new GradScaler each epoch was ignored as "not the watch's", so no step ended after
    # the first epoch's last, and its skips went unseen (review 57f).
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**20) for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, scaler=scalers[0], optimizer=opt, every=1,
                          tensorboard=False) as w:
        for scaler in scalers:
            for _ in range(8):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(16, 8, generator=g)).float().pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    s = w.session
    assert s.steps == 24 and s.scaler is not None
    assert [r.step for r in s.scaler.resets] == [8, 16]
    assert {8, 16} <= set(s.scaler.skipped_steps)  # each new scaler's first step
    (f,) = s.findings_of("scaler_recreated")
    assert f.step == 8
    assert not s.findings_of("scale_collapse")


class _WrappedOptimizer:
    """An optimizer wrapper that is no ``torch.optim.Optimizer`` (as Accelerate's
    ``AcceleratedOptimizer``): GradScaler's skip of it is read from the device later."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.optimizer = opt

    @property
    def param_groups(self) -> list[dict[str, object]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> object:
        return self.optimizer.state

    def step(self, closure: object = None) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def test_a_skip_read_after_the_step_ended_is_in_the_steps_record() -> None:
    # The step records of steps GradScaler skipped said skipped: False where the skip
    # was read after the step ended (the Hugging Face Trainer's optimizer; review 57f),
    # while the scaler's timeline listed them.
    torch.manual_seed(0)
    model = _net()
    opt = _WrappedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for _ in range(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8, generator=g)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)  # type: ignore[arg-type]
            scaler.update()
    s = w.session
    assert s.scaler is not None
    assert 0 < len(s.scaler.skipped_steps) < 8  # a calibration, then steps that trained
    assert [r.step for r in s.history if r.skipped] == s.scaler.skipped_steps


def test_a_swap_inside_an_accumulation_window_adds_no_step() -> None:
    # The model is replaced between the micro-batches of one update (gradient
    # accumulation, 2 backward passes a step). Ending a step when the new object is found
    # (as for a resume with a new optimizer and GradScaler) must wait for an update: here
    # the found forward continued the window, and a boundary there made 13 steps of 12.
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for it in range(24):
            if it == 9:  # the second micro-batch of step 4
                model = copy.deepcopy(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8, generator=g)).float().pow(2).mean()
            scaler.scale(loss / 2).backward()
            if it % 2 == 1:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    s = w.session
    assert s.steps == 12
    assert [f.kind for f in s.findings if f.kind.startswith("model_")] == ["model_replaced"]
    assert all({"0", "2"} <= set(r.layers) for r in s.history if r.step > 5)


def test_backoffs_beside_a_large_loss_name_the_loss() -> None:
    # An output layer whose weights grew large makes a cross-entropy of some hundreds;
    # its gradient overflows float16 in that layer's backward, one op after the model's
    # finite output gradient, and the scale backs off step after step. The finding
    # blamed a layer's backward and advised float32 for it, never the loss's size
    # (review 57g: a loss summed over tokens, about 1e3).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 512))
    with torch.no_grad():
        model[3].weight.mul_(200)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    losses: list[float] = []
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for _ in range(8):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 512, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    s = w.session
    assert s.scaler is not None and len(s.scaler.skipped_steps) >= 3
    assert all(math.isfinite(v) for v in losses)
    med = sorted(abs(v) for v in losses)[len(losses) // 2]
    assert med >= 100
    (f,) = [f for f in s.findings if f.kind in ("scaler_backoff", "scale_collapse")]
    assert f.severity == "warning"
    text = " ".join(f.message.split())
    assert "The loss itself is large (median " in text, text
    assert "a loss summed over tokens or a batch instead of averaged" in text
    assert f.advice.startswith("Average the loss instead of summing it"), f.advice


def test_unrecorded_backoffs_with_no_culprits_are_not_said_to_have_none() -> None:
    from amp_doctor.analysis.detect_scaler import _culprit_text

    # (review 57g: steps 6 and 8 at every=10 were "no watched layer had non-finite
    # gradients"; recorded with --every 1, two layers had them.)
    assert "none of these steps was recorded" in _culprit_text([], None, recorded=False)
    assert "no watched layer had non-finite gradients" in _culprit_text([], None)


def test_a_finished_watch_holds_no_loss_of_another_models_scaler() -> None:
    # The losses a scaler not yet known to be the watch's multiplied are held until its
    # step() says whose it is (a new scaler's first step); another model's scaler never
    # says so, and its last loss stayed referenced by the finished watch.
    import gc
    import weakref

    torch.manual_seed(0)
    model, other = _net(), _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt2 = torch.optim.SGD(other.parameters(), lr=0.05)
    scaler, scaler2 = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    ref: weakref.ref[torch.Tensor] | None = None
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for _ in range(3):
            x = torch.randn(4, 8)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            with torch.autocast("cpu", dtype=torch.float16):
                loss2 = other(x).float().pow(2).mean()
            ref = weakref.ref(loss2)
            opt2.zero_grad()
            scaler2.scale(loss2).backward()
            scaler2.step(opt2)
            scaler2.update()
    del loss2
    gc.collect()
    assert w.session.steps == 3
    assert ref is not None and ref() is None
