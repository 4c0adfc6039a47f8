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

A pattern that matches a container without a ``forward`` of its own
(``nn.ModuleList``, ``nn.ModuleDict``) means its members: such a container is
iterated, never called, so hooks on it would never fire and the run would be
unchanged while its header said otherwise (review 56b: ``--fp32 blocks``). Its
children are forced instead, and the report lists them. A forced module whose
forward never ran is counted too: a pattern none of whose modules ran is an error
at the end of the run, like a pattern that matches nothing.

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

__all__ = ["Fp32Islands", "Fp32NotRun", "check_patterns", "is_container", "layer_name",
           "near_names"]

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


class Fp32NotRun(AmpDoctorError):
    """A --fp32 pattern matched modules, but none of them ran a forward during the run."""


def is_container(mod: nn.Module) -> bool:
    """A module without a ``forward`` of its own (``ModuleList``, ``ModuleDict``): it is
    iterated or indexed, never called, so forward hooks on it never fire."""
    return type(mod).forward is nn.Module.forward


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
        # Matched containers that are never called, and the members forced in their place.
        self.containers: dict[str, list[str]] = {}
        # Per pattern, the modules forced for it (id, report name): what "ran" is checked on.
        self._forced_for: dict[str, list[tuple[int, str]]] = {p: [] for p in self.patterns}
        # Forced modules whose pre-hook fired. Kept across reattach: the modules are the same.
        self._ran_ids: set[int] = set()
        # The autocast contexts of the forced calls in flight, per thread.
        self._local = threading.local()

    def attach(self, prefix: str, model: nn.Module) -> list[str]:
        """Hook the modules of ``model`` that match; returns their names."""
        forced_here: list[str] = []
        # Module id -> the forced ancestor (id, name) it runs inside, autocast off.
        inside_forced: dict[int, tuple[int, str]] = {}
        # Patterns a never-called container passes down to its members (named_modules
        # lists a parent before its children, so they are known when a child comes).
        inherited: dict[int, list[str]] = {}
        for qual, mod in model.named_modules():
            name = layer_name(prefix, qual, mod)
            self.names.append(name)
            # The exact name first: a printed name may hold glob characters (enc[0]).
            pats = [p for p in self.patterns if p == name or fnmatch.fnmatchcase(name, p)]
            for p in pats:
                self.matched[p].append(name)
            pats += [p for p in inherited.get(id(mod), ()) if p not in pats]
            if not pats:
                continue
            # Autocast is already off inside a forced ancestor: the pattern ran when it did.
            if id(mod) in inside_forced:
                for p in pats:
                    self._forced_for[p].append(inside_forced[id(mod)])
                continue
            if is_container(mod):
                kids = list(mod.named_children())
                self.containers[name] = [layer_name(name, q, k) for q, k in kids]
                for _, kid in kids:
                    inherited.setdefault(id(kid), []).extend(pats)
                continue
            if any(p.dtype in _LOW for p in mod.parameters()):
                self.refused.append(name)
                continue
            inside_forced.update((id(m), (id(mod), name)) for m in mod.modules())
            forced_here.append(name)
            for p in pats:
                self._forced_for[p].append((id(mod), name))
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
        self._forced_for = {p: [] for p in self.patterns}
        self.forced, self.refused, self.names = [], [], []
        self.containers = {}
        for prefix, model in models.items():
            self.attach(prefix, model)

    def check(self, ended: bool = False) -> None:
        """Raise for a pattern that matches no layer; once the run has ``ended``, also
        (:class:`Fp32NotRun`) for one none of whose forced modules ever ran."""
        check_patterns(self.patterns, self.matched, self.names)
        if not ended:
            return  # a module may first run later (an evaluation, a second stage)
        for pat in self.patterns:
            if any(i in self._ran_ids for i, _ in self._forced_for[pat]):
                continue
            forced = [n for _, n in self._forced_for[pat]]
            what = (f"{', '.join(dict.fromkeys(forced))} never ran a forward" if forced
                    else "none of it could be forced (weights already in float16/bfloat16, "
                    "or an empty container)")
            raise Fp32NotRun(
                f"--fp32 pattern {pat!r} matches {', '.join(self.matched[pat])}, but "
                f"{what} during the run, so nothing ran in float32 for it; name layers "
                "that the report's layer table lists (those ran).")

    def ran(self) -> list[str]:
        """The forced modules whose forward ran, in model order: what ran in float32."""
        return [n for n in self.forced if n in self._ran_names()]

    def not_run(self) -> list[str]:
        """The forced modules whose forward never ran: --fp32 changed nothing for them."""
        return [n for n in self.forced if n not in self._ran_names()]

    def _ran_names(self) -> set[str]:
        return {n for pairs in self._forced_for.values() for i, n in pairs
                if i in self._ran_ids}

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
        self._ran_ids.add(id(module))
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
