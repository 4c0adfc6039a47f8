"""Where ``watch(every=1)`` spends its time: a per-recorded-step breakdown.

``python benchmarks/profile_overhead.py [--models cnn,transformer] [--dtypes bfloat16]``

Per (model, dtype), on CPU, four configurations are timed interleaved in
rounds, each on its own copy of the model: plain AMP; ``watch(every=1)``
(every step recorded); ``watch(every=10**9)`` (hooks installed but idle after
step 0: what an unrecorded step of ``watch()`` default costs); and
``watch(every=1)`` with amp-doctor's stats path wrapped in timers:
``StepBuffer.add()`` (the per-tensor stats) split by caller (activations in forward hooks, output
gradients in tensor hooks, parameter gradients), the Python around it in each
hook, the step-boundary host copy (``StepBuffer.flush``), host decode
(``decode_step``) and aggregation (``LayerAggregates.add``). What the
timers do not cover (the module-call slow path once hooks exist, autograd
nodes for tensor hooks, the GradScaler/optimizer patches) is "unattributed".

The timers add ~1 us per wrapped call, so the attributed parts are slight
over-estimates; the overhead total comes from the uninstrumented run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from bench_models import DTYPES, SPECS, Trainer, Workload
from tabulate import tabulate

import amp_doctor
import amp_doctor.device.recorder as recorder_mod
import amp_doctor.hooks.probes as probes_mod
import amp_doctor.steps.aggregates as aggregates_mod
import amp_doctor.steps.folder as steps_mod
import amp_doctor.watch  # noqa: F401  (the package loads it lazily)

# ``amp_doctor.watch`` the attribute is the function; the module is in sys.modules.
watch_mod = sys.modules["amp_doctor.watch"]


class Timers:
    """Accumulated seconds and call counts per label; a stack attributes summarize()."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.numel: dict[str, int] = defaultdict(int)
        self.phase: list[str] = []
        self.enabled = True

    @contextmanager
    def span(self, label: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self.phase.append(label)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[label] += time.perf_counter() - t0
            self.calls[label] += 1
            self.phase.pop()


@contextmanager
def instrumented(timers: Timers) -> Iterator[None]:
    """Wrap the stats path of amp-doctor with timers; restore everything on exit."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        orig = getattr(owner, name)
        saved.append((owner, name, orig))
        setattr(owner, name, make(orig))

    def wrap_add(orig: Callable[[Any, torch.Tensor], int]) -> Any:
        def add(self: Any, x: torch.Tensor) -> int:
            caller = timers.phase[-1] if timers.phase else "other"
            label = f"summarize[{caller}]"
            if timers.enabled:
                timers.numel[label] += x.numel()
            with timers.span(label):
                return orig(self, x)

        return add

    def wrap_method(label: str) -> Callable[[Any], Any]:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def method(*args: Any, **kwargs: Any) -> Any:
                with timers.span(label):
                    return orig(*args, **kwargs)

            return method

        return make

    patch(recorder_mod.StepBuffer, "add", wrap_add)
    patch(probes_mod.Probes, "_pre", wrap_method("forward pre-hook"))
    patch(probes_mod.Probes, "_post", wrap_method("forward hook"))
    patch(probes_mod.Probes, "_on_grad", wrap_method("grad hook"))
    patch(probes_mod.Probes, "summarize_param_grads", wrap_method("param grads"))
    patch(recorder_mod.StepBuffer, "flush", wrap_method("flush (host copy)"))
    patch(steps_mod, "decode_step", wrap_method("host decode"))
    patch(aggregates_mod.LayerAggregates, "add", wrap_method("aggregate"))
    patch(watch_mod.Watch, "_finish_step", wrap_method("step boundary"))
    try:
        yield
    finally:
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)


def _time_steps(trainer: Trainer, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.step()
        out.append(time.perf_counter() - t0)
    return out


# plain; every=1 as shipped; hooks installed but idle (the unrecorded step of
# watch() default); every=1 with the stats path wrapped in timers.
CONFIGS: dict[str, int | None] = {"plain": None, "every1": 1, "idle": 10**9, "timed": 1}


def measure(work: Workload, steps: int, rounds: int) -> tuple[dict[str, float], Timers, int]:
    """Interleaved rounds; returns median step times, the timers and recorded steps timed."""
    trainers = {k: work.trainer() for k in CONFIGS}
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    timers = Timers()
    recorded = 0
    keys = list(CONFIGS)
    for r in range(rounds):
        k0 = r % len(keys)
        for key in keys[k0:] + keys[:k0]:
            tr, every = trainers[key], CONFIGS[key]
            with ExitStack() as stack:
                if key == "timed":
                    # Patch before attaching: module hooks bind their methods at attach time.
                    stack.enter_context(instrumented(timers))
                w = stack.enter_context(amp_doctor.watch(tr.model, every=every)) if every else None
                timers.enabled = False
                _time_steps(tr, 3)  # warm-up; step 0 of the idle watch is recorded here
                timers.enabled = key == "timed"
                rec0 = w.recorded if w is not None else 0
                times[key] += _time_steps(tr, steps)
                timers.enabled = False
                if key == "timed" and w is not None:
                    recorded += w.recorded - rec0
    return {k: statistics.median(v) for k, v in times.items()}, timers, recorded


# Parents and children in the span tree: a parent's "own" time excludes its children.
CHILDREN = {
    "forward hook": ["summarize[forward hook]"],
    "grad hook": ["summarize[grad hook]"],
    "param grads": ["summarize[param grads]"],
    "step boundary": ["flush (host copy)", "host decode", "aggregate"],
}


def report(key: str, dtype: str, work: Workload, med: dict[str, float], timers: Timers,
           recorded: int) -> str:
    plain = med["plain"]
    total = med["every1"] - plain
    per = {k: v / recorded for k, v in timers.seconds.items()}
    rows: list[list[str]] = []
    attributed = 0.0

    def add(label: str, seconds: float, calls: int | None, note: str = "") -> None:
        nonlocal attributed
        attributed += seconds
        rows.append([label, f"{1e3 * seconds:.2f}", f"{100 * seconds / total:.0f}%"
                     if total > 0 else "-", "" if calls is None else f"{calls / recorded:.0f}",
                     note])

    for label in ("summarize[forward hook]", "summarize[grad hook]", "summarize[param grads]"):
        n = timers.numel.get(label, 0) / recorded
        add(f"{label} kernels", per.get(label, 0.0), timers.calls.get(label, 0),
            f"{n / 1e3:.0f}k elements/step")
    for parent, kids in CHILDREN.items():
        own = per.get(parent, 0.0) - sum(per.get(k, 0.0) for k in kids)
        if parent == "step boundary":
            for k in kids:
                add(k, per.get(k, 0.0), timers.calls.get(k, 0))
            add("step boundary, rest (records, history)", own, None)
        else:
            add(f"{parent}, Python around summarize", own, timers.calls.get(parent, 0))
    add("forward pre-hook", per.get("forward pre-hook", 0.0),
        timers.calls.get("forward pre-hook", 0))
    rows.append(["unattributed (module-call slow path, autograd hook nodes, API patches)",
                 f"{1e3 * (total - attributed):.2f}",
                 f"{100 * (total - attributed) / total:.0f}%" if total > 0 else "-", "", ""])
    head = (f"## {key}, {dtype}, batch {work.batch_size}: plain {1e3 * plain:.1f} ms/step; "
            f"every=1 {1e3 * med['every1']:.1f} ms ({med['every1'] / plain:.2f}x, "
            f"+{1e3 * total:.1f} ms per recorded step; instrumented {1e3 * med['timed']:.1f} ms); "
            f"idle hooks (unrecorded step) "
            f"{1e3 * med['idle']:.1f} ms ({med['idle'] / plain:.2f}x, "
            f"{1e3 * (med['idle'] - plain):+.1f} ms)\n")
    table = tabulate(rows, headers=["part of every=1 overhead", "ms / recorded step",
                                    "share", "calls / step", ""], tablefmt="github")
    return head + "\n" + table + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--models", default="cnn,transformer")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for key in args.models.split(","):
        for dtype in args.dtypes.split(","):
            if key not in SPECS or dtype not in DTYPES:
                raise SystemExit(f"unknown model/dtype {key}/{dtype}")
            work = Workload(SPECS[key], dtype, torch.device("cpu"))
            med, timers, recorded = measure(work, args.steps, args.rounds)
            print(report(key, dtype, work, med, timers, recorded), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
