"""One base exception; every message names the cause and the fix."""

from __future__ import annotations

__all__ = ["AmpDoctorError", "NonFiniteError", "ReportFormatError", "StopRun", "Terminated",
           "UsageError", "tensorboard_path_error"]


class AmpDoctorError(Exception):
    """Base of all errors amp-doctor raises on purpose."""


class UsageError(AmpDoctorError):
    """Bad input from the user: a path, an option, a model."""


class NonFiniteError(AmpDoctorError):
    """Raised in anomaly mode with ``on_nonfinite="raise"`` at the first NaN/Inf origin."""


class ReportFormatError(AmpDoctorError, ValueError):
    """A JSON report that is damaged, foreign, or from another major version.

    The message names the problem and where it is (``findings[2].severity``); the
    caller adds the file name. A ``ValueError`` too, so code that skips unreadable
    files (the rank merge) keeps working.
    """


class Terminated(BaseException):
    """The process was sent SIGTERM (a scheduler's time limit, ``kill``, ``docker stop``)
    while ``amp-doctor diagnose`` ran the script: raised in the main thread so that the
    run unwinds (the script's ``finally`` blocks run) and the report is written, as for
    Ctrl-C. A ``BaseException`` that is not a ``KeyboardInterrupt``: the script's own
    ``except KeyboardInterrupt`` does not take it for a Ctrl-C.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


class StopRun(BaseException):
    """Raised at a step boundary once ``stop_after`` steps ran (``--stop-after``).

    A ``BaseException``, like ``KeyboardInterrupt``: it ends the user's loop
    without being caught by ``except Exception``, after the step completed.
    """

    def __init__(self, steps: int) -> None:
        super().__init__(f"amp-doctor stopped the run after {steps} steps (--stop-after)")
        self.steps = steps


def tensorboard_path_error(logdir: object, cause: Exception) -> UsageError:
    """TensorBoard encodes paths as UTF-8; a C locale decodes a non-ASCII path to
    surrogates, which it cannot encode back. Said before the script runs by the CLI, and
    by ``watch()`` when its writer is made."""
    return UsageError(
        f"TensorBoard cannot write under {str(logdir)!r} ({cause}); run with a UTF-8 locale "
        "(LC_ALL=C.UTF-8), pick an ASCII logdir, or turn TensorBoard off (--no-tensorboard, "
        "watch(tensorboard=False)).")
