"""The work a recorded step adds, counted rather than timed:
``python benchmarks/count_work.py [--models transformer,cnn,gpt]``.

Per model (float16, one thread): the aten ops of a ``watch(every=1)`` step
(``torch.profiler``, every op) and its Python function calls (``cProfile``), minus
those of a plain AMP step. Unlike step times these counts do not move with the
machine's load, so two commits compare on a shared machine: run it with a worktree of
each first on ``PYTHONPATH``. The values each tensor's histogram reads are not in the
counts (``stats.SAMPLE_LIMIT`` bounds them).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats

import torch
from bench_models import SPECS, Trainer, Workload
from torch.profiler import ProfilerActivity, profile

import amp_doctor


def per_step(tr: Trainer, steps: int, watched: bool) -> tuple[float, float]:
    """(aten ops, Python calls) per step of ``tr``, under ``watch(every=1)`` or plain."""
    ctx = amp_doctor.watch(tr.model, every=1, tensorboard=False) if watched else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for _ in range(3):
            tr.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                tr.step()
        ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            tr.step()
        pr.disable()
        calls = pstats.Stats(pr).total_calls  # type: ignore[attr-defined]
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return ops / steps, calls / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="transformer,cnn,gpt")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {}
    for key in args.models.split(","):
        work = Workload(SPECS[key], "float16", torch.device("cpu"))
        steps = 5 if key == "gpt" else 10
        p_ops, p_calls = per_step(work.trainer(), steps, False)
        w_ops, w_calls = per_step(work.trainer(), steps, True)
        out[key] = {"aten_ops_added": round(w_ops - p_ops),
                    "python_calls_added": round(w_calls - p_calls),
                    "plain_aten_ops": round(p_ops), "plain_python_calls": round(p_calls)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
