"""Which models a watch watches: given ones, discovered ones, their names and parameters.

:class:`ModelSet` owns the watched root models by name prefix (the layer-name
prefix; "" while a single model is watched), the names the user's code gave
them, and the set of their parameters' ids. :class:`GlobalDiscovery` finds
models nobody passed to ``watch()`` (the ``diagnose`` CLI): a global forward
pre-hook sees the first call of every module with parameters, and a patch on
``OptimizedModule.__call__`` does the same for ``torch.compile``'d ones.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from amp_doctor.errors import AmpDoctorError
from amp_doctor.hooks.compiled import capturing
from amp_doctor.hooks.probes import run_eagerly_when_called_by_dynamo

__all__ = ["Models", "ModelSet", "GlobalDiscovery", "as_models", "unwrap",
           "compile_wrappers", "compiled_by_method", "variable_name", "is_parametrization",
           "same_architecture", "owning_model"]

Models = nn.Module | Iterable[nn.Module] | Mapping[str, nn.Module]
# Wrappers whose inner module is the user's model.
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "OptimizedModule")
# Frames searched for the variable a discovered model is bound to.
NAME_SEARCH_FRAMES = 40
# Containers (dicts, lists, ModuleDicts) searched one level deep, when no larger than this.
NAME_SEARCH_ITEMS = 64
# Submodules of a frame's module searched for the Sequential a slice was taken from.
SLICE_SEARCH_MODULES = 2000


# Containers that hold models but have no forward of their own: the loop calls what
# is inside them, so each member is a root model (named by its key or index).
_CONTAINERS = (nn.ModuleDict, nn.ModuleList)


def as_models(model: Models) -> dict[str, nn.Module]:
    if isinstance(model, _CONTAINERS) and len(model):
        model = dict(model.items()) if isinstance(model, nn.ModuleDict) else \
            {str(i): m for i, m in enumerate(model)}
    if isinstance(model, nn.Module):
        return {"": model}
    if isinstance(model, Mapping):
        out = dict(model)
    else:
        items = list(model)
        names = [type(m).__name__ for m in items]
        out = {}
        for i, (n, m) in enumerate(zip(names, items, strict=True)):
            out[n if names.count(n) == 1 else f"{n}{i}"] = m
    for k, m in out.items():
        if not isinstance(m, nn.Module):
            raise AmpDoctorError(
                f"watch() got a {type(m).__name__} for {k!r}, not a torch.nn.Module. "
                "Pass the model (or a list/dict of models) you call in the training loop."
            )
    return out


def compile_wrappers(model: nn.Module) -> list[nn.Module]:
    """The ``torch.compile`` wrappers (``OptimizedModule``) on the way to the user's module."""
    out: list[nn.Module] = []
    while True:
        name = type(model).__name__
        inner = getattr(model, "_orig_mod" if name == "OptimizedModule" else "module", None)
        if not isinstance(inner, nn.Module) or name not in _WRAPPERS:
            return out
        if name == "OptimizedModule":
            out.append(model)
        model = inner


def compiled_by_method(model: nn.Module) -> bool:
    """``model.compile()`` was called: its hooks run inside the compiled graph."""
    return getattr(model, "_compiled_call_impl", None) is not None


def is_parametrization(module: nn.Module) -> bool:
    """A ``torch.nn.utils.parametrize`` list (spectral_norm, weight_norm, orthogonal):
    part of the layer that owns it, never a model, though it is called outside any
    forward (once when registered, and whenever the user's code reads the weight)."""
    return isinstance(module, ParametrizationList)


def unwrap(model: nn.Module) -> nn.Module:
    # DDP/DataParallel/torch.compile wrappers: watch the user's module so
    # layer names carry no "module." / "_orig_mod." prefix.
    for attr in ("module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module) and type(model).__name__ in _WRAPPERS:
            return unwrap(inner)
    return model


def _user_locals() -> Iterator[tuple[str, Any]]:
    """(name, value) of the local variables of the user's frames on the stack, innermost
    first, up to :data:`NAME_SEARCH_FRAMES` frames; torch's and amp-doctor's own frames
    are left out, and so are names starting with ``_``."""
    # amp_doctor/ as a whole (this file is in amp_doctor/hooks/): the watch calls from there.
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frame: Any = sys._getframe(2)  # the caller of the function iterating over this
    for _ in range(NAME_SEARCH_FRAMES):
        if frame is None:
            return
        if not frame.f_code.co_filename.startswith(skip):
            code = frame.f_code
            first = code.co_varnames[0] if code.co_argcount else None
            for name, value in frame.f_locals.items():
                if name == first and _method_of(value, code):
                    yield "self", value  # however the method names it (``def forward(s, x)``)
                elif not name.startswith("_"):
                    yield name, value
        frame = frame.f_back


def _method_of(value: Any, code: Any) -> bool:
    """``code`` is a method of ``value``'s class, of which ``value`` is the instance."""
    if not isinstance(value, nn.Module):
        return False
    fn = getattr(type(value), code.co_name, None)
    return getattr(fn, "__code__", None) is code


def variable_name(module: nn.Module) -> str | None:
    """The name the user's code binds ``module`` to ("gen", "disc"), for layer prefixes."""
    for name, value in _user_locals():
        if name == "self":
            continue
        if value is module:
            return name
        key = _key_in(value, module)
        if key is not None:
            return f"{name}.{key}"
    return None


def slice_source(module: nn.Module) -> tuple[nn.Module, str] | None:
    """The container ``module`` was sliced from, and its name: ``feat[:k]`` makes a new
    ``Sequential`` on every call (a perceptual loss over a frozen network's first
    layers), which must not be a new model each time. The user's frames are searched
    for a module of the same class whose children include all of ``module``'s."""
    kids = {id(m) for m in module._modules.values() if m is not None}
    if not kids:
        return None
    for name, value in _user_locals():
        if not isinstance(value, nn.Module) or value is module:
            continue
        for i, (path, sub) in enumerate(value.named_modules()):
            if i >= SLICE_SEARCH_MODULES:
                break
            if (sub is not module and type(sub) is type(module)
                    and kids <= {id(m) for m in sub._modules.values()}):
                if name == "self":  # the loss module's own part: named by its path
                    return sub, path or type(sub).__name__
                return sub, f"{name}.{path}" if path else name
    return None


def owning_model(module: nn.Module, wanted: Callable[[nn.Module], bool]
                 ) -> tuple[nn.Module, str | None] | None:
    """The model ``module`` is part of, and its name, when the loop calls the part itself:
    ``model.actor(obs)`` runs ``self.pi(self.trunk(obs))``, and the model's own forward
    never runs (review 60a: its layers were named ``Linear1``, ``Sequential.0``, which
    match nothing in the user's code). The user's frames are searched (``self`` too) for
    a module that is ``wanted`` and holds ``module``; the outermost one is the model. A
    ``ModuleDict`` or ``ModuleList`` (no forward: its members are the models) is not one."""
    best: tuple[int, nn.Module] | None = None
    seen: set[int] = set()
    for _, value in _user_locals():
        if (not isinstance(value, nn.Module) or value is module or id(value) in seen
                or isinstance(value, _CONTAINERS)):
            continue
        seen.add(id(value))
        n = 0
        holds = False
        for sub in value.modules():
            n += 1
            if sub is module:
                holds = True
            if n >= SLICE_SEARCH_MODULES:
                break
        if holds and (best is None or n > best[0]) and wanted(value):
            best = (n, value)
    if best is None:
        return None
    return best[1], variable_name(best[1])


def _key_in(holder: Any, module: nn.Module) -> str | None:
    """``module``'s key in a small dict, ``nn.ModuleDict``, list or ``nn.ModuleList`` (the
    parts a script calls as ``parts["encoder"](x)``), or None."""
    kind = type(holder)  # not isinstance: a proxy's __class__ may run arbitrary code
    if issubclass(kind, dict | nn.ModuleDict) and len(holder) <= NAME_SEARCH_ITEMS:
        return next((str(k) for k, v in holder.items() if v is module), None)
    if issubclass(kind, list | tuple | nn.ModuleList) and len(holder) <= NAME_SEARCH_ITEMS:
        return next((str(i) for i, v in enumerate(holder) if v is module), None)
    return None


def same_architecture(a: nn.Module, b: nn.Module) -> bool:
    """``b`` has ``a``'s architecture: the same class, submodules (paths and classes) and
    parameters (names and shapes), as a model reloaded from ``a``'s full checkpoint
    (``torch.load(path, weights_only=False)``) or ``copy.deepcopy(a)`` has. Values and
    dtypes may differ."""
    if type(a) is not type(b):
        return False
    mods_a = [(q, type(m)) for q, m in a.named_modules()]
    mods_b = [(q, type(m)) for q, m in b.named_modules()]
    if mods_a != mods_b:
        return False
    return ([(n, p.shape) for n, p in a.named_parameters()]
            == [(n, p.shape) for n, p in b.named_parameters()])


def _free_name(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    i = 1
    while f"{name}{i}" in taken:
        i += 1
    return f"{name}{i}"


class Added(NamedTuple):
    prefix: str
    # The first model, unprefixed while it was alone, and the prefix it gets now.
    renamed: tuple[nn.Module, str] | None


class ModelSet:
    """The watched root models by prefix, and their parameters."""

    def __init__(self, given: Mapping[str, nn.Module]) -> None:
        self.given = dict(given)
        self.models = {k: unwrap(m) for k, m in self.given.items()}
        self._given_names: dict[int, str] = {}
        self._owned: set[int] = set()
        self._owned_at_step = -1

    def add(self, model: nn.Module, name: str) -> Added:
        """Watch one more (unwrapped) root model. With several, each gets a prefix."""
        self._given_names[id(model)] = name
        renamed = None
        if not self.models:
            prefix = ""
        else:
            taken = set(self.models)
            if "" in self.models:
                # The first model was unprefixed while it was alone; name it now.
                first = self.models.pop("")
                first_name = _free_name(
                    self._given_names.get(id(first), type(first).__name__), taken | {name})
                renamed = (first, first_name)
                self.models[first_name] = first
                taken = set(self.models)
            prefix = _free_name(name, taken)
        self.models[prefix] = model
        self._owned.update(id(p) for p in model.parameters())
        return Added(prefix, renamed)

    def replaced(self, model: nn.Module, name: str | None,
                 idle: Callable[[nn.Module], bool]) -> str | None:
        """The prefix of the watched root whose place ``model`` takes, or None (a new
        model): a root the user's code called by the same ``name``, of the same
        architecture, that is ``idle`` (it trained before, but not in this step). That is
        one model whose object the script replaced mid-run: ``model =
        torch.load(path, weights_only=False)`` to resume, ``model = copy.deepcopy(model)``
        (review 56a: named as a second model, ``model1``, whose boundaries shifted every
        later step by one). ``name`` None: any name (an in-code watch, which knows no
        variable the loop called its model by; see :mod:`amp_doctor.hooks.replacement`)."""
        for prefix, old in self.models.items():
            if ((name is None or self._given_names.get(id(old)) == name) and idle(old)
                    and same_architecture(old, model)):
                return prefix
        return None

    def replace(self, prefix: str, model: nn.Module, name: str) -> nn.Module:
        """``model`` is the root at ``prefix`` from now on (see :meth:`replaced`); returns
        the root it replaces."""
        old = self.models[prefix]
        self.models[prefix] = model
        self._given_names.pop(id(old), None)
        self._given_names[id(model)] = name
        self.given = {k: model if unwrap(g) is old else g for k, g in self.given.items()}
        self.scan_params()
        return old

    def remove(self, model: nn.Module) -> None:
        """Watch ``model`` no longer as a root (a model it is part of takes it in)."""
        self.models = {k: m for k, m in self.models.items() if m is not model}
        self.scan_params()

    def label(self) -> str:
        """The model's name in a message about the whole model."""
        root = next(iter(self.models), "")
        return root or (type(self.models[root]).__name__ if self.models else "the model")

    def names(self) -> list[str]:
        return [k or type(m).__name__ for k, m in self.models.items()]

    def scan_params(self) -> None:
        self._owned = {id(q) for m in self.models.values() for q in m.parameters()}

    def owns(self, p: torch.Tensor, step: int, rescan: Callable[[], None]) -> bool:
        """A parameter of a watched model; rescanned (once a step) on a miss, since
        ``load_state_dict(assign=True)`` or ``to_empty`` swap parameter objects.
        ``rescan`` is told so that the layers' parameter lists follow."""
        if id(p) in self._owned:
            return True
        if self._owned_at_step != step and self.models:
            self._owned_at_step = step
            self.scan_params()
            rescan()
        return id(p) in self._owned

    def first_grad(self) -> torch.Tensor | None:
        """A watched parameter that has a gradient (the first one found)."""
        for m in self.models.values():
            for q in m.parameters():
                if q.grad is not None:
                    return q
        return None


class GlobalDiscovery:
    """Finds the models a loop calls, for a watch started without them.

    ``wanted(module)`` says whether a module is a new root model (not watched,
    with parameters); ``found(model, name, args, called)`` adds it, ``args`` being the
    call's inputs when the call is already under way (None: before the call) and
    ``called`` the part of the model being called (None: the model itself, see
    :func:`owning_model`), and returns the inputs that call should take instead, or None.
    """

    def __init__(self, wanted: Callable[[nn.Module], bool],
                 found: Callable[[nn.Module, str | None, tuple[Any, ...] | None,
                                  nn.Module | None], tuple[Any, ...] | None],
                 owners: bool = False) -> None:
        """``owners``: a module called by the loop may be part of a model it holds (see
        :func:`owning_model`); otherwise each module called is a model of its own."""
        self._wanted = wanted
        self._found = found
        self._owners = owners
        self._handles: list[Any] = []
        self._depth = 0
        self._unpatch: Callable[[], None] | None = None
        self._stopped = False

    def start(self) -> None:
        run_eagerly_when_called_by_dynamo(self._pre, self._post)
        self._register()
        self._patch_compiled_call()

    def stop(self) -> None:
        """Remove the hooks and the patch; each removal independent of the others."""
        self._stopped = True
        removers: list[Callable[[], Any]] = [h.remove for h in self._handles]
        self._handles = []
        if self._unpatch is not None:
            removers.append(self._unpatch)
            self._unpatch = None
        for fn in removers:
            try:
                fn()
            except Exception:  # pragma: no cover - best effort on teardown
                pass

    def _register(self) -> None:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._handles = [
            register_module_forward_pre_hook(self._pre),  # type: ignore[arg-type]
            register_module_forward_hook(self._post, always_call=True),
        ]

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if capturing():
            return None  # traced into a graph: do nothing, so the graph holds only the user's ops
        self._depth += 1
        if self._depth != 1 or self._stopped:
            return None
        if not self._wanted(module):
            return None  # loss functions and other parameter-free callables are not models
        if isinstance(module, nn.Sequential | nn.ModuleList):
            # (Before its own name: `g1 = gen[:2]` in the loop is a new slice each time.)
            source = slice_source(module)
            if source is not None:
                # A slice's layers are its source's: watch the source once (its layers'
                # own hooks then see every slice's call), not each new slice.
                if self._wanted(source[0]):
                    self._found(source[0], source[1], args, None)
                return None
        # This call's own pre-hooks were collected before we added ours: pass its inputs
        # (a global pre-hook's return value replaces them).
        owner = owning_model(module, self._wanted) if self._owners else None
        if owner is not None:
            return self._found(owner[0], owner[1], args, module)
        return self._found(module, variable_name(module), args, None)

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if capturing():
            return
        self._depth = max(0, self._depth - 1)

    def _patch_compiled_call(self) -> None:
        """Discovery without global hooks around a ``torch.compile``'d module's call.

        ``OptimizedModule.__call__`` warns on every call while any global module
        hook exists, and dynamo would trace ours. So the call itself discovers the
        model, and the global hooks are off while it runs (the model's own root
        hooks still run, eagerly, around the compiled forward).
        """
        try:
            from torch._dynamo.eval_frame import OptimizedModule
        except ImportError:  # pragma: no cover - torch without dynamo
            return
        orig: Callable[..., Any] = OptimizedModule.__call__
        ref = weakref.ref(self)

        def __call__(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            disc = ref()
            if disc is None or not disc._handles or torch.compiler.is_compiling():
                return orig(module, *args, **kwargs)
            handles, disc._handles = disc._handles, []
            for h in handles:
                h.remove()
            try:
                if disc._depth == 0 and not disc._stopped and disc._wanted(module):
                    # Hooked before the call: its root hooks see this very call.
                    disc._found(module, variable_name(module), None, None)
                return orig(module, *args, **kwargs)
            finally:
                if not disc._stopped and disc._unpatch is not None:
                    disc._register()

        __call__.__wrapped__ = orig  # type: ignore[attr-defined]
        OptimizedModule.__call__ = __call__  # type: ignore[method-assign,assignment]

        def unpatch() -> None:
            if OptimizedModule.__call__ is __call__:
                OptimizedModule.__call__ = orig  # type: ignore[method-assign]

        self._unpatch = unpatch
