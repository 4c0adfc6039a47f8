"""-inf written on purpose is a mask, not an overflow (review 39).

An RL policy's ``logits.masked_fill(~legal, -inf)``, a causal-mask submodule, and a
Hugging Face-style additive mask ``(1 - mask) * finfo(float32).min`` that autocast casts
to float16 (-inf) all put -inf in a healthy run. Each was an ERROR (or, in raise mode, a
``NonFiniteError`` that ended a healthy run). A layer that overflows to -inf alone, and a
cast of values that really are beyond float16's max, still are.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor
from amp_doctor.errors import NonFiniteError


class Policy(nn.Module):
    """Illegal actions masked with -inf in the model's own output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.logits = nn.Linear(64, 10)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.logits(self.body(obs)).masked_fill(~legal, float("-inf"))


def _train_policy(model: nn.Module, dtype: torch.dtype, steps: int = 12) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    sc = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        obs = torch.randn(32, 12, generator=g)
        legal = torch.rand(32, 10, generator=g) < 0.6
        legal[:, 0] = True
        target = torch.where(legal, torch.rand(32, 10, generator=g), -1.0).argmax(-1)
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(obs, legal), target)
        opt.zero_grad()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_action_mask_in_the_models_output_is_an_info_not_an_overflow(dtype) -> None:
    torch.manual_seed(0)
    plain = Policy()
    watched = Policy()
    watched.load_state_dict(plain.state_dict())
    want = _train_policy(plain, dtype)
    with amp_doctor.watch(watched, every=1) as doctor:
        got = _train_policy(watched, dtype)
    assert got == want and all(math.isfinite(v) for v in got)
    s = doctor.session
    assert [(f.kind, f.severity, f.module) for f in s.findings] == [
        ("neg_inf_mask", "info", "Policy")]
    f = s.findings[0]
    assert f.data["neg_inf_frac"] > 0.2  # about 40% of the logits are masked
    assert 0 < f.data["largest_finite"] < 8
    assert "a mask written on purpose" in f.message
    lay = next(lay for lay in s.layers if lay.name == "Policy")
    assert lay.neg_inf_steps == lay.nonfinite_steps == 12 and lay.grad_nonfinite_steps == 0
    row = next(line for line in doctor.report().splitlines() if line.startswith("Policy "))
    assert "-inf mask" in row and " inf " not in row
    assert "-inf mask: the output held -inf written on purpose" in " ".join(
        doctor.report().split())


class CausalMask(nn.Module):
    def __init__(self, t: int) -> None:
        super().__init__()
        self.register_buffer("tril", torch.tril(torch.ones(t, t)).bool())

    def forward(self, att: torch.Tensor) -> torch.Tensor:
        t = att.shape[-1]
        return att.masked_fill(~self.tril[:t, :t], float("-inf"))


class Attn(nn.Module):
    def __init__(self, d: int = 32, t: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.maskmod = CausalMask(t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        att = self.maskmod((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]))
        return self.proj(att.softmax(-1) @ v)


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.attn = Attn()
        self.head = nn.Linear(32, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        return self.head(x + self.attn(x))


def test_a_causal_mask_submodule_with_anomaly_mode_gives_no_error() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with amp_doctor.watch(model, every=1, anomaly=True) as doctor:
        for _ in range(8):
            idx = torch.randint(0, 50, (4, 16), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(idx).view(-1, 50), idx.roll(-1, 1).view(-1))
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    s = doctor.session
    assert [(f.kind, f.module) for f in s.findings] == [("neg_inf_mask", "attn.maskmod")]
    assert not [e for e in s.events if e.kind.startswith("nonfinite")]


class Overflowing(nn.Module):
    """A float16 Linear whose outputs run from -1e5 to -4e4: -inf where beyond the max,
    finite values next to it. An overflow to -inf alone, not a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        with torch.no_grad():
            self.fc.weight.fill_(0.0)
            self.fc.bias.copy_(torch.linspace(-1e5, -4e4, 8))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(x).float().clamp(min=-7e4) * 1e-5)


def test_a_layer_overflowing_to_minus_inf_alone_is_still_an_overflow() -> None:
    torch.manual_seed(0)
    model = Overflowing()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with amp_doctor.watch(model, every=1) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, 4))
            out.float().sum().backward()
            opt.step()
            opt.zero_grad()
    s = doctor.session
    lay = next(lay for lay in s.layers if lay.name == "fc")
    assert lay.neg_inf_steps == lay.nonfinite_steps == 3  # only -inf, no NaN or +inf
    kinds = [(f.kind, f.severity, f.module) for f in s.findings]
    assert ("activation_overflow", "error", "fc") in kinds
    assert not [k for k in kinds if k[0] == "neg_inf_mask"]


class Encoder(nn.Module):
    """A float32 additive padding mask, ``(1 - mask) * finfo(float32).min``, given to
    ``scaled_dot_product_attention`` under float16 autocast: autocast casts it to
    float16, where -3.4e38 is -inf."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.cls = nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor,
                fill: float = torch.finfo(torch.float32).min) -> torch.Tensor:
        x = self.emb(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        ext = (1.0 - mask[:, None, None, :].float()) * fill
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=ext)
        return self.cls(a.transpose(1, 2).reshape(b, t, d)[:, 0])


def _train_encoder(model: Encoder, steps: int, fill: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 100, (8, 12), generator=g)
        lens = torch.randint(4, 13, (8,), generator=g)
        mask = torch.arange(12)[None] < lens[:, None]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(ids, mask, fill), torch.randint(0, 2, (8,), generator=g))
        opt.zero_grad()
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        losses.append(loss.item())
    return losses


def test_autocasts_cast_of_a_finfo_min_padding_mask_is_no_origin_even_in_raise_mode() -> None:
    torch.manual_seed(0)
    model = Encoder()
    with amp_doctor.watch(model, every=1, anomaly=True, on_nonfinite="raise") as doctor:
        losses = _train_encoder(model, 6, torch.finfo(torch.float32).min)
    assert all(math.isfinite(v) for v in losses)
    assert not [e for e in doctor.session.events if e.kind.startswith("nonfinite")]
    assert not doctor.session.findings


def test_a_cast_of_values_really_beyond_float16_is_still_the_origin() -> None:
    # -1e5 is no format's lowest value: a cast of it to float16 is an overflow.
    torch.manual_seed(0)
    model = Encoder()
    with pytest.raises(NonFiniteError, match=r"aten\._to_copy"):
        with amp_doctor.watch(model, every=1, anomaly=True, on_nonfinite="raise"):
            _train_encoder(model, 2, -1e5)


class LogOfSoftmax(nn.Module):
    """``log(softmax(x))``: a float16 softmax underflows to 0 and its log is -inf alone,
    exactly what a mask looks like to the layer's figures."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 10)
        self.sm = nn.Softmax(-1)
        self.log = Log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log(self.sm(self.fc(x) * 40))


class Log(nn.Module):
    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return torch.log(p)


def test_a_log_of_zero_that_makes_the_loss_inf_is_the_losss_error_not_a_mask() -> None:
    """Before: "a mask written on purpose" (info) for the -inf that made every loss inf, and
    a second error, the scale collapse the inf loss caused."""
    torch.manual_seed(0)
    model = LogOfSoftmax()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    losses = []
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(12):
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = nn.functional.nll_loss(out.float(), y)
            losses.append(loss.item())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert all(v == math.inf for v in losses)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        p = model.sm(model.fc(x) * 40)
    assert (p == 0).any() and torch.isneginf(torch.log(p)).any()
    s = doctor.session
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module) for f in errors] == [("nonfinite_loss", "log")], errors
    assert ("That output held -inf and never +inf or NaN: a log of values that underflowed "
            "to 0 (the log of a float16 softmax or sigmoid)") in errors[0].message
    assert "F.log_softmax" in errors[0].advice
    assert "the loss scale collapsed to 16" in errors[0].message
    assert not s.findings_of("neg_inf_mask")
    assert s.findings_of("scale_collapse")[0].severity == "info"


def test_a_causal_mask_before_a_layer_overflowing_from_the_first_step_is_not_blamed() -> None:
    """The head overflows float16 from step 0 (a bfloat16-trained model fine-tuned in
    float16): no step has a finite loss to show the mask beside it. Before: the loss's
    error named the mask, with log(0) advice (review 42c)."""
    torch.manual_seed(0)
    model = TinyGPT()
    with torch.no_grad():
        model.head.weight.mul_(1e5)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with amp_doctor.watch(model, every=1) as doctor:
        for _ in range(4):
            idx = torch.randint(0, 50, (4, 16), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(idx)
                loss = F.cross_entropy(out.view(-1, 50).float(), idx.roll(-1, 1).view(-1))
            assert torch.isposinf(out).any() and not math.isfinite(loss.item())
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    s = doctor.session
    errors = [f for f in s.findings if f.severity == "error"]
    assert [f.module for f in errors] == ["head"], errors
    assert not any("log of values" in f.message for f in s.findings)
