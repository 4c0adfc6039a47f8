"""Session 44: a NaN that began in a step whose update nothing skipped.

Without a GradScaler (float16 without one, or bfloat16, which needs none) nothing skips
an update whose gradients are NaN/inf: the optimizer writes them into the weights, and
from the next step on every forward is NaN from the first layer that uses them. That
layer is where the NaN shows, not where it began (review 44b: a DDPM in bfloat16 was
told to run its first layer in float32).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import amp_doctor

BAD_STEP = 12


def _train(dtype: torch.dtype, every: int, model: nn.Module, spike: float = 1e6,
           steps: int = 30) -> tuple[amp_doctor.Session, list[float]]:
    """Adam, no GradScaler; the loss is multiplied by ``spike`` at BAD_STEP (a loss term
    that blows up once): its gradient overflows float16 in backward."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    with amp_doctor.watch(model, every=every, tensorboard=False) as doctor:
        for step in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with torch.autocast("cpu", dtype=dtype):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y) * (spike if step == BAD_STEP else 1.0)
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return doctor.session, losses


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _errors(s: amp_doctor.Session) -> list[tuple[str, str | None, int | None]]:
    return [(f.kind, f.module, f.step) for f in s.findings if f.severity == "error"]


def test_a_recorded_step_whose_update_took_overflowed_gradients_is_the_one_error() -> None:
    s, losses = _train(torch.float16, 1, _mlp())
    # The run really is this: finite up to the spike (finite too), NaN from the next step.
    assert all(math.isfinite(v) for v in losses[: BAD_STEP + 1]) and losses[BAD_STEP] > 1e5
    assert all(math.isnan(v) for v in losses[BAD_STEP + 1:])
    # Layer 2's output gradient is the loss's own: the first to overflow in backward. Not
    # "layer 0's output went NaN at step 13: run it in float32".
    assert _errors(s) == [("nonfinite_grads_applied", "2", BAD_STEP)], s.findings
    f = s.findings_of("nonfinite_grads_applied")[0]
    assert f.data["culprits"][0] == "2" and "Sequential" not in f.data["culprits"]
    assert f.data["loss"] > 1e5
    assert "GradScaler" in f.advice and "isfinite(norm)" in f.advice
    assert "nonfinite_loss from step 13" in f.message
    loss = s.findings_of("nonfinite_loss")[0]
    assert loss.severity == "info" and loss.module is None
    assert loss.data["after_grads_applied"] == BAD_STEP and loss.data["shown_in"] == "0"
    assert "only where it showed" in loss.message


def test_an_unrecorded_step_that_made_the_weights_nan_blames_no_layer() -> None:
    s, losses = _train(torch.float16, 10, _mlp())
    assert math.isnan(losses[20])
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module) for f in errors] == [("nonfinite_loss", None)], s.findings
    f = errors[0]
    # Recorded steps 0, 10, 20: steps 13..19 had NaN losses that nothing checked.
    assert f.data["began_unrecorded"] == 7 and f.data["last_recorded_before"] == 10
    assert f.data["shown_in"] == "0" and f.data["origin"] is None
    assert "may not be where it began" in f.message
    assert "watch(model, every=1)" in f.advice and "in float32" not in f.advice
    assert not s.findings_of("nonfinite_grads_applied")


class ZeroNorm(nn.Module):
    """``h / (|h| + 1)``: finite forward, but the backward of ``sqrt`` at 0 is inf, and
    0 * inf is NaN, when a row of ``h`` is all zeros (set at BAD_STEP)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.zero = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x) * (0.0 if self.zero else 1.0)
        n = h.float().pow(2).sum(-1, keepdim=True).sqrt()
        return self.fc2(h / (n + 1))


def test_bfloat16_gradients_that_a_backward_op_made_nan_are_named_without_a_scaler() -> None:
    torch.manual_seed(0)
    model = ZeroNorm()
    orig = model.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        model.zero = forward.calls == BAD_STEP
        forward.calls += 1
        return orig(x)

    forward.calls = 0  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]
    s, losses = _train(torch.bfloat16, 1, model, spike=1.0, steps=16)
    assert math.isfinite(losses[BAD_STEP]) and math.isnan(losses[BAD_STEP + 1])
    assert [k for k, _, _ in _errors(s)] == ["nonfinite_grads_applied"], s.findings
    f = s.findings_of("nonfinite_grads_applied")[0]
    assert f.step == BAD_STEP and f.module == "fc1"
    # bfloat16 does not overflow there: the advice is the op, not a GradScaler.
    assert "GradScaler" not in f.advice and "sqrt" in f.advice
    assert s.findings_of("nonfinite_loss")[0].severity == "info"


class LoudNorm(nn.Module):
    """A float32 LayerNorm output scaled past float16's max from step 3 (a residual stream
    grown too large), into a Linear that autocast runs in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc, self.head = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 4)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.ln(x) * self.gain)))


def test_a_float32_input_cast_to_inf_is_not_called_an_op_far_from_the_max() -> None:
    """Review 44a: every output of the failing step was inf/NaN (the matmul spreads the
    cast's inf), so "its finite values stayed below 2" came from the healthy steps."""
    torch.manual_seed(0)
    model = LoudNorm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for step in range(6):
            model.gain = 4e4 if step >= 3 else 1.0
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    fc = next(lay for lay in s.layers if lay.name == "fc")
    assert fc.input_dtypes == ["float32"] and fc.nonfinite_steps == 3
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module) for f in errors] == [("activation_overflow", "fc")], s.findings
    assert "not values growing past the max" not in errors[0].message
    assert "Its input came in float32" in errors[0].message


class ActorCritic(nn.Module):
    """Returns the value head's output squeezed (``v(h).squeeze(-1)``), as actor-critic
    code does, and the policy head's cast to float32."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.pi, self.v = nn.Linear(32, 3), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.pi(h).float(), self.v(h).squeeze(-1)


def test_an_output_layer_seen_through_a_view_or_cast_is_the_models_output() -> None:
    """Review 44b: value targets in the tens of thousands collapse the scale at the value
    head; returned squeezed, it was not the model's output layer, and the advice was to run
    it in float32 instead of keeping the loss O(1)."""
    torch.manual_seed(0)
    model = ActorCritic()
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, every=4) as doctor:
        for _ in range(24):
            x = torch.randn(32, 8)
            ret = 2e4 + 1e3 * x[:, 0]
            with torch.autocast("cpu", dtype=torch.float16):
                logits, value = model(x)
            loss = nn.functional.mse_loss(value.float(), ret, reduction="sum") \
                + nn.functional.cross_entropy(logits, torch.randint(0, 3, (32,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.layer("v").model_output and s.layer("pi").model_output
    assert not s.layer("trunk.0").model_output
    (collapse,) = s.findings_of("scale_collapse")
    assert collapse.module == "v" and "the loss is too large for float16, not v" in \
        collapse.message
    assert collapse.advice.startswith("Keep the loss O(1)")


def _checkpointed_session(reentrant: bool | None) -> amp_doctor.Session:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            x = torch.randn(8, 16, generator=g).requires_grad_()
            y = torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x) if reentrant is None else checkpoint(
                    model, x, use_reentrant=reentrant)
                loss = nn.functional.cross_entropy(out.float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_a_model_checkpointed_whole_with_reentrant_checkpoint_is_recorded() -> None:
    """Review 44a: ``checkpoint(model, x, use_reentrant=True)`` runs the model's first pass
    under no_grad, which read as validation: "model_not_run" and an empty layer table."""
    plain = _checkpointed_session(None)
    for reentrant in (True, False):
        s = _checkpointed_session(reentrant)
        assert not s.findings_of("model_not_run"), s.findings
        for name in ("0", "1", "2"):
            lay, ref = s.layer(name), plain.layer(name)
            assert (lay.calls, lay.recorded_steps) == (ref.calls, ref.recorded_steps) == (4, 4)
            assert lay.absmax == ref.absmax and lay.grad_absmax == ref.grad_absmax
            assert lay.grad_absmax is not None and lay.grad_absmax > 0


class Embedder(nn.Module):
    """Fourier features made in the model's own forward, then a Sequential MLP: the
    features' inf shows first in the Sequential's first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.tmlp = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)
        self.freq = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = x.half() * self.freq  # float16: inf once freq is large
        return self.head(self.tmlp(feats))


def test_the_code_before_a_sequentials_first_layer_is_its_callers() -> None:
    """Review 44b: "the op that made it is in tmlp's own forward code before tmlp.0", but
    a Sequential has no code of its own; the op is in the model's forward."""
    torch.manual_seed(0)
    model = Embedder()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for step in range(4):
            model.freq = 1e5 if step >= 2 else 1.0
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (loss_f,) = doctor.session.findings_of("nonfinite_loss")
    assert loss_f.module == "tmlp.0", doctor.session.findings
    assert "in the model's own forward code before tmlp.0" in loss_f.message


class LogBlock(nn.Module):
    """``log(softmax(300 z))``: the softmax underflows to 0 in float16, and its log is -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.fc1(x) * 300.0, dim=-1)
        return self.fc2(torch.log(p) * p)


class CheckpointedNet(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block, self.head = LogBlock(), nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def test_a_checkpoints_recomputed_forward_is_not_a_backward_op_in_anomaly_mode() -> None:
    """Review 44a: a non-reentrant checkpoint reruns the block's forward inside the backward
    node that unpacks its saved input (fc2's AddmmBackward0): its log was reported as a
    backward op of that node, at fc2's line."""
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = CheckpointedNet(reentrant)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
            for _ in range(3):
                x = torch.randn(8, 16).requires_grad_()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        s = doctor.session
        errors = [(f.kind, f.module, f.op) for f in s.findings if f.severity == "error"]
        assert errors == [("nonfinite_forward", "block", "aten.log")], (reentrant, s.findings)
        for f in s.findings_of("nonfinite_backward"):
            # The backward of a forward op: its node is that op's, never fc2's matmul.
            assert f.data.get("node") != "AddmmBackward0", (reentrant, f)
