"""Watched training recipes shared by the finding tests.

Apart from ``tests/helpers.py`` on purpose: that module defines models that tests pickle
and load where amp_doctor cannot be imported, so it must not import amp_doctor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor


def classify(model: nn.Module, steps: int, shape: tuple[int, int, int],
              before: Callable[[int], None] = lambda step: None, lr: float = 1e-3,
              **watch: Any) -> amp_doctor.Session:
    """The seed recipe on random (batch, features, classes) ``shape`` batches, in float16
    with a GradScaler, under a watch; ``before(step)`` runs first in each step."""
    batch, features, classes = shape
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, **watch) as doctor:
        for step in range(steps):
            before(step)
            x, y = torch.randn(batch, features), torch.randint(0, classes, (batch,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session
