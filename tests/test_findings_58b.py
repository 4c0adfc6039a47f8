"""Session 58b: a GradScaler's lifecycle as the reports tell it.

* A loop that drops its GradScaler mid-run: the header's "GradScaler on until step N"
  (and the gradient-underflow finding's "only up to step N") is the last step the
  scaler worked in, every step seen, not the last *recorded* one (``--every 5`` said 5
  where the scaler's last step was 6).
* A new GradScaler taking over from the one named to ``watch(scaler=...)`` records its
  first step's loss as the loop computed it, not times the new scaler's scale.
* TensorBoard shows where a new GradScaler took over (``scaler/resets`` and a text note),
  so that the scale chart's jump back to ``init_scale`` is explained.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator as ea_mod
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn

import amp_doctor
from amp_doctor.records import Session
from amp_doctor.sinks import tb_session as tbv
from tests.helpers import console_script

# The script's steps with float16 autocast and a GradScaler, then model.half() and plain
# optimizer steps: with --every 5 the last recorded step with the scaler is 5, its last
# step 6.
SCALED_STEPS = 7
HALF_STEPS = 9
DROP_SCRIPT = f'''
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for i in range({SCALED_STEPS + HALF_STEPS}):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    if i < {SCALED_STEPS}:
        with torch.autocast("cpu", dtype=torch.float16):
            # A small loss: its float16 gradients underflow without a loss scale.
            loss = nn.functional.cross_entropy(model(x), y) * 1e-3
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        if i == {SCALED_STEPS}:
            model.half()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
        loss = nn.functional.cross_entropy(model(x.half()).float(), y) * 1e-3
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("loss", i, repr(loss.item()))
'''


def _diagnose(tmp: Path, script: str, every: int) -> tuple[str, str, Session]:
    """The script through the real CLI: its stdout, the text report and the JSON one."""
    (tmp / "train.py").write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    logdir = f"ad_every{every}"
    r = subprocess.run([console_script(), "diagnose", "-q", "--every", str(every),
                        "--logdir", logdir, "train.py"],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = (tmp / logdir / "report.txt").read_text()
    return r.stdout, report, Session.load(tmp / logdir / "amp_doctor.json")


@pytest.mark.parametrize("every", [1, 5])
def test_the_scalers_last_step_is_its_real_last_at_any_every(tmp_path: Path,
                                                              every: int) -> None:
    out, report, s = _diagnose(tmp_path, DROP_SCRIPT, every)
    assert s.steps == SCALED_STEPS + HALF_STEPS
    assert s.recorded_steps == len(range(0, s.steps, every))
    last = SCALED_STEPS - 1
    assert f"GradScaler on until step {last}, then none" in report.splitlines()[0]
    assert s.scaler is not None and s.scaler.last_step == last
    raw = json.loads((tmp_path / f"ad_every{every}" / "amp_doctor.json").read_text())
    assert raw["scaler"]["last_step"] == last
    under = s.findings_of("gradient_underflow")
    assert under
    for f in under:
        assert f"with the loss scale only up to step {last}:" in f.message, f.message
    # The loop ran as without amp-doctor's recording: every step's loss printed.
    assert len(re.findall(r"^loss \d+ ", out, re.M)) == s.steps


def test_a_scaler_used_to_the_end_was_not_dropped(tmp_path: Path) -> None:
    # The same script with no plain steps after the scaler's: no "until step".
    script = DROP_SCRIPT.replace(f"range({SCALED_STEPS + HALF_STEPS})",
                                 f"range({SCALED_STEPS})")
    _, report, s = _diagnose(tmp_path, script, 5)
    assert s.scaler is not None and s.scaler.last_step == SCALED_STEPS - 1
    assert "GradScaler on |" in report.splitlines()[0]


# -- a new scaler taking over from the one named to the watch ---------------------------

EPOCHS = 3
EPOCH_STEPS = 4


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _epochs(explicit: bool, watched: bool, logdir: Path | None = None,
            every: int = 1, opt_cls: type | None = None
            ) -> tuple[list[float], list[float], Session | None]:
    """A new GradScaler each epoch; ``explicit``: the first one named to the watch. The
    losses as the loop saw them, the final parameters' sums and the session."""
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stepped = opt if opt_cls is None else opt_cls(opt)
    g = torch.Generator().manual_seed(0)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 20) for _ in range(EPOCHS)]
    named = {"scaler": scalers[0], "optimizer": opt} if explicit else {}
    losses: list[float] = []
    w = amp_doctor.watch(model, every=every, tensorboard=logdir is not None,
                         **({"logdir": logdir} if logdir is not None else {}),
                         **named) if watched else None
    try:
        for scaler in scalers:
            for _ in range(EPOCH_STEPS):
                with torch.autocast("cpu", dtype=torch.float16):
                    # x100: each new scaler backs off from 2**20 a few times.
                    loss = model(torch.randn(16, 8, generator=g)).float().pow(2).mean() * 100
                stepped.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(stepped)
                scaler.update()
                losses.append(loss.item())
    finally:
        if w is not None:
            w.close()
    sums = [float(p.detach().double().sum()) for p in model.parameters()]
    return losses, sums, (w.session if w is not None else None)


@pytest.mark.parametrize("explicit", [True, False])
def test_a_new_scalers_first_step_keeps_its_loss(tmp_path: Path, explicit: bool) -> None:
    losses, sums, s = _epochs(explicit, watched=True, logdir=tmp_path)
    assert s is not None and s.scaler is not None
    assert (losses, sums) == _epochs(explicit, watched=False)[:2]
    starts = list(range(EPOCH_STEPS, EPOCHS * EPOCH_STEPS, EPOCH_STEPS))
    assert [r.step for r in s.scaler.resets] == starts
    # Read back from the JSON report: every step's loss is the one the loop computed
    # (the takeover steps' were the loss times 2**20 with a named scaler).
    loaded = Session.load(tmp_path / "amp_doctor.json")
    recorded = {r.step: r.loss for r in loaded.history}
    assert sorted(recorded) == list(range(len(losses)))
    for step, loss in recorded.items():
        assert loss is not None and math.isclose(loss, losses[step], rel_tol=1e-6), (
            step, loss, losses[step])


# -- TensorBoard -------------------------------------------------------------------------

def _load(logdir: Path) -> ea_mod.EventAccumulator:
    guidance = {ea_mod.SCALARS: 0, ea_mod.TENSORS: 0}
    return ea_mod.EventAccumulator(str(logdir), size_guidance=guidance).Reload()


def _scalars(acc: ea_mod.EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _scaler_charts(acc: ea_mod.EventAccumulator) -> dict[str, list[str]]:
    proto = layout_pb2.Layout()
    # TensorBoard reads the run's last layout, written again at close.
    proto.ParseFromString(acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    (cat,) = [c for c in proto.category if c.title == "Scaler"]
    return {ch.title: list(ch.multiline.tag) for ch in cat.chart}


class _WrappedOptimizer:
    """No ``torch.optim.Optimizer`` (as Accelerate's wrapper): GradScaler's skip of it is
    read from the device at the end, so the scaler charts are written at close."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.optimizer = opt

    @property
    def param_groups(self) -> list[dict[str, object]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> object:
        return self.optimizer.state

    def step(self, closure: object = None) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


@pytest.mark.parametrize(("every", "wrapped"), [(1, False), (5, False), (1, True)])
def test_tensorboard_marks_each_new_scaler(tmp_path: Path, every: int, wrapped: bool) -> None:
    losses, sums, s = _epochs(False, watched=True, logdir=tmp_path, every=every,
                              opt_cls=_WrappedOptimizer if wrapped else None)
    assert s is not None and s.scaler is not None
    starts = list(range(EPOCH_STEPS, EPOCHS * EPOCH_STEPS, EPOCH_STEPS))
    assert [r.step for r in s.scaler.resets] == starts
    acc = _load(tmp_path)
    resets = _scalars(acc, "scaler/resets")
    # One point a step, like the scale's; the count rises exactly where a new scaler
    # took over, where the scale jumps back to its init_scale.
    assert [st for st, _ in resets] == list(range(len(losses)))
    rises = [st for (st, v), (_, before) in zip(resets[1:], resets[:-1], strict=True)
             if v > before]
    assert rises == starts
    assert resets[-1][1] == len(starts)
    scale = dict(_scalars(acc, "scaler/scale"))
    assert all(scale[st] > scale[st - 1] for st in starts)
    charts = _scaler_charts(acc)
    assert charts[tbv.RESETS_TITLE] == [r"^scaler/resets$"]
    (note,) = acc.Tensors("scaler_resets/text_summary")
    assert note.step == starts[0]
    text = note.tensor_proto.string_val[0].decode()
    assert f"GradScaler replaced {len(starts)} times" in text
    assert [int(m) for m in re.findall(r"^\* step (\d+): ", text, re.M)] == starts
    # Each new scaler's backoffs are a note of their own, not the old scaler's episode
    # going on across the takeover.
    notes = {e.step for e in acc.Tensors("backoffs/text_summary")}
    assert set(starts) <= notes
    assert (losses, sums) == _epochs(False, watched=False,
                                     opt_cls=_WrappedOptimizer if wrapped else None)[:2]


def test_one_scaler_for_the_run_has_no_reset_chart(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, logdir=tmp_path):
        for _ in range(EPOCH_STEPS):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    acc = _load(tmp_path)
    assert {v for _, v in _scalars(acc, "scaler/resets")} == {0.0}
    assert tbv.RESETS_TITLE not in _scaler_charts(acc)
    assert "scaler_resets/text_summary" not in acc.Tags()["tensors"]
