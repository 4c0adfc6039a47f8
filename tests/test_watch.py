"""The foundation: per-layer recording, dtypes, stats, sampling, numerics, cleanup."""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import math
import os
import socket
import subprocess
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import amp_doctor
from amp_doctor import Session
from amp_doctor.errors import UsageError
from amp_doctor.runfiles import LOCK_NAME
from amp_doctor.steps.scaler import patches_installed
from tests.helpers import MLP, train


def _hooks_of(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


def test_dtypes_and_activation_stats_per_layer() -> None:
    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=3)
    s = doctor.session
    assert s.amp.device_type == "cpu" and s.amp.dtype == "float16" and s.amp.scaler
    assert s.steps == 3 and s.recorded_steps == 3
    fc1 = s.layer("fc1")
    assert fc1.type == "Linear"
    assert fc1.input_dtypes == ["float32"] and fc1.output_dtypes == ["float16"]
    assert fc1.param_dtypes == ["float32"]
    assert fc1.ran_low_precision and not fc1.what_if
    # ReLU of N(0,1)-ish pre-activations: about half the values are exactly zero.
    assert 0.3 < s.layer("act").zero_frac < 0.7
    assert 0 < fc1.absmax < 10 and fc1.headroom > 12
    assert fc1.overflow_frac == 0 and fc1.nonfinite_steps == 0
    assert fc1.grad_absmax is not None and fc1.param_grad_absmax is not None
    assert s.findings == []


def test_overflow_in_fp16_layer_is_an_error_finding() -> None:
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.fc1.weight.mul_(50000.0)  # |fc1(x)| ~ 1e5: beyond 65504 in fp16
    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=2)
    lay = doctor.session.layer("fc1")
    assert lay.overflow_frac > 0.01 and lay.nonfinite_steps == 2
    kinds = {(f.kind, f.module, f.severity) for f in doctor.session.findings}
    assert ("activation_overflow", "fc1", "error") in kinds


def test_what_if_for_layers_that_stayed_in_float32() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.big = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            with torch.autocast("cpu", enabled=False):
                return self.big(h.float())

    model = Model()
    with torch.no_grad():
        model.big.weight.fill_(1e5)
        model.big.bias.zero_()
    x = torch.ones(2, 4)
    with amp_doctor.watch(model, every=1) as doctor:
        with torch.autocast("cpu", dtype=torch.float16):
            model(x).sum().backward()
        doctor.step()
    big = doctor.session.layer("big")
    assert big.output_dtypes == ["float32"] and big.what_if and not big.ran_low_precision
    assert big.overflow_frac == 1.0  # every value would overflow if cast to float16
    assert math.isfinite(big.absmax) and big.absmax > 65504
    assert not doctor.session.layer("fc").what_if


def test_underflow_fraction_counts_nonzero_values_below_smallest_normal() -> None:
    class Tiny(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1e-6  # 1e-6 < 2**-14: subnormal in float16

    model = nn.Sequential(nn.Linear(4, 8), Tiny())
    with amp_doctor.watch(model, every=1) as doctor:
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.randn(16, 4))
        doctor.step()
    tiny = doctor.session.layer("1")
    assert tiny.output_dtypes == ["float16"]
    assert tiny.underflow_frac > 0.9
    f = [f for f in doctor.session.findings if f.kind == "activation_underflow"]
    assert f and f[0].module == "1" and "%" in f[0].message


def test_scaled_and_unscaled_gradient_views() -> None:
    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=1)
    rec = doctor.session.history[0]
    g = rec.layers["fc2"].grad
    gu = rec.layers["fc2"].grad_unscaled
    assert g is not None and gu is not None
    assert rec.scale == 65536.0
    assert gu.absmax == pytest.approx(g.absmax / 65536.0)
    assert gu.headroom == pytest.approx(g.headroom + 16)


def test_gradient_underflow_without_scaler_is_found() -> None:
    torch.manual_seed(0)
    model = MLP()

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 16), torch.randint(0, 4, (8,))

    class Shrink(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1e-4

    net = nn.Sequential(model, Shrink())
    with amp_doctor.watch(net, every=1) as doctor:
        train(net, steps=2, scaler=False, batch=batch)
    # d(loss)/d(fc2 out) is ~1e-2 * 1e-4 = 1e-6 < 2**-14 in float16.
    lay = doctor.session.layer("0.fc2")
    assert lay.grad_underflow_frac is not None and lay.grad_underflow_frac > 0.5
    assert any(f.kind == "missing_scaler" for f in doctor.session.findings)


def test_autocast_inactive() -> None:
    model = MLP()
    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=2, scaler=False, autocast=False)
    kinds = [f.kind for f in doctor.session.findings]
    assert kinds == ["autocast_inactive"]
    assert doctor.session.layer("fc1").what_if


def test_autocast_on_with_a_float64_model_is_not_healthy() -> None:
    # CPU and CUDA autocast never cast float64: every layer ran wide under float16 autocast.
    model = MLP().double()
    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, 16, dtype=torch.float64, generator=g), torch.tensor([0, 1, 2, 3] * 2)

    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=2, batch=batch)
    (f,) = doctor.session.findings
    assert f.kind == "autocast_inactive" and f.severity == "warning"
    assert f.data["autocast_on"] and f.data["output_dtypes"] == ["float64"]
    assert "Autocast (float16) was on" in f.message and "float64" in f.message
    assert "model.float()" in f.advice


def test_autocast_on_with_no_op_it_lowers_is_not_healthy() -> None:
    # LayerNorm and softmax stay float32 under CPU autocast: nothing ran low.
    class Norms(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.ln(x), -1)[:, :4]

    model = Norms()
    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=2, dtype=torch.bfloat16, scaler=False)
    (f,) = doctor.session.findings
    assert f.kind == "autocast_inactive"
    assert f.data["output_dtypes"] == ["float32"]
    assert "Autocast (bfloat16) was on" in f.message and "stays float32" in f.message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("every", [1, 3])
def test_bit_identical_numerics(dtype: torch.dtype, every: int) -> None:
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(123)
        model = MLP()
        if watched:
            with amp_doctor.watch(model, every=every):
                losses = train(model, steps=5, dtype=dtype, seed=7)
        else:
            losses = train(model, steps=5, dtype=dtype, seed=7)
        return losses, [p.detach().clone() for p in model.parameters()]

    l0, p0 = run(False)
    l1, p1 = run(True)
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))


def test_everything_removed_on_exit_and_on_exception() -> None:
    import torch.nn.utils as nnu
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    originals = (torch.amp.GradScaler.step, torch.amp.GradScaler.update, nnu.clip_grad_norm_,
                 torch.autograd.backward, warnings.warn)
    model = MLP()
    with amp_doctor.watch(model, every=1):
        assert _hooks_of(model) > 0 and patches_installed()
        train(model, steps=1)
    assert _hooks_of(model) == 0 and not patches_installed()
    assert not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks
    with pytest.raises(RuntimeError, match="boom"):
        with amp_doctor.watch(model, every=1):
            train(model, steps=1)
            raise RuntimeError("boom")
    assert _hooks_of(model) == 0 and not patches_installed()
    with pytest.raises(KeyboardInterrupt):
        with amp_doctor.watch(model, every=1) as d:
            raise KeyboardInterrupt
    assert d.session.run.outcome == "interrupted"
    assert (torch.amp.GradScaler.step, torch.amp.GradScaler.update, nnu.clip_grad_norm_,
            torch.autograd.backward, warnings.warn) == originals


def test_a_warning_from_a_patched_function_names_the_users_line() -> None:
    # The scaler skips the first optimizer step (calibration from 2**40), so the scheduler
    # stepped before the optimizer ever did: torch warns, with stacklevel=2, at the line
    # that called scheduler.step(). Under a watch it named amp-doctor's patching.py: the
    # wrapper around LRScheduler.step was the frame it counted.
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(100 * torch.randn(8, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            sched.step()
            # Any stacklevel names what it names without amp-doctor.
            here = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            warnings.warn("zero", UserWarning, stacklevel=0)
            warnings.warn("one", UserWarning, stacklevel=1)
            warnings.warn("deep", UserWarning, stacklevel=10_000)
    assert doctor.session.scaler is not None and doctor.session.scaler.skipped_steps == [0]
    sched_w = [w for w in said if "lr_scheduler.step()" in str(w.message)]
    assert len(sched_w) == 1
    assert (sched_w[0].filename, sched_w[0].lineno) == (__file__, line)
    by = {str(w.message): w for w in said}
    assert (by["zero"].filename, by["zero"].lineno) == (__file__, here)
    assert (by["one"].filename, by["one"].lineno) == (__file__, here + 1)
    assert by["deep"].filename == "sys"  # python's own name for beyond the stack


def test_a_watch_into_a_folder_that_holds_a_run_says_so_at_the_users_line(
        tmp_path: Path) -> None:
    # The README's quickstart run twice mixed both runs' TensorBoard events into one run
    # without a word; the CLI said it, watch() did not (review 38).
    for _ in range(2):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with amp_doctor.watch(MLP(), every=1, logdir=tmp_path) as doctor:
                train(doctor.models[""], steps=1)
    (w,) = [w for w in said if "already holds a run" in str(w.message)]
    assert w.category is RuntimeWarning and w.filename == __file__


def test_one_run_at_a_time_in_a_logdir(tmp_path: Path) -> None:
    # Two runs writing into one logdir mixed their TensorBoard events and overwrote each
    # other's reports without a word; the second is now refused, and the logdir is free
    # again once the first ends, also by an exception or Ctrl-C.
    lock = tmp_path / LOCK_NAME
    first = amp_doctor.watch(MLP(), every=1, logdir=tmp_path, tensorboard=False)
    assert lock.read_text().split()[0] == str(os.getpid())
    with pytest.raises(UsageError, match=r"another watch in this process is writing into "
                       r".*still open: close it first \(doctor.close\(\).*pass another logdir"):
        amp_doctor.watch(MLP(), every=1, logdir=tmp_path, tensorboard=False)
    assert lock.exists()  # the refused watch took nothing away from the first
    first.close()
    assert not lock.exists()
    for ending in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(ending)):
            with amp_doctor.watch(MLP(), every=1, logdir=tmp_path, tensorboard=False):
                assert lock.exists()
                raise ending
        assert not lock.exists()
    # A lock left by a run that was killed (kill -9) is taken over.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(f"{dead.pid} {socket.gethostname()}\n")
    with amp_doctor.watch(MLP(), every=1, logdir=tmp_path, tensorboard=False):
        assert lock.read_text().split()[0] == str(os.getpid())
    assert not lock.exists()


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").exists(),
                    reason="Linux: boot ids and flock")
def test_a_lock_is_judged_by_its_flock_not_its_process_id(tmp_path: Path) -> None:
    # A run killed with kill -9 (out of memory, a container stopped) leaves its lock. Its
    # process id may be reused by then (a restarted container numbers its processes from
    # 1 again), and a new container has another host name: both used to refuse the logdir
    # until the file was removed by hand. A run holds a flock on its lock while it runs,
    # which the kernel drops when it ends: no flock, stale, on this machine.
    lock = tmp_path / LOCK_NAME
    here, boot = socket.gethostname(), _boot_id()

    def takes(text: str) -> bool:
        lock.write_text(text)
        try:
            with amp_doctor.watch(MLP(), every=1, logdir=tmp_path, tensorboard=False):
                assert lock.read_text().split() == [str(os.getpid()), here, boot]
        except UsageError as e:
            assert "another amp-doctor run (process" in str(e)
            return False
        assert not lock.exists()
        return True

    alive = os.getppid()  # a live process that is no amp-doctor run
    assert takes(f"{alive} {here} {boot}\n")  # a reused process id: taken over
    assert takes(f"7 0123456789ab {boot}\n")  # another container on this machine
    # What a flock cannot speak for is judged by its process id, as before.
    assert not takes(f"{alive} {here}\n")  # an older amp-doctor's lock: alive
    assert not takes(f"{alive} other-machine 00000000-0000-0000-0000-000000000000\n")
    # A live run holds the flock: refused, whatever the file says.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        lock.write_text(f"{holder.pid} {here} {boot}\n")
        with pytest.raises(UsageError, match=f"another amp-doctor run \\(process {holder.pid}\\)"):
            amp_doctor.watch(MLP(), every=1, logdir=tmp_path, tensorboard=False)
    finally:
        holder.kill()
        holder.wait()
    assert takes(f"{holder.pid} {here} {boot}\n")  # its flock went with it


def test_plain_handle_with_close() -> None:
    model = MLP()
    doctor = amp_doctor.watch(model, every=1)
    train(model, steps=2)
    session = doctor.close()
    assert session.steps == 2 and _hooks_of(model) == 0
    assert doctor.close() is session  # idempotent


def test_overlapping_watches_restore_in_any_order() -> None:
    a, b = MLP(), MLP()
    wa = amp_doctor.watch(a, every=1)
    wb = amp_doctor.watch(b, every=1)
    train(a, steps=1)
    wa.close()
    assert patches_installed()
    train(b, steps=1)
    wb.close()
    assert not patches_installed()
    assert wa.session.steps == 1 and wb.session.steps == 1


def test_finished_watch_holds_no_activation() -> None:
    model = MLP()
    captured: list[weakref.ref[torch.Tensor]] = []
    model.fc1.register_forward_hook(lambda m, i, o: captured.append(weakref.ref(o)))
    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=2)
    gc.collect()
    assert captured and all(r() is None for r in captured)
    assert doctor.session.recorded_steps == 2


def test_sampling_every_n_and_max_steps() -> None:
    model = MLP()
    with amp_doctor.watch(model, every=3) as doctor:
        train(model, steps=10)
    s = doctor.session
    assert s.steps == 10 and s.recorded_steps == 4  # steps 0, 3, 6, 9
    assert [r.step for r in s.history] == [0, 3, 6, 9]
    with amp_doctor.watch(model, every=1, max_steps=2) as doctor:
        losses = train(model, steps=5)
    assert doctor.session.recorded_steps == 2 and doctor.session.steps == 5
    assert len(losses) == 5


def test_history_is_bounded_and_spans_the_run() -> None:
    from amp_doctor.records import StepRecord
    from amp_doctor.steps.history import History

    h = History(limit=16)
    for i in range(1000):
        h.add(StepRecord(step=i, loss=None, scale=None, skipped=(i == 777), layers={}))
    steps = [r.step for r in h.records]
    assert len(steps) <= 16 and steps[0] == 0 and steps[-1] >= 900 and 777 in steps


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: Any


class Odd(nn.Module):
    """Every odd output shape a user's model may return."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.nop = nn.Identity()

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        h = self.lin(h)  # the same module twice in one step
        return {
            "tuple": (h, None, 3),
            "dc": Out(h * 2, [torch.arange(3), torch.tensor([True, False])]),
            "empty": torch.empty(0, 4),
            "nested": [[{"deep": h + 1}]],
            "none": self.nop(None),
            "int": 7,
        }


def test_odd_outputs_and_modules_never_crash() -> None:
    model = Odd()
    with amp_doctor.watch(model, every=1) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(3, 4))
            (out["dc"].logits.float().sum() + out["nested"][0][0]["deep"].float().sum()).backward()
            doctor.step()
    s = doctor.session
    assert s.layer("lin").calls == 4 and s.layer("lin").output_dtypes == ["bfloat16"]
    assert s.layer("Odd").recorded_steps == 2
    assert "int64" in s.layer("Odd").output_dtypes and "bool" in s.layer("Odd").output_dtypes
    nop = s.layer("nop")
    assert nop.calls == 2 and nop.output_dtypes == []
    # No parameters at all, and an empty container that passes its input through.
    net = nn.Sequential(nn.ReLU(), nn.Sequential())
    x = torch.randn(2)
    with amp_doctor.watch(net) as d2:
        out = net(x)
    assert torch.equal(out, torch.relu(x))
    s2 = d2.session
    assert s2.steps == 0  # no optimizer step, no backward: no step boundary
    # The watched model is the one that ran: each of its modules was seen once.
    assert {lay.name: lay.calls for lay in s2.layers} == {"0": 1, "1": 1, "Sequential": 1}
    assert all(lay.output_dtypes == ["float32"] for lay in s2.layers)


def test_session_json_round_trip(tmp_path) -> None:
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.fc1.weight.mul_(50000.0)
    with amp_doctor.watch(model, every=1, logdir=tmp_path, tensorboard=False) as doctor:
        train(model, steps=3)
    path = tmp_path / "amp_doctor.json"
    assert path.exists()
    loaded = Session.load(path)
    # NaN != NaN, so compare the serialised forms, and the NaN-free parts directly.
    assert loaded.to_json() == doctor.session.to_json()
    assert loaded.layers == doctor.session.layers or any(
        math.isnan(x.min) for x in loaded.layers)
    assert loaded.findings == doctor.session.findings
    assert loaded.scaler == doctor.session.scaler
    text = path.read_text()
    import json

    def no_constants(c: str) -> None:
        raise AssertionError(f"non-strict JSON constant {c}")

    data = json.loads(text, parse_constant=no_constants)
    for key in ("version", "amp", "steps", "layers", "scaler", "findings"):
        assert key in data
    assert set(data["amp"]) >= {"device_type", "dtype", "scaler"}
    lay = data["layers"][0]
    for key in ("name", "type", "input_dtypes", "output_dtypes", "param_dtypes", "absmax",
                "overflow_frac", "underflow_frac", "grad_underflow_frac", "nonfinite_steps"):
        assert key in lay
    assert set(data["scaler"]) >= {"scale", "backoff_steps", "growth_steps", "skipped_steps"}
    f = data["findings"][0]
    assert set(f) >= {"kind", "severity", "module", "op", "step", "message", "advice"}


def test_bad_arguments_get_clear_errors() -> None:
    with pytest.raises(amp_doctor.AmpDoctorError, match="every must be a positive integer"):
        amp_doctor.watch(MLP(), every=0)
    with pytest.raises(amp_doctor.AmpDoctorError, match="not a torch.nn.Module"):
        amp_doctor.watch("model")  # type: ignore[arg-type]
    assert not patches_installed()


def test_a_run_that_recorded_nothing_is_not_called_healthy() -> None:
    model = MLP()
    with amp_doctor.watch(model) as doctor:
        pass
    text = doctor.report()
    assert "nothing was recorded" in text and "looks healthy" not in text
    with amp_doctor.watch(model, every=1) as doctor:
        train(model, steps=2)
    assert "AMP looks healthy" in doctor.report()


def test_watching_a_copy_of_the_trained_model_says_so_and_nothing_it_cannot_know() -> None:
    # The loop trains a deepcopy: no hook of the watched model runs. "Autocast was not
    # active" and "no step ended" would be guesses; one finding names the cause.
    torch.manual_seed(0)
    watched = MLP()
    trained = copy.deepcopy(watched)
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    with amp_doctor.watch(watched, every=1) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = trained(torch.randn(4, 16)).float().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert [f.kind for f in s.findings] == ["model_not_run"]
    f = s.findings[0]
    assert f.severity == "warning" and f.data["backward"] is True
    assert "the loop trains another module than the one watched" in f.message
    # Whether torch.compile also ran earlier in this process (other tests) decides
    # whether the reused-graph cause is named beside it.
    assert f.data["compiled"] == ("torch.compile reused" in f.message)
    assert "copy" in f.advice


def test_a_submodule_replaced_after_watch_is_watched_in_its_place() -> None:
    # A task head replaced after watch() (linear probe, then fine-tune). Before: the new
    # head had no hooks, and its overflow was blamed on the whole model.
    from torch.nn.modules.module import _global_module_registration_hooks

    registration_hooks = len(_global_module_registration_hooks)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        model[2] = nn.Sequential(nn.Linear(16, 4), nn.Tanh())  # before the first step
        opt.add_param_group({"params": model[2].parameters()})
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    s = doctor.session
    assert {lay.name: (lay.type, lay.calls) for lay in s.layers if lay.name.startswith("2")} \
        == {"2": ("Sequential", 3), "2.0": ("Linear", 3), "2.1": ("Tanh", 3)}
    assert s.layer("2.0").param_dtypes == ["float32"]
    # Nothing left behind: no hook on the new head, the global hook gone.
    assert len(_global_module_registration_hooks) == registration_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
