"""Review 42a (real-style code: MoE, adapters): layers named in the wrong order.

- A submodule that does not run every step (an MoE expert that got no tokens, an
  adapter switched on later) was placed in forward order where it was first seen:
  after the model's output. Its overflow was then blamed on its parent, and with
  anomaly mode there were two errors for one cause.
- A layer whose weights' gradients alone overflowed in its own backward (its output
  gradient finite) was listed after the layers its backward fed: "in backward order:
  enc, head" of a head whose backward ran first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor
from tests.recipes import classify


class MoE(nn.Module):
    """Two experts; expert 1's second Linear overflows float16 (its weights x 3e5), and
    it runs only in ``active_steps`` when ``sporadic``."""

    def __init__(self, d: int, sporadic: bool) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(d, d), nn.Linear(d, d)) for _ in range(2)])
        with torch.no_grad():
            self.experts[1][1].weight.mul_(3e5)
        self.sporadic = sporadic
        self.active_steps = {2, 5}
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            if e == 1 and self.sporadic and self.step not in self.active_steps:
                continue
            sel = torch.arange(e, x.shape[0], 2)
            out = out.index_add(0, sel, ex(x[sel]))
        return out


class Net(nn.Module):
    def __init__(self, sporadic: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.moe = MoE(16, sporadic)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(F.relu(self.inp(x))))


def _train(model: Net, anomaly: bool = False, steps: int = 6,
           every: int = 1) -> amp_doctor.Session:
    torch.manual_seed(1)
    return classify(model, steps, (6, 8, 3), lambda step: setattr(model.moe, "step", step),
                     lr=1e-2, every=every, anomaly=anomaly)


def test_an_expert_first_seen_in_a_later_step_takes_its_place_in_forward_order() -> None:
    torch.manual_seed(0)
    model = Net(sporadic=True)
    # Independently: the expert's own Linear makes the inf from a finite input.
    x = torch.randn(3, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = model.moe.experts[1][0](x)
        assert torch.isfinite(h).all() and torch.isinf(model.moe.experts[1][1](h)).any()
    s = _train(model)
    order = [lay.name for lay in sorted(s.layers, key=lambda lay: lay.order)]
    assert order.index("moe.experts.1.1") < order.index("moe") < order.index("head")
    assert order.index("moe.experts.0.1") < order.index("moe.experts.1.0")
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module) for f in errors] == [
        ("activation_overflow", "moe.experts.1.1")], errors
    assert "only carried its inf/NaN on and are not separate problems: moe" in \
        errors[0].message


def test_with_anomaly_mode_the_late_experts_overflow_is_one_error() -> None:
    torch.manual_seed(0)
    s = _train(Net(sporadic=True), anomaly=True)
    errors = [f for f in s.findings if f.severity == "error"]
    assert len(errors) == 1 and errors[0].module == "moe.experts.1.1", errors


def test_an_unlocated_nan_loss_is_not_called_scaled_gradients_overflowing() -> None:
    """The expert runs at steps 2 and 14 only, both unrecorded: the search after step 2
    sees no NaN, and two bad steps 12 apart aim past the run's end. Before: "Scaled
    gradients beyond float16's max are what a GradScaler skips" of steps whose loss was
    inf (review 42a)."""
    torch.manual_seed(0)
    model = Net(sporadic=True)
    model.moe.active_steps = {2, 14}
    s = _train(model, anomaly=True, steps=20, every=10)
    assert s.scaler is not None and s.scaler.skipped_steps == [2, 14]
    (loss,) = s.findings_of("nonfinite_loss")
    assert loss.data["bad_steps"] == [2, 14]
    (f,) = s.findings_of("nonfinite_unlocated")
    assert f.severity == "info" and "what a GradScaler skips" not in f.message
    assert "The GradScaler skipped steps whose loss was already NaN/inf (first at step 2" in \
        " ".join(f.message.split())


class Adapter(nn.Module):
    """enc -> adapter (weights x 2000) -> head: head's weight gradient, the adapter's huge
    output times head's output gradient, overflows in head's own backward, the first to
    run; enc's output gradient overflows later, in the adapter's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 32)
        self.adapter = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        with torch.no_grad():
            self.adapter.weight.mul_(2000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.adapter(F.relu(self.enc(x))))


def test_a_layer_whose_weight_gradient_overflows_in_its_own_backward_is_first() -> None:
    torch.manual_seed(0)
    model = Adapter()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    seen: dict[str, list[bool]] = {"head_w": [], "head_out": [], "enc_out": []}
    outs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> object:
        def hook(m: nn.Module, i: object, o: torch.Tensor) -> None:
            outs[name] = o
            o.register_hook(lambda g: seen[f"{name}_out"].append(bool(torch.isfinite(g).all())))
        return hook

    model.head.register_forward_hook(keep("head"))
    model.enc.register_forward_hook(keep("enc"))
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            x, y = torch.randn(16, 8) * 4, torch.randint(0, 4, (16,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            seen["head_w"].append(bool(torch.isfinite(model.head.weight.grad).all()))
            scaler.step(opt)
            scaler.update()
    # Independently: head's output gradient is finite, its weight gradient is not, and
    # enc's output gradient is not.
    assert seen["head_out"] == [True] * 4 and seen["head_w"] == [False] * 4
    assert seen["enc_out"] == [False] * 4
    (b,) = doctor.session.findings_of("scaler_backoff")
    assert "in backward order: head, enc. The first, head, is where they appeared" in \
        " ".join(b.message.split())
    assert all(e.culprits[:2] == ["head", "enc"] for e in doctor.session.scaler.events)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)  # float32 under autocast: it finishes first
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(t))[0][:, -1])


def test_a_first_forward_that_dies_in_a_float16_op_is_not_called_autocast_inactive() -> None:
    """nn.LSTM has no float16 kernel on the CPU: the first forward raises, before any
    layer finished in float16. Before: "Autocast (float16) was on, yet no layer ran in
    float16 ... check that autocast wraps the forward pass" beside run_ended_early."""
    torch.manual_seed(0)
    model = Recurrent()
    x = torch.randint(0, 50, (4, 5))
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError) as plain:
        model(x)
    doctor = amp_doctor.watch(model, every=1, tensorboard=False)
    with pytest.raises(RuntimeError) as watched, doctor:
        with torch.autocast("cpu", dtype=torch.float16):
            model(x).sum().backward()
    assert str(watched.value) == str(plain.value)
    s = doctor.session
    assert [f.kind for f in s.findings] == ["run_ended_early"], s.findings
    assert s.run.outcome == "exception"
    assert [lay.name for lay in s.layers if lay.output_dtypes] == ["emb"]


def test_a_run_that_switches_autocast_dtype_midway_names_both_in_the_header() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for step in range(6):
            dtype = torch.float16 if step < 4 else torch.bfloat16
            with torch.autocast("cpu", dtype=dtype):
                loss = F.cross_entropy(model(torch.randn(8, 16)), torch.zeros(8).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert s.amp.dtype == "float16" and s.amp.other_dtypes == ["bfloat16"]
    assert ": cpu | float16 autocast (also bfloat16) |" in doctor.report().splitlines()[0]
    assert amp_doctor.Session.from_json(s.to_json()).amp.other_dtypes == ["bfloat16"]


# -- review 42b: regressions of the changes above --------------------------------------


class SharedAct(nn.Module):
    """``self.act`` serves two branches (torchvision's BasicBlock calls its ReLU twice);
    B overflows float16 from step 3."""

    def __init__(self) -> None:
        super().__init__()
        self.A, self.B, self.E = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(8, 16)
        self.D, self.act = nn.Linear(16, 2), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.B(self.act(self.A(x)))
        return self.D(g + self.act(self.E(x)))


def test_a_module_called_twice_keeps_forward_order_and_the_origin() -> None:
    """Before: after the shared act's second call, every new layer went right after its
    first call: E and D before B, and D named where the NaN loss first showed."""
    torch.manual_seed(0)
    model = SharedAct()
    done: list[str] = []
    for name in ("A", "B", "E", "D", "act"):
        getattr(model, name).register_forward_hook(
            lambda m, i, o, name=name: done.append(name) if name not in done else None)
    s = classify(model, 6, (16, 8, 2), _blow_up_at(3, model.B), every=1)
    assert done == ["A", "act", "B", "E", "D"]  # the first completions, as python saw them
    order = [lay.name for lay in sorted(s.layers, key=lambda lay: lay.order)]
    assert order == ["A", "act", "B", "E", "D", "SharedAct"]
    (loss_f,) = s.findings_of("nonfinite_loss")
    assert loss_f.module == "B" and "It first appeared in B's output" in \
        " ".join(loss_f.message.split())


def _blow_up_at(step: int, layer: nn.Linear) -> Callable[[int], None]:
    """Multiply ``layer``'s weights by 1e6 at ``step``: it overflows float16 from then on."""
    def before(i: int) -> None:
        if i == step:
            with torch.no_grad():
                layer.weight.mul_(1e6)
    return before


class _Boom(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by 1e6."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * 1e6


class StemMidHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.mid, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, boom: bool) -> torch.Tensor:
        h = self.stem(x)
        if boom:
            h = _Boom.apply(h)
        return self.head(torch.relu(self.mid(h)))


@pytest.mark.parametrize("boom_first", [True, False])
def test_with_two_backward_calls_a_weight_gradient_overflow_is_not_placed_with_certainty(
        boom_first: bool) -> None:
    """Accumulation: stem's output gradient goes inf in one backward call; head's and
    mid's weight gradients alone overflow in the other. Which came first is not known
    from the step's figures (its parameter gradients are read once, at its end). Review
    42b: "in backward order: head, mid, stem. The first, head, ..." when stem's came
    first; review 42c: "stem, head, mid. The first, stem, ..." when it came second."""
    torch.manual_seed(0)
    model = StemMidHead()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    bad_after: list[list[str]] = []
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            opt.zero_grad()
            for micro in range(2):
                boom = (micro == 0) == boom_first
                x = torch.randn(4, 8) if boom else torch.randn(4096, 8) * 8
                y = torch.randint(0, 4, (x.shape[0],))
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x, boom=boom), y, reduction="sum")
                scaler.scale(loss).backward()
                bad_after.append([n for n in ("stem", "mid", "head")
                                  if not torch.isfinite(getattr(model, n).weight.grad).all()])
            scaler.step(opt)
            scaler.update()
    # Independently: after the first backward only stem's weight gradient is bad, or
    # all three are (the big batch came first).
    assert bad_after[0] == (["stem"] if boom_first else ["stem", "mid", "head"])
    assert bad_after[1] == ["stem", "mid", "head"]
    (b,) = doctor.session.findings_of("scaler_backoff")
    text = " ".join(b.message.split())
    assert "in backward order" not in text and "is where they appeared" not in text
    assert ("non-finite gradients in 3 layer(s): stem, head, mid. The first with a "
            "non-finite output gradient is stem; only the weights' gradients of head, mid "
            "went non-finite, in one of the step's backward calls, so whether they came "
            "before it is not known") in text


class ActionMask(nn.Module):
    def forward(self, logits: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(~legal, float("-inf"))


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.pi, self.v = nn.Linear(8, 32), nn.Linear(32, 6), nn.Linear(32, 1)
        self.mask = ActionMask()

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.relu(self.trunk(obs))
        return self.mask(self.pi(h), legal), self.v(h)


def test_a_mask_before_the_layer_that_made_the_loss_inf_is_not_blamed() -> None:
    """An action mask holds -inf every step; the value head overflows from step 3 and
    the loss is inf. Before: the loss's error named the mask, with log(0) advice."""
    torch.manual_seed(0)
    model = ActorCritic()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for step in range(8):
            if step == 3:
                with torch.no_grad():
                    model.v.weight.mul_(1e6)
            obs, legal = torch.randn(32, 8), torch.rand(32, 6) > 0.3
            legal[:, 0] = True
            act, ret = torch.multinomial(legal.float(), 1).squeeze(1), torch.randn(32)
            with torch.autocast("cpu", dtype=torch.float16):
                logits, value = model(obs, legal)
                logp = torch.log_softmax(logits.float(), -1).gather(1, act[:, None]).squeeze(1)
                v = value.squeeze(1).float()
                loss = -(logp * (ret - v).detach()).mean() + (ret - v).pow(2).mean()
            losses.append(loss.item())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert all(math.isfinite(v) for v in losses[:3]) and not any(
        math.isfinite(v) for v in losses[3:])
    s = doctor.session
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module) for f in errors] == [("nonfinite_loss", "v")], errors
    assert "log" not in errors[0].advice
    assert s.findings_of("neg_inf_mask")[0].module == "mask"


class BasicBlock(nn.Module):
    """torchvision's BasicBlock shape: one ReLU module called twice; its second call
    carries fc2's inf on (review 42c)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(d, d), nn.LayerNorm(d)
        self.fc2, self.bn2 = nn.Linear(d, d), nn.LayerNorm(d)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.fc2(self.relu(self.bn1(self.fc1(x)))))
        return self.relu(out + x)


def test_a_module_called_twice_is_not_the_origin_of_what_its_second_call_carried() -> None:
    """Before: "It first appeared in block.relu's output": the ReLU's figures merge its
    two calls, and its first call came before fc2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), BasicBlock(), nn.Linear(32, 2))
    first_bad: list[str] = []
    for name, m in model.named_modules():
        m.register_forward_hook(
            lambda m, i, o, name=name: first_bad.append(name)
            if not torch.isfinite(o).all() and len(first_bad) == 0 else None)
    s = classify(model, 5, (16, 8, 2), _blow_up_at(3, model[1].fc2), every=1)
    assert first_bad[0] == "1.fc2"
    errors = [f for f in s.findings if f.severity == "error"]
    assert [f.module for f in errors] == ["1.fc2"], errors
