"""Instructions a training step executes, counted by valgrind (callgrind), not timed:
``python benchmarks/count_instructions.py [--models transformer,gpt] [--steps 10]``.

Per model (float16, one thread): a plain AMP step, an unrecorded step of ``watch()``
(``every=10**9``: hooks idle after step 0) and a recorded step (``every=1``), each in
its own process under ``valgrind --tool=callgrind``, counting only the timed steps
(``--toggle-collect`` on ``operator.call``, which runs them). A count does not move
with the machine's load, so two commits compare on a shared VM where step times
wander by tens of per cent: run it with a worktree of each first on ``PYTHONPATH``.

What a count does not show: time that is not instructions. An unrecorded transformer
step executes 0.7% more instructions than a plain one and takes ~10% longer on this
machine (session 62): amp-doctor's few dozen touch points a step run from a cold cache.
Under valgrind torch's kernels take their AVX2 paths, so the plain step's count is
not the native one; amp-doctor's own work (Python) is counted as it runs natively.
Needs ``valgrind`` on the PATH and a Python whose symbols are not stripped (a count
of 0 says they are). Each process takes one to three minutes.
"""

from __future__ import annotations

import argparse
import operator
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from bench_models import SPECS, Workload
from tabulate import tabulate

import amp_doctor

MODES = {"plain": None, "unrecorded": 10**9, "recorded": 1}


def inner(key: str, mode: str, steps: int) -> None:
    """Run in the counted process: warm-up steps, then ``steps`` counted ones."""
    torch.set_num_threads(1)
    tr = Workload(SPECS[key], "float16", torch.device("cpu")).trainer()

    def run(n: int) -> None:
        for _ in range(n):
            tr.step()

    every = MODES[mode]
    if every is None:
        run(3)
        operator.call(run, steps)
        return
    with amp_doctor.watch(tr.model, every=every, tensorboard=False):
        run(3)
        operator.call(run, steps)


def count(key: str, mode: str, steps: int) -> float:
    """Instructions per counted step of (``key``, ``mode``), from callgrind's total."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
           "--collect-atstart=no", "--toggle-collect=_operator_call",
           sys.executable, str(Path(__file__).resolve()), "--inner", key, mode, str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"Collected : (\d+)", out.stderr)
    if m is None:
        raise SystemExit(f"no callgrind total in:\n{out.stderr[-2000:]}")
    return int(m.group(1)) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="transformer,gpt")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default=",".join(MODES), help="of: " + ", ".join(MODES))
    p.add_argument("--inner", nargs=3, metavar=("MODEL", "MODE", "STEPS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        inner(args.inner[0], args.inner[1], int(args.inner[2]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on the PATH (Debian: apt-get install valgrind)")
    rows = []
    for key in args.models.split(","):
        ir = {mode: count(key, mode, args.steps) for mode in args.modes.split(",")}
        if not any(ir.values()):
            raise SystemExit("callgrind counted nothing: is this Python's binary stripped?")
        plain = ir.get("plain")
        for mode, n in ir.items():
            rows.append([key, mode, f"{n / 1e6:.2f}",
                         f"{n / plain:.3f}x" if plain else "-",
                         f"{(n - plain) / 1e6:+.2f}" if plain else "-"])
    print(tabulate(rows, headers=["model", "step", "M instructions", "x plain",
                                  "M added"]))


if __name__ == "__main__":
    main()
