"""Loading a JSON report: exact round trip, and one clear problem for a damaged or foreign file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

import amp_doctor
from amp_doctor.errors import ReportFormatError
from amp_doctor.records import Session
from amp_doctor.sinks.jsonfile import write_json, write_text_atomic
from tests.helpers import MLP, train


@pytest.fixture(scope="module")
def report() -> dict:
    model = MLP()
    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=3)
    return json.loads(doctor.session.to_json())


def load(data: object) -> Session:
    return Session.from_json(json.dumps(data))


def test_round_trip_is_exact(report: dict) -> None:
    s = load(report)
    assert json.loads(s.to_json()) == report
    assert s.steps == 3 and s.history and isinstance(s.history[0].layers, dict)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: d.update(amp=None), "amp is null, expected an object"),
        (lambda d: d["amp"].pop("dtype"), "amp.dtype is missing"),
        (lambda d: d.pop("history"), "history is missing"),
        (lambda d: d.update(history={}), "history is an object, expected a list"),
        (lambda d: d["layers"][1].update(calls="3"), "layers[1].calls is '3', expected an integer"),
        (lambda d: d["layers"][0].update(passthrough=1), "layers[0].passthrough is 1"),
        (lambda d: d["history"][0]["layers"].update(x={"act": 3}),
         "history[0].layers['x'].act is 3, expected an object"),
        (lambda d: d["scaler"].update(scale=[[1, 2, 3]]),
         "scaler.scale[0] is a list, expected a list of 2 values"),
        (lambda d: d["run"].update(exit_code=True), "run.exit_code is True, expected an integer"),
        (lambda d: d.update(findings=[{"kind": "k", "severity": "fatal", "module": None,
                                       "op": None, "step": None, "message": "m",
                                       "advice": "a"}]),
         "findings[0].severity is 'fatal', expected one of 'error', 'warning', 'info'"),
        (lambda d: d.update(version="1.0.0"), "another major version"),
        (lambda d: d.update(version=None), "'version' is null"),
    ],
)
def test_damaged_report_names_the_field_and_the_problem(report: dict, change,
                                                         message: str) -> None:
    data = json.loads(json.dumps(report))
    change(data)
    with pytest.raises(ReportFormatError) as e:
        load(data)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_not_a_report_at_all() -> None:
    with pytest.raises(ReportFormatError, match="not valid JSON"):
        Session.from_json("{ nope")
    with pytest.raises(ReportFormatError, match="top level is a list"):
        Session.from_json("[1, 2]")
    with pytest.raises(ReportFormatError, match="not an amp-doctor report"):
        Session.from_json('{"name": "some other tool"}')


def test_a_newer_minor_version_with_extra_fields_loads(report: dict) -> None:
    data = json.loads(json.dumps(report))
    major = amp_doctor.__version__.split(".")[0]
    data["version"] = f"{major}.99.0"
    data["new_top_level_field"] = [1, 2]
    data["layers"][0]["new_layer_field"] = "x"
    s = load(data)
    assert s.version == f"{major}.99.0" and s.layers[0].name == report["layers"][0]["name"]


def test_damaged_rank_files_are_skipped_by_the_merge(report: dict, tmp_path: Path) -> None:
    from amp_doctor.merge import merge_run_dir

    for rank, data in ((0, report), (1, {**report, "amp": None})):
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "amp_doctor.json").write_text(json.dumps(data))
    merged = merge_run_dir(tmp_path, 2, timeout=0)
    assert merged is not None and merged.run.world_size == 2
    assert "no report from rank(s) [1]" in (merged.run.error or "")


def test_reports_are_written_atomically(report: dict, tmp_path: Path) -> None:
    target = tmp_path / "sub" / "amp_doctor.json"
    write_text_atomic(target, "old")
    write_json(load(report), target)
    assert json.loads(target.read_text()) == report
    assert sorted(p.name for p in target.parent.iterdir()) == ["amp_doctor.json"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    # A failed write leaves the old file whole and no temporary file behind.
    with pytest.raises(TypeError):
        write_text_atomic(target, 42)  # type: ignore[arg-type]
    assert json.loads(target.read_text()) == report
    assert sorted(p.name for p in target.parent.iterdir()) == ["amp_doctor.json"]


def test_the_codec_fast_paths_keep_values_and_their_checks() -> None:
    import math as _math

    from amp_doctor.jsoncodec import from_jsonable, to_jsonable
    from amp_doctor.records import ReportFormatError as _RFE

    assert to_jsonable([1, 2, 3]) == [1, 2, 3]
    assert to_jsonable([1.5, _math.inf, -_math.inf]) == [1.5, "inf", "-inf"]
    assert to_jsonable((1, 2.0)) == [1, 2.0]
    assert from_jsonable(list[int], [1, 2, 3]) == [1, 2, 3]
    assert from_jsonable(list[float], [1, 2.5, "nan"])[:2] == [1.0, 2.5]
    assert _math.isnan(from_jsonable(list[float], [1, 2.5, "nan"])[2])
    with pytest.raises(_RFE, match=r"\[1\] is True, expected an integer"):
        from_jsonable(list[int], [1, True])
