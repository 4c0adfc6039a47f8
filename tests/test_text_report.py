"""The text report and the TensorBoard findings markdown, against golden files.

Sessions are committed JSON fixtures (``tests/golden/*.json``, recorded from the sample
models and stripped of per-step history); the expected output is the committed
``.txt`` / ``.md`` next to them. After an intended change to the report, regenerate
with ``AMP_DOCTOR_UPDATE_GOLDEN=1 pytest tests/test_text_report.py`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest

from amp_doctor import format as F
from amp_doctor.records import Session
from amp_doctor.sinks.text import (
    NONFINITE_HEADER,
    group_findings,
    layer_table,
    render_markdown,
    render_text,
    render_verdict,
)

GOLDEN = Path(__file__).parent / "golden"
CASES = ["grouped_underflow", "anomaly_hidden_op", "fp16_overflow"]
UPDATE = os.environ.get("AMP_DOCTOR_UPDATE_GOLDEN") == "1"


def _check(path: Path, got: str) -> None:
    if UPDATE:
        path.write_text(got)
    want = path.read_text()
    assert got == want, (
        f"{path.name} differs from the rendered report; if the change is intended, "
        "regenerate with AMP_DOCTOR_UPDATE_GOLDEN=1 and review the diff")


@pytest.mark.parametrize("case", CASES)
def test_text_report_matches_the_golden_file(case: str) -> None:
    s = Session.load(GOLDEN / f"{case}.json")
    _check(GOLDEN / f"{case}.txt", render_text(s))


@pytest.mark.parametrize("case", CASES)
def test_findings_markdown_matches_the_golden_file(case: str) -> None:
    s = Session.load(GOLDEN / f"{case}.json")
    _check(GOLDEN / f"{case}.md", render_markdown(s))


def test_same_kind_findings_on_many_layers_are_one_group() -> None:
    s = Session.load(GOLDEN / "grouped_underflow.json")
    kinds = [f.kind for f in s.findings]
    assert kinds.count("gradient_underflow") == 8 and kinds.count("activation_underflow") == 2
    groups = group_findings(s.findings, s.layers)
    assert [(g.lead.kind, len(g.findings)) for g in groups] == [
        ("gradient_underflow", 8), ("activation_underflow", 2)]
    # Worst first, as in the layer table: fc1's 56.9% before norm's 52.7%.
    assert groups[0].modules[:2] == ["blocks.0.fc1", "blocks.1.fc1"]
    assert groups[1].modules == ["blocks.1.ls", "blocks.0.ls"]
    text = render_text(s)
    # One block per group: the advice once, every layer named.
    assert text.count("fix: Gradients flush to zero") == 1
    assert "gradient_underflow  on 8 layers" in text
    for f in s.findings:
        assert f.module is not None and f.module in text
    assert "Findings: 0 error(s), 10 warning(s), 0 info (2 groups)" in text


def test_tiny_shares_read_as_tiny_and_type_names_are_whole() -> None:
    s = Session.load(GOLDEN / "fp16_overflow.json")
    table = layer_table(s)
    assert "SensorRegressor" in table.split("\n")[-1]  # the root's type, not cut
    assert NONFINITE_HEADER in table and "nf a/g" not in table
    # A share of 4.9e-17 (one value in 2e16) reads "<0.001%", not "4.9e-15%".
    act = s.layer("act")
    tiny = dataclasses.replace(act, underflow_frac=4.9e-17)
    s = dataclasses.replace(s, layers=[tiny if x.name == "act" else x for x in s.layers])
    row = next(r for r in layer_table(s).splitlines() if r.startswith("act "))
    assert "<0.001%" in row and "e-" not in row, row


def test_an_all_nan_layer_reads_nan_not_zero() -> None:
    s = Session.load(GOLDEN / "fp16_overflow.json")
    norm = s.layer("norm")
    # What the summary holds for a layer whose every output was NaN: no finite value.
    nan_norm = dataclasses.replace(norm, absmax=0.0, headroom=math.inf, nonfinite_steps=2)
    s = dataclasses.replace(s, layers=[nan_norm if x.name == "norm" else x for x in s.layers])
    row = next(r for r in layer_table(s).splitlines() if r.startswith("norm "))
    cells = row.split()
    assert cells[3:5] == ["NaN", "NaN"], row


def test_the_markdown_puts_the_verdict_first() -> None:
    s = Session.load(GOLDEN / "anomaly_hidden_op.json")
    md = render_markdown(s)
    verdict = render_verdict(s)
    assert md.startswith(verdict)
    first = md.splitlines()[0]
    for part in ("`mlp.act`", "`aten.pow`", "hidden_op_overflow.py:63"):
        assert part in first
    assert "**Fix:** For aten.pow in mlp.act" in verdict
    # One block per finding, no squeezed many-column findings table.
    assert md.count("\n#### ") == len(group_findings(s.findings, s.layers))
    assert "| severity |" not in md


@pytest.mark.parametrize(("share", "text"), [
    (None, "-"), (0.0, "0%"), (1.0, "100%"), (4.9e-17, "<0.001%"), (3.4e-5, "0.0034%"),
    (0.0123, "1.23%"), (0.285, "28.5%"), (0.99999, ">99.9%"), (math.nan, "NaN"),
])
def test_pct(share: float | None, text: str) -> None:
    assert F.pct(share) == text


def test_numbers_scales_and_limits() -> None:
    assert F.num(None) == "-" and F.num(math.nan) == "NaN" and F.num(-math.inf) == "-inf"
    assert F.num(471.0) == "471" and F.num(3.67e-5) == "3.67e-05" and F.num(2e5) == "2.00e+05"
    assert F.scale(65536.0) == "65536" and F.scale(2.0**-20) == "2^-20"
    assert F.scale(16.0) == "16" and F.scale(None) == "-"
    assert F.limit(65504.0) == "65504" and F.limit(6.103515625e-05) == "6.10352e-05"
    assert F.bits(-math.inf) == "-inf" and F.bits(8.44) == "8.4" and F.bits(131.2) == "131"


def test_a_long_exception_message_is_one_short_line_in_the_report() -> None:
    # torch's dispatcher errors run to 8 KB (every backend's kernel listed): printed in
    # the report's header and again in run_ended_early, they pushed the findings off the
    # terminal (review 37). The report keeps the first line, cut; the traceback has it all.
    import torch
    from torch import nn

    import amp_doctor

    model = nn.Linear(4, 4)
    long = "the kernel is missing for this backend\n" + "\n".join(
        f"Backend{i}: registered at a/long/path/to/generated/file_{i}.cpp" for i in range(200))
    with pytest.raises(RuntimeError):
        with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(2, 4))
            raise RuntimeError(long)
    s = doctor.session
    assert s.run.error == ("RuntimeError: the kernel is missing for this backend ... "
                           "(see the traceback)")
    text = doctor.report()
    assert "Backend1" not in text and len(text) < 4000
    cut = F.error_line(ValueError("x" * 1000))
    assert cut == f"ValueError: {'x' * F.ERROR_CHARS} ... (see the traceback)"
    assert F.error_line(KeyError()) == "KeyError"


def test_a_run_that_ended_before_its_first_step_does_not_say_it_had_no_scaler() -> None:
    # Review 40: raise mode stopped a script at step 0, before it called the GradScaler
    # it had made; the header said "no GradScaler".
    from amp_doctor.sinks.text import summary_line

    s = Session.load(GOLDEN / "fp16_overflow.json")
    no_scaler = dataclasses.replace(s, amp=dataclasses.replace(s.amp, scaler=False))
    assert "| no GradScaler |" in summary_line(no_scaler)
    ended = dataclasses.replace(no_scaler, steps=0)
    assert "| no GradScaler used before the end |" in summary_line(ended)
    assert "GradScaler on" in summary_line(dataclasses.replace(s, steps=0))
    # A script that never imported torch: nothing was watched, at no sampling rate.
    unwatched = dataclasses.replace(ended, run=dataclasses.replace(s.run, every=0))
    assert summary_line(unwatched).endswith(f": nothing watched | {s.run.outcome}")
