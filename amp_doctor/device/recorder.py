"""Step boundary: one host copy of the step's device buffer -> a :class:`HostCopy`;
and the run-long sums of every layer's exponent histograms.

This is the only place in the recording path that copies device data to
the host, once per *recorded* step (see :meth:`StepBuffer.flush`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from amp_doctor.device import stats as S
from amp_doctor.devicework import count_sync

__all__ = ["StepBuffer", "HostCopy", "HistSums", "StepHists", "HIST_FIELDS", "merge_rows",
           "scale_log2_of", "AFTER_UNSCALE_BAD_KEY", "AFTER_UNSCALE_FIRST_KEY"]

# Step scalars: how many of the gradients a scaler's step applied went NaN/inf after the
# loop's own unscale_ found none, and the first of them (an index into
# ``StepBuffer.after_unscale_layers``).
AFTER_UNSCALE_BAD_KEY = "after_unscale_bad"
AFTER_UNSCALE_FIRST_KEY = "after_unscale_first"


class StepBuffer:
    """Device-side summaries gathered during one recorded step.

    Per tensor, a hook pays for :meth:`add` (exact min/max and a staged sample,
    see :class:`~amp_doctor.device.stats.Batch`); the histograms of many tensors
    are then counted by one pass per staging buffer, and :meth:`flush` packs
    every row and scalar of the step for a single host copy.
    """

    def __init__(self, step: int, filed_before: dict[torch.device, int] | None = None) -> None:
        """``filed_before``: the bytes the previous recorded step filed, per device, as
        :meth:`flush` leaves them; the staging buffers are sized from it from the
        first tensor on (see ``stats.STAGE_HEAD_START``), and flush updates it."""
        self.step = step
        self._filed_before = filed_before if filed_before is not None else {}
        self.closed = False
        # One batch per device (a model split over devices); rows numbered globally.
        self._batches: dict[torch.device, S.Batch] = {}
        # The device of each row, in insertion order (no tuple per row: a step's
        # thousands of small objects would feed Python's full-heap collections).
        self._where: list[torch.device] = []
        self._scalars: dict[str, torch.Tensor] = {}
        self.assigned: dict[tuple[str, str], list[int]] = {}
        self.backward_order: list[str] = []
        self.param_grads_done: set[str] = set()
        self.param_grads_scaled = False
        # The layer of each gradient AFTER_UNSCALE_FIRST_KEY counts.
        self.after_unscale_layers: list[str] = []
        # Layers called in this step on empty inputs only (an MoE expert no token chose):
        # their weights' gradients are exact zeros that say nothing of their values.
        self.empty_outputs: set[str] = set()

    def add(self, x: torch.Tensor) -> int:
        """Summarise ``x`` (floating point, non-empty, strided); returns its row."""
        dev = x.device
        self._batch(dev).add(x)
        self._where.append(dev)
        return len(self._where) - 1

    def add_many(self, xs: list[torch.Tensor]) -> list[int]:
        """Summarise every tensor of ``xs`` (as :meth:`add` takes them), batched per
        device (see ``Batch.add_many``); returns their rows, in order."""
        rows: list[int] = []
        i = 0
        while i < len(xs):
            dev = xs[i].device
            j = i + 1
            while j < len(xs) and xs[j].device == dev:
                j += 1
            batch = self._batch(dev)
            # Global row = this step's rows before the batch's, plus its row in the batch.
            offset = len(self._where) - len(batch)
            rows.extend(offset + r for r in batch.add_many(xs[i:j]))
            self._where.extend([dev] * (j - i))
            i = j
        return rows

    def _batch(self, dev: torch.device) -> S.Batch:
        batch = self._batches.get(dev)
        if batch is None:
            head = int(self._filed_before.get(dev, 0) * S.STAGE_HEAD_START)
            batch = self._batches[dev] = S.Batch(head_start_bytes=head)
        return batch

    def release(self) -> None:
        """Free the staging buffers until the next :meth:`add` (see ``Batch.release``)."""
        for batch in self._batches.values():
            batch.release()

    def assign(self, layer: str, fld: str, idx: int) -> None:
        self.assigned.setdefault((layer, fld), []).append(idx)

    def note_backward(self, layer: str) -> None:
        self.backward_order.append(layer)

    def put_scalar(self, key: str, value: torch.Tensor) -> None:
        """Keep a device scalar (loss, scale) for the step's single host copy."""
        self._scalars[key] = value.detach().reshape(-1)[:1].to(torch.float64)

    def add_scalar(self, key: str, value: torch.Tensor) -> None:
        """Add ``value`` to the device scalar kept as ``key`` (one op, no sync)."""
        self._scalars[key] = self._scalars[key] + value.detach().reshape(-1)[:1].to(
            device=self._scalars[key].device, dtype=torch.float64)

    def add_applied_after_unscale(self, bad: torch.Tensor, first: torch.Tensor,
                                  layers: list[str]) -> None:
        """One optimizer's gradients made NaN/inf after the loop's unscale_ (``bad``, the
        index of the ``first`` into ``layers``): kept as AFTER_UNSCALE_BAD_KEY and
        AFTER_UNSCALE_FIRST_KEY, summed over the step's optimizers (the first stays the
        first optimizer's that had one). Device ops only."""
        first = first + len(self.after_unscale_layers)
        prev = self._scalars.get(AFTER_UNSCALE_BAD_KEY)
        if prev is None:
            self.put_scalar(AFTER_UNSCALE_BAD_KEY, bad)
            self.put_scalar(AFTER_UNSCALE_FIRST_KEY, first)
        else:
            self.put_scalar(AFTER_UNSCALE_FIRST_KEY, torch.where(
                prev > 0, self._scalars[AFTER_UNSCALE_FIRST_KEY],
                first.reshape(-1)[:1].to(prev.device, torch.float64)))
            self.add_scalar(AFTER_UNSCALE_BAD_KEY, bad)
        self.after_unscale_layers += layers

    def rename(self, mapping: dict[str, str]) -> None:
        """Layers were renamed mid-step (a second model prefixes the first's names)."""
        self.assigned = {(mapping.get(k, k), f): v for (k, f), v in self.assigned.items()}
        self.backward_order = [mapping.get(k, k) for k in self.backward_order]
        self.param_grads_done = {mapping.get(k, k) for k in self.param_grads_done}

    def has_scalar(self, key: str) -> bool:
        return key in self._scalars

    def flush(self) -> HostCopy:
        """The one host sync of a recorded step: copy every summary and scalar at once.

        The step's rows, zero rows for the host's merged rows and, in one more row,
        its scalars make a single matrix (on the CPU it is the host copy itself: no
        copy at all).
        """
        self.closed = True
        keys = list(self._scalars)
        if len(keys) > S.SUMMARY_LEN:
            raise ValueError(f"{len(keys)} step scalars do not fit in one row")
        # Zero rows after the step's rows: the host fills them with the merged rows of
        # fields filed several times, so that one decode reads one matrix.
        spare = merged_count(self.assigned)
        batches = list(self._batches.values())
        if len(batches) == 1:
            matrix = batches[0].finish(extra_rows=spare + 1)
        else:
            # A model split over devices: gather every device's rows on the first.
            parts = [b.finish() for b in batches]
            dev0 = parts[0].device if parts else torch.device("cpu")
            parts.append(torch.zeros(spare + 1, S.SUMMARY_LEN, dtype=torch.float64, device=dev0))
            matrix = torch.cat([p.to(dev0, non_blocking=True) for p in parts])
        if keys:
            matrix[-1, : len(keys)] = torch.cat([self._scalars[k].to(matrix.device)
                                                 for k in keys])
        host = to_host(matrix)
        count_sync()
        hs = unpack_host(host, self)
        self._filed_before.clear()
        self._filed_before.update({dev: b.filed_bytes for dev, b in self._batches.items()})
        self._batches = {}
        self._where = []
        self._scalars = {}
        return hs


def unpack_host(host: torch.Tensor, buf: StepBuffer) -> HostCopy:
    """The host copy of a step -> a :class:`HostCopy` (host data only, no device tensor).

    ``host`` is :meth:`StepBuffer.flush`'s matrix: the rows of every device in
    turn, the spare rows, then the scalar row.
    """
    n_rows = len(buf._where)
    keys = list(buf._scalars)
    scalars = dict(zip(keys, host[-1, : len(keys)].tolist(), strict=True))
    batches = list(buf._batches.items())
    if len(batches) == 1:
        # One device (the usual case): rows are already in insertion order.
        block = host[:-1]
        S.host_rows(block[:n_rows], batches[0][1].numel, batches[0][1].sampled)
    else:
        order: list[int] = []
        numel: list[int] = []
        sampled: list[int] = []
        for dev, batch in batches:
            # Rows were grouped by device; put them back in insertion order.
            order += [i for i, d in enumerate(buf._where) if d == dev]
            numel += batch.numel
            sampled += batch.sampled
        grouped = S.host_rows(host[:n_rows], numel, sampled)
        block = torch.zeros(host.shape[0] - 1, host.shape[1], dtype=host.dtype)
        block[order] = grouped
    # One row per (layer, field): its own, or the merge of its rows in a spare row.
    row_of: dict[tuple[str, str], int] = {}
    groups: list[list[int]] = []
    for key, idx in buf.assigned.items():
        if len(idx) == 1:
            row_of[key] = idx[0]
        else:
            row_of[key] = n_rows + len(groups)
            groups.append(idx)
    if groups:
        merge_rows(block[:n_rows], groups, out=block[n_rows : n_rows + len(groups)])
    return HostCopy(buf.step, block[:n_rows], scalars, row_of, list(buf.backward_order),
                    block[: n_rows + len(groups)],
                    {layer: idx for (layer, fld), idx in buf.assigned.items() if fld == "grad"},
                    {layer: idx for (layer, fld), idx in buf.assigned.items() if fld == "act"})


def merged_count(assigned: dict[tuple[str, str], list[int]]) -> int:
    """How many (layer, field) were filed more than once: the rows to merge on the host."""
    return sum(len(idx) > 1 for idx in assigned.values())


def to_host(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` on the host: the step's single device->host copy.

    On CUDA the copy goes to pinned memory without blocking and the stream is
    synchronized once (the same one sync as ``.cpu()``, without a pageable
    staging copy). On the CPU it is the tensor itself (``.cpu()`` returns it:
    the call is kept so that tests/syncs.py sees the one transfer on the CPU too).
    """
    if flat.device.type == "cpu":
        return flat.cpu()  # the same tensor: no copy
    cuda = flat.device.type == "cuda"
    out = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=cuda)
    out.copy_(flat, non_blocking=cuda)
    if cuda:
        torch.cuda.current_stream(flat.device).synchronize()
    return out


@dataclass
class HostCopy:
    """The host copy of one recorded step (a :class:`~amp_doctor.steps.listeners.StepRows`)."""

    step: int
    matrix: torch.Tensor  # [rows, SUMMARY_LEN] float64, on the host: one per filed tensor
    scalars: dict[str, float]
    # (layer, field) -> its row of ``block``: the tensor's own row, or for a field
    # filed several times (repeated calls, a layer's parameter gradients) their merge.
    row_of: dict[tuple[str, str], int]
    backward_order: list[str]
    block: torch.Tensor  # ``matrix`` followed by the merged rows, in one tensor
    # Each layer's output-gradient rows of ``matrix``, in arrival order (rows are
    # numbered as tensors were filed: a lower row came earlier in the step).
    grad_rows: dict[str, list[int]] = field(default_factory=dict)
    # ... and its output rows, one per call in completion order (a module called twice
    # in the step has two).
    act_rows: dict[str, list[int]] = field(default_factory=dict)

    def merged(self, layer: str, fld: str) -> torch.Tensor | None:
        """One summary row for a layer's field, merging repeated calls (accumulation)."""
        row = self.row_of.get((layer, fld))
        return None if row is None else self.block[row]


def merge_rows(matrix: torch.Tensor, groups: list[list[int]],
               out: torch.Tensor | None = None) -> torch.Tensor:
    """One summary row per group of rows of ``matrix``, as if their tensors were one:
    counts summed, the least min and the greatest max (NaN if any is NaN). All
    groups at once: a layer's parameter gradients, repeated calls. ``out``: the
    rows to write them to (overwritten)."""
    seg = torch.tensor([g for g, idx in enumerate(groups) for _ in idx])
    src = matrix.index_select(0, torch.tensor([i for idx in groups for i in idx]))
    if out is None:
        out = torch.zeros(len(groups), matrix.shape[1], dtype=matrix.dtype)
    else:
        out.zero_()
    out.index_add_(0, seg, src)
    out[:, S.MIN] = torch.full((len(groups),), math.inf, dtype=matrix.dtype).scatter_reduce_(
        0, seg, src[:, S.MIN], "amin")
    out[:, S.MAX] = torch.full((len(groups),), -math.inf, dtype=matrix.dtype).scatter_reduce_(
        0, seg, src[:, S.MAX], "amax")
    return out


def scale_log2_of(scale: float | None) -> int:
    if not scale or not math.isfinite(scale) or scale <= 0:
        return 0
    return round(math.log2(scale))


# The fields whose exponent histograms are summed over the run, in HistSums' order.
HIST_FIELDS = ("act", "grad")
# Rows gathered at once when summing histograms (a 256 x 256 float64 transient).
_HIST_CHUNK = 256
# HistSums' columns before its window: bins 0 and 255.
_EDGE_COLS = 2
# HistSums' window edges are multiples of this many bins.
_WINDOW_ROUND = 8


class StepHists(NamedTuple):
    """A recorded step's histogram rows: ``(layer, HIST_FIELDS index, row of matrix)``."""

    matrix: torch.Tensor
    cells: list[tuple[str, int, int]]


class HistSums:
    """Every layer's exponent histograms summed over the run.

    One ``[layers, len(HIST_FIELDS), columns]`` float32 tensor on the host, updated
    by one ``index_add_`` per recorded step instead of two small tensor ops per
    layer. float32 keeps it half of float64's size, and a bin's sum is exact below
    2**24 and good to about seven digits beyond, far finer than any figure drawn
    from it (fractions, charts).

    The columns are bin 0 (zeros), bin 255 (inf, NaN) and a window of the finite
    bins between, grown to whatever the run populates: a low-precision run fills
    30-40 of the 254 (the benchmark models: 29-40), so a layer costs about 0.3 KB
    for the whole run instead of 2 KB.
    """

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._lo = self._hi = 0  # the window, bins [lo, hi) of 1..254; empty at first
        self._sums = torch.zeros(0, len(HIST_FIELDS), _EDGE_COLS, dtype=torch.float32)

    def add(self, step: StepHists) -> None:
        if not step.cells:
            return
        slots = [self._slot.setdefault(name, len(self._slot)) for name, _, _ in step.cells]
        hist = step.matrix[:, S.HIST :]
        cells = torch.tensor([slot * len(HIST_FIELDS) + f
                              for slot, (_, f, _) in zip(slots, step.cells, strict=True)])
        rows = torch.tensor([r for _, _, r in step.cells])
        # The finite bins the cells' rows populate (a bool gather: 1 byte a bin).
        inner = (hist[:, 1 : S.N_EXP_BINS - 1] > 0).index_select(0, rows).any(0).nonzero()
        self._fit(len(self._slot),
                  (int(inner[0]) + 1, int(inner[-1]) + 2) if inner.numel() else None)
        cols = torch.tensor([0, S.N_EXP_BINS - 1, *range(self._lo, self._hi)])
        sums = self._sums.view(-1, self._sums.shape[-1])
        # In chunks: the gathered rows are a transient copy (float64, then float32).
        for i in range(0, len(rows), _HIST_CHUNK):
            part = hist.index_select(0, rows[i : i + _HIST_CHUNK]).index_select(1, cols)
            sums.index_add_(0, cells[i : i + _HIST_CHUNK], part.float())

    def _fit(self, layers: int, need: tuple[int, int] | None) -> None:
        """Grow the tensor to ``layers`` slots and the window to cover bins
        ``[need[0], need[1])``."""
        lo, hi = self._lo, self._hi
        if need is not None:
            lo, hi = need if hi == lo else (min(lo, need[0]), max(hi, need[1]))
            # Rounded out, so that a run drifting by a bin or two does not regrow it.
            lo = max(1, lo - lo % _WINDOW_ROUND)
            hi = min(S.N_EXP_BINS - 1, hi + (-hi) % _WINDOW_ROUND)
        old = self._sums
        if layers <= old.shape[0] and (lo, hi) == (self._lo, self._hi):
            return
        n = old.shape[0]
        slots = n if layers <= n else max(layers, 2 * n)
        grown = torch.zeros(slots, len(HIST_FIELDS), _EDGE_COLS + hi - lo, dtype=torch.float32)
        grown[:n, :, :_EDGE_COLS] = old[:, :, :_EDGE_COLS]
        if self._hi > self._lo:
            at = _EDGE_COLS + self._lo - lo
            grown[:n, :, at : at + self._hi - self._lo] = old[:, :, _EDGE_COLS:]
        self._sums, self._lo, self._hi = grown, lo, hi

    def of(self, name: str) -> tuple[list[int], list[int]]:
        """The layer's (outputs, output grads) histograms; sampled counts rounded."""
        full = torch.zeros(len(HIST_FIELDS), S.N_EXP_BINS, dtype=torch.int64)
        slot = self._slot.get(name)
        if slot is not None:
            got = self._sums[slot].round().to(torch.int64)
            full[:, 0] = got[:, 0]
            full[:, S.N_EXP_BINS - 1] = got[:, 1]
            full[:, self._lo : self._hi] = got[:, _EDGE_COLS:]
        act, grad = full.tolist()
        return act, grad

    def rename(self, mapping: dict[str, str]) -> None:
        self._slot = {mapping.get(k, k): v for k, v in self._slot.items()}
