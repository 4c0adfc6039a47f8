"""Pathology: ``torch.log(torch.softmax(logits))`` in float16; small
probabilities underflow to 0 and their log is ``-inf``.

What goes wrong: a prototype classifier sharpens its logits with a low
temperature (0.05, as in contrastive / distillation heads), so logit gaps of
20-60 are normal. Its head computes log-probabilities by hand as
``torch.log(torch.softmax(logits / T, dim=-1))`` instead of
``torch.log_softmax``. Under CPU float16 autocast, ``head.fc`` returns float16
and both ``softmax`` and ``log`` run in float16 (CPU autocast has no float32
rule for them). float16's smallest subnormal is 6e-8, so every probability
below ~3e-8 (a logit gap above ~17) becomes exactly 0, and ``log(0) = -inf``.
Whenever a sample's *target* class underflows, ``nll_loss`` returns ``inf``;
and even for the other entries the backward of ``log`` computes ``0 / 0 =
NaN``. In float32 the same probabilities (down to ~1e-26) are representable
and the loss is finite; bfloat16 (float32's range) is fine too.

Why: float16's exponent range; on CUDA, autocast runs ``softmax`` and
``log`` in float32, so this sample reproduces under CPU autocast (or anywhere
these ops run on float16 tensors outside autocast).

Symptom when run plainly: the loss is ``inf`` from step 0 on, the head's
output holds ``-inf`` entries (``neg_inf_frac``), gradients are NaN, every
step is skipped and the scale halves each step (65536 -> 16 after 12 steps).

Expected amp-doctor findings: ``nonfinite_forward`` in module ``head`` (the
``ProbHead`` that computes log(softmax)), op ``aten.log`` (the softmax op
``aten._softmax`` stays finite: its zeros are the underflow), plus
``scaler_backoff`` and ``scale_collapse``. ``--dtype bfloat16`` or
``--dtype float32`` is healthy.

Module names: ``encoder`` (``encoder.0`` Linear, ``encoder.1`` ReLU),
``head``, ``head.fc``.
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
HIDDEN = 32
N_CLASSES = 10
TEMPERATURE = 0.05


class ProbHead(nn.Module):
    """Linear -> temperature -> log(softmax), written out by hand."""

    def __init__(self, d_in: int, n_classes: int, temperature: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, n_classes)
        self.temperature = temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.fc(x) / self.temperature, dim=-1)
        # The bug: log of probabilities that may have underflowed to 0.
        return torch.log(probs)


class PrototypeClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(N_FEATURES, HIDDEN), nn.ReLU())
        self.head = ProbHead(HIDDEN, N_CLASSES, TEMPERATURE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters around fixed class centres."""
    centres = 2.0 * torch.randn(N_CLASSES, N_FEATURES, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, N_CLASSES, (batch_size,))
    x = centres[y] + torch.randn(batch_size, N_FEATURES)
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

    model = PrototypeClassifier().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    init_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"device={device.type} dtype={args.dtype} init_scale={init_scale:g}")

    loss_value = math.nan
    first_bad: int | None = None
    for step in range(args.steps):
        x, y = make_batch(device, args.batch_size)
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=dtype,
                            enabled=dtype != torch.float32):
            log_probs = model(x)
            loss = F.nll_loss(log_probs, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        loss_value = loss.item()
        if first_bad is None and not math.isfinite(loss_value):
            first_bad = step
        neg_inf = torch.isneginf(log_probs).float().mean().item()
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        if step % 2 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.4f} neg_inf_frac={neg_inf:.3f} "
                  f"log_probs_dtype={str(log_probs.dtype).removeprefix('torch.')} "
                  f"scale={scale:g}")

    final_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"final_loss={loss_value:.4f} init_scale={init_scale:g} final_scale={final_scale:g}")
    if first_bad is not None:
        print(f"SYMPTOM: loss is {loss_value} from step {first_bad} (log of underflowed "
              f"softmax); scale fell from {init_scale:g} to {final_scale:g}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
