"""Peak memory of one variant's training run, measured exactly rather than sampled.

CPU: torch's CPU allocations are invisible to ``tracemalloc``, and the
process RSS is a poor proxy here: its high-water mark is process-wide,
glibc keeps freed pages, and the first call of a kernel pages in library
code, all of which swamp a few MB of tensors. Instead the torch profiler is
run with ``profile_memory=True``: every allocation and free made by torch's
CPU allocator is reported with the allocator's running total, so the peak of
that total is the peak of live tensor bytes, deterministically (the same
quantity ``torch.cuda.max_memory_allocated`` gives on CUDA). The window
starts before the variant's model copy is made, so the figure is the peak
of the whole training run: parameters, gradients, optimizer state,
activations and whatever the variant allocates. Python objects (hooks,
records) are not tensors; ``tracemalloc`` measures their peak over the same
window, reported separately.

Profiling slows the steps down, so this is a separate, untimed pass.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
import tracemalloc
from collections.abc import Iterator
from typing import Any

import torch
from bench_models import Workload
from bench_variants import Variant
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _drop_profiler_banner() -> Iterator[None]:
    """Swallow the "USDT: ... profiler_start/stop" lines the C++ profiler writes to fd 2.

    They cannot be turned off by a log level in this torch build; anything
    else written meanwhile is passed on.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)


def _walk(events: list[Any]) -> Iterator[Any]:
    for e in events:
        yield e
        yield from _walk(e.children)


def _cpu_tensor_peak(prof: profile) -> int:
    """Peak of the CPU allocator's running total over the profiled window, in bytes,
    above what was already allocated when the window opened.

    The running total is process-wide: tensors that outlive an earlier measurement
    in the same process (the profiler's own, the timing rounds' trainers) are in it.
    So the total just before the window's first allocation is subtracted; without
    that, each variant measured after another was charged with its leftovers.
    """
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("torch profiler returned no results")
    events = sorted((e for e in _walk(results.experimental_event_tree())
                     if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"),
                    key=lambda e: e.start_time_ns)
    if not events:
        return 0
    first = events[0].extra_fields
    base = int(first.total_allocated) - int(first.alloc_size)
    return max(int(e.extra_fields.total_allocated) for e in events) - base


def measure(work: Workload, variant: Variant, steps: int) -> dict[str, Any]:
    """Peak tensor bytes and peak Python-heap bytes of ``steps`` steps with ``variant``."""
    gc.collect()
    cuda = work.device.type == "cuda"
    tracemalloc.start()
    try:
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            prof = None
        else:
            base = 0
            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _drop_profiler_banner():
                prof.__enter__()
        try:
            trainer = work.trainer()
            attached = variant.attach(trainer)
            try:
                for _ in range(steps):
                    trainer.step()
                # Read before close(): building the final report is not training memory.
                py_peak = tracemalloc.get_traced_memory()[1]
            finally:
                attached.close()
        finally:
            if prof is not None:
                with _drop_profiler_banner():
                    prof.__exit__(None, None, None)
    finally:
        tracemalloc.stop()
    if cuda:
        torch.cuda.synchronize()
        tensor_peak = torch.cuda.max_memory_allocated() - base
        method = "torch.cuda.max_memory_allocated"
    else:
        assert prof is not None
        tensor_peak = _cpu_tensor_peak(prof)
        method = "torch profiler (profile_memory), allocator running total"
    return {"tensor_peak": tensor_peak, "python_peak": py_peak, "method": method}
