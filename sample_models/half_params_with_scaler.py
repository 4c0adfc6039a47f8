"""Pathology: ``model.half()`` (float16 parameters) combined with a GradScaler.

What goes wrong: to "save memory" the user converts the model with
``model.half()`` and keeps the AMP recipe (autocast + GradScaler). The
parameters, and therefore their gradients, are float16. ``scaler.step``
calls ``scaler.unscale_``, which refuses float16 gradients and raises
``ValueError: Attempting to unscale FP16 gradients.`` (unscaling in float16
would itself underflow/overflow; AMP expects float32 master parameters and
casts them per op).

Symptom when run plainly: the step-0 forward and backward run (the loss is
printed), then ``scaler.step`` raises. The script prints
``SYMPTOM: ValueError: Attempting to unscale FP16 gradients.`` and re-raises,
so it exits with status 1 and a traceback (this sample is the one that does
not exit 0: the crash is the symptom).

Expected amp-doctor finding: ``fp16_params`` (no module, no op).

Module names: ``net`` (``net.0``/``net.2`` Linear, ``net.1`` ReLU).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES = 16
HIDDEN = 32
N_CLASSES = 4


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, N_FEATURES)
    y = x[:, :N_CLASSES].argmax(dim=1)
    return x.to(device), y.to(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (it fails at the first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    # The bug: float16 parameters (and so float16 gradients) under AMP.
    model = Classifier().to(device).half()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type)
    print(f"device={device.type} dtype=float16 param_dtype={next(model.parameters()).dtype} "
          f"init_scale={scaler.get_scale():g}")

    for step in range(args.steps):
        x, y = make_batch(device, args.batch_size)
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        grad = next(model.parameters()).grad
        grad_dtype = None if grad is None else grad.dtype
        print(f"step={step} loss={loss.item():.4f} grad_dtype={grad_dtype} "
              f"scale={scaler.get_scale():g}")
        try:
            scaler.step(optimizer)
        except ValueError as e:
            # Name the symptom for readers of the log, then fail as the user would.
            print(f"SYMPTOM: ValueError: {e}", flush=True)
            raise
        scaler.update()

    print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
