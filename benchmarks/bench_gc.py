"""Python's garbage collector under amp-doctor: ``python benchmarks/bench_gc.py``.

``run.py`` reports a low quantile of step times, which leave out the rare step that a
full (generation 2) collection lands in. Those collections sweep the whole
Python heap (a few hundred thousand objects once torch is imported: about a
tenth of a second) and are triggered by objects that survive the younger
collections, such as tensor objects a tool keeps alive through a step. This
script counts them: the same steps of each model with nothing attached,
with ``watch()`` default and with ``watch(every=1)``, each collection timed by
``gc.callbacks`` (wall time), and the mean step time (thread CPU time), which
includes them.

``--markdown PATH`` appends the table to PATH (``make bench`` appends it to
``benchmarks/results.md``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_models import SPECS, Workload
from tabulate import tabulate

import amp_doctor

__all__ = ["main", "measure"]

# Steps per model and variant: a few full collections' worth on the GPT.
DEFAULT_STEPS = {"cnn": 100, "transformer": 100, "gpt": 40}
VARIANTS = {"plain": None, "watch() default (every=10)": 10, "watch(every=1)": 1}


class _Collections:
    """Collections per generation and their wall time, while installed."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = int(info["generation"])
            self.count[g] += 1
            self.seconds[g] += time.perf_counter() - self._t0


def measure(model: str, every: int | None, steps: int) -> tuple[float, _Collections]:
    """Mean thread-CPU seconds per step, and the collections in those steps."""
    work = Workload(SPECS[model], "float16", torch.device("cpu"), None)
    trainer = work.trainer()
    w = amp_doctor.watch(trainer.model, every=every) if every else None
    try:
        for _ in range(3):
            trainer.step()
        gc.collect()  # the same start for every variant
        seen = _Collections()
        gc.callbacks.append(seen)
        try:
            t0 = time.thread_time()
            for _ in range(steps):
                trainer.step()
            spent = (time.thread_time() - t0) / steps
        finally:
            gc.callbacks.remove(seen)
    finally:
        if w is not None:
            w.close()
    return spent, seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="cnn,transformer,gpt")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models.split(","):
        steps = DEFAULT_STEPS.get(model, 40)
        plain = None
        for label, every in VARIANTS.items():
            mean, seen = measure(model, every, steps)
            plain = plain or mean
            rows.append([
                model, label, steps, f"{1e3 * mean:.1f} ({mean / plain:.2f}x)",
                " / ".join(str(c) for c in seen.count),
                f"{1e3 * sum(seen.seconds) / steps:.1f}",
                f"{1e3 * seen.seconds[2] / max(seen.count[2], 1):.0f}" if seen.count[2] else "-",
            ])
            print(f"{model} {label} done", file=sys.stderr, flush=True)
    table = tabulate(rows, headers=[
        "model", "variant", "steps", "mean step ms (x plain)",
        "collections gen 0 / 1 / 2", "GC ms per step", "ms per gen-2 collection"],
        tablefmt="github")
    print(table)
    if args.markdown:
        with args.markdown.open("a", encoding="utf-8") as f:
            f.write("\n".join([
                "", "## Python's garbage collector (`benchmarks/bench_gc.py`)", "",
                f"float16, {args.threads} thread(s), CPU; the mean step time (thread CPU time) "
                "includes the collections, which the low quantiles above leave out. The "
                "collections are counted with `gc.callbacks`.", "", table, ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
