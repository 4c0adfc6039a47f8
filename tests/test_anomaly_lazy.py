"""Anomaly mode that costs almost nothing until something goes non-finite (issue 15),
leaves the user's dispatch modes, anomaly flags and threads alone (issue 14), and does
not change a compiled model's numerics (issue 13).

The op-level search runs on the first step and on the steps after the per-step check
saw a non-finite value; these tests make the problem start later, so that it is the
per-step check that has to catch it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

import amp_doctor
from amp_doctor.anomaly.mode import AnomalyMode
from amp_doctor.devicework import host_syncs
from tests.helpers import MLP, console_script, marked_line, train

THIS_FILE = __file__
AMP_DOCTOR = console_script()


class CubeGELU(nn.Module):
    """tanh-GELU: the cube overflows in float16, tanh saturates it back to a finite 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))  # POW_LINE
        return 0.5 * x * (1.0 + torch.tanh(inner))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.act = CubeGELU()
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Standardize(nn.Module):
    """(x - mean) / sqrt(var + 1e-8): 1e-8 is 0 in float16, so a dead channel is 0/0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(0, keepdim=True)
        var = x.var(0, unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-8)  # DIV_LINE


def _line_of(marker: str) -> int:
    return marked_line(THIS_FILE, marker)


def _outliers_from(start: int, value: float = 400.0):
    """Batches that turn pathological at step ``start`` (outlier channels)."""
    def x_fn(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, 16, generator=g)
        if i >= start:
            x[:, :4] = value
        return x
    return x_fn


def _loop(model: nn.Module, steps: int, x_fn, dtype=torch.float16, scaler=True,
          on_forward=None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    losses = []
    for i in range(steps):
        x = x_fn(i)
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x).float().mean()
        if on_forward is not None:
            on_forward(i)
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


def _search_steps(doctor) -> list[int]:
    return sorted({e.step for e in doctor.session.events if e.kind.startswith("nonfinite")
                   or e.data.get("hidden")})


# -- the per-step check arms the op-level search -----------------------------------------
def test_hidden_overflow_starting_late_is_found_on_the_next_step_from_a_scaler_skip() -> None:
    """float16 + GradScaler, every=10: the overflow starts at unrecorded step 4. The
    scaler's skip (host-known, no sync of ours) arms the search for step 5."""
    torch.manual_seed(0)
    model = Net()
    searching: list[bool] = []
    with amp_doctor.watch(model, anomaly=True, every=10) as doctor:
        _loop(model, 9, _outliers_from(4),
              on_forward=lambda i: searching.append(_get_current_dispatch_mode() is not None))
    s = doctor.session
    # The mode is on the stack only on the first step and the searched ones after step 4.
    assert searching[:4] == [True, False, False, False], searching
    assert searching[4] is False and searching[5] is True, searching
    pow_ev = [e for e in s.events if e.kind == "activation_overflow" and e.op == "aten.pow"]
    assert pow_ev, doctor.report()
    e = pow_ev[0]
    assert (e.module, e.step) == ("act", 5)
    assert e.frame == f"{THIS_FILE}:{_line_of('POW_LINE')} in forward"
    assert e.data["module_output_finite"] is True and e.data["first_seen_step"] == 4
    back = [e for e in s.events if e.kind == "nonfinite_backward"]
    assert back and all(e.step == 5 and e.data["forward_op"] for e in back)
    # Named once: the search stops after it found the origin (a cool-down follows).
    assert searching[6:] == [False, False, False], searching
    f = [f for f in s.findings if f.kind == "activation_overflow" and f.op == "aten.pow"]
    assert f and f[0].severity == "error"


def _flat_from(start: int):
    def x_fn(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, 16, generator=g)
        if i >= start:
            x[:, :] = 1.0  # every row equal: the batch variance is exactly 0 -> 0/0
        return x
    return x_fn


def test_no_scaler_is_caught_by_the_gradient_check_riding_in_the_recorded_copy() -> None:
    """No GradScaler: nothing on the host says the step went bad until the recorded
    step's copy brings the on-device gradient flags; the search runs on the next step.
    The loop skips updates with a non-finite gradient norm (as many trainers do), so the
    weights stay finite and the next step starts from finite inputs again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Standardize(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x_fn = _flat_from(2)
    with amp_doctor.watch(model, anomaly=True, every=4) as doctor:
        for i in range(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x_fn(i)).float().mean()
            opt.zero_grad()
            loss.backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            if torch.isfinite(norm):
                opt.step()
            else:
                doctor.step()  # the loop's own boundary for a skipped update
    s = doctor.session
    ev = [e for e in s.events if e.kind == "nonfinite_forward"]
    assert ev, doctor.report()
    # Bad from step 2; flags read at recorded step 4; searched at step 5.
    assert (ev[0].module, ev[0].op, ev[0].step) == ("1", "aten.div", 5)
    assert ev[0].frame == f"{THIS_FILE}:{_line_of('DIV_LINE')} in forward"
    assert ev[0].data["first_seen_step"] == 2
    assert ev[0].data["nan"] and ev[0].data["output_max"] != math.inf
    assert not [e for e in s.events if e.kind == "nonfinite_unlocated"]


def test_no_scaler_and_poisoned_weights_say_why_the_origin_is_not_named() -> None:
    """Without a GradScaler the first bad step's update writes NaN into the weights, so
    no later op starts from finite inputs: the report says so and names the remedy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Standardize(), nn.Linear(16, 4))
    with amp_doctor.watch(model, anomaly=True, every=4) as doctor:
        _loop(model, 8, _flat_from(2), dtype=torch.float16, scaler=False)
    s = doctor.session
    assert not [e for e in s.events if e.kind in ("nonfinite_forward", "nonfinite_backward")]
    un = [e for e in s.events if e.kind == "nonfinite_unlocated"]
    assert len(un) == 1, s.events
    d = un[0].data
    assert un[0].step == 2 and d["steps"][:3] == [2, 3, 4] and d["searched_steps"] == [5, 6, 7]
    assert d["weights_nonfinite_at"] == 5 and "on_nonfinite='raise'" in d["reason"]
    # What the reason recommends does name it: every op of every step, stopping at the op.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Standardize(), nn.Linear(16, 4))
    with pytest.raises(amp_doctor.errors.NonFiniteError, match=r"aten\.div in module '1'"):
        with amp_doctor.watch(model, anomaly=True, on_nonfinite="raise"):
            _loop(model, 8, _flat_from(2), dtype=torch.float16, scaler=False)


class Booster(nn.Module):
    """Multiplies by ``gain``; the loop sets a float16-overflowing gain for one step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gain


def test_a_transient_nonfinite_step_that_does_not_come_back_is_reported_unlocated() -> None:
    torch.manual_seed(0)
    model = Booster()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=1.0)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        for i in range(9):
            model.gain = 1e6 if i == 2 else 1.0  # once, then never again
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16, generator=g)).float().square().mean()
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    s = doctor.session
    un = [e for e in s.events if e.kind == "nonfinite_unlocated"]
    assert len(un) == 1, s.events
    d = un[0].data
    assert un[0].step == 2 and d["steps"] == [2] and d["searched_steps"] == [3, 4, 5]
    assert d["scaler_skipped_only"] is True and d["weights_nonfinite_at"] is None
    assert "stayed finite" in d["reason"]
    assert not [e for e in s.events if e.kind in ("nonfinite_forward", "nonfinite_backward")]
    assert s.scaler is not None and 2 in s.scaler.skipped_steps
    # Not "NaN/Inf was seen in N step(s)": N would be the steps searched, not the skips.
    # Nor "scaled gradients beyond float16's max": the loss itself was inf (review 42a).
    (f,) = [f for f in s.findings if f.kind == "nonfinite_unlocated"]
    assert f.severity == "info" and f.message.startswith(
        "The GradScaler skipped steps whose loss was already NaN/inf (first at step 2; ")
    assert s.findings_of("nonfinite_loss")[0].data["bad_steps"] == [2]


class BatchStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A batch of one sample has no std: NaN.
        return (x - x.mean(0)) / (x.std(0) + 1e-3)  # STD_LINE


def test_a_nan_that_recurs_every_epoch_is_located_by_an_aimed_search() -> None:
    """21 samples in batches of 4: each epoch's last batch holds one sample, whose std
    is NaN, every 6 steps. The ordinary search (3 steps after a skip) falls between
    occurrences every time; the spacing of the last two aims one at the next."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), BatchStandardize(), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    x_all, y_all = torch.randn(21, 16), torch.randn(21, 1)
    searching: list[bool] = []
    with amp_doctor.watch(model, anomaly=True, every=10) as doctor:
        for _ in range(6):
            for i in range(0, 21, 4):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x_all[i:i + 4])
                    searching.append(_get_current_dispatch_mode() is not None)
                    loss = nn.functional.mse_loss(out.float(), y_all[i:i + 4])
                opt.zero_grad()
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.skipped_steps == [5, 11, 17, 23, 29, 35]
    evs = [e for e in s.events if e.kind == "nonfinite_forward"]
    assert {(e.module, e.op) for e in evs} == {("1", "aten.std")}, evs
    ev = evs[0]
    assert ev.frame == f"{THIS_FILE}:{_line_of('STD_LINE')} in forward"
    # Step 0 (calibration); steps 6-8 after the skip at 5, which missed; then the one
    # step that the skips at 5 and 11 predict, which names it and the steps before it.
    searched = [i for i, on in enumerate(searching) if on]
    assert searched[:5] == [0, 6, 7, 8, 17], searched
    assert ev.step == 17 and ev.data["first_seen_step"] == 5
    assert not [e for e in s.events if e.kind == "nonfinite_unlocated"], s.events
    (f,) = [f for f in s.findings if f.kind == "nonfinite_forward"]
    assert f.severity == "error" and f.message.startswith("aten.std in layer 1 was the first op")
    assert ("step(s) the op-level search looked at, first at step 17 (it was armed by the "
            "NaN/Inf the per-step check saw at step 5)") in f.message
    # The std of one sample is NaN in float32 too: no "keep it in float32" advice.
    assert f.advice.startswith("A std or var over a dimension with no more values than its "
                               "correction is NaN in any precision")
    # A Sequential's child "1" reads as a layer, not as a count.
    assert "ERROR  nonfinite_forward  layer 1 [aten.std] step 17\n" in doctor.report()


def test_a_gans_discriminator_gradients_from_the_generator_step_are_not_checked() -> None:
    """The generator's backward runs through the discriminator and, at G's scale, writes
    D.2's weight gradients to inf on every step; D's next ``zero_grad()`` drops them,
    and no optimizer takes them (G's scaler never backs off). The per-step check reads
    the gradients each optimizer step is given, so nothing is flagged; the op the first
    step's search saw is said to be harmless."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 16))
    disc = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    with torch.no_grad():
        disc[0].weight.mul_(300.0)  # hidden activations ~1e3 ...
        disc[2].weight.mul_(1e-3)  # ... times G's scale overflow D.2's weight gradient only
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-4)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-9)
    sc_g = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=10 ** 6)
    sc_d = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=10 ** 6)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(0)
    d_grads_bad = []
    with amp_doctor.watch([gen, disc], anomaly=True, every=5) as doctor:
        for _ in range(24):  # past the first search's cool-down
            real, z = torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                fake = gen(z)
                d_loss = (bce(disc(real), torch.ones(16, 1))
                          + bce(disc(fake.detach()), torch.zeros(16, 1)))
            opt_d.zero_grad()
            sc_d.scale(d_loss).backward()
            sc_d.step(opt_d)
            sc_d.update()
            with torch.autocast("cpu", dtype=torch.float16):
                g_loss = bce(disc(fake), torch.ones(16, 1))
            opt_g.zero_grad()
            sc_g.scale(g_loss).backward()
            d_grads_bad.append(not bool(disc[2].weight.grad.isfinite().all()))
            sc_g.step(opt_g)
            sc_g.update()
    assert all(d_grads_bad) and sc_g.get_scale() == 2.0 ** 16 and sc_d.get_scale() == 8.0
    s = doctor.session
    nonfinite = [f for f in s.findings if f.kind.startswith("nonfinite")]
    assert [(f.severity, f.kind, f.step) for f in nonfinite] == [
        ("info", "nonfinite_discarded", 0)], nonfinite
    assert nonfinite[0].op == "aten.mm" and nonfinite[0].module.endswith(".2")
    # Seen by the first step's search only: the per-step check never re-armed it.
    assert nonfinite[0].data["occurrences"] == 1
    assert "every gradient an optimizer step took was finite" in nonfinite[0].message
    assert "Training is not affected" in nonfinite[0].message


class SparseEmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16, sparse=True)
        self.head = nn.Linear(16, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.emb(idx).mean(1)
        # The where hides the forward NaN of sqrt(e < 0), not its NaN gradient.
        return self.head(torch.where(e > 0, e.sqrt(), torch.zeros_like(e)))


def test_a_nan_reaching_only_a_sparse_gradient_is_found_and_advised_as_a_domain_error() -> None:
    """Embedding(sparse=True) + SparseAdam: the NaN gradient is in a sparse tensor only,
    every step is skipped. The per-step check reads a sparse gradient's values, so the
    forward sqrt is the origin (not 'dropped, training not affected'), and its advice
    says that a float32 sqrt of a negative number is no precision problem."""
    torch.manual_seed(0)
    model = SparseEmbedNet()
    opt_s = torch.optim.SparseAdam(list(model.emb.parameters()), lr=1e-2)
    opt_d = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, anomaly=True, every=5) as doctor:
        for _ in range(6):
            idx, y = torch.randint(0, 100, (8, 5), generator=g), torch.randint(0, 2, (8,),
                                                                                generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(idx), y)
            opt_s.zero_grad()
            opt_d.zero_grad()
            sc.scale(loss).backward()
            assert model.emb.weight.grad.is_sparse
            assert bool(model.emb.weight.grad.coalesce().values().isnan().any())
            sc.step(opt_s)
            sc.step(opt_d)
            sc.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.skipped_steps == list(range(6))
    assert not s.findings_of("nonfinite_discarded")
    (f,) = s.findings_of("nonfinite_forward")
    assert (f.severity, f.op, f.step) == ("error", "aten.sqrt", 0)
    assert f.data["dtype"] == "float32"
    assert f.advice.startswith("aten.sqrt made NaN from finite float32 inputs: the input was "
                               "outside the op's domain")
    assert "Keep this op in float32" not in f.advice


def test_a_closure_steps_gradients_are_checked_after_the_closure_made_them() -> None:
    """optimizer.step(closure): the closure computes the step's gradients inside the
    step, after its pre-hook; the NaN gradients of step 3 are flagged at step 3, not a
    step later (review 41b). bfloat16, no GradScaler: the update poisons the weights."""
    class LogGuarded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(8))
            self.a = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # The where keeps the forward finite; log's gradient at 0 is NaN through it.
            return self.a(torch.where(x > 0, torch.log(x * self.s), torch.zeros_like(x)))

    torch.manual_seed(0)
    model = LogGuarded()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    xs = torch.rand(6, 4, 8, generator=g) + 0.1
    xs[3, 0, 0] = 0.0
    ys = torch.randint(0, 3, (6, 4), generator=g)
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        for step in range(6):
            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(xs[step]).float(), ys[step])
                loss.backward()
                return loss
            opt.step(closure)
    assert not bool(model.s.isfinite().all())
    (un,) = [e for e in doctor.session.events if e.kind == "nonfinite_unlocated"]
    assert un.step == 3 and un.data["steps"][0] == 3


# -- cost ------------------------------------------------------------------------------
class _HostReads:
    """Counts host reads of tensor values made from anomaly mode's modules, independently
    of amp-doctor's own counter: any such read that forgot ``count_sync`` shows up."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "nonzero", "__float__", "__int__")

    def __init__(self) -> None:
        self.n = 0
        self._saved: dict[str, object] = {}

    def __enter__(self) -> _HostReads:
        import amp_doctor.anomaly.checkwindow
        import amp_doctor.anomaly.events
        import amp_doctor.anomaly.mode
        import amp_doctor.anomaly.oprecord
        import amp_doctor.anomaly.origins
        import amp_doctor.anomaly.stepcheck

        files = {m.__file__ for m in (amp_doctor.anomaly.mode, amp_doctor.anomaly.events,
                                      amp_doctor.anomaly.checkwindow, amp_doctor.anomaly.oprecord,
                                      amp_doctor.anomaly.origins, amp_doctor.anomaly.stepcheck)}
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def wrapper(t, *a, _orig=orig, **k):
                if sys._getframe(1).f_code.co_filename in files:
                    self.n += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)


def test_healthy_run_costs_one_host_read_per_recorded_step_counted_independently() -> None:
    torch.manual_seed(0)
    model = MLP()
    start = host_syncs()
    with _HostReads() as reads:
        with amp_doctor.watch(model, anomaly=True, every=5) as doctor:
            train(model, steps=23, scaler=True)
    assert doctor.session.recorded_steps == 5
    # Anomaly mode's own reads on a healthy run: none on any step (its flag rides in the
    # recorded step's copy), one at the close for the steps after the last recorded one;
    # and one more of the watch's, its end-of-run counts (every step's batch is checked).
    assert reads.n == 1
    assert host_syncs() - start <= doctor.session.recorded_steps + 2
    assert not [e for e in doctor.session.events if e.kind.startswith("nonfinite")]


def _gradient_reads_in_an_unrecorded_step(fused: bool, scaler: bool) -> tuple[int, list[int]]:
    """The norm ops of anomaly mode's per-step gradient check in one unrecorded step
    (torch.profiler), and the steps of the findings when a NaN batch comes at step 6."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    sc = torch.amp.GradScaler("cpu") if scaler else None
    dtype = torch.float16 if scaler else torch.bfloat16
    norms = -1
    with amp_doctor.watch(model, anomaly=True, every=10**6) as doctor:
        for i in range(9):
            x = torch.randn(8, 16)
            if i == 6:
                x[0, 0] = math.nan
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x).float().mean()
            opt.zero_grad()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                if sc is not None:
                    sc.scale(loss).backward()
                    sc.step(opt)
                    sc.update()
                else:
                    loss.backward()
                    opt.step()
            if i == 3:
                norms = sum(e.count for e in prof.key_averages()
                            if e.key in ("aten::linalg_vector_norm", "aten::_foreach_norm"))
    return norms, sorted({f.step for f in doctor.session.findings if f.step is not None})


def test_with_a_grad_scaler_the_per_step_check_takes_its_found_inf() -> None:
    # The scaler's unscale_ has checked every gradient the optimizer takes: reading them
    # all again (a norm per tensor on the CPU) cost 5% of a 646-parameter GPT's step.
    norms, steps = _gradient_reads_in_an_unrecorded_step(fused=False, scaler=True)
    assert norms == 0
    assert steps == [6]
    # A fused optimizer unscales inside its own step: the check reads them itself.
    norms, steps = _gradient_reads_in_an_unrecorded_step(fused=True, scaler=True)
    assert norms > 0
    assert steps == [6]
    # Without a scaler nothing has checked them: the norms are the check.
    norms, steps = _gradient_reads_in_an_unrecorded_step(fused=False, scaler=False)
    assert norms > 0
    assert steps == [6]


def test_a_healthy_run_searches_only_its_first_step() -> None:
    torch.manual_seed(0)
    model = MLP()
    on_stack: list[bool] = []
    with amp_doctor.watch(model, anomaly=True, every=3) as doctor:
        g = torch.Generator().manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sc = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for _ in range(7):
            x = torch.randn(8, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                on_stack.append(_get_current_dispatch_mode() is not None)
                out = model(x)
                on_stack[-1] = on_stack[-1] or _get_current_dispatch_mode() is not None
                loss = out.float().square().mean()
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    assert on_stack == [True] + [False] * 6
    assert not [e for e in doctor.session.events if e.kind.startswith("nonfinite")]


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_large_but_finite_gradients_and_weights_are_not_taken_for_an_inf(param_dtype) -> None:
    # A float32 2-norm of a 1e20 gradient is inf (its square is beyond float32's max):
    # the per-step check armed a search for a NaN that never was, and the report said
    # "NaN/Inf was seen in 3 step(s)". Weights of 1e20 are checked the same way.
    torch.manual_seed(0)
    big = 1e20
    # float64 weights are checked another way: their squares overflow float64 at 1e155.
    table = 1e160 if param_dtype == torch.float64 else big
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(param_dtype)
    model.register_parameter("table", nn.Parameter(torch.full((3,), table, dtype=param_dtype)))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = []
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.rand(4, 8, dtype=param_dtype))
            loss = out.to(torch.promote_types(param_dtype, torch.float32)).sum() * big
            loss.backward()
            grads.append(model[2].weight.grad.abs().max().item())
            opt.step()
            opt.zero_grad()
    assert all(math.isfinite(g) and g > big / 100 for g in grads)
    assert not [e for e in doctor.session.events if e.kind.startswith("nonfinite")]
    assert not [f for f in doctor.session.findings if f.kind.startswith("nonfinite")]


# -- numerics --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,scaler", [(torch.float16, True), (torch.bfloat16, False)])
def test_numerics_bit_identical_while_the_search_arms_and_disarms(dtype, scaler) -> None:
    """Dropout draws random numbers: a search that changed RNG use would show here."""
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(3)
        model = Net()
        if watched:
            with amp_doctor.watch(model, anomaly=True, every=3):
                losses = _loop(model, 10, _outliers_from(4), dtype=dtype, scaler=scaler)
        else:
            losses = _loop(model, 10, _outliers_from(4), dtype=dtype, scaler=scaler)
        return losses, [p.detach().clone() for p in model.parameters()]

    l0, p0 = run(False)
    l1, p1 = run(True)
    assert len(l0) == len(l1)
    for a, b in zip(l0, l1, strict=True):
        assert a == b or (math.isnan(a) and math.isnan(b))
    for a, b in zip(p0, p1, strict=True):
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(
            a.nan_to_num(), b.nan_to_num())


def test_compiled_model_with_dropout_trains_bit_identically() -> None:
    """Issue 13: under a dispatch mode torch.compile fell back to eager, whose dropout
    draws other random numbers. The search is on the stack at step 0: the compiled
    region must run compiled anyway."""
    torch._dynamo.reset()

    def run(watched: bool) -> list[float]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 4))
        compiled = torch.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sc = torch.amp.GradScaler("cpu")
        g = torch.Generator().manual_seed(1)
        losses = []

        def loop() -> None:
            for _ in range(4):
                x = torch.randn(8, 16, generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = compiled(x).float().square().mean()
                opt.zero_grad()
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
                losses.append(float(loss.detach()))

        if watched:
            with amp_doctor.watch(compiled, anomaly=True, every=1):
                loop()
        else:
            loop()
        return losses

    plain = run(False)
    watched = run(True)
    assert plain == watched


# -- leave the user's state alone ------------------------------------------------------
class UserMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _stack() -> list[object]:
    return [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]


def test_closing_inside_the_users_dispatch_mode_removes_only_ours() -> None:
    """Issue 14: close() popped the user's mode and left ours on the stack."""
    model = MLP()
    user = UserMode()
    doctor = amp_doctor.watch(model, anomaly=True, every=1)
    try:
        with user:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(8, 16)).float().sum().backward()
            # Step 0 is searched: ours went in at the root forward, below the user's mode.
            stack = _stack()
            assert len(stack) == 2 and stack[-1] is user
            doctor.close()
            assert _stack() == [user]
            assert _get_current_dispatch_mode() is user
            n = user.ops
            torch.ones(2) + 1
            assert user.ops > n  # still dispatching
        assert _stack() == []
        # The other order: the user's mode ends first, while ours is below it.
        user2 = UserMode()
        doctor = amp_doctor.watch(model, anomaly=True, every=1)
        with user2:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(8, 16)).float().sum().backward()
        assert len(_stack()) == 1 and _stack()[0] is not user2
        doctor.close()
        assert _stack() == []
    finally:
        doctor.close()
        while torch._C._len_torch_dispatch_stack():
            torch._C._pop_torch_dispatch_stack(None)


def test_users_mode_around_each_forward_exits_cleanly_while_we_search() -> None:
    """The search is entered inside the user's ``with`` (at the root forward); the user's
    ``__exit__`` pops the top of the stack, so ours must not be there."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu")
    x_fn = _outliers_from(0)
    users = []
    with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
        for i in range(3):
            user = UserMode()
            users.append(user)
            with user, torch.autocast("cpu", dtype=torch.float16):
                loss = model(x_fn(i)).float().mean()
            assert user not in _stack()
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    assert _stack() == []
    assert all(u.ops > 0 for u in users)
    assert [e for e in doctor.session.events if e.op == "aten.pow"]


def test_users_own_detect_anomaly_setting_survives_the_watch() -> None:
    model = MLP()
    before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    try:
        with amp_doctor.watch(model, anomaly=True, every=1):
            train(model, steps=1)
            torch.autograd.set_detect_anomaly(True, check_nan=False)
        assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == (True, False)
    finally:
        torch.autograd.set_detect_anomaly(*before)


def test_background_inference_thread_neither_crashes_nor_loses_steps() -> None:
    torch.manual_seed(0)
    model = MLP()
    stop = threading.Event()
    errors: list[BaseException] = []
    calls = [0]

    def infer() -> None:
        try:
            while not stop.is_set():
                with torch.no_grad():
                    model(torch.randn(4, 16))
                calls[0] += 1
        except BaseException as e:  # pragma: no cover - reported by the assert below
            errors.append(e)

    t = threading.Thread(target=infer, daemon=True)
    with _no_internal_warnings():
        t.start()
        try:
            with amp_doctor.watch(model, anomaly=True, every=1) as doctor:
                train(model, steps=30)
        finally:
            stop.set()
            t.join()
    s = doctor.session
    assert not errors and calls[0] > 0
    assert (s.steps, s.recorded_steps) == (30, 30)
    # The other thread's no_grad calls are its own (per-thread forward state): neither
    # recorded as training nor crashing on a step buffer closed meanwhile.
    assert {lay.name: lay.calls for lay in s.layers} == {"MLP": 30, "fc1": 30, "act": 30,
                                                         "fc2": 30}
    assert not [e for e in s.events if e.kind in ("internal_error",) or e.kind.startswith(
        "nonfinite")], s.events


class _no_internal_warnings:
    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)
        bad = [str(w.message) for w in self.caught if "amp-doctor" in str(w.message)]
        assert not bad, bad


def test_only_one_search_mode_and_nothing_left_after_an_exception() -> None:
    model = Net()
    with pytest.raises(RuntimeError, match="boom"):
        with amp_doctor.watch(model, anomaly=True, every=1):
            _loop(model, 2, _outliers_from(0))
            raise RuntimeError("boom")
    assert _stack() == [] and AnomalyMode._active is None


# -- the CLI's discovery path ------------------------------------------------------------
BF16_LOG_SCRIPT = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 64)

    def forward(self, x):
        return torch.log(torch.softmax(self.fc(x) * 400.0, dim=-1))

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for i in range(4):
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = -model(x).float()[:, 0].mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.skipif(not AMP_DOCTOR, reason="console script not installed")
def test_cli_names_the_discovered_root_model_as_the_origins_module(tmp_path: Path) -> None:
    """Issue 14: the API said ``in Net``, the CLI said ``outside the watched model``:
    the model is found inside its first call, before its own hooks exist."""
    script = tmp_path / "bf16_log.py"
    script.write_text(BF16_LOG_SCRIPT)
    out = tmp_path / "out"
    proc = subprocess.run([AMP_DOCTOR, "diagnose", "--anomaly", "--every", "1", "--logdir",
                           str(out), str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((out / "amp_doctor.json").read_text())
    ev = [e for e in data["events"] if e["kind"] == "nonfinite_forward"]
    assert ev, proc.stdout
    assert (ev[0]["module"], ev[0]["op"]) == ("Net", "aten.log")
    assert ev[0]["frame"].startswith(f"{script}:")
    # log(0) made -inf, not a value past the format's max.
    assert ev[0]["data"]["neg_inf"] and not ev[0]["data"]["pos_inf"]
    assert ev[0]["data"]["output_min"] == "-inf" and ev[0]["data"]["output_max"] != "inf"
    assert "outside the watched model" not in proc.stdout


class _LogHead(nn.Module):
    def __init__(self, log_inside: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.log_inside = log_inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(x) * 400.0
        return torch.log(torch.softmax(z, dim=-1)) if self.log_inside else z


@pytest.mark.parametrize("log_inside", [True, False])
def test_discovered_model_names_its_own_ops_and_not_the_loss_after_it(log_inside: bool) -> None:
    """Issue 14 (item 6), in process: a model found inside its first call (the CLI's
    discovery) owns the ops of that call, ``Net`` and not "outside the watched model";
    a log(softmax) in the loss, after the model returned, stays outside."""
    from amp_doctor.watch import Watch

    torch.manual_seed(0)
    model = _LogHead(log_inside)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    w = Watch(None, every=1, discover=True, anomaly=True, tensorboard=False).start()
    try:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(8, 16, generator=g))
                logp = out if log_inside else torch.log(torch.softmax(out, dim=-1))
            loss = -logp.float()[:, 0].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        s = w.close()
    ev = [e for e in s.events if e.kind == "nonfinite_forward"]
    assert ev and ev[0].op == "aten.log" and ev[0].step == 0
    assert ev[0].module == ("_LogHead" if log_inside else None)


class _Float64Big(nn.Module):
    """A float64 submodule whose finite outputs (about 1e40) are beyond float32's max."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 64)
        self.edge = nn.Identity()
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.edge(self.l1(x).double() * 1e40)
        return self.head((h / h.detach().abs().amax(-1, keepdim=True)).float())


def test_finite_float64_values_beyond_float32s_max_are_not_taken_for_inf() -> None:
    # They were staged (histogram) and summarised (anomaly mode) in float32: inf there,
    # so the table said "absmax inf, inf/NaN out 4/0" and anomaly mode named an op.
    torch.manual_seed(0)
    model = _Float64Big()
    losses = []
    with amp_doctor.watch(model, every=1, anomaly=True) as doctor:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for i in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    s = doctor.session
    assert not [e for e in s.events if e.kind.startswith("nonfinite")]
    assert not [f for f in s.findings if f.severity in ("error", "warning")]
    edge = next(lay for lay in s.layers if lay.name == "edge")
    assert edge.nonfinite_steps == 0 and 1e38 < edge.absmax < 1e42
