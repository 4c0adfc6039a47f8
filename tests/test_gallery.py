"""The acceptance suite: each sample's pathology is found on the right module, by the CLI.

Each sample is diagnosed once per mode and the verdict shared by the tests below:
in process (``amp_doctor.cli.main``, the same entry point the console script calls:
the fast suite) and, marked slow, in a subprocess exactly as a user runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

GALLERY = Path(__file__).resolve().parents[1] / "sample_models"
sys.path.insert(0, str(GALLERY))

import gallery  # noqa: E402
from expected import EXPECTED  # noqa: E402

MODES = [pytest.param(True, id="in-process"),
         pytest.param(False, id="subprocess", marks=pytest.mark.slow)]
PATHOLOGICAL = [s for s, found in EXPECTED.items() if found]
# The one sample whose own exit status is not 0: the crash is its symptom.
EXIT_CODES = {"half_params_with_scaler.py": 1}


@pytest.fixture(scope="session")
def diagnosed(tmp_path_factory: pytest.TempPathFactory
              ) -> Callable[[str, bool], gallery.Verdict]:
    verdicts: dict[tuple[str, bool], gallery.Verdict] = {}

    def get(script: str, in_process: bool) -> gallery.Verdict:
        key = (script, in_process)
        if key not in verdicts:
            work = tmp_path_factory.mktemp(Path(script).stem)
            verdicts[key] = gallery.check(script, workdir=work, in_process=in_process)
        return verdicts[key]

    return get


def _explain(v: gallery.Verdict) -> str:
    return v.line() + "\nfindings:\n" + "\n".join(
        f"  {f['severity']} {f['kind']} {f['module']} {f['op']}: {f['message']}"
        for f in v.found)


@pytest.mark.parametrize("in_process", MODES)
@pytest.mark.parametrize("script", list(EXPECTED))
def test_sample_is_diagnosed_as_expected(
        script: str, in_process: bool, diagnosed: Callable[[str, bool], gallery.Verdict]
) -> None:
    v = diagnosed(script, in_process)
    assert not v.missing, _explain(v)
    if not EXPECTED[script]:
        assert not v.unexpected, _explain(v)  # healthy: no warning, no error
    # The script's own exit status passes through (no --fail-on here).
    assert v.exit_code == EXIT_CODES.get(script, 0), _explain(v)


@pytest.mark.parametrize("in_process", MODES)
@pytest.mark.parametrize("script", PATHOLOGICAL)
def test_pathological_sample_has_no_extra_errors(
        script: str, in_process: bool, diagnosed: Callable[[str, bool], gallery.Verdict]
) -> None:
    v = diagnosed(script, in_process)
    # Every error matches its own entry of the table: one error per root cause.
    assert not v.unexpected, _explain(v)


def test_every_sample_has_a_table_entry() -> None:
    scripts = {p.name for p in GALLERY.glob("*.py")} - {"expected.py", "gallery.py"}
    assert scripts == set(EXPECTED)
