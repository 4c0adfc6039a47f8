"""Pathology: gradient clipping on still-scaled gradients (no ``scaler.unscale_``).

What goes wrong: the loop calls
``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` right after
``scaler.scale(loss).backward()``, without ``scaler.unscale_(optimizer)``
first. The gradients at that point are multiplied by the loss scale (65536),
so ``clip_grad_norm_`` sees a total norm 65536x too large (~2.6e4 here,
while the true norm is ~0.4 and should not be clipped at all) and shrinks the
gradients to norm 1 *in scaled units*. ``scaler.step`` then divides by 65536:
the update applied is ~2.6e4x smaller than with the correct recipe
(``unscale_``, then clip at 1.0). With SGD the model does not move.

Why: GradScaler only unscales inside ``scaler.step`` unless ``unscale_`` is
called explicitly; anything that reads gradient magnitudes before that
(clipping, logging grad norms) sees scaled values.

Symptom when run plainly: ``clip_total_norm`` (the value returned by
``clip_grad_norm_``) is ~2.6e4 every step; ``true_grad_norm`` (that
divided by the scale) is ~0.4; ``update_shrink`` is ~2.6e4; the loss does
not move (full-batch training, relative change < 1e-3). ``--fixed`` runs the correct
recipe: the loss falls by more than half in the same number of steps.

Expected amp-doctor finding: ``clip_before_unscale`` (no module, no op).

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
MAX_NORM = 1.0


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN), nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
            nn.Linear(HIDDEN, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_dataset(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A small linear-regression dataset, trained on full-batch so losses compare."""
    w = 0.25 * torch.randn(N_FEATURES, 1, generator=torch.Generator().manual_seed(3))
    x = torch.randn(n, N_FEATURES)
    return x.to(device), (x @ w).to(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-samples", type=int, default=128, help="dataset size (full batch)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fixed", action="store_true",
                   help="call scaler.unscale_(optimizer) before clipping (the correct recipe)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    model = Regressor().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type)
    init_scale = scaler.get_scale()
    print(f"device={device.type} dtype=float16 init_scale={init_scale:g} fixed={args.fixed}")

    x, y = make_dataset(device, args.n_samples)
    first_loss = math.nan
    loss_value = math.nan
    norms: list[float] = []
    shrinks: list[float] = []
    for step in range(args.steps):
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            pred = model(x)
            loss = F.mse_loss(pred, y)
        scaler.scale(loss).backward()
        if args.fixed:
            scaler.unscale_(optimizer)
        # The bug (without --fixed): these gradients are still multiplied by the scale.
        total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()

        loss_value = loss.item()
        norms.append(total_norm)
        if step == 0:
            first_loss = loss_value
        true_norm = total_norm if args.fixed else total_norm / scale
        # How much smaller the applied update is than with unscale_ before clipping.
        shrink = min(1.0, MAX_NORM / true_norm) / min(1.0, MAX_NORM / total_norm)
        shrinks.append(shrink)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.5f} clip_total_norm={total_norm:.4g} "
                  f"true_grad_norm={true_norm:.4g} update_shrink={shrink:.4g} scale={scale:g}")

    rel_change = (first_loss - loss_value) / first_loss
    median_norm = sorted(norms)[len(norms) // 2]
    print(f"first_loss={first_loss:.5f} final_loss={loss_value:.5f} "
          f"rel_loss_change={rel_change:.3g} median_clip_total_norm={median_norm:.4g} "
          f"final_scale={scaler.get_scale():g}")
    if not args.fixed and median_norm > 1e3 * MAX_NORM:
        shrink = sorted(shrinks)[len(shrinks) // 2]
        print(f"SYMPTOM: clip_grad_norm_ saw scaled gradients (total norm {median_norm:.3g}, "
              f"scale {init_scale:g}); updates {shrink:.3g}x too small, loss "
              f"{first_loss:.5f} -> {loss_value:.5f}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
