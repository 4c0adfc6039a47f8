"""The ``amp-doctor`` command: ``diagnose``, ``report``, ``view``.

The CLI only arranges things: it runs the user's script faithfully
(:mod:`amp_doctor.runner`) under a :class:`~amp_doctor.watch.Watch` that
discovers models, scalers and optimizers by itself, then renders the same
session. It has no analysis of its own.
"""

from __future__ import annotations

import datetime as _dt
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import click

from . import runner
from ._version import __version__
from .errors import AmpDoctorError
from .recorder import HostStep
from .records import SEVERITIES, Session, StepRecord

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


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(f"amp-doctor: error: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="amp-doctor")
def cli() -> None:
    """Find out why mixed-precision (AMP) training misbehaves, and where."""


def _default_logdir(target: runner.Target) -> Path:
    stem = Path(target.name).stem if target.kind == "path" else target.name.replace(".", "_")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / "amp-doctor" / f"{stem}-{stamp}"


def _check_writable(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".amp-doctor-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        _fail(
            f"cannot write to logdir {str(d)!r} ({e.strerror or e}); "
            "pass a writable directory with --logdir DIR."
        )


class _Progress:
    """A live status line on stderr for long runs (TTY only)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._last = 0.0
        self.shown = False

    def __call__(self, rec: StepRecord, hs: HostStep) -> None:
        del hs
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.5:
            return
        self._last = now
        scale = f"{rec.scale:g}" if rec.scale is not None else "-"
        loss = f"{rec.loss:.4g}" if rec.loss is not None else "-"
        bad = sum(
            1 for ls in rec.layers.values()
            if ls.act is not None and (ls.act.nonfinite_frac > 0 or ls.act.overflow_frac > 0)
        )
        sys.stderr.write(
            f"\r\x1b[2Kamp-doctor: step {rec.step}  loss {loss}  scale {scale}  "
            f"layers overflowing {bad}"
        )
        sys.stderr.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


def _severity_reached(session: Session, level: str) -> bool:
    if level == "never":
        return False
    worst = SEVERITIES.index(level)
    return any(SEVERITIES.index(f.severity) <= worst for f in session.findings)


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Run a training script under amp-doctor.",
)
@click.option("-m", "module", metavar="MODULE", help="Run a module, as `python -m MODULE`.")
@click.option("--logdir", type=click.Path(path_type=Path), default=None,
              help="Where the JSON and TensorBoard logs go "
                   "[default: runs/amp-doctor/<script>-<timestamp>].")
@click.option("--every", type=click.IntRange(min=1), default=None,
              help="Record one training step in N [default: 10].")
@click.option("--anomaly", is_flag=True,
              help="Find the first op that produced NaN/Inf (slower).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
              help="Also write the JSON report here.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=None,
              help="Also write the text report here.")
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
    try:
        resolved = runner.resolve(target)
    except (runner.ScriptNotFound, runner.ModuleNotFound) as e:
        _fail(str(e))
    except BaseException as e:
        # A SyntaxError in the script, or whatever `-m pkg.mod` raised while
        # importing pkg: python reports these before anything runs, and so do we.
        sys.exit(runner.report_exit(e))
    # Absolute before the script runs: it may chdir.
    logdir = (logdir or _default_logdir(target)).absolute()
    _check_writable(logdir)
    json_out = json_path.absolute() if json_path else None
    report_out = report_path.absolute() if report_path else None
    for p in (json_out, report_out):
        if p is not None:
            _check_writable(p.parent)
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
    code = _diagnose(resolved, target, logdir, every, anomaly, json_out, report_out, fail_on,
                     max_steps, quiet, not no_tensorboard, fp32, stop_after, target_dtype)
    sys.exit(code)


def _diagnose(
    resolved: Any, target: runner.Target, logdir: Path, every: int | None, anomaly: bool,
    json_out: Path | None, report_out: Path | None, fail_on: str, max_steps: int | None,
    quiet: bool, tensorboard: bool, fp32: tuple[str, ...] = (), stop_after: int | None = None,
    target_dtype: str | None = None,
) -> int:
    from .errors import StopRun
    from .merge import merge_run_dir, rank_dir, rank_env
    from .watch import DEFAULT_EVERY, Watch

    ranks = rank_env()
    under_launcher = bool(os.environ.get(_LAUNCHER_ENV))
    run_dir = rank_dir(logdir, ranks[0]) if ranks else logdir
    doctor = Watch(None, every=every or DEFAULT_EVERY, logdir=run_dir, anomaly=anomaly,
                   max_steps=max_steps, discover=True, tensorboard=tensorboard, fp32=fp32,
                   stop_after=stop_after, target_dtype=target_dtype)
    speaks = ranks is None or (ranks[0] == 0 and not under_launcher)
    progress = _Progress(enabled=speaks and not quiet and sys.stderr.isatty())
    command = ["python", *(["-m", target.name] if target.kind == "module" else [target.name]),
               *target.args]
    exc: BaseException | None = None
    doctor.start()
    doctor.add_listener(progress)
    try:
        runner.run(resolved)
    except StopRun:
        pass  # --stop-after: a normal end of a shortened run
    except BaseException as e:  # the user's exit path, whatever it is, is ours to report
        exc = e
    finally:
        progress.clear()
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
    doctor.set_run_meta(command=command, exit_code=code, outcome=outcome, error=error,
                        rank=ranks[0] if ranks else None, world_size=ranks[1] if ranks else None)
    try:
        session = doctor.close()
    except OSError as e:
        click.echo(f"amp-doctor: error: could not write the logs in {run_dir} ({e}); "
                   "check free space and permissions.", err=True)
        session = doctor.session
    # The user's own error first, exactly as python would print it.
    runner.report_exit(exc, sys.stderr)
    if ranks is not None:
        (run_dir / TEXT_NAME).write_text(_render(session))
        if not speaks:
            return code
        # Direct `torchrun -m amp_doctor diagnose`: rank 0 merges what the others wrote.
        merged = merge_run_dir(logdir, ranks[1])
        session = merged or session
    code = _publish(session, logdir, json_out, report_out, fail_on, tensorboard, code)
    if doctor.fp32_islands is not None:
        try:
            doctor.fp32_islands.check()
        except AmpDoctorError as e:  # after the report: what ran is still worth reading
            click.echo(f"amp-doctor: error: {e}", err=True)
            return EXIT_USAGE
    return code


def _render(session: Session) -> str:
    from .sinks.text import render_text

    return render_text(session)


def _publish(session: Session, logdir: Path, json_out: Path | None, report_out: Path | None,
             fail_on: str, tensorboard: bool, code: int) -> int:
    """Write and print the report; the exit code, raised to 1 by --fail-on."""
    text = _render(session)
    text_file = logdir / TEXT_NAME
    text_file.write_text(text)
    if report_out is not None:
        report_out.write_text(text)
    if json_out is not None:
        session.save(json_out)
    _print_report(text, text_file)
    click.echo(f"amp-doctor: JSON report: {logdir / JSON_NAME}", err=True)
    if tensorboard:
        q = shlex.quote(str(logdir))
        click.echo(f"amp-doctor: view the dashboards: tensorboard --logdir {q}"
                   f"   (or: amp-doctor view {q})", err=True)
    if code == 0 and _severity_reached(session, fail_on):
        click.echo(f"amp-doctor: exit 1: findings at or above '{fail_on}' (--fail-on).",
                   err=True)
        return 1
    return code


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
    merged = merge_run_dir(logdir, nproc, timeout=5.0)
    if merged is None:
        _fail(f"no rank wrote a report in {logdir}; see the errors above.", code=rc or 1)
    code = merged.run.exit_code or rc
    return _publish(merged, logdir, json_out, report_out, fail_on, tensorboard, code)


def _print_report(text: str, path: Path) -> None:
    lines = text.splitlines()
    if len(lines) <= MAX_PRINTED_LINES:
        click.echo("\n" + text, err=True, nl=False)
        return
    head = []
    for line in lines:
        if line.startswith("Layers, worst first"):
            break
        head.append(line)
    if len(head) > MAX_PRINTED_LINES:
        head = head[:MAX_PRINTED_LINES] + ["..."]
    click.echo("\n" + "\n".join(head), err=True)
    click.echo(f"amp-doctor: full report ({len(lines)} lines): {path}", err=True)


def _load_session(path: Path) -> Session:
    p = path / JSON_NAME if path.is_dir() else path
    if not p.exists():
        _fail(f"no amp-doctor report at {str(p)!r}; pass a run directory written by "
              "`amp-doctor diagnose` (it holds amp_doctor.json) or a JSON report file.")
    try:
        return Session.load(p)
    except (ValueError, KeyError, TypeError) as e:
        _fail(f"{str(p)!r} is not an amp-doctor JSON report ({type(e).__name__}: {e}).")


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


@cli.command(short_help="Open a run's dashboards in TensorBoard.")
@click.argument("run", type=click.Path(path_type=Path, exists=False))
@click.option("--port", type=int, default=6006, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
def view(run: Path, port: int, host: str) -> None:
    """Start TensorBoard on RUN and print its URL; Ctrl-C stops it."""
    if not run.is_dir():
        _fail(f"no run directory at {str(run)!r}; pass the --logdir of a diagnose run "
              "(default runs/amp-doctor/<script>-<timestamp>).")
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(run), "--host", host,
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    click.echo(f"amp-doctor: TensorBoard on {run} at http://{host}:{port}/  (Ctrl-C to stop)")
    try:
        _, err = proc.communicate()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        return
    if proc.returncode:
        _fail(f"tensorboard exited with {proc.returncode}: "
              f"{(err or '').strip().splitlines()[-1:] or ''}; is port {port} free? "
              "Try --port.", code=1)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="amp-doctor", standalone_mode=True)
    except AmpDoctorError as e:
        _fail(str(e))


