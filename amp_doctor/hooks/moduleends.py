"""The end of a watched module's call, relayed from the probes' post-hook.

Anomaly mode needs each watched module's output while it searches (to tell a
hidden overflow from one the module passes on). A global module hook of its
own would be traced by dynamo, guarded on (adding or removing it recompiles a
compiled model) and warned about by ``OptimizedModule``; the probes' own
per-module hooks already run at exactly those points, and already leave
compiled graphs alone. So the probes publish each module end here, and at
most one listener (the one active anomaly watch) hears them.

A leaf module: it imports nothing else from amp-doctor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["ModuleEndListener", "Listening", "listen", "publish"]

ModuleEndListener = Callable[[nn.Module, Any], None]

_listener: list[ModuleEndListener] = []


class Listening:
    """What :func:`listen` returns: ``remove()`` stops the listener (idempotent)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: ModuleEndListener) -> None:
        self._fn: ModuleEndListener | None = fn

    def remove(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None and _listener and _listener[0] is fn:
            _listener.clear()


def listen(fn: ModuleEndListener) -> Listening:
    """Have ``fn(module, output)`` called at the end of each watched module's call."""
    if _listener:
        raise RuntimeError("one module-end listener at a time")
    _listener.append(fn)
    return Listening(fn)


def publish(module: nn.Module, output: Any) -> None:
    """Called by the probes' post-hook (eagerly, never inside a compiled graph)."""
    if _listener:
        _listener[0](module, output)
