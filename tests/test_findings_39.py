"""Review 39 (anomaly mode on a nanoGPT-like trainer): origins that were missed or
misnamed.

- A softmax over a row that a -inf mask covers whole makes NaN from inputs with no
  NaN: it was never an origin (its inputs were not finite), so the report blamed the
  next submodule and advised float32, and raise mode never raised.
- ``torch.where(z > 0, torch.log(z), 0)`` makes NaN that ``where`` drops: a healthy run
  got an ERROR.
- The backward of ``sqrt`` at 0 divides by 0: reported as an info "scaled overflow",
  while the backoffs it caused were the error, advising float32.
- (Review 39c, HF-style runs) a masked row's NaN that reaches the gradients while the
  loss stays finite; a -inf mask layer blamed for a calibrating scaler's backoffs; T5's
  log(0) in integer bucket maths.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor
from amp_doctor.errors import NonFiniteError
from tests.helpers import marked_line

THIS_FILE = __file__
T, C = 8, 16


def _line_of(marker: str) -> int:
    return marked_line(THIS_FILE, marker)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.pad_row = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(C, -1)
        att = q @ k.transpose(-2, -1) / math.sqrt(C)
        mask = ~torch.tril(torch.ones(T, T, dtype=torch.bool))
        if self.pad_row:
            mask[2, :] = True  # query 2 attends to nothing
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(att, dim=-1)  # SOFTMAX_LINE
        return self.proj(att @ v)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.head = nn.Linear(C, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def _train(model: Model, steps: int, bad_from: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        model.attn.pad_row = step >= bad_from
        x = torch.randn(4, T, C, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def test_a_row_masked_whole_names_the_softmax_once_with_mask_advice() -> None:
    torch.manual_seed(0)
    model = Model()
    with amp_doctor.watch(model, anomaly=True) as doctor:
        losses = _train(model, 8, bad_from=3)
    assert all(math.isfinite(v) for v in losses[:3]) and math.isnan(losses[3])
    s = doctor.session
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module, f.op) for f in errors] == [
        ("nonfinite_forward", "attn", "aten._softmax")]
    f = errors[0]
    assert f.frame == f"{THIS_FILE}:{_line_of('SOFTMAX_LINE')} in forward"
    assert "from float16 inputs without NaN (min -inf" in f.message
    assert "a row that the -inf mask covers whole" in f.message
    assert "the loss was NaN/inf in" in f.message  # the NaN loss folded in
    assert "torch.finfo(scores.dtype).min" in f.advice
    assert "bfloat16" not in f.advice  # a precision change does not help
    (loss,) = s.findings_of("nonfinite_loss")
    assert loss.severity == "info" and "It began at aten._softmax in attn" in loss.message
    assert "unknown" not in loss.message


def test_raise_mode_stops_at_the_softmax_of_a_row_masked_whole() -> None:
    torch.manual_seed(0)
    model = Model()
    with pytest.raises(NonFiniteError, match=(
            r"aten\._softmax in module 'attn' produced NaN from float16 inputs without NaN "
            r"at step 3 at .*:" + str(_line_of("SOFTMAX_LINE")))):
        with amp_doctor.watch(model, anomaly=True, on_nonfinite="raise"):
            _train(model, 6, bad_from=3)


def _safe_log_run(watch_kw: dict) -> tuple[list[float], amp_doctor.Watch]:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    losses = []
    with amp_doctor.watch(model, **watch_kw) as doctor:
        for _ in range(6):
            x = torch.randn(16, 8, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                z = model(x).float()
                safe = torch.where(z > 0, torch.log(z), torch.zeros_like(z))  # LOG_LINE
                loss = safe.mean() + z.pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return losses, doctor


def test_a_nan_that_torch_where_drops_is_info_not_an_error() -> None:
    losses, doctor = _safe_log_run({"anomaly": True})
    assert all(math.isfinite(v) for v in losses)
    s = doctor.session
    assert not [f for f in s.findings if f.severity == "error"], doctor.report()
    (f,) = [f for f in s.findings if f.kind == "nonfinite_discarded"]
    assert f.severity == "info" and f.op == "aten.log" and f.step == 0
    assert f.frame is not None and f.frame.startswith(f"{THIS_FILE}:{_line_of('LOG_LINE')}")
    assert "the step's loss stayed finite" in f.message
    assert "torch.log(torch.where(z > 0, z, 1))" in f.advice


def test_raise_mode_still_stops_at_the_first_nan_even_one_that_where_drops() -> None:
    # Raise mode checks each op as it runs, before anything can drop its output: as
    # documented, it ends the run at the first NaN/Inf made from finite inputs.
    with pytest.raises(NonFiniteError, match=r"aten\.log"):
        _safe_log_run({"anomaly": True, "on_nonfinite": "raise"})


def test_the_backward_of_sqrt_at_zero_is_the_one_error_with_the_backoffs_folded_in() -> None:
    torch.manual_seed(0)
    model = nn.Linear(C, C)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, anomaly=True) as doctor:
        for step in range(8):
            x = torch.randn(4, C, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                h = model(x).float()
                if step >= 3:
                    h = h * 0  # a dead batch: its variance is exactly 0
                std = torch.sqrt(h.var(0))  # SQRT_LINE
                loss = std.mean() + h.pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and len(s.scaler.skipped_steps) >= 4
    errors = [f for f in s.findings if f.severity in ("error", "warning")]
    assert [(f.kind, f.op) for f in errors] == [("nonfinite_backward", "aten.div")]
    f = errors[0]
    assert f.data["node"] == "SqrtBackward0"
    assert f.frame is not None and f.frame.startswith(f"{THIS_FILE}:{_line_of('SQRT_LINE')}")
    assert "Its denominator was exactly 0" in f.message
    assert "GradScaler backed off" in f.message  # the backoffs folded in
    assert "torch.sqrt(x + eps)" in f.advice and "does not help" in f.advice


def test_a_learning_rate_spike_is_told_to_be_a_divergence_not_a_precision_problem() -> None:
    # bfloat16 without a GradScaler; a learning rate of 1e6 from step 3 blows the weights
    # up. The op that goes non-finite ran on values of 1e21: "keep it in float32, or use
    # bfloat16" (in a bfloat16 run) was the advice.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16),
                          nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    losses = []
    with pytest.raises(NonFiniteError) as info:
        with amp_doctor.watch(model, anomaly=True, on_nonfinite="raise"):
            for step in range(30):
                for group in opt.param_groups:
                    group["lr"] = 1e6 if step >= 3 else 0.01
                x = torch.randn(8, 16, generator=g)
                y = torch.randint(0, 4, (8,), generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    assert losses[-1] > 1e6  # the loss exploded before anything went non-finite
    msg = str(info.value)
    assert "the run diverged" in msg and "Lower the learning rate" in msg
    assert "use bfloat16" not in msg and "Keep this op in float32" not in msg


# -- review 39c: Hugging Face-style runs ----------------------------------------------------
def test_a_row_masked_whole_whose_loss_ignores_it_still_names_the_softmax() -> None:
    # The padded sample's labels are ignored (-100), so the loss stays finite while the
    # softmax's NaN reaches every gradient through backward: harmful, not "discarded".
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, anomaly=True) as doctor:
        for step in range(10):
            model.attn.pad_row = step >= 4
            x = torch.randn(4, T, C, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x).float().squeeze(-1)  # [4, T]
                keep = torch.ones_like(out, dtype=torch.bool)
                keep[:, 2] = False  # the masked query's output is left out of the loss
                loss = out[keep].pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            assert math.isfinite(loss.item())
    s = doctor.session
    assert s.scaler is not None and len(s.scaler.skipped_steps) >= 5
    errors = [f for f in s.findings if f.severity in ("error", "warning")]
    assert [(f.kind, f.module, f.op) for f in errors] == [
        ("nonfinite_forward", "attn", "aten._softmax")]
    assert not s.findings_of("nonfinite_discarded")


class _Scorer(nn.Module):
    """Attention scores with a causal -inf mask: the layer's own output holds it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        att = q @ k.transpose(-2, -1)
        return att.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))


class _MaskModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(C, 2 * C)
        self.scorer = _Scorer()
        self.head = nn.Linear(C, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).split(C, -1)
        return self.head(self.scorer(q, k).softmax(-1) @ x)


def test_a_mask_layer_is_not_blamed_for_a_calibrating_scalers_backoffs() -> None:
    # init_scale 2**24: the scaled gradients overflow in `head` first and flow back
    # through the mask layer for several steps. Before, the mask layer got an ERROR
    # ("an op in it made inf/NaN") and the backoffs "began at scorer".
    torch.manual_seed(0)
    model = _MaskModel()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1) as doctor:
        for _ in range(20):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, T, C, generator=g)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            assert math.isfinite(loss.item())
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps
    scorer = next(lay for lay in s.layers if lay.name == "scorer")
    assert scorer.grad_nonfinite_steps > 0  # they came back through it from `head`
    assert [f.severity for f in s.findings_of("neg_inf_mask")] == ["info"]
    assert not [f for f in s.findings if f.severity == "error"]
    assert all(f.module != "scorer" for f in s.findings if f.kind.startswith("scale"))


def test_an_inf_in_maths_without_grad_that_a_cast_drops_is_info() -> None:
    # T5's relative-position buckets: log(0) = -inf on integer positions made float,
    # then cast back to integers and dropped by torch.where. No gradient flows there.
    class Buckets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Embedding(8, 1)
            self.fc = nn.Linear(C, C)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(T)[None, :] - torch.arange(T)[:, None]
            rel = pos.abs()
            big = (torch.log(rel.float() / 2) * 2).to(torch.long)  # BUCKET_LINE
            bucket = torch.where(rel < 2, rel, big.clamp(0, 7))
            return self.fc(x) + self.bias(bucket).squeeze(-1)[0][:, None]

    torch.manual_seed(0)
    model = Buckets()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, anomaly=True) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(T, C, generator=g)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert not [f for f in s.findings if f.severity in ("error", "warning")], doctor.report()
    (f,) = s.findings_of("nonfinite_discarded")
    assert f.op == "aten.log" and f.frame is not None
    assert f.frame.startswith(f"{THIS_FILE}:{_line_of('BUCKET_LINE')}")
