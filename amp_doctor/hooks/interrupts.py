"""A Ctrl-C that Python dropped, delivered again.

A ``KeyboardInterrupt`` raised while Python runs a weakref callback or a ``__del__``
cannot propagate: Python reports it ("Exception ignored in ...") through
``sys.unraisablehook`` and goes on, and the Ctrl-C is lost. amp-doctor's hooks keep
per-step weak maps of tensors, whose callbacks run whenever an activation dies, which
widens that window beyond the user's run alone: a script once looped on after its
Ctrl-C landed in such a callback (CI, ``test_ctrl_c_after_the_report_is_out_...``).

While a watch runs, such a ``KeyboardInterrupt`` is delivered again to the main thread
(``_thread.interrupt_main``), as the press would have landed without it. From a timer
thread, a moment later: called from the hook itself, the handler runs at the hook's next
bytecode, inside the callback machinery, and is dropped again. One landing in another
callback is caught here again. Every other unraisable exception goes to the hook that
was there. One installation for every live watch, restored when the last one ends,
unless the program replaced it meanwhile.
"""

from __future__ import annotations

import _thread
import sys
import threading
from typing import Any

__all__ = ["hold", "let_go"]

# Seconds between a dropped Ctrl-C and its second delivery: the main thread has left the
# callback by then (a pause the user does not notice).
REDELIVER_DELAY_S = 0.02

_lock = threading.Lock()
_holders = 0
_previous: Any = None


def _deliver() -> None:
    # A SIGINT that is ignored meanwhile (the report being written) stays ignored.
    _thread.interrupt_main()


def _redeliver(unraisable: Any) -> None:
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        timer = threading.Timer(REDELIVER_DELAY_S, _deliver)
        timer.daemon = True
        timer.start()
        return
    (_previous or sys.__unraisablehook__)(unraisable)


def hold() -> None:
    """One more live watch: install the hook if it is the first."""
    global _holders, _previous
    with _lock:
        if _holders == 0:
            _previous = sys.unraisablehook
            sys.unraisablehook = _redeliver
        _holders += 1


def let_go() -> None:
    """One live watch fewer: put the previous hook back after the last."""
    global _holders, _previous
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            if sys.unraisablehook is _redeliver:
                sys.unraisablehook = _previous
            _previous = None
