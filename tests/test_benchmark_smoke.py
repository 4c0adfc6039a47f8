"""Smoke test of the overhead benchmark harness (``benchmarks/run.py``, issue 8).

It runs the harness the way ``make bench`` does, with tiny settings, and checks
the structure of what it prints and the facts that do not depend on timing:
which rows appear, how many steps were recorded, host syncs per recorded step,
that memory was measured. Timings on a shared CI machine are noise at this
size, so no assertion here ever looks at a time or a time ratio.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

STEPS = 10  # one full sampling period of watch() default (every=10)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    # One intra-op thread: on a machine shared with other jobs, OpenMP's
    # spinning barriers otherwise stretch tiny steps from ms to seconds.
    cmd = [sys.executable, str(BENCH / "run.py"), "--steps", str(STEPS), "--warmup", "1",
           "--rounds", "1", "--models", "cnn", "--dtypes", "bfloat16", "--batch-size", "16",
           "--device", "cpu", "--threads", "1", "--json", str(out)]
    # The timeout only guards against a hang; it is not a performance check.
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, json.loads(out.read_text())


def test_prints_a_table_with_one_row_per_variant(smoke: tuple[str, dict]) -> None:
    stdout, _ = smoke
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("| model"))
    for col in ("ms/step", "x plain", "spread", "peak mem vs plain",
                "host syncs / recorded step", "targets"):
        assert col in header
    rows = [line for line in lines if line.startswith("| cnn (bs 16) | bfloat16")]
    labels = ["plain AMP", "watch() default (every=10)", "watch(every=1)",
              "naive hooks + .item()", "autograd.detect_anomaly",
              "empty TorchDispatchMode (floor)", "empty module + grad hooks (floor)",
              "watch(anomaly=True) (every=10)", "hooks + one copy per tensor (floor)",
              "hooks + stats device ops (floor)"]
    assert len(rows) == len(labels)
    for label in labels:
        assert sum(f"| {label} " in r for r in rows) == 1, label
    plain_row = next(r for r in rows if "| plain AMP " in r)
    assert "| 1.00x " in plain_row and "(ref)" in plain_row


def test_recorded_steps_and_host_syncs(smoke: tuple[str, dict]) -> None:
    _, data = smoke
    (cell,) = data["cells"]
    assert (cell["model"], cell["dtype"], cell["device"]) == ("cnn", "bfloat16", "cpu")
    v = cell["variants"]
    assert all(x["timed_steps"] == STEPS for x in v.values())
    # every=1 records every step and copies to the host once per recorded step, as
    # counted by tests/syncs.py (patched tensor methods), not by amp-doctor itself.
    assert v["every1"]["recorded_steps"] == STEPS
    assert v["every1"]["sync_pass_recorded_steps"] == 10
    assert v["every1"]["syncs_per_recorded_step"] <= 1
    # The default records one step in ten: exactly one in a 10-step window.
    assert v["default"]["recorded_steps"] == 1
    assert v["default"]["sync_pass_recorded_steps"] == 1
    assert v["default"]["syncs"] <= v["default"]["sync_pass_recorded_steps"]
    assert v["default"]["syncs_per_recorded_step"] <= 1
    # Anomaly mode samples like the default, with the same sync budget.
    assert v["anomaly"]["recorded_steps"] == 1
    assert v["anomaly"]["syncs_per_recorded_step"] <= 1
    # The naive baseline syncs once per statistic per tensor, every step.
    naive = v["naive"]
    assert naive["recorded_steps"] == STEPS
    assert naive["syncs"] % 8 == 0 and naive["syncs_per_recorded_step"] > 1
    assert v["plain"]["syncs"] == 0 and v["plain"]["recorded_steps"] == 0
    assert v["detect_anomaly"]["syncs"] is None  # not countable on CPU, and says so
    assert v["empty_mode"]["recorded_steps"] == STEPS and v["empty_mode"]["syncs"] == 0
    assert v["empty_hooks"]["recorded_steps"] == STEPS and v["empty_hooks"]["syncs"] == 0
    # The floors: one copy per tensor never syncs; the stats floor copies its
    # finished batch to the host once a step, as watch(every=1) does.
    assert v["copy_floor"]["recorded_steps"] == STEPS and v["copy_floor"]["syncs"] == 0
    assert v["stats_floor"]["recorded_steps"] == STEPS
    assert v["stats_floor"]["syncs_per_recorded_step"] == 1


def test_structure_of_figures(smoke: tuple[str, dict]) -> None:
    _, data = smoke
    env = data["environment"]
    for key in ("date", "cpu", "nproc", "torch"):
        assert env[key]
    (cell,) = data["cells"]
    for key, x in cell["variants"].items():
        assert math.isfinite(x["cost_ms"]) and len(x["round_ratios"]) == 1
        assert x["memory"]["tensor_peak"] > 0
        assert x["memory"]["python_peak"] >= 0
        assert isinstance(x["targets_missed"], list)
        if key == "plain":
            assert x["ratio"] == 1.0 and x["memory_overhead"] == 0.0
        else:
            assert x["memory_overhead"] is not None


def test_amortized_cost_weights_recorded_steps_by_the_sampling_rate() -> None:
    from run import step_cost

    times = [1.0] * 9 + [11.0]
    flags = [False] * 9 + [True]
    assert step_cost(times, flags, every=10) == pytest.approx(0.1 * 11.0 + 0.9 * 1.0)
    assert step_cost(times, flags, every=1) == 1.0  # unsampled: one statistic of all
    assert step_cost([1.0, 2.0, 3.0], [False] * 3, every=10, stat=statistics.median) == 2.0


def test_the_low_statistic_reads_the_undisturbed_steps_not_the_bursts() -> None:
    from run import low_quantile, step_cost

    # A shared machine: a third of the steps stretched by a neighbour's burst.
    times = [6.1, 6.2, 6.15, 9.8, 6.3, 10.1, 6.2, 6.25, 12.0, 6.1] * 3
    assert statistics.median(times) == pytest.approx(6.225)
    assert low_quantile(times) == pytest.approx(6.1)
    assert low_quantile([3.0]) == 3.0
    assert low_quantile([1.0, 2.0]) == pytest.approx(1.1)  # interpolated
    assert step_cost(times, [False] * 30, every=1) == pytest.approx(6.1)


def test_naive_baseline_counts_one_sync_per_stat_per_tensor() -> None:
    from naive_hooks import STATS, NaiveStatsHooks

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    hooks = NaiveStatsHooks(model)
    try:
        model(torch.randn(3, 4)).sum().backward()
    finally:
        hooks.remove()
    # 4 module outputs (3 layers + the Sequential), each with a gradient.
    assert hooks.steps == 1 and hooks.syncs == len(STATS) * 4 * 2
    assert all(len(model[i]._forward_hooks) == 0 for i in range(3))


def test_the_gc_count_sees_the_collections_of_the_steps_it_times() -> None:
    """bench_gc.py counts collections with gc.callbacks during the timed steps only."""
    import gc

    import bench_gc

    mean, seen = bench_gc.measure("cnn", 1, 3)
    assert mean > 0 and len(seen.count) == 3 and seen not in gc.callbacks  # removed
    # The counter is the one Python calls: a forced collection inside is counted.
    counter = bench_gc._Collections()
    gc.callbacks.append(counter)
    try:
        gc.collect(1)
    finally:
        gc.callbacks.remove(counter)
    assert counter.count[1] == 1 and counter.seconds[1] > 0


def test_the_guard_harness_times_both_ways_and_restores_the_guard() -> None:
    """bench_guard.py forces own_ops around every filed tensor for one copy only."""
    import bench_guard

    from amp_doctor.devicework import own_ops

    shipped = type(own_ops).__dict__["needed_for"]
    r = bench_guard.measure("cnn", "bfloat16", rounds=1, steps=1)
    assert type(own_ops).__dict__["needed_for"] is shipped
    assert not own_ops.needed_for(torch.ones(2)) and own_ops.needed_for(nn.Parameter(torch.ones(2)))
    assert r["plain_ms"] > 0 and len(r["forced"]) == len(r["shipped"]) == 1


def test_each_missed_time_target_names_the_floors_beneath_it() -> None:
    from bench_variants import VARIANTS
    from run import Cell, VariantRun, floor_notes

    def run(key: str, recorded: float, unrecorded: float | None = None) -> VariantRun:
        every = VARIANTS[key].every
        flags = [i % every == 0 for i in range(2 * every)] if every > 1 else [True] * 4
        times = [recorded if f else unrecorded for f in flags]
        return VariantRun(VARIANTS[key], rounds=[times], flags=[flags])

    cell = Cell("cpu", "tiny", "float16", 8, {
        "plain": run("plain", 10.0),
        "default": run("default", 20.0, 10.1),   # 0.9 * 1.01 + 0.1 * 2.0 = 1.109x
        "every1": run("every1", 20.0),           # 2.00x
        "anomaly": run("anomaly", 20.0, 10.0),   # 1.10x: met, no note
        "empty_hooks": run("empty_hooks", 10.5),
        "copy_floor": run("copy_floor", 13.0),
        "stats_floor": run("stats_floor", 17.0),
    })
    notes = floor_notes(cell)
    assert len(notes) == 2
    default, every1 = notes
    assert default.startswith("tiny float16, watch() default (every=10): 1.11x > 1.03x.")
    assert "Unrecorded steps 1.01x, recorded steps 2.00x (one in 10)" in default
    assert "it would be 1.03x (read once) or 1.07x (device ops)" in default
    assert "The read-once floor alone misses" not in default
    assert every1.startswith("tiny float16, watch(every=1): 2.00x > 1.25x.")
    assert ("hooks alone 1.05x, reading each tensor once 1.30x, amp-doctor's device ops "
            "1.70x; the rest, +0.30x, is host-side bookkeeping") in every1
    assert "The read-once floor is above the target" in every1
    del cell.runs["copy_floor"]  # a run without the floors explains nothing
    assert floor_notes(cell) == []


# The scripts `make bench` runs (the Makefile's bench target).
MAKE_BENCH_SCRIPTS = ("run.py", "bench_scale.py", "bench_gc.py")


def test_the_make_bench_scripts_print_their_help() -> None:
    """``run.py --help`` raised on a "%" in a help text (argparse formats them)."""
    makefile = (ROOT / "Makefile").read_text()
    assert all(f"benchmarks/{name}" in makefile for name in MAKE_BENCH_SCRIPTS)
    for name in MAKE_BENCH_SCRIPTS:
        proc = subprocess.run([sys.executable, str(BENCH / name), "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, (name, proc.stderr[-1000:])
        assert proc.stdout.startswith("usage: ") and "--threads" in proc.stdout, name


def test_the_instruction_counter_runs_its_counted_steps_and_prints_its_help() -> None:
    """``count_instructions.py``: the part valgrind runs (``--inner``), without valgrind
    (counting a real run takes minutes), and its help."""
    script = str(BENCH / "count_instructions.py")
    for mode in ("plain", "recorded"):
        proc = subprocess.run([sys.executable, script, "--inner", "cnn", mode, "1"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, (mode, proc.stderr[-1000:])
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "callgrind" in proc.stdout, proc.stderr[-1000:]
