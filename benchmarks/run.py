"""amp-doctor overhead benchmark (issue 8): ``python benchmarks/run.py`` / ``make bench``.

Times one training step (forward + backward + optimizer step, with
``GradScaler`` under float16) of the sample models with nothing attached
(plain AMP, the 1.00x reference), with amp-doctor attached in its modes, and
with three baselines: a naive per-module stats hook that calls ``.item()`` per
statistic, ``torch.autograd.detect_anomaly``, and an empty ``TorchDispatchMode``
(the floor of any per-op checker written in Python). All variants run in one
process, interleaved in rounds, each on its own copy of the same initial
model and the same fixed batches. See ``benchmarks/results.md``.

Method, in short (the module docstrings of the helpers say more):

* per round, per variant (order rotated each round): attach, ``--warmup``
  untimed steps, ``--steps`` timed steps, detach;
* a step is timed whole by ``--clock``: on one torch thread the process's CPU time
  (``time.process_time``, which other processes on a shared machine do not inflate),
  otherwise ``time.perf_counter`` (CUDA: a pair of
  ``torch.cuda.Event`` recorded around it, read after the step);
* step cost: a low quantile of the step times (``--stat low``: the 10th percentile;
  ``--stat median``); for a variant that records one step in N it is the amortized
  cost ``(1/N) * q(recorded) + (1-1/N) * q(unrecorded)``, i.e. the per-step cost of a
  long run. Why low, not the median: on a shared virtual machine, other guests only ever
  *add* time to a step (steal, cache and memory-bandwidth contention, even in the
  process's CPU time), in bursts that cover some steps and not others. A transformer
  step timed 4,000 times in a row here had a median that wandered from 6.2 to 10.2 ms
  between blocks of 200 steps while each block's fastest step stayed at 6.05-6.3 ms
  (``benchmarks/README.md``, Method and noise). The low quantile measures the work a
  step does; the median measures the neighbours;
* ratio: the median over the rounds of cost / plain's cost in the same round (the
  machine's speed drifts over minutes); spread: min-max of the per-round ratios;
* peak memory: a separate untimed pass per variant; peak live tensor bytes of the
  whole run from the torch profiler's allocator events (CPU) or
  ``torch.cuda.max_memory_allocated`` (CUDA), see ``bench_memory``;
* host syncs: a separate untimed pass per variant of ``max(every)`` steps under
  ``tests/syncs.py``'s :class:`SyncCounter`, which patches ``Tensor.item``,
  ``.tolist``, ``.cpu``, ``.numpy``, ``__bool__``, ``nonzero``, ... and counts every
  call made from amp-doctor's code (on CUDA it also turns on
  ``torch.cuda.set_sync_debug_mode("warn")``): independent of amp-doctor's own
  counter, so a sync nobody counted still shows. The baselines report their own
  count (the naive hook's ``.item()`` calls).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_memory
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_models import DTYPES, SPECS, Trainer, Workload
from bench_variants import VARIANTS, Attached, Variant
from syncs import SyncCounter  # tests/syncs.py: the independent count
from tabulate import tabulate

from amp_doctor.watch import DEFAULT_EVERY

LOW_QUANTILE = 0.10  # --stat low: the step time 10% of the steps beat
MEMORY_TARGET = 0.10  # peak memory overhead vs plain, issue 8
SYNC_TARGET = 1.0  # host syncs per recorded step
AMP_DOCTOR_VARIANTS = ("default", "every1", "anomaly")
COLUMNS = ["model", "dtype", "variant", "ms/step", "x plain", "spread (rounds)",
           "peak mem vs plain", "host syncs / recorded step", "recorded", "targets"]


# -- measurement ---------------------------------------------------------------
def low_quantile(times: list[float]) -> float:
    """The :data:`LOW_QUANTILE` quantile of ``times`` (linear interpolation): a
    statistic that one stray fast or slow step does not move, and that the bursts of a
    shared machine's interference (which only add time) leave alone."""
    xs = sorted(times)
    pos = LOW_QUANTILE * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


STATS: dict[str, Callable[[list[float]], float]] = {
    "low": low_quantile, "median": statistics.median}


@dataclass
class VariantRun:
    """Everything measured for one variant in one (device, model, dtype) cell."""

    variant: Variant
    rounds: list[list[float]] = field(default_factory=list)  # seconds, per timed step
    flags: list[list[bool]] = field(default_factory=list)  # step was recorded
    syncs: int | None = 0  # in the sync pass
    sync_pass_recorded: int = 0
    attach_s: list[float] = field(default_factory=list)
    stat: str = "low"  # a key of STATS: how a list of step times becomes one figure
    close_s: list[float] = field(default_factory=list)
    memory: dict[str, Any] | None = None

    @property
    def times(self) -> list[float]:
        return [t for r in self.rounds for t in r]

    @property
    def all_flags(self) -> list[bool]:
        return [f for r in self.flags for f in r]

    def cost(self, times: list[float] | None = None, flags: list[bool] | None = None) -> float:
        return step_cost(self.times if times is None else times,
                         self.all_flags if flags is None else flags, self.variant.every,
                         STATS[self.stat])

    def split_costs(self, rounds: list[list[float]] | None = None,
                    flags: list[list[bool]] | None = None) -> tuple[float | None, float | None]:
        """The statistic of recorded and of unrecorded step times (seconds), for
        sampled variants: of all rounds, or of the ``rounds`` given with their ``flags``."""
        stat = STATS[self.stat]
        times = [t for r in (self.rounds if rounds is None else rounds) for t in r]
        marks = [f for r in (self.flags if flags is None else flags) for f in r]
        rec = [t for t, f in zip(times, marks, strict=True) if f]
        un = [t for t, f in zip(times, marks, strict=True) if not f]
        return (stat(rec) if rec else None, stat(un) if un else None)


def step_cost(times: list[float], flags: list[bool], every: int,
              stat: Callable[[list[float]], float] = low_quantile) -> float:
    """One step's cost; amortized over recorded/unrecorded steps for a sampled variant.

    One statistic over all the steps would hide the 1-in-N recorded step entirely; a
    plain mean would let one stray scheduler hiccup dominate. Weighting the statistic of
    each kind of step by the sampling rate gives the long-run average cost, robustly.
    """
    rec = [t for t, f in zip(times, flags, strict=True) if f]
    un = [t for t, f in zip(times, flags, strict=True) if not f]
    if every <= 1 or not rec or not un:
        return stat(times)
    share = 1.0 / every
    return share * stat(rec) + (1.0 - share) * stat(un)


@dataclass
class Cell:
    device: str
    model: str
    dtype: str
    batch_size: int
    runs: dict[str, VariantRun]
    notes: list[str] = field(default_factory=list)

    def ratio(self, key: str) -> float:
        """The median of the rounds' ratios: a round compares blocks run a few seconds
        apart, while the machine's speed can drift by half over minutes (a shared
        machine's plain step went from 6.5 to 10.6 ms between two runs); one statistic
        over all rounds would compare a variant's slow-phase blocks with plain's
        fast-phase ones."""
        return 1.0 if key == "plain" else statistics.median(self.round_ratios(key))

    def split_ratios(self, key: str) -> tuple[float | None, float | None]:
        """(recorded, unrecorded) step costs of ``key`` as ratios to plain's, the
        median over the rounds (as :meth:`ratio`)."""
        run, plain = self.runs[key], self.runs["plain"]
        rec: list[float] = []
        un: list[float] = []
        for rt, rf, pt, pf in zip(run.rounds, run.flags, plain.rounds, plain.flags,
                                  strict=True):
            base = plain.cost(pt, pf)
            r, u = run.split_costs([rt], [rf])
            if r is not None:
                rec.append(r / base)
            if u is not None:
                un.append(u / base)
        return (statistics.median(rec) if rec else None,
                statistics.median(un) if un else None)

    def round_ratios(self, key: str) -> list[float]:
        run, plain = self.runs[key], self.runs["plain"]
        return [
            run.cost(rt, rf) / plain.cost(pt, pf)
            for rt, rf, pt, pf in zip(run.rounds, run.flags, plain.rounds, plain.flags,
                                      strict=True)
        ]

    def mem_overhead(self, key: str) -> float | None:
        m, p = self.runs[key].memory, self.runs["plain"].memory
        if not m or not p or p["tensor_peak"] <= 0:
            return None
        return float(m["tensor_peak"] / p["tensor_peak"] - 1.0)

    def syncs_per_recorded(self, key: str) -> float | None:
        run = self.runs[key]
        if run.syncs is None or not run.sync_pass_recorded:
            return None
        return run.syncs / run.sync_pass_recorded


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_clock(name: str) -> Callable[[], float]:
    """The clock that times a CPU step: ``wall`` (``time.perf_counter``) or ``cpu``
    (``time.process_time``: the CPU time of every thread of this process, so the other
    processes on a shared machine's cores do not inflate it, and work that amp-doctor
    or torch did in a thread of its own is still counted). ``auto``: ``cpu`` with one
    torch thread, where the whole step runs on the CPU, in this process; wall time
    otherwise (idle intra-op workers spin, and a step's wall time is what counts)."""
    if name == "auto":
        name = "cpu" if torch.get_num_threads() == 1 else "wall"
    return time.process_time if name == "cpu" else time.perf_counter


def time_block(run: VariantRun, trainer: Trainer, warmup: int, steps: int,
               clock: Callable[[], float] = time.perf_counter) -> None:
    """Attach, warm up, time ``steps`` whole steps, detach: one block of one round.
    ``clock`` times a CPU step (:func:`cpu_clock`); attach and close are wall time."""
    gc.collect()  # garbage of the previous block is not this variant's cost
    dev = trainer.device
    t0 = time.perf_counter()
    attached: Attached = run.variant.attach(trainer)
    run.attach_s.append(time.perf_counter() - t0)
    try:
        for _ in range(warmup):
            trainer.step()
        _sync(dev)
        times: list[float] = []
        flags: list[bool] = []
        cuda = dev.type == "cuda"
        for _ in range(steps):
            before = attached.recorded()
            if cuda:
                # Device time of the whole step, recorded in the stream.
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                trainer.step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = clock()
                trainer.step()
                times.append(clock() - t)
            flags.append(attached.recorded() > before)
        run.rounds.append(times)
        run.flags.append(flags)
    finally:
        t0 = time.perf_counter()
        attached.close()
        run.close_s.append(time.perf_counter() - t0)


def count_syncs(variant: Variant, trainer: Trainer, steps: int) -> tuple[int | None, int]:
    """Host syncs in ``steps`` untimed steps, and the steps recorded among them.

    amp-doctor's variants are counted by :class:`SyncCounter` (patched tensor
    methods, and CUDA's sync debug mode), never by amp-doctor's own counter; the
    baselines report their own count (None: not countable).
    """
    attached = variant.attach(trainer)
    try:
        for _ in range(2):
            trainer.step()
        _sync(trainer.device)
        rec0 = attached.recorded()
        if variant.key in AMP_DOCTOR_VARIANTS:
            with SyncCounter() as counter:
                for _ in range(steps):
                    trainer.step()
                _sync(trainer.device)
            n: int | None = len(counter)
        else:
            s0 = attached.syncs()
            for _ in range(steps):
                trainer.step()
            s1 = attached.syncs()
            n = None if s0 is None or s1 is None else s1 - s0
        return n, attached.recorded() - rec0
    finally:
        attached.close()


def run_cell(device: torch.device, model: str, dtype: str, variants: list[Variant],
             args: argparse.Namespace, log: Callable[[str], None]) -> Cell:
    work = Workload(SPECS[model], dtype, device, args.batch_size)
    trainers = {v.key: work.trainer() for v in variants}
    cell = Cell(device.type, model, dtype, work.batch_size,
                {v.key: VariantRun(v, stat=args.stat) for v in variants})
    for r in range(args.rounds):
        # Rotate the order so no variant always runs right after the same one.
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            time_block(cell.runs[v.key], trainers[v.key], args.warmup, args.steps,
                       cpu_clock(args.clock))
        plain = cell.runs["plain"]
        log(f"  {device.type} {model} {dtype}: round {r + 1}/{args.rounds} done "
            f"(plain {1e3 * statistics.median(plain.rounds[-1]):.1f} ms/step)")
    # One full sampling period of the sparsest variant: each records at least one step.
    n_steps = max(v.every for v in variants)
    for v in variants:
        run = cell.runs[v.key]
        run.syncs, run.sync_pass_recorded = count_syncs(v, trainers[v.key], n_steps)
    if not args.no_memory:
        for v in variants:
            cell.runs[v.key].memory = bench_memory.measure(work, v, args.mem_steps)
        log(f"  {device.type} {model} {dtype}: memory pass done")
    for v in variants:
        sampled = v.every > 1
        if sampled and args.steps % v.every:
            cell.notes.append(
                f"{v.label}: --steps {args.steps} is not a multiple of {v.every}; "
                f"its recorded share in the timed steps is not 1/{v.every}.")
        run = cell.runs[v.key]
        if sampled and not any(run.all_flags):
            cell.notes.append(f"{v.label}: no recorded step among the timed steps; "
                              "its figure is the unrecorded-step cost only.")
    return cell


# -- output --------------------------------------------------------------------
def _fmt_mem(cell: Cell, key: str) -> str:
    run = cell.runs[key]
    plain = cell.runs["plain"].memory
    if run.memory is None or plain is None:
        return "not measured"
    if key == "plain":
        return f"{run.memory['tensor_peak'] / 2**20:.1f} MB (ref)"
    over = cell.mem_overhead(key)
    if over is None:
        return "n/a"
    delta = run.memory["tensor_peak"] - plain["tensor_peak"]
    return f"{100 * over:+.1f}% ({delta / 2**20:+.2f} MB)"


def _fmt_syncs(cell: Cell, key: str) -> str:
    if key == "plain":
        return "0 (ref)" if cell.device == "cuda" else "0"
    value = cell.syncs_per_recorded(key)
    if value is None:
        if key == "detect_anomaly" and cell.device == "cpu":
            return "not countable on CPU"
        return "n/a"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def _fmt_recorded(cell: Cell, key: str) -> str:
    run = cell.runs[key]
    if key == "plain":
        return "-"
    return f"{sum(run.all_flags)}/{len(run.times)}"


def targets_missed(cell: Cell, key: str) -> list[str]:
    """Issue 8's targets this variant misses, as short phrases ([] = all met)."""
    v = cell.runs[key].variant
    if v.target is None or key not in AMP_DOCTOR_VARIANTS:
        return []
    missed = []
    ratio = cell.ratio(key)
    if ratio > v.target:
        missed.append(f"time {ratio:.2f}x > {v.target:.2f}x")
    mem = cell.mem_overhead(key)
    if mem is not None and mem > MEMORY_TARGET:
        missed.append(f"mem {100 * mem:+.0f}% > +{100 * MEMORY_TARGET:.0f}%")
    syncs = cell.syncs_per_recorded(key)
    if syncs is not None and syncs > SYNC_TARGET:
        missed.append(f"syncs {syncs:.2f} > {SYNC_TARGET:.0f}")
    return missed


def _recorded_ratio(cell: Cell, key: str) -> tuple[float | None, float | None]:
    """(recorded, unrecorded) step costs of ``key`` as ratios to plain's cost."""
    return cell.split_ratios(key)


def floor_notes(cell: Cell) -> list[str]:
    """For each missed time target of ``cell``, the measured floors beneath it.

    The floors read the same tensors as ``watch(every=1)``: hooks that do nothing, one
    copy of each tensor's sample (the least a design pays that reads every tensor from
    a Python hook), and amp-doctor's device ops. A sampled variant's cost is its
    unrecorded steps' plus one recorded step in ``every``: its floor is that of a
    recorded step divided by ``every``.
    """
    r = {k: cell.ratio(k) for k in ("empty_hooks", "copy_floor", "stats_floor")
         if k in cell.runs}
    if len(r) < 3:
        return []
    hooks, copy, dev = r["empty_hooks"], r["copy_floor"], r["stats_floor"]
    where = f"{cell.model} {cell.dtype}"
    out = []
    for key in AMP_DOCTOR_VARIANTS:
        if key not in cell.runs:
            continue
        v = cell.runs[key].variant
        ratio = cell.ratio(key)
        if v.target is None or ratio <= v.target:
            continue
        head = f"{where}, {v.label}: {ratio:.2f}x > {v.target:.2f}x."
        if key == "every1":
            text = (f"{head} Floors: hooks alone {hooks:.2f}x, reading each tensor once "
                    f"{copy:.2f}x, amp-doctor's device ops {dev:.2f}x; the rest, "
                    f"{ratio - dev:+.2f}x, is host-side bookkeeping.")
            if copy > v.target:
                text += (" The read-once floor is above the target: no design that reads "
                         "every tensor from a Python hook meets it here.")
            out.append(text)
            continue
        n = v.every
        rec, un = _recorded_ratio(cell, key)
        if rec is None or un is None:
            continue
        best_copy, best_dev = 1 + (copy - 1) / n, 1 + (dev - 1) / n
        text = (f"{head} Unrecorded steps {un:.2f}x, recorded steps {rec:.2f}x (one in "
                f"{n}). With unrecorded steps free and recorded ones at a floor, it would "
                f"be {best_copy:.2f}x (read once) or {best_dev:.2f}x (device ops).")
        if key == "anomaly" and "default" in cell.runs:
            _, un_default = _recorded_ratio(cell, "default")
            if un_default is not None:
                text += (f" Its per-step check: unrecorded steps {un:.2f}x against the "
                         f"default's {un_default:.2f}x.")
        if best_copy > v.target:
            text += " The read-once floor alone misses the target."
        out.append(text)
    return out


def _fmt_targets(cell: Cell, key: str) -> str:
    v = cell.runs[key].variant
    if v.target is None:
        return "reference" if key == "plain" else "baseline"
    missed = targets_missed(cell, key)
    return "met" if not missed else "MISSED: " + "; ".join(missed)


def table_rows(cells: list[Cell]) -> list[list[str]]:
    rows = []
    for cell in cells:
        dtype = cell.dtype if cell.device == "cpu" else f"{cell.device} {cell.dtype}"
        for key, run in cell.runs.items():
            ratios = cell.round_ratios(key)
            rows.append([
                f"{cell.model} (bs {cell.batch_size})", dtype, run.variant.label,
                f"{1e3 * run.cost():.1f}",
                f"{cell.ratio(key):.2f}x",
                "-" if key == "plain" else f"{min(ratios):.2f}-{max(ratios):.2f}x",
                _fmt_mem(cell, key), _fmt_syncs(cell, key), _fmt_recorded(cell, key),
                _fmt_targets(cell, key),
            ])
    return rows


def detail_rows(cells: list[Cell]) -> list[list[str]]:
    """Recorded vs unrecorded step costs, one-off attach/close costs, Python heap."""
    rows = []
    for cell in cells:
        for key, run in cell.runs.items():
            if key == "plain":
                continue
            rec, un = run.split_costs()
            rec_x, un_x = cell.split_ratios(key)
            rows.append([
                cell.model, cell.dtype if cell.device == "cpu" else f"{cell.device} {cell.dtype}",
                run.variant.label,
                "-" if un is None else f"{1e3 * un:.1f} ({un_x:.2f}x)",
                "-" if rec is None else f"{1e3 * rec:.1f} ({rec_x:.2f}x)",
                f"{1e3 * statistics.median(run.attach_s):.1f}",
                f"{1e3 * statistics.median(run.close_s):.1f}",
                _fmt_py_heap(cell, key),
            ])
    return rows


DETAIL_COLUMNS = ["model", "dtype", "variant", "unrecorded step ms (x plain)",
                  "recorded step ms (x plain)", "attach ms", "close ms",
                  "Python heap peak vs plain"]


def _fmt_py_heap(cell: Cell, key: str) -> str:
    m, p = cell.runs[key].memory, cell.runs["plain"].memory
    if m is None or p is None:
        return "not measured"
    return f"{(m['python_peak'] - p['python_peak']) / 2**20:+.2f} MB"


def environment() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg_start": os.getloadavg()[0],
    }


def markdown(env: dict[str, Any], args: argparse.Namespace, cells: list[Cell]) -> str:
    lines = [
        "# amp-doctor overhead benchmark: measured run",
        "",
        f"- date: {env['date']}",
        f"- machine: {env['cpu']}, {env['nproc']} CPUs (torch threads: {env['torch_threads']}), "
        f"{env['platform']}",
        f"- GPU: {env['cuda'] or 'none'}",
        f"- torch {env['torch']}, Python {env['python']}",
        f"- load average (1 min) at start / end: {env['loadavg_start']:.2f} / "
        f"{env['loadavg_end']:.2f}",
        f"- command: `{env['command']}`",
        f"- settings: {args.rounds} rounds x {args.steps} timed steps per variant "
        f"(after {args.warmup} warm-up steps per block), memory: {args.mem_steps} steps "
        "per variant in a subprocess",
        f"- CPU step time: {env.get('clock', 'wall time (time.perf_counter)')}; CUDA step "
        "time: torch.cuda.Event pairs",
        f"- a variant's step cost: {env.get('stat', 'the median')} of its step times "
        "(recorded and unrecorded steps apart, weighted by the sampling rate)",
        "",
        tabulate(table_rows(cells), headers=COLUMNS, tablefmt="github"),
        "",
        "Recorded and unrecorded steps, and one-off costs per attach/close:",
        "",
        tabulate(detail_rows(cells), headers=DETAIL_COLUMNS, tablefmt="github"),
        "",
    ]
    notes = [n for c in cells for n in c.notes]
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    floors = [n for c in cells for n in floor_notes(c)]
    if floors:
        lines += ["Where a time target is missed, the measured floors beneath it "
                  "(`run.py: floor_notes`):", ""] + [f"- {n}" for n in floors] + [""]
    return "\n".join(lines)


def as_json(env: dict[str, Any], cells: list[Cell]) -> dict[str, Any]:
    out_cells = []
    for cell in cells:
        variants = {}
        for key, run in cell.runs.items():
            rec, un = run.split_costs()
            variants[key] = {
                "label": run.variant.label,
                "cost_ms": 1e3 * run.cost(),
                "ratio": cell.ratio(key),
                "round_ratios": cell.round_ratios(key),
                "recorded_step_ms": None if rec is None else 1e3 * rec,
                "unrecorded_step_ms": None if un is None else 1e3 * un,
                "timed_steps": len(run.times),
                "recorded_steps": sum(run.all_flags),
                "syncs": run.syncs,
                "sync_pass_recorded_steps": run.sync_pass_recorded,
                "syncs_per_recorded_step": cell.syncs_per_recorded(key),
                "memory": run.memory,
                "memory_overhead": cell.mem_overhead(key),
                "targets_missed": targets_missed(cell, key),
                "attach_ms": [1e3 * s for s in run.attach_s],
                "close_ms": [1e3 * s for s in run.close_s],
                "times_ms": [[1e3 * t for t in r] for r in run.rounds],
            }
        out_cells.append({"device": cell.device, "model": cell.model, "dtype": cell.dtype,
                          "batch_size": cell.batch_size, "notes": cell.notes,
                          "variants": variants})
    return {"environment": env, "cells": out_cells}


# -- CLI -----------------------------------------------------------------------
def _csv(choices: list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return items

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="amp-doctor overhead benchmark (issue 8)")
    p.add_argument("--models", type=_csv(list(SPECS)), default=list(SPECS))
    p.add_argument("--dtypes", type=_csv(list(DTYPES)), default=list(DTYPES))
    p.add_argument("--variants", type=_csv(list(VARIANTS)), default=list(VARIANTS),
                   help="subset to time; plain is always included")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CPU, plus CUDA when a GPU is present")
    p.add_argument("--steps", type=int, default=20,
                   help="timed steps per variant per round (a multiple of 10 keeps the "
                        "1-in-10 sampling of watch() default exact)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=None,
                   help="override the per-model batch size (cnn 128, transformer 32)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto",
                   help="what times a CPU step: the process's CPU time (not inflated by "
                        "other processes) or wall time; auto: CPU time with one torch "
                        "thread, else wall (CUDA steps: torch.cuda.Event)")
    p.add_argument("--stat", choices=sorted(STATS), default="low",
                   help="how a variant's step times become its cost: low, the "
                        f"{LOW_QUANTILE * 100:.0f}%% quantile (other guests of a shared machine "
                        "only add time, in bursts), or median")
    p.add_argument("--mem-steps", type=int, default=DEFAULT_EVERY + 1,
                   help="steps of the memory pass; the default records steps 0 and "
                        f"{DEFAULT_EVERY} of watch() default, the second with the run-long "
                        "aggregates already allocated")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--markdown", type=Path, default=None, help="also write a markdown report")
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.mem_steps < 1:
        p.error("--steps, --rounds and --mem-steps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    devices = ["cpu"]
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("benchmark: --device cuda but torch.cuda.is_available() is False")
        devices = ["cuda"] if args.device == "cuda" else ["cpu", "cuda"]

    variants = [VARIANTS["plain"]] + [VARIANTS[k] for k in args.variants if k != "plain"]

    env = environment()
    if env["loadavg_start"] > 0.5 * (env["nproc"] or 1):
        # Other processes on the cores stretch OpenMP barriers: ratios become noise.
        print(f"note: load average {env['loadavg_start']:.2f} on {env['nproc']} CPUs: the "
              "machine is busy and timings will be noisy (--threads 1 is more robust).")
    env["command"] = " ".join(["python", "benchmarks/run.py", *(argv or sys.argv[1:])])
    env["clock"] = ("process CPU time (time.process_time)"
                    if cpu_clock(args.clock) is time.process_time
                    else "wall time (time.perf_counter)")
    env["stat"] = (f"the {LOW_QUANTILE:.0%} quantile" if args.stat == "low"
                   else "the median")
    cells: list[Cell] = []
    for device in devices:
        for model in args.models:
            for dtype in args.dtypes:
                if SPECS[model].dtypes is not None and dtype not in SPECS[model].dtypes:
                    continue
                cells.append(run_cell(torch.device(device), model, dtype, variants, args, log))

    env["loadavg_end"] = os.getloadavg()[0]

    print(tabulate(table_rows(cells), headers=COLUMNS, tablefmt="github"))
    print()
    print(tabulate(detail_rows(cells), headers=DETAIL_COLUMNS, tablefmt="github"))
    for note in (n for c in cells for n in c.notes):
        print(f"note: {note}")
    print(f"\n{env['date']}; torch {env['torch']}; {env['cpu']}, {env['nproc']} CPUs; "
          f"load average {env['loadavg_start']:.2f} -> {env['loadavg_end']:.2f}. "
          "ms/step of sampled variants is the amortized per-step cost.")
    if args.markdown:
        args.markdown.write_text(markdown(env, args, cells))
    if args.json:
        args.json.write_text(json.dumps(as_json(env, cells), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
