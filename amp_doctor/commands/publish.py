"""The end of every run: write the report files, then print; the ``--fail-on`` gate.

Files first: whatever happens to the terminal or the process while printing, the report
is on disk. Each file is written atomically.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amp_doctor.analysis.next_steps import next_section, next_steps
from amp_doctor.commands.common import SMOOTHING_HINT, severity_reached
from amp_doctor.commands.terminal import Console, usable
from amp_doctor.runfiles import JSON_NAME, TEXT_NAME, text_report_path

if TYPE_CHECKING:
    from amp_doctor.records import Session

__all__ = ["MAX_PRINTED_LINES", "print_user_exit", "publish", "render_report", "view_hint",
           "write_or_warn"]

# A report longer than this many lines is written to a file and only its
# path and the findings' headlines are printed.
MAX_PRINTED_LINES = 60


def print_user_exit(exc: BaseException | None, console: Console) -> None:
    """The user's own traceback, exactly as python would print it, where python would."""
    from amp_doctor import runner

    stream: Any = sys.stderr if usable(sys.stderr) else console.stream
    try:
        runner.report_exit(exc, stream)
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            runner.report_exit(exc, console.stream)


def write_or_warn(write: Any, path: Path, console: Console) -> bool:
    try:
        write()
    except OSError as e:
        console.echo(f"amp-doctor: error: could not write {path} ({e.strerror or e}); "
                     "check free space and permissions.")
        return False
    return True


def render_report(session: Session, here: str | None = None) -> str:
    """The text report as its file holds it: the report, then what to run next (review
    52b: the `next:` commands were on the terminal only, gone once it scrolled). ``here``:
    the run's folder, for a command that names it."""
    from amp_doctor.sinks.text import render_text

    return render_text(session) + next_section(session, here)


def publish(session: Session, logdir: Path, json_out: Path | None, report_out: Path | None,
            fail_on: str, tensorboard: bool, code: int, console: Console | None = None,
            exc: BaseException | None = None) -> int:
    """Write the report files, then print; the exit code, raised to 1 by --fail-on.

    Files first: whatever happens to the terminal or the process while printing, the
    report is on disk. Each file is written atomically.
    """
    if console is None:
        console = Console()
        try:
            return publish(session, logdir, json_out, report_out, fail_on, tensorboard, code,
                           console, exc)
        finally:
            console.close()
    from amp_doctor.sinks.jsonfile import write_json, write_text_atomic
    from amp_doctor.sinks.text import render_text

    text = render_text(session)  # the terminal's: its `next:` lines come last, below
    text_file = text_report_path(logdir)
    if text_file.name != TEXT_NAME:
        console.echo(f"amp-doctor: {logdir / TEXT_NAME} is not amp-doctor's (the script's "
                     f"own?): it is kept, and the report goes to {text_file.name} beside it.")
    file_text = text + next_section(session, str(logdir))
    write_or_warn(lambda: write_text_atomic(text_file, file_text), text_file, console)
    if report_out is not None:
        write_or_warn(lambda: write_text_atomic(report_out, file_text), report_out, console)
    if json_out is not None:
        write_or_warn(lambda: write_json(session, json_out), json_out, console)
    print_user_exit(exc, console)
    _print_report(text, text_file, console)
    if (logdir / JSON_NAME).is_file():  # not when the disk was full, say
        console.echo(f"amp-doctor: JSON report: {logdir / JSON_NAME}")
    if tensorboard and _has_events(logdir):  # not when TensorBoard could not start
        console.echo(view_hint(logdir))
    for line in next_steps(session, str(logdir)):
        console.echo(line)
    if code == 0 and severity_reached(session, fail_on):
        console.echo(f"amp-doctor: exit 1: findings at or above '{fail_on}' (--fail-on).")
        return 1
    return code


def _has_events(logdir: Path) -> bool:
    """TensorBoard event files with something in them, in ``logdir`` or a rank folder."""
    files = [*logdir.glob("events.out.tfevents.*"), *logdir.glob("*/events.out.tfevents.*")]
    return any(f.stat().st_size > 0 for f in files if f.is_file())


def view_hint(logdir: Path) -> str:
    q = shlex.quote(str(logdir))
    parent = shlex.quote(str(logdir.parent))
    return (f"amp-doctor: view the dashboards: amp-doctor view {q}   (or: tensorboard "
            f"--logdir {parent}, where this run is {logdir.name!r}); {SMOOTHING_HINT}.")


def _print_report(text: str, path: Path, console: Console) -> None:
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
