"""Stop 45's fixes: what-ifs that say what they cannot see, and wording."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import amp_doctor


class _Attention(nn.Module):
    """Hand-written attention whose scores are large: beyond float16's max inside the
    module, while every layer's output (a softmax-weighted mean) stays small."""

    def __init__(self, d: int = 16, temperature: float = 1.0) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.temperature = temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        att = (q @ k.transpose(-2, -1)) * self.temperature
        return self.proj(att.softmax(-1) @ v)


def _train(model: nn.Module, dtype: torch.dtype, steps: int = 4,
           **watch_kw: object) -> tuple[list[float], amp_doctor.Session | None]:
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses: list[float] = []

    def loop() -> None:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype):
                loss = model(torch.randn(2, 8, 16)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())

    if not watch_kw:
        loop()
        return losses, None
    with amp_doctor.watch(model, every=1, tensorboard=False, **watch_kw) as doctor:
        loop()
    return losses, doctor.session


def test_a_float16_what_if_names_what_it_cannot_see() -> None:
    """Review 44d: a bfloat16 nanoGPT whose attention scores overflow float16 inside the
    attention module got a what-if that blamed only layers' outputs. The simulation reads
    layers' outputs; it now says so, and how to check the rest."""
    torch.manual_seed(0)
    model = _Attention(temperature=3e5)
    fp16 = _Attention(temperature=3e5)
    fp16.load_state_dict(model.state_dict())
    # The blind spot is real: in float16 the scores overflow and the loss is NaN ...
    fp16_losses, _ = _train(fp16, torch.float16)
    assert any(v != v for v in fp16_losses), fp16_losses
    # ... while no layer's output leaves float16's range in the bfloat16 run.
    _, s = _train(model, torch.bfloat16, target_dtype="float16")
    assert s is not None
    (wi,) = [f for f in s.findings if f.kind == "whatif_float16"]
    assert "not simulated" in wi.advice and "`amp-doctor diagnose --anomaly`" in wi.advice
    assert "q @ k.transpose(-2, -1)" in wi.advice


def test_an_asked_float16_what_if_that_finds_nothing_says_so() -> None:
    torch.manual_seed(0)
    _, s = _train(_Attention(temperature=0.25), torch.bfloat16, target_dtype="float16")
    assert s is not None
    (wi,) = [f for f in s.findings if f.kind == "whatif_float16"]
    assert wi.severity == "info" and wi.data["rows"] == []
    assert "no watched layer's outputs or output gradients would leave float16's range" \
        in wi.message
    assert "not simulated" in wi.advice
    # Unasked, a bfloat16 run that would fit float16 gets no such finding.
    torch.manual_seed(0)
    _, quiet = _train(_Attention(temperature=0.25), torch.bfloat16, target_dtype=None)
    assert quiet is not None
    assert not [f for f in quiet.findings if f.kind == "whatif_float16"]


class _Towers(nn.Module):
    """Review 45b's two towers: each tower's fc2 overflows float16 on its own input."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        self.item = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        for tower in (self.user, self.item):
            with torch.no_grad():
                tower[2].weight.normal_(0, 60.0)
        self.norm = nn.LayerNorm(128)
        self.head = nn.Linear(128, 1)

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.cat([self.user(u), self.item(i)], -1)))


def _towers_losses(steps: int = 3, **watch_kw: object) -> tuple[list[float],
                                                                amp_doctor.Session | None]:
    torch.manual_seed(0)
    model = _Towers()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []

    def loop() -> None:
        for _ in range(steps):
            u, i = 1000 * torch.randn(64, 16, generator=g), 1000 * torch.randn(64, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(u, i).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())

    if not watch_kw:
        loop()
        return losses, None
    with amp_doctor.watch(None, every=1, tensorboard=False, **watch_kw) as doctor:
        loop()
    return losses, doctor.session


def test_fp32_on_a_model_found_inside_its_first_call_applies_from_step_0() -> None:
    """Review 45b: `diagnose --fp32 Net` (or '*') found the model in its first forward,
    after torch had collected that call's pre-hooks: step 0 ran in float16 and went NaN."""
    plain, _ = _towers_losses()
    assert plain[0] != plain[0]  # unwatched, float16 overflows at step 0
    forced, s = _towers_losses(discover=True, fp32=["_Towers"])
    assert s is not None and s.run.fp32_modules == ["_Towers"]
    assert all(v == v for v in forced), forced
    # Autocast was on and every layer ran in float32, as asked: nothing to warn of.
    assert not [f for f in s.findings if f.kind == "autocast_inactive"]
    assert not [f for f in s.findings if f.severity == "error"]


def test_two_layers_that_overflow_apart_are_two_errors_and_both_are_tried() -> None:
    """Review 45b: two towers whose last layers overflow float16 on their own inputs. The
    second to finish was folded into the first as "only carried its inf/NaN on", so the
    `next:` line and `fix` tried the first alone, which cannot work. A layer is its own
    origin when every input it took was a watched layer's finite output."""
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps

    torch.manual_seed(0)
    model = _Towers()
    _, s = _towers_losses_of(model)
    errors = {f.module: f for f in s.findings if f.severity == "error"}
    assert set(errors) == {"user.2", "item.2"}, [(f.kind, f.module) for f in s.findings]
    assert all(f.kind == "activation_overflow" for f in errors.values())
    lays = {lay.name: lay for lay in s.layers}
    assert lays["user.2"].overflow_origin_steps == lays["item.2"].overflow_origin_steps == 3
    # What only carried an inf on stays folded: the LayerNorm takes the concatenation.
    assert lays["norm"].overflow_origin_steps == 0
    # Each took its input from its ReLU, finite: the input is known, and so is the origin.
    assert "user.2" in lays["user.1"].consumers and "item.2" in lays["item.1"].consumers
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t.py"]))
    (first, *_) = next_steps(s)
    assert first.endswith("amp-doctor diagnose --fp32 user.2 --fp32 item.2 t.py"), first


def _towers_losses_of(model: nn.Module) -> tuple[list[float], amp_doctor.Session]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            u, i = 1000 * torch.randn(64, 16, generator=g), 1000 * torch.randn(64, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(u, i).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return losses, doctor.session


def test_a_nan_loss_first_seen_after_its_parents_code_tries_the_parent() -> None:
    """Review 45b: the NaN loss was first seen in `attn.proj`, whose input the attention's
    own scores (`q @ k^T`, beyond float16's max) had made NaN; `--fp32 attn.proj` cannot
    fix that, `--fp32 attn` (the parent, whose code made it) does."""
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = _Attention(temperature=3e5)
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attn(x))

    torch.manual_seed(0)
    net = Net()
    _, s = _train(net, torch.float16, steps=2, anomaly=False)
    assert s is not None
    (loss,) = [f for f in s.findings if f.kind == "nonfinite_loss"]
    assert loss.severity == "error" and loss.module == "attn.proj", loss
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t.py"]))
    assert next_steps(s)[0].endswith("amp-doctor diagnose --fp32 attn t.py"), next_steps(s)


def test_the_suggested_fix_runs_past_the_step_where_the_problem_began() -> None:
    """Review 45b: an overflow that began at step 24 (a curriculum growing the inputs) was
    followed by `amp-doctor fix script.py`, whose trials stop after 20 steps: it found no
    error to fix. The suggested command now runs its trials past the first NaN loss."""
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps
    from amp_doctor.fix import DEFAULT_MAX_STEPS

    torch.manual_seed(0)
    _, s = _towers_losses_of(_Towers())
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t.py"]))
    # As the run began: the NaN loss at step 0, inside the trials' 20 steps.
    assert any(line.endswith("amp-doctor fix t.py") for line in next_steps(s))
    late = [dataclasses.replace(f, step=None, steps=[]) if f.severity == "error" else
            dataclasses.replace(f, step=24, steps=[24]) if f.kind == "nonfinite_loss" else f
            for f in s.findings]
    assert 24 >= DEFAULT_MAX_STEPS
    lines = next_steps(dataclasses.replace(s, findings=late))
    assert any(line.endswith("amp-doctor fix --stop-after 34 t.py") for line in lines), lines


def test_after_a_search_that_missed_the_next_step_is_not_the_same_search() -> None:
    """Review 45b: `diagnose --anomaly` of a one-off NaN batch ended with `nonfinite_unlocated`
    and suggested `diagnose --anomaly` again, which misses it again. The next step then is
    the check of every op, which stops at the op (`--on-nonfinite raise`)."""
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps

    torch.manual_seed(0)
    _, s = _towers_losses_of(_Towers())
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t.py"]))
    assert next_steps(s)[-1].endswith("amp-doctor diagnose --anomaly t.py")
    searched = [dataclasses.replace(f, data={**f.data, "anomaly": True})
                if f.kind == "nonfinite_loss" else f for f in s.findings]
    last = next_steps(dataclasses.replace(s, findings=searched))[-1]
    assert last.endswith("amp-doctor diagnose --on-nonfinite raise t.py"), last
    assert "--anomaly t.py" not in last


def test_layers_a_flush_starves_of_every_gradient_are_one_error_at_its_source() -> None:
    """Review 45b: a deep MLP in float16 without a GradScaler, with a small loss: the
    gradient underflows in the last Linear and reaches the six before it as exact zeros,
    so they never move. That was eight warnings; it is one error, at the layer where the
    flush began, that lists the layers which do not train."""
    torch.manual_seed(0)
    hidden = [m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())]
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), *hidden, nn.Linear(64, 1))
    before = {name: m.weight.detach().clone() for name, m in model.named_children()
              if isinstance(m, nn.Linear)}
    opt = torch.optim.SGD(model.parameters(), lr=50.0)
    w = torch.randn(32, 1) * 1e-3
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            x = torch.randn(1024, 32)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = 0.01 * nn.functional.mse_loss(model(x).float(), x @ w)
            opt.zero_grad()
            loss.backward()
            opt.step()
    # The layers that never trained, read off their weights: the flush is real.
    still = [n for n, w0 in before.items() if torch.equal(model.get_submodule(n).weight, w0)]
    assert len(still) >= 3 and "14" not in still, still
    s = doctor.session
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert err.kind == "missing_scaler" and err.module == "14", err
    assert err.data["starved_layers"] == still
    assert "do not train" in err.message
    # Their own warnings are its consequences: info, each pointing at it.
    theirs = [f for f in s.findings if f.module in err.data["starved_layers"]]
    assert {f.module for f in theirs} == set(still)
    assert all(f.severity == "info" and f.data["follow_on_of"] == "14" for f in theirs)


def test_two_errors_of_one_kind_in_one_module_are_both_shown() -> None:
    """Review 45a: a VAE's `aten.mul` (step 0) and `aten.exp` (step 17), both in the root
    module's own code: "2 error(s)", but the group "on 1 layers" showed the first alone."""
    from amp_doctor.records import Finding
    from amp_doctor.sinks.text import group_findings

    def err(op: str, step: int) -> Finding:
        return Finding(kind="nonfinite_forward", severity="error", module="VAE", op=op,
                       step=step, message=f"{op} made inf.", advice="Keep it in float32.")

    groups = group_findings([err("aten.mul", 0), err("aten.exp", 17)])
    assert [[f.op for f in g.findings] for g in groups] == [["aten.mul"], ["aten.exp"]]


def test_fix_never_tries_a_whole_model_and_bisects_every_child() -> None:
    """Review 45b/45a: `fix`'s "all blocks" trial was the root's children less the first,
    plus the root itself (AMP off), and a culprit that is the root model got the snippet
    `model.get_submodule('CLIP')`, which raises. A whole model is never a candidate."""
    from amp_doctor.fix import _blocks, _culprits

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = nn.Linear(4, 4)
            self.item = nn.Linear(4, 4)
            self.head = nn.Linear(8, 1)

        def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return self.head(torch.cat([self.user(u), self.item(i)], -1)) * 1e6

    torch.manual_seed(0)
    net = Net()
    with amp_doctor.watch(net, every=1, tensorboard=False) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                out = net(torch.randn(2, 4), torch.randn(2, 4))
            out.float().sum().backward()
    s = doctor.session
    assert s.run.models == ["Net"]
    assert _blocks(s) == ["user", "item", "head"]
    assert "Net" not in _culprits(s)


def test_a_mask_value_float16_cannot_hold_is_named() -> None:
    """Review 45a: `scores.masked_fill(mask, -1e9)` on float16 attention scores raises
    "value cannot be converted to type c10::Half without overflow" (the Annotated
    Transformer's mask under autocast). That was "run_ended_early: fix the error"."""
    import pytest

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            q, k = self.qk(x).chunk(2, -1)
            scores = (q @ k.transpose(-2, -1)).masked_fill(mask == 0, -1e9)
            return scores.softmax(-1).sum()

    torch.manual_seed(0)
    model = Masked()
    x, mask = torch.randn(2, 4, 8), torch.ones(2, 4, 4)
    with pytest.raises(RuntimeError, match="c10::Half without overflow"):
        with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
            with torch.autocast("cpu", dtype=torch.float16):
                model(x, mask).backward()
    s = doctor.session
    assert s.run.outcome == "exception"
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert f.kind == "constant_overflow" and f.data["dtype"] == "float16"
    assert "masked_fill(mask, -1e9)" in f.message and "65504" in f.message
    assert "torch.finfo(scores.dtype).min" in f.advice
    # No step ended because the run did: not a loop without a step boundary (review 45c).
    assert not [x for x in s.findings if x.kind == "no_step_boundary"]


def test_fp8_amax_outrunning_the_scale_is_judged_on_consecutive_steps_only() -> None:
    """Review 45b: at `every=10` an activation amax that grew 2x over ten unrecorded steps
    was counted as outrunning the delayed scale (which follows every step); at `every=1`
    the claim was gone. Only a step recorded right after another is compared."""
    from amp_doctor.analysis.whatif import _outran

    growing = [(0, 1.0), (10, 2.5), (20, 6.0), (30, 15.0)]  # 2.5x per 10 steps
    assert _outran(growing) == (0, 0)
    # Consecutive recorded steps: a jump beyond 2x the window's amax is counted.
    assert _outran([(0, 1.0), (1, 1.1), (2, 3.0), (3, 3.1)]) == (1, 3)
    # The window is 16 training steps: an old large amax has left it.
    assert _outran([(0, 10.0), (30, 1.0), (31, 2.5)]) == (1, 1)


def _mlp_run(bad_step: int | None, steps: int = 30) -> amp_doctor.Session:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10**6)
    with amp_doctor.watch(model, tensorboard=False) as doctor:  # every=10
        for step in range(steps):
            x = torch.randn(8, 8) * (1e6 if step == bad_step else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_compare_counts_every_nan_loss_and_keeps_a_lone_backoff() -> None:
    """Review 45b: `compare` said "non-finite losses 0 of 3" for a run whose one NaN loss was
    in an unrecorded step (the device checks every step), and its scale table, thinned
    evenly, dropped the run's only backoff."""
    from amp_doctor.analysis.compare import _scale_rows, compare, render

    clean, bad = _mlp_run(None), _mlp_run(13)
    assert 13 in bad.scaler.backoff_steps and 13 not in [r.step for r in bad.history]
    c = compare(clean, bad, "clean", "bad")
    assert (c.a.loss_bad, c.a.loss_checked) == (0, 30)
    assert (c.b.loss_bad, c.b.loss_checked) == (1, 30)
    assert "1 of 30" in render(c)
    assert "13" in [r[0] for r in _scale_rows(c)]
    # A long run's table is thinned to 20 rows: a lone backoff (step 57) stays in it.
    import dataclasses

    long = dataclasses.replace(
        c, a=dataclasses.replace(c.a, scale_points=[(i, 65536.0) for i in range(100)]),
        b=dataclasses.replace(c.b, scale_points=[(i, 65536.0 if i < 57 else 32768.0)
                                                 for i in range(100)]))
    rows = _scale_rows(long)
    assert len(rows) == 20 and ["57", "65536", "32768"] in rows, rows


def test_ctrl_c_during_fix_says_where_the_trials_are_and_dies_by_sigint(tmp_path: Path) -> None:
    """Review 45b: Ctrl-C during `fix` printed click's "Aborted!" and exited 1."""
    import signal
    import subprocess
    import time

    from tests.helpers import console_script

    (tmp_path / "slow.py").write_text(
        "import time, torch\nfrom torch import nn\n"
        "m = nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(50):\n"
        "    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "        loss = m(torch.randn(8, 4)).float().pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step(); time.sleep(0.5)\n")
    proc = subprocess.Popen([console_script(), "fix", "slow.py"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    assert proc.stderr is not None
    seen = ""
    while "--logdir" not in seen and time.monotonic() < deadline:  # a trial has begun
        seen += proc.stderr.readline()
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, seen + err)
    assert "amp-doctor fix: interrupted; the trials that ran are in /" in err
    assert "Aborted!" not in err


def test_a_fix_for_a_target_format_says_so_and_keeps_it_in_its_commands() -> None:
    """Review 45b: `fix --target-dtype float16` printed its before/after commands without
    --target-dtype (so `compare` showed nothing resolved) and said "every error finding is
    gone" of warnings; and it listed the layers in string order ("0, 10, 12, 14, 2")."""
    from amp_doctor.fix import FixResult, Trial, render_fix

    def trial(fp32: tuple[str, ...], errors: tuple[str, ...]) -> Trial:
        return Trial(fp32=fp32, why="x", errors=errors, exit_code=0, steps=20,
                     final_loss=0.5, skipped=0)

    r = FixResult(baseline=trial((), ("whatif_float16@user.fc2",)),
                  best=trial(("item.fc2", "user.fc2"), ()),
                  layer_types={"user.fc2": "Linear", "item.fc2": "Linear"},
                  device_type="cpu", models=["Net"], command=["t.py", "--dtype", "bfloat16"],
                  target_dtype="float16")
    text = render_fix(r)
    assert "keep user.fc2, item.fc2 in float32" in text
    assert "Every error finding and float16 what-if warning is gone" in text
    assert ("amp-doctor diagnose --logdir runs/before --target-dtype float16 t.py --dtype "
            "bfloat16") in text
    assert ("amp-doctor diagnose --logdir runs/after --target-dtype float16 --fp32 user.fc2 "
            "--fp32 item.fc2 t.py") in text


def test_backoffs_of_a_nan_loss_say_nothing_of_the_loss_size() -> None:
    """Review 45a: an LM whose entropy term made 0 * log(0) = NaN was told "the loss is too
    large for float16" (its loss was ~0.02): a NaN loss's gradient is NaN at any scale.
    Only backoffs with a finite loss count, and one (the scaler's calibration) is not
    enough."""
    import dataclasses

    from amp_doctor.analysis.detect_scaler import _loss_gradient_overflow

    torch.manual_seed(0)
    _, s = _towers_losses_of(_Towers())
    backoffs = [e for e in s.scaler.events if e.kind == "backoff"]
    assert len(backoffs) == 3 and all(e.loss_nonfinite for e in backoffs)
    assert all(e.culprits[0] == "head" for e in backoffs)
    assert _loss_gradient_overflow(s, backoffs) is None
    # The same backoffs with a finite loss are the loss's size ...
    finite = [dataclasses.replace(e, loss_nonfinite=False) for e in backoffs]
    got = _loss_gradient_overflow(s, finite)
    assert got is not None and got[0] == "head"
    # ... but not the first alone.
    assert _loss_gradient_overflow(s, finite[:1]) is None


def test_an_overflow_whose_input_no_layer_made_says_its_input_is_unseen() -> None:
    """Review 45a: a VAE's `mu + std * eps` (std = exp of a large logvar) made the decoder's
    input inf in the model's own code; the decoder was called the overflowing layer, with
    no word that its input is not checked. A layer fed only by watched layers' outputs
    (a tower's second Linear after its ReLU) needs no such word."""

    class Vae(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(16, 8)
            self.dec = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mu, logvar = self.enc(x).chunk(2, -1)
            z = mu + torch.exp(0.5 * logvar * 40) * torch.randn_like(mu)  # inf in float16
            return self.dec(z)

    torch.manual_seed(0)
    model = Vae()
    with torch.no_grad():
        model.enc.weight.mul_(4)
    _, s = _train(model, torch.float16, steps=2, anomaly=False)
    assert s is not None
    lays = {lay.name: lay for lay in s.layers}
    assert not lays["dec"].inputs_known
    (err,) = [f for f in s.findings if f.severity == "error" and f.module == "dec"]
    # Its finite values stayed far from the max: an op made the inf, in it or before it.
    assert ("an op in it, or in the model's own forward code before it (its input was not a "
            "watched layer's output), that made inf/NaN") in err.message, err.message
    _, towers = _towers_losses_of(_Towers())
    assert all("not a watched layer's output" not in f.message for f in towers.findings)
    # The plain overflow's message says it too (review 45a's VAE: 3% inf, finite values
    # near the max), and not of a layer fed by watched layers.
    from amp_doctor.analysis.detect_layers import _input_unseen

    assert _input_unseen(s, lays["dec"]).startswith(
        " Its input was not a watched layer's output (made by the model's own forward code")
    tl = {lay.name: lay for lay in towers.layers}
    assert tl["user.2"].inputs_known and _input_unseen(towers, tl["user.2"]) == ""


def test_a_fp32_try_that_left_errors_points_at_the_search() -> None:
    """Review 45b: a `--fp32` rerun that still had errors printed no `next:` line at all."""
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps

    torch.manual_seed(0)
    _, s = _towers_losses_of(_Towers())
    s = dataclasses.replace(s, run=dataclasses.replace(
        s.run, command=["python", "t.py"], fp32_modules=["user.2"]))
    assert next_steps(s) == [
        "amp-doctor: next: errors remain with user.2 in float32; to search a set of float32 "
        "layers that removes them: amp-doctor fix t.py",
        "amp-doctor: next: to name the op and the line that made the first inf/NaN: "
        "amp-doctor diagnose --anomaly t.py"]


def test_a_trial_that_trades_the_errors_for_a_ruined_loss_is_no_fix() -> None:
    """Review 45c: one corrupt batch (1e5 times the data) that the GradScaler skipped gave an
    error; `fix` found "keep 0, 3, 5 in float32", which let that batch update the weights:
    the loss ended at 2.31 (chance) against 0.0015 before. Such a trial is no fix."""
    from amp_doctor.fix import FixResult, Trial, _loss_worse, render_fix

    assert _loss_worse(2.314, 0.001459) and _loss_worse(float("nan"), 0.5)
    assert not _loss_worse(0.0015, 0.001459) and not _loss_worse(0.3, float("nan"))
    assert not _loss_worse(-3.0, -1.0)  # a negative loss (a log-likelihood): no judgement
    base = Trial(fp32=(), why="baseline", errors=("activation_overflow@0",), exit_code=0,
                 steps=20, final_loss=0.001459, skipped=1)
    ruined = Trial(fp32=("0", "3", "5"), why="all blocks", errors=(), exit_code=0, steps=20,
                   final_loss=2.314, skipped=0,
                   rejected="loss ended at 2.314 against 0.001459 before")
    assert not ruined.ok
    text = render_fix(FixResult(baseline=base, trials=[ruined], device_type="cpu"))
    assert "Smallest fix found" not in text
    assert "loss ended at 2.314 against 0.001459 before" in text
    assert "Look at the data of the step the errors name" in text


def test_fp32_on_every_layer_with_weights_is_not_autocast_inactive() -> None:
    """Review 45c: `--fp32 0 --fp32 3 --fp32 5` (every matmul/conv layer) warned that
    autocast looked inactive: the ReLUs between them follow their float32 inputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with amp_doctor.watch(model, every=1, tensorboard=False, fp32=["0", "2"]) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert {lay.name: lay.output_dtypes for lay in s.layers}["1"] == ["float32"]
    assert not [f for f in s.findings if f.kind == "autocast_inactive"]


def test_a_nan_loss_from_step_0_began_at_the_step_0_op() -> None:
    """Review 45c: a VAE's loss was NaN from step 0, where anomaly mode found `aten.mul`;
    it also found `aten.exp` at step 17, both carried on by the decoder. The loss's
    finding said "It began at aten.exp" (the last one to name the decoder)."""
    from amp_doctor.analysis.folding import fold_follow_ons
    from amp_doctor.records import Finding

    def op(name: str, step: int) -> Finding:
        return Finding(kind="nonfinite_forward", severity="error", module="VAE", op=name,
                       step=step, message=f"{name} made inf.", advice="float32.",
                       data={"carriers": ["dec"]})

    loss = Finding(kind="nonfinite_loss", severity="error", module="dec", op=None, step=0,
                   message="The loss was NaN/inf from step 0.", advice="Look.",
                   data={"origin": "dec", "bad_steps": list(range(20))})
    torch.manual_seed(0)
    _, s = _towers_losses_of(_Towers())
    out = fold_follow_ons(s, [op("aten.mul", 0), op("aten.exp", 17), loss])
    (folded,) = [f for f in out if f.kind == "nonfinite_loss"]
    assert folded.severity == "info" and "It began at aten.mul in VAE" in folded.message


def test_the_layer_table_shows_a_gradient_flushed_whole_as_zeros_not_0_percent() -> None:
    """Review 45b/45c: layers whose gradients were 100% exact zeros showed "grad underflow
    0%" (no subnormal left to count), which read as healthy."""
    import dataclasses

    from amp_doctor.sinks.text import _grad_cell

    torch.manual_seed(0)
    _, s = _towers_losses_of(_Towers())
    lay = next(x for x in s.layers if x.name == "user.0")
    flushed = dataclasses.replace(lay, ran_low_precision=True, grad_zero_frac=1.0,
                                  grad_underflow_frac=0.0)
    assert _grad_cell(flushed, 0.0) == "100% zero"
    assert _grad_cell(dataclasses.replace(flushed, grad_zero_frac=0.2), 0.0) == "0%"


def test_fix_with_nothing_to_fix_says_how_many_steps_its_trials_ran() -> None:
    """Review 45c: `fix --target-dtype float8` said "nothing to fix" where the full run warns:
    its trials stop after 20 steps, and nothing said so."""
    from amp_doctor.fix import find_fix

    healthy = _mlp_run(None, steps=12)
    assert not [f for f in healthy.findings if f.severity in ("error", "warning")]
    result = find_fix(lambda fp32: (healthy, 0))
    assert result.best is None and not result.trials
    (note,) = result.notes
    assert note.startswith("The baseline has no error finding in its 12 steps (each trial "
                           "stops there: a problem that begins later needs a larger "
                           "`--stop-after`): nothing to fix."), note


def test_a_layer_inside_a_forced_module_ran_in_float32_by_fp32() -> None:
    """Review 45c: `--fp32 user` left `user.2` told it "stayed in float32" (keep it there),
    the advice for a layer autocast kept wide, not for one --fp32 forced."""
    torch.manual_seed(0)
    model = _Towers()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with amp_doctor.watch(model, every=1, tensorboard=False, fp32=["user", "item"]) as doctor:
        for _ in range(2):
            u, i = 1000 * torch.randn(64, 16, generator=g), 1000 * torch.randn(64, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(u, i).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in doctor.session.findings if f.module == "user.2"]
    assert f.severity == "info" and "ran in float32 by --fp32" in f.message, f.message
    assert f.advice.startswith("It ran in float32 here only because --fp32")
