"""What filing a plain tensor outside ``own_ops`` buys: one process, interleaved rounds.

``python benchmarks/bench_guard.py [--models gpt,transformer] [--rounds 5] [--steps 4]``

``own_ops`` (``amp_doctor.devicework``) keeps the user's autocast, default device and
tensor subclasses away from amp-doctor's work, and marks it for anomaly mode. Entering
and leaving it costs 3-6 us, about a third of filing a small tensor; since it is
entered only where it is needed (``_OwnOps.needed_for``: a tensor subclass, a dispatch
mode, and the ops that make tensors), a plain tensor's own ops do without it. This
harness times ``watch(every=1)`` as shipped against the same watch with the guard forced
around every filed tensor (the behaviour before), and plain AMP, on their own copies of
the model, in interleaved rounds of one process, by thread CPU time: only the guard
changes between the two watched copies. Ratios are medians of the rounds' medians; the
difference is taken within each round, so that the machine's drift between rounds cancels.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from bench_models import SPECS, Trainer, Workload
from tabulate import tabulate

import amp_doctor
from amp_doctor.devicework import own_ops

_GUARD = type(own_ops)
_AS_SHIPPED = _GUARD.__dict__["needed_for"]
_ALWAYS = staticmethod(lambda t: True)


def _median_step(tr: Trainer, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.thread_time()
        tr.step()
        times.append(time.thread_time() - t)
    return statistics.median(times)


def measure(model: str, dtype: str, rounds: int, steps: int) -> dict[str, Any]:
    work = Workload(SPECS[model], dtype, torch.device("cpu"), None)
    plain, forced, shipped = work.trainer(), work.trainer(), work.trainer()
    watches = [amp_doctor.watch(forced.model, every=1), amp_doctor.watch(shipped.model, every=1)]
    times: dict[str, list[float]] = {"plain": [], "forced": [], "shipped": []}
    try:
        for tr in (plain, forced, shipped):  # warm-up: the first steps allocate
            tr.step()
            tr.step()
        for _ in range(rounds):
            times["plain"].append(_median_step(plain, steps))
            _GUARD.needed_for = _ALWAYS  # type: ignore[method-assign]
            try:
                times["forced"].append(_median_step(forced, steps))
            finally:
                _GUARD.needed_for = _AS_SHIPPED  # type: ignore[method-assign]
            times["shipped"].append(_median_step(shipped, steps))
    finally:
        for w in watches:
            w.close()
    ratios = {k: [v / p for v, p in zip(vs, times["plain"], strict=True)]
              for k, vs in times.items() if k != "plain"}
    return {"model": model, "dtype": dtype, "plain_ms": statistics.median(times["plain"]) * 1e3,
            "forced": ratios["forced"], "shipped": ratios["shipped"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,transformer")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models.split(","):
        r = measure(model, args.dtype, args.rounds, args.steps)
        f, s = statistics.median(r["forced"]), statistics.median(r["shipped"])
        # Paired within each round: the machine's drift between rounds cancels.
        diffs = [b - a for a, b in zip(r["forced"], r["shipped"], strict=True)]
        rows.append([model, r["dtype"], f"{r['plain_ms']:.1f}", f"{f:.2f}x", f"{s:.2f}x",
                     f"{statistics.median(diffs):+.3f}x ({min(diffs):+.3f} to {max(diffs):+.3f})",
                     f"{sum(d < 0 for d in diffs)}/{args.rounds}"])
    headers = ["model", "dtype", "plain ms/step", "every=1, guard on every tensor",
               "every=1 as shipped", "shipped - guarded, per round (median, range)",
               "rounds shipped was faster"]
    print(tabulate(rows, headers=headers, tablefmt="github"))

if __name__ == "__main__":
    main()
