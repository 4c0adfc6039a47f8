"""Healthy baseline: a tiny CNN trained with float16 autocast and a GradScaler.

What goes wrong: nothing. This is the textbook recipe from the AMP tutorials
(``SimpleCNN`` with conv -> ReLU -> max-pool twice and a linear classifier,
``torch.autocast`` around forward + loss, ``scaler.scale(loss).backward()``,
``scaler.step(optimizer)``, ``scaler.update()``), shrunk to 16x16 images so its
training loop runs in well under a second on a CPU.

Symptom when run plainly: none. The loss falls, stays finite, and the loss
scale stays at its initial 65536 (no inf/NaN gradient ever makes GradScaler
back off; it would only grow after ``growth_interval`` = 2000 clean steps).

Expected amp-doctor finding: nothing (an empty list of findings).

Module names: ``conv1``, ``relu``, ``pool``, ``conv2``, ``fc``.

``make_model``, ``make_batch`` and ``loss_fn`` are importable so a benchmark can
time the same model with and without amp-doctor attached.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 4
IMG_SIZE = 16


class SimpleCNN(nn.Module):
    """conv(3->8) -> ReLU -> pool -> conv(8->16) -> ReLU -> pool -> fc, for 16x16 inputs."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        # Few channels on purpose: float16 convolutions are slow on CPU.
        self.conv1 = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=3, padding=1)
        # Two 2x2 poolings turn 16x16 into 4x4.
        self.fc = nn.Linear(16 * (IMG_SIZE // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc(x)


def make_model(device: torch.device | str) -> nn.Module:
    """The model, float32 parameters on ``device`` (autocast casts per op)."""
    return SimpleCNN().to(device)


def make_batch(device: torch.device | str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic batch: each class is a fixed random image plus noise.

    The class templates come from a private generator so they are the same in
    every run; the labels and noise come from the global RNG (``--seed``).
    """
    gen = torch.Generator().manual_seed(1234)
    templates = torch.randn(NUM_CLASSES, 3, IMG_SIZE, IMG_SIZE, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (batch_size,))
    x = templates[y] + 0.8 * torch.randn(batch_size, 3, IMG_SIZE, IMG_SIZE)
    return x.to(device), y.to(device)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (autocast runs it in float32 on both CPU and CUDA)."""
    return F.cross_entropy(output, target)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    model = make_model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type)
    init_scale = scaler.get_scale()
    print(f"device={device.type} dtype=float16 init_scale={init_scale:.1f}")

    first_loss = math.nan
    loss_value = math.nan
    bad_step: int | None = None
    model.train()
    for step in range(args.steps):
        x, y = make_batch(device, args.batch_size)
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            output = model(x)
            loss = loss_fn(output, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        loss_value = loss.item()
        if step == 0:
            first_loss = loss_value
        if bad_step is None and not math.isfinite(loss_value):
            bad_step = step
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.4f} scale={scaler.get_scale():.1f}")

    final_scale = scaler.get_scale()
    print(f"first_loss={first_loss:.4f} final_loss={loss_value:.4f} "
          f"init_scale={init_scale:.1f} final_scale={final_scale:.1f}")
    if bad_step is not None:
        print(f"SYMPTOM: loss is non-finite at step {bad_step}")
    elif final_scale < init_scale:
        print(f"SYMPTOM: scale fell from {init_scale:g} to {final_scale:g}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
