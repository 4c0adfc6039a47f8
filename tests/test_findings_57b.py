"""Session 57b: a GradScaler the loop stops using mid-run.

Once a GradScaler had ended the steps, a plain ``optimizer.step()`` was taken for one
beside it (a bfloat16 generator next to a float16 discriminator) and ended no step:
10 float16 steps with a scaler then 20 bfloat16 (or ``model.half()``) steps without it
were reported as 10 steps, the last one holding 21 forwards. A plain step now ends a
step when the scaler took no part in it and it steps an optimizer the scaler stepped
before, with new gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_doctor
from amp_doctor.records import Session

SCALED = 10
STEPS = 30


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _loop(later: str, watched: bool, every: int = 1, lr: float = 1e-2
          ) -> tuple[list[float], list[float], Session | None]:
    """SCALED float16 steps with a GradScaler, then plain steps until STEPS: under
    bfloat16 autocast (``later="bf16"``) or with the model cast by ``model.half()``
    (``later="half"``). Returns the losses, the final parameters' sums and the session."""
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    losses: list[float] = []
    w = amp_doctor.watch(model, every=every, tensorboard=False) if watched else None
    try:
        for step in range(STEPS):
            x, y = _batch(step)
            if step < SCALED:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                if later == "bf16":
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = nn.functional.cross_entropy(model(x), y)
                else:
                    if step == SCALED:
                        model.half()
                    loss = nn.functional.cross_entropy(model(x.half()).float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())
    finally:
        if w is not None:
            w.close()
    sums = [float(p.detach().double().sum()) for p in model.parameters()]
    return losses, sums, (w.session if w is not None else None)


@pytest.mark.parametrize("later", ["bf16", "half"])
def test_plain_steps_after_the_scaler_is_dropped_are_steps(later: str) -> None:
    losses, sums, s = _loop(later, watched=True)
    assert s is not None
    assert s.steps == STEPS
    assert [r.step for r in s.history] == list(range(STEPS))
    # One forward a step, each step recorded: no step holds the forwards of later ones.
    assert sorted(lay.name for lay in s.layers) == ["0", "1", "2", "Sequential"]
    for lay in s.layers:
        assert (lay.name, lay.calls, lay.recorded_steps) == (lay.name, STEPS, STEPS)
    # The scaler's scale stays where its last update left it, with no backoff; the steps
    # after it was dropped had no scale (review 57d: they showed its last one).
    assert s.scaler is not None and not s.scaler.backoff_steps
    assert s.scaler.scale[-1] == (SCALED - 1, 2.0 ** 16)
    assert all(r.scale is None for r in s.history if r.step >= SCALED)
    plain_losses, plain_sums, _ = _loop(later, watched=False)
    assert losses == plain_losses and sums == plain_sums


def test_every_n_counts_the_steps_after_the_scaler() -> None:
    _, _, s = _loop("bf16", watched=True, every=10)
    assert s is not None
    assert s.steps == STEPS and s.recorded_steps == STEPS // 10
    assert [r.step for r in s.history] == [0, 10, 20]


def test_updates_lost_in_half_cover_each_plain_step() -> None:
    # A small learning rate: most float16 updates round away.
    _, _, s = _loop("half", watched=True, lr=1e-3)
    assert s is not None
    (f,) = [f for f in s.findings if f.kind == "lowp_updates_lost"]
    assert f.severity == "error"
    # Every weight value has a gradient, sampled in each of the float16 steps (not in
    # one step holding them all).
    sampled = (STEPS - SCALED) * sum(p.numel() for p in _net().parameters())
    assert f"of {sampled}). " in f.message


def test_a_second_plain_optimizer_beside_the_scaler_ends_no_step() -> None:
    # A head stepped outside the scaler after the update (its own float32 loss) in the
    # same iteration: the scaler took part in each step, so the update alone ends them.
    torch.manual_seed(0)
    body, head = nn.Linear(16, 16), nn.Linear(16, 4)
    opt_b = torch.optim.SGD(body.parameters(), lr=1e-2)
    opt_h = torch.optim.SGD(head.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    model = nn.Sequential(body, head)
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(8):
            x, y = _batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                feats = body(x)
            opt_b.zero_grad()
            scaler.scale(feats.float().pow(2).mean()).backward()
            scaler.step(opt_b)
            scaler.update()
            opt_h.zero_grad()
            nn.functional.cross_entropy(head(feats.detach().float()), y).backward()
            opt_h.step()
    assert w.session.steps == 8


def test_a_step_after_the_update_without_a_backward_ends_no_step() -> None:
    # scaler.step(opt); scaler.update(); opt.step(): the same gradients stepped again,
    # not a training step of their own.
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(6):
            x, y = _batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.step()
    assert w.session.steps == 6


def test_a_run_that_switched_format_is_not_called_a_bfloat16_run() -> None:
    _, _, s = _loop("bf16", watched=True)
    assert s is not None
    # bfloat16 by most forwards, float16 in the first SCALED steps.
    assert (s.amp.dtype, s.amp.other_dtypes, s.amp.scaler) == ("bfloat16", ["float16"], True)
    (f,) = [f for f in s.findings if f.kind == "whatif_float16"]
    assert "this bfloat16 run" not in f.message
    assert "this run (bfloat16 in most steps, float16 in the others)" in f.message


def test_a_new_optimizer_without_the_scaler_ends_its_steps() -> None:
    # The second phase makes its own optimizer for the same model: it steps parameters
    # the scaler stepped, so its plain steps end steps as the old optimizer's would.
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(STEPS):
            x, y = _batch(step)
            if step == SCALED:
                del opt
                opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            with torch.autocast("cpu", dtype=torch.float16 if step < SCALED else torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            if step < SCALED:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
    assert w.session.steps == STEPS
    assert all(lay.recorded_steps == STEPS for lay in w.session.layers)


def test_a_plain_generator_stepped_before_the_scaled_discriminator_ends_no_step() -> None:
    # A bfloat16 generator stepped first, a float16 discriminator with the scaler named to
    # the watch: the generator's step comes after the update that ended the last step and
    # before any scaler call, but it steps parameters no scaler steps.
    torch.manual_seed(0)
    gen, disc = nn.Linear(8, 16), nn.Linear(16, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    iters = 8
    with amp_doctor.watch([gen, disc], every=1, tensorboard=False, scaler=scaler) as w:
        for step in range(iters):
            z = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                g_loss = -disc(gen(z)).float().mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            with torch.autocast("cpu", dtype=torch.float16):
                d_loss = disc(gen(z).detach()).float().pow(2).mean()
            opt_d.zero_grad()
            scaler.scale(d_loss).backward()
            scaler.step(opt_d)
            scaler.update()
    assert w.session.steps == iters
