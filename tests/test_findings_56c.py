"""Session 56, review 56c: how a run watched in code ends (``sys.exit`` in a ``with``
block, a handle never closed) and ``compare`` of such a run."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import amp_doctor
from amp_doctor.analysis.compare import compare, render
from tests.helpers import MLP, train

# What the report says of a watch the script never closed (amp_doctor.watch.NOT_CLOSED).
NOT_CLOSED = ("the watch was never closed (leave a `with amp_doctor.watch(...)` block, or "
              "call `doctor.close()`): closed at interpreter exit")

_LOOP = """
import sys, torch
import amp_doctor

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
{open}
for step in range(8):
    if step == 5:
        sys.exit(3)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(8, 16)).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def _run(tmp_path: Path, opening: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    script = tmp_path / "loop.py"
    body = _LOOP.format(open=opening)
    if opening.startswith("with"):
        head, loop = body.split("for step", 1)
        body = head + "    for step" + textwrap.indent(loop, "    ")[4:]
    script.write_text(body)
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300, cwd=root)
    return r, json.loads((tmp_path / "run" / "amp_doctor.json").read_text())


def test_sys_exit_in_a_with_block_is_the_scripts_exit(tmp_path: Path) -> None:
    # Review 56c: recorded as an exception ("The run ended with SystemExit: 3") with no
    # exit code, where the CLI records the same script as `exit`, exit code 3.
    r, saved = _run(tmp_path, f"with amp_doctor.watch(model, logdir={str(tmp_path / 'run')!r}):")
    assert r.returncode == 3, r.stderr
    assert saved["run"]["outcome"] == "exit" and saved["run"]["exit_code"] == 3
    assert saved["run"]["error"] is None and saved["steps"] == 5


def test_a_watch_never_closed_is_closed_at_exit(tmp_path: Path) -> None:
    # Review 56c: `doctor = amp_doctor.watch(model, logdir=...)` and a script that ended
    # before `doctor.close()` left an empty event file and no report.
    r, saved = _run(tmp_path, f"doctor = amp_doctor.watch(model, logdir={str(tmp_path / 'run')!r})")
    assert r.returncode == 3
    assert saved["steps"] == 5 and saved["recorded_steps"] >= 1
    assert saved["run"]["error"] == NOT_CLOSED
    assert f"amp-doctor: {NOT_CLOSED}; report: {tmp_path / 'run' / 'amp_doctor.json'}" in r.stderr


def test_compare_with_a_run_watched_in_code_names_no_other_script() -> None:
    # Review 56c: "the runs come from different scripts (; python loop_fp16.py)" for a
    # watch() run (no command) beside the CLI's run of the same script.
    model = MLP()
    with amp_doctor.watch(model) as doctor:
        train(model, steps=2)
    a = doctor.session
    assert a is not None and a.run.command is None
    b = dataclasses.replace(a, run=dataclasses.replace(a.run, command=["python", "loop.py"]))
    c = compare(a, b, "a", "b")
    assert c.scripts is None
    assert "different scripts" not in render(c, "text")
    other = dataclasses.replace(a, run=dataclasses.replace(a.run, command=["python", "x.py"]))
    assert compare(other, b, "a", "b").scripts == ("python x.py", "python loop.py")


def test_a_callbacks_folder_is_labelled_by_the_trainers(tmp_path: Path) -> None:
    from amp_doctor.commands.saved import _run_label

    assert _run_label(tmp_path / "hf_out" / "amp_doctor") == "hf_out/amp_doctor"
    assert _run_label(tmp_path / "hf_out" / "amp_doctor" / "amp_doctor.json") == (
        "hf_out/amp_doctor")
    assert _run_label(tmp_path / "runs" / "a") == "a"



_SPAWNED = """
import multiprocessing as mp, sys, torch
import amp_doctor

def child(logdir):
    model = torch.nn.Linear(4, 4)
    doctor = amp_doctor.watch(model, logdir=logdir)  # never closed, in a child process

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child, args=(sys.argv[1],))
    p.start()
    p.join()
    sys.exit(p.exitcode)
"""


def test_a_child_process_writes_nothing_at_exit(tmp_path: Path) -> None:
    # A spawned worker (a DataLoader's, re-running an unguarded script's watch()) closes
    # nothing at exit: its empty report would overwrite the parent's.
    script = tmp_path / "spawned.py"
    script.write_text(_SPAWNED)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "run" / "amp_doctor.json").exists()
    assert NOT_CLOSED not in r.stderr
