"""What every subcommand shares: exit codes, the usage error, reading a saved report."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from amp_doctor.runfiles import JSON_NAME

if TYPE_CHECKING:
    from amp_doctor.records import Session

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "LAUNCHER_ENV", "OWNS_PROCESS", "SMOOTHING_HINT",
           "DASHBOARD_FRAGMENT", "OUTLIERS_HINT",
           "RunsAScript", "fail", "load_session", "owns_process", "severity_reached"]

EXIT_USAGE = 2
# What a shell shows for a process ended by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
# Set for the rank processes a `diagnose --nproc-per-node` launcher starts: it merges.
LAUNCHER_ENV = "AMP_DOCTOR_LAUNCHER"
# The click context object's key: the command runs as this process's entry point
# (``amp-doctor ...``, ``python -m amp_doctor ...``), not called from other Python code.
OWNS_PROCESS = "owns_process"
# A short run has few points per chart: smoothing bends them, and with "Ignore
# outliers" TensorBoard may scale a two-point chart so that both points fall outside.
SMOOTHING_HINT = ("in TensorBoard's left panel, set Smoothing to 0 and untick 'Ignore outliers in "
                  "chart scaling' to see each step's true value")
# Where `view` sends the user: the CUSTOM SCALARS tab (amp-doctor's groups), unsmoothed.
# TensorBoard's default smoothing (0.6) drew a line from a run's first point to nowhere
# near its second, and a layer recorded every 10th step has few (review 52b). That tab
# reads its smoothing from the URL's fragment; the outlier option lives in the browser's
# storage only, hence OUTLIERS_HINT.
DASHBOARD_FRAGMENT = "#custom_scalars&_smoothingWeight=0"
OUTLIERS_HINT = ("it opens unsmoothed; untick 'Ignore outliers in chart scaling' in its left "
                 "panel to see every step's value")


class RunsAScript(click.Command):
    """A command that runs ``SCRIPT [ARGS]...`` or ``-m MODULE [ARGS]...``: as under python,
    everything after the script or the module is the script's.

    click stops parsing options at the first positional argument (the script path), but
    ``-m MODULE`` is an option with a value, after which it went on: ``-m pkg.train
    --every 3`` took the module's ``--every`` as amp-doctor's, and ``--help`` showed
    amp-doctor's help. The arguments after the module are put behind a ``--`` here, so
    that click passes them on untouched (a ``--`` of the user's among them too).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self._module_args_last(args))

    def _module_args_last(self, args: list[str]) -> list[str]:
        takes_value = {name for p in self.params if isinstance(p, click.Option)
                       and not p.is_flag and not p.count for name in p.opts}
        i = 0
        while i < len(args):
            a = args[i]
            if a == "--" or not a.startswith("-") or a == "-":
                return args  # the script (or an explicit end of options) comes first
            if a == "-m" and i + 1 < len(args):
                return [*args[: i + 2], "--", *args[i + 2 :]]
            if a.startswith("-m") and not a.startswith("--"):
                return [*args[: i + 1], "--", *args[i + 1 :]]  # -mpkg.train
            if a in takes_value:
                i += 1  # skip the option's value
            i += 1
        return args


class EndAsKeyboardInterrupt(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """The script ended by a Ctrl-C it did not catch, and the report is out. Raised to
    the entry point (past click, which would print "Aborted!" and exit 1), which ends
    the process as python ends such a script: the uncaught KeyboardInterrupt at the top,
    then the script's threads and its ``atexit`` handlers, then death by SIGINT (or the
    status python gives when a handler intervenes)."""


def owns_process() -> bool:
    """The running command is this process's entry point (see :data:`OWNS_PROCESS`)."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    return bool(isinstance(obj, dict) and obj.get(OWNS_PROCESS))


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(f"amp-doctor: error: {message}", err=True)
    sys.exit(code)


def fail_unknown_option(given: str) -> NoReturn:
    """The error for an unknown option before the script: ``diagnose`` and ``fix`` pass
    unknown options through to the script, so a misspelt option of theirs arrives as the
    "script" name: say so, instead of "No script at '--evry'"."""
    import difflib

    ctx = click.get_current_context()
    known = [opt for param in ctx.command.params
             for opt in getattr(param, "opts", []) if opt.startswith("-")]
    close = difflib.get_close_matches(given.split("=")[0], known, n=1)
    hint = f" Did you mean {close[0]}?" if close else ""
    cmd = ctx.command_path
    fail(f"no such option: {given}.{hint} amp-doctor's options go before the script: "
         f"{cmd} [OPTIONS] SCRIPT [ARGS]... (see {cmd} --help).")


def severity_reached(session: Session, level: str) -> bool:
    if level == "never":
        return False
    from amp_doctor.records import SEVERITIES

    worst = SEVERITIES.index(level)
    return any(SEVERITIES.index(f.severity) <= worst for f in session.findings)


def load_session(path: Path) -> Session:
    """A saved run's Session, or a one-line error naming the file and the problem."""
    # Imported here: --help and argument errors need neither (the CLI starts faster).
    from amp_doctor.errors import ReportFormatError
    from amp_doctor.records import Session

    p = path / JSON_NAME if path.is_dir() else path
    if not p.exists() and path.is_dir() and any(path.glob("events.out.tfevents.*")):
        fail(f"no amp-doctor report in {str(path)!r}: the run was stopped before it wrote one "
             "(killed by a signal: SIGTERM, `timeout`, a scheduler; Ctrl-C writes it). Its "
             f"live TensorBoard charts are there: amp-doctor view {shlex.quote(str(path))}.")
    if not p.exists() and path.is_dir():
        runs = sorted((d for d in path.iterdir() if (d / JSON_NAME).is_file()),
                      key=lambda d: d.stat().st_mtime, reverse=True)
        if runs:  # the folder of runs (runs/amp-doctor), not a run
            shown = ", ".join(shlex.quote(str(d)) for d in runs[:3])
            what = "a run in a folder of its own" if len(runs) == 1 else f"{len(runs)} runs"
            fail(f"{str(path)!r} holds {what}; pass the run's folder: {shown}"
                 + (", ..." if len(runs) > 3 else "") + (" (newest first)." if len(runs) > 1
                                                          else "."))
    if not p.exists():
        fail(f"no amp-doctor report at {str(p)!r}; pass a run directory written by "
             "`amp-doctor diagnose` (it holds amp_doctor.json) or a JSON report file.")
    try:
        return Session.load(p)
    except ReportFormatError as e:
        fix = "" if "amp-doctor" in str(e) else (
            " Pass a JSON report written by `amp-doctor diagnose` or watch(logdir=...).")
        fail(f"cannot read {str(p)!r}: {e}.{fix}")
    except OSError as e:
        fail(f"cannot read {str(p)!r} ({e.strerror or e}); check the path and permissions.")
