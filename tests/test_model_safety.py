"""Watching a model never breaks or alters it: save, copy, EMA, round trips, odd tensors.

Every test runs the real thing (a real torch.save to disk, a real deepcopy, a real
AveragedModel, real vmap) and compares losses bit for bit with an unwatched run.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import json
import subprocess
import sys
import warnings
import weakref
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import amp_doctor
from amp_doctor.hooks.probes import Unwatched
from amp_doctor.jsoncodec import to_jsonable
from tests.helpers import MLP, train

STEPS = 6


def _module_hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for m in model.modules())


def _tensor_hook_count(model: nn.Module) -> int:
    return sum(len(p._backward_hooks or {}) for p in model.parameters())


def _loop(
    model: nn.Module,
    watched: bool,
    each_step: Callable[[int, nn.Module], None] | None = None,
    steps: int = STEPS,
    every: int = 1,
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]] | None = None,
    around_step: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    **watch_kw: Any,
) -> tuple[list[float], Any]:
    """The usual AMP loop (float16 autocast + GradScaler on CPU); returns losses and session.
    ``around_step``: entered around each whole step (forward, backward, update)."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    w = amp_doctor.watch(model, every=every, **watch_kw) if watched else None
    losses = []
    try:
        for i in range(steps):
            if make_batch is not None:
                x, y = make_batch(g)
            else:
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with around_step():
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            losses.append(float(loss.detach()))
            if each_step is not None:
                each_step(i, model)
    finally:
        session = w.close() if w is not None else None
    return losses, session


def _fresh() -> MLP:
    torch.manual_seed(0)
    return MLP()


# -- torch.save / deepcopy / EMA --------------------------------------------------


def test_whole_model_torch_save_during_watch_loads_an_unwatched_copy(tmp_path: Path) -> None:
    saved: list[Path] = []

    def save(i: int, model: nn.Module) -> None:
        path = tmp_path / f"model{i}.pt"
        torch.save(model, path)  # pytorch/examples word_language_model does this
        saved.append(path)

    plain, _ = _loop(_fresh(), watched=False)
    model = _fresh()
    watched, session = _loop(model, watched=True, each_step=save, logdir=tmp_path / "logs")
    assert watched == plain
    assert session.recorded_steps == STEPS
    assert _module_hook_count(model) == 0

    loaded = torch.load(saved[-1], weights_only=False)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    # The checkpoint holds none of amp-doctor's hooks (review 42a: it held inert ones,
    # and loading it needed amp_doctor installed).
    assert _module_hook_count(loaded) == 0
    assert torch.equal(loaded(x), model(x))
    with zipfile.ZipFile(saved[-1]) as z:
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"amp_doctor" not in pickled
    # Loaded where amp_doctor cannot be imported (an inference box): tests/ defines MLP.
    assert _load_without_amp_doctor(saved[-1], tmp_path) == ["MLP", "0"]


def _load_without_amp_doctor(path: Path, tmp_path: Path) -> list[str]:
    """torch.load ``path`` in a python where importing amp_doctor fails; its class name
    and how many forward (pre-)hooks its modules hold."""
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "amp_doctor.py").write_text("raise ImportError('amp_doctor is not here')\n")
    r = subprocess.run(
        [sys.executable, "-c", "import sys, torch; sys.path.insert(0, sys.argv[2]); "
         "sys.path.insert(0, sys.argv[3]); m = torch.load(sys.argv[1], weights_only=False); "
         "print(type(m).__name__, sum(len(x._forward_hooks) + len(x._forward_pre_hooks) "
         "for x in m.modules()))",
         str(path), str(Path(__file__).resolve().parents[1]), str(blocker)],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_a_recurrent_models_checkpoint_loads_without_amp_doctor(tmp_path: Path) -> None:
    # nn.LSTM's RNNBase has its own __getstate__, which does not call nn.Module's: its
    # checkpoint still named amp_doctor's hooks (review 42b).
    torch.manual_seed(0)
    model = nn.LSTM(8, 16, batch_first=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 5, 8))[0].float().square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert _module_hook_count(model) > 0
        torch.save(model, tmp_path / "lstm.pt")
    assert doctor.session.recorded_steps == 2
    assert _load_without_amp_doctor(tmp_path / "lstm.pt", tmp_path) == ["LSTM", "0"]


class OwnState(nn.Module):
    """A module whose own __getstate__ does not call nn.Module's, and returns its
    __dict__ itself, not a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def __getstate__(self) -> dict:
        return self.__dict__


def test_a_copy_of_a_module_with_its_own_getstate_is_unwatched_and_the_original_still_watched(
        ) -> None:
    torch.manual_seed(0)
    model = OwnState()
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        before = _module_hook_count(model)
        twin = copy.deepcopy(model)
        # Its own __getstate__ returns its __dict__ itself: the original keeps its hooks.
        assert _module_hook_count(model) == before > 0
        assert _module_hook_count(twin) == 0

        class Later(OwnState):
            """Defined once the watch runs, as a script's classes are under the CLI
            (review 42c: its copies and checkpoints carried the hooks)."""

            def __getstate__(self) -> dict:
                return dict(self.__dict__)

        class Mixin:
            def __getstate__(self) -> dict:
                return dict(self.__dict__)

        class Mixed(Mixin, OwnState):  # a __getstate__ that is none of nn.Module's
            pass

        later, mixed = Later(), Mixed()
        with amp_doctor.watch([later, mixed], every=1, tensorboard=False):
            assert _module_hook_count(later) > 0 and _module_hook_count(mixed) > 0
            # (local classes do not pickle; a deep copy takes the same __getstate__)
            assert _module_hook_count(copy.deepcopy(later)) == 0
            assert _module_hook_count(copy.deepcopy(mixed)) == 0
            # A __getstate__ set on a class after it was made is not patched: its
            # copy's hooks are inert ones, which remove themselves on first use.
            Later.__getstate__ = lambda self: dict(self.__dict__)  # type: ignore[method-assign]
            copied = copy.deepcopy(later)
        hooks = [h for m in copied.modules() for h in (*m._forward_pre_hooks.values(),
                                                       *m._forward_hooks.values())]
        assert hooks and all(isinstance(h, Unwatched) for h in hooks)
        copied(torch.randn(2, 16))
        assert _module_hook_count(copied) == 0
        train(model, steps=2)
    assert doctor.session.recorded_steps == 2
    assert {lay.name for lay in doctor.session.layers} >= {"fc"}


def test_deepcopy_during_watch_is_an_unwatched_copy() -> None:
    copies: list[nn.Module] = []

    def snapshot(i: int, model: nn.Module) -> None:
        copies.append(copy.deepcopy(model))
        # The copy runs, and is not watched: calling it records nothing.
        copies[-1](torch.randn(2, 16))

    plain, _ = _loop(_fresh(), watched=False)
    model = _fresh()
    watched, session = _loop(model, watched=True, each_step=snapshot)
    assert watched == plain
    assert all(_module_hook_count(c) == 0 for c in copies)
    # Only the watched model's calls were counted (one per step), not the copies'.
    by_name = {lay.name: lay for lay in session.layers}
    assert by_name["fc1"].calls == STEPS
    for c, p in zip(copies[-1].parameters(), model.parameters(), strict=True):
        assert torch.equal(c, p)


def test_averaged_model_made_before_and_during_training() -> None:
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor]]:
        model = _fresh()
        ema_before = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        holder: dict[str, AveragedModel] = {}

        def update(i: int, m: nn.Module) -> None:
            if i == 2:  # an EMA built after training started (deep-copies the watched model)
                holder["late"] = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
            ema_before.update_parameters(m)
            if "late" in holder:
                holder["late"].update_parameters(m)
                holder["late"](torch.ones(2, 16))  # evaluating the EMA is normal too

        losses, _ = _loop(model, watched=watched, each_step=update)
        assert _module_hook_count(holder["late"]) == 0
        return (losses, [p.detach().clone() for p in ema_before.parameters()],
                [p.detach().clone() for p in holder["late"].parameters()])

    plain, watched = run(False), run(True)
    assert watched[0] == plain[0]
    for a, b in zip(plain[1] + plain[2], watched[1] + watched[2], strict=True):
        assert torch.equal(a, b)


def test_state_dict_round_trip_to_and_train_eval_during_watch() -> None:
    def fiddle(i: int, model: nn.Module) -> None:
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(sd)
        model.eval()
        with torch.no_grad():
            model(torch.ones(2, 16))
        model.train()
        model.to(torch.float64).to(torch.float32)
        model.to("cpu")

    plain, _ = _loop(_fresh(), watched=False, each_step=fiddle)
    model = _fresh()
    watched, session = _loop(model, watched=True, each_step=fiddle)
    assert watched == plain
    assert session.steps == STEPS
    assert {lay.name for lay in session.layers} >= {"fc1", "fc2"}
    assert _module_hook_count(model) == 0


def test_nothing_reachable_from_the_watched_model_holds_the_watch(tmp_path: Path) -> None:
    """Hooks hold a weak reference only: pickling sees no writer, lock or buffer."""
    import pickle

    model = _fresh()
    with amp_doctor.watch(model, every=1, logdir=tmp_path) as w:
        _loop(model, watched=False, steps=2)
        blob = pickle.dumps(model)
        assert b"amp_doctor.watch" not in blob and b"SummaryWriter" not in blob
        assert w.session.recorded_steps == 2


# -- tensor hooks: nothing piles up, nothing kept alive ---------------------------


class ReturnsParam(nn.Module):
    """A learned positional table returned as is (``return self.pos``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(8, 16))
        self.ident = nn.Identity()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.ident(self.pos))


def test_module_returning_its_parameter_gets_no_growing_hooks() -> None:
    counts: list[int] = []

    def count(i: int, model: nn.Module) -> None:
        counts.append(_tensor_hook_count(model))

    torch.manual_seed(0)
    plain, _ = _loop(ReturnsParam(), watched=False, steps=40)
    torch.manual_seed(0)
    model = ReturnsParam()
    watched, session = _loop(model, watched=True, each_step=count, steps=40)
    assert watched == plain
    # At most the current step's hook, removed at the next step boundary.
    assert max(counts) <= 1
    assert _tensor_hook_count(model) == 0
    assert _module_hook_count(model) == 0
    by_name = {lay.name: lay for lay in session.layers}
    assert by_name["ident"].calls == 40


def test_returned_parameter_with_hand_written_update_and_no_boundary() -> None:
    """No optimizer, no scaler (word_language_model's loop): still one hook at most."""

    def run(watched: bool) -> tuple[list[float], list[int], ReturnsParam]:
        torch.manual_seed(0)
        model = ReturnsParam()
        w = amp_doctor.watch(model, every=1) if watched else None
        losses, counts = [], []
        g = torch.Generator().manual_seed(0)
        for _ in range(30):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
            losses.append(float(loss.detach()))
            counts.append(_tensor_hook_count(model))
        if w is not None:
            w.close()
        return losses, counts, model

    plain, _, _ = run(False)
    watched, counts, model = run(True)
    assert watched == plain
    assert max(counts) == 1
    assert _tensor_hook_count(model) == 0


def test_retain_graph_without_step_keeps_no_activation_alive() -> None:
    model = _fresh()
    refs: list[weakref.ref[torch.Tensor]] = []

    def keep_ref(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        refs.append(weakref.ref(out))

    h = model.fc1.register_forward_hook(keep_ref)
    try:
        with amp_doctor.watch(model, every=1):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            loss.backward(retain_graph=True)
            del loss
            gc.collect()
            assert refs and refs[0]() is None  # no optimizer step came, still freed
    finally:
        h.remove()


# -- odd tensors: skipped, counted once, the run goes on ------------------------


class OddOutputs(nn.Module):
    """Layers whose outputs amp-doctor cannot (or need not) summarise."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.table = torch.randn(4, 4)
        with torch.inference_mode():
            self.cached = torch.randn(8, 4)  # e.g. a rotary cache made under inference_mode
        self.sparse = _Fn(lambda x: x.detach().to_sparse())
        self.f8 = _Fn(lambda x: x.detach().to(torch.float8_e4m3fn))
        self.meta = _Fn(lambda x: torch.empty(3, device="meta"))
        self.cplx = _Fn(lambda x: torch.complex(x.detach(), x.detach()))
        self.ints = _Fn(lambda x: x.detach().long())
        self.empty = _Fn(lambda x: x[:0])
        self.inf_cache = _Fn(lambda x: self.cached)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        side = [self.sparse(y), self.f8(y), self.meta(y), self.cplx(y.float()), self.ints(y),
                self.empty(y), self.inf_cache(y)]
        assert side[0].is_sparse and side[2].is_meta
        return y + side[6].to(y.dtype) * 0


class _Fn(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(x)


def test_odd_output_tensors_are_skipped_and_noted_once() -> None:
    torch.manual_seed(0)
    plain, _ = _loop(OddOutputs(), watched=False)
    torch.manual_seed(0)
    model = OddOutputs()
    watched, session = _loop(model, watched=True)
    assert watched == plain
    skipped = {(e.module, e.data["tensor"]): e.data["count"]
               for e in session.events if e.kind == "unsummarized"}
    assert skipped == {("sparse", "sparse"): STEPS, ("f8", "float8"): STEPS,
                       ("meta", "meta"): STEPS}
    assert len([e for e in session.events if e.kind == "unsummarized"]) == 3
    by_name = {lay.name: lay for lay in session.layers}
    # The inference-mode tensor is an ordinary float tensor: it is summarised.
    assert by_name["inf_cache"].recorded_steps == STEPS
    assert by_name["inf_cache"].absmax > 0
    assert by_name["cplx"].output_dtypes == ["complex64"]
    assert by_name["ints"].output_dtypes == ["int64"]


def test_transformer_encoder_fast_path_nested_tensors() -> None:
    """Frozen encoder in eval with a padding mask takes the nested-tensor fast path."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
            self.head = nn.Linear(16, 4)
            self.enc.requires_grad_(False)
            self.enc.eval()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
            mask[:, -3:] = True
            # The CPU fast path refuses float16 inputs: the encoder runs in float32.
            with torch.autocast("cpu", enabled=False):
                h = self.enc(x.float(), src_key_padding_mask=mask)
            return self.head(h.mean(1))

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(4, 6, 16, generator=g), torch.randint(0, 4, (4,), generator=g)

    def run(watched: bool) -> tuple[list[float], Any]:
        torch.manual_seed(0)
        return _loop(Net(), watched=watched, make_batch=batch)

    plain, _ = run(False)
    watched, session = run(True)
    assert watched == plain
    kinds = {e.data["tensor"] for e in session.events if e.kind == "unsummarized"}
    assert kinds == {"nested"}
    assert {lay.name for lay in session.layers} >= {"head"}


def test_vmap_per_sample_grads_over_the_watched_model() -> None:
    from torch.func import functional_call, grad, vmap

    model = _fresh()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def loss_fn(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_sample = vmap(grad(loss_fn), in_dims=(None, 0, 0))
    expected = per_sample(params, x, y)
    with amp_doctor.watch(model, every=1) as w:
        got = per_sample(params, x, y)
        # An ordinary step after the vmap is still recorded.
        _loop(model, watched=False, steps=1)
    for k in expected:
        assert torch.equal(expected[k], got[k])
    kinds = {e.data["tensor"] for e in w.session.events if e.kind == "unsummarized"}
    assert kinds == {"functorch"}
    assert w.session.recorded_steps == 1
    assert _module_hook_count(model) == 0


# -- amp-doctor's own failures --------------------------------------------------------


def test_a_step_that_fails_to_fold_costs_neither_the_run_nor_the_later_steps(
        monkeypatch: Any) -> None:
    """An internal error while folding one recorded step (simulated in amp-doctor's own
    folder; torch and the scaler are real) is reported once by the patch hub; the
    training's numerics are untouched, the next steps are recorded, and close() neither
    raises nor loses them. Before, the spent step buffer was kept and flushed again,
    and close() raised a shape error into the user's script."""
    from amp_doctor.steps import folder

    monkeypatch.delenv("AMP_DOCTOR_DEBUG", raising=False)
    fold = folder.StepFolder.fold
    calls = [0]

    def fold_failing_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("simulated fold failure")
        return fold(self, *args, **kwargs)

    monkeypatch.setattr(folder.StepFolder, "fold", fold_failing_once)
    plain, _ = _loop(_fresh(), watched=False)
    model = _fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched, session = _loop(model, watched=True)
    assert watched == plain
    assert calls[0] == STEPS  # every step was folded once, the failed one included
    assert session.recorded_steps == STEPS
    assert [r.step for r in session.history] == [s for s in range(STEPS) if s != 1]
    assert any("simulated fold failure" in str(w.message) for w in caught)
    assert _module_hook_count(model) == 0 and _tensor_hook_count(model) == 0


def test_an_internal_error_at_close_becomes_a_report_event_not_an_exception(
        monkeypatch: Any) -> None:
    """A run that stops mid-step (after a backward, before the optimizer step) has that
    step folded by close(); if folding it fails, close() still returns the report of
    the steps before, with the failure as an event, and leaves no hook behind."""
    from amp_doctor.steps import folder

    monkeypatch.delenv("AMP_DOCTOR_DEBUG", raising=False)
    fold = folder.StepFolder.fold
    calls = [0]

    def fold_failing_third(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("simulated fold failure at close")
        return fold(self, *args, **kwargs)

    monkeypatch.setattr(folder.StepFolder, "fold", fold_failing_third)
    model = _fresh()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    w = amp_doctor.watch(model, every=1)
    for i in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        if i < 2:  # the third step stops after its backward
            scaler.step(opt)
            scaler.update()
    session = w.close()
    assert calls[0] == 3
    errors = [e for e in session.events if e.kind == "internal_error"]
    assert len(errors) == 1 and "at close" in errors[0].data["error"]
    assert [r.step for r in session.history] == [0, 1]
    assert _module_hook_count(model) == 0 and _tensor_hook_count(model) == 0


# -- the user's default device ------------------------------------------------------

_DEFAULT_DEVICE_SCRIPT = Path(__file__).parent / "fixtures" / "default_device.py"


def _default_device_run(tmp_path: Path, device: str, mode: str) -> dict[str, Any]:
    out = tmp_path / f"{device}-{mode}.json"
    proc = subprocess.run([sys.executable, str(_DEFAULT_DEVICE_SCRIPT), device, str(out), mode],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "amp-doctor: internal error" not in proc.stderr, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.parametrize("mode", ["watch", "anomaly"])
def test_a_default_device_set_before_import_leaves_the_run_and_report_as_they_were(
        tmp_path: Path, mode: str) -> None:
    # torch.set_default_device("cuda") sends every tensor made without a device argument
    # to the GPU: amp-doctor's host tensors (some made at import) must not go there.
    # "meta" stands in for "cuda" on this machine: a tensor made there has no data.
    plain = _default_device_run(tmp_path, "cpu", "")
    reference = _default_device_run(tmp_path, "cpu", mode)
    got = _default_device_run(tmp_path, "meta", mode)
    assert got["losses"] == reference["losses"] == plain["losses"]
    assert got["params"] == plain["params"]
    assert got["session"] == reference["session"]
    kinds = {(f["kind"], f["module"]) for f in got["session"]["findings"]}
    assert ("activation_overflow", "2") in kinds


def test_a_default_device_set_after_import_leaves_the_run_and_report_as_they_were() -> None:
    def cpu_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(8, 16, generator=g, device="cpu") * 3e3,
                torch.randint(0, 4, (8,), generator=g, device="cpu"))

    plain, _ = _loop(_fresh(), watched=False, make_batch=cpu_batch)
    runs = []
    for device in (None, "meta"):  # one call site: the event's user frames are alike
        model = _fresh()
        torch.set_default_device(device)
        try:
            runs.append(_loop(model, watched=True, make_batch=cpu_batch, anomaly=True))
        finally:
            torch.set_default_device(None)
    assert torch.get_default_device().type == "cpu"
    (reference_losses, reference), (watched, session) = runs
    assert watched == reference_losses == plain
    got, want = to_jsonable(session), to_jsonable(reference)
    got.pop("run")
    want.pop("run")
    assert got == want
    # The op-level search found the overflowing backward op in both runs.
    assert ("nonfinite_backward", "fc2") in {(f.kind, f.module) for f in session.findings}
    assert session.events[0].op == "aten.mm"


def _two_format_run(watch: bool) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    b = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    runs = [(a, torch.optim.SGD(a.parameters(), lr=0.1), torch.amp.GradScaler("cpu"),
             torch.float16),
            (b, torch.optim.SGD(b.parameters(), lr=0.1), torch.amp.GradScaler("cpu"),
             torch.bfloat16)]
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []
    doctor = amp_doctor.watch([a, b], every=1, tensorboard=False) if watch else None
    try:
        for _ in range(STEPS):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            for m, opt, scaler, dt in runs:
                with torch.autocast("cpu", dtype=dt):
                    loss = nn.functional.cross_entropy(m(x), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(loss.item())
    finally:
        if doctor is not None:
            s = doctor.close()
            assert s.steps == STEPS
            assert not [e for e in s.events if e.kind == "internal_error"]
    return losses, [p.detach().clone() for m, *_ in runs for p in m.parameters()]


def test_two_models_in_float16_and_bfloat16_train_as_they_would_unwatched() -> None:
    # The step boundary after the first model's update is taken in the second model's
    # forward, under the user's autocast: amp-doctor's stack of float16 and bfloat16
    # statistics raised there ("Unexpected floating ScalarType in
    # at::autocast::prioritize") until own_ops turned autocast off for its own work.
    plain = _two_format_run(False)
    watched = _two_format_run(True)
    assert plain[0] == watched[0]
    assert all(torch.equal(p, q) for p, q in zip(plain[1], watched[1], strict=True))
    assert not torch.is_autocast_enabled("cpu")


class _OpLog(torch.Tensor):
    """A user's ``__torch_function__`` subclass that logs every op it sees."""

    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("kw", [{"every": 1}, {"anomaly": True}])
def test_a_torch_function_subclass_sees_only_the_users_own_ops(kw: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step() -> list[str]:
        _OpLog.seen = []
        x = torch.randn(8, 16).as_subclass(_OpLog)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), torch.zeros(8).long())
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return list(_OpLog.seen)

    step()  # the scaler's first scale() reads more than later ones
    plain = step()
    with amp_doctor.watch(model, tensorboard=False, **kw):
        watched = [step() for _ in range(3)]
    assert "linear" in plain
    assert watched == [plain] * 3


class _FunctionLog(TorchFunctionMode):
    """A user's function mode: logs every call, and refuses ``refused`` as a strict one might."""

    def __init__(self, refused: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.refused = refused
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in self.refused:
            raise RuntimeError(f"this mode refuses {name}")
        self.seen[name] += 1
        return func(*args, **(kwargs or {}))


class _DispatchLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _modes_loop(watch_kw: dict[str, Any] | None, make_modes: Callable[[], list[Any]]
                ) -> tuple[list[float], list[Any]]:
    """The AMP loop with the user's modes around each whole step (forward, backward, update)."""
    modes = make_modes()

    def around() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for m in modes:
            stack.enter_context(m)
        return stack

    losses, _ = _loop(_fresh(), watch_kw is not None, steps=4, around_step=around,
                      **(watch_kw or {}))
    return losses, modes


@pytest.mark.parametrize("kw", [{"every": 1}, {"every": 2}, {"anomaly": True, "every": 1},
                                {"on_nonfinite": "raise", "every": 1}])
def test_the_users_function_and_dispatch_modes_see_only_the_users_ops(
        kw: dict[str, Any]) -> None:
    # A FlopCounterMode counted the histograms' mm (+18% FLOPs on a small MLP), and a
    # function mode that refuses aminmax or empty failed the user's step in a hook.
    from torch.utils.flop_counter import FlopCounterMode

    def modes() -> list[Any]:
        return [_FunctionLog(), _DispatchLog(), FlopCounterMode(display=False)]

    plain, (fn, disp, flops) = _modes_loop(None, modes)
    watched, (wfn, wdisp, wflops) = _modes_loop(kw, modes)
    assert watched == plain
    assert fn.seen["linear"] == 4 * 2 and disp.seen["aten.addmm.default"] == 4 * 2  # 2 Linear
    assert wfn.seen == fn.seen
    if kw.get("anomaly") or kw.get("on_nonfinite") == "raise":
        # While the op-level search runs beneath the user's mode (step 0 here; every
        # step in raise mode), that mode also sees a ``detach`` after some factory calls
        # of GradScaler and backward (full, ones_like: 4 in step 0, fewer later),
        # dispatched by torch from the user's own frame. Every other op, and the FLOPs,
        # are the user's alone.
        extra = wdisp.seen - disp.seen
        searched = 4 if kw.get("on_nonfinite") == "raise" else 1
        assert set(extra) <= {"aten.detach.default"} and extra.total() <= 4 * searched
        assert not disp.seen - wdisp.seen
    else:
        assert wdisp.seen == disp.seen
    assert wflops.get_total_flops() == flops.get_total_flops() > 0
    assert torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0

    strict, _ = _modes_loop(kw, lambda: [_FunctionLog(frozenset({"aminmax", "empty", "copy_",
                                                                  "stack", "count_nonzero"}))])
    assert strict == plain


def test_anomaly_mode_beside_vmap_of_grad_still_names_the_nan_batch() -> None:
    # functional_call under vmap(grad(...)) calls the watched model with batched tensors:
    # a summary of those made at the root's call failed later, outside the transform.
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))

    def per_sample(p: dict[str, torch.Tensor], xi: torch.Tensor,
                   yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    g = torch.Generator().manual_seed(0)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        if step == 4:
            x[0, 0] = float("nan")
        params = {k: v.detach() for k, v in model.named_parameters()}
        vmap(grad(per_sample), in_dims=(None, 0, 0))(params, x, y)  # per-sample grads
        return x, y

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an internal error warns
        with amp_doctor.watch(model, anomaly=True, tensorboard=False) as doctor:
            train(model, steps=6, lr=0.1, batch=batch)
    s = doctor.session
    assert s is not None
    assert not [e for e in s.events if e.kind == "internal_error"]
    errors = [(f.kind, f.steps) for f in s.findings if f.severity == "error"]
    assert errors == [("nonfinite_input", [4])]


def test_a_copy_evaluated_after_training_is_no_second_model() -> None:
    # A deep copy of the trained model, checked under no_grad after training (ordinary
    # "does the copy/reload match" code), was adopted as a second model: every layer of
    # the trained one was renamed "model.fc1", and --fp32 with the name the report
    # printed matched nothing during training (review 35). A copy that trains is a model.
    from amp_doctor.watch import Watch

    torch.manual_seed(0)
    w = Watch(None, every=1, discover=True, tensorboard=False).start()
    try:
        model = MLP()
        train(model, steps=2)
        clone = copy.deepcopy(model)
        with torch.no_grad():
            clone(torch.randn(4, 16))
    finally:
        s = w.close()
    assert len(s.run.models) == 1
    assert {"fc1", "act", "fc2"} <= {lay.name for lay in s.layers}
    assert all(lay.calls == 2 for lay in s.layers)
    assert s.steps == 2


def test_spectral_norm_layers_are_part_of_the_discovered_model() -> None:
    # ParametrizationList calls itself while spectral_norm() registers it, before the
    # model exists: discovery must not take it for a model of its own.
    from torch.nn.utils.parametrizations import spectral_norm

    from amp_doctor.watch import Watch

    def run(watched: bool) -> tuple[list[float], list[torch.Tensor], Any]:
        torch.manual_seed(0)
        w = Watch(None, every=1, discover=True, tensorboard=False).start() if watched else None
        try:
            disc = nn.Sequential(spectral_norm(nn.Linear(8, 32)), nn.LeakyReLU(0.2),
                                 spectral_norm(nn.Linear(32, 1)))
            losses = train(disc, steps=3, batch=lambda i: (torch.randn(8, 8),
                                                           torch.zeros(8, dtype=torch.long)))
        finally:
            if w is not None:
                w.close()
        return losses, [p.detach().clone() for p in disc.parameters()], w

    plain, plain_params, _ = run(False)
    losses, params, w = run(True)
    assert losses == plain
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    names = {lay.name for lay in w.session.layers}
    assert w.session.run.models == ["Sequential"]
    # The parametrizations compute the layers' weights: part of those layers.
    assert names == {"0", "1", "2", "Sequential"}


@pytest.mark.parametrize("kw", [{"every": 1}, {"every": 1, "on_nonfinite": "raise"}])
def test_torchscript_export_during_a_watch_works_and_leaves_the_watch_as_it_was(
        kw: dict[str, Any]) -> None:
    # torch.jit.script compiled amp-doctor's hooks ("'_PostHook' object has no attribute
    # '__name__'"); torch.jit.trace on a recorded step failed its check (the hooks'
    # Python changed the graph's value names between the two runs).
    def export(watched: bool) -> tuple[list[float], list[torch.Tensor], set[str], Any]:
        model = _fresh()
        hooks_seen: dict[str, int] = {}

        def at_step(i: int, m: nn.Module) -> None:
            if i != STEPS - 1:
                return
            x = torch.randn(2, 16)
            hooks_seen["before"] = _module_hook_count(m)
            scripted = torch.jit.script(m)
            hooks_seen["after"] = _module_hook_count(m)
            # (Tracing runs the model under no_grad: an evaluation, which runs with the
            # layers' hooks off until the next training forward.)
            traced = torch.jit.trace(m, x)  # check_trace=True: two runs, one graph
            outs.extend([scripted(x), traced(x), m(x)])
            kinds.update(n.kind() for n in traced.inlined_graph.nodes())

        outs: list[torch.Tensor] = []
        kinds: set[str] = set()
        losses, session = _loop(model, watched, each_step=at_step, **kw)
        assert hooks_seen["after"] == hooks_seen["before"]  # every hook back
        return losses, outs, kinds, session

    plain, plain_outs, plain_kinds, _ = export(False)
    watched, outs, kinds, session = export(True)
    assert watched == plain
    assert all(torch.equal(a, b) for a, b in zip(plain_outs, outs, strict=True))
    assert kinds == plain_kinds and "aten::linear" in kinds and "aten::aminmax" not in kinds
    assert session.steps == STEPS and not [e for e in session.events
                                           if e.kind == "internal_error"]
    assert torch.jit.script is torch.jit._script.script  # the patch is gone with the watch


@pytest.mark.parametrize("kw", [{"every": 1}, {"every": 1, "anomaly": True},
                                {"every": 1, "on_nonfinite": "raise"}])
def test_a_fake_tensor_forward_mid_training_is_not_taken_for_a_training_step(
        kw: dict[str, Any]) -> None:
    # A memory or shape estimate under FakeTensorMode between steps ran the hooks: its
    # calls were counted as training, its fake tensors filed, and the step's histogram
    # pass failed on them (DynamicOutputShapeException), losing that step's record.
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes: list[tuple[int, ...]] = []

    def estimate(i: int, m: nn.Module) -> None:
        with FakeTensorMode(allow_non_fake_inputs=True):
            with torch.autocast("cpu", dtype=torch.float16):
                shapes.append(tuple(m(torch.empty(4, 16)).shape))

    plain, _ = _loop(_fresh(), False, each_step=estimate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched, s = _loop(_fresh(), True, each_step=estimate, **kw)
    assert watched == plain and shapes == [(4, 4)] * (2 * STEPS)
    assert not [str(c.message) for c in caught if "amp-doctor" in str(c.message)]
    assert (s.steps, s.recorded_steps) == (STEPS, STEPS)
    assert {lay.name: lay.calls for lay in s.layers} == dict.fromkeys(
        ("MLP", "fc1", "act", "fc2"), STEPS)
    assert not [e for e in s.events if e.kind == "internal_error"]
