"""The variants timed side by side: what is attached to a trainer for one block of steps.

Each variant is attached at the start of a block and removed at its end, so
while one variant is timed nothing of any other is installed (amp-doctor's
GradScaler/optimizer patches are process-wide while any watch is open; a
watch left open across blocks would slow the plain reference too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from bench_models import Trainer
from naive_hooks import NaiveStatsHooks
from torch.utils._python_dispatch import TorchDispatchMode

import amp_doctor
import amp_doctor.device.stats as S
from amp_doctor.hooks.seen import SeenTensors
from amp_doctor.watch import DEFAULT_EVERY


class Attached:
    """A variant attached to one trainer. Counters are cumulative since attach."""

    def recorded(self) -> int:
        """Steps whose statistics were recorded so far (0 for plain)."""
        return 0

    def syncs(self) -> int | None:
        """A baseline's own count of its device->host copies so far; None when not
        countable. amp-doctor's variants are counted from outside instead
        (``run.count_syncs`` with ``tests/syncs.py``), so theirs is never asked."""
        return 0

    def close(self) -> None:
        return None


class _Watch(Attached):
    def __init__(self, trainer: Trainer, every: int, anomaly: bool) -> None:
        # Default options otherwise: scaler and optimizer are found automatically,
        # as in a user's loop. No logdir, so nothing is written on close.
        self.watch = amp_doctor.watch(trainer.model, every=every, anomaly=anomaly)

    def recorded(self) -> int:
        return self.watch.recorded

    def syncs(self) -> int | None:
        return None  # counted independently, by run.count_syncs

    def close(self) -> None:
        self.watch.close()


class _Naive(Attached):
    def __init__(self, trainer: Trainer) -> None:
        self.hooks = NaiveStatsHooks(trainer.model)

    def recorded(self) -> int:
        return self.hooks.steps

    def syncs(self) -> int | None:
        return self.hooks.syncs

    def close(self) -> None:
        self.hooks.remove()


class _DetectAnomaly(Attached):
    def __init__(self, trainer: Trainer) -> None:
        self._prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self._steps0 = trainer.steps
        self._trainer = trainer
        # Same effect as wrapping the loop in ``with torch.autograd.detect_anomaly():``
        # without its "enabled" warning on every block.
        torch.autograd.set_detect_anomaly(True, check_nan=True)

    def recorded(self) -> int:
        return self._trainer.steps - self._steps0  # it checks every step

    def syncs(self) -> int | None:
        return None  # its NaN checks are inside autograd's C++: not countable on CPU

    def close(self) -> None:
        torch.autograd.set_detect_anomaly(*self._prev)


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _EmptyDispatchMode(Attached):
    """The floor of any per-op checker written in Python: a TorchDispatchMode that
    only passes each op through, on every op of the step (optimizer included)."""

    def __init__(self, trainer: Trainer) -> None:
        self._mode = _PassThrough()
        self._mode.__enter__()
        self._steps0 = trainer.steps
        self._trainer = trainer

    def recorded(self) -> int:
        return self._trainer.steps - self._steps0

    def syncs(self) -> int | None:
        return 0

    def close(self) -> None:
        self._mode.__exit__(None, None, None)


class _EmptyHooks(Attached):
    """The floor of any per-module hook design: a forward hook on every module that
    puts a no-op gradient hook on each tensor output, and does nothing else."""

    def __init__(self, trainer: Trainer) -> None:
        def on_grad(grad: torch.Tensor) -> None:
            return None

        def on_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(on_grad)

        self._handles = [m.register_forward_hook(on_forward) for m in trainer.model.modules()]
        self._steps0 = trainer.steps
        self._trainer = trainer

    def recorded(self) -> int:
        return self._trainer.steps - self._steps0

    def syncs(self) -> int | None:
        return 0

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class _DeviceFloor(Attached):
    """The floors of amp-doctor's recorded step, made of its own parts without its
    bookkeeping: the hooks of :class:`_EmptyHooks` filing every tensor that
    ``watch(every=1)`` files (each module's output once, the gradient of each, every
    parameter's gradient after backward), and once per step a host copy.

    ``full=False``: each tensor is only copied into a staging buffer (its sample, as
    ``stats.Batch`` would take it): the least any design pays that reads every
    tensor from a Python hook. ``full=True``: each is filed by ``stats.Batch``
    itself (exact min and max, staged sample, non-zero count, batched histogram
    passes) and the step ends with ``finish()`` and its host copy: amp-doctor's
    device work, without its per-layer records, decode or aggregation.
    """

    def __init__(self, trainer: Trainer, full: bool) -> None:
        self._full = full
        self._batch = S.Batch()
        self._stage: torch.Tensor | None = None  # sized and regrown as stats.Batch does
        self._used = 0
        self._filed = 0  # bytes filed this step
        self._head = 0  # the stage's head start (stats.STAGE_HEAD_START of the last step)
        self._seen: SeenTensors[bool] = SeenTensors()  # as the probes: no id reuse

        def file(t: torch.Tensor) -> None:
            if self._full:
                self._batch.add(t)
                return
            sample = S._sample(t.detach())
            k = sample.numel()
            self._filed += t.numel() * t.element_size()
            if self._stage is not None and self._used + k > self._stage.numel():
                self._used = 0
                if self._stage.numel() < S.stage_size(self._filed):
                    self._stage = None
            if self._stage is None:
                self._stage = torch.empty(S.stage_size(max(self._filed, self._head)),
                                          dtype=torch.float32)
            self._stage[self._used : self._used + k].copy_(sample)
            self._used += k

        def on_grad(grad: torch.Tensor) -> None:
            file(grad)

        def on_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
            if (isinstance(output, torch.Tensor) and output.requires_grad
                    and self._seen.get(output) is None):
                self._seen[output] = True
                file(output)
                output.register_hook(on_grad)

        params = [p for p in trainer.model.parameters() if p.requires_grad]
        step = trainer.step

        def step_and_close() -> None:
            step()
            for p in params:
                if p.grad is not None:
                    file(p.grad)
            filed = self._batch.filed_bytes if self._full else self._filed
            self._head = int(filed * S.STAGE_HEAD_START)
            if self._full:
                self._batch.finish().cpu()  # the step's one host copy
                self._batch = S.Batch(head_start_bytes=self._head)
            self._stage, self._used, self._filed = None, 0, 0
            self._seen.clear()

        self._handles = [m.register_forward_hook(on_forward) for m in trainer.model.modules()]
        trainer.step = step_and_close  # type: ignore[method-assign]
        self._steps0 = trainer.steps
        self._trainer = trainer

    def recorded(self) -> int:
        return self._trainer.steps - self._steps0

    def syncs(self) -> int | None:
        return self.recorded() if self._full else 0  # finish().cpu() once a step

    def close(self) -> None:
        del self._trainer.step  # the class's step again
        for h in self._handles:
            h.remove()


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    # Target as a ratio to plain AMP step time (issue 15); None: a baseline, no target.
    target: float | None
    # Record one step in ``every``: sampled steps are weighted accordingly.
    every: int = 1

    def attach(self, trainer: Trainer) -> Attached:
        if self.key == "plain":
            return Attached()
        if self.key == "default":
            return _Watch(trainer, every=DEFAULT_EVERY, anomaly=False)
        if self.key == "every1":
            return _Watch(trainer, every=1, anomaly=False)
        if self.key == "anomaly":
            return _Watch(trainer, every=DEFAULT_EVERY, anomaly=True)
        if self.key == "naive":
            return _Naive(trainer)
        if self.key == "detect_anomaly":
            return _DetectAnomaly(trainer)
        if self.key == "empty_mode":
            return _EmptyDispatchMode(trainer)
        if self.key == "empty_hooks":
            return _EmptyHooks(trainer)
        if self.key == "copy_floor":
            return _DeviceFloor(trainer, full=False)
        if self.key == "stats_floor":
            return _DeviceFloor(trainer, full=True)
        raise ValueError(f"unknown variant {self.key!r}")


_EVERY = DEFAULT_EVERY
VARIANTS: dict[str, Variant] = {
    v.key: v
    for v in (
        Variant("plain", "plain AMP", None),
        Variant("default", f"watch() default (every={_EVERY})", 1.03, every=_EVERY),
        Variant("every1", "watch(every=1)", 1.25),
        # Issue 15: a healthy run with --anomaly at most 1.10x.
        Variant("anomaly", f"watch(anomaly=True) (every={_EVERY})", 1.10, every=_EVERY),
        Variant("naive", "naive hooks + .item()", None),
        Variant("detect_anomaly", "autograd.detect_anomaly", None),
        Variant("empty_mode", "empty TorchDispatchMode (floor)", None),
        Variant("empty_hooks", "empty module + grad hooks (floor)", None),
        Variant("copy_floor", "hooks + one copy per tensor (floor)", None),
        Variant("stats_floor", "hooks + stats device ops (floor)", None),
    )
}
