"""Healthy: gradient accumulation with AMP, plus clipping after ``unscale_``.

What goes wrong: nothing. The recipe from the AMP docs: each micro-batch's
loss is divided by ``accum_steps`` and ``scaler.scale(loss).backward()`` runs
every micro-step, so scaled gradients accumulate in ``.grad``. Every
``accum_steps`` micro-steps the loop calls ``scaler.unscale_(optimizer)``,
clips the now *unscaled* gradients with
``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``, then
``scaler.step(optimizer)``, ``scaler.update()`` and ``optimizer.zero_grad()``.
The scale is only updated once per optimizer step, as it must be.

Symptom when run plainly: none. The loss falls and stays finite, the grad
norm reported by ``clip_grad_norm_`` is O(1) (unscaled), and the scale stays
at 65536.

Expected amp-doctor finding: nothing (an empty list of findings; in
particular no ``clip_before_unscale`` and no ``missing_update``).

Module names: ``net`` (``net.0``/``net.2``/``net.4`` Linear, ``net.1``/``net.3``
ReLU).
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
N_CLASSES = 4
MAX_NORM = 1.0


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN), nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
            nn.Linear(HIDDEN, N_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters around fixed class centres."""
    centres = torch.randn(N_CLASSES, N_FEATURES, generator=torch.Generator().manual_seed(9))
    y = torch.randint(0, N_CLASSES, (batch_size,))
    x = centres[y] + torch.randn(batch_size, N_FEATURES)
    return x.to(device), y.to(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=15, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accum-steps", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    accum = args.accum_steps

    model = Classifier().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type)
    init_scale = scaler.get_scale()
    print(f"device={device.type} dtype=float16 accum_steps={accum} init_scale={init_scale:g}")

    first_loss = math.nan
    step_loss = 0.0
    loss_value = math.nan
    bad_step: int | None = None
    optimizer.zero_grad()
    for i in range(args.steps * accum):
        x, y = make_batch(device, args.micro_batch_size)
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            logits = model(x)
            # Average over the micro-batches of one optimizer step.
            loss = F.cross_entropy(logits, y) / accum
        scaler.scale(loss).backward()
        step_loss += loss.item()

        if (i + 1) % accum == 0:
            step = i // accum
            # Clip the real gradients: unscale them first.
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

            loss_value, step_loss = step_loss, 0.0
            if step == 0:
                first_loss = loss_value
            if bad_step is None and not math.isfinite(loss_value):
                bad_step = step
            if step % 3 == 0 or step == args.steps - 1:
                print(f"step={step} loss={loss_value:.4f} grad_norm={grad_norm:.4f} "
                      f"scale={scaler.get_scale():g}")

    final_scale = scaler.get_scale()
    print(f"first_loss={first_loss:.4f} final_loss={loss_value:.4f} "
          f"init_scale={init_scale:g} final_scale={final_scale:g}")
    if bad_step is not None:
        print(f"SYMPTOM: loss is non-finite at step {bad_step}")
    elif final_scale < init_scale:
        print(f"SYMPTOM: scale fell from {init_scale:g} to {final_scale:g}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
