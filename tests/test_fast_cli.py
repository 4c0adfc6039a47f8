"""`--help`, argument errors, `report` and `view`'s checks start without importing torch.

Importing torch takes seconds; these commands need none of it. Checked by what the
interpreter imported (``-X importtime`` lists every module), not by timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import amp_doctor


def imported_modules(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "amp_doctor", *args],
                       cwd=cwd, capture_output=True, text=True, timeout=120, env=env)
    names = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines()
             if line.startswith("import time:") and "|" in line}
    return r, names


def torch_modules(names: set[str]) -> set[str]:
    return {n for n in names if n == "torch" or n.startswith("torch.")}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers import MLP, train

    run = tmp_path_factory.mktemp("run")
    model = MLP()
    with amp_doctor.watch(model, every=1, logdir=run, tensorboard=False):
        train(model, steps=2)
    assert (run / "amp_doctor.json").exists()
    return run


@pytest.mark.parametrize("args", [["--help"], ["diagnose", "--help"], ["report", "--help"],
                                  ["diagnose", "--every", "zero", "train.py"],
                                  ["diagnose", "no_such_script.py"], ["--version"]],
                         ids=["help", "diagnose-help", "report-help", "bad-option",
                              "missing-script", "version"])
def test_help_and_argument_errors_import_no_torch(tmp_path: Path, args: list[str]) -> None:
    r, names = imported_modules(args, tmp_path)
    assert "amp_doctor.cli" in names  # the check saw the CLI load
    assert not torch_modules(names), sorted(torch_modules(names))[:5]
    assert r.returncode in (0, 2), r.stderr[-2000:]


@pytest.mark.parametrize("fmt", ["text", "json", "markdown"])
def test_report_imports_no_torch(saved_run: Path, fmt: str) -> None:
    r, names = imported_modules(["report", str(saved_run), "--format", fmt], saved_run)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "amp-doctor" in r.stdout or fmt == "json"
    assert "amp_doctor.sinks.text" in names
    assert not torch_modules(names), sorted(torch_modules(names))[:5]


def test_report_modules_import_without_torch(tmp_path: Path) -> None:
    code = ("import sys\n"
            "import amp_doctor, amp_doctor.cli, amp_doctor.records, amp_doctor.analysis.analyze\n"
            "import amp_doctor.sinks.text, amp_doctor.sinks.jsonfile, amp_doctor.merge\n"
            "from amp_doctor import Session, Finding\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_lazy_names_are_the_real_objects() -> None:
    import amp_doctor.watch as _  # noqa: F401  the submodule of the same name as the function
    from amp_doctor import records, watch

    assert amp_doctor.Session is records.Session and amp_doctor.Finding is records.Finding
    # `amp_doctor.watch` stays the function even after its submodule was imported.
    assert callable(amp_doctor.watch) and amp_doctor.watch is watch
    assert amp_doctor.watch.__module__ == "amp_doctor.watch"
    assert amp_doctor.Watch.__name__ == "Watch"
    assert set(amp_doctor.__all__) <= set(dir(amp_doctor))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        amp_doctor.nope  # noqa: B018


def test_misspelt_option_names_the_option_not_a_missing_script(tmp_path: Path) -> None:
    r, names = imported_modules(["diagnose", "--evry", "3", "train.py"], tmp_path)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("import time:")]
    assert len(lines) == 1, lines
    assert "no such option: --evry. Did you mean --every?" in lines[0]
    assert not torch_modules(names)


def test_misspelt_option_of_fix_names_the_option_and_the_fix_command(tmp_path: Path) -> None:
    # Review 55: `amp-doctor fix --logdir x train.py` said "No script at '--logdir'".
    for given, said in ((["fix", "--trails", "3", "train.py"],
                         "no such option: --trails. Did you mean --trials?"),
                        (["fix", "--logdir", "runs", "train.py"], "no such option: --logdir.")):
        r, names = imported_modules(given, tmp_path)
        assert r.returncode == 2
        lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("import time:")]
        assert len(lines) == 1, lines
        assert said in lines[0]
        assert "amp-doctor fix [OPTIONS] SCRIPT [ARGS]... (see amp-doctor fix --help)" in lines[0]
        assert not torch_modules(names)


def test_no_fast_path_imports_torch_in_one_process(saved_run: Path, tmp_path: Path) -> None:
    # Every torch-free path run through the entry point in one fresh interpreter; torch
    # must not be in sys.modules afterwards (what was imported, not how long it took).
    calls = [["--help"], ["diagnose", "--help"], ["diagnose", "--every", "zero", "t.py"],
             ["diagnose", "no_such_script.py"], ["diagnose", "--evry", "3", "t.py"],
             ["fix", "no_such_script.py"], ["report", str(saved_run)],
             ["report", str(saved_run), "--format", "markdown"],
             ["compare", str(saved_run), str(saved_run)], ["view", str(tmp_path / "nope")]]
    code = ("import sys, json\n"
            "from amp_doctor.cli import main\n"
            "codes = []\n"
            f"for args in {calls!r}:\n"
            "    try:\n"
            "        main(args)\n"
            "    except SystemExit as e:\n"
            "        codes.append(e.code)\n"
            "torch = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "sys.__stderr__.write('RESULT ' + json.dumps([codes, torch[:5]]) + '\\n')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("RESULT ")]
    assert line, r.stderr[-2000:]
    import json

    codes, torch = json.loads(line[-1][len("RESULT "):])
    assert codes == [0, 0, 2, 2, 2, 2, 0, 0, 0, 2], r.stderr[-2000:]
    assert torch == []
