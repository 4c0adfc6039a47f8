"""amp-doctor: why your PyTorch mixed-precision training misbehaves, and where.

    import amp_doctor
    with amp_doctor.watch(model, logdir="runs/amp") as doctor:
        ...  # the usual autocast + GradScaler loop
    print(doctor.report())
"""

from ._version import __version__
from .errors import AmpDoctorError, NonFiniteError
from .records import Finding, Session
from .watch import Watch, watch

__all__ = ["watch", "Watch", "Session", "Finding", "AmpDoctorError", "NonFiniteError",
           "__version__"]
