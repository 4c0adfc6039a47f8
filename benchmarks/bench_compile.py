"""Does a ``torch.compile``d per-tensor stats function beat the eager ops (issue 15)?

``python benchmarks/bench_compile.py``

What :meth:`amp_doctor.device.stats.Batch.add` pays per tensor, done two ways on the
same tensors (the shapes of the benchmark GPT's activations and gradients):

* eager: ``torch.aminmax`` (the exact min and max), the sample copied into a float32
  staging buffer, ``torch.count_nonzero`` of the sample: three ops;
* compiled: one ``torch.compile(dynamic=True)`` function computing the same three
  results, which inductor fuses into one kernel (a fresh float32 sample is returned
  instead of a copy into the stage: a compiled function that writes into a slice of
  a caller's buffer is a mutation it must guard on).

It prints the compile time (paid once per process, and again on each recompile), the
recompiles over the shapes, and the steady cost per tensor by thread CPU time.
A compiled call's fixed cost is its guards and wrapper in Python; a fused kernel saves
launches, which on the CPU cost little and on a GPU are what the guards cost again.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from tabulate import tabulate


def eager(x: torch.Tensor, stage: torch.Tensor) -> tuple[torch.Tensor, ...]:
    mn, mx = torch.aminmax(x)
    flat = x.reshape(-1)
    stage[: flat.numel()].copy_(flat)
    return mn, mx, torch.count_nonzero(flat)


def fused(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    flat = x.reshape(-1)
    return flat.min(), flat.max(), (flat != 0).sum(), flat.float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [(8, 16, 32)] * 6 + [(8, 16, 128)] * 2 + [(8, 4, 16, 16)] * 2 + [(32, 32), (128, 32)]
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        xs = [torch.randn(s).to(dtype) for s in shapes] * 50
        stage = torch.empty(1 << 16)
        torch._dynamo.reset()
        graphs0 = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled = torch.compile(fused, dynamic=True)
        t0 = time.perf_counter()
        for s in dict.fromkeys(shapes):
            compiled(torch.randn(s).to(dtype))
        compile_s = time.perf_counter() - t0
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs0

        def run_eager(xs: list[torch.Tensor] = xs, stage: torch.Tensor = stage) -> None:
            for x in xs:
                eager(x, stage)

        def run_compiled(xs: list[torch.Tensor] = xs, fn: Callable[..., object] = compiled
                         ) -> None:
            for x in xs:
                fn(x)

        def timed(fn: Callable[[], None], n: int = len(xs)) -> float:
            out = []
            for _ in range(args.reps):
                t = time.thread_time()
                fn()
                out.append(time.thread_time() - t)
            return statistics.median(out) / n

        run_eager()
        run_compiled()
        e, c = timed(run_eager), timed(run_compiled)
        # Exactness: the same min, max and non-zero count.
        for x in xs[: len(shapes)]:
            a, b = eager(x, stage), compiled(x)
            assert all(torch.equal(u.to(v.dtype), v) for u, v in zip(a, b[:3], strict=True))
        rows.append([str(dtype).removeprefix("torch."), f"{compile_s:.1f}", frames,
                     f"{1e6 * e:.1f}", f"{1e6 * c:.1f} ({c / e:.2f}x)"])
    print(tabulate(rows, headers=["dtype", "compile s", "graphs compiled",
                                  "eager us/tensor", "compiled us/tensor (x eager)"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
