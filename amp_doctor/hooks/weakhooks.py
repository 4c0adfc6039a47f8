"""Hooks on the user's modules and tensors that never keep a watch alive.

Whatever amp-doctor registers on a user's model is reachable from it: by
``copy.deepcopy(model)``, ``torch.save(model)``, an EMA's ``AveragedModel``.
So a hook holds only a *weak* reference to its owner (never a writer, a lock
or a step buffer's owner), and a deep copy or a pickle of it is an
:class:`Unwatched` hook: the copy is an unwatched model that runs as the user
wrote it, and each of those hooks removes itself from its module on its first
call.

A leaf module: it imports nothing else from amp-doctor.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch import nn

__all__ = ["Unwatched", "WeakHook", "WeakMethodHook", "drop_hook", "own_hooks_lifted",
           "state_without_own_hooks"]

_O = TypeVar("_O")


def _forward_hook_dicts(module: nn.Module) -> Iterator[tuple[dict[Any, Any],
                                                            tuple[dict[Any, Any], ...]]]:
    """``module``'s forward (pre-)hook dicts, each with the flag dicts keyed like it."""
    yield module._forward_pre_hooks, (module._forward_pre_hooks_with_kwargs,)
    yield module._forward_hooks, (module._forward_hooks_with_kwargs,
                                  module._forward_hooks_always_called)


def drop_hook(module: nn.Module, hook: object) -> None:
    """Remove every registration of ``hook`` from ``module``'s forward hook dicts."""
    for hooks, flags in _forward_hook_dicts(module):
        for k in [k for k, v in hooks.items() if v is hook]:
            del hooks[k]
            for f in flags:
                f.pop(k, None)


@contextlib.contextmanager
def own_hooks_lifted(root: nn.Module) -> Iterator[None]:
    """Take amp-doctor's hooks (and the :class:`Unwatched` ones of a copy) off the forward
    hook dicts of ``root`` and its submodules for the block, then put every dict back as it
    was, in its order: for ``torch.jit.script``, which compiles a module's forward hooks
    as TorchScript, and so would fail on them (and must not carry them if it could)."""
    saved: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    for m in root.modules():
        for hooks, flags in _forward_hook_dicts(m):
            ours = [k for k, v in hooks.items() if isinstance(v, (WeakHook, Unwatched))]
            if not ours:
                continue
            for d in (hooks, *flags):
                saved.append((d, dict(d)))
            for k in ours:
                del hooks[k]
                for f in flags:
                    f.pop(k, None)
    try:
        yield
    finally:
        for d, was in saved:
            d.clear()
            d.update(was)


def state_without_own_hooks(state: dict[str, Any]) -> dict[str, Any]:
    """A module's pickled state (what ``__getstate__`` returned, a copy of its
    ``__dict__``) without amp-doctor's forward hooks: a deep copy or a checkpoint
    (``torch.save(model)``) of a watched model carries none of them, and loads where
    amp_doctor is not installed."""
    for hooks, flags in _forward_hook_dicts_of(state):
        ours = {k for k, v in state[hooks].items() if isinstance(v, (WeakHook, Unwatched))}
        if not ours:
            continue
        for name in (hooks, *flags):
            d = state.get(name)
            if d is not None:
                state[name] = type(d)((k, v) for k, v in d.items() if k not in ours)
    return state


def _forward_hook_dicts_of(state: dict[str, Any]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """The names of the forward (pre-)hook dicts in a module's state, each with the names
    of the flag dicts keyed like it (as :func:`_forward_hook_dicts`)."""
    if state.get("_forward_pre_hooks"):
        yield "_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)
    if state.get("_forward_hooks"):
        yield "_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class Unwatched:
    """What a watched model's hook becomes in a deep copy or an unpickled model, where
    :func:`state_without_own_hooks` did not leave it out (a ``__getstate__`` assigned to
    a module class after the watch started, which the patch hub never saw).

    It does nothing and, on its first eager call on a module, removes itself from
    it. A copy of a watched model (``copy.deepcopy``, ``AveragedModel``,
    ``torch.save``/``torch.load``) is therefore an unwatched model.
    """

    # Tensor hooks: torch.save must not warn that this hook is not serialised.
    __torch_unserializable__ = True

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if torch.compiler.is_compiling() or torch._C._is_tracing():
            return None
        if args and isinstance(args[0], nn.Module):
            drop_hook(args[0], self)
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        return (Unwatched, ())


class WeakHook(Generic[_O]):
    """Base of every hook amp-doctor puts on a user's module or tensor.

    :meth:`owner` is the object the hook reports to, or None once it is gone;
    a deep copy or a pickle is an :class:`Unwatched` hook.
    """

    __torch_unserializable__ = True
    # Subclasses without __slots__ still get a __dict__; those made per tensor
    # declare theirs, so that each is one object for the garbage collector, not two.
    __slots__ = ("_owner",)

    def __init__(self, owner: _O) -> None:
        self._owner = weakref.ref(owner)

    def owner(self) -> _O | None:
        return self._owner()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Unwatched, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Unwatched:
        return Unwatched()


class WeakMethodHook(WeakHook[_O]):
    """A hook that calls ``method(owner, *args)`` while its owner lives."""

    def __init__(self, owner: _O, method: Callable[..., Any]) -> None:
        super().__init__(owner)
        self._method = method

    def __call__(self, *args: Any) -> Any:
        owner = self._owner()
        if owner is None:
            return None
        return self._method(owner, *args)
