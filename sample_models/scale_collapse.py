"""Pathology: the loss scale collapses: GradScaler backs off step after step,
far below 1, and every optimizer step is skipped.

What goes wrong: a regressor predicts targets in raw units (~5e4, e.g.
prices in dollars; nobody normalised them) with a *sum*-reduced MSE. The
forward pass is fine: the prediction starts near 0, the loss (computed in
float32 by autocast) is ~1e11 but finite. The backward pass is not: the
gradient of the loss w.r.t. the prediction is ``2*(pred - y)`` ~ -1e5 per
element, already beyond float16's max (65504) before any loss scaling, and
``head``'s weight gradient sums 64 of those. Those gradients flow through
``head``'s float16 backward matmul, so they are ``inf`` unless the scale is
below ~1/64. GradScaler halves the scale after every inf step: 65536 ->
32768 -> ... -> 0.0625 after 20 steps, and the optimizer never steps, so the
loss never improves. In float32 or bfloat16 no step is skipped.

Why: float16's max is 65504; GradScaler can only fix overflow by scaling the
loss *down*, which defeats its purpose (a scale < 1 makes small gradients
underflow). The gradients themselves are too big for float16.

Symptom when run plainly: finite loss that never improves (~1.6e11 on every
batch); ``scale`` halves every step
to 0.0625 (< 1) after 20 steps; ``skipped`` counts 20 of 20 steps.

Expected amp-doctor findings: ``scale_collapse`` (final scale < 1, 20
backoffs in a row) and ``scaler_backoff``, both with culprit ``head`` (the
first module in backward order with non-finite gradients; ``head``'s
parameter gradients are non-finite at every scale the run visits, those of
``body.*`` only while the scale is >= ~0.125). With ``--dtype bfloat16`` or
``--dtype float32`` no step is skipped.

Module names: ``body`` (``body.0``/``body.2`` Linear, ``body.1``/``body.3``
ReLU) and ``head``.
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
N_FEATURES = 8
HIDDEN = 32
# Raw-unit targets: mean 5e4 (fits float16 as a value; its gradients do not).
TARGET_MEAN = 5e4
TARGET_STD = 5e3


class PriceRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN), nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        )
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, N_FEATURES)
    y = TARGET_MEAN + TARGET_STD * torch.tanh(x[:, :1] + x[:, 1:2])
    return x.to(device), y.to(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
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

    model = PriceRegressor().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    init_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"device={device.type} dtype={args.dtype} init_scale={init_scale:g}")

    loss_value = math.nan
    first_loss = math.nan
    skipped = 0
    for step in range(args.steps):
        x, y = make_batch(device, args.batch_size)
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=dtype,
                            enabled=dtype != torch.float32):
            pred = model(x)
            # The bug: raw-unit targets with a summed loss.
            loss = F.mse_loss(pred, y, reduction="sum")
        scaler.scale(loss).backward()
        before = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(optimizer)
        scaler.update()
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        # GradScaler backs off exactly when it skipped the optimizer step.
        skipped += scale < before

        loss_value = loss.item()
        if step == 0:
            first_loss = loss_value
        print(f"step={step} loss={loss_value:.5g} scale={scale:g} skipped={skipped}")

    final_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"first_loss={first_loss:.5g} final_loss={loss_value:.5g} init_scale={init_scale:g} "
          f"final_scale={final_scale:g} skipped={skipped}/{args.steps}")
    if final_scale < init_scale / 2**10:
        print(f"SYMPTOM: scale collapsed from {init_scale:g} to {final_scale:g}; "
              f"{skipped} of {args.steps} optimizer steps skipped; loss finite but stuck")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
