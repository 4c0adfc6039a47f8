"""Pathology: an epsilon of 1e-8 added in float16 is 0; a division by zero follows.

What goes wrong: a custom batch-standardisation layer ``norm`` computes
``(x - mean) / torch.sqrt(var + 1e-8)`` over the batch, on the output of a
ReLU. A few ReLU units are dead (their pre-activation is always negative, as
after a bad learning-rate spike), so their channel is all zeros and its
variance is exactly 0. In float32, ``0 + 1e-8`` is ``1e-8`` and the dead
channel comes out as ``0 / 1e-4 = 0``. Under float16 autocast ``fc1`` returns
float16, the whole normalisation runs in float16 (CPU autocast has no float32
rule for ``mean``/``var``/``add``/``sqrt``/``div``), and 1e-8 is below
float16's smallest subnormal (6e-8): ``0 + 1e-8`` rounds to ``0``,
``sqrt(0) = 0`` and ``0 / 0 = NaN`` in every dead channel.

Why: float16 cannot represent 1e-8; epsilons for float16 must be >= ~1e-5
(e.g. 1e-5, as ``nn.LayerNorm`` / ``nn.BatchNorm1d`` use). ``var``, ``add``,
``sqrt`` and ``div`` have no autocast rule on CUDA either, so this also
happens there.

Symptom when run plainly: the loss is ``nan`` from step 0 on (``norm``'s
output has NaN in the dead channels: ``norm_nan_frac``), every step is
skipped and the scale halves each step (65536 -> 16 after 12 steps).

Expected amp-doctor findings: ``nonfinite_forward`` in module ``norm``
(``BatchStandardize``), op ``aten.div`` (the add of eps and the sqrt stay
finite: they produce the zero that the division then divides by), plus
``scaler_backoff`` and ``scale_collapse``. ``--dtype bfloat16`` or
``--dtype float32`` is healthy.

Module names: ``fc1``, ``act``, ``norm``, ``head``.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
N_FEATURES = 16
HIDDEN = 32
N_DEAD = 4
EPS = 1e-8


class BatchStandardize(nn.Module):
    """Per-channel standardisation over the batch (a hand-rolled BatchNorm)."""

    def __init__(self, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=0, keepdim=True)
        var = x.var(dim=0, unbiased=False, keepdim=True)
        # The bug: eps=1e-8 vanishes when var is float16.
        return (x - mean) / torch.sqrt(var + self.eps)


class DeadUnitNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_FEATURES, HIDDEN)
        self.act = nn.ReLU()
        self.norm = BatchStandardize()
        self.head = nn.Linear(HIDDEN, 1)
        with torch.no_grad():
            # Dead units: their pre-activation is always far below zero.
            self.fc1.bias[:N_DEAD] = -100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.act(self.fc1(x))))


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, N_FEATURES)
    y = (x[:, :1] * x[:, 1:2]).tanh()
    return x.to(device), y.to(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                   help="autocast dtype (float32 disables autocast)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]

    model = DeadUnitNet().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    init_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"device={device.type} dtype={args.dtype} init_scale={init_scale:g}")

    # What a user adds to see where the NaN appears: keep norm's output.
    seen: dict[str, torch.Tensor] = {}
    model.norm.register_forward_hook(
        lambda _mod, _inp, out: seen.__setitem__("norm", out.detach()))

    loss_value = math.nan
    first_bad: int | None = None
    for step in range(args.steps):
        x, y = make_batch(device, args.batch_size)
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=dtype,
                            enabled=dtype != torch.float32):
            pred = model(x)
            loss = F.mse_loss(pred, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        loss_value = loss.item()
        if first_bad is None and not math.isfinite(loss_value):
            first_bad = step
        norm_out = seen["norm"]
        nan_frac = torch.isnan(norm_out).float().mean().item()
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        if step % 2 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.4f} norm_nan_frac={nan_frac:.3f} "
                  f"norm_dtype={str(norm_out.dtype).removeprefix('torch.')} scale={scale:g}")

    final_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"final_loss={loss_value:.4f} init_scale={init_scale:g} final_scale={final_scale:g}")
    if first_bad is not None:
        print(f"SYMPTOM: loss is {loss_value} from step {first_bad} (eps={EPS:g} is 0 in "
              f"float16 -> 0/0 in norm); scale fell from {init_scale:g} to {final_scale:g}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
