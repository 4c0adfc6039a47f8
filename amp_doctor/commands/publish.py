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
from amp_doctor.commands.common import DASHBOARD_FRAGMENT, SMOOTHING_HINT, severity_reached
from amp_doctor.commands.terminal import Console, usable
from amp_doctor.runfiles import JSON_NAME, TEXT_NAME, text_report_path

if TYPE_CHECKING:
    from amp_doctor.records import Session

__all__ = ["MAX_PRINTED_LINES", "MAX_SIBLINGS_READ", "print_user_exit", "publish", "render_report",
           "run_before", "view_hint",
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


def render_report(session: Session, here: Path | None = None) -> str:
    """The text report as its file holds it: the report, then what to run next (review
    52b: the `next:` commands were on the terminal only, gone once it scrolled). ``here``:
    the run's folder, for a command that names it."""
    from amp_doctor.sinks.text import render_text

    return render_text(session) + _next_section(session, here)


# Sibling runs read, newest first, to name the run a successful --fp32 try came from.
MAX_SIBLINGS_READ = 20


def run_before(here: Path, session: Session) -> Path | None:
    """The run a --fp32 try came from: the newest other run in the same parent folder
    (the CLI's runs/amp-doctor/) of the same command, without --fp32, that had errors.
    Read only for a --fp32 run, from at most :data:`MAX_SIBLINGS_READ` reports."""
    import json

    if not session.run.fp32_modules or not session.run.command:
        return None
    found: list[tuple[float, Path]] = []
    try:
        me = here.resolve()
        for p in here.parent.iterdir():
            with contextlib.suppress(OSError):
                if p.resolve() != me and (p / JSON_NAME).is_file():
                    found.append(((p / JSON_NAME).stat().st_mtime, p))
    except OSError:
        return None
    for _, p in sorted(found, reverse=True)[:MAX_SIBLINGS_READ]:
        try:
            d = json.loads((p / JSON_NAME).read_text())
        except (OSError, ValueError):
            continue
        run = d.get("run") if isinstance(d, dict) else None
        if (isinstance(run, dict) and run.get("command") == session.run.command
                and not run.get("fp32_modules")
                and str(run.get("started", "")) < session.run.started
                and any(isinstance(f, dict) and f.get("severity") == "error"
                        for f in d.get("findings") or [])):
            return p
    return None


def _next_section(session: Session, here: Path | None) -> str:
    before = run_before(here, session) if here is not None else None
    return next_section(session, None if here is None else str(here),
                        None if before is None else str(before))


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
    before = run_before(logdir, session)
    file_text = text + next_section(session, str(logdir), None if before is None else str(before))
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
    for line in next_steps(session, str(logdir), None if before is None else str(before)):
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
    # The by-hand way lands on the same tab as `view` (review 56d: TIME SERIES, smoothed).
    return (f"amp-doctor: view the dashboards: amp-doctor view {q}   (or: tensorboard "
            f"--logdir {parent}, where this run is {logdir.name!r}, and open "
            f"http://localhost:6006/{DASHBOARD_FRAGMENT}); {SMOOTHING_HINT}.")


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
