"""Stop 46's fixes: an error's line in the user's code, and python's exit codes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_doctor
from tests.helpers import console_script

_MASKED = '''
import torch
from torch import nn


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x, mask):
        q, k = self.qk(x).chunk(2, -1)
        scores = (q @ k.transpose(-2, -1)).masked_fill(mask == 0, -1e9)  # line 13
        return scores.softmax(-1).sum()


model = Masked()
with torch.autocast("cpu", dtype=torch.float16):
    model(torch.randn(2, 4, 8), torch.ones(2, 4, 4)).backward()
'''


def test_a_mask_value_float16_cannot_hold_names_the_users_line(tmp_path: Path) -> None:
    """Review 45c: the constant_overflow error named the mask, not where it is. The run's
    error now keeps the user's innermost line (RunInfo.error_at), under the CLI and
    under watch() alike."""
    (tmp_path / "masked.py").write_text(_MASKED)
    r = subprocess.run([console_script(), "diagnose", "--logdir", "out", "masked.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    s = json.loads((tmp_path / "out" / "amp_doctor.json").read_text())
    assert s["run"]["error_at"] == f"{tmp_path / 'masked.py'}:13 in forward"
    (f,) = [f for f in s["findings"] if f["severity"] == "error"]
    assert f["kind"] == "constant_overflow"
    assert f"at {tmp_path / 'masked.py'}:13 in forward after 0 steps" in f["message"]

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk = nn.Linear(8, 16)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            q, k = self.qk(x).chunk(2, -1)
            return (q @ k.transpose(-2, -1)).masked_fill(mask == 0, -1e9).sum()

    model = Masked()
    with pytest.raises(RuntimeError, match="c10::Half without overflow"):
        with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
            with torch.autocast("cpu", dtype=torch.float16):
                model(torch.randn(2, 4, 8), torch.ones(2, 4, 4)).backward()
    at = doctor.session.run.error_at
    assert at is not None and at.startswith(f"{__file__}:") and at.endswith(" in forward")
    line = int(at.split(":")[-1].split()[0])
    assert "masked_fill" in Path(__file__).read_text().splitlines()[line - 1]
    from amp_doctor.sinks.text import render_text

    text = " ".join(render_text(doctor.session).split())  # lines are wrapped
    assert f"c10::Half without overflow (at {at})" in text


def test_a_missing_module_exits_1_as_python_does(tmp_path: Path) -> None:
    """`python -m no_such_module` exits 1 (a missing script 2); diagnose exited 2 for both."""
    r = subprocess.run([console_script(), "diagnose", "-m", "no_such_module_46"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "No module named 'no_such_module_46'" in r.stderr
    r = subprocess.run([console_script(), "fix", "-m", "no_such_module_46"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "No module named 'no_such_module_46'" in r.stderr


def test_a_scale_collapse_of_a_nan_loss_is_not_blamed_on_the_last_layer() -> None:
    """Review 45c (lm_entropy): a loss term `p * log(p)` that went NaN collapsed the scale,
    and scale_collapse said "the first layer with non-finite gradients was lm_head in 16
    of 16 backoffs" with the advice to run that layer in float32. Every layer's gradient
    was NaN because the loss was: the advice is the NaN loss's."""
    from amp_doctor.analysis.advice import ADVICE

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for step in range(40):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, 8))
            loss = out.float().pow(2).mean()
            if step >= 22:  # 0 * log(0): NaN, and so is its gradient
                loss = loss + (out.float() * 0).sum() * torch.log(torch.zeros(()))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (f,) = doctor.session.findings_of("scale_collapse")
    assert f.data["loss_nonfinite"] is True
    assert "the loss itself was NaN/inf in every backoff" in f.message
    assert "only says where the backward pass met it, not where it began" in f.message
    assert "the first layer with non-finite gradients was" not in f.message
    # Its fix is the NaN loss's (the finding it follows from), not the layer's in float32.
    assert f.advice.startswith("Nothing of its own to fix: it follows from the "
                               "nonfinite_loss error")
    assert "float32" not in f.advice
    (loss,) = [x for x in doctor.session.findings if x.severity == "error"]
    assert loss.kind == "nonfinite_loss" and f.severity == "info"  # its consequence
    # (Its loss reached backward in float32: not told to compute it in float32, session 55.)
    assert loss.data["loss_dtypes"] == ["float32"]
    assert loss.advice == ADVICE["nonfinite_loss_float32"]


def _two_optimizer_loop(pattern: str, steps: int = 12) -> amp_doctor.Session:
    torch.manual_seed(0)
    body, head = nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Linear(32, 1)
    model = nn.Sequential(body, head)
    opt_body = torch.optim.SGD(body.parameters(), lr=0.01)
    opt_head = torch.optim.SGD(head.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(64, 16)
    y = x @ torch.randn(16, 1)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(steps):
            opt_body.zero_grad()
            opt_head.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if pattern == "correct":
                scaler.step(opt_body)
                scaler.step(opt_head)
            elif pattern == "head_bypassed":
                scaler.step(opt_body)
                opt_head.step()
            elif pattern == "unscale_then_step":
                scaler.unscale_(opt_body)
                scaler.unscale_(opt_head)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt_body.step()
                opt_head.step()
            elif pattern == "stepped_twice":
                scaler.step(opt_body)
                scaler.step(opt_head)
                opt_body.step()
            elif pattern == "update_between":
                scaler.step(opt_body)
                scaler.update()
                scaler.step(opt_head)
            scaler.update()
    return doctor.session


@pytest.mark.parametrize(("pattern", "kind", "severity", "optimizer"), [
    ("head_bypassed", "scaled_grads_stepped", "error", "SGD#1"),
    ("unscale_then_step", "step_after_unscale", "error", "SGD#1"),
    ("stepped_twice", "stepped_twice", "error", "SGD#0"),
    ("update_between", "update_between_steps", "warning", "SGD#1"),
])
def test_an_optimizer_stepped_outside_the_scaler_is_named(
        pattern: str, kind: str, severity: str, optimizer: str) -> None:
    """Review 46b: `scaler.step(opt_body); opt_head.step()`, `unscale_` then `opt.step()`, a
    leftover `opt.step()` after `scaler.step(opt)`, and an update between two optimizers'
    steps were told as a NaN loss in a layer (`--fp32 1`, which could not help), or not at
    all. Each is named, with its optimizer, as the one cause; the NaN after it is its
    consequence."""
    s = _two_optimizer_loop(pattern)
    worst = [f for f in s.findings if f.severity in ("error", "warning")]
    assert [f.kind for f in worst] == [kind]
    (f,) = worst
    if pattern == "unscale_then_step":  # both did it, in the order their inf came
        assert f.severity == severity and "SGD#0.step()" in f.message
        assert "SGD#1.step()" in f.message and "whose gradients held inf/NaN" in f.message
        return
    assert f.severity == severity and f.message.startswith(
        {"scaled_grads_stepped": f"{optimizer}.step() ran on gradients still multiplied",
         "stepped_twice": f"{optimizer}.step() was called again after "
                          f"scaler.step({optimizer})",
         "update_between_steps": f"scaler.step({optimizer}) ran after a scaler.update()"}[kind])
    assert "12 times, first at step 0" in f.message


def test_the_recipe_with_two_optimizers_is_no_misuse() -> None:
    s = _two_optimizer_loop("correct")
    assert not [f for f in s.findings if f.severity in ("error", "warning")]


def test_an_unscaled_second_model_beside_a_scaled_one_is_no_misuse() -> None:
    """A float32 critic trained with a plain `opt.step()` next to a scaled generator (the
    GAN case the old rule guarded by judging only a scaler that never stepped)."""
    torch.manual_seed(0)
    gen, critic = nn.Linear(8, 8), nn.Linear(8, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch([gen, critic], tensorboard=False) as doctor:
        for _ in range(6):
            z = torch.randn(4, 8)
            with torch.autocast("cpu", dtype=torch.float16):
                g_loss = critic(gen(z)).float().mean()
            opt_g.zero_grad()
            scaler.scale(g_loss).backward()
            scaler.step(opt_g)
            c_loss = critic(gen(z).detach()).mean()  # float32, not scaled
            opt_c.zero_grad()
            c_loss.backward()
            opt_c.step()
            scaler.update()
    kinds = {f.kind for f in doctor.session.findings}
    assert not kinds & {"scaled_grads_stepped", "step_after_unscale", "stepped_twice",
                        "update_between_steps"}


def _encoder_run(watched: bool) -> tuple[list[float], list[int]]:
    """Train a TransformerEncoder classifier, evaluating it under no_grad between steps;
    returns the eval losses and, per eval, how many sublayer hooks it ran with."""
    hooks: list[int] = []

    class Count(nn.Module):
        """Counts the encoder's hooks from inside an eval forward, once it has begun."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.training:
                hooks.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                                 for m in encoder.modules()))
            return x

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    model = nn.Sequential(Count(), encoder, nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    evals: list[float] = []
    doctor = amp_doctor.watch(model, every=1, tensorboard=False) if watched else None
    try:
        for _ in range(4):
            model.train()
            x, y = torch.randn(8, 6, 32, generator=g), torch.randint(0, 3, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).mean(1).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            model.eval()
            with torch.no_grad():
                x = torch.randn(8, 6, 32, generator=g)
                evals.append(model(x).sum().item())  # the fast path, without hooks
    finally:
        if doctor is not None:
            doctor.close()
    return evals, hooks


def test_evaluation_between_steps_runs_without_sublayer_hooks() -> None:
    """Review 46a: with `--every 1` (and before each recorded step at the default), the
    sublayer hooks stayed on through the evaluation between steps. A forward hook turns
    off TransformerEncoderLayer's fast path: every eval loss differed from the run
    without amp-doctor (3.06600 against 3.06598), and a fast-path crash under autocast
    went away. An evaluation of a watched model now runs with none of them."""
    plain, _ = _encoder_run(False)
    watched, hooks = _encoder_run(True)
    assert watched == plain  # bit-identical
    assert hooks == [0] * 4


def test_float16_weights_are_not_told_to_add_a_grad_scaler_alone() -> None:
    """Review 46b: `model.half()` trained with no autocast got, beside its lost-updates
    error, "float16 autocast without a GradScaler ... Create scaler = GradScaler(...)":
    followed, that raises `Attempting to unscale FP16 gradients.`. Float16 weights are
    told to go back to float32 weights first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=5e-5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 32, generator=g)
    y = torch.tanh(x[:, :1]) * 0.5
    x, y = x.half(), y.half()
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(20):
            opt.zero_grad()
            nn.functional.mse_loss(model(x).float(), y.float()).backward()
            opt.step()
    (f,) = doctor.session.findings_of("missing_scaler")
    assert "float16 subnormals" in f.message
    assert "a GradScaler cannot help while the weights themselves are float16" in f.advice
    assert "Keep the weights in float32 first" in f.advice
    assert doctor.session.findings_of("lowp_updates_lost")


def test_clip_error_if_nonfinite_with_a_grad_scaler_is_explained() -> None:
    """Review 46b: `clip_grad_norm_(..., error_if_nonfinite=True)` in the documented recipe
    raised at the scaler's first, too-large scale: "run_ended_early: fix the error". It is
    the scaler working as designed, and the option is what to change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    x = torch.randn(64, 16) * 30
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        with amp_doctor.watch(model, tensorboard=False) as doctor:
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
                scaler.step(opt)
                scaler.update()
    s = doctor.session
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert f.kind == "clip_error_if_nonfinite"
    assert f.message.startswith(f"The run raised at {__file__}:")
    assert "Drop `error_if_nonfinite=True`" in f.advice


def test_a_run_cut_short_while_the_scaler_calibrates_is_no_collapse() -> None:
    """Review 46a: `--stop-after 6` of a healthy run with `init_scale=2**28` got an ERROR
    scale_collapse (2**28 -> 2**22, "do not just lower init_scale"); its 24-step run was
    calibration, as designed. Cut short, it still is, and the note says nothing trained."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**28)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps == [0, 1, 2, 3, 4, 5]
    assert not [f for f in s.findings if f.severity != "info"]
    (f,) = s.findings_of("scaler_backoff")
    assert "the calibration was still under way when the run ended: every optimizer step " \
           "was skipped, so the model has not trained yet" in " ".join(f.message.split())


def test_anomaly_mode_names_a_batch_beyond_float16_in_an_unrecorded_step() -> None:
    """Review 46a: a data spike of 1e5 at steps 3 and 7 under `--anomaly` gave "No recorded
    step had it, so where it appeared is unknown" and an unlocated NaN, while `--every 1`
    named the batch. The per-step batch check had its range: a finite value beyond the
    max of the format autocast casts to is now the finding, and the NaN loss its
    consequence."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
        for step in range(10):
            x = torch.randn(8, 16, generator=g)
            y = torch.randint(0, 4, (8,), generator=g)
            if step in (3, 7):
                x[0, 0] = 1e5
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert f.kind == "input_beyond_format" and f.module == "Sequential" and f.step == 3
    assert f.data["batch_steps"] == [3, 7] and f.data["input_absmax"] == 1e5
    assert "beyond float16's max 65504, in 2 steps" in f.message
    assert s.findings_of("nonfinite_loss")[0].severity == "info"
    assert not s.findings_of("nonfinite_unlocated")


def test_a_large_batch_that_never_goes_non_finite_is_no_finding_in_anomaly_mode() -> None:
    """Values beyond float16's max that a float32 op takes first (a LayerNorm) make no
    inf: no finding, however often the per-step check sees them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
        for _ in range(6):
            x = torch.randn(8, 16) * 1e5
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert not doctor.session.findings_of("input_beyond_format")
    assert not [f for f in doctor.session.findings if f.severity == "error"]


def test_a_layer_shared_across_depth_only_carries_the_inf_made_between_its_calls() -> None:
    """Review 46a: `shared(x)`, then `mid` (which overflows), then `shared` again. shared's
    second call carried mid's inf, but as its first call ran before mid, it was no later
    layer: two errors, shared "worst" with "an op in it made inf". The same model with a
    second Linear in its place was right: mid's error, the other a carrier."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared, self.mid = nn.Linear(32, 32), nn.Linear(32, 32)
            self.norm, self.out = nn.LayerNorm(32), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.norm(self.shared(self.mid(self.shared(x)))))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.mid.weight.mul_(300000)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(torch.randn(16, 32)),
                                                   torch.randint(0, 4, (16,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (f,) = [f for f in doctor.session.findings if f.severity == "error"]
    assert f.kind == "activation_overflow" and f.module == "mid"
    assert "only carried its inf/NaN on and are not separate problems: shared" in " ".join(
        f.message.split())


def _fc1_grad_absmax(inplace: bool) -> float | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(inplace=inplace), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            x = torch.randn(2, 4, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).reshape(-1, 4),
                                                   torch.randint(0, 4, (8,), generator=g))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return next(x.grad_absmax for x in doctor.session.layers if x.name == "0")


def test_an_inplace_activation_after_a_3d_linear_keeps_its_output_gradient() -> None:
    """Review 46a: under autocast a Linear on 3-D input returns a view; `ReLU(inplace=True)`
    after it rebased the view's history, so the hook on fc1's output never ran: no
    output-gradient figures for fc1 (the table's '-', said to mean "it has none"). They
    are now those of the same run with an out-of-place ReLU."""
    with_inplace = _fc1_grad_absmax(True)
    assert with_inplace is not None and with_inplace == _fc1_grad_absmax(False) > 0


def test_clipping_after_unscaling_one_of_two_optimizers_names_the_other() -> None:
    """Review 46b: `scaler.unscale_(opt1)` only, then clipping every parameter: the error
    said "no scaler.unscale_(optimizer) before it", though one was there."""
    torch.manual_seed(0)
    body, head = nn.Sequential(nn.Linear(16, 64), nn.ReLU()), nn.Linear(64, 1)
    model = nn.Sequential(body, head)
    opt1 = torch.optim.SGD(body.parameters(), lr=0.05)
    opt2 = torch.optim.SGD(head.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(32, 16)
    y = x @ torch.randn(16, 1)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(4):
            opt1.zero_grad()
            opt2.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt1)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt1)
            scaler.step(opt2)
            scaler.update()
    (f,) = doctor.session.findings_of("clip_before_unscale")
    assert "with no scaler.unscale_(SGD#1) before it (it clipped those parameters too" in \
        " ".join(f.message.split())


def _warmup(first: float, init_scale: float) -> amp_doctor.Session:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + first) / 10))
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(16):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
    return doctor.session


def test_a_warmup_the_skipped_steps_ate_is_a_warning() -> None:
    """Review 46b: a 10-step warmup with `init_scale=2**32`, whose first 12 steps the
    scaler skipped, was "usually harmless": the first update ran at the peak LR. Also
    from an LR of 0 (a Hugging Face warmup; review 46c)."""
    (f,) = _warmup(1, 2.0**32).findings_of("scheduler_on_skipped_step")
    assert f.severity == "warning"
    assert "the LR rose from 1.00e-04 to 0.001 over those skipped steps" in " ".join(
        f.message.split())
    (f,) = _warmup(0, 2.0**32).findings_of("scheduler_on_skipped_step")
    assert f.severity == "warning" and "the LR rose from 0 to 0.001" in " ".join(
        f.message.split())
    # Three skips at the start of the warmup: the LR tripled, no more.
    (f,) = _warmup(1, 2.0**23).findings_of("scheduler_on_skipped_step")
    assert f.severity == "info" and f.steps == [0, 1, 2]


def _offset_regression(dtype: torch.dtype, **watch_kw: object) -> amp_doctor.Session:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[2].bias.fill_(300.0)  # initialised at the targets' mean
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = 300.0 + x[:, :1] * 0.5
    with amp_doctor.watch(model, tensorboard=False, every=2, **watch_kw) as doctor:
        for _ in range(20):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                pred = model(x)
            nn.functional.mse_loss(pred.float(), y).backward()
            opt.step()
    return doctor.session


def test_a_bfloat16_output_on_a_large_offset_is_named() -> None:
    """Review 46b: a regression head predicting values near 300 in bfloat16 (spacing 2
    there) could not learn a spread of 0.5 and its loss rose; amp-doctor said "AMP looks
    healthy" and `fix` found nothing. `--fp32 2` restores the float32 curve."""
    s = _offset_regression(torch.bfloat16)
    (f,) = [f for f in s.findings if f.severity != "info"]
    assert f.kind == "output_resolution" and f.module == "2"
    # Rounded to one or two values: an error (fix and the next: lines act on it).
    assert f.data["levels"] < 2 and f.severity == "error" and f.data["spacing"] == 2.0
    assert "`--fp32 2` runs it in float32" in " ".join(f.message.split())
    lay = next(x for x in s.layers if x.name == "2")
    assert lay.range_rel is not None and lay.range_rel < 8 / 2**7
    # Run in float32 by --fp32, it is no finding.
    forced = _offset_regression(torch.bfloat16, fp32=["2"])
    assert not forced.findings_of("output_resolution")


def test_reentrant_checkpointing_keeps_the_layers_inputs_known() -> None:
    """Review 46a: under `checkpoint(block, x, use_reentrant=True)` the recompute in
    backward takes detached copies of the block's inputs, which were counted as inputs
    no watched layer made: `inputs_known` of the second block went False (it decides
    whether a layer is folded as a carrier), against the README's "the same figures as
    without checkpointing"."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc(self.ln(x))

    class Net(nn.Module):
        def __init__(self, mode: str) -> None:
            super().__init__()
            self.b0, self.b1, self.head = Block(), Block(), nn.Linear(16, 4)
            self.mode = mode

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in (self.b0, self.b1):
                x = (b(x) if self.mode == "none"
                     else checkpoint(b, x, use_reentrant=self.mode == "reentrant"))
            return self.head(x)

    def known(mode: str) -> dict[str, tuple[bool, list[str]]]:
        torch.manual_seed(0)
        model = Net(mode)
        with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
            for _ in range(2):
                x = torch.randn(4, 16, requires_grad=mode == "reentrant")
                with torch.autocast("cpu", dtype=torch.float16):
                    model(x).float().sum().backward()
                doctor.step()
        return {x.name: (x.inputs_known, x.consumers) for x in doctor.session.layers}

    plain = known("none")
    assert plain["b1"] == (True, ["head"]) and plain["b1.ln"][0]
    assert known("reentrant") == plain
    assert known("non_reentrant") == plain


def test_a_large_batch_during_the_scalers_calibration_is_no_finding_in_anomaly_mode() -> None:
    """Review 46c: values up to 1e6 that a float32 `log1p` takes first, in the steps a high
    `init_scale` skips while calibrating: the gradients overflowed, the loss stayed finite.
    That was an ERROR input_beyond_format under `--anomaly`."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(torch.log1p(x))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    g = torch.Generator().manual_seed(1)
    with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
        for step in range(8):
            x = torch.rand(64, 8, generator=g) * (1e6 if step in (1, 2, 3) else 1e3)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (64,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and {1, 2, 3} <= set(s.scaler.backoff_steps)
    assert not s.findings_of("input_beyond_format")


def test_clip_error_if_nonfinite_on_a_real_nan_is_not_blamed_on_the_scaler() -> None:
    """Review 46c: a NaN of the run's own (a sqrt of a negative at step 6, the scale never
    changed) stopped by `error_if_nonfinite=True` was said to be the GradScaler's probe."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        with amp_doctor.watch(model, tensorboard=False) as doctor:
            for step in range(10):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(8, 16)).float().pow(2).mean()
                if step == 6:
                    loss = loss + torch.sqrt(-model[0].weight.abs().sum())
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
                scaler.step(opt)
                scaler.update()
    (f,) = [f for f in doctor.session.findings if f.severity == "error"]
    assert f.kind == "clip_error_if_nonfinite" and f.step == 6
    assert f.data["scaler_probe"] is False and "the inf/NaN is the run's own" in f.message
    assert "--on-nonfinite raise" in f.advice


def test_a_loop_that_checks_the_norm_before_stepping_after_unscale_is_no_misuse() -> None:
    """Review 46c: `unscale_`, clipping, then `if torch.isfinite(norm): opt.step()` steps
    only finite gradients: it was an ERROR step_after_unscale ("it writes inf/NaN into the
    weights"). Only a step whose gradients held inf/NaN is one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if torch.isfinite(norm):
                opt.step()
            scaler.update()
    s = doctor.session
    # The scale fell: inf steps were there (backoffs after unscale_ alone are not counted).
    assert s.scaler is not None and s.scaler.scale[-1][1] <= 2.0**24 / 2**6
    assert not s.findings_of("step_after_unscale")
    assert not [f for f in s.findings if f.severity == "error"]


def test_a_second_step_on_a_float32_losss_own_gradients_is_not_stepped_twice() -> None:
    """Review 46c: `scaler.step(opt)`, then `zero_grad()`, a float32 regulariser's own
    backward and `opt.step()` before the update: the second step's gradients are new,
    not the scaled step's again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            opt.zero_grad()
            (1e-3 * sum(p.pow(2).sum() for p in model.parameters())).backward()
            opt.step()
            scaler.update()
    assert not doctor.session.findings_of("stepped_twice")


def test_a_scaled_backward_overflow_the_bypassed_scaler_would_skip_is_its_consequence() -> None:
    """Review 46c: `scaler.scale(loss).backward(); opt.step()` under `--anomaly` gave a
    second error, nonfinite_backward in aten.mm at step 0 ("run it in float32"): the scaled
    gradients' overflow, which scaler.step would have skipped and the bypass applied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(256, 16)
    y = x @ torch.randn(16, 1)
    with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
        for _ in range(12):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            opt.step()
    errors = [f for f in doctor.session.findings if f.severity == "error"]
    assert [f.kind for f in errors] == ["scaled_grads_stepped"]
    assert any(f.kind == "nonfinite_backward" and f.severity == "info"
               for f in doctor.session.findings)


_THREAD_AFTER_SIGTERM = '''
import sys, threading, time, torch
from torch import nn
last, steps = [time.monotonic()], [0]
def serve():
    # Like multiprocessing's resource sharer: it fails once the workers it serves are gone
    # (here: once the training loop stops), and reports through sys.excepthook. Not
    # before the test sends the signal (step 70): a loaded machine's slow step is no stop.
    while steps[0] < 70 or time.monotonic() - last[0] < 0.12:
        time.sleep(0.01)
    try:
        raise ConnectionResetError("the worker this thread served was ended")
    except Exception:
        sys.excepthook(*sys.exc_info())
threading.Thread(target=serve, daemon=True).start()
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10**6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(2, 4)).float().sum()
    opt.zero_grad(); loss.backward(); opt.step()
    last[0], steps[0] = time.monotonic(), step
    if step == 70:
        print("ready", flush=True)
    time.sleep(0.01)
'''


def test_other_threads_die_quietly_while_a_sigterm_run_writes_its_report(
        tmp_path: Path) -> None:
    """A SIGTERM to the job (CI run 46e): python dies at once, every thread with it; under
    diagnose the report is written first, and meanwhile a DataLoader's resource-sharer
    thread, whose workers the same signal ended, printed a traceback. The script's other
    threads now stay quiet then, as under python."""
    import os
    import signal

    (tmp_path / "t.py").write_text(_THREAD_AFTER_SIGTERM)
    p = subprocess.Popen([console_script(), "diagnose", "--logdir", "out", "t.py"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("ready"):
            break
    os.killpg(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGTERM, err
    assert "amp-doctor: the script was stopped by SIGTERM" in err
    assert "ConnectionResetError" not in err and "Traceback" not in err, err
