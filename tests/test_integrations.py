"""The Hugging Face ``Trainer`` and Lightning callbacks, run in-process on tiny models.

The training scripts are the acceptance suite's (tests/acceptance/scripts), called here as
functions with the callback added, so that the callback's report can be compared with
``amp-doctor diagnose`` on the very same script: same layers, dtype, finding kinds, steps.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from amp_doctor import Session
from amp_doctor.steps.scaler import patches_installed
from tests.helpers import console_script

SCRIPTS = Path(__file__).parent / "acceptance" / "scripts"
STEPS = 6


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"acc_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _diagnose(tmp: Path, script: str, *args: str) -> Session:
    """The same script through the real CLI, in a subprocess."""
    out = tmp / "cli"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([console_script(), "diagnose", "-q", "--every", "1", "--logdir", "ad",
                        str(SCRIPTS / f"{script}.py"), *args],
                       cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return Session.load(out / "ad" / "amp_doctor.json")


def _kinds(s: Session) -> list[tuple[str, str]]:
    return sorted((f.severity, f.kind) for f in s.findings)


def _same_report(cb: Session, cli: Session) -> None:
    assert cb.steps == cli.steps and cb.recorded_steps == cli.recorded_steps
    assert {lay.name for lay in cb.layers} == {lay.name for lay in cli.layers}
    assert cb.amp == cli.amp
    assert _kinds(cb) == _kinds(cli)


# -- optional imports ---------------------------------------------------------------------

def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[1])


def test_import_amp_doctor_imports_no_framework() -> None:
    r = _python("import sys, amp_doctor, amp_doctor.integrations, amp_doctor.cli\n"
                "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning',"
                " 'accelerate') if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize(("module", "blocked", "package"), [
    ("transformers", "transformers", "transformers"),
    ("lightning", "lightning", "lightning"),
])
def test_integration_without_its_framework_says_what_to_install(
        module: str, blocked: str, package: str) -> None:
    # A real import failure: a meta-path finder that refuses the framework, as when it
    # is not installed.
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ({blocked!r}, 'pytorch_lightning'):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
try:
    import amp_doctor.integrations.{module}
except ImportError as e:
    print(str(e))
"""
    r = _python(code)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout
    assert f"pip install {package}" in lines[0]
    assert f"amp_doctor.integrations.{module}" in lines[0]


# -- Hugging Face Trainer -----------------------------------------------------------------

@pytest.fixture()
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    return tmp_path


def test_hf_callback_writes_report_and_matches_diagnose(in_tmp: Path) -> None:
    from amp_doctor.integrations.transformers import AmpDoctorCallback

    hf = _script("hf_trainer")
    cb = AmpDoctorCallback(every=1)
    trainer = hf.main(["--steps", str(STEPS), "--precision", "bf16", "--out_dir", "out"],
                      callbacks=[cb])
    assert not patches_installed()
    logdir = in_tmp / "out" / "amp_doctor"
    assert cb.logdir == logdir
    s = Session.load(logdir / "amp_doctor.json")
    assert (logdir / "report.txt").read_text().startswith("amp-doctor")
    assert any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())
    assert s.steps == STEPS and s.recorded_steps == STEPS and s.run.outcome == "completed"
    assert not s.amp.scaler and s.amp.device_type == "cpu"
    assert "transformer.h.1.mlp.c_fc" in {lay.name for lay in s.layers}
    # The one-line summary sits in the Trainer's logs; log_history[-1] is still the metrics.
    history = trainer.state.log_history
    assert "train_runtime" in history[-1]
    (entry,) = [h for h in history if "amp_doctor" in h]
    assert entry["amp_doctor"] == cb.summary and entry["step"] == STEPS
    assert f"{STEPS} steps" in cb.summary and str(logdir / "report.txt") in cb.summary
    _same_report(s, _diagnose(in_tmp, "hf_trainer", "--steps", str(STEPS), "--precision",
                              "bf16", "--out_dir", "out"))


def test_hf_callback_finds_accelerates_autocast(in_tmp: Path) -> None:
    from amp_doctor.integrations.transformers import AmpDoctorCallback

    cb = AmpDoctorCallback(every=1)
    _script("hf_trainer").main(["--steps", "2", "--precision", "bf16", "--out_dir", "out"],
                               callbacks=[cb])
    assert cb.session is not None
    assert cb.session.amp.dtype == "bfloat16" and cb.session.amp.autocast_seen


def test_hf_callback_takes_the_scaler_from_acceleratedoptimizer() -> None:
    """fp16 on a GPU: Accelerate's optimizer wrapper carries the GradScaler."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from amp_doctor.integrations.transformers import _scaler_and_optimizer

    # The wrapper reads Accelerate's process-wide state: made here (as a Trainer
    # would), so that this test passes alone as well as after the Trainer tests.
    Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    wrapped = AcceleratedOptimizer(inner, device_placement=False, scaler=scaler)
    assert _scaler_and_optimizer(wrapped) == (scaler, inner)
    assert _scaler_and_optimizer(inner) == (None, inner)


class _Boom(Exception):
    pass


def test_hf_callback_closes_the_watch_when_training_raises(in_tmp: Path) -> None:
    from transformers import TrainerCallback

    from amp_doctor.integrations.transformers import AmpDoctorCallback

    class Crash(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3:
                raise _Boom("the data loader died")

    cb = AmpDoctorCallback(every=1)
    with pytest.raises(_Boom):
        _script("hf_trainer").main(["--steps", str(STEPS), "--out_dir", "out"],
                                   callbacks=[Crash(), cb])
    # transformers has no exception event: the watch is still on until the callback goes.
    assert patches_installed()
    logdir = cb.logdir
    assert logdir is not None
    del cb
    gc.collect()
    assert not patches_installed()
    s = Session.load(logdir / "amp_doctor.json")
    assert s.run.outcome == "exception" and s.steps == 3
    # The text report too, as the callback writes it when closed (review 56c).
    assert (logdir / "report.txt").read_text().startswith("amp-doctor")
    assert "| exception" in (logdir / "report.txt").read_text().splitlines()[0]


def test_hf_callback_closed_in_except_records_the_exception(in_tmp: Path) -> None:
    # Review 56c: `callback.close()` in the user's `except`, as the README says, recorded
    # the crashed train() as completed, and left `summary` None.
    from transformers import TrainerCallback

    from amp_doctor.integrations.transformers import AmpDoctorCallback

    class Crash(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2:
                raise _Boom("the data loader died")

    cb = AmpDoctorCallback(every=1)
    try:
        _script("hf_trainer").main(["--steps", str(STEPS), "--out_dir", "out"],
                                   callbacks=[Crash(), cb])
    except _Boom:
        s = cb.close()
    assert not patches_installed()
    assert s is not None and s.run.outcome == "exception" and s.steps == 2
    assert s.run.error == "_Boom: the data loader died"
    assert cb.summary is not None and "| exception |" in cb.summary
    assert cb.logdir is not None and (cb.logdir / "report.txt").is_file()


# -- Lightning ----------------------------------------------------------------------------

@pytest.mark.parametrize(("precision", "dtype", "scaler"), [
    ("16-mixed-plugin", "float16", True),
    ("bf16-mixed", "bfloat16", False),
])
def test_lightning_callback_writes_report_and_matches_diagnose(
        in_tmp: Path, precision: str, dtype: str, scaler: bool) -> None:
    from amp_doctor.integrations.lightning import AmpDoctor

    pl = _script("lightning_train")
    cb = AmpDoctor(every=1)
    args = ["--steps", str(STEPS), "--precision", precision, "--root", "out"]
    trainer = pl.main(args, callbacks=[cb])
    assert not patches_installed()
    plugin_scaler = trainer.precision_plugin.scaler
    assert (plugin_scaler is not None) == scaler
    logdir = (Path(trainer.log_dir) / "amp_doctor").absolute()
    assert cb.logdir == logdir and logdir.is_relative_to(in_tmp / "out")
    s = Session.load(logdir / "amp_doctor.json")
    assert (logdir / "report.txt").is_file()
    assert s.steps == STEPS and s.recorded_steps == STEPS and s.run.outcome == "completed"
    assert s.amp.dtype == dtype and s.amp.autocast_seen and s.amp.scaler == scaler
    if scaler:
        # The plugin's own scaler was watched: its scale is the report's.
        assert s.scaler is not None
        assert s.scaler.scale[-1][1] == plugin_scaler.get_scale()
    assert [(sev, k) for sev, k in _kinds(s) if sev != "info"] == []
    assert cb.summary is not None and f"{STEPS} steps" in cb.summary
    _same_report(s, _diagnose(in_tmp, "lightning_train", *args))


def test_lightning_callback_closes_on_exception(in_tmp: Path) -> None:
    import lightning as L

    from amp_doctor.integrations.lightning import AmpDoctor

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any, **kw: Any) -> None:
            if trainer.global_step == 3:
                raise _Boom("a metric blew up")

    cb = AmpDoctor(every=1)
    with pytest.raises(_Boom):
        _script("lightning_train").main(
            ["--steps", str(STEPS), "--precision", "bf16-mixed", "--root", "out"],
            callbacks=[Crash(), cb])
    assert not patches_installed()  # on_exception closed it at once
    assert cb.session is not None and cb.logdir is not None
    s = Session.load(cb.logdir / "amp_doctor.json")
    assert s.run.outcome == "exception" and "a metric blew up" in (s.run.error or "")
    assert s.steps == 3


def test_lightning_training_step_calling_a_submodule_is_checked(in_tmp: Path) -> None:
    # Most LightningModules' training_step calls self.net(x) or self.model(x): the
    # LightningModule's own forward never runs. Before: a NaN batch trained on NaN
    # losses with "Findings: none" and the device unknown.
    import lightning as L

    from amp_doctor.integrations.lightning import AmpDoctor

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                           torch.nn.Linear(32, 3))

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    L.seed_everything(0, verbose=False)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    x[40] = math.nan  # batch 5
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    cb = AmpDoctor(anomaly=True)
    L.Trainer(max_epochs=1, accelerator="cpu", precision="bf16-mixed", callbacks=[cb],
              logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=str(in_tmp)).fit(Net(), data)
    assert cb.session is not None
    s = cb.session
    assert s.amp.device_type == "cpu" and s.steps == 8
    assert [(f.kind, f.module, f.step) for f in s.findings if f.severity == "error"] == [
        ("nonfinite_input", "net", 5)]


def test_a_lightning_gan_with_manual_optimization_is_one_step_per_iteration(
        in_tmp: Path) -> None:
    # One LightningModule holding a generator and a discriminator, each with its own
    # optimizer, stepped by hand in training_step. Before: the discriminator's update
    # ended each step, the generator's backward fell into the next one (its layers had
    # no gradient figures, and an extra step appeared), and Lightning's own
    # manual_backward, which it runs inside autocast, was warned about on every step.
    import lightning as L

    from amp_doctor.integrations.lightning import AmpDoctor

    class GAN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.G = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 8))
            self.D = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 1))

        def training_step(self, batch: Any, i: int) -> None:
            og, od = self.optimizers()  # type: ignore[misc]
            x = batch[0]
            fake = self.G(torch.randn(x.shape[0], 4))
            ld = (torch.nn.functional.softplus(-self.D(x)).mean()
                  + torch.nn.functional.softplus(self.D(fake.detach())).mean())
            od.zero_grad()
            self.manual_backward(ld)
            od.step()
            lg = torch.nn.functional.softplus(-self.D(fake)).mean()
            og.zero_grad()
            self.manual_backward(lg)
            og.step()

        def configure_optimizers(self) -> Any:
            return [torch.optim.Adam(self.G.parameters(), 1e-3),
                    torch.optim.Adam(self.D.parameters(), 1e-3)]

    L.seed_everything(0, verbose=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 8)),
                                       batch_size=8)
    cb = AmpDoctor(every=1)
    L.Trainer(max_epochs=1, accelerator="cpu", precision="bf16-mixed", callbacks=[cb],
              logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=str(in_tmp)).fit(GAN(), data)
    s = cb.session
    assert s is not None
    assert (s.steps, s.recorded_steps) == (6, 6)
    assert all(r.layers["G.0"].grad is not None and r.layers["G.0"].param_grad is not None
               for r in s.history)
    assert not s.findings_of("backward_in_autocast")
