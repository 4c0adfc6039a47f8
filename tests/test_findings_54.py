"""Session 54: the FP8 table of a run whose loss scale fell and whose output overflowed;
a masked NaN in anomaly mode."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import amp_doctor
from amp_doctor.analysis.whatif import fp8_rows, render_fp8_table
from tests.test_findings_53 import _house_prices


def test_fp8_amax_spread_of_gradients_is_their_own_not_the_loss_scales() -> None:
    # The gradients' amaxes as the GradScaler scaled them moved with the scale's fall:
    # "amax spread (bits) 138" for a layer whose own gradients moved 15 bits (review 54).
    s = _house_prices(192)
    rows = {(r.layer, r.tensor): r for r in fp8_rows(s)}
    row = rows[("0", "gradient")]
    # Over the steps whose gradient was finite: a NaN's step has only its histogram's
    # bound for an absmax (session 59), and FP8 leaves inf/NaN steps out.
    def finite(t: object) -> bool:
        return (t is not None and math.isfinite(t.min) and math.isfinite(t.max)  # type: ignore
                and t.absmax > 0)  # type: ignore[attr-defined]

    own = [r.layers["0"].grad_unscaled.absmax for r in s.history
           if "0" in r.layers and finite(r.layers["0"].grad_unscaled)]
    scaled = [r.layers["0"].grad.absmax for r in s.history
              if "0" in r.layers and finite(r.layers["0"].grad)]
    assert len(own) >= 2
    assert row.amax_spread_bits == math.log2(max(own) / min(own))
    # Over its finite steps the scale moved too: the scaled amaxes spread otherwise.
    assert abs(row.amax_spread_bits - math.log2(max(scaled) / min(scaled))) > 4


def test_fp8_table_says_which_tensors_held_inf_or_nan_and_were_left_out() -> None:
    # Review 52a: the head's output was inf in most recorded steps, yet its FP8 row read as
    # any other (from its finite values), and an all-fine note said "nothing to fix".
    s = _house_prices(192)
    head = next(lay for lay in s.layers if lay.name == "4")
    assert head.nonfinite_steps > 0
    row = next(r for r in fp8_rows(s) if (r.layer, r.tensor) == ("4", "activation"))
    assert (row.nonfinite_steps, row.steps) == (head.nonfinite_steps, head.recorded_steps)
    table = render_fp8_table(s)
    assert (f"Left out of the simulation: the inf/NaN values of layer 4 activations (in "
            f"{head.nonfinite_steps} of {head.recorded_steps} recorded steps)") in table
    (fp8,) = [f for f in s.findings if f.kind == "fp8_readiness"]
    left_out = fp8.message.split("Left out of the simulation: the inf/NaN values of ")[1]
    assert f"layer 4 activations (in {head.nonfinite_steps} of " in left_out


class _BertLayerNorm(nn.Module):
    """BERT's hand-written LayerNorm, epsilon 1e-12 (0 in float16)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - u) / torch.sqrt(s + 1e-12)) + self.bias


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.mix = nn.Linear(16, 16, bias=False)
        self.norm = _BertLayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mix(self.emb(ids))))


STEPS_54 = 24


def test_a_masked_nan_whose_gradients_went_nan_is_not_called_harmless() -> None:
    # Review 54: padded positions (zero embeddings) make 0/0 in a float16 LayerNorm; their
    # labels are ignored, so the loss stays finite, but cross-entropy's backward multiplies
    # their NaN by 0 and every step's gradients go NaN. The forward origin read "Training
    # is not affected" beside 4 of 4 steps skipped.
    torch.manual_seed(0)
    model = _Tagger()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, anomaly=True, every=1, tensorboard=False) as doctor:
        for _ in range(STEPS_54):
            ids = torch.randint(1, 50, (4, 8), generator=g)
            ids[:, 6:] = 0
            labels = ids.remainder(5).masked_fill(ids == 0, -100)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(ids).view(-1, 5), labels.view(-1))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            assert torch.isfinite(loss)
    s = doctor.session
    assert s.scaler is not None and len(s.scaler.skipped_steps) == STEPS_54
    errors = [f for f in s.findings if f.severity == "error"]
    assert [(f.kind, f.module, f.op) for f in errors] == [("nonfinite_backward", "norm",
                                                            "aten.div")]
    # It failed in every step; the op-level search looked at a few of them (review 54: "in
    # 2 step(s)" read as how often it failed).
    searched = errors[0].message.split(" step(s) the op-level search looked at, first at")
    assert len(searched) == 2 and 1 < int(searched[0].rsplit(" ", 1)[1]) < STEPS_54
    for f in s.findings_of("nonfinite_discarded"):
        assert "not affected" not in f.message and "Nothing to do" not in f.advice
        assert "The step's gradients went non-finite all the same" in f.message
        assert f.advice.startswith("Make the input of aten.div in norm safe before the op")
    assert s.findings_of("nonfinite_discarded")


def test_anomaly_mode_names_a_cast_parameter_not_the_data() -> None:
    # Review 54: an output bias initialised at the mean price (2.5e5) is cast to float16 by
    # autocast at every use; anomaly mode told the user to fix "the data", where the
    # default mode's activation_overflow said to standardise the targets.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[-1].bias.fill_(2.5e5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 12), torch.full((32, 1), 2.5e5)
    with amp_doctor.watch(model, anomaly=True, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (err,) = [f for f in doctor.session.findings if f.severity == "error"]
    assert (err.kind, err.module, err.op) == ("nonfinite_forward", "2", "aten._to_copy")
    assert "cast values up to 2.50e+05 to float16" in err.message
    assert "Those values are a parameter of layer 2 (a weight or bias, in float32)" in err.message
    assert err.advice.startswith("A parameter of layer 2 holds values beyond the format's max")
    assert "standardise the targets" in err.advice and "--fp32 2 " in err.advice
    assert "the data" not in err.advice


def test_a_loss_beyond_float16_with_its_output_layer_in_float32_is_still_the_losss() -> None:
    # Review 54: a regression on raw prices (loss ~1e9) run with its output layer in float32
    # (`--fp32 4`, as the report's next step offered): the overflow moved to the layer below,
    # and the report blamed that layer ("run it in float32"), never the loss's size.
    torch.manual_seed(0)
    x = torch.randn(1024, 12)
    y = (x @ (torch.rand(12) * 3e4) + 2.5e5).unsqueeze(1)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 1))
    with torch.no_grad():
        model[-1].bias.fill_(2.5e5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, fp32=["4"], tensorboard=False) as doctor:
        for _ in range(40):
            idx = torch.randint(0, 1024, (64,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert err.kind == "scale_collapse" and err.data["loss_too_large"]
    assert err.module in ("2", "3")
    assert "in the recorded steps that backed off, beyond float16's max 65504" in err.message
    assert err.message.endswith(f"so the loss is too large, not {err.module}.")
    assert err.advice.startswith("Keep the loss O(1): normalise the data and targets")


def test_the_header_of_a_run_with_a_disabled_gradscaler_says_disabled() -> None:
    # Review 54: "no GradScaler" in the header, "GradScaler present but disabled" below it
    # (a `torch.cuda.amp.GradScaler()` disables itself without CUDA).
    from amp_doctor.sinks.text import render_text

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    text = render_text(doctor.session)
    header = text.splitlines()[0]
    assert "| GradScaler disabled |" in header and "no GradScaler" not in header
    assert "Scaler: GradScaler present but disabled" in text


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_loss_of_an_accumulated_step_is_the_sum_of_its_micro_batches(
        dtype: torch.dtype) -> None:
    # Review 54: with gradient accumulation (loss / 4 per micro-batch) the step's recorded
    # loss was the last micro-batch's quarter (0.589 against 2.33), on the loss chart too
    # (bfloat16, no GradScaler: the first micro-batch's).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    g = torch.Generator().manual_seed(0)
    sums = []
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            opt.zero_grad()
            total = 0.0
            for _ in range(4):
                x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
                with torch.autocast("cpu", dtype=dtype):
                    loss = F.cross_entropy(model(x), y) / 4
                total += float(loss.detach())
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            sums.append(total)
    got = [r.loss for r in doctor.session.history]
    assert len(got) == 3
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, sums, strict=True))
    assert all(1.0 < v < 1.3 for v in got)  # about ln 3: the whole batch's mean loss


def test_an_op_findings_steps_say_what_the_search_looked_at_and_what_armed_it() -> None:
    from amp_doctor.analysis.messages import MessageArgs, _op_steps
    from amp_doctor.records import Event

    ev = Event("nonfinite_forward", 17, "1", "aten.std", data={"first_seen_step": 5})
    assert _op_steps(MessageArgs(ev, 1, "at step 17", [17])) == (
        "at step 17 (the step the op-level search looked at; it was armed by the NaN/Inf "
        "the per-step check saw at step 5)")
    assert _op_steps(MessageArgs(ev, 3, "first at step 17", [17, 29, 41])) == (
        "in 3 step(s) the op-level search looked at, first at step 17 (it was armed by the "
        "NaN/Inf the per-step check saw at step 5)")
    plain = Event("nonfinite_forward", 0, "1", "aten.std", data={"first_seen_step": 0})
    assert _op_steps(MessageArgs(plain, 2, "first at step 0", [0, 9])) == (
        "in 2 step(s) the op-level search looked at, first at step 0")


def test_fix_numbers_its_trials_as_their_folders() -> None:
    # Review 54: the table's rows counted from 0 (the baseline) while the trials' folders
    # count from trial01: row 2 was trial03.
    from amp_doctor.fix import FixResult, Trial, render_fix

    def trial(fp32: tuple[str, ...], why: str, errors: tuple[str, ...]) -> Trial:
        return Trial(fp32=fp32, why=why, errors=errors, exit_code=0, steps=20,
                     final_loss=0.5, skipped=0)

    bad = ("activation_overflow@proj",)
    r = FixResult(baseline=trial((), "baseline", bad),
                  trials=[trial((), "baseline, repeated", bad),
                          trial(("proj",), "culprit", ())],
                  best=trial(("proj",), "culprit", ()), device_type="cpu", models=["Net"],
                  command=["t.py"])
    text = render_fix(r)
    assert "its report in the folder trialNN" in text
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("trial "))
    firsts = [ln.split()[0] for ln in lines[head + 2 : head + 5]]
    assert firsts == ["1", "2", "3"]
    assert lines[head + 4].split()[1] == "proj"


def test_a_ctrl_c_python_dropped_in_a_weakref_callback_is_delivered_again() -> None:
    # CI, test_ctrl_c_after_the_report_is_out_...: a Ctrl-C that landed in a weakref
    # callback (torch's WeakIdKeyDictionary, which the hooks keep per step) was reported
    # as "Exception ignored" and lost, and the script looped on.
    import gc
    import sys
    import time
    import weakref

    from amp_doctor.hooks import interrupts

    class Dies:
        pass

    def callback(ref: object) -> None:
        raise KeyboardInterrupt  # as a SIGINT landing here would

    before = sys.unraisablehook
    model = nn.Linear(4, 4)
    with amp_doctor.watch(model, tensorboard=False):
        assert sys.unraisablehook is interrupts._redeliver
        obj = Dies()
        ref = weakref.ref(obj, callback)
        with pytest.raises(KeyboardInterrupt):
            del obj
            gc.collect()
            for _ in range(1000):  # the handler runs at the next bytecode
                time.sleep(0.001)
        assert ref() is None
        # Anything else still goes to the hook that was there.
        seen: list[type] = []
        interrupts._previous = lambda u: seen.append(type(u.exc_value))
        try:
            other = Dies()
            refs = [weakref.ref(other, lambda r: 1 / 0)]
            del other
            assert refs[0]() is None and seen == [ZeroDivisionError]
        finally:
            interrupts._previous = before
    assert sys.unraisablehook is before  # restored with the watch
