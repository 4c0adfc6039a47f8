"""Checks of ``watch()``'s arguments, each failure a one-line message naming the fix.

Without them, ``watch(None)``, ``watch([])`` or ``optimizer="adam"`` ran and gave an
empty report, and ``watch(opt)`` died on ``TypeError: 'SGD' object is not iterable``
deep inside. Counts accept any integral number (``numpy.int64`` from a config or an
argument parser), but not ``bool`` or ``float``.
"""

from __future__ import annotations

import difflib
import inspect
import operator
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from torch import Tensor, nn
from torch.amp.grad_scaler import GradScaler
from torch.optim import Optimizer

from amp_doctor.errors import UsageError

__all__ = ["CheckedArgs", "check_option_names", "check_watch_args"]

ON_NONFINITE_CHOICES = ("record", "raise")


class CheckedArgs(NamedTuple):
    model: Any  # an nn.Module, a list of them, a dict of them, or None (discovery)
    every: int
    max_steps: int | None
    top_k: int
    optimizers: list[Optimizer]


def _what(value: Any) -> str:
    text = repr(value)
    shown = text if len(text) <= 30 else text[:27] + "..."
    return f"{type(value).__name__} {shown}" if isinstance(value, (str, int, float)) \
        else type(value).__name__


def _count(name: str, value: Any, minimum: int, example: str) -> int:
    """``value`` as an int >= minimum: any integral number (numpy too), not bool."""
    if isinstance(value, bool):
        n = None
    else:
        try:
            n = operator.index(value)
        except TypeError:
            n = None
    if n is None or n < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise UsageError(f"{name} must be a {bound} integer, got {_what(value)}; "
                         f"e.g. {example}.")
    return n


def _model_hint(value: Any) -> str:
    if isinstance(value, Optimizer):
        return (" That is the optimizer: pass the model first, and the optimizer as "
                "optimizer=opt (or leave it out: it is found automatically).")
    if isinstance(value, GradScaler):
        return (" That is the GradScaler: pass the model first, and the scaler as "
                "scaler=scaler (or leave it out: it is found automatically).")
    if isinstance(value, Tensor):
        return " Pass the module itself, not its parameters or outputs."
    return ""


def _check_model(model: Any, discover: bool) -> Any:
    usage = "Pass the model (or a list/dict of models) you call in the training loop."
    if model is None:
        if discover:
            return None
        raise UsageError(f"watch() got None instead of a model. {usage}")
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, (str, bytes, Tensor, Optimizer, GradScaler)) or not isinstance(
            model, (Iterable, Mapping)):
        raise UsageError(f"watch() got a {type(model).__name__}, not a torch.nn.Module."
                         f"{_model_hint(model) or ' ' + usage}")
    items: list[tuple[str, Any]]
    if isinstance(model, Mapping):
        items = [(repr(k), v) for k, v in model.items()]
        checked: Any = dict(model)
    else:
        checked = list(model)  # a generator can be read once: keep what it gave
        items = [(f"item {i}", v) for i, v in enumerate(checked)]
    if not items:
        raise UsageError(f"watch() got an empty {type(model).__name__}: nothing to watch. "
                         f"{usage}")
    for where, m in items:
        if not isinstance(m, nn.Module):
            raise UsageError(f"watch() got a {type(m).__name__} for {where}, not a "
                             f"torch.nn.Module.{_model_hint(m) or ' ' + usage}")
    return checked


def _check_optimizers(optimizer: Any) -> list[Optimizer]:
    fix = ("pass the optimizer object you call .step() on, e.g. optimizer=opt, or leave it "
           "out: it is found automatically")
    if optimizer is None:
        return []
    if isinstance(optimizer, Optimizer):
        return [optimizer]
    if isinstance(optimizer, (str, bytes, Mapping)) or not isinstance(optimizer, Iterable):
        raise UsageError(f"optimizer= must be a torch.optim.Optimizer (or a list of them), "
                         f"got {_what(optimizer)}; {fix}.")
    opts = list(optimizer)
    for i, o in enumerate(opts):
        if not isinstance(o, Optimizer):
            raise UsageError(f"optimizer= item {i} is a {type(o).__name__}, not a "
                             f"torch.optim.Optimizer; {fix}.")
    return opts


def check_watch_args(
    model: Any,
    *,
    every: Any,
    max_steps: Any,
    top_k: Any,
    scaler: Any,
    optimizer: Any,
    on_nonfinite: Any,
    logdir: Any,
    discover: bool,
) -> CheckedArgs:
    """Check and normalise ``Watch``'s arguments; raise :class:`UsageError` on the first bad one."""
    checked_model = _check_model(model, discover)
    n_every = _count("every", every, 1, "every=10 records one step in ten")
    n_max = None if max_steps is None else _count(
        "max_steps", max_steps, 1, "max_steps=100, or None for no limit")
    n_top = _count("top_k", top_k, 0, "top_k=16")
    if scaler is not None and not isinstance(scaler, GradScaler):
        raise UsageError(f"scaler= must be a torch.amp.GradScaler, got {_what(scaler)}; pass "
                         "the GradScaler you call scaler.scale(loss) on, or leave it out: it "
                         "is found automatically.")
    opts = _check_optimizers(optimizer)
    if on_nonfinite not in ON_NONFINITE_CHOICES:
        raise UsageError(f"on_nonfinite must be 'record' or 'raise', got {on_nonfinite!r}.")
    if logdir is not None and not isinstance(logdir, (str, os.PathLike)):
        raise UsageError(f"logdir= must be a folder path (str or pathlib.Path), got "
                         f"{_what(logdir)}; e.g. logdir='runs/amp'.")
    return CheckedArgs(checked_model, n_every, n_max, n_top, opts)


def check_option_names(options: Mapping[str, Any], signature_of: Callable[..., Any]) -> None:
    """A misspelt keyword (``evry=1``) names the closest option instead of a bare TypeError."""
    params = inspect.signature(signature_of).parameters
    known = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}=? " if close else ""
            raise UsageError(f"watch() has no option {name!r}; {hint}"
                             f"options: {', '.join(known)}.")
