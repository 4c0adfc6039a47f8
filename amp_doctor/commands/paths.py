"""The run folder (a fresh one per run by default) and the checks, before the script
runs, that every output path can be written."""

from __future__ import annotations

import datetime as _dt
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import click

from amp_doctor.commands.common import fail
from amp_doctor.errors import tensorboard_path_error
from amp_doctor.runfiles import make_writable_dir

if TYPE_CHECKING:
    from amp_doctor import runner

__all__ = ["DEFAULT_RUNS_DIR", "check_output_file", "check_outputs_apart",
           "check_tensorboard_path", "check_writable",
           "default_logdir", "logdir_option", "output_file_option"]

DEFAULT_RUNS_DIR = Path("runs") / "amp-doctor"
# Parallel runs started in the same second (a sweep) get "-2", "-3", ... suffixes; a
# cap only so that a folder we cannot create by any name ends in an error, not a loop.
MAX_LOGDIR_SUFFIX = 1000


def default_logdir(target: runner.Target) -> Path:
    """A fresh folder per run under runs/amp-doctor/: <script>-<timestamp>[-N].

    Claimed with an exclusive mkdir, so parallel runs started in the same second (a
    sweep) never share one: a shared folder would keep one JSON and mix the event files.
    The ranks of one torchrun job must agree on the folder instead: they share it,
    named by the job's run id when torchrun gives one.
    """
    from amp_doctor.merge import rank_env

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
            fail(f"cannot create the default logdir {str(d)!r} ({e.strerror or e}); "
                 "pass a writable directory with --logdir DIR.")
        return d
    fail(f"no free folder name for {stem}-{stamp} in {str(DEFAULT_RUNS_DIR)!r}; "
         "pass --logdir DIR.")


def logdir_option(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """``--logdir``'s value as a path: an empty one (an unset shell variable,
    ``--logdir "$OUT"``) would be the working directory, and fails instead."""
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("is empty; pass a directory, e.g. --logdir runs/exp1 "
                                 "(an unset shell variable?).")
    return Path(value)


def check_writable(d: Path, option: str = "--logdir") -> None:
    if option == "--logdir" and d.is_file():
        fail(f"--logdir {str(d)!r} is a file, not a directory; pass a directory, e.g. "
             f"--logdir {shlex.quote(str(d) + '_runs')}.")
    what = "logdir" if option == "--logdir" else f"the folder of {option}"
    # A file where a folder of the path should be: mkdir says "File exists" of it.
    blocker = next((a for a in (d, *d.parents) if a.exists()), None)
    if blocker is not None and not blocker.is_dir():
        fail(f"cannot write to {what} {str(d)!r}: {str(blocker)!r} is a file, not a "
             f"directory; pass another path with {option}.")
    try:
        make_writable_dir(d)
    except OSError as e:
        fail(f"cannot write to {what} {str(d)!r} ({e.strerror or e}); "
             f"pass a writable {'directory' if option == '--logdir' else 'path'} "
             f"with {option}.")


def check_tensorboard_path(d: Path) -> None:
    """Fail before the script runs if TensorBoard cannot write under ``d``: it encodes
    paths as UTF-8, and a C locale decodes a non-ASCII path to surrogates."""
    try:
        str(d).encode("utf-8")
    except UnicodeEncodeError as e:
        fail(str(tensorboard_path_error(d, e)))


def output_file_option(ctx: click.Context, param: click.Parameter,
                       value: str | None) -> Path | None:
    """``--json``/``--report``'s value as a path: an empty one (an unset shell variable)
    would name the working directory, and ``-`` a file named "-"."""
    if value is None:
        return None
    name = param.opts[0] if param.opts else "the option"
    example = "amp_doctor.json" if "json" in name else "report.txt"
    if not value.strip():
        raise click.BadParameter(f"is empty; pass a file path, e.g. {name} {example} "
                                 "(an unset shell variable?).")
    if value == "-":
        raise click.BadParameter(f"'-' would be a file named '-'; to print it, pass "
                                 f"{name} /dev/stdout.")
    return Path(value)


def check_outputs_apart(outputs: list[tuple[str, Path, str]], script: str | None) -> None:
    """Fail before the script runs if a report would overwrite the script itself, another
    Python source, or the other report: ``outputs`` are ``(option, path, example name)``.
    Streams and devices (``/dev/stdout`` for both) are written into, not replaced."""
    seen: dict[str, str] = {}
    own = os.path.realpath(script) if script else None
    for option, p, example in outputs:
        if (p.exists() and not p.is_file()) or p.parts[1:2] in (("dev",), ("proc",)):
            continue  # (/dev/stdout is a file when the shell redirected it to one)
        real = os.path.realpath(p)
        hint = f"pass another path, e.g. {option} {shlex.quote(str(p.parent / example))}"
        if real in seen:
            fail(f"{seen[real]} and {option} name the same file {str(p)!r}, which would hold "
                 f"only the last report written; {hint}.")
        seen[real] = option
        if real == own or (p.suffix == ".py" and p.exists()):
            what = "the script being run" if real == own else "a Python source file"
            fail(f"{option} {str(p)!r} is {what}: the report would overwrite it; {hint}.")


def check_output_file(p: Path, option: str, example: str) -> None:
    """Fail before the script runs if the report cannot be written to ``p``."""
    if p.is_dir():
        fail(f"{option} {str(p)!r} is a directory; pass a file path, "
             f"e.g. {option} {shlex.quote(str(p / example))}.")
    if p.exists() and not p.is_file():
        # /dev/stdout, a FIFO: written straight into, so it must be writable itself.
        if not os.access(p, os.W_OK):
            fail(f"cannot write to {option} {str(p)!r}; pass a writable path with {option}.")
        return
    # A symlink is written through (write_text_atomic): its target's folder must be writable.
    check_writable(Path(os.path.realpath(p)).parent, option)


