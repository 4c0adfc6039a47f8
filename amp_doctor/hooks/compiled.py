"""Leaving ``torch.compile`` as it was: hooks that dynamo neither traces nor compiles.

Every hook amp-doctor puts on a module returns at once under
``torch.compiler.is_compiling()``, so a graph traced through it gets no break
and no recompile; :func:`run_eagerly_when_called_by_dynamo` keeps dynamo from
compiling the hooks themselves when ``model.compile()`` calls them as frames.
What is then not recorded is said in the report (:data:`COMPILED_NOTE`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["COMPILED_NOTE", "run_eagerly_when_called_by_dynamo", "capturing", "capturing_eagerly",
           "dynamo_compiled_something", "compiled_autocast"]

# What the session says about a model that ran under torch.compile.
COMPILED_NOTE = (
    "ran under torch.compile: activations and gradients of the layers inside the compiled "
    "graph are not recorded (hooks there would add graph breaks and recompiles). Recorded: "
    "the batch (checked for NaN/Inf) and the model's own output, outside the graph (not "
    "when watch() was given the model but the loop calls its torch.compile wrapper: give "
    "watch() the compiled model), parameter "
    "gradients, the GradScaler and the optimizer. For per-layer statistics, run a few steps "
    "without compiling. Under anomaly mode (--anomaly) the ops inside the compiled graph "
    "are not searched one by one: a NaN/Inf made there is still seen by the per-step check "
    "(the batch, the gradients) and reported as not located."
)


def run_eagerly_when_called_by_dynamo(*fns: Callable[..., Any]) -> None:
    """Have dynamo run ``fns`` as plain Python when it meets them as frames of their own.

    ``model.compile()`` compiles ``Module._call_impl``, which dynamo skips, so
    each hook it calls would become a frame that dynamo compiles (and counts in
    ``counters["frames"]``). Marking the code objects SKIP (recursively) keeps
    dynamo out of them and of whatever they call; they then run eagerly around
    the compiled forward. Inside a graph (a hook traced inline) this changes
    nothing: there the hooks see ``torch.compiler.is_compiling()`` and return.
    """
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # pragma: no cover - other torch versions: hooks still no-op in graphs
        return
    for fn in fns:
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


_MODE_KEYS = getattr(torch._C, "_TorchDispatchModeKey", None)
# The dispatch modes torch itself runs a module under when it only traces or propagates
# shapes: fake tensors (a FakeTensorMode memory or shape estimate, torch.export), the
# proxy of make_fx, functionalization.
_INFRA_MODE_KEYS = tuple(getattr(_MODE_KEYS, k) for k in ("FAKE", "PROXY", "FUNCTIONAL")
                         if hasattr(_MODE_KEYS, k))


def capturing_eagerly() -> bool:
    """:func:`capturing` without its dynamo test: for a caller that made that test
    itself (the pre-hook, which notes dynamo's autocast), or that dynamo never runs
    (anomaly mode's op handler ignores compiled regions)."""
    return torch._C._is_tracing() or (
        bool(torch._C._len_torch_dispatch_stack())
        and any(torch._C._get_dispatch_mode(k) is not None for k in _INFRA_MODE_KEYS))


def capturing() -> bool:
    """The running forward or backward is being captured or traced, not trained: dynamo
    compiling, ``torch.jit.trace``, or a fake, proxy or functional mode of torch's.
    Hooks then do nothing, so that the graph holds only the user's ops (a trace records
    every op its inputs flow through, and its check compares two runs' graphs), and
    such a pass (fake tensors have no values) is not taken for a training step's."""
    return torch.compiler.is_compiling() or capturing_eagerly()


def dynamo_compiled_something() -> bool:
    """Whether dynamo made any graph in this process (a dict lookup, no import)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return bool(counters is not None and counters["stats"].get("unique_graphs"))


def compiled_autocast() -> str:
    """``"device:dtype"`` of the active autocast, "" if none; traced at compile time."""
    if not torch.is_grad_enabled():
        return "-"
    for dev in ("cuda", "cpu"):
        if torch.is_autocast_enabled(dev):
            return dev + ":" + str(torch.get_autocast_dtype(dev)).replace("torch.", "")
    return ""
