"""Count host syncs made by amp-doctor's code, independently of its own counter.

:class:`SyncCounter` patches, for the duration of a ``with`` block, every
Python-level way a tensor's value reaches the host: ``Tensor.item``,
``.tolist``, ``.cpu``, ``.numpy``, ``__bool__``, ``__float__``, ``__int__``,
``__index__``, ``Tensor.nonzero`` and ``torch.nonzero``. A call counts when
its direct caller is a source file of the ``amp_doctor`` package, so the
user's own ``loss.item()`` (and torch's own, inside ``GradScaler.step``) is
not counted. On CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` also reports the
synchronizing calls that no Python method shows (``bincount``, pageable
copies), attributed the same way.

On the CPU every tensor is a host tensor, so "device" and "host" are told
apart by where the call is made: amp-doctor's host-side functions, which
only ever receive the step's single host copy (decoding, aggregates,
sinks, analysis), are listed in :data:`HOST_SIDE` and not counted. Any other
call from amp-doctor's code counts, so a new sync anywhere in a hook, a
patch or the step boundary fails the tests that use this counter.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

import amp_doctor

__all__ = ["SyncCounter", "HOST_SIDE", "SyncCall"]

PACKAGE_DIR = str(Path(amp_doctor.__file__).resolve().parent)
TORCH_DIR = str(Path(torch.__file__).resolve().parent)
THIS_FILE = str(Path(__file__).resolve())

# (file relative to amp_doctor/, function name), (file, "*") or (folder/, "*"): host-side code.
HOST_SIDE: frozenset[tuple[str, str]] = frozenset({
    ("device/recorder.py", "unpack_host"),
    ("steps/table.py", "*"),
    ("steps/aggregates.py", "*"),
    ("steps/history.py", "*"),
    ("device/recorder.py", "HostCopy.merged"),
    ("device/recorder.py", "HistSums.add"),
    ("device/recorder.py", "HistSums.of"),
    ("device/recorder.py", "merge_rows"),
    ("device/stats.py", "host_rows"),
    ("device/stats.py", "decode"),
    ("device/stats.py", "decode_many"),
    ("device/stats.py", "decode_table"),
    ("device/stats.py", "_band_sums"),
    ("device/stats.py", "_absmax_from_hist"),
    ("analysis/", "*"),
    ("format.py", "*"),
    ("records.py", "*"),
    ("merge.py", "*"),
    ("sinks/text.py", "*"),
    ("sinks/jsonfile.py", "*"),
    ("sinks/tensorboard.py", "*"),
})

_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__",
            "nonzero")


@dataclass(frozen=True)
class SyncCall:
    what: str  # the method, or "cuda" for a set_sync_debug_mode warning
    site: str  # amp_doctor/<file>:<line> in <function>
    device: str


@dataclass
class SyncCounter:
    """``with SyncCounter() as c: ...``; then ``c.calls`` / ``len(c)``."""

    calls: list[SyncCall] = field(default_factory=list)
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list)
    _busy: threading.local = field(default_factory=threading.local)
    _cuda_warnings: Any = None

    def __len__(self) -> int:
        return len(self.calls)

    def reset(self) -> None:
        self.calls.clear()

    # -- attribution ---------------------------------------------------------
    @staticmethod
    def _site(frame: FrameType | None) -> tuple[str, str] | None:
        """The amp_doctor frame that made the call, or None if the user's code did."""
        # The direct caller decides: a sync inside torch's own code (GradScaler.step
        # reading found_inf) is made by torch, also in a plain run, even when
        # amp-doctor's wrapper called that torch function.
        while frame is not None and frame.f_code.co_filename == THIS_FILE:
            frame = frame.f_back
        if frame is None:
            return None
        fn = frame.f_code.co_filename
        if not fn.startswith(PACKAGE_DIR):
            return None
        rel = fn[len(PACKAGE_DIR) + 1 :].replace("\\", "/")
        code = frame.f_code
        name = getattr(code, "co_qualname", code.co_name)  # qualname: Python 3.11+
        return rel, f"{name}:{frame.f_lineno}"

    def _note(self, what: str, t: Any, frame: FrameType | None) -> None:
        site = self._site(frame)
        if site is None:
            return
        rel, where = site
        func = where.split(":")[0]
        short = func.rsplit(".", 1)[-1]
        if ((rel, func) in HOST_SIDE or (rel, short) in HOST_SIDE or (rel, "*") in HOST_SIDE
                or (rel.rsplit("/", 1)[0] + "/", "*") in HOST_SIDE):
            return
        dev = t.device.type if isinstance(t, torch.Tensor) else "?"
        self.calls.append(SyncCall(what, f"amp_doctor/{rel}:{where.split(':')[1]} in {func}",
                                   dev))

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def patched(*args: Any, **kwargs: Any) -> Any:
            # A patched method calling another (tolist -> __index__) counts once.
            if getattr(counter._busy, "on", False):
                return orig(*args, **kwargs)
            counter._busy.on = True
            try:
                counter._note(name, args[0] if args else None, sys._getframe(1))
                return orig(*args, **kwargs)
            finally:
                counter._busy.on = False

        patched.__name__ = getattr(orig, "__name__", name)
        return patched

    # -- install / restore ---------------------------------------------------
    def __enter__(self) -> SyncCounter:
        for name in _METHODS:
            orig = getattr(torch.Tensor, name)
            self._saved.append((torch.Tensor, name, torch.Tensor.__dict__.get(name, _ABSENT)))
            setattr(torch.Tensor, name, self._wrap(name, orig))
        self._saved.append((torch, "nonzero", torch.nonzero))
        torch.nonzero = self._wrap("torch.nonzero", torch.nonzero)  # type: ignore[assignment]
        if torch.cuda.is_available():
            self._cuda_warnings = warnings.catch_warnings(record=True)
            self._cuda_log = self._cuda_warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._cuda_warnings is not None:
                torch.cuda.set_sync_debug_mode(0)
                for w in self._cuda_log:
                    if "synchroniz" in str(w.message).lower():
                        # The warning carries the Python caller's file and line.
                        fn = str(Path(w.filename).resolve())
                        if fn.startswith(PACKAGE_DIR):
                            self.calls.append(SyncCall("cuda", f"{fn}:{w.lineno}", "cuda"))
                self._cuda_warnings.__exit__(et, ev, tb)
        finally:
            for owner, name, value in reversed(self._saved):
                if value is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, value)
            self._saved.clear()


_ABSENT = object()
