"""Issue 13 item 3, 5 and issue 14 item 6: findings that are true on real training code.

Each test runs a real loop (no mocks) and asserts on the findings' real values.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp_doctor
from amp_doctor.analysis.analyze import risk_order
from amp_doctor.analysis.folding import fold_follow_ons
from amp_doctor.records import Finding, Session
from tests.fixtures.findings import tiny_gpt
from tests.helpers import MLP, train

C_FC = "transformer.h.1.mlp.c_fc"


def errors(s: Session) -> list[Finding]:
    return [f for f in s.findings if f.severity == "error"]


@pytest.mark.parametrize("every", [1, 10])
def test_gpt_overflow_is_one_error_named_the_same_at_every_rate(every: int) -> None:
    """nanoGPT-style run, h[1].mlp.c_fc weight x1e5, float16 + GradScaler."""
    _, losses, doctor = tiny_gpt.train(steps=20, blowup=True,
                                       watch={"every": every, "tensorboard": False})
    assert all(math.isnan(v) or math.isinf(v) for v in losses)  # the pathology happened
    s = doctor.session
    assert s.steps == 20 and s.recorded_steps == 20 // every
    errs = [f for f in s.findings if f.severity in ("error", "warning")]
    # One root cause, one error; nothing else at error or warning level.
    assert [(f.kind, f.module) for f in errs] == [("activation_overflow", C_FC)]
    origin = errs[0]
    # GELU only carried c_fc's inf on: listed in the origin, not an error of its own.
    assert "transformer.h.1.mlp.gelu" in origin.data["also_affected"]
    assert not [f for f in s.findings if f.module == "transformer.h.1.mlp.gelu"]
    # The scaler's findings agree with it, and say what they cost it.
    collapse = s.findings_of("scale_collapse")[0]
    backoff = s.findings_of("scaler_backoff")[0]
    assert collapse.module == backoff.module == C_FC
    assert collapse.severity == backoff.severity == "info"
    assert f"started at {C_FC} in 20 of 20 backoffs" in collapse.message
    recorded = 20 // every
    if every == 1:
        assert "(20 seen in that step)" in collapse.message
    else:
        assert (f"({recorded} seen in that step, {20 - recorded} inferred for unrecorded "
                "steps") in collapse.message
    assert any("collapsed" in c for c in origin.data["consequences"])
    loss = s.findings_of("nonfinite_loss")[0]
    assert loss.module == C_FC and loss.data["steps_bad"] == 20
    assert "ln_f" not in collapse.message


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_nan_in_the_batch_is_blamed_on_the_input_not_the_first_layer(bad: float) -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=2, tensorboard=False) as doctor:
        for _ in range(4):
            x = torch.randn(8, 16, generator=g)
            x[3, 5] = bad
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.zeros(8).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    errs = errors(s)
    assert [(f.kind, f.module) for f in errs] == [("nonfinite_input", "MLP")]
    event = next(e for e in s.events if e.kind == "nonfinite_input")
    assert (event.data["nan"], event.data["inf"]) == (math.isnan(bad), math.isinf(bad))
    assert ("already held NaN" if math.isnan(bad) else "already held inf") in errs[0].message
    assert all(lay.overflow_origin_steps == 0 for lay in s.layers)
    # No layer is blamed, and the NaN loss is the input's consequence.
    assert not [f for f in s.findings if f.module == "fc1"]
    loss = s.findings_of("nonfinite_loss")[0]
    assert loss.severity == "info"
    # Not "every watched layer's output was finite": the NaN went through all of them.
    assert "already held NaN/inf on recorded step 0: it came from the data" in loss.message


class _Wrapper(nn.Module):
    """A model whose own forward the loop never calls (as a LightningModule's
    training_step calling ``self.net(x)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()


@pytest.mark.parametrize("kw", [{"every": 2}, {"anomaly": True}], ids=["every=2", "anomaly"])
def test_a_loop_that_calls_a_submodule_of_the_watched_model_is_still_checked(
        kw: dict[str, object]) -> None:
    # Before: the batch and step checks ran only from the root's own forward, so a NaN
    # batch trained on with "Findings: none" (anomaly mode), or was blamed on net.fc1,
    # and the device was unknown.
    torch.manual_seed(0)
    w = _Wrapper()
    opt = torch.optim.SGD(w.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    losses = []
    with amp_doctor.watch(w, tensorboard=False, **kw) as doctor:  # type: ignore[arg-type]
        for step in range(6):
            x = torch.randn(8, 16, generator=g)
            if step == 2:
                x[2, 4] = math.nan
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(w.net(x).float(), torch.zeros(8).long())
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert s.amp.device_type == "cpu" and s.steps == 6
    assert [(f.kind, f.module, f.step) for f in errors(s)] == [("nonfinite_input", "net", 2)]
    assert math.isfinite(losses[1]) and all(map(math.isnan, losses[2:]))


def test_raise_mode_stops_a_loop_that_calls_a_submodule() -> None:
    torch.manual_seed(0)
    w = _Wrapper()
    x = torch.randn(8, 16)
    x[2, 4] = math.nan
    from amp_doctor.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match="the batch passed to 'net' holds NaN"), \
            amp_doctor.watch(w, on_nonfinite="raise", tensorboard=False):
        w.net(torch.randn(8, 16)).sum().backward()
        w.net(x).sum().backward()


def test_worst_first_puts_the_layer_closest_to_the_max_first() -> None:
    torch.manual_seed(0)
    with amp_doctor.watch(MLP(), every=1, tensorboard=False) as doctor:
        from tests.helpers import train
        train(doctor.models[""], steps=1)
    base = doctor.session.layers[0]
    near = dataclasses.replace(base, name="near", headroom=4.9, underflow_frac=0.0, order=9)
    under = [dataclasses.replace(base, name=f"u{i}", headroom=15.0, underflow_frac=0.01 * i,
                                 order=i) for i in range(1, 30)]
    nonfinite = dataclasses.replace(base, name="nf", nonfinite_steps=1, order=40)
    ranked = [lay.name for lay in risk_order([*under, near, nonfinite])]
    assert ranked[:3] == ["nf", "near", "u29"]
    # The text report (and TensorBoard's top-k, which uses it) ranks the same way.
    from amp_doctor.sinks.text import risk_order as text_order
    assert [x.name for x in text_order([*under, near, nonfinite])] == ranked


def test_scaled_gradients_stepped_without_unscaling_is_misuse() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            x = torch.randn(8, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.zeros(8).long())
            opt.zero_grad()
            scaler.scale(loss).backward()
            opt.step()
    s = doctor.session
    f = s.findings_of("scaled_grads_stepped")[0]
    assert f.severity == "error" and f.count == 3 and f.steps == [0, 1, 2]
    assert "65536 times too large" in f.message
    assert s.steps == 3
    assert "looks healthy" not in doctor.report()
    # Review 41c: the header said "no GradScaler" of this run.
    assert doctor.report().splitlines()[0] == (
        "amp-doctor 0.1.0: cpu | float16 autocast | GradScaler scales but never steps | "
        "3 steps (3 recorded, every 1) | completed")


def test_what_updates_65536x_too_large_break_next_is_the_misuses_consequence() -> None:
    """After the first update on scaled gradients the weights are far off and the next
    forward overflows: one error, the misuse, which lists the overflow and the NaN loss
    as its consequences (review 41a: the overflow was an error of its own, first)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    losses = []
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(6):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            losses.append(loss.item())
            opt.zero_grad()
            scaler.scale(loss).backward()
            opt.step()
    assert losses[0] < 2 and losses[1] > 1000 and not any(math.isfinite(v) for v in losses[2:])
    s = doctor.session
    errors = [f for f in s.findings if f.severity == "error"]
    assert [f.kind for f in errors] == ["scaled_grads_stepped"], errors
    assert "Consequences: activation_overflow in layer 2; nonfinite_loss in layer 0 from step 2" \
        in errors[0].message, errors[0].message
    assert s.findings_of("activation_overflow")[0].severity == "info"
    assert doctor.report().index("ERROR  scaled_grads_stepped") < doctor.report().index(
        "activation_overflow")


class QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.q = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _dqn_steps(net: QNet, steps: int) -> list[float]:
    """A DQN step: the trained net itself computes the TD target under no_grad, from
    unnormalised next states (x3e4) that overflow float16 in fc1 there only."""
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        s, a, r = (torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g),
                   torch.randn(32, generator=g))
        s2 = torch.randn(32, 8, generator=g) * 3e4
        with torch.autocast("cpu", dtype=torch.float16):
            qsa = net(s).gather(1, a[:, None]).squeeze(1)
            with torch.no_grad():
                target = r + 0.99 * net(s2).max(1).values
            loss = nn.functional.smooth_l1_loss(qsa.float(), target.float())
        losses.append(loss.item())
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return losses


def test_the_trained_models_own_no_grad_call_in_its_step_is_recorded() -> None:
    """Before: 'Every watched layer's output was finite' and a scale collapse blamed on
    q, since a no_grad call was taken for validation; --on-nonfinite raise never raised."""
    torch.manual_seed(0)
    net = QNet()
    with amp_doctor.watch(net, every=1, tensorboard=False) as doctor:
        losses = _dqn_steps(net, 4)
    assert not any(math.isfinite(v) for v in losses)
    s = doctor.session
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module) for f in errors] == [("activation_overflow", "fc1")], errors
    assert s.layer("fc1").nonfinite_steps == 4 and s.layer("fc1").recorded_steps == 4
    loss = s.findings_of("nonfinite_loss")
    assert loss and loss[0].severity == "info" and "fc1's output" in loss[0].message
    torch.manual_seed(0)
    net = QNet()
    with pytest.raises(amp_doctor.errors.NonFiniteError, match=r"in module 'fc1'.* step 0"):
        with amp_doctor.watch(net, anomaly=True, on_nonfinite="raise", tensorboard=False):
            _dqn_steps(net, 2)


@pytest.mark.parametrize("on_nonfinite", ["record", "raise"])
def test_validation_between_micro_batches_is_not_the_training_steps_work(
        on_nonfinite: str) -> None:
    """Gradient accumulation with a validation pass under no_grad between micro-batches
    (Lightning's val_check_interval can land there), on data that overflows float16:
    not the step's work (it comes after a backward), so no finding, and raise mode does
    not stop a healthy run in it (review 41b)."""
    torch.manual_seed(0)
    net = QNet()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    val = torch.randn(16, 8, generator=g) * 3e4
    val_nonfinite = []
    with amp_doctor.watch(net, every=1, tensorboard=False, anomaly=on_nonfinite == "raise",
                          on_nonfinite=on_nonfinite) as doctor:
        for i in range(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = net(torch.randn(16, 8, generator=g)).float().pow(2).mean() / 2
            scaler.scale(loss).backward()
            if i % 3 == 1:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                    val_nonfinite.append(not bool(net(val).isfinite().all()))
            if i % 2 == 1:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    assert val_nonfinite and all(val_nonfinite)
    s = doctor.session
    assert s.steps == 4 and s.scaler is not None and not s.scaler.skipped_steps
    assert [f for f in s.findings if f.severity != "info"] == []
    assert s.layer("fc1").nonfinite_steps == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pure_low_precision_training_with_frozen_weights_is_a_finding(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = MLP().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    before = [p.detach().clone() for p in model.parameters()]
    with amp_doctor.watch(model, every=2, tensorboard=False) as doctor:
        for _ in range(4):
            x = torch.randn(8, 16, generator=g).to(dtype)
            loss = nn.functional.cross_entropy(model(x).float(), torch.zeros(8).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    frozen = sum(int((a == b).sum()) for a, b in zip(before, model.parameters(), strict=True))
    total = sum(p.numel() for p in model.parameters())
    assert frozen / total > 0.5  # the pathology: most weights never changed
    f = doctor.session.findings_of("lowp_updates_lost")[0]
    name = str(dtype).removeprefix("torch.")
    assert f.severity == "error" and f.data["frac"] > 0.5
    assert f.data["dtypes"] == [name] and "did not change" in f.message
    # The fix keeps the weights' own format for autocast: bfloat16 weights were told to
    # move to float16 with a GradScaler (review 37).
    assert f"dtype=torch.{name})" in f.advice
    assert ("GradScaler`" in f.advice) == (dtype == torch.float16)


def test_float32_weights_with_autocast_have_no_frozen_weight_finding() -> None:
    torch.manual_seed(0)
    with amp_doctor.watch(MLP(), every=1, tensorboard=False) as doctor:
        from tests.helpers import train
        train(doctor.models[""], steps=3)
    assert not doctor.session.findings_of("lowp_updates_lost")


class _WrappedForward(nn.Module):
    """Accelerate-style: autocast is entered inside ``forward``, not around the call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_autocast_entered_inside_forward_is_recognised() -> None:
    torch.manual_seed(0)
    model = _WrappedForward()
    inner = model.forward

    def forward(*a: object, **k: object) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return inner(*a, **k)

    model.forward = forward  # type: ignore[method-assign]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            out = model(torch.randn(8, 16, generator=g))
            loss = nn.functional.cross_entropy(out.float(), torch.zeros(8).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert s.amp.autocast_seen and s.amp.dtype == "bfloat16"
    assert not s.findings_of("autocast_inactive")
    assert "bfloat16 autocast" in doctor.report()


def test_nan_loss_from_a_fully_masked_row_is_always_a_finding() -> None:
    """Masked mean over an all-padding batch row: 0/0 in the loss, outside the model."""
    torch.manual_seed(0)
    model = MLP(d_out=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=2, tensorboard=False) as doctor:
        for _ in range(4):
            x = torch.randn(8, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x).float()
            mask = torch.ones(8, 6)
            mask[2] = 0  # a fully padded row
            per_row = (out.pow(2) * mask).sum(1) / mask.sum(1)
            loss = per_row.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    f = s.findings_of("nonfinite_loss")[0]
    assert f.severity == "error" and f.module is None
    # Seen on the recorded steps (0 and 2), from their one host copy each; counted on the
    # device in every step (all 4 were NaN), read once at the end.
    assert (f.data["steps_bad"], f.data["checked"], f.step) == (4, 4, 0)
    assert f.data["every_step"] and "in 4 of the 4 steps with a loss" in f.message
    assert "outside the watched layers' outputs" in f.message
    assert "looks healthy" not in doctor.report()


class _PaddedAttention(nn.Module):
    """Hand-written attention: a fully padded row softmaxes over all -inf, 0/0 = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(1, 2)) / 4.0
        att = att.masked_fill(pad[:, None, :], float("-inf")).softmax(-1)
        return self.head(att @ v)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("every", [3, 100])
def test_nan_loss_on_every_step_from_a_padded_attention_row_is_one_error(
        dtype: str, every: int) -> None:
    torch.manual_seed(0)
    model = _PaddedAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == "float16")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=every, tensorboard=False) as doctor:
        for _ in range(6):
            x = torch.randn(4, 5, 16, generator=g)
            pad = torch.zeros(4, 5, dtype=torch.bool)
            pad[1] = True  # one sequence is all padding
            with torch.autocast("cpu", dtype=getattr(torch, dtype)):
                out = model(x, pad)
            loss = out.float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    # The NaN loss is the one error; the backoffs and the collapse it caused are its
    # consequences (float16), not errors of their own.
    assert [f.kind for f in errors(s)] == ["nonfinite_loss"], s.findings
    f = errors(s)[0]
    # Every step whose loss was checked was NaN (with a scaler: every step; without: the
    # recorded ones).
    assert f.data["steps_bad"] == f.data["checked"] >= 1
    if dtype == "float16":
        assert "Consequences: GradScaler backed off 6x" in f.message
        assert {x.kind: x.severity for x in s.findings if x.kind.startswith("scale")} == {
            "scaler_backoff": "info", "scale_collapse": "info"}
    assert "looks healthy" not in doctor.report()


def _finding(kind: str, module: str | None, op: str | None = None, step: int = 0,
             severity: str = "error", **data: object) -> Finding:
    return Finding(kind=kind, severity=severity, module=module, op=op,  # type: ignore[arg-type]
                   step=step, message=f"{kind}.", advice="", steps=[step], data=dict(data))


def test_backward_nan_after_a_forward_origin_is_folded_into_it() -> None:
    s = Session.load(Path(__file__).parent / "golden" / "fp16_overflow.json")
    fwd = _finding("nonfinite_forward", "head", "aten.log")
    bwd = _finding("nonfinite_backward", "head", "aten.div", node="LogBackward0",
                   forward_op="aten.log", nan=True)
    out = fold_follow_ons(s, [fwd, bwd])
    assert [(f.kind, f.severity) for f in out] == [("nonfinite_forward", "error"),
                                                    ("nonfinite_backward", "info")]
    assert out[1].data["follow_on_of"] == "head"
    assert "LogBackward0, the backward of aten.log" in out[0].data["consequences"][0]
    # Another module, a finite loss (a mask swallowed the forward's -inf), or another
    # step: the backward NaN is a problem of its own.
    other = _finding("nonfinite_backward", "body", "aten.mul")
    later = _finding("nonfinite_backward", "head", "aten.div", step=5)
    out = fold_follow_ons(s, [fwd, other, later])
    assert [f.severity for f in out] == ["error", "error", "error"]
    # With the loss NaN in that step, the forward origin explains it wherever it is.
    loss = _finding("nonfinite_loss", None, severity="info", origin="head")
    out = fold_follow_ons(s, [fwd, other, loss])
    assert [f.severity for f in out if f.kind != "nonfinite_loss"] == ["error", "info"]


def test_float16_log0_is_not_called_values_beyond_the_max() -> None:
    """Without anomaly mode: -inf from log(0) is inf in float16 too, but not an overflow."""
    torch.manual_seed(0)
    model = _LogSoftmaxHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                logp = model(torch.randn(8, 16, generator=g))
            loss = nn.functional.nll_loss(logp.float(), torch.zeros(8).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    [f] = errors(s)
    assert f.kind == "activation_overflow" and f.module == "_LogSoftmaxHead"
    assert "beyond the format's max" not in f.message and "log(0)" in f.message
    assert "anomaly" in f.advice and "dtype=torch.bfloat16" not in f.advice


class _LogSoftmaxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # log(softmax) of very spread logits: probabilities of exactly 0, log gives -inf.
        return torch.log(torch.softmax(self.fc(x) * 1e4, dim=-1))


@pytest.mark.parametrize("anomaly", [False, True])
def test_bf16_run_is_never_told_to_use_bf16_and_log0_is_not_an_overflow(anomaly: bool) -> None:
    torch.manual_seed(0)
    model = _LogSoftmaxHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False, anomaly=anomaly) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp = model(torch.randn(8, 16, generator=g))
            loss = nn.functional.nll_loss(logp.float(), torch.zeros(8).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert s.amp.dtype == "bfloat16"
    assert any(math.isinf(lay.min) for lay in s.layers)  # the -inf happened
    for f in s.findings:
        assert "dtype=torch.bfloat16" not in f.advice, f
        assert "beyond the format's max" not in f.message, f
    if anomaly:
        f = s.findings_of("nonfinite_forward")[0]
        assert f.op == "aten.log" and "log_softmax" in f.advice


def _resume_loop(every: int) -> tuple[list[float], amp_doctor.Watch]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    g = torch.Generator().manual_seed(0)
    real: list[float] = []
    with amp_doctor.watch(model, every=every, tensorboard=False) as doctor:
        for i in range(8):
            if i == 4:  # resume from a checkpoint with another scale
                scaler = torch.amp.GradScaler("cpu", growth_interval=2)
                scaler.load_state_dict({"scale": 8.0, "growth_factor": 2.0,
                                        "backoff_factor": 0.5, "growth_interval": 2,
                                        "_growth_tracker": 1})
            x = torch.randn(8, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.zeros(8).long())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            real.append(scaler.get_scale())
    return real, doctor


def test_scale_timeline_follows_a_resumed_scaler_on_unrecorded_steps() -> None:
    real, doctor = _resume_loop(every=1000)
    sc = doctor.session.scaler
    assert sc is not None
    by_step = dict(sc.scale)
    got = []
    last = None
    for i in range(8):
        last = by_step.get(i, last)
        got.append(last)
    assert got == real
    assert real[4] == 16.0  # tracker 1 + 1 = 2: the loaded scale grew at once


def test_forward_overflow_during_accumulation_is_not_calibration() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=10, tensorboard=False) as doctor:
        for i in range(12):
            opt.zero_grad()
            for micro in range(2):
                x = torch.randn(8, 16, generator=g)
                if i == 1 and micro == 1:
                    x = x * 1e6  # fc1's float16 output overflows to inf
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x).float(),
                                                       torch.zeros(8).long()) / 2
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps == [1]
    ev = [e for e in s.scaler.events if e.kind == "backoff"][0]
    assert ev.loss_nonfinite is True
    f = s.findings_of("scaler_backoff")[0]
    assert "calibrating" not in f.message
    # One error for one cause (review 38): the backoff of a step whose loss was inf is
    # that NaN loss's consequence, and the loss the batch's: x * 1e6 is beyond float16's
    # max, and autocast's cast of it is inf (an unrecorded step's batch, checked).
    assert f.severity == "info" and f.data["loss_nonfinite"]
    (cause,) = [x for x in s.findings if x.severity == "error"]
    assert (cause.kind, cause.step) == ("input_beyond_format", 1)
    assert any("backed off" in c for c in cause.data["consequences"])
    assert s.findings_of("nonfinite_loss")[0].severity == "info"


class _TwoBranch(nn.Module):
    """``big``'s weight gradient overflows float16 at every scale, so the scale collapses;
    ``small``'s gradients then underflow at that tiny scale."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(16, 4)
        self.small = nn.Linear(16, 4)
        with torch.no_grad():
            self.big.weight.mul_(1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x * 3e4) + self.small(x * 1e-5)


def test_underflow_at_a_collapsed_scale_is_the_collapse_not_advice_to_raise_init_scale() -> None:
    torch.manual_seed(0)
    model = _TwoBranch()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(30):
            x = torch.randn(64, 16, generator=g).clamp(-2, 2)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.zeros(64).long(),
                                                   reduction="sum")
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.layer("small").param_grad_underflow_frac is not None
    assert s.layer("small").param_grad_underflow_frac > 0.1  # it did underflow
    assert not s.findings_of("gradient_underflow")
    collapse = s.findings_of("scale_collapse")[0]
    assert collapse.severity == "error" and collapse.module == "big"
    assert collapse.data["underflow_follow_ons"] == ["small"]
    assert "not a reason to raise `init_scale`" in collapse.message
    # The backoffs name the same layer as the collapse.
    assert [f.module for f in s.findings_of("scaler_backoff")] == ["big"]
    assert [f.severity for f in s.findings if f.severity == "error"] == ["error"]


def test_clip_before_unscale_gives_no_false_underflow_warning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            x = torch.randn(16, 64, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.zeros(16).long())
            opt.zero_grad()
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # still scaled
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert not s.findings_of("gradient_underflow")
    clip = s.findings_of("clip_before_unscale")[0]
    assert clip.severity == "error" and clip.data["underflow_follow_ons"] == ["0"]
    assert [f.kind for f in s.findings if f.severity in ("error", "warning")] == [
        "clip_before_unscale"]


class _Exp20(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x * 20)  # beyond float16's max for x > 0.55


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(16, 16)
        self.blk = nn.Sequential(nn.Linear(16, 16), _Exp20())
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.blk, self.inp(x), use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [True, False])
def test_an_overflow_inside_activation_checkpointing_is_blamed_on_its_layer(
        reentrant: bool) -> None:
    # A reentrant checkpoint runs its first pass under no_grad and the second inside
    # backward; neither was recorded, so the error went to `out`, which only passed
    # the inf on.
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        train(model, steps=3, lr=0.01)
    s = doctor.session
    assert s is not None
    errors = [(f.kind, f.module) for f in s.findings if f.severity == "error"]
    assert errors == [("activation_overflow", "blk.1")]
    calls = {layer.name: layer.calls for layer in s.layers}
    assert calls["blk.1"] == calls["out"] == 3  # once a step: the recompute is not counted


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_model_found_by_diagnose_is_recorded_from_its_first_step(
        reentrant: bool) -> None:
    # Under `diagnose` a model is found during its first call, after its own pre-hook
    # would have run: a reentrant checkpoint's first pass (no_grad) in that call was
    # taken for inference, so its layers missed step 0 and came last in the layer
    # order, and a later NaN was blamed on the first layer after the checkpoint that
    # passed it on (review 35: `lnf` instead of `blocks.1.fc`).
    from amp_doctor.watch import Watch

    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    w = Watch(None, every=1, discover=True, tensorboard=False).start()
    try:
        train(model, steps=3, lr=0.01)
    finally:
        s = w.close()
    calls = {layer.name: layer.calls for layer in s.layers}
    assert calls["blk.1"] == calls["out"] == 3
    assert "blk.1" in s.history[0].layers
    errors = [(f.kind, f.module) for f in s.findings if f.severity == "error"]
    assert errors == [("activation_overflow", "blk.1")]


def _outlier_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 16, generator=g)
    if i == 2:
        x[0, 3] = 1e5  # an un-normalised outlier: finite in float32, beyond float16's max
    return x, torch.randint(0, 4, (8,), generator=g)


def test_an_input_beyond_float16s_max_is_blamed_on_the_data() -> None:
    # autocast casts the float32 batch to float16 for the first Linear: 1e5 becomes inf
    # before any arithmetic. Before, the report said "not values growing past the max,
    # but an op in it that made inf/NaN (log(0), x/0, exp)" and advised anomaly mode and
    # epsilons (review 35); raise mode said "from finite float16 inputs" of a float32 one.
    from amp_doctor.errors import NonFiniteError

    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        train(model, steps=4, lr=0.01, batch=_outlier_batch)
    s = doctor.session
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.module, f.step) == ("activation_overflow", "fc1", 2)
    assert "the batch given to MLP held values up to 1.00e+05 (first at step 2), beyond " \
           "float16's max 65504" in f.message
    assert f.advice.startswith("Normalise or clip the data") and f.data["input_absmax"] == 1e5
    (loss,) = s.findings_of("nonfinite_loss")
    assert "Its input is not checked" not in loss.message
    torch.manual_seed(0)
    model = MLP()
    with pytest.raises(NonFiniteError, match=r"aten\._to_copy in module 'fc1' produced \+inf "
                       r"at step 2 .*: it cast values up to 1\.00e\+05 to float16, beyond its "
                       r"max 65504\. Fix: For aten\._to_copy in fc1: the values it cast"):
        with amp_doctor.watch(model, on_nonfinite="raise", tensorboard=False):
            train(model, steps=4, lr=0.01, batch=_outlier_batch)


class _WideGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)
        with torch.no_grad():
            self.fc1.weight.mul_(9)  # pre-activations of std ~5: GELU's tail is subnormal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_gelus_negative_tail_is_no_activation_underflow() -> None:
    # About 7% of GELU's outputs are its negative tail, |y| < 6e-5 in float16, beside a
    # largest |y| of 18: more than ACT_RELEVANT_BITS below it, they move no float16 result
    # they feed. Before, a warning advised bfloat16 or float32 for the layer (review 36).
    torch.manual_seed(0)
    model = _WideGelu()
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        train(model, steps=3, lr=1e-4)
    s = doctor.session
    act = s.layer("act")
    assert act.underflow_frac > 0.05 and act.absmax > 16  # the shares the rule is about
    assert not s.findings_of("activation_underflow")
    # The same outputs scaled down as a whole are all small: every subnormal counts.
    torch.manual_seed(0)
    small = _WideGelu()
    with torch.no_grad():
        small.fc1.weight.mul_(1e-5)
        small.fc1.bias.mul_(1e-5)
    with amp_doctor.watch(small, every=1, tensorboard=False) as doctor:
        train(small, steps=3, lr=1e-4)
    assert [f.module for f in doctor.session.findings_of("activation_underflow")][:1] == ["fc1"]


def test_data_beyond_the_max_that_comes_out_nan_is_blamed_on_the_data() -> None:
    # A batch scaled by 1e6 (a unit mix-up) from step 4: autocast's cast makes inf and
    # fc1's matmul NaN, not values past the max, so no overflow finding read the batch's
    # range and the report blamed "fc1's output". At step 3 the loss alone blew up (x1e8):
    # the scaler backed off in the backward pass, with a finite forward, and the backoff
    # finding said its whole episode (3-6) began in fc1's forward pass (review 37).
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for step in range(8):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            if step in (4, 5, 6):
                x = x * 1e6
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                loss = nn.functional.cross_entropy(out.float(), y) * (1e8 if step == 3 else 1)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            assert torch.isfinite(out).all() == (step not in (4, 5, 6))
    s = doctor.session
    fc1 = next(lay for lay in s.layers if lay.name == "fc1")
    assert fc1.nonfinite_steps == 3 and fc1.overflow_frac == 0  # NaN, not past the max
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.module, f.step) == ("input_beyond_format", "fc1", 4)
    assert "in 3 recorded step(s) that went non-finite (first at step 4); fc1's output was " \
           "the first to go non-finite in 3 of them" in f.message
    (b,) = s.findings_of("scaler_backoff")
    assert b.steps == [3, 4, 5, 6] and b.data["follow_on_of"] == "fc1"
    assert ("fc1's output went non-finite first, in the forward pass, at step 4 (the "
            "backoffs before it, from step 3, show no forward origin)") in b.message


class _SensorGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


@pytest.mark.parametrize("anomaly", [False, True])
def test_data_beyond_float16s_max_inside_a_gru_is_blamed_on_the_data(anomaly: bool) -> None:
    # Raw sensor readings (one column in the 1e4s, an outlier of 1e5) into a GRU under
    # float16 autocast: its gate matmuls run in float16 inside it (the cast makes inf),
    # its output stays float32 and finite,
    # and its gradients go NaN, so the scaler skips and collapses. No layer's output
    # overflowed, so the report said only "scale collapsed ... fix the culprit layer"
    # (review 37). Now the data is named, and the scaler's findings are its consequences.
    torch.manual_seed(0)
    model = _SensorGRU()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([1.0, 10.0, 1e4, 5.0])
    skipped = 0
    with amp_doctor.watch(model, every=1, tensorboard=False, anomaly=anomaly) as doctor:
        for _ in range(6):
            x = torch.randn(8, 12, 4, generator=g) * scale
            x[0, 0, 2] = 1e5  # finite in float32, beyond float16's max
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (model(x).float() - 1).pow(2).mean()
            opt.zero_grad()
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
    assert skipped == 6  # plain torch's word: every step's gradients were non-finite
    s = doctor.session
    gru = next(lay for lay in s.layers if lay.name == "gru")
    assert gru.output_dtypes == ["float32"] and gru.nonfinite_steps == 0
    (f,) = [f for f in s.findings if f.severity == "error"]
    if anomaly:  # the cast itself, with the user's line; one error, not two
        assert (f.kind, f.module, f.op, f.step) == ("activation_overflow", "gru",
                                                    "aten._to_copy", 0)
        assert "it cast values up to 1.00e+05 to float16, beyond its max 65504" in f.message
        assert "normalise or clip them where they are made" in f.advice
    else:
        assert (f.kind, f.module, f.step) == ("input_beyond_format", "gru", 0)
        assert f.message.startswith("The batch given to _SensorGRU held values up to 1.00e+05, "
                                    "beyond float16's max 65504, in 6 recorded step(s) whose "
                                    "gradients went non-finite")
        assert f.advice.startswith("Normalise or clip the data")
    backoff = next(iter(s.findings_of("scaler_backoff")))
    assert backoff.severity == "info" and backoff.data["follow_on_of"] == "gru"


class _CheckpointedMLP(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(16, 32)
        self.blk = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.mode == "none":
            return self.out(self.blk(h))
        return self.out(checkpoint(self.blk, h, use_reentrant=self.mode == "reentrant"))


def test_gradients_inside_a_reentrant_checkpoint_are_recorded() -> None:
    # A reentrant checkpoint's first pass runs under no_grad: its outputs have no
    # gradient, which exists only on the outputs recomputed inside backward. Before,
    # those were skipped, so no output gradient of a checkpointed layer was ever
    # recorded (gradient_underflow missed them; review 35). Every mode now records the
    # same figures as the model without checkpointing.
    fields = ("calls", "grad_absmax", "grad_underflow_frac", "param_grad_underflow_frac")
    seen = {}
    for mode in ("none", "reentrant", "nonreentrant"):
        torch.manual_seed(0)
        model = _CheckpointedMLP(mode)
        with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
            train(model, steps=3, lr=0.01)
        seen[mode] = {lay.name: tuple(getattr(lay, k) for k in fields)
                      for lay in doctor.session.layers}
    assert seen["reentrant"] == seen["nonreentrant"] == seen["none"]
    assert seen["reentrant"]["blk.0"][0] == 3
    assert all(seen["reentrant"][n][1] > 0 for n in ("blk.0", "blk.1", "blk.2", "blk.3"))


@pytest.mark.parametrize("reentrant", [True, False])
def test_anomaly_mode_names_the_op_inside_activation_checkpointing(reentrant: bool) -> None:
    # The reentrant first pass runs under no_grad inside the training forward, and its
    # recompute runs inside CheckpointFunctionBackward: both are blk.1's forward, so the
    # origin is aten.exp in blk.1, with no backward finding that blames no module.
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    with amp_doctor.watch(model, every=1, anomaly=True, tensorboard=False) as doctor:
        train(model, steps=3, lr=0.01)
    s = doctor.session
    errors = [(f.kind, f.module, f.op) for f in s.findings if f.severity == "error"]
    assert errors == [("nonfinite_forward", "blk.1", "aten.exp")]
    (origin,) = s.findings_of("nonfinite_forward")
    assert origin.step == 0
    line = inspect.getsourcelines(_Exp20.forward)[1] + 1  # the exp's own line
    assert origin.data["frames"][0].endswith(f"test_real_findings.py:{line} in forward")
    assert all(f.module == "blk.1" for f in s.findings_of("nonfinite_backward"))


class _CausalAttention(nn.Module):
    """One self-attention layer that takes the mask the nn.Transformer tutorial makes."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1) / 4 + mask).softmax(-1)
        return self.out(att @ v)


@pytest.mark.parametrize("kw", [{"every": 1}, {}, {"anomaly": True}],
                         ids=["every=1", "default", "anomaly"])
def test_a_causal_minus_inf_mask_given_to_the_model_is_not_bad_data(
        kw: dict[str, object]) -> None:
    # Before: the recorded steps' batch check called the -inf mask a NaN/inf batch (an
    # error, "check the data pipeline") on a run whose every loss was finite.
    torch.manual_seed(0)
    model = _CausalAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    assert mask.min() == -math.inf and mask.max() == 0
    with amp_doctor.watch(model, tensorboard=False, **kw) as doctor:  # type: ignore[arg-type]
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(2, 6, 16), mask).float().pow(2).mean()
            assert torch.isfinite(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f.kind for f in doctor.session.findings if f.severity != "info"] == []
    # A stray -inf among positive values is still bad data (the -inf test above).


def _distill(teacher_first: bool, watch: dict[str, object] | None,
             steps: int = 6) -> tuple[list[float], list[torch.Tensor], amp_doctor.Watch | None]:
    """Knowledge distillation under float16: a frozen teacher run under no_grad inside the
    step, whose last Linear overflows float16 on every batch."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        teacher[2].weight.mul_(1e5)
    teacher.eval()
    student = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses: list[float] = []
    doctor = (amp_doctor.watch({"student": student, "teacher": teacher}, tensorboard=False,
                               **watch)  # type: ignore[arg-type]
              if watch is not None else None)
    try:
        for _ in range(steps):
            x = torch.randn(16, 8)
            with torch.autocast("cpu", dtype=torch.float16):
                if teacher_first:
                    with torch.no_grad():
                        t = teacher(x)
                s = student(x)
                if not teacher_first:
                    with torch.no_grad():
                        t = teacher(x)
                loss = nn.functional.kl_div(nn.functional.log_softmax(s.float(), -1),
                                            nn.functional.softmax(t.float(), -1),
                                            reduction="batchmean")
            losses.append(loss.item())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    finally:
        if doctor is not None:
            doctor.close()
    return losses, [p.detach().clone() for p in student.parameters()], doctor


@pytest.mark.parametrize("teacher_first", [True, False])
@pytest.mark.parametrize("kw", [{"every": 1}, {}, {"every": 1, "anomaly": True}],
                         ids=["every1", "default", "anomaly"])
def test_a_frozen_teacher_under_no_grad_is_watched_and_blamed(
        teacher_first: bool, kw: dict[str, object]) -> None:
    # Before: the teacher's no_grad call was taken for inference, never recorded, and the
    # NaN loss was blamed on "the loss computation", the backoffs on the student.
    losses, params, doctor = _distill(teacher_first, kw)
    plain_losses, plain_params, _ = _distill(teacher_first, None)
    assert any(math.isnan(v) for v in losses)  # the pathology happened
    assert [str(v) for v in losses] == [str(v) for v in plain_losses]  # bit-identical
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    assert doctor is not None
    s = doctor.session
    assert s.steps == 6
    errs = [f for f in s.findings if f.severity in ("error", "warning")]
    want = "nonfinite_forward" if kw.get("anomaly") else "activation_overflow"
    assert [(f.kind, f.module) for f in errs] == [(want, "teacher.2")]
    loss = s.findings_of("nonfinite_loss")[0]
    assert loss.module == "teacher.2" and loss.severity == "info"
    teacher2 = next(layer for layer in s.layers if layer.name == "teacher.2")
    assert teacher2.recorded_steps == s.recorded_steps  # from the first step on
    student = next(layer for layer in s.layers if layer.name == "student.2")
    assert student.recorded_steps == s.recorded_steps
    # The teacher's work is filed into its own iteration's step.
    assert all("teacher.2" in r.layers for r in s.history)


def test_raise_mode_stops_at_the_teachers_overflow() -> None:
    with pytest.raises(amp_doctor.NonFiniteError, match="teacher.2") as info:
        _distill(True, {"on_nonfinite": "raise"})
    assert "at step 0" in str(info.value)


def test_validation_of_the_trained_model_under_no_grad_is_still_inference() -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            x = torch.randn(4, 16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)
    first = next(layer for layer in doctor.session.layers if layer.name != "")
    assert first.calls == 3  # the three training calls, not the validation ones


def test_a_teacher_under_inference_mode_first_in_the_step_leaves_the_run_whole() -> None:
    # A teacher run under inference_mode (its output cloned for the loss) first in each
    # step: from the second step on it is a companion, whose call files the step's first
    # tensor. Before: the staging buffer made then was an inference tensor, and the
    # student's forward, filing into it, raised "Inplace update to inference tensor
    # outside InferenceMode" inside the user's step.
    def run(watch: bool) -> tuple[list[float], amp_doctor.Watch | None]:
        torch.manual_seed(0)
        teacher = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
        student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        doctor = (amp_doctor.watch({"student": student, "teacher": teacher}, every=1,
                                   tensorboard=False) if watch else None)
        losses = []
        try:
            for _ in range(4):
                x = torch.randn(16, 8)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    with torch.inference_mode():
                        t = teacher(x)
                    loss = (student(x).float() - t.float().clone()).pow(2).mean()
                losses.append(loss.item())
                opt.zero_grad()
                loss.backward()
                opt.step()
        finally:
            if doctor is not None:
                doctor.close()
        return losses, doctor

    losses, doctor = run(True)
    assert [str(v) for v in losses] == [str(v) for v in run(False)[0]]
    assert doctor is not None and doctor.session.steps == 4
    teacher2 = next(layer for layer in doctor.session.layers if layer.name == "teacher.2")
    assert teacher2.recorded_steps == 3  # from the second step on (see _companion)


def test_a_sanity_check_of_two_models_under_inference_mode_is_not_a_step() -> None:
    # Lightning validates every model under inference_mode before training (its sanity
    # check): before, the first model's call was taken for a teacher's run first in the
    # very first iteration, and its values (here overflowing float16) filed into step 0.
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    with amp_doctor.watch({"gen": gen, "disc": disc}, every=1, tensorboard=False) as doctor:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
            disc(gen(torch.full((4, 8), 1e5)))  # the sanity check, on a huge batch
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                d_loss = disc(gen(torch.randn(4, 8)).detach()).float().mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            with torch.autocast("cpu", dtype=torch.float16):
                g_loss = -disc(gen(torch.randn(4, 8))).float().mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
    s = doctor.session
    assert [f.kind for f in s.findings if f.severity != "info"] == []
    gen0 = next(layer for layer in s.layers if layer.name == "gen.0")
    assert gen0.calls == 6  # two a training step, none from the sanity check


@pytest.mark.parametrize("scaled", [False, True])
def test_gradients_that_all_flush_to_zero_are_an_error(scaled: bool) -> None:
    # A tiny loss weight in float16: the loss's gradient flushes to zero on its way back,
    # every weight gradient is exactly 0 and the model does not train. Before: "AMP looks
    # healthy" (an underflow share counts subnormals, and these are zeros).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000, enabled=scaled)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            x, y = torch.randn(32, 16), torch.randn(32, 1)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y) * 1e-9
            opt.zero_grad()
            scaler.scale(loss).backward()
            assert model[0].weight.grad is not None
            assert not model[0].weight.grad.any()  # the pathology happened
            scaler.step(opt)
            scaler.update()
    errs = errors(doctor.session)
    kind = "gradient_underflow" if scaled else "missing_scaler"
    assert [(f.kind, f.module) for f in errs] == [(kind, "3")]
    assert errs[0].message.startswith("Every parameter gradient was exactly zero in all 4")
    assert "does not train" in errs[0].message


def test_a_zero_loss_with_zero_gradients_is_not_a_flush() -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().sum() * 0.0
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not errors(doctor.session)


@pytest.mark.parametrize("anomaly", [False, True])
def test_a_nan_loss_on_an_unrecorded_step_proposes_anomaly_mode_only_when_off(
        anomaly: bool) -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with amp_doctor.watch(model, every=10, anomaly=anomaly, tensorboard=False) as doctor:
        for i in range(14):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean() * (
                    math.inf if i == 6 else 1.0)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    f = doctor.session.findings_of("nonfinite_loss")[0]
    assert f.step == 6 and "where it appeared is unknown (record every step with `every=1`" \
        in f.message
    assert ("or use anomaly mode" in f.message) is not anomaly


def test_a_container_that_passes_its_last_layers_output_on_repeats_no_finding() -> None:
    # Review 34: float16 without a GradScaler, a loss of ~1e-7 (small regression targets):
    # the last Linear's gradients underflow, and the Sequential around it, whose output
    # and output gradient are that Linear's own tensors, got the same warning again (a
    # LightningModule around it a third): the counts --fail-on and compare read doubled.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    w = torch.randn(16) * 1e-3
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(200):
            x = torch.randn(128, 16)
            y = (x @ w + 2e-4 * torch.randn(128))[:, None]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x) - y.half()) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    root = next(lay for lay in s.layers if lay.type == "Sequential")
    assert root.passthrough
    flagged = {f.module for f in s.findings if f.kind in ("missing_scaler",
                                                          "gradient_underflow")}
    assert "4" in flagged and root.name not in flagged
    assert all(s.layer(m).type != "Sequential" for m in flagged if m is not None)


def test_a_confident_classifiers_negligible_subnormal_gradients_are_no_finding() -> None:
    # Review 34 (HIGH): a healthy float16 classifier, once confident, has wrong-class
    # logit gradients of p < 1e-7 that are float16 subnormals, 10-27% of its output
    # gradients, and got gradient_underflow warnings on 1-3 layers. They lie more than 24
    # bits below each tensor's largest gradient (hundreds to thousands, scaled): below
    # float32's resolution of every sum they are in, so flushing them changes nothing.
    torch.manual_seed(0)
    d, k = 32, 8
    w = torch.randn(d, k)
    xs = torch.randn(20000, d)
    ys = (xs @ w + 0.5 * torch.randn(20000, k)).argmax(1)
    net = nn.Sequential(nn.Linear(d, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 128),
                        nn.GELU(), nn.Linear(128, k))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(net, tensorboard=False) as doctor:
        for _ in range(1000):
            idx = torch.randint(0, 20000, (64,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(net(xs[idx]), ys[idx])
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
    s = doctor.session
    assert loss.item() < 0.3  # it learned, and is confident
    subnormal = [lay for lay in s.layers if (lay.grad_underflow_frac or 0) > 0.10]
    assert subnormal  # the subnormals are there ...
    for lay in subnormal:  # ... far below each tensor's largest gradient
        assert lay.grad_absmax is not None and lay.grad_absmax >= 2.0 ** 9
    assert [f for f in s.findings if f.severity != "info"] == []


def test_a_nan_made_in_a_parents_own_code_points_to_it_and_to_anomaly_mode() -> None:
    # Review 34 (HIGH): attention logits overflowing float16 in the attention module's own
    # code (q @ k^T without 1/sqrt(d)) first show in the output of its next child, o: the
    # report named o and advised float32 for it, which does not help. Only outputs are
    # watched, so the message now says where else the op can be, and how to name it.
    s, loss = _attention_overflowing_in_its_own_code(anomaly=False)
    assert not math.isfinite(loss)
    f = s.findings_of("nonfinite_loss")[0]
    assert f.module == "attn.o"
    assert ("Its input is not checked: if it was non-finite already, the op that made it is "
            "in attn's own forward code before attn.o") in f.message
    assert "`--anomaly`" in f.message


def test_a_run_that_diverged_before_it_overflowed_is_told_so() -> None:
    # Review 34 (HIGH): a learning rate that keeps rising (a warmup that never stops)
    # makes the loss and the weights grow until float16 overflows; the report named the
    # overflowing layer and advised float32 or bfloat16 for it, which only delays the NaN
    # (the same run goes NaN in float32). The loss climb before the overflow now says so.
    torch.manual_seed(0)
    d = 32
    w = torch.randn(d, 1) / d ** 0.5
    model = nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for it in range(450):
            for group in opt.param_groups:
                group["lr"] = 0.02 * (1 + it / 20)
            x = torch.randn(64, d)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), torch.sin(3 * x @ w) + x @ w)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    errors = [f for f in s.findings if f.severity == "error"]
    assert [f.kind for f in errors] == ["activation_overflow"]
    d_ = errors[0].data["diverged"]
    assert d_["high"] > 10 * d_["low"] and d_["low_step"] < d_["high_step"]
    assert "the run was diverging, and the overflow may be its end" in errors[0].message
    assert errors[0].advice.startswith("The loss climbed before any overflow: lower the "
                                       "learning rate")
    # A run whose loss only fell is not told so. Its first layer overflowed by itself (its
    # finite outputs reached float16's max): the NaN loss does not say that the op may be
    # before it.
    healthy = analyze_healthy_overflow()
    assert not [f for f in healthy.findings if "diverged" in f.data]
    loss_f = healthy.findings_of("nonfinite_loss")
    assert loss_f and all("Its input is not checked" not in f.message for f in loss_f)


def analyze_healthy_overflow() -> Session:
    """An overflow from the first step (weights too large), the loss never climbing."""
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.fc1.weight.mul_(3e5)  # its outputs pass float16's max
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        train(model, steps=5)
    assert [f.kind for f in doctor.session.findings if f.severity == "error"]
    return doctor.session


def test_anomaly_mode_gives_one_error_for_an_op_in_a_parents_own_code() -> None:
    # Review 34 (MEDIUM): an attention module's own q @ k^T overflowed; anomaly mode named
    # the op in `attn`, and the NaN loss, first seen in the output of its child `attn.o`,
    # was an error of its own (listed first): two or three errors for one cause.
    s, _ = _attention_overflowing_in_its_own_code(anomaly=True)
    assert [(f.kind, f.module, f.op) for f in errors(s)] == [
        ("nonfinite_forward", "attn", "aten.mul")]
    loss_f = s.findings_of("nonfinite_loss")[0]
    assert loss_f.severity == "info" and loss_f.data["follow_on_of"] == "attn"
    assert "the loss was NaN/inf in 3 of the 3 steps checked" in errors(s)[0].message
    # One op of one module that overflowed where a mask hid it, and later made NaN that
    # reached the output: one error, at its first step.
    hidden = _finding("activation_overflow", "attn", "aten.bmm", step=941, hidden=True)
    later = _finding("nonfinite_forward", "attn", "aten.bmm", step=974)
    other = _finding("nonfinite_forward", "mlp", "aten.div", step=980)
    out = fold_follow_ons(s, [later, hidden, other])
    assert [(f.kind, f.severity) for f in out] == [("nonfinite_forward", "info"),
                                                    ("activation_overflow", "error"),
                                                    ("nonfinite_forward", "error")]
    assert "The same op again later: nonfinite_forward at step 974." in out[1].message


class _Attn(nn.Module):
    """Attention whose own q @ k^T (in its forward, between its children) overflows
    float16: the NaN shows first in the output of its child ``o``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att = (self.q(x) @ self.k(x).transpose(-2, -1)) * 1e4  # overflows float16
        return self.o(att.softmax(-1))


class _AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = _Attn(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def _attention_overflowing_in_its_own_code(anomaly: bool) -> tuple[Session, float]:
    """3 float16 steps of :class:`_AttnNet` with a GradScaler: the session, the last loss."""
    torch.manual_seed(0)
    model = _AttnNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, anomaly=anomaly, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(10 * torch.randn(2, 4, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session, loss.item()
