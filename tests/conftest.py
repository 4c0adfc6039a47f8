from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A test run started in the background by a non-interactive shell (`make test &` in a CI
# script) inherits SIGINT ignored, and so would every script the tests Ctrl-C: python
# keeps an ignored SIGINT, and those tests would wait on a run that never stops. The
# scripts get python's default instead (a handler set here is SIG_DFL in a child).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def _temp_files_under_pytests_basetemp(tmp_path_factory: pytest.TempPathFactory
                                       ) -> Iterator[None]:
    """What the code under test puts in the temporary folder (`amp-doctor fix` keeps its
    trials' reports there for the user) goes under pytest's own, which pytest prunes,
    instead of piling up in /tmp: for this process and every script it starts."""
    tmp = tmp_path_factory.mktemp("tmpdir")
    before = (os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp)
    yield
    if before[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before[0]
    tempfile.tempdir = before[1]


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
