"""The baseline amp-doctor is compared with: the common module-hook debugger.

This is what tools that "log stats of every layer" typically do: a forward
hook on every module, and a gradient hook on every output tensor, each
computing a handful of statistics per tensor and calling ``.item()`` on each
one so the numbers can be logged right away. Every ``.item()`` is a
device->host copy (a blocking sync on CUDA), and every statistic is its own
pass over the tensor. It is written here, deliberately plainly, so its cost
is measured in the same run as amp-doctor's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

# Statistics a typical layer-stats hook logs; each is one reduction + .item().
STATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "min": torch.min,
    "max": torch.max,
    "mean": torch.mean,
    "std": torch.std,
    "absmax": lambda t: t.abs().max(),
    "has_nan": lambda t: t.isnan().any(),
    "has_inf": lambda t: t.isinf().any(),
    "zero_frac": lambda t: (t == 0).float().mean(),
}


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)


class NaiveStatsHooks:
    """Forward hooks on every module + grad hooks on their outputs, one ``.item()`` per stat."""

    def __init__(self, model: nn.Module) -> None:
        self.syncs = 0  # our own sync points, counted for the host-sync column
        self.steps = 0
        self.log: dict[str, dict[str, float]] = {}
        self._handles: list[RemovableHandle] = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def _summarize(self, key: str, t: torch.Tensor) -> None:
        t = t.detach()
        out: dict[str, float] = {}
        for stat, fn in STATS.items():
            out[stat] = float(fn(t).item())
            self.syncs += 1
        self.log[key] = out

    def _forward_hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if name == "":
                self.steps += 1  # the root module runs once per training step
            for i, t in enumerate(_tensors(output)):
                if not t.is_floating_point() or t.numel() == 0:
                    continue
                self._summarize(f"{name}.out{i}", t)
                if t.requires_grad:
                    key = f"{name}.grad{i}"
                    t.register_hook(lambda g, key=key: self._summarize(key, g))

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
