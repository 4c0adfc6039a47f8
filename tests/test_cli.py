"""`amp-doctor diagnose/report/view`, run in subprocesses as a user runs them."""

from __future__ import annotations

import json
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

FIX = Path(__file__).parent / "fixtures" / "cli"
AMP_DOCTOR = console_script()
ENTRY_POINTS = [
    pytest.param([AMP_DOCTOR], id="amp-doctor"),
    pytest.param([sys.executable, "-m", "amp_doctor"], id="python-m"),
]


def run(cmd: list[str], cwd: Path, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env, **kw)


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    for f in FIX.iterdir():
        if f.is_dir():
            shutil.copytree(f, tmp_path / f.name)
        else:
            shutil.copy(f, tmp_path / f.name)
    return tmp_path


def test_console_script_is_installed() -> None:
    assert AMP_DOCTOR, "the amp-doctor console script is not on PATH; run `make install`"


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_script_sees_what_python_gives_it(work: Path, entry: list[str]) -> None:
    plain = run([sys.executable, "probe.py", "a", "--b"], work)
    under = run([*entry, "diagnose", "--logdir", "out", "probe.py", "a", "--b"], work)
    assert plain.returncode == under.returncode == 0, under.stderr
    a = json.loads(plain.stdout.splitlines()[0])
    b = json.loads(under.stdout.splitlines()[0])
    assert a == b
    assert b["name"] == "__main__" and b["argv"] == ["probe.py", "a", "--b"]
    assert b["path0"] == str(work) and b["pickled"] == 3 and b["spec_is_none"]
    # The script's stdout is exactly what python printed: the report goes to stderr.
    assert under.stdout == plain.stdout


def test_module_mode_for_packages(work: Path) -> None:
    plain = run([sys.executable, "-m", "pkgmod", "x"], work)
    under = run([AMP_DOCTOR, "diagnose", "--logdir", "out", "-m", "pkgmod", "x"], work)
    assert plain.stdout == under.stdout == "pkgmod main ['x']\n"
    assert under.returncode == 0


def _report(work: Path, logdir: str = "out") -> Session:
    return Session.load(work / logdir / "amp_doctor.json")


@pytest.mark.parametrize(
    ("args", "code", "outcome"),
    [([], 0, "completed"), (["--exit", "3"], 3, "exit"), (["--raise-error"], 1, "exception"),
     # sys.exit(main()) returning 0 is the usual way a script ends.
     (["--exit", "0"], 0, "completed")],
)
def test_exit_codes_and_report_on_every_path(work: Path, args: list[str], code: int,
                                             outcome: str) -> None:
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "train_tiny.py",
             "--steps", "3", *args], work)
    assert r.returncode == code, r.stderr
    s = _report(work)
    assert s.run.exit_code == code and s.run.outcome == outcome
    assert s.steps == 3 and s.recorded_steps == 3
    assert (work / "out" / "report.txt").read_text().startswith("amp-doctor")
    assert "tensorboard --logdir" in r.stderr
    if outcome == "exception":
        # The user's traceback, as python prints it, without amp-doctor's frames.
        assert "ValueError: user bug in the training script" in r.stderr
        assert 'train_tiny.py", line' in r.stderr
        assert "amp_doctor" not in r.stderr.split("Traceback")[1].split("ValueError")[0]


def test_ctrl_c_writes_the_report_and_exits_130(work: Path) -> None:
    proc = subprocess.Popen(
        [AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "train_tiny.py", "--wait"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    s = _report(work)
    assert s.run.outcome == "interrupted" and s.steps >= 3 and s.recorded_steps >= 3


def test_two_models_are_each_watched_with_prefixes(work: Path) -> None:
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "gan.py"], work)
    assert r.returncode == 0, r.stderr
    s = _report(work)
    names = {lay.name for lay in s.layers}
    assert {"gen.0", "gen.2", "disc.0", "disc.2"} <= names
    assert s.run.models == ["gen", "disc"]
    assert s.steps == 4 and s.scaler is not None and s.amp.scaler


def test_fail_on_gates_on_severity(work: Path) -> None:
    healthy = run([AMP_DOCTOR, "diagnose", "--fail-on", "warning", "--logdir", "a",
                   "train_tiny.py"], work)
    assert healthy.returncode == 0, healthy.stderr
    sick = run([AMP_DOCTOR, "diagnose", "--fail-on", "error", "--every", "1", "--logdir", "b",
                "train_tiny.py", "--overflow"], work)
    assert sick.returncode == 1
    assert "--fail-on" in sick.stderr
    s = _report(work, "b")
    assert any(f.kind == "activation_overflow" and f.module == "0" and f.severity == "error"
               for f in s.findings)
    never = run([AMP_DOCTOR, "diagnose", "--logdir", "c", "train_tiny.py", "--overflow"], work)
    assert never.returncode == 0


def test_report_renders_a_saved_run_exactly(work: Path) -> None:
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "--json", "r.json",
             "--report", "r.txt", "train_tiny.py", "--overflow"], work)
    assert r.returncode == 0
    saved = (work / "r.txt").read_text()
    again = run([AMP_DOCTOR, "report", "out"], work)
    assert again.returncode == 0 and again.stdout == saved
    from_json = run([AMP_DOCTOR, "report", "r.json", "--format", "json"], work)
    assert json.loads(from_json.stdout) == json.loads((work / "r.json").read_text())
    md = run([AMP_DOCTOR, "report", "out", "--format", "markdown"], work)
    assert md.stdout.startswith("**Verdict:") and "#### ERROR" in md.stdout


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_missing_script_and_unknown_module(work: Path, entry: list[str]) -> None:
    r = run([*entry, "diagnose", "trian.py"], work)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "trian.py" in r.stderr and "Traceback" not in r.stderr
    r = run([*entry, "diagnose", "-m", "no_such_module_xyz"], work)
    assert r.returncode == 2 and "no_such_module_xyz" in r.stderr
    assert "Traceback" not in r.stderr


def test_unwritable_logdir_fails_before_the_script_runs(work: Path) -> None:
    (work / "afile").write_text("")
    r = run([AMP_DOCTOR, "diagnose", "--logdir", "afile/sub", "train_tiny.py"], work)
    assert r.returncode == 2
    assert "--logdir" in r.stderr and r.stderr.count("\n") == 1
    assert "trained" not in r.stdout  # the script never started


def test_syntax_error_is_reported_as_python_does(work: Path) -> None:
    (work / "syntax_error.py").write_text('x = (1,\nprint("never")\n')
    plain = run([sys.executable, "syntax_error.py"], work)
    under = run([AMP_DOCTOR, "diagnose", "syntax_error.py"], work)
    assert plain.returncode == under.returncode == 1
    assert "SyntaxError" in under.stderr and "never" not in under.stdout
    assert plain.stderr.strip().splitlines()[-1] == under.stderr.strip().splitlines()[-1]


def test_report_on_missing_run_is_a_one_line_error(work: Path) -> None:
    r = run([AMP_DOCTOR, "report", "nowhere"], work)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "amp_doctor.json" in r.stderr


def test_view_serves_tensorboard(work: Path) -> None:
    import socket
    import urllib.request

    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "train_tiny.py"], work)
    assert r.returncode == 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([AMP_DOCTOR, "view", "out", "--port", str(port)], cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert f"http://127.0.0.1:{port}/" in proc.stdout.readline()
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2) as u:
                    runs = json.loads(u.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "tensorboard did not answer"
                time.sleep(0.5)
        assert runs == ["out"]  # named after its folder, not "." (issue 18)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_scheduler_made_before_the_first_forward_does_not_hide_the_scaler(work: Path) -> None:
    # LinearLR's constructor shows the optimizer before the model is discovered.
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "with_scheduler.py"],
            work)
    assert r.returncode == 0, r.stderr
    s = _report(work)
    assert s.amp.scaler and s.steps == 6 and s.recorded_steps == 6
    assert s.scaler is not None and s.scaler.scale[-1][1] == 65536.0
    assert not s.findings_of("missing_scaler")
