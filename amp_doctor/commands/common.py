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

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "LAUNCHER_ENV", "SMOOTHING_HINT", "fail",
           "load_session", "severity_reached"]

EXIT_USAGE = 2
# What a shell shows for a process ended by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
# Set for the rank processes a `diagnose --nproc-per-node` launcher starts: it merges.
LAUNCHER_ENV = "AMP_DOCTOR_LAUNCHER"
# A short run has few points per chart: smoothing bends them, and with "Ignore
# outliers" TensorBoard may scale a two-point chart so that both points fall outside.
SMOOTHING_HINT = ("in TensorBoard's left panel, set Smoothing to 0 and untick 'Ignore outliers in "
                  "chart scaling' to see each step's true value")


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(f"amp-doctor: error: {message}", err=True)
    sys.exit(code)


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
