"""The names of the files in a run folder, defined once for every writer and reader."""

from __future__ import annotations

__all__ = ["JSON_NAME", "TEXT_NAME"]

# The machine-readable report: Session.to_json(), read back by `report`, `compare`, merges.
JSON_NAME = "amp_doctor.json"
# The text report, as printed at the end of a run.
TEXT_NAME = "report.txt"
