"""Pathology: one layer's float16 output overflows (> 65504) and becomes inf.

What goes wrong: a regressor on raw, unnormalised sensor readings (values
in the hundreds) has a hidden layer ``proj`` whose weights are large (as
if loaded from a float32 checkpoint trained without weight decay: std 300).
Its outputs reach a few 1e5. In float32 (and in bfloat16, which has
float32's exponent range) that is harmless: the LayerNorm ``norm`` right
after ``proj`` rescales them to O(1) and the model trains. Under float16
autocast, ``proj``'s matmul runs in float16 and every value beyond float16's
maximum of 65504 becomes ``inf``; ``norm`` turns the infs into NaN and the
loss is NaN.

Why: float16 has 5 exponent bits, so its largest finite value is 65504;
autocast runs ``nn.Linear`` in float16 on both CPU and CUDA.

Symptom when run plainly: the loss is ``nan`` from step 0 on, every
optimizer step is skipped by GradScaler, and the scale halves each step
(65536 -> 32768 -> ... -> 16 after 12 steps).

Expected amp-doctor findings: ``activation_overflow`` on module ``proj``
(the first module whose output is non-finite; ``inp``, ``act`` are
finite), plus ``scaler_backoff`` and ``scale_collapse`` (every step backs
off). ``--dtype bfloat16`` or ``--dtype float32`` makes the run healthy.

Module names: ``inp``, ``act``, ``proj``, ``norm``, ``head``.
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
# Raw sensor readings are in the hundreds: nobody normalised the inputs.
INPUT_SCALE = 100.0
# std of proj's weights: big enough for its outputs to pass 65504.
PROJ_WEIGHT_STD = 300.0


class SensorRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(N_FEATURES, HIDDEN)
        self.act = nn.ReLU()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        # Post-projection normalisation is what keeps float32 training sane.
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)
        with torch.no_grad():
            # Stand-in for a checkpoint whose weights grew large in float32.
            self.proj.weight.normal_(0.0, PROJ_WEIGHT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.act(self.inp(x)))))


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = INPUT_SCALE * torch.randn(batch_size, N_FEATURES)
    # The target only depends on the sign pattern of two readings: learnable.
    y = torch.tanh(x[:, :1] / INPUT_SCALE) + 0.5 * torch.tanh(x[:, 1:2] / INPUT_SCALE)
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

    model = SensorRegressor().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    init_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"device={device.type} dtype={args.dtype} init_scale={init_scale:.1f}")

    first_bad: int | None = None
    loss_value = math.nan
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
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        if step % 2 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.4f} scale={scale:g}")

    final_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"final_loss={loss_value:.4f} init_scale={init_scale:g} final_scale={final_scale:g}")
    if first_bad is not None:
        print(f"SYMPTOM: loss is {loss_value} from step {first_bad}; scale fell from "
              f"{init_scale:g} to {final_scale:g}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
