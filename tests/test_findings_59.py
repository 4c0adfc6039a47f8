"""Session 59: review 59a's checkpointed trainer with a hand-written softmax.

Its ``exp`` overflowed float16 on a few steps only: 23, then 31, 32, 35 and 38 of 40.
On those steps, layers whose outputs held a NaN among finite values showed the
histogram's bound as their absmax; and backoffs at 31 (begun in block 2) and 32 (block 0),
one GradScaler episode, were charged to block 2 alone. And the review's T5 (recorded every
step) had FP8 amax columns of "-" and "0/1": they came from the step history, which keeps
each step's 32 worst layers.
Anomaly mode's op-level search ran at 24-26, which stayed finite; its cool-down (16
steps, for a value on every step) then waited past every later NaN, and the finding said
the value "did not recur there". After a search that found nothing, a value back on
steps close together arms an ordinary search at once (from the aimed searches' budget),
and a value that comes back only between searches is said to have come back.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import amp_doctor
from amp_doctor.analysis.messages import event_message
from amp_doctor.analysis.whatif import fp8_rows
from amp_doctor.device import stats as S
from amp_doctor.dtypes import limits
from amp_doctor.records import Event, LayerStep, TensorStats
from amp_doctor.steps.aggregates import LayerAggregates
from amp_doctor.steps.table import StepTable
from tests.helpers import console_script

# Two branches with a softmax written by hand, without the max subtracted: exp overflows
# float16 past 11.1. The batch's half for branch a is large (finite, within float16's
# range) on the steps listed in argv[1], branch b's on those in argv[2].
_SCRIPT = '''
import sys
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads(1)
BAD_A, BAD_B = ({int(s) for s in arg.split(",") if s} for arg in sys.argv[1:3])
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(16, 16)
    def forward(self, x):
        w = torch.exp(self.score(x))  # no max subtracted
        return w / w.sum(-1, keepdim=True)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Attn()
        self.b = Attn()
        self.out = nn.Linear(16, 4)
    def forward(self, x):
        return self.out(self.a(x[:, :16]) + self.b(x[:, 16:]))
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
for step in range(int(sys.argv[3])):
    x = torch.randn(32, 32, generator=g)
    x[:, :16] *= 400.0 if step in BAD_A else 1.0
    x[:, 16:] *= 400.0 if step in BAD_B else 1.0
    y = torch.randint(0, 4, (32,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print("step", step, repr(loss.item()), scaler.get_scale())
'''


def _run(tmp_path: Path, bad_a: str, bad_b: str, steps: int, *flags: str
         ) -> tuple[str, str, dict[str, Any]]:
    """The script run plainly, then through the CLI with ``flags``; and its JSON report."""
    (tmp_path / "softmax.py").write_text(_SCRIPT)
    args = ["softmax.py", bad_a, bad_b, str(steps)]
    plain = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / "out"
    r = subprocess.run([console_script(), "diagnose", "-q", "--no-tensorboard", *flags,
                        "--logdir", str(out), *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    return plain.stdout, r.stdout, json.loads((out / "amp_doctor.json").read_text())


def test_a_nan_back_on_close_steps_after_a_search_that_found_nothing_is_searched_at_once(
        tmp_path: Path) -> None:
    plain, watched, report = _run(tmp_path, "5,13,14,17,20", "", 24, "--anomaly")
    assert watched == plain  # the script's numerics, bit for bit
    losses = [line.split()[2] for line in plain.splitlines()]
    assert [i for i, v in enumerate(losses) if v == "nan"] == [5, 13, 14, 17, 20]
    (op,) = [f for f in report["findings"] if f["kind"] == "nonfinite_forward"]
    # Step 5's search (6-8) saw finite steps only; 14 came a step after 13: searched at
    # once (15-17), where the cool-down would have waited until step 25.
    assert (op["module"], op["op"], op["step"]) == ("a", "aten.exp", 17)
    assert op["frame"].endswith("softmax.py:12 in forward"), op["frame"]
    assert op["severity"] == "error"
    assert not [f for f in report["findings"] if f["kind"] == "nonfinite_unlocated"]


def test_a_nan_that_came_back_between_searches_is_not_said_to_have_stopped() -> None:
    d = {"steps": [23, 31, 32, 35, 38], "count": 5, "searched_steps": [24, 25, 26],
         "scaler_skipped_only": True, "loss_nonfinite": True}
    text = " ".join(event_message(Event(kind="nonfinite_unlocated", step=23, data=d),
                                  1).split())
    assert "did not recur" not in text, text
    assert "ran at steps 24, 25, 26, which stayed finite" in text, text
    assert "came back at steps 31, 32, 35, 38, between its searches" in text, text
    assert "--on-nonfinite raise" in text
    d["steps"] = [23]  # it never came back: as before
    text = " ".join(event_message(Event(kind="nonfinite_unlocated", step=23, data=d),
                                  1).split())
    assert "it did not recur there" in text


def _stats(x: torch.Tensor) -> TensorStats:
    d = S.decode(S.summary_row(x).tolist(), limits(torch.float16))
    return TensorStats(d.numel, d.min, d.max, d.absmax, d.zero_frac, d.nonfinite_frac,
                       d.overflow_frac, d.underflow_frac, d.headroom)


def test_a_step_whose_output_held_a_nan_does_not_stand_for_the_layers_absmax() -> None:
    # Review 59a: on the NaN steps a layer's absmax was its histogram's top bin's upper
    # edge (4.0 for outputs up to 2.42), and the layer table showed absmax 4, headroom 14.
    x = torch.linspace(-2.42, 2.42, 101, dtype=torch.float16)
    with_nan = x.clone()
    with_nan[7] = math.nan
    bounded = _stats(with_nan)
    assert math.isnan(bounded.min) and bounded.absmax == 4.0  # the bound, as recorded
    agg = LayerAggregates()
    agg.add(StepTable.from_layers({"fc": LayerStep(act=_stats(x), grad=_stats(x)),
                                   "only_nan": LayerStep(act=bounded)}))
    agg.add(StepTable.from_layers({"fc": LayerStep(act=bounded, grad=bounded),
                                   "only_nan": LayerStep(act=bounded)}))
    fc = agg.summary("fc", "Linear", 0, 2, set(), {"float16"}, set(), {}, ([], []))
    assert fc.absmax == float(x.abs().max()) and fc.grad_absmax == fc.absmax
    assert fc.headroom == math.log2(65504 / fc.absmax) == fc.grad_headroom
    assert fc.nonfinite_steps == 1
    # A layer with no step of exact extremes keeps the bound: all that is known.
    only = agg.summary("only_nan", "Linear", 1, 2, set(), {"float16"}, set(), {}, ([], []))
    assert only.absmax == 4.0 and only.headroom == math.log2(65504 / 4.0)


def test_consecutive_backoffs_that_began_in_two_layers_are_each_their_own_layers(
        tmp_path: Path) -> None:
    # Backoffs at 8 (made in b) and 9 (made in a) are one GradScaler episode; a's finding
    # missed step 9, and b's claimed it, while the collapse counted it as a's.
    plain, watched, report = _run(tmp_path, "4,9", "8", 16, "--every", "1")
    assert watched == plain
    assert report["scaler"]["backoff_steps"] == [4, 8, 9]
    backoffs = {f["module"]: f for f in report["findings"] if f["kind"] == "scaler_backoff"}
    assert sorted(backoffs) == ["a", "b"], list(backoffs)
    assert backoffs["a"]["steps"] == [4, 9] and backoffs["b"]["steps"] == [8]


def test_fp8_amax_columns_cover_every_layer_of_a_deep_model_recorded_every_step() -> None:
    # Review 59a: a T5's FP8 table showed "-" and "0/1" for layers recorded every step: the
    # amaxes came from the step history, which keeps each step's 32 worst layers. 40
    # blocks (80 leaf modules), every step recorded: each row compares 9 of 10 steps.
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(40) for m in (nn.Linear(8, 8), nn.Tanh())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as w:
        for step in range(10):
            x = torch.randn(16, 8) * (1.0 + 3 * (step % 2))  # amax jumps every other step
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = w.session
    assert len([lay for lay in s.layers if lay.type in ("Linear", "Tanh")]) == 80
    assert all(len(r.layers) <= 32 for r in s.history)
    acts = {r.layer: r for r in fp8_rows(s) if r.tensor == "activation"}
    assert len(acts) == 80  # every leaf ran in float16
    assert {(r.recorded, r.compared) for r in acts.values()} == {(10, 9)}
    grads = [r for r in fp8_rows(s) if r.tensor == "gradient"]
    # (Deep in the stack some gradients are exact zeros in some steps: no amax there.)
    full = [r for r in grads if r.recorded == 10]
    assert len(full) >= 40 and {r.compared for r in full} == {9}
    # The first Linear's outputs quadruple every other step: step 1's outran the scale
    # that step 0 set (later windows hold a large amax already).
    first = acts["0"]
    assert first.amax_spread_bits is not None and first.amax_spread_bits > 1.5
    assert first.steps_amax_beyond_scale >= 1
    # Its figures are those a full history gives: the report of a run written before
    # them (no such fields) reads them from the history, for the layers it kept.
    kept = [name for name in acts if all(name in r.layers for r in s.history)]
    old = replace(s, layers=[replace(lay, fp8_act_amax_steps=None, fp8_grad_amax_steps=None)
                             for lay in s.layers])
    for row in fp8_rows(old):
        if row.layer in kept and row.tensor == "activation":
            assert row == acts[row.layer], row.layer


def test_fix_follows_the_error_into_the_next_blocks_copy_of_what_it_forced() -> None:
    # Review 59a: with blocks.0.attn in float32 the error moved to blocks.1.attn.proj, and
    # `fix` added that Linear (and the next block's), which left it there: the exp is in
    # attn's own code. 14 trials of 40 s for a 4-second script. The next block's copy of
    # the forced member is what to add; and the children of a copy of a member whose
    # children did not do are not tried again.
    from amp_doctor.fix import find_fix
    from tests.test_findings_56b import _run_attention

    result = find_fix(lambda fp32: (_run_attention(fp32, anomaly=False), 0), max_trials=12)
    tried = [(t.fp32, t.why) for t in result.trials]
    assert tried == [
        ((), "baseline, repeated"),
        (("blocks.0.attn.proj",), "the culprits the errors name"),
        (("blocks.0.attn",), "their enclosing modules"),
        (("blocks.0.attn", "blocks.1.attn"), "add blocks.1.attn: the error moved there"),
        (("blocks.0.attn.qkv", "blocks.1.attn"), "narrow blocks.0.attn to blocks.0.attn.qkv"),
        (("blocks.0.attn.proj", "blocks.1.attn"), "narrow blocks.0.attn to blocks.0.attn.proj"),
        (("blocks.1.attn",), "drop blocks.0.attn"),
    ], tried
    assert result.best is not None and result.best.fp32 == ("blocks.0.attn", "blocks.1.attn")
