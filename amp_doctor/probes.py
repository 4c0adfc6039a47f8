"""Module hooks that turn activations and gradients into on-device summaries.

Nothing here copies to the host. Each hook only computes
:func:`amp_doctor.stats.summarize` on the tensors it sees and files the
result in the current :class:`~amp_doctor.recorder.StepBuffer`; the buffer
is copied to the host once, at the step boundary.

Design choices that keep the cost low and the user's run untouched:

* forward hooks plus ``Tensor.register_hook`` on outputs for gradients;
  no ``register_full_backward_hook`` (costly, and broken on in-place ops);
* a tensor that several nested modules return (a ``Sequential`` and its last
  child) is summarised once and credited to all of them;
* hooks return ``None`` and never touch the tensors they see, so the
  user's numerics are bit-identical with and without amp-doctor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from .anomaly import own_ops
from .dtypes import LOW_PRECISION_DTYPES, dtype_name
from .recorder import StepBuffer
from .stats import summarize

__all__ = ["LayerMeta", "Probes", "iter_tensors"]

# Deeply nested outputs are rare and walking them is pure overhead.
MAX_OUTPUT_DEPTH = 4
MAX_TENSORS_PER_OUTPUT = 64


@dataclass
class LayerMeta:
    """Host-side facts about one layer; cheap metadata only, never values."""

    name: str
    type: str
    order: int
    calls: int = 0
    input_dtypes: set[str] = field(default_factory=set)
    output_dtypes: set[str] = field(default_factory=set)
    param_dtypes: set[str] = field(default_factory=set)
    params: list[nn.Parameter] = field(default_factory=list, repr=False)
    root: int = 0
    qual: str = ""
    # Calls whose output was the very tensor a sublayer returned (a container).
    passthrough_calls: int = 0


def iter_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside an arbitrary module output: tuples, dicts, dataclasses, None..."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth >= MAX_OUTPUT_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float)):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from iter_tensors(v, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), depth + 1)


def _first_tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in iter_tensors(obj):
        out.append(t)
        if len(out) >= MAX_TENSORS_PER_OUTPUT:
            break
    return out


class Probes:
    """Forward hooks on the modules of the watched models.

    Roots (the models given to ``watch``) are hooked for the whole watch:
    ``on_root_forward`` lets the owner see each root call (autocast state,
    step starts) without hooks of its own. Every other module is hooked only
    while :meth:`set_armed` says so, which the owner does for recorded steps
    (and for anomaly mode, which needs the module stack on every step): once
    a module has any hook, torch calls it through its slow path, and on an
    unrecorded step even an idle hook would be pure cost.
    """

    def __init__(
        self,
        models: dict[str, nn.Module],
        buffer_provider: Callable[[], StepBuffer],
        on_root_forward: Callable[[nn.Module, tuple[Any, ...]], None],
    ) -> None:
        self.layers: dict[str, LayerMeta] = {}
        self._names: dict[int, str] = {}
        self._roots: set[int] = set()
        self._handles: list[RemovableHandle] = []
        # Hooks on non-root modules, present only while armed.
        self._sub_handles: list[RemovableHandle] = []
        self._subs: list[nn.Module] = []
        self.armed = False
        self._want_armed = False
        self._buffer = buffer_provider
        self._on_root_forward = on_root_forward
        self.recording = False
        self._depth = 0
        # Names of the modules whose forward is running, innermost last.
        self.stack: list[str] = []
        # Per step: which summary a tensor got, and which layers own its grad.
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.param_owner: dict[int, str] = {}
        self._root_prefix: dict[int, str] = {}
        self._next_order = 0
        for prefix, model in models.items():
            self.add_root(prefix, model)

    @staticmethod
    def _layer_name(prefix: str, qual: str, mod: nn.Module) -> str:
        return ".".join(p for p in (prefix, qual) if p) or type(mod).__name__

    def add_root(self, prefix: str, model: nn.Module) -> bool:
        """Hook every module of ``model``; False if it is already watched."""
        if id(model) in self._names:
            return False
        self._roots.add(id(model))
        self._root_prefix[id(model)] = prefix
        for qual, mod in model.named_modules():
            if id(mod) in self._names:
                continue  # shared submodule: first name wins
            name = self._layer_name(prefix, qual, mod)
            meta = LayerMeta(name=name, type=type(mod).__name__, order=-1, root=id(model),
                             qual=qual)
            meta.params = list(mod.parameters(recurse=False))
            meta.param_dtypes = {dtype_name(p.dtype) for p in meta.params}
            for p in meta.params:
                self.param_owner.setdefault(id(p), name)
            self.layers[name] = meta
            self._names[id(mod)] = name
            if mod is model:
                self._handles.extend(self._hook(mod))
            else:
                self._subs.append(mod)
                if self.armed:
                    self._sub_handles.extend(self._hook(mod))
        return True

    def _hook(self, mod: nn.Module) -> tuple[RemovableHandle, RemovableHandle]:
        return (mod.register_forward_pre_hook(self._pre, with_kwargs=True),
                mod.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def set_armed(self, armed: bool) -> None:
        """Hook (or unhook) every non-root module; applied between forward passes.

        A request made while a forward is running waits for the next root
        call: removing a hook mid-forward would lose its module's post-hook.
        """
        self._want_armed = armed
        if self._depth == 0:
            self._apply_armed()

    def _apply_armed(self) -> None:
        if self._want_armed == self.armed:
            return
        if self._want_armed:
            for mod in self._subs:
                self._sub_handles.extend(self._hook(mod))
        else:
            for h in self._sub_handles:
                h.remove()
            self._sub_handles.clear()
        self.armed = self._want_armed

    def watches(self, module: nn.Module) -> bool:
        return id(module) in self._names

    def rename_root(self, model: nn.Module, prefix: str) -> dict[str, str]:
        """Give an already watched model a prefix; returns old -> new layer names."""
        rid = id(model)
        mods = {id(m): (q, m) for q, m in model.named_modules()}
        mapping: dict[str, str] = {}
        for mid, name in list(self._names.items()):
            meta = self.layers[name]
            if meta.root != rid or mid not in mods:
                continue
            qual, mod = mods[mid]
            new = self._layer_name(prefix, qual, mod)
            mapping[name] = new
        self._root_prefix[rid] = prefix
        self.layers = {mapping.get(k, k): v for k, v in self.layers.items()}
        for meta in self.layers.values():
            meta.name = mapping.get(meta.name, meta.name)
        self._names = {k: mapping.get(v, v) for k, v in self._names.items()}
        self.param_owner = {k: mapping.get(v, v) for k, v in self.param_owner.items()}
        self.stack = [mapping.get(v, v) for v in self.stack]
        return mapping

    # -- lifecycle -------------------------------------------------------
    def remove(self) -> None:
        for h in (*self._handles, *self._sub_handles):
            h.remove()
        self._handles.clear()
        self._sub_handles.clear()
        self.armed = self._want_armed = False
        self._seen = WeakIdKeyDictionary()

    def name_of(self, module: nn.Module) -> str | None:
        return self._names.get(id(module))

    def current_module(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def new_step(self) -> None:
        self._seen = WeakIdKeyDictionary()

    # -- hooks -----------------------------------------------------------
    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._depth == 0 and self._want_armed != self.armed:
            self._apply_armed()
        self._depth += 1
        self.stack.append(self._names[id(module)])
        if id(module) in self._roots and self._depth == 1:
            self._on_root_forward(module, args)
        if not self.recording or not torch.is_grad_enabled():
            return
        meta = self.layers[self._names[id(module)]]
        for t in _first_tensors((args, kwargs)):
            if t.is_floating_point():
                meta.input_dtypes.add(dtype_name(t.dtype))

    def _post(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        self._depth = max(0, self._depth - 1)
        if self.stack:
            self.stack.pop()
        # Inference passes (validation under no_grad) are not training steps.
        if not self.recording or not torch.is_grad_enabled():
            return
        name = self._names[id(module)]
        meta = self.layers[name]
        if meta.order < 0:
            meta.order = self._next_order
            self._next_order += 1
        meta.calls += 1
        buf = self._buffer()
        for t in _first_tensors(output):
            meta.output_dtypes.add(dtype_name(t.dtype))
            if not t.is_floating_point() or t.numel() == 0:
                continue
            entry = self._seen.get(t)
            # An in-place op (x.mul_(gamma)) returns the same tensor with new
            # values: only an unchanged version counter means "already seen".
            if entry is None or entry[2] != t._version:
                with own_ops:
                    idx = buf.add(summarize(t))
                owners = [name]
                self._seen[t] = (idx, owners, t._version)
                if t.requires_grad:
                    t.register_hook(self._grad_hook(owners, buf))
            else:
                idx, owners, _ = entry
                if name in owners:
                    continue  # same tensor returned twice in one output
                owners.append(name)
                meta.passthrough_calls += 1
            buf.assign(name, "act", idx)

    def _grad_hook(self, owners: list[str], buf: StepBuffer) -> Callable[[torch.Tensor], None]:
        # The closure holds the layer names and the step's buffer, never the
        # activation: a finished step keeps no reference to user tensors.
        def hook(grad: torch.Tensor) -> None:
            if buf.closed or grad is None or not grad.is_floating_point() or grad.numel() == 0:
                return
            with own_ops:
                idx = buf.add(summarize(grad))
            for n in owners:
                buf.assign(n, "grad", idx)
            buf.note_backward(owners[0])

        return hook

    # -- parameter gradients --------------------------------------------
    def summarize_param_grads(self, params: list[torch.Tensor], buf: StepBuffer) -> None:
        """Summaries of the gradients of ``params``, one per owning layer, once per step."""
        by_layer: dict[str, list[torch.Tensor]] = {}
        for p in params:
            name = self.param_owner.get(id(p))
            if name is None or p.grad is None or name in buf.param_grads_done:
                continue
            g = p.grad
            if g.is_sparse or not g.is_floating_point() or g.numel() == 0:
                continue
            by_layer.setdefault(name, []).append(g.detach().reshape(-1))
        with own_ops:
            for name, grads in by_layer.items():
                buf.param_grads_done.add(name)
                flat = grads[0] if len(grads) == 1 else torch.cat([g.float() for g in grads])
                buf.assign(name, "param_grad", buf.add(summarize(flat)))

    def low_precision_outputs(self) -> set[str]:
        lows = {dtype_name(d) for d in LOW_PRECISION_DTYPES}
        return {d for m in self.layers.values() for d in m.output_dtypes if d in lows}
