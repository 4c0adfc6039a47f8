"""Where closing a big watch and loading its report spend their time (issue 14, item 5).

``python benchmarks/profile_close.py [--layers 2000] [--steps 20] [--every 10]``

Trains the ``bench_scale`` stack of ``--layers`` leaf modules for ``--steps``
steps under a watch that writes its outputs to a temporary folder, then times
and profiles (cProfile) ``Watch.close()`` and ``Session.load`` of the JSON it
wrote, and prints the JSON's size. ``--top N`` rows of each profile are printed,
sorted by cumulative time; ``--no-profile`` prints the wall times only (cProfile
itself roughly doubles the time of Python-heavy code).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_scale import make_model

import amp_doctor
from amp_doctor.records import Session
from amp_doctor.runfiles import JSON_NAME


def _profiled(fn: object, enabled: bool, top: int) -> tuple[float, str]:
    prof = cProfile.Profile() if enabled else None
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    fn()  # type: ignore[operator]
    if prof is not None:
        prof.disable()
    elapsed = time.perf_counter() - t
    text = ""
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
        text = out.getvalue()
    return elapsed, text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=2000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = make_model(args.layers, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 16)
    with tempfile.TemporaryDirectory() as tmp:
        w = amp_doctor.watch(model, every=args.every, logdir=tmp,
                             tensorboard=args.tensorboard)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        train_s = time.perf_counter() - t0
        close_s, close_prof = _profiled(w.close, not args.no_profile, args.top)
        path = Path(tmp) / JSON_NAME
        size = path.stat().st_size
        load_s, load_prof = _profiled(lambda: Session.load(path), not args.no_profile, args.top)
    print(f"{args.layers} layers, {args.steps} steps at every={args.every}: "
          f"training {train_s:.2f} s, close {close_s:.2f} s, "
          f"JSON {size / 2**20:.2f} MB, Session.load {load_s:.2f} s"
          + ("" if args.no_profile else " (under cProfile)"))
    if close_prof:
        print("\n== close ==\n" + close_prof)
        print("\n== Session.load ==\n" + load_prof)
    return 0


if __name__ == "__main__":
    sys.exit(main())
