"""Session 47's fixes: findings that were wrong on real-style runs."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
from tensorboard.backend.event_processing import event_accumulator as ea_mod
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn

import amp_doctor
from tests.helpers import console_script

_SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"


def test_a_batch_beyond_the_max_is_not_blamed_for_a_calibrating_scalers_backoffs() -> None:
    """Raw sensor counts past float16's max, normalised by a float32 LayerNorm first: no
    cast makes inf. A calibrating GradScaler backs off in the first steps (a large loss),
    and those steps had such a batch, but so did every later, finite step. That was an
    ERROR input_beyond_format, whose consequence read "(scale ? -> ?)"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(12):
            x = torch.randn(64, 16) * 3e4
            y = torch.randn(64, 1) * 50
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert [e.step for e in s.scaler.events if e.kind == "backoff"][:4] == [0, 1, 2, 3]
    assert not s.findings_of("input_beyond_format")
    assert not [f for f in s.findings if f.severity == "error"]
    (b,) = s.findings_of("scaler_backoff")
    assert b.severity == "info" and b.data["calibration"] == 4
    assert (b.data["scale_before"], b.data["backoffs"]) == (65536.0, len(b.steps))


def test_backoffs_after_unscale_then_optimizer_step_are_counted() -> None:
    """``scaler.unscale_(opt); clip; opt.step(); scaler.update()``: the update backs off on
    the unscale's inf checks though nothing was skipped. The report said "0 backoffs"
    beside a scale that fell from 65536 to 2^-14, and the loss's finding said the
    gradients "stayed finite"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(12):
            x, y = torch.randn(64, 16), torch.randn(64, 1) * 200
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            scaler.update()
    s = doctor.session
    assert s.scaler is not None
    assert s.scaler.backoff_steps == list(range(12))
    assert s.scaler.skipped_steps == []
    assert s.scaler.scale[-1][1] == scaler.get_scale() == 65536 * 0.5 ** 12
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert err.kind == "step_after_unscale"
    (b,) = s.findings_of("scaler_backoff")
    assert b.data["backoffs"] == 12 and b.severity == "info"
    assert "and no optimizer step was skipped" in b.message
    assert all("stayed finite" not in f.message for f in s.findings)


class _HandNorm(nn.Module):
    """A hand-written LayerNorm: ``x.pow(2)`` overflows float16 once |x| > 256, the
    variance is inf, and ``x / sqrt(inf)`` is exactly 0."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(-1, keepdim=True)
        var = x.pow(2).mean(-1, keepdim=True)
        return self.w * x / torch.sqrt(var + 1e-5)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.ln = _HandNorm(64)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.up(x)))


def _train_hand_norm(anomaly: bool) -> tuple[amp_doctor.Session, nn.Module]:
    torch.manual_seed(0)
    model = _Net()
    with torch.no_grad():
        model.up.weight.mul_(60)
    up_before = model.up.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, anomaly=anomaly, tensorboard=False) as doctor:
        for _ in range(12):
            x = torch.randn(32, 16) * 10
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = (out.float() - torch.tanh(x[:, :1] / 10)).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    # What the finding says: the layer before the norm never moved.
    assert torch.equal(model.up.weight, up_before)
    return doctor.session, model


def test_a_norm_whose_float16_square_overflowed_to_zeros_is_the_error() -> None:
    """The norm's output is exactly zero: no value is inf, so no overflow finding saw it,
    and the report's only error was the output head's resolution (a consequence). It
    also hid that the layer before the norm got no gradient at all."""
    s, _ = _train_hand_norm(anomaly=False)
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert (err.kind, err.module) == ("zeroed_output", "ln")
    assert err.data["starved_layers"] == ["up"] and err.data["own_weights_starved"]
    assert err.data["input_from"] == "up" and err.data["input_absmax"] > 256
    assert "x ** 2` passes float16's max 65504" in err.message
    # The head's output is its bias alone, a constant near 0 where float16's spacing is
    # far finer than its targets: no resolution finding beside the cause (review 56b).
    head = next(lay for lay in s.layers if lay.name == "head")
    assert head.absmax < 1 and not s.findings_of("output_resolution")


def test_anomaly_mode_names_the_square_whose_inf_became_the_zeros() -> None:
    """Anomaly mode saw aten.pow make +inf in the norm, and said "Training is not
    affected" (its inf was dropped by a later op): it is the zeroed output's cause."""
    s, _ = _train_hand_norm(anomaly=True)
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert (err.kind, err.module, err.op) == ("zeroed_output", "ln", "aten.pow")
    assert err.frame is not None and err.frame.endswith("in forward")
    assert "test_findings_47.py" in err.frame
    assert not s.findings_of("nonfinite_discarded")
    assert all("not affected" not in f.message for f in s.findings)


def test_a_dead_relu_after_a_negative_layer_is_no_zeroed_output() -> None:
    """A rectifier fed only non-positive values puts out zeros by design."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(-1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    lays = {x.name: x for x in doctor.session.layers}
    assert lays["1"].absmax == 0 and lays["1"].zero_frac == 1.0
    assert not doctor.session.findings_of("zeroed_output")


def test_a_zero_initialised_adapter_is_no_zeroed_output() -> None:
    """LoRA's B starts at zero: its output is zero until the first update, and the A
    before it gets no gradient in that step. Its own weights get one: it trains out of
    its zeros. Recorded only then (a frozen base, a GradScaler skipping its first steps),
    it is no finding."""
    torch.manual_seed(0)

    class Lora(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(16, 16).requires_grad_(False)
            self.a = nn.Linear(16, 4, bias=False)
            self.b = nn.Linear(4, 16, bias=False)
            nn.init.zeros_(self.b.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.b(self.a(x))

    model = Lora()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # skips its first steps
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.skipped_steps == [0, 1, 2]
    b = next(x for x in s.layers if x.name == "b")
    assert b.absmax == 0 and b.zero_frac == 1.0 and b.recorded_steps == 3
    assert not s.findings_of("zeroed_output")


def test_a_layerscales_shrunk_gradients_are_its_finding_not_eight_warnings(
        tmp_path: Path) -> None:
    """The activation_underflow sample: LayerScale at 1e-6 puts out values below float16's
    smallest normal, and shrinks the gradient into its block by the same gain. The report
    gave eight gradient_underflow warnings ("raise init_scale") beside it, and the
    dashboards' verdict named blocks.0.fc1. The LayerScale's warning now lists them."""
    r = subprocess.run([console_script(), "diagnose", "--logdir", "out",
                        str(_SAMPLES / "activation_underflow.py")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "out" / "amp_doctor.json").read_text())
    warn = [f for f in s["findings"] if f["severity"] in ("warning", "error")]
    assert {(f["kind"], f["module"]) for f in warn} == {
        ("activation_underflow", "blocks.0.ls"), ("activation_underflow", "blocks.1.ls")}
    by = {f["module"]: f for f in warn}
    assert by["blocks.0.ls"]["data"]["shrinks_gradients_of"] == [
        "blocks.0.fc1", "blocks.0.norm", "blocks.0.act", "blocks.0.fc2"]
    grads = [f for f in s["findings"] if f["kind"] == "gradient_underflow"]
    assert len(grads) == 8
    assert all(f["severity"] == "info" and f["data"]["follow_on_of"] ==
               f["module"].rsplit(".", 1)[0] + ".ls" for f in grads)
    lays = {x["name"]: x for x in s["layers"]}
    assert lays["blocks.0.fc1"]["grad_absmax"] < lays["blocks.0.ls"]["grad_absmax"] / 256
    # The dashboards: no layer is where inf/NaN started, so the custom-scalars tab's last
    # layout (the one TensorBoard shows) has no Culprits group of empty charts on top.
    acc = ea_mod.EventAccumulator(str(tmp_path / "out"), size_guidance={"tensors": 0}).Reload()
    last = acc.Tensors("custom_scalars__config__")[-1]
    layout = layout_pb2.Layout.FromString(last.tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == [
        "Scaler", "Overflow risk", "Underflow", "Gradients"]


def test_an_overflow_a_tanh_dropped_is_not_blamed_for_calibration_backoffs() -> None:
    """A shared layer's second call overflows float16 into a tanh (tanh(inf) = 1, its
    gradient 0): the loss and that layer's gradients stay finite. The scaler's start-up
    backoffs, with only the first layer's gradients non-finite, were called that
    overflow's consequences ("They began at shared.fc ... look there"); running it in
    float32 gives the same backoffs."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(16, 32)
            self.fc = nn.Linear(32, 32)
            self.out = nn.Linear(32, 4)
            with torch.no_grad():
                self.fc.weight.copy_(torch.eye(32) * 300.0)
                self.fc.bias.zero_()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(self.fc(torch.tanh(self.inp(x))))
            return self.out(torch.tanh(h / 1000))

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(6):
            x, y = torch.randn(16, 16) * 3, torch.randint(0, 4, (16,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            assert torch.isfinite(loss)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps[:2] == [0, 1]
    assert all("fc" not in e.culprits for e in s.scaler.events if e.kind == "backoff")
    (ov,) = s.findings_of("activation_overflow")
    assert ov.module == "fc" and "Consequences" not in ov.message
    assert all(f.severity == "info" and "began at" not in f.message
               for f in s.findings_of("scaler_backoff"))


def test_gradient_findings_rank_and_report_the_gradient_they_name() -> None:
    """No GradScaler: the gradients flush on their way back. The group led with the
    layer whose weight gradients were 99% subnormal and 0.6% zero, before one 75% zero;
    the JSON's grad_zero_frac was the output gradient's, while the text gave the weight
    gradient's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            x, y = torch.randn(512, 64), 1e-3 * torch.randn(512, 1)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y) * 1e-3
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    found = {f.module: f for f in s.findings_of("missing_scaler")}
    lays = {x.name: x for x in s.layers}
    for name, f in found.items():
        assert f.data["gradient"] == "weight"
        assert f.data["grad_zero_frac"] == lays[name].param_grad_zero_frac
    from amp_doctor.sinks.text import group_findings
    (g,) = [g for g in group_findings(s.findings, s.layers) if g.lead.kind == "missing_scaler"]
    assert [f.module for f in g.findings] == ["0", "2", "4"]
    zeros = [float(f.data["grad_zero_frac"] or 0.0) for f in g.findings]
    assert zeros[0] > 0.5 > zeros[2]


def test_a_contrastive_losss_backward_overflow_is_not_blamed_on_the_output_layer() -> None:
    """Unnormalised embeddings and ``z1 @ z2.T / 0.07`` in float16: the gradient reaching
    ``proj`` (the model's output) was already inf, made in the loss's backward. The scale
    collapse said to run proj in float32 ("do not just lower init_scale"), which changes
    nothing; anomaly mode names the loss's aten.mm."""
    torch.manual_seed(0)

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64))
            self.proj = nn.Linear(64, 64)
            with torch.no_grad():
                self.proj.weight.mul_(40.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(nn.functional.relu(self.backbone(x)))

    enc = Enc()
    opt = torch.optim.SGD(enc.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(enc, tensorboard=False) as doctor:
        for _ in range(20):
            x = torch.randn(32, 32)
            with torch.autocast("cpu", dtype=torch.float16):
                z1, z2 = enc(x), enc(x + 0.1 * torch.randn_like(x))
                loss = nn.functional.cross_entropy(z1 @ z2.t() / 0.07, torch.arange(32))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    (c,) = s.findings_of("scale_collapse")
    assert c.severity == "error" and c.data["loss_too_large"]
    assert "made in the backward of the code after the model" in c.message
    assert "not in proj, so running proj in float32 does not help" in c.message
    assert c.advice.startswith("Keep the loss O(1)") and "z1.float() @ z2.float().T" in c.advice


def test_a_lora_adapters_underflow_at_the_start_only_is_info() -> None:
    """LoRA's B starts at zero: its outputs sit below float16's smallest normal for the
    first steps, then grow out of it. Recorded every step that was a warning whose advice
    (bfloat16) would lose those small values sooner; it is info, with its trend."""
    torch.manual_seed(0)

    class Lora(nn.Module):
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base
            self.lora_A = nn.Linear(64, 4, bias=False)
            self.lora_B = nn.Linear(4, 64, bias=False)
            nn.init.kaiming_uniform_(self.lora_A.weight, a=5 ** 0.5)
            nn.init.zeros_(self.lora_B.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.lora_B(self.lora_A(x)) * 2.0

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.l1, self.l2 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64)
            self.head = nn.Linear(64, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = nn.functional.relu(self.emb(x))
            x = nn.functional.relu(self.l1(x))
            return self.head(nn.functional.relu(self.l2(x)))

    model = Net().requires_grad_(False)
    model.l1, model.l2 = Lora(model.l1), Lora(model.l2)  # type: ignore[assignment]
    model.head.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = torch.randn(32, 5)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(30):
            x = torch.randn(16, 32)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), (x @ w).argmax(1))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (f,) = doctor.session.findings_of("activation_underflow")
    assert f.module == "l2.lora_B" and f.severity == "info"
    assert f.data["underflow_first_third"] > 0.05 >= f.data["underflow_last_third"]
    assert f.advice.startswith("Nothing to fix")


def _amp_steps(model: nn.Module, steps: int, batch: Callable[[int], tuple[torch.Tensor, ...]],
               loss_fn: Callable[..., torch.Tensor], every: int = 10,
               init_scale: float = 2.0 ** 16) -> amp_doctor.Session:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with amp_doctor.watch(model, every=every, tensorboard=False) as doctor:
        for i in range(steps):
            x, y = batch(i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_a_disabled_branch_is_no_zeroed_output() -> None:
    """``nn.Dropout(p=1.0)`` as an ablation switch puts out zeros in float32 too: it has no
    weights, and review 47c saw an ERROR blaming a float16 overflow for them."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.branch = nn.Linear(16, 32), nn.Linear(32, 32)
            self.branch_drop = nn.Dropout(p=1.0)
            self.head = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.stem(x))
            return self.head(h + self.branch_drop(self.branch(h)))

    s = _amp_steps(Net(), 21, lambda i: (torch.randn(32, 16), torch.randint(0, 4, (32,))),
                   nn.functional.cross_entropy)
    assert next(x for x in s.layers if x.name == "branch_drop").zero_frac == 1.0
    assert not s.findings_of("zeroed_output")
    assert not [f for f in s.findings if f.severity == "error"]


def test_an_overflow_whose_own_backward_made_the_nan_keeps_its_backoffs() -> None:
    """An Exp module overflows float16; a torch.where drops the inf, so the loss stays
    finite, but exp's backward makes 0 * inf = NaN in the layer that fed it. The inf did
    reach the gradients: the backoffs are the overflow's consequences, one error."""
    torch.manual_seed(0)

    class Exp(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.proj = nn.Linear(8, 32), nn.Linear(32, 16)
            self.act, self.head = Exp(), nn.Linear(16, 1)
            with torch.no_grad():
                self.proj.bias[:4].fill_(14.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e = self.act(self.proj(torch.tanh(self.body(x))))
            keep = torch.ones(16, dtype=torch.bool)
            keep[:4] = False
            return self.head(torch.where(keep, e, torch.zeros((), dtype=e.dtype)))

    s = _amp_steps(Net(), 21, lambda i: (torch.randn(32, 8), torch.randn(32, 1)),
                   nn.functional.mse_loss)
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert (err.kind, err.module) == ("activation_overflow", "act")
    assert "Consequences: GradScaler backed off" in err.message
    assert all(f.severity == "info" for f in s.findings_of("scale_collapse"))


def test_a_glitch_cast_to_float16_is_blamed_beside_a_harmless_large_column() -> None:
    """Column 0, a timestamp beyond float16's max, is normalised in float32 first; in
    three steps a glitch puts 1e5 into column 3, which fc1 casts to inf. The finite steps
    with the harmless column had cancelled the glitch's blame (review 47c)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.cat([(x[:, :1] - 1.5e5) / 5e4, x[:, 1:]], 1)
            return self.fc2(torch.relu(self.fc1(x)))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 8)
        x[:, 0] = 1e5 + 1e5 * torch.rand(64)
        if i % 10 == 5:
            x[7, 3] = 1.0e5
        return x, torch.randn(64, 1)

    s = _amp_steps(Net(), 26, batch, nn.functional.mse_loss, every=1)
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert (err.module, err.step) == ("fc1", 5)
    assert "autocast's cast of them to float16 is inf" in err.message


def test_a_loop_that_skips_its_own_step_after_unscale_counts_the_skips() -> None:
    """``unscale_; norm = clip(...); if torch.isfinite(norm): opt.step(); update()``: the
    loop skipped the steps the scaler found inf in. They are skipped steps, not "no
    optimizer step was skipped"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    skips = []
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for i in range(12):
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
                opt.step()
            else:
                skips.append(i)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and skips
    assert s.scaler.backoff_steps == s.scaler.skipped_steps == skips
    assert not [f for f in s.findings if f.severity in ("error", "warning")]
    assert all("no optimizer step was skipped" not in f.message for f in s.findings)
