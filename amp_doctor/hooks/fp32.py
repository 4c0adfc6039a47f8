"""Run chosen modules in float32 under autocast, without editing the user's code.

``watch(model, fp32=["transformer.h.1.mlp.*"])`` and ``amp-doctor diagnose
--fp32 PATTERN`` put a pair of forward hooks on every module whose report name
matches a pattern (``fnmatch`` globs over the names the report prints):

* the pre-hook disables autocast for the module's device and casts its
  float16/bfloat16 inputs up to float32;
* the post-hook restores autocast and leaves the outputs in float32.

This is exactly what the report's advice asks the user to write
(``with torch.autocast(device_type, enabled=False): out = layer(x.float())``),
so a trial proves that advice. Outputs are deliberately *not* cast back to the
low-precision dtype: a layer whose output overflows float16 would get its inf
back from the cast, and no trial could ever remove the overflow. The rest of
the model keeps autocast's policy: a matmul or convolution that consumes the
float32 output still runs in the low-precision dtype (autocast casts its
inputs), while ops that follow their input's dtype (add, normalisation,
activations) now see float32, as they would after the hand-written fix.
This changes the run's numerics on purpose; a run with no matching module
is unchanged.

The hooks are :class:`~amp_doctor.hooks.weakhooks.WeakMethodHook` objects: a deep copy
or a pickle of the model (``torch.save(model)``, EMA copies) gets unwatched hooks,
so a copy runs as the user wrote it.
"""

from __future__ import annotations

import difflib
import fnmatch
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from amp_doctor.devicework import map_tensors
from amp_doctor.errors import AmpDoctorError
from amp_doctor.hooks.weakhooks import WeakMethodHook

__all__ = ["Fp32Islands", "check_patterns", "layer_name", "near_names"]

_LOW = (torch.float16, torch.bfloat16)
# Near names listed in an "unmatched pattern" error.
NEAR_NAMES = 5


def layer_name(prefix: str, qual: str, mod: nn.Module) -> str:
    """The name the report prints for a module (the same rule as the probes)."""
    return ".".join(p for p in (prefix, qual) if p) or type(mod).__name__


def near_names(pattern: str, names: Iterable[str], n: int = NEAR_NAMES) -> list[str]:
    """Names close to ``pattern``, for an error message; globs compare their literal part."""
    names = list(names)
    literal = pattern.replace("*", "").replace("?", "").rstrip(".")
    close = difflib.get_close_matches(literal, names, n=n, cutoff=0.6)
    if not close:
        # A name sharing the pattern's first component is a better hint than nothing.
        head = literal.split(".")[0]
        close = [x for x in names if x.startswith(head)][:n]
    return close


def check_patterns(patterns: Sequence[str], matched: dict[str, list[str]],
                   names: Iterable[str]) -> None:
    """Raise a one-line :class:`AmpDoctorError` for the first pattern that matched nothing."""
    names = list(names)
    for pat in patterns:
        if matched.get(pat):
            continue
        near = near_names(pat, names)
        hint = f"near names: {', '.join(near)}" if near else "no layer has a similar name"
        raise AmpDoctorError(
            f"--fp32 pattern {pat!r} matches no layer ({hint}); use the layer names "
            "the report prints, with * and ? as wildcards (e.g. 'blocks.1.mlp.*')."
        )


def _first_device(obj: Any, module: nn.Module) -> str:
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            return x.device.type
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    p = next(module.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _up(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW else t


class Fp32Islands:
    """Forward hooks that keep matching modules in float32 under autocast."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns: tuple[str, ...] = tuple(patterns)
        self.matched: dict[str, list[str]] = {p: [] for p in self.patterns}
        self.forced: list[str] = []  # report names, in model order
        # Modules that matched but could not be forced (low-precision weights).
        self.refused: list[str] = []
        self.names: list[str] = []  # every name seen, for near-name hints
        self._handles: list[RemovableHandle] = []
        self._forced_ids: set[int] = set()
        # The autocast contexts of the forced calls in flight, per thread.
        self._local = threading.local()

    def attach(self, prefix: str, model: nn.Module) -> list[str]:
        """Hook the modules of ``model`` that match; returns their names."""
        forced_here: list[str] = []
        inside_forced: set[int] = set()
        for qual, mod in model.named_modules():
            name = layer_name(prefix, qual, mod)
            self.names.append(name)
            # The exact name first: a printed name may hold glob characters (enc[0]).
            pats = [p for p in self.patterns if p == name or fnmatch.fnmatchcase(name, p)]
            if not pats:
                continue
            for p in pats:
                self.matched[p].append(name)
            # Autocast is already off inside a forced ancestor.
            if id(mod) in inside_forced:
                continue
            if any(p.dtype in _LOW for p in mod.parameters()):
                self.refused.append(name)
                continue
            inside_forced.update(id(m) for m in mod.modules())
            forced_here.append(name)
            self._forced_ids.add(id(mod))
            self._handles.append(mod.register_forward_pre_hook(
                WeakMethodHook(self, Fp32Islands._pre), with_kwargs=True, prepend=True))
            self._handles.append(mod.register_forward_hook(
                WeakMethodHook(self, Fp32Islands._post), always_call=True))
        self.forced.extend(forced_here)
        return forced_here

    def reattach(self, models: dict[str, nn.Module]) -> None:
        """Match every model anew, under its current prefix."""
        self.remove()
        self.matched = {p: [] for p in self.patterns}
        self.forced, self.refused, self.names = [], [], []
        for prefix, model in models.items():
            self.attach(prefix, model)

    def check(self) -> None:
        check_patterns(self.patterns, self.matched, self.names)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._forced_ids.clear()

    def enter_call(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """``module``'s call is under way and its pre-hook was not called: the CLI found
        the model inside its own first call, after torch had collected the call's
        pre-hooks (its post-hook, registered by then, still runs at the end). Force
        the call as the pre-hook would have; returns the inputs to call it with (None:
        as they are). Without this, ``--fp32`` on the top-level model (or ``'*'``)
        missed the first step."""
        if id(module) not in self._forced_ids:
            return None
        got = self._pre(module, args, {})
        return None if got is None else got[0]

    # -- hooks --------------------------------------------------------------
    def _frames(self) -> list[Any]:
        frames: list[Any] | None = getattr(self._local, "frames", None)
        if frames is None:
            frames = []
            self._local.frames = frames
        return frames

    def _pre(self, module: nn.Module, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        frames = self._frames()
        dev = _first_device((args, kwargs), module)
        if not torch.is_autocast_enabled(dev):
            frames.append(None)
            return None
        ctx = torch.autocast(dev, enabled=False)
        ctx.__enter__()
        frames.append(ctx)
        return map_tensors(args, _up), map_tensors(kwargs, _up)

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        frames = self._frames()
        ctx = frames.pop() if frames else None
        if ctx is not None:
            ctx.__exit__(None, None, None)
