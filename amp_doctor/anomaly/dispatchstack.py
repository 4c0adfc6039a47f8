"""A private dispatch mode that sees every aten op, entered below the user's own modes.

``TorchDispatchMode.__exit__`` pops whatever mode is on top. Entering ours on top
while a user's mode is active would make the user's ``__exit__`` pop ours and
leave theirs behind; so ours goes in below the user's modes, and is taken out
from wherever it is, the others keeping their order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._python_dispatch as _pd
from torch.utils._python_dispatch import TorchDispatchMode

from amp_doctor.devicework import OWN_MODE_FLAG, pop_dispatch_modes, push_dispatch_modes

__all__ = ["OpHandler", "OpMode", "enter_below_user_modes", "on_stack", "remove_mode"]

# ``handler(func, args, kwargs)`` runs the op (``func(*args, **kwargs)``) and returns its result.
OpHandler = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


class OpMode(TorchDispatchMode):
    """Hands every aten op to ``handler``."""

    def __init__(self, handler: OpHandler) -> None:
        super().__init__()
        self._handler = handler

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # A compiled region runs compiled, not eagerly op by op under this mode: eager
        # dropout draws other random numbers than inductor's, so the losses would change.
        return True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return self._handler(func, args, kwargs or {})


# own_ops keeps it on the stack (it skips amp-doctor's ops itself) while it takes the
# user's modes off.
setattr(OpMode, OWN_MODE_FLAG, True)


def _pop_user_modes_above(mode: TorchDispatchMode | None) -> list[Any]:
    """Pop the non-infra modes above ``mode`` (or all, if None); top first."""
    return pop_dispatch_modes(lambda top: top is mode)


def _sync_mode_flags() -> None:
    """torch's "a mode is active" flags, from the stack as it now is.

    Each mode saves and restores them in ``__enter__``/``__exit__`` as if the stack
    only grew and shrank at the top; after taking ours out of the middle they are
    set from what is really there.
    """
    modes = [torch._C._get_dispatch_stack_at(i)
             for i in range(torch._C._len_torch_dispatch_stack())]
    _pd._is_in_torch_dispatch_mode = bool(modes)
    _pd._is_in_non_infra_torch_dispatch_mode = any(not m.is_infra_mode() for m in modes)
    without = any(not m.ignore_compile_internals() for m in modes)
    _pd._is_in_any_mode_without_ignore_compile_internals = without
    _pd.set_is_in_mode_without_ignore_compile_internals(without)


def enter_below_user_modes(mode: TorchDispatchMode) -> None:
    """Enter ``mode`` below every non-infra mode already on the stack."""
    popped = _pop_user_modes_above(None)
    try:
        mode.__enter__()
    finally:
        push_dispatch_modes(popped)
        if popped:
            _sync_mode_flags()


def on_stack(mode: TorchDispatchMode) -> bool:
    return any(torch._C._get_dispatch_stack_at(i) is mode
               for i in range(torch._C._len_torch_dispatch_stack()))


def remove_mode(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off the dispatch stack wherever it is; the others keep their order."""
    if not on_stack(mode):
        return
    popped = _pop_user_modes_above(mode)
    try:
        n = torch._C._len_torch_dispatch_stack()
        if n and torch._C._get_dispatch_stack_at(n - 1) is mode:
            mode.__exit__(None, None, None)
    finally:
        push_dispatch_modes(popped)
        if popped:
            _sync_mode_flags()
