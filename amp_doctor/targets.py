"""What ``amp-doctor diagnose`` is asked to run, found and compiled without running it.

:func:`resolve` turns a :class:`Target` (``script.py`` or ``-m module``, with its
arguments) into a :class:`ResolvedTarget` that :func:`amp_doctor.runner.run` executes,
and raises :class:`ScriptNotFound` / :class:`ModuleNotFound` (or the user's
``SyntaxError``) first, so the CLI fails fast on a typo. Only ``-m pkg.mod`` imports
``pkg``, exactly as ``python -m`` does. Also here: where python puts the script's
directory on ``sys.path`` (:func:`install_path0`), shared with the runner.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import os
import pkgutil
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import CodeType
from typing import Any, Literal

__all__ = [
    "ModuleNotFound",
    "ResolvedTarget",
    "ScriptNotFound",
    "NoMainModule",
    "Target",
    "install_path0",
    "resolve",
    "safe_path",
    "uninstall_path0",
]


class ScriptNotFound(Exception):
    """The script path does not name a runnable file, directory or zip archive."""

    exit_code = 2  # as ``python missing.py`` exits


class NoMainModule(ScriptNotFound):
    """A directory or zip archive without a ``__main__`` module to run."""

    exit_code = 1  # as ``python folder`` exits ("can't find '__main__' module")


class ModuleNotFound(Exception):
    """The ``-m`` module name does not name a runnable module or package."""

    exit_code = 1  # as ``python -m missing`` exits


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
    path0 = None if safe_path() else os.path.dirname(os.path.realpath(filename))
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
        raise NoMainModule(
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
    path0 = None if safe_path() else cwd
    if path0 is None:
        spec = _find_main_spec(name, cwd)
    else:
        original = sys.path[0] if sys.path else None
        replaced = install_path0(path0)
        try:
            spec = _find_main_spec(name, cwd)
        finally:
            uninstall_path0(path0, original if replaced else None)

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


def install_path0(path0: str) -> bool:
    """Put ``path0`` first on sys.path; return True if it replaced an entry."""
    # Python inserted our *own* script's directory (or the cwd) at sys.path[0]; the user's
    # code must see theirs in that slot instead, and not ours, which could shadow their
    # modules. Under -P python inserted nothing, so there is no slot to take over.
    if sys.path and not safe_path():
        sys.path[0] = path0
        return True
    sys.path.insert(0, path0)
    return False


def uninstall_path0(path0: str, original: str | None) -> None:
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


def safe_path() -> bool:
    # sys.flags.safe_path (python -P, PYTHONSAFEPATH) only exists from Python 3.11 on.
    return bool(getattr(sys.flags, "safe_path", False))
