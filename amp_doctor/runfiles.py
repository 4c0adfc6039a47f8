"""A run folder: the names of its files, defined once for every writer and reader, the
check that it takes files, and the claim of one run on it while it writes there."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from amp_doctor.errors import UsageError

__all__ = ["JSON_NAME", "LOCK_NAME", "TEXT_NAME", "check_run_dir_free", "claim_run_dir",
           "make_writable_dir"]

# The machine-readable report: Session.to_json(), read back by `report`, `compare`, merges.
JSON_NAME = "amp_doctor.json"
# The text report, as printed at the end of a run.
TEXT_NAME = "report.txt"


def make_writable_dir(d: Path) -> None:
    """Create ``d`` if needed and write a probe file in it; raises the ``OSError`` that a
    report written there at the end of the run would meet (a file in its place, a
    read-only parent)."""
    d.mkdir(parents=True, exist_ok=True)
    probe = d / f".amp-doctor-write-test-{os.getpid()}"
    probe.write_text("")
    probe.unlink()


# Held in a run folder while a run writes there: two runs into one folder would mix
# their TensorBoard events and overwrite each other's reports without a word.
LOCK_NAME = ".amp-doctor.lock"
# A lock file this young with no holder written in it yet is a run starting, not a
# stale one (its holder writes the line right after creating the file).
_LOCK_BIRTH_S = 5.0
_CLAIMED: set[str] = set()  # run folders this process holds, resolved
# Of those, the ones claimed for a watch this process starts later, which takes the claim
# over (the CLI claims before the script runs; the watch starts at its `import torch`).
_HANDED: set[str] = set()


def _holder(lock: Path) -> tuple[int, str] | None:
    """(pid, host) written in ``lock``; None for none or garbled."""
    try:
        pid, host = lock.read_text().split()[:2]
        return int(pid), host
    except (OSError, ValueError):
        return None


def _busy(lock: Path) -> str | None:
    """Who holds the lock (for the error), or None if nobody does (no file, or a stale
    one: its process has ended)."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    holder = _holder(lock)
    if holder is None:
        return "a run starting now" if age < _LOCK_BIRTH_S else None
    pid, host = holder
    if host != socket.gethostname():
        return f"process {pid} on {host}"
    if pid == os.getpid():
        return None  # this process no longer holds it (its claim is in _CLAIMED if it does)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return f"process {pid}"


def _busy_error(d: Path, who: str, option: str) -> UsageError:
    return UsageError(
        f"another amp-doctor run ({who}) is writing into {str(d)!r}: their reports and "
        f"TensorBoard events would mix; pass another {option}, or wait for it to end "
        f"(if it has, remove {str(d / LOCK_NAME)!r}).")


def check_run_dir_free(d: Path, option: str = "--logdir") -> None:
    """Raise :class:`~amp_doctor.errors.UsageError` if a live run holds ``d`` (see
    :func:`claim_run_dir`); before a script runs, so that it fails before training."""
    if str(d.resolve()) in _CLAIMED:
        # A notebook's cell run again while the watch it started last time is open.
        raise UsageError(
            f"another watch in this process is writing into {str(d)!r}, and still open: "
            "close it first (doctor.close(), or `with amp_doctor.watch(...) as doctor:`), "
            f"or pass another {option}; their reports and TensorBoard events would mix.")
    who = _busy(d / LOCK_NAME)
    if who is not None:
        raise _busy_error(d, who, option)


def claim_run_dir(d: Path, option: str = "logdir", *,
                  for_a_watch: bool = False) -> Callable[[], None]:
    """Claim the existing folder ``d`` for this run until the returned function is
    called: a lock file naming this process, taken over if its process has ended (a
    run killed with ``kill -9``). Raises :class:`~amp_doctor.errors.UsageError` if a
    live run, in this process or another, holds it.

    ``for_a_watch``: the claim is for a watch this process starts later, whose own
    claim of ``d`` takes this one over (and its release frees it): no second run can
    slip in between. The release removes the file only in the process that claimed
    it: a forked child (a DataLoader worker) leaves the parent's claim alone.
    """
    key = str(d.resolve())
    lock = d / LOCK_NAME
    me = (os.getpid(), socket.gethostname())
    if key in _HANDED and not for_a_watch:
        _HANDED.discard(key)  # the watch it was claimed for
        return functools.partial(_release, key, lock, me)
    check_run_dir_free(d, option)
    if not _create_lock(lock, me):
        who = _busy(lock)
        raise _busy_error(d, who or "a run starting now", option)
    _CLAIMED.add(key)
    if for_a_watch:
        _HANDED.add(key)
    return functools.partial(_release, key, lock, me)


def _release(key: str, lock: Path, me: tuple[int, str]) -> None:
    if os.getpid() != me[0]:
        return
    _CLAIMED.discard(key)
    _HANDED.discard(key)
    if _holder(lock) == me:
        with contextlib.suppress(OSError):
            lock.unlink()


def _create_lock(lock: Path, me: tuple[int, str]) -> bool:
    """Create ``lock`` naming ``me``, taking a stale one over; False if a live run holds it
    (or wins the race for a stale one)."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _busy(lock) is not None:
                return False
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()  # stale: its process has ended
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{me[0]} {me[1]}\n")
        return True
    return False
