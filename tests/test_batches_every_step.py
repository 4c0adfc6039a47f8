"""Every step's batch is checked for NaN/inf (``steps/batches.py``), not only recorded ones.

A NaN sample at an unrecorded step was "the loss was NaN at step 7, where it appeared is
unknown" at the default ``every=10``; without a GradScaler (bfloat16, HF's Trainer) its
update poisoned every weight and the report blamed the first layer of the next recorded
step (review 48c).
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from syncs import SyncCounter
from torch import nn
from torch.nn import functional as F

import amp_doctor
from tests.helpers import console_script


def _loop(doctor_kw: dict | None, dtype: torch.dtype = torch.float16,
          bad_at: tuple[int, ...] = (7,), steps: int = 30, handled: bool = False,
          ) -> tuple[list[float], list[torch.Tensor], amp_doctor.Session | None, int]:
    """A plain AMP loop (GradScaler in float16, none in bfloat16) whose batch holds a NaN
    at ``bad_at``. ``handled``: the model replaces NaN (missing values) by 0 first.
    Returns the losses, the final weights, the session and the syncs counted in the
    loop itself (not in ``close``)."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = body

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(torch.nan_to_num(x) if handled else x)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    doctor = (amp_doctor.watch(model, tensorboard=False, **doctor_kw)
              if doctor_kw is not None else None)
    losses: list[float] = []
    try:
        with SyncCounter() as c:
            for step in range(steps):
                x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
                if step in bad_at:
                    x[3, 5] = math.nan
                opt.zero_grad()
                with torch.autocast("cpu", dtype=dtype):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(loss.detach())  # read after the loop: no sync of the user's
    finally:
        session = doctor.close() if doctor is not None else None
    return ([float(v) for v in losses], [p.detach().clone() for p in model.parameters()],
            session, len(c.calls))


def _same(a: list[float], b: list[float]) -> bool:
    return all((x == y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def test_a_nan_batch_at_an_unrecorded_step_is_named_at_the_default_every() -> None:
    losses, params, s, syncs = _loop({})
    assert s is not None and s.recorded_steps == 3
    # No sync of its own in the steps (the run reads its checks once, at the end); the
    # skipped unrecorded step costs its one, as any does (tests/test_syncs.py).
    assert syncs == s.recorded_steps + 1
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.module, f.step) == ("nonfinite_input", "Net", 7)
    assert f.data["unrecorded_steps"] == 1 and f.data["nan"] is True
    assert ("already held NaN at step 7 (not a recorded step), and the loss or the gradients "
            "went NaN/inf with it") in f.message
    assert "GradScaler backed off 1x" in f.message  # its consequence, in its finding
    (loss,) = s.findings_of("nonfinite_loss")
    assert loss.severity == "info" and "It began at the batch given to Net at step 7" in (
        loss.message)
    plain_losses, plain_params, _, _ = _loop(None)
    assert _same(losses, plain_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))


def test_a_nan_batch_that_poisons_the_weights_without_a_scaler_is_the_one_error() -> None:
    """bfloat16, no GradScaler: the step-7 update takes NaN gradients and every later loss
    is NaN. The batch is the cause; the NaN losses from step 10 on are its consequence."""
    losses, params, s, _ = _loop({}, dtype=torch.bfloat16)
    assert s is not None
    assert math.isnan(losses[-1])
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.step) == ("nonfinite_input", 7)
    assert "made the weights non-finite" in f.message
    (loss,) = s.findings_of("nonfinite_loss")
    assert loss.severity == "info"
    assert "It began at the batch given to Net at step 7 (see that finding)" in loss.message
    assert "Record every step" not in loss.message + loss.advice
    assert "skip an update whose gradient norm is not finite" in loss.advice
    plain_losses, plain_params, _, _ = _loop(None, dtype=torch.bfloat16)
    assert _same(losses, plain_losses)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
               for a, b in zip(params, plain_params, strict=True))


def test_nan_batches_the_model_handles_in_unrecorded_steps_are_info() -> None:
    _, _, s, _ = _loop({}, bad_at=(3, 7, 13, 17), handled=True)
    assert s is not None
    (f,) = s.findings_of("nonfinite_input")
    assert f.severity == "info" and f.step == 3
    assert (f.data["unrecorded_steps"], f.data["unrecorded_harmless"]) == (0, 4)
    assert "held NaN in 4 steps (first at step 3, none of them recorded), but the loss " \
           "stayed finite: the model handles such values" in f.message
    assert not [x for x in s.findings if x.severity != "info"]


def test_a_recorded_bad_batch_says_how_often_unrecorded_ones_were_bad_too() -> None:
    _, _, s, _ = _loop({}, bad_at=(5, 10, 16))
    assert s is not None
    (f,) = s.findings_of("nonfinite_input")
    assert f.severity == "error" and f.step == 5
    assert f.data["detected"] == "recorded step" and f.data["recorded_first"] == 10
    assert f.data["unrecorded_steps"] == 2
    assert "held NaN in 3 steps (first at step 5; recorded step 10 shows it)" in f.message
    assert "GradScaler backed off 3x" in f.message  # the recorded step's backoff too


def test_anomaly_mode_names_the_batch_once() -> None:
    _, _, s, _ = _loop({"anomaly": True})
    assert s is not None
    assert [f.kind for f in s.findings if f.severity == "error"] == ["nonfinite_input"]
    assert len(s.findings_of("nonfinite_input")) == 1


@pytest.mark.parametrize("bad_step", [7, 10])
def test_the_model_given_the_bad_batch_is_named_when_two_models_train(bad_step: int) -> None:
    """A GAN-like step: the generator gets finite noise, the discriminator the real batch,
    which holds a NaN at step 7 (unrecorded) or 10 (recorded: the generator, called first,
    was named; review 49a)."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD([*gen.parameters(), *disc.parameters()], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch({"gen": gen, "disc": disc}, tensorboard=False) as doctor:
        for step in range(20):
            real = torch.randn(16, 8)
            if step == bad_step:
                real[0, 0] = math.nan
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                fake = gen(torch.randn(16, 4))
                loss = (F.softplus(-disc(real)).mean() + F.softplus(disc(fake)).mean()).float()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (f,) = doctor.session.findings_of("nonfinite_input")
    assert (f.severity, f.module, f.step) == ("error", "disc", bad_step)


def test_integer_batches_cost_no_check_and_no_read_at_the_end() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    doctor = amp_doctor.watch(model, tensorboard=False)
    with SyncCounter() as c:
        for _ in range(12):
            ids = torch.randint(0, 50, (4, 8))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        s = doctor.close()
    assert len(c.calls) == s.recorded_steps == 2, [x.site for x in c.calls]
    assert not s.findings_of("nonfinite_input")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_cli_names_a_nan_sample_in_an_unrecorded_step(tmp_path: Path, dtype: str) -> None:
    script = tmp_path / "nan_sample.py"
    script.write_text(
        "import math, torch, torch.nn as nn, torch.nn.functional as F\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
        f"dt = torch.{dtype}\n"
        "scaler = torch.amp.GradScaler('cpu', enabled=dt == torch.float16)\n"
        "data = torch.randn(400, 16); data[77, 3] = math.nan  # one corrupt sample\n"
        "labels = torch.randint(0, 4, (400,))\n"
        "for step in range(25):\n"
        "    idx = torch.arange(step * 16, step * 16 + 16) % 400\n"
        "    opt.zero_grad()\n"
        "    with torch.autocast('cpu', dtype=dt):\n"
        "        loss = F.cross_entropy(model(data[idx]), labels[idx])\n"
        "    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()\n"
        "print('final loss', loss.item())\n")
    r = subprocess.run([console_script(), "diagnose", "--no-tensorboard",
                        "--logdir", str(tmp_path / "runs"), str(script)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ERROR  nonfinite_input  Sequential step 4" in r.stderr  # sample 77: step 4
    assert "already held NaN at step 4 (not a recorded step)" in " ".join(r.stderr.split())
    assert r.stderr.count("ERROR") == 1


def _fp16_loop(model: nn.Module, steps: int, step_fn: Callable[[int], torch.Tensor],
               params: list[nn.Parameter] | None = None) -> amp_doctor.Session:
    opt = torch.optim.SGD(params if params is not None else model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for step in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = step_fn(step)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_what_a_watched_model_made_is_not_data_when_the_loop_passes_it_on() -> None:
    """The loop calls a model's parts itself (``head(backbone(x))``), and a GAN gives the
    discriminator the generator's samples detached: an overflow the backbone or the
    generator made at an unrecorded step was "the batch given to head held NaN: the data
    was non-finite before any layer ran" (review 49a)."""
    torch.manual_seed(0)

    class TwoStage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
            self.head = nn.Linear(16, 3)

    model = TwoStage()

    def two_stage(step: int) -> torch.Tensor:
        feat = model.backbone(torch.randn(8, 8) * (1e5 if step == 7 else 1.0))
        return F.cross_entropy(model.head(feat * (1e3 if step == 7 else 1.0)).float(),
                               torch.zeros(8, dtype=torch.long))

    s = _fp16_loop(model, 20, two_stage)
    assert not s.findings_of("nonfinite_input")

    torch.manual_seed(0)

    class Gen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2, self.gain = nn.Linear(4, 16), nn.Linear(16, 8), 1.0

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.l2(torch.relu(self.l1(z)) * self.gain)

    gen, disc = Gen(), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    pair = nn.ModuleDict({"gen": gen, "disc": disc})

    def gan(step: int) -> torch.Tensor:
        gen.gain = 1e6 if step == 7 else 1.0  # the generator's own overflow
        fake = gen(torch.randn(8, 4))
        real = torch.randn(8, 8)
        return (F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
                + F.softplus(-disc(fake)).mean()).float()

    s = _fp16_loop(pair, 20, gan)
    assert not s.findings_of("nonfinite_input")


def test_a_recurrent_state_carried_over_detached_is_not_data() -> None:
    """Truncated BPTT: ``h = h.detach()`` goes into the next step's forward. A NaN the
    model made in it is the model's, not the batch's."""
    torch.manual_seed(0)

    class Cell(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.rec, self.out = nn.Linear(4, 16), nn.Linear(16, 16), nn.Linear(16, 2)
            self.gain = 1.0

        def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.tanh(self.inp(x) + self.rec(h)) * self.gain
            return self.out(h), h

    model = Cell()
    h = torch.zeros(8, 16)

    def tbptt(step: int) -> torch.Tensor:
        nonlocal h
        model.gain = math.inf if step == 7 else 1.0
        out, h_new = model(torch.randn(8, 4), h)
        h = h_new.detach().nan_to_num() if step > 8 else h_new.detach()
        return F.cross_entropy(out.float(), torch.zeros(8, dtype=torch.long))

    s = _fp16_loop(model, 20, tbptt)
    assert not s.findings_of("nonfinite_input")


def test_the_input_the_model_does_not_clean_is_the_culprit_beside_one_it_does() -> None:
    """``feat`` holds NaN in every step (missing values, replaced by the model); ``aux``
    holds one at step 7, which the model does not clean: an error at step 7 about the
    second input, not "the model handles such values" (review 49a)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(16, 32), nn.Linear(4, 32), nn.Linear(32, 4)

        def forward(self, feat: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.a(torch.nan_to_num(feat)) + self.b(aux)))

    model = Net()

    def step_fn(step: int) -> torch.Tensor:
        feat, aux = torch.randn(8, 16), torch.randn(8, 4)
        feat[torch.rand(8, 16) < 0.1] = math.nan
        if step == 7:
            aux[1, 2] = math.nan
        return F.cross_entropy(model(feat, aux).float(), torch.randint(0, 4, (8,)))

    s = _fp16_loop(model, 30, step_fn)
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.step) == ("nonfinite_input", 7)
    assert (f.data["input"], f.data["inputs"]) == ("positional argument 2", 2)
    assert "(in its positional argument 2, one of 2 floating inputs) at step 7" in f.message


def test_a_nan_sample_the_loss_leaves_out_still_skips_the_step_and_is_the_cause() -> None:
    """The loop drops bad rows from the loss (``ce[valid].mean()``), so the loss stays
    finite, but the backward multiplies the NaN input by a zero gradient: the GradScaler
    skips the step. The batch is the cause, not a model that handles NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def step_fn(step: int) -> torch.Tensor:
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        if step == 7:
            x[3, 5] = math.nan
        valid = x.isfinite().all(1)
        ce = F.cross_entropy(model(x).float(), y, reduction="none")
        return ce[valid].mean()

    s = _fp16_loop(model, 20, step_fn)
    (f,) = s.findings_of("nonfinite_input")
    assert (f.severity, f.step) == ("error", 7)


def test_without_a_scaler_a_nan_sample_the_loss_leaves_out_poisons_the_weights() -> None:
    """bfloat16, no GradScaler: the loss leaves the NaN row out and stays finite at step 7,
    but its gradients are NaN (0 * NaN) and the update writes them into the weights: every
    loss after it is NaN. It was "info: the model handles such values" beside a NaN loss
    whose origin was unknown (review 49a)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for step in range(20):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            if step == 7:
                x[3, 5] = math.nan
            valid = x.isfinite().all(1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ce = F.cross_entropy(model(x).float(), y, reduction="none")
            loss = ce[valid].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.step) == ("nonfinite_input", 7)
    assert "The loss stayed finite in that step, but from the steps after it on" in f.message
    (loss_f,) = s.findings_of("nonfinite_loss")
    assert loss_f.severity == "info"


def test_a_batch_in_memory_a_freed_output_held_is_still_data() -> None:
    """A denoiser's output has its batch's shape and is freed after backward: the next
    batch often lands at its address. Matching addresses took such batches for the
    model's own output and skipped them, a different count on every run (review 49b)."""
    torch.manual_seed(0)

    class Denoiser(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.out = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.enc(x)).float())

    model = Denoiser()

    def step_fn(step: int) -> torch.Tensor:
        x = torch.randn(32, 64)
        if step in (7, 13, 23, 37):
            x[5, 5] = math.nan
        return F.mse_loss(model(x), torch.zeros(32, 64))

    s = _fp16_loop(model, 40, step_fn)
    (f,) = s.findings_of("nonfinite_input")
    assert (f.severity, f.step, f.data["unrecorded_steps"]) == ("error", 7, 4)


def test_of_two_inputs_bad_in_one_step_the_one_bad_more_often_is_named() -> None:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(16, 32), nn.Linear(4, 32), nn.Linear(32, 4)

        def forward(self, feat: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.a(torch.nan_to_num(feat)) + self.b(aux)))

    model = Net()

    def step_fn(step: int) -> torch.Tensor:
        feat, aux = torch.randn(8, 16), torch.randn(8, 4)
        if step == 7:
            feat[2, 3] = math.nan  # handled, in the same step as aux's
        if step in (7, 27):
            aux[1, 2] = math.nan
        return F.cross_entropy(model(feat, aux).float(), torch.randint(0, 4, (8,)))

    s = _fp16_loop(model, 30, step_fn)
    (f,) = s.findings_of("nonfinite_input")
    assert (f.severity, f.step, f.data["input"], f.data["unrecorded_steps"]) == (
        "error", 7, "positional argument 2", 2)


def test_an_input_the_model_clamps_is_no_error_for_a_calibration_skip_in_a_recorded_step(
        ) -> None:
    """Log-features with -inf in every step, clamped by the model: recorded step 0 fell
    on the GradScaler's start-up skip, which made the batch an ERROR; and a layer's
    overflow at step 13 was then "it began at the batch" (review 49b)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.big, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
            self.gain = 1.0

        def forward(self, feat: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.a(feat.clamp_min(-20.0)))
            return self.head(torch.relu(self.big(h * self.gain)))

    model = Net()

    def step_fn(step: int) -> torch.Tensor:
        p = torch.rand(8, 16)
        p[0, 0] = 0.0
        model.gain = 1e6 if step == 13 else 1.0
        return F.cross_entropy(model(p.log() + 1.0).float(), torch.randint(0, 4, (8,)))

    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")  # 65536: it skips the first steps while calibrating
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for step in range(30):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = step_fn(step)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    (f,) = s.findings_of("nonfinite_input")
    assert f.severity == "info"
    (loss_f,) = s.findings_of("nonfinite_loss")
    assert loss_f.severity == "error" and loss_f.step == 13


class _Backbone(nn.Module):
    """A frozen feature extractor whose hidden values overflow float16 at ``gain`` 1e6."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.l2 = nn.Linear(32, 32)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)) * self.gain)


def _frozen_backbone_run(doctor_kw: dict | None, teacher: bool = False, overflow_at: int = -1,
                         nan_x_at: int = -1) -> tuple[list[float], amp_doctor.Session | None]:
    """Linear probing (review 49b): a frozen backbone called under no_grad, its features
    pooled and normalised (a new tensor: no grad_fn, storage of its own) and given to a
    trained head; or (``teacher``) a teacher's softened output given to a student beside
    the batch. Its hidden layer overflows float16 at ``overflow_at`` (the batch finite);
    the batch itself holds a NaN at ``nan_x_at``."""
    torch.manual_seed(0)
    backbone = _Backbone().requires_grad_(False)
    head = nn.Linear(48 if teacher else 32, 4)
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    doctor = (amp_doctor.watch({"backbone": backbone, "head": head}, tensorboard=False,
                               **doctor_kw) if doctor_kw is not None else None)
    losses: list[float] = []
    try:
        for step in range(30):
            x, y = torch.randn(8, 5, 16), torch.randint(0, 4, (8,))
            if step == nan_x_at:
                x[2, 1, 3] = math.nan
            backbone.gain = 1e6 if step == overflow_at else 1.0
            with torch.autocast("cpu", dtype=torch.float16):
                with torch.no_grad():
                    f = backbone(x).float().mean(1)
                    post = F.softmax(f / 2.0, 1) if teacher else F.normalize(f, dim=1)
                logits = head(torch.cat([x.mean(1), post], 1) if teacher else post)
                loss = F.cross_entropy(logits.float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    finally:
        session = doctor.close() if doctor is not None else None
    return losses, session


@pytest.mark.parametrize("teacher", [False, True])
def test_a_frozen_backbones_overflow_at_an_unrecorded_step_is_not_the_batch(teacher: bool
                                                                            ) -> None:
    plain, _ = _frozen_backbone_run(None, teacher, overflow_at=7)
    losses, s = _frozen_backbone_run({}, teacher, overflow_at=7)
    assert _same(losses, plain) and math.isnan(losses[7])
    assert s is not None and s.recorded_steps == 3
    assert not s.findings_of("nonfinite_input")  # the batch was finite
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.step) == ("nonfinite_loss", 7)
    assert "It began in backbone's output at step 7 (not a recorded step)" in f.message
    assert "where it appeared is unknown" not in f.message


def test_a_frozen_backbones_overflow_on_a_recorded_step_names_its_layer() -> None:
    plain, _ = _frozen_backbone_run(None, overflow_at=7)
    losses, s = _frozen_backbone_run({"every": 1}, overflow_at=7)
    assert _same(losses, plain)
    assert s is not None
    assert not s.findings_of("nonfinite_input")
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.module, f.step) == ("nonfinite_loss", "backbone.l2", 7)


def test_anomaly_mode_does_not_take_a_frozen_backbones_overflow_for_the_batch() -> None:
    plain, _ = _frozen_backbone_run(None, overflow_at=7)
    losses, s = _frozen_backbone_run({"anomaly": True}, overflow_at=7)
    assert _same(losses, plain)
    assert s is not None
    assert not s.findings_of("nonfinite_input")
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.step) == ("nonfinite_loss", 7)
    assert "backbone's output at step 7" in f.message


@pytest.mark.parametrize("every", [10, 1])
def test_a_nan_batch_given_to_a_frozen_backbone_is_still_the_data(every: int) -> None:
    """Its output goes NaN too, after its batch did: the batch is the cause."""
    plain, _ = _frozen_backbone_run(None, nan_x_at=7)
    losses, s = _frozen_backbone_run({"every": every}, nan_x_at=7)
    assert _same(losses, plain) and math.isnan(losses[7])
    assert s is not None
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.module, f.step) == ("nonfinite_input", "backbone", 7)
    assert "backbone's output" not in " ".join(x.message for x in s.findings)


def test_an_optional_keyword_input_that_comes_and_goes_keeps_its_own_key() -> None:
    """A multimodal collator (review 49b): ``tabular`` holds missing values as NaN in every
    step (the model replaces them); odd steps also carry ``image``, first in the dict. At
    step 7 an image is corrupt. By position, the image sat where ``tabular`` sits in even
    steps, and its NaN was taken for a handled one (info, and an unknown NaN loss)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.img, self.tab, self.head = nn.Linear(12, 16), nn.Linear(6, 16), nn.Linear(16, 4)

        def forward(self, image: torch.Tensor | None = None,
                    tabular: torch.Tensor | None = None) -> torch.Tensor:
            assert tabular is not None
            h = self.tab(torch.nan_to_num(tabular))
            if image is not None:
                h = h + self.img(image)
            return self.head(torch.relu(h))

    model = Net()

    def step_fn(step: int) -> torch.Tensor:
        batch = {"tabular": torch.randn(8, 6)}
        batch["tabular"][torch.rand(8, 6) < 0.2] = math.nan
        if step % 2:
            image = torch.randn(8, 12)
            if step == 7:
                image[0, 3] = math.nan
            batch = {"image": image, **batch}
        return F.cross_entropy(model(**batch).float(), torch.randint(0, 4, (8,)))

    s = _fp16_loop(model, 30, step_fn)
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.step) == ("nonfinite_input", 7)
    assert (f.data["input"], f.data["inputs"]) == ("argument `image`", 2)
    assert "(in its argument `image`, one of 2 floating inputs) at step 7" in f.message
    assert "where it appeared is unknown" not in " ".join(x.message for x in s.findings)
