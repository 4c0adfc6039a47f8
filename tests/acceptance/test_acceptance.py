"""Acceptance: real-style training scripts run through the real CLI, each with its truth.

Every script in ``scripts/`` is run twice in a subprocess, as a user runs it: once with
plain ``python`` and once with ``amp-doctor diagnose --json ... script.py args``. The JSON
report is read back and checked against what is true of that run: the same exit code and
the same printed losses as plain python (amp-doctor never changes the numerics), the right
number of steps, the dtype and scaler the framework really used, no error or warning on a
healthy run, and the one right culprit on a broken one.

Each test keeps its truth strict: a regression fails CI.

Run with ``make acceptance`` (``pytest -m acceptance``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from amp_doctor import Session
from tests.helpers import console_script

pytestmark = pytest.mark.acceptance

SCRIPTS = Path(__file__).parent / "scripts"
AMP_DOCTOR = console_script()
# Generous: torch.compile's first inductor build on a loaded 2-core CI machine.
TIMEOUT_S = 900
GPT_STEPS = 30
OVERFLOW_LAYER = "transformer.h.1.mlp.c_fc"
LOSS_LINE = re.compile(r"^(?:iter|step) \d+: loss .*$", re.M)


@dataclass
class Pair:
    plain: subprocess.CompletedProcess[str]
    under: subprocess.CompletedProcess[str]
    session: Session | None

    @property
    def report(self) -> Session:
        assert self.session is not None, f"no JSON report written:\n{self.under.stderr[-3000:]}"
        return self.session

    def losses(self, which: str) -> list[str]:
        proc = self.plain if which == "plain" else self.under
        return LOSS_LINE.findall(proc.stdout)

    def loud(self) -> list[tuple[str, str, str | None]]:
        """Error and warning findings as (severity, kind, module)."""
        return sorted((f.severity, f.kind, f.module) for f in self.report.findings
                      if f.severity in ("error", "warning"))


def _env() -> dict[str, str]:
    # One thread: the same float reduction order in both runs, and kind to a shared machine.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            "TOKENIZERS_PARALLELISM": "false"}


class Runs:
    """Runs each (script, args, amp-doctor options) once per test session and caches it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[tuple[str, tuple[str, ...], tuple[str, ...]], Pair] = {}
        # A plain run does not depend on amp-doctor's options: one per (script, args).
        self._plain: dict[tuple[str, tuple[str, ...]], subprocess.CompletedProcess[str]] = {}

    def get(self, script: str, args: tuple[str, ...] = (), opts: tuple[str, ...] = ()) -> Pair:
        key = (script, args, opts)
        if key not in self._cache:
            self._cache[key] = self._run(script, args, opts)
        return self._cache[key]

    def _run(self, script: str, args: tuple[str, ...], opts: tuple[str, ...]) -> Pair:
        assert AMP_DOCTOR, "the amp-doctor console script is not installed; run `make install`"
        d = self.root / f"run{len(self._cache)}"
        (d / "plain").mkdir(parents=True)
        (d / "under").mkdir()
        path = str(SCRIPTS / script)
        plain = self._plain.get((script, args))
        if plain is None:
            plain = subprocess.run([sys.executable, path, *args], cwd=d / "plain", env=_env(),
                                   capture_output=True, text=True, timeout=TIMEOUT_S)
            self._plain[(script, args)] = plain
        report = d / "under" / "report.json"
        under = subprocess.run(
            [AMP_DOCTOR, "diagnose", "--quiet", "--json", str(report), "--logdir", "ad",
             *opts, path, *args],
            cwd=d / "under", env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        session = Session.load(report) if report.exists() else None
        return Pair(plain, under, session)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("acceptance"))


def _same_run(p: Pair) -> None:
    """The script behaves exactly as under plain python: exit code and every loss."""
    assert p.plain.returncode == 0, p.plain.stderr[-3000:]
    assert p.under.returncode == p.plain.returncode, p.under.stderr[-3000:]
    assert p.losses("plain"), p.plain.stdout[-2000:]
    assert p.losses("under") == p.losses("plain")


# -- a nanoGPT-style trainer --------------------------------------------------------------

GPT_HEALTHY = ("--steps", str(GPT_STEPS))
GPT_OVERFLOW = (*GPT_HEALTHY, "--inject_overflow")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpt_healthy(runs: Runs, dtype: str) -> None:
    p = runs.get("gpt_train.py", (*GPT_HEALTHY, "--dtype", dtype))
    _same_run(p)
    s = p.report
    assert s.run.exit_code == 0 and s.run.outcome == "completed"
    assert s.steps == GPT_STEPS and s.recorded_steps == GPT_STEPS // 10
    assert s.amp.dtype == dtype and s.amp.autocast_seen
    assert s.amp.scaler == (dtype == "float16")
    assert p.loud() == []
    # The watched model's layers carry the user's names.
    names = {lay.name for lay in s.layers}
    assert {OVERFLOW_LAYER, "transformer.ln_f", "lm_head"} <= names


@pytest.mark.parametrize("every", ["1", "10"])
def test_gpt_overflow_steps_and_backoff_culprit(runs: Runs, every: str) -> None:
    p = runs.get("gpt_train.py", GPT_OVERFLOW, ("--every", every))
    _same_run(p)
    s = p.report
    assert s.steps == GPT_STEPS and s.recorded_steps == GPT_STEPS // int(every)
    assert s.amp.dtype == "float16" and s.amp.scaler
    assert s.scaler is not None and len(s.scaler.skipped_steps) == GPT_STEPS
    (backoff,) = s.findings_of("scaler_backoff")
    assert backoff.module == OVERFLOW_LAYER


@pytest.mark.parametrize("every", ["1", "10"])
def test_gpt_overflow_one_culprit(runs: Runs, every: str) -> None:
    p = runs.get("gpt_train.py", GPT_OVERFLOW, ("--every", every))
    s = p.report
    errors = [f for f in s.findings if f.severity == "error"]
    assert errors and {f.module for f in errors} == {OVERFLOW_LAYER}, p.loud()
    # Follow-on effects (the layers after c_fc, the underflow after the collapse) are not
    # errors or warnings of their own.
    assert {m for _, _, m in p.loud() if m is not None} == {OVERFLOW_LAYER}, p.loud()


def test_gpt_overflow_agrees_at_every_sampling_rate(runs: Runs) -> None:
    one = runs.get("gpt_train.py", GPT_OVERFLOW, ("--every", "1"))
    ten = runs.get("gpt_train.py", GPT_OVERFLOW, ("--every", "10"))
    assert one.loud() == ten.loud()


# -- Hugging Face Trainer -----------------------------------------------------------------

HF_STEPS = 12


def test_hf_trainer_bf16_runs_unchanged(runs: Runs) -> None:
    p = runs.get("hf_trainer.py", ("--steps", str(HF_STEPS), "--precision", "bf16"),
                 ("--every", "1"))
    _same_run(p)
    s = p.report
    assert s.steps == HF_STEPS and s.recorded_steps == HF_STEPS
    assert not s.amp.scaler
    assert p.loud() == []
    assert any(lay.name.startswith("transformer.h.1.mlp") for lay in s.layers)


def test_hf_trainer_bf16_autocast_found(runs: Runs) -> None:
    p = runs.get("hf_trainer.py", ("--steps", str(HF_STEPS), "--precision", "bf16"),
                 ("--every", "1"))
    assert p.report.amp.dtype == "bfloat16" and p.report.amp.autocast_seen


def test_hf_trainer_fp16_on_cpu_is_not_mixed_precision(runs: Runs) -> None:
    """``fp16=True`` on a CPU: Accelerate sets no autocast and no GradScaler (its
    ``native_amp`` is off for fp16 on CPU), so the run is float32. Saying so is the truth."""
    p = runs.get("hf_trainer.py", ("--steps", str(HF_STEPS), "--precision", "fp16"),
                 ("--every", "1"))
    _same_run(p)
    s = p.report
    assert s.steps == HF_STEPS
    assert not s.amp.autocast_seen and not s.amp.scaler and s.amp.dtype is None
    assert [k for _, k, _ in p.loud()] == ["autocast_inactive"]


# -- Lightning ----------------------------------------------------------------------------

PL_STEPS = 12


@pytest.mark.parametrize(
    ("precision", "dtype", "scaler"),
    [
        # Lightning itself swaps "16-mixed" for bf16 on a CPU (with a warning).
        ("16-mixed", "bfloat16", False),
        # Real float16 AMP on a CPU: the MixedPrecision plugin with its own GradScaler.
        ("16-mixed-plugin", "float16", True),
        ("bf16-mixed", "bfloat16", False),
    ],
)
def test_lightning(runs: Runs, precision: str, dtype: str, scaler: bool) -> None:
    p = runs.get("lightning_train.py", ("--steps", str(PL_STEPS), "--precision", precision),
                 ("--every", "1"))
    _same_run(p)
    s = p.report
    assert s.steps == PL_STEPS and s.recorded_steps == PL_STEPS
    assert s.amp.dtype == dtype and s.amp.autocast_seen and s.amp.scaler == scaler
    assert p.loud() == []
    assert {"encoder.0", "head"} <= {lay.name for lay in s.layers}


# -- EMA (AveragedModel) and whole-model torch.save ---------------------------------------

def test_ema_and_torch_save_keep_working(runs: Runs) -> None:
    p = runs.get("ema_save.py", ("--steps", "12"), ("--every", "1"))
    _same_run(p)
    assert "ema eval loss" in p.under.stdout
    s = p.report
    assert s.run.outcome == "completed" and s.steps == 12
    assert s.amp.dtype == "float16" and s.amp.scaler
    assert p.loud() == []


# -- torch.compile ------------------------------------------------------------------------

def _dynamo_counters(proc: subprocess.CompletedProcess[str]) -> dict[str, int]:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("opts", [pytest.param((), id="default"),
                                  pytest.param(("--anomaly",), id="anomaly")])
def test_compiled_model_unchanged(runs: Runs, opts: tuple[str, ...]) -> None:
    p = runs.get("compiled_mlp.py", ("--steps", "8"), opts)
    assert p.plain.returncode == p.under.returncode == 0, p.under.stderr[-3000:]
    plain = _dynamo_counters(p.plain)
    assert plain["graph_breaks"] == 0 and plain["unique_graphs"] == 1
    assert _dynamo_counters(p.under) == plain
    assert p.losses("under") == p.losses("plain")
    s = p.report
    assert s.steps == 8 and s.amp.dtype == "float16" and s.amp.scaler
    assert p.loud() == []
