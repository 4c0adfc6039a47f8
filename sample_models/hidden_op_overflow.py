"""Pathology: an op *inside* a module overflows in float16 although the module's
output is finite; the backward pass turns the hidden inf into NaN.

What goes wrong: the MLP uses the GPT-2 tanh approximation of GELU written
out by hand (``TanhGELU``: ``0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3)))``).
A few input channels carry outlier values (hundreds, like the "massive
activations" of large language models), so some pre-activations coming out of
``mlp.fc1`` are a few hundred. Under float16 autocast ``fc1`` returns float16,
so ``torch.pow(x, 3.0)`` runs in float16 and ``x**3`` exceeds 65504 -> ``inf``
for every ``|x| > ~40``. The forward pass hides it: ``tanh(inf) == 1`` so the
module returns ``x`` (or 0), which is finite, and the loss is finite. The
backward pass does not: tanh's derivative is exactly 0 there, and pow's
backward multiplies it by ``3*x**2``, which is itself ``inf`` in float16 for
``|x| > ~148``; ``0 * inf = NaN``. All gradients upstream of the activation
(``mlp.fc1``) are NaN, GradScaler skips every step and halves the scale.

Why: CPU autocast has no float32 rule for ``pow``/``tanh``, so they run in
the dtype of their input, float16 here. (CUDA autocast runs ``pow`` in
float32, so on CUDA this sample is healthy: the pathology is CPU-autocast
specific, or happens on CUDA whenever the op runs outside autocast on float16
tensors.)

Symptom when run plainly: loss and model output finite at every step, but the
scaled gradients of ``mlp.fc1.weight``/``mlp.fc1.bias`` are NaN; every step is
skipped and the scale halves each step (65536 -> 16 after 12 steps).

Expected amp-doctor findings: ``activation_overflow`` at op level on module
``mlp.act`` (``TanhGELU``), op ``aten.pow``, although ``mlp.act``'s output is
finite; ``nonfinite_backward`` in ``mlp.act``; ``scaler_backoff`` and
``scale_collapse``. ``--dtype bfloat16`` or ``--dtype float32`` is healthy.

Module names: ``mlp``, ``mlp.fc1``, ``mlp.act``, ``mlp.fc2``, ``norm``, ``head``.
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
HIDDEN = 64
# Two outlier channels with values in the hundreds/thousands.
OUTLIER_CHANNELS = (3, 11)
OUTLIER_SCALE = 1000.0
# Several regression targets: keeps each output's gradient well inside float16.
N_TARGETS = 8


class TanhGELU(nn.Module):
    """GELU, tanh approximation, written the way GPT-2's ``gelu_new`` is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class MLPBlock(nn.Module):
    def __init__(self, d_in: int, d_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = TanhGELU()
        self.fc2 = nn.Linear(d_hidden, d_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fc1 runs under autocast, so act receives a float16 tensor.
        return self.fc2(self.act(self.fc1(x)))


class OutlierNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLPBlock(N_FEATURES, HIDDEN)
        # Normalising the MLP output keeps the prediction, the loss and the
        # gradients O(1): the only overflow left is the hidden one in mlp.act.
        self.norm = nn.LayerNorm(N_FEATURES)
        self.head = nn.Linear(N_FEATURES, N_TARGETS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mlp(x)))


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, N_FEATURES)
    for c in OUTLIER_CHANNELS:
        x[:, c] = OUTLIER_SCALE * torch.rand(batch_size)
    # Targets: squashed copies of the ordinary (non-outlier) channels.
    ordinary = [c for c in range(N_FEATURES) if c not in OUTLIER_CHANNELS][:N_TARGETS]
    y = torch.tanh(x[:, ordinary])
    return x.to(device), y.to(device)


def nonfinite_grads(model: nn.Module) -> list[str]:
    """Names of parameters whose (scaled) gradient holds inf/NaN."""
    return [n for n, p in model.named_parameters()
            if p.grad is not None and not torch.isfinite(p.grad).all()]


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

    model = OutlierNet().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    init_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"device={device.type} dtype={args.dtype} init_scale={init_scale:g}")

    loss_value = math.nan
    all_out_finite = True
    first_bad_grad: int | None = None
    bad_names: list[str] = []
    for step in range(args.steps):
        x, y = make_batch(device, args.batch_size)
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=dtype,
                            enabled=dtype != torch.float32):
            pred = model(x)
            loss = F.mse_loss(pred, y)
        scaler.scale(loss).backward()
        # The check a user adds when the scale keeps dropping: which grads are bad?
        bad = nonfinite_grads(model)
        scaler.step(optimizer)
        scaler.update()

        loss_value = loss.item()
        out_finite = bool(torch.isfinite(pred).all())
        all_out_finite = all_out_finite and out_finite and math.isfinite(loss_value)
        if bad and first_bad_grad is None:
            first_bad_grad, bad_names = step, bad
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        if step % 2 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.4f} out_finite={out_finite} "
                  f"grads_finite={not bad} scale={scale:g}")
            if bad:
                print(f"  nonfinite_grads={','.join(bad)}")

    final_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"final_loss={loss_value:.4f} init_scale={init_scale:g} final_scale={final_scale:g}")
    if first_bad_grad is not None:
        finite = "finite" if all_out_finite else "NOT finite"
        print(f"SYMPTOM: forward/loss {finite} but gradients non-finite from step "
              f"{first_bad_grad} ({','.join(bad_names)}); scale fell from {init_scale:g} "
              f"to {final_scale:g}")
    elif not all_out_finite:
        print("SYMPTOM: loss is non-finite")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
