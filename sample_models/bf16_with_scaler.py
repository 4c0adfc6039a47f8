"""Misconfiguration: bfloat16 autocast with a GradScaler (works, but unneeded).

What goes wrong: nothing visible. The loop follows the float16 recipe
(``GradScaler``, ``scaler.scale(loss).backward()``, ``scaler.step``,
``scaler.update``) but autocasts to bfloat16. bfloat16 has float32's 8-bit
exponent, so gradients neither overflow nor underflow for lack of range and
loss scaling buys nothing; it only costs an extra multiply, an unscale pass
and a host sync per step (``scaler.step`` checks for infs) and makes the
code look like it needs the scaler.

Symptom when run plainly: none. The loss falls and stays finite; the scale
stays at 65536 (no backoff ever happens).

Expected amp-doctor finding: ``scaler_with_bf16`` (informational; no module,
no op).

Module names: ``net`` (``net.0``/``net.2``/``net.4`` Linear, ``net.1``/``net.3``
GELU).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES = 16
HIDDEN = 64
N_CLASSES = 5


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, N_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters around fixed class centres."""
    centres = torch.randn(N_CLASSES, N_FEATURES, generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, N_CLASSES, (batch_size,))
    x = centres[y] + 0.7 * torch.randn(batch_size, N_FEATURES)
    return x.to(device), y.to(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    model = Classifier().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # The misconfiguration: a float16 tool kept after switching to bfloat16.
    scaler = torch.amp.GradScaler(device.type)
    init_scale = scaler.get_scale()
    print(f"device={device.type} dtype=bfloat16 scaler=True init_scale={init_scale:g}")

    first_loss = math.nan
    loss_value = math.nan
    bad_step: int | None = None
    for step in range(args.steps):
        x, y = make_batch(device, args.batch_size)
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        loss_value = loss.item()
        if step == 0:
            first_loss = loss_value
        if bad_step is None and not math.isfinite(loss_value):
            bad_step = step
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.4f} scale={scaler.get_scale():g}")

    final_scale = scaler.get_scale()
    print(f"first_loss={first_loss:.4f} final_loss={loss_value:.4f} "
          f"init_scale={init_scale:g} final_scale={final_scale:g}")
    if bad_step is not None:
        print(f"SYMPTOM: loss is non-finite at step {bad_step}")
    elif final_scale < init_scale:
        print(f"SYMPTOM: scale fell from {init_scale:g} to {final_scale:g}")
    else:
        print("SYMPTOM: none visible (trains fine; the GradScaler is unneeded with bfloat16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
