"""Session 58: review 57g's nanoGPT-like trainer, two cases anomaly mode and the next:
lines told wrong.

* A loss summed over tokens: the scaled loss gradient arrives at the output layer near
  float16's max, and its matmul's backward is the first op to overflow. Anomaly mode
  named that matmul as the cause ("look there", "run the forward op in float32").
* A hand-written GELU whose cube overflows in each block's MLP: the default mode's first
  `next:` put one block's Linear before it in float32 (`--fp32 h.1.mlp.c_fc`), which left
  every step skipped: the cube is in the MLP's own code, which every block runs.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from amp_doctor import format as F
from tests.helpers import console_script

_SUM_LOSS_SCRIPT = '''
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
# 2048 tokens over a vocabulary of 32: each output column's weight gradient adds up some
# 64 target rows of the scaled loss gradient.
VOCAB, DIM, TOKENS = 32, 32, 2048
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
    def forward(self, idx):
        return self.head(self.norm(self.proj(self.emb(idx))))
model = LM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
for step in range(12):
    x = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    y = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y, reduction="sum")  # summed, not averaged
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print("step", step, repr(loss.item()), scaler.get_scale())
'''


def _run(tmp_path: Path, name: str, script: str, *flags: str
         ) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str],
                    dict[str, Any]]:
    """The script run plainly, then through the CLI with ``flags``; and its JSON report."""
    (tmp_path / name).write_text(script)
    plain = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / "out"
    r = subprocess.run([console_script(), "diagnose", "-q", "--no-tensorboard", *flags,
                        "--logdir", str(out), name], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    return plain, r, json.loads((out / "amp_doctor.json").read_text())


def test_anomaly_mode_names_the_scaled_loss_gradient_not_the_layer_it_overflowed_in(
        tmp_path: Path) -> None:
    plain, r, report = _run(tmp_path, "sumloss.py", _SUM_LOSS_SCRIPT, "--anomaly",
                            "--every", "1")
    assert r.stdout == plain.stdout  # the script's numerics, bit for bit
    scales = [float(line.split()[-1]) for line in plain.stdout.splitlines()]
    assert scales[5] == 1024.0  # six backoffs from 65536: no calibration
    findings = report["findings"]
    (op,) = [f for f in findings if f["kind"] == "nonfinite_backward"]
    assert (op["module"], op["op"], op["step"]) == ("head", "aten.mm", 0)
    # The head's output gradient, the scaled loss gradient, was finite and near the max.
    arrived = op["data"]["grad_arrived_absmax"]
    assert 65504 / 4 <= arrived <= 65504, arrived
    assert op["data"]["loss_scale"] == 65536.0
    assert op["data"]["loss"] > 1000
    assert op["data"]["loss_too_large"] is True
    text = " ".join(op["message"].split())
    assert f"But the gradient arriving at head was already up to {F.num(arrived)}" in text, text
    assert "the loss's gradient times the loss scale 65536" in text
    assert "the scaled loss gradient is too large for float16, not head" in text
    assert op["advice"].startswith("Average the loss instead of summing it"), op["advice"]
    assert "init_scale" in op["advice"]
    assert "float32 with" not in op["advice"] and "clamp" not in op["advice"]
    (backoff,) = [f for f in findings if f["kind"] == "scaler_backoff"]
    assert backoff["severity"] == "warning"
    text = " ".join(backoff["message"].split())
    assert "look there" not in text, text
    assert "They began at head: the backward of aten.mm in head (aten.mm) was the first " \
           "op to go non-finite, but only because the gradient arriving at head" in text
    assert "a loss summed over tokens or a batch instead of averaged" in text
    assert backoff["data"]["loss_too_large"] is True
    assert backoff["advice"] == op["advice"]
    assert "look there" not in r.stderr


def test_a_collapse_from_a_summed_loss_suggests_no_float32_layer(tmp_path: Path) -> None:
    # Two classes over 8192 tokens: each weight gradient of the head adds up some 4096
    # rows of the scaled loss gradient, and the scale falls to 16 (a collapse, an error).
    script = (_SUM_LOSS_SCRIPT.replace("VOCAB, DIM, TOKENS = 32, 32, 2048",
                                       "VOCAB, DIM, TOKENS = 2, 32, 8192")
              .replace("range(12)", "range(24)"))
    plain, r, report = _run(tmp_path, "collapse.py", script, "--anomaly", "--every", "1")
    assert r.stdout == plain.stdout
    assert float(plain.stdout.splitlines()[11].split()[-1]) == 16.0
    (c,) = [f for f in report["findings"] if f["kind"] == "scale_collapse"]
    assert (c["severity"], c["module"]) == ("error", "head")
    text = " ".join(c["message"].split())
    assert "started at head in 11 of 12 backoffs" in text, text
    assert ", but only because the gradient arriving at head was already up to" in text
    assert "the scaled loss gradient is too large for float16, not head" in text
    assert c["data"]["loss_too_large"] is True
    assert c["advice"].startswith("Average the loss instead of summing it"), c["advice"]
    # No float32 layer to try: before, `next:` said `--fp32 head`.
    assert "--fp32" not in r.stderr, r.stderr


_GELU_SCRIPT = '''
import math
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        nn.init.normal_(self.fc.weight, 0.0, 20.0)  # a large init: |fc(x)| up to ~300
    def forward(self, x):
        h = self.fc(x)
        # a hand-written tanh-GELU: the cube overflows float16 past |h| = 40, and its
        # backward's 3 * h**2 past |h| = 148
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h.pow(3))))
        return self.proj(h)
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d)
    def forward(self, x):
        return x + self.mlp(self.norm(x))
class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 4)
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
for step in range(12):
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print("step", step, repr(loss.item()), scaler.get_scale())
'''


def test_the_first_next_puts_the_mlp_whose_code_overflowed_in_float32_not_its_linear(
        tmp_path: Path) -> None:
    plain, r, report = _run(tmp_path, "gelu.py", _GELU_SCRIPT)
    assert r.stdout == plain.stdout
    assert plain.stdout.splitlines()[-1].split()[-1] == "16.0"  # every step skipped
    (c,) = [f for f in report["findings"] if f["kind"] == "scale_collapse"]
    assert (c["severity"], c["module"]) == ("error", "blocks.1.mlp.fc")
    text = " ".join(c["message"].split())
    assert ("the overflow is in the backward of blocks.1.mlp's code after blocks.1.mlp.fc"
            in text), text
    nexts = [line.removeprefix("amp-doctor: next: ") for line in r.stderr.splitlines()
             if line.startswith("amp-doctor: next: ")]
    assert nexts, r.stderr
    first = nexts[0]
    assert "blocks.1.mlp.fc's output stayed finite" in first, first
    assert "--fp32 blocks.1.mlp.fc" not in r.stderr
    command = first[first.index("amp-doctor diagnose "):]
    assert command == "amp-doctor diagnose --fp32 'blocks.*.mlp' gelu.py", command
    # The printed command, as the user would paste it: the overflow is gone.
    tried = subprocess.run([console_script(), *shlex.split(command)[1:]], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
    assert tried.returncode == 0, tried.stderr
    at = next(line for line in tried.stderr.splitlines() if "JSON report: " in line)
    after = json.loads(Path(at.split("JSON report: ", 1)[1].strip()).read_text())
    assert after["run"]["fp32_modules"] == ["blocks.0.mlp", "blocks.1.mlp"]
    assert not [f for f in after["findings"] if f["severity"] == "error"], after["findings"]
    scales = [float(line.split()[-1]) for line in tried.stdout.splitlines()]
    # It settles (GradScaler's search from 2**16) and trains, where it skipped every step.
    assert max(after["scaler"]["skipped_steps"]) <= 5 and scales[-1] >= 1024.0, scales


def test_fix_searches_no_float32_layers_for_an_error_the_summed_loss_made(
        tmp_path: Path) -> None:
    # `amp-doctor fix` on the collapse above ran seven trials and answered "keep proj, head
    # in float32": every matmul of the model, for an error whose fix is the loss's reduction.
    script = (_SUM_LOSS_SCRIPT.replace("VOCAB, DIM, TOKENS = 32, 32, 2048",
                                       "VOCAB, DIM, TOKENS = 2, 32, 8192")
              .replace("range(12)", "range(24)"))
    (tmp_path / "collapse.py").write_text(script)
    r = subprocess.run([console_script(), "fix", "collapse.py"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr  # the error is still there: fix found no float32 set
    out = " ".join(r.stdout.split())
    assert ("The baseline's error (scale_collapse (head)) comes from the loss's size, not "
            "from a layer") in out, out
    assert "Fix the loss: Average the loss instead of summing it" in out
    assert "Smallest fix found" not in out and "keep_in_float32" not in out
    assert r.stderr.count("amp-doctor fix: float32 [") == 1  # the baseline alone
