"""Pathology: a module's float16 outputs sit below float16's smallest normal
number (activation underflow): they lose most of their precision, some are 0.

What goes wrong: a residual MLP uses LayerScale as in ConvNeXt / CaiT / timm:
each residual branch ends with ``x * gamma`` where ``gamma`` is a learned
per-channel scale initialised to 1e-6, and (as timm's ``LayerScale(...,
inplace=True)`` does) the multiply is in place: ``x.mul_(gamma)``. Training
starts with the usual linear learning-rate warm-up (from lr/1000), so
``gamma`` stays near 1e-6 for the first steps. Under float16 autocast the
branch output ``x`` (from ``fc2``) is float16, and an in-place op keeps its
tensor's dtype, so the product is stored in float16. Values of ~1e-7 to
1e-5 are below float16's smallest normal (6.1e-5): they are subnormal,
carry only a few significant bits (step 6e-8), and everything below ~3e-8
is flushed to exactly 0. The residual branches' contributions are quantised
until ``gamma`` grows. In float32 the same products are exact (float32's
smallest normal is 1.2e-38).

Why: float16's exponent range ends at 2**-14 (normal) / 2**-24 (subnormal).
Note the contrast: the out-of-place ``x * gamma`` *promotes* to float32
(``gamma`` is a float32 parameter), so ``--no-inplace`` avoids the underflow.

Symptom when run plainly: the loss is finite and the scale is stable, but
each printed step shows for ``blocks.0.ls``: ``below_normal_frac`` (share of
outputs below 6.1e-5 in magnitude) 1.0 for the first ~15 steps and still
~0.9 at step 20; at step 0 ``zero_frac`` ~13% (flushed to 0 although the
float32 product is non-zero) and ``rel_err`` ~10% (median relative error vs
the float32 product).

Expected amp-doctor finding: ``activation_underflow`` on ``blocks.0.ls`` and
``blocks.1.ls``.

Module names: ``stem``, ``blocks.0``/``blocks.1`` (each with ``norm``,
``fc1``, ``act``, ``fc2``, ``ls``), ``head``.
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
N_CLASSES = 4
LAYER_SCALE_INIT = 1e-6
FP16_TINY = torch.finfo(torch.float16).tiny  # smallest normal, 6.1e-5


class LayerScale(nn.Module):
    """Per-channel learned scale, as in timm (``init_values=1e-6``)."""

    def __init__(self, dim: int, init_values: float = LAYER_SCALE_INIT,
                 inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place keeps x's float16; out of place would promote to float32.
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class ResBlock(nn.Module):
    def __init__(self, dim: int, inplace: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * dim, dim)
        self.ls = LayerScale(dim, inplace=inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ls(self.fc2(self.act(self.fc1(self.norm(x)))))


class ResMLP(nn.Module):
    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.stem = nn.Linear(N_FEATURES, WIDTH)
        self.blocks = nn.ModuleList(ResBlock(WIDTH, inplace) for _ in range(2))
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_batch(device: torch.device, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters around fixed class centres."""
    centres = torch.randn(N_CLASSES, N_FEATURES, generator=torch.Generator().manual_seed(11))
    y = torch.randint(0, N_CLASSES, (batch_size,))
    x = centres[y] + torch.randn(batch_size, N_FEATURES)
    return x.to(device), y.to(device)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=1000)
    p.add_argument("--no-inplace", action="store_true",
                   help="out-of-place LayerScale (x * gamma promotes to float32: the fix)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    model = ResMLP(inplace=not args.no_inplace).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # The usual linear warm-up: the learning rate starts at lr/1000, so gamma
    # stays near its 1e-6 init for the first steps.
    scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1e-3, total_iters=args.warmup_steps)
    scaler = torch.amp.GradScaler(device.type)
    init_scale = scaler.get_scale()
    print(f"device={device.type} dtype=float16 inplace={not args.no_inplace} "
          f"init_scale={init_scale:g}")

    # What a user adds to look at one LayerScale: the exact float32 product
    # (taken before the in-place multiply overwrites the input) and the output.
    block = model.blocks[0]
    assert isinstance(block, ResBlock)
    ls = block.ls

    def keep_reference(_mod: nn.Module, inp: tuple[torch.Tensor, ...]) -> None:
        seen["ref"] = inp[0].detach().float() * ls.gamma.detach().float()

    seen: dict[str, torch.Tensor] = {}
    ls.register_forward_pre_hook(keep_reference)
    ls.register_forward_hook(
        lambda _mod, _inp, out: seen.__setitem__("out", out.detach().clone()))

    first_loss = math.nan
    loss_value = math.nan
    below_fracs: list[float] = []
    zero0 = rel_err0 = math.nan
    out_dtype = ""
    for step in range(args.steps):
        x, y = make_batch(device, args.batch_size)
        optimizer.zero_grad()
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        loss_value = loss.item()
        if step == 0:
            first_loss = loss_value
        out, ref = seen["out"].float(), seen["ref"]
        nonzero = ref != 0
        below = (out.abs() < FP16_TINY).float().mean().item()
        zero = ((out == 0) & nonzero).float().mean().item()
        rel_err = ((out - ref).abs()[nonzero] / ref.abs()[nonzero]).median().item()
        out_dtype = str(seen["out"].dtype).removeprefix("torch.")
        below_fracs.append(below)
        if step == 0:
            zero0, rel_err0 = zero, rel_err
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.4f} scale={scaler.get_scale():g} "
                  f"ls_dtype={out_dtype} below_normal_frac={below:.3f} zero_frac={zero:.3f} "
                  f"rel_err={rel_err:.4f}")

    print(f"first_loss={first_loss:.4f} final_loss={loss_value:.4f} "
          f"init_scale={init_scale:g} final_scale={scaler.get_scale():g}")
    mean_below = sum(below_fracs) / max(len(below_fracs), 1)
    print(f"mean_below_normal_frac={mean_below:.3f} step0_zero_frac={zero0:.3f} "
          f"step0_rel_err={rel_err0:.4f}")
    if out_dtype == "float16" and mean_below > 0.5:
        print(f"SYMPTOM: {mean_below:.0%} of blocks.0.ls float16 outputs were below float16's "
              f"smallest normal ({FP16_TINY:.2g}); at step 0 {zero0:.1%} were flushed to "
              f"zero, median relative error {rel_err0:.1%}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
