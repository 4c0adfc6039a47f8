"""Run an unmodified user script or module as ``__main__``, the way ``python`` would.

``amp-doctor diagnose train.py --lr 3e-4`` has to behave like ``python train.py --lr 3e-4``
while amp_doctor watches from inside the same process. This module does the two halves
of that separately so the CLI can fail fast on a typo before anything is instrumented:

* :func:`resolve` finds and compiles the target and raises :class:`ScriptNotFound` /
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
import difflib
import importlib._bootstrap
import importlib._bootstrap_external
import importlib.machinery
import importlib.util
import os
import pkgutil
import runpy
import sys
import traceback
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType, TracebackType
from typing import Any, Literal, TextIO

__all__ = [
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


class ScriptNotFound(Exception):
    """The script path does not name a runnable file, directory or zip archive."""


class ModuleNotFound(Exception):
    """The ``-m`` module name does not name a runnable module or package."""


@dataclass(frozen=True)
class Target:
    """What the user asked to run: ``kind="path"`` for ``script.py``, ``"module"`` for ``-m``."""

    kind: Literal["path", "module"]
    name: str
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("path", "module"):
            raise ValueError(f"Target.kind must be 'path' or 'module', not {self.kind!r}")
        # Callers naturally pass argv slices (lists); freezing them keeps the target hashable
        # and stops a later mutation of the caller's list from changing what gets run.
        object.__setattr__(self, "args", tuple(self.args))


@dataclass(frozen=True)
class ResolvedTarget:
    """Everything :func:`run` needs, computed once so a later ``os.chdir`` cannot change it.

    ``file``, ``loader``, ``spec``, ``package`` and ``cached`` become the ``__main__``
    module's dunder attributes. ``path0`` is the entry python would put first on
    ``sys.path``; ``None`` means leave ``sys.path`` alone (``python -P`` / PYTHONSAFEPATH).
    """

    target: Target
    code: CodeType
    argv: tuple[str, ...]
    path0: str | None
    file: str | None
    spec: ModuleSpec | None
    loader: Any
    package: str | None
    cached: str | None


def resolve(target: Target) -> ResolvedTarget:
    """Find and compile ``target`` without running it.

    Raises :class:`ScriptNotFound` or :class:`ModuleNotFound` with a one-line message
    naming the cause and the fix. A ``SyntaxError`` in the target is raised from *here*,
    not from :func:`run`; format it with :func:`user_traceback` (exit code 1, as python).
    For ``-m pkg.mod`` the parent package ``pkg`` is imported, as ``python -m`` does, so
    any exception its ``__init__`` raises also comes out of this function.
    """
    if target.kind == "module":
        return _resolve_module(target)
    return _resolve_path(target)


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
    main = ModuleType("__main__")
    namespace = main.__dict__
    namespace.update(
        __file__=resolved.file,
        __cached__=resolved.cached,
        __loader__=resolved.loader,
        __spec__=resolved.spec,
        __package__=resolved.package,
        # Python gives __main__ the builtins *module* (imported modules get its dict) and
        # an empty __annotations__; scripts that introspect either expect what python does.
        __builtins__=builtins,
        __annotations__={},
    )

    saved_argv = sys.argv
    saved_path = sys.path
    saved_path_entries = list(sys.path)
    saved_main = sys.modules.get("__main__")
    saved_mp_main = sys.modules.get("__mp_main__")

    sys.argv = list(resolved.argv)
    if resolved.path0 is not None:
        _install_path0(resolved.path0)
    # pickle finds classes defined in the script through sys.modules["__main__"], and a
    # multiprocessing spawn child re-runs the script under the name "__mp_main__".
    sys.modules["__main__"] = main
    sys.modules["__mp_main__"] = main
    # Taking the previous run's globals over releases them, before this run allocates.
    _last_main[:] = [main]
    try:
        _exec_main(resolved.code, namespace)
    finally:
        sys.argv = saved_argv
        # Restore the whole list in place: a script that inserted its own directories
        # must not leave them able to shadow what amp_doctor imports after the run, and
        # other code may hold a reference to the original list object.
        saved_path[:] = saved_path_entries
        sys.path = saved_path
        _restore_module("__main__", saved_main)
        _restore_module("__mp_main__", saved_mp_main)


def user_traceback(exc: BaseException) -> str:
    """Format ``exc`` as python would print it, showing only the user's frames.

    Frames before the user's code (the CLI, :func:`run`), frames inside the amp_doctor
    package and runpy/importlib plumbing are dropped; chained exceptions and exception
    groups keep their usual layout. A ``SyntaxError`` from :func:`resolve` gets python's
    caret display with no "Traceback" header, exactly as ``python bad.py`` prints it.
    """
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

    ``SystemExit(None)`` -> 0, ``SystemExit(n)`` -> n, any other ``SystemExit`` payload
    -> 1 (python also prints it: see :func:`system_exit_message`), ``KeyboardInterrupt``
    -> 130, anything else -> 1. Pass the result to ``sys.exit``, which applies the same
    truncation to 8 bits that python's own exit would.
    """
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        # bool is an int here too, as in CPython's handling: sys.exit(True) exits 1.
        if isinstance(exc.code, int):
            return exc.code
        return 1
    if isinstance(exc, KeyboardInterrupt):
        return _SIGINT_EXIT
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
    return str(exc.code)


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
    elif exc is not None:
        stream.write(user_traceback(exc))
    stream.flush()
    return exit_code(exc)


# The module of the last script run, kept alive until the interpreter exits, as python
# keeps ``__main__``. Releasing it as soon as the script returns would run the C++
# destructors of the script's objects on the spot, holding the GIL, which deadlocks a
# DDP run: ``~Reducer`` -> ``~ProcessGroupGloo`` joins a gloo worker thread that is still
# freeing its last allreduce, whose captured thread-local state (torch's backward stashes
# a ``contextvars.Context`` there) needs the GIL to be freed. Under load that worker lags
# behind the script's end, and the rank hung before writing its report. At interpreter
# exit the workers have long been idle, as in a plain ``python train.py``.
_last_main: list[ModuleType] = []


# --------------------------------------------------------------------------- resolution


def _resolve_path(target: Target) -> ResolvedTarget:
    name = target.name
    cwd = os.getcwd()
    # Python >= 3.9 makes the script's __file__ absolute by plain joining with the cwd,
    # without normalising ("./x.py" -> "/cwd/./x.py"); matching it keeps tracebacks,
    # __file__ comparisons and multiprocessing's re-run of the script identical.
    filename = name if os.path.isabs(name) else os.path.join(cwd, name)

    # Like python, a directory or zip archive runs the __main__ module inside it.
    if name and pkgutil.get_importer(filename) is not None:
        return _resolve_archive(target, filename, cwd)

    try:
        with open(filename, "rb") as handle:
            source = handle.read()
    except FileNotFoundError:
        hint = _close_file_hint(name, filename)
        raise ScriptNotFound(
            f"No script at {name!r} (cwd {cwd}).{hint} Check the path, or use -m for a module."
        ) from None
    except OSError as exc:
        raise ScriptNotFound(
            f"Cannot read script {name!r} (cwd {cwd}): {exc.strerror or exc}. "
            "Check that it is a readable Python file."
        ) from None

    loader: importlib.machinery.SourceFileLoader | importlib.machinery.SourcelessFileLoader
    if source[:4] == importlib.util.MAGIC_NUMBER or filename.endswith(".pyc"):
        # Python runs compiled .pyc files given on the command line too.
        loader = importlib.machinery.SourcelessFileLoader("__main__", filename)
        problem = ""
        try:
            compiled = loader.get_code("__main__")
        except ImportError as exc:  # bad magic number or truncated file
            compiled = None
            problem = str(exc)
        if compiled is None:
            raise ScriptNotFound(
                f"Cannot run {name!r}: {problem or 'no code in the .pyc file'}. "
                "Run the .py source, or recompile it with this Python."
            )
        code = compiled
    else:
        loader = importlib.machinery.SourceFileLoader("__main__", filename)
        code = _compile_source(source, filename)

    # sys.path[0] is the directory of the script with symlinks resolved (python runs
    # realpath on it), so a symlinked train.py still imports its real siblings; under
    # -P / PYTHONSAFEPATH python adds nothing.
    path0 = None if _safe_path() else os.path.dirname(os.path.realpath(filename))
    return ResolvedTarget(
        target=target,
        code=code,
        argv=(name, *target.args),
        path0=path0,
        file=filename,
        spec=None,
        loader=loader,
        package=None,
        cached=None,
    )


def _resolve_archive(target: Target, location: str, cwd: str) -> ResolvedTarget:
    # PathFinder ignores sys.modules, where "__main__" is already taken by the caller.
    spec = importlib.machinery.PathFinder.find_spec("__main__", [location])
    if spec is None or spec.loader is None:
        raise ScriptNotFound(
            f"No __main__.py in {target.name!r} (cwd {cwd}). "
            "Point at the script itself, or add a __main__.py to it."
        )
    code = _code_from_loader(spec, target.name, ScriptNotFound)
    return ResolvedTarget(
        target=target,
        code=code,
        argv=(target.name, *target.args),
        # Python puts the directory or archive itself first on sys.path, even under -P.
        path0=location,
        file=spec.origin if spec.has_location else None,
        spec=spec,
        loader=spec.loader,
        package=spec.parent,
        cached=spec.cached if spec.has_location else None,
    )


def _resolve_module(target: Target) -> ResolvedTarget:
    name = target.name
    cwd = os.getcwd()
    if not name or name.startswith("."):
        raise ModuleNotFound(
            f"Cannot run module {name!r}: relative or empty module names are not supported. "
            "Give the full dotted name."
        )
    if name.endswith(".py"):
        # python -m would import the file as a package first (running its code) and then
        # fail; refusing up front avoids running a training script just to report a typo.
        raise ModuleNotFound(
            f"Module names do not end in '.py': use -m {name[:-3]!r}, "
            f"or pass {name!r} as a script path without -m."
        )

    # python -m looks the module up with the cwd first on sys.path; our sys.path[0] is the
    # CLI's own directory, so swap the cwd in for the lookup (and for run(), via path0).
    path0 = None if _safe_path() else cwd
    if path0 is None:
        spec = _find_main_spec(name, cwd)
    else:
        original = sys.path[0] if sys.path else None
        replaced = _install_path0(path0)
        try:
            spec = _find_main_spec(name, cwd)
        finally:
            _uninstall_path0(path0, original if replaced else None)

    code = _code_from_loader(spec, name, ModuleNotFound)
    return ResolvedTarget(
        target=target,
        code=code,
        # python -m puts the module's file in argv[0] (its origin, even when not a path).
        argv=(str(spec.origin), *target.args),
        path0=path0,
        file=spec.origin if spec.has_location else None,
        spec=spec,
        loader=spec.loader,
        package=spec.parent,
        cached=spec.cached if spec.has_location else None,
    )


def _find_main_spec(name: str, cwd: str) -> ModuleSpec:
    """The spec python -m would run for ``name``: the module, or ``name.__main__``."""
    spec = _find_spec(name, cwd)
    if spec.submodule_search_locations is None:
        return spec
    if name == "__main__" or name.endswith(".__main__"):
        raise ModuleNotFound(
            f"Cannot run {name!r}: it is a package, and a package cannot be __main__. "
            "Name a module file instead."
        )
    main_name = name + ".__main__"
    try:
        return _find_spec(main_name, cwd)
    except ModuleNotFound:
        raise ModuleNotFound(
            f"Package {name!r} has no __main__.py, so it cannot be run with -m. "
            f"Add {name.replace('.', '/')}/__main__.py, or give a module inside it."
        ) from None


def _find_spec(name: str, cwd: str) -> ModuleSpec:
    parent = name.rpartition(".")[0]
    if parent:
        # Import the parent ourselves, as runpy does, to tell "no such package" apart from
        # "the package's own __init__ failed": the latter is the user's bug and must
        # surface as their exception, not as a misleading "not found".
        try:
            __import__(parent)
        except ImportError as exc:
            if exc.name is None or (exc.name != parent and not parent.startswith(exc.name + ".")):
                raise
    not_found = (
        f"No module named {name!r} (cwd {cwd}). Check the spelling and that it is "
        "importable by this Python (installed, or on PYTHONPATH), or pass a file path "
        "instead of -m."
    )
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, AttributeError, TypeError, ValueError):
        raise ModuleNotFound(not_found) from None
    if spec is None:
        raise ModuleNotFound(not_found)
    return spec


def _code_from_loader(
    spec: ModuleSpec, shown_name: str, error: type[ScriptNotFound | ModuleNotFound]
) -> CodeType:
    loader = spec.loader
    get_code = getattr(loader, "get_code", None)
    if loader is None or get_code is None:
        raise error(
            f"{shown_name!r} has no code to run (namespace package or loader without "
            "get_code). Give a module or a package that has a __main__.py."
        )
    code = get_code(spec.name)
    if code is None:
        raise error(
            f"{shown_name!r} has no Python code to run (built-in or extension module). "
            "Give a pure-Python module or script."
        )
    if not isinstance(code, CodeType):
        raise TypeError(f"Loader for {shown_name!r} returned {type(code).__name__}, not code")
    return code


def _compile_source(source: bytes, filename: str) -> CodeType:
    # Compiling the bytes (not decoded text) lets compile() honour PEP 263 coding
    # cookies and a BOM, as python does; dont_inherit keeps this module's
    # `from __future__ import annotations` out of the user's code.
    try:
        return compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        if exc.filename is not None or b"\0" not in source:
            raise
        # A NUL byte (e.g. a checkpoint passed by mistake) fails before parsing, so the
        # error names no file; python's own report names file and line, so add them.
        nul = source.index(b"\0")
        lineno = source.count(b"\n", 0, nul) + 1
        line = source[source.rfind(b"\n", 0, nul) + 1 : nul].decode("utf-8", "replace")
        raise SyntaxError(exc.msg, (filename, lineno, None, line)) from None


def _close_file_hint(name: str, filename: str) -> str:
    folder = os.path.dirname(filename)
    try:
        candidates = os.listdir(folder)
    except OSError:
        return ""
    matches = difflib.get_close_matches(os.path.basename(filename), candidates, n=1, cutoff=0.75)
    if not matches:
        return ""
    return f" Did you mean {os.path.join(os.path.dirname(name), matches[0])!r}?"


# ------------------------------------------------------------------------ running


def _exec_main(code: CodeType, namespace: dict[str, Any]) -> None:
    # user_traceback() treats this function's frame as the boundary between amp_doctor's
    # frames and the user's, so the user's code must be entered here and only here.
    exec(code, namespace)


def _install_path0(path0: str) -> bool:
    """Put ``path0`` first on sys.path; return True if it replaced an entry."""
    # Python inserted our *own* script's directory (or the cwd) at sys.path[0]; the user's
    # code must see theirs in that slot instead, and not ours, which could shadow their
    # modules. Under -P python inserted nothing, so there is no slot to take over.
    if sys.path and not _safe_path():
        sys.path[0] = path0
        return True
    sys.path.insert(0, path0)
    return False


def _uninstall_path0(path0: str, original: str | None) -> None:
    """Take ``path0`` out of sys.path again, putting back ``original`` if it was replaced."""
    # Undo only our own edit, found by identity: a parent package imported during the
    # lookup may legitimately have extended sys.path, and python -m would keep that.
    for index, entry in enumerate(sys.path):
        if entry is path0:
            if original is not None:
                sys.path[index] = original
            else:
                del sys.path[index]
            return


def _safe_path() -> bool:
    # sys.flags.safe_path (python -P, PYTHONSAFEPATH) only exists from Python 3.11 on.
    return bool(getattr(sys.flags, "safe_path", False))


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
    kept = [
        summary
        for index, summary in enumerate(stack)
        if index >= start and not _is_hidden(summary.filename)
    ]
    return traceback.StackSummary.from_list(kept)


def _is_hidden(filename: str) -> bool:
    return filename in _PLUMBING_FILES or _is_own_file(filename)


def _is_own_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = os.path.normcase(os.path.abspath(filename))
    return path.startswith(os.path.normcase(_PACKAGE_DIR) + os.sep)
