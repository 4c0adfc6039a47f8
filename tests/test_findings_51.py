"""Review 51: real-style float16 scripts whose text said something false.

- A VAE whose ``logvar.exp()`` in the loss overflows once (step 19), after the GradScaler's
  calibration skips (steps 0-2): anomaly mode's "not located" note said the loss "was
  already NaN/inf (first at step 1)", a calibration skip with a finite loss.
- A CLIP model whose ``logit_scale.exp() * img @ txt.t()`` overflows float16: the model's
  error said its input came in float32 and autocast's cast of it made the inf, though the
  batch (checked every step) held values of about 4; and it advised float32 for "this
  layer", the whole model.
- A focal loss whose loss fell near zero (1.4e-4) and read 0.41 on a noisy batch: "the run
  was diverging" and "lower the learning rate", though it never rose above its start.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import amp_doctor
from tests.helpers import console_script

_VAE = '''
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
D, Z = 20, 4
class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 64); self.mu = nn.Linear(64, Z); self.logvar = nn.Linear(64, Z)
        self.dec = nn.Sequential(nn.Linear(Z, 64), nn.ReLU(), nn.Linear(64, D))
    def forward(self, x):
        h = F.relu(self.fc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        return self.dec(mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)), mu, logvar
basis = torch.randn(Z, D)
model = VAE()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(30):
    x = torch.randn(32, Z) @ basis + 0.1 * torch.randn(32, D)
    if step == 19:
        x = x * 20.0  # an un-normalised shard
    with torch.autocast("cpu", dtype=torch.float16):
        recon, mu, logvar = model(x)
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        loss = (F.mse_loss(recon, x, reduction="sum") + kld) / x.shape[0]
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(step, loss.item(), scaler.get_scale())
'''


def test_anomaly_modes_unlocated_nan_loss_starts_at_the_nan_loss_not_a_calibration_skip(
        tmp_path: Path) -> None:
    (tmp_path / "vae.py").write_text(_VAE)
    plain = subprocess.run([__import__("sys").executable, "vae.py"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    rows = [line.split() for line in plain.stdout.splitlines()]
    bad = [int(s) for s, loss, _ in rows if loss in ("inf", "nan")]
    skipped = [int(s) for (s, _, sc), (_, _, prev) in zip(rows[1:], rows, strict=False)
               if float(sc) < float(prev)]
    assert bad == [19] and 1 in skipped + [0]  # a calibration skip before, with a finite loss
    r = subprocess.run([console_script(), "diagnose", "--anomaly", "--no-tensorboard",
                        "--logdir", "out", "vae.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout  # the same losses and scales, step by step
    text = " ".join(r.stderr.split())
    assert "whose loss was already NaN/inf (first at step 1;" not in text
    if "nonfinite_unlocated" in text:
        assert "info nonfinite_unlocated step 19" in text
        assert "whose loss was already NaN/inf (first at step 19;" in text


_CLIP = '''
import math, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
class CLIP(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 32))
        self.token_embedding = nn.EmbeddingBag(100, 64, mode="mean")
        self.text_proj = nn.Linear(64, 32)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    def forward(self, images, texts):
        img = F.normalize(self.visual(images), dim=-1)
        txt = F.normalize(self.text_proj(self.token_embedding(texts)), dim=-1)
        logits = self.logit_scale.exp() * img @ txt.t()
        return logits, logits.t()
proto = torch.randn(20, 48)
model = CLIP()
with torch.no_grad():  # "pretrained" towers: the text tower starts aligned
    target = model.visual[2](model.visual[1](model.visual[0](proto)))
    model.text_proj.weight.copy_(torch.eye(32, 64)); model.text_proj.bias.zero_()
    for c in range(20):
        for t in range(6):
            model.token_embedding.weight[(c * 5 + t) % 100, :32] = target[c]
other = [p for n, p in model.named_parameters() if n != "logit_scale"]
opt = torch.optim.AdamW([{"params": other, "lr": 1e-3},
                         {"params": [model.logit_scale], "lr": 2.0, "weight_decay": 0.0}],
                        betas=(0.9, 0.98), eps=1e-6)
scaler = torch.amp.GradScaler("cpu")
for step in range(30):
    cls = torch.randperm(20)[:16]
    images = proto[cls] + 0.02 * torch.randn(16, 48)
    texts = (cls[:, None] * 5 + torch.arange(6)[None]) % 100
    labels = torch.arange(16)
    with torch.autocast("cpu", dtype=torch.float16):
        lpi, lpt = model(images, texts)
        loss = (F.cross_entropy(lpi, labels) + F.cross_entropy(lpt, labels)) / 2
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(step, loss.item(), scaler.get_scale(), images.abs().max().item())
'''


def test_an_overflow_made_in_the_models_own_code_from_a_fine_batch_is_not_the_inputs_cast(
        tmp_path: Path) -> None:
    (tmp_path / "clip.py").write_text(_CLIP)
    r = subprocess.run([console_script(), "diagnose", "--every", "1", "--no-tensorboard",
                        "--logdir", "out", "clip.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    assert max(float(row[3]) for row in rows) < 10  # the batch: far from float16's max
    assert any(row[1] in ("inf", "nan") for row in rows)
    text = " ".join(r.stderr.split())
    # (Its parts, called one by one before training, are named within it: one model.)
    assert text.count("ERROR") == 1 and "ERROR activation_overflow CLIP" in text
    assert "Its input came in float32" not in text
    assert ("Its input is the batch, which amp-doctor checks at every step: it held no NaN/inf "
            "and no value beyond the format's max, so the inf was made in CLIP's own forward "
            "code") in text
    assert "fix: The op is in the model's own forward code" in text
    assert "clamp a learned scale or temperature" in text


def test_a_noisy_batch_after_a_near_zero_loss_is_no_divergence() -> None:
    from amp_doctor.analysis.divergence import divergence
    from amp_doctor.records import StepRecord

    def session(losses: list[float]) -> amp_doctor.Session:
        torch.manual_seed(0)
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with amp_doctor.watch(model, tensorboard=False, every=1) as doctor:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(torch.randn(4, 2)).float().sum()
                opt.zero_grad()
                out.backward()
                opt.step()
        s = doctor.session
        hist = [StepRecord(step=i, loss=v, scale=None, skipped=False, layers={})
                for i, v in enumerate(losses)]
        return __import__("dataclasses").replace(s, history=hist)

    # The review's focal loss: 1.61 at the start, 1.4e-4, then 0.41 on a noisy batch.
    assert divergence(session([1.61, 0.45, 0.098, 1.4e-4, 0.15, 0.41, float("inf")])) is None
    # A loss that climbs past where it began still is one (a learning rate too high).
    d = divergence(session([1.0, 0.5, 0.05, 0.8, 3.0, 40.0, float("inf")]))
    assert d is not None and (d.low_step, d.high_step, d.high) == (2, 5, 40.0)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)
        probs = (q @ k.transpose(-1, -2) / 4 + mask).softmax(-1)
        return self.head(self.out(probs @ v)[:, 0])


def test_a_nan_beside_a_minus_inf_mask_says_a_row_masked_whole_is_nan_in_float32_too() -> None:
    """A sample that is all padding, masked with -inf: its softmax is 0/0. With every
    step recorded the NaN showed first in the attention's out-projection, whose input is
    not checked, and ``--fp32`` on the attention was the next thing to try, which leaves
    the NaN (review 51)."""
    torch.manual_seed(0)
    model = _Attn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, every=1) as doctor:
        for step in range(8):
            ids = torch.randint(0, 50, (4, 6))
            lengths = torch.tensor([6, 3, 0 if step == 5 else 2, 4])
            mask = torch.zeros(4, 1, 6).masked_fill(
                (torch.arange(6)[None] >= lengths[:, None])[:, None], float("-inf"))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(ids, mask), torch.randint(0, 3, (4,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    (f,) = [x for x in s.findings if x.severity == "error"]
    assert (f.kind, f.step) == ("nonfinite_loss", 5)
    assert f.data["attn_mask_given"] is True
    assert ("The model was given an additive attention mask holding -inf in that step: if it "
            "covers a row whole (a sample that is all padding), that row's softmax is 0/0, NaN "
            "in float32 too") in " ".join(f.message.split())
    # The op first, where `--fp32` on the attention would leave the NaN.
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t.py"]))
    first, *rest = next_steps(s)
    assert first.endswith("amp-doctor diagnose --anomaly --on-nonfinite raise t.py")
    assert "float32 would not help then" in first
    assert not any("--anomaly" in line for line in rest)


_PART_FIRST = '''
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.head = nn.Linear(4, 2)
    def forward(self, x):
        return self.head(self.visual(x))
model = Net()
with torch.no_grad():
    protos = model.visual(torch.randn(3, 8))  # a part of the model, called by itself first
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(torch.randn(5, 8)).float(), torch.randint(0, 2, (5,)))
    opt.zero_grad(); loss.backward(); opt.step()
print("loss", loss.item())
'''


def test_a_part_called_by_itself_before_training_is_named_within_its_model(
        tmp_path: Path) -> None:
    """``model.visual(protos)`` under no_grad before the loop made ``visual`` a model of
    its own, "Sequential", and its layers "Sequential.0", ... beside "model.head" once the
    whole model trained (review 51)."""
    import json
    import sys

    (tmp_path / "t.py").write_text(_PART_FIRST)
    plain = subprocess.run([sys.executable, "t.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    r = subprocess.run([console_script(), "diagnose", "--every", "1", "--no-tensorboard",
                        "--logdir", "out", "t.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout
    report = json.loads((tmp_path / "out" / "amp_doctor.json").read_text())
    names = {lay["name"] for lay in report["layers"]}
    assert {"visual", "visual.0", "visual.2", "head"} <= names
    assert not any(n.startswith("Sequential") or n.startswith("model.") for n in names)
    assert report["run"]["models"] == ["Net"]
    recorded = {lay["name"]: lay["recorded_steps"] for lay in report["layers"]}
    assert recorded["visual.0"] == recorded["head"] == 4


def test_anomaly_mode_says_a_learned_scale_beyond_float16_is_to_be_bounded(
        tmp_path: Path) -> None:
    """Anomaly mode named ``aten.mul`` and its line, with the fix for a log of a softmax or
    a division by an epsilon (review 51)."""
    (tmp_path / "clip.py").write_text(_CLIP)
    r = subprocess.run([console_script(), "diagnose", "--anomaly", "--no-tensorboard",
                        "--logdir", "out", "clip.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stderr.split())
    assert text.count("ERROR") == 1 and "ERROR nonfinite_forward CLIP [aten.mul]" in text
    assert "One of its inputs is a single value, " in text
    assert "beyond float16's max: a 0-dim tensor (a learned scale or temperature" in text
    assert "fix: Bound the scale that grew: clamp it where it is used" in text
    assert "log_softmax" not in text.split("fix: Bound the scale")[1].split("info")[0]
