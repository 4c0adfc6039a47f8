"""Anomaly mode: the first op that produced a NaN/Inf, forward or backward.

``torch.autograd.detect_anomaly`` is backward-only, captures a Python
traceback for every autograd node, aborts the run and names a node rather
than a module. A forward hook only sees module outputs, so an op that
overflows *inside* a module whose output stays finite (a cube in a tanh-GELU)
goes unseen until its backward turns NaN.

This mode instead runs a private :class:`TorchDispatchMode`. It sees every
aten op after autocast has cast its inputs, backward ops included, and for
each one keeps a two-number summary (min, max) of every floating output.
Those two numbers tell NaN (both NaN), +inf (max), -inf (min) and the range,
from a single reduction. A summary is cached per tensor (weakly, keyed by
identity and version), so an op's inputs are almost always looked up rather
than reduced again.

An op is an *origin* (a producer, not a propagator) when an output is
non-finite while every floating input was finite, and no infinity came in as
a constant (``masked_fill(mask, -inf)``, ``full(..., -inf)``, ``where``):
intentional infinities, and the ``max``/``softmax`` that consume them, are
therefore never reported. The user can allow more ops or modules by name.

Host syncs: none per op. The summaries stay on the device; at a recorded
step boundary one device scalar (how many entries were flagged) rides along
in the step's single host copy (:meth:`AnomalyMode.flagged_count`). Only when
it is non-zero, an abnormal step, a second copy fetches the details. In
``on_nonfinite="raise"`` mode every op is checked at once, one sync per op,
so that the exception is raised where the NaN/Inf appears.

Backward ops are mapped to their forward module and op through the autograd
node running them (``torch._C._current_autograd_node()``): each forward op's
node is tagged in its ``metadata`` with the module, the op and the user's
frames. Torch's own anomaly mode is not switched on (its per-node traceback
is what makes it slow); its flags are saved and restored all the same.
"""

from __future__ import annotations

import fnmatch
import math
import os
import sys
import sysconfig
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils.hooks import RemovableHandle

from .dtypes import dtype_name
from .errors import AmpDoctorError, NonFiniteError
from .recorder import count_sync
from .records import Event

__all__ = [
    "AnomalyMode",
    "own_ops",
    "MAX_PENDING_ENTRIES",
    "MAX_ORIGINS_PER_CHECK",
    "MAX_USER_FRAMES",
]

# Bounded memory between recorded steps: past this many pending op entries
# the check runs early (one extra sync) instead of growing without limit.
MAX_PENDING_ENTRIES = 200_000
# On an abnormal step, report at most this many distinct (kind, module, op) origins.
MAX_ORIGINS_PER_CHECK = 8
# The user's own frames kept per op, innermost first.
MAX_USER_FRAMES = 4
# Events kept per (kind, module, op); later ones are only counted.
MAX_EVENTS_PER_KEY = 50

_TAG = "amp_doctor"
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

_SKIP_DIRS = tuple(
    os.path.dirname(p) + os.sep
    for p in (torch.__file__, __file__)
) + tuple(
    d + os.sep for d in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    if "site-packages" + os.sep + "click" + os.sep in filename:
        return False
    return not filename.startswith(_SKIP_DIRS)


# (min, max) of a tensor: two 0-d device tensors from one aminmax reduction.
_Summary = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class _Entry:
    """One op call (or one root-model input), waiting for the next check."""

    kind: str  # "forward" | "backward" | "input"
    op: str | None
    module: str | None
    step: int
    dtype: str
    outs: list[int]  # indices into the window's summaries: each floating output
    ins: list[int]  # and each floating input
    frames: tuple[tuple[str, int, str], ...]
    node: str | None = None
    forward_op: str | None = None


@dataclass(slots=True)
class _ModuleCall:
    name: str
    end: int  # index of the first entry after this call
    outs: list[int]


@dataclass
class _Pending:
    """One window of op entries between two checks.

    Each tensor's summary is stored once in ``sums`` and referred to by index, so an
    op's inputs (earlier ops' outputs) cost nothing more to keep, or to check.
    """

    entries: list[_Entry] = field(default_factory=list)
    calls: list[_ModuleCall] = field(default_factory=list)
    sums: list[_Summary] = field(default_factory=list)
    # Computed at the boundary, on the device: per-entry "origin" flags, and the
    # summaries stacked as [n, 2] (min, max) float32 rows.
    flags: torch.Tensor | None = None
    rows: torch.Tensor | None = None


class _NonFiniteMode(TorchDispatchMode):
    """Private: hands every aten op to its owner."""

    def __init__(self, owner: AnomalyMode) -> None:
        super().__init__()
        self._owner = owner

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return self._owner._on_op(func, args, kwargs or {})


class _OwnOps:
    """``with own_ops:`` marks amp-doctor's own tensor work (stats, the step's host
    copy, the scaler observer), which the dispatch mode must neither check nor count.

    A plain counter, not a thread-local: on CUDA the backward pass runs on another
    thread while the caller waits, and amp-doctor's gradient hooks run there.
    """

    depth = 0

    def __enter__(self) -> None:
        _OwnOps.depth += 1

    def __exit__(self, *exc: object) -> None:
        _OwnOps.depth -= 1


own_ops = _OwnOps()


def _leaves(obj: Any) -> Iterator[Any]:
    # Op arguments are flat, with the odd list (cat, stack, foreach ops).
    for a in obj:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _summarizable(t: torch.Tensor) -> bool:
    return (t.is_floating_point() and t.layout is torch.strided and not t.is_meta
            and t.numel() > 0)


class AnomalyMode:
    """Finds the first op whose output went non-finite from finite inputs.

    Owned by :class:`~amp_doctor.watch.Watch`; ``start``/``stop`` install and
    remove everything (the dispatch mode, one global module hook, the tags
    on autograd nodes are plain dict entries that die with the graph).
    """

    def __init__(
        self,
        current_module: Callable[[], str | None],
        step_of: Callable[[], int],
        mode: str = "record",
        allow: Iterable[str] = (),
        module_name: Callable[[nn.Module], str | None] | None = None,
    ) -> None:
        self._current_module = current_module
        self._module_name = module_name
        self._step_of = step_of
        self._raise = mode == "raise"
        self._allow = tuple(allow)
        self._allow_cache: dict[str | None, bool] = {}
        self._mode: _NonFiniteMode | None = None
        self._handle: RemovableHandle | None = None
        self._opt_handles: list[RemovableHandle] = []
        self._suspended = False
        self._saved_anomaly: tuple[bool, bool] | None = None
        # id(tensor) -> (summary, version, weakref): a plain dict is several times cheaper
        # per op than WeakIdKeyDictionary; the weakref guards against a reused id, and
        # the dict is emptied at every step boundary, so it stays small.
        self._cache: dict[int, tuple[_Summary, int, weakref.ref[torch.Tensor], _Pending, int]] = {}
        self._cache_step = -1
        self._pending = _Pending()
        self._to_tag: tuple[list[torch.Tensor], tuple[Any, ...]] | None = None
        self._names: dict[Any, str] = {}
        self._user_code: dict[Any, bool] = {}
        self._op_dtypes: dict[str, dict[str, dict[str, int]]] = {}
        self._events: dict[tuple[str, str | None, str | None], list[Event]] = {}
        self._counts: dict[tuple[str, str | None, str | None], int] = {}
        self._internal_error: str | None = None
        self.checks = 0

    # -- lifecycle -------------------------------------------------------------
    # Dispatch modes form a stack that only unwinds from the top: two anomaly
    # watches closed out of order would pop each other's mode.
    _active: AnomalyMode | None = None

    def start(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook

        if AnomalyMode._active is not None:
            raise AmpDoctorError(
                "only one watch(..., anomaly=True) can run at a time; close the other one "
                "first, or watch several models with one call: watch([model_a, model_b], "
                "anomaly=True).")
        AnomalyMode._active = self
        self._saved_anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self._handle = register_module_forward_hook(self._module_post, always_call=True)
        self._opt_handles = [register_optimizer_step_pre_hook(self._suspend),
                             register_optimizer_step_post_hook(self._resume)]
        self._mode = _NonFiniteMode(self)
        self._mode.__enter__()

    def stop(self) -> None:
        """Remove the mode and the hook, check what is pending, drop every tensor reference."""
        try:
            if self._mode is not None:
                mode, self._mode = self._mode, None
                if not self._suspended:
                    mode.__exit__(None, None, None)
        finally:
            self._suspended = False
            if AnomalyMode._active is self:
                AnomalyMode._active = None
            if self._handle is not None:
                self._handle.remove()
                self._handle = None
            for h in self._opt_handles:
                h.remove()
            self._opt_handles = []
            if self._saved_anomaly is not None:
                torch.autograd.set_detect_anomaly(*self._saved_anomaly)
                self._saved_anomaly = None
            self._tag_previous()
            try:
                self.check_now()
            finally:
                self._pending = _Pending()
                self._cache = {}
                self._to_tag = None

    # An optimizer step runs without grad, so the mode only passes its ops
    # through; but a Python dispatch mode costs a call per op, and an Adam step
    # is half the ops of a small model's training step. Leave the stack while
    # it runs, if ours is the innermost mode (the stack only unwinds from the
    # top); a step that raised is resumed from at the next root forward.
    def _suspend(self, *_: Any) -> None:
        if (self._mode is not None and not self._suspended
                and _get_current_dispatch_mode() is self._mode):
            self._tag_previous()
            self._mode.__exit__(None, None, None)
            self._suspended = True

    def _resume(self, *_: Any) -> None:
        if self._suspended and self._mode is not None:
            self._suspended = False
            self._mode.__enter__()

    # -- results ---------------------------------------------------------------
    def op_dtypes(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per layer: each forward aten op and the dtypes its outputs had, with counts."""
        return {m: {op: dict(d) for op, d in ops.items()} for m, ops in self._op_dtypes.items()}

    def events(self) -> list[Event]:
        out: list[Event] = []
        for key, es in self._events.items():
            n = self._counts[key]
            first = es[0]
            out.append(Event(kind=first.kind, step=first.step, module=first.module, op=first.op,
                             frame=first.frame, data={**first.data, "occurrences": n}))
            out.extend(es[1:])
        if self._internal_error:
            out.append(Event(kind="internal_error", step=0,
                             data={"error": self._internal_error, "where": "anomaly"}))
        return out

    # -- the step boundary -------------------------------------------------------
    def flagged_count(self) -> torch.Tensor | None:
        """A device scalar: how many pending entries are origins. No sync.

        The owner copies it to the host with the step's other summaries and
        passes the value to :meth:`resolve`.
        """
        self._tag_previous()
        p = self._pending
        if not p.entries:
            return None
        p.flags, p.rows = self._origin_flags(p, p.entries)
        return p.flags.sum()

    def resolve(self, flagged: float | None) -> None:
        """Turn the flagged entries into events (a second sync, only if any were flagged)."""
        p, self._pending = self._pending, _Pending()
        if flagged and p.flags is not None and p.rows is not None:
            self._report(p, p.flags, p.rows)

    def check_now(self) -> None:
        """Check what is pending with a sync of its own (unrecorded stretch, close)."""
        self._tag_previous()
        p = self._pending
        if not p.entries:
            return
        if p.flags is None or p.rows is None:
            p.flags, p.rows = self._origin_flags(p, p.entries)
        self._pending = _Pending()
        count_sync()
        if bool(p.flags.any()):
            self._report(p, p.flags, p.rows)

    # -- per op ------------------------------------------------------------------
    def _on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._to_tag is not None:
            self._tag_previous()
        if _OwnOps.depth or (
                not torch.is_grad_enabled() and torch._C._current_autograd_node() is None):
            # amp-doctor's own work; or neither a training forward nor backward:
            # optimizer updates, GradScaler's unscale, evaluation under no_grad.
            return func(*args, **kwargs)
        try:
            pre = self._before(func, args, kwargs)
        except Exception as e:  # our bookkeeping must never break the user's run
            self._note_internal(e)
            pre = None
        out = func(*args, **kwargs)
        if pre is not None:
            try:
                self._after(pre, out)
            except NonFiniteError:
                raise
            except Exception as e:
                self._note_internal(e)
        return out

    def _before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        step = self._step_of()
        if step != self._cache_step:
            # Parameters changed in the optimizer step; last step's tensors are gone.
            self._cache = {}
            self._cache_step = step
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func.overloadpacket)
        if func.is_view:
            return (name, None, True, False, args, step)
        constant_inf = False
        ins: list[int] = []
        leaves: Iterable[Any] = _leaves(args)
        if name in _OVERWRITES:
            leaves = list(leaves)[1:]
        for a in leaves:
            if isinstance(a, torch.Tensor):
                if _summarizable(a):
                    ins.append(self._summary(a))
            elif isinstance(a, float) and not math.isfinite(a):
                constant_inf = True
        for a in kwargs.values():
            if isinstance(a, torch.Tensor) and _summarizable(a):
                ins.append(self._summary(a))
            elif isinstance(a, float) and not math.isfinite(a):
                constant_inf = True
        allowed = constant_inf or name in _UNINITIALIZED
        return (name, ins, False, allowed, None, step)

    def _after(self, pre: Any, out: Any) -> None:
        name, ins, is_view, allowed, args, step = pre
        outs = [t for t in (out if isinstance(out, (list, tuple)) else (out,))
                if isinstance(t, torch.Tensor)]
        node = torch._C._current_autograd_node()
        forward = node is None
        if is_view:
            # Same values as the viewed tensor: share its summary, record nothing.
            base = args[0] if args and isinstance(args[0], torch.Tensor) else None
            known = self._cache.get(id(base)) if base is not None else None
            if base is not None and known is not None and self._valid(base, known):
                for t in outs:
                    if not t.is_inference():
                        self._cache[id(t)] = (known[0], t._version, weakref.ref(t), known[3],
                                              known[4])
            if forward and torch.is_grad_enabled():
                self._to_tag = (outs, (self._current_module(), name, ()))
            return
        summaries: list[int] = []
        dtype = ""
        for t in outs:
            if not _summarizable(t) or name in _UNINITIALIZED:
                continue
            s = self._summarize(t)
            summaries.append(s)
            dtype = dtype or dtype_name(t.dtype)
        if forward:
            module = self._current_module()
            frames = self._user_frames()
            if dtype:
                per = self._op_dtypes.setdefault(module or "<outside>", {}).setdefault(name, {})
                per[dtype] = per.get(dtype, 0) + 1
            if torch.is_grad_enabled():
                self._to_tag = (outs, (module, name, frames))
            kind, fwd_op, node_name = "forward", None, None
        else:
            tag = cast(dict[str, Any], node.metadata).get(_TAG)
            module, fwd_op, frames = tag if tag is not None else (None, None, ())
            kind, node_name = "backward", node.name()
        if not summaries or allowed or self._allowed(name, module):
            return
        entry_ = _Entry(kind=kind, op=name, module=module, step=step, dtype=dtype,
                        outs=summaries, ins=ins, frames=frames, node=node_name,
                        forward_op=fwd_op)
        self._add(entry_)

    def _add(self, entry: _Entry) -> None:
        p = self._pending
        p.entries.append(entry)
        if self._raise:
            self._check_one(p)
        elif len(p.entries) >= MAX_PENDING_ENTRIES:
            self.check_now()

    def _check_one(self, p: _Pending) -> None:
        flags, rows = self._origin_flags(p, p.entries[-1:])
        count_sync()
        self._pending = _Pending()
        if bool(flags[0]):
            # The module has not finished yet: whether its output stays finite is unknown.
            ev = self._report(_Pending(entries=p.entries[-1:], sums=p.sums), flags, rows)
            if ev is not None:
                raise NonFiniteError(_one_line(ev))

    def check_inputs(self, module: str, args: Any) -> None:
        """A root model is being called: note its floating inputs (the batch)."""
        from .probes import iter_tensors

        self._resume()

        try:
            tensors = [t for t in iter_tensors(args) if _summarizable(t)]
            if tensors:
                outs = [self._summary(t) for t in tensors]
                self._add(_Entry(kind="input", op=None, module=module, step=self._step_of(),
                                 dtype=dtype_name(tensors[0].dtype), outs=outs, ins=[],
                                 frames=self._user_frames()))
        except NonFiniteError:
            raise
        except Exception as e:
            self._note_internal(e)

    def _module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._mode is None:
            return
        name = self._module_name(module) if self._module_name is not None else None
        if name is None:
            return
        from .probes import iter_tensors

        outs = []
        for t in iter_tensors(output):
            e = self._cache.get(id(t))
            if e is not None and self._valid(t, e):
                outs.append(self._index(e))
        if outs:
            self._pending.calls.append(_ModuleCall(name, len(self._pending.entries), outs))

    # -- helpers ---------------------------------------------------------------
    def _summarize(self, t: torch.Tensor) -> int:
        """Reduce ``t`` to (min, max) on its device; its index in the window's summaries."""
        p = self._pending
        s = torch.aminmax(t)
        p.sums.append((s[0], s[1]))
        i = len(p.sums) - 1
        if not t.is_inference():
            self._cache[id(t)] = (p.sums[i], t._version, weakref.ref(t), p, i)
        return i

    @staticmethod
    def _valid(t: torch.Tensor, e: tuple[Any, ...]) -> bool:
        return e[2]() is t and not t.is_inference() and e[1] == t._version

    def _index(self, e: tuple[_Summary, int, Any, _Pending, int]) -> int:
        """The index of a cached summary in the current window (added once if it is new)."""
        p = self._pending
        if e[3] is p:
            return e[4]
        p.sums.append(e[0])
        return len(p.sums) - 1

    def _summary(self, t: torch.Tensor) -> int:
        e = self._cache.get(id(t))
        if e is not None and self._valid(t, e):
            return self._index(e)
        return self._summarize(t)

    def _tag_previous(self) -> None:
        pending, self._to_tag = self._to_tag, None
        if pending is None:
            return
        outs, info = pending
        for t in outs:
            gf = t.grad_fn
            if gf is not None:
                md = cast(dict[str, Any], gf.metadata)
                if _TAG not in md:
                    md[_TAG] = info

    def _user_frames(self) -> tuple[tuple[str, int, str], ...]:
        out: list[tuple[str, int, str]] = []
        f: Any = sys._getframe(2)
        known = self._user_code
        while f is not None and len(out) < MAX_USER_FRAMES:
            code = f.f_code
            user = known.get(code)
            if user is None:
                user = known[code] = _is_user_file(code.co_filename)
            if user:
                out.append((code.co_filename, f.f_lineno, code.co_name))
            f = f.f_back
        return tuple(out)

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

    def _note_internal(self, e: Exception) -> None:
        if self._internal_error is None:
            self._internal_error = f"{type(e).__name__}: {e}"

    @staticmethod
    def _origin_flags(p: _Pending, entries: list[_Entry]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per entry, on the device: an origin of non-finite values? No sync.

        Also returns the window's summaries stacked as [n, 2] rows, for the report.
        """
        rows = _stack(p.sums)
        dev = rows.device
        out_idx: list[int] = []
        out_owner: list[int] = []
        in_idx: list[int] = []
        in_owner: list[int] = []
        is_input: list[bool] = []
        for i, e in enumerate(entries):
            out_idx.extend(e.outs)
            out_owner.extend([i] * len(e.outs))
            in_idx.extend(e.ins)
            in_owner.extend([i] * len(e.ins))
            is_input.append(e.kind == "input")
        n = len(entries)
        bad_any = ~torch.isfinite(rows).all(1)
        # Inputs to the model: NaN or +inf is bad data; -inf is how masks are written.
        bad_data = torch.isnan(rows).any(1) | (rows[:, 1] == math.inf)
        oi = torch.tensor(out_idx, device=dev)
        oo = torch.tensor(out_owner, device=dev)
        sel = torch.tensor(is_input, device=dev)[oo]
        bad_out = torch.where(sel, bad_data[oi], bad_any[oi])
        out_bad = torch.zeros(n, device=dev).index_add_(0, oo, bad_out.float())
        flags = out_bad > 0
        if in_idx:
            in_bad = torch.zeros(n, device=dev).index_add_(
                0, torch.tensor(in_owner, device=dev),
                bad_any[torch.tensor(in_idx, device=dev)].float())
            flags &= in_bad == 0
        return flags, rows

    def _report(self, p: _Pending, flags: torch.Tensor, rows: torch.Tensor) -> Event | None:
        """Events for the first distinct origins among the flagged entries (syncs)."""
        idx = flags.nonzero().flatten().tolist()
        count_sync()
        # Per step and direction, only the first origin: the ones after it in the same
        # pass are usually knock-on effects (a scaled gradient overflowing in layer
        # after layer). Steps with the same first origin are grouped.
        firsts: dict[tuple[int, str], int] = {}
        for i in idx:
            e = p.entries[i]
            firsts.setdefault((e.step, e.kind), i)
        groups: dict[tuple[str, str | None, str | None], list[int]] = {}
        for i in firsts.values():
            e = p.entries[i]
            groups.setdefault((e.kind, e.module, e.op), []).append(i)
        chosen = [members[0] for members in list(groups.values())[:MAX_ORIGINS_PER_CHECK]]
        # One host copy for everything the chosen events report: their outputs, their
        # inputs and, in the forward pass, the output of the module they ran in.
        needs: list[tuple[list[int], list[int], list[int]]] = []
        for i in chosen:
            e = p.entries[i]
            call = self._module_call(p, e.module, i) if e.kind == "forward" else None
            needs.append((e.outs, e.ins, call.outs if call is not None else []))
        wanted = [j for need in needs for part in need for j in part]
        host = rows[torch.tensor(wanted, dtype=torch.long, device=rows.device)].cpu()
        count_sync()
        first: Event | None = None
        pos = 0
        for i, members, need in zip(chosen, groups.values(), needs, strict=False):
            parts = []
            for part in need:
                parts.append(host[pos:pos + len(part)])
                pos += len(part)
            ev = self._event_for(p.entries[i], *parts)
            self._store(ev, sorted({p.entries[j].step for j in members}))
            first = first or ev
        return first

    def _store(self, ev: Event, steps: list[int]) -> None:
        """Keep one event per step an origin showed up in, and count them all."""
        key = (ev.kind, ev.module, ev.op)
        es = self._events.setdefault(key, [])
        seen = {e.step for e in es}
        new = [s for s in steps if s not in seen]
        self._counts[key] = self._counts.get(key, 0) + len(new)
        for s in new:
            if len(es) >= MAX_EVENTS_PER_KEY:
                break
            es.append(ev if s == ev.step else Event(
                kind=ev.kind, step=s, module=ev.module, op=ev.op, frame=ev.frame,
                data=ev.data))

    @staticmethod
    def _event_for(e: _Entry, o: torch.Tensor, x: torch.Tensor, call: torch.Tensor) -> Event:
        """An event from host rows: ``o``/``x`` the op's outputs/inputs, ``call`` its module's."""
        has_nan = bool(torch.isnan(o).any())
        has_pos_inf = bool((o[:, 1] == math.inf).any())
        has_neg_inf = bool((o[:, 0] == -math.inf).any())
        data: dict[str, Any] = {
            "dtype": e.dtype, "nan": has_nan, "pos_inf": has_pos_inf, "neg_inf": has_neg_inf,
            "frames": [f"{f}:{ln} in {fn}" for f, ln, fn in e.frames],
        }
        if len(x):
            lo, hi = float(x[:, 0].min()), float(x[:, 1].max())
            data.update(input_min=lo, input_max=hi, input_absmax=max(abs(lo), abs(hi)))
        if e.kind == "input":
            kind = "nonfinite_input"
            data["output_min"], data["output_max"] = float(o[:, 0].min()), float(o[:, 1].max())
        elif e.kind == "backward":
            kind = "nonfinite_backward"
            data.update(node=e.node, forward_op=e.forward_op)
        else:
            kind = "nonfinite_forward"
            finite_after = bool(torch.isfinite(call).all()) if len(call) else None
            data["module_output_finite"] = finite_after
            if finite_after and not has_nan:
                kind = "activation_overflow"
                data["hidden"] = True
        frame = data["frames"][0] if data["frames"] else None
        return Event(kind=kind, step=e.step, module=e.module, op=e.op, frame=frame, data=data)

    @staticmethod
    def _module_call(p: _Pending, module: str | None, i: int) -> _ModuleCall | None:
        """The call of ``module`` that entry ``i`` ran in (the first to end after it)."""
        if module is None:
            return None
        return next((c for c in p.calls if c.name == module and c.end > i), None)


def _stack(summaries: list[_Summary]) -> torch.Tensor:
    """[n, 2] float32 (min, max) rows, on the device of the first summary.

    Summaries are stacked per dtype (stacking mixed dtypes is several times slower)
    and put back in order. A CUDA op may take a 0-d CPU tensor, so a summary can
    live elsewhere than the rest: it is moved first.
    """
    home = summaries[0][0].device
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, s in enumerate(summaries):
        groups.setdefault((s[0].dtype, s[0].device), []).append(i)
    parts = []
    order: list[int] = []
    for (_, dev), idx in groups.items():
        lo = torch.stack([summaries[i][0] for i in idx])
        hi = torch.stack([summaries[i][1] for i in idx])
        part = torch.stack((lo, hi), 1).to(torch.float32)
        parts.append(part if dev == home else part.to(home))
        order.extend(idx)
    cat = parts[0] if len(parts) == 1 else torch.cat(parts)
    if order == list(range(len(order))):
        return cat
    out = torch.empty_like(cat)
    out[torch.tensor(order, device=home)] = cat
    return out


def _one_line(ev: Event) -> str:
    """The ``NonFiniteError`` message: where, what, and analysis's fix for it."""
    from .analysis import event_advice

    d = ev.data
    where = f"module {ev.module!r}" if ev.module else "code outside the watched model"
    what = "NaN" if d.get("nan") else ("+inf" if d.get("pos_inf") else "-inf")
    at = f" at {ev.frame}" if ev.frame else ""
    if ev.kind == "nonfinite_input":
        head = f"the batch passed to {ev.module!r} holds {what} at step {ev.step}{at}"
    elif ev.kind == "nonfinite_backward":
        head = (f"{ev.op} in the backward of {d.get('forward_op')} ({d.get('node')}, {where}) "
                f"produced {what} from finite inputs at step {ev.step}{at}")
    else:
        head = (f"{ev.op} in {where} produced {what} from finite {d.get('dtype')} inputs at "
                f"step {ev.step}{at}")
    return f"{head}. Fix: {' '.join(event_advice(ev).split())}"
