"""The CUSTOM SCALARS "culprit headroom" chart shows an overflow to inf (headroom -inf).

TensorBoard cannot draw -inf, and the culprit is usually a culprit *because* its output
overflowed: the chart draws those steps at a documented floor, minus the format's
exponent range, and its title says so. Read back with TensorBoard's own reader.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import torch
from tensorboard.backend.event_processing import event_accumulator as ea_mod
from tensorboard.plugins.custom_scalar import layout_pb2

from amp_doctor.dtypes import limits
from amp_doctor.sinks import tb_session as tbv
from tests.helpers import console_script

AMP_DOCTOR = console_script()
SAMPLE = Path(__file__).parent.parent / "sample_models" / "fp16_activation_overflow.py"


def test_floor_is_minus_the_formats_exponent_range() -> None:
    f16, bf16 = limits(torch.float16), limits(torch.bfloat16)
    assert tbv.headroom_floor(f16) == -(16 + 24) == -40.0
    assert tbv.headroom_floor(bf16) == -(128 + 133) == -261.0
    assert tbv.culprit_headroom(-math.inf, f16) == -40.0
    assert tbv.culprit_headroom(-50.0, f16) == -40.0  # anything lower is clipped too
    assert tbv.culprit_headroom(-3.5, f16) == -3.5 and tbv.culprit_headroom(9.0, f16) == 9.0
    # No finite value to measure (all zero, all NaN): no point.
    assert tbv.culprit_headroom(math.inf, f16) is None
    assert tbv.culprit_headroom(math.nan, f16) is None


def test_diagnose_sample_draws_the_culprits_overflow(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    subprocess.run([AMP_DOCTOR, "diagnose", "-q", "--logdir", str(logdir), str(SAMPLE)],
                   check=True, capture_output=True, text=True, timeout=600,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    guidance = {ea_mod.SCALARS: 0, ea_mod.TENSORS: 0}
    acc = ea_mod.EventAccumulator(str(logdir), size_guidance=guidance).Reload()
    tags = acc.Tags()["scalars"]
    # proj overflows float16 on every recorded step (0 and 10): inf in its output.
    assert [(e.step, e.value) for e in acc.Scalars("culprits/proj/nonfinite")][0][1] > 0
    assert "headroom/proj" not in tags  # the per-layer chart stays honest: no stand-in
    assert [(e.step, e.value) for e in acc.Scalars("culprits/proj/headroom")] == [
        (0, -40.0), (10, -40.0)]
    # Its gradients were NaN/inf too: no headroom of their finite rest (21-33 bits of
    # "room" beside 2016 NaN of 2048, review 47b), the floor in the culprit's chart.
    assert "grad_headroom/proj" not in tags
    bad = [st for st, v in ((e.step, e.value) for e in acc.Scalars("grad_nonfinite/proj"))
           if v > 0]
    assert bad and [(e.step, e.value) for e in acc.Scalars("culprits/proj/grad_headroom")
                    if e.step in bad] == [(st, -40.0) for st in bad]
    # The chart that selects it says how it is drawn.
    # TensorBoard reads the run's last layout, written again at close.
    cfg = acc.Tensors("custom_scalars__config__")[-1]
    layout = layout_pb2.Layout.FromString(cfg.tensor_proto.string_val[0])
    charts = {ch.title: list(ch.multiline.tag) for c in layout.category for ch in c.chart}
    # One culprit: a chart of its own, named (review 56d).
    (title,) = [t for t, regex in charts.items() if regex == [r"^culprits/proj/headroom$"]]
    assert title.startswith("proj: ")
    assert "< 0 = overflow" in title and "inf/NaN outputs" in title and "-40 in float16" in title
