"""The bounded history of step records: it keeps spanning the whole run.

Host data only. Its rows are step records, each holding only the step's worst
layers, packed (:class:`~amp_doctor.steps.table.KeptLayers`) and read as plain
records by the JSON report and the TensorBoard sink.
"""

from __future__ import annotations

import dataclasses

from amp_doctor.records import StepRecord
from amp_doctor.steps.table import StepTable

__all__ = ["History", "HISTORY_LIMIT", "HISTORY_LAYERS", "trim_layers"]

# Bounded memory: the history keeps at most this many step records; when it
# is full every other record is dropped, so it always spans the whole run.
HISTORY_LIMIT = 512
# ... and each record keeps at most this many layers, the step's worst, so the
# history's size does not grow with the model (issue 14: 165 MB of JSON).
HISTORY_LAYERS = 32


def trim_layers(rec: StepRecord, limit: int) -> StepRecord:
    """``rec`` with only its ``limit`` worst layers (forward order kept; see
    :meth:`StepTable.worst`), packed for keeping."""
    table = StepTable.from_layers(rec.layers)
    keep = table.worst(limit)
    return dataclasses.replace(rec, layers=table.keep(keep),
                               dropped_layers=rec.dropped_layers + len(table) - len(keep))


class History:
    """Bounded list of step records that keeps spanning the whole run.

    Bounded in bytes, not only in rows: at most ``limit`` rows (thinned by
    halving, skipped steps always kept) of at most ``layers`` layers each (the
    step's worst; the rest of the layer's figures live in the per-layer
    aggregates). So the history is at most ``limit * layers`` layer cells
    whatever the model's size or the run's length: about 7 MB of JSON.
    """

    def __init__(self, limit: int = HISTORY_LIMIT, layers: int = HISTORY_LAYERS) -> None:
        self.limit = limit
        self.layers = layers
        self.stride = 1
        self.records: list[StepRecord] = []
        self._seen = 0

    def add(self, rec: StepRecord) -> None:
        self._seen += 1
        # Skipped steps are what users ask about: always keep them.
        if (self._seen - 1) % self.stride and not rec.skipped:
            return
        self.records.append(trim_layers(rec, self.layers))
        if len(self.records) > self.limit:
            keep = [r for i, r in enumerate(self.records) if i % 2 == 0 or r.skipped]
            self.records = keep[-self.limit :]
            self.stride *= 2
