"""Pathology: a GradScaler whose scale is too low (``init_scale=1.0``) to
protect float16 gradients; early layers' gradients still flush to zero.

What goes wrong: the same model and data as ``gradient_underflow_no_scaler.py``
(a deep-ish tanh MLP with a near-zero-initialised output layer ``head``
regressing small targets, so the hidden layers' gradients are ~1e-8 to
1e-7). This time the user *does* use a GradScaler, but constructed it with
``init_scale=1.0`` (copied from a config meant to "avoid the skipped first
steps"). A scale of 1 multiplies nothing: the float16 backward matmuls of
``body.0`` and ``body.2`` still round every gradient entry to 0. The scaler
never sees an inf, so it only grows the scale after ``growth_interval``
(2000) clean steps: for the whole run the scale stays at 1.

Symptom when run plainly: finite loss, scale constant at 1, and ~100% of the
weight-gradient entries of ``body.0`` and ``body.2`` are exactly zero
(``zero_grad_frac``), versus 0% in float32 (``fp32_zero_grad_frac_step0``).
``--init-scale 65536`` (GradScaler's default) fixes it.

The float32 reference is computed functionally (``F.linear`` on detached
copies of the weights and ``torch.autograd.grad``) so a profiler that hooks
modules, parameters or optimizers globally does not see a second model.

Expected amp-doctor finding: ``gradient_underflow`` (a scaler is in use, but
gradients still underflow), an error at ``head``, where they underflow first,
listing ``body.0``, whose weights get no gradient at all; and on ``body.0``
(its consequence, info) and ``body.2`` (also ``body.4``, ``body.6``, where
underflow is partial).

Module names: ``body`` (``body.0``/``.2``/``.4``/``.6`` are ``nn.Linear``,
``body.1``/``.3``/``.5``/``.7`` are ``nn.Tanh``) and ``head``.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES = 16
WIDTH = 32
DEPTH = 4
N_OUTPUTS = 64
HEAD_INIT_STD = 1e-4
# The early layers whose gradients the symptom is about.
EARLY = ("body.0", "body.2")


class DeepRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = N_FEATURES
        for _ in range(DEPTH):
            layers += [nn.Linear(d, WIDTH), nn.Tanh()]
            d = WIDTH
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(WIDTH, N_OUTPUTS)
        with torch.no_grad():
            # Near-zero init of the output layer: the network starts as ~0.
            self.head.weight.normal_(0.0, HEAD_INIT_STD)
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Small regression targets: a fixed linear teacher with weights ~0.01."""
    teacher = 0.01 * torch.randn(N_FEATURES, N_OUTPUTS, generator=torch.Generator().manual_seed(1))
    x = torch.randn(batch_size, N_FEATURES)
    return x.to(device), (x @ teacher).to(device)


def linear_layers(model: DeepRegressor) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def zero_grad_fractions(model: DeepRegressor) -> dict[str, float]:
    """Share of each Linear's weight-gradient entries that are exactly 0."""
    return {n: (m.weight.grad == 0).float().mean().item()
            for n, m in linear_layers(model).items() if m.weight.grad is not None}


def fp32_reference_zero_fractions(model: DeepRegressor, x: torch.Tensor,
                                  y: torch.Tensor) -> dict[str, float]:
    """Same fractions for a float32 forward/backward of the same weights and batch.

    Done without calling any module, on detached copies of the parameters, so
    nothing here touches the model's ``.grad`` or its hooks.
    """
    weights = {n: (m.weight.detach().clone().requires_grad_(), m.bias.detach().clone())
               for n, m in linear_layers(model).items()}
    h = x
    for i, layer in enumerate(model.body):
        if isinstance(layer, nn.Linear):
            w, b = weights[f"body.{i}"]
            h = F.linear(h, w, b)
        else:
            h = torch.tanh(h)
    w, b = weights["head"]
    loss = F.mse_loss(F.linear(h, w, b), y)
    grads = torch.autograd.grad(loss, [w for w, _ in weights.values()])
    return {n: (g == 0).float().mean().item() for n, g in zip(weights, grads, strict=True)}


def fmt(fracs: dict[str, float]) -> str:
    return " ".join(f"{n}={f:.3f}" for n, f in fracs.items())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init-scale", type=float, default=1.0,
                   help="GradScaler init_scale (the bug: 1.0; the default 65536 fixes it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    model = DeepRegressor().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # The bug: a loss scale of 1 does not lift any gradient out of underflow.
    scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale)
    init_scale = scaler.get_scale()
    print(f"device={device.type} dtype=float16 init_scale={init_scale:g}")

    batches = [make_batch(device, args.batch_size) for _ in range(args.steps)]
    ref = fp32_reference_zero_fractions(model, *batches[0])

    loss_value = math.nan
    fracs: dict[str, float] = {}
    step0_fracs: dict[str, float] = {}
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            pred = model(x)
            loss = F.mse_loss(pred, y)
        scaler.scale(loss).backward()
        # Zero stays zero whatever the scale: no need to unscale to count them.
        fracs = zero_grad_fractions(model)
        scaler.step(optimizer)
        scaler.update()

        loss_value = loss.item()
        if step == 0:
            step0_fracs = fracs
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.6f} scale={scaler.get_scale():g} "
                  f"zero_grad_frac {fmt(fracs)}")

    print(f"fp16_zero_grad_frac_step0 {fmt(step0_fracs)}")
    print(f"fp32_zero_grad_frac_step0 {fmt(ref)}")
    worst = max(EARLY, key=lambda n: fracs.get(n, 0.0))
    if fracs.get(worst, 0.0) > 0.5:
        print(f"SYMPTOM: {fracs[worst]:.0%} of {worst} weight gradients are zero in float16 "
              f"despite the GradScaler (scale {scaler.get_scale():g}; float32: "
              f"{ref[worst]:.0%}); loss={loss_value:.6f}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
