"""Session 56: a 0/0 loss term with finite gradients arms anomaly mode's search, which
names the division in the loop's code as the one root cause (review 55, item 5)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import amp_doctor
from amp_doctor.records import Session
from amp_doctor.sinks.text import render_text


def _count_div_run(steps: int = 30) -> tuple[Session, list[float]]:
    """A detector-style loss: a box term summed over the positive samples and divided by
    their count, which is 0 every 7th step (3, 10, 17, 24): 0/0 = NaN in the loss, while
    the gradients stay finite (the sum is over no elements), so the GradScaler skips
    nothing and no gradient flag shows the bad step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    losses: list[float] = []
    with amp_doctor.watch(model, anomaly=True) as doctor:
        for step in range(steps):
            x = torch.randn(64, 16)
            labels = torch.randint(0, 2, (64,))
            if step % 7 == 3:
                labels.zero_()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                cls = nn.functional.cross_entropy(out[:, :2].float(), labels)
                pos = labels > 0
                box = (out[pos, 2:].float() ** 2).sum() / pos.sum()  # DIVISION LINE
                loss = cls + box
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    assert doctor.session is not None
    return doctor.session, losses


def test_a_nan_loss_with_finite_gradients_arms_the_search() -> None:
    # Review 55: the search never armed (only the gradients' flags armed it), so the report
    # said "the op search ran after the NaN and did not see it again" and named no op,
    # where `--on-nonfinite raise` found the division at once.
    s, losses = _count_div_run()
    assert [i for i, v in enumerate(losses) if v != v] == [3, 10, 17, 24]
    assert s.scaler is not None and s.scaler.skipped_steps == []
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.op, f.module) for f in errors] == [("nonfinite_forward", "aten.div", None)]
    (err,) = errors
    # Found by the search aimed at the recurrence (every 7 steps), with the line.
    assert err.step == 17
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), start=1)
                if text.rstrip().endswith("# DIVISION LINE"))
    assert err.data["frames"][0].startswith(f"{__file__}:{line} ")
    assert "computed 0/0" in err.advice and "clamp_min(1)" in err.advice
    # The NaN loss is its consequence, not a second error.
    (loss,) = [f for f in s.findings if f.kind == "nonfinite_loss"]
    assert loss.severity == "info"
    assert "The op-level search found aten.div make NaN/inf in that code at step 17" in (
        loss.message)
    # The division's backward made inf that went nowhere: part of the same error, not an
    # info finding of its own.
    assert not [f for f in s.findings if f.kind == "nonfinite_discarded"]
    text = render_text(s)
    assert "Consequences: the loss was NaN/inf in 4 of the 30 steps checked." in " ".join(
        text.split())


def test_the_error_where_a_flush_began_is_kept_beside_the_layers_it_starved() -> None:
    # Review 56b: a 14-layer MLP, float16, no GradScaler, the loss times 1e-6. The error
    # at the layer where the flush began (listing the 13 layers whose weights got no
    # gradient) was the 14th missing_scaler finding, and the cap of 8 per kind cut it; the
    # report's only error was then a resolution finding on the output, a near-constant
    # 0.09 at initialisation, whose float16 spacing (6e-5) is no limit to its targets.
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(13):
        layers += [nn.Linear(32 if i == 0 else 64, 64), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(64, 1))
    first = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1e4, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(32, 1, generator=g)
    with amp_doctor.watch(model, every=5) as doctor:
        for _ in range(10):
            x = torch.randn(64, 32, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x)
                loss = 1e-6 * nn.functional.mse_loss(pred.float(), torch.tanh(x @ w_true / 4))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    assert torch.equal(model[0].weight, first)  # what the finding says: it never trained
    s = doctor.session
    assert s is not None
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module) for f in errors] == [("missing_scaler", "26")]
    assert errors[0].data["starved_layers"] == [str(i) for i in range(0, 26, 2)]
    assert not s.findings_of("output_resolution")
    out = next(lay for lay in s.layers if lay.name == "26")
    assert out.absmax < 1 and out.range_rel is not None and out.range_rel < 0.001


def _contrastive_run(**watch_kw: object) -> Session:
    """SimCLR's loss on embeddings someone forgot to normalise, float16: their
    similarities (about 1600) over a temperature of 0.01 pass float16's max in the
    division, outside the model; the cross entropy of the inf is NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(16))
        model[0].bias.fill_(10.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, **watch_kw) as doctor:  # type: ignore[arg-type]
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                z = model(torch.randn(8, 16) * 0.1)
                sim = z @ z.t() / 0.01  # QUOTIENT LINE
                sim = sim.masked_fill(torch.eye(8, dtype=torch.bool), float("-inf"))
                loss = nn.functional.cross_entropy(sim.float(), torch.arange(8).roll(1))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert doctor.session is not None
    return doctor.session


def test_a_quotient_past_the_format_is_not_told_to_add_an_epsilon() -> None:
    # Review 56a: "add an epsilon that float16 can hold" for a division by 0.01; and the
    # markdown verdict named the scaler's first culprit layer as the culprit of an op that
    # its finding placed outside the model.
    from amp_doctor.sinks.text import render_verdict

    s = _contrastive_run(anomaly=True)
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert (err.kind, err.op, err.module, err.step) == ("nonfinite_forward", "aten.div", None, 0)
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), start=1)
                if text.rstrip().endswith("# QUOTIENT LINE"))
    assert err.data["frames"][0].startswith(f"{__file__}:{line} ")
    assert "the quotient grew past the format's max" in err.advice
    assert "epsilon" not in err.advice and "F.normalize" in err.advice
    verdict = render_verdict(s)
    assert "**culprit** the loop's own code (outside the watched model)" in verdict
    assert "`0`" not in verdict


def test_a_float32_loss_is_not_said_to_rule_out_a_float16_overflow_before_it() -> None:
    # Review 56a: "the loss computation itself, which ran in float32 already here, so not
    # a float16 overflow there" for the similarities above, float16 before the loss.
    s = _contrastive_run()
    (loss,) = s.findings_of("nonfinite_loss")
    assert loss.data["loss_dtypes"] == ["float32"]
    assert "not a float16 overflow" not in loss.advice
    assert "`z @ z.t() / temperature` can overflow float16" in loss.advice


def test_the_follow_ons_of_a_bad_update_have_no_fix_of_their_own() -> None:
    # Review 56b: after `opt.step()` beside `scaler.step(opt)`, the backoffs, the collapse
    # and the NaN loss were info under the error but each advised its own fix (conv1 in
    # float32), whose weights the extra update had made NaN.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # A scale that overflows the first steps' gradients: skipped by the scaler, applied
    # by the leftover step, which makes the weights NaN.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    with amp_doctor.watch(model, every=2) as doctor:
        for _ in range(6):
            x, y = torch.randn(32, 16) * 50, torch.randint(0, 4, (32,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            opt.step()  # the leftover of the float32 loop
            scaler.update()
    assert not all(p.isfinite().all() for p in model.parameters())
    s = doctor.session
    assert s is not None
    (err,) = [f for f in s.findings if f.severity == "error"]
    follow = [f for f in s.findings if f.data.get("follow_on_of", "-") != "-"
              and f.kind != "stepped_twice"]
    assert err.kind == "stepped_twice" and follow
    for f in follow:
        assert f.severity == "info"
        assert f.advice.startswith("Nothing of its own to fix: it follows from the "
                                   "stepped_twice error"), (f.kind, f.advice)
        assert "It follows from the stepped_twice error (see that finding)" in f.message


def test_the_launcher_is_no_user_frame() -> None:
    # Review 56a: the frames of an op in the script's own code ended with
    # `.venv/bin/amp-doctor:8 in <module>`, the console script that ran it.
    import os
    import sysconfig

    from amp_doctor.anomaly.userframes import is_user_file

    assert not is_user_file(os.path.join(sysconfig.get_paths()["scripts"], "amp-doctor"))
    assert is_user_file(__file__)


def test_anomaly_mode_tells_a_batch_beyond_float16_as_the_data_like_the_default() -> None:
    # Review 56b: raw audio features up to 1.8e5 given to a Conv1d under float16 autocast.
    # The default mode said `input_beyond_format`, the fix in the data; anomaly mode named
    # the cast (`nonfinite_forward [aten._to_copy]`) with "keep the op in float32", and its
    # next steps were `--fp32 frontend.0` (which moved the inf one layer on) and `fix`.
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.ReLU(), nn.Conv1d(8, 8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu")
    runs = {}
    for anomaly in (False, True):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1e-6)
        with amp_doctor.watch(m, anomaly=anomaly) as doctor:
            for _ in range(4):
                x = torch.rand(2, 4, 32) * 1.8e5  # unnormalised features
                with torch.autocast("cpu", dtype=torch.float16):
                    out = m(x)  # MODEL CALL
                loss = out.float().pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        assert doctor.session is not None
        runs[anomaly] = doctor.session
    for anomaly, s in runs.items():
        errors = [f for f in s.findings if f.severity == "error"]
        # The default mode's recorded layer figures: the first layer's output overflowed,
        # from a batch beyond the format (its `input_absmax`).
        kind = "input_beyond_format" if anomaly else "activation_overflow"
        assert [(f.kind, f.module) for f in errors] == [(kind, "0")], anomaly
        assert errors[0].data["input_absmax"] > 65504
        as_cli = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python",
                                                                                "t.py"]))
        lines = next_steps(as_cli)
        assert any("the fix is in the data" in line for line in lines), (anomaly, lines)
        assert not any("--fp32" in line or "amp-doctor fix" in line for line in lines), lines
    err = next(f for f in runs[True].findings if f.severity == "error")
    assert err.op == "aten._to_copy" and err.data["batch_cast"] is True
    assert err.advice.startswith("Normalise or clip the data before the model")
    assert err.data["input_absmax"] > 65504 and err.frame is not None
    assert "autocast's cast of it for layer 0 (aten._to_copy) made +inf" in " ".join(
        err.message.split())


class _LossReturning(nn.Module):
    """A model that returns ``(logits, loss)``, the loss in float32 (nanoGPT, HF)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
        logits = self.head(self.emb(idx))
        return logits, nn.functional.cross_entropy(logits.float(), targets)


def test_the_loss_a_compiled_model_returns_is_no_gradient_to_simulate() -> None:
    # Review 56a: under torch.compile only the model's own outputs are recorded; the
    # gradient of the float32 loss it returns is backward's seed, 1, read as "2^16 at a
    # GradScaler's scale: beyond float16's max" in 100% of the model's gradients.
    torch.manual_seed(0)
    raw = _LossReturning()
    model = torch.compile(raw, backend="aot_eager")
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    with amp_doctor.watch(model) as doctor:
        for _ in range(3):
            idx = torch.randint(0, 32, (8,))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(idx, idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert s is not None and s.findings_of("compiled_model")
    assert not s.findings_of("whatif_float16")
    root = next(lay for lay in s.layers if lay.type == "_LossReturning")
    assert root.grad_absmax != 1.0  # the seed is not among the recorded gradients


class _Forecaster(nn.Module):
    """Review 56b's latent ODE: z ~ 300 integrated by z + 1e-3 * dyn(z); dyn's Tanh
    saturates (its input reaches ~250), so its backward makes exact zeros, in float32 too."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 32)
        self.dyn = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
        self.decoder = nn.Linear(32, 8)
        with torch.no_grad():
            for lin in (self.encoder, self.decoder):
                lin.weight.zero_()
                lin.bias.zero_()
            self.encoder.weight[:8, :].copy_(torch.eye(8))
            self.decoder.weight[:, :8].copy_(torch.eye(8))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        z = self.encoder(t)
        for _ in range(20):
            z = z + 1e-3 * self.dyn(z)
        return self.decoder(z)


def test_zeros_a_saturated_tanh_made_are_not_called_a_flush() -> None:
    # Review 56b: "dyn.0: 98.8% of its output-gradient values are exactly zero: the gradient
    # had already underflowed float16 in dyn.2 ... flushed to zero even with the loss
    # scale", with advice to raise init_scale; the Tanh after dyn.0 got gradients that were
    # neither zero nor subnormal, and made the zeros itself (1 - y**2 at y = 1).
    torch.manual_seed(0)
    model = _Forecaster()
    opt = torch.optim.Adam(model.dyn.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=5) as doctor:
        for _ in range(10):
            t = 290 + 20 * torch.rand(32, 8, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(t).float(), t + 0.3 * torch.sin(t))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s is not None
    lay = {x.name: x for x in s.layers}
    assert (lay["dyn.0"].grad_zero_frac or 0) > 0.9  # the zeros are there
    assert (lay["dyn.1"].grad_zero_frac or 0) < 0.1  # but the Tanh got none
    assert (lay["dyn.1"].grad_underflow_frac or 0) < 0.1
    assert not [f for f in s.findings if f.module == "dyn.0"]


def test_markdown_keeps_code_spans_as_written_and_lists_render() -> None:
    # Review 56d: TensorBoard's text tab showed `GradScaler(device\_type, init\_scale=2.0\*\*16)`
    # (copied code broken), and the backoff notes' bullets as literal asterisks.
    import re

    from amp_doctor.sinks.tb_session import backoff_groups
    from amp_doctor.sinks.text import _md, render_markdown

    advice = "raise `init_scale`: `torch.amp.GradScaler(device_type, init_scale=2.0**16)`"
    assert _md(advice) == ("raise `init_scale`: `torch.amp.GradScaler(device_type, "
                           "init_scale=2.0**16)`")
    assert _md("a_b * c | d `e_f`") == "a\\_b \\* c \\| d `e_f`"
    assert _md("an unpaired ` a_b") == "an unpaired ` a\\_b"
    s = _contrastive_run(anomaly=True)
    md = render_markdown(s)
    spans = re.findall(r"`([^`]*)`", md)
    assert any("z.float() @ z.float().t() / t" == x for x in spans)
    assert not [x for x in spans if "\\" in x]
    notes = backoff_groups(s)
    assert notes
    for _, text in notes:
        head, blank, *rest = text.splitlines()
        assert head.startswith("**Scale backoff") and blank == "" and rest[0].startswith("* ")
        assert "overflowed first in" not in text


def test_a_heatmaps_grey_cells_say_when_the_history_left_layers_out() -> None:
    # Review 56d: on a 100-layer model more than half of the heatmap was grey, "not
    # recorded", in a run that recorded every step: the history keeps each step's 32 worst.
    # Since session 60 every layer's cells are kept (Session.heatmaps): no grey cell at all;
    # a report from before them still says why its cells are grey.
    import dataclasses

    from amp_doctor.dtypes import limits
    from amp_doctor.sinks.tb_session import MISSING_KEPT, heatmap_grids
    from amp_doctor.steps.history import HISTORY_LAYERS

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(HISTORY_LAYERS + 8)])
    with amp_doctor.watch(model, every=1) as doctor:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s is not None and all(rec.dropped_layers > 0 for rec in s.history)
    grids = heatmap_grids(s, limits(torch.float16))
    assert len(grids) == 4 and all(g.missing == "not recorded" for g in grids.values())
    for g in grids.values():
        assert len(g.names) == HISTORY_LAYERS + 8 and g.steps == [0, 1]
        assert all(v is not None for row in g.values for v in row), g.figure
    old = heatmap_grids(dataclasses.replace(s, heatmaps=None), limits(torch.float16))
    assert old and all(g.missing == MISSING_KEPT for g in old.values())
    assert any(v is None for row in old["heatmap/headroom"].values for v in row)
    small = _count_div_run(steps=2)[0]
    kept_all = heatmap_grids(small, limits(torch.float16))
    assert kept_all and all(g.missing == "not recorded" for g in kept_all.values())


def test_the_next_fp32_try_for_an_op_covers_every_layer_that_runs_its_line() -> None:
    # Review 56b: anomaly mode found the hand-written exp in blocks.0.attn, and the next
    # step was `--fp32 blocks.0.attn`, which moved the overflow to blocks.1.attn (the same
    # class, the same line). The try is every such layer: `--fp32 'blocks.*.attn'`.
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps
    from tests.test_findings_56b import _run_attention

    s = _run_attention(())
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module, f.op) for f in errors] == [
        ("nonfinite_forward", "blocks.0.attn", "aten.exp")]
    as_cli = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t.py"]))
    lines = next_steps(as_cli)
    assert "amp-doctor diagnose --fp32 'blocks.*.attn' t.py" in lines[0]
    fixed = _run_attention(("blocks.*.attn",))
    assert not [f for f in fixed.findings if f.severity == "error"]


class _Gated(nn.Module):
    """A hand-written sigmoid gate, ``1 / (1 + exp(-x))``: exp(-x) overflows float16 for
    x < -11, and the gate's ``x * (1 / inf)`` is fine, but ``inf / inf`` in its own code is
    NaN. Its input is the output of a watched Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.fc(x))


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(-x)
        return e / (e * (1 + e))  # = 1 / (1 + e), NaN once e is inf


def test_a_nan_first_seen_in_a_layer_fed_by_watched_layers_is_its_own() -> None:
    # Review 56c: "Its input is not checked: if it was non-finite already, the op that made
    # it is in blocks.1's own forward code", and `--fp32 blocks.1` next, for a gate whose
    # input was a watched Linear's output, finite in that step.
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps

    torch.manual_seed(0)
    model = _Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with amp_doctor.watch(model, every=1) as doctor:
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(4, 8) * (400.0 if step == 1 else 1.0))
            loss = out.float().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert s is not None
    (loss_f,) = s.findings_of("nonfinite_loss")
    assert loss_f.module == "gate" and loss_f.data["inputs_watched"] is True
    text = " ".join(loss_f.message.split())
    assert "its inputs were watched layers' outputs, finite then" in text
    assert "Its input is not checked" not in text
    as_cli = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t.py"]))
    assert "--fp32 gate t.py" in next_steps(as_cli)[0]
