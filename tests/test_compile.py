"""``torch.compile`` is left as it was: same graphs, breaks, recompiles and losses.

Each test compiles for real and reads dynamo's own counters
(``torch._dynamo.utils.counters``) for a plain run and a watched run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import amp_doctor
from amp_doctor.sinks.text import layer_table
from amp_doctor.watch import Watch
from tests.helpers import MLP, console_script

STEPS = 6
# What must not change: graph breaks, graphs made, recompiles, frames compiled.
COUNTER_GROUPS = ("graph_break", "recompiles", "stats", "frames", "unimplemented")


def _counts() -> dict[str, dict[str, int]]:
    return {g: {k: v for k, v in counters[g].items()} for g in COUNTER_GROUPS
            if counters.get(g)}


def _make(how: str) -> tuple[nn.Module, nn.Module]:
    """(the module the loop calls, the module given to watch())"""
    torch.manual_seed(0)
    m = MLP()
    if how == "compile_before":
        c = torch.compile(m)
        return c, c
    if how == "compile_after":
        return m, m  # compiled after watch() starts, see _run
    if how == "method":
        m.compile()
        return m, m
    if how in ("called_once", "called_once_inner"):
        c = torch.compile(m)
        with torch.autocast("cpu", dtype=torch.float16):
            c(torch.randn(8, 16))
        return c, (m if how == "called_once_inner" else c)
    raise AssertionError(how)


def _run(how: str, watched: bool, every: int = 1, discover: bool = False, anomaly: bool = False
         ) -> tuple[list[float], dict[str, dict[str, int]], Any, list[str]]:
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, given = _make(how)
        w: Watch | None = None
        if watched:
            w = Watch(None, every=every, discover=True, anomaly=anomaly).start() if discover \
                else amp_doctor.watch(given, every=every, anomaly=anomaly)
        if how == "compile_after":
            model = torch.compile(model)
        g = torch.Generator().manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu")
        losses = []
        try:
            for _ in range(STEPS):
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(float(loss.detach()))
        finally:
            session = w.close() if w is not None else None
    msgs = sorted({str(c.message)[:120] for c in caught})
    return losses, _counts(), session, msgs


@pytest.mark.parametrize(
    "how", ["compile_before", "compile_after", "method", "called_once", "called_once_inner"])
def test_compiled_model_same_graphs_and_losses(how: str) -> None:
    plain_losses, plain_counts, _, plain_warn = _run(how, watched=False)
    losses, counts, session, warn = _run(how, watched=True)
    assert plain_counts["stats"]["unique_graphs"] >= 1  # it really compiled
    assert losses == plain_losses
    assert counts == plain_counts
    # No torch warnings caused by amp-doctor (lru_cache traced, global hooks). Import-time
    # deprecations are given once per process, so the watched run may see fewer.
    assert set(warn) <= set(plain_warn)
    assert session.recorded_steps == STEPS
    notes = [e for e in session.events if e.kind == "compiled_model"]
    assert [e.module for e in notes] == ["MLP"]
    assert "torch.compile" in notes[0].data["message"]
    # At the step it ran compiled, not the next one (review 57a: one step late).
    assert notes[0].step == 0
    # autocast inside the compiled graph is known: no false "autocast_inactive".
    assert session.amp.autocast_seen and session.amp.dtype == "float16"
    assert "autocast_inactive" not in {f.kind for f in session.findings}
    # Parameter gradients are recorded outside the graph.
    by_name = {lay.name: lay for lay in session.layers}
    assert by_name["fc1"].param_grad_absmax is not None


@pytest.mark.parametrize("how", ["compile_before", "method"])
def test_compiled_model_boundary_is_recorded(how: str) -> None:
    """The root's hooks run eagerly around the compiled forward: its output is recorded."""
    _, _, session, _ = _run(how, watched=True)
    by_name = {lay.name: lay for lay in session.layers}
    assert by_name["MLP"].calls == STEPS
    assert by_name["MLP"].recorded_steps == STEPS
    assert by_name["MLP"].output_dtypes == ["float16"]
    assert by_name["MLP"].absmax > 0
    # Inner layers ran inside the graph: not recorded as activations, and the layer
    # table says so instead of a zero output with infinite headroom (review 36).
    assert "fc1" not in by_name or by_name["fc1"].calls == 0
    if "fc1" in by_name:
        row = next(ln for ln in layer_table(session).splitlines() if ln.startswith("fc1 "))
        assert row.split()[3:7] == ["-", "-", "-", "-"] and "inf" not in row


def test_compiled_model_sampled_steps_do_not_recompile() -> None:
    """every=3 arms and disarms the sublayer hooks between steps: still no recompile."""
    plain_losses, plain_counts, _, _ = _run("compile_before", watched=False)
    losses, counts, session, _ = _run("compile_before", watched=True, every=3)
    assert losses == plain_losses
    assert counts == plain_counts
    assert session.recorded_steps == 2


def test_compiled_model_discovered_by_global_hooks() -> None:
    """The CLI's discovery mode (global module hooks) leaves the compiled model alone."""
    plain_losses, plain_counts, _, plain_warn = _run("compile_before", watched=False)
    losses, counts, session, warn = _run("compile_before", watched=True, discover=True)
    assert losses == plain_losses
    assert counts == plain_counts
    assert set(warn) <= set(plain_warn)
    assert len(session.run.models) == 1
    assert any(e.kind == "compiled_model" for e in session.events)
    assert session.layers[0].calls == STEPS  # the model's own output, recorded eagerly
    # Nothing left behind: no global hooks, OptimizedModule.__call__ restored.
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.modules.module import _has_any_global_hook

    assert not _has_any_global_hook()
    assert not hasattr(OptimizedModule.__call__, "__wrapped__")


@pytest.mark.parametrize(("how", "discover"), [("compile_before", False), ("method", False),
                                               ("compile_before", True)])
def test_anomaly_mode_leaves_the_compiled_model_alone(how: str, discover: bool) -> None:
    """Issue 13: ``--anomaly`` added graph breaks and a recompile (its global module hook
    was traced and guarded on). Module ends now come from the probes' own hooks."""
    from torch.nn.modules.module import _has_any_global_hook

    plain_losses, plain_counts, _, plain_warn = _run(how, watched=False)
    losses, counts, session, warn = _run(how, watched=True, discover=discover, anomaly=True)
    assert losses == plain_losses
    assert counts == plain_counts
    assert set(warn) <= set(plain_warn)
    assert session.recorded_steps == STEPS
    # What anomaly mode cannot do inside the graph is said in the report.
    notes = [e for e in session.events if e.kind == "compiled_model"]
    assert notes and "anomaly mode" in notes[0].data["message"]
    assert not [e for e in session.events if e.kind == "internal_error"]
    assert not _has_any_global_hook()


SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import torch
    from torch import nn
    from torch._dynamo.utils import counters

    warnings.simplefilter("always")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(8):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    keep = ("graph_break", "recompiles", "stats", "frames", "unimplemented")
    print(json.dumps({"losses": losses,
                      "counters": {g: dict(counters[g]) for g in keep if counters.get(g)}}))
""")


def test_compiled_script_through_the_cli(tmp_path: Path) -> None:
    script = tmp_path / "train_compiled.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    under = subprocess.run(
        [console_script(), "diagnose", "--every", "2", "--logdir", "out", "--no-tensorboard",
         str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert under.returncode == 0, under.stderr
    first = json.loads(plain.stdout.strip().splitlines()[0])
    second = json.loads(next(ln for ln in under.stdout.splitlines() if ln.startswith("{")))
    assert second == first  # losses and dynamo counters, exactly
    assert plain.stderr.count("Warning") == under.stderr.count("Warning")
    report = json.loads((tmp_path / "out" / "amp_doctor.json").read_text())
    kinds = [e["kind"] for e in report["events"]]
    assert "compiled_model" in kinds
    assert "autocast_inactive" not in {f["kind"] for f in report["findings"]}


def _run_compiled_step(watched: bool, every: int) -> tuple[list[float], dict[str, Any], Any]:
    """The forward and loss inside one compiled function (the model's hooks are inlined)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")

    @torch.compile
    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return nn.functional.cross_entropy(m(x).float(), y)

    w = amp_doctor.watch(m, every=every) if watched else None
    g = torch.Generator().manual_seed(0)
    losses = []
    try:
        for _ in range(STEPS):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = forward_loss(x, y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    finally:
        session = w.close() if w is not None else None
    return losses, _counts(), session


@pytest.mark.parametrize("every", [1, 3])
def test_compiled_training_function_with_the_model_inside(every: int) -> None:
    plain_losses, plain_counts, _ = _run_compiled_step(watched=False, every=every)
    losses, counts, session = _run_compiled_step(watched=True, every=every)
    assert losses == plain_losses
    assert counts == plain_counts
    # Autocast is only visible at trace time here; it is still known.
    assert session.amp.autocast_seen and session.amp.dtype == "float16"
    assert [e.module for e in session.events if e.kind == "compiled_model"] == ["MLP"]
    assert "autocast_inactive" not in {f.kind for f in session.findings}


def test_anomaly_mode_says_why_an_overflow_inside_a_compiled_graph_is_not_located() -> None:
    """The ops inside a compiled graph are not searched one by one: the per-step check
    still sees their NaN/Inf, and the report says why no op is named."""

    class Blowup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * 1e5  # past float16's max

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Blowup()
    c = torch.compile(m)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(c, anomaly=True, every=1, tensorboard=False) as doctor:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = c(torch.randn(8, 16, generator=g)).float().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    events = doctor.session.events
    unlocated = [e for e in events if e.kind == "nonfinite_unlocated"]
    assert unlocated and unlocated[0].step == 0
    assert "torch.compile" in unlocated[0].data["reason"]
    assert any(e.kind == "compiled_model" for e in events)


def test_a_graph_compiled_before_the_watch_and_reused_is_named_not_taken_for_no_autocast(
        ) -> None:
    """A model compiled and trained unwatched, then a fresh one of the same class compiled
    and watched: dynamo reuses the first graph, which has no hooks, so nothing of the
    second model is seen. That is said, not "autocast was not active" (it was)."""
    torch._dynamo.reset()

    def train(watched: bool) -> tuple[list[float], Any]:
        torch.manual_seed(0)
        # An nn.Sequential: torch's own forward, which dynamo inlines; a module with a
        # forward of its own (MLP) gets a graph of its own and its hooks run eagerly.
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        compiled = torch.compile(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        w = amp_doctor.watch(m, every=1) if watched else None
        g = torch.Generator().manual_seed(0)
        losses = []
        try:
            for _ in range(3):
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = compiled(x)
                assert out.dtype == torch.bfloat16
                loss = nn.functional.cross_entropy(out.float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        finally:
            session = w.close() if w is not None else None
        return losses, session

    plain, _ = train(False)
    losses, session = train(True)
    assert losses == plain
    kinds = [f.kind for f in session.findings]
    assert "autocast_inactive" not in kinds and "no_step_boundary" not in kinds
    (f,) = [f for f in session.findings if f.kind == "model_not_run"]
    assert f.severity == "warning" and f.data["compiled"] is True and f.data["steps"] == 3
    assert "torch._dynamo.reset()" in f.advice
    torch._dynamo.reset()


def _run_sequential(watched: bool, discover: bool) -> tuple[list[str], dict[str, Any], Any,
                                                            list[torch.Tensor]]:
    """torch.compile of a ``torch.nn`` module (nn.Sequential), whose call dynamo traces
    whole, root hooks included; a NaN in the batch at step 5, not a recorded step."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    cmodel = torch.compile(model)
    w: Watch | None = None
    if watched:
        w = Watch(None, every=10, discover=True).start() if discover \
            else amp_doctor.watch(cmodel, every=10)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    try:
        for step in range(8):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            if step == 5:
                x[3, 5] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(cmodel(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(repr(float(loss.detach())))
    finally:
        session = w.close() if w is not None else None
    return losses, _counts(), session, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("discover", [False, True])
def test_a_compiled_torch_nn_module_has_its_batch_checked(discover: bool) -> None:
    """Review 49a: dynamo traces a compiled nn.Sequential's own call, root hooks included,
    so its NaN batch went unchecked ("where it appeared is unknown"). The compile wrapper's
    hooks run eagerly: the batch is checked and the model's output recorded, with the same
    graphs, recompiles, losses and parameters as without amp-doctor."""
    plain_losses, plain_counts, _, plain_params = _run_sequential(False, discover)
    losses, counts, session, params = _run_sequential(True, discover)
    assert plain_counts["stats"]["unique_graphs"] >= 1
    assert losses == plain_losses and losses[5] == "nan"
    assert counts == plain_counts
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    errors = [(f.kind, f.module, f.step) for f in session.findings if f.severity == "error"]
    assert errors == [("nonfinite_input", "Sequential", 5)]
    by_name = {lay.name: lay for lay in session.layers}
    assert by_name["Sequential"].recorded_steps == 1  # step 0, its output
    assert by_name["Sequential"].output_dtypes == ["float16"]
    assert 0 < by_name["Sequential"].absmax < 10
