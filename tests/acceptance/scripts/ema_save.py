"""EMA with ``AveragedModel`` and whole-model checkpoints, for amp-doctor's acceptance suite.

The patterns of the timm / torchvision reference trainers and pytorch/examples'
word_language_model: an exponential moving average built with
``torch.optim.swa_utils.AveragedModel`` (which deep-copies the model) after training has
started, ``torch.save(model)`` of the whole module (pickled, not a state dict), a
``copy.deepcopy`` for a best-model snapshot, and a ``state_dict`` round trip.

    python ema_save.py --steps 12 --dtype float16 [--out_dir out-ema]

Prints ``step N: loss X`` per step and ``ema eval loss X`` at the end.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class ConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--ema_start", type=int, default=2, help="build the EMA after this many steps")
    ap.add_argument("--out_dir", default="out-ema")
    args = ap.parse_args()

    torch.manual_seed(0)
    os.makedirs(args.out_dir, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    g = torch.Generator().manual_seed(1)
    ema: AveragedModel | None = None
    best: nn.Module | None = None
    for step in range(args.steps):
        x = torch.randn(8, 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step}: loss {loss.item()!r}", flush=True)
        if step + 1 == args.ema_start:
            ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        elif ema is not None:
            ema.update_parameters(model)
        if step % 4 == 3:
            best = copy.deepcopy(model)  # a best-model snapshot
            torch.save(model, os.path.join(args.out_dir, "model.pt"))  # the whole module
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "scaler": scaler.state_dict()}, os.path.join(args.out_dir, "ckpt.pt"))

    # Resume as a user would: load the pickled module and the state dicts back.
    reloaded = torch.load(os.path.join(args.out_dir, "model.pt"), weights_only=False)
    ckpt = torch.load(os.path.join(args.out_dir, "ckpt.pt"), weights_only=True)
    fresh = ConvNet()
    fresh.load_state_dict(ckpt["model"])
    model.load_state_dict(ckpt["model"])
    assert best is not None and ema is not None
    for a, b in zip(reloaded.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    ema.eval()
    with torch.no_grad():
        x = torch.randn(8, 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        print(f"ema eval loss {nn.functional.cross_entropy(ema(x), y).item()!r}")


if __name__ == "__main__":
    main()
