"""Run an unmodified user script or module as ``__main__``, the way ``python`` would.

``amp-doctor diagnose train.py --lr 3e-4`` has to behave like ``python train.py --lr 3e-4``
while amp_doctor watches from inside the same process. This module does the two halves
of that separately so the CLI can fail fast on a typo before anything is instrumented:

* :func:`resolve` (from :mod:`amp_doctor.targets`, re-exported here) finds and
  compiles the target and raises :class:`ScriptNotFound` /
  :class:`ModuleNotFound` (or the user's ``SyntaxError``) without running user code,
  except that ``-m pkg.mod`` imports ``pkg`` exactly as ``python -m`` does.
* :func:`run` executes it in a fresh ``__main__`` module and lets every exception,
  ``SystemExit`` and ``KeyboardInterrupt`` included, reach the caller untouched.

:func:`user_traceback`, :func:`exit_code` and :func:`report_exit` then let the caller
print and exit the way the interpreter would have.

Modelled on CPython's ``runpy`` and coverage.py's ``execfile``; the details below were
checked against CPython 3.11's own behaviour (``Modules/main.c``, ``Python/pythonrun.c``).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib._bootstrap
import importlib._bootstrap_external
import os
import runpy
import sys
import traceback
from types import CodeType, ModuleType, TracebackType
from typing import Any, TextIO

from amp_doctor.errors import Terminated
from amp_doctor.targets import (
    ModuleNotFound,
    ResolvedTarget,
    ScriptNotFound,
    Target,
    install_path0,
    resolve,
)

__all__ = [
    "ScriptState",
    "ModuleNotFound",
    "ResolvedTarget",
    "ScriptNotFound",
    "Target",
    "exit_code",
    "report_exit",
    "resolve",
    "run",
    "system_exit_message",
    "user_traceback",
]

# Exit status a shell reports for a process killed by SIGINT; python itself dies by the
# signal after an uncaught KeyboardInterrupt, which a shell shows as 128 + 2.
_SIGINT_EXIT = 130

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# The import system and runpy are plumbing the user never wrote; CPython hides the
# importlib frames itself, and ``python -m`` would show runpy's, which only add noise.
_PLUMBING_FILES = frozenset(
    {
        "<frozen runpy>",
        "<frozen importlib._bootstrap>",
        "<frozen importlib._bootstrap_external>",
        *(
            os.path.abspath(path)
            for path in (
                getattr(runpy, "__file__", None),
                getattr(importlib._bootstrap, "__file__", None),
                getattr(importlib._bootstrap_external, "__file__", None),
            )
            if path
        ),
    }
)


def run(resolved: ResolvedTarget) -> None:
    """Execute ``resolved`` as ``__main__`` in this process, as python would.

    The code runs in a fresh ``__main__`` module (also registered as ``__mp_main__``)
    with ``sys.argv`` and ``sys.path[0]`` set as python sets them. Exceptions from the
    user's code, ``SystemExit`` and ``KeyboardInterrupt`` included, propagate unchanged.
    ``sys.argv``, ``sys.path`` and ``sys.modules['__main__'|'__mp_main__']`` are restored
    afterwards whatever happens; the working directory and stdin are never touched, so a
    script that calls ``os.chdir`` leaves the process there (make output paths absolute
    before calling this). May be called again with the same ``resolved``.

    The script's globals outlive the call, as under python, where ``__main__`` lives until
    the interpreter exits: they are released at exit, or when the next :func:`run` starts.
    """
    state = ScriptState(resolved)
    state.enter()
    try:
        state.exec()
    finally:
        state.leave()


class ScriptState:
    """What python sets up for a script: a fresh ``__main__`` module (also registered as
    ``__mp_main__``: pickle finds the script's classes through it, and a multiprocessing
    spawn child re-runs the script under that name), ``sys.argv`` and ``sys.path[0]``.

    :func:`run` puts it in place for the script's code only. The CLI keeps it in place
    past that, as python does until the process exits: the script's non-daemon threads
    are waited for while it holds (an async checkpoint thread pickling the script's
    classes), it is taken back while amp-doctor writes its report (a script's folder on
    ``sys.path`` must not shadow what amp-doctor imports then), and put back before the
    process ends, for the script's ``atexit`` handlers.
    """

    def __init__(self, resolved: ResolvedTarget) -> None:
        self.resolved = resolved
        self.main = ModuleType("__main__")
        self.main.__dict__.update(
            __file__=resolved.file,
            __cached__=resolved.cached,
            __loader__=resolved.loader,
            __spec__=resolved.spec,
            __package__=resolved.package,
            # Python gives __main__ the builtins *module* (imported modules get its dict)
            # and an empty __annotations__; scripts that introspect either expect that.
            __builtins__=builtins,
            __annotations__={},
        )
        self._saved: tuple[Any, ...] | None = None
        self._script_argv: list[str] = list(resolved.argv)
        self._script_path: list[str] | None = None  # sys.path as the script left it

    def enter(self) -> None:
        """Put the script's state in place (again: as the script last left it)."""
        if self._saved is not None:
            return
        self._saved = (sys.argv, sys.path, list(sys.path), sys.modules.get("__main__"),
                       sys.modules.get("__mp_main__"))
        sys.argv = self._script_argv
        if self._script_path is not None:
            sys.path[:] = self._script_path
        elif self.resolved.path0 is not None:
            install_path0(self.resolved.path0)
        sys.modules["__main__"] = self.main
        sys.modules["__mp_main__"] = self.main
        # Taking the previous run's globals over releases them, before this run allocates.
        _last_main[:] = [self.main]

    def exec(self) -> None:
        """Run the script's code in its ``__main__`` (the state must be in place)."""
        _exec_main(self.resolved.code, self.main.__dict__)

    def leave(self) -> None:
        """Take the script's state back: what was there before :meth:`enter`."""
        if self._saved is None:
            return
        saved_argv, saved_path, saved_entries, saved_main, saved_mp_main = self._saved
        self._saved = None
        self._script_argv = sys.argv
        self._script_path = list(sys.path)
        sys.argv = saved_argv
        # Restore the whole list in place: a script that inserted its own directories
        # must not leave them able to shadow what amp_doctor imports after the run, and
        # other code may hold a reference to the original list object.
        saved_path[:] = saved_entries
        sys.path = saved_path
        _restore_module("__main__", saved_main)
        _restore_module("__mp_main__", saved_mp_main)


def user_traceback(exc: BaseException) -> str:
    """Format ``exc`` as python would print it, showing only the user's frames.

    Frames before the user's code (the CLI, :func:`run`), frames inside the amp_doctor
    package and runpy/importlib plumbing are dropped; chained exceptions and exception
    groups keep their usual layout. A ``SyntaxError`` from :func:`resolve` gets python's
    caret display with no "Traceback" header, exactly as ``python bad.py`` prints it.
    With ``AMP_DOCTOR_DEBUG`` set, every frame is kept: that traceback is the one an
    internal error asks to be reported with (review 60a: it showed no amp_doctor frame).
    """
    if os.environ.get("AMP_DOCTOR_DEBUG"):
        return "".join(traceback.format_exception(exc))
    summary = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    pending: list[tuple[traceback.TracebackException, BaseException]] = [(summary, exc)]
    while pending:
        current, error = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.stack = _user_frames(current.stack, error.__traceback__)
        # TracebackException mirrors the exception graph (it only leaves out repeats), so
        # walking both side by side pairs every summary with the exception it came from.
        if current.__cause__ is not None and error.__cause__ is not None:
            pending.append((current.__cause__, error.__cause__))
        if current.__context__ is not None and error.__context__ is not None:
            pending.append((current.__context__, error.__context__))
        # Exception groups (3.11+) hold their members in .exceptions on both sides.
        members = getattr(current, "exceptions", None)
        if members and getattr(error, "exceptions", None):
            pending.extend(zip(members, error.exceptions, strict=False))  # type: ignore[attr-defined]
    return "".join(summary.format())


def exit_code(exc: BaseException | None) -> int:
    """The exit status python would give for a run that ended with ``exc`` (None: success).

    ``SystemExit(None)`` -> 0, ``SystemExit(n)`` -> the status the process gets (n's low
    8 bits: ``sys.exit(300)`` ends with 44, ``sys.exit(-1)`` with 255, ``sys.exit(True)``
    with 1), any other ``SystemExit`` payload -> 1 (python also prints it: see
    :func:`system_exit_message`), ``KeyboardInterrupt`` -> 130,
    :class:`~amp_doctor.errors.Terminated` -> 128 + its signal (what a shell shows for a
    process the signal killed), anything else -> 1. The report records this status, and
    ``--fail-on`` judges it: ``sys.exit(256)`` is a success, as the shell sees it.
    """
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):  # bool too: sys.exit(True) exits 1
            code = int(exc.code)
            # CPython reads the code as a C long (-1 when it does not fit), and the
            # system keeps its low 8 bits.
            return (code if -(2**63) <= code < 2**63 else -1) & 0xFF
        return 1
    if isinstance(exc, KeyboardInterrupt):
        return _SIGINT_EXIT
    if isinstance(exc, Terminated):
        return 128 + exc.signum
    return 1


def system_exit_message(exc: BaseException | None) -> str | None:
    """The line python prints to stderr for ``sys.exit(payload)``, or None if it prints none.

    Python prints ``str(payload)`` only when the payload is neither None nor an int,
    e.g. ``sys.exit("bad config")``.
    """
    if not isinstance(exc, SystemExit):
        return None
    if exc.code is None or isinstance(exc.code, int):
        return None
    try:
        return str(exc.code)
    except Exception:
        return ""  # python prints an empty line when the payload's str() fails


def report_exit(exc: BaseException | None, file: TextIO | None = None) -> int:
    """Print what python prints when a script ends with ``exc``; return its exit code.

    Nothing for success or ``sys.exit(int)``, the payload for ``sys.exit("msg")``, the
    :func:`user_traceback` otherwise (``KeyboardInterrupt`` included). Writes to
    ``file``, default ``sys.stderr``. Typical CLI use::

        try:
            runner.run(resolved)
        except BaseException as exc:
            sys.exit(runner.report_exit(exc))
    """
    stream = sys.stderr if file is None else file
    # The user's buffered stdout would otherwise appear after the traceback when both
    # streams share a terminal or a log file, unlike under plain python.
    try:
        sys.stdout.flush()
    except (AttributeError, OSError, ValueError):
        pass
    if isinstance(exc, SystemExit):
        message = system_exit_message(exc)
        if message is not None:
            stream.write(message + "\n")
    elif isinstance(exc, Terminated):
        pass  # python, killed by the signal, prints nothing; amp-doctor says it once
    elif exc is not None and stream is sys.stderr and sys.excepthook is not sys.__excepthook__:
        # The script installed its own hook (a crash logger, Sentry, rich): python would
        # call it, with the user's frames.
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
        try:
            sys.excepthook(type(exc), exc, _script_tb(exc.__traceback__))
        except Exception:
            stream.write(user_traceback(exc))
    elif exc is not None:
        stream.write(user_traceback(exc))
    # The script's own stderr replacement may have no flush (a hand-written tee).
    with contextlib.suppress(AttributeError, OSError, ValueError):
        stream.flush()
    return exit_code(exc)


def _script_tb(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from the script's first frame on (below :func:`_exec_main`), as python's
    own traceback of an uncaught exception starts there; all of it if not found."""
    here = tb
    while here is not None and here.tb_frame.f_code is not _exec_main.__code__:
        here = here.tb_next
    return here.tb_next if here is not None and here.tb_next is not None else tb


# The module of the last script run, kept alive until the interpreter exits, as python
# keeps ``__main__``. Releasing it as soon as the script returns would run the C++
# destructors of the script's objects on the spot, holding the GIL, which deadlocks a
# DDP run: ``~Reducer`` -> ``~ProcessGroupGloo`` joins a gloo worker thread that is still
# freeing its last allreduce, whose captured thread-local state (torch's backward stashes
# a ``contextvars.Context`` there) needs the GIL to be freed. Under load that worker lags
# behind the script's end, and the rank hung before writing its report. At interpreter
# exit the workers have long been idle, as in a plain ``python train.py``.
_last_main: list[ModuleType] = []


# ------------------------------------------------------------------------ running


def _exec_main(code: CodeType, namespace: dict[str, Any]) -> None:
    # user_traceback() treats this function's frame as the boundary between amp_doctor's
    # frames and the user's, so the user's code must be entered here and only here.
    exec(code, namespace)


def _restore_module(name: str, module: ModuleType | None) -> None:
    if module is None:
        sys.modules.pop(name, None)
    else:
        sys.modules[name] = module


# ---------------------------------------------------------------------- tracebacks


def _user_frames(stack: traceback.StackSummary, tb: TracebackType | None) -> traceback.StackSummary:
    frames = [frame for frame, _ in traceback.walk_tb(tb)]
    start = 0
    for index, frame in enumerate(frames):
        if frame.f_code is _exec_main.__code__:
            start = index + 1
    if start == 0:
        # The exception never passed through run(): either it was raised inside the
        # user's code and caught there (a __context__), which keeps its frames, or it
        # came from amp_doctor itself, e.g. compiling in resolve(), which has no user
        # frames at all (python shows none for a script's SyntaxError either).
        origin = next(
            (f for f in reversed(frames) if f.f_code.co_filename not in _PLUMBING_FILES), None
        )
        if origin is not None and _is_own_file(origin.f_code.co_filename):
            return traceback.StackSummary.from_list([])
    hidden = [index < start or _is_hidden(summary.filename)
              for index, summary in enumerate(stack)]
    # torch's dispatch plumbing that only runs because amp-doctor's code is there (its
    # dispatch mode: torch/_compile.py, eval_frame.py, then _ops.py after it): python
    # without amp-doctor shows none of it. The same files away from amp-doctor's frames
    # (the user's own dispatch mode, torch.compile) stay.
    for index, summary in enumerate(stack):
        if index >= start and _is_own_file(summary.filename):
            for step in (-1, 1):
                j = index + step
                while 0 <= j < len(stack) and (
                        _is_dispatch_plumbing(stack[j].filename) or (
                            hidden[j] and _is_own_file(stack[j].filename))):
                    hidden[j] = True
                    j += step
    kept = [summary for summary, hide in zip(stack, hidden, strict=True) if not hide]
    return traceback.StackSummary.from_list(kept)


# torch's files between a call and a TorchDispatchMode's handler, and after it.
_DISPATCH_PLUMBING = tuple(os.path.join("torch", *p.split("/")) for p in (
    "_compile.py", "_dynamo/eval_frame.py", "_ops.py", "utils/_python_dispatch.py",
    "overrides.py"))


def _is_dispatch_plumbing(filename: str) -> bool:
    return os.path.normcase(filename).endswith(
        tuple(os.path.normcase(os.sep + p) for p in _DISPATCH_PLUMBING))


def _is_hidden(filename: str) -> bool:
    return filename in _PLUMBING_FILES or _is_own_file(filename)


def _is_own_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = os.path.normcase(os.path.abspath(filename))
    return path.startswith(os.path.normcase(_PACKAGE_DIR) + os.sep)
