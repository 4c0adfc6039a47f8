"""Session 44: a NaN that began in a step whose update nothing skipped.

Without a GradScaler (float16 without one, or bfloat16, which needs none) nothing skips
an update whose gradients are NaN/inf: the optimizer writes them into the weights, and
from the next step on every forward is NaN from the first layer that uses them. That
layer is where the NaN shows, not where it began (review 44b: a DDPM in bfloat16 was
told to run its first layer in float32).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from pathlib import Path

import torch
from torch import nn

import amp_doctor
from tests.helpers import console_script

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
    # Review 44c: nothing beside it says to run v in float32.
    (backoff,) = s.findings_of("scaler_backoff")
    assert backoff.severity == "info" and backoff.advice == collapse.advice
    from amp_doctor.analysis.next_steps import next_steps

    as_cli = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t.py"]))
    assert not [line for line in next_steps(as_cli) if "--fp32" in line or "--anomaly" in line]


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


class TwoExperts(nn.Module):
    """Top-1 routing of each row to one of two experts; expert 1 gets rows only when
    ``self.route_some`` (otherwise it is called on an empty batch, as MoE loops do)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.route_some = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        to_1 = torch.zeros(x.shape[0], dtype=torch.bool)
        if self.route_some:
            to_1[::2] = True
        out = torch.zeros(x.shape[0], 8)
        for e, mask in enumerate((~to_1, to_1)):
            idx = mask.nonzero().squeeze(1)
            out = out.index_add(0, idx, self.experts[e](x.index_select(0, idx)).float())
        return out


def test_an_expert_called_on_no_rows_counts_only_the_steps_it_ran() -> None:
    """Review 44a: an expert that got tokens in 3 of 16 steps read as "non-finite in 3 of
    16 recorded steps", and its weights' exact-zero gradients of the other 13 made 90% of
    its weight gradients "zero"."""
    torch.manual_seed(0)
    model = TwoExperts()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for step in range(8):
            model.route_some = step in (2, 5)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
    s = doctor.session
    e0, e1 = s.layer("experts.0"), s.layer("experts.1")
    assert (e0.calls, e0.recorded_steps) == (8, 8)
    assert (e1.calls, e1.recorded_steps) == (8, 2)
    # Its weight gradients, from the two steps it had rows: not mostly zeros.
    assert e1.param_grad_zero_frac is not None and e1.param_grad_zero_frac < 0.1


class LoRA(nn.Module):
    """A frozen base model with a trainable low-rank ``B(A(h))`` added to its residual
    stream (B zero-initialised, as LoRA does)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.head = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 10)
        self.A = nn.Linear(64, 4, bias=False)
        self.B = nn.Linear(4, 64, bias=False)
        nn.init.zeros_(self.B.weight)
        for m in (self.emb, self.ln, self.head):
            m.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(h + self.B(self.A(self.ln(h))) * 2.0)


def test_a_culprit_whose_gradient_overflowed_in_the_next_layers_backward_says_so() -> None:
    """Review 44a: B's weights grown to 3e3 overflow float16 in B's backward (the gradient
    times B's weights), which is A's output gradient: A was named, with no word of B.
    Review 44d: the same with a float32 LayerNorm before an overflowing head."""
    torch.manual_seed(0)
    model = LoRA()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with amp_doctor.watch(model, every=3, tensorboard=False) as doctor:
        for step in range(16):
            if step == 4:
                with torch.no_grad():
                    model.B.weight.fill_(3e3)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.layer("A").consumers == ["B"]
    (collapse,) = s.findings_of("scale_collapse")
    # The finding is about B, where the product overflowed; A is where it showed.
    assert collapse.module == "B", s.findings
    assert "the first layer with non-finite gradients was A" in collapse.message
    assert "A's output gradient is computed in the backward of B" in collapse.message


class Router(nn.Module):
    """An entropy bonus on a float16 softmax kept on the module (an auxiliary loss): one
    expert's probability underflows to 0, and p * log(p) is 0 * -inf = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.router, self.out = nn.Linear(16, 4), nn.Linear(16, 4)
        with torch.no_grad():
            self.router.bias[3] = -50.0
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.router(x), dim=-1)  # float16 under autocast
        self.aux = -(p * torch.log(p)).sum(-1).mean()
        return self.out(x)


def test_the_log_of_an_underflowed_zero_is_not_called_an_overflow() -> None:
    """Review 44a: "aten.log overflowed to -inf ... The backward of this op is where NaN
    usually appears next", where log(0) is no overflow and the NaN came at once."""
    torch.manual_seed(0)
    model = Router()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean() + 0.01 * model.aux
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    f = next(f for f in doctor.session.findings if f.op == "aten.log")
    assert (f.kind, f.severity, f.module) == ("activation_overflow", "error", "Router")
    assert "the log of exactly 0" in f.message and "not an overflow" in f.message
    assert "is NaN at once" in f.message
    assert "where NaN usually appears next" not in f.message


def test_a_batch_an_op_in_the_data_code_made_nan_is_one_error_the_ops() -> None:
    """Review 44b: ``x / x.std()`` of a blank image made the batch NaN; anomaly mode gave
    "nonfinite_input" and the division's "nonfinite_forward" (outside the model, with its
    line), two errors for one cause."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def batch(step: int) -> torch.Tensor:
        x = torch.randn(8, 16, generator=g) * (0.0 if step % 5 == 3 else 1.0)
        return x / x.std(dim=1, keepdim=True)  # 0 / 0 for a blank batch

    with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
        for step in range(20):
            x = batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module, f.op) for f in errors] == [
        ("nonfinite_forward", None, "aten.div")], s.findings
    assert "It made the batch given to Sequential non-finite" in errors[0].message
    assert errors[0].frame is not None and "in batch" in errors[0].frame
    (inp,) = s.findings_of("nonfinite_input")
    assert inp.severity == "info" and "made by aten.div" in inp.message


def test_a_loop_that_skips_updates_on_a_nonfinite_norm_is_not_told_they_were_applied() -> None:
    """The advice's own recipe: step only if clip_grad_norm_'s norm is finite. The
    gradients of that iteration overflowed, but the optimizer never took them; and that
    iteration, with no optimizer step to end it, was merged into the next one."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    skipped = 0
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for step in range(20):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y) * (1e6 if step == BAD_STEP else 1.0)
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if torch.isfinite(norm):
                opt.step()
            else:
                skipped += 1
    assert skipped == 1
    s = doctor.session
    # The iteration whose update the loop dropped is a step of its own, not merged with
    # the next one (there was no optimizer step to end it).
    assert s.steps == 20 and s.recorded_steps == 20
    assert not s.findings_of("nonfinite_grads_applied"), s.findings
    assert not [f for f in s.findings if f.severity == "error"]


def test_a_script_that_checkpoints_its_model_whole_is_recorded_from_step_0(tmp_path: Path
                                                                          ) -> None:
    """Review 44c: under the CLI the model is found inside its first call, which a
    reentrant checkpoint makes under no_grad: step 0's outputs were not recorded, and a
    short healthy run was told the model never ran."""
    (tmp_path / "t.py").write_text("""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
for step in range(3):
    x = torch.randn(8, 16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        out = checkpoint(model, x, use_reentrant=True)
        loss = nn.functional.cross_entropy(out.float(), torch.randint(0, 4, (8,)))
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
""")
    r = subprocess.run([console_script(), "diagnose", "--every", "1", "--no-tensorboard",
                        "--logdir", "out", "t.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "out" / "amp_doctor.json").read_text())
    assert not [f for f in s["findings"] if f["kind"] == "model_not_run"], s["findings"]
    layers = {lay["name"]: lay for lay in s["layers"]}
    assert layers["0"]["recorded_steps"] == layers["0"]["calls"] == 3
    step0 = next(r for r in s["history"] if r["step"] == 0)
    assert step0["layers"]["0"]["act"] is not None


class LoudInput(nn.Module):
    """The output layer's input is 3e3 times too large: its weights' gradient (the
    gradient times that input) overflows float16, its output gradient does not."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)) * 3e3)


def test_an_output_layer_whose_weight_gradient_alone_overflows_is_not_a_loss_too_large(
) -> None:
    """Review 44c: "the loss is too large for float16, not head_b" when head_b's output
    gradient was finite and only its weights' overflowed, from an input grown large."""
    torch.manual_seed(0)
    model = LoudInput()
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(24):
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            with torch.autocast("cpu", dtype=torch.float16):
                # Summed: at the first scales the output gradient overflows too; later
                # only the weights' gradient does, from the large input.
                loss = nn.functional.cross_entropy(model(x).float(), y, reduction="sum")
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    head = s.layer("head")
    assert head.model_output and 0 < head.grad_nonfinite_steps < head.param_grad_nonfinite_steps
    (collapse,) = s.findings_of("scale_collapse")
    assert collapse.module == "head", s.findings
    assert "the loss is too large" not in collapse.message
    assert not collapse.advice.startswith("Keep the loss O(1)")


class _NanBackward(torch.autograd.Function):
    """Identity whose backward is NaN (a backward op that made 0 * inf)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * math.nan


class Poisoned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.poison:
            h = _NanBackward.apply(h)
        return self.head(torch.relu(self.b(h)))


def test_a_clip_with_a_nan_norm_does_not_make_every_layer_a_culprit() -> None:
    """Review 44d: after ``unscale_``, ``clip_grad_norm_`` with a NaN total norm multiplies
    every gradient by NaN; an unrecorded skip's check then found every layer non-finite
    and named the last one (ln_f), whose gradients were finite."""
    torch.manual_seed(0)
    model = Poisoned()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=100, tensorboard=False) as doctor:
        for step in range(6):
            model.poison = step >= 3
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert math.isnan(norm.item()) == (step >= 3)
            scaler.step(opt)
            scaler.update()
    events = {e.step: e for e in doctor.session.scaler.events if e.kind == "backoff"}
    assert sorted(events) == [3, 4, 5]
    # Which layer overflowed is not known (the clip made them all NaN): none is named.
    assert all(not e.recorded and e.culprits == [] for e in events.values()), events


def test_a_group_of_findings_counts_the_layers_the_cap_left_out() -> None:
    """Review 44d: "missing_scaler on 8 layers", then "(and 8 more like it)": 16 in all."""
    from amp_doctor.analysis.folding import cap_per_kind
    from amp_doctor.records import Finding
    from amp_doctor.sinks.text import _group_block, group_findings

    found = [Finding(kind="missing_scaler", severity="warning", module=f"l{i}", op=None,
                     step=None, message=f"l{i} underflows.", advice="Use a GradScaler.")
             for i in range(16)]
    (group,) = group_findings(cap_per_kind(found))
    assert len(group.findings) == 8 and group.unlisted == 8
    text = _group_block(group)
    assert "missing_scaler  on 16 layers" in text and "and 8 more not listed" in text
    # The worst layer may be the one that carries the cap's count: the block counts those
    # layers once, in its list, not again after the worst one's message.
    from amp_doctor.sinks.text import FindingGroup, _md_group
    worst_capped = FindingGroup(tuple(reversed(group.findings)))
    assert worst_capped.lead.data["more_like_it"] == 8
    # Review 61a: the JSON names the layers the cap left out.
    assert worst_capped.lead.data["more_modules"] == [f"l{i}" for i in range(8, 16)]
    for block in (_group_block(worst_capped), _md_group(worst_capped)):
        assert "more like it" not in block and "8 more not listed" in block, block
        assert "l7 underflows." in block


def test_sams_two_passes_per_update_stay_one_step() -> None:
    """Sharpness-aware minimisation: a backward, a hand-made move of the weights with the
    gradients reset (its first step), a second forward and backward, then the optimizer.
    The gradients were reset between the two forwards, but the weights moved: no update
    was dropped, and the iteration is one step."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(6):
            x, y = torch.randn(8, 16), torch.randn(8, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            with torch.no_grad():  # SAM's first step: climb, reset the gradients
                eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in model.parameters()]
                for p, e in zip(model.parameters(), eps, strict=True):
                    p.add_(e)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                nn.functional.mse_loss(model(x).float(), y).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), eps, strict=True):
                    p.sub_(e)
            opt.step()
            opt.zero_grad()
    # 6 iterations, 7 steps: until the first optimizer step is seen, steps are counted
    # from the loop's backward passes and weight changes, and the first iteration's two
    # passes are two (a known limit, the same before this change). Counting a reset of
    # the gradients as a dropped update, whatever the weights did, made it 12.
    assert doctor.session.steps == 7
