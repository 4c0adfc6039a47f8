"""amp_doctor.runner must run a script exactly as ``python script.py args`` would.

Most checks run the same command twice in real subprocesses, once under plain python and
once through ``fixtures/runner/drive.py`` (resolve + run + report_exit, as the CLI does),
and compare what the script saw, what was printed and the exit status. The rest run the
runner in-process to look at restoration of interpreter state and at the error types.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from amp_doctor import runner  # noqa: E402 - needs the repo root on sys.path first

FIXTURES = REPO / "tests" / "fixtures" / "runner"
DRIVE = FIXTURES / "drive.py"
RUNNER_FILE = os.path.join("amp_doctor", "runner.py")


def _env(pythonpath: str | None = str(FIXTURES), **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    # Keeps __pycache__ out of the fixtures; __cached__ is still reported identically.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    env.update(extra)
    return env


def _python(
    argv: list[str], cwd: Path, env: dict[str, str], driven: bool
) -> subprocess.CompletedProcess[str]:
    prefix = [sys.executable, str(DRIVE)] if driven else [sys.executable]
    return subprocess.run(
        [*prefix, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _both(
    argv: list[str], cwd: Path = REPO, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """(python argv..., drive.py argv...) run the same way."""
    env = _env() if env is None else env
    return _python(argv, cwd, env, driven=False), _python(argv, cwd, env, driven=True)


def _probe_output(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    seen: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return seen


# --------------------------------------------------------------- parity with python


PROBE = FIXTURES / "probe.py"


@pytest.mark.parametrize(
    ("argv", "cwd", "expected"),
    [
        pytest.param(
            ["tests/fixtures/runner/probe.py", "a", "b"],
            REPO,
            {
                "argv": ["tests/fixtures/runner/probe.py", "a", "b"],
                "file": str(PROBE),
                "path0": str(FIXTURES),
                "spec_name": None,
            },
            id="relative-path",
        ),
        pytest.param(
            ["./probe.py", "--lr", "3e-4"],
            FIXTURES,
            # python joins cwd and the argument without normalising the "./"
            {
                "argv": ["./probe.py", "--lr", "3e-4"],
                "file": f"{FIXTURES}/./probe.py",
                "path0": str(FIXTURES),
                "spec_name": None,
            },
            id="dot-relative-path",
        ),
        pytest.param(
            [str(PROBE), "x y", ""],
            REPO / "tests",
            {
                "argv": [str(PROBE), "x y", ""],
                "file": str(PROBE),
                "path0": str(FIXTURES),
                "spec_name": None,
            },
            id="absolute-path",
        ),
        pytest.param(
            ["tests/fixtures/runner/probe_dir", "a"],
            REPO,
            {
                "argv": ["tests/fixtures/runner/probe_dir", "a"],
                "file": str(FIXTURES / "probe_dir" / "__main__.py"),
                "path0": str(FIXTURES / "probe_dir"),
                "spec_name": "__main__",
            },
            id="directory-with-main",
        ),
        pytest.param(
            ["-m", "probe", "a", "b"],
            REPO,
            {
                "argv": [str(PROBE), "a", "b"],
                "file": str(PROBE),
                "path0": str(REPO),
                "spec_name": "probe",
            },
            id="module",
        ),
        pytest.param(
            ["-m", "probe_pkg", "a"],
            REPO,
            {
                "argv": [str(FIXTURES / "probe_pkg" / "__main__.py"), "a"],
                "file": str(FIXTURES / "probe_pkg" / "__main__.py"),
                "path0": str(REPO),
                "spec_name": "probe_pkg.__main__",
            },
            id="package-main",
        ),
    ],
)
def test_script_sees_what_python_gives_it(
    argv: list[str], cwd: Path, expected: dict[str, Any]
) -> None:
    plain, driven = _both(argv, cwd)
    seen, want = _probe_output(driven), _probe_output(plain)
    assert seen == want  # field for field, including all of sys.path and the dunders
    assert seen["name"] == "__main__"
    assert seen["argv"] == expected["argv"]
    assert seen["file"] == expected["file"]
    assert seen["path"][0] == expected["path0"]
    assert seen["spec_name"] == expected["spec_name"]
    assert seen["spec_is_none"] is (expected["spec_name"] is None)
    assert seen["roundtrip"] == 3  # a class defined in the script pickles
    assert seen["main_is_self"] is True
    assert seen["builtins_is_module"] is True
    assert driven.stderr == plain.stderr == ""


def test_symlinked_script_gets_the_real_directory_on_sys_path(tmp_path: Path) -> None:
    (tmp_path / "link.py").symlink_to(PROBE)
    plain, driven = _both(["link.py", "a"], cwd=tmp_path)
    seen = _probe_output(driven)
    assert seen == _probe_output(plain)
    assert seen["file"] == str(tmp_path / "link.py")
    assert seen["path"][0] == str(FIXTURES)


def test_zip_archive_runs_its_main_like_python(tmp_path: Path) -> None:
    import zipfile

    archive = tmp_path / "app.pyz"
    with zipfile.ZipFile(archive, "w") as bundle:
        bundle.writestr(
            "__main__.py",
            "import json, sys\n"
            "print(json.dumps([__file__, sys.argv, sys.path[0], __spec__.name, __package__]))\n",
        )
    plain, driven = _both(["app.pyz", "x"], cwd=tmp_path)
    assert driven.returncode == plain.returncode == 0, driven.stderr
    assert driven.stdout == plain.stdout
    assert json.loads(driven.stdout) == [
        str(archive / "__main__.py"),
        ["app.pyz", "x"],
        str(archive),
        "__main__",
        "",
    ]


@pytest.mark.parametrize("argv", [["probe.py", "a"], ["-m", "probe", "a"]], ids=["path", "module"])
def test_safe_path_mode_adds_nothing_to_sys_path(argv: list[str]) -> None:
    plain, driven = _both(argv, cwd=FIXTURES, env=_env(PYTHONSAFEPATH="1"))
    seen = _probe_output(driven)
    assert seen == _probe_output(plain)
    # Only PYTHONPATH put the fixtures there: no script directory or cwd in front of it.
    assert seen["path"][0] == str(FIXTURES)
    assert seen["path"].count(str(FIXTURES)) == 1


def test_module_is_found_in_the_cwd_like_python_m(tmp_path: Path) -> None:
    (tmp_path / "cwdmod.py").write_text(
        "import json, sys\nprint(json.dumps([__file__, sys.argv, sys.path[0]]))\n"
    )
    plain, driven = _both(["-m", "cwdmod", "x"], cwd=tmp_path, env=_env(pythonpath=None))
    assert driven.returncode == plain.returncode == 0, driven.stderr
    module_file = str(tmp_path / "cwdmod.py")
    assert json.loads(driven.stdout) == [module_file, [module_file, "x"], str(tmp_path)]
    assert driven.stdout == plain.stdout


# ------------------------------------------------------------ exits and tracebacks


@pytest.mark.parametrize(
    ("args", "code", "stderr"),
    [
        (["int", "3"], 3, ""),
        (["int", "0"], 0, ""),
        (["none"], 0, ""),
        (["msg", "bad config"], 1, "bad config\n"),
    ],
)
def test_exit_status_and_message_match_python(args: list[str], code: int, stderr: str) -> None:
    plain, driven = _both(["tests/fixtures/runner/exits.py", *args])
    assert driven.returncode == plain.returncode == code
    assert driven.stderr == plain.stderr == stderr
    assert driven.stdout == plain.stdout == "started\n"


def test_keyboard_interrupt_exits_130_with_its_traceback() -> None:
    plain, driven = _both(["tests/fixtures/runner/exits.py", "kbd"])
    # python kills itself with SIGINT (a shell shows 130); the CLI exits 130 directly.
    assert plain.returncode == -signal.SIGINT
    assert driven.returncode == 130
    assert driven.stderr == plain.stderr
    assert driven.stderr.endswith("    raise KeyboardInterrupt\nKeyboardInterrupt\n")


@pytest.mark.parametrize("script", ["boom.py", "imports_broken.py", "group.py"])
def test_uncaught_exception_prints_exactly_what_python_prints(script: str) -> None:
    plain, driven = _both([f"tests/fixtures/runner/{script}"])
    assert driven.returncode == plain.returncode == 1
    assert driven.stderr == plain.stderr
    assert f'File "{FIXTURES / script}", line' in driven.stderr
    assert "drive.py" not in driven.stderr
    assert RUNNER_FILE not in driven.stderr
    assert "importlib" not in driven.stderr


def test_module_traceback_is_pythons_without_runpy_frames() -> None:
    plain, driven = _both(["-m", "boom"])
    assert driven.returncode == plain.returncode == 1
    python_lines = [line for line in plain.stderr.splitlines() if "<frozen runpy>" not in line]
    assert len(python_lines) < len(plain.stderr.splitlines())  # python did show runpy
    assert driven.stderr.splitlines() == python_lines
    assert driven.stderr.endswith("ValueError: no key in the table\n")


def test_syntax_error_is_reported_like_python(tmp_path: Path) -> None:
    bad = tmp_path / "bad_syntax.py"
    bad.write_text('print("fine")\nx = (1,\ny = 2\n')
    plain, driven = _both([str(bad)])
    assert driven.returncode == plain.returncode == 1
    assert driven.stderr == plain.stderr
    assert driven.stderr == (
        f"  File \"{bad}\", line 2\n    x = (1,\n        ^\nSyntaxError: '(' was never closed\n"
    )
    assert driven.stdout == ""  # nothing ran


def test_spawn_dataloader_pickles_a_dataset_defined_in_the_script() -> None:
    driven = _python(
        ["tests/fixtures/runner/spawn_loader.py"], REPO, _env(pythonpath=None), driven=True
    )
    assert driven.returncode == 0, driven.stderr
    assert driven.stdout.splitlines()[-1] == "loader-total 6.0"


@pytest.mark.parametrize(
    "argv", [["tests/fixtures/runner/mp_spawn.py"], ["-m", "mp_spawn"]], ids=["path", "module"]
)
def test_spawn_pool_pickles_a_class_defined_in_the_script(argv: list[str]) -> None:
    driven = _python(argv, REPO, _env(), driven=True)
    assert driven.returncode == 0, driven.stderr
    assert driven.stdout == "mp-result 60\n"


def test_missing_script_fails_in_the_driver_with_exit_2() -> None:
    driven = _python(["trian.py", "--epochs", "1"], REPO, _env(), driven=True)
    assert driven.returncode == 2
    assert driven.stderr == (
        f"drive: No script at 'trian.py' (cwd {REPO}). Check the path, or use -m for a module.\n"
    )


# ---------------------------------------------------------------------- in-process


@pytest.fixture
def in_fixtures(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(FIXTURES)
    return FIXTURES


def _snapshot() -> tuple[Any, list[str], list[str], Any, Any, bool]:
    return (
        sys.argv,
        list(sys.argv),
        list(sys.path),
        sys.modules.get("__main__"),
        sys.modules.get("__mp_main__"),
        "__mp_main__" in sys.modules,
    )


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_run_sets_then_restores_interpreter_state(
    ending: str, in_fixtures: Path, tmp_path: Path
) -> None:
    record = tmp_path / "inside.json"
    before = _snapshot()
    resolved = runner.resolve(runner.Target("path", "inside.py", (str(record), ending)))
    assert _snapshot() == before  # resolving a path changes nothing

    if ending == "raise":
        with pytest.raises(LookupError, match="raised on purpose"):
            runner.run(resolved)
    else:
        runner.run(resolved)

    inside = json.loads(record.read_text())
    assert inside == {
        "argv": ["inside.py", str(record), ending],
        "path0": str(in_fixtures),
        "main_is_self": True,
        "mp_main_is_self": True,
    }
    after = _snapshot()
    assert after[0] is before[0]  # the very same sys.argv list
    assert after[1:] == before[1:]
    assert "/nonexistent/inserted-by-script" not in sys.path


def test_script_globals_live_until_the_next_run_as_under_python(tmp_path: Path) -> None:
    # Freeing a DDP script's objects the moment it returns deadlocked a rank (see
    # runner._last_main); python keeps __main__'s globals until the interpreter exits.
    import gc
    import weakref

    script = tmp_path / "keeps.py"
    script.write_text("import sys\nclass Box: pass\nbox = Box()\nsys.amp_doctor_test_box = box\n")
    runner.run(runner.resolve(runner.Target("path", str(script))))
    box = weakref.ref(sys.__dict__.pop("amp_doctor_test_box"))
    gc.collect()
    assert box() is not None and type(box()).__name__ == "Box"
    empty = tmp_path / "empty.py"
    empty.write_text("")
    runner.run(runner.resolve(runner.Target("path", str(empty))))
    gc.collect()
    assert box() is None  # the next run released the previous run's globals


def test_exceptions_propagate_unchanged_and_traceback_hides_the_runner(in_fixtures: Path) -> None:
    resolved = runner.resolve(runner.Target("path", "boom.py", ()))
    with pytest.raises(ValueError) as caught:
        runner.run(resolved)
    exc = caught.value
    assert isinstance(exc.__cause__, KeyError)
    assert runner.exit_code(exc) == 1

    text = runner.user_traceback(exc)
    boom = in_fixtures / "boom.py"
    assert text.startswith("Traceback (most recent call last):\n")
    assert f'File "{boom}", line 15, in <module>\n    main()\n' in text
    assert f'File "{boom}", line 5, in lookup\n' in text
    assert "The above exception was the direct cause of the following exception:" in text
    assert text.endswith("ValueError: no key in the table\n")
    assert RUNNER_FILE not in text
    assert "test_runner.py" not in text  # the caller's frames are not the user's


def test_system_exit_and_keyboard_interrupt_propagate(in_fixtures: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        runner.run(runner.resolve(runner.Target("path", "exits.py", ("int", "3"))))
    assert exited.value.code == 3
    assert runner.exit_code(exited.value) == 3
    with pytest.raises(KeyboardInterrupt) as interrupted:
        runner.run(runner.resolve(runner.Target("path", "exits.py", ("kbd",))))
    assert runner.exit_code(interrupted.value) == 130


def test_module_run_in_process(in_fixtures: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path_before = list(sys.path)
    resolved = runner.resolve(runner.Target("module", "probe_pkg", ["q"]))  # type: ignore[arg-type]
    assert sys.path == path_before  # the cwd was only on sys.path for the lookup
    assert resolved.argv == (str(in_fixtures / "probe_pkg" / "__main__.py"), "q")
    assert resolved.path0 == str(in_fixtures)
    assert resolved.spec is not None and resolved.spec.name == "probe_pkg.__main__"
    assert resolved.package == "probe_pkg"
    runner.run(resolved)
    seen = json.loads(capsys.readouterr().out)
    assert seen["spec_name"] == "probe_pkg.__main__"
    assert seen["package"] == "probe_pkg"
    assert seen["path"][0] == str(in_fixtures)
    assert seen["roundtrip"] == 3
    assert sys.path == path_before


def test_chdir_in_the_script_does_not_disturb_the_resolution(
    in_fixtures: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resolved = runner.resolve(runner.Target("path", "chdir_script.py", (str(tmp_path),)))
    frozen = (resolved.argv, resolved.path0, resolved.file, resolved.code.co_filename)
    script = str(in_fixtures / "chdir_script.py")
    assert frozen == (("chdir_script.py", str(tmp_path)), str(in_fixtures), script, script)

    for _ in range(2):  # the second time starts from the directory the first one left
        with pytest.raises(RuntimeError) as caught:
            runner.run(resolved)
        seen = json.loads(capsys.readouterr().out)
        assert seen == {
            "cwd": str(tmp_path),
            "file": script,
            "helper": str(in_fixtures / "probe_lib.py"),
        }
        text = runner.user_traceback(caught.value)
        assert f'File "{script}", line 11, in <module>\n' in text
        assert '    raise RuntimeError("failed after chdir")\n' in text

    assert (resolved.argv, resolved.path0, resolved.file, resolved.code.co_filename) == frozen
    assert os.getcwd() == str(tmp_path)  # run() leaves the cwd where the script put it


def test_syntax_error_is_raised_by_resolve(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n    pass\n")
    with pytest.raises(SyntaxError) as caught:
        runner.resolve(runner.Target("path", str(bad), ()))
    assert caught.value.filename == str(bad)
    assert caught.value.lineno == 1
    text = runner.user_traceback(caught.value)
    assert text.startswith(f'  File "{bad}", line 1\n    def f(:\n')
    assert "^" in text
    assert "Traceback" not in text
    assert runner.exit_code(caught.value) == 1


def test_binary_file_is_a_syntax_error_naming_file_and_line(tmp_path: Path) -> None:
    blob = tmp_path / "model.pt"
    blob.write_bytes(b"ok = 1\nPK\x00\x01junk")
    with pytest.raises(SyntaxError) as caught:
        runner.resolve(runner.Target("path", str(blob), ()))
    assert (caught.value.filename, caught.value.lineno) == (str(blob), 2)
    assert "null bytes" in runner.user_traceback(caught.value)


def test_compiled_pyc_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import py_compile

    source = tmp_path / "compiled.py"
    source.write_text("import sys\nprint('pyc', sys.argv[1:])\n")
    pyc = tmp_path / "compiled.pyc"
    py_compile.compile(str(source), cfile=str(pyc), doraise=True)
    resolved = runner.resolve(runner.Target("path", str(pyc), ("z",)))
    assert type(resolved.loader).__name__ == "SourcelessFileLoader"
    runner.run(resolved)
    assert capsys.readouterr().out == "pyc ['z']\n"


# -------------------------------------------------------------- resolution errors


def test_missing_script_names_the_path_the_cwd_and_a_close_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "train.py").write_text("print('never runs')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(runner.ScriptNotFound) as caught:
        runner.resolve(runner.Target("path", "trian.py", ("--epochs", "1")))
    message = str(caught.value)
    assert message == (
        f"No script at 'trian.py' (cwd {tmp_path}). Did you mean 'train.py'? "
        "Check the path, or use -m for a module."
    )


def test_directory_without_main_is_script_not_found(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(runner.ScriptNotFound) as caught:
        runner.resolve(runner.Target("path", str(tmp_path / "empty"), ()))
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith(f"No __main__.py in {str(tmp_path / 'empty')!r}")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "no_such_module_xyz",
            "No module named 'no_such_module_xyz' (cwd {cwd}). Check the spelling and that it "
            "is importable by this Python (installed, or on PYTHONPATH), or pass a file path "
            "instead of -m.",
        ),
        (
            "probe_pkg.nope",
            "No module named 'probe_pkg.nope' (cwd {cwd}). Check the spelling and that it "
            "is importable by this Python (installed, or on PYTHONPATH), or pass a file path "
            "instead of -m.",
        ),
        (
            "nomain_pkg",
            "Package 'nomain_pkg' has no __main__.py, so it cannot be run with -m. "
            "Add nomain_pkg/__main__.py, or give a module inside it.",
        ),
        (
            "probe.py",
            "Module names do not end in '.py': use -m 'probe', or pass 'probe.py' as a script "
            "path without -m.",
        ),
        (
            ".relative",
            "Cannot run module '.relative': relative or empty module names are not supported. "
            "Give the full dotted name.",
        ),
    ],
)
def test_unknown_module_is_module_not_found(
    name: str, expected: str, in_fixtures: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path_before = list(sys.path)
    with pytest.raises(runner.ModuleNotFound) as caught:
        runner.resolve(runner.Target("module", name, ()))
    assert str(caught.value) == expected.format(cwd=in_fixtures)
    assert capsys.readouterr().out == ""  # in particular, -m probe.py did not run probe.py
    assert sys.path == path_before


# ------------------------------------------------------------ exit codes, reporting


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (None, 0, None),
        (SystemExit(), 0, None),
        (SystemExit(None), 0, None),
        (SystemExit(0), 0, None),
        (SystemExit(3), 3, None),
        (SystemExit(True), 1, None),
        (SystemExit("bad config"), 1, "bad config"),
        (SystemExit(1, 2), 1, "(1, 2)"),
        (KeyboardInterrupt(), 130, None),
        (ValueError("x"), 1, None),
        (runner.ScriptNotFound("x"), 1, None),
    ],
)
def test_exit_code_and_message(exc: BaseException | None, code: int, message: str | None) -> None:
    assert runner.exit_code(exc) == code
    assert runner.system_exit_message(exc) == message


def test_report_exit_prints_what_python_prints() -> None:
    stream = io.StringIO()
    assert runner.report_exit(SystemExit("bad config"), stream) == 1
    assert stream.getvalue() == "bad config\n"

    stream = io.StringIO()
    assert runner.report_exit(SystemExit(4), stream) == 4
    assert runner.report_exit(None, stream) == 0
    assert stream.getvalue() == ""

    stream = io.StringIO()
    assert runner.report_exit(KeyboardInterrupt(), stream) == 130
    assert stream.getvalue() == "KeyboardInterrupt\n"


def test_user_traceback_keeps_frames_of_code_not_run_by_the_runner() -> None:
    def failing() -> None:
        raise OSError("elsewhere")

    try:
        failing()
    except OSError as exc:
        text = runner.user_traceback(exc)
    assert "in failing\n" in text
    assert text.endswith("OSError: elsewhere\n")


def test_target_freezes_its_arguments() -> None:
    args = ["--lr", "1"]
    target = runner.Target("path", "train.py", args)  # type: ignore[arg-type]
    args.append("--later")
    assert target.args == ("--lr", "1")
    assert pickle.loads(pickle.dumps(target)) == target
    with pytest.raises(ValueError, match="kind"):
        runner.Target("script", "train.py", ())  # type: ignore[arg-type]
