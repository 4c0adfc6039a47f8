"""Which recorded op is an *origin* of non-finite values, and the event that names it.

An op is an origin (a producer, not a propagator) when an output is non-finite
while every floating input was finite, or a forward op's output is NaN while its
inputs held no NaN or +inf (a softmax of a row that a -inf mask covers whole). The
op recorder keeps a (min, max) summary of each floating tensor on the device; here
those summaries are turned into one flag per op entry without a sync, and the
flagged entries into events (a host copy, only on an abnormal step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from amp_doctor.anomaly.userframes import Frame, format_frames
from amp_doctor.device.stats import bad_batch, upload
from amp_doctor.devicework import count_sync
from amp_doctor.records import Event

__all__ = ["Summary", "OpEntry", "ModuleCall", "OpWindow", "origin_flags", "report_origins",
           "stack_rows", "MAX_ORIGINS_PER_CHECK"]

# On an abnormal step, report at most this many distinct (kind, module, op) origins.
MAX_ORIGINS_PER_CHECK = 8
# Ops that pass an additive mask on: autocast's cast of a float32 mask to float16, and
# the sum of two masks (a causal and a padding mask, each filled with finfo.min).
_MASK_OPS = frozenset({"aten._to_copy", "aten.copy_", "aten.add"})
# The lowest finite values an additive mask is filled with (``(1 - mask) *
# torch.finfo(dtype).min``, as Hugging Face models do), as the float32 summaries hold them.
_MASK_FILLS = (torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min)
# Ops that make +inf of a mask's -inf itself, not of its finite values.
_SIGN_OPS = frozenset({"aten.neg", "aten.abs", "aten.pow", "aten.square", "aten.rsub",
                       "aten.sub", "aten.reciprocal"})


class Summary(NamedTuple):
    """(min, max) of a tensor: two 0-d device tensors from one aminmax reduction."""

    lo: torch.Tensor
    hi: torch.Tensor


@dataclass(slots=True)
class OpEntry:
    """One op call (or, in raise mode, one root-model input), waiting for the next check."""

    kind: str  # "forward" | "backward" | "input"
    op: str | None
    module: str | None
    step: int
    dtype: str
    outs: list[int]  # indices into the window's summaries: each floating output
    ins: list[int]  # and each floating input
    frames: tuple[Frame, ...]
    node: str | None = None
    forward_op: str | None = None
    in_dtypes: tuple[str, ...] = ()  # a division's input dtypes
    casts_parameter: bool = False  # a cast whose input is an nn.Parameter
    on_graph: bool = True  # an input required grad: a gradient can flow back through it


@dataclass(slots=True)
class ModuleCall:
    """A watched module's call that ended: its output summaries."""

    name: str
    end: int  # index of the first entry after this call
    outs: list[int]


@dataclass
class OpWindow:
    """One window of op entries between two checks.

    Each tensor's summary is stored once in ``sums`` and referred to by index, so an
    op's inputs (earlier ops' outputs) cost nothing more to keep, or to check.
    """

    entries: list[OpEntry] = field(default_factory=list)
    calls: list[ModuleCall] = field(default_factory=list)
    sums: list[Summary] = field(default_factory=list)


def origin_flags(w: OpWindow, entries: list[OpEntry]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per entry, on the device: an origin of non-finite values? No sync. An origin made
    a non-finite output from finite inputs, or, in the forward pass, a NaN from inputs
    whose only non-finite values were -inf (a mask's).

    A cast of an additive mask is not one: an input whose max is at most 0 and whose
    min is a format's lowest finite value (``torch.finfo(float32).min``), cast to
    float16, is -inf where it masks and finite elsewhere, which is what the model's
    softmax expects (autocast makes that cast when the float32 mask meets a float16 op).
    Nor is a sum of such masks, -inf where both mask.

    Also returns the window's summaries stacked as [n, 2] rows, for the report.
    """
    rows = _stack_summaries(w.sums)
    dev = rows.device
    out_idx: list[int] = []
    out_owner: list[int] = []
    in_idx: list[int] = []
    in_owner: list[int] = []
    is_input: list[bool] = []
    is_forward: list[bool] = []
    for i, e in enumerate(entries):
        out_idx.extend(e.outs)
        out_owner.extend([i] * len(e.outs))
        in_idx.extend(e.ins)
        in_owner.extend([i] * len(e.ins))
        is_input.append(e.kind == "input")
        is_forward.append(e.kind == "forward")
    n = len(entries)
    bad_any = ~torch.isfinite(rows).all(1)
    nan = rows.isnan().any(1)  # aminmax propagates NaN: a NaN anywhere makes both NaN
    bad_data = bad_batch(rows)  # inputs to the model
    # Host lists go up without a sync (pinned, non-blocking on CUDA).
    oi = upload(out_idx, dev)
    oo = upload(out_owner, dev)
    sel = upload([int(b) for b in is_input], dev).bool()[oo]
    bad_out = torch.where(sel, bad_data[oi], bad_any[oi])
    # In backward, NaN from an inf is what follows a scaled gradient's overflow (inf - inf),
    # which the GradScaler skips: the overflow is the origin there.
    fwd = upload([int(b) for b in is_forward], dev).bool()[oo]
    nan_out = nan[oi] & fwd
    # +inf made in the forward pass by an op that does not flip signs (an exp of masked
    # scores: review 61a, a hand-written softmax overflowing float16 past the -inf mask).
    flips = upload([int(e.op in _SIGN_OPS) for e in entries], dev).bool()[oo]
    pos_inf_out = (rows[oi, 1] == math.inf) & fwd & ~flips
    zeros = torch.zeros(n, dtype=torch.float32, device=dev)
    out_bad = zeros.index_add(0, oo, bad_out.float()) > 0
    out_nan = zeros.index_add(0, oo, nan_out.float()) > 0
    out_pos_inf = zeros.index_add(0, oo, pos_inf_out.float()) > 0
    flags = out_bad
    if in_idx:
        owner = upload(in_owner, dev)
        ins = upload(in_idx, dev)
        in_bad = zeros.index_add(0, owner, bad_any[ins].float()) > 0
        # A -inf but no +inf or NaN in any input: what a mask holds (an overflow makes
        # both signs, and its own op is the origin, earlier in the pass).
        in_masked = zeros.index_add(0, owner, (nan | (rows[:, 1] == math.inf))[ins].float()) == 0
        # An op that made NaN from such inputs is one too: a softmax over a row that the
        # mask covers whole; and one that made +inf of them, from their finite values.
        flags = (out_bad & ~in_bad) | ((out_nan | out_pos_inf) & in_masked)
    # One line per input of a cast or a sum of masks (the first of a sum holds the fill).
    masking = [(i, e.ins[0], e.outs[0]) for i, e in enumerate(entries)
               if e.op in _MASK_OPS and e.ins and e.outs]
    if masking:
        at, src_i, dst_i = (upload(list(c), dev) for c in zip(*masking, strict=True))
        src, dst = rows[src_i], rows[dst_i]
        lo = src[:, 0]
        filled = (lo == _MASK_FILLS[0]) | (lo == _MASK_FILLS[1])
        # Every input of the op at most 0: the largest input max, per entry.
        top = torch.full((n,), -math.inf, dtype=rows.dtype, device=dev)
        if in_idx:
            # scatter_reduce, not index_reduce: the same amax here, and no "beta" warning
            # in the user's output.
            top = top.scatter_reduce(0, owner, rows[ins, 1], "amax")  # uploaded above
        mask = (filled & (top[at] <= 0)
                & (dst[:, 0] == -math.inf) & (dst[:, 1] < math.inf))
        flags[at] = flags[at] & ~mask
    return flags, rows


class _Needs(NamedTuple):
    """The summary indices an event reports: the op's outputs and inputs, its module's,
    and the outputs of the later module calls that may have carried its values on."""

    outs: list[int]
    ins: list[int]
    call: list[int]
    later: list[int]
    # An op off the autograd graph: the inputs of the ops on it that ran after it in its
    # module's call (did its values reach a trained weight's op?).
    fed: list[int]


def _in_subtree(module: str | None, top: str) -> bool:
    return module is not None and (module == top or module.startswith(top + "."))


def _later_calls(w: OpWindow, i: int, flagged: list[int]) -> tuple[list[ModuleCall], list[str]]:
    """The module calls of forward origin ``i``'s step that ended after it, before any
    later origin of that step, and do not hold it (so a non-finite output of theirs can
    only have come from it); and the modules whose own op made NaN/inf later in that step
    (independent origins: the report keeps only a step's first)."""
    entries = w.entries
    step = entries[i].step
    end = next((j for j in range(i + 1, len(entries)) if entries[j].step != step), len(entries))
    later = [j for j in flagged if i < j < end and entries[j].kind == "forward"]
    calls = [c for c in w.calls
             if i < c.end <= end and not _in_subtree(entries[i].module, c.name)
             and not any(j < c.end for j in later)]
    own = list(dict.fromkeys(m for j in later if (m := entries[j].module) is not None
                             and m != entries[i].module))
    return calls, own


def report_origins(w: OpWindow, flags: torch.Tensor, rows: torch.Tensor,
                   store: Callable[[Event, list[int]], None],
                   finite_loss_steps: frozenset[int] = frozenset(),
                   finite_grad_steps: frozenset[int] = frozenset()) -> Event | None:
    """Events for the first distinct origins among the flagged entries (syncs).

    ``store(event, steps)`` keeps each one; the first is returned (the first that did
    harm, if one did). A forward origin whose values went nowhere (a ``torch.where`` or
    a mask dropped them: ``torch.where(z > 0, torch.log(z), 0)``) is a
    ``nonfinite_discarded`` event: its step's loss was checked finite
    (``finite_loss_steps``) and its gradients stayed finite (``finite_grad_steps``), or
    a backward op of the step made them non-finite from finite inputs (a GradScaler's
    overflow, not this NaN); so is a backward origin in a step whose gradients that
    optimizers took stayed finite. It is grouped apart from the same op's origins in
    steps that it harmed.
    """
    idx = flags.nonzero().flatten().tolist()
    count_sync()
    # Per step and direction, only the first origin: the ones after it in the same
    # pass are usually knock-on effects (a scaled gradient overflowing in layer
    # after layer). Steps with the same first origin are grouped.
    firsts: dict[tuple[int, str], int] = {}
    # A step whose first forward origin is off the autograd graph (T5's log of integer
    # distances, dropped by a cast to integers: review 55) has its first origin on the
    # graph as a candidate too, kept if the first one's values went nowhere.
    seconds: dict[int, int] = {}
    for i in idx:
        e = w.entries[i]
        first_i = firsts.setdefault((e.step, e.kind), i)
        if (e.kind == "forward" and e.on_graph and not w.entries[first_i].on_graph
                and e.module != w.entries[first_i].module):
            seconds.setdefault(e.step, i)
    groups: dict[tuple[str, str | None, str | None, int], list[int]] = {}
    for i in [*firsts.values(), *seconds.values()]:
        e = w.entries[i]
        # 2: the loss and the gradients stayed finite; 1: the gradients were overflowed by
        # a backward op of the step (a GradScaler calibrating); 0: it may have done harm.
        dropped = 0
        if e.kind == "forward" and e.step in finite_loss_steps:
            dropped = (2 if e.step in finite_grad_steps
                       else 1 if (e.step, "backward") in firsts else 0)
        elif e.kind == "backward" and e.step in finite_grad_steps:
            # Every gradient an optimizer took was finite: the values went into gradients
            # that were dropped (a GAN's discriminator, in the generator's backward).
            dropped = 2
        groups.setdefault((e.kind, e.module, e.op, dropped), []).append(i)
    chosen = [members[0] for members in list(groups.values())[:MAX_ORIGINS_PER_CHECK]]
    # One host copy for everything the chosen events report: their outputs, their
    # inputs and, in the forward pass, the output of the module they ran in.
    needs: list[_Needs] = []
    later: list[tuple[list[ModuleCall], list[str]]] = []
    for i in chosen:
        e = w.entries[i]
        call = _module_call(w, e.module, i) if e.kind == "forward" else None
        after = _later_calls(w, i, idx) if e.kind == "forward" else ([], [])
        later.append(after)
        needs.append(_Needs(e.outs, e.ins, call.outs if call is not None else [],
                            [j for c in after[0] for j in c.outs],
                            _fed_on_graph(w, i, call) if e.kind == "forward"
                            and not e.on_graph else []))
    wanted = [j for need in needs for part in need for j in part]
    host = rows[torch.tensor(wanted, dtype=torch.long, device=rows.device)].cpu()
    count_sync()
    first: Event | None = None
    pos = 0
    built: list[tuple[Event, list[int]]] = []
    dead_steps: set[int] = set()  # steps whose off-graph first origin went nowhere
    second_members = set(seconds.values())
    for i, (key, members), need, (calls, own) in zip(chosen, groups.items(), needs, later,
                                                      strict=False):
        parts = []
        for part in need:
            parts.append(host[pos:pos + len(part)])
            pos += len(part)
        e = w.entries[i]
        ev = _event_for(e, *parts[:3])
        # A module whose own op made NaN/inf later in the step (a second call of it) is an
        # origin of its own, whatever an earlier call of it carried.
        carriers = [c for c in _carriers(calls, parts[3])
                    if not any(_in_subtree(m, c) for m in own)]
        if carriers:
            ev.data["carriers"] = carriers
        if own:
            ev.data["later_origins"] = own[:MAX_ORIGINS_PER_CHECK]
        steps = sorted({w.entries[j].step for j in members})
        if (e.kind == "forward" and not e.on_graph and not carriers
                and ev.data.get("module_output_finite") and bool(torch.isfinite(parts[4]).all())):
            # No gradient flows back through it, no op on the graph took a non-finite input
            # after it in its module (a GRU's gate matmul took its cast batch's inf: review
            # 55), and its module's output and every later call were finite: a cast to
            # integers or a `torch.where` dropped its values.
            ev = Event(kind="nonfinite_discarded", step=ev.step, module=ev.module, op=ev.op,
                       frame=ev.frame, data={**ev.data, "made": ev.kind, "off_graph": True})
            dead_steps.update(steps)
        # An overflow its module's output hid keeps its kind unless nothing went non-finite
        # after it: its own backward is where its harm shows (a cube inside a GELU).
        elif key[3] == 2 or (key[3] and ev.kind == "nonfinite_forward"):
            ev = Event(kind="nonfinite_discarded", step=ev.step, module=ev.module, op=ev.op,
                       frame=ev.frame, data={**ev.data, "made": ev.kind,
                                             # the step's gradients went non-finite all
                                             # the same, first in a backward op of its own
                                             "grads_nonfinite": key[3] == 1})
        built.append((ev, [j for j in members]))
    for ev, members in built:
        if any(j in second_members for j in members):
            # A second candidate counts only in the steps whose first origin went nowhere;
            # elsewhere it is the first one's knock-on.
            members = [j for j in members if j not in second_members
                       or w.entries[j].step in dead_steps]
            if not members:
                continue
        store(ev, sorted({w.entries[j].step for j in members}))
        if first is None or (first.kind == "nonfinite_discarded"
                             and ev.kind != "nonfinite_discarded"):
            first = ev
    return first


def _event_for(e: OpEntry, o: torch.Tensor, x: torch.Tensor, call: torch.Tensor) -> Event:
    """An event from host rows: ``o``/``x`` the op's outputs/inputs, ``call`` its module's."""
    has_nan = bool(torch.isnan(o).any())
    has_pos_inf = bool((o[:, 1] == math.inf).any())
    has_neg_inf = bool((o[:, 0] == -math.inf).any())
    data: dict[str, Any] = {
        "dtype": e.dtype, "nan": has_nan, "pos_inf": has_pos_inf, "neg_inf": has_neg_inf,
        "frames": format_frames(e.frames),
    }
    if e.in_dtypes:
        data["input_dtypes"] = list(e.in_dtypes)
    if e.casts_parameter:
        data["casts_parameter"] = True
    if len(x):
        lo, hi = float(x[:, 0].min()), float(x[:, 1].max())
        data.update(input_min=lo, input_max=hi, input_absmax=max(abs(lo), abs(hi)))
        if len(x) > 1:  # each input's own range: x / 0 hides a zero denominator otherwise
            data["input_ranges"] = [[float(a), float(b)] for a, b in x[:, :2].tolist()]
    if e.kind == "input":
        kind = "nonfinite_input"
        data["output_min"], data["output_max"] = float(o[:, 0].min()), float(o[:, 1].max())
    elif e.kind == "backward":
        kind = "nonfinite_backward"
        data.update(node=e.node, forward_op=e.forward_op)
    else:
        kind = "nonfinite_forward"
        # What the op made: -inf from log(0) is not an overflow past the format's max.
        data["output_min"], data["output_max"] = float(o[:, 0].min()), float(o[:, 1].max())
        finite_after = bool(torch.isfinite(call).all()) if len(call) else None
        data["module_output_finite"] = finite_after
        if finite_after and not has_nan:
            kind = "activation_overflow"
            data["hidden"] = True
    frame = data["frames"][0] if data["frames"] else None
    return Event(kind=kind, step=e.step, module=e.module, op=e.op, frame=frame, data=data)


# Input summaries looked at for one off-graph origin (a module call's ops after it).
MAX_FED_INPUTS = 4096


def _fed_on_graph(w: OpWindow, i: int, call: ModuleCall | None) -> list[int]:
    """The inputs of the forward ops on the autograd graph that ran after entry ``i`` in
    its module's call (or, with no module, in its step)."""
    step = w.entries[i].step
    end = call.end if call is not None else len(w.entries)
    out: list[int] = []
    for e in w.entries[i + 1:end]:
        if e.step != step:
            break
        if e.kind == "forward" and e.on_graph:
            out.extend(e.ins)
            if len(out) >= MAX_FED_INPUTS:
                break
    return out


def _carriers(calls: list[ModuleCall], rows: torch.Tensor) -> list[str]:
    """The modules among ``calls`` (see :func:`_later_calls`) whose output was non-finite:
    they only carried the origin's values on, in the step it was found in."""
    names: dict[str, None] = {}
    bad = (~torch.isfinite(rows).all(1)).tolist() if len(rows) else []  # host rows: no sync
    pos = 0
    for c in calls:
        if any(bad[pos:pos + len(c.outs)]):
            names[c.name] = None
        pos += len(c.outs)
    return list(names)


def _module_call(w: OpWindow, module: str | None, i: int) -> ModuleCall | None:
    """The call of ``module`` that entry ``i`` ran in (the first to end after it)."""
    if module is None:
        return None
    return next((c for c in w.calls if c.name == module and c.end > i), None)


def _stack_summaries(summaries: list[Summary]) -> torch.Tensor:
    """[n, 2] (min, max) rows, on the device of the first summary: float32, or float64
    when a summary is (a float64 value beyond float32's max is finite, not inf).

    Summaries are stacked per dtype (stacking mixed dtypes is several times slower)
    and put back in order. A CUDA op may take a 0-d CPU tensor, so a summary can
    live elsewhere than the rest: it is moved first.
    """
    home = summaries[0].lo.device
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, s in enumerate(summaries):
        groups.setdefault((s.lo.dtype, s.lo.device), []).append(i)
    wide = torch.float64 if any(dt == torch.float64 for dt, _ in groups) else torch.float32
    parts = []
    order: list[int] = []
    for (_, dev), idx in groups.items():
        lo = torch.stack([summaries[i].lo for i in idx])
        hi = torch.stack([summaries[i].hi for i in idx])
        part = torch.stack((lo, hi), 1).to(wide)
        parts.append(part if dev == home else part.to(home))
        order.extend(idx)
    cat = parts[0] if len(parts) == 1 else torch.cat(parts)
    if order == list(range(len(order))):
        return cat
    out = torch.empty_like(cat)
    out[upload(order, home)] = cat
    return out


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """[n, 2] rows on the device of the first (a batch on another device is moved)."""
    home = rows[0].device
    return torch.stack([r if r.device == home else r.to(home) for r in rows])
