"""Issue 13 item 4: step boundaries come from what the loop does, and a run in which
nothing was judged is never called healthy."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp_doctor
from tests.helpers import MLP, train_gan_two_scalers

HEALTHY = "looks healthy"


def _batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _scaled_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 g: torch.Generator) -> None:
    x, y = _batch(g)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_hand_written_update_without_optimizer_counts_every_step() -> None:
    """pytorch/examples word_language_model style: zero_grad, backward, p.data.add_."""
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=5, tensorboard=False) as doctor:
        for _ in range(12):
            model.zero_grad()
            x, y = _batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.01)
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (12, 3)
    f = s.findings_of("steps_from_backward")[0]
    assert f.severity == "info" and "12 step(s)" in f.message
    assert [r.step for r in s.history] == [0, 5, 10]
    assert "12 steps (3 recorded, every 5)" in doctor.report()


def test_hand_written_update_in_no_grad_with_accumulation() -> None:
    """``p.add_`` under no_grad after two backward passes: one step per update."""
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(5):
            for _ in range(2):
                x, y = _batch(g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(x).float(), y) / 2
                loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.01)
                    p.grad = None
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (5, 5)
    # Both micro-steps of a step are in its record: fc1 was called twice per step.
    assert s.layer("fc1").calls == 10


def test_forward_only_loop_says_no_step_ended_and_is_not_healthy() -> None:
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        x, y = _batch(g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        # backward, then nothing that ends a step, and the run ends
        for p in model.parameters():
            p.requires_grad_(True)
        loss.backward()
    s = doctor.session
    assert s.steps == 1  # the backward reached the weights: one (final) step
    assert HEALTHY not in doctor.report()


def test_run_that_died_in_its_first_forward_is_not_healthy() -> None:
    torch.manual_seed(0)
    model = MLP()
    doctor = amp_doctor.watch(model, every=1, tensorboard=False)
    try:
        with doctor:
            with torch.autocast("cpu", dtype=torch.float16):
                model(torch.randn(8, 15))  # wrong width: fc1 raises
    except RuntimeError:
        pass
    s = doctor.session
    assert s.steps == 0 and s.run.outcome == "exception"
    f = s.findings_of("run_ended_early")[0]
    assert f.severity == "error" and "before its first training step finished" in f.message
    assert HEALTHY not in doctor.report()


def test_eval_pass_after_the_last_step_is_not_a_step() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            _scaled_step(model, opt, scaler, g)
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            model(_batch(g)[0])
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (4, 4)
    assert [r.step for r in s.history] == [0, 1, 2, 3]


def test_doctor_step_with_a_scaler_counts_each_step_once() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(6):
            _scaled_step(model, opt, scaler, g)
            doctor.step()
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (6, 6)
    assert [r.step for r in s.history] == list(range(6))


@pytest.mark.parametrize("container", ["list", "ModuleDict", "ModuleList"])
def test_two_models_with_two_gradscalers(container: str) -> None:
    # Each iteration trains a, then b, each with its own optimizer and scaler: one step
    # holds both, from the first iteration on (b's first forward comes after a's update).
    # A ModuleDict or ModuleList has no forward: the models inside it are the roots.
    torch.manual_seed(0)
    a, b = MLP(), MLP()
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (a, b))
    sa, sb = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    given: Any = {"list": [a, b], "ModuleDict": nn.ModuleDict({"a": a, "b": b}),
                  "ModuleList": nn.ModuleList([a, b])}[container]
    with amp_doctor.watch(given, every=1, tensorboard=False) as doctor:
        for _ in range(5):
            _scaled_step(a, oa, sa, g)
            _scaled_step(b, ob, sb, g)
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (5, 5)
    names = {"list": ["MLP0", "MLP1"], "ModuleDict": ["a", "b"],
             "ModuleList": ["0", "1"]}[container]
    assert s.run.models == names
    fc1 = [f"{n}.fc1" for n in names]
    assert [sorted(n for n in r.layers if n in fc1) for r in s.history] == [fc1] * 5
    assert [(s.layer(n).calls, s.layer(n).recorded_steps) for n in fc1] == [(5, 5)] * 2


def _gan_iteration(order: str, gen: nn.Module, disc: nn.Module,
                   opts: dict[str, torch.optim.Optimizer],
                   scalers: dict[str, torch.amp.GradScaler], g: torch.Generator,
                   doctor: Any, seen: list[str]) -> None:
    """One GAN iteration: each letter of ``order`` is a discriminator ("d") or generator
    ("g") update, and both run the generator forward. An update with a scaler is float16,
    through its model's scaler; one without is bfloat16."""
    for who in order:
        dtype = torch.float16 if who in scalers else torch.bfloat16
        z, real = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opts[who].zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            fake = gen(z)
            if who == "d":
                loss = disc(real).float().mean() - disc(fake.detach()).float().mean()
            else:
                loss = disc(fake).float().mean()
        if who in scalers:
            scalers[who].scale(loss).backward()
            scalers[who].step(opts[who])
            scalers[who].update()
        else:
            loss.backward()
            opts[who].step()
        seen.append(f"{who}{doctor.step_index}")


@pytest.mark.parametrize("scalers", ["none", "two", "shared", "d_only"])
@pytest.mark.parametrize("order", ["dg", "gd", "ddg"])
def test_a_gan_is_one_step_per_iteration(order: str, scalers: str) -> None:
    # Before: the first update ended every step (its optimizer's step, or its scaler's
    # update), so each step held one iteration's generator update and the next one's
    # discriminator update; and close added a partial step. d_only (a float16
    # discriminator with a GradScaler, a bfloat16 generator without): a plain step after
    # the scaler's update never ended a step ("no training step was seen to end").
    torch.manual_seed(0)
    gen, disc = MLP(16, 32, 4), MLP(4, 32, 1)
    opts = {"g": torch.optim.Adam(gen.parameters(), 1e-3),
            "d": torch.optim.Adam(disc.parameters(), 1e-3)}
    one = torch.amp.GradScaler("cpu")
    sc = {"none": {}, "shared": {"g": one, "d": one}, "d_only": {"d": one},
          "two": {"g": torch.amp.GradScaler("cpu"), "d": torch.amp.GradScaler("cpu")}}[scalers]
    g = torch.Generator().manual_seed(0)
    seen: list[str] = []
    with amp_doctor.watch({"gen": gen, "disc": disc}, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            _gan_iteration(order, gen, disc, opts, sc, g, doctor, seen)
    # The step index after each update: the iteration's last update ends the step.
    assert seen == [f"{w}{k + (i == len(order) - 1)}"
                    for k in range(4) for i, w in enumerate(order)]
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (4, 4)
    assert [r.step for r in s.history] == [0, 1, 2, 3]
    per_step = len(order)  # the generator runs once per update
    assert s.layer("gen.fc1").calls == 4 * per_step
    assert s.layer("disc.fc1").calls == 4 * (per_step + order.count("d"))
    assert all({"gen.fc1", "disc.fc1"} <= set(r.layers) for r in s.history)


@pytest.mark.parametrize("scalers", ["none", "two"])
@pytest.mark.parametrize("order", ["dg", "gd", "ddg"])
def test_a_gan_in_one_module_is_one_step_per_iteration(order: str, scalers: str) -> None:
    # The generator and the discriminator as two halves of one watched module (as in a
    # LightningModule), each with its own optimizer. Before: the first update ended each
    # step, so the other half's backward fell into the next step (no gradient figures for
    # it) and an extra step appeared.
    torch.manual_seed(0)
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gen, self.disc = MLP(16, 32, 4), MLP(4, 32, 1)

    both = Pair()
    gen, disc = both.gen, both.disc
    opts = {"g": torch.optim.Adam(gen.parameters(), 1e-3),
            "d": torch.optim.Adam(disc.parameters(), 1e-3)}
    sc = {"none": {}, "two": {"g": torch.amp.GradScaler("cpu"),
                              "d": torch.amp.GradScaler("cpu")}}[scalers]
    g = torch.Generator().manual_seed(0)
    seen: list[str] = []
    with amp_doctor.watch(both, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            _gan_iteration(order, gen, disc, opts, sc, g, doctor, seen)
    assert seen == [f"{w}{k + (i == len(order) - 1)}"
                    for k in range(4) for i, w in enumerate(order)]
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (4, 4)
    assert all(r.layers["gen.fc1"].grad is not None for r in s.history)


@pytest.mark.parametrize("order", ["dg", "gd"])
def test_a_float16_and_a_bfloat16_model_are_each_judged_in_their_own_format(
        order: str) -> None:
    # A bfloat16 generator without a scaler beside a float16 discriminator with one; the
    # last layer of each puts its outputs near 1e-6, in float16's subnormal range. Before:
    # every layer was judged against the one run format: in a run taken for bfloat16 the
    # discriminator's underflow was missed and "a GradScaler with bfloat16" was said; in
    # one taken for float16 the bfloat16 generator got float16 underflow warnings.
    torch.manual_seed(0)
    gen, disc = MLP(16, 32, 4), MLP(4, 32, 1)
    with torch.no_grad():
        for m in (gen, disc):
            m.fc2.weight.mul_(1e-5)
            m.fc2.bias.zero_()
    og, od = torch.optim.Adam(gen.parameters(), 1e-3), torch.optim.Adam(disc.parameters(), 1e-3)
    sd = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch({"gen": gen, "disc": disc}, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            z, real = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            for who in order:
                if who == "d":
                    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                        fake = gen(z)
                    with torch.autocast("cpu", dtype=torch.float16):
                        ld = disc(real).float().mean() - disc(fake.float()).float().mean()
                    od.zero_grad()
                    sd.scale(ld).backward()
                    sd.step(od)
                    sd.update()
                else:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        lg = disc(gen(z).float()).float().mean()
                    og.zero_grad()
                    lg.backward()
                    og.step()
    s = doctor.session
    assert s.steps == 4
    assert s.layer("gen.fc2").output_dtypes == ["bfloat16"]
    assert "float16" in s.layer("disc.fc2").output_dtypes
    under = [f for f in s.findings if f.kind == "activation_underflow"]
    # disc's output is disc.fc2's tensor: the finding is disc.fc2's alone (3b2cf0c).
    assert s.layer("disc").passthrough
    assert [f.module for f in under] == ["disc.fc2"]
    assert all(f.data["dtype"] == "float16" for f in under)
    assert s.layer("disc.fc2").underflow_frac > 0.3
    assert s.layer("gen.fc2").underflow_frac == 0.0  # bfloat16 holds 1e-6
    assert not [f for f in s.findings if f.module and f.module.startswith("gen")
                and f.severity != "info"]
    assert not s.findings_of("scaler_with_bf16")
    assert not s.findings_of("no_step_boundary")


def test_a_second_model_that_no_optimizer_holds_is_not_waited_for() -> None:
    # An EMA copy watched beside the model: its parameters require grad, but no
    # optimizer steps them, so the model's optimizer ends every step.
    torch.manual_seed(0)
    model = MLP()
    ema = MLP()
    ema.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    after: list[int] = []
    with amp_doctor.watch({"model": model, "ema": ema}, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            x, y = _batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
                ema(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            after.append(doctor.step_index)
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
                    pe.lerp_(pm, 0.1)
    assert after == [1, 2, 3]
    assert (doctor.session.steps, doctor.session.recorded_steps) == (3, 3)


@pytest.mark.parametrize("updates", ["together", "each"])
def test_a_second_gradscaler_is_followed_too(updates: str) -> None:
    # A GAN with a GradScaler per network. At iteration 6 the generator's scaled loss
    # overflows float16: its scaler skips opt_g and halves its scale. Before, only the
    # first scaler seen (the discriminator's) was followed: "0 backoffs; 0 skipped" and
    # no finding. "together": both update()s after both steps (the primary's ends the
    # step first); "each": each update() right after its own step.
    torch.manual_seed(0)
    gen, disc = MLP(16, 32, 4), MLP(4, 32, 1)
    with amp_doctor.watch({"gen": gen, "disc": disc}, every=5, tensorboard=False) as doctor:
        scales = train_gan_two_scalers(gen, disc, iters=10, boost_at=6, updates=updates)
    # Plain torch's word: the discriminator's scaler settles once at iteration 0, the
    # generator's backs off at iteration 6 only.
    assert scales == (32768.0, 32768.0)
    s = doctor.session
    assert s.steps == 10
    assert s.scaler is not None and s.scaler.backoff_steps == [0]
    [other] = s.other_scalers
    assert {s.scaler.name, other.name} == {"Adam#0", "Adam#1"}
    # Each says whose parameters its optimizers step, read while they stepped (the
    # optimizers are gone by the end of a script run under diagnose).
    assert (s.scaler.stepping, other.stepping) == ("disc", "gen")
    assert other.label == f"{other.name} (params of gen)"
    assert (other.backoff_steps, other.skipped_steps) == ([6], [6])
    assert other.skipped_by_optimizer == {other.name: [6]}
    assert other.scale[-1][1] == 32768.0
    [f] = [f for f in s.findings_of("scaler_backoff") if f.data.get("scaler") == other.name]
    assert f.step == 6 and f.message.startswith(f"The GradScaler of {other.label} backed off 1x")
    assert f.data["culprits"]  # step 6's inf gradients
    [first] = [f for f in s.findings_of("scaler_backoff") if f.data["scaler"] != other.name]
    assert first.message.startswith(f"The GradScaler of {s.scaler.label} backed off 1x")
    text = doctor.report()
    # Each scaler's finding is shown: the report groups findings by scaler too.
    assert f.message.split(":")[0] in " ".join(text.split())
    assert first.message.split(":")[0] in " ".join(text.split())
    flat = " ".join(text.split())
    assert f"Scaler of {s.scaler.label}: scale 65536 -> 32768; 1 backoff (step 0)" in flat
    assert f"Scaler of {other.label}: scale 65536 -> 32768; 1 backoff (step 6)" in flat
    # The JSON report keeps it, and reads back.
    assert amp_doctor.Session.from_json(s.to_json()).other_scalers == s.other_scalers


def test_the_amp_docs_two_model_example_names_only_layers_of_the_report() -> None:
    # PyTorch's AMP docs, "multiple models, losses and optimizers", found by discovery
    # (as under diagnose). model1's first call renamed model0's layers ("0" -> "model0.0")
    # in the middle of step 0, but the gradient hooks of that step kept the old names:
    # step 0's culprits named "2", "1", "0" and "Sequential", layers of no report. And a
    # step where both optimizers skipped said "1 optimizer step(s) were skipped" (review 35).
    from amp_doctor.watch import Watch

    torch.manual_seed(0)
    w = Watch(None, every=1, discover=True, tensorboard=False).start()
    try:
        model0 = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
        model1 = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
        opt0 = torch.optim.SGD(model0.parameters(), lr=0.01)
        opt1 = torch.optim.SGD(model1.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        wr = torch.randn(16)
        for it in range(25):
            x = torch.randn(32, 16)
            t = (x @ wr).unsqueeze(-1)
            t1 = t.clone()
            if it == 20:
                t1[0] = math.inf
            opt0.zero_grad()
            opt1.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out0, out1 = model0(x), model1(x)
                loss0 = nn.functional.mse_loss(2 * out0 + 3 * out1, t)
                loss1 = nn.functional.mse_loss(3 * out0 - 5 * out1, t1)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            scaler.unscale_(opt0)
            nn.utils.clip_grad_norm_(model0.parameters(), 1.0)
            scaler.step(opt0)
            scaler.step(opt1)
            scaler.update()
    finally:
        s = w.close()
    names = {lay.name for lay in s.layers}
    assert s.scaler is not None and 0 in s.scaler.backoff_steps and 20 in s.scaler.backoff_steps
    for e in s.scaler.events:
        assert set(e.culprits) <= names, (e.step, e.culprits)
    assert {"model0.0", "model1.2"} <= set(s.scaler.events[0].culprits)
    (f,) = [f for f in s.findings_of("scaler_backoff") if f.step == 20]
    assert "2 optimizer step(s) were skipped (skipped per optimizer: SGD#0 1, SGD#1 1)" \
        in f.message


def test_a_gan_found_mid_step_names_only_layers_of_the_report() -> None:
    # Discovery finds G at its first call (layers "0".."4"), then D in the same step,
    # which renames G's layers "G.0".."G.4". The gradient hooks of G's pre-ReLU outputs
    # outlive those tensors' Python objects (ReLU keeps its own output), and kept the old
    # names: step 0's backoffs named "2" and "0", layers of no report (review 36).
    from amp_doctor.watch import Watch

    torch.manual_seed(0)
    w = Watch(None, every=1, discover=True, tensorboard=False).start()
    try:
        G = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 2))
        D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
        og, od = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
        sg = torch.amp.GradScaler("cpu", init_scale=2.0**30)
        sd = torch.amp.GradScaler("cpu")
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                fake = G(torch.randn(128, 8))
                d_loss = (nn.functional.softplus(-D(torch.randn(128, 2))).mean()
                          + nn.functional.softplus(D(fake.detach())).mean())
            od.zero_grad()
            sd.scale(d_loss).backward()
            sd.step(od)
            sd.update()
            with torch.autocast("cpu", dtype=torch.float16):
                g_loss = nn.functional.softplus(-D(fake)).mean()
            og.zero_grad()
            sg.scale(g_loss).backward()
            sg.step(og)
            sg.update()
    finally:
        s = w.close()
    names = {lay.name for lay in s.layers}
    events = [e for sc in (s.scaler, *s.other_scalers) if sc for e in sc.events]
    assert any(e.step == 0 and "G.0" in e.culprits for e in events)
    for e in events:
        assert set(e.culprits) <= names, (e.step, e.culprits)


@pytest.mark.parametrize("scaled", [True, False])
def test_an_optimizer_that_starts_late_costs_no_steps(scaled: bool) -> None:
    # Gradual unfreezing: the head's optimizer steps from the first iteration, the
    # body's from iteration 30. The first step waited for the body's optimizer for
    # FIRST_CYCLE_MAX_STEPS (16) updates and then ended, as one step: before, every
    # later step number was 15 lower than the loop's (a backoff at iteration 20 was
    # "step 5", and 40 iterations were 25 steps).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    body = torch.optim.SGD(model[0].parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    g = torch.Generator().manual_seed(0)
    after: list[int] = []
    with amp_doctor.watch(model, every=10, tensorboard=False) as doctor:
        for it in range(40):
            x, y = _batch(g)
            if it == 20:
                x = x * 1e5  # float16 overflows: the scaler backs off at iteration 20
            with torch.autocast("cpu", dtype=torch.float16 if scaled else torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            head.zero_grad()
            body.zero_grad()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(head)
                if it >= 30:
                    scaler.step(body)
                scaler.update()
            else:
                loss.backward()
                head.step()
                if it >= 30:
                    body.step()
            after.append(doctor.step_index)
    # Iterations 0-15 are the first step; from then on a step is an iteration.
    assert after == [0] * 15 + list(range(16, 41))
    s = doctor.session
    assert s.steps == 40
    assert [r.step for r in s.history] == [0, 20, 30]
    if scaled:
        assert s.scaler is not None and s.scaler.backoff_steps == [20]
        assert [f.step for f in s.findings_of("scaler_backoff")] == [20]


def test_a_new_gradscaler_for_the_same_optimizer_takes_over() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first, second = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu", init_scale=256.0)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1000, tensorboard=False) as doctor:
        for i in range(6):
            _scaled_step(model, opt, first if i < 3 else second, g)
    s = doctor.session
    assert s.steps == 6
    # The timeline holds the changes: the second scaler's scale from step 3 on.
    assert s.scaler is not None and s.scaler.scale == [(0, 65536.0), (3, 256.0)]


def test_assign_true_load_and_a_new_optimizer() -> None:
    torch.manual_seed(0)
    model = MLP()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        model.load_state_dict(state, assign=True)  # new Parameter objects
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(4):
            _scaled_step(model, opt, scaler, g)
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (4, 4)
    assert s.amp.scaler
    assert s.layer("fc1").param_grad_absmax is not None


def test_non_reentrant_checkpointing_counts_steps_once() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=2, tensorboard=False) as doctor:
        for _ in range(6):
            x, y = _batch(g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = checkpoint(model, x, use_reentrant=False)
                loss = nn.functional.cross_entropy(out.float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (6, 3)
    assert s.scaler is not None and s.scaler.backoff_steps == []
    # The recompute in backward is not a second call: one forward per recorded step.
    assert s.layer("fc1").calls == 3


def test_no_visible_step_boundary_is_said_with_the_fix() -> None:
    """Training forwards but no backward, optimizer, scaler or doctor.step()."""
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                model(_batch(g)[0])
    s = doctor.session
    assert (s.steps, s.recorded_steps) == (0, 1)
    f = s.findings_of("no_step_boundary")[0]
    assert f.severity == "warning" and "doctor.step()" in f.advice
    assert HEALTHY not in doctor.report()


class _ComplexFilter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.fft.fft(self.lin(x).float()) * self.w).abs()


def test_a_run_that_dies_in_its_first_step_is_not_told_to_call_doctor_step() -> None:
    # GradScaler cannot unscale a complex parameter's gradient: torch raises in the
    # first scaler.step(). No step ended because the run did; the report said so, and
    # also warned that no boundary was seen and advised doctor.step() (review 37).
    model = _ComplexFilter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(NotImplementedError, match="ComplexFloat"):
        with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(2, 4)).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
    s = doctor.session
    assert s.run.outcome == "exception"
    assert [(f.kind, f.severity) for f in s.findings] == [("run_ended_early", "error")]
    assert "doctor.step()" not in doctor.report()


def test_the_loss_flag_is_exact_for_every_loss_shape_and_value() -> None:
    # A 0-d flag (the skip check stacks it with the layers'), set by NaN, inf and
    # -inf in any low-precision format, and OR-ed over the step's backward passes.
    from amp_doctor.steps.loop import LoopSignals

    values = [1.5, -0.0, 65504.0, math.nan, math.inf, -math.inf]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape in ((), (1,), (1, 1)):
            for v in values:
                sig = LoopSignals()
                w = torch.ones((), requires_grad=True)
                loss = (w * torch.tensor(v)).to(dtype).reshape(shape)
                sig.note_loss([loss])
                flag = sig.loss_flag()
                assert flag is not None and flag.shape == ()
                assert bool(flag) is (not math.isfinite(v)), (dtype, shape, v)
    sig = LoopSignals()
    w = torch.ones((), requires_grad=True)
    sig.note_loss([w * 2.0, w * math.inf])  # one backward of two roots
    assert bool(sig.loss_flag()) is True
    sig.note_loss([w * 3.0])  # a later backward of the same step does not clear it
    flag = sig.loss_flag()
    assert flag is not None and flag.shape == () and bool(flag) is True
    assert LoopSignals().loss_flag() is None


def test_an_optimizer_of_a_parameter_dict_is_named_and_can_be_given() -> None:
    # torch.func.functional_call with a parameter dict: the optimizer steps tensors that
    # are not the model's parameters. Before: "no optimizer.step(), no scaler.update()".
    from torch.func import functional_call

    torch.manual_seed(0)
    model = MLP()
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    opt = torch.optim.SGD(params.values(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)

    def train(doctor: Any) -> None:
        for _ in range(3):
            x, y = _batch(g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(functional_call(model, params, (x,)), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    with amp_doctor.watch(model, tensorboard=False) as doctor:
        train(doctor)
    f = doctor.session.findings_of("no_step_boundary")[0]
    assert "SGD#0 stepped, but none of the watched model's parameters" in f.message
    assert "watch(model, optimizer=opt, scaler=scaler)" in f.advice
    with amp_doctor.watch(model, optimizer=opt, scaler=scaler, tensorboard=False) as doctor:
        train(doctor)
    s = doctor.session
    assert (s.steps, s.amp.scaler) == (3, True) and not s.findings_of("no_step_boundary")
