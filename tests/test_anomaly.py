"""Anomaly mode: the first NaN/Inf origin, at op level, forward and backward, in real loops."""

from __future__ import annotations

import gc
import importlib.util
import math
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import amp_doctor
from amp_doctor.devicework import host_syncs
from amp_doctor.errors import AmpDoctorError, NonFiniteError
from tests.helpers import MLP, marked_line, train

THIS_FILE = __file__


class LogProbHead(nn.Module):
    """log(softmax(x / T)): probabilities that underflow in float16 give log(0) = -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.fc(x) / 0.01, dim=-1)
        return torch.log(probs)  # LOG_LINE


class CubeGELU(nn.Module):
    """tanh-GELU: the cube overflows in float16, tanh saturates it back to a finite 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))  # POW_LINE
        return 0.5 * x * (1.0 + torch.tanh(inner))


class Net(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.act = act
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _line_of(marker: str) -> int:
    return marked_line(THIS_FILE, marker)


def _loop(model: nn.Module, steps: int, x_fn, dtype=torch.float16, scaler=True) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    losses = []
    for i in range(steps):
        x = x_fn(i)
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x).float().mean()
        opt.zero_grad()
        if sc is not None:
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        else:
            loss.backward()
            opt.step()
        losses.append(float(loss.detach()))
    return losses


def _big_x(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 16, generator=g)
    x[:, :4] = 400.0
    return x


def test_forward_origin_names_module_op_line_and_input_range() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), LogProbHead())
    with torch.no_grad():
        model[0].weight.mul_(20)
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        _loop(model, 3, lambda i: torch.randn(8, 16))
    ev = [e for e in doctor.session.events if e.kind == "nonfinite_forward"]
    assert ev, doctor.report()
    first = ev[0]
    assert (first.module, first.op, first.step) == ("2", "aten.log", 0)
    assert first.frame == f"{THIS_FILE}:{_line_of('LOG_LINE')} in forward"
    # log's input was the softmax output: finite probabilities in [0, 1].
    assert first.data["input_min"] == 0.0 and 0 < first.data["input_max"] <= 1.0
    assert first.data["neg_inf"] and not first.data["nan"] and first.data["dtype"] == "float16"
    # The softmax before it stayed finite: it is not blamed, nor is any later op.
    assert not [e for e in ev if e.op != "aten.log"]
    f = doctor.session.findings_of("nonfinite_forward")[0]
    assert f.severity == "error" and f.module == "2" and f.op == "aten.log"
    assert "log_softmax" in f.advice and "-inf" in f.message and "absmax 1" in f.message


def test_hidden_overflow_inside_a_module_with_finite_output() -> None:
    torch.manual_seed(0)
    model = Net(CubeGELU())
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        _loop(model, 2, _big_x)
    s = doctor.session
    hidden = s.findings_of("activation_overflow")
    op_level = [f for f in hidden if f.op == "aten.pow"]
    assert op_level, doctor.report()
    f = op_level[0]
    assert f.module == "act" and f.data["module_output_finite"] is True
    assert "output stayed finite" in f.message
    assert f.frame == f"{THIS_FILE}:{_line_of('POW_LINE')} in forward"
    # The module-level stats really do see a finite output for act.
    assert s.layer("act").nonfinite_steps == 0
    # And the backward pass goes non-finite, mapped back to a forward module and op.
    back = [e for e in s.events if e.kind == "nonfinite_backward"]
    assert back and all(e.data["node"] and e.data["forward_op"] for e in back)


def test_backward_only_origin_is_mapped_to_its_forward_op() -> None:
    class SqrtLayer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # d/dx sqrt(0) = inf, and the mask's backward makes NaN of it: inf * 0.
            return torch.sqrt(x * (x > 0).to(x.dtype))  # SQRT_LINE

    torch.manual_seed(0)
    model = Net(SqrtLayer())
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        _loop(model, 1, lambda i: torch.randn(8, 16), dtype=torch.bfloat16, scaler=False)
    s = doctor.session
    assert not [e for e in s.events if e.kind == "nonfinite_forward"]
    back = [e for e in s.events if e.kind == "nonfinite_backward"]
    assert back, doctor.report()
    e = back[0]
    assert e.module == "act" and e.data["forward_op"] == "aten.sqrt"
    assert e.data["node"] == "SqrtBackward0" and e.step == 0
    assert e.frame is not None and e.frame.startswith(f"{THIS_FILE}:")
    f = s.findings_of("nonfinite_backward")[0]
    assert f.severity == "error" and "SqrtBackward0" in f.message


def test_a_backward_inf_that_a_later_backward_op_drops_is_harmless() -> None:
    """sqrt(relu(x)): d/dx sqrt(0) = inf, but relu's backward (a ``where``, not a
    product) writes 0 there, so every parameter gradient is finite: said, not an error."""
    class SqrtRelu(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(torch.relu(x))

    torch.manual_seed(0)
    model = Net(SqrtRelu())
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        _loop(model, 1, lambda i: torch.randn(8, 16), dtype=torch.bfloat16, scaler=False)
    assert all(bool(p.grad.isfinite().all()) for p in model.parameters())
    s = doctor.session
    (f,) = [f for f in s.findings if f.kind.startswith("nonfinite")]
    assert (f.severity, f.kind, f.module, f.op) == ("info", "nonfinite_discarded", "act",
                                                     "aten.div")
    assert f.message.endswith("Training is not affected.")


class SpectralMix(nn.Module):
    """A complex filter whose one entry overflows the complex product (float32 parts)."""

    def __init__(self) -> None:
        super().__init__()
        filt = torch.randn(17, dtype=torch.complex64)
        filt[3] = 1e38
        self.register_buffer("filt", filt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x.float(), dim=-1) * self.filt  # MIX_LINE


class ToReal(nn.Module):
    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(spec, n=32, dim=-1)


def test_complex_intermediates_are_searched_so_the_fft_is_not_taken_for_the_origin() -> None:
    """The inf is made by a complex product in ``mix``, whose output no layer statistic
    covers (complex), and ``back``'s inverse FFT turns it into NaN. The search reads
    complex values too: the product is the origin, not the FFT that received the inf,
    and the NaN loss downstream is its consequence, not a second error."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(16, 32)
            self.mix = SpectralMix()
            self.back = ToReal()
            self.out = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.back(self.mix(self.inp(x))))

    torch.manual_seed(0)
    model = Net()
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        losses = _loop(model, 3, lambda i: torch.randn(8, 16))
    assert all(not math.isfinite(v) for v in losses)
    s = doctor.session
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module, f.op) for f in errors] == [
        ("nonfinite_forward", "mix", "aten.mul")], errors
    f = errors[0]
    assert f.data["dtype"] == "complex64"
    assert f.frame == f"{THIS_FILE}:{_line_of('MIX_LINE')} in forward"
    assert not [e for e in s.events if e.op == "aten._fft_c2r"]
    loss = s.findings_of("nonfinite_loss")
    assert loss and loss[0].severity == "info" and "It began at aten.mul in mix" in loss[0].message
    assert "at the first step, before any update" in f.advice


def test_intentional_infinities_are_not_reported() -> None:
    class MaskedAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = self.q(x) @ x.t()
            n = scores.shape[-1]
            causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
            pad = torch.zeros(n, n, dtype=torch.bool)
            pad[:, -1] = True
            scores = scores + causal
            scores = scores.masked_fill(pad, float("-inf"))
            scores = torch.where(pad, float("-inf"), scores)
            return torch.softmax(scores.float(), dim=-1) @ x

    torch.manual_seed(0)
    model = nn.Sequential(MaskedAttention(), nn.Linear(16, 4))
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        _loop(model, 3, lambda i: torch.randn(8, 16), dtype=torch.bfloat16, scaler=False)
    s = doctor.session
    nonfinite = [e for e in s.events if e.kind.startswith("nonfinite") or e.data.get("hidden")]
    assert nonfinite == [], nonfinite
    assert not [f for f in s.findings if f.severity in ("error", "warning")], doctor.report()


def test_nan_in_the_batch_is_blamed_on_the_input() -> None:
    torch.manual_seed(0)
    model = MLP()

    def x_fn(i: int) -> torch.Tensor:
        x = torch.randn(8, 16)
        if i == 1:
            x[3, 5] = float("nan")
        return x

    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        _loop(model, 3, x_fn, dtype=torch.bfloat16, scaler=False)
    s = doctor.session
    inputs = [e for e in s.events if e.kind == "nonfinite_input"]
    assert [(e.module, e.step) for e in inputs] == [("MLP", 1)]
    assert inputs[0].data["nan"]
    # No layer is blamed for what the data brought in (later steps have NaN weights).
    assert not [e for e in s.events if e.kind in ("nonfinite_forward", "nonfinite_backward")]
    f = s.findings_of("nonfinite_input")[0]
    assert f.severity == "error" and "isfinite" in f.advice


def test_raise_mode_stops_at_the_op_and_restores_everything() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), LogProbHead())
    with torch.no_grad():
        model[0].weight.mul_(20)
    before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    with pytest.raises(NonFiniteError, match=r"aten\.log in module '1'") as info:
        with amp_doctor.watch(model, anomaly=True, on_nonfinite="raise") as doctor:
            _loop(model, 3, lambda i: torch.randn(8, 16))
    assert f"{THIS_FILE}:{_line_of('LOG_LINE')}" in str(info.value)
    assert "\n" not in str(info.value)
    assert _get_current_dispatch_mode() is None
    assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == before
    assert doctor.session.run.outcome == "exception"
    assert doctor.session.findings_of("nonfinite_forward")


@pytest.mark.parametrize("anomaly", [True, False])
def test_raise_alone_asks_for_anomaly_mode_as_the_cli_does(anomaly: bool) -> None:
    # watch(on_nonfinite="raise") without anomaly=True ran no check at all, silently.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), LogProbHead())
    with torch.no_grad():
        model[0].weight.mul_(20)
    with pytest.raises(NonFiniteError, match=r"aten\.log in module '1'"):
        with amp_doctor.watch(model, anomaly=anomaly, on_nonfinite="raise"):
            _loop(model, 3, lambda i: torch.randn(8, 16))


def test_raise_mode_lets_the_grad_scaler_skip_its_own_overflows() -> None:
    # A healthy float16 run: the default scale (65536) overflows the summed loss's scaled
    # gradients in the first steps, the scaler skips them and backs off, and training
    # goes on. Raise mode stopped it at step 0 with an error and advice to change the
    # model; now the backward through scale() is recorded as in record mode.
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor], Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        sc = torch.amp.GradScaler("cpu")
        g = torch.Generator().manual_seed(0)
        w = amp_doctor.watch(model, on_nonfinite="raise") if watched else None
        losses, scales = [], []
        try:
            for _ in range(8):
                x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
                opt.zero_grad()
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
                losses.append(float(loss.detach()))
                scales.append(sc.get_scale())
        finally:
            session = w.close() if w is not None else None
        return losses, [p.detach().clone() for p in model.parameters()], (session, scales)

    plain, plain_params, (_, scales) = run(False)
    losses, params, (s, _) = run(True)
    assert losses == plain
    assert all(torch.equal(a, b) for a, b in zip(plain_params, params, strict=True))
    assert scales[0] < 65536 and all(math.isfinite(x) for x in plain)  # it did overflow
    assert s.run.outcome == "completed" and s.steps == 8
    # The overflows are recorded, as the scaler's business: calibration (steps 0-2 here)
    # and one more backoff at step 4 (the scaler's own finding judges that one).
    overflows = s.findings_of("nonfinite_backward")
    assert overflows and {f.severity for f in overflows} == {"info"}
    assert not [f for f in s.findings if f.severity == "error"]


def test_allowlist_by_op_or_module() -> None:
    torch.manual_seed(0)
    for allow in (["aten.log"], ["log"], ["1"]):
        model = nn.Sequential(nn.Linear(16, 16), LogProbHead())
        with torch.no_grad():
            model[0].weight.mul_(20)
        with amp_doctor.watch(model, anomaly=True, anomaly_allow=allow, every=1) as doctor:
            _loop(model, 2, lambda i: torch.randn(8, 16))
        assert not [e for e in doctor.session.events if e.kind == "nonfinite_forward"], allow


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_anomaly_mode_keeps_numerics_bit_identical(dtype: torch.dtype) -> None:
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(5)
        model = Net(CubeGELU())
        if watched:
            with amp_doctor.watch(model, anomaly=True, every=2):
                losses = _loop(model, 4, _big_x, dtype=dtype)
        else:
            losses = _loop(model, 4, _big_x, dtype=dtype)
        return losses, [p.detach().clone() for p in model.parameters()]

    l0, p0 = run(False)
    l1, p1 = run(True)
    assert l0 == l1 or all(math.isnan(a) and math.isnan(b) for a, b in zip(l0, l1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))


def test_op_dtypes_record_what_autocast_ran() -> None:
    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        train(model, steps=2, dtype=torch.bfloat16)
    fc1 = doctor.session.layer("fc1")
    # Ops are recorded on searched steps: a healthy run searches only its first step.
    assert fc1.ops["aten.addmm"] == {"bfloat16": 1}
    # The casts autocast inserted for the weight and bias ran inside fc1 too.
    assert fc1.ops["aten._to_copy"]["bfloat16"] >= 2
    assert doctor.session.layer("act").ops["aten.relu"] == {"bfloat16": 1}


def test_healthy_run_costs_at_most_one_sync_per_recorded_step() -> None:
    torch.manual_seed(0)
    model = MLP()
    start = host_syncs()
    with amp_doctor.watch(model, anomaly=True, every=2) as doctor:
        train(model, steps=8)
    syncs = host_syncs() - start
    assert doctor.session.recorded_steps == 4
    # GradScaler's own per-step sync is not ours; ours: 4 recorded steps, and at the close
    # anomaly mode's last window and the loop's end-of-run counts (every batch is checked).
    assert syncs <= doctor.session.recorded_steps + 2, syncs
    assert not [e for e in doctor.session.events if e.kind.startswith("nonfinite")]


def test_teardown_on_exception_and_interrupt_leaves_nothing() -> None:
    from torch.nn.modules.module import _global_forward_hooks

    model = MLP()
    hooks_before = len(_global_forward_hooks)
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with amp_doctor.watch(model, anomaly=True, every=1):
                train(model, steps=1)
                raise exc
        assert _get_current_dispatch_mode() is None
        assert len(_global_forward_hooks) == hooks_before
    # And a finished anomaly watch keeps no activation alive.
    captured: list[weakref.ref[torch.Tensor]] = []
    model.fc1.register_forward_hook(lambda m, i, o: captured.append(weakref.ref(o)))
    with amp_doctor.watch(model, anomaly=True, every=1):
        train(model, steps=2)
    gc.collect()
    assert captured and all(r() is None for r in captured)


def test_one_anomaly_watch_at_a_time() -> None:
    a, b = MLP(), MLP()
    with amp_doctor.watch(a, anomaly=True):
        with pytest.raises(AmpDoctorError, match="one watch.*anomaly=True"):
            amp_doctor.watch(b, anomaly=True)
    assert _get_current_dispatch_mode() is None


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kw", [{"anomaly": True}, {"on_nonfinite": "raise"}],
                         ids=["anomaly", "raise"])
def test_a_default_dtype_of_the_users_does_not_break_anomaly_mode(
        default: torch.dtype, kw: dict[str, Any]) -> None:
    # Before: torch.set_default_dtype(bfloat16) made anomaly mode's zeros bfloat16 (an
    # index_add_ dtype error each step, "nothing was recorded"), and float64 gradients
    # could not be normed in float32 (an internal error each step).
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with amp_doctor.watch(model, every=1, tensorboard=False, **kw) as doctor:
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(torch.randn(4, 16)).float().pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        torch.set_default_dtype(saved)
    s = doctor.session
    assert [e.data for e in s.events if e.kind == "internal_error"] == []
    assert (s.steps, s.recorded_steps) == (3, 3)


def test_eps_underflow_message_gives_each_inputs_range() -> None:
    # Review 34 (LOW): anomaly mode's finding said the division ran "from finite float32
    # inputs (min -1.97, max 2.25)": the output's dtype, and one range pooled over both
    # inputs, which hid the denominator that was exactly 0 (1e-8 vanishes in float16).
    mod = _sample("eps_underflow.py")
    torch.manual_seed(0)
    model = mod.DeadUnitNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = mod.make_batch(torch.device("cpu"), 64)
    with amp_doctor.watch(model, every=1, anomaly=True, tensorboard=False) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    f = next(f for f in doctor.session.findings
             if f.kind == "nonfinite_forward" and f.op == "aten.div")
    ranges = f.data["input_ranges"]
    # The numerator's range, then the denominator's, whose dead channels are exactly 0 (the
    # vanished eps: sqrt(0 + 0)); pooled, the 0 was hidden inside [-0.386, 1.97].
    assert len(ranges) == 2 and ranges[0][0] < 0 and ranges[1][0] == 0.0
    assert "from finite inputs ([-0.386, 1.97]; [0, 0.506])" in f.message
    assert "float32 inputs" not in f.message


def _sample(script: str) -> types.ModuleType:
    path = Path(__file__).resolve().parent.parent / "sample_models" / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_an_input_beyond_the_outputs_format_is_not_called_that_format() -> None:
    """The dtype an op entry records is its output's: a backward cast of a float32
    gradient of -4.4e5 to float16 read 'from finite float16 inputs (min -4.43e+05...)',
    which float16 cannot hold (review 41c)."""
    from amp_doctor.analysis.messages import event_message
    from amp_doctor.records import Event

    data = {"dtype": "float16", "neg_inf": True, "input_min": -4.43e5, "input_max": -3.9e5,
            "input_absmax": 4.43e5, "node": "ToCopyBackward0", "forward_op": "aten._to_copy"}
    text = event_message(Event(kind="nonfinite_backward", step=0, module="fc", op="aten._to_copy",
                               data=data), 1)
    assert "from finite inputs (min -4.43e+05" in text and "float16 inputs" not in text
    text = event_message(Event(kind="nonfinite_backward", step=0, module="fc", op="aten.div",
                               data={**data, "input_min": -2.0, "input_max": 0.0,
                                     "input_absmax": 2.0}), 1)
    assert "from finite float16 inputs (min -2" in text


def test_a_gradscalers_calibration_overflow_is_said_to_need_no_fix() -> None:
    """init_scale 2**22: the scaled gradients overflow in the first five backward passes
    while the scaler halves its way down, as designed. Anomaly mode names the backward op
    that overflowed, and says there is nothing to fix, as the backoff finding does; its
    advice read 'run the forward op in float32' (review 41c)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        for _ in range(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(32, 16, generator=g)).float().mean()
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps == [0, 1, 2, 3, 4]
    assert [(f.severity, f.kind) for f in s.findings] == [
        ("info", "nonfinite_backward"), ("info", "scaler_backoff")]
    assert s.findings[0].advice.startswith("Nothing to fix: at a GradScaler's first steps")
    assert s.findings[1].advice.startswith("Nothing to fix")
