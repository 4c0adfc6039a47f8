"""A Ctrl-C that Python dropped, delivered again; and a SIGTERM the script swallowed,
carried out when its training goes on.

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

A SIGTERM under ``amp-doctor diagnose`` unwinds the script with an exception, so that the
report holds what ran; a bare ``except:`` in the training loop swallowed it, and the script
trained on until the scheduler's SIGKILL, leaving no report (review 58c; python would have
died at once). The runner registers how to end the run (:func:`end_when_training_resumes`);
the next backward pass or optimizer step in the main thread carries it out
(:func:`training_resumed`). Not a forward pass: a ``finally`` block that evaluates the
model while the script unwinds runs to its end, as it did before.
"""

from __future__ import annotations

import _thread
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["hold", "let_go", "end_when_training_resumes", "training_resumed"]

# Seconds between a dropped Ctrl-C and its second delivery: the main thread has left the
# callback by then (a pause the user does not notice).
REDELIVER_DELAY_S = 0.02

_lock = threading.Lock()
_holders = 0
_previous: Any = None
# How to end a run whose SIGTERM the script swallowed (None: no such run).
_end_run: Callable[[], None] | None = None


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


def end_when_training_resumes(end: Callable[[], None] | None) -> None:
    """``end`` (which does not return: it writes the report and ends the process) runs at
    the next training event in the main thread; None forgets it."""
    global _end_run
    _end_run = end


def training_resumed() -> None:
    """A backward pass or an optimizer step starts: a swallowed SIGTERM's end, if one is
    due and this is the main thread. A module global's check when none is."""
    global _end_run
    end = _end_run
    if end is not None and threading.current_thread() is threading.main_thread():
        _end_run = None
        end()
