"""Do ``torch._foreach_*`` batched reductions beat per-tensor ``aminmax`` (issue 15)?

``python benchmarks/bench_foreach.py``

Times, on many tensors at once, what :func:`amp_doctor.device.stats.summarize` needs per
tensor (the exact signed min and max) in three ways, by thread CPU time:

* ``aminmax``: one ``torch.aminmax`` per tensor, then one ``stack`` (today's code);
* ``foreach max/neg``: ``_foreach_max(xs)`` and ``_foreach_max(_foreach_neg(xs))``
  (exact min and max, but the negation allocates a copy of every tensor);
* ``foreach norm(inf)``: ``_foreach_norm(xs, ord=inf)``, which gives only
  ``max |x|`` (and NaN/Inf), not the signed extremes.

On CUDA the foreach ops launch one kernel per group of tensors instead of one per
tensor, which is where they pay; on the CPU they are loops over the same kernels.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
from tabulate import tabulate


def _time(fn: Callable[[], object], reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.thread_time()
        fn()
        out.append(time.thread_time() - t)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for count, numel in ((500, 256), (2000, 256), (200, 65536)):
        for dtype in (torch.float32, torch.bfloat16):
            xs = [torch.randn(numel).to(dtype) for _ in range(count)]

            def per_tensor(xs: list[torch.Tensor] = xs) -> object:
                mm = [torch.aminmax(x) for x in xs]
                return torch.stack([m for m, _ in mm]), torch.stack([m for _, m in mm])

            def foreach_minmax(xs: list[torch.Tensor] = xs) -> object:
                return (torch.stack(torch._foreach_max(xs)),
                        torch.stack(torch._foreach_max(torch._foreach_neg(xs))))

            def foreach_norm(xs: list[torch.Tensor] = xs) -> object:
                return torch.stack(torch._foreach_norm(xs, ord=math.inf))

            base = _time(per_tensor, args.reps)
            fm = _time(foreach_minmax, args.reps)
            fn = _time(foreach_norm, args.reps)
            rows.append([count, numel, str(dtype).removeprefix("torch."),
                         f"{1e3 * base:.2f}", f"{1e3 * fm:.2f} ({fm / base:.2f}x)",
                         f"{1e3 * fn:.2f} ({fn / base:.2f}x)"])
    print(tabulate(rows, headers=["tensors", "numel", "dtype", "aminmax ms",
                                  "foreach max/neg ms (x)", "foreach norm(inf) ms (x)"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
