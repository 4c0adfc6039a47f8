"""The models under test and one training step of the seed recipe.

The sample models are plain scripts, not a package, so they are loaded by
path. Every variant trains its own deep copy of one initial model on the
same fixed batches: numerics stay identical across variants and never drift
into NaN, and data generation is never inside a timed step.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from torch.optim import Optimizer

ROOT = Path(__file__).resolve().parents[1]
SAMPLES_DIR = ROOT / "sample_models"
BENCH_DIR = Path(__file__).resolve().parent

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}

OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


@dataclass(frozen=True)
class ModelSpec:
    """What the benchmark needs from a sample model."""

    key: str
    file: str
    # Chosen so a plain CPU step takes a few tens of ms on a 2-core machine:
    # long enough that ratios are not Python noise, short enough for a quick run.
    batch_size: int
    optimizer: OptimizerFactory
    folder: Path = SAMPLES_DIR
    # The dtypes it is timed in (None: all of DTYPES). The wide model runs float16 only,
    # the case with a GradScaler, to keep a full `make bench` near ten minutes.
    dtypes: tuple[str, ...] | None = None


def _adam(params: Iterable[nn.Parameter]) -> Optimizer:
    return torch.optim.Adam(params, lr=3e-3)


def _adamw(params: Iterable[nn.Parameter]) -> Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


# The optimizers are the ones the sample scripts use in their own main().
SPECS: dict[str, ModelSpec] = {
    "cnn": ModelSpec("cnn", "healthy_cnn.py", batch_size=128, optimizer=_adam),
    "transformer": ModelSpec("transformer", "healthy_transformer.py", batch_size=32,
                             optimizer=_adamw),
    # Wide and deep (issue 15): 40 blocks, 524 leaf modules; benchmarks/gpt_model.py.
    "gpt": ModelSpec("gpt", "gpt_model.py", batch_size=8, optimizer=_adamw, folder=BENCH_DIR,
                     dtypes=("float16",)),
}

# How many distinct fixed batches a trainer cycles through.
N_BATCHES = 4


def load_sample(spec: ModelSpec) -> ModuleType:
    """Import ``<folder>/<file>`` by path; a clear error when it is missing."""
    path = spec.folder / spec.file
    if not path.exists():
        raise SystemExit(
            f"benchmark: {path} is missing; it must expose make_model(device), "
            "make_batch(device, batch_size) and loss_fn."
        )
    mod_spec = importlib.util.spec_from_file_location(f"_bench_sample_{spec.key}", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    for attr in ("make_model", "make_batch", "loss_fn"):
        if not hasattr(module, attr):
            raise SystemExit(f"benchmark: {path} has no {attr}()")
    return module


class Trainer:
    """One model copy with its own optimizer and scaler; ``step()`` is the timed unit."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.batches = batches
        self.device = device
        self.dtype = dtype
        # The seed recipe: float16 needs loss scaling, bfloat16 does not
        # (it has float32's exponent range), so it trains without a scaler.
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        )
        self.steps = 0

    def step(self) -> None:
        """forward + loss under autocast, backward, optimizer step (+ scaler update)."""
        x, y = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            loss = self.loss_fn(self.model(x), y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()


class Workload:
    """One (model, dtype, device) cell: the initial weights and the fixed batches."""

    def __init__(self, spec: ModelSpec, dtype_name: str, device: torch.device,
                 batch_size: int | None = None) -> None:
        self.spec = spec
        self.dtype_name = dtype_name
        self.dtype = DTYPES[dtype_name]
        self.device = device
        self.batch_size = batch_size or spec.batch_size
        self.module = load_sample(spec)
        torch.manual_seed(0)
        self.initial: nn.Module = self.module.make_model(device)
        torch.manual_seed(1)
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = [
            self.module.make_batch(device, self.batch_size) for _ in range(N_BATCHES)
        ]

    def trainer(self) -> Trainer:
        """A fresh copy of the initial model, with its own optimizer and scaler."""
        model = copy.deepcopy(self.initial)
        model.train()
        return Trainer(model, self.spec.optimizer(model.parameters()), self.module.loss_fn,
                       self.batches, self.device, self.dtype)
