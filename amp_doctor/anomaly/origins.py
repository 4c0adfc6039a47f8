"""Which recorded op is an *origin* of non-finite values, and the event that names it.

An op is an origin (a producer, not a propagator) when an output is non-finite
while every floating input was finite. The op recorder keeps a (min, max)
summary of each floating tensor on the device; here those summaries are turned
into one flag per op entry without a sync, and the flagged entries into events
(a host copy, only on an abnormal step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from amp_doctor.anomaly.userframes import Frame, format_frames
from amp_doctor.device.stats import bad_batch
from amp_doctor.devicework import count_sync
from amp_doctor.records import Event

__all__ = ["Summary", "OpEntry", "ModuleCall", "OpWindow", "origin_flags", "report_origins",
           "stack_rows", "MAX_ORIGINS_PER_CHECK"]

# On an abnormal step, report at most this many distinct (kind, module, op) origins.
MAX_ORIGINS_PER_CHECK = 8


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
    """Per entry, on the device: an origin of non-finite values? No sync.

    Also returns the window's summaries stacked as [n, 2] rows, for the report.
    """
    rows = _stack_summaries(w.sums)
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
    bad_data = bad_batch(rows)  # inputs to the model
    oi = torch.tensor(out_idx, device=dev)
    oo = torch.tensor(out_owner, device=dev)
    sel = torch.tensor(is_input, device=dev)[oo]
    bad_out = torch.where(sel, bad_data[oi], bad_any[oi])
    out_bad = torch.zeros(n, dtype=torch.float32, device=dev).index_add_(0, oo, bad_out.float())
    flags = out_bad > 0
    if in_idx:
        in_bad = torch.zeros(n, dtype=torch.float32, device=dev).index_add_(
            0, torch.tensor(in_owner, device=dev),
            bad_any[torch.tensor(in_idx, device=dev)].float())
        flags &= in_bad == 0
    return flags, rows


class _Needs(NamedTuple):
    """The summary indices an event reports: the op's outputs and inputs, its module's."""

    outs: list[int]
    ins: list[int]
    call: list[int]


def report_origins(w: OpWindow, flags: torch.Tensor, rows: torch.Tensor,
                   store: Callable[[Event, list[int]], None]) -> Event | None:
    """Events for the first distinct origins among the flagged entries (syncs).

    ``store(event, steps)`` keeps each one; the first is returned.
    """
    idx = flags.nonzero().flatten().tolist()
    count_sync()
    # Per step and direction, only the first origin: the ones after it in the same
    # pass are usually knock-on effects (a scaled gradient overflowing in layer
    # after layer). Steps with the same first origin are grouped.
    firsts: dict[tuple[int, str], int] = {}
    for i in idx:
        e = w.entries[i]
        firsts.setdefault((e.step, e.kind), i)
    groups: dict[tuple[str, str | None, str | None], list[int]] = {}
    for i in firsts.values():
        e = w.entries[i]
        groups.setdefault((e.kind, e.module, e.op), []).append(i)
    chosen = [members[0] for members in list(groups.values())[:MAX_ORIGINS_PER_CHECK]]
    # One host copy for everything the chosen events report: their outputs, their
    # inputs and, in the forward pass, the output of the module they ran in.
    needs: list[_Needs] = []
    for i in chosen:
        e = w.entries[i]
        call = _module_call(w, e.module, i) if e.kind == "forward" else None
        needs.append(_Needs(e.outs, e.ins, call.outs if call is not None else []))
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
        ev = _event_for(w.entries[i], *parts)
        store(ev, sorted({w.entries[j].step for j in members}))
        first = first or ev
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


def _module_call(w: OpWindow, module: str | None, i: int) -> ModuleCall | None:
    """The call of ``module`` that entry ``i`` ran in (the first to end after it)."""
    if module is None:
        return None
    return next((c for c in w.calls if c.name == module and c.end > i), None)


def _stack_summaries(summaries: list[Summary]) -> torch.Tensor:
    """[n, 2] float32 (min, max) rows, on the device of the first summary.

    Summaries are stacked per dtype (stacking mixed dtypes is several times slower)
    and put back in order. A CUDA op may take a 0-d CPU tensor, so a summary can
    live elsewhere than the rest: it is moved first.
    """
    home = summaries[0].lo.device
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, s in enumerate(summaries):
        groups.setdefault((s.lo.dtype, s.lo.device), []).append(i)
    parts = []
    order: list[int] = []
    for (_, dev), idx in groups.items():
        lo = torch.stack([summaries[i].lo for i in idx])
        hi = torch.stack([summaries[i].hi for i in idx])
        part = torch.stack((lo, hi), 1).to(torch.float32)
        parts.append(part if dev == home else part.to(home))
        order.extend(idx)
    cat = parts[0] if len(parts) == 1 else torch.cat(parts)
    if order == list(range(len(order))):
        return cat
    out = torch.empty_like(cat)
    out[torch.tensor(order, device=home)] = cat
    return out


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """[n, 2] rows on the device of the first (a batch on another device is moved)."""
    home = rows[0].device
    return torch.stack([r if r.device == home else r.to(home) for r in rows])
