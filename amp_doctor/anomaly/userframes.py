"""The user's own stack frames at an op: where in their code a NaN/Inf was made.

Frames inside torch, amp-doctor, the standard library, console scripts (the
``amp-doctor`` launcher) and click (the CLI's runner) are skipped; what is left is
the user's script and libraries.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Any, NamedTuple

import torch

__all__ = ["Frame", "UserFrames", "is_user_file", "format_frames", "raised_at", "MAX_USER_FRAMES"]

# The user's own frames kept per op, innermost first.
MAX_USER_FRAMES = 4

_SKIP_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    # Console scripts (the `amp-doctor` launcher that runs the user's script).
    sysconfig.get_paths()["scripts"] + os.sep,
    # amp_doctor/ as a whole: this file is in amp_doctor/anomaly/.
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
) + tuple(
    d + os.sep for d in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)


def is_user_file(filename: str) -> bool:
    """Whether a code object's file is the user's (not torch, amp-doctor, stdlib, click)."""
    if filename.startswith("<"):
        return False
    if "site-packages" + os.sep + "click" + os.sep in filename:
        return False
    return not filename.startswith(_SKIP_DIRS)


class Frame(NamedTuple):
    """One of the user's frames."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


class UserFrames:
    """Captures the user's innermost frames; remembers which code objects are theirs."""

    def __init__(self) -> None:
        self._user_code: dict[Any, bool] = {}

    def capture(self, skip: int = 1) -> tuple[Frame, ...]:
        """The user's frames above the caller (``skip`` frames of ours left out), innermost
        first, at most :data:`MAX_USER_FRAMES`."""
        out: list[Frame] = []
        f: Any = sys._getframe(skip + 1)
        known = self._user_code
        while f is not None and len(out) < MAX_USER_FRAMES:
            code = f.f_code
            user = known.get(code)
            if user is None:
                user = known[code] = is_user_file(code.co_filename)
            if user:
                out.append(Frame(code.co_filename, f.f_lineno, code.co_name))
            f = f.f_back
        return tuple(out)


def raised_at(exc: BaseException) -> str | None:
    """``file:line in function`` of the user's innermost frame in ``exc``'s traceback:
    the line of their code that raised it (through torch's), or None."""
    tb = exc.__traceback__
    last: Frame | None = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_user_file(code.co_filename):
            last = Frame(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return str(last) if last is not None else None


def format_frames(frames: tuple[Frame, ...]) -> list[str]:
    """``file:line in function`` per frame, as events store them."""
    return [str(f) for f in frames]
