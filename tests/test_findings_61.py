"""Session 61: gradients the loop changes between ``scaler.unscale_`` and ``scaler.step``;
a run-long finding's first step; a frozen part called in a validation loop.

GradScaler looks for NaN/inf inside ``unscale_`` only. A DP-SGD-style loop that adds
noise to ``.grad`` after it (or a custom clip) can make the gradients NaN there: the
scaler's step does not skip, the update takes them, and every weight is NaN from the next
step on. amp-doctor said "the loss was NaN from step 1, where it appeared is unknown", an
error with nothing to fix; the step that did it, and what did it, were not named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_doctor
from tests.helpers import diagnose_pair, marked_line

_NOISE_SCRIPT = '''
import sys
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
SIGMA = float(sys.argv[1])  # the noise's scale at step AT (nan: a sigma computed as 0/0)
AT = int(sys.argv[2]) if len(sys.argv) > 2 else 0
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    x = torch.randn(4, 8)
    y = torch.randint(0, 3, (4,))
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for p in model.parameters():
        p.grad = p.grad + torch.randn_like(p.grad) * (SIGMA if step == AT else 0.01)
    scaler.step(opt)
    scaler.update()
    print(step, float(loss.detach()))
print("params", sum(float(p.detach().double().sum()) for p in model.parameters()))
'''


def test_nan_noise_added_after_unscale_is_named_at_its_step(tmp_path: Path) -> None:
    plain, r, report = diagnose_pair(tmp_path, "noise.py", _NOISE_SCRIPT, ["nan"])
    assert r.stdout.startswith(plain) and "params nan" in plain
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["step"]) for f in errors] == [("nonfinite_grads_applied", 0)]
    err = errors[0]
    # All four parameter gradients, the first layer's first.
    assert err["data"]["after_unscale"] is True and err["data"]["grads_bad"] == 4
    assert err["module"] == "0"
    assert "unscale_" in err["message"] and "unscale_" in err["advice"]
    assert "GradScaler:" not in err["advice"]  # not "add a scaler" to a loop with one
    # Review 60a: no FP8 what-if table beside an error of this format.
    text = (tmp_path / "out" / "report.txt").read_text()
    assert "FP8 readiness (simulated) is left out" in text
    assert "FP8 readiness, simulated" not in text
    # What the NaN weights made next is the error's, not a cause of its own.
    loss = next(f for f in report["findings"] if f["kind"] == "nonfinite_loss")
    assert loss["severity"] == "info" and loss["step"] == 1
    assert "nonfinite_grads_applied" in loss["advice"]


def test_nan_noise_after_unscale_in_a_step_not_recorded_is_named_too(tmp_path: Path) -> None:
    # Review 61b: at step 3 (every=10 records 0 and 10) the NaN loss from step 4 on was
    # charged to layer 2 ("an op in its own forward code made it"), with `--fp32 2` next.
    plain, r, report = diagnose_pair(tmp_path, "noise.py", _NOISE_SCRIPT, ["nan", "3"])
    assert r.stdout.startswith(plain) and "params nan" in plain
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["step"], f["module"]) for f in errors] == [
        ("nonfinite_grads_applied", 3, None)]
    assert errors[0]["data"]["unrecorded"] is True
    assert "--fp32" not in r.stderr
    loss = next(f for f in report["findings"] if f["kind"] == "nonfinite_loss")
    assert loss["severity"] == "info" and loss["step"] == 4


def test_finite_noise_after_unscale_and_clipping_is_no_finding(tmp_path: Path) -> None:
    plain, r, report = diagnose_pair(tmp_path, "noise.py", _NOISE_SCRIPT, ["0.01"],
                                     "--every", "1")
    assert r.stdout.startswith(plain) and "params nan" not in plain
    assert report["recorded_steps"] == 6
    assert not [f for f in report["findings"] if f["severity"] == "error"]
    assert not [f for f in report["findings"] if f["kind"] == "nonfinite_grads_applied"]
    text = (tmp_path / "out__every1" / "report.txt").read_text()
    assert "FP8 readiness, simulated" in text  # a healthy run's next step


def test_a_run_long_overflow_finding_says_when_it_began() -> None:
    # Review 60b: "activation_overflow proj" stood for the whole run with no step: a user
    # could not tell whether it began at step 0 or late in training. From step 3 on the
    # batch (within float16's range) makes the first layer's output pass its max.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight.fill_(2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(6):
            x = torch.randn(16, 8).abs() * (1e4 if step >= 3 else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = w.session
    first = {lay.name: lay.first_overflow_step for lay in s.layers}
    assert first["0"] == 3 and first["1"] == 3
    f = next(f for f in s.findings if f.kind == "activation_overflow" and f.module == "0")
    assert "first at step 3" in f.message, f.message


# A frozen backbone the loop calls itself (under no_grad) in training, and again in a
# validation pass in eval mode, whose outlier batch overflows float16 there only.
_VALIDATION_SCRIPT = """import torch
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)
class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        s.head = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5))
model = Net()
for p in model.backbone.parameters():
    p.requires_grad_(False)
opt = torch.optim.SGD(model.head.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(12):
    model.train()
    x = torch.randn(16, 16); y = torch.randint(0, 5, (16,))
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            feats = model.backbone(x)
        loss = nn.functional.cross_entropy(model.head(feats).float(), y)
    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    if step % 5 == 4:
        model.eval()  # validation: an outlier batch whose features overflow float16
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            vf = model.backbone(torch.randn(16, 16) * 3e4)
            acc = (model.head(vf).argmax(-1) == 0).float().mean()
        print("val", step, bool(torch.isfinite(vf).all()))
print("params", sum(float(p.detach().double().sum()) for p in model.parameters()))
"""


def test_a_frozen_parts_validation_call_is_not_the_training_steps_work(
        tmp_path: Path) -> None:
    # Review 60b: session 60 made a frozen part's no_grad call the step's work (a
    # backbone feeding the head); the same call in a validation loop was filed too, and
    # its outlier batch read as an activation_overflow error of training.
    plain, r, report = diagnose_pair(tmp_path, "val.py", _VALIDATION_SCRIPT, [],
                                     "--every", "1")
    assert r.stdout.startswith(plain) and "val 4 False" in plain  # it did overflow
    assert report["recorded_steps"] == 12
    assert not report["findings"], [f["kind"] for f in report["findings"]]
    # The training calls are recorded, with the training batches' range.
    layers = {lay["name"]: lay for lay in report["layers"]}
    assert layers["backbone.0"]["recorded_steps"] == 12
    assert layers["backbone.0"]["absmax"] < 100


# An actor-critic whose actor method takes a float16 exp under a tanh (its forward stays
# finite, its backward is 0 x inf = NaN) from step 20 on, when the observations grow: the
# critic's Linear meets the NaN gradients first in backward.
_EXP_IN_A_METHOD = '''
import torch
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)
class AC(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.pi = nn.Linear(32, 4)
        self.v = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    def actor(self, obs):
        h = self.trunk[0](obs)
        e = torch.exp(h)  # exp
        return self.pi(self.trunk[3](self.trunk[2](torch.tanh(e))))
    def critic(self, obs):
        return self.v(obs)
model = AC()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(40):
    obs = torch.randn(16, 8) * (20 if step >= 20 else 1)
    act = torch.randint(0, 4, (16,))
    ret = torch.randn(16)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model.actor(obs)
        v = model.critic(obs).squeeze(-1)
        lp = torch.log_softmax(logits.float(), -1).gather(1, act[:, None]).squeeze(1)
        adv = (ret - v.float()).detach()
        loss = -(lp * adv).mean() + 0.5 * (ret - v.float()).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("scale", scaler.get_scale())
print("params", sum(float(p.detach().double().sum()) for p in model.parameters()))
'''


def test_a_collapse_below_one_is_the_forward_ops_the_search_found(tmp_path: Path) -> None:
    # Review 60b: two errors that contradicted each other: scale_collapse charged to the
    # critic's v.2 (the first layer the NaN gradients met in backward), and the actor's
    # exp that made them. One cause, one error: the exp, with the collapse its consequence.
    plain, r, report = diagnose_pair(tmp_path, "ac.py", _EXP_IN_A_METHOD, [], "--anomaly")
    assert r.stdout.startswith(plain) and "scale 0.0625" in plain
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["op"]) for f in errors] == [("nonfinite_forward", "aten.exp")]
    line = marked_line(str(tmp_path / "ac.py"), "exp")
    assert errors[0]["frame"].endswith(f"ac.py:{line} in actor"), errors[0]["frame"]
    collapse = next(f for f in report["findings"] if f["kind"] == "scale_collapse")
    assert collapse["severity"] == "info" and "aten.exp" in collapse["advice"]
    assert any("collapsed" in c for c in errors[0]["data"]["consequences"])


# A frozen feature extractor and a trained head, two models; from step 13 on the batch
# (finite, within float16's range) makes the backbone's last Linear overflow float16.
_FROZEN_BACKBONE = '''
import torch
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)
backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
head = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5))
for p in backbone.parameters():
    p.requires_grad_(False)
with torch.no_grad():
    backbone[2].weight.mul_(40.0)
opt = torch.optim.SGD(head.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(24):
    x = torch.randn(16, 16) * (5000.0 if step >= 13 else 1.0)
    y = torch.randint(0, 5, (16,))
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            feats = backbone(x)
        loss = nn.functional.cross_entropy(head(feats).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("scale", scaler.get_scale())
'''


def test_a_feature_extractors_overflow_is_not_advised_as_a_prediction(tmp_path: Path) -> None:
    # Review 60b: the backbone returns its model's output, so its overflow got the output
    # head's advice ("standardise the regression targets"); the head takes that output.
    plain, r, report = diagnose_pair(tmp_path, "fb.py", _FROZEN_BACKBONE, [])
    assert r.stdout.startswith(plain)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["module"]) for f in errors] == [("activation_overflow", "backbone.2")]
    assert "targets" not in errors[0]["advice"] and "float32" in errors[0]["advice"]
    # It began at step 13; every=10 recorded 20 first (review 61b: "first at step 20").
    assert "first recorded at step 20" in errors[0]["message"]
    layers = {lay["name"]: lay for lay in report["layers"]}
    assert layers["backbone.2"]["model_output"] and "head.0" in layers["backbone.2"]["consumers"]


class _Float32Block(nn.Module):
    """A block kept in float32 whose output goes inf (by float32's own max) at step 2."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.lin(x.float()) * self.gain


def test_the_table_stars_no_real_overflow_of_a_float32_layer() -> None:
    # Review 60b: '*' marks a what-if (a float32 layer's values as if cast to float16); a
    # float32 output that held inf itself showed its overflow starred all the same.
    from amp_doctor.sinks.text import layer_table

    torch.manual_seed(0)
    block = _Float32Block()
    model = nn.Sequential(nn.Linear(8, 8), block, nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(4):
            block.gain = 1e39 if step == 2 else 1.0
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = w.session
    lay = next(lay for lay in s.layers if lay.name == "1")
    assert lay.what_if and lay.nonfinite_steps == 1 and lay.overflow_frac > 0.5
    row = next(line.split() for line in layer_table(s).splitlines() if line.startswith("1 "))
    assert row[5].endswith("%") and row[6].endswith("%*"), row  # overflow real, underflow what-if


class _ZeroNorm(nn.Module):
    """y / its norm with an epsilon float16 rounds to 0: 0/0 = NaN, y being all zero (a
    dead input); its backward sends NaN to the layers before it (NaN x 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 0.0
        return y / (y.pow(2).mean(-1, keepdim=True) + 1e-8).sqrt()


def test_the_layer_where_nan_began_leads_the_table() -> None:
    # Review 61a: a PixelNorm whose eps is 0 in float16 made NaN (no overflow, only NaN);
    # the layers before it, whose gradients were NaN, ranked above it, the origin 8th.
    from amp_doctor.analysis.risk import risk_order

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), _ZeroNorm(),
                          nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                p.grad.nan_to_num_(0.0)  # the weights stay finite
            opt.step()
    s = w.session
    lay = {x.name: x for x in s.layers}
    assert lay["3"].overflow_origin_steps == 3 and lay["3"].overflow_frac == 0
    assert lay["0"].grad_nonfinite_steps == 3 and lay["0"].nonfinite_steps == 0
    assert risk_order(list(s.layers))[0].name == "3"


class _ExpAttention(nn.Module):
    """Causal attention with a -inf mask and a hand-written softmax without the max
    subtracted: float16's exp overflows past 11.1 on the unmasked scores."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).split(8, -1)
        att = (q @ k.transpose(-2, -1)).masked_fill(
            ~torch.tril(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool)), float("-inf"))
        e = torch.exp(att)
        return (e / e.sum(-1, keepdim=True)) @ x


@pytest.mark.parametrize("gain", [3.0, 12.0])
def test_anomaly_mode_names_an_overflow_beside_a_minus_inf_mask(gain: float) -> None:
    # Review 61a: the exp's inputs held the mask's -inf, so its +inf was taken for one
    # passed on: "saw no op make NaN/Inf", and raise mode did not stop. Review 61c: past
    # x = 88.7 float32 overflows too, and "compute it in float32" does not help.
    torch.manual_seed(0)
    model = nn.Sequential(_ExpAttention(), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].qk.weight.mul_(gain)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, anomaly=True, tensorboard=False) as w:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(2, 6, 8)).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    errors = [f for f in w.session.findings if f.severity == "error"]
    assert [(f.kind, f.op, f.module) for f in errors] == [("nonfinite_forward", "aten.exp", "0")]
    assert "overflowed the format" in errors[0].message
    assert "torch.softmax" in errors[0].advice and "mask" not in errors[0].advice
    top = errors[0].data["input_max"]
    if gain < 5:
        assert 11.1 < top < 88.7 and "float32" in errors[0].advice, top
    else:
        assert top > 88.7 and errors[0].advice.startswith("exp overflows past x = 88.7"), top


def test_a_logdir_whose_report_names_are_folders(tmp_path: Path) -> None:
    # Review 61b: a folder named amp_doctor.json in the logdir was found only after the
    # script had run, and the JSON was lost; one named report.txt lost the text report.
    import subprocess

    from tests.helpers import console_script

    (tmp_path / "s.py").write_text("print('ran')\n")
    (tmp_path / "dj" / "amp_doctor.json").mkdir(parents=True)
    r = subprocess.run([console_script(), "diagnose", "-q", "--no-tensorboard", "--logdir",
                        "dj", "s.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ran" not in r.stdout
    assert r.stderr.strip().splitlines() == [
        f"amp-doctor: error: cannot write to logdir '{tmp_path / 'dj'}' (amp_doctor.json in "
        "it is a folder); pass a writable directory with --logdir."]
    (tmp_path / "dr" / "report.txt").mkdir(parents=True)
    r = subprocess.run([console_script(), "diagnose", "-q", "--no-tensorboard", "--logdir",
                        "dr", "s.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ran" in r.stdout
    assert (tmp_path / "dr" / "amp_doctor_report.txt").read_text().startswith("amp-doctor ")


_CLOBBER = '''
import shutil, sys
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    if step == 2:  # a "clean old logs" step gone wrong: the logdir becomes a file
        shutil.rmtree(sys.argv[1], ignore_errors=True)
        open(sys.argv[1], "w").write("x")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
sys.exit(4)
'''


def test_a_logdir_the_script_replaced_with_a_file(tmp_path: Path) -> None:
    # Review 61b: "internal error ... Please report this bug" and two "could not write"
    # lines, and no report anywhere. One note, the user's exit code, the reports beside.
    import subprocess

    from tests.helpers import console_script

    (tmp_path / "s.py").write_text(_CLOBBER)
    # The logdir itself, and (review 61c) a folder above it.
    for logdir, clobbered, moved in (("logs", "logs", "logs-amp-doctor"),
                                     ("top/amp", "top", "top-amp-doctor/amp")):
        r = subprocess.run([console_script(), "diagnose", "-q", "--logdir", logdir, "s.py",
                            clobbered], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 4, r.stderr
        said = [line for line in r.stderr.splitlines() if line.startswith("amp-doctor:")]
        assert len([x for x in said if "replaced by a file" in x]) == 1, said
        assert not [x for x in said if "error" in x], said
        out = tmp_path / moved
        assert (out / "report.txt").read_text().startswith("amp-doctor ")
        assert json.loads((out / "amp_doctor.json").read_text())["run"]["exit_code"] == 4


class _PaddedAttention(nn.Module):
    """Self-attention with a -inf key-padding mask: a batch with an empty document masks a
    whole row, whose softmax is 0/0 = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).split(8, -1)
        att = (q @ k.transpose(-2, -1)).masked_fill(pad[:, None, :], float("-inf"))
        return torch.softmax(att, -1) @ x


def test_a_nan_that_recurs_after_its_origin_was_found_is_that_origins() -> None:
    # Review 61a: the op-level search named the masked softmax at its second occurrence;
    # the third, which it no longer looked at, was "did not recur", an unlocated NaN.
    torch.manual_seed(0)
    att, head = _PaddedAttention(), nn.Linear(8, 2)
    opt = torch.optim.SGD([*att.parameters(), *head.parameters()], lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch({"att": att, "head": head}, anomaly=True, tensorboard=False) as w:
        for step in range(30):
            pad = torch.zeros(2, 5, dtype=torch.bool)
            if step in (7, 12, 17, 22, 27):
                pad[0] = True  # an empty document
            with torch.autocast("cpu", dtype=torch.float16):
                loss = head(att(torch.randn(2, 5, 8), pad)).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    fs = w.session.findings
    errors = [f for f in fs if f.severity == "error"]
    assert [(f.kind, f.op) for f in errors] == [("nonfinite_forward", "aten._softmax")]
    unlocated = [f for f in fs if f.kind == "nonfinite_unlocated"]
    assert unlocated and all(f.data.get("follow_on_of") == errors[0].module
                             and "aten._softmax" in f.advice for f in unlocated)
    assert any("most likely the same cause" in c for c in errors[0].data["consequences"])


def test_nan_the_loop_adds_to_grad_without_a_scaler_is_not_called_a_backward_nan() -> None:
    # Review 61b: bfloat16, no GradScaler, NaN added to .grad before the step: "the
    # gradients went NaN/inf in the backward pass", where every output gradient was finite.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 8)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if step == 1:
                model[2].weight.grad.add_(float("nan"))
            opt.step()
    f = next(f for f in w.session.findings if f.kind == "nonfinite_grads_applied")
    assert f.severity == "error" and f.step == 1 and f.module == "2"
    assert f.data["weights_only"] is True
    assert "backward pass of step" not in f.message and "custom clip" in f.message


def test_a_sparse_gradient_made_nan_after_unscale_is_seen() -> None:
    # Review 61b: a sparse embedding gradient made NaN after unscale_ was left out of the
    # check (sparse tensors are not summarised): "an op in emb's own forward code".
    torch.manual_seed(0)
    emb, head = nn.Embedding(50, 8, sparse=True), nn.Linear(8, 2)
    o_sp = torch.optim.SparseAdam(list(emb.parameters()), lr=1e-2)
    o_head = torch.optim.SGD(head.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch({"emb": emb, "head": head}, every=1, tensorboard=False) as w:
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = head(emb(torch.randint(0, 50, (4, 3))).mean(1)).float().pow(2).mean()
            for o in (o_sp, o_head):
                o.zero_grad()
            scaler.scale(loss).backward()
            for o in (o_sp, o_head):
                scaler.unscale_(o)
            if step == 1:
                emb.weight.grad = emb.weight.grad * float("nan")  # still sparse
            for o in (o_sp, o_head):
                scaler.step(o)
            scaler.update()
    f = next(f for f in w.session.findings if f.kind == "nonfinite_grads_applied")
    assert (f.severity, f.step, f.module) == ("error", 1, "emb")
    assert f.data["after_unscale"] is True


def test_a_disabled_scaler_is_told_to_be_enabled_not_created() -> None:
    # Review 61a: "Create `scaler = torch.amp.GradScaler(...)`" to a loop that has one,
    # made with enabled=False ("not needed on CPU").
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().mean() * 1e-6
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    fs = [f for f in w.session.findings if f.kind == "missing_scaler"]
    assert fs and all("enabled=True" in f.advice and "Create" not in f.advice for f in fs)


# A VAE whose logvar head starts at 12: float16's exp(logvar) overflows in the loop's KL
# term; the loss is summed in float16 too, so the loss scale's own cast (65536 > 65504)
# is the first backward op to overflow at step 0.
_VAE = '''
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
class VAE(nn.Module):
    def __init__(s):
        super().__init__()
        s.enc = nn.Sequential(nn.Linear(32, 64), nn.SiLU())
        s.mu, s.logvar = nn.Linear(64, 8), nn.Linear(64, 8)
        s.dec = nn.Linear(8, 32)
    def forward(s, x):
        h = s.enc(x)
        mu, logvar = s.mu(h), s.logvar(h)
        return s.dec(mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)), mu, logvar
model = VAE()
with torch.no_grad():
    model.logvar.bias.fill_(12.0)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(12):
    x = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.float16):
        recon, mu, logvar = model(x)
        rec = F.mse_loss(recon, x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.shape[0]
        loss = rec + kl
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("scale", scaler.get_scale())
'''


def test_the_loss_scales_own_cast_is_nothing_to_fix_beside_a_real_error(
        tmp_path: Path) -> None:
    # Review 61a: the cast of 1 x 65536 to float16 at step 0 got "keep the loss O(1)" in
    # the broken run and "nothing to fix" in the healthy one: the same op, line and value.
    plain, r, report = diagnose_pair(tmp_path, "vae.py", _VAE, [], "--anomaly")
    assert r.stdout.startswith(plain)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert errors and errors[0]["op"] == "aten.exp"
    casts = [f for f in report["findings"] if f["kind"] == "nonfinite_backward"
             and f["op"] == "aten._to_copy" and f["data"].get("input_max") == 65536.0]
    assert casts and all(f["severity"] == "info" and f["advice"].startswith("Nothing to fix")
                         for f in casts), [(f["severity"], f["advice"]) for f in casts]


def test_sys_exit_with_a_message_keeps_it_in_the_report(tmp_path: Path) -> None:
    # Review 61b: `sys.exit("fatal: config wrong")` printed its message and exited 1, and
    # the JSON said `error: null`.
    import subprocess

    from tests.helpers import console_script

    (tmp_path / "s.py").write_text(
        "import sys, torch\nm = torch.nn.Linear(2, 2)\nsys.exit('fatal: config wrong')\n")
    r = subprocess.run([console_script(), "diagnose", "-q", "--no-tensorboard", "--logdir",
                        "out", "s.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "fatal: config wrong" in r.stderr
    run = json.loads((tmp_path / "out" / "amp_doctor.json").read_text())["run"]
    assert (run["outcome"], run["exit_code"], run["error"]) == (
        "exit", 1, "SystemExit: fatal: config wrong")


# A linear probe: the model stays in eval mode (its frozen backbone's BatchNorm-like
# statistics), only the head trains; from step 6 on the training batches overflow the
# backbone in float16.
_LINEAR_PROBE = '''
import torch
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(1)
class Net(nn.Module):
    def __init__(s):
        super().__init__()
        s.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        s.head = nn.Linear(64, 5)
model = Net()
for p in model.backbone.parameters():
    p.requires_grad_(False)
model.eval()
model.head.train()
opt = torch.optim.SGD(model.head.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(10):
    x = torch.randn(16, 16) * (3e4 if step >= 6 else 1.0)
    y = torch.randint(0, 5, (16,))
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            feats = model.backbone(x)
        loss = nn.functional.cross_entropy(model.head(feats).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("scale", scaler.get_scale())
'''


def test_a_linear_probes_frozen_backbone_is_the_steps_work(tmp_path: Path) -> None:
    # Review 61c: the model in eval mode with only its head training read as a validation
    # loop: the backbone's overflow was charged to the head ("--fp32 head").
    plain, r, report = diagnose_pair(tmp_path, "probe.py", _LINEAR_PROBE, [], "--every", "1")
    assert r.stdout.startswith(plain)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert errors and errors[0]["module"].startswith("backbone"), [
        (f["kind"], f["module"]) for f in errors]
    assert "--fp32 head" not in r.stderr


# Two towers, two optimizers, one scaler; one clip over both towers' parameters. At step
# 6 tower A's gradients overflow: unscale_ finds it for A's optimizer (skipped), but the
# shared clip's NaN norm makes B's gradients NaN after B's unscale_ found none.
_TWO_TOWERS = '''
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
A = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
B = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
oA, oB = torch.optim.SGD(A.parameters(), lr=0.01), torch.optim.SGD(B.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(14):
    xa = torch.randn(16, 16) * (300.0 if step == 6 else 1.0)
    y = torch.randn(16, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(A(xa).float(), y) + F.mse_loss(B(torch.randn(16, 16)).float(), y)
    oA.zero_grad()
    oB.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(oA)
    scaler.unscale_(oB)
    torch.nn.utils.clip_grad_norm_([*A.parameters(), *B.parameters()], 1.0)
    scaler.step(oA)
    scaler.step(oB)
    scaler.update()
print("scale", scaler.get_scale())
'''


def test_a_shared_clip_that_poisons_the_other_optimizer_is_one_error(tmp_path: Path) -> None:
    # Review 61c: nonfinite_grads_applied at the step, and beside it a scale_collapse
    # error "fix the culprit layer A.0" for the backoffs the NaN weights made after it.
    plain, r, report = diagnose_pair(tmp_path, "tt.py", _TWO_TOWERS, [])
    assert r.stdout.startswith(plain)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["step"]) for f in errors] == [("nonfinite_grads_applied", 6)]
    assert "several optimizers" in errors[0]["message"]
    collapse = [f for f in report["findings"] if f["kind"] == "scale_collapse"]
    assert all(f["severity"] == "info" for f in collapse)


# Distillation: a frozen teacher in eval mode, run under no_grad, whose over-confident
# logits overflow float16; its output feeds the loss only.
_KD = '''
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
with torch.no_grad():
    teacher[2].weight.mul_(1e5)
teacher.eval()
for p in teacher.parameters():
    p.requires_grad_(False)
student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(12):
    x = torch.randn(16, 16) * (8.0 if step >= 5 else 1.0)
    y = torch.randint(0, 10, (16,))
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            t = teacher(x)
        s = student(x)
        loss = F.cross_entropy(s.float(), y) + F.kl_div(
            F.log_softmax(s.float(), -1), F.softmax(t.float(), -1), reduction="batchmean")
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("scale", scaler.get_scale())
'''


def test_a_frozen_teachers_overflow_is_the_one_error(tmp_path: Path) -> None:
    # Review 61c: the teacher's overflow with "standardise the targets", and beside it a
    # nonfinite_loss error saying every watched output was finite.
    plain, r, report = diagnose_pair(tmp_path, "kd.py", _KD, [])
    assert r.stdout.startswith(plain)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["module"]) for f in errors] == [("activation_overflow", "teacher.2")]
    assert "targets" not in errors[0]["advice"]
    loss = next(f for f in report["findings"] if f["kind"] == "nonfinite_loss")
    assert loss["severity"] == "info"


def test_training_after_a_forgotten_model_train_is_still_watched() -> None:
    # Review 61c: after a validation pass (model.eval()) without model.train() after it,
    # the training forwards in eval mode were taken for evaluation: nothing recorded from
    # then on, and a false "model_stopped" (the loop trains another module).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    model.train()
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if step == 2:
                model.eval()  # validation; model.train() forgotten after it
                with torch.no_grad():
                    model(torch.randn(8, 8))
    s = w.session
    kinds = {f.kind: f for f in s.findings}
    assert "model_stopped" not in kinds
    f = kinds["trains_in_eval_mode"]
    assert f.severity == "warning" and f.step == 3 and "model.train()" in f.advice
    lay = next(x for x in s.layers if x.name == "0")
    assert lay.recorded_steps == 8


# A GAN, one GradScaler started at 2**24 (its first steps overflow, as designed), a clip
# after each unscale_; at step 7 the loop divides the generator's gradients by 0 after its
# unscale_: the generator's weights are NaN from then on, and so is every batch of fakes
# it gives the discriminator.
_GAN = '''
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
D = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
oG = torch.optim.Adam(G.parameters(), lr=2e-4)
oD = torch.optim.Adam(D.parameters(), lr=2e-4)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
for step in range(20):
    real, z = torch.randn(16, 16) + 2, torch.randn(16, 8)
    oD.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        fake = G(z)
        lossD = (F.binary_cross_entropy_with_logits(D(real).float(), torch.ones(16, 1))
                 + F.binary_cross_entropy_with_logits(D(fake.detach()).float(),
                                                      torch.zeros(16, 1)))
    scaler.scale(lossD).backward()
    scaler.unscale_(oD)
    torch.nn.utils.clip_grad_norm_(D.parameters(), 1.0)
    scaler.step(oD)
    oG.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        lossG = F.binary_cross_entropy_with_logits(D(G(z)).float(), torch.ones(16, 1))
    scaler.scale(lossG).backward()
    scaler.unscale_(oG)
    torch.nn.utils.clip_grad_norm_(G.parameters(), 1.0)
    if step == 7:
        for p in G.parameters():
            p.grad.div_(0.0)
    scaler.step(oG)
    scaler.update()
print("scale", scaler.get_scale())
'''


def test_a_gans_fakes_made_nan_by_a_bad_update_are_that_updates(tmp_path: Path) -> None:
    # Review 61c: under --anomaly, the NaN update of the generator at step 7 beside a
    # "nonfinite_input D: it came from the data" error (the generator's fakes) and a
    # scale_collapse error from the scaler's start-up: three errors for one cause.
    plain, r, report = diagnose_pair(tmp_path, "gan.py", _GAN, [], "--anomaly")
    assert r.stdout.startswith(plain)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["step"]) for f in errors] == [("nonfinite_grads_applied", 7)]
    assert all(f["severity"] == "info" for f in report["findings"]
               if f["kind"] in ("nonfinite_input", "scale_collapse", "nonfinite_unlocated"))
