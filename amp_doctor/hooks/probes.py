"""Module hooks that turn activations and gradients into on-device summaries.

Nothing here copies to the host. Each hook only files the tensors it sees in
the current :class:`~amp_doctor.device.recorder.StepBuffer` (``buf.add(t)``:
two or three device ops, see :class:`~amp_doctor.device.stats.Batch`); the buffer is
copied to the host once, at the step boundary.

Design choices that keep the cost low and the user's run untouched:

* forward hooks plus ``Tensor.register_hook`` on outputs for gradients;
  no ``register_full_backward_hook`` (costly, and broken on in-place ops);
* a tensor that several nested modules return (a ``Sequential`` and its last
  child) is summarised once and credited to all of them;
* hooks return ``None`` and never touch the tensors they see, so the
  user's numerics are bit-identical with and without amp-doctor;
* what is registered on the user's modules and tensors is a small hook
  object holding only a weak reference to the :class:`Probes` (never the
  writer, the buffer's owner or a lock), so ``torch.save(model)`` and
  ``copy.deepcopy(model)`` keep working. A copy or an unpickled model gets
  :class:`Unwatched` hooks instead: it is an unwatched model, and each of
  those hooks removes itself from its module on its first call;
* under ``torch.compile`` every hook returns before doing anything, so
  dynamo traces nothing (no graph breaks, no recompiles). The pre-hook only
  stores, as a trace-time constant, which autocast state the graph was
  compiled for; dynamo replays that attribute store after the graph, which
  is how a compiled model is noticed without changing it;
* tensors that cannot be summarised (sparse, nested, meta, float8,
  functorch-wrapped under ``vmap``/``grad``) are skipped and counted once
  per (layer, kind) in an ``unsummarized`` event, without a host sync;
* tensor hooks live in ``RemovableHandle`` objects that are removed at the
  next step boundary: a module returning one of its own parameters does not
  pile up hooks on it;
* the modules of a parametrization (``weight_norm``, ``spectral_norm``,
  ``register_parametrization``) compute a layer's weight, not an activation: they
  are not layers, and their parameters are the parametrized layer's.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from amp_doctor.device.recorder import StepBuffer
from amp_doctor.device.stats import nonfinite_since_check
from amp_doctor.devicework import iter_tensors, without_subclasses
from amp_doctor.dtypes import LOW_PRECISION_NAMES, dtype_name
from amp_doctor.hooks.compiled import (
    COMPILED_NOTE,
    capturing,
    capturing_eagerly,
    compiled_autocast,
    dynamo_compiled_something,
    run_eagerly_when_called_by_dynamo,
)
from amp_doctor.hooks.moduleends import publish
from amp_doctor.hooks.seen import SeenTensors
from amp_doctor.hooks.tensorkinds import unsummarizable
from amp_doctor.hooks.weakhooks import Unwatched, WeakHook
from amp_doctor.records import Event

__all__ = ["LayerMeta", "Probes", "Unwatched", "unsummarizable",
           "run_eagerly_when_called_by_dynamo", "COMPILED_NOTE", "own_params",
           "in_reentrant_checkpoint"]

# Deeply nested outputs are rare and walking them is pure overhead.
MAX_TENSORS_PER_OUTPUT = 64
# Tensor-hook handles kept between step boundaries before the dead ones are pruned.
MAX_TENSOR_HANDLES = 4096


class _PreHook(WeakHook["Probes"]):
    def __init__(self, probes: Probes) -> None:
        super().__init__(probes)
        # Set only while dynamo traces this hook: the autocast state the
        # compiled graph was made for. Dynamo replays the store on every call.
        self.traced: str | None = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            self.traced = compiled_autocast()
            return None
        if capturing_eagerly():
            return None
        probes = self.owner()
        if probes is not None:
            without_subclasses(probes._pre, module, args, kwargs)
        return None


class _PostHook(WeakHook["Probes"]):
    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
        if capturing():
            return None
        probes = self.owner()
        if probes is not None:
            without_subclasses(probes._post, module, args, kwargs, output)
        return None


class _WrapperHook(WeakHook["Probes"]):
    """A hook on the ``torch.compile`` wrapper (``OptimizedModule``) of a watched root.
    For a ``torch.nn`` module (``nn.Sequential``) dynamo traces the module's own call,
    root hooks included, into the graph, where they do nothing: only the wrapper's hooks
    run eagerly around it."""

    __slots__ = ("_inner",)

    def __init__(self, probes: Probes, inner: nn.Module) -> None:
        super().__init__(probes)
        self._inner = weakref.ref(inner)


class _WrapperPreHook(_WrapperHook):
    """Notes the call, for :class:`_WrapperPostHook`."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        probes, inner = self.owner(), self._inner()
        if probes is not None and inner is not None and not capturing():
            probes._wrapper_calls.add(id(inner))
        return None


class _WrapperPostHook(_WrapperHook):
    """The root's own hooks, run from its wrapper's post-hook when they did not run
    eagerly during the call (they were traced into the compiled graph): the batch is
    checked and the model's output recorded as for a model whose hooks torch calls
    outside the graph (review 49a: a compiled ``nn.Sequential``'s NaN batch went
    unchecked). After the forward: the batch as given, unless the model changed it in
    place."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
        probes, inner = self.owner(), self._inner()
        if probes is None or inner is None or capturing():
            return None
        if id(inner) in probes._wrapper_calls:
            probes._wrapper_calls.discard(id(inner))
            without_subclasses(probes._pre, inner, args, kwargs)
            without_subclasses(probes._post, inner, args, kwargs, output)
        return None


class _RegisteredHook(WeakHook["Probes"]):
    """Global: a submodule assigned to a module (``model.head = nn.Linear(...)``)."""

    def __call__(self, module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        probes = self.owner()
        if probes is not None and submodule is not None and not capturing():
            probes._registered(module, name, submodule)
        return None


def _seed_of_backward(t: torch.Tensor) -> bool:
    """A float32 (or wider) scalar output: a loss a model returns beside its logits (HF's
    ``(logits, loss)``). Its gradient is backward's seed (1, or the loss scale), not a
    value the network made, and no low-precision format holds it (review 56a: the seed of
    2^16 read as a float16 gradient overflow in the what-if)."""
    return t.dim() == 0 and dtype_name(t.dtype) not in LOW_PRECISION_NAMES


class _GradHook(WeakHook["Probes"]):
    # The hook holds the layer names and the step's buffer, never the
    # activation: a finished step keeps no reference to user tensors.
    __slots__ = ("owners", "buf")

    def __init__(self, probes: Probes, owners: list[str], buf: StepBuffer) -> None:
        super().__init__(probes)
        self.owners = owners
        self.buf = buf

    def __call__(self, grad: torch.Tensor) -> None:
        if capturing():
            return None
        probes = self.owner()
        if probes is not None:
            without_subclasses(probes._on_grad, self.owners, self.buf, grad)
        return None


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
    # Its output was (part of) its model's output: its gradient is the loss's own.
    model_output: bool = False
    # The watched layers that took its output itself as their input, with how many of its
    # recorded calls' outputs they took (at most MAX_CONSUMERS, first seen first): one
    # that took every one computes its output gradient in its backward (see consumers()).
    consumer_calls: dict[str, int] = field(default_factory=dict)
    # Floating inputs (in recorded training calls) that were not a watched layer's output
    # as that layer returned it: the batch, or a tensor the parent's code made. A layer
    # without any took only watched outputs, whose values the step recorded.
    untraced_inputs: int = 0

    def producers_known(self) -> bool:
        """Every floating input it took was a watched layer's output, unchanged."""
        return self.untraced_inputs == 0

    def consumers(self) -> list[str]:
        """The layers that took the output of every recorded call of this one directly
        (no op of the parent's code between: ``B(A(x))``, not ``B(f(A(x)))``)."""
        return [c for c, n in self.consumer_calls.items() if 0 < self.calls <= n]


# The attribute torch.nn.utils.parametrize keeps a parametrized module's parametrizations
# in (a ModuleDict of ParametrizationList modules).
_PARAMETRIZATIONS = "parametrizations"


def own_params(mod: nn.Module) -> list[nn.Parameter]:
    """The parameters a layer's name stands for: its own, and those of its
    parametrizations (``weight_norm``'s ``original0``/``original1``)."""
    params = list(mod.parameters(recurse=False))
    if torch.nn.utils.parametrize.is_parametrized(mod):
        params += list(getattr(mod, _PARAMETRIZATIONS).parameters())
    return params


def _parametrization_parts(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of ``model``'s parametrization subtrees."""
    return tuple(".".join(q for q in (qual, _PARAMETRIZATIONS) if q)
                 for qual, mod in model.named_modules()
                 if torch.nn.utils.parametrize.is_parametrized(mod))


def _scripted_parts(model: nn.Module, base: str = "") -> tuple[str, ...]:
    """The qualified names of ``model``'s outermost TorchScript modules (a submodule
    given to ``torch.jit.script``, or ``model`` itself): they take no Python hooks
    (``register_forward_pre_hook is not supported on ScriptModules``), nor do their
    submodules, which TorchScript made script modules too."""
    if isinstance(model, torch.jit.ScriptModule):
        return (base,)
    tops: list[str] = []
    for qual, mod in model.named_modules(prefix=base):
        if isinstance(mod, torch.jit.ScriptModule) and not _within(qual, tuple(tops)):
            tops.append(qual)
    return tuple(tops)


def _within(qual: str, tops: tuple[str, ...]) -> bool:
    """``qual`` is one of ``tops`` or inside one ("" being the whole model)."""
    return any(qual == t or not t or qual.startswith(t + ".") for t in tops)


# Autograd nodes of views and casts (their class names less the version digits): a
# model output made by them from a layer's output is that layer's output, reshaped.
_VIEW_NODES = frozenset({
    "SqueezeBackward", "UnsqueezeBackward", "ViewBackward", "ReshapeAliasBackward",
    "ToCopyBackward", "CloneBackward", "TBackward", "TransposeBackward", "PermuteBackward",
    "SelectBackward", "SliceBackward", "ExpandBackward", "AsStridedBackward",
    "UnsafeViewBackward", "AliasBackward", "ContiguousBackward",
})
# View and cast nodes walked back from a model's output, at most.
MAX_VIEW_HOPS = 6


# Consumers kept per layer (see LayerMeta.consumers).
MAX_CONSUMERS = 4
# Frames walked up from a forward pre-hook to find a reentrant checkpoint's forward.
CHECKPOINT_FRAMES = 12


def in_reentrant_checkpoint() -> bool:
    """Is this call inside ``torch.utils.checkpoint``'s reentrant forward (its first
    pass, run under no_grad: training work, not validation)? Asked only of a model's
    forward that starts with grad disabled."""
    mod = sys.modules.get("torch.utils.checkpoint")  # not imported: not in one
    fn = getattr(getattr(mod, "CheckpointFunction", None), "forward", None)
    code = getattr(fn, "__code__", None)
    f: FrameType | None = sys._getframe(1)
    for _ in range(CHECKPOINT_FRAMES):
        if f is None or code is None:
            return False
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _frozen_part_call(module: nn.Module, root: nn.Module | None) -> bool:
    """A call of ``module`` under no_grad (not inference_mode) whose parameters, it has
    some, take no gradient, while its model ``root`` trains: a frozen part whose outputs
    feed the trained part. With the model and each of its parts in eval mode it is a
    validation loop's call. A frozen backbone in a training step may be in eval mode
    itself (for its BatchNorm), and a linear probe may leave the model in eval mode with
    only its head in train mode (review 61c): some part of it trains."""
    if torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    if root is not None and not root.training and not any(
            c.training for c in root.children()):
        return False
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def _first_tensors(obj: Any) -> list[torch.Tensor]:
    # Most modules take and return one plain tensor: skip the walker's generator.
    if type(obj) is torch.Tensor:
        return [obj]
    if type(obj) is tuple and len(obj) == 2 and type(obj[1]) is dict and not obj[1]:
        args = obj[0]  # (args, kwargs) of a pre-hook, without kwargs
        if type(args) is tuple and len(args) == 1 and type(args[0]) is torch.Tensor:
            return [args[0]]
    out: list[torch.Tensor] = []
    for t in iter_tensors(obj):
        out.append(t)
        if len(out) >= MAX_TENSORS_PER_OUTPUT:
            break
    return out


class _ForwardCalls(threading.local):
    """The watched forward calls running in one thread."""

    def __init__(self) -> None:
        self.depth = 0
        # The outermost watched call of the running forward had grad enabled: a training
        # forward, in which a no_grad part (a reentrant checkpoint's first pass, a teacher
        # or EMA call) still ran in the step and is recorded.
        self.training = False
        # The outermost watched call began inside a backward: a checkpoint recomputing it
        # (an autograd.grad taken in a forward runs inside that forward's call instead).
        self.in_backward = False
        # Names of the modules whose forward is running, innermost last.
        self.stack: list[str] = []
        # The outermost watched call is an evaluation of a watched model (no grad, not a
        # companion's): it runs with the sublayer hooks removed (see Probes._pre).
        self.inference = False


class Probes:
    """Forward hooks on the modules of the watched models.

    Roots (the models given to ``watch``) are hooked for the whole watch:
    ``on_root_forward`` lets the owner see each root call (autocast state,
    step starts) without hooks of its own, ``on_root_output`` its output.
    Every other module is hooked only while :meth:`set_armed` says so, which
    the owner does for recorded steps (and for anomaly mode, which needs the
    module stack on every step): once a module has any hook, torch calls it
    through its slow path, and on an
    unrecorded step even an idle hook would be pure cost.
    """

    def __init__(
        self,
        models: dict[str, nn.Module],
        buffer_provider: Callable[[], StepBuffer | None],
        on_root_forward: Callable[[nn.Module, tuple[Any, ...]], None],
        events: list[Event] | None = None,
        on_compiled: Callable[[str, str], None] | None = None,
        on_root_output: Callable[[nn.Module, Any], None] | None = None,
        step_of: Callable[[], int] | None = None,
    ) -> None:
        self.layers: dict[str, LayerMeta] = {}
        # The watch's step index, for events of modules found mid-run.
        self._step_of = step_of
        self._names: dict[int, str] = {}
        self._roots: set[int] = set()
        # Weak: the model is the user's, and a finished watch holds none of it.
        self._root_refs: dict[int, weakref.ref[nn.Module]] = {}
        # Submodules the loop calls directly (see _entry): hooked for the whole watch.
        self._entries: set[int] = set()
        # Roots whose own forward ran with grad enabled: their submodules are no entries.
        self._roots_trained: set[int] = set()
        # Roots whose training forward ran since the last backward or boundary, and the
        # thread it ran in (another thread's no_grad inference is never the step's).
        self._trained_this_step: dict[int, int] = {}
        # Every thread a root's training forward ran in (the script's training threads).
        self.trainer_threads: set[int] = set()
        self._roots_called: set[int] = set()  # any outermost call, training or not
        self._handles: list[RemovableHandle] = []
        # Hooks on non-root modules, present only while armed.
        self._sub_handles: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}
        self._subs: list[nn.Module] = []
        # Roots known to run under torch.compile: their sublayer hooks are never
        # added or removed again, since dynamo guards on the hook dicts it traced
        # (toggling them per recorded step would recompile).
        self._frozen: set[int] = set()
        # Per recorded step: root calls made while armed, and sublayer calls, by root.
        self._armed_root_calls: dict[int, int] = {}
        self._sub_calls: dict[int, int] = {}
        # The autograd node of each output filed during the outermost watched forward
        # running, with its layers: a model output reshaped or cast from one is found by
        # walking back to it (_viewed_output). Strong keys (nodes take no weak reference),
        # dropped when that forward returns: the graph holds the nodes until then anyway.
        self._out_nodes: dict[Any, list[str]] = {}
        self.armed = False
        self._want_armed = False
        # Outermost watched forwards running, in every thread.
        self._inflight = 0
        # Held while a root call reads _inflight and arms or disarms by it, and while it
        # counts itself in or out: else a thread about to run inference read 0 while
        # the training thread was between passes, and disarmed in the middle of the
        # training forward that began meanwhile (its layers' calls went unrecorded).
        self._arm_lock = threading.RLock()
        self._buffer = buffer_provider
        self._on_root_forward = on_root_forward
        self._on_root_output = on_root_output
        self.recording = False
        # Per thread: a forward the user runs in another thread meanwhile (inference
        # under no_grad) has depth, stack and grad mode of its own, and must neither
        # be recorded as training nor unbalance the training forward's.
        self._calls = _ForwardCalls()
        # Per step: which summary a tensor got, and which layers own its grad.
        self._seen: SeenTensors[tuple[int, list[str], int]] = SeenTensors()
        # The owner lists of this step's gradient hooks, renamed with their layers.
        self._step_owners: list[list[str]] = []
        self.param_owner: dict[int, str] = {}
        self._root_prefix: dict[int, str] = {}
        # Each root's own pre/post hook handles (also in _handles), for forget_root.
        self._root_handles: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}
        # Roots called through a hooked torch.compile wrapper whose own pre-hook has not
        # run eagerly in that call (yet): see _WrapperPostHook.
        self._wrapper_calls: set[int] = set()
        self._wrapped: set[int] = set()  # wrappers hooked, by id
        # Every recorded layer in forward order (of completion: children before their
        # parent), and the furthest place in it that this step's forward has reached: a
        # layer first seen in a later step (an MoE expert that got no tokens before) goes
        # where it ran, not after the model's output. The furthest, not the last layer
        # done: a module called twice (a block's shared ReLU) is done again at its
        # first call's place.
        self._forward_seq: list[LayerMeta] = []
        self._reached = -1
        # One pre/post hook object per module, reused each time it is armed.
        self._hook_objs: dict[int, tuple[_PreHook, _PostHook]] = {}
        # Tensor hooks of the current step; removed at the step boundary.
        self._tensor_handles: list[RemovableHandle] = []
        self._leaf_hooks: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Session events: "unsummarized" (one per layer and kind, counted).
        self._events = events if events is not None else []
        self._skipped: dict[tuple[str, str], Event] = {}
        # TorchScript modules left unhooked, by layer name: one event each; and the
        # watched models that are TorchScript modules themselves.
        self._scripted_noted: set[str] = set()
        self.scripted_roots: set[str] = set()
        self._on_compiled = on_compiled
        run_eagerly_when_called_by_dynamo(_PreHook.__call__, _PostHook.__call__,
                                          _GradHook.__call__, Unwatched.__call__)
        for prefix, model in models.items():
            self.add_root(prefix, model)
        self._handles.append(torch.nn.modules.module.register_module_module_registration_hook(
            _RegisteredHook(self)))

    @staticmethod
    def _layer_name(prefix: str, qual: str, mod: nn.Module) -> str:
        return ".".join(p for p in (prefix, qual) if p) or type(mod).__name__

    def add_root(self, prefix: str, model: nn.Module) -> bool:
        """Hook every module of ``model``; False if it is already watched."""
        if id(model) in self._names:
            return False
        self._roots.add(id(model))
        self._root_refs[id(model)] = weakref.ref(model)
        self._root_prefix[id(model)] = prefix
        parts = _parametrization_parts(model)
        scripted = self._skip_scripted(prefix, model, _scripted_parts(model))
        for qual, mod in model.named_modules():
            if id(mod) in self._names or _within(qual, parts) or _within(qual, scripted):
                continue  # shared submodule: first name wins; a weight's parametrization
            name = self._layer_name(prefix, qual, mod)
            meta = LayerMeta(name=name, type=type(mod).__name__, order=-1, root=id(model),
                             qual=qual)
            meta.params = own_params(mod)
            meta.param_dtypes = {dtype_name(p.dtype) for p in meta.params}
            for p in meta.params:
                self.param_owner.setdefault(id(p), name)
            self.layers[name] = meta
            self._names[id(mod)] = name
            if mod is model:
                hs = self._hook(mod)
                self._root_handles[id(mod)] = hs
                self._handles.extend(hs)
            else:
                self._subs.append(mod)
                if self.armed:
                    self._sub_handles[id(mod)] = self._hook(mod)
        return True

    def _registered(self, parent: nn.Module, name: str, new: nn.Module) -> None:
        """``new`` is being assigned to ``parent.<name>`` (a task head replaced after the
        watch began): if ``parent`` is watched, ``new`` and its submodules are watched
        under the names they take, in place of the module they replace."""
        pname = self._names.get(id(parent))
        if pname is None or id(new) in self._names:
            return
        pmeta = self.layers[pname]
        if name == _PARAMETRIZATIONS and isinstance(new, nn.ModuleDict):
            # register_parametrization (weight_norm) on a watched layer: what it adds
            # computes the layer's weight; its parameters are read at the next boundary.
            return
        old = parent._modules.get(name)
        if old is not None:
            self._forget_subtree(old)
        base = ".".join(q for q in (pmeta.qual, name) if q)
        prefix = self._root_prefix.get(pmeta.root, "")
        parts = tuple(".".join(q for q in (base, p) if q) for p in _parametrization_parts(new))
        scripted = self._skip_scripted(prefix, new, _scripted_parts(new, base), base)
        for qual, mod in new.named_modules(prefix=base):
            if id(mod) in self._names or _within(qual, parts) or _within(qual, scripted):
                continue  # shared with a watched module: first name wins
            lname = self._layer_name(prefix, qual, mod)
            meta = self.layers.get(lname)
            if meta is None or meta.root != pmeta.root:
                meta = self.layers[lname] = LayerMeta(
                    name=lname, type=type(mod).__name__, order=-1, root=pmeta.root, qual=qual)
            meta.type = type(mod).__name__
            meta.params = own_params(mod)
            meta.param_dtypes = {dtype_name(p.dtype) for p in meta.params}
            for p in meta.params:
                self.param_owner[id(p)] = lname
            self._names[id(mod)] = lname
            self._subs.append(mod)
            if self.armed:
                self._sub_handles[id(mod)] = self._hook(mod)

    def _forget_subtree(self, old: nn.Module) -> None:
        """The modules of ``old``, replaced in the model: no longer watched."""
        for mod in old.modules():
            mid = id(mod)
            if mid in self._roots or self._names.pop(mid, None) is None:
                continue
            for h in self._sub_handles.pop(mid, ()):
                h.remove()
            self._subs = [m for m in self._subs if m is not mod]

    def forget_root(self, model: nn.Module) -> dict[int, str]:
        """Stop watching the root ``model`` as a root (the model it is part of is found, and
        watches it under its own names); returns each of its modules' old name, by ``id``.
        Only before any training forward: its figures so far are renamed, not merged."""
        rid = id(model)
        old: dict[int, str] = {}
        for h in self._root_handles.pop(rid, ()):
            h.remove()
            self._handles = [x for x in self._handles if x is not h]
        for mod in model.modules():
            mid = id(mod)
            name = self._names.get(mid)
            if name is None or self.layers[name].root != rid:
                continue
            old[mid] = self._names.pop(mid)
            self.layers.pop(name, None)
            for h in self._sub_handles.pop(mid, ()):
                h.remove()
        gone = set(old)
        self._subs = [m for m in self._subs if id(m) not in gone]
        self._entries -= gone
        names = set(old.values())
        self.param_owner = {k: v for k, v in self.param_owner.items() if v not in names}
        self._roots.discard(rid)
        self._root_refs.pop(rid, None)
        self._root_prefix.pop(rid, None)
        self._roots_called.discard(rid)
        self._frozen.discard(rid)
        return old

    def replace_root(self, old: nn.Module, new: nn.Module) -> None:
        """The root ``new`` takes the place of the root ``old`` (the same architecture: a
        model reloaded from a full checkpoint, a deep copy; see
        :func:`~amp_doctor.hooks.discovery.same_architecture`). Each of ``new``'s modules
        takes over the layer of ``old``'s module at the same path: its name, its place in
        forward order and its figures so far, so the layers' statistics run on under the
        same names. ``old``'s modules are unhooked and no longer watched."""
        rid, nid = id(old), id(new)
        prefix = self._root_prefix.get(rid, "")
        by_qual = {meta.qual: meta for meta in self.layers.values() if meta.root == rid}
        for h in self._root_handles.pop(rid, ()):
            h.remove()
            self._handles = [x for x in self._handles if x is not h]
        entry_quals: set[str] = set()
        gone: set[int] = set()
        for qual, mod in old.named_modules():
            mid = id(mod)
            name = self._names.get(mid)
            if name is None or self.layers[name].root != rid:
                continue
            del self._names[mid]
            gone.add(mid)
            if mid in self._entries:
                # Its hooks are kept among the watch's for good: they find no name now.
                entry_quals.add(qual)
            for h in self._sub_handles.pop(mid, ()):
                h.remove()
            self._hook_objs.pop(mid, None)
        self._subs = [m for m in self._subs if id(m) not in gone]
        self._entries -= gone
        old_params = {id(p) for meta in by_qual.values() for p in meta.params}
        self.param_owner = {k: v for k, v in self.param_owner.items() if k not in old_params}
        self._root_refs.pop(rid, None)
        self._root_refs[nid] = weakref.ref(new)
        # What was learned of the old root holds for the new one: it trained, was called.
        for ids in (self._roots, self._roots_trained, self._roots_called):
            if rid in ids:
                ids.discard(rid)
                ids.add(nid)
        for d in (self._trained_this_step, self._armed_root_calls, self._sub_calls):
            if rid in d:
                d[nid] = d.pop(rid)
        # A compiled old root says nothing of the new one (compiled again, it is found so).
        self._frozen.discard(rid)
        del self._root_prefix[rid]
        self._root_prefix[nid] = prefix
        parts = _parametrization_parts(new)
        scripted = self._skip_scripted(prefix, new, _scripted_parts(new))
        for qual, mod in new.named_modules():
            if id(mod) in self._names or _within(qual, parts) or _within(qual, scripted):
                continue  # shared submodule: first name wins; a weight's parametrization
            meta = by_qual.get(qual)
            if meta is None:
                meta = LayerMeta(name=self._layer_name(prefix, qual, mod),
                                 type=type(mod).__name__, order=-1, qual=qual)
                self.layers[meta.name] = meta
            meta.root = nid
            meta.params = own_params(mod)
            meta.param_dtypes = {dtype_name(p.dtype) for p in meta.params}
            for p in meta.params:
                self.param_owner[id(p)] = meta.name
            self._names[id(mod)] = meta.name
            if mod is new:
                hs = self._hook(mod)
                self._root_handles[id(mod)] = hs
                self._handles.extend(hs)
            elif qual in entry_quals:
                # Called by the loop itself, as its counterpart was: hooked for good.
                self._handles.extend(self._hook(mod))
                self._entries.add(id(mod))
            else:
                self._subs.append(mod)
                if self.armed:
                    self._sub_handles[id(mod)] = self._hook(mod)

    def _entry(self, module: nn.Module) -> bool:
        """``module``, a submodule of a watched model, is called by the loop itself (a
        Lightning ``training_step`` calling ``self.net(x)``, a loop calling
        ``model.backbone(x)``): the root's forward never runs, so this call is where a
        training step's forward starts. From the first such training call on, it is
        hooked on every step, as a root is, and its calls are seen as the root's."""
        mid = id(module)
        if mid in self._entries:
            return True
        root = self._root_of(mid)
        if ((not torch.is_grad_enabled() and not _frozen_part_call(module,
                                                                   self._root_module(root)))
                or torch._C._current_graph_task_id() != -1
                or root in self._roots_trained or root in self._frozen
                or mid not in self._sub_handles):
            # Inference; a checkpoint's recompute in backward; a model whose own forward
            # trains (found by discovery during that call, whose hooks it missed); or a
            # compiled model (dynamo guards on the hook dicts it traced).
            return False
        self._handles.extend(self._sub_handles.pop(mid))
        self._subs.remove(module)
        self._entries.add(mid)
        return True

    def _companion(self, module: nn.Module) -> bool:
        """``module``, called under no_grad (or inference_mode) outside backward, belongs
        to a watched model that has never trained while another one has: a distillation
        teacher, a frozen reference model, whose outputs feed the training step's loss.
        Its forward is the step's work, recorded and checked as the trained model's is
        (a teacher's float16 overflow poisons the student's loss). Validation of a
        trained model, and a Lightning sanity check before the first training forward
        (of one model, or of several under inference_mode), is inference."""
        root = self._root_of(id(module))
        if torch._C._current_graph_task_id() != -1:
            return False
        if id(module) not in self._roots and _frozen_part_call(module,
                                                               self._root_module(root)):
            # A frozen part of a watched model the loop calls itself (``feats =
            # model.backbone(x)`` under no_grad, then ``model.head(feats)``): its outputs
            # are the trained part's input, as a teacher's are (review 60b: a backbone's
            # float16 overflow read as "the batch given to head already held inf").
            return True
        if (self._trained_this_step.get(root) == threading.get_ident() and module.training
                and not torch.is_inference_mode_enabled()):
            # The trained model itself, in train mode, called under no_grad between its
            # training forward and that forward's backward (a DQN's TD target, a
            # bootstrapped value): that output feeds the loss, and an overflow in it is
            # this step's NaN. Validation (eval mode, or after a backward: between
            # micro-batches of gradient accumulation) is not.
            return True
        if root in self._roots_trained:
            return False
        # Before any model trained: a teacher run first in the very first iteration (its
        # student not called yet), but not a single model's validation, nor Lightning's
        # sanity check of several, which runs under inference_mode (a teacher's output
        # made there cannot feed the loss's backward without a clone).
        return bool(self._roots_trained) or (
            not torch.is_inference_mode_enabled()
            and any(r not in self._roots_called for r in self._roots if r != root))

    def in_companion_call(self) -> bool:
        """The outermost watched call running is a companion's (see :meth:`_companion`)."""
        calls = self._calls
        return calls.depth == 1 and calls.training and not torch.is_grad_enabled()

    def note_root_call(self, model: nn.Module) -> None:
        """``model``'s forward is running, though its hooks were not called (discovery
        found it during the call)."""
        calls = self._calls
        calls.training = torch.is_grad_enabled() or in_reentrant_checkpoint()
        calls.in_backward = torch._C._current_graph_task_id() != -1
        if calls.training:
            self._roots_trained.add(id(model))
            self._trained_this_step[id(model)] = ident = threading.get_ident()
            self.trainer_threads.add(ident)
        name = self._names.get(id(model))
        if calls.depth == 0 and name is not None:
            # As its pre-hook would have: its layers are inside a training call (a
            # reentrant checkpoint's first pass runs them under no_grad), until its
            # post-hook, which runs at the end of this very call, closes it.
            calls.depth = 1
            calls.stack.append(name)
            self._roots_called.add(id(model))

    def join_part_call(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """``module``, part of a model discovery watched during this very call of it (the
        loop calls the part itself), missed its pre-hook: run it as it would have run.
        Only when the part's post-hook is registered, which closes the call at its end."""
        mid = id(module)
        if mid in self._sub_handles or mid in self._entries:
            self._pre(module, args, {})

    def root_id(self, module: nn.Module) -> int:
        """The ``id()`` of the watched model ``module`` belongs to (itself for a root)."""
        return self._root_of(id(module))

    def hook_wrapper(self, wrapper: nn.Module, inner: nn.Module) -> None:
        """Run the root ``inner``'s hooks around ``wrapper``'s call (a ``torch.compile``
        wrapper of it) when dynamo traced them into the graph (see _WrapperPostHook)."""
        if id(wrapper) in self._wrapped or id(inner) not in self._roots:
            return
        self._wrapped.add(id(wrapper))
        self._handles.append(wrapper.register_forward_pre_hook(
            _WrapperPreHook(self, inner), with_kwargs=True))
        self._handles.append(wrapper.register_forward_hook(
            _WrapperPostHook(self, inner), with_kwargs=True, always_call=True))

    def freeze(self, model: nn.Module) -> None:
        """``model`` runs under torch.compile: leave its sublayer hooks as they are now."""
        self._frozen.add(id(model))

    def _root_module(self, root_id: int) -> nn.Module | None:
        ref = self._root_refs.get(root_id)
        return ref() if ref is not None else None

    def _root_of(self, mod_id: int) -> int:
        name = self._names.get(mod_id)
        meta = self.layers.get(name) if name is not None else None
        return meta.root if meta is not None else mod_id

    def _hook(self, mod: nn.Module) -> tuple[RemovableHandle, RemovableHandle]:
        objs = self._hook_objs.get(id(mod))
        if objs is None:
            objs = self._hook_objs[id(mod)] = (_PreHook(self), _PostHook(self))
        return (mod.register_forward_pre_hook(objs[0], with_kwargs=True),
                mod.register_forward_hook(objs[1], with_kwargs=True, always_call=True))

    def set_armed(self, armed: bool) -> None:
        """Hook (or unhook) every non-root module; applied between forward passes.

        A request made while a forward is running waits for the next root
        call: removing a hook mid-forward would lose its module's post-hook.
        """
        self._want_armed = armed
        if self._calls.depth == 0:
            self.apply_armed()

    def apply_armed(self) -> None:
        with self._arm_lock:
            self._apply_armed()

    def _apply_armed(self) -> None:
        want = self._want_armed and not self._calls.inference
        if want == self.armed or (not want and self._inflight > 0):
            # (Not while another thread is inside a watched forward: it would lose its
            # layers' post-hooks. A later root call applies it.)
            return
        if want:
            for mod in self._subs:
                if id(mod) not in self._sub_handles and self._root_of(id(mod)) not in self._frozen:
                    self._sub_handles[id(mod)] = self._hook(mod)
        else:
            for mid, hs in list(self._sub_handles.items()):
                if self._root_of(mid) not in self._frozen:
                    for h in hs:
                        h.remove()
                    del self._sub_handles[mid]
        self.armed = want

    def trained_any(self) -> bool:
        """A watched model ran a training forward (with grad)."""
        return bool(self._roots_trained)

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
            meta.consumer_calls = {mapping.get(c, c): n for c, n in meta.consumer_calls.items()}
        self._names = {k: mapping.get(v, v) for k, v in self._names.items()}
        self.param_owner = {k: mapping.get(v, v) for k, v in self.param_owner.items()}
        self._calls.stack = [mapping.get(v, v) for v in self._calls.stack]
        # The step's gradient hooks hold their layers' names (shared lists, kept here even
        # when the tensor object died: its hook still runs in backward): gradients still to
        # come in this step go to the new names, not to layers that no longer are.
        for owners in self._step_owners:
            owners[:] = [mapping.get(n, n) for n in owners]
        return mapping

    # -- lifecycle -------------------------------------------------------
    def remove(self) -> None:
        self._collect_compiled()
        subs = [h for hs in self._sub_handles.values() for h in hs]
        for h in (*self._handles, *subs, *self._tensor_handles):
            h.remove()
        self._handles.clear()
        self._root_handles.clear()  # the same handles as in _handles, removed above
        self._wrapper_calls.clear()
        self._wrapped.clear()
        self._sub_handles.clear()
        self._tensor_handles.clear()
        self._leaf_hooks = WeakIdKeyDictionary()
        self.armed = self._want_armed = False
        self._seen.clear()
        self._out_nodes.clear()
        self._step_owners = []
        self._calls.stack.clear()
        self._calls.depth = 0
        self._calls.inference = False
        self._inflight = 0

    def name_of(self, module: nn.Module) -> str | None:
        return self._names.get(id(module))

    def name_of_id(self, module_id: int) -> str | None:
        return self._names.get(module_id)

    def current_module(self) -> str | None:
        stack = self._calls.stack
        return stack[-1] if stack else None

    def recomputing(self) -> bool:
        """A watched forward is running again inside backward (activation checkpointing)."""
        calls = self._calls
        return calls.depth > 0 and calls.in_backward

    def in_training_forward(self) -> bool:
        """A watched layer below the root is running inside a forward whose outermost
        watched call had grad enabled (so a ``no_grad`` block in it, e.g. a reentrant
        checkpoint's first pass, is still training work). The root alone does not count:
        a compiled root's graph runs under no_grad inside its call, and is not searched."""
        calls = self._calls
        return calls.depth > 1 and calls.training

    def new_step(self) -> None:
        self._seen.clear()
        self._out_nodes.clear()
        self._reached = -1
        self._trained_this_step.clear()
        self._step_owners = []
        # Gradient hooks of the step that ended: its backward has run. Removing
        # them keeps long-lived tensors (a parameter a module returns) from
        # gathering one hook per step, and no graph kept alive with
        # retain_graph=True holds the old step's buffer.
        for h in self._tensor_handles:
            h.remove()
        self._tensor_handles.clear()
        self._leaf_hooks = WeakIdKeyDictionary()
        self._collect_compiled()

    def _place(self, meta: LayerMeta) -> None:
        """Give a layer seen for the first time its place in forward order: right after
        the furthest layer this step's forward has completed (first if none did), and
        renumber the layers after it."""
        seq = self._forward_seq
        at = self._reached + 1
        seq.insert(at, meta)
        for i in range(at, len(seq)):
            seq[i].order = i

    def backward_ran(self) -> None:
        """A backward pass ended: a no_grad call after it is no longer the loss's part."""
        self._trained_this_step.clear()

    def _hook_grad(self, t: torch.Tensor, owners: list[str], buf: StepBuffer) -> None:
        self._step_owners.append(owners)
        if t.grad_fn is None:
            # A leaf (a parameter a module returns) lives on: one hook on it at a
            # time, retargeted to the latest call, however many calls come
            # before the next step boundary (a loop with no optimizer has none).
            hook = self._leaf_hooks.get(t)
            if hook is not None:
                hook.owners, hook.buf = owners, buf
                return
            hook = self._leaf_hooks[t] = _GradHook(self, owners, buf)
            self._keep_handle(t.register_hook(hook))
            return
        base = t._base
        if base is not None and base.grad_fn is not None and base.numel() == t.numel():
            # A reshape of the layer's result (a Linear on 3-D input under autocast returns
            # a view): an in-place op after the layer (ReLU(inplace=True)) rebases the
            # view's history, and a hook on it would never run (review 46a). Its base's
            # gradient holds the same values.
            t = base
        self._keep_handle(t.register_hook(_GradHook(self, owners, buf)))

    def _keep_handle(self, handle: RemovableHandle) -> None:
        # A loop with no step boundary would grow the list forever; most handles
        # point at activations already freed (their hook dict is gone).
        if len(self._tensor_handles) >= MAX_TENSOR_HANDLES:
            self._tensor_handles = [h for h in self._tensor_handles
                                    if h.hooks_dict_ref() is not None]
        self._tensor_handles.append(handle)

    def _collect_compiled(self) -> None:
        """Report modules whose hooks dynamo traced since the last call (see _PreHook),
        and roots compiled before they were watched: called while their sublayers were
        hooked, yet no sublayer hook ran (the graph was traced without them)."""
        if self._on_compiled is None:
            return
        for root, n in self._armed_root_calls.items():
            if (n and not self._sub_calls.get(root) and root not in self._frozen
                    and dynamo_compiled_something()
                    and any(self._root_of(id(m)) == root for m in self._subs)):
                self._frozen.add(root)
                self._on_compiled(self._names[root], "")
        self._armed_root_calls.clear()
        self._sub_calls.clear()
        for mid, (pre, _) in self._hook_objs.items():
            if pre.traced is not None:
                root = self._root_of(mid)
                self._frozen.add(root)
                name = self._names.get(root)
                if name is not None:
                    self._on_compiled(name, pre.traced)
                pre.traced = None

    def _skip_scripted(self, prefix: str, model: nn.Module, quals: tuple[str, ...],
                       base: str = "") -> tuple[str, ...]:
        """``quals`` (TorchScript modules of ``model``, see :func:`_scripted_parts`) are
        left unhooked, each with an info event; returns them."""
        mods = dict(model.named_modules(prefix=base))
        for qual in quals:
            name = self._layer_name(prefix, qual, mods[qual])
            if not qual and not prefix:
                # A scripted model's class is TorchScript's: name it by the scripted one's.
                name = str(getattr(mods[qual], "original_name", name))
            if name in self._scripted_noted:
                continue
            self._scripted_noted.add(name)
            step = self._step_of() if self._step_of is not None else 0
            if mods[qual] is model and not base:
                # The watched model itself: nothing of it can be recorded.
                self.scripted_roots.add(name)
                data = {"severity": "warning", "message": (
                    f"The watched model {name} is a TorchScript module (torch.jit.script): "
                    "TorchScript runs no Python hooks, so none of its layers can be recorded "
                    "(the GradScaler, the optimizer and the loss still are). The run itself "
                    "is unaffected."), "advice": (
                    "Watch the Python module, before `torch.jit.script`: "
                    "`amp_doctor.watch(model)` on the model you script, for a few steps "
                    "unscripted.")}
            else:
                data = {"severity": "info", "message": (
                    f"{name} is a TorchScript module (torch.jit.script): TorchScript runs no "
                    "Python hooks, so it and its submodules have no rows of their own (its "
                    "work shows in the rows of its parent and of the layers that take its "
                    "output), and the run itself is unaffected."), "advice": (
                    "Nothing to fix. For its own rows, watch a few steps with the module "
                    "not scripted.")}
            self._events.append(Event(kind="scripted_module", step=step, module=name,
                                      data=data))
        return quals

    def _note_skipped(self, name: str, kind: str, step: int) -> None:
        """Count a tensor that could not be summarised; one event per (layer, kind)."""
        ev = self._skipped.get((name, kind))
        if ev is None:
            ev = Event(kind="unsummarized", step=step, module=name, data={
                "tensor": kind, "count": 0, "severity": "info",
                "message": (f"{name}: {kind} tensors are not summarised (no statistics for "
                            "them); the run itself is unaffected."),
            })
            self._skipped[(name, kind)] = ev
            self._events.append(ev)
        ev.data["count"] += 1

    # -- hooks -----------------------------------------------------------
    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = self._names.get(id(module))
        if name is None:
            # copy.copy(module) shares the hook dicts: that copy is not watched.
            return
        calls = self._calls
        if calls.depth == 0:
            if self._wrapper_calls:
                self._wrapper_calls.discard(id(module))  # its hooks run eagerly: not again
            calls.in_backward = torch._C._current_graph_task_id() != -1
            # A model run whole through a reentrant checkpoint trains under no_grad.
            ckpt = not torch.is_grad_enabled() and in_reentrant_checkpoint()
            calls.training = torch.is_grad_enabled() or ckpt or self._companion(module)
            # Evaluation of a watched model between steps runs with no sublayer hooks, as
            # without amp-doctor: a hook turns off TransformerEncoderLayer's fast path,
            # which changes its results (review 46a). Only when no other thread is inside
            # a watched forward, whose post-hooks removing them would lose.
            with self._arm_lock:
                calls.inference = (not calls.training and id(module) in self._roots
                                   and self._inflight == 0)
                if (self._want_armed and not calls.inference) != self.armed:
                    self.apply_armed()
                self._inflight += 1
        calls.depth += 1
        calls.stack.append(name)
        if calls.depth == 1:
            self._roots_called.add(self._root_of(id(module)))
            # The batch as the loop gave it: keyword arguments too (HF's Trainer calls
            # ``model(**inputs)``; review 48c: a NaN ``inputs_embeds`` went unchecked).
            given = (args, kwargs) if kwargs else args
            if id(module) in self._roots:
                if torch.is_grad_enabled() or ckpt:
                    self._roots_trained.add(id(module))
                    self._trained_this_step[id(module)] = ident = threading.get_ident()
                    self.trainer_threads.add(ident)
                self._on_root_forward(module, given)
                if self.armed and self.recording:
                    self._armed_root_calls[id(module)] = \
                        self._armed_root_calls.get(id(module), 0) + 1
            elif self._entry(module):
                self._on_root_forward(module, given)
        # An activation-checkpointing recompute (inside backward) takes detached copies of
        # the inputs its first pass took from watched layers: not new producers.
        if (not self.recording or not (calls.training or torch.is_grad_enabled())
                or calls.in_backward):
            return
        meta = self.layers[name]
        ins = _first_tensors((args, kwargs))
        if len(ins) >= MAX_TENSORS_PER_OUTPUT:
            meta.untraced_inputs += 1  # some inputs were not looked at
        for t in ins:
            if t.is_floating_point():
                meta.input_dtypes.add(dtype_name(t.dtype))
                entry = self._seen.get(t)
                if entry is not None and entry[2] == (-1 if t.is_inference() else t._version):
                    for owner in entry[1]:
                        cons = self.layers[owner].consumer_calls
                        if name in cons or len(cons) < MAX_CONSUMERS:
                            cons[name] = cons.get(name, 0) + 1
                        else:
                            meta.untraced_inputs += 1
                else:
                    # Not a watched layer's output as it left the layer (the batch, or
                    # made by code between layers): its values are not known.
                    meta.untraced_inputs += 1

    def _post(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        name = self._names.get(id(module))
        if name is None:
            return
        calls = self._calls
        calls.depth = max(0, calls.depth - 1)
        if calls.depth == 0:
            with self._arm_lock:
                self._inflight = max(0, self._inflight - 1)
            calls.inference = False
        if calls.stack:
            calls.stack.pop()
        publish(module, output)
        if calls.depth == 0 and self._on_root_output is not None and (
                id(module) in self._roots or id(module) in self._entries):
            self._on_root_output(module, output)
        # Inference passes (validation under no_grad) are not training steps; and an
        # activation-checkpointing recompute (it runs inside backward) is a second run
        # of a forward already recorded, which would double the layer's calls. A
        # reentrant checkpoint's first pass runs under no_grad inside the training
        # forward: recorded, as it is the only pass of those layers outside backward.
        if not self.recording or not (calls.training or torch.is_grad_enabled()):
            return
        if torch._C._current_graph_task_id() != -1:
            self._recomputed(name, output)
            return
        meta = self.layers[name]
        if meta.order < 0:
            self._place(meta)
        self._reached = max(self._reached, meta.order)
        meta.calls += 1
        if meta.root != id(module):
            self._sub_calls[meta.root] = self._sub_calls.get(meta.root, 0) + 1
        buf = self._buffer()
        if buf is None or buf.closed:
            return  # closed meanwhile, by another thread (the end of the run)
        for t in _first_tensors(output):
            meta.output_dtypes.add(dtype_name(t.dtype))
            if not t.is_floating_point():
                continue
            why = unsummarizable(t)
            if why is not None:
                self._note_skipped(name, why, buf.step)
                continue
            if t.numel() == 0:
                buf.empty_outputs.add(name)
                continue
            # Inference tensors (made under torch.inference_mode) have no version counter.
            version = -1 if t.is_inference() else t._version
            entry = self._seen.get(t)
            # An in-place op (x.mul_(gamma)) returns the same tensor with new
            # values: only an unchanged version counter means "already seen".
            if entry is None or entry[2] != version:
                idx = buf.add(t)  # enters own_ops itself, when it needs to
                owners = [name]
                self._seen[t] = (idx, owners, version)
                if t.requires_grad and not _seed_of_backward(t):
                    self._hook_grad(t, owners, buf)
                    if id(module) in self._roots:
                        for owner in self._viewed_output(t):
                            self.layers[owner].model_output = True
                    elif t.grad_fn is not None:
                        self._out_nodes[t.grad_fn] = owners
            else:
                idx, owners, _ = entry
                if name in owners:
                    continue  # same tensor returned twice in one output
                owners.append(name)
                meta.passthrough_calls += 1
                if id(module) in self._roots:
                    for owner in owners:
                        self.layers[owner].model_output = True
            buf.assign(name, "act", idx)
        if calls.depth == 0:
            self._out_nodes.clear()

    def _viewed_output(self, t: torch.Tensor) -> list[str]:
        """The layers whose output the model's output ``t`` is a view or a cast of
        (``self.v(h).squeeze(-1)``, ``self.head(h).float()``): their gradient is the
        loss's own, as when the model returns their output itself (review 44b). Walks
        back through single-input view and cast nodes of the autograd graph, only."""
        node = t.grad_fn
        hops = 0
        while (node is not None and hops < MAX_VIEW_HOPS
               and type(node).__name__.rstrip("0123456789") in _VIEW_NODES):
            node = node.next_functions[0][0] if node.next_functions else None
            hops += 1
        if hops == 0 or node is None:
            return []
        return self._out_nodes.get(node, [])

    def _recomputed(self, name: str, output: Any) -> None:
        """A forward run again inside backward (activation checkpointing): its outputs
        were recorded in the first pass, so only their gradients are hooked here. A
        reentrant checkpoint's first pass runs under no_grad, and its outputs' gradients
        exist only on these recomputed tensors; a non-reentrant one's flow through the
        first pass's, and its recomputed outputs get none (their hooks never run)."""
        buf = self._buffer()
        if buf is None or buf.closed:
            return
        for t in _first_tensors(output):
            if (not t.is_floating_point() or not t.requires_grad or t.numel() == 0
                    or unsummarizable(t) is not None):
                continue
            entry = self._seen.get(t)
            if entry is None:
                owners = [name]
                self._seen[t] = (-1, owners, t._version)  # row -1: no activation filed
                self._hook_grad(t, owners, buf)
            elif name not in entry[1]:
                entry[1].append(name)  # a container passing its sublayer's output on

    def _on_grad(self, owners: list[str], buf: StepBuffer, grad: torch.Tensor) -> None:
        if buf.closed or grad is None or not grad.is_floating_point():
            return
        why = unsummarizable(grad)
        if why is not None:
            self._note_skipped(owners[0], why + " gradient", buf.step)
            return
        if grad.numel() == 0:
            return
        idx = buf.add(grad)
        for n in owners:
            buf.assign(n, "grad", idx)
        buf.note_backward(owners[0])

    # -- parameter gradients --------------------------------------------
    def summarize_param_grads(self, params: list[torch.Tensor], buf: StepBuffer,
                              grads: list[torch.Tensor | None] | None = None) -> None:
        """Summaries of the gradients of ``params`` (their ``.grad``, or ``grads``: what
        ``torch.autograd.grad`` returned for them), once per layer and step.

        One row per gradient, merged per layer on the host (as repeated calls are):
        concatenating a layer's gradients first would copy them all, a transient
        as large as the layer's parameters (an embedding's, on a GPU). The gradients
        are in hand all at once, so the small ones are filed together
        (``StepBuffer.add_many``).
        """
        by_layer: dict[str, list[torch.Tensor]] = {}
        for p, g in zip(params, grads if grads is not None else [p.grad for p in params],
                        strict=True):
            name = self.param_owner.get(id(p))
            if name is None or g is None or name in buf.param_grads_done:
                continue
            if not g.is_floating_point() or g.numel() == 0:
                continue
            if name in buf.empty_outputs and (name, "act") not in buf.assigned:
                continue  # it ran on nothing this step: its gradient is zeros by design
            why = unsummarizable(g)
            if why is not None:
                self._note_skipped(name, why + " gradient", buf.step)
                continue
            by_layer.setdefault(name, []).append(g)
        names = [name for name, grads in by_layer.items() for _ in grads]
        rows = buf.add_many([g for grads in by_layer.values() for g in grads])
        buf.param_grads_done.update(by_layer)
        for name, row in zip(names, rows, strict=True):
            buf.assign(name, "param_grad", row)

    def grads_after_unscale(self, params: list[torch.Tensor], found: list[torch.Tensor],
                            named: bool) -> tuple[torch.Tensor, torch.Tensor, list[str]] | None:
        """Whether the gradients ``scaler.step`` is about to apply went NaN/inf after the
        loop's own ``unscale_`` found none (``found``): noise or a custom clip applied to
        ``.grad`` in between, which the scaler no longer checks. (how many, the index of
        the first, each one's layer): device counts, see ``stats.nonfinite_since_check``;
        None when no parameter has a gradient it can read. A sparse gradient is read by
        its values. ``named``: each gradient's layer is wanted (a recorded step); else the
        list is empty, and the check is one pass over the parameters (every step pays it)."""
        owner = self.param_owner
        grads: list[torch.Tensor] = []
        names: list[str] = []
        for p in params:
            g = p.grad
            if g is None or not g.is_floating_point():
                continue
            if g.layout != torch.strided:
                if g.layout != torch.sparse_coo:
                    continue
                g = g._values()
            # Not a tensor subclass's (a DTensor's norm would be a collective).
            if not g.numel() or type(g) is not torch.Tensor:
                continue
            if named:
                name = owner.get(id(p))
                if name is None or unsummarizable(g) is not None:
                    continue
                names.append(name)
            grads.append(g)
        if not grads:
            return None
        if len({g.device for g in grads}) > 1:  # one run per device, in a stable order
            order = sorted(range(len(grads)), key=lambda i: str(grads[i].device))
            grads = [grads[i] for i in order]
            names = [names[i] for i in order] if named else names
        try:
            bad, first = nonfinite_since_check(grads, found)
        except (RuntimeError, NotImplementedError):
            return None  # a dtype _foreach_norm does not take (float8): no check, no harm
        return bad, first, names

    def low_precision_outputs(self) -> set[str]:
        return {d for m in self.layers.values() for d in m.output_dtypes
                if d in LOW_PRECISION_NAMES}
