"""Stop 45's fixes: what-ifs that say what they cannot see, and wording."""

from __future__ import annotations

import torch
from torch import nn

import amp_doctor


class _Attention(nn.Module):
    """Hand-written attention whose scores are large: beyond float16's max inside the
    module, while every layer's output (a softmax-weighted mean) stays small."""

    def __init__(self, d: int = 16, temperature: float = 1.0) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.temperature = temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        att = (q @ k.transpose(-2, -1)) * self.temperature
        return self.proj(att.softmax(-1) @ v)


def _train(model: nn.Module, dtype: torch.dtype, steps: int = 4,
           **watch_kw: object) -> tuple[list[float], amp_doctor.Session | None]:
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses: list[float] = []

    def loop() -> None:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype):
                loss = model(torch.randn(2, 8, 16)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())

    if not watch_kw:
        loop()
        return losses, None
    with amp_doctor.watch(model, every=1, tensorboard=False, **watch_kw) as doctor:
        loop()
    return losses, doctor.session


def test_a_float16_what_if_names_what_it_cannot_see() -> None:
    """Review 44d: a bfloat16 nanoGPT whose attention scores overflow float16 inside the
    attention module got a what-if that blamed only layers' outputs. The simulation reads
    layers' outputs; it now says so, and how to check the rest."""
    torch.manual_seed(0)
    model = _Attention(temperature=3e5)
    fp16 = _Attention(temperature=3e5)
    fp16.load_state_dict(model.state_dict())
    # The blind spot is real: in float16 the scores overflow and the loss is NaN ...
    fp16_losses, _ = _train(fp16, torch.float16)
    assert any(v != v for v in fp16_losses), fp16_losses
    # ... while no layer's output leaves float16's range in the bfloat16 run.
    _, s = _train(model, torch.bfloat16, target_dtype="float16")
    assert s is not None
    (wi,) = [f for f in s.findings if f.kind == "whatif_float16"]
    assert "not simulated" in wi.advice and "`amp-doctor diagnose --anomaly`" in wi.advice
    assert "q @ k.transpose(-2, -1)" in wi.advice


def test_an_asked_float16_what_if_that_finds_nothing_says_so() -> None:
    torch.manual_seed(0)
    _, s = _train(_Attention(temperature=0.25), torch.bfloat16, target_dtype="float16")
    assert s is not None
    (wi,) = [f for f in s.findings if f.kind == "whatif_float16"]
    assert wi.severity == "info" and wi.data["rows"] == []
    assert "no watched layer's outputs or output gradients would leave float16's range" \
        in wi.message
    assert "not simulated" in wi.advice
    # Unasked, a bfloat16 run that would fit float16 gets no such finding.
    torch.manual_seed(0)
    _, quiet = _train(_Attention(temperature=0.25), torch.bfloat16, target_dtype=None)
    assert quiet is not None
    assert not [f for f in quiet.findings if f.kind == "whatif_float16"]
