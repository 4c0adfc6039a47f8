"""Which precision the run used: the device, the autocast dtype, the low-precision format.

Seen from the root models' forward calls (autocast state on entry), from the
trace-time autocast of compiled graphs, and, when autocast is entered inside
the model's forward (Accelerate wraps ``forward``), from the layers' recorded
output dtypes. The low-precision format decides the overflow/underflow limits
every recorded step is judged against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from amp_doctor.devicework import iter_tensors
from amp_doctor.dtypes import LOW_PRECISION_NAMES, dtype_name

__all__ = ["PrecisionSeen", "WHAT_IF_DTYPE"]

# Judge what-if overflow/underflow against float16 when autocast never ran:
# it is the format with the narrower range, so the stricter question.
WHAT_IF_DTYPE = torch.float16


class _LayerDtypes(Protocol):
    param_dtypes: set[str]
    output_dtypes: set[str]


class PrecisionSeen:
    """The device type and autocast dtypes seen so far."""

    def __init__(self, layers: Callable[[], Iterable[_LayerDtypes] | None],
                 low_outputs: Callable[[], set[str]], recorded: Callable[[], int]) -> None:
        self._layers = layers
        self._low_outputs = low_outputs
        self._recorded = recorded
        self.device_type: str | None = None
        self._autocast: dict[str, int] = {}  # dtype name -> forward calls under it
        # Autocast entered inside the model's forward, judged once per recorded step.
        self._inside: str | None = None
        self._inside_at = -1

    @property
    def autocast_seen(self) -> bool:
        return bool(self._autocast) or self.autocast_inside() is not None

    @property
    def low_precision_seen(self) -> bool:
        """Autocast ran, or some layer produced float16/bfloat16 outputs."""
        return bool(self._autocast) or bool(self._low_outputs())

    def note_compiled(self, device: str, dtype: str) -> None:
        """A compiled graph was traced under autocast (its hooks cannot see it)."""
        self._autocast[dtype] = self._autocast.get(dtype, 0) + 1
        if self.device_type is None:
            self.device_type = device

    def note_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A root model's forward starts: its device, and the autocast it runs under."""
        if self.device_type is None:
            dev = None
            for t in iter_tensors(args):
                dev = t.device.type
                break
            if dev is None:
                p = next(module.parameters(), None)
                dev = p.device.type if p is not None else "cpu"
            self.device_type = dev
        dev = self.device_type
        if torch.is_grad_enabled() and torch.is_autocast_enabled(dev):
            name = dtype_name(torch.get_autocast_dtype(dev))
            self._autocast[name] = self._autocast.get(name, 0) + 1

    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype most forward calls ran under (None: no autocast)."""
        if not self._autocast:
            inside = self.autocast_inside()
            return getattr(torch, inside) if inside else None
        name = max(self._autocast, key=lambda k: self._autocast[k])
        return getattr(torch, name)

    def autocast_dtypes(self) -> list[str]:
        """Every dtype a root forward ran under autocast with, most used first."""
        return sorted(self._autocast, key=lambda k: -self._autocast[k])

    def scaler_dtype(self) -> torch.dtype | None:
        """The autocast dtype a GradScaler is judged against: float16 if any forward ran
        under float16 autocast (a float16 discriminator beside a bfloat16 generator: the
        scaler serves it), else :meth:`autocast_dtype`."""
        if "float16" in self._autocast:
            return torch.float16
        return self.autocast_dtype()

    def autocast_inside(self) -> str | None:
        """Autocast entered inside the model's forward (Accelerate wraps ``forward``).

        The root's pre-hook runs before it, so it sees no autocast. But a layer
        whose own parameters are float32 and whose output is float16/bfloat16
        ran under autocast: its recorded output dtype says so.
        """
        layers = self._layers()
        if layers is None:
            return None
        # Output dtypes only change on recorded steps: judge once per recorded step.
        recorded = self._recorded()
        if self._inside_at == recorded:
            return self._inside
        self._inside_at = recorded
        seen: dict[str, int] = {}
        for meta in layers:
            if meta.param_dtypes and meta.param_dtypes <= {"float32"}:
                for d in meta.output_dtypes & LOW_PRECISION_NAMES:
                    seen[d] = seen.get(d, 0) + 1
        self._inside = max(seen, key=lambda k: seen[k]) if seen else None
        return self._inside

    def low_dtype(self) -> torch.dtype:
        """The low-precision format the run's values are judged against."""
        dt = self.autocast_dtype()
        if dt is not None:
            return dt
        lows = self._low_outputs()
        if lows:
            return torch.float16 if "float16" in lows else torch.bfloat16
        return WHAT_IF_DTYPE
