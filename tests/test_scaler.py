"""GradScaler, optimizer, clipping, scheduler and backward observation (issue 3).

Every test runs a small real training loop on the CPU (float16 autocast and
``torch.amp.GradScaler("cpu")`` work there) and checks what amp-doctor
reports against the numbers the loop itself observed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

# Bound before any watch starts, as in most training scripts: the clip must
# still be seen.
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

import amp_doctor
from amp_doctor import Session
from amp_doctor.devicework import host_syncs
from amp_doctor.steps.scaler import patches_installed
from tests.helpers import MLP

F16_MAX = torch.finfo(torch.float16).max


class _GradAmp(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``factor`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.factor, None


class GradAmp(nn.Module):
    """Blows up the gradient flowing into the layer before it, on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GradAmp.apply(x, self.factor)


class Net(nn.Module):
    """fc1 -> act -> fc2 -> amp -> fc3. When ``amp`` fires, the gradient of
    fc2's output is the first to turn inf in backward order; fc3's is finite."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.amp = GradAmp()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.amp(self.fc2(self.act(self.fc1(x)))))


def loop(
    model: nn.Module,
    steps: int,
    scaler: Any = "default",
    *,
    blowup: Iterable[int] = (),
    opt: torch.optim.Optimizer | None = None,
    sched: Any = None,
    accum: int = 1,
    clip: str | None = None,
    dtype: torch.dtype = torch.float16,
    backward_in_autocast: bool = False,
    unscaled_backward: bool = False,
    after_step: Callable[[int], None] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """The seed recipe, with switches for each misuse. Returns what the loop saw."""
    g = torch.Generator().manual_seed(seed)
    if scaler == "default":
        scaler = torch.amp.GradScaler("cpu")
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    blow = set(blowup)
    seen: dict[str, Any] = {"scales": [], "norms": [], "skipped": []}
    calls: list[int] = []
    handle = opt.register_step_post_hook(lambda *a: calls.append(1))
    for i in range(steps):
        amp = getattr(model, "amp", None)
        if amp is not None:
            amp.factor = 1e30 if i in blow else 1.0
        opt.zero_grad()
        for _ in range(accum):
            x = torch.randn(8, 16, generator=g)
            y = torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.cross_entropy(model(x).float(), y) / accum
                if backward_in_autocast:
                    scaler.scale(loss).backward()
            if backward_in_autocast:
                continue
            if scaler is None:
                loss.backward()
            elif unscaled_backward:
                scaler.scale(loss)  # computed, then the wrong tensor is backpropagated
                loss.backward()
            else:
                scaler.scale(loss).backward()
        if scaler is None:
            opt.step()
        else:
            if clip == "right":
                scaler.unscale_(opt)
                seen["norms"].append(clip_grad_norm_(model.parameters(), 1.0))
            elif clip == "before_unscale":
                seen["norms"].append(clip_grad_norm_(model.parameters(), 1.0))
            elif clip == "value_before_unscale":
                clip_grad_value_(model.parameters(), 0.5)
            stepped = len(calls)
            scaler.step(opt)
            if len(calls) == stepped:
                seen["skipped"].append(i)
            scaler.update()
            seen["scales"].append(scaler.get_scale())
        if sched is not None:
            sched.step()
        if after_step is not None:
            after_step(i)
    handle.remove()
    return seen


def kinds(s: Session, severities: tuple[str, ...] = ("error", "warning", "info")) -> set[str]:
    return {f.kind for f in s.findings if f.severity in severities}


def only(s: Session, kind: str) -> Any:
    fs = s.findings_of(kind)
    assert len(fs) == 1, [(f.kind, f.message) for f in s.findings]
    return fs[0]


def scale_per_step(s: Session) -> list[float]:
    """The scale after each step, rebuilt from the timeline (points at changes)."""
    assert s.scaler is not None
    points = dict(s.scaler.scale)
    out, cur = [], s.scaler.init_scale
    for i in range(s.steps):
        cur = points.get(i, cur)
        out.append(cur)
    return out


# ---------------------------------------------------------------------------
# Healthy loops: nothing to report
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["plain", "accumulation", "clip_right", "scheduler"])
def test_healthy_loops_give_no_warning(variant: str) -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3) if variant == "scheduler" else None
    with amp_doctor.watch(model, every=2) as doctor:
        seen = loop(model, 8, opt=opt, sched=sched,
                    accum=4 if variant == "accumulation" else 1,
                    clip="right" if variant == "clip_right" else None)
    s = doctor.session
    assert s.steps == 8 and s.amp.scaler
    assert [f for f in s.findings if f.severity != "info"] == [], s.findings
    assert s.scaler is not None and s.scaler.backoff_steps == []
    assert scale_per_step(s) == seen["scales"] == [65536.0] * 8
    assert not [e for e in s.events if e.kind in ("clip_before_unscale", "missing_update",
                                                  "loss_not_scaled")]


# ---------------------------------------------------------------------------
# Per step: scale before/after, backoffs, growths, skips; culprits
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("every", [1, 1000])
def test_backoff_names_culprits_in_backward_order(every: int) -> None:
    torch.manual_seed(0)
    model = Net()
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    with amp_doctor.watch(model, every=every) as doctor:
        seen = loop(model, 12, blowup=[4, 5, 6, 10], scaler=scaler)
    s = doctor.session
    assert seen["skipped"] == [4, 5, 6, 10]
    sc = s.scaler
    assert sc is not None
    assert sc.backoff_steps == sc.skipped_steps == [4, 5, 6, 10]
    assert sc.skipped_by_optimizer == {"SGD#0": [4, 5, 6, 10]}
    assert scale_per_step(s) == seen["scales"]
    # Growth after 3 clean steps: steps 2 and 9 (the backoffs reset the count).
    assert sc.growth_steps == [2, 9]
    ev = {e.step: e for e in sc.events}
    assert (ev[2].kind, ev[2].scale_before, ev[2].scale_after) == ("growth", 65536.0, 131072.0)
    assert (ev[4].kind, ev[4].scale_before, ev[4].scale_after) == ("backoff", 131072.0, 65536.0)
    assert (ev[5].kind, ev[5].scale_before, ev[5].scale_after) == ("backoff", 65536.0, 32768.0)
    assert (ev[6].kind, ev[6].scale_before, ev[6].scale_after) == ("backoff", 32768.0, 16384.0)
    # fc3's gradients are finite; the inf appears at fc2's output gradient and
    # flows down to fc1. Recorded steps see output and parameter gradients
    # (act has none of its own); unrecorded steps see parameter gradients.
    want = ["fc2", "act", "fc1"] if every == 1 else ["fc2", "fc1"]
    assert ev[4].culprits == ev[5].culprits == ev[6].culprits == ev[10].culprits == want
    # Three halvings in a row: values 8x beyond what the scale allowed, a warning.
    warn = [f for f in s.findings if f.kind == "scaler_backoff" and f.severity == "warning"]
    assert len(warn) == 1 and warn[0].module == "fc2" and warn[0].steps == [4, 5, 6]
    msg = warn[0].message
    assert "backed off 3x at steps 4-6: the scale fell from 131072 to 16384, and 3" in msg
    assert "3 optimizer step(s) were skipped (skipped per optimizer: SGD#0 3)" in msg
    assert "in backward order: " + ", ".join(want) + ". The first, fc2," in msg
    # Step 10 only undid the growth of step 9: GradScaler probing, reported as info.
    info = [f for f in s.findings if f.kind == "scaler_backoff" and f.severity == "info"]
    assert len(info) == 1 and info[0].steps == [10]
    assert "each undoing the growth before it" in info[0].message
    assert "scale_collapse" not in kinds(s)
    text = doctor.report()
    assert "steps 4-6" in text and "fc2" in text


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.cls = nn.Linear(32, 4)
        self.reg = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.cls(h), self.reg(h)


@pytest.mark.parametrize("every", [1, 100])
def test_culprits_of_two_backward_calls_start_where_the_non_finite_came_in(every: int) -> None:
    # Two losses, two backward calls (retain_graph=True); at step 2 the regression target
    # is inf. The first backward's gradients are finite everywhere and reach trunk.2
    # first; the second brings the inf in through reg. Before, culprits were ordered by
    # any gradient's first arrival: "trunk.2 ... is where they appeared" (review 35).
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=every, tensorboard=False) as doctor:
        for step in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            t = torch.randn(8, 1, generator=g) * (math.inf if step == 2 else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                logits, pred = model(x)
                l1 = nn.functional.cross_entropy(logits.float(), y)
                l2 = nn.functional.mse_loss(pred.float(), t)
            opt.zero_grad()
            scaler.scale(l1).backward(retain_graph=True)
            scaler.scale(l2).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps == [2]
    (ev,) = [e for e in s.scaler.events if e.kind == "backoff"]
    assert ev.culprits.index("reg") < ev.culprits.index("trunk.2")
    assert "cls" not in ev.culprits  # its gradients stayed finite
    (f,) = s.findings_of("scaler_backoff")
    assert f.module == "reg"


def test_early_layer_parameter_gradient_overflow_is_the_only_culprit() -> None:
    """fc1's weight gradient overflows float16 (huge inputs, tiny weights); every
    output gradient stays finite, so fc1 alone is named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    skipped = []
    with amp_doctor.watch(model, every=1) as doctor:
        for i in range(3):
            x = 3000 * torch.randn(8, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.zeros(8).long())
            opt.zero_grad()
            scaler.scale(loss).backward()
            fc1_inf = not torch.isfinite(model[0].weight.grad).all()
            others = all(torch.isfinite(p.grad).all() for p in list(model.parameters())[2:])
            scaler.step(opt)
            scaler.update()
            if fc1_inf:
                skipped.append(i)
            assert others
    s = doctor.session
    assert skipped and s.scaler is not None and s.scaler.backoff_steps == skipped
    for e in s.scaler.events:
        if e.kind == "backoff":
            assert e.culprits == ["0"]


def test_host_mirror_tracks_the_real_scale_without_reading_it() -> None:
    """Non-power-of-two factors: the mirror must round like the float32 kernel."""
    torch.manual_seed(0)
    model = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_factor=1.7,
                                  backoff_factor=0.3, growth_interval=2)
    with amp_doctor.watch(model, every=1000) as doctor:
        seen = loop(model, 15, scaler=scaler, blowup=[3, 4, 10])
    s = doctor.session
    assert s.recorded_steps == 1
    assert scale_per_step(s) == seen["scales"]
    real = [1000.0] + seen["scales"]
    assert s.scaler is not None
    assert s.scaler.growth_steps == [i for i in range(15) if real[i + 1] > real[i]]
    assert s.scaler.backoff_steps == [3, 4, 10]
    for e in s.scaler.events:
        assert (e.scale_before, e.scale_after) == (real[e.step], real[e.step + 1])


def test_no_host_sync_on_healthy_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the recorded step copies to the host; nothing in amp_doctor reads a tensor."""
    import sys

    reads: list[str] = []
    here = str(__import__("amp_doctor").__path__[0])

    def counting(name: str) -> Callable[..., Any]:
        orig = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            f = sys._getframe(1)
            if f.f_code.co_filename.startswith(here):
                reads.append(f"{name} at {f.f_code.co_filename}:{f.f_lineno}")
            return orig(self, *a, **k)

        return wrapper

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1000) as doctor:
        loop(model, 1, scaler, opt=opt)  # step 0: the recorded one
        syncs = host_syncs()
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, counting(name))
        loop(model, 20, scaler, opt=opt, sched=sched, clip="right", accum=2)
        assert reads == [] and host_syncs() == syncs
        monkeypatch.undo()
    assert doctor.session.steps == 21 and doctor.session.recorded_steps == 1


def test_scale_collapse_with_real_numbers() -> None:
    torch.manual_seed(0)
    model = Net()
    with amp_doctor.watch(model, every=5) as doctor:
        seen = loop(model, 20, blowup=range(20))
    s = doctor.session
    assert seen["skipped"] == list(range(20))
    assert seen["scales"][-1] == 65536.0 / 2 ** 20
    f = only(s, "scale_collapse")
    assert f.severity == "error" and f.module == "fc2"
    final = _fmt_scale(seen["scales"][-1])
    first_below = next(i for i, v in enumerate(seen["scales"]) if v < 1)
    assert f"the scale fell to {final} (below 1, first at step {first_below})" in f.message
    assert "20 backoffs in a row at steps 0-19 (scale 65536 -> " + final + ")" in f.message
    assert "20 of 20 optimizer steps were skipped" in f.message
    assert "fc2 in 20 of 20 backoffs" in f.message
    b = s.findings_of("scaler_backoff")
    # The same 20 backoffs: the collapse's detail (culprits, per optimizer), not a warning.
    assert len(b) == 1 and b[0].severity == "info" and b[0].steps == list(range(20))
    assert b[0].data["follow_on_of"] == "fc2"
    assert "scale_stuck" not in kinds(s)


def test_a_collapse_with_two_optimizers_counts_the_one_that_skipped() -> None:
    """The blow-up reaches fc1 and fc2 only: their optimizer skips every step while
    fc3's steps. The collapse said "20 of 20 optimizer steps were skipped" (review 41c)."""
    torch.manual_seed(0)
    model = Net()
    head = torch.optim.SGD(model.fc3.parameters(), lr=0.01)
    body = torch.optim.SGD([*model.fc1.parameters(), *model.fc2.parameters()], lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    stepped = {"head": 0, "body": 0}
    head.register_step_post_hook(lambda *a: stepped.__setitem__("head", stepped["head"] + 1))
    body.register_step_post_hook(lambda *a: stepped.__setitem__("body", stepped["body"] + 1))
    model.amp.factor = 1e30
    with amp_doctor.watch(model, every=5) as doctor:
        for _ in range(20):
            head.zero_grad()
            body.zero_grad()
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(head)
            scaler.step(body)
            scaler.update()
    assert stepped == {"head": 20, "body": 0}
    f = only(doctor.session, "scale_collapse")
    assert "optimizer steps were skipped" not in f.message
    assert ("In 20 of 20 steps an optimizer step was skipped (skipped per optimizer: SGD#1 20; "
            "never skipped: SGD#0)") in f.message


def test_a_short_growth_interval_probing_at_a_steady_scale_is_no_collapse() -> None:
    """growth_interval=2: the scaler grows every two clean steps and the next step
    overflows, a backoff in every third step (33%, past BACKOFF_SHARE_COLLAPSE) at a
    scale that stays where it started. Each backoff repays a growth: no collapse. The
    same share with the scale really falling is one."""
    torch.manual_seed(0)
    model = Net()
    with amp_doctor.watch(model, every=5) as doctor:
        seen = loop(model, 60, torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2),
                    blowup=[i for i in range(60) if i % 3 == 2])
    assert seen["scales"][:6] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 1024.0]
    assert seen["scales"][-1] == 1024.0 and len(seen["skipped"]) == 20
    s = doctor.session
    assert "scale_collapse" not in kinds(s)
    (b,) = s.findings_of("scaler_backoff")
    assert b.severity == "info" and "20 each undoing the growth before it" in b.message
    torch.manual_seed(0)
    model = Net()
    with amp_doctor.watch(model, every=5) as doctor:
        seen = loop(model, 60, torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2),
                    blowup=[i for i in range(60) if i % 3 != 0])
    assert seen["scales"][-1] == 2.0 ** -21
    f = only(doctor.session, "scale_collapse")
    assert "22 backoffs (and 4 growths) in the 40 steps after the first 20 (55%)" in f.message


def _fmt_scale(x: float) -> str:
    return str(int(x)) if x >= 1 and x == int(x) else f"{x:.4g}"


def test_scale_stuck_names_the_reason() -> None:
    """An overflow every 6th step resets the growth count before it reaches 8."""
    torch.manual_seed(0)
    model = Net()
    scaler = torch.amp.GradScaler("cpu", growth_interval=8)
    blow = [i for i in range(60) if i % 6 == 5]
    with amp_doctor.watch(model, every=10) as doctor:
        seen = loop(model, 60, scaler=scaler, blowup=blow)
    s = doctor.session
    assert seen["skipped"] == blow and seen["scales"][-1] == 65536.0 / 2 ** len(blow)
    assert s.scaler is not None and s.scaler.growth_steps == []
    assert "scale_collapse" not in kinds(s)
    f = only(s, "scale_stuck")
    assert f.severity == "warning" and f.module == "fc2"
    assert "did not grow in the last 60 steps (7.5 growth intervals of 8, i.e. never)" in f.message
    assert f"it is {_fmt_scale(seen['scales'][-1])}" in f.message
    assert f"{len(blow)} backoff(s)" in f.message
    assert "bits of headroom" in f.message
    b = s.findings_of("scaler_backoff")
    assert len(b) == 1 and b[0].steps == blow and "in 10 separate episodes" in b[0].message
    assert "torch.autocast(device_type, enabled=False)" in f.advice
    # Per layer, the headroom of the scaled gradients against float16's max.
    fc3 = s.layer("fc3")
    assert fc3.grad_absmax is not None and fc3.grad_headroom is not None
    assert fc3.grad_headroom == pytest.approx(math.log2(F16_MAX / fc3.grad_absmax), abs=1.0)


# ---------------------------------------------------------------------------
# Misuse of the scaler API
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["norm", "value"])
def test_clip_before_unscale(how: str) -> None:
    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=2) as doctor:
        seen = loop(model, 4, clip="before_unscale" if how == "norm" else "value_before_unscale")
    s = doctor.session
    f = only(s, "clip_before_unscale")
    assert f.severity == "error" and f.count == 4 and f.steps == [0, 1, 2, 3]
    assert "scaler.unscale_(optimizer)" in f.advice
    if how == "norm":
        # The norm clip_grad_norm_ returned, read by the loop, is in the message.
        tn = float(seen["norms"][0])
        assert tn > 1000  # scaled by 65536
        assert f.data["total_norm"] == pytest.approx(tn)
        assert f.message.startswith("clip_grad_norm_ ran on gradients still multiplied by the "
                                    "loss scale (65536): 4 times, first at step 0")
        assert f"total norm it saw was {_e(tn)} (scaled; {_e(tn / 65536)} unscaled)" in f.message
        assert "cut to norm 1.53e-05 instead of 1" in f.message
    else:
        assert "clip_grad_value_ ran on gradients" in f.message
        assert "clipped at 7.63e-06" in f.message


def _e(x: float) -> str:
    from amp_doctor.format import num as _fmt

    return _fmt(x)


def test_clip_with_get_total_norm_api_and_accumulation_is_fine() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1) as doctor:
        for _ in range(3):
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 16)).float().pow(2).mean() / 3
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            grads = [p.grad for p in model.parameters()]
            norm = torch.nn.utils.get_total_norm(grads)
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert kinds(doctor.session, ("error", "warning")) == set()


def test_missing_update_is_recorded_before_torch_raises() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        with amp_doctor.watch(model, every=1) as doctor:
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 16)).float().mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)  # no scaler.update()
    s = doctor.session
    assert s.run.outcome == "exception" and "already been called" in (s.run.error or "")
    f = only(s, "missing_update")
    assert f.severity == "error"
    assert "scaler.step(SGD#0) was called again" in f.message and "step() has already" in f.message
    assert "scaler.update()" in f.advice


def test_update_on_every_micro_step_is_named_before_torch_raises() -> None:
    """Gradient accumulation with scaler.update() on every micro-step: the first update
    comes before any scaler.step and torch raises. Before: 'no GradScaler' and 'No
    optimizer or GradScaler was seen' beside torch's AssertionError (review 41a)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        with amp_doctor.watch(model, every=1) as doctor:
            for i in range(8):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 16)).float().mean() / 4
                scaler.scale(loss).backward()
                if (i + 1) % 4 == 0:
                    scaler.step(opt)
                    opt.zero_grad()
                scaler.update()
    s = doctor.session
    assert s.run.outcome == "exception" and s.amp.scaler
    errors = [f for f in s.findings if f.severity == "error"]
    assert [f.kind for f in errors] == ["update_without_step"]
    assert "No inf checks were recorded prior to update" in errors[0].message
    assert "only on the last micro-step" in errors[0].advice
    assert not s.findings_of("steps_from_backward")


def test_missing_update_at_the_end_of_a_run() -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1) as doctor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 16)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
    f = only(doctor.session, "missing_update")
    assert "scaler.step() ran 1 time(s) but scaler.update() never ran" in f.message
    assert "stayed at 65536" in f.message


def test_unscale_twice_in_accumulation_is_explained() -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        with amp_doctor.watch(model, every=1) as doctor:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 16)).float().mean()
                scaler.scale(loss).backward()
                scaler.unscale_(opt)  # wrong: once per micro-step
            scaler.step(opt)
    f = only(doctor.session, "missing_update")
    assert "called twice" in f.message and "accumulation" in f.message


def test_fp16_params_explained_when_unscale_raises() -> None:
    torch.manual_seed(0)
    model = MLP().half()
    n_params = len(list(model.parameters()))
    numel = sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        with amp_doctor.watch(model, every=1) as doctor:
            loop(model, 2)
    s = doctor.session
    assert s.run.outcome == "exception"
    f = only(s, "fp16_params")
    assert f.severity == "error" and f.step == 0
    assert f.message.startswith(f"{n_params} of the {n_params} parameters of SGD#0 "
                                f"({numel:,} values) have float16 gradients")
    assert "Attempting to unscale FP16 gradients." in f.message
    assert "model.half()" in f.advice and "model.float()" in f.advice


def test_scaler_with_bf16_is_info() -> None:
    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=2) as doctor:
        loop(model, 3, dtype=torch.bfloat16)
    s = doctor.session
    assert s.amp.dtype == "bfloat16"
    f = only(s, "scaler_with_bf16")
    assert f.severity == "info" and "(scale 65536)" in f.message
    assert "enabled=False" in f.advice
    assert kinds(s, ("error", "warning")) == set()


def test_missing_scaler_names_the_layer_with_real_numbers() -> None:
    class Shrink(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1e-4

    torch.manual_seed(0)
    net = nn.Sequential(MLP(), Shrink())
    with amp_doctor.watch(net, every=1) as doctor:
        loop(net, 3, scaler=None)
    s = doctor.session
    fs = s.findings_of("missing_scaler")
    assert fs and all(f.severity == "warning" for f in fs)
    by_module = {f.module: f for f in fs}
    assert "0.fc2" in by_module
    lay = s.layer("0.fc2")
    f = by_module["0.fc2"]
    gu = max(v for v in (lay.grad_underflow_frac, lay.param_grad_underflow_frac) if v)
    assert f.data["grad_underflow_frac"] == gu and gu > 0.5
    # The share, its zeros and its largest value are all of one tensor (review 36: an
    # output-gradient share beside a weight gradient's zeros and max passed 100%).
    which = "weight" if lay.param_grad_underflow_frac == gu else "output"
    assert f"{100 * gu:.3g}% of its {which}-gradient values are float16 subnormals (below " \
        "the smallest" in f.message
    big = lay.param_grad_absmax if which == "weight" else lay.grad_absmax
    assert f.data["grad_absmax"] == big
    assert "no GradScaler is in use" in f.message
    assert "torch.amp.GradScaler(device_type)" in f.advice
    # The same loop with a scaler does not lack one.
    with amp_doctor.watch(net, every=1) as doctor:
        loop(net, 3)
    assert "missing_scaler" not in kinds(doctor.session)


def test_scheduler_on_skipped_step() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: scheduler before optimizer.step
        with amp_doctor.watch(model, every=4) as doctor:
            seen = loop(model, 10, opt=opt, sched=sched, blowup=[3, 7])
    s = doctor.session
    assert seen["skipped"] == [3, 7]
    f = only(s, "scheduler_on_skipped_step")
    assert f.severity == "info" and f.count == 2
    assert [e.data["skipped_step"] for e in s.events if e.kind == f.kind] == [3, 7]
    assert ("StepLR.step() ran for SGD#0 after GradScaler skipped its optimizer step: 2 times, "
            "first for the skipped step 3 (scale 65536 -> 32768)") in f.message
    assert "scaler.get_scale() >= scale: scheduler.step()" in f.advice
    # The finding is at the step it names (review 40: 'step 1 ... skipped step 0').
    assert f.step == 3


def test_a_per_epoch_scheduler_after_an_epochs_skipped_last_step_is_no_finding() -> None:
    # Review 40: StepLR stepped once an epoch; the epoch's last step was a backoff. The
    # epoch's other steps changed the parameters, and the advice (step the scheduler
    # only if the scale held) would have lost that epoch's decay.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    skipped = []
    with amp_doctor.watch(model, every=1) as doctor:
        for epoch in range(3):
            for i in range(4):
                model.amp.factor = 1e30 if i == 3 and epoch != 1 else 1.0
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 16)).float().mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                if scaler.get_scale() < before:
                    skipped.append(4 * epoch + i)
            sched.step()
    s = doctor.session
    assert skipped == [3, 11]  # the last step of epochs 0 and 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert "scheduler_on_skipped_step" not in kinds(s)


def test_scheduler_between_step_and_update_on_skipped_step() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=4) as doctor:
        for i in range(4):
            model.amp.factor = 1e30 if i == 2 else 1.0
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            sched.step()
            scaler.update()
    f = only(doctor.session, "scheduler_on_skipped_step")
    assert f.count == 1 and f.data["skipped_step"] == 2


def test_loss_not_scaled() -> None:
    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=2) as doctor:
        loop(model, 3, unscaled_backward=True)
    f = only(doctor.session, "loss_not_scaled")
    assert f.severity == "error" and f.count == 3 and f.steps == [0, 1, 2]
    assert "scale 65536" in f.message and "divides those gradients by 65536" in f.message
    assert "scaler.scale(loss).backward()" in f.advice


def test_loss_never_scaled_is_recorded_before_torch_asserts() -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(AssertionError):
        with amp_doctor.watch(model, every=1) as doctor:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 16)).float().mean()
            loss.backward()
            scaler.step(opt)  # torch: "Attempted step but _scale is None"
    assert "loss_not_scaled" in kinds(doctor.session)


def test_no_false_loss_not_scaled() -> None:
    """Accumulation, several losses, retain_graph, derived tensors, autograd.grad,
    a separate float32 model trained next to it, and disabled scalers."""
    torch.manual_seed(0)
    model, other = MLP(), MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt_other = torch.optim.SGD(other.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=2) as doctor:
        for _ in range(3):
            x = torch.randn(4, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x).float()
                l1, l2 = out.mean(), out.pow(2).mean()
            # Gradient penalty as in the AMP examples: autograd.grad on a scaled output.
            (gp,) = torch.autograd.grad(scaler.scale(l2), [out], create_graph=True)
            scaler.scale(l1).backward(retain_graph=True)
            scaler.scale(l2 + gp.pow(2).mean() * 0).div(2).backward(retain_graph=True)
            torch.autograd.backward([scaler.scale(l1), scaler.scale(l2)])
            # A float32 model, not under the scaler.
            other(x).mean().backward()
            opt_other.step()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            opt_other.zero_grad()
        loop(model, 3, accum=3)
    assert kinds(doctor.session, ("error", "warning")) == set()
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    with amp_doctor.watch(model, every=2) as doctor:
        loop(model, 3, scaler=disabled, unscaled_backward=True)
        loop(model, 3, scaler=disabled)
    s = doctor.session
    assert s.findings == [] and s.scaler is not None and not s.scaler.enabled


def test_backward_in_autocast() -> None:
    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=2) as doctor:
        loop(model, 3, backward_in_autocast=True)
    f = only(doctor.session, "backward_in_autocast")
    assert f.severity == "warning" and f.count == 3
    assert "(device cpu, dtype float16) in 3 step(s), first at step 0" in f.message
    assert "outside the autocast block" in f.advice
    assert torch.is_autocast_enabled("cuda") is False  # asked on a CPU-only build: no error


# ---------------------------------------------------------------------------
# Which scalers are observed
# ---------------------------------------------------------------------------


def test_deprecated_cuda_spelling_on_cpu_is_disabled_and_quiet() -> None:
    torch.manual_seed(0)
    model = MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.cuda.amp.GradScaler()
    assert not scaler.is_enabled()  # no CUDA here: torch disables it
    with amp_doctor.watch(model, every=2) as doctor:
        loop(model, 4, scaler=scaler)
    s = doctor.session
    assert s.steps == 4 and s.scaler is not None and not s.scaler.enabled
    assert not s.amp.scaler and s.findings == []


def test_deprecated_cpu_spelling_is_fully_observed() -> None:
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.cpu.amp.GradScaler()
    assert type(scaler) is not torch.amp.GradScaler
    with amp_doctor.watch(model, every=1000) as doctor:
        seen = loop(model, 6, scaler=scaler, blowup=[3])
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps == seen["skipped"] == [3]
    assert s.scaler.events[0].culprits == ["fc2", "fc1"]
    assert scale_per_step(s) == seen["scales"]


def test_scalers_created_after_the_watch_started_are_observed() -> None:
    torch.manual_seed(0)
    model = Net()
    with amp_doctor.watch(model, every=1000) as doctor:
        seen1 = loop(model, 4, scaler=torch.amp.GradScaler("cpu"), blowup=[1])
        # A second training phase with a fresh scaler (the first one is gone).
        seen2 = loop(model, 4, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0),
                     blowup=[2])
    s = doctor.session
    assert s.steps == 8
    assert s.scaler is not None and s.scaler.backoff_steps == [1, 6]
    assert scale_per_step(s)[4:] == seen2["scales"] and seen1["scales"][1] == 32768.0


def test_explicit_scaler_is_the_only_one_observed() -> None:
    torch.manual_seed(0)
    a, b = MLP(), Net()
    sa, sb = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    oa = torch.optim.SGD(a.parameters(), lr=0.01)
    ob = torch.optim.SGD(b.parameters(), lr=0.01)
    with amp_doctor.watch([a, b], every=2, scaler=sa) as doctor:
        for _ in range(4):
            b.amp.factor = 1e30
            x = torch.randn(4, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                la, lb = a(x).float().mean(), b(x).float().mean()
            sa.scale(la).backward()
            sb.scale(lb).backward()  # scaled by another scaler: not "unscaled"
            sa.step(oa)
            sb.step(ob)
            sa.update()
            sb.update()
            oa.zero_grad()
            ob.zero_grad()
    s = doctor.session
    assert sb.get_scale() == 65536.0 / 16 and sa.get_scale() == 65536.0
    assert s.steps == 4 and s.scaler is not None and s.scaler.backoff_steps == []
    assert kinds(s) == set()


def test_gan_style_two_optimizers_one_scaler() -> None:
    torch.manual_seed(0)
    gen, disc = Net(), Net()
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch({"gen": gen, "disc": disc}, every=1000) as doctor:
        for i in range(6):
            disc.amp.factor = 1e30 if i == 2 else 1.0
            gen.amp.factor = 1e30 if i == 4 else 1.0
            x = torch.randn(4, 16)
            with torch.autocast("cpu", dtype=torch.float16):
                loss_d = disc(x).float().mean()
            opt_d.zero_grad()
            scaler.scale(loss_d).backward()
            scaler.step(opt_d)
            with torch.autocast("cpu", dtype=torch.float16):
                loss_g = gen(x).float().pow(2).mean()
            opt_g.zero_grad()
            scaler.scale(loss_g).backward()
            scaler.step(opt_g)
            scaler.update()
    sc = doctor.session.scaler
    assert sc is not None and sc.backoff_steps == [2, 4]
    assert sc.skipped_by_optimizer == {"SGD#0": [2], "SGD#1": [4]}
    ev = {e.step: e for e in sc.events}
    assert ev[2].culprits == ["disc.fc2", "disc.fc1"]
    assert ev[4].culprits == ["gen.fc2", "gen.fc1"]


def test_fused_optimizer_skips_are_read_in_one_batch() -> None:
    """A fused optimizer checks for inf on the device: no host sync tells the
    skip; the flags are read once, when the session is built (beside the run's one read
    of its end-of-run counts: every step's batch is checked)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    with amp_doctor.watch(model, every=1000) as doctor:
        seen = loop(model, 10, scaler=scaler, opt=opt, blowup=[4, 5])
        syncs = host_syncs()
    s = doctor.session
    assert host_syncs() == syncs + 2
    sc = s.scaler
    assert sc is not None and sc.backoff_steps == sc.skipped_steps == [4, 5]
    assert sc.skipped_by_optimizer == {"AdamW#0": [4, 5]}
    assert scale_per_step(s) == seen["scales"]
    assert sc.growth_steps == [2, 8]


def test_everything_patched_is_restored() -> None:
    import torch.nn.utils as nnu
    import torch.nn.utils.clip_grad as cg
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    def snapshot() -> dict[str, Any]:
        out = {f"GradScaler.{m}": vars(torch.amp.GradScaler)[m]
               for m in ("scale", "unscale_", "step", "update")}
        out.update({
            "cg._clip_grads_with_norm_": cg._clip_grads_with_norm_,
            "cg._group": cg._group_tensors_by_device_and_dtype,
            "nnu.clip_grads_with_norm_": nnu.clip_grads_with_norm_,
            "LRScheduler.step": vars(LRScheduler)["step"],
            "ReduceLROnPlateau.step": vars(ReduceLROnPlateau)["step"],
            "backward": torch.autograd.backward,
            "cuda.GradScaler": dict(vars(torch.cuda.amp.GradScaler)),
        })
        return out

    before = snapshot()
    model = MLP()
    with amp_doctor.watch(model, every=1):
        assert patches_installed() and snapshot() != before
        loop(model, 2, clip="right")
    assert not patches_installed() and snapshot() == before


def test_missing_scaler_on_layers_whose_gradients_arrive_flushed_to_zero() -> None:
    """The gradient underflows float16 at a tiny-init head; the layers before it
    get exact zeros (not subnormals) and are named as well."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
    head = nn.Linear(32, 64)
    with torch.no_grad():
        head.weight.normal_(0, 1e-4)
        head.bias.zero_()
    model = nn.Sequential(body, head)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    teacher = 0.01 * torch.randn(16, 64, generator=g)
    zero_frac = []
    with amp_doctor.watch(model, every=1) as doctor:
        for _ in range(3):
            x = torch.randn(64, 16, generator=g)
            y = x @ teacher
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            zero_frac.append(float((body[0].weight.grad == 0).float().mean()))
            opt.step()
    assert min(zero_frac) > 0.9  # the symptom, seen by the loop itself
    s = doctor.session
    by_module = {f.module: f for f in s.findings_of("missing_scaler")}
    assert "1" in by_module and "0.0" in by_module, list(by_module)
    f = by_module["0.0"]
    lay = s.layer("0.0")
    assert f"{100 * lay.grad_zero_frac:.3g}% of its output-gradient values are exactly zero" \
        in f.message
    assert "underflowed float16 in 1 (" in f.message and "no GradScaler is in use" in f.message


def _penalty_run(kw: dict[str, Any] | None) -> tuple[list[float], list[torch.Tensor], Any]:
    """PyTorch's AMP recipe for a gradient penalty: the gradients of the scaled loss
    (``torch.autograd.grad``, ``create_graph=True``), unscaled by hand. In the scaler's
    first steps they overflow, the penalty is inf and GradScaler skips the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    doctor = amp_doctor.watch(model, tensorboard=False, **kw) if kw is not None else None
    losses = []
    try:
        for _ in range(8):
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()),
                                        create_graph=True)
            inv = 1.0 / scaler.get_scale()
            with torch.autocast("cpu", dtype=torch.float16):
                total = loss + sum((g * inv).pow(2).sum() for g in grads).sqrt()
            opt.zero_grad()
            scaler.scale(total).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(total.item())
    finally:
        if doctor is not None:
            doctor.close()
    return losses, [p.detach().clone() for p in model.parameters()], doctor


@pytest.mark.parametrize("kw", [{}, {"every": 1}, {"on_nonfinite": "raise"}],
                         ids=["default", "every=1", "raise"])
def test_the_gradient_penalty_recipe_calibrates_without_findings(kw: dict[str, Any]) -> None:
    # Before: raise mode stopped this healthy run at step 0 (the scaled gradients'
    # overflow in torch.autograd.grad was not known to be a scaled backward); record
    # modes gave a nonfinite_loss error and a scaler_backoff warning for the calibration.
    plain_losses, plain_params, _ = _penalty_run(None)
    assert math.isinf(plain_losses[0]) and all(map(math.isfinite, plain_losses[1:]))
    losses, params, doctor = _penalty_run(kw)
    assert str(losses) == str(plain_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    s = doctor.session
    assert [f.kind for f in s.findings if f.severity != "info"] == []
    assert "while calibrating" in s.findings_of("scaler_backoff")[0].message


def test_a_high_init_scale_calibrating_down_is_not_a_collapse() -> None:
    # GradScaler(init_scale=2**32), Megatron-LM's default: it halves 13 times and settles
    # above the default 2**16. Before: scale_collapse (an error, "do not just lower
    # init_scale") and a warning blaming the last layer.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                      nn.Linear(64, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 32, growth_interval=20)
    with amp_doctor.watch(m, tensorboard=False) as doctor:
        _train_classifier(m, scaler, 60, 32, torch.Generator().manual_seed(0))
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps[:13] == list(range(13))
    assert scaler.get_scale() > 2.0 ** 16
    assert not s.findings_of("scale_collapse")
    assert [f.kind for f in s.findings if f.severity == "error"] == []
    info = next(f for f in s.findings_of("scaler_backoff") if f.severity == "info")
    assert "13 while calibrating at the start (steps 0-12, scale 4294967296 -> 524288)" \
        in info.message


def test_one_more_backoff_after_calibration_is_not_called_part_of_the_start() -> None:
    """Calibration at steps 0-2, then one backoff at step 14 before any growth: as designed
    (the calibrated scale was just too high for a later batch), but it read "4 while
    calibrating at the start (steps 0-2, 14)" after 11 clean steps (review 42a)."""
    torch.manual_seed(0)
    model = Net()
    with amp_doctor.watch(model, every=5) as doctor:
        seen = loop(model, 20, blowup=[0, 1, 2, 14])
    assert seen["skipped"] == [0, 1, 2, 14]
    (b,) = doctor.session.findings_of("scaler_backoff")
    assert b.severity == "info"
    assert ("backed off 4x as designed: 3 while calibrating at the start (steps 0-2, scale "
            "65536 -> 8192); 1 more at step 14, before the scale ever grew: the calibrated "
            "scale was just too high for a later batch (scale 8192 -> 4096)") in \
        " ".join(b.message.split())


def test_short_backoff_episodes_at_a_high_scale_are_info_and_a_falling_scale_warns() -> None:
    # growth_interval 3: growth at step 2 (65536 -> 131072); step 3 undoes it (a probe);
    # step 5 halves the scale once more, and steps 9-10 twice after the growth at 8: short
    # episodes that leave the scale high, GradScaler settling where the gradients fit.
    # Before, each was a warning advising float32 layers or bfloat16 (review 34).
    torch.manual_seed(0)
    model = Net()
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        seen = loop(model, 13, blowup=[3, 5, 9, 10], scaler=scaler)
    s = doctor.session
    assert s.scaler is not None and s.scaler.growth_steps == [2, 8]
    assert seen["skipped"] == s.scaler.backoff_steps == [3, 5, 9, 10]
    assert [f.severity for f in s.findings_of("scaler_backoff")] == ["info"]
    info = s.findings_of("scaler_backoff")[0]
    assert info.steps == [3, 5, 9, 10] and info.data["probes"] == 1
    assert info.data["settling"] == 3
    assert "1 each undoing the growth before it (step 3)" in info.message
    assert ("3 in 2 short episode(s) of at most 2 that left the scale at or above 2048, "
            "settling where the gradients fit (steps 5, 9, 10)") in info.message
    # A lone backoff in a run shorter than the default growth_interval (2000), so with no
    # growth before it: the one most runs of a few hundred steps see.
    model = Net()
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        loop(model, 20, blowup=[10], scaler=torch.amp.GradScaler("cpu"))
    assert [(f.severity, f.steps) for f in doctor.session.findings_of("scaler_backoff")] == [
        ("info", [10])]
    # Halvings that take the scale below 2048 (half the init_scale here) are a falling
    # scale, small gradients start to underflow there: one warning, with the halving
    # before it that the scale never grew back from.
    model = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=100)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        loop(model, 10, blowup=[4, 8], scaler=scaler)
    s = doctor.session
    assert [f.severity for f in s.findings_of("scaler_backoff")] == ["warning"]
    warn = s.findings_of("scaler_backoff")[0]
    assert warn.steps == [4, 8]
    assert ("backed off 2x in 2 separate episodes (steps 4, 8): the scale fell as low as "
            "1024 (from 4096 before step 4), and was 1024 at the end") in warn.message


def test_a_healthy_run_at_its_settled_scale_has_no_backoff_warning() -> None:
    # Small gradients: the scale grows to 2**20 and then oscillates between 2**18 and
    # 2**20, backing off now and then a few steps after a growth, not only right after.
    # Before, those lone backoffs were a warning advising float32 layers or bfloat16.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    scaler = torch.amp.GradScaler("cpu", growth_interval=20)
    with amp_doctor.watch(m, tensorboard=False) as doctor:
        _train_classifier(m, scaler, 400, 64)
    s = doctor.session
    assert s.scaler is not None
    backoffs = s.scaler.backoff_steps
    assert len(backoffs) >= 8 and backoffs[0] > 20
    scales = [e.scale_after for e in s.scaler.events if e.kind == "backoff"]
    assert min(scales) >= 2.0 ** 17  # it never fell far: the gradients are small
    assert [f for f in s.findings if f.severity != "info"] == []
    info = next(f for f in s.findings_of("scaler_backoff"))
    assert info.data["settling"] >= 1 and info.steps == backoffs[:50]
    assert "settling where the gradients fit" in info.message


def _train_classifier(m: nn.Sequential, scaler: torch.amp.GradScaler, steps: int, batch: int,
                      g: torch.Generator | None = None) -> None:
    """AdamW on random inputs and labels, float16 with ``scaler``: a healthy run."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    n_in, n_out = m[0].in_features, m[-1].out_features
    for _ in range(steps):
        x = torch.randn(batch, n_in, generator=g)
        y = torch.randint(0, n_out, (batch,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_a_scale_that_underflowed_to_zero_reads_zero() -> None:
    # Review 34: a scale halved below float32's smallest subnormal is 0.0, which the
    # backoff events recorded as NaN (`x or nan`), so the messages said "-> ?" beside a
    # "final scale 0".
    torch.manual_seed(0)
    model = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** -148)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        seen = loop(model, 5, blowup=[1, 2, 3], scaler=scaler)
    assert seen["scales"][-1] == 0.0
    s = doctor.session
    assert s.scaler is not None
    afters = [e.scale_after for e in s.scaler.events if e.kind == "backoff"]
    assert afters[-2:] == [0.0, 0.0]
    text = " ".join(f.message for f in s.findings)
    assert "?" not in text and "fell to 0 " in text


def test_a_settling_backoff_before_a_failed_forward_pass_stays_info() -> None:
    # A lone backoff at step 5 (gradients just past the scale) and, hundreds of steps
    # later with the default growth_interval, a NaN loss: the NaN is no fall of the scale,
    # and the early backoff is not made part of it (review 34's attention run got a
    # warning for its steps 6-7 that way).
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for i in range(12):
            model.amp.factor = 1e30 if i == 5 else 1.0
            x = torch.randn(8, 16, generator=g)
            if i == 10:
                x[0, 0] = math.nan  # the batch itself is bad
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), torch.zeros(8).long())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.scaler is not None and s.scaler.backoff_steps == [5, 10]
    early = [f for f in s.findings_of("scaler_backoff") if 5 in f.steps]
    assert len(early) == 1 and early[0].severity == "info" and early[0].steps == [5]
