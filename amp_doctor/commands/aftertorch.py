"""Start watching when the user's script imports torch, not before it runs.

A script may set what torch reads at import before it imports torch:
``os.environ["OMP_NUM_THREADS"] = "1"`` (the intra-op thread count, and with it how a
float32 sum is split, so its rounding), ``MKL_NUM_THREADS``, ``TORCH_LOGS``. Under
``python train.py`` those take effect; if ``diagnose`` imported torch first, they would
not, and the run would differ from the same run without amp-doctor. So ``diagnose``
imports nothing of torch before the script, and starts its watch right after the
script's own ``import torch`` has run torch's ``__init__``, before the script's next
statement: nothing of the script's torch work happens unwatched.

A Ctrl-C in that moment is held until the watch has started, then raised into the
script's ``import torch``, as python would have raised it there: the report covers the
run. One during torch's own ``__init__`` leaves torch half-imported, and a second
import of it would fail (torch cannot register its operators twice): the finder says
so (``import_failed``), and nothing imports torch again.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

from amp_doctor.commands.terminal import hold_sigint

__all__ = ["after_torch_import"]


class _TorchImport(importlib.abc.MetaPathFinder):
    """Finds ``torch`` as the finders after it would, and calls back once its
    ``__init__`` has run."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._lock = threading.Lock()
        self.called = False
        # What the callback raised: not raised into the user's import, which would fail
        # it after torch's __init__ ran (a second import would run it again, and torch
        # cannot register its operators twice).
        self.error: BaseException | None = None
        # What the script's import of torch itself raised (a Ctrl-C in its __init__):
        # torch is half-imported and must not be imported again in this process.
        self.import_failed: BaseException | None = None
        # torch, once its __init__ has run.
        self.module: ModuleType | None = None

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch" or self.called:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            # An instance attribute over the loader's method, for this one import.
            del loader.exec_module  # type: ignore[attr-defined]
            try:
                real_exec(module)
            except BaseException as e:
                self.import_failed = e
                raise
            self.module = module
            self.call()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def call(self) -> None:
        with self._lock:
            if self.called:
                return
            self.called = True
        with hold_sigint() as held:
            try:
                self._callback()
            except BaseException as e:  # kept for the caller: see self.error
                self.error = e
        if held:
            # Now that the watch is on: into the script's import, through its own handler.
            # The import machinery then takes torch out of sys.modules: see keep_torch.
            signal.raise_signal(signal.SIGINT)

    def keep_torch(self) -> None:
        """Put torch back in ``sys.modules`` if an exception raised into the script's import
        after torch's ``__init__`` had run (the held Ctrl-C) took it out: amp-doctor's own
        imports of torch, as the run ends, must find it, not run its ``__init__`` again."""
        if self.module is not None and "torch" not in sys.modules:
            sys.modules["torch"] = self.module


@contextlib.contextmanager
def after_torch_import(callback: Callable[[], None]) -> Iterator[_TorchImport]:
    """While the block runs, call ``callback`` once torch is imported: at once if it is
    already (amp-doctor run in-process, a sitecustomize that imports it), raising what it
    raises; else inside the script's import, keeping what it raises in the ``error`` of
    what is yielded (the script runs on, unwatched)."""
    if "torch" in sys.modules:
        done = _TorchImport(callback)
        done.called = True
        callback()
        yield done
        return
    hook = _TorchImport(callback)
    sys.meta_path.insert(0, hook)
    try:
        yield hook
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(hook)
