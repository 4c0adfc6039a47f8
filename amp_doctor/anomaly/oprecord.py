"""The op-level search's recorder: every aten op of a searched step, summarised on the device.

Runs inside the dispatch mode (:mod:`amp_doctor.anomaly.dispatchstack`), on every op, so
it is the hot path of anomaly mode: each floating output gets one ``aminmax``
reduction (kept on the device), each floating input is found in a per-step
cache of earlier outputs, and each op becomes an :class:`~amp_doctor.anomaly.origins.OpEntry`
in the current window, for :func:`~amp_doctor.anomaly.origins.origin_flags` to judge.

Backward ops are mapped to their forward module and op through the autograd
node running them (``torch._C._current_autograd_node()``): each forward op's
node is tagged in its ``metadata`` with the module, the op and the user's
frames.
"""

from __future__ import annotations

import fnmatch
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, cast

import torch

from amp_doctor.anomaly.origins import ModuleCall, OpEntry, OpWindow, Summary
from amp_doctor.anomaly.userframes import Frame, UserFrames
from amp_doctor.devicework import iter_tensors, own_ops
from amp_doctor.dtypes import dtype_name
from amp_doctor.errors import NonFiniteError
from amp_doctor.hooks.compiled import capturing_eagerly
from amp_doctor.hooks.tensorkinds import unsummarizable
from amp_doctor.opnames import DIVISION_OPS

__all__ = ["OpRecorder", "OpTag", "summarizable"]

_TAG = "amp_doctor"
# The autograd node of torch.utils.checkpoint(use_reentrant=True): it reruns the forward.
_REENTRANT_RECOMPUTE = "CheckpointFunctionBackward"
# The op_dtypes key of the ops that ran outside every watched module.
_OUTSIDE = "<outside>"
# Ops whose output is garbage or constant by design: never an origin.
_UNINITIALIZED = frozenset({
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.empty_permuted",
})
# In-place ops that overwrite their first argument: its old values are not an input.
_OVERWRITES = frozenset({
    "aten.copy_", "aten.fill_", "aten.zero_", "aten.normal_", "aten.uniform_",
    "aten.bernoulli_", "aten.random_", "aten.exponential_", "aten.set_",
})


class OpTag(NamedTuple):
    """What a forward op's autograd node is tagged with, for its backward ops."""

    module: str | None
    op: str | None
    frames: tuple[Frame, ...]


_UNTAGGED = OpTag(None, None, ())


class _Cached(NamedTuple):
    """A tensor's summary, valid while the tensor lives with the same version."""

    summary: Summary
    version: int
    ref: weakref.ref[torch.Tensor]
    window: OpWindow
    pos: int  # in ``window.sums``

    def valid_for(self, t: torch.Tensor) -> bool:
        return self.ref() is t and not t.is_inference() and self.version == t._version


# autocast's cast of a float32 input to the low-precision format.
_CAST = "aten._to_copy"


class _PreOp(NamedTuple):
    """What :meth:`OpRecorder._before` learnt of an op's inputs, for :meth:`_after`."""

    name: str
    ins: list[int]
    is_view: bool
    allowed: bool  # never an origin (an infinity came in as a constant; uninitialized)
    args: tuple[Any, ...] | None  # a view's arguments: it shares its base's summary
    step: int
    # A division's input dtypes: a float16 denominator of exactly 0 may be an underflow
    # (eps=1e-12 is 0 there), a float32 one is not.
    in_dtypes: tuple[str, ...] = ()
    # A cast of a parameter (autocast's of a float32 weight or bias): its values beyond
    # the format are the layer's own, not the data's.
    casts_parameter: bool = False
    # An input requires grad (with grad mode on): the op is on the autograd graph. One
    # off it (T5's relative-position buckets: log of integer distances) passes no
    # gradient back, so a non-finite value it makes that is dropped harms nothing.
    on_graph: bool = True


class _ToTag(NamedTuple):
    """A forward op's outputs, whose autograd node is tagged once the op returned."""

    outs: list[torch.Tensor]
    tag: OpTag


def _leaves(obj: Any) -> Iterator[Any]:
    # Op arguments are flat, with the odd list (cat, stack, foreach ops).
    for a in obj:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def summarizable(t: torch.Tensor) -> bool:
    """A floating or complex, non-empty tensor that the probes could summarise too (not
    sparse, meta, float8, nor wrapped by ``vmap``/``grad``, whose summary would be a
    batched tensor that fails once the transform has returned): one ``aminmax``
    summarises it (a complex one over its real and imaginary parts). Complex values
    count: an FFT's inverse that receives an inf must not pass for its origin."""
    return ((t.is_floating_point() or t.is_complex()) and t.numel() > 0
            and unsummarizable(t) is None)


class OpRecorder:
    """Summarises each op's floating inputs and outputs into the current :class:`OpWindow`.

    ``module_of()`` names the innermost watched module running; ``on_entry()`` is
    called after each new entry (the owner may check the window then);
    ``on_error`` gets amp-doctor's own failures, which never reach the user's run.
    """

    def __init__(
        self,
        module_of: Callable[[], str | None],
        step_of: Callable[[], int],
        allow: Iterable[str],
        on_entry: Callable[[], None],
        on_error: Callable[[Exception], None],
        training_forward: Callable[[], bool] = lambda: False,
        recomputing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._module_of = module_of
        self._training_forward = training_forward
        self._recomputing = recomputing
        self._step_of = step_of
        self._allow = tuple(allow)
        self._allow_cache: dict[str, bool] = {}
        self._on_entry = on_entry
        self._on_error = on_error
        self.frames = UserFrames()
        self.window = OpWindow()
        # id(tensor) -> summary: a plain dict is several times cheaper per op than
        # WeakIdKeyDictionary; the weakref guards against a reused id, and the dict is
        # emptied at every step boundary, so it stays small.
        self._cache: dict[int, _Cached] = {}
        self._cache_step = -1
        self._to_tag: _ToTag | None = None
        self._names: dict[Any, str] = {}
        self._op_dtypes: dict[str, dict[str, dict[str, int]]] = {}

    # -- the window ----------------------------------------------------------------
    def take(self) -> OpWindow:
        """The window so far; a new one starts."""
        self.tag_previous()
        w, self.window = self.window, OpWindow()
        return w

    def clear(self) -> None:
        """Drop every tensor reference."""
        self.window = OpWindow()
        self._cache = {}
        self._to_tag = None

    def op_dtypes(self) -> dict[str, dict[str, dict[str, int]]]:
        return {m: {op: dict(d) for op, d in ops.items()} for m, ops in self._op_dtypes.items()}

    def saw_module_ops(self) -> bool:
        """Whether any searched forward op ran inside a watched module (not so when the
        model runs compiled: its ops are not dispatched one by one)."""
        return any(m != _OUTSIDE for m in self._op_dtypes)

    def add(self, entry: OpEntry) -> None:
        self.window.entries.append(entry)
        self._on_entry()

    def module_end(self, name: str, output: Any) -> None:
        """A watched module's call ended: its output's summaries, for the report."""
        outs = []
        for t in iter_tensors(output):
            e = self._cache.get(id(t))
            if e is not None and e.valid_for(t):
                outs.append(self._index(e))
        if outs:
            self.window.calls.append(ModuleCall(name, len(self.window.entries), outs))

    # -- per op --------------------------------------------------------------------
    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._to_tag is not None:
            self.tag_previous()
        if own_ops.active() or capturing_eagerly() or (
                not torch.is_grad_enabled() and torch._C._current_autograd_node() is None
                and not self._training_forward()):
            # amp-doctor's own work; torch.jit.trace or a fake/proxy mode running them
            # (its graph must hold the user's alone; fake tensors have no values); or
            # neither a training forward nor backward:
            # optimizer updates, GradScaler's unscale, evaluation under no_grad. (A
            # no_grad block inside a training forward, such as a reentrant checkpoint's
            # first pass, is the forward: checked.)
            return func(*args, **kwargs)
        try:
            pre = self._before(func, args, kwargs)
        except Exception as e:  # our bookkeeping must never break the user's run
            self._on_error(e)
            pre = None
        out = func(*args, **kwargs)
        if pre is not None:
            try:
                self._after(pre, out)
            except NonFiniteError:
                raise
            except Exception as e:
                self._on_error(e)
        return out

    def _before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _PreOp:
        step = self._step_of()
        if step != self._cache_step:
            # Parameters changed in the optimizer step; last step's tensors are gone.
            self._cache = {}
            self._cache_step = step
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func.overloadpacket)
        if func.is_view:
            return _PreOp(name, [], True, False, args, step)
        constant_inf = False
        on_graph = False
        ins: list[int] = []
        leaves: Iterable[Any] = _leaves(args)
        if name in _OVERWRITES:
            leaves = list(leaves)[1:]
        for a in leaves:
            if isinstance(a, torch.Tensor):
                on_graph = on_graph or a.requires_grad
                if summarizable(a):
                    ins.append(self.summary(a))
            elif isinstance(a, float) and not math.isfinite(a):
                constant_inf = True
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                on_graph = on_graph or a.requires_grad
            if isinstance(a, torch.Tensor) and summarizable(a):
                ins.append(self.summary(a))
            elif isinstance(a, float) and not math.isfinite(a):
                constant_inf = True
        allowed = constant_inf or name in _UNINITIALIZED
        in_dtypes = (tuple(dtype_name(a.dtype) for a in args if isinstance(a, torch.Tensor))
                     if name in DIVISION_OPS else ())
        param = name == _CAST and bool(args) and isinstance(args[0], torch.nn.Parameter)
        return _PreOp(name, ins, False, allowed, None, step, in_dtypes, param,
                      on_graph and torch.is_grad_enabled())

    def _after(self, pre: _PreOp, out: Any) -> None:
        name = pre.name
        outs = [t for t in (out if isinstance(out, (list, tuple)) else (out,))
                if isinstance(t, torch.Tensor)]
        node = torch._C._current_autograd_node()
        # A checkpoint recomputes its layers' forward inside backward: a reentrant one in
        # its own node, a non-reentrant one in the node that unpacks a saved tensor (an
        # AddmmBackward0, review 44a). Those are the layers' forward ops, tagged as such
        # for their own backward, not that node's. (The module stack first: it is empty in
        # a plain backward, so no op there pays for the node's name.)
        forward = node is None or (self._module_of() is not None and (
            self._recomputing() or node.name() == _REENTRANT_RECOMPUTE))
        if pre.is_view:
            self._after_view(pre, outs, forward)
            return
        summaries: list[int] = []
        dtype = ""
        for t in outs:
            if not summarizable(t) or name in _UNINITIALIZED:
                continue
            summaries.append(self._summarize(t))
            dtype = dtype or dtype_name(t.dtype)
        if forward:
            module = self._module_of()
            frames = self.frames.capture(2)
            if dtype:
                per = self._op_dtypes.setdefault(module or _OUTSIDE, {}).setdefault(name, {})
                per[dtype] = per.get(dtype, 0) + 1
            if torch.is_grad_enabled():
                self._to_tag = _ToTag(outs, OpTag(module, name, frames))
            kind, fwd_op, node_name = "forward", None, None
        else:
            tag = cast(dict[str, Any], node.metadata).get(_TAG, _UNTAGGED)
            module, fwd_op, frames = tag
            kind, node_name = "backward", node.name()
        if not summaries or pre.allowed or self._allowed(name, module):
            return
        self.add(OpEntry(kind=kind, op=name, module=module, step=pre.step, dtype=dtype,
                         outs=summaries, ins=pre.ins, frames=frames, node=node_name,
                         forward_op=fwd_op, in_dtypes=pre.in_dtypes,
                         casts_parameter=pre.casts_parameter, on_graph=pre.on_graph))

    def _after_view(self, pre: _PreOp, outs: list[torch.Tensor], forward: bool) -> None:
        # Same values as the viewed tensor: share its summary, record nothing. A part of it
        # (q, k and v split from one qkv) gets its own range when an op reads it: the
        # report gives each input's range.
        args = pre.args
        base = args[0] if args and isinstance(args[0], torch.Tensor) else None
        known = self._cache.get(id(base)) if base is not None else None
        if base is not None and known is not None and known.valid_for(base):
            for t in outs:
                if not t.is_inference() and t.numel() == base.numel():
                    self._cache[id(t)] = known._replace(version=t._version, ref=weakref.ref(t))
        if forward and torch.is_grad_enabled():
            self._to_tag = _ToTag(outs, OpTag(self._module_of(), pre.name, ()))

    # -- summaries -----------------------------------------------------------------
    def _summarize(self, t: torch.Tensor) -> int:
        """Reduce ``t`` to (min, max) on its device; its index in the window's summaries."""
        w = self.window
        s = torch.aminmax(torch.view_as_real(t.resolve_conj()) if t.is_complex() else t)
        summary = Summary(s[0], s[1])
        w.sums.append(summary)
        i = len(w.sums) - 1
        if not t.is_inference():
            self._cache[id(t)] = _Cached(summary, t._version, weakref.ref(t), w, i)
        return i

    def _index(self, e: _Cached) -> int:
        """The index of a cached summary in the current window (added once if it is new)."""
        w = self.window
        if e.window is w:
            return e.pos
        w.sums.append(e.summary)
        return len(w.sums) - 1

    def summary(self, t: torch.Tensor) -> int:
        """``t``'s summary index in the current window, reduced only if not known yet."""
        e = self._cache.get(id(t))
        if e is not None and e.valid_for(t):
            return self._index(e)
        return self._summarize(t)

    def tag_previous(self) -> None:
        """Tag the last forward op's autograd node (made once the op returned)."""
        pending, self._to_tag = self._to_tag, None
        if pending is None:
            return
        for t in pending.outs:
            gf = t.grad_fn
            if gf is not None:
                md = cast(dict[str, Any], gf.metadata)
                if _TAG not in md:
                    md[_TAG] = pending.tag

    def _allowed(self, op: str, module: str | None) -> bool:
        if not self._allow:
            return False
        key = f"{op}|{module}"
        hit = self._allow_cache.get(key)
        if hit is None:
            names = [op, op.removeprefix("aten.")] + ([module] if module else [])
            hit = any(fnmatch.fnmatchcase(n, pat) for n in names for pat in self._allow)
            self._allow_cache[key] = hit
        return hit
