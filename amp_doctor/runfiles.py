"""A run folder: the names of its files, defined once for every writer and reader, and
the check that it takes files."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["JSON_NAME", "TEXT_NAME", "make_writable_dir"]

# The machine-readable report: Session.to_json(), read back by `report`, `compare`, merges.
JSON_NAME = "amp_doctor.json"
# The text report, as printed at the end of a run.
TEXT_NAME = "report.txt"


def make_writable_dir(d: Path) -> None:
    """Create ``d`` if needed and write a probe file in it; raises the ``OSError`` that a
    report written there at the end of the run would meet (a file in its place, a
    read-only parent)."""
    d.mkdir(parents=True, exist_ok=True)
    probe = d / f".amp-doctor-write-test-{os.getpid()}"
    probe.write_text("")
    probe.unlink()
