from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _clean_torch_state():
    """Every test must leave torch's global state as it found it."""
    from amp_doctor.steps.scaler import patches_installed

    anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    yield
    if patches_installed():
        # A watch that was dropped without close() lets go of its patches when it is
        # collected; a full collection on every test would cost ~0.3 s each (the heap
        # holds torch, transformers and lightning), so only when something is left.
        gc.collect()
    assert not patches_installed(), "a test left amp-doctor patches installed"
    assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == anomaly
