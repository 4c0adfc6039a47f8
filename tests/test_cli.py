"""`amp-doctor diagnose/report/view`, as a user runs them.

Each way a run can end (normal, sys.exit(n), an exception, Ctrl-C, a missing script,
a syntax error, a bad logdir) runs at least once in a subprocess through the installed
console script. The other checks call the same entry point, ``amp_doctor.cli.main``, in
this process (``cli`` fixture): seconds of start-up and torch import saved per run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from amp_doctor import Session
from amp_doctor.cli import main as cli_main
from tests.helpers import console_script

FIX = Path(__file__).parent / "fixtures" / "cli"
AMP_DOCTOR = console_script()
# How `amp-doctor ARGS...` is run: None is cli_main(ARGS) in this process (the `cli`
# fixture). `make test-fast` leaves out the `python -m amp_doctor` runs: its __main__.py
# calls the same cli_main, and the gallery's subprocess runs use it too.
ENTRY_POINTS = [
    pytest.param(None, id="in-process"),
    pytest.param([AMP_DOCTOR], id="amp-doctor"),
    pytest.param([sys.executable, "-m", "amp_doctor"], id="python-m", marks=pytest.mark.slow),
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


@dataclass
class Ran:
    """What a run of the CLI in this process returned and printed (as CompletedProcess)."""

    returncode: int
    stdout: str
    stderr: str


Cli = Callable[[list[str]], Ran]


@pytest.fixture()
def cli(work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    """``amp-doctor ARGS...`` in this process, in ``work``: ``cli_main(ARGS)``, exit status
    as the shell sees it, and what it printed."""
    monkeypatch.chdir(work)

    def call(args: list[str]) -> Ran:
        capsys.readouterr()  # only this run's output
        try:
            cli_main(args)
            code: int = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capsys.readouterr()
        return Ran(code, out, err)

    return call


def test_console_script_is_installed() -> None:
    assert AMP_DOCTOR, "the amp-doctor console script is not on PATH; run `make install`"


def _amp_doctor(request: pytest.FixtureRequest, entry: list[str] | None, work: Path,
                args: list[str]) -> Ran | subprocess.CompletedProcess:
    if entry is None:
        ran: Ran = request.getfixturevalue("cli")(args)
        return ran
    return run([*entry, *args], work)


@pytest.mark.parametrize("entry", [
    # The normal exit path through the console script already runs in a subprocess in
    # `make test` (test_exit_codes_and_report_on_every_path).
    pytest.param(None, id="in-process"),
    pytest.param([AMP_DOCTOR], id="amp-doctor", marks=pytest.mark.slow),
    ENTRY_POINTS[2],
])
def test_script_sees_what_python_gives_it(request: pytest.FixtureRequest, work: Path,
                                          entry: list[str] | None) -> None:
    plain = run([sys.executable, "probe.py", "a", "--b"], work)
    under = _amp_doctor(request, entry, work,
                        ["diagnose", "--logdir", "out", "probe.py", "a", "--b"])
    assert plain.returncode == under.returncode == 0, under.stderr
    a = json.loads(plain.stdout.splitlines()[0])
    b = json.loads(under.stdout.splitlines()[0])
    assert a == b
    assert b["name"] == "__main__" and b["argv"] == ["probe.py", "a", "--b"]
    assert b["path0"] == str(work) and b["pickled"] == 3 and b["spec_is_none"]
    # The script's stdout is exactly what python printed: the report goes to stderr.
    assert under.stdout == plain.stdout


def test_module_mode_for_packages(work: Path, cli: Cli) -> None:
    plain = run([sys.executable, "-m", "pkgmod", "x"], work)
    under = cli(["diagnose", "--logdir", "out", "-m", "pkgmod", "x"])
    assert plain.stdout == under.stdout == "pkgmod main ['x']\n"
    assert under.returncode == 0


@pytest.mark.parametrize("args", [
    ["--every", "3", "--logdir", "theirs", "-q"],
    ["-m", "other", "--json", "j.json"],
    ["--", "--every", "4"],  # python hands the module the "--" too
    ["--help"],
])
def test_arguments_after_the_module_are_the_modules(work: Path, cli: Cli,
                                                    args: list[str]) -> None:
    # Before: -m is an option with a value, after which click went on parsing, and took
    # the module's --every, --logdir, -q, -m, --json and --help for amp-doctor's (review 38).
    plain = run([sys.executable, "-m", "pkgmod", *args], work)
    under = cli(["diagnose", "--no-tensorboard", "--logdir", "out", "-m", "pkgmod", *args])
    assert under.stdout == plain.stdout == f"pkgmod main {args}\n"
    assert under.returncode == 0, under.stderr
    assert _report(work).run.command == ["python", "-m", "pkgmod", *args]
    assert not (work / "theirs").exists() and not (work / "j.json").exists()
    fix = cli(["fix", "--trials", "1", "-m", "pkgmod", "--help"])  # fix takes them alike
    assert "Usage: amp-doctor fix" not in fix.stdout


def _report(work: Path, logdir: str = "out") -> Session:
    return Session.load(work / logdir / "amp_doctor.json")


EXIT_PATHS = [  # (script arguments, exit code, outcome, id)
    ([], 0, "completed", "completed"),
    (["--exit", "3"], 3, "exit", "exit-3"),
    (["--raise-error"], 1, "exception", "exception"),
    # sys.exit(main()) returning 0 is the usual way a script ends.
    (["--exit", "0"], 0, "completed", "exit-0"),
]
# Every path in process; in a subprocess too, where `make test-fast` leaves out
# sys.exit(0)'s run (the same SystemExit path as sys.exit(3)).
EXIT_RUNS = [
    pytest.param(args, code, outcome, in_process, id=f"{name}-{mode}",
                 marks=[pytest.mark.slow] if name == "exit-0" and not in_process else [])
    for args, code, outcome, name in EXIT_PATHS
    for in_process, mode in ((True, "in-process"), (False, "subprocess"))
]


@pytest.mark.parametrize(("args", "code", "outcome", "in_process"), EXIT_RUNS)
def test_exit_codes_and_report_on_every_path(request: pytest.FixtureRequest, work: Path,
                                             args: list[str], code: int, outcome: str,
                                             in_process: bool) -> None:
    cmd = ["diagnose", "--every", "1", "--logdir", "out", "train_tiny.py", "--steps", "3", *args]
    r = _amp_doctor(request, None if in_process else [AMP_DOCTOR], work, cmd)
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


@pytest.mark.parametrize(("code", "status", "outcome"), [
    ("True", 1, "exit"), ("False", 0, "completed"), ("300", 44, "exit"), ("-1", 255, "exit"),
    ("2**70", 255, "exit"), ("256", 0, "completed")])
def test_the_report_records_the_exit_status_the_process_gets(work: Path, cli: Cli, code: str,
                                                             status: int,
                                                             outcome: str) -> None:
    # sys.exit(main()) with main() returning a bool wrote "exit_code": false, which report,
    # compare and fix then refused to read; sys.exit(300) was recorded as 300 where the
    # process ends with 44, and --fail-on judged 256 a failure while the shell saw 0
    # (review 38).
    (work / "ends.py").write_text(f"import sys, runpy\nsys.argv[1:] = ['--steps', '2']\n"
                                  f"runpy.run_path('train_tiny.py', run_name='__main__')\n"
                                  f"sys.exit({code})\n")
    plain = run([sys.executable, "ends.py"], work)
    r = cli(["diagnose", "--no-tensorboard", "--logdir", "out", "ends.py"])
    assert r.returncode == plain.returncode == status
    s = _report(work)
    assert (s.run.exit_code, s.run.outcome) == (status, outcome)
    assert cli(["report", "out"]).returncode == 0  # it reads back


def _signal_a_waiting_run(work: Path, sig: int) -> tuple[int, str]:
    """``sig`` to a diagnose run once its script has trained 3 steps; (exit status, stderr)."""
    proc = subprocess.Popen(
        [AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "train_tiny.py", "--wait"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, err


def test_ctrl_c_writes_the_report_then_dies_by_sigint(work: Path) -> None:
    # As python does after an uncaught KeyboardInterrupt (a shell shows 130).
    code, err = _signal_a_waiting_run(work, signal.SIGINT)
    assert code == -signal.SIGINT, err
    s = _report(work)
    assert s.run.outcome == "interrupted" and s.steps >= 3 and s.recorded_steps >= 3
    assert s.run.exit_code == 130
    assert (work / "out" / "report.txt").read_text().startswith("amp-doctor")


def test_ctrl_c_stops_a_shell_loop_of_runs(work: Path) -> None:
    # A sweep: `for lr in ...; do amp-doctor diagnose ...; done`. Ctrl-C reaches the whole
    # foreground group; bash stops the loop only if its command died by SIGINT. An exit
    # status of 130 (what amp-doctor gave before) made it start the next run.
    loop = (f"for i in 1 2; do {shlex.quote(AMP_DOCTOR)} diagnose --every 1 --logdir out$i "
            "train_tiny.py --wait; echo next $i; done")
    shell = subprocess.Popen(["bash", "-c", loop], cwd=work, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert shell.stdout is not None
        assert shell.stdout.readline().strip() == "ready"
        os.killpg(shell.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        out, err = shell.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    assert "next" not in out and shell.returncode == -signal.SIGINT, err
    assert not (work / "out2").exists()
    s = Session.load(work / "out1" / "amp_doctor.json")
    assert s.run.outcome == "interrupted" and s.steps >= 3


def test_sigterm_writes_the_report_then_dies_by_it(work: Path) -> None:
    # What a scheduler's time limit, `kill` or `docker stop` sends: python would die at
    # once, with nothing written; the run unwinds instead, as for Ctrl-C, and once the
    # report is written the process ends by the signal, as python's would have.
    code, err = _signal_a_waiting_run(work, signal.SIGTERM)
    assert code == -signal.SIGTERM, err
    s = _report(work)
    assert s.run.outcome == "interrupted" and s.run.error == "SIGTERM (signal 15)"
    assert s.run.exit_code == 143 and s.steps >= 3 and s.recorded_steps >= 3
    assert "amp-doctor: the script was stopped by SIGTERM" in err
    assert "Traceback" not in err and "Terminated" not in err
    assert (work / "out" / "report.txt").read_text().startswith("amp-doctor")


def test_a_scripts_own_sigterm_handler_is_kept(work: Path) -> None:
    (work / "own_term.py").write_text("""
import os, signal, sys
import torch
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(7))
m = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(3):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(torch.randn(2, 4)).float().pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
os.kill(os.getpid(), signal.SIGTERM)
print("not reached")
""")
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "own_term.py"], work)
    assert r.returncode == 7 and "not reached" not in r.stdout, r.stderr
    s = _report(work)
    assert s.run.outcome == "exit" and s.steps == 3
    assert "SIGTERM" not in r.stderr


def test_two_models_are_each_watched_with_prefixes(work: Path, cli: Cli) -> None:
    r = cli(["diagnose", "--every", "1", "--logdir", "out", "gan.py"])
    assert r.returncode == 0, r.stderr
    s = _report(work)
    names = {lay.name for lay in s.layers}
    assert {"gen.0", "gen.2", "disc.0", "disc.2"} <= names
    assert s.run.models == ["gen", "disc"]
    assert s.steps == 4 and s.scaler is not None and s.amp.scaler


def test_parts_called_from_a_dict_are_named_by_their_keys(work: Path, cli: Cli) -> None:
    # Before: Linear, Linear1, Linear2..., which no finding or --fp32 pattern maps back.
    (work / "parts.py").write_text("""
import torch
from torch import nn
torch.manual_seed(0)
parts = nn.ModuleDict({"encoder": nn.Linear(8, 8), "decoder": nn.Linear(8, 2)})
nets = {"gen": nn.Linear(8, 8), "disc": nn.Linear(8, 1)}
params = [*parts.parameters(), *[p for m in nets.values() for p in m.parameters()]]
opt = torch.optim.SGD(params, lr=0.1)
for i in range(3):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = parts["decoder"](parts["encoder"](torch.randn(2, 8)))
        loss = h.float().pow(2).mean() + nets["disc"](nets["gen"](torch.randn(2, 8))).float().mean()
    loss.backward(); opt.step(); opt.zero_grad()
""")
    r = cli(["diagnose", "--every", "1", "--logdir", "out", "parts.py"])
    assert r.returncode == 0, r.stderr
    assert _report(work).run.models == ["parts.encoder", "parts.decoder", "nets.gen", "nets.disc"]


@pytest.mark.parametrize("gen_call", ["gen(z)", "g2(g1(z))"])
def test_slices_of_a_sequential_are_its_layers_not_a_new_model_per_call(
        work: Path, cli: Cli, gen_call: str) -> None:
    # A perceptual loss over a frozen network's first layers: feat[:k] is a new
    # Sequential on every call. Before: 'Sequential', 'Sequential1'... one model per call
    # (25 models in 6 steps here, and the JSON growing with every step).
    (work / "sliced.py").write_text(f"""
import torch
from torch import nn
torch.manual_seed(0)
gen = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
feat = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
feat.requires_grad_(False)
opt = torch.optim.Adam(gen.parameters(), lr=1e-3)
for it in range(6):
    z, target = torch.randn(8, 16), torch.randn(8, 16)
    g1, g2 = gen[:2], gen[2:]  # slices held in variables, made anew each iteration
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = {gen_call}
        loss = nn.functional.mse_loss(out, target)
        for k in (2, 4):
            loss = loss + nn.functional.mse_loss(feat[:k](out), feat[:k](target))
    opt.zero_grad()
    loss.backward()
    opt.step()
""")
    r = cli(["diagnose", "--every", "1", "--logdir", "out", "sliced.py"])
    assert r.returncode == 0, r.stderr
    s = _report(work)
    assert s.run.models == ["gen", "feat"]
    assert {lay.name for lay in s.layers} - {"gen"} == {"gen.0", "gen.1", "gen.2",
                                                        "feat.0", "feat.1", "feat.2", "feat.3"}
    assert s.layer("feat.2").recorded_steps == 6 and s.steps == 6


def test_fail_on_gates_on_severity(work: Path, cli: Cli) -> None:
    healthy = cli(["diagnose", "--fail-on", "warning", "--logdir", "a", "train_tiny.py"])
    assert healthy.returncode == 0, healthy.stderr
    sick = cli(["diagnose", "--fail-on", "error", "--every", "1", "--logdir", "b",
                "train_tiny.py", "--overflow"])
    assert sick.returncode == 1
    assert "--fail-on" in sick.stderr
    s = _report(work, "b")
    assert any(f.kind == "activation_overflow" and f.module == "0" and f.severity == "error"
               for f in s.findings)
    never = cli(["diagnose", "--logdir", "c", "train_tiny.py", "--overflow"])
    assert never.returncode == 0


def test_report_renders_a_saved_run_exactly(work: Path, cli: Cli) -> None:
    r = cli(["diagnose", "--every", "1", "--logdir", "out", "--json", "r.json",
             "--report", "r.txt", "train_tiny.py", "--overflow"])
    assert r.returncode == 0
    saved = (work / "r.txt").read_text()
    again = cli(["report", "out"])
    assert again.returncode == 0 and again.stdout == saved
    from_json = cli(["report", "r.json", "--format", "json"])
    assert json.loads(from_json.stdout) == json.loads((work / "r.json").read_text())
    md = cli(["report", "out", "--format", "markdown"])
    assert md.stdout.startswith("**Verdict:") and "#### ERROR" in md.stdout


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_missing_script_and_unknown_module(request: pytest.FixtureRequest, work: Path,
                                           entry: list[str] | None) -> None:
    # The exit codes are python's own: `python trian.py` exits 2, `python -m nope` 1.
    r = _amp_doctor(request, entry, work, ["diagnose", "trian.py"])
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "trian.py" in r.stderr and "Traceback" not in r.stderr
    r = _amp_doctor(request, entry, work, ["diagnose", "-m", "no_such_module_xyz"])
    assert r.returncode == 1 and "no_such_module_xyz" in r.stderr
    assert "Traceback" not in r.stderr
    # `python folder` without a __main__.py exits 1 ("can't find '__main__' module").
    (work / "folder").mkdir()
    r = _amp_doctor(request, entry, work, ["diagnose", "folder"])
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "No __main__.py in 'folder'" in r.stderr


def test_unwritable_logdir_fails_before_the_script_runs(work: Path, cli: Cli) -> None:
    (work / "afile").write_text("")
    r = cli(["diagnose", "--logdir", "afile/sub", "train_tiny.py"])
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


def test_fix_on_a_syntax_error_is_reported_as_python_does(work: Path) -> None:
    # Before: an internal traceback through click before the user's error.
    (work / "syntax_error.py").write_text('x = (1,\nprint("never")\n')
    plain = run([sys.executable, "syntax_error.py"], work)
    under = run([AMP_DOCTOR, "fix", "syntax_error.py"], work)
    assert plain.returncode == under.returncode == 1
    assert "click" not in under.stderr and "amp_doctor" not in under.stderr
    assert plain.stderr.strip().splitlines()[-1] == under.stderr.strip().splitlines()[-1]


def test_fix_on_a_script_that_never_trains_says_so(work: Path, cli: Cli) -> None:
    # Before: AMP advice (bfloat16, loss scaling) for a script whose config was missing,
    # and the crash named nowhere.
    (work / "early.py").write_text('raise RuntimeError("config missing: data path")\n')
    r = cli(["fix", "--no-anomaly", "early.py"])
    assert r.returncode == 1
    assert ("The baseline run finished no training step (it ended with RuntimeError: "
            "config missing: data path)") in r.stdout
    assert "bfloat16" not in r.stdout and "Next things to try" not in r.stdout


@pytest.mark.parametrize(("given", "says"), [
    ("-", "a script read from standard input (`-`) cannot be diagnosed"),
    ("nb.ipynb", "is a Jupyter notebook, not a Python script: convert it with "
                 "`jupyter nbconvert --to script nb.ipynb`"),
])
def test_scripts_diagnose_cannot_run_are_one_clear_line(work: Path, cli: Cli, given: str,
                                                         says: str) -> None:
    (work / "nb.ipynb").write_text('{"cells": []}')
    r = cli(["diagnose", given])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr


def test_reports_are_written_through_a_symlink_and_into_a_fifo(work: Path, cli: Cli) -> None:
    # The atomic write renamed over the path: a symlink was replaced by a file (its target
    # kept the old report), and --json /dev/stdout replaced /dev/stdout itself as root.
    (work / "real").mkdir()
    (work / "real" / "r.json").write_text('{"old": true}')
    (work / "r.json").symlink_to(work / "real" / "r.json")
    os.mkfifo(work / "pipe.txt")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append((work / "pipe.txt").read_bytes()),
                              daemon=True)
    reader.start()
    r = cli(["diagnose", "--quiet", "--no-tensorboard", "--json", "r.json",
             "--report", "pipe.txt", "train_tiny.py"])
    reader.join(timeout=60)
    assert r.returncode == 0
    assert (work / "r.json").is_symlink()
    assert json.loads((work / "real" / "r.json").read_text())["steps"] == 4
    assert got and got[0].startswith(b"amp-doctor ")
    assert stat.S_ISFIFO((work / "pipe.txt").stat().st_mode)


def test_an_empty_logdir_is_an_error_not_the_working_directory(work: Path, cli: Cli) -> None:
    # --logdir "$OUT" with OUT unset: before, the reports went into the working directory.
    before = sorted(p.name for p in work.iterdir())
    r = cli(["diagnose", "--logdir", "", "train_tiny.py"])
    assert r.returncode == 2
    assert "Invalid value for '--logdir': is empty; pass a directory" in r.stderr
    assert sorted(p.name for p in work.iterdir()) == before


def test_logdir_that_is_a_file_is_named_so(work: Path, cli: Cli) -> None:
    (work / "afile").write_text("")
    r = cli(["diagnose", "--logdir", "afile", "train_tiny.py"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "afile' is a file, not a directory; pass a directory" in r.stderr


def test_a_json_path_under_a_file_names_the_file(work: Path, cli: Cli) -> None:
    # Review 40: "(File exists)" from mkdir, of a path whose parent is a file.
    (work / "afile").write_text("")
    r = cli(["diagnose", "--json", "afile/x.json", "train_tiny.py"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "/afile' is a file, not a directory; pass another path with --json." in r.stderr


def test_a_report_path_that_would_overwrite_the_script_or_the_other_report_fails(
        work: Path, cli: Cli) -> None:
    # Review 58c: `--json victim.py victim.py` replaced the user's source with the JSON, and
    # `--json same.out --report same.out` kept only one of the two reports; both exited 0.
    script = (work / "train_tiny.py").read_text()
    (work / "helper.py").write_text("X = 1\n")
    for args, says in (
            (["--json", "train_tiny.py"], "--json '" + str(work / "train_tiny.py")
             + "' is the script being run: the report would overwrite it; pass another "
             "path, e.g. --json " + str(work / "amp_doctor.json") + "."),
            (["--report", "./helper.py"], "is a Python source file: the report would "
             "overwrite it"),
            (["--json", "same.out", "--report", "same.out"], "--json and --report name the "
             "same file '" + str(work / "same.out") + "', which would hold only the last "
             "report written")):
        r = cli(["diagnose", *args, "train_tiny.py"])
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert says in r.stderr
        assert "trained" not in r.stdout  # the script never started
    assert (work / "train_tiny.py").read_text() == script
    assert (work / "helper.py").read_text() == "X = 1\n"
    assert not (work / "same.out").exists()


def test_report_on_a_run_killed_before_its_report_says_so(work: Path, cli: Cli) -> None:
    (work / "killed").mkdir()
    (work / "killed" / "events.out.tfevents.1.host").write_bytes(b"")
    r = cli(["report", "killed"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "the run was stopped before it wrote one" in r.stderr


def test_report_on_missing_run_is_a_one_line_error(work: Path) -> None:
    r = run([AMP_DOCTOR, "report", "nowhere"], work)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "amp_doctor.json" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_view_serves_tensorboard(work: Path, cli: Cli, sig: int) -> None:
    # SIGTERM (kill, an IDE's stop button) left the TensorBoard server running, its port
    # bound, and view's folder behind; Ctrl-C did not (review 38).
    import socket
    import urllib.request

    r = cli(["diagnose", "--every", "1", "--logdir", "out", "train_tiny.py"])
    assert r.returncode == 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([AMP_DOCTOR, "view", "out", "--port", str(port)], cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        # It opens amp-doctor's tab unsmoothed: smoothing 0.6 drew a few recorded steps
        # as a line nowhere near them (review 52b).
        said = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/#custom_scalars&_smoothingWeight=0 " in said, said
        assert "Ignore outliers" in proc.stdout.readline()
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
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        tree = [p for p in Path(tempfile.gettempdir()).glob("amp-doctor-view-*")]
        assert children and tree
    finally:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == (0 if sig == signal.SIGINT else -sig)
    for pid in children:  # the server is gone with it
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(
            f"/proc/{pid}/status").read_text()
    assert not any(p.exists() for p in tree)


def test_scheduler_made_before_the_first_forward_does_not_hide_the_scaler(
        work: Path, cli: Cli) -> None:
    # LinearLR's constructor shows the optimizer before the model is discovered.
    r = cli(["diagnose", "--every", "1", "--logdir", "out", "with_scheduler.py"])
    assert r.returncode == 0, r.stderr
    s = _report(work)
    assert s.amp.scaler and s.steps == 6 and s.recorded_steps == 6
    assert s.scaler is not None and s.scaler.scale[-1][1] == 65536.0
    assert not s.findings_of("missing_scaler")


def test_an_unlocated_nan_is_told_what_it_has_not_tried_and_raise_names_the_op(
        cli: Cli, work: Path) -> None:
    # One outlier batch: the search on the next steps sees only finite ops. The advice
    # leaves out --every 1 (already so) and gives the CLI's way to stop at the op.
    ran = cli(["diagnose", "--every", "1", "--anomaly", "--logdir", "a", "outlier_batch.py"])
    assert ran.returncode == 0
    (f,) = [f for f in json.loads((work / "a" / "amp_doctor.json").read_text())["findings"]
            if f["kind"] == "nonfinite_unlocated"]
    assert f["step"] == 5
    assert "--every 1" not in f["advice"] and "--anomaly --on-nonfinite raise" in f["advice"]
    assert "Without a GradScaler" not in f["advice"]  # the run has one
    ran = cli(["diagnose", "--every", "1", "--on-nonfinite", "raise", "--logdir", "r",
               "outlier_batch.py"])
    assert ran.returncode == 1  # the script ended at the op, as with watch(on_nonfinite=...)
    report = json.loads((work / "r" / "amp_doctor.json").read_text())
    assert report["run"]["outcome"] == "exception"
    origin = [(f["kind"], f["module"], f["op"], f["step"]) for f in report["findings"]
              if f["severity"] == "error"]
    assert origin == [("nonfinite_forward", "block", "aten.exp", 5)]
    # Steps 0-4 finished; step 5 was recorded up to the op that raised.
    assert "| 5 steps (6 recorded, the last unfinished, every 1) |" in \
        (work / "r" / "report.txt").read_text()
