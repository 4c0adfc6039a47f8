"""Pathology: float16 autocast without a GradScaler; early layers' gradients
flush to zero.

What goes wrong: a deep-ish tanh MLP regresses small targets (std ~0.04)
with a mean-reduced MSE over 64 outputs, and its output layer ``head`` is
initialised tiny (std 1e-4, the "near-zero init of the last layer" used by
many diffusion / residual models). The per-element gradients reaching the
hidden layers are ~1e-8 to 1e-7. In float32 that is small but perfectly
representable: no entry is zero. Under float16 autocast the backward
matmuls of the ``nn.Linear`` layers run in float16, whose smallest
subnormal is 6e-8: the gradients of ``body.0`` and ``body.2`` round to
exactly 0 and those layers never learn.
There is no GradScaler, so nothing multiplies the loss to lift the gradients
into float16's range.

Symptom when run plainly: the loss is finite, but ~100% of the gradient
entries of the early layers ``body.0`` and ``body.2`` are exactly zero
(printed each few steps as ``zero_grad_frac``), versus 0% for the same model
and batch in float32 (``fp32_zero_grad_frac_step0``, computed once before
training on the step-0 batch).

The float32 reference is computed functionally (``F.linear`` on detached
copies of the weights and ``torch.autograd.grad``) so a profiler that hooks
modules, parameters or optimizers globally does not see a second model.

Expected amp-doctor finding: ``missing_scaler`` (gradient underflow with no
GradScaler), an error at ``head``, where the gradient underflows first, listing
``body.0``, whose weights get no gradient at all; and ``missing_scaler`` on
``body.0`` (its consequence, info) and ``body.2`` (also ``body.4``, ``body.6``,
where underflow is partial).

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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    model = DeepRegressor().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    print(f"device={device.type} dtype=float16 scaler=None")

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
        # No GradScaler: the gradients are whatever float16 can represent.
        loss.backward()
        fracs = zero_grad_fractions(model)
        optimizer.step()

        loss_value = loss.item()
        if step == 0:
            step0_fracs = fracs
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.6f} zero_grad_frac {fmt(fracs)}")

    print(f"fp16_zero_grad_frac_step0 {fmt(step0_fracs)}")
    print(f"fp32_zero_grad_frac_step0 {fmt(ref)}")
    worst = max(EARLY, key=lambda n: fracs.get(n, 0.0))
    if fracs.get(worst, 0.0) > 0.5:
        print(f"SYMPTOM: {fracs[worst]:.0%} of {worst} weight gradients are zero in float16 "
              f"(float32: {ref[worst]:.0%}); loss={loss_value:.6f}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
