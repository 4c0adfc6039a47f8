"""Session 55: a GradScaler updated after each of two optimizers (two backoffs in one
step); anomaly mode's origins off the autograd graph (T5's position buckets); a 0/0 loss
term under a GradScaler; a CTC loss that is inf in float32 (reviews 54, 55, 55b)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import amp_doctor
from amp_doctor.analysis.next_steps import next_steps
from amp_doctor.fix import find_fix, render_fix
from amp_doctor.jsoncodec import from_jsonable, to_jsonable
from amp_doctor.records import Session
from amp_doctor.sinks.text import render_text
from tests.test_tensorboard import _load, _scalars


def _two_optimizers(update_each: bool, logdir: Path | None = None) -> Session:
    """Body and head with an optimizer each, one GradScaler; every gradient overflows in
    step 3 (the loss times 1e30). ``update_each``: ``scaler.update()`` after each
    ``scaler.step`` (the misuse), else once per iteration (the recipe)."""
    torch.manual_seed(0)
    body, head = nn.Linear(4, 4), nn.Linear(4, 2)
    model = nn.Sequential(body, head)
    opt_b = torch.optim.SGD(body.parameters(), lr=0.0)
    opt_h = torch.optim.SGD(head.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    with amp_doctor.watch(model, tensorboard=logdir is not None,
                          logdir=str(logdir) if logdir else None) as doctor:
        for step in range(6):
            x = torch.randn(8, 4)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = (out.float() * (1e30 if step == 3 else 1.0)).sum()
            opt_b.zero_grad()
            opt_h.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt_b)
            if update_each:
                scaler.update()
            scaler.step(opt_h)
            scaler.update()
    assert doctor.session is not None
    return doctor.session


def test_two_backoffs_in_one_step_are_counted_as_two(tmp_path: Path) -> None:
    # Review 54: with update() after each optimizer the scale halved twice in one
    # iteration (1024 -> 256), yet the report said "1 backoff", "each skipped one optimizer
    # step" and "1 skipped optimizer step", where both optimizers skipped.
    s = _two_optimizers(True, tmp_path)
    sc = s.scaler
    assert sc is not None
    assert sc.backoff_steps == [3]
    assert [(e.step, e.kind, e.count) for e in sc.events] == [(3, "backoff", 2)]
    assert sc.scale[-1] == (3, 256.0)
    assert sc.skipped_by_optimizer == {"SGD#0": [3], "SGD#1": [3]}
    text = " ".join(render_text(s).split())
    assert ("Scaler: scale 1024 -> 256; 2 backoffs in 1 step (step 3); 0 growths; "
            "2 skipped optimizer steps in 1 step (SGD#0 1, SGD#1 1).") in text
    (f,) = [f for f in s.findings if f.kind == "scaler_backoff"]
    assert f.message.startswith("GradScaler backed off 2x in 1 step at step 3: the scale fell "
                                "from 1024 to 256")
    assert f.data["backoffs"] == 2
    # The count survives the JSON report (``amp-doctor report`` renders it again).
    saved = json.loads(json.dumps(to_jsonable(s)))  # as the JSON report holds it
    assert [e["count"] for e in saved["scaler"]["events"]] == [2]
    again = from_jsonable(Session, saved)
    assert render_text(again) == render_text(s)
    assert [f.kind for f in s.findings if f.severity == "warning"][0] == "update_between_steps"
    # The dashboard's cumulative count, as the step happened.
    assert [v for st, v in _scalars(_load(tmp_path), "scaler/backoffs") if st >= 3][0] == 2.0


def test_one_update_per_iteration_backs_off_once_and_names_both_optimizers_skips() -> None:
    s = _two_optimizers(False)
    sc = s.scaler
    assert sc is not None
    assert [(e.step, e.count) for e in sc.events] == [(3, 1)]
    assert sc.scale[-1] == (3, 512.0)
    text = " ".join(render_text(s).split())
    assert ("1 backoff (step 3); 0 growths; 2 skipped optimizer steps in 1 step "
            "(SGD#0 1, SGD#1 1).") in text
    (f,) = [f for f in s.findings if f.kind == "scaler_backoff"]
    assert f.severity == "info"
    assert "GradScaler backed off 1x as designed" in f.message
    # Not "Each skipped one optimizer step": each optimizer skipped one.
    assert "Each skipped one optimizer step" not in f.message
    assert "2 optimizer step(s) were skipped (skipped per optimizer: SGD#0 1, SGD#1 1)" \
        in " ".join(f.message.split())


def test_culprits_of_two_optimizers_skips_are_in_backward_order() -> None:
    # The body's optimizer skips first, so its layer was named first ("in backward order:
    # 0, 1"); the head's gradients come first in backward.
    s = _two_optimizers(False)
    sc = s.scaler
    assert sc is not None
    assert sc.events[0].culprits == ["1", "0"]
    (f,) = [f for f in s.findings if f.kind == "scaler_backoff"]
    assert "in backward order: 1, 0." in " ".join(f.message.split())


def _buckets(t: int) -> torch.Tensor:
    """T5's relative-position buckets in small: the log of integer distances is -inf at
    distance 0, cast to integers and dropped by ``torch.where``; no gradient passes."""
    rel = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).abs()
    far = 4 + (torch.log(rel.float() / 4) * 2).to(torch.long)
    return torch.where(rel < 4, rel, far.clamp(max=7))


class _PosBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Embedding(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias(_buckets(x.shape[1])).squeeze(-1)[None].mean(-1, keepdim=True)
        return x + b


class _Scores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x) * self.gain
        return torch.bmm(q, q.transpose(1, 2)).mean(-1)


def test_a_dropped_log_off_the_graph_does_not_hide_the_real_overflow() -> None:
    # Review 55 (a T5 encoder): anomaly mode named the bucket function's harmless log(0),
    # the first non-finite op of every step, as an error with the later backoffs as its
    # consequences, and never named the attention scores that overflowed float16.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _PosBias(), _Scores())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
        for step in range(12):
            model[2].gain = 1e3 if step in (6, 7) else 1.0  # q @ q^T beyond 65504
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(2, 6, 16)).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s is not None
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module, f.op, f.step) for f in errors] == [
        ("nonfinite_forward", "2", "aten.bmm", 7)]
    assert "it was armed by the NaN/Inf the per-step check saw at step 6" in " ".join(
        errors[0].message.split())
    (log,) = [f for f in s.findings if f.op == "aten.log"]
    assert (log.kind, log.severity, log.module) == ("nonfinite_discarded", "info", "1")
    assert log.data["off_graph"] is True
    assert "No gradient flows back through it" in " ".join(log.message.split())
    assert log.advice.startswith("Nothing to do")
    # The op's own input range is no batch beyond the format: the next step is float32
    # for the layer, not "the fix is in the data" (review 55).
    as_cli = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t5.py"]))
    lines = next_steps(as_cli)
    assert lines and "--fp32 2 t5.py" in lines[0]
    assert not any("the fix is in the data" in line for line in lines)


def test_a_zero_over_zero_loss_term_under_a_scaler_is_told_as_nan_from_its_first_step() -> None:
    # Review 55: a box loss divided by its count of positives, 0 in some batches: NaN at
    # steps 3, 10, 17, with finite gradients (the scaler skipped none). The report said
    # "first seen at step 10", that the updates took NaN gradients that make the weights
    # non-finite, and that the loss was inf from the square of a large value.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for step in range(20):
            x = torch.randn(8, 4)
            pos = torch.zeros(8, dtype=torch.bool) if step % 7 == 3 else torch.arange(8) < 3
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x).float()
            loss = out.pow(2).mean() + out[pos, 0].abs().sum() / pos.sum()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s is not None
    assert all(torch.isfinite(p).all() for p in model.parameters())
    (f,) = [f for f in s.findings if f.kind == "nonfinite_loss"]
    assert f.step == 3 and f.data["bad_steps"][:2] == [3, 10]
    msg = " ".join(f.message.split())
    assert "first seen at step 3" in msg
    assert "Their updates took" not in msg and "make the weights non-finite" not in msg
    assert "The GradScaler did not skip 3 of these steps" in msg
    assert "a 0/0 such as a sum over no elements divided by a count of 0" in msg
    assert msg.endswith("but the loss you see is NaN.")
    assert f.advice.startswith("Guard the division that can be 0/0")


def _ctc_session() -> Session:
    """Targets longer than their input in steps 0 and 3: `F.ctc_loss` is inf there, in the
    float32 autocast runs it in (anomaly mode on)."""
    torch.manual_seed(0)
    net = nn.ModuleDict({"body": nn.Sequential(nn.Conv1d(8, 16, 5, padding=2, stride=2),
                                               nn.ReLU()),
                         "head": nn.Linear(16, 10)})
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(net, anomaly=True, tensorboard=False) as doctor:
        for step in range(6):
            x = torch.randn(4, 8, 20)
            in_len = torch.full((4,), 10, dtype=torch.long)
            tgt_len = torch.full((4,), 4, dtype=torch.long)
            if step % 3 == 0:
                tgt_len[0] = 12  # longer than its 10 input frames: no alignment
            tgt = torch.randint(1, 10, (4, 12))
            with torch.autocast("cpu", dtype=torch.float16):
                logp = net["head"](net["body"](x).transpose(1, 2)).log_softmax(-1)
                loss = F.ctc_loss(logp.transpose(0, 1), tgt, in_len, tgt_len)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert doctor.session is not None
    return doctor.session


def test_a_ctc_loss_without_an_alignment_is_not_told_to_run_in_float32() -> None:
    # Review 55b: anomaly mode's advice for a CTC loss that was inf in float32 (the format
    # autocast runs it in) was "Keep this op in float32 ... or use bfloat16", which cannot
    # help; `zero_infinity=True` does. And `fix` spent every trial on float32 layers.
    s = _ctc_session()
    (f,) = [f for f in s.findings if f.op == "aten._ctc_loss"]
    assert f.severity == "error" and f.data["dtype"] == "float32"
    assert "zero_infinity=True" in f.advice and "ran in float32 already" in f.advice
    assert "bfloat16" not in f.advice
    runs: list[tuple[str, ...]] = []

    def run(fp32: tuple[str, ...]) -> tuple[Session, int]:
        runs.append(fp32)
        return _ctc_session(), 0

    result = find_fix(run)
    assert runs == [()]  # the baseline only: no float32 layer set is tried
    assert any("ran in float32 already (aten._ctc_loss): float32 layers cannot fix them"
               in n and "zero_infinity=True" in n for n in result.notes)
    text = render_fix(result)
    assert "No set of float32 layers removed" not in text and "bfloat16" not in text


class _LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.to(x.dtype)  # timm-style, in the activations' format


def test_activation_underflow_gives_the_tables_share_and_its_worst_step() -> None:
    # Review 55b: a LayerScale at 1e-6 growing as it trains read "18.9% of output values
    # are below float16's smallest normal" beside the table's 37.3% and a step 0 at 89%.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), _LayerScale(64), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(8):
            x = torch.randn(32, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean() - model(x).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s is not None
    lay = s.layer("1")
    steps = [(r.layers["1"].act.underflow_frac, r.step) for r in s.history
             if "1" in r.layers and r.layers["1"].act is not None]
    worst, at = max(steps)
    assert worst > lay.underflow_frac + 0.01  # it grew out of the tiny start
    (f,) = [f for f in s.findings if f.kind == "activation_underflow" and f.module == "1"]
    msg = " ".join(f.message.split())
    from amp_doctor import format as fmt

    assert msg.startswith(f"layer 1 (_LayerScale): {fmt.pct(lay.underflow_frac)} of its "
                          f"output values over {lay.recorded_steps} recorded steps were below "
                          "float16's smallest normal")
    assert f"{fmt.pct(worst)} at step {at}" in msg


def test_a_collapse_whose_every_backoff_had_a_bad_loss_does_not_mention_a_search() -> None:
    # Review 55b: "the loss itself was NaN/inf in every backoff but GradScaler's own search
    # for its scale" of a run in which every backoff had an inf loss, none the scaler's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for step in range(40):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(16, 8)).float()
            loss = out.pow(2).mean() * (math.inf if step % 4 == 0 else 1.0)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s is not None and s.scaler is not None
    assert s.scaler.backoff_steps == list(range(0, 40, 4))
    (f,) = s.findings_of("scale_collapse")
    msg = " ".join(f.message.split())
    assert "the loss itself was NaN/inf in every backoff, so the gradients" in msg
    assert "own search" not in msg
    # Its layers, not the model itself counted as one more (review 55b: "4 layers").
    assert s.scaler.events[0].culprits == ["2", "Sequential", "1", "0"]
    (b,) = s.findings_of("scaler_backoff")
    assert "(3 layers with non-finite gradients)" in " ".join(b.message.split())


def test_a_float32_loss_is_not_told_to_be_computed_in_float32() -> None:
    # Review 55b: "compute the loss in float32 with `loss_fn(out.float(), y)`" to a loop
    # that did (a diffusion model's `F.mse_loss(model(x, t).float(), noise)`).
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for step in range(12):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(16, 8)).float()
            loss = F.mse_loss(out, torch.zeros_like(out)) / (0.0 if step == 5 else 1.0)
            opt.zero_grad()
            loss.backward()
            if step != 5:
                opt.step()
    s = doctor.session
    assert s is not None
    (f,) = s.findings_of("nonfinite_loss")
    assert f.data["loss_dtypes"] == ["float32"]
    assert "ran in float32 already here" in f.advice and ".float(), y)" not in f.advice
