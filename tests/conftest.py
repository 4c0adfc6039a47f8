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
    gc.collect()
    assert not patches_installed(), "a test left amp-doctor patches installed"
    assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == anomaly
