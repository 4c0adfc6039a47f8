"""A run folder: the names of its files, defined once for every writer and reader, the
check that it takes files, and the claim of one run on it while it writes there."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from amp_doctor.errors import UsageError

try:
    import fcntl
except ImportError:  # Windows: no flock(2); the named process's liveness decides
    fcntl = None  # type: ignore[assignment]

__all__ = ["JSON_NAME", "SUBDIR", "LOCK_NAME", "TEXT_NAME", "OWN_TEXT_NAME", "check_run_dir_free",
           "claim_run_dir", "make_writable_dir", "relocated_run_dir", "reused_run_note",
           "text_report_path"]

# The machine-readable report: Session.to_json(), read back by `report`, `compare`, merges.
JSON_NAME = "amp_doctor.json"
# The trainer callbacks write into this sub-folder of the framework's log directory, so
# that TensorBoard pointed at that directory shows amp-doctor as one run among the others.
SUBDIR = "amp_doctor"
# The text report, as printed at the end of a run.
TEXT_NAME = "report.txt"
# ... where the folder already holds a report.txt that is not amp-doctor's (a script
# writing its own results into the folder given as --logdir): that one is kept.
OWN_TEXT_NAME = "amp_doctor_report.txt"
# The first line of every text report amp-doctor writes.
_TEXT_HEAD = "amp-doctor "


def reused_run_note(d: Path) -> str | None:
    """The note for a run started in a folder that already holds one (its reports are
    replaced, and TensorBoard shows both runs' event files as one run), or None."""
    if (d / JSON_NAME).exists() or any(d.glob("events.out.tfevents.*")):
        return (f"amp-doctor: note: {d} already holds a run: its reports will be replaced "
                "and TensorBoard will show both runs' event files as one run. Give each run "
                "a folder of its own (the CLI does when --logdir is left out).")
    return None


def text_report_path(d: Path) -> Path:
    """Where the run's text report goes in ``d``: ``report.txt``, unless a file of that
    name is there that amp-doctor did not write; then :data:`OWN_TEXT_NAME`."""
    path = d / TEXT_NAME
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            head = f.read(len(_TEXT_HEAD))
    except IsADirectoryError:
        return d / OWN_TEXT_NAME  # a folder of that name is not ours to replace
    except (FileNotFoundError, NotADirectoryError):
        return path
    except OSError:
        return path  # unreadable: writing it says why
    return path if head == _TEXT_HEAD or not head else d / OWN_TEXT_NAME


def make_writable_dir(d: Path) -> None:
    """Create ``d`` if needed and write a probe file in it; raises the ``OSError`` that a
    report written there at the end of the run would meet (a file in its place, a
    read-only parent)."""
    d.mkdir(parents=True, exist_ok=True)
    probe = d / f".amp-doctor-write-test-{os.getpid()}"
    probe.write_text("")
    probe.unlink()
    if (d / JSON_NAME).is_dir():
        # The JSON report's own name taken by a folder: the run's end could not write it
        # (review 61b: found only after the script had run).
        raise IsADirectoryError(errno.EISDIR, f"{JSON_NAME} in it is a folder",
                                str(d / JSON_NAME))


def relocated_run_dir(d: Path) -> Path | None:
    """A new folder for the run's reports when ``d``, or a folder above it, is a file now
    (the script replaced it: a "clean old logs" step gone wrong), or None when ``d`` is a
    folder or was only deleted (then it is made again). The file's first free sibling
    ``<name>-amp-doctor``, ``<name>-amp-doctor-2``..., with the rest of ``d``'s path
    under it."""
    blocker = next((a for a in (d, *d.parents) if a.exists()), None)
    if blocker is None or blocker.is_dir():
        return None
    rest = d.relative_to(blocker)
    for i in range(1, 1000):
        new = blocker.with_name(f"{blocker.name}-amp-doctor" + (f"-{i}" if i > 1 else ""))
        if not new.exists():
            make_writable_dir(new / rest)
            return new / rest
    return None


# Held in a run folder while a run writes there: two runs into one folder would mix
# their TensorBoard events and overwrite each other's reports without a word. The file
# names the run (for the error) and, where the file system has locks, carries an
# exclusive flock(2) for as long as the run holds the folder: the kernel drops it when
# the process ends however it ends (kill -9, out of memory), so a lock file left behind
# is known to be stale even when its process id has been reused (a container restarted).
# Without locks (some network file systems), whether the named process is alive decides.
LOCK_NAME = ".amp-doctor.lock"
# A lock file this young with no holder written in it yet is a run starting, not a
# stale one (its holder writes the line right after creating the file).
_LOCK_BIRTH_S = 5.0
_CLAIMED: set[str] = set()  # run folders this process holds, resolved
# Of those, the ones claimed for a watch this process starts later, which takes the claim
# over (the CLI claims before the script runs; the watch starts at its `import torch`).
_HANDED: set[str] = set()
# The open, flock-ed lock file of each claim (none where the file system has no locks).
_FDS: dict[str, int] = {}


def _boot_id() -> str:
    """This kernel's boot id: processes that share it share their flock(2) locks, also
    from other containers (whose host names differ); "-" where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or "-"
    except OSError:
        return "-"


def _me() -> tuple[int, str, str]:
    return os.getpid(), socket.gethostname(), _boot_id()


def _holder(lock: Path) -> tuple[int, str, str] | None:
    """(pid, host, boot id) written in ``lock`` (boot id "-" if not written); None for
    none or garbled."""
    try:
        parts = lock.read_text().split()
        return int(parts[0]), parts[1], (parts[2] if len(parts) > 2 else "-")
    except (OSError, ValueError, IndexError):
        return None


def _try_flock(fd: int, exclusive: bool) -> bool | None:
    """Take flock(2) on ``fd`` without waiting: True taken, False another open file holds
    it, None this file system (or platform) has no such locks."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP, EINVAL: no locks here
        return None


def _flocked(lock: Path) -> bool | None:
    """Whether a live run holds ``lock``'s flock; None if that cannot be told (no locks
    on this file system, or the file cannot be opened)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        got = _try_flock(fd, exclusive=False)
    finally:
        os.close(fd)  # also drops the shared lock just taken
    return None if got is None else not got


def _describe(holder: tuple[int, str, str] | None) -> str:
    if holder is None:
        return "a run starting now"
    pid, host, _ = holder
    return f"process {pid}" if host == socket.gethostname() else f"process {pid} on {host}"


def _busy(lock: Path) -> str | None:
    """Who holds the lock (for the error), or None if nobody does (no file, or a stale
    one: its process has ended)."""
    locked = _flocked(lock)
    holder = _holder(lock)
    if locked:
        return _describe(holder)
    if locked is False and _flock_tells(holder):
        return None  # nobody holds its flock, and its run would: stale
    return _busy_by_pid(lock, holder)


def _flock_tells(holder: tuple[int, str, str] | None) -> bool:
    """Whether the flock on a lock file naming ``holder`` says if its run is alive: it was
    written by a run on this kernel (the same boot id: this machine, any container on
    it), which holds the flock while it runs. A lock written without a boot id (another
    platform, an older amp-doctor) or on another machine (a network file system need
    not share locks) is judged by its process id."""
    return holder is None or holder[2] != "-" and holder[2] == _boot_id()


def _busy_by_pid(lock: Path, holder: tuple[int, str, str] | None) -> str | None:
    """:func:`_busy` where locks cannot tell: by whether the named process is alive."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if holder is None:
        return "a run starting now" if age < _LOCK_BIRTH_S else None
    pid, host, _ = holder
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
    called: a lock file naming this process, held with flock(2) where the file system
    has locks, taken over if its run has ended (a run killed with ``kill -9``). Raises
    :class:`~amp_doctor.errors.UsageError` if a live run, in this process or another,
    holds it.

    ``for_a_watch``: the claim is for a watch this process starts later, whose own
    claim of ``d`` takes this one over (and its release frees it): no second run can
    slip in between. The release removes the file only in the process that claimed
    it: a forked child (a DataLoader worker) leaves the parent's claim alone.
    """
    key = str(d.resolve())
    lock = d / LOCK_NAME
    me = _me()
    if key in _HANDED and not for_a_watch:
        _HANDED.discard(key)  # the watch it was claimed for
        return functools.partial(_release, key, lock, me)
    check_run_dir_free(d, option)
    try:
        fd = _take_lock(lock, me)
    except OSError as e:
        # A full disk (creating the file needs no block, writing its line does) or a
        # quota: a lock naming no one would be left behind, and the run could not write
        # its report there either.
        if _holder(lock) is None:
            with contextlib.suppress(OSError):
                lock.unlink()
        raise UsageError(f"cannot write to {option} {str(d)!r} ({e.strerror or e}); free "
                         "some space there or pick another folder.") from None
    if fd is None:
        who = _busy(lock)
        raise _busy_error(d, who or "a run starting now", option)
    if fd >= 0:
        _FDS[key] = fd
    _CLAIMED.add(key)
    if for_a_watch:
        _HANDED.add(key)
    return functools.partial(_release, key, lock, me)


def _release(key: str, lock: Path, me: tuple[int, str, str]) -> None:
    if os.getpid() != me[0]:
        return
    _CLAIMED.discard(key)
    _HANDED.discard(key)
    if _holder(lock) == me:
        with contextlib.suppress(OSError):
            lock.unlink()
    fd = _FDS.pop(key, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)  # drops the flock


def _take_lock(lock: Path, me: tuple[int, str, str]) -> int | None:
    """Take ``lock`` for ``me``, a stale one over: its open file descriptor, holding the
    flock (-1 where the file system has no locks), or None if a live run holds it (or
    wins the race for it)."""
    for _ in range(3):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        got = _try_flock(fd, exclusive=True)
        if got is None:
            os.close(fd)
            return -1 if _create_by_pid(lock, me) else None
        if not got:
            os.close(fd)
            return None
        try:
            current = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if not current:  # released and removed since it was opened: try the new file
            os.close(fd)
            continue
        holder = _holder(lock)
        if not _flock_tells(holder) and _busy_by_pid(lock, holder) is not None:
            # A live run the flock cannot speak for (another machine's, on a file system
            # that does not share locks; an older amp-doctor's).
            os.close(fd)
            return None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{me[0]} {me[1]} {me[2]}\n".encode())
        except OSError:
            os.close(fd)
            raise
        return fd
    return None


def _create_by_pid(lock: Path, me: tuple[int, str, str]) -> bool:
    """Create ``lock`` naming ``me`` where there are no locks, taking a stale one over;
    False if a live run holds it (or wins the race for a stale one)."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _busy_by_pid(lock, _holder(lock)) is not None:
                return False
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()  # stale: its process has ended
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{me[0]} {me[1]} {me[2]}\n")
        return True
    return False
