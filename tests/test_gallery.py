"""The acceptance suite: each sample's pathology is found on the right module, by the CLI."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

GALLERY = Path(__file__).resolve().parents[1] / "sample_models"
sys.path.insert(0, str(GALLERY))

import gallery  # noqa: E402
from expected import EXPECTED  # noqa: E402


@pytest.mark.parametrize("script", list(EXPECTED))
def test_sample_is_diagnosed_as_expected(script: str, tmp_path: Path) -> None:
    v = gallery.check(script, workdir=tmp_path)
    assert v.ok, v.line() + "\nfindings:\n" + "\n".join(
        f"  {f['severity']} {f['kind']} {f['module']} {f['op']}: {f['message']}"
        for f in v.found)


def test_every_sample_has_a_table_entry() -> None:
    scripts = {p.name for p in GALLERY.glob("*.py")} - {"expected.py", "gallery.py"}
    assert scripts == set(EXPECTED)
