"""How the cost grows with the number of layers: ``python benchmarks/bench_scale.py``.

A stack of N/2 ``Linear(16, 16)`` + ``Tanh`` pairs (N leaf modules), float16
autocast with a GradScaler, batch 8: a deliberately tiny model, so that
per-module costs dominate (the worst case for a per-module tool). Plain AMP,
``watch()`` default (every=10) and ``watch(every=1)`` are timed interleaved
in rounds on one copy of the model each. The machine this runs on is shared,
so each step is timed by the thread's CPU time (``time.thread_time``), which
other processes on the same cores do not inflate; the figure is ``run.py``'s step cost
(the 10% quantile, amortized over recorded and unrecorded steps for the default).
On CUDA, steps are timed with ``torch.cuda.Event`` pairs instead.

``--markdown PATH`` appends the table and a text figure of the cost per
recorded step against the number of layers to PATH (``make bench`` appends them
to ``benchmarks/results.md``, after ``run.py`` wrote it).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from torch import nn

import amp_doctor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import step_cost  # noqa: E402  (the same statistic as make bench's tables)


def make_model(n_layers: int, device: torch.device) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(n_layers // 2):
        mods += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*mods).to(device)


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> _Timer:
        if self.cuda:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.thread_time() - self.t


def run(n_layers: int, rounds: int, steps: int, device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    base = make_model(n_layers, device)
    x = torch.randn(8, 16, device=device)
    times: dict[str, list[float]] = {"plain": [], "default": [], "every1": []}
    flags: dict[str, list[bool]] = {k: [] for k in times}
    models = {k: copy.deepcopy(base) for k in times}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    scalers = {k: torch.amp.GradScaler(device.type) for k in times}
    for _ in range(rounds):
        for key in times:
            m, opt, sc = models[key], opts[key], scalers[key]
            w = None
            if key != "plain":
                w = amp_doctor.watch(m, every=1 if key == "every1" else 10)
            for i in range(steps + 2):
                before = w.recorded if w is not None else 0
                with _Timer(device) as t:
                    opt.zero_grad()
                    with torch.autocast(device.type, dtype=torch.float16):
                        loss = m(x).float().pow(2).mean()
                    sc.scale(loss).backward()
                    sc.step(opt)
                    sc.update()
                if i >= 2:
                    times[key].append(t.s)
                    flags[key].append(w is not None and w.recorded > before)
            if w is not None:
                w.close()
    return {k: step_cost(v, flags[k], 10 if k == "default" else 1) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", default="50,200,1000,2000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="a multiple of 10")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--markdown", type=Path, default=None,
                   help="append the table and the figure to this markdown file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    results: list[tuple[int, dict[str, float]]] = []
    for n in (int(v) for v in args.layers.split(",")):
        r = run(n, args.rounds, args.steps, device)
        results.append((n, r))
        rows.append([n, f"{1e3 * r['plain']:.1f}", f"{r['default'] / r['plain']:.2f}x",
                     f"{r['every1'] / r['plain']:.2f}x",
                     f"{1e6 * (r['every1'] - r['plain']) / n:.0f}"])
        print(f"{n} layers done", file=sys.stderr, flush=True)
    table = tabulate(rows, headers=["leaf modules", "plain ms/step", "default (every=10)",
                                    "every=1", "every=1 extra us per module"],
                     tablefmt="github")
    print(table)
    print(figure(results))
    if args.markdown:
        with args.markdown.open("a", encoding="utf-8") as f:
            f.write(markdown(table, results, args, device))
    return 0


FIGURE_WIDTH = 50  # characters of the longest bar


def figure(results: list[tuple[int, dict[str, float]]]) -> str:
    """A text bar chart: the extra time of a recorded step (every=1) per number of layers."""
    extra = [(n, 1e3 * max(r["every1"] - r["plain"], 0.0)) for n, r in results]
    top = max((ms for _, ms in extra), default=0.0) or 1.0
    lines = ["extra ms per recorded step (every=1), by leaf modules:"]
    for n, ms in extra:
        bar = "#" * max(1, round(FIGURE_WIDTH * ms / top))
        lines.append(f"{n:>6} | {bar} {ms:.1f} ms")
    return "\n".join(lines)


def markdown(table: str, results: list[tuple[int, dict[str, float]]],
             args: argparse.Namespace, device: torch.device) -> str:
    return "\n".join([
        "",
        "## Cost against the number of layers (`benchmarks/bench_scale.py`)",
        "",
        f"A stack of `Linear(16, 16)` + `Tanh` pairs, batch 8, float16 with a GradScaler, "
        f"{args.rounds} rounds x {args.steps} steps, {device.type}, {args.threads} thread(s); "
        "step time by thread CPU time (CUDA: `torch.cuda.Event`). The last column is the "
        "slope: near-constant means the cost is linear in the number of modules.",
        "",
        table,
        "",
        "```",
        figure(results),
        "```",
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())
