"""Session 58: review 57g's nanoGPT-like trainer, two cases anomaly mode and the next:
lines told wrong.

* A loss summed over tokens: the scaled loss gradient arrives at the output layer near
  float16's max, and its matmul's backward is the first op to overflow. Anomaly mode
  named that matmul as the cause ("look there", "run the forward op in float32").
"""

from __future__ import annotations

import json
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
