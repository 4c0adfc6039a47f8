"""Small real training loops shared by the tests."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def train(
    model: nn.Module,
    steps: int = 4,
    dtype: torch.dtype = torch.float16,
    scaler: torch.amp.GradScaler | None | bool = True,
    seed: int = 0,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    lr: float = 0.05,
    autocast: bool = True,
) -> list[float]:
    """The seed recipe: autocast forward + loss, scaled backward, step, update."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if scaler is True:
        scaler = torch.amp.GradScaler("cpu")
    losses = []
    for i in range(steps):
        if batch is not None:
            x, y = batch(i)
        else:
            x = torch.randn(8, 16, generator=g)
            y = torch.randint(0, 4, (8,), generator=g)
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = model(x)
            loss = nn.functional.cross_entropy(out.float(), y)
        opt.zero_grad()
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        losses.append(float(loss.detach()))
    return losses


def train_gan_two_scalers(gen: nn.Module, disc: nn.Module, iters: int, boost_at: int,
                          updates: str = "together") -> tuple[float, float]:
    """A GAN with a GradScaler per network; at ``boost_at`` the generator's scaled loss
    overflows float16. ``updates``: "together" (both update()s after both steps) or
    "each" (each right after its own step). Returns the (disc, gen) scales at the end."""
    og, od = torch.optim.Adam(gen.parameters(), 1e-3), torch.optim.Adam(disc.parameters(), 1e-3)
    sg, sd = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    for it in range(iters):
        z, real = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        od.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            fake = gen(z)
            ld = disc(real).float().mean() - disc(fake.detach()).float().mean()
        sd.scale(ld).backward()
        sd.step(od)
        if updates == "each":
            sd.update()
        og.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            lg = disc(fake).float().mean() * (1e30 if it == boost_at else 1.0)
        sg.scale(lg).backward()
        sg.step(og)
        if updates == "together":
            sd.update()
        sg.update()
    return sd.get_scale(), sg.get_scale()


def console_script(name: str = "amp-doctor") -> str:
    """The installed console script, found next to the interpreter running the tests.

    ``make test`` runs ``.venv/bin/python -m pytest`` without the venv's bin/ on PATH.
    """
    import os
    import shutil
    import sys
    from pathlib import Path

    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which(name, path=path) or ""


def marked_line(path: str, marker: str) -> int:
    """The line number of the line of ``path`` that ends with ``# marker``: what a
    report's ``file:line`` must name."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith("# " + marker):
                return i
    raise AssertionError(marker)


def diagnose_pair(tmp_path: Path, name: str, script: str, args: list[str], *flags: str
                  ) -> tuple[str, subprocess.CompletedProcess[str], dict[str, Any]]:
    """The script run plainly, then through the CLI with ``flags``; and its JSON report."""
    (tmp_path / name).write_text(script)
    plain = subprocess.run([sys.executable, name, *args], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / ("out" + "".join(flags).replace("-", "_").replace(" ", ""))
    r = subprocess.run([console_script(), "diagnose", "-q", "--no-tensorboard", *flags,
                        "--logdir", str(out), name, *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    return plain.stdout, r, json.loads((out / "amp_doctor.json").read_text())
