"""The report is never lost: odd ways out of a script, bad output paths, parallel runs.

Each case is the situation issue 14 met, run as a user runs it: a real script in a
subprocess through the installed `amp-doctor` command.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from amp_doctor.records import Session
from tests.helpers import console_script

FIX = Path(__file__).parent / "fixtures" / "cli"
AMP_DOCTOR = console_script()


def run(cmd: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    shutil.copy(FIX / "train_tiny.py", tmp_path / "train_tiny.py")
    return tmp_path


# A tiny AMP loop, then whatever way out the test appends.
LOOP = """
import os, sys, time
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
def step():
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
for _ in range(3):
    step()
"""


@pytest.mark.parametrize("option,name", [("--json", "amp_doctor.json"), ("--report", "report.txt")])
def test_output_path_that_is_a_folder_fails_before_the_script_runs(
        work: Path, option: str, name: str) -> None:
    (work / "reports").mkdir()
    r = run([AMP_DOCTOR, "diagnose", "--logdir", "out", option, "reports", "train_tiny.py"],
            work)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1, r.stderr
    assert option in r.stderr and "is a directory" in r.stderr
    assert f"reports/{name}" in r.stderr  # the fix: a file path in that folder
    assert "trained" not in r.stdout  # the script never started
    assert not (work / "out" / "amp_doctor.json").exists()


def test_unwritable_json_path_blames_json_not_logdir(work: Path) -> None:
    r = run([AMP_DOCTOR, "diagnose", "--logdir", "out", "--json", "/proc/x/y.json",
             "train_tiny.py"], work)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--json" in r.stderr and "--logdir" not in r.stderr
    assert "trained" not in r.stdout


@pytest.mark.parametrize("how", ["redirect-and-close", "close-the-real-one"])
def test_script_that_closes_stderr_still_gets_its_report(work: Path, how: str) -> None:
    if how == "redirect-and-close":
        ending = ("sys.stderr = open('script.log', 'w')\n"
                  "print('to the log', file=sys.stderr)\n"
                  "sys.stderr.close()\n")
    else:
        ending = "sys.stderr.close()\nsys.stdout.close()\n"
    (work / "closer.py").write_text(LOOP + ending + "sys.exit(3)\n")
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "closer.py"], work)
    assert r.returncode == 3, r.stderr  # the script's own exit code
    text = (work / "out" / "report.txt").read_text()
    assert text.startswith("amp-doctor")
    # Printed on amp-doctor's own handle to the terminal, not into the closed stream.
    assert "amp-doctor" in r.stderr and "JSON report" in r.stderr
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.run.exit_code == 3 and s.run.outcome == "exit" and s.steps == 3
    if how == "redirect-and-close":
        assert (work / "script.log").read_text() == "to the log\n"


def test_os_exit_keeps_its_code_and_writes_what_the_readme_says(work: Path) -> None:
    # README, Reliability: os._exit runs no Python code after it, so no report; the
    # exit code is the script's.
    (work / "hard_exit.py").write_text(LOOP + "sys.stdout.flush()\nos._exit(7)\n")
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "hard_exit.py"], work)
    assert r.returncode == 7
    assert not (work / "out" / "amp_doctor.json").exists()
    assert not (work / "out" / "report.txt").exists()
    assert "amp-doctor" not in r.stderr


# The LOOP trains in each forked worker; 40 steps write more than a TensorBoard queue holds.
POOL = LOOP.replace("for _ in range(3):\n    step()", "") + """
import multiprocessing as mp
def train(seed):
    torch.manual_seed(seed)
    for _ in range(40):
        step()
    return seed
if __name__ == "__main__":
    for _ in range(3):
        step()
    with mp.get_context("fork").Pool(2) as pool:
        print("sweep", pool.map(train, range(4)), flush=True)
"""

FORK_CHILD = LOOP + """
pid = os.fork()
if pid == 0:
    for _ in range(30):
        step()
    print("child done", flush=True)
    sys.exit(0)
os.waitpid(pid, 0)
step()
print("parent done", flush=True)
"""


@pytest.mark.parametrize("script", ["pool", "os_fork"])
def test_forked_children_that_train_run_unwatched_and_the_parent_reports(
        work: Path, script: str) -> None:
    # Before: a fork child inherited the watch but not the TensorBoard writer's thread, so
    # its writes filled the queue and blocked forever (a Pool hung; an os.fork child
    # hung in its exit's flush, or printed a second report into the parent's logdir).
    (work / "forks.py").write_text(POOL if script == "pool" else FORK_CHILD)
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "forks.py"], work,
            timeout=120)
    assert r.returncode == 0, r.stderr
    expected = ("sweep [0, 1, 2, 3]\n" if script == "pool"
                else "child done\nparent done\n")
    assert r.stdout.startswith(expected)
    assert (r.stdout + r.stderr).count("amp-doctor 0.1.0:") == 1  # the parent's report only
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.steps == (3 if script == "pool" else 4) and s.run.outcome == "completed"


def test_a_training_thread_that_outlives_the_main_code_is_waited_for(work: Path) -> None:
    # Python waits for non-daemon threads before it exits. Before: diagnose closed the
    # watch when the main code returned, so the report held part of the run, or the
    # training thread died of an AssertionError in amp-doctor's hook.
    (work / "threaded.py").write_text(LOOP.replace("for _ in range(3):\n    step()", "") + """
import threading
from concurrent.futures import ThreadPoolExecutor
def train():
    for _ in range(60):
        step()
    print("thread done", flush=True)
# A pool left running: python stops its workers at exit; they must not be waited for.
ThreadPoolExecutor(2).submit(lambda: None).result()
threading.Thread(target=train).start()
print("main done", flush=True)
""")
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "threaded.py"], work)
    assert r.returncode == 0 and "Error" not in r.stderr, r.stderr
    assert r.stdout.startswith("main done\nthread done\n")
    s = Session.load(work / "out" / "amp_doctor.json")
    assert (s.steps, s.recorded_steps, s.run.outcome) == (60, 60, "completed")


def test_what_the_script_sets_before_importing_torch_takes_effect(work: Path) -> None:
    # OMP_NUM_THREADS set at the top of the script, before `import torch`: torch reads it
    # at import. Before: diagnose had imported torch already, so the run used every core
    # (and a float32 sum split over them rounded differently from the same run under
    # python). The script then trains, watched from its first torch op.
    (work / "pinned.py").write_text('import os\nos.environ["OMP_NUM_THREADS"] = "1"\n'
                                    + LOOP + 'print("threads", torch.get_num_threads())\n')
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",
                                                             "MKL_NUM_THREADS")}
    plain = subprocess.run([sys.executable, "pinned.py"], cwd=work, capture_output=True,
                           text=True, env=env, timeout=120)
    r = subprocess.run([AMP_DOCTOR, "diagnose", "--no-tensorboard", "--every", "1",
                        "--logdir", "out", "pinned.py"], cwd=work, capture_output=True,
                       text=True, env=env, timeout=180)
    assert plain.stdout == "threads 1\n"
    assert r.returncode == 0 and r.stdout.startswith("threads 1\n"), r.stderr
    s = Session.load(work / "out" / "amp_doctor.json")
    assert (s.steps, s.recorded_steps) == (3, 3) and s.layer("0").calls == 3


def test_a_logdir_the_script_deletes_is_said_in_one_line_and_the_reports_still_written(
        work: Path) -> None:
    # shutil.rmtree("runs") to clear old TensorBoard logs, while amp-doctor's are in there.
    # Before: "could not write the logs ... check free space and permissions", and no
    # report. (TensorBoard's writer thread is left out here: its re-opening of the event
    # file races with rmtree, as a SummaryWriter of the script's own would; its errors
    # are kept off the output, test_tensorboard.py.)
    (work / "cleans.py").write_text(LOOP + """
import shutil
shutil.rmtree("out")
for _ in range(3):
    step()
""")
    r = run([AMP_DOCTOR, "diagnose", "--no-tensorboard", "--every", "1", "--logdir", "out",
             "cleans.py"], work)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Exception in thread" not in r.stderr, r.stderr
    assert "was deleted while the run was on (by the script?): its TensorBoard events are " \
        "lost; the reports are written there again." in r.stderr
    assert r.stderr.count("amp-doctor: ") >= 1 and "TensorBoard output was not" not in r.stderr
    assert Session.load(work / "out" / "amp_doctor.json").steps == 6


def test_stop_after_in_a_training_thread_ends_it_without_a_traceback(work: Path) -> None:
    # Before: amp-doctor's StopRun traceback, as "Exception in thread", in the output.
    (work / "threaded_stop.py").write_text(LOOP.replace("for _ in range(3):\n    step()", "")
                                           + """
import threading
def train():
    for _ in range(50):
        step()
    print("thread done", flush=True)
t = threading.Thread(target=train)
t.start()
t.join()
print("main done", flush=True)
""")
    r = run([AMP_DOCTOR, "diagnose", "--no-tensorboard", "--stop-after", "3", "--logdir", "out",
             "threaded_stop.py"], work)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "StopRun" not in r.stderr, r.stderr
    assert r.stdout.startswith("main done\n")
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.steps == 3
    # Review 40: a shortened run read "completed".
    assert s.run.outcome == "stopped" and s.run.exit_code == 0
    assert "| stopped by amp-doctor (--stop-after)" in r.stderr


def test_a_script_that_never_imports_torch_still_gets_its_report(work: Path) -> None:
    # A wrapper that starts the real trainer in a subprocess, or the wrong file. Before:
    # torch imported to report nothing (seconds), empty TensorBoard logs, and "check that
    # the script trains" (review 38).
    (work / "plain.py").write_text('import sys\nprint("no torch here")\nsys.exit(3)\n')
    r = run([AMP_DOCTOR, "diagnose", "--logdir", "out", "plain.py"], work)
    assert r.returncode == 3 and r.stdout.startswith("no torch here\n"), r.stderr
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.steps == 0 and s.run.exit_code == 3 and s.run.outcome == "exit"
    assert "the script never imported torch" in r.stderr
    assert not list((work / "out").glob("events.out.tfevents.*"))
    assert "view the dashboards" not in r.stderr


def test_a_crash_under_anomaly_mode_shows_no_dispatch_plumbing_in_the_traceback(
        work: Path) -> None:
    # A shape error inside F.linear, with anomaly mode's dispatch mode on: the traceback
    # ended with torch/_compile.py, eval_frame.py and _ops.py frames python never shows
    # (review 42a).
    (work / "crash.py").write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(15, 4))\n"
        "with torch.autocast('cpu', dtype=torch.float16):\n"
        "    out = model(torch.randn(4, 8))\n")
    plain = run([sys.executable, "crash.py"], work)
    r = run([AMP_DOCTOR, "diagnose", "--anomaly", "--logdir", "out", "crash.py"], work)
    assert plain.returncode == r.returncode == 1
    tail = plain.stderr.rstrip().splitlines()[-4:]  # linear.py's frame, then the error
    assert "linear.py" in tail[0] and tail[-1].startswith("RuntimeError: mat1 and mat2")
    shown = r.stderr[r.stderr.index("Traceback"):]
    shown = shown[: shown.index(tail[-1]) + len(tail[-1])]
    assert shown.splitlines()[-4:] == tail
    for internal in ("_compile.py", "eval_frame.py", "_ops.py", "amp_doctor"):
        assert internal not in shown, shown


def test_a_checkpoint_of_a_scripts_own_module_class_loads_without_amp_doctor(
        work: Path) -> None:
    # Under the CLI the watch starts at `import torch`, before the script defines its
    # classes: one with its own __getstate__ saved whole needed amp_doctor to load
    # (review 42c).
    (work / "own.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class Own(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.fc = nn.Linear(8, 2)\n"
        "    def forward(self, x):\n        return self.fc(x)\n"
        "    def __getstate__(self):\n        return dict(self.__dict__)\n"
        "if __name__ == '__main__':\n"
        "    m = Own(); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "    for _ in range(2):\n"
        "        with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "            loss = m(torch.randn(4, 8)).float().sum()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    torch.save(m, 'own.pt')\n")
    r = run([AMP_DOCTOR, "diagnose", "--logdir", "out", "own.py"], work)
    assert r.returncode == 0, r.stderr
    assert Session.load(work / "out" / "amp_doctor.json").steps == 2
    loader = ("import sys; sys.modules['amp_doctor'] = None; sys.path.insert(0, '.'); "
              "import torch, own; sys.modules['__main__'].Own = own.Own; "
              "m = torch.load('own.pt', weights_only=False); "
              "print(type(m).__name__, len(m._forward_hooks) + len(m.fc._forward_hooks))")
    r = run([sys.executable, "-c", loader], work)
    assert r.returncode == 0 and r.stdout.split() == ["Own", "0"], r.stderr


def test_a_scripts_help_leaves_no_run_folder(work: Path) -> None:
    # `diagnose train.py --help`: argparse prints and exits 0 before torch is imported.
    # Before: a runs/amp-doctor/<run>/ folder holding a report of nothing (review 40).
    (work / "cli.py").write_text(
        "import argparse\nargparse.ArgumentParser(description='trains').parse_args()\n"
        "import torch\n")
    (work / "mine").mkdir()
    r = run([AMP_DOCTOR, "diagnose", "cli.py", "--help"], work)
    assert r.returncode == 0 and "trains" in r.stdout, r.stderr
    assert "never imported torch" in r.stderr and "no report was written" in r.stderr
    assert sorted(p.name for p in work.iterdir()) == ["cli.py", "mine", "train_tiny.py"]
    # A folder that existed stays; a report the user asked for is still written.
    (work / "runs").mkdir()
    r = run([AMP_DOCTOR, "diagnose", "cli.py", "--help"], work)
    assert r.returncode == 0 and list((work / "runs").iterdir()) == []
    r = run([AMP_DOCTOR, "diagnose", "--json", "mine/r.json", "cli.py", "--help"], work)
    assert r.returncode == 0 and Session.load(work / "mine" / "r.json").run.exit_code == 0
    # Most scripts import torch first (review 42b): the watch starts, then the help.
    shutil.rmtree(work / "runs")
    (work / "torch_first.py").write_text(
        "import argparse, torch\nargparse.ArgumentParser(description='trains').parse_args()\n")
    r = run([AMP_DOCTOR, "diagnose", "torch_first.py", "--help"], work)
    assert r.returncode == 0 and "trains" in r.stdout, r.stderr
    assert "printed its help and trained nothing; no report was written" in r.stderr
    assert not (work / "runs").exists()
    # Without --help, the same script's run of nothing still gets its report.
    r = run([AMP_DOCTOR, "diagnose", "torch_first.py"], work)
    assert r.returncode == 0 and len(list((work / "runs" / "amp-doctor").glob("*/*.json"))) == 1


def test_the_scripts_own_excepthook_is_called_as_under_python(work: Path) -> None:
    # A crash logger (Sentry, rich) installed by the script. Before: never called.
    (work / "hooked.py").write_text(LOOP + """
def hook(t, v, tb):
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    open("crash.log", "w").write(f"{t.__name__}: {v} in {names}")
sys.excepthook = hook
def boom():
    raise ValueError("boom")
boom()
""")
    r = run([AMP_DOCTOR, "diagnose", "--logdir", "out", "hooked.py"], work)
    assert r.returncode == 1
    # The script's frames only, from its module level, as python hands them over.
    assert (work / "crash.log").read_text() == "ValueError: boom in ['<module>', 'boom']"
    assert Session.load(work / "out" / "amp_doctor.json").run.outcome == "exception"


def test_a_stderr_replacement_without_flush_still_gets_the_report(work: Path) -> None:
    # A hand-written tee with write() only. Before: amp-doctor's own traceback on its
    # flush(), and no report printed.
    (work / "tee.py").write_text("""
import sys
class Tee:
    def __init__(self, f): self.f = f
    def write(self, s): return self.f.write(s)
sys.stderr = Tee(sys.stderr)
""" + LOOP)
    plain = run([sys.executable, "tee.py"], work)
    r = run([AMP_DOCTOR, "diagnose", "--logdir", "out", "tee.py"], work)
    assert r.returncode == plain.returncode  # python's own 120 at shutdown, as plain
    assert "Traceback" not in r.stderr and "amp-doctor 0.1.0:" in r.stderr
    assert Session.load(work / "out" / "amp_doctor.json").steps == 3


def test_a_non_ascii_folder_under_a_c_locale_is_one_line_with_the_fix(work: Path) -> None:
    # Python decodes the path to surrogates; TensorBoard cannot encode them. Before: a
    # 51-line internal traceback.
    folder = work / "d\u00e9"
    folder.mkdir()
    shutil.copy(work / "train_tiny.py", folder / "train_tiny.py")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([AMP_DOCTOR, "diagnose", "train_tiny.py"], cwd=folder, env=env,
                       capture_output=True, timeout=180)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert "TensorBoard cannot write under" in err and "--no-tensorboard" in err
    ok = subprocess.run([AMP_DOCTOR, "diagnose", "--no-tensorboard", "train_tiny.py"],
                        cwd=folder, env=env, capture_output=True, timeout=180)
    assert ok.returncode == 0


def test_a_script_that_re_executes_itself_gets_the_report_first(work: Path) -> None:
    # Before: no report, no message, exit 0 (no Python code runs after an exec).
    (work / "reexec.py").write_text("""
import os, sys
if os.environ.get("REEXECED") != "1":
    os.environ["REEXECED"] = "1"
""" + LOOP.replace("\n", "\n    ").replace("\n    \n", "\n\n") + """
    os.execv(sys.executable, [sys.executable, "-c", "print('new process')"])
""")
    r = run([AMP_DOCTOR, "diagnose", "--logdir", "out", "reexec.py"], work)
    assert r.returncode == 0 and r.stdout.endswith("new process\n"), r.stderr
    assert "amp-doctor: the script replaced itself (os.execv)" in r.stderr
    assert Session.load(work / "out" / "amp_doctor.json").steps == 3


def test_a_second_run_into_a_busy_logdir_is_refused_before_its_script_runs(
        work: Path) -> None:
    first = subprocess.Popen(
        [AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "train_tiny.py", "--wait"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "ready"
        r = run([AMP_DOCTOR, "diagnose", "--logdir", "out", "train_tiny.py"], work)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"another amp-doctor run (process {first.pid}) is writing into" in r.stderr
        assert "pass another --logdir" in r.stderr
        assert "trained" not in r.stdout  # the script never started
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == -signal.SIGINT, err
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.run.outcome == "interrupted" and s.steps >= 3  # the first run's, whole
    assert not (work / "out" / ".amp-doctor.lock").exists()
    r = run([AMP_DOCTOR, "diagnose", "--logdir", "out", "train_tiny.py"], work)
    assert r.returncode == 0, r.stderr  # free again


def test_two_runs_started_together_into_one_logdir_one_runs_the_other_fails_first(
        work: Path) -> None:
    # Review 33: the claim was made at the script's `import torch`, after the CLI's check:
    # both passed the check, and the second trained to its end unwatched, then failed.
    cmd = [AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "train_tiny.py",
           "--steps", "3"]
    procs = [subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    out, err = outs[[p.returncode for p in procs].index(2)]
    assert "trained" not in out and "another amp-doctor run" in err
    assert "pass another --logdir" in err and err.count("\n") == 1, err
    assert Session.load(work / "out" / "amp_doctor.json").steps == 3
    assert not (work / "out" / ".amp-doctor.lock").exists()


TRAIN = """
import os, signal, sys, threading, time
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
def term():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
"""


@pytest.mark.parametrize("case", ["before_torch", "swallowed", "swallowed_in_loop",
                                  "thread_wait", "pool", "workers"])
def test_sigterm_in_every_phase_of_a_run(work: Path, case: str) -> None:
    # Review 33: each of these crashed the run, printed amp-doctor's tracebacks, wrote no
    # report, or reported a completed run or an amp-doctor bug.
    scripts = {
        # Before the watch is on: python's own death, nothing to report yet.
        "before_torch": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n"
                        "import time\ntime.sleep(5)\nprint('not reached')\n",
        # The script's bare except swallows it: still reported, still the end.
        "swallowed": TRAIN + "for i in range(3):\n    step()\ntry:\n    term()\n"
                             "except:\n    pass\nstep()\n",
        # Review 58c: a bare except inside the loop swallowed it and training went on
        # until the scheduler's SIGKILL, with no report. Python dies at the signal; the
        # run ends at its next step, with the report.
        "swallowed_in_loop": TRAIN + "t0 = time.time()\ni = 0\n"
                                     "while time.time() - t0 < 20:\n    try:\n"
                                     "        step()\n        i += 1\n"
                                     "        if i == 3:\n            term()\n"
                                     "    except:\n        pass\n"
                                     "print('not reached')\n",
        # While diagnose waits for the script's training thread, as python would.
        "thread_wait": TRAIN + "def train():\n    for i in range(3):\n        step()\n"
                               "    term()\n    print('not reached')\n"
                               "threading.Thread(target=train).start()\n",
        # Pool ends its workers with SIGTERM: they die as under python, silently.
        "pool": TRAIN + "import multiprocessing as mp\ndef sq(x):\n    return x * x\n"
                        "if __name__ == '__main__':\n    for i in range(3):\n        step()\n"
                        "    with mp.get_context('fork').Pool(2) as p:\n"
                        "        print(sum(p.map(sq, range(8))))\n"
                        "        p.map_async(time.sleep, [3, 3])\n"
                        "        time.sleep(0.5)  # both busy when the pool ends\n",
        # A scheduler signals the whole job: DataLoader workers die of it too, and
        # torch's SIGCHLD handler raises while the main process unwinds.
        "workers": TRAIN + "data = torch.utils.data.DataLoader(torch.randn(4000, 8), "
                           "batch_size=4, num_workers=2)\n"
                           "for i, x in enumerate(data):\n    step()\n"
                           "    if i == 3:\n        os.killpg(os.getpgid(0), signal.SIGTERM)\n"
                           "        time.sleep(5)\n",
    }
    (work / "t.py").write_text(scripts[case])
    r = subprocess.run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "t.py"],
                       cwd=work, capture_output=True, text=True, timeout=120,
                       start_new_session=True)  # killpg: the run's own group only
    assert "not reached" not in r.stdout
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    if case == "before_torch":
        assert r.returncode == -signal.SIGTERM and r.stderr == ""
        assert not (work / "out" / "amp_doctor.json").exists()
        return
    if case == "pool":
        assert r.returncode == 0 and r.stdout == "140\n", r.stderr
        assert Session.load(work / "out" / "amp_doctor.json").run.outcome == "completed"
        return
    assert r.returncode == -signal.SIGTERM, r.stderr
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.run.outcome == "interrupted" and s.run.error == "SIGTERM (signal 15)"
    assert s.steps >= 3 and s.run.exit_code == 143
    if case == "swallowed_in_loop":
        assert s.steps == 3  # the step the swallowed signal let start ended the run
    assert "amp-doctor: the script was stopped by SIGTERM" in r.stderr
    assert not (work / "out" / ".amp-doctor.lock").exists()


@pytest.mark.parametrize("dies", [True, False])
def test_a_training_thread_that_dies_is_a_finding_not_a_completed_run(work: Path,
                                                                      dies: bool) -> None:
    # Review 58c: a thread that trained died of an exception at step 3 of 6; python printed
    # its traceback and exited 0, and the report said "completed" with nothing about it.
    (work / "t.py").write_text(TRAIN + f"""
def train():
    for i in range(6):
        step()
        if i == 2 and {dies!r}:
            raise RuntimeError("the data ran out")
t = threading.Thread(target=train, name="trainer")
t.start()
t.join()
print("main done")
""")
    r = subprocess.run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "t.py"],
                       cwd=work, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "main done" in r.stdout, r.stderr  # python's code, as python
    assert ("Exception in thread trainer" in r.stderr) is dies  # its traceback, as python's
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.run.outcome == "completed" and s.steps == (3 if dies else 6)
    died = [f for f in s.findings if f.kind == "thread_died"]
    if not dies:
        assert not died
        return
    assert len(died) == 1 and died[0].severity == "warning" and died[0].step == 3
    assert died[0].data["thread"] == "trainer"
    assert died[0].data["error"] == "RuntimeError: the data ran out"
    assert "training in it stopped there" in died[0].message


def test_a_watch_puts_the_thread_excepthook_back() -> None:
    import threading

    from torch import nn

    import amp_doctor

    mine = threading.excepthook
    with amp_doctor.watch(nn.Linear(2, 2)):
        assert threading.excepthook is not mine
    assert threading.excepthook is mine


@pytest.mark.parametrize("when", ["torch_init", "watch_start"])
def test_ctrl_c_while_the_script_imports_torch(work: Path, when: str) -> None:
    # A Ctrl-C in the first seconds, while `import torch` runs (1-3 s). In torch's own
    # __init__, it left torch half-imported, and amp-doctor imported it again to write the
    # report: "partially initialized module 'torch'", "generic_type: cannot initialize
    # type ... already defined" or an abort, with amp-doctor's traceback and no report.
    # While the watch started (right after torch's __init__), it was kept as a start error
    # and the script trained on, unwatched. Now python's own KeyboardInterrupt at the
    # script's `import torch`, a report saying so, and death by SIGINT.
    wait_for = {"torch_init": "torch._C", "watch_start": "amp_doctor.watch"}[when]
    (work / "t.py").write_text(f"""
import os, signal, sys, threading, time
def user():  # plays the user at the terminal
    while {wait_for!r} not in sys.modules:
        time.sleep(0.0002)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=user, daemon=True).start()
import torch
print("not reached")
""")
    r = subprocess.run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "t.py"],
                       cwd=work, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGINT, r.stderr
    assert "not reached" not in r.stdout
    assert 'File "t.py", line 8, in <module>\n    import torch\n' in r.stderr.replace(
        str(work / "t.py"), "t.py"), r.stderr
    assert "\nKeyboardInterrupt\n" in r.stderr
    assert "amp_doctor" not in r.stderr.split("KeyboardInterrupt")[0]  # the user's frames
    assert "Error" not in r.stderr and "internal error" not in r.stderr, r.stderr
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.run.outcome == "interrupted" and s.run.exit_code == 130 and s.steps == 0
    if when == "torch_init":
        assert "the script's `import torch` did not finish (KeyboardInterrupt), so nothing " \
               "was watched" in r.stderr
    else:  # watched: the report is the watch's own
        assert s.run.torch_version.startswith(torch_version_prefix())
        assert (work / "out" / "report.txt").read_text().startswith("amp-doctor")
    assert not (work / "out" / ".amp-doctor.lock").exists()


def torch_version_prefix() -> str:
    import torch

    return torch.__version__.split("+")[0]


def test_ctrl_c_during_the_report_writing_is_ignored(work: Path) -> None:
    # The script's own thread plays the user: one Ctrl-C to stop training, then Ctrl-C
    # again and again until the JSON report is on disk, so that some land while the
    # reports are written (the TensorBoard logs and report.txt come after the JSON).
    flood = """
import threading
def user(pid=os.getpid()):
    time.sleep(0.2)
    os.kill(pid, signal.SIGINT)
    time.sleep(0.01)
    while not os.path.exists(os.path.join(sys.argv[1], "amp_doctor.json")):
        os.kill(pid, signal.SIGINT)
        time.sleep(0.005)
import signal
threading.Thread(target=user, daemon=True).start()
while True:
    step()
"""
    (work / "flood.py").write_text(LOOP + flood)
    logdir = work / "out"
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", str(logdir), "flood.py",
             str(logdir)], work)
    assert r.returncode == -signal.SIGINT, r.stderr
    assert "Aborted" not in r.stderr
    s = Session.load(logdir / "amp_doctor.json")
    assert s.run.outcome == "interrupted" and s.steps >= 3
    assert (logdir / "report.txt").read_text().startswith("amp-doctor")
    assert "JSON report" in r.stderr  # printed after the files were written
    assert not list(logdir.glob(".*.tmp"))  # atomic writes leave no temp files


def test_ctrl_c_after_the_report_is_out_still_ends_the_run_by_sigint(work: Path) -> None:
    # Ctrl-C pressed again and again until the process is gone: some land after the
    # report is written and its shield is down, on the way out. They ended the run with
    # click's "Aborted!" and exit 1 (seen in CI, in the test above), where python ends a
    # script Ctrl-C'd at its very end by SIGINT. The presses come from another process,
    # as a terminal's do: a thread of the script's own would wait for the GIL.
    presser = work / "presser.py"
    presser.write_text("""
import os, signal, sys, time
pid, report = int(sys.argv[1]), sys.argv[2]
os.kill(pid, signal.SIGINT)
while not os.path.exists(report):
    time.sleep(0.001)
while os.getppid() == pid:  # until the run is gone (then this process is reparented)
    os.kill(pid, signal.SIGINT)
    time.sleep(0.0002)
""")
    late = """
import subprocess
subprocess.Popen([sys.executable, "presser.py", str(os.getpid()),
                  os.path.join(sys.argv[1], "report.txt")])
while True:
    step()
"""
    (work / "late.py").write_text(LOOP + late)
    logdir = work / "out"
    r = run([AMP_DOCTOR, "diagnose", "--every", "1", "--no-tensorboard", "--logdir",
             str(logdir), "late.py", str(logdir)], work)
    assert r.returncode == -signal.SIGINT, r.stderr
    assert "Aborted" not in r.stderr
    assert Session.load(logdir / "amp_doctor.json").run.outcome == "interrupted"


def test_parallel_runs_get_their_own_logdirs(work: Path) -> None:
    # A sweep: `for s in 1 2 3; do amp-doctor diagnose sweep.py $s & done`, default logdir.
    (work / "sweep.py").write_text(LOOP + "print('seed', sys.argv[1])\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([AMP_DOCTOR, "diagnose", "--every", "1", "--quiet", "sweep.py",
                               str(seed)], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2, 3)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    runs = sorted((work / "runs" / "amp-doctor").iterdir())
    assert len(runs) == 3, runs
    for d in runs:
        assert re.fullmatch(r"sweep-\d{8}-\d{6}(-\d+)?", d.name), d.name
        assert Session.load(d / "amp_doctor.json").steps == 3
        assert len(list(d.glob("events.out.tfevents.*"))) == 1  # no mixed event files
    commands = sorted(Session.load(d / "amp_doctor.json").run.command[-1] for d in runs)
    assert commands == ["1", "2", "3"]


def test_default_logdirs_made_in_one_second_are_distinct(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from amp_doctor import runner
    from amp_doctor.commands.paths import default_logdir

    monkeypatch.chdir(tmp_path)
    target = runner.Target("path", "sweep.py")
    dirs = [default_logdir(target) for _ in range(3)]
    assert len(set(dirs)) == 3 and all(d.is_dir() for d in dirs)
    stamp = dirs[0].name
    if dirs[1].name.startswith(stamp):  # made within the same second
        assert dirs[1].name == f"{stamp}-2"


@pytest.mark.parametrize(
    "damage,problem",
    [(lambda d: d.update(amp=None), "amp is null, expected an object"),
     (lambda d: d["findings"].append({**d["findings"][0], "severity": "fatal"}),
      "severity is 'fatal', expected one of 'error', 'warning', 'info'"),
     (lambda d: d.pop("history"), "history is missing"),
     (lambda d: d.update(version="7.0.0"), "another major version"),
     (lambda d: d["layers"][0].update(absmax="big"),
      "layers[0].absmax is 'big', expected a number")],
    ids=["amp-null", "unknown-severity", "no-history", "major-version", "bad-number"],
)
def test_report_on_damaged_json_is_one_line_naming_file_and_problem(
        tmp_path: Path, saved_run: Path, damage, problem: str) -> None:
    data = json.loads(saved_run.read_text())
    damage(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    r = run([AMP_DOCTOR, "report", str(bad)], tmp_path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(bad) in r.stderr and problem in r.stderr


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run's JSON report, made in process with watch()."""
    import torch

    import amp_doctor
    from tests.helpers import MLP, train

    path = tmp_path_factory.mktemp("saved") / "amp_doctor.json"
    model = MLP()
    with torch.no_grad():
        model.fc1.weight.mul_(3000.0)  # an overflow, so that there are findings
    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=3)
    doctor.session.save(path)
    assert doctor.session.findings
    return path


def test_view_on_a_busy_port_is_one_clear_line(work: Path) -> None:
    (work / "out").mkdir()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        r = run([AMP_DOCTOR, "view", "out", "--port", str(port)], work, timeout=60)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "[" not in r.stderr, r.stderr
    assert f"port {port}" in r.stderr and "--port" in r.stderr
    assert r.stdout == ""  # no URL of a server that never started


def test_view_shows_two_runs_side_by_side_under_their_names(tmp_path: Path) -> None:
    import urllib.request

    from torch.utils.tensorboard import SummaryWriter

    for name, value in (("fp16", 1.0), ("bf16", 2.0)):
        with SummaryWriter(str(tmp_path / "runs" / name)) as w:
            w.add_scalar("scaler/scale", value, 0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Only this view's folder counts: an earlier run killed with SIGKILL may have left its own.
    view_dirs = Path(os.environ.get("TMPDIR", "/tmp")).glob
    before = set(view_dirs("amp-doctor-view-*/fp16"))
    proc = subprocess.Popen([AMP_DOCTOR, "view", "runs/fp16", "runs/bf16", "--port", str(port)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in first and "fp16, bf16" in first
        assert "opens unsmoothed" in proc.stdout.readline()
        deadline = time.monotonic() + 120
        runs: list[str] = []
        while sorted(runs) != ["bf16", "fp16"]:
            assert time.monotonic() < deadline, f"tensorboard shows {runs}"
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs",
                                            timeout=5) as u:
                    runs = json.loads(u.read())
            except OSError:
                continue
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert not set(view_dirs("amp-doctor-view-*/fp16")) - before


@pytest.mark.parametrize("term", ["xterm", "dumb"])
def test_status_line_never_glues_onto_the_scripts_output(work: Path, term: str) -> None:
    # On a terminal the live status line is drawn without a newline; each line the script
    # prints must start on a cleared line, not after the status text. A dumb terminal
    # (TERM=dumb: an Emacs shell) would show the escapes raw: it gets no status line.
    chatty = """
for i in range(40):
    step()
    print(f"tick {i}", flush=True)
    time.sleep(0.03)
"""
    (work / "chatty.py").write_text(LOOP + chatty)
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TERM": term}
    proc = subprocess.Popen([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out",
                             "chatty.py"], cwd=work, env=env, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=60) == 0
    text = out.decode("utf-8", "replace")
    if term == "dumb":
        assert "\x1b[" not in text and "amp-doctor: step" not in text
    else:
        assert "amp-doctor: step" in text  # the status line was drawn
    # The terminal turns "\n" into "\r\n"; what is left of a line after its last
    # carriage return or clear-line is what shows on the screen.
    ticks = [line.removesuffix("\r") for line in text.split("\n")
             if re.search(r"(?<!un)tick \d+", line)]  # not the hint to untick a box
    assert len(ticks) == 40
    for line in ticks:
        visible = re.split(r"\r|\x1b\[2K", line)[-1]
        assert visible.startswith("tick "), repr(line)


def test_a_watch_that_fails_to_start_at_the_scripts_import_leaves_the_import_whole(
        tmp_path: Path) -> None:
    # The watch starts inside the script's `import torch`. Raised there, the import would
    # fail after torch's __init__ ran, and the next import would run it again (torch
    # cannot register its operators twice): the error is kept for after the script.
    code = """
from amp_doctor.commands.aftertorch import after_torch_import
def start():
    raise RuntimeError("could not start")
with after_torch_import(start) as started:
    import torch
    import torch.nn
    print(torch.ones(2).sum().item())
print(repr(started.error))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "2.0\nRuntimeError('could not start')\n"


def test_atexit_handlers_and_late_threads_see_the_scripts_main_argv_and_path(
        work: Path) -> None:
    # An async checkpoint thread and an atexit handler pickling a class defined in the
    # script, and a late import of a sibling module: __main__, sys.argv and sys.path were
    # amp-doctor's again once the main code returned, so the checkpoints failed to pickle
    # (review 38).
    (work / "sub").mkdir()
    (work / "sub" / "late_helper.py").write_text("VALUE = 42\n")
    (work / "sub" / "late.py").write_text(LOOP + """
import atexit, pickle, threading
class Cfg:
    lr = 0.1
def save(tag):
    pickle.dumps(Cfg())
    import late_helper
    print(tag, "ok", sys.argv[1:], late_helper.VALUE, flush=True)
atexit.register(save, "atexit")
threading.Thread(target=lambda: (time.sleep(0.5), save("thread"))).start()
""")
    plain = run([sys.executable, "sub/late.py", "a1"], work)
    r = run([AMP_DOCTOR, "diagnose", "-q", "--no-tensorboard", "--logdir", "out",
             "sub/late.py", "a1"], work)
    assert plain.stdout == "thread ok ['a1'] 42\natexit ok ['a1'] 42\n", plain.stderr
    assert r.stdout == plain.stdout, r.stderr
    assert r.returncode == 0 and "Error" not in r.stderr


def test_a_watch_that_cannot_start_tensorboard_still_watches_and_keeps_the_exit_code(
        work: Path) -> None:
    # tensorboard not importable (a --no-deps install): the script ran unwatched, then
    # amp-doctor's own traceback and exit 1, no report (review 38).
    fake = work / "fake" / "tensorboard"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named tensorboard')\n")
    (work / "ends4.py").write_text(LOOP + "sys.exit(4)\n")
    env = {**os.environ, "PYTHONPATH": str(work / "fake"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([AMP_DOCTOR, "diagnose", "--every", "1", "--logdir", "out", "ends4.py"],
                       cwd=work, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 4, r.stderr
    assert "Traceback" not in r.stderr
    said = [ln for ln in r.stderr.splitlines() if "TensorBoard is off" in ln]
    assert len(said) == 1 and "pip install tensorboard" in said[0]
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.steps == 3 and s.recorded_steps == 3 and s.run.exit_code == 4
    assert not list((work / "out").glob("events.out.tfevents.*"))
    assert "view the dashboards" not in r.stderr


def test_a_logdir_that_cannot_be_written_to_is_one_line_and_leaves_no_lock(work: Path) -> None:
    # A full disk: creating the lock file needs no block, writing its line does. Before: a
    # raw OSError traceback from the lock, and a 0-byte lock left (review 38). A file
    # size limit of 0 fails every write the same way.
    import resource

    (work / "out").mkdir()

    def no_writes() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    r = subprocess.run([AMP_DOCTOR, "diagnose", "--logdir", "out", "train_tiny.py"],
                       cwd=work, capture_output=True, text=True, timeout=120,
                       preexec_fn=no_writes)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot write to --logdir" in r.stderr and "free some space" in r.stderr
    assert not list((work / "out").iterdir())


def test_a_report_txt_the_script_wrote_into_the_logdir_is_kept(work: Path) -> None:
    # A script writing its own results into the folder also given as --logdir: its
    # report.txt was replaced by amp-doctor's without a word (review 38).
    (work / "own.py").write_text(LOOP + """
os.makedirs("out", exist_ok=True)
open("out/report.txt", "w").write("EVAL REPORT: final loss 0.57\\n")
""")
    r = run([AMP_DOCTOR, "diagnose", "--no-tensorboard", "--logdir", "out", "own.py"], work)
    assert r.returncode == 0, r.stderr
    assert (work / "out" / "report.txt").read_text() == "EVAL REPORT: final loss 0.57\n"
    assert (work / "out" / "amp_doctor_report.txt").read_text().startswith("amp-doctor ")
    assert "is not amp-doctor's" in r.stderr and "amp_doctor_report.txt" in r.stderr
    again = run([AMP_DOCTOR, "diagnose", "--no-tensorboard", "--logdir", "out2",
                 "train_tiny.py"], work)  # a folder of amp-doctor's own: report.txt as ever
    assert again.returncode == 0 and (work / "out2" / "report.txt").is_file()


def test_an_exception_whose_str_fails_is_reported_as_python_does(work: Path) -> None:
    # Before: amp-doctor's own traceback from str(exc), no report (review 38).
    (work / "weird.py").write_text(LOOP + """
class Weird(Exception):
    def __str__(self):
        raise ValueError("no str for you")
raise Weird()
""")
    plain = run([sys.executable, "weird.py"], work)
    r = run([AMP_DOCTOR, "diagnose", "--no-tensorboard", "--logdir", "out", "weird.py"], work)
    assert r.returncode == plain.returncode == 1
    assert "Weird: <exception str() failed>" in plain.stderr
    assert "Weird: <exception str() failed>" in r.stderr and "no str for you" not in r.stderr
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.run.outcome == "exception" and s.run.error == "Weird: <exception str() failed>"


def test_the_terminal_guard_keeps_the_streams_protocols() -> None:
    # On a terminal the script's stdout/stderr clear the status line before each write.
    # `with sys.stdout:` raised TypeError, isinstance(sys.stdout, io.TextIOWrapper) was
    # False, and bytes gave amp-doctor's own error (review 38).
    import io

    from amp_doctor.commands.terminal import Console, GuardedStream, Progress

    inner = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    guard = GuardedStream(inner, Progress(enabled=False, console=Console()))
    assert isinstance(guard, io.TextIOWrapper) and type(guard) is GuardedStream
    with pytest.raises(TypeError, match="must be str, not bytes"):
        guard.write(b"x")  # type: ignore[arg-type]
    with guard as f:
        f.write("written\n")
    assert inner.closed  # closed by the with, as python's own stream would be


def _plain(work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "t.py"], cwd=work, capture_output=True, text=True,
                          timeout=120)


def _diagnosed(work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([AMP_DOCTOR, "diagnose", "--logdir", "out", "t.py"], cwd=work,
                          capture_output=True, text=True, timeout=120)


def _plain_and_diagnosed(work: Path) -> tuple[subprocess.CompletedProcess,
                                              subprocess.CompletedProcess]:
    """``t.py`` in ``work`` run by python, then by ``amp-doctor diagnose --logdir out``."""
    return _plain(work), _diagnosed(work)


def test_a_ctrl_c_the_script_did_not_catch_runs_its_atexit_handlers(work: Path) -> None:
    """python runs a script's atexit handlers (a last checkpoint) after an uncaught
    KeyboardInterrupt; amp-doctor killed itself by SIGINT once the report was out, and
    they never ran."""
    (work / "t.py").write_text("""
import atexit, pathlib, torch
atexit.register(lambda: pathlib.Path("saved_at_exit").write_text("ok"))
model = torch.nn.Linear(4, 2)
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = model(torch.randn(3, 4)).float().sum()
loss.backward()
raise KeyboardInterrupt
""")
    plain = _plain(work)
    assert (work / "saved_at_exit").read_text() == "ok"
    (work / "saved_at_exit").unlink()
    r = _diagnosed(work)
    assert r.returncode == plain.returncode == -signal.SIGINT, r.stderr
    assert (work / "saved_at_exit").read_text() == "ok"
    assert r.stderr.count("Traceback (most recent call last)") == 1, r.stderr
    assert "Aborted" not in r.stderr
    assert Session.load(work / "out" / "amp_doctor.json").run.outcome == "interrupted"


def test_the_script_sees_no_thread_of_amp_doctors(work: Path) -> None:
    """TensorBoard's writer thread ran from the script's `import torch` on: a script that
    waits until `threading.active_count() == 1` for its own workers waited forever, and
    its threads were numbered one further (Thread-2)."""
    (work / "t.py").write_text("""
import threading, time, torch
m = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
def work():
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(torch.randn(2, 4)).float().sum()
        opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
print(threading.active_count(), [t.name for t in threading.enumerate()])
t = threading.Thread(target=work)
print(t.name)
t.start()
while threading.active_count() > 1:
    time.sleep(0.05)
print("all workers done")
""")
    plain, r = _plain_and_diagnosed(work)
    assert r.returncode == plain.returncode == 0, r.stderr
    assert r.stdout == plain.stdout == "1 ['MainThread']\nThread-1 (work)\nall workers done\n"
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.steps == 3
    events = list((work / "out").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 1000


def test_a_tensorboard_py_beside_the_script_is_not_imported_by_amp_doctor(work: Path) -> None:
    """The script's folder is first on sys.path: amp-doctor imported the user's own
    tensorboard.py (running it: its output in the script's stdout), then failed and
    advised `pip install tensorboard`."""
    (work / "tensorboard.py").write_text("print('USER MODULE tensorboard IMPORTED')\n")
    (work / "t.py").write_text("""
import torch
m = torch.nn.Linear(4, 2)
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = m(torch.randn(2, 4)).float().sum()
loss.backward()
print("done")
""")
    plain, r = _plain_and_diagnosed(work)
    assert r.returncode == plain.returncode == 0, r.stderr
    assert r.stdout == plain.stdout == "done\n"
    assert (f"amp-doctor: TensorBoard is off for this run: {work / 'tensorboard.py'} hides the "
            "tensorboard package") in r.stderr
    assert "pip install" not in r.stderr
    assert (work / "out" / "amp_doctor.json").exists()


def test_a_sigterm_to_the_job_with_persistent_dataloader_workers_is_no_internal_error(
        work: Path) -> None:
    """A scheduler's SIGTERM to the whole job (`timeout`, Slurm) while persistent workers
    are busy: their SIGCHLD came while amp-doctor closed the run, torch's handler raised
    there, and that was reported as an internal error of amp-doctor's."""
    (work / "t.py").write_text("""
import time, torch
from torch import nn
class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 10 ** 6
    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.randn(16), i % 4
if __name__ == "__main__":
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.utils.data.DataLoader(Slow(), batch_size=8, num_workers=2,
                                       persistent_workers=True)
    for step, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        if step % 20 == 0:
            print("step", step, flush=True)
""")
    p = subprocess.Popen([AMP_DOCTOR, "diagnose", "--logdir", "out", "t.py"], cwd=work,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("step 60"):
            break
    os.killpg(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGTERM, err
    assert "internal error" not in err and "Traceback" not in err, err
    assert "amp-doctor: the script was stopped by SIGTERM" in err
    s = Session.load(work / "out" / "amp_doctor.json")
    assert s.run.outcome == "interrupted" and s.steps >= 60
