"""Session 43: one error per cause when anomaly mode finds the op in a parent's own code.

An op in a module's own forward (``self.B(h * 1e5)``) that overflows float16 first
shows in the output of the child called after it. Anomaly mode names the op, and the
child's activation statistics name the child: two errors for one cause, unless the op
search saw that the child only carried the op's inf on. A child that overflowed by
itself after the op (its own op made inf from finite inputs) stays an error.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor
from tests.recipes import classify


class Parent(nn.Module):
    """``B(A(x) * k)``: the multiply in the parent's own code overflows float16 from
    step 2 (``k`` large). With ``b_overflows`` the multiply's inf goes to a branch B
    never sees, and from step 2 B's own weights overflow it from finite inputs."""

    def __init__(self, b_overflows: bool) -> None:
        super().__init__()
        self.A = nn.Linear(8, 16)
        self.B = nn.Linear(16, 16)
        self.D = nn.Linear(16, 3)
        self.k = 1.0
        self.b_overflows = b_overflows

    def break_at_step_2(self) -> None:
        self.k = 1e5
        if self.b_overflows:
            with torch.no_grad():
                self.B.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.A(x))
        if self.b_overflows:
            aside = (h * self.k).sum()  # the multiply's inf: into the loss, not into B
            return self.D(self.B(h)) + aside
        return self.D(self.B(h * self.k))


def _train(model: Parent, steps: int = 5, **watch: Any) -> amp_doctor.Session:
    return classify(model, steps, (16, 8, 3),
                    lambda step: model.break_at_step_2() if step == 2 else None, **watch)


def _errors(s: amp_doctor.Session) -> list[tuple[str, str | None, str | None]]:
    return [(f.kind, f.module, f.op) for f in s.findings if f.severity == "error"]


def test_a_child_that_only_carried_its_parents_op_overflow_is_not_a_second_error() -> None:
    torch.manual_seed(0)
    s = _train(Parent(b_overflows=False), anomaly=True, every=1)
    assert _errors(s) == [("nonfinite_forward", "Parent", "aten.mul")]
    err = s.findings_of("nonfinite_forward")[0]
    assert "B" in err.data["carriers"]
    assert err.data["also_affected"][0] == "B"
    assert "only carried its inf/NaN on" in err.message and ": B" in err.message
    # The child's statistics still say it was the first watched output to show it.
    assert s.layer("B").overflow_origin_steps == 3
    assert s.layer("B").nonfinite_steps == 3


def test_a_child_that_overflowed_by_itself_after_the_op_stays_an_error() -> None:
    torch.manual_seed(0)
    s = _train(Parent(b_overflows=True), anomaly=True, every=1)
    errors = _errors(s)
    assert ("activation_overflow", "B", None) in errors
    assert ("nonfinite_forward", "Parent", "aten.mul") in errors
    err = s.findings_of("nonfinite_forward")[0]
    assert "B" not in err.data.get("carriers", [])
    assert err.data["later_origins"] == ["B"]
    assert "later in that step an op in B made NaN/inf from finite inputs too" in err.message
    assert "every op after it only passed it on" not in err.message
    # D carried B's inf, not the multiply's.
    assert s.findings_of("activation_overflow")[0].data["also_affected"] == ["D"]


def _manual_steps(model: nn.Module, steps: int) -> list[float]:
    """A loop with no optimizer and no ``.grad``: ``torch.autograd.grad`` of the loss with
    respect to the weights, then ``p -= lr * g`` by hand (meta-learning code, textbooks)."""
    params = list(model.parameters())
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= 0.1 * g
        losses.append(loss.item())
    return losses


def _manual_sgd(model: nn.Module, steps: int, **watch: Any) -> tuple[amp_doctor.Session,
                                                                     list[float]]:
    with amp_doctor.watch(model, tensorboard=False, **watch) as doctor:
        losses = _manual_steps(model, steps)
    return doctor.session, losses


def test_a_loop_that_updates_from_autograd_grad_by_hand_counts_its_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    s, _ = _manual_sgd(model, 6, every=2)
    assert (s.steps, s.recorded_steps) == (6, 3)
    assert not s.findings_of("no_step_boundary")
    assert [r.step for r in s.history] == [0, 2, 4]
    # The activation gradients of each recorded step were filed.
    assert s.layer("2").grad_absmax is not None and s.layer("2").grad_absmax > 0
    assert s.findings_of("steps_from_backward")
    # The weights' gradients are what autograd.grad returned for them: no .grad to read.
    assert all(s.layer(n).param_grad_absmax for n in ("0", "2"))
    assert s.layer("1").param_grad_absmax is None


def test_gradients_of_a_penalty_on_the_inputs_do_not_end_a_step() -> None:
    """A gradient penalty takes ``autograd.grad`` of the inputs, not of the weights: the
    loop's optimizer ends each step, once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with amp_doctor.watch(model, tensorboard=False, every=1) as doctor:
        for _ in range(4):
            x = torch.randn(16, 8, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = out.float().mean() + 0.1 * gx.float().pow(2).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert (doctor.session.steps, doctor.session.recorded_steps) == (4, 4)
    assert not doctor.session.findings_of("steps_from_backward")


def test_watching_a_hand_written_update_leaves_its_numerics_bit_identical() -> None:
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        losses = (_manual_sgd(model, 5, every=1, anomaly=True)[1] if watched
                  else _manual_steps(model, 5))
        return losses, [p.detach().clone() for p in model.parameters()]

    plain, watched = run(False), run(True)
    assert plain[0] == watched[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1], strict=True))


class TiedLM(nn.Module):
    """An embedding, an MLP block and an output head whose weight is the embedding's
    (weight tying, as in GPT-2): the head owns no parameter of its own."""

    def __init__(self, vocab: int = 11, d: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        return self.head(x + self.c_proj(self.gelu(self.c_fc(x))))


def test_backoff_culprits_follow_a_recorded_steps_backward_order() -> None:
    """The first backoffs were not recorded (their culprits: the layers with parameters,
    in reverse forward order); a later recorded one saw every layer's gradient arrive.
    The culprit list takes the recorded order: the model's output and the tied head
    first, the GELU between the two Linears around it."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, every=5) as doctor:
        for step in range(8):
            if step == 3:
                with torch.no_grad():
                    model.c_fc.weight.mul_(1e5)
            idx = torch.randint(0, 11, (4, 8))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None
    assert [e.step for e in s.scaler.events if e.kind == "backoff"] == [3, 4, 5, 6, 7]
    assert [e.recorded for e in s.scaler.events] == [False, False, True, False, False]
    (backoff,) = s.findings_of("scaler_backoff")
    culprits = backoff.data["culprits"]
    assert set(culprits[:2]) == {"TiedLM", "head"}  # one gradient: the model's output
    assert culprits.index("c_proj") < culprits.index("gelu") < culprits.index("c_fc")
    assert culprits.index("c_fc") < culprits.index("wte")


def test_a_weights_parametrization_is_part_of_its_layer_not_a_layer() -> None:
    """weight_norm and spectral_norm (a GAN discriminator's) compute a layer's weight: the
    parametrization modules are not layers, and their parameters' gradients are the
    parametrized layer's; one added during the watch is left out too."""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(8, 32)), nn.ReLU(), nn.Linear(32, 2))
    s = classify(model, 3, (16, 8, 2), lambda step: spectral_norm(model[2]) if step == 1
                 else None, lr=1e-2, every=1)
    assert [lay.name for lay in s.layers] == ["0", "1", "2", "Sequential"]
    assert s.layer("0").type == "ParametrizedLinear"
    assert s.layer("0").param_dtypes == ["float32"]
    assert s.layer("0").param_grad_absmax is not None and s.layer("0").param_grad_absmax > 0
    assert s.layer("2").param_grad_absmax is not None


def test_a_shallow_copy_of_a_watched_model_shares_its_hook_dicts_as_unwatched() -> None:
    """``copy.copy(module)`` shares the original's hook dicts: a hook registered on the
    copy runs for the original too. Watching must not change that; the copy is not
    watched itself, and the watch's hooks leave both at its end."""
    import copy

    def check(watched: bool) -> tuple[bool, int, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
        doctor = amp_doctor.watch(model, tensorboard=False, every=1) if watched else None
        twin = copy.copy(model)
        calls: list[int] = []
        twin.register_forward_hook(lambda *a: calls.append(1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(3, 2)).float().sum() + twin(torch.randn(3, 2)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if doctor is not None:
            s = doctor.close()
            assert [lay.name for lay in s.layers] == ["0", "1", "2", "Sequential"]
            assert s.steps == 2
        return twin._forward_hooks is model._forward_hooks, len(calls), len(model._forward_hooks)

    assert check(True) == check(False) == (True, 4, 1)


class BertLayerNorm(nn.Module):
    """The hand-written layer norm of early BERT code, with eps=1e-12 (0 in float16)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = 1e-12

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * (x - u) / torch.sqrt(s + self.eps) + self.bias


def test_a_float16_division_by_an_underflowed_zero_is_not_called_format_independent() -> None:
    """Padding rows are all 0, so their variance is 0, and eps=1e-12 is 0 in float16:
    sqrt(0) divides. In float32 (or bfloat16) the epsilon keeps the denominator above 0,
    so "float32 and bfloat16 would make inf too" was false."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), BertLayerNorm(16), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, anomaly=True, every=1) as doctor:
        for _ in range(3):
            x = torch.randn(8, 8)
            x[4:] = 0  # padding rows
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.cross_entropy(out.float(), torch.randint(0, 3, (8,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    back = [f for f in s.findings if f.kind == "nonfinite_backward"]
    assert back and back[0].data["input_dtypes"] == ["float32", "float16"]
    assert "exactly 0 in float16" in back[0].message
    assert "would make inf too" not in back[0].message
    assert "does not help" not in back[0].advice and "do not help" not in back[0].advice
    assert ">= 1e-5" in back[0].advice


class CLIP(nn.Module):
    """Contrastive image-text model whose embeddings are not L2-normalised: its logits come
    near float16's max, and the backward of the similarity matmul overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Sequential(nn.Linear(96, 128), nn.GELU(), nn.Linear(128, 64))
        self.txt = nn.Sequential(nn.Linear(80, 128), nn.GELU(), nn.Linear(128, 64))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.01)))

    def forward(self, im: torch.Tensor, tx: torch.Tensor) -> torch.Tensor:
        return self.logit_scale.exp() * self.img(im) @ self.txt(tx).t()


def _clip_run(steps: int, **watch: Any) -> amp_doctor.Session:
    torch.manual_seed(0)
    model = CLIP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = torch.randn(96, 80) / 10
    with amp_doctor.watch(model, tensorboard=False, **watch) as doctor:
        for _ in range(steps):
            im = 14 * torch.randn(64, 96)
            tx = im @ w + torch.randn(64, 80)
            y = torch.arange(64)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(im, tx)
                loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_recorded_backoffs_whose_gradients_leave_the_origin_out_are_not_inferred_to_it() -> None:
    """Every step recorded: the first backoffs begin in the backward of CLIP's similarity
    matmul (anomaly mode saw step 0); later ones (8-11) in the encoders' weight gradients,
    with CLIP's own parameter's gradient finite. They were "inferred" to CLIP, and called
    unrecorded steps to record with every=1, which the run had."""
    s = _clip_run(14, anomaly=True, every=1)
    assert s.scaler is not None
    late = [e for e in s.scaler.events if e.kind == "backoff" and "CLIP" not in e.culprits]
    assert late and all(e.recorded for e in late)
    (collapse,) = s.findings_of("scale_collapse")
    assert collapse.severity == "error" and collapse.module == "CLIP"
    n = len([e for e in s.scaler.events if e.kind == "backoff"])
    assert f"started at CLIP in {n - len(late)} of {n} backoffs" in collapse.message
    assert f"{len(late)} recorded backoff(s)" in collapse.message
    assert "had no forward origin" in collapse.message
    assert "every=1" not in collapse.message
    # The backoffs' own finding is the collapse's detail, not a second warning.
    assert [f.severity for f in s.findings_of("scaler_backoff")] == ["info"]


class QKVAttention(nn.Module):
    """Unscaled attention on q, k, v split from one projection (a UNet's attention block)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.out((w @ v).mean(1))


def test_a_matmul_overflow_gets_matmul_advice_and_each_inputs_own_range() -> None:
    """q and k are views of one qkv tensor: each had the whole tensor's range in the report.
    And a matmul was advised about log(softmax) and divisions."""
    torch.manual_seed(0)
    model = QKVAttention()
    with torch.no_grad():
        model.qkv.weight[:16].mul_(2e4)  # q alone: q @ k^T overflows float16
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, anomaly=True, every=1) as doctor:
        for _ in range(2):
            x = torch.randn(4, 8, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).float(), torch.randint(0, 3, (4,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (f,) = [f for f in doctor.session.findings if f.severity == "error"]
    assert (f.kind, f.op) == ("nonfinite_forward", "aten.bmm")
    q_range, k_range = f.data["input_ranges"]
    assert max(map(abs, q_range)) > 20 * max(map(abs, k_range))
    assert "scaled_dot_product_attention" in f.advice
    assert "log_softmax" not in f.advice and "epsilon" not in f.advice


def test_a_collapse_from_a_loss_too_large_for_float16_blames_the_loss_not_the_output_layer(
) -> None:
    """Regression targets in the tens of thousands and a summed squared error: the loss's
    gradient at the model's output, times the scale, is beyond float16, so the scale falls
    to about 1. The first non-finite gradient is the output layer's, and "run it in float32"
    only moved the overflow to the layer before it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, every=4) as doctor:
        for _ in range(24):
            x = torch.randn(32, 8)
            y = 2e4 + 1e3 * x[:, :1]
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y, reduction="sum")
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.layer("2").model_output and not s.layer("0").model_output
    (collapse,) = s.findings_of("scale_collapse")
    assert collapse.severity == "error" and collapse.module == "2"
    assert "the loss is too large for float16, not 2" in collapse.message
    assert "first non-finite gradients were those of 2, which returns the model" in \
        collapse.message
    assert collapse.advice.startswith("Keep the loss O(1)")
    assert [f.kind for f in s.findings if f.severity == "error"] == ["scale_collapse"]


def test_nan_losses_of_unrecorded_steps_are_counted_without_a_sync_of_their_own() -> None:
    """An inf term whose gradient is 0 (nothing skips the step) in steps 1, 2, 4, 5 and 7,
    recorded every 4th step: only step 4's was seen, and the report said "1 of the 3
    steps checked". The device counts every step's loss, and keeps the first bad step
    (review 55: "first seen at step 4" of a loss bad since step 1); the run reads it once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    bad = {1, 2, 4, 5, 7}
    with amp_doctor.watch(model, tensorboard=False, every=4) as doctor:
        for step in range(12):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(8, 8))
            loss = out.float().pow(2).mean() + (math.inf if step in bad else 0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = doctor.session.findings_of("nonfinite_loss")
    assert (f.data["steps_bad"], f.data["checked"], f.step) == (5, 12, 1)
    assert "in 5 of the 12 steps with a loss (12 steps in all), first seen at step 1" in \
        f.message


def test_a_float16_what_if_of_underflow_alone_is_not_told_to_keep_overflowing_layers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
    with torch.no_grad():
        model[0].weight.mul_(1e-6)
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amp_doctor.watch(model, tensorboard=False, every=1) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(torch.randn(8, 8)).float(),
                                       torch.randint(0, 2, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = doctor.session.findings_of("whatif_float16")
    assert "below float16's smallest normal" in f.message and "beyond" not in f.message
    assert "overflowing" not in f.advice and "GradScaler" in f.advice


class ScoresAttn(nn.Module):
    """Attention scores made in the module's own code (no 1/sqrt(d) scale), then a child
    Linear; ``second`` calls that child again on a finite input it overflows by itself."""

    def __init__(self, d: int = 32, t: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(t, d)
        self.second = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.q(x) @ self.k(x).transpose(-2, -1))
        if self.second:
            big = 6e4 * self.proj.weight[0].detach().sign().expand(*x.shape[:-1], 16)
            h = h + self.proj(big) * 1e-3
        return h


def _scores_run(bad_steps: set[int], second: bool) -> amp_doctor.Session:
    torch.manual_seed(0)
    model = nn.Sequential(ScoresAttn(), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False, anomaly=True, every=1) as doctor:
        for step in range(8):
            model[0].second = second and step in bad_steps
            x = torch.randn(4, 16, 32) * (100.0 if step in bad_steps else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_a_child_that_also_overflows_by_itself_later_in_the_step_is_not_a_carrier() -> None:
    """proj carried the scores' inf in its first call, and made inf of its own from a
    finite input in its second: two causes, two errors (it was listed as a carrier)."""
    s = _scores_run(set(range(4, 8)), second=True)
    errors = _errors(s)
    assert ("nonfinite_forward", "0", "aten.bmm") in errors
    assert ("activation_overflow", "0.proj", None) in errors
    op = next(f for f in s.findings if f.op == "aten.bmm")
    assert "0.proj" in op.data["later_origins"] and "0.proj" not in op.data.get("carriers", [])


def test_a_one_off_overflow_anomaly_mode_could_not_locate_says_its_layer_is_unconfirmed(
) -> None:
    """The scores overflow in step 4 only: the op search, armed for step 5, saw nothing.
    proj is the first watched output with the inf, and whether it came in with proj's
    input is not known; the error said proj overflowed, full stop."""
    s = _scores_run({4}, second=False)
    assert s.findings_of("nonfinite_unlocated")
    (f,) = [f for f in s.findings if f.severity == "error"]
    assert (f.kind, f.module) == ("activation_overflow", "0.proj")
    assert "did not see it recur, so whether it began here or came in with the layer's " \
        "input (made in 0's own forward code" in f.message


@pytest.mark.parametrize("anomaly", [False, True])
def test_each_gradscaler_of_a_gan_names_culprits_of_its_own_model(anomaly: bool) -> None:
    """A GAN with a GradScaler per network: the step's culprits (all its non-finite
    gradients) went to both scalers, so the discriminator's collapse was blamed on the
    generator's layer, which its backward (on a detached fake) never reaches."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 64), nn.LeakyReLU(0.2), nn.Linear(64, 16))
    disc = nn.Sequential(nn.Linear(16, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    og = torch.optim.Adam(gen.parameters(), lr=2e-4)
    od = torch.optim.Adam(disc.parameters(), lr=2e-4)
    sg, sd = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    bce = nn.BCEWithLogitsLoss()
    with amp_doctor.watch({"gen": gen, "disc": disc}, tensorboard=False, every=2,
                          anomaly=anomaly) as doctor:
        for step in range(12):
            if step == 5:
                with torch.no_grad():
                    gen[2].weight.mul_(2e4)
            real, z = torch.randn(32, 16) + 1.0, torch.randn(32, 8)
            with torch.autocast("cpu", dtype=torch.float16):
                fake = gen(z)
                ld = bce(disc(real), torch.ones(32, 1)) + bce(disc(fake.detach()),
                                                            torch.zeros(32, 1))
            od.zero_grad()
            sd.scale(ld).backward()
            sd.step(od)
            sd.update()
            with torch.autocast("cpu", dtype=torch.float16):
                lg = bce(disc(fake), torch.ones(32, 1))
            og.zero_grad()
            sg.scale(lg).backward()
            sg.step(og)
            sg.update()
    s = doctor.session
    timelines = [t for t in (s.scaler, *s.other_scalers) if t is not None]
    assert sorted(t.stepping for t in timelines) == ["disc", "gen"]
    for t in timelines:
        culprits = {c for e in t.events if e.kind == "backoff" for c in e.culprits}
        assert culprits, t.label
        assert all(c == t.stepping or c.startswith(t.stepping + ".") for c in culprits), \
            (t.label, culprits)
    # Each scaler's collapse names a layer of its own model (anomaly mode's first origin
    # of a step, in the discriminator's backward, is not the generator's scaler's).
    for net in ("gen", "disc"):
        (f,) = [f for f in s.findings_of("scale_collapse") if f"params of {net}" in f.message]
        assert f.module is not None and f.module.startswith(net + "."), f.message
