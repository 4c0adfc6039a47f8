"""How big the JSON report gets (issue 14, item 5; issue 15: <= 20 MB for any model and run).

``python benchmarks/bench_output_size.py``

Two measured runs, both at ``every=1`` (the largest output), with a float16
GradScaler whose scale starts at 2**24 so that the first steps back off (backoff
events name every culprit layer, the largest events there are):

* a wide model (``--layers``, default the ``bench_scale`` stack of 2,000 leaf
  modules) for ``--wide-steps`` steps. Its per-layer part is the same at any run
  length; its history grows by one row per recorded step up to
  ``history.HISTORY_LIMIT`` rows of at most ``history.HISTORY_LAYERS`` layers, so
  the full-length size is extrapolated from the largest row written;
* a small model (20 leaf modules) for ``--long-steps`` (10,000) steps: the run-length
  terms (history thinning, the scale timeline, step lists, events), measured whole,
  with its TensorBoard event file (every layer live at ``every=1``: the largest).
  The target holds for the JSON and the event file together.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_scale import make_model

import amp_doctor
from amp_doctor.jsoncodec import to_jsonable
from amp_doctor.records import Session
from amp_doctor.runfiles import JSON_NAME
from amp_doctor.sinks.tensorboard import LIVE_FULL_POINTS
from amp_doctor.steps.history import HISTORY_LIMIT

JSON_TARGET = 20 * 2**20


def run(layers: int, steps: int, tensorboard: bool = False
        ) -> tuple[int, int, float, Session, int]:
    """(JSON bytes, largest history row in bytes, close seconds, session, TensorBoard
    event-file bytes)."""
    torch.manual_seed(0)
    model = make_model(layers, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    x = torch.randn(8, 16)
    with tempfile.TemporaryDirectory() as tmp:
        w = amp_doctor.watch(model, every=1, logdir=tmp, tensorboard=tensorboard)
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        t = time.perf_counter()
        session = w.close()
        close_s = time.perf_counter() - t
        size = (Path(tmp) / JSON_NAME).stat().st_size
        tb = sum(p.stat().st_size for p in Path(tmp).rglob("events.out.tfevents.*"))
    row = max((len(json.dumps(to_jsonable(r), separators=(",", ":")))
               for r in session.history), default=0)
    return size, row, close_s, session, tb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=2000)
    p.add_argument("--wide-steps", type=int, default=20)
    p.add_argument("--long-steps", type=int, default=10_000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    mb = 2**20
    size, row, close_s, s, _ = run(args.layers, args.wide_steps)
    full = size + max(0, HISTORY_LIMIT - len(s.history)) * row
    print(f"{args.layers} leaf modules, {args.wide_steps} steps at every=1: JSON "
          f"{size / mb:.2f} MB ({len(s.history)} history rows, largest {row / 1024:.0f} KB); "
          f"a full history ({HISTORY_LIMIT} rows): <= {full / mb:.2f} MB; close {close_s:.2f} s")
    size2, _, close2, s2, tb2 = run(20, args.long_steps, tensorboard=True)
    print(f"20 leaf modules, {args.long_steps} steps at every=1: JSON {size2 / mb:.2f} MB "
          f"({len(s2.history)} history rows, {len(s2.scaler.scale) if s2.scaler else 0} "
          f"scale points, {len(s2.events)} events), TensorBoard {tb2 / mb:.2f} MB "
          f"(live series thinned after {LIVE_FULL_POINTS} recorded steps); "
          f"close {close2:.2f} s")
    ok = full <= JSON_TARGET and size2 + tb2 <= JSON_TARGET
    print(f"target <= {JSON_TARGET / mb:.0f} MB: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
