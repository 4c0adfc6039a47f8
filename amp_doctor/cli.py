"""The ``amp-doctor`` command: ``diagnose``, ``report``, ``view``.

The CLI only arranges things: it runs the user's script faithfully
(:mod:`amp_doctor.runner`) under a :class:`~amp_doctor.watch.Watch` that
discovers models, scalers and optimizers by itself, then renders the same
session. It has no analysis of its own.

Nothing here imports torch at module level: ``--help``, argument errors,
``report`` and ``view`` start in a fraction of a second. Commands that run
a model import what they need inside the command.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import click

from . import runner
from ._version import __version__
from .errors import AmpDoctorError, ReportFormatError
from .records import SEVERITIES, Session, StepRecord

if TYPE_CHECKING:
    from .recorder import HostStep

__all__ = ["main", "cli"]

# A report longer than this many lines is written to a file and only its
# path and the findings' headlines are printed.
MAX_PRINTED_LINES = 60
EXIT_USAGE = 2
# Set for the rank processes a `diagnose --nproc-per-node` launcher starts: it merges.
_LAUNCHER_ENV = "AMP_DOCTOR_LAUNCHER"
EXIT_INTERRUPTED = 130
JSON_NAME = "amp_doctor.json"
TEXT_NAME = "report.txt"
DEFAULT_RUNS_DIR = Path("runs") / "amp-doctor"
# Parallel runs started in the same second (a sweep) get "-2", "-3", ... suffixes; a
# cap only so that a folder we cannot create by any name ends in an error, not a loop.
MAX_LOGDIR_SUFFIX = 1000
# Redraw the live status line at most this often.
STATUS_INTERVAL_S = 0.5
# How long `view` waits for TensorBoard to print its URL before giving up.
TENSORBOARD_START_TIMEOUT_S = 120.0
SMOOTHING_HINT = ("in TensorBoard, set Smoothing to 0 in the left panel of the SCALARS tab "
                  "to see each step's true value")
_CLEAR_LINE = "\r\x1b[2K"


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(f"amp-doctor: error: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="amp-doctor")
def cli() -> None:
    """Find out why mixed-precision (AMP) training misbehaves, and where."""


# --------------------------------------------------------------------------- terminal


class _Console:
    """amp-doctor's own handle on the terminal, kept apart from the script's ``sys.stderr``.

    A script may point ``sys.stderr`` at a file and close it, or close the real one; the
    report must still reach the terminal. So the handle is a duplicate of file
    descriptor 2 taken before the script runs. Where stderr has no file descriptor
    (captured in-process, e.g. by click's test runner) it is the stream object itself.
    """

    def __init__(self) -> None:
        self.stream: TextIO | None = sys.stderr
        self.fd: int | None = None
        self._owned = False
        try:
            err = sys.stderr
            err.flush()
            fd = os.dup(err.fileno())
        except (AttributeError, OSError, ValueError):
            return  # io.UnsupportedOperation is an OSError and a ValueError
        self.fd = fd
        self.stream = os.fdopen(fd, "w", buffering=1,
                                encoding=getattr(err, "encoding", None) or "utf-8",
                                errors="backslashreplace")
        self._owned = True

    def write(self, text: str) -> None:
        # The terminal may be gone (closed pipe, hung-up tty): the files are written
        # already, so losing the printout must not change the exit code.
        stream = self.stream
        if stream is None:
            return
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):
            pass

    def echo(self, text: str) -> None:
        self.write(text + "\n")

    def write_now(self, text: str) -> None:
        """Write from a signal handler: unbuffered, so never re-entering a buffer's lock."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.fd, text.encode("utf-8", "backslashreplace"))

    def isatty(self) -> bool:
        try:
            return bool(self.stream is not None and self.stream.isatty())
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        if self._owned and self.stream is not None:
            with contextlib.suppress(OSError, ValueError):
                self.stream.close()
        self._owned = False


def _usable(stream: Any) -> bool:
    return stream is not None and not getattr(stream, "closed", False)


def _restore_std_streams(console: _Console) -> None:
    """Give the process working std streams again if the script closed its own.

    Python keeps whatever ``sys.stdout``/``sys.stderr`` the script left, and so do we,
    unless it is closed: then warnings or anything else printed while the report is
    built would raise ``ValueError: I/O operation on closed file``.
    """
    if not _usable(sys.stderr):
        if _usable(sys.__stderr__):
            sys.stderr = sys.__stderr__
        elif console.stream is not None:
            sys.stderr = console.stream
            console._owned = False  # now the process's; Python closes it at exit
    if not _usable(sys.stdout) and _usable(sys.__stdout__):
        sys.stdout = sys.__stdout__


class _Progress:
    """A live status line on the terminal for long runs (TTY only), drawn like tqdm's.

    The line is written with carriage return + clear-to-end-of-line and no newline. So
    that the script's own output never lands glued onto it, ``sys.stdout`` and
    ``sys.stderr`` (when they are terminals) are wrapped while the script runs: each
    write first clears the status line; it is redrawn on a later step.
    """

    def __init__(self, enabled: bool, console: _Console) -> None:
        self.enabled = enabled
        self.console = console
        self._last = 0.0
        self.shown = False
        self._user_mid_line = False
        self._wrapped: list[tuple[str, Any, _GuardedStream]] = []

    def __call__(self, rec: StepRecord, hs: HostStep) -> None:
        del hs
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < STATUS_INTERVAL_S or self._user_mid_line:
            return  # never wipe half a line the script has printed
        self._last = now
        scale = f"{rec.scale:g}" if rec.scale is not None else "-"
        loss = f"{rec.loss:.4g}" if rec.loss is not None else "-"
        bad = sum(
            1 for ls in rec.layers.values()
            if ls.act is not None and (ls.act.nonfinite_frac > 0 or ls.act.overflow_frac > 0)
        )
        self.console.write(
            f"{_CLEAR_LINE}amp-doctor: step {rec.step}  loss {loss}  scale {scale}  "
            f"layers overflowing {bad}"
        )
        self.shown = True

    def before_user_write(self, text: str) -> None:
        if self.shown:
            self.shown = False
            self.console.write(_CLEAR_LINE)
        if text:
            self._user_mid_line = not text.endswith("\n")

    def wrap_std_streams(self) -> None:
        if not self.enabled:
            return
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            try:
                tty = stream.isatty()
            except (AttributeError, OSError, ValueError):
                tty = False
            if tty:
                guard = _GuardedStream(stream, self)
                setattr(sys, name, guard)
                self._wrapped.append((name, stream, guard))

    def unwrap_std_streams(self) -> None:
        for name, original, guard in self._wrapped:
            if getattr(sys, name) is guard:  # the script may have replaced it: keep theirs
                setattr(sys, name, original)
        self._wrapped = []

    def clear(self) -> None:
        if self.shown:
            self.shown = False
            self.console.write(_CLEAR_LINE)


class _GuardedStream:
    """A script's terminal stream that clears amp-doctor's status line before each write.

    Everything but ``write``/``writelines`` is the wrapped stream's own (``buffer``,
    ``fileno``, ``isatty``, ``encoding``...).
    """

    def __init__(self, inner: Any, progress: _Progress) -> None:
        self._inner = inner
        self._progress = progress

    def write(self, text: str) -> int:
        self._progress.before_user_write(text)
        n: int = self._inner.write(text)
        return n

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _sigint_shield(console: _Console) -> Iterator[None]:
    """While the report is written, a further Ctrl-C does not abort the writing.

    A second Ctrl-C used to land in the middle of ``close()`` and lose everything
    ("Aborted!", exit 1). The run is over by then; the writing takes a moment. The
    previous handler is restored afterwards. Only the main thread may set handlers.
    """
    noted = False

    def ignore(signum: int, frame: Any) -> None:
        nonlocal noted
        del signum, frame
        if not noted:
            noted = True
            console.write_now("\namp-doctor: writing the report; Ctrl-C is ignored until "
                              "it is written.\n")

    previous: Any = None
    installed = False
    if threading.current_thread() is threading.main_thread():
        try:
            previous = signal.signal(signal.SIGINT, ignore)
            installed = True
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        if installed:
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signal.SIGINT, previous if previous is not None
                              else signal.default_int_handler)


# --------------------------------------------------------------------------- paths


def _default_logdir(target: runner.Target) -> Path:
    """A fresh folder per run under runs/amp-doctor/: <script>-<timestamp>[-N].

    Claimed with an exclusive mkdir, so parallel runs started in the same second (a
    sweep) never share one: a shared folder would keep one JSON and mix the event files.
    The ranks of one torchrun job must agree on the folder instead: they share it,
    named by the job's run id when torchrun gives one.
    """
    from .merge import rank_env

    stem = Path(target.name).stem if target.kind == "path" else target.name.replace(".", "_")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if rank_env() is not None:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        name = f"{stem}-torchrun-{run_id[:8]}" if run_id not in ("", "none") else f"{stem}-{stamp}"
        return DEFAULT_RUNS_DIR / name
    for n in range(1, MAX_LOGDIR_SUFFIX + 1):
        d = DEFAULT_RUNS_DIR / (f"{stem}-{stamp}" if n == 1 else f"{stem}-{stamp}-{n}")
        try:
            d.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as e:
            _fail(f"cannot create the default logdir {str(d)!r} ({e.strerror or e}); "
                  "pass a writable directory with --logdir DIR.")
        return d
    _fail(f"no free folder name for {stem}-{stamp} in {str(DEFAULT_RUNS_DIR)!r}; "
          "pass --logdir DIR.")


def _check_writable(d: Path, option: str = "--logdir") -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".amp-doctor-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        what = "logdir" if option == "--logdir" else f"the folder of {option}"
        _fail(f"cannot write to {what} {str(d)!r} ({e.strerror or e}); "
              f"pass a writable {'directory' if option == '--logdir' else 'path'} "
              f"with {option}.")


def _check_output_file(p: Path, option: str, example: str) -> None:
    """Fail before the script runs if the report cannot be written to ``p``."""
    if p.is_dir():
        _fail(f"{option} {str(p)!r} is a directory; pass a file path, "
              f"e.g. {option} {shlex.quote(str(p / example))}.")
    _check_writable(p.parent, option)


def _note_reused_logdir(logdir: Path, console: _Console) -> None:
    if (logdir / JSON_NAME).exists() or any(logdir.glob("events.out.tfevents.*")):
        console.echo(f"amp-doctor: note: {logdir} already holds a run: its reports will be "
                     "replaced and TensorBoard will show both runs' event files as one run. "
                     "Leave out --logdir for a fresh folder per run.")


def _severity_reached(session: Session, level: str) -> bool:
    if level == "never":
        return False
    worst = SEVERITIES.index(level)
    return any(SEVERITIES.index(f.severity) <= worst for f in session.findings)


# --------------------------------------------------------------------------- diagnose


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Run a training script under amp-doctor.",
)
@click.option("-m", "module", metavar="MODULE", help="Run a module, as `python -m MODULE`.")
@click.option("--logdir", type=click.Path(path_type=Path), default=None,
              help="Where the JSON and TensorBoard logs go "
                   "[default: a new runs/amp-doctor/<script>-<timestamp> per run].")
@click.option("--every", type=click.IntRange(min=1), default=None,
              help="Record one training step in N [default: 10].")
@click.option("--anomaly", is_flag=True,
              help="Find the first op that produced NaN/Inf (slower).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
              help="Also write the JSON report to this file.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=None,
              help="Also write the text report to this file.")
@click.option("--fail-on", type=click.Choice(["never", "warning", "error"]), default="never",
              show_default=True, help="Exit 1 when findings reach this severity.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Record only the first N recorded steps; training runs on untouched.")
@click.option("--fp32", "fp32", multiple=True, metavar="PATTERN",
              help="Run the layers matching PATTERN (a layer name as the report prints it; "
                   "* and ? are wildcards) in float32 under autocast. Repeatable.")
@click.option("--target-dtype", type=click.Choice(["float16", "float8"]), default=None,
              help="The format you plan to move to: its simulated what-ifs become warnings.")
@click.option("--stop-after", type=click.IntRange(min=1), default=None, metavar="N",
              help="End the script after N training steps (a quick trial).")
@click.option("--quiet", "-q", is_flag=True, help="No progress line; print only the report.")
@click.option("--no-tensorboard", is_flag=True, help="Write no TensorBoard event files.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Launch N processes with torch.distributed.run (torchrun), each under "
                   "amp-doctor; logs go to <logdir>/rank<k>/ and one merged report.")
@click.argument("script_and_args", nargs=-1, type=click.UNPROCESSED)
def diagnose(
    module: str | None,
    logdir: Path | None,
    every: int | None,
    anomaly: bool,
    json_path: Path | None,
    report_path: Path | None,
    fail_on: str,
    max_steps: int | None,
    fp32: tuple[str, ...],
    target_dtype: str | None,
    stop_after: int | None,
    quiet: bool,
    no_tensorboard: bool,
    nproc_per_node: int | None,
    script_and_args: tuple[str, ...],
) -> None:
    """Run SCRIPT [ARGS]... (or -m MODULE [ARGS]...) as python would, and diagnose its AMP.

    Everything after the script or module belongs to it:

        amp-doctor diagnose --every 1 train.py --epochs 3
    """
    if module is not None:
        target = runner.Target("module", module, tuple(script_and_args))
    elif script_and_args:
        target = runner.Target("path", script_and_args[0], tuple(script_and_args[1:]))
    else:
        _fail("no script given; usage: amp-doctor diagnose [OPTIONS] SCRIPT [ARGS]... "
              "or -m MODULE [ARGS]...")
    if target.kind == "path" and target.name.startswith("-") and not Path(target.name).exists():
        _fail_unknown_option(target.name)
    try:
        resolved = runner.resolve(target)
    except (runner.ScriptNotFound, runner.ModuleNotFound) as e:
        _fail(str(e))
    except BaseException as e:
        # A SyntaxError in the script, or whatever `-m pkg.mod` raised while
        # importing pkg: python reports these before anything runs, and so do we.
        sys.exit(runner.report_exit(e))
    # Every output path is checked before the script runs: a report that cannot be
    # written must fail now, not after hours of training. Absolute: the script may chdir.
    json_out = json_path.absolute() if json_path else None
    report_out = report_path.absolute() if report_path else None
    if json_out is not None:
        _check_output_file(json_out, "--json", JSON_NAME)
    if report_out is not None:
        _check_output_file(report_out, "--report", TEXT_NAME)
    explicit = logdir is not None
    logdir = (logdir or _default_logdir(target)).absolute()
    _check_writable(logdir)
    if nproc_per_node is not None and nproc_per_node > 1:
        forwarded = [*(["--every", str(every)] if every else []),
                     *(["--anomaly"] if anomaly else []),
                     *(["--max-steps", str(max_steps)] if max_steps else []),
                     *[a for p in fp32 for a in ("--fp32", p)],
                     *(["--stop-after", str(stop_after)] if stop_after else []),
                     *(["--target-dtype", target_dtype] if target_dtype else []),
                     *(["--no-tensorboard"] if no_tensorboard else [])]
        sys.exit(_launch(nproc_per_node, target, logdir, forwarded, json_out, report_out,
                         fail_on, not no_tensorboard))
    console = _Console()
    try:
        if explicit and not os.environ.get(_LAUNCHER_ENV):
            _note_reused_logdir(logdir, console)
        code = _diagnose(resolved, target, logdir, every, anomaly, json_out, report_out,
                         fail_on, max_steps, quiet, not no_tensorboard, console, fp32,
                         stop_after, target_dtype)
    finally:
        console.close()
    sys.exit(code)


def _fail_unknown_option(given: str) -> NoReturn:
    # diagnose passes unknown options through to the script, so a misspelt option of
    # ours arrives here as the "script" name: say so, instead of "No script at '--evry'".
    import difflib

    known = [opt for param in click.get_current_context().command.params
             for opt in getattr(param, "opts", []) if opt.startswith("-")]
    close = difflib.get_close_matches(given.split("=")[0], known, n=1)
    hint = f" Did you mean {close[0]}?" if close else ""
    _fail(f"no such option: {given}.{hint} amp-doctor's options go before the script: "
          "amp-doctor diagnose [OPTIONS] SCRIPT [ARGS]... (see amp-doctor diagnose --help).")


def _diagnose(
    resolved: Any, target: runner.Target, logdir: Path, every: int | None, anomaly: bool,
    json_out: Path | None, report_out: Path | None, fail_on: str, max_steps: int | None,
    quiet: bool, tensorboard: bool, console: _Console, fp32: tuple[str, ...] = (),
    stop_after: int | None = None, target_dtype: str | None = None,
) -> int:
    from .merge import rank_dir, rank_env
    from .watch import DEFAULT_EVERY, Watch

    ranks = rank_env()
    under_launcher = bool(os.environ.get(_LAUNCHER_ENV))
    run_dir = rank_dir(logdir, ranks[0]) if ranks else logdir
    doctor = Watch(None, every=every or DEFAULT_EVERY, logdir=run_dir, anomaly=anomaly,
                   max_steps=max_steps, discover=True, tensorboard=tensorboard, fp32=fp32,
                   stop_after=stop_after, target_dtype=target_dtype)
    speaks = ranks is None or (ranks[0] == 0 and not under_launcher)
    progress = _Progress(enabled=speaks and not quiet and console.isatty(), console=console)
    command = ["python", *(["-m", target.name] if target.kind == "module" else [target.name]),
               *target.args]
    doctor.start()
    doctor.add_listener(progress)
    progress.wrap_std_streams()
    try:
        exc = _run_script(resolved)
    except KeyboardInterrupt as late:  # a second Ctrl-C as the script's own exit unwound
        exc = late
    # A Ctrl-C in the instant before the shield is up only means "interrupted": nothing is
    # written yet, so take it as the outcome and finish again, shielded.
    while True:
        try:
            with _sigint_shield(console):
                progress.unwrap_std_streams()
                progress.clear()
                return _finish(doctor, exc, command, ranks, speaks, run_dir, logdir, json_out,
                               report_out, fail_on, tensorboard, console)
        except KeyboardInterrupt as late:
            exc = exc if exc is not None else late


def _run_script(resolved: Any) -> BaseException | None:
    """Run the user's script; how it ended (None for falling off the end)."""
    from .errors import StopRun

    try:
        runner.run(resolved)
    except StopRun:
        pass  # --stop-after: a normal end of a shortened run
    except BaseException as e:  # the user's exit path, whatever it is, is ours to report
        return e
    return None


def _finish(doctor: Any, exc: BaseException | None, command: list[str],
            ranks: tuple[int, int] | None, speaks: bool, run_dir: Path, logdir: Path,
            json_out: Path | None, report_out: Path | None, fail_on: str, tensorboard: bool,
            console: _Console) -> int:
    """Close the watch, write every file, then print; the exit code."""
    from .merge import merge_run_dir
    from .sinks.jsonfile import write_text_atomic

    _restore_std_streams(console)
    code = runner.exit_code(exc)
    outcome = "completed"
    error = None
    if isinstance(exc, KeyboardInterrupt):
        outcome = "interrupted"
    elif isinstance(exc, SystemExit):
        # sys.exit(0) / sys.exit(None), as in `sys.exit(main())`, is a normal end.
        outcome = "exit" if code != 0 else "completed"
    elif exc is not None:
        outcome = "exception"
        error = f"{type(exc).__name__}: {exc}"
    meta: dict[str, Any] = dict(command=command, exit_code=code, outcome=outcome, error=error,
                                rank=ranks[0] if ranks else None,
                                world_size=ranks[1] if ranks else None)
    doctor.set_run_meta(**meta)
    try:
        session = doctor.close()
    except OSError as e:
        console.echo(f"amp-doctor: error: could not write the logs in {run_dir} ({e}); "
                     "check free space and permissions.")
        session = doctor.session
    except Exception as e:  # amp-doctor's own bug: still write what was gathered
        console.echo(f"amp-doctor: internal error while finishing the run "
                     f"({type(e).__name__}: {e}); the report holds what was recorded before "
                     "it. Please report this bug.")
        session = _salvage(doctor, run_dir, console, meta)
    if ranks is not None:
        _write_or_warn(lambda: write_text_atomic(run_dir / TEXT_NAME, _render(session)),
                       run_dir / TEXT_NAME, console)
        if not speaks:
            _print_user_exit(exc, console)
            return code
        # Direct `torchrun -m amp_doctor diagnose`: rank 0 merges what the others wrote.
        merged = merge_run_dir(logdir, ranks[1])
        session = merged or session
    code = _publish(session, logdir, json_out, report_out, fail_on, tensorboard, code,
                    console, exc=exc)
    if doctor.fp32_islands is not None:
        try:
            doctor.fp32_islands.check()
        except AmpDoctorError as e:  # after the report: what ran is still worth reading
            console.echo(f"amp-doctor: error: {e}")
            return EXIT_USAGE
    return code


def _salvage(doctor: Any, run_dir: Path, console: _Console, meta: dict[str, Any]) -> Session:
    """The session as far as it can be built after ``close()`` failed, written to disk."""
    from .records import AmpConfig, RunInfo
    from .sinks.jsonfile import write_json

    try:
        session: Session = doctor.session
    except Exception:
        # Not even a snapshot: an empty report that still says how the run ended.
        torch_version = str(getattr(sys.modules.get("torch"), "__version__", "?"))
        session = Session(
            version=__version__, amp=AmpConfig(device_type=None, dtype=None, scaler=False),
            steps=int(getattr(doctor, "step_index", 0)),
            recorded_steps=int(getattr(doctor, "recorded", 0)), layers=[], scaler=None,
            history=[], events=[], findings=[],
            run=RunInfo(torch_version=torch_version, started="", duration_s=0.0,
                        every=int(getattr(doctor, "every", 0)), models=[],
                        command=meta.get("command"), exit_code=meta.get("exit_code"),
                        outcome=meta["outcome"], error=meta["error"], rank=meta["rank"],
                        world_size=meta["world_size"]))
    _write_or_warn(lambda: write_json(session, run_dir / JSON_NAME), run_dir / JSON_NAME,
                   console)
    return session


def _print_user_exit(exc: BaseException | None, console: _Console) -> None:
    """The user's own traceback, exactly as python would print it, where python would."""
    stream: Any = sys.stderr if _usable(sys.stderr) else console.stream
    try:
        runner.report_exit(exc, stream)
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            runner.report_exit(exc, console.stream)


def _write_or_warn(write: Any, path: Path, console: _Console) -> bool:
    try:
        write()
    except OSError as e:
        console.echo(f"amp-doctor: error: could not write {path} ({e.strerror or e}); "
                     "check free space and permissions.")
        return False
    return True


def _render(session: Session) -> str:
    from .sinks.text import render_text

    return render_text(session)


def _publish(session: Session, logdir: Path, json_out: Path | None, report_out: Path | None,
             fail_on: str, tensorboard: bool, code: int, console: _Console | None = None,
             exc: BaseException | None = None) -> int:
    """Write the report files, then print; the exit code, raised to 1 by --fail-on.

    Files first: whatever happens to the terminal or the process while printing, the
    report is on disk. Each file is written atomically.
    """
    if console is None:
        console = _Console()
        try:
            return _publish(session, logdir, json_out, report_out, fail_on, tensorboard, code,
                            console, exc)
        finally:
            console.close()
    from .sinks.jsonfile import write_json, write_text_atomic

    text = _render(session)
    text_file = logdir / TEXT_NAME
    _write_or_warn(lambda: write_text_atomic(text_file, text), text_file, console)
    if report_out is not None:
        _write_or_warn(lambda: write_text_atomic(report_out, text), report_out, console)
    if json_out is not None:
        _write_or_warn(lambda: write_json(session, json_out), json_out, console)
    _print_user_exit(exc, console)
    _print_report(text, text_file, console)
    console.echo(f"amp-doctor: JSON report: {logdir / JSON_NAME}")
    if tensorboard:
        console.echo(_view_hint(logdir))
    if code == 0 and _severity_reached(session, fail_on):
        console.echo(f"amp-doctor: exit 1: findings at or above '{fail_on}' (--fail-on).")
        return 1
    return code


def _view_hint(logdir: Path) -> str:
    q = shlex.quote(str(logdir))
    parent = shlex.quote(str(logdir.parent))
    return (f"amp-doctor: view the dashboards: amp-doctor view {q}   (or: tensorboard "
            f"--logdir {parent}, where this run is {logdir.name!r}); {SMOOTHING_HINT}.")


def _launch(nproc: int, target: runner.Target, logdir: Path, forwarded: list[str],
            json_out: Path | None, report_out: Path | None, fail_on: str,
            tensorboard: bool) -> int:
    """Run every rank under amp-doctor with PyTorch's own launcher, then merge the ranks."""
    from .merge import merge_run_dir

    what = ["-m", target.name] if target.kind == "module" else [target.name]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "amp_doctor", "diagnose", "--quiet",
           "--logdir", str(logdir), *forwarded, *what, *target.args]
    env = {**os.environ, _LAUNCHER_ENV: "1"}
    try:
        rc = subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        rc = EXIT_INTERRUPTED
    console = _Console()
    try:
        with _sigint_shield(console):
            merged = merge_run_dir(logdir, nproc, timeout=5.0)
            if merged is None:
                _fail(f"no rank wrote a report in {logdir}; see the errors above.", code=rc or 1)
            code = merged.run.exit_code or rc
            return _publish(merged, logdir, json_out, report_out, fail_on, tensorboard, code,
                            console)
    finally:
        console.close()


def _print_report(text: str, path: Path, console: _Console) -> None:
    lines = text.splitlines()
    if len(lines) <= MAX_PRINTED_LINES:
        console.write("\n" + text)
        return
    head = []
    for line in lines:
        if line.startswith("Layers, worst first"):
            break
        head.append(line)
    if len(head) > MAX_PRINTED_LINES:
        head = head[:MAX_PRINTED_LINES] + ["..."]
    console.echo("\n" + "\n".join(head))
    console.echo(f"amp-doctor: full report ({len(lines)} lines): {path}")


# --------------------------------------------------------------------------- report


def _load_session(path: Path) -> Session:
    """A saved run's Session, or a one-line error naming the file and the problem."""
    p = path / JSON_NAME if path.is_dir() else path
    if not p.exists():
        _fail(f"no amp-doctor report at {str(p)!r}; pass a run directory written by "
              "`amp-doctor diagnose` (it holds amp_doctor.json) or a JSON report file.")
    try:
        return Session.load(p)
    except ReportFormatError as e:
        fix = "" if "amp-doctor" in str(e) else (
            " Pass a JSON report written by `amp-doctor diagnose` or watch(logdir=...).")
        _fail(f"cannot read {str(p)!r}: {e}.{fix}")
    except OSError as e:
        _fail(f"cannot read {str(p)!r} ({e.strerror or e}); check the path and permissions.")


@cli.command(short_help="Render a saved run again.")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text",
              show_default=True)
def report(run: Path, fmt: str) -> None:
    """Render RUN (a run directory or its amp_doctor.json) from the JSON alone."""
    from .sinks.text import render_markdown, render_text

    session = _load_session(run)
    if fmt == "json":
        click.echo(session.to_json())
    elif fmt == "markdown":
        click.echo(render_markdown(session), nl=False)
    else:
        click.echo(render_text(session), nl=False)


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Find the smallest set of float32 layers that removes every error.",
)
@click.option("-m", "module", metavar="MODULE", help="Run a module, as `python -m MODULE`.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Training steps per trial [default: 20].")
@click.option("--trials", type=click.IntRange(min=1), default=None,
              help="Most trial runs after the baseline [default: 12].")
@click.option("--anomaly/--no-anomaly", default=True, show_default=True,
              help="Name op-level origins in every trial (slower, more precise culprits).")
@click.option("--target-dtype", type=click.Choice(["float16", "float8"]), default=None,
              help="Also remove the simulated what-if warnings for this format.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
              help="Also write the trials and the result as JSON here.")
@click.argument("script_and_args", nargs=-1, type=click.UNPROCESSED)
def fix(module: str | None, max_steps: int | None, trials: int | None, anomaly: bool,
        target_dtype: str | None, json_path: Path | None,
        script_and_args: tuple[str, ...]) -> None:
    """Rerun SCRIPT [ARGS]... with candidate layers in float32 (--fp32) until its errors are
    gone, and print the smallest such set with a snippet that applies it.

    Each trial is a real, shortened run of the script; it must be deterministic
    for the steps it runs (fix checks that with a repeated baseline).
    """
    from . import fix as fixing

    if module is None and not script_and_args:
        _fail("no script given; usage: amp-doctor fix [OPTIONS] SCRIPT [ARGS]...")
    target = (runner.Target("module", module, tuple(script_and_args)) if module is not None
              else runner.Target("path", script_and_args[0], tuple(script_and_args[1:])))
    try:
        runner.resolve(target)
    except (runner.ScriptNotFound, runner.ModuleNotFound) as e:
        _fail(str(e))
    if json_path is not None:
        _check_writable(json_path.absolute().parent)
    workdir = fixing.default_workdir()
    run = fixing.subprocess_runner(
        script_and_args, module, max_steps or fixing.DEFAULT_MAX_STEPS, anomaly, workdir,
        lambda line: click.echo(line, err=True), target_dtype)

    def log(t: fixing.Trial) -> None:
        verdict = "ok" if t.ok else f"{len(t.errors)} error(s)"
        click.echo(f"amp-doctor fix: float32 [{', '.join(t.fp32) or 'none'}]: {verdict}",
                   err=True)

    result = fixing.find_fix(run, max_trials=trials or fixing.DEFAULT_TRIALS, log=log)
    result.command = [*(["-m", module] if module else []), *script_and_args]
    click.echo("\n" + fixing.render_fix(result), nl=False)
    click.echo(f"amp-doctor fix: trial runs are in {workdir}", err=True)
    if json_path is not None:
        json_path.write_text(fixing.to_json(result))
    sys.exit(0 if result.best is not None or result.baseline.ok else 1)


@cli.command(short_help="Compare two saved runs (e.g. before and after a fix).")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json"]), default="text",
              show_default=True)
def compare(run_a: Path, run_b: Path, fmt: str) -> None:
    """Show what changed from RUN_A to RUN_B: findings resolved, new and unchanged, the
    scale timelines, per-layer headroom and underflow, and the loss."""
    from .compare import compare as compare_runs
    from .compare import render

    a, b = _load_session(run_a), _load_session(run_b)
    la, lb = _run_label(run_a), _run_label(run_b)
    if la == lb:
        la, lb = f"A:{la}", f"B:{lb}"
    click.echo(render(compare_runs(a, b, la, lb), fmt), nl=False)


def _run_label(path: Path) -> str:
    p = path.absolute()
    return (p.parent.name if p.name == JSON_NAME else p.name) or str(path)


# --------------------------------------------------------------------------- view


def _run_names(runs: list[Path]) -> list[str]:
    """Short distinct names: each folder's own name, with parents only to tell them apart."""
    parts = [r.absolute().parts for r in runs]
    depth = 1
    while True:
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names) or depth >= max(len(p) for p in parts):
            return names
        depth += 1


def _port_in_use(host: str, port: int) -> bool:
    import socket

    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False  # TensorBoard will report the bad host itself
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As TensorBoard's server does: a port in TIME_WAIT is free to take.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError:
            return True
    return False


@cli.command(short_help="Open runs' dashboards in TensorBoard.")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--port", type=click.IntRange(0, 65535), default=6006, show_default=True,
              help="0 picks a free port.")
@click.option("--host", default="127.0.0.1", show_default=True)
def view(runs: tuple[Path, ...], port: int, host: str) -> None:
    """Start TensorBoard on one or more RUNS and print its URL; Ctrl-C stops it.

    Each run shows under its own folder's name, so several runs (before and after a
    fix, float16 and bfloat16) compare side by side: amp-doctor view RUN_A RUN_B
    """
    import shutil
    import tempfile

    for run in runs:
        if not run.is_dir():
            _fail(f"no run directory at {str(run)!r}; pass the --logdir of a diagnose run "
                  "(default runs/amp-doctor/<script>-<timestamp>).")
    if _port_in_use(host, port):
        _fail(f"port {port} on {host} is in use (another TensorBoard?); pass a free port "
              f"with --port {port + 1 if port < 65535 else 6006}, or --port 0 for any free one.",
              code=1)
    # TensorBoard names a run by its folder relative to --logdir: pointed at the run
    # itself, the run is called ".". A folder of symlinks named after the runs gives each
    # its name (TensorBoard's own advice instead of --logdir_spec).
    tree = Path(tempfile.mkdtemp(prefix="amp-doctor-view-"))
    try:
        for run, name in zip(runs, _run_names(list(runs)), strict=True):
            link = tree / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(run.absolute(), target_is_directory=True)
        code = _serve_tensorboard(tree, host, port, ", ".join(_run_names(list(runs))))
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    if code:
        sys.exit(code)


def _serve_tensorboard(logdir: Path, host: str, port: int, names: str) -> int:
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", host,
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def drain() -> None:
        # Read TensorBoard's stderr to the end, so it never blocks on a full pipe.
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip())
            if not url and "http://" in line:
                url.append(line[line.index("http://"):].split()[0])
                ready.set()
        ready.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        ready.wait(TENSORBOARD_START_TIMEOUT_S)
        if url or proc.poll() is None:  # still starting after the wait: say where it will be
            at = url[0] if url else f"http://{host}:{port}/"
            click.echo(f"amp-doctor: TensorBoard at {at}  (runs: {names}; Ctrl-C to stop)")
            click.echo(f"amp-doctor: {SMOOTHING_HINT}.")
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        return 0
    reader.join(timeout=5)
    if proc.returncode:
        said = [ln for ln in lines if ln.strip() and not ln.startswith(("NOTE", "    "))]
        last = said[-1].strip() if said else "no message"
        click.echo(f"amp-doctor: error: tensorboard exited with {proc.returncode}: {last}",
                   err=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="amp-doctor", standalone_mode=True)
    except AmpDoctorError as e:
        _fail(str(e))
