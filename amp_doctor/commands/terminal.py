"""amp-doctor's own handle on the terminal, the live status line, the Ctrl-C shield.

The user's script owns sys.stdout/sys.stderr while it runs and may redirect or
close them; the report must still reach the terminal, and a second Ctrl-C must not
abort the writing of the report.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from amp_doctor.errors import Terminated
from amp_doctor.hooks import interrupts

if TYPE_CHECKING:
    from amp_doctor.records import StepRecord
    from amp_doctor.steps.listeners import StepRows

__all__ = ["Console", "GuardedStream", "Progress", "SigtermUnwinds", "die_by_signal",
           "give_back_sigterm", "hold_sigint", "restore_std_streams", "sigint_shield",
           "sigterm_unwinds", "take_sigterm", "usable"]

# Redraw the live status line at most this often.
STATUS_INTERVAL_S = 0.5
_CLEAR_LINE = "\r\x1b[2K"


class Console:
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


def usable(stream: Any) -> bool:
    return stream is not None and not getattr(stream, "closed", False)


def restore_std_streams(console: Console) -> None:
    """Give the process working std streams again if the script closed its own.

    Python keeps whatever ``sys.stdout``/``sys.stderr`` the script left, and so do we,
    unless it is closed: then warnings or anything else printed while the report is
    built would raise ``ValueError: I/O operation on closed file``.
    """
    if not usable(sys.stderr):
        if usable(sys.__stderr__):
            sys.stderr = sys.__stderr__
        elif console.stream is not None:
            sys.stderr = console.stream
            console._owned = False  # now the process's; Python closes it at exit
    if not usable(sys.stdout) and usable(sys.__stdout__):
        sys.stdout = sys.__stdout__


class Progress:
    """A live status line on the terminal for long runs (TTY only), drawn like tqdm's.

    The line is written with carriage return + clear-to-end-of-line and no newline. So
    that the script's own output never lands glued onto it, ``sys.stdout`` and
    ``sys.stderr`` (when they are terminals) are wrapped while the script runs: each
    write first clears the status line; it is redrawn on a later step.
    """

    def __init__(self, enabled: bool, console: Console) -> None:
        self.enabled = enabled
        self.console = console
        self._last = 0.0
        self.shown = False
        self._user_mid_line = False
        self._wrapped: list[tuple[str, Any, GuardedStream]] = []
        self._input: Any = None  # builtins.input while it is guarded

    def __call__(self, rec: StepRecord, hs: StepRows) -> None:
        del hs
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < STATUS_INTERVAL_S or self._user_mid_line:
            return  # never wipe half a line the script has printed
        self._last = now
        scale = f"{rec.scale:g}" if rec.scale is not None else "-"
        loss = f"{rec.loss:.4g}" if rec.loss is not None else "-"
        from amp_doctor.steps.table import ACT, StepTable  # loaded with the watch anyway

        bad = int(StepTable.from_layers(rec.layers).flagged((ACT,)).sum())
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
                guard = GuardedStream(stream, self)
                setattr(sys, name, guard)
                self._wrapped.append((name, stream, guard))
        if self._wrapped and self._input is None:
            # input() on a terminal writes its prompt through readline, straight to the
            # file descriptor: the status line is cleared before it, or the prompt would
            # be glued onto it.
            self._input = builtins.input
            builtins.input = self._guarded_input

    def _guarded_input(self, prompt: object = "") -> str:
        self.before_user_write("")
        assert self._input is not None
        return self._input(prompt)

    def unwrap_std_streams(self) -> None:
        for name, original, guard in self._wrapped:
            if getattr(sys, name) is guard:  # the script may have replaced it: keep theirs
                setattr(sys, name, original)
        self._wrapped = []
        if self._input is not None:
            if builtins.input == self._guarded_input:
                builtins.input = self._input
            self._input = None

    def clear(self) -> None:
        if self.shown:
            self.shown = False
            self.console.write(_CLEAR_LINE)


class GuardedStream:
    """A script's terminal stream that clears amp-doctor's status line before each write.

    Everything but ``write``/``writelines`` is the wrapped stream's own (``buffer``,
    ``fileno``, ``isatty``, ``encoding``...), the protocols too: ``with sys.stdout:``
    (the "a file or stdout" idiom) closes the real stream as under python, and
    ``isinstance(sys.stdout, io.TextIOWrapper)`` (the guard before ``reconfigure``) holds,
    through ``__class__``, which ``isinstance`` consults.
    """

    def __init__(self, inner: Any, progress: Progress) -> None:
        self._inner = inner
        self._progress = progress

    def write(self, text: str) -> int:
        # Anything but a str (bytes written by mistake) is the stream's to refuse, with
        # python's own message.
        self._progress.before_user_write(text if isinstance(text, str) else "")
        n: int = self._inner.write(text)
        return n

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: F811
        return type(self._inner)

    def __enter__(self) -> Any:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._inner.__exit__(*exc)

    def __iter__(self) -> Any:
        return iter(self._inner)

    def __next__(self) -> Any:
        return next(self._inner)


@contextlib.contextmanager
def sigint_shield(console: Console, interrupted: bool = False) -> Iterator[None]:
    """While the report is written, a further Ctrl-C does not abort the writing.

    A second Ctrl-C used to land in the middle of ``close()`` and lose everything
    ("Aborted!", exit 1). The run is over by then; the writing takes a moment. The
    previous handler is restored afterwards, unless the run was ``interrupted`` (Ctrl-C
    ended it): then Ctrl-C stays ignored on the way out, which ends by SIGINT anyway,
    so that a press landing there is not click's "Aborted!". Only the main thread may
    set handlers. A SIGTERM (a scheduler sends it again before its SIGKILL) is ignored
    meanwhile too.
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
    previous_term: Any = None
    installed = False
    if threading.current_thread() is threading.main_thread():
        try:
            previous = signal.signal(signal.SIGINT, ignore)
            installed = True
            previous_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        if installed:
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signal.SIGINT, signal.SIG_IGN if interrupted else
                              previous if previous is not None
                              else signal.default_int_handler)
            if previous_term is not None:
                with contextlib.suppress(ValueError, OSError, TypeError):
                    signal.signal(signal.SIGTERM, previous_term)


def take_sigterm(handler: Any) -> bool:
    """Make ``handler`` SIGTERM's, if SIGTERM has its default action and this is the main
    thread (only it may set handlers): a handler the environment installed is left alone.
    Whether it was taken."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with contextlib.suppress(ValueError, OSError, TypeError):
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, handler)
            return True
    return False


def give_back_sigterm(handler: Any) -> None:
    """Undo :func:`take_sigterm`, unless the script has made another handler SIGTERM's
    meanwhile (it is kept)."""
    if signal.getsignal(signal.SIGTERM) == handler:
        with contextlib.suppress(ValueError, OSError, TypeError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class SigtermUnwinds:
    """See :func:`sigterm_unwinds`."""

    def __init__(self) -> None:
        self.received: int | None = None  # the signal, once it came (if it ever does)
        self._pid = os.getpid()
        self._armed = False
        # Writes the report and ends the process by the signal (does not return): for a
        # script that swallowed the exception and trains on (see hooks.interrupts).
        self.end_run: Callable[[int], None] | None = None

    def arm(self) -> None:
        """From now on, SIGTERM raises :class:`~amp_doctor.errors.Terminated` in the main
        thread. Called once the watch has started: before, python's own death by the
        signal is what the user would get (there is nothing to report yet, and an
        exception inside ``import torch`` would leave torch half-imported)."""
        if not self._armed:
            self._armed = take_sigterm(self._unwind)

    def disarm(self) -> None:
        if self._armed:
            give_back_sigterm(self._unwind)
        self._armed = False
        interrupts.end_when_training_resumes(None)

    def _unwind(self, signum: int, frame: Any) -> None:
        del frame
        if os.getpid() != self._pid:
            # A forked child (a multiprocessing worker, which Pool ends with SIGTERM):
            # the default action, as under python.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        first = self.received is None
        self.received = signum
        if first:  # a second one while the script unwinds changes nothing
            _quiet_other_threads()
            end = self.end_run
            if end is not None:
                # If a bare except swallows it and the loop trains on, the run ends there.
                interrupts.end_when_training_resumes(lambda: end(signum))
            raise Terminated(signum)


def _quiet_other_threads() -> None:
    """The process ends by SIGTERM once the report is written: as under python, whose
    SIGTERM ends every thread at once, the script's other threads die without a word
    meanwhile. A DataLoader's resource-sharer thread, whose workers the same signal to
    the job ended, printed a traceback there (through ``sys.excepthook``). The main
    thread's errors are reported as before."""
    main = threading.main_thread()
    sys_hook, thread_hook = sys.excepthook, threading.excepthook

    def quiet_sys(tp: Any, value: Any, tb: Any) -> None:
        if threading.current_thread() is main:
            sys_hook(tp, value, tb)

    def quiet_thread(args: Any) -> None:
        if args.thread is main:
            thread_hook(args)

    sys.excepthook = quiet_sys
    threading.excepthook = quiet_thread


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[SigtermUnwinds]:
    """While the block runs, once armed (:meth:`SigtermUnwinds.arm`), SIGTERM raises
    :class:`~amp_doctor.errors.Terminated` in the main thread instead of killing the
    process at once: the run unwinds and the report holds what ran, as for Ctrl-C (a
    scheduler's time limit is a SIGTERM); ``received`` says it came, even if the
    script swallowed the exception. Then :func:`die_by_signal` ends the process as the
    signal would have.

    Only where SIGTERM has its default action: a handler the environment installed is
    left alone, and one the script installs replaces this one (and is kept).
    """
    term = SigtermUnwinds()
    try:
        yield term
    finally:
        term.disarm()


@contextlib.contextmanager
def hold_sigint() -> Iterator[list[int]]:
    """While the block runs, a Ctrl-C is held instead of raised inside it; the yielded list
    says whether one came. For work that must not be cut in half (the watch starting
    inside the script's ``import torch``): the caller delivers it afterwards with
    ``signal.raise_signal``, which runs the script's own handler at once, as the Ctrl-C
    would have. Only the main thread can hold it, and only a handler set from Python is
    swapped (one set from C is left alone)."""
    came: list[int] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is None):
        yield came
        return

    def hold(signum: int, frame: Any) -> None:
        del frame
        came.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, previous)


def die_by_signal(signum: int) -> NoReturn:
    """End the process by ``signum``'s default action, as python would have ended on it
    (a scheduler sees the signal; a shell shows 128 + ``signum``), once the report is
    written: the script's other threads stop with it, as they would have. A further
    ``signum`` meanwhile is ignored: it would cut the flush short with an exception."""
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signum, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()  # type: ignore[union-attr]
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(128 + signum)
