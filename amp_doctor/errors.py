"""One base exception; every message names the cause and the fix."""

from __future__ import annotations

__all__ = ["AmpDoctorError", "NonFiniteError", "UsageError"]


class AmpDoctorError(Exception):
    """Base of all errors amp-doctor raises on purpose."""


class UsageError(AmpDoctorError):
    """Bad input from the user: a path, an option, a model."""


class NonFiniteError(AmpDoctorError):
    """Raised in anomaly mode with ``on_nonfinite="raise"`` at the first NaN/Inf origin."""
