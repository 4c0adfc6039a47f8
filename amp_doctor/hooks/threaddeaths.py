"""Uncaught exceptions that end the script's threads, seen as they end them.

Python prints such a thread's traceback (``threading.excepthook``) and goes on; the
process's exit code does not show it. A script that trains in a thread whose training
died at step 10 of 15 exited 0 and its report said "completed" (review 58c). While a
watch runs, every such exception is passed to its listener, then to the hook that was
there before, which prints it as before. One installation for every live watch, restored
when the last one ends, unless the program replaced it meanwhile (then ours stays in its
chain, forwarding only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["listen", "stop"]

Listener = Callable[[Any], None]  # takes threading.ExceptHookArgs

_lock = threading.Lock()
_listeners: list[Listener] = []
_previous: Any = None


def _hook(args: Any) -> None:
    for fn in list(_listeners):
        try:
            fn(args)
        except Exception:  # the thread's own traceback must still be printed
            pass
    (_previous or threading.__excepthook__)(args)


def listen(fn: Listener) -> None:
    """``fn(args)`` for each uncaught exception of a thread from now on."""
    global _previous
    with _lock:
        if not _listeners and threading.excepthook is not _hook:
            _previous = threading.excepthook
            threading.excepthook = _hook
        _listeners.append(fn)


def stop(fn: Listener) -> None:
    """No more calls of ``fn``; the previous hook is back after the last listener."""
    global _previous
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)
        if not _listeners and threading.excepthook is _hook:
            threading.excepthook = _previous or threading.__excepthook__
            _previous = None
