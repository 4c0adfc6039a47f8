"""amp-doctor: why your PyTorch mixed-precision training misbehaves, and where.

    import amp_doctor
    with amp_doctor.watch(model, logdir="runs/amp") as doctor:
        ...  # the usual autocast + GradScaler loop
    print(doctor.report())

The names below are imported on first use (PEP 562), so that ``amp-doctor --help``
and ``amp-doctor report`` start without importing torch, which takes seconds.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from amp_doctor._version import __version__
from amp_doctor.errors import AmpDoctorError, NonFiniteError

if TYPE_CHECKING:
    from amp_doctor.records import Finding, Session
    from amp_doctor.watch import Watch, watch

__all__ = ["watch", "Watch", "Session", "Finding", "AmpDoctorError", "NonFiniteError",
           "__version__"]

# public name -> the submodule that defines it
_LAZY = {"watch": "watch", "Watch": "watch", "Session": "records", "Finding": "records"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'amp_doctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


class _Package(types.ModuleType):
    """Keeps ``amp_doctor.watch`` the function when the submodule of that name loads.

    Importing ``amp_doctor.watch`` (the module) makes the import system set it as this
    package's ``watch`` attribute; the eager ``from .watch import watch`` used to undo
    that right away, and this does the same on demand.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "watch" and isinstance(value, types.ModuleType):
            value = value.watch
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
