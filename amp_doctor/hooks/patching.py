"""The process-wide patches on torch's AMP API, and the hub that forwards them.

One :class:`_ApiHub` installs the patches and global hooks when the first
watch subscribes and restores every one of them when the last one leaves,
so several watches can overlap in any order. The hub only forwards calls to
subscribers (:class:`ApiSubscriber`); what they mean for one watch is
decided by :class:`~amp_doctor.steps.monitor.AmpMonitor`.

What is patched, and why at that level:

* ``GradScaler.scale/unscale_/step/update/load_state_dict`` on the class (and
  on every subclass that overrides one of them), so every scaler is seen:
  passed to ``watch``, created before the watch or after it, and the
  deprecated ``torch.cuda.amp.GradScaler`` / ``torch.cpu.amp.GradScaler``
  spellings, which are subclasses;
* global optimizer step pre/post hooks (every ``torch.optim.Optimizer``);
* ``torch.nn.utils.clip_grad``'s inner functions, which ``clip_grad_norm_``
  and ``clip_grad_value_`` look up at call time, so a clip is seen even when
  the user's code imported the function before the watch started;
* ``LRScheduler.step`` (and subclasses that override it) and
  ``torch.autograd.backward`` (which ``Tensor.backward`` calls);
* ``warnings.warn``, so that a warning raised inside a patched function keeps the
  location it has without amp-doctor: a wrapper is one more frame between the user's
  call and the function, and a ``stacklevel=2`` warning (the scheduler's "Detected
  call of `lr_scheduler.step()` before `optimizer.step()`", which every run whose
  GradScaler skips its first step gets) named ``patching.py`` instead of the user's
  line. Wrapper frames are left out of the count (:func:`_warn_past_wrappers`).

Every wrapper forwards only its outermost call (:meth:`_ApiHub.outermost`): a
subclass method calling ``super()``, ``clip_grad_norm`` calling
``clip_grad_norm_``, a ``SequentialLR`` stepping its children or reentrant
checkpointing running backward inside backward are one call to the subscribers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from types import CodeType
from typing import Any, Protocol

import torch
from torch.amp.grad_scaler import GradScaler
from torch.optim import Optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.weak import WeakIdKeyDictionary

from amp_doctor.devicework import iter_tensors, own_ops
from amp_doctor.hooks import interrupts
from amp_doctor.hooks.weakhooks import own_hooks_lifted, state_without_own_hooks

__all__ = ["ApiSubscriber", "Subscription", "subscribe", "patches_installed",
           "in_scaler_step", "in_closure_step", "in_scaled_backward", "scaled_backwards"]

_SCALER_METHODS = ("scale", "unscale_", "step", "update", "load_state_dict")
# The events that mean the loop trains on (not a forward: evaluation while it unwinds).
_TRAINING_EVENTS = frozenset(("on_backward", "on_optimizer_pre", "on_scaler_step_begin"))

# The code of every wrapper the hub installs: frames a warning's stacklevel steps over.
_WRAPPER_CODES: set[CodeType] = set()


class ApiSubscriber(Protocol):
    """What the hub forwards.

    :class:`~amp_doctor.steps.monitor.AmpMonitor` is the one implementation.
    """

    def on_scale_begin(self, scaler: GradScaler) -> None: ...
    def on_scale(self, scaler: GradScaler, outputs: Any, result: Any) -> None: ...
    def on_unscale(self, scaler: GradScaler, optimizer: Optimizer) -> None: ...
    def on_unscaled(self, scaler: GradScaler, optimizer: Optimizer) -> None: ...
    def on_scaler_step_begin(self, scaler: GradScaler, optimizer: Optimizer) -> None: ...
    def on_scaler_step(self, scaler: GradScaler, optimizer: Optimizer, stepped: bool) -> None: ...
    def on_update_begin(self, scaler: GradScaler) -> None: ...
    def on_update_end(self, scaler: GradScaler, new_scale: Any) -> None: ...
    def on_optimizer_pre(self, optimizer: Optimizer) -> None: ...
    def on_optimizer_post(self, optimizer: Optimizer) -> None: ...
    def on_clip(self, func: str, parameters: list[torch.Tensor], info: dict[str, Any]) -> None: ...
    def on_scheduler_step(self, scheduler: Any) -> None: ...
    def on_backward(self, tensors: Any) -> None: ...
    def on_backward_end(self, tensors: Any, through_scaler: bool) -> None: ...
    def on_scaled_grads(self, grads: Any) -> None: ...
    def on_grads_taken(self, outputs: Any, inputs: Any, grads: Any, scaled: bool) -> None: ...
    def on_scaler_load(self, scaler: GradScaler, state: Any) -> None: ...


def _all_subclasses(cls: type) -> list[type]:
    out = [cls]
    sub: type
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


class _Outermost:
    """The context of :meth:`_ApiHub.outermost`: one per patched function, reused, as
    its state is the depth in the hub's dict (a ``contextlib.contextmanager`` made a
    generator and a context object at every call of the user's; a step makes about
    ten, each on a cold cache)."""

    __slots__ = ("_depth", "_key")

    def __init__(self, depth: dict[str, int], key: str) -> None:
        self._depth = depth
        self._key = key

    def __enter__(self) -> bool:
        d = self._depth.get(self._key, 0)
        self._depth[self._key] = d + 1
        return d == 0

    def __exit__(self, *exc: object) -> None:
        self._depth[self._key] -= 1


class _ApiHub:
    """Process-wide patches, installed once and restored when unused."""

    def __init__(self) -> None:
        self.subscribers: list[ApiSubscriber] = []
        self._restore: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._step_counts: dict[int, int] = {}
        self.in_scaler_step = 0
        # The optimizer step starting was given a closure (LBFGS): its gradients are
        # computed inside the step, after its pre-hook.
        self.closure_step = False
        # Call depth per patched function (see outermost).
        self._depth: dict[str, int] = {}
        self._gates: dict[str, _Outermost] = {}
        # Backward passes that went through a scaled output, per scaler id.
        self.flows: dict[int, int] = {}
        self._total_flows = 0
        self._scaled_outputs: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # The running outermost backward reached (or starts at) an enabled GradScaler's
        # scale() output: an overflow in it is what the scaler detects and skips.
        self.in_backward = False
        self.scaled_backward = False

    @property
    def installed(self) -> bool:
        return bool(self._restore)

    # -- subscription ------------------------------------------------------
    def add(self, sub: ApiSubscriber) -> None:
        with self._lock:
            if not self.subscribers:
                self._install()
            self.subscribers.append(sub)

    def remove(self, sub: ApiSubscriber) -> None:
        with self._lock:
            if sub in self.subscribers:
                self.subscribers.remove(sub)
            if not self.subscribers:
                self._uninstall()

    def emit(self, method: str, *args: Any) -> None:
        if method in _TRAINING_EVENTS:
            interrupts.training_resumed()
        with own_ops:
            for sub in list(self.subscribers):
                try:
                    getattr(sub, method)(*args)
                except Exception as e:  # never let amp-doctor break a training run
                    if _raised_by_a_signal_handler(e):
                        raise  # the process's, not amp-doctor's (see the function)
                    _internal_error(sub, method, e)

    def outermost(self, key: str) -> _Outermost:
        """``with hub.outermost(key) as outer``: True only for the outermost call of ``key``."""
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = _Outermost(self._depth, key)
        return gate

    @contextlib.contextmanager
    def _backward_pass(self, roots: Any) -> Iterator[bool]:
        """While the outermost backward from ``roots`` runs; yields whether they are
        outputs of a scaler's ``scale()`` (the flow hook may tell it later, too)."""
        scaled = any(t in self._scaled_outputs for t in iter_tensors(roots))
        self.in_backward, self.scaled_backward = True, scaled
        try:
            yield scaled
        finally:
            self.in_backward = self.scaled_backward = False

    def note_flow(self, scaler_id: int) -> None:
        """A backward pass went through an output of scaler ``scaler_id``'s ``scale()``."""
        self.flows[scaler_id] = self.flows.get(scaler_id, 0) + 1
        self._total_flows += 1
        if self.in_backward:
            self.scaled_backward = True

    # -- installation ------------------------------------------------------
    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any], *,
               wrapper: bool = True) -> None:
        had = name in vars(owner)
        orig = vars(owner)[name] if had else getattr(owner, name)
        made = make(orig)
        if wrapper:
            _WRAPPER_CODES.add(made.__code__)
        setattr(owner, name, made)

        def restore() -> None:
            if had:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)

        self._restore.append(restore)

    def _install(self) -> None:
        self._step_counts.clear()
        self._depth.clear()
        self.in_scaler_step = 0
        wrappers = {"scale": self._wrap_scale, "unscale_": self._wrap_unscale,
                    "step": self._wrap_step, "update": self._wrap_update,
                    "load_state_dict": self._wrap_load}
        # Subclasses that override a method (e.g. FSDP's ShardedGradScaler)
        # need their own patch; the deprecated torch.cuda.amp / torch.cpu.amp
        # spellings inherit and are covered by the base class.
        for cls in _all_subclasses(GradScaler):
            for meth in _SCALER_METHODS:
                if meth in vars(cls):
                    self._patch(cls, meth, wrappers[meth])
        h1 = register_optimizer_step_pre_hook(self._opt_pre)
        h2 = register_optimizer_step_post_hook(self._opt_post)
        self._restore.extend([h1.remove, h2.remove])
        import torch.nn.utils as nnu
        import torch.nn.utils.clip_grad as cg

        # clip_grad_norm_ calls these through its module's globals, so the
        # patch sees the clip even through a reference imported earlier.
        self._patch(cg, "_clip_grads_with_norm_", self._wrap_clip_norm)
        if getattr(nnu, "clip_grads_with_norm_", None) is not None:
            self._patch(nnu, "clip_grads_with_norm_", self._wrap_clip_norm)
        if hasattr(cg, "_group_tensors_by_device_and_dtype"):
            self._patch(cg, "_group_tensors_by_device_and_dtype", self._wrap_clip_value_probe)
        from torch.optim.lr_scheduler import LRScheduler

        for cls in _all_subclasses(LRScheduler):
            if "step" in vars(cls):
                self._patch(cls, "step", self._wrap_sched)
        self._patch(torch.autograd, "backward", self._wrap_backward)
        self._patch(torch.autograd, "grad", self._wrap_grad)
        self._patch(torch.jit, "script", _wrap_jit_script)
        # nn.Module's, and each subclass's own that may not call it (LSTM's RNNBase,
        # LightningModule, DDP, a mixin's): a copy or a checkpoint carries none of
        # amp-doctor's hooks. Also of the classes made while the watch runs: under the
        # CLI, it starts at `import torch`, before the script defines or imports them.
        for cls in dict.fromkeys(_all_subclasses(torch.nn.Module)):
            self._cover_getstate(cls)
        self._patch(torch.nn.Module, "__init_subclass__", self._wrap_init_subclass,
                    wrapper=False)
        self._patch(warnings, "warn", _warn_past_wrappers, wrapper=False)

    def _cover_getstate(self, cls: type) -> None:
        """Patch the ``__getstate__`` a module class resolves to, unless it is ours."""
        if not getattr(getattr(cls, "__getstate__", None), _GETSTATE_MARK, False):
            self._patch(cls, "__getstate__", _wrap_getstate)

    def _wrap_init_subclass(self, orig: Callable[..., Any]) -> Any:
        hub = self

        def __init_subclass__(cls: type[torch.nn.Module], **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            hub._cover_getstate(cls)

        return classmethod(__init_subclass__)

    def _uninstall(self) -> None:
        while self._restore:
            try:
                self._restore.pop()()
            except Exception:  # pragma: no cover - restore the others regardless
                pass

    # -- wrappers ------------------------------------------------------------
    def _wrap_scale(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def scale(scaler: GradScaler, outputs: Any) -> Any:
            with hub.outermost("scale") as outer:
                if not outer:
                    return orig(scaler, outputs)
                hub.emit("on_scale_begin", scaler)
                result = orig(scaler, outputs)
                if scaler._enabled:
                    hub._mark_scaled(scaler, result)
                hub.emit("on_scale", scaler, outputs, result)
                return result

        return scale

    def _mark_scaled(self, scaler: GradScaler, result: Any) -> None:
        hook = functools.partial(_flow_hook, id(scaler))
        with own_ops:  # a __torch_function__ subclass of the user's sees none of it
            for t in iter_tensors(result):
                if t.requires_grad:
                    self._scaled_outputs[t] = id(scaler)
                    t.register_hook(hook)

    def _wrap_unscale(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def unscale_(scaler: GradScaler, optimizer: Any) -> Any:
            with hub.outermost("unscale_") as outer:
                # Before the call: unscale_ raises on float16 gradients and
                # on a second unscale_ without update(); the event must exist
                # by then so that the report explains the exception.
                if outer and scaler._enabled:
                    hub.emit("on_unscale", scaler, optimizer)
                result = orig(scaler, optimizer)
                if outer and scaler._enabled:
                    hub.emit("on_unscaled", scaler, optimizer)  # its found_inf exists now
                return result

        return unscale_

    def _wrap_step(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def step(scaler: GradScaler, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            with hub.outermost("step") as outer:
                if not outer:
                    return orig(scaler, optimizer, *args, **kwargs)
                # Before the call: a second step() without update() raises.
                hub.emit("on_scaler_step_begin", scaler, optimizer)
                before = hub._step_counts.get(id(optimizer), 0)
                hub.in_scaler_step += 1
                try:
                    result = orig(scaler, optimizer, *args, **kwargs)
                finally:
                    hub.in_scaler_step -= 1
                # GradScaler calls optimizer.step only when no inf/NaN was found:
                # an optimizer step that did not happen is the skip, with no sync.
                stepped = hub._step_counts.get(id(optimizer), 0) != before
                hub.emit("on_scaler_step", scaler, optimizer, stepped)
                return result

        return step

    def _wrap_update(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def update(scaler: GradScaler, new_scale: Any = None) -> Any:
            with hub.outermost("update") as outer:
                # Before the call: update() with no step since the last one raises.
                if outer and scaler._enabled and new_scale is None:
                    hub.emit("on_update_begin", scaler)
                result = orig(scaler, new_scale)
                if outer:
                    hub.emit("on_update_end", scaler, new_scale)
                return result

        return update

    def _wrap_load(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def load_state_dict(scaler: GradScaler, state_dict: Any) -> Any:
            with hub.outermost("load") as outer:
                result = orig(scaler, state_dict)
                # After the call: a resumed run's scale is the loaded one from here on.
                if outer:
                    hub.emit("on_scaler_load", scaler, state_dict)
                return result

        return load_state_dict

    def _opt_pre(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # (args holds the optimizer itself first, then the step's own arguments)
        self.closure_step = (any(callable(a) for a in args or ())
                             or callable((kwargs or {}).get("closure")))
        self.emit("on_optimizer_pre", optimizer)

    def _opt_post(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.closure_step = False  # a later unscale_ belongs to no closure step
        self._step_counts[id(optimizer)] = self._step_counts.get(id(optimizer), 0) + 1
        self.emit("on_optimizer_post", optimizer)

    def _wrap_clip_norm(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: Any,
                                  *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            with hub.outermost("clip") as outer:
                if outer:
                    caller = sys._getframe(1).f_code.co_name
                    name = "clip_grad_norm_" if caller == "clip_grad_norm_" else \
                        "clip_grads_with_norm_"
                    hub.emit("on_clip", name, params,
                             {"max_norm": max_norm, "total_norm": total_norm})
                return orig(params, max_norm, total_norm, *args, **kwargs)

        return clip_grads_with_norm_

    def _wrap_clip_value_probe(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        # clip_grad_value_ has no helper of its own to patch; it groups the
        # gradients with this one, which it looks up at call time.
        hub = self

        @functools.wraps(orig)
        def group(*args: Any, **kwargs: Any) -> Any:
            try:
                frame = sys._getframe(1)
                if frame.f_code.co_name == "clip_grad_value_" and hub._depth.get("clip", 0) == 0:
                    # Its parameters may be a spent generator by now: pass the grads.
                    loc = frame.f_locals
                    grads = [g for g in loc.get("grads") or [] if isinstance(g, torch.Tensor)]
                    hub.emit("on_clip", "clip_grad_value_", [],
                             {"clip_value": loc.get("clip_value"), "grads": grads})
            except Exception:  # pragma: no cover - observing must never break clipping
                pass
            return orig(*args, **kwargs)

        return group

    def _wrap_sched(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def sched_step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            with hub.outermost("sched") as outer:
                if outer:
                    hub.emit("on_scheduler_step", scheduler)
                return orig(scheduler, *args, **kwargs)

        return sched_step

    def _wrap_backward(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        hub = self

        @functools.wraps(orig)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            with hub.outermost("backward") as outer:
                if not outer or _in_functorch_transform():
                    return orig(tensors, *args, **kwargs)
                flows = hub._total_flows
                hub.emit("on_backward", tensors)
                with hub._backward_pass(tensors) as scaled_roots:
                    result = orig(tensors, *args, **kwargs)
                through = hub._total_flows != flows or scaled_roots
                hub.emit("on_backward_end", tensors, through)
                return result

        return backward


    def _wrap_grad(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.autograd.grad``: a backward pass too. Through a scaled output (the AMP
        recipe for a gradient penalty: the gradients of ``scaler.scale(loss)``, then
        unscaled by hand) it overflows in the scaler's calibration steps, as any scaled
        backward does, and the loss made from those gradients with it."""
        hub = self

        @functools.wraps(orig)
        def grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
            with hub.outermost("backward") as outer:
                if not outer or _in_functorch_transform():
                    return orig(outputs, *args, **kwargs)
                with hub._backward_pass(outputs) as scaled:
                    result = orig(outputs, *args, **kwargs)
                if scaled:
                    hub.emit("on_scaled_grads", result)
                hub.emit("on_grads_taken", outputs, args[0] if args else kwargs.get("inputs"),
                         result, bool(scaled))
                return result

        return grad


def _in_functorch_transform() -> bool:
    """Inside ``torch.func.grad``/``vmap``/``jvp`` (which take gradients through
    ``torch.autograd.grad``): its losses and gradients are the transform's wrapped
    tensors, which must not escape it (review 60a: a flag kept from a vmapped loss raised
    at the step's end, and lost the step), and its backward is not the training step's."""
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return level is not None and level() is not None


def _warn_past_wrappers(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``warnings.warn`` whose ``stacklevel`` counts no frame of the hub's wrappers: the
    warning names the line it names without amp-doctor (its filters, its once-per-location
    registry and its module with it). Global state is not touched per call, so threads
    warning at once are safe; only warnings raised through ``warnings.warn`` itself are
    seen (not one a module bound with ``from warnings import warn`` before the watch)."""

    @functools.wraps(orig)
    def warn(message: Any, category: Any = None, stacklevel: int = 1, source: Any = None,
             **kwargs: Any) -> None:
        if not isinstance(stacklevel, int):
            return orig(message, category, stacklevel, source, **kwargs)  # its own error
        level = max(stacklevel, 1)  # python names the caller for any stacklevel below 1
        try:
            frame = sys._getframe(level)  # what `orig` would name, seen from here
            while frame.f_code in _WRAPPER_CODES and frame.f_back is not None:
                frame = frame.f_back
                level += 1
        except ValueError:  # beyond the stack: `orig` says so as it would have
            level = stacklevel
        # One more for this frame, which `orig` sees between it and the caller.
        return orig(message, category, level + 1, source, **kwargs)

    return warn


def _wrap_jit_script(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def script(obj: Any, *args: Any, **kwargs: Any) -> Any:
        # TorchScript compiles a module's forward hooks too: a watched model's would
        # fail it ("'_PostHook' object has no attribute '__name__'"), and the scripted
        # model, a copy made for export, is not watched anyway.
        if not isinstance(obj, torch.nn.Module):
            return orig(obj, *args, **kwargs)
        with own_hooks_lifted(obj):
            return orig(obj, *args, **kwargs)

    return script


# Set on the patched __getstate__ functions: a class resolving to one is covered.
_GETSTATE_MARK = "_amp_doctor_leaves_out_its_hooks"


# copy.copy calls __reduce_ex__, whose C code calls __getstate__: copy.copy's frame is the
# caller's. (copy.deepcopy and pickle's callers are other frames.)
_SHALLOW_COPY = copy.copy.__code__


def _wrap_getstate(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def __getstate__(self: torch.nn.Module) -> Any:
        # A copy or a checkpoint of a watched model: without amp-doctor's hooks, so that
        # torch.save(model) loads where amp_doctor is not installed.
        state = orig(self)
        if sys._getframe(1).f_code is _SHALLOW_COPY:
            # copy.copy(model) shares the original's hook dicts, as it does unwatched (a
            # hook registered on the copy is the original's too); amp-doctor's hooks do
            # nothing for the copy, which is not a watched module.
            return state
        if isinstance(state, dict):
            if state is self.__dict__:  # a subclass's own __getstate__, not a copy
                state = dict(state)
            state = state_without_own_hooks(state)
        return state

    setattr(__getstate__, _GETSTATE_MARK, True)
    return __getstate__


def _flow_hook(scaler_id: int, grad: torch.Tensor) -> None:
    """Tensor hook on a scaled output: a backward went through the scaler."""
    _HUB.note_flow(scaler_id)


_HUB = _ApiHub()
_REPORTED: set[tuple[int, str]] = set()


def _raised_by_a_signal_handler(exc: BaseException) -> bool:
    """``exc`` came from a Python signal handler that ran while amp-doctor's code did
    (torch's DataLoader raises from its SIGCHLD handler when a worker dies, on the SIGTERM
    a scheduler sends the whole job): the user's run must end on it as it would
    without amp-doctor, not have it taken for amp-doctor's bug and go on."""
    codes = set()
    for sig in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            handler = signal.getsignal(sig)
            code = getattr(getattr(handler, "__func__", handler), "__code__", None)
            if code is not None:
                codes.add(code)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False


def _internal_error(sub: Any, method: str, exc: Exception) -> None:
    key = (id(sub), method)
    if key not in _REPORTED:
        _REPORTED.add(key)
        warnings.warn(
            f"amp-doctor: internal error in {method} ({type(exc).__name__}: {exc}); "
            "training continues unaffected, but this part of the report may be incomplete. "
            "Please report it with the traceback from AMP_DOCTOR_DEBUG=1.",
            RuntimeWarning,
            stacklevel=3,
        )
    if os.environ.get("AMP_DOCTOR_DEBUG"):
        raise exc


class Subscription:
    """Removable like a hook handle; removing the last one restores every patch."""

    def __init__(self, sub: ApiSubscriber) -> None:
        self._sub: ApiSubscriber | None = sub
        _HUB.add(sub)

    def remove(self) -> None:
        if self._sub is not None:
            _HUB.remove(self._sub)
            self._sub = None


def subscribe(sub: ApiSubscriber) -> Subscription:
    """Start forwarding AMP API calls to ``sub``; the handle's ``remove`` stops it."""
    return Subscription(sub)


def patches_installed() -> bool:
    """True while any watch is active (tests use it to prove nothing is left behind)."""
    return _HUB.installed


def in_scaler_step() -> bool:
    """True inside ``GradScaler.step`` (an optimizer step there is the scaler's)."""
    return _HUB.in_scaler_step > 0


def in_closure_step() -> bool:
    """The optimizer step whose pre-hook is running was given a closure: the gradients it
    takes are not computed yet."""
    return _HUB.closure_step


def in_scaled_backward() -> bool:
    """True inside a backward pass that goes through an enabled GradScaler's ``scale()``
    (from where the scaled output's gradient is reached; ``scaler.scale(loss).backward()``:
    from its start)."""
    return _HUB.scaled_backward


def scaled_backwards(scaler: GradScaler | None) -> int:
    """How many backward passes so far went through ``scaler.scale()``'s outputs."""
    return _HUB.flows.get(id(scaler), 0)
