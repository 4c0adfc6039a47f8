"""torchrun/DDP on CPU with gloo: per-rank records, one merged report, exit codes.

Each run starts three processes that import torch, so the cases share runs: one per
launcher (`--nproc-per-node`, plain torchrun) with an overflowing rank, and one healthy
run whose rank 1 fails. `make test-fast` runs the first; the other two are slow (only in
`make test`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from amp_doctor import Session
from tests.helpers import console_script

FIX = Path(__file__).parent / "fixtures" / "cli" / "ddp_train.py"
AMP_DOCTOR = console_script() or "amp-doctor"


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240,
                          env={**env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    shutil.copy(FIX, tmp_path / FIX.name)
    return tmp_path


def test_only_rank_1_overflows_and_the_merged_report_says_so(work: Path) -> None:
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--no-tensorboard", "--logdir", "out",
             "--nproc-per-node", "2", "ddp_train.py", "--bad-rank", "1"], work)
    assert r.returncode == 0, r.stderr[-3000:]
    for k in (0, 1):
        s = Session.load(work / "out" / f"rank{k}" / "amp_doctor.json")
        assert s.run.rank == k and s.run.world_size == 2
    rank0 = Session.load(work / "out" / "rank0" / "amp_doctor.json")
    assert not any(f.kind == "activation_overflow" for f in rank0.findings)
    merged = Session.load(work / "out" / "amp_doctor.json")
    over = [f for f in merged.findings if f.kind == "activation_overflow" and f.module == "0"]
    assert over and over[0].rank == 1 and over[0].ranks == [1]
    assert "[rank 1]" in over[0].message
    assert merged.layer("0").worst_rank == 1 and merged.layer("0").overflow_frac > 0
    # The layer names carry no DDP "module." prefix.
    assert not any(lay.name.startswith("module") for lay in merged.layers)
    # DDP all-reduces the inf into both ranks' gradients: both skip, one timeline.
    assert merged.scaler is not None and merged.scaler.skipped_steps == [0, 1, 2]
    assert "activation_overflow" in r.stderr and "[rank 1]" in r.stderr


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_a_signal_to_the_launcher_ends_every_rank_and_merges_their_reports(
        work: Path, how: str) -> None:
    # Review 33: a SIGTERM (a scheduler's) ended the launcher at once, and left torchrun
    # and both ranks running as orphans, with no merged report and a stale logdir lock.
    # A Ctrl-C reaches the whole foreground group: the launcher, torchrun and the ranks.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    ready = work / "ready"
    proc = subprocess.Popen(
        [AMP_DOCTOR, "diagnose", "--every", "1", "--no-tensorboard", "--logdir", "out",
         "--nproc-per-node", "2", "ddp_train.py", "--wait-file", str(ready)],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
        start_new_session=True)
    sig = signal.SIGTERM if how == "sigterm" else signal.SIGINT
    try:
        deadline = time.monotonic() + 180
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.communicate(timeout=10)
        if how == "sigterm":
            proc.send_signal(sig)
        else:
            os.killpg(proc.pid, sig)  # what the terminal does on Ctrl-C
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -sig, err[-3000:]
    for k in (0, 1):
        s = Session.load(work / "out" / f"rank{k}" / "amp_doctor.json")
        assert s.run.outcome == "interrupted" and s.steps == 3
        assert s.run.error == ("SIGTERM (signal 15)" if how == "sigterm" else None)
    merged = Session.load(work / "out" / "amp_doctor.json")
    assert merged.run.world_size == 2 and merged.run.exit_code == 128 + sig
    assert not list((work / "out").rglob(".amp-doctor.lock"))
    time.sleep(1)
    script = str(work / "ddp_train.py")
    left = [p for p in Path("/proc").glob("[0-9]*")
            if script.encode() in _cmdline(p) or b"ddp_train.py" in _cmdline(p)
            and str(work).encode() in _cwd(p)]
    assert left == []  # no rank, no torchrun, left running


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def _cwd(p: Path) -> bytes:
    try:
        return os.readlink(p / "cwd").encode()
    except OSError:
        return b""


@pytest.mark.slow
def test_healthy_two_process_run_has_no_findings(work: Path) -> None:
    # Under load this run used to hang in one rank after the script ended (the script's
    # DDP freed early deadlocked with a gloo thread; see runner._last_main): both ranks
    # must write a full report, and the launcher must merge both.
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--no-tensorboard", "--logdir", "out",
             "--nproc-per-node", "2", "ddp_train.py"], work)
    assert r.returncode == 0, r.stderr[-3000:]
    for k in (0, 1):
        s = Session.load(work / "out" / f"rank{k}" / "amp_doctor.json")
        assert s.run.rank == k and s.steps == 3 and s.findings == []
    merged = Session.load(work / "out" / "amp_doctor.json")
    assert merged.findings == [] and merged.run.world_size == 2 and merged.steps == 3


@pytest.mark.slow
def test_exit_code_of_a_failing_rank_propagates(work: Path) -> None:
    # torchrun stops the other ranks as soon as one fails: only the exit code is certain.
    r = run([AMP_DOCTOR, "diagnose", "--no-tensorboard", "--logdir", "out",
             "--nproc-per-node", "2", "ddp_train.py", "--fail-rank", "1"], work)
    assert r.returncode == 7, r.stderr[-3000:]
    merged = Session.load(work / "out" / "amp_doctor.json")
    assert merged.run.exit_code == 7


@pytest.mark.slow
def test_plain_torchrun_with_amp_doctor_module(work: Path) -> None:
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=2", "-m", "amp_doctor", "diagnose", "--every", "1",
             "--no-tensorboard", "--logdir", "out", "ddp_train.py", "--bad-rank", "0"], work)
    assert r.returncode == 0, r.stderr[-3000:]
    merged = Session.load(work / "out" / "amp_doctor.json")
    over = [f for f in merged.findings if f.kind == "activation_overflow" and f.module == "0"]
    assert over and over[0].ranks == [0]
