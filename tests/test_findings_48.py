"""Session 48's fixes: findings that were missing or wrong on real-style runs."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from syncs import SyncCounter
from torch import nn
from torch.nn import functional as F

import amp_doctor
from tests.helpers import console_script

BAD_ITERS = (7, 15)


def _skipping_loop(doctor_kw: dict | None, bad: str = "nan", iters: int = 25,
                   bad_iters: tuple[int, ...] = BAD_ITERS
                   ) -> tuple[list[float], list[torch.Tensor], amp_doctor.Session | None,
                              list[int]]:
    """A float16 loop that guards itself: ``if not torch.isfinite(loss): continue``.

    ``bad``: "nan", a NaN in the batch at :data:`BAD_ITERS` (a corrupt sample); "made",
    a finite batch that the first layer's float16 output overflows there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    losses: list[float] = []
    skipped: list[int] = []
    doctor = (amp_doctor.watch(model, tensorboard=False, **doctor_kw)
              if doctor_kw is not None else None)
    try:
        for it in range(iters):
            x = torch.randn(16, 8)
            y = x.sum(1, keepdim=True)
            if it in bad_iters:
                if bad == "nan":
                    x[3, 2] = float("nan")
                else:
                    x[3] = 6e4  # finite in float16; the first layer's output is not
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            if not torch.isfinite(loss):
                skipped.append(it)
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    finally:
        session = doctor.close() if doctor is not None else None
    return losses, [p.detach().clone() for p in model.parameters()], session, skipped


def test_a_nan_batch_the_loop_skips_before_backward_is_reported_at_the_default_every() -> None:
    """The loop's own guard kept the NaN loss from backward and from the GradScaler: no
    backoff, no skip, no loss check, and the report said "Findings: none" beside the
    user's own "loss is nan, skipping" (review 47a). Now the batch's finding names it: a
    warning, as the loop's guard kept it from training (session 50; review 49a: an ERROR
    told the user their training was hurt)."""
    losses, params, session, skipped = _skipping_loop({})
    assert skipped == list(BAD_ITERS)
    assert session is not None and session.recorded_steps == 3
    (f,) = session.findings_of("nonfinite_input")
    assert f.severity == "warning" and f.step == 7 and f.module == "Sequential"
    assert "training took none of it" in f.message
    assert f.data["unrecorded_steps"] == f.data["unrecorded_dropped"] == 2
    assert f.data["nan"] is True
    assert "held NaN in 2 steps (first at step 7, none of them recorded)" in f.message
    assert "no backward reached those forwards' outputs: the loop dropped them" in f.message
    assert not session.findings_of("nonfinite_output_dropped")
    # Never the user's numerics: the same losses and weights as without the watch.
    plain_losses, plain_params, _, _ = _skipping_loop(None)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))


def test_a_forward_overflow_the_loop_skips_is_a_warning_that_points_to_anomaly_mode() -> None:
    losses, params, session, skipped = _skipping_loop({}, bad="made")
    assert skipped[:1] == [7]  # (at 15 the weights had moved: finite)
    assert session is not None
    assert not session.findings_of("nonfinite_input")
    (f,) = session.findings_of("nonfinite_output_dropped")
    assert f.severity == "warning" and f.step == 7 and f.data["steps_bad"] == len(skipped)
    assert "from a finite batch" in f.message
    assert "--anomaly" in f.advice
    plain_losses, plain_params, _, _ = _skipping_loop(None, bad="made")
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))


def test_under_anomaly_mode_the_dropped_steps_join_the_origin_the_recorded_steps_found() -> None:
    """The glitch comes back in later batches, where the loss stays finite (the ReLU
    drops the -inf) and the scaler backs off: the layer is found, and the dropped step is
    one of its consequences, not a second warning."""
    _, _, session, skipped = _skipping_loop({"anomaly": True}, bad="made",
                                            bad_iters=(7, 11, 15, 19, 23))
    assert skipped == [7] and session is not None
    (root,) = [f for f in session.findings if f.severity == "error"]
    assert (root.kind, root.module) == ("activation_overflow", "0")
    (f,) = session.findings_of("nonfinite_output_dropped")
    assert f.severity == "info" and f.data["follow_on_of"] == "0"
    assert "which the loop dropped before backward" in root.message
    assert not [u for u in session.findings_of("nonfinite_unlocated") if u.severity != "info"]


def test_a_one_off_dropped_overflow_arms_anomaly_modes_search_and_says_it_did_not_recur() -> None:
    _, _, session, skipped = _skipping_loop({"anomaly": True}, bad="made", bad_iters=(7,))
    assert skipped == [7] and session is not None
    (f,) = session.findings_of("nonfinite_output_dropped")
    assert f.severity == "warning" and f.step == 7
    assert f.advice.startswith("Anomaly mode searched the steps after it")
    (u,) = session.findings_of("nonfinite_unlocated")
    assert u.severity == "info" and u.step == 7
    assert "the op-level search ran on the next steps and they stayed finite" in u.message
    assert [x.severity for x in session.findings].count("warning") == 1


def test_a_bad_batch_in_a_recorded_step_is_counted_once() -> None:
    _, _, session, skipped = _skipping_loop({}, bad_iters=(10,))
    assert skipped == [10] and session is not None
    (f,) = session.findings_of("nonfinite_input")
    assert f.step == 10 and f.data["detected"] == "recorded step"
    assert "unrecorded_steps" not in f.data


class _TwoViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("eval_with_grad", [False, True])
def test_forwards_without_their_own_backward_are_not_dropped_iterations(
        eval_with_grad: bool) -> None:
    """Two views and one backward (a contrastive loss): both forwards are reached by it.
    A validation forward in train mode with grad on: no backward reaches it, and it is
    finite. Nothing to report; the run reads its batch checks and dropped forwards in one
    sync, at the end."""
    torch.manual_seed(0)
    model = _TwoViews()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    doctor = amp_doctor.watch(model, tensorboard=False, every=10)
    with SyncCounter() as c:
        for _ in range(20):
            x = torch.randn(16, 8)
            with torch.autocast("cpu", dtype=torch.float16):
                z1, z2 = model(x), model(x + 0.1 * torch.randn_like(x))
                loss = F.cross_entropy((z1 @ z2.T).float() / 4, torch.arange(16))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if eval_with_grad:
                with torch.autocast("cpu", dtype=torch.float16):
                    model(torch.randn(4, 8)).float().mean().item()
        session = doctor.close()
    assert session.steps == 20
    assert [f.kind for f in session.findings if f.severity != "info"] == []
    assert len(c.calls) == session.recorded_steps + 1, [x.site for x in c.calls]


def test_the_cli_reports_a_loop_that_skips_nan_batches(tmp_path: Path) -> None:
    script = tmp_path / "skip_nan.py"
    script.write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
        "scaler = torch.amp.GradScaler('cpu', init_scale=256.0)\n"
        "for it in range(25):\n"
        "    x = torch.randn(16, 8); y = x.sum(1, keepdim=True)\n"
        "    if it in (7, 15): x[3, 2] = float('nan')\n"
        "    with torch.autocast('cpu', dtype=torch.float16):\n"
        "        loss = F.mse_loss(model(x).float(), y)\n"
        "    if not torch.isfinite(loss):\n"
        "        print(f'iter {it}: loss is nan, skipping'); continue\n"
        "    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()\n")
    r = subprocess.run([console_script(), "diagnose", "--no-tensorboard",
                        "--logdir", str(tmp_path / "runs"), str(script)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "iter 7: loss is nan, skipping" in r.stdout
    assert "WARN   nonfinite_input  Sequential step 7" in r.stderr
    assert "held NaN in 2 steps (first at step 7, none of them recorded)" in r.stderr


def test_a_heads_backward_through_a_tanh_is_blamed_on_the_head_not_the_first_layer() -> None:
    """A head with weights grown x20000 overflows in its backward: the Tanh before it
    passes the inf on, and layer 0 is the first layer with weights whose gradients went
    non-finite. The collapse was an ERROR at layer 0 (`--fp32 0` would not help); the
    head's backward made it (review 47c #6)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.mul_(20000.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(30):
            x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    (c,) = s.findings_of("scale_collapse")
    assert c.severity == "error" and c.module == "2"
    assert "computed in the backward of 2, which takes 0's output (through 1, which only " \
        "passed it on)" in c.message


def _train(model: nn.Module, batches: int, step_fn: Callable[[int], torch.Tensor | None],
           **kw: object) -> amp_doctor.Session:
    """A float16 loop with a GradScaler; ``step_fn(it)`` returns the loss, or None when
    the loop skips that iteration before backward."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, **kw) as doctor:  # type: ignore[arg-type]
        for it in range(batches):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = step_fn(it)
            if loss is None:
                continue
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_masked_outputs_of_two_forwards_that_one_backward_reaches_are_not_dropped() -> None:
    """Action masking (-inf logits) and two forwards per step (R-Drop): the first forward
    is reached by the step's one backward. It was a warning that 45 of 50 iterations were
    skipped (review 48a)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))

    def step(it: int) -> torch.Tensor:
        x = torch.randn(16, 8)
        legal = torch.rand(16, 6) > 0.3
        legal[:, 0] = True
        a, b = (model(x).masked_fill(~legal, float("-inf")) for _ in range(2))
        return F.cross_entropy(a.float(), torch.zeros(16, dtype=torch.long)) + \
            F.kl_div(a.float().log_softmax(-1).clamp_min(-1e4),
                     b.float().log_softmax(-1).clamp_min(-1e4), log_target=True,
                     reduction="batchmean")

    s = _train(model, 30, step)
    assert s.steps == 30
    assert not s.findings_of("nonfinite_output_dropped")
    assert not [f for f in s.findings if f.severity != "info"]


class _Tagger(nn.Module):
    """Returns an HF-style output: ``.loss`` (cross-entropy, ignore_index=-100) and
    ``.logits``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.relu(self.emb(ids)))
        loss = F.cross_entropy(logits.float().view(-1, 5), labels.view(-1), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def test_a_returned_loss_that_is_nan_beside_finite_logits_blames_the_loss_not_a_layer() -> None:
    """A batch whose labels are all ignored: the model's mean cross-entropy is 0/0. It
    was "a layer or an op made it ... re-run with --anomaly" (review 48a)."""
    torch.manual_seed(0)
    model = _Tagger()

    def step(it: int) -> torch.Tensor | None:
        labels = torch.randint(0, 5, (8, 12))
        if it in (15, 33):
            labels[:] = -100
        loss = model(torch.randint(0, 100, (8, 12)), labels)["loss"]
        return None if torch.isnan(loss) else loss

    s = _train(model, 40, step)
    (f,) = s.findings_of("nonfinite_output_dropped")
    assert (f.step, f.data["steps_bad"], f.data["loss_only"]) == (15, 2, 2)
    assert "the loss computation made it, not a layer" in f.message
    assert "ignore_index" in f.advice and "--anomaly" not in f.advice


@pytest.mark.parametrize("bad", ["spike", "nan"])
def test_every_output_tensor_is_checked_and_a_reused_buffer_is_checked_as_the_model_saw_it(
        bad: str) -> None:
    """``return feat, logits`` with the logits overflowing, fed through a reused input
    buffer (``buf.copy_(x)``): the first output alone was checked, and the batch was
    called finite though nobody could see it (review 48a); then "not known" (it was
    checked at the step's end, after the next copy). Now each batch is checked as the
    forward is given it: a finite spike the model blows up is the model's, a NaN copied
    into the buffer the data's."""
    torch.manual_seed(0)
    body, head = nn.Linear(8, 16), nn.Linear(16, 2)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = body, head

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            feat = torch.relu(self.body(x))
            return feat, self.head(feat) * (1e5 if x[0, 0] > 100 else 1.0)

    model = Net()
    buf = torch.empty(4, 8)

    def step(it: int) -> torch.Tensor | None:
        x = torch.randn(4, 8)
        if it in (13, 27):
            x[0, 0] = 1000.0 if bad == "spike" else math.nan
        buf.copy_(x)
        _, logits = model(buf)
        loss = F.cross_entropy(logits.float(), torch.zeros(4, dtype=torch.long))
        return loss if torch.isfinite(loss) else None

    s = _train(model, 30, step)
    if bad == "spike":
        assert not s.findings_of("nonfinite_input")
        (f,) = s.findings_of("nonfinite_output_dropped")
        assert (f.step, f.data["steps_bad"]) == (13, 2)
        assert "from a finite batch" in f.message
    else:
        assert not s.findings_of("nonfinite_output_dropped")
        (f,) = s.findings_of("nonfinite_input")
        # (The loop dropped those steps: training took none of it.)
        assert (f.severity, f.step, f.data["unrecorded_steps"]) == ("warning", 13, 2)


class _FM(nn.Module):
    """A DLRM-style interaction: ``z @ z^T`` of which only the strict upper triangle is
    used. The dense tower's self-dot (the diagonal) is +inf in float16; indexing drops it."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 16))
        self.emb = nn.ModuleList([nn.Embedding(1000, 16) for _ in range(3)])
        self.top = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, cats: torch.Tensor) -> torch.Tensor:
        feats = [self.bottom(dense)] + [e(c) for e, c in zip(self.emb, cats.T, strict=True)]
        z = torch.stack([f.to(feats[0].dtype) for f in feats], 1)
        inter = torch.bmm(z, z.transpose(1, 2))
        iu = torch.triu_indices(4, 4, 1)
        return self.top(inter[:, iu[0], iu[1]] / 16).squeeze(-1)


def test_a_hidden_overflow_seen_only_in_the_scalers_start_up_backoff_is_no_error() -> None:
    """Anomaly mode searched step 0, where a default GradScaler's calibration overflowed
    the head's scaled gradients: the bmm's dropped +inf diagonal was an ERROR ("the backward
    of this op is where NaN usually appears next") in a run whose only skip was that
    calibration (review 48b)."""
    torch.manual_seed(0)
    model = _FM()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, anomaly=True) as doctor:
        for _ in range(20):
            dense, cats = torch.rand(256, 4) * 500, torch.randint(0, 1000, (256, 3))
            y = ((dense[:, 0] > 250) ^ (cats[:, 0] % 2 == 0)).float()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.binary_cross_entropy_with_logits(model(dense, cats), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.skipped_steps == [0]
    (f,) = s.findings_of("activation_overflow")
    assert (f.op, f.step, f.severity) == ("aten.bmm", 0, "warning")
    assert not [x for x in s.findings if x.severity == "error"]


class _LogFeatures(nn.Module):
    """A parameter-free front end: ``log(x @ fb + 1e-10)``, whose matmul runs in float16
    under autocast, where 1e-10 is 0: zero-padded frames give log(0) = -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fb", torch.rand(32, 16))

    def forward(self, power: torch.Tensor) -> torch.Tensor:
        return torch.log(power @ self.fb + 1e-10)


def test_a_weightless_front_ends_log_of_zero_is_no_mask_when_a_layer_makes_nan_of_it() -> None:
    """The front end's -inf went into a Linear, whose output was NaN: it was "a mask
    written on purpose" (its gradient was finite only because it had none) and the
    Linear was blamed, with `--fp32` for it (review 48b)."""
    torch.manual_seed(0)
    model = nn.Sequential(_LogFeatures(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, every=5) as doctor:
        for _ in range(10):
            power = torch.rand(8, 32)
            power[:, :] *= (torch.arange(8) < 6).float()[:, None]  # two padded frames
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(power), torch.randint(0, 4, (8,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert not s.findings_of("neg_inf_mask")
    (f,) = [x for x in s.findings if x.severity == "error"]
    assert (f.kind, f.module) == ("activation_overflow", "0")
    assert "the loss was NaN/inf in 10 of the 10 steps checked" in f.message
    (loss,) = s.findings_of("nonfinite_loss")
    assert loss.severity == "info" and loss.data["follow_on_of"] == "0"


def test_backoffs_from_the_backward_of_bce_on_probabilities_are_not_a_loss_too_large() -> None:
    """``F.binary_cross_entropy(torch.sigmoid(logits), y)`` with a float16 sigmoid: a
    confidently wrong entry's gradient, 1 / (p (1 - p)), overflows in the loss code's
    backward while the loss is about 0.2. It was "the loss is too large for float16" with
    "Keep the loss O(1)" (review 48b)."""
    torch.manual_seed(0)
    w = torch.randn(32, 10) * 2
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(120):
            x = 3 * torch.randn(128, 32)
            y = ((x @ w) > 0).float()
            y = torch.where(torch.rand_like(y) < 0.01, 1 - y, y)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.binary_cross_entropy(torch.sigmoid(model(x)), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    (c,) = s.findings_of("scale_collapse")
    assert "an op of the loss code makes the large gradient in its backward" in c.message
    assert "too large for float16" not in c.message
    assert c.advice.startswith("Compute the code between the model's output and the loss")
    assert "binary_cross_entropy_with_logits" in c.advice


def test_an_output_layer_past_the_max_is_told_to_standardise_the_targets() -> None:
    """House prices in dollars (1e5 to 3.5e5) as targets: the head's float16 output must
    pass 65504 to fit them. Its advice was "Keep this layer in float32", after which the
    loss's gradient overflowed the layer before it (review 48b)."""
    torch.manual_seed(0)
    x = torch.randn(2048, 8)
    y = (2.2e5 + x @ torch.tensor([40e3, 25e3, -10e3, 5e3, 0, 0, 8e3, 3e3])).clamp(1e5, 3.5e5)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), 3e-2)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(150):
            idx = torch.randint(0, len(x), (256,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x[idx]).squeeze(-1), y[idx])
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (f,) = [x for x in doctor.session.findings if x.severity == "error"]
    assert (f.kind, f.module) == ("activation_overflow", "4")
    assert f.advice.startswith("This layer returns the model's output")
    assert "Standardise the targets" in f.advice
    # Its backoffs, led by the same layer, are its consequences, not a warning beside it.
    assert not [x for x in doctor.session.findings if x.severity == "warning"]
    assert all(b.severity == "info" and b.data["follow_on_of"] == "4"
               for b in doctor.session.findings_of("scaler_backoff"))


class _VAE(nn.Module):
    """``std = exp(0.5 * logvar)`` in the model's own code overflows float16 before the
    decoder's first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.dec1 = nn.Linear(4, 16)
        self.dec2 = nn.Linear(16, 16)
        with torch.no_grad():
            self.enc.weight.mul_(40.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.enc(x).chunk(2, -1)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.dec2(torch.relu(self.dec1(z)))


def test_an_overflow_whose_input_came_from_unseen_code_sends_to_anomaly_mode_first() -> None:
    """The decoder's first layer was blamed with `next: --fp32 dec1` first, which leaves
    the NaN: the exp before it made the inf (review 48b). Its finding says whether the inf
    came in with its input is not known; the first `next:` line now finds out."""
    import dataclasses

    from amp_doctor.analysis.next_steps import next_steps

    torch.manual_seed(0)
    model = _VAE()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, every=1) as doctor:
        for _ in range(3):
            x = torch.randn(32, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), x)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    (f,) = [x for x in s.findings if x.severity == "error"]
    assert (f.kind, f.module) == ("activation_overflow", "dec1")
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, command=["python", "t.py"]))
    first, second, *_ = next_steps(s)
    assert first.startswith("amp-doctor: next: first find where the inf began (dec1's input")
    assert first.endswith("amp-doctor diagnose --anomaly t.py")
    assert second.endswith("amp-doctor diagnose --fp32 dec1 t.py")


def test_anomaly_mode_does_not_call_a_minus_inf_batch_values_beyond_the_max() -> None:
    """Log features made in the loop (``torch.log`` of zero-padded frames: -inf among
    negative values) given to a Linear: the batch was "values up to inf, beyond float16's
    max: autocast's cast of such values is inf", a second error beside the Linear's NaN
    (review 48b). Since review 49a #8 the -inf among negatives (max below 0, where a
    mask's is 0) is the data's: one error, the batch, with the Linear's NaN its
    consequence."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, anomaly=True) as doctor:
        for _ in range(4):
            power = torch.rand(8, 16) * 0.5
            power[6:] = 0.0  # padded frames
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(torch.log(power)), torch.randint(0, 4, (8,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert not s.findings_of("input_beyond_format")
    (f,) = [x for x in s.findings if x.severity == "error"]
    assert (f.kind, f.module, f.step) == ("nonfinite_input", "Sequential", 0)
    assert "already holds -inf" in f.message
    assert "aten.addmm in layer 0 made NaN of that inf at step 0" in " ".join(f.message.split())
    (op,) = s.findings_of("nonfinite_forward")
    assert (op.severity, op.module, op.op) == ("info", "0", "aten.addmm")


class _MissingAware(nn.Module):
    """Missing values encoded as NaN, replaced in the forward with a missingness mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 4)
        with torch.no_grad():
            self.fc1.weight.mul_(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([torch.nan_to_num(x), torch.isnan(x).to(x.dtype)], -1)
        return self.fc2(torch.relu(self.fc1(x)))


def test_nan_a_model_handles_is_info_and_not_blamed_for_an_overflow_the_loop_skipped() -> None:
    """Every batch holds NaN (missing values) that the model replaces; a finite sensor
    spike overflows fc1 at two iterations, which the loop skips. It was an ERROR blaming
    the batch for both (review 48a)."""
    torch.manual_seed(0)
    model = _MissingAware()
    losses: list[float] = []

    def step(it: int) -> torch.Tensor | None:
        x = torch.randn(32, 16)
        x[torch.rand(32, 16) < 0.05] = float("nan")
        if it in (17, 44):
            x[0] = 30000.0
        loss = F.cross_entropy(model(x), torch.randint(0, 4, (32,)))
        if not torch.isfinite(loss):
            return None
        losses.append(loss.item())
        return loss

    s = _train(model, 50, step)
    assert len(losses) == 48
    (i,) = s.findings_of("nonfinite_input")
    assert i.severity == "info" and i.data["harmful"] == 0
    assert "the model handles such values" in i.message
    (f,) = s.findings_of("nonfinite_output_dropped")
    assert f.severity == "warning" and (f.step, f.data["steps_bad"]) == (17, 2)
    assert f.data["batch_nan_handled_at"] == 0
    assert not [x for x in s.findings if x.severity == "error"]


def test_a_scatter_sum_overflow_is_told_to_accumulate_into_a_float32_buffer() -> None:
    """A graph network's ``zeros_like(h).index_add_(0, dst, msg)`` overflowed at a hub
    node: the advice said to cast the op's input `.float()`, which only fails on a dtype
    mismatch with the float16 buffer (review 48b)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.msg, self.head = nn.Linear(16, 16), nn.Linear(16, 1)

        def forward(self, h: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
                    ) -> torch.Tensor:
            m = torch.relu(self.msg(h))[src]
            agg = torch.zeros_like(m[: h.shape[0]]).index_add_(0, dst, m)
            return self.head(agg / 1e4)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    src = torch.randint(0, 64, (20000,))
    dst = torch.zeros(20000, dtype=torch.long)  # every edge into node 0: a hub
    with amp_doctor.watch(model, tensorboard=False, anomaly=True) as doctor:
        for _ in range(5):
            h = torch.randn(64, 16) * 40
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(h, src, dst).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    f = next(x for x in doctor.session.findings if x.op == "aten.index_add_")
    assert "accumulate in float32, into a float32 buffer" in f.advice
    assert "`.float()` inputs" not in f.advice


def test_a_heatmap_of_two_recorded_steps_labels_both() -> None:
    """Review 47b: a run recorded at steps 0 and 10 drew two 24-pixel columns labelled "0"
    alone (labels were kept 30 pixels apart whatever their width)."""
    from amp_doctor.sinks.heatmap import step_ticks

    assert step_ticks(2, 24, 20) == [0, 1]
    assert step_ticks(3, 24, 20) == [0, 1, 2]
    # Long runs still space their labels by the widest one.
    shown = step_ticks(400, 1, 36)
    assert shown[:3] == [0, 36, 72]
    assert all(b - a >= 36 for a, b in zip(shown, shown[1:], strict=False))


def test_the_gradient_underflow_heatmap_shows_a_flushed_gradient_as_all_lost() -> None:
    """A new heatmap of the output gradients' underflow: a gradient flushed whole to zero
    counts as 100% lost (the share of non-zero values below the normal range would read 0%
    there, the darkest cell for the worst layer)."""
    from amp_doctor.dtypes import limits
    from amp_doctor.sinks.tb_session import heatmap_grids

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amp_doctor.watch(model, tensorboard=False, every=1) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(32, 8)).float().mean() * 1e-9
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    grid = heatmap_grids(s, limits(torch.float16))["heatmap/grad_underflow"]
    row = grid.names.index("0")
    for c, rec in enumerate(s.history):
        g = rec.layers["0"].grad
        assert g is not None and g.zero_frac >= 0.99  # flushed whole
        assert grid.values[row][c] == 1.0


def test_an_overflow_share_pooled_over_a_layers_calls_says_so() -> None:
    """A block shared across depth, called twice a step; only its second call overflows.
    "31% of values beyond the max" was the two calls' values pooled (review 47a)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.fc, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
            with torch.no_grad():
                self.fc.weight.copy_(torch.eye(32) * 300.0)
                self.fc.bias.zero_()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.fc(self.fc(self.inp(x))))

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, every=1) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(torch.randn(8, 16)).float(),
                                       torch.randint(0, 4, (8,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (f,) = [x for x in doctor.session.findings_of("activation_overflow") if x.module == "fc"]
    assert "(worst step, pooled over its 2 calls a step)" in f.message


def test_a_dropped_nan_no_layer_finding_shows_is_reported_in_a_recorded_step_too() -> None:
    """``x / x.norm()`` of an all-zero row is 0/0 in a step the loop skips: reported at
    the default `every`, but "Findings: none" with `--every 1` (review 48c): recorded
    steps were left to their own checks, and no layer finding shows a 0/0."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x / x.norm(dim=-1, keepdim=True))

    model = Net()

    def step(it: int) -> torch.Tensor | None:
        x = torch.randn(16, 8)
        if it == 6:
            x[2] = 0.0
        loss = F.cross_entropy(model(x).float(), torch.randint(0, 4, (16,)))
        return loss if torch.isfinite(loss) else None

    for every in (10, 1):
        s = _train(model, 12, step, every=every)
        (f,) = s.findings_of("nonfinite_output_dropped")
        assert (f.step, f.data["steps_bad"]) == (6, 1), every


def test_a_batch_given_as_keyword_arguments_is_checked() -> None:
    """HF's Trainer calls ``model(**inputs)``: a NaN ``inputs_embeds`` was "a finite
    batch: a layer or an op made it" (review 48c)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
            assert x is not None
            return self.fc(x)

    model = Net()

    def step(it: int) -> torch.Tensor | None:
        x = torch.randn(16, 8)
        if it == 4:
            x[0, 0] = float("nan")
        loss = F.cross_entropy(model(x=x).float(), torch.randint(0, 4, (16,)))
        return loss if torch.isfinite(loss) else None

    for every in (10, 1):
        s = _train(model, 12, step, every=every)
        (f,) = s.findings_of("nonfinite_input")
        # (The loop dropped that step: training took none of it.)
        assert f.step == 4 and f.severity == "warning", every
        assert not s.findings_of("nonfinite_output_dropped")


def test_a_metrics_forward_whose_output_holds_a_minus_inf_mask_is_not_a_dropped_loss() -> None:
    """A forward with grad on that no backward reaches, every step, whose second output is
    ``masked_fill(mask, -inf)`` on purpose: "NaN/inf in 14 steps" (review 48c)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.fc(x)
            return out, out.masked_fill(torch.arange(4) >= 3, float("-inf"))

    model = Net()

    def step(it: int) -> torch.Tensor:
        x = torch.randn(16, 8)
        model(torch.randn(4, 8))  # metrics, with grad on, never backpropagated
        return F.cross_entropy(model(x)[0].float(), torch.randint(0, 4, (16,)))

    s = _train(model, 15, step)
    assert not s.findings_of("nonfinite_output_dropped")
    assert not [f for f in s.findings if f.severity != "info"]
