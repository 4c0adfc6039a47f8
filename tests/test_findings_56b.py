"""Review 56b: `--fp32` on a ModuleList changed nothing; `fix` did not follow an error that
moved to the next block, and searched float32 layers for an op in the loop's own code."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor
from amp_doctor.fix import find_fix, render_fix
from amp_doctor.hooks.fp32 import Fp32Islands
from amp_doctor.records import Session
from amp_doctor.sinks.text import render_text
from tests.helpers import console_script

D, HEADS, T, B, V = 32, 4, 8, 4, 5
# Every other batch is "loud" (x 6): its attention scores pass log(65504) ~ 11.09, and the
# hand-written exp overflows float16 in both blocks (review 56b's s3 script).
LOUD = 6.0
STEPS = 6
# The contrastive loop's batches in raw units, not standardised.
RAW_UNITS = 40.0


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        w = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(D // HEADS))  # no max subtracted
        w = w / w.sum(-1, keepdim=True)
        return self.proj((w @ v).transpose(1, 2).reshape(b, t, D))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.ModuleList([_Block(), _Block()])  # iterated, never called
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h.mean(1))


def _run_attention(fp32: tuple[str, ...], anomaly: bool = True) -> Session:
    torch.manual_seed(0)
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with amp_doctor.watch(model, every=1, fp32=fp32, anomaly=anomaly,
                          tensorboard=False) as doctor:
        for step in range(STEPS):
            x = torch.randn(B, T, 16, generator=g) * (LOUD if step % 2 else 1.0)
            y = torch.randint(0, V, (B,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


# -- A: --fp32 on a container ---------------------------------------------------------------

def test_fp32_on_a_modulelist_runs_its_members_in_float32_and_says_so() -> None:
    """`--fp32 blocks` hooked the ModuleList, which is never called: the header said
    "blocks" ran in float32 while every layer ran in float16, with the same NaN steps."""
    s = _run_attention(("blocks",), anomaly=False)
    assert s.run.fp32_modules == ["blocks.0", "blocks.1"]
    assert s.run.fp32_containers == {"blocks": ["blocks.0", "blocks.1"]}
    assert s.run.fp32_not_run == []
    for name in ("blocks.0", "blocks.1.attn.qkv", "blocks.1.mlp.2"):
        assert s.layer(name).output_dtypes == ["float32"]
    assert s.layer("inp").output_dtypes == ["float16"]  # outside: untouched
    assert not [f for f in s.findings if f.severity == "error"]  # the exp no longer overflows
    text = " ".join(render_text(s).split())
    assert "Run in float32 under autocast (--fp32): blocks.0, blocks.1" in text
    assert ("blocks is a container, iterated and never called: --fp32 ran its members "
            "instead (blocks.0, blocks.1).") in text


def test_a_forced_module_that_never_ran_is_reported() -> None:
    from amp_doctor.hooks.fp32 import Fp32NotRun

    torch.manual_seed(0)
    model = nn.ModuleDict({"enc": nn.Linear(4, 4), "spare": nn.Linear(4, 4)})
    islands = Fp32Islands(["enc", "spare"])
    islands.attach("", model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model["enc"](torch.randn(2, 4))
    assert out.dtype == torch.float32  # enc ran forced
    assert islands.ran() == ["enc"] and islands.not_run() == ["spare"]
    islands.check()  # during the run: spare may still run later
    with pytest.raises(Fp32NotRun, match=r"--fp32 pattern 'spare' matches spare, but spare "
                                         r"never ran a forward during the run"):
        islands.check(ended=True)
    islands.remove()


def test_diagnose_with_a_pattern_whose_layer_never_ran_ends_with_exit_2(
        tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = nn.Linear(8, 4)\n"
        "        self.spare = nn.Linear(4, 4)  # built, never called\n"
        "    def forward(self, x):\n"
        "        return self.body(x)\n"
        "model = M()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for i in range(3):\n"
        "    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "        loss = model(torch.randn(4, 8)).float().pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n")
    proc = subprocess.run([console_script(), "diagnose", "-q", "--no-tensorboard", "--fp32",
                           "spare", "--logdir", "ad", str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith(
        "amp-doctor: error: --fp32 pattern 'spare' matches spare, but spare never ran")
    saved = json.loads((tmp_path / "ad" / "amp_doctor.json").read_text())
    assert saved["run"]["fp32_modules"] == [] and saved["run"]["fp32_not_run"] == ["spare"]
    assert [f["kind"] for f in saved["findings"]][:1] == ["fp32_not_run"]


# -- B: the fix search follows a moved error ---------------------------------------------

def test_fix_adds_the_layer_the_error_moved_to() -> None:
    """Trial 3 (blocks.0.attn) moved the exp's overflow to blocks.1.attn; the search then
    tried `blocks` (a ModuleList: nothing forced), bisected the MLP of one block under the
    label "all blocks", and found no fix."""
    calls: list[tuple[str, ...]] = []

    def run(fp32: tuple[str, ...]) -> tuple[Session | None, int]:
        calls.append(fp32)
        return _run_attention(fp32), 0

    result = find_fix(run, max_trials=4)
    assert calls[:4] == [(), (), ("blocks.0.attn",), ("blocks.0.attn", "blocks.1.attn")]
    assert result.trials[1].errors == ("nonfinite_forward@blocks.1.attn",)
    assert result.trials[2].why == "add blocks.1.attn: the error moved there"
    assert result.trials[2].ok
    assert result.best is not None and result.best.fp32 == ("blocks.0.attn", "blocks.1.attn")
    assert "Smallest fix found: keep blocks.0.attn, blocks.1.attn in float32" in render_fix(
        result)


def test_fix_names_the_members_a_container_stands_for_and_bisects_the_blocks() -> None:
    """The enclosing module of blocks.0 is the ModuleList `blocks`, no layer of the
    report: its members stand for it. The blocks bisected are blocks.0/blocks.1 (they hold
    the most layers), not the three layers of blocks.0.mlp."""
    from amp_doctor.fix import _block_group, _enclosing

    bs = _run_attention((), anomaly=False)
    assert _enclosing(bs, ["blocks.0"]) == ["blocks.0", "blocks.1"]
    assert _enclosing(bs, ["blocks.0.attn", "blocks.1.attn.proj"]) == ["blocks.0",
                                                                        "blocks.1.attn"]
    assert _block_group(bs) == ("blocks", ["blocks.0", "blocks.1"])


# -- C: an op in the training loop's own code --------------------------------------------

def _run_contrastive(fp32: tuple[str, ...]) -> Session:
    """NT-Xent on unnormalised projections with temperature 0.01: on raw-unit batches
    (x 40, every step: the op search then meets one at once) `z @ z.T / 0.01` overflows
    float16 in the loss, outside the encoder."""
    torch.manual_seed(3)
    enc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 32))
    opt = torch.optim.Adam(enc.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(enc, every=1, fp32=fp32, anomaly=True, tensorboard=False) as doctor:
        for _ in range(STEPS):
            base = torch.randn(32, 32) * RAW_UNITS
            with torch.autocast("cpu", dtype=torch.float16):
                z = torch.cat([enc(base + 0.1 * torch.randn_like(base)),
                               enc(base + 0.1 * torch.randn_like(base))])
                sim = z @ z.t() / 0.01  # THE LOOP'S DIVISION
                sim = sim.masked_fill(torch.eye(64, dtype=torch.bool), float("-inf"))
                targets = torch.cat([torch.arange(32, 64), torch.arange(0, 32)])
                loss = F.cross_entropy(sim, targets)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_fix_does_not_search_layers_for_an_op_outside_the_model() -> None:
    calls: list[tuple[str, ...]] = []

    def run(fp32: tuple[str, ...]) -> tuple[Session | None, int]:
        calls.append(fp32)
        return _run_contrastive(fp32), 0

    result = find_fix(run, max_trials=4)
    errors = [f for f in _run_contrastive(()).findings if f.severity == "error"]
    assert [(f.kind, f.module, f.op) for f in errors] == [
        ("nonfinite_forward", None, "aten.div")]
    assert calls == [()]  # the baseline only: no backbone.* sets
    assert result.not_searched and result.best is None
    note = " ".join(result.notes)
    assert ("The baseline's error is in an op outside every module of the model, in the "
            "training loop's own code (aten.div at ") in note
    assert "test_findings_56b.py:" in note and "in _run_contrastive" in note
    assert "so no set of float32 layers reaches it, and none is searched for" in note
    assert f"Fix it in that code: {errors[0].advice}" in note
    assert "No set of float32 layers removed" not in render_fix(result)
