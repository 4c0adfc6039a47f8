"""One report from the per-rank sessions of a multi-process (torchrun/DDP) run.

Merging happens through files after the ranks have finished, never through a
collective inside a hook, so ranks that diverge or die cannot deadlock the
run: whatever rank files exist are merged, and missing ranks are named.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import TypeVar

from amp_doctor.records import Event, Finding, LayerSummary, RunInfo, Session
from amp_doctor.runfiles import JSON_NAME
from amp_doctor.sinks.jsonfile import write_json

__all__ = ["rank_env", "rank_dir", "merge_sessions", "merge_run_dir", "wait_for_ranks",
           "RANK_WAIT_S"]

_N = TypeVar("_N", int, float)

# How long rank 0 waits for the other ranks' reports when it merges them.
RANK_WAIT_S = 60.0


def rank_env() -> tuple[int, int] | None:
    """(rank, world_size) when running under torchrun with more than one process."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    return (rank, world) if world > 1 else None


def rank_dir(logdir: Path, rank: int) -> Path:
    return logdir / f"rank{rank}"


def wait_for_ranks(logdir: Path, world: int, timeout: float = RANK_WAIT_S) -> list[Path]:
    """The rank reports that exist, waiting up to ``timeout`` seconds for all of them."""
    deadline = time.monotonic() + timeout
    while True:
        found = [rank_dir(logdir, r) / JSON_NAME for r in range(world)]
        present = [p for p in found if p.exists()]
        if len(present) == world or time.monotonic() > deadline:
            return present
        time.sleep(0.2)


def _worse(a: float | None, b: float | None) -> float | None:
    vals = [v for v in (a, b) if v is not None and not math.isnan(v)]
    return max(vals) if vals else a if a is not None else b


def _least(a: _N | None, b: _N | None) -> _N | None:
    vals = [v for v in (a, b) if v is not None]
    return min(vals) if vals else None


def _merge_layer(items: list[tuple[int, LayerSummary]]) -> LayerSummary:
    """Worst case over ranks, with the rank that showed it in ``worst_rank``."""
    rank0, base = items[0]
    worst_rank, worst = rank0, base
    for r, lay in items[1:]:
        if (lay.overflow_frac, lay.nonfinite_steps, -lay.headroom) > (
                worst.overflow_frac, worst.nonfinite_steps, -worst.headroom):
            worst_rank, worst = r, lay
    merged = dataclasses.replace(worst)
    for _, lay in items:
        merged = dataclasses.replace(
            merged,
            absmax=max(merged.absmax, lay.absmax),
            headroom=min(merged.headroom, lay.headroom),
            underflow_frac=max(merged.underflow_frac, lay.underflow_frac),
            nonfinite_steps=max(merged.nonfinite_steps, lay.nonfinite_steps),
            grad_underflow_frac=_worse(merged.grad_underflow_frac, lay.grad_underflow_frac),
            grad_nonfinite_steps=max(merged.grad_nonfinite_steps, lay.grad_nonfinite_steps),
            param_grad_nonfinite_steps=max(merged.param_grad_nonfinite_steps,
                                           lay.param_grad_nonfinite_steps),
            range_rel=_least(merged.range_rel, lay.range_rel),
            first_overflow_step=_least(merged.first_overflow_step, lay.first_overflow_step),
            input_dtypes=sorted(set(merged.input_dtypes) | set(lay.input_dtypes)),
            output_dtypes=sorted(set(merged.output_dtypes) | set(lay.output_dtypes)),
        )
    # A mask on every rank stays one; -inf-only steps on one rank beside others' overflow
    # do not make the merged layer a mask.
    masked = all(lay.neg_inf_steps == lay.nonfinite_steps for _, lay in items)
    return dataclasses.replace(merged, worst_rank=worst_rank,
                               neg_inf_steps=merged.nonfinite_steps if masked else 0)


def merge_sessions(sessions: dict[int, Session], world: int | None = None) -> Session:
    """Merge per-rank sessions; rank 0's (or the lowest rank's) scale timeline is kept.

    Every rank runs the same GradScaler decisions (DDP all-reduces the
    gradients before the inf check), so one timeline speaks for all.
    """
    if not sessions:
        raise ValueError("no rank reports to merge")
    ranks = sorted(sessions)
    first = sessions[ranks[0]]
    by_name: dict[str, list[tuple[int, LayerSummary]]] = {}
    order: list[str] = []
    for r in ranks:
        for lay in sessions[r].layers:
            if lay.name not in by_name:
                order.append(lay.name)
            by_name.setdefault(lay.name, []).append((r, lay))
    layers = [_merge_layer(by_name[n]) for n in order]

    grouped: dict[tuple[str, str | None, str | None], list[tuple[int, Finding]]] = {}
    for r in ranks:
        for f in sessions[r].findings:
            grouped.setdefault((f.kind, f.module, f.op), []).append((r, f))
    findings: list[Finding] = []
    for items in grouped.values():
        # Show the occurrence from the rank that saw it first (lowest step).
        r0, f0 = min(items, key=lambda it: (it[1].step if it[1].step is not None else 1 << 60,
                                           it[0]))
        seen = sorted({r for r, _ in items})
        where = "" if len(seen) == len(ranks) > 1 else f" [rank {', '.join(map(str, seen))}]"
        findings.append(dataclasses.replace(f0, rank=r0, ranks=seen,
                                            message=f0.message + where))
    findings.sort(key=lambda f: ({"error": 0, "warning": 1, "info": 2}[f.severity],
                                 f.step if f.step is not None else 0))
    events: list[Event] = []
    for r in ranks:
        events.extend(dataclasses.replace(e, data={**e.data, "rank": r})
                      for e in sessions[r].events)
    missing = sorted(set(range(world or len(ranks))) - set(ranks))
    codes = [sessions[r].run.exit_code for r in ranks if sessions[r].run.exit_code]
    outcomes = [sessions[r].run.outcome for r in ranks if sessions[r].run.outcome != "completed"]
    run = RunInfo(
        **{**first.run.__dict__,
           "exit_code": codes[0] if codes else first.run.exit_code,
           "outcome": outcomes[0] if outcomes else first.run.outcome,
           "error": "; ".join(
               [f"rank {r}: {sessions[r].run.error}" for r in ranks if sessions[r].run.error]
               + ([f"no report from rank(s) {missing} (crashed or killed?)"] if missing else [])
           ) or None,
           "rank": None, "world_size": world or len(ranks)},
    )
    return Session(
        version=first.version, amp=first.amp,
        steps=max(s.steps for s in sessions.values()),
        recorded_steps=max(s.recorded_steps for s in sessions.values()),
        layers=layers, scaler=first.scaler, history=first.history, events=events,
        findings=findings, run=run, heatmaps=first.heatmaps,
    )


def merge_run_dir(logdir: Path, world: int, timeout: float = RANK_WAIT_S) -> Session | None:
    """Merge ``<logdir>/rank<k>/amp_doctor.json`` into ``<logdir>/amp_doctor.json``."""
    paths = wait_for_ranks(logdir, world, timeout)
    sessions = {}
    for p in paths:
        try:
            sessions[int(p.parent.name.removeprefix("rank"))] = Session.load(p)
        except (OSError, ValueError):  # ReportFormatError is a ValueError
            continue  # a rank whose report is unreadable: merge the others
    if not sessions:
        return None
    merged = merge_sessions(sessions, world)
    # Atomic, as every report file: a reader never sees half a merged report.
    write_json(merged, logdir / JSON_NAME)
    return merged
