"""``watch(model, fp32=[...])``: chosen modules run in float32 under autocast."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import amp_doctor
from amp_doctor.errors import AmpDoctorError
from amp_doctor.hooks.fp32 import Fp32Islands
from tests.helpers import console_script

SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"


def _sample(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train_overflow(steps: int = 4, fp32: tuple[str, ...] | None = None,
                    autocast: bool = True) -> tuple[list[float], amp_doctor.Session | None]:
    """The fp16_activation_overflow sample's loop, optionally under watch(fp32=...)."""
    s = _sample("fp16_activation_overflow")
    torch.manual_seed(0)
    model = s.SensorRegressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    doctor = amp_doctor.watch(model, every=1, fp32=fp32) if fp32 is not None else None
    losses = []
    try:
        for _ in range(steps):
            x, y = s.make_batch(torch.device("cpu"), 64)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    finally:
        session = doctor.close() if doctor is not None else None
    return losses, session


def test_forcing_the_overflowing_layer_removes_the_overflow() -> None:
    plain, _ = _train_overflow()
    assert all(math.isnan(v) for v in plain)  # the pathology is real
    forced, session = _train_overflow(fp32=("proj",))
    assert session is not None
    assert all(math.isfinite(v) for v in forced)
    assert session.run.fp32_modules == ["proj"]
    proj = session.layer("proj")
    assert proj.output_dtypes == ["float32"]  # it really ran in float32
    assert proj.overflow_frac > 0 and proj.what_if  # and float16 would still overflow
    # The layers around it still ran in float16.
    assert session.layer("inp").output_dtypes == ["float16"]
    assert session.layer("head").output_dtypes == ["float16"]
    assert not [f for f in session.findings if f.severity == "error"]


def test_patterns_are_globs_over_report_names_and_ancestors_win() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    islands = Fp32Islands(["0*", "1"])
    assert islands.attach("", model) == ["0", "1"]  # "0.0" and "0.1" are inside "0"
    assert islands.matched == {"0*": ["0", "0.0", "0.1"], "1": ["1"]}
    islands.remove()
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks


def test_diagnose_says_an_unmatched_pattern_after_the_first_step(tmp_path: Path) -> None:
    # Under diagnose the models are found as the script runs: a typo in --fp32 was said
    # only after the whole run had trained without the fix (review 36). It is said once
    # the first step is recorded; the run goes on, and ends with the error and exit 2.
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "scaler = torch.amp.GradScaler('cpu')\n"
        "for i in range(4):\n"
        "    with torch.autocast('cpu', dtype=torch.float16):\n"
        "        loss = model(torch.randn(4, 8)).float().pow(2).mean()\n"
        "    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()\n"
        "    print(f'step {i} done', file=sys.stderr, flush=True)\n")
    proc = subprocess.run([console_script(), "diagnose", "-q", "--no-tensorboard", "--fp32",
                           "2x", "--logdir", "ad", str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    err = proc.stderr
    early = err.index("amp-doctor: warning: --fp32 pattern '2x' matches no layer")
    assert early < err.index("step 1 done")  # said during the run, after step 0
    assert "The run goes on without it and will end with exit code 2" in err
    assert err.rstrip().splitlines()[-1].startswith(
        "amp-doctor: error: --fp32 pattern '2x' matches no layer (near names: 2")
    # The saved run says so too: no clean float32 trial for `report` or `compare` to read
    # (review 55: "AMP looks healthy", exit code 0 in its JSON).
    saved = json.loads((tmp_path / "ad" / "amp_doctor.json").read_text())
    assert saved["run"]["exit_code"] == 2
    assert [f["kind"] for f in saved["findings"]][:1] == ["fp32_unmatched"]
    assert saved["findings"][0]["severity"] == "error"
    text = (tmp_path / "ad" / "report.txt").read_text()
    assert "This run is not the float32 trial it was asked to be: --fp32 pattern '2x'" in (
        " ".join(text.split()))


def test_an_exact_name_with_glob_characters_matches_itself() -> None:
    # A model found in a list is named enc[0]; as a glob, "[0]" is a character class, so
    # the name the report printed matched nothing.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    islands = Fp32Islands(["enc[0]"])
    assert islands.attach("enc[0]", model) == ["enc[0]"]
    islands.remove()


def test_an_unmatched_pattern_is_a_one_line_error_with_near_names() -> None:
    s = _sample("fp16_activation_overflow")
    model = s.SensorRegressor()
    with pytest.raises(AmpDoctorError) as e:
        amp_doctor.watch(model, fp32=["prj"])
    msg = str(e.value)
    assert "'prj' matches no layer" in msg and "near names: proj" in msg
    assert "\n" not in msg
    # Nothing was left installed by the refused watch.
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_without_autocast_forcing_changes_nothing() -> None:
    plain, _ = _train_overflow(autocast=False)
    forced, _ = _train_overflow(fp32=("proj",), autocast=False)
    assert plain == forced  # bit-identical: there was no autocast to turn off


def test_inputs_are_cast_up_and_autocast_is_restored_after_the_module() -> None:
    seen: dict[str, object] = {}

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["dtype_in"] = x.dtype
            seen["autocast_in"] = torch.is_autocast_enabled("cpu")
            return x * 2

    model = nn.Sequential(nn.Linear(4, 4), Probe(), nn.Linear(4, 4))
    islands = Fp32Islands(["1"])
    islands.attach("", model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(2, 4))
            assert torch.is_autocast_enabled("cpu")
    finally:
        islands.remove()
    assert seen == {"dtype_in": torch.float32, "autocast_in": False}
    assert out.dtype == torch.bfloat16  # the next Linear still ran under autocast


def test_a_copied_or_saved_model_runs_unforced(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    islands = Fp32Islands(["0"])
    islands.attach("", model)
    try:
        twin = copy.deepcopy(model)
        torch.save(model, tmp_path / "m.pt")
        loaded = torch.load(tmp_path / "m.pt", weights_only=False)
        x = torch.randn(2, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model[0](x).dtype == torch.float32
            assert twin[0](x).dtype == torch.bfloat16
            assert loaded[0](x).dtype == torch.bfloat16
    finally:
        islands.remove()


def test_low_precision_weights_are_refused_not_broken() -> None:
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4))
    islands = Fp32Islands(["*"])
    # The root and "0" hold bfloat16 weights: autocast off would not make them float32.
    assert islands.attach("", model) == ["1"]
    assert islands.refused == ["Sequential", "0"]
    islands.remove()
