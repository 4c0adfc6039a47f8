"""Findings on the model families of review 38: a NaN loss only unrecorded steps saw, a
NaN passed on (not made) by a layer, an auxiliary loss kept on a module, float16 weights
that the optimizer's update turns NaN, an attention overflow under anomaly mode, LBFGS's
closure, and autocast off beside a float16 layer.

Each test runs a real loop (no mocks) and asserts on the findings' real values; each
failed before its fix.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import amp_doctor
from amp_doctor.records import Finding, Session


def errors(s: Session) -> list[Finding]:
    return [f for f in s.findings if f.severity in ("error", "warning")]


class _HandNorm(nn.Module):
    """A hand-written batch normalisation: (x - mean) / sqrt(var + eps) over the batch, with
    an eps that is 0 in float16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.var(dim=0, keepdim=True, unbiased=False)
        return (x - x.mean(dim=0, keepdim=True)) / torch.sqrt(var + 1e-8)


class _NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _HandNorm()
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.hidden(x))))


def test_a_nan_loss_only_unrecorded_steps_saw_is_one_error_not_the_output_layers() -> None:
    # A flat batch (variance 0, eps 0 in float16: 0/0) on steps 3, 8 and 13, none of them
    # recorded: the backoffs named `out`, the first layer in backward order, as "where
    # they appeared: look there" beside the NaN-loss error (review 38, the UNet's
    # GroupNorm).
    torch.manual_seed(0)
    model = _NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=10, tensorboard=False) as doctor:
        for step in range(15):
            x = torch.randn(8, 8, generator=g)
            if step in (3, 8, 13):
                x = torch.zeros(8, 8)  # a batch of equal rows: variance 0, 0/0
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), torch.zeros(8, 4))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps == [3, 8, 13]
    (err,) = errors(s)
    assert err.kind == "nonfinite_loss" and err.module is None
    (b,) = s.findings_of("scaler_backoff")
    assert b.severity == "info" and b.data["loss_nonfinite"]
    assert ("the loss itself was NaN/inf in each of these steps, so the gradients of every "
            "layer were too (2 layers with non-finite gradients); the first of them in "
            "backward order, out, only says where the backward pass met the NaN/inf first (the "
            "last layer with trainable weights before the loss), not where it began"
            ) in " ".join(b.message.split())
    assert "look there" not in b.message
    assert any("backed off 3x" in c for c in err.data["consequences"])


class _Attn(nn.Module):
    """q @ k^T without the 1/sqrt(d) scale: rows whose logits overflow float16 become NaN
    in the softmax, in this module's own code; `proj` only passes the NaN on."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        att = torch.softmax(q @ q.transpose(-2, -1) * 4000.0, dim=-1)
        return self.proj(att @ q)


def test_a_layer_that_only_passed_a_nan_on_keeps_the_input_caveat() -> None:
    # Its largest finite output, 128-256, read as "within 8 bits of float16's max" through
    # the histogram's top edge (256 * 2**8 > 65504), so the NaN-loss error said the layer
    # made it itself and dropped "its input is not checked" (review 38, the UNet).
    torch.manual_seed(0)
    model = _Attn()
    with torch.no_grad():
        model.proj.weight.mul_(300.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 16, generator=g)
    x[0, 0] *= 30.0  # one row's logits overflow
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        out.float().nan_to_num().sum().backward()
    proj = next(lay for lay in doctor.session.layers if lay.name == "proj")
    assert proj.nonfinite_steps == 1 and proj.overflow_frac == 0  # NaN only, no inf
    assert 128 <= max(abs(v) for v in out[1].float().flatten().tolist()) < 65504 / 2 ** 8
    from amp_doctor.analysis.detect_events import _overflowed_itself

    assert not _overflowed_itself(doctor.session, "proj")


class _MoE(nn.Module):
    """A router whose z-loss (logsumexp(logits) ** 2) is kept on the module, as Switch and
    Mixtral code keeps its auxiliary losses; in float16 its square overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.expert = nn.Linear(16, 16)
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        self.aux = (logits.logsumexp(-1) ** 2).mean()
        return self.expert(x) * logits.softmax(-1).max(-1, keepdim=True).values


class _MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = _MoE()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(x))


@pytest.mark.parametrize("anomaly", [False, True])
def test_an_auxiliary_loss_kept_on_a_module_is_named_as_such(anomaly: bool) -> None:
    # The z-loss's inf made the loss inf while the gradients stayed finite: the error said
    # the inf "appeared outside the watched modules"; anomaly mode found aten.pow as a
    # second finding saying "a later op saturated it" (review 38, the MoE).
    torch.manual_seed(0)
    model = _MoENet()
    with torch.no_grad():
        model.moe.router.bias.fill_(300.0)  # logsumexp ~ 300: its square is past 65504
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    g = torch.Generator().manual_seed(0)
    skipped = 0
    with amp_doctor.watch(model, every=1, tensorboard=False, anomaly=anomaly) as doctor:
        for _ in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                loss = nn.functional.cross_entropy(out.float(), y) + 1e-3 * model.moe.aux
            before = scaler.get_scale()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
            assert torch.isinf(loss)
    assert skipped == 0  # plain torch: the gradients were finite every step
    s = doctor.session
    (err,) = errors(s)
    if anomaly:
        assert (err.kind, err.module, err.op) == ("activation_overflow", "moe", "aten.pow")
        assert "kept aside (an auxiliary loss on the module)" in err.message
        loss_f = s.findings_of("nonfinite_loss")[0]
        assert loss_f.severity == "info" and loss_f.data["follow_on_of"] == "moe"
    else:
        assert err.kind == "nonfinite_loss"
        assert "a value a module computed aside and added to the loss" in err.message
        assert "did not skip 4 of these steps" in err.message
        assert err.advice.startswith("Compute the loss's terms in float32")


class _HalfHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.head(self.stem(x).half()).float()


@pytest.mark.parametrize("every", [1, 10])
def test_float16_weights_an_adam_update_turns_nan_are_the_root_cause(every: int) -> None:
    # Adam's eps (1e-8) is 0 in float16 and exp_avg_sq underflows: step 0's update makes
    # the head NaN from finite weights and gradients. Each mode blamed something else: a
    # forward op, the stem's output, step 1's gradients (review 38).
    torch.manual_seed(0)
    model = _HalfHead()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=every, tensorboard=False) as doctor:
        for _ in range(12):
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not model.head.weight.isfinite().all()  # the pathology happened
    s = doctor.session
    (err,) = errors(s)
    assert (err.kind, err.module, err.step) == ("lowp_update_nonfinite", "head", 0)
    assert "made head's weights (float16) NaN/inf from finite weights and finite gradients" \
        in err.message
    assert err.advice.startswith("Keep the parameters in float32")
    assert err.data["consequences"]


class _TempAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        self.temp = nn.Parameter(torch.tensor(20000.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = torch.softmax((q * self.temp) @ k.transpose(-2, -1), dim=-1)
        return self.proj(att @ v)


def test_anomaly_mode_gives_one_backoff_finding_for_one_attention_overflow() -> None:
    # Recorded steps in the op search's cool-down gave module-level origins (attn.proj,
    # passing the inf of attn's own matmul on): a second backoff finding with its own
    # culprits, and "backed off 14x ... backed off 5x" in the error (review 38, the ViT).
    torch.manual_seed(0)
    model = nn.Sequential(_TempAttn(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False, anomaly=True) as doctor:
        for _ in range(30):
            x = torch.randn(4, 6, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and len(s.scaler.backoff_steps) >= 20
    backoffs = s.findings_of("scaler_backoff")
    assert len(backoffs) == 1, [(b.module, b.steps) for b in backoffs]
    (err,) = errors(s)
    assert err.module == "0" and err.op is not None
    assert sum("backed off" in c for c in err.data["consequences"]) == 1


def test_lbfgs_closures_belong_to_their_optimizer_step() -> None:
    # LBFGS evaluates its closure (forward and backward) several times in one step():
    # the step boundaries fired inside it, "No optimizer or GradScaler was seen" although
    # one was given, and 15 steps counted as 19 or 20 (review 38).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        return loss

    with amp_doctor.watch(model, every=1, tensorboard=False, optimizer=opt) as doctor:
        for _ in range(6):
            opt.step(closure)
    assert calls > 6  # the closure ran several times per step
    s = doctor.session
    assert s.steps == 6 and s.recorded_steps == 6
    assert not s.findings_of("steps_from_backward")
    assert not [f for f in s.findings if f.kind == "no_step_boundary"]


class _FrozenHalfStem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16).half().requires_grad_(False)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.stem(x.half()).float())))


def test_autocast_that_never_ran_is_said_beside_a_float16_layer() -> None:
    # torch.cuda.amp.autocast() on a machine without CUDA disables itself; a frozen
    # float16 stem ran in float16 by its own weights, and the report said "AMP looks
    # healthy" (review 38).
    torch.manual_seed(0)
    model = _FrozenHalfStem()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ctx = torch.autocast("cpu", dtype=torch.float16, enabled=False)
            with ctx:
                loss = model(torch.randn(4, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = doctor.session.findings_of("autocast_inactive")
    assert f.severity == "warning" and f.data["low_by_weights"] == ["stem"]
    assert "only 1 layer with low-precision weights ran in low precision (stem)" in f.message
    assert "AMP looks healthy" not in doctor.report()
