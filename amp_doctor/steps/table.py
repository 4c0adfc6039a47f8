"""A recorded step's per-layer figures as one table: decoded at once, read as records on demand.

A recorded step of a 600-layer model holds about 1,500 (layer, tensor) figures.
Making a :class:`~amp_doctor.records.TensorStats` and a
:class:`~amp_doctor.records.LayerStep` for each cost more host time than decoding
them (about 10 ms a step on the benchmark GPT), yet few are ever read one by one:
the history keeps a step's worst :data:`~amp_doctor.steps.history.HISTORY_LAYERS`
layers, the TensorBoard sink its live ones. So a step's figures stay one float64
tensor ``[layers, len(SLOTS), len(TS_FIELDS)]``. Whole-step questions (which
layers went non-finite, which are the worst, the run-long aggregates of
:mod:`amp_doctor.steps.aggregates`) are tensor ops over it, and a
:class:`LayerStep` is made only when a layer is looked up.

Host data only: the table is decoded from the step's one host copy.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections.abc import Iterator, Mapping, Sequence

import torch

from amp_doctor.device import stats as S
from amp_doctor.device.recorder import HIST_FIELDS, HostCopy, StepHists, scale_log2_of
from amp_doctor.dtypes import FormatLimits
from amp_doctor.records import LayerStep, TensorStats

__all__ = ["SLOTS", "TS_FIELDS", "KeptLayers", "StepTable", "decode_step", "first_nonfinite"]

# A layer's tensors in a step, in LayerStep's field order.
SLOTS = tuple(f.name for f in dataclasses.fields(LayerStep))
ACT, GRAD, GRAD_U, PG, PG_U = range(len(SLOTS))
assert SLOTS == ("act", "grad", "grad_unscaled", "param_grad", "param_grad_unscaled")
# A tensor's figures, in TensorStats' field order.
TS_FIELDS = tuple(f.name for f in dataclasses.fields(TensorStats))
NUMEL, MIN, MAX, ABSMAX, ZERO, NONFINITE, OVER, UNDER, HEAD = range(len(TS_FIELDS))
assert TS_FIELDS == ("numel", "min", "max", "absmax", "zero_frac", "nonfinite_frac",
                     "overflow_frac", "underflow_frac", "headroom")
# decode_table's columns that make a TensorStats, in its field order.
_TS_COLUMNS = [S.DECODED_FIELDS.index(f) for f in TS_FIELDS]
# The slot each slot falls back to when absent (an unscaled view: its scaled slot).
# (Host tensors made at import name the CPU: the user may have set another default device.)
_FALLBACK = torch.tensor([ACT, GRAD, GRAD, PG, PG], device="cpu")
# The tensors a layer's risk is judged on: outputs, their gradients, parameter gradients.
_RISK_SLOTS = torch.tensor([ACT, GRAD, PG_U], device="cpu")
# The slot a filed field fills, and the slot of its unscaled view.
_SLOT_OF = {"act": (ACT, None), "grad": (GRAD, GRAD_U), "param_grad": (PG, PG_U)}


class StepTable(Mapping[str, LayerStep]):
    """``layer name -> LayerStep`` for one recorded step, backed by one tensor.

    ``data[i, slot, field]`` is layer ``names[i]``'s figure (NaN where the slot
    is absent, see ``present``). Names are in forward order of first filing.
    A looked-up layer's :class:`LayerStep` is made once and kept.
    """

    def __init__(self, names: list[str], data: torch.Tensor, present: torch.Tensor) -> None:
        self.names = names
        self.data = data
        self.present = present
        self._index = {n: i for i, n in enumerate(names)}
        self._made: dict[int, LayerStep] = {}

    @classmethod
    def from_layers(cls, layers: Mapping[str, LayerStep]) -> StepTable:
        """The table of records made elsewhere (a history row, a test)."""
        if isinstance(layers, StepTable):
            return layers
        names = list(layers)
        nan_row = [math.nan] * len(TS_FIELDS)
        cells = [[getattr(ls, f) for f in SLOTS] for ls in layers.values()]
        values = torch.tensor(
            [[[float(getattr(ts, f)) for f in TS_FIELDS] if ts is not None else nan_row
              for ts in row] for row in cells], dtype=torch.float64,
        ).view(len(names), len(SLOTS), len(TS_FIELDS))
        present = torch.tensor([[ts is not None for ts in row] for row in cells],
                               dtype=torch.bool).view(len(names), len(SLOTS))
        return cls(names, values, present)

    # -- Mapping --------------------------------------------------------
    def __getitem__(self, name: str) -> LayerStep:
        return self.layer(self._index[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def layer(self, i: int) -> LayerStep:
        ls = self._made.get(i)
        if ls is None:
            self._make([i])
            ls = self._made[i]
        return ls

    def to_dict(self, keep: list[int] | None = None) -> dict[str, LayerStep]:
        """Plain records of every layer, or of rows ``keep`` (in their order)."""
        rows = list(range(len(self.names))) if keep is None else keep
        self._make([i for i in rows if i not in self._made])
        return {self.names[i]: self._made[i] for i in rows}

    def _make(self, rows: list[int]) -> None:
        """Make the records of ``rows``, with one host read for all of them."""
        if not rows:
            return
        at = torch.tensor(rows)
        data = self.data.index_select(0, at).flatten(1).tolist()
        present = self.present.index_select(0, at).tolist()
        for i, values, has in zip(rows, data, present, strict=True):
            self._made[i] = _layer_step(values, has)

    def keep(self, rows: list[int]) -> KeptLayers:
        """The layers of ``rows`` (in their order), packed for keeping through the run."""
        at = torch.tensor(rows, dtype=torch.long)
        values = array("d", self.data.index_select(0, at).flatten().tolist())
        present = bytes(self.present.index_select(0, at).flatten().tolist())
        return KeptLayers([self.names[i] for i in rows], values, present)

    # -- whole-step questions -------------------------------------------
    def column(self, slot: int, fld: int) -> torch.Tensor:
        """``[layers]`` figure ``fld`` of ``slot`` (NaN where absent)."""
        return self.data[:, slot, fld]

    def flagged(self, slots: tuple[int, ...] = (ACT,)) -> torch.Tensor:
        """``[layers]`` bool: a tensor of ``slots`` overflowed or went non-finite."""
        v = self.data[:, list(slots)]
        return ((v[..., NONFINITE] > 0) | (v[..., OVER] > 0)).any(1)

    def filled(self) -> torch.Tensor:
        """:attr:`data` with each absent unscaled slot holding its scaled slot's figures
        (the step had no loss scale: the gradients as filed are the unscaled ones)."""
        return torch.where(self.present[:, :, None], self.data,
                           self.data.index_select(1, _FALLBACK))

    def where(self, mask: torch.Tensor) -> list[str]:
        """The names of the layers where ``mask`` (``[layers]`` bool) holds, in order."""
        return [self.names[i] for i in mask.nonzero().flatten().tolist()]

    def worst(self, limit: int) -> list[int]:
        """The rows of the ``limit`` riskiest layers, in forward order.

        Risk, worst first: a non-finite value, then the largest overflow, the least
        headroom, the largest underflow, over the outputs, their gradients and the
        parameters' (unscaled) gradients; ties keep forward order.
        """
        n = len(self.names)
        if n <= limit:
            return list(range(n))
        v = self.filled().index_select(1, _RISK_SLOTS)
        nonfinite = v[..., NONFINITE].nan_to_num(0.0).amax(1) > 0
        over = v[..., OVER].nan_to_num(0.0).clamp(min=0.0).amax(1)
        under = v[..., UNDER].nan_to_num(0.0).clamp(min=0.0).amax(1)
        head = torch.where(v[..., HEAD].isnan(), math.inf, v[..., HEAD]).amin(1)
        order = torch.arange(n)
        # Least significant key first: stable sorts keep the earlier keys' order.
        for key in (-under, head, -over, -nonfinite.to(torch.float64)):
            order = order[torch.argsort(key[order], stable=True)]
        return sorted(order[:limit].tolist())


class KeptLayers(Mapping[str, LayerStep]):
    """Some layers of one step, as kept by the history for the whole run.

    As records, a history row's 32 layers are about 150 Python objects (about
    80 KB, each one swept by every full garbage collection, and a run keeps
    512 rows); here their figures are one ``array("d")`` (11.5 KB) and a
    presence mask. A layer's :class:`LayerStep` is made when it is looked up
    (the JSON report, the TensorBoard sink at close), once.
    """

    __slots__ = ("names", "_values", "_present", "_made")

    def __init__(self, names: list[str], values: array[float], present: bytes) -> None:
        self.names = names
        self._values = values
        self._present = present
        self._made: dict[int, LayerStep] = {}

    def __getitem__(self, name: str) -> LayerStep:
        try:
            i = self.names.index(name)
        except ValueError:
            raise KeyError(name) from None
        ls = self._made.get(i)
        if ls is None:
            ls = self._made[i] = self._make(i)
        return ls

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __repr__(self) -> str:
        return f"KeptLayers({dict(self.items())!r})"

    def _make(self, i: int) -> LayerStep:
        n = len(SLOTS) * len(TS_FIELDS)
        return _layer_step(self._values[i * n : (i + 1) * n],
                           self._present[i * len(SLOTS) : (i + 1) * len(SLOTS)])


def _layer_step(values: Sequence[float], present: Sequence[bool | int]) -> LayerStep:
    """One layer's record from its figures, ``len(SLOTS) * len(TS_FIELDS)`` values in
    slot order, and each slot's presence."""
    w = len(TS_FIELDS)
    return LayerStep(*(
        TensorStats(int(values[s * w + NUMEL]), *values[s * w + 1 : (s + 1) * w]) if p else None
        for s, p in enumerate(present)))


def decode_step(hs: HostCopy, fmt: FormatLimits, grad_scale: float | None,
                param_grad_scale: float | None,
                formats: Mapping[str, FormatLimits] | None = None
                ) -> tuple[StepTable, list[StepHists]]:
    """Decode a host step into its :class:`StepTable`, and the rows of its histograms.

    Every figure (a layer's field, and the unscaled view of a scaled gradient) is
    decoded in one batch per format from the copy's one row per (layer, field):
    ``fmt``, or the layer's own in ``formats`` (see ``dtypes.judged_format``).
    """
    formats = formats or {}
    shift_of = {GRAD_U: scale_log2_of(grad_scale), PG_U: scale_log2_of(param_grad_scale)}
    n_slots = len(SLOTS)
    # Comprehensions over the cells, not one loop of appends: a 600-layer step has 2,400.
    items = list(hs.row_of.items())
    names: dict[str, int] = {}  # forward order of first filing
    first = [names.setdefault(name, len(names)) * n_slots for (name, _), _ in items]
    cells = [at + _SLOT_OF[fld][0] for at, ((_, fld), _) in zip(first, items, strict=True)]
    rows = [row for _, row in items]
    shifts = [0] * len(items)
    # A scaled gradient is decoded once more, as if unscaled.
    again = [(k, un) for k, ((_, fld), _) in enumerate(items)
             if (un := _SLOT_OF[fld][1]) is not None and shift_of[un]]
    cells += [first[k] + un for k, un in again]
    rows += [rows[k] for k, _ in again]
    shifts += [shift_of[un] for _, un in again]
    from_item = list(range(len(items))) + [k for k, _ in again]
    hist_cells = [(name, HIST_FIELDS.index(fld), row) for (name, fld), row in items
                  if fld in HIST_FIELDS]
    values = torch.full((len(names) * n_slots, len(TS_FIELDS)), math.nan, dtype=torch.float64)
    present = torch.zeros(len(names) * n_slots, dtype=torch.bool)
    # Cells by the format their layer is judged against (keyed by name: hashing a
    # FormatLimits per cell cost 1.7 ms a GPT step).
    groups: dict[str, tuple[FormatLimits, list[int]]] = {fmt.name: (fmt, list(range(len(cells))))}
    if formats:
        own = [formats.get(name, fmt) for (name, _), _ in items]
        groups = {}
        for c, k in enumerate(from_item):
            groups.setdefault(own[k].name, (own[k], []))[1].append(c)
    for f, pick in groups.values():
        at = torch.tensor([cells[c] for c in pick], dtype=torch.long)
        decoded = S.decode_table(hs.block, f, [shifts[c] for c in pick],
                                 index=[rows[c] for c in pick])
        values.index_copy_(0, at, decoded[:, _TS_COLUMNS])
        present[at] = True
    table = StepTable(list(names), values.view(len(names), n_slots, len(TS_FIELDS)),
                      present.view(len(names), n_slots))
    return table, [StepHists(hs.block, hist_cells)] if hist_cells else []


def first_nonfinite(hs: HostCopy, rows: list[int]) -> int | None:
    """The first of ``rows`` (rows of the host copy's matrix, in filing order) whose
    tensor held inf or NaN (a non-finite min or max), or None."""
    ext = hs.matrix[rows][:, S.MIN:S.MAX + 1]
    hit = (~ext.isfinite()).any(1).nonzero()
    return rows[int(hit[0, 0])] if len(hit) else None
