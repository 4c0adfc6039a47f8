"""The sample gallery shows its pathologies when run plainly, without amp-doctor.

Part 1 runs every sample (the scripts named in ``sample_models/expected.py``)
and checks the symptom from the numbers it prints: in-process, by calling
the script's ``main([])`` (what its ``if __name__ == "__main__"`` block
calls), and, marked slow, in a subprocess exactly as a user would
(``python sample_models/x.py``). The subprocesses start in the background
(two at a time: the machine may have two cores) when this module's first
test runs; the checks of their output are the last tests.

Part 2 imports a few samples in-process and checks *why* the symptom happens
(which module's output is non-finite, which aten op first produces inf/NaN,
which backward node turns it into NaN), and that the fix named in each
docstring removes it. It never imports amp_doctor.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_models"


def load(script: str) -> ModuleType:
    """Import a file of the gallery by path (the gallery is not a package)."""
    path = SAMPLES / script
    spec = importlib.util.spec_from_file_location(f"sample_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The acceptance table names the samples; helper files (expected.py, the
# amp-doctor runner gallery.py) are not samples.
EXPECTED: dict[str, tuple[tuple[str, str | None, str | None], ...]] = \
    load("expected.py").EXPECTED
SCRIPTS = sorted(EXPECTED)
FP16_MAX = torch.finfo(torch.float16).max
UNSCALE_FP16_MSG = "Attempting to unscale FP16 gradients."


# --------------------------------------------------------------------------
# Running the scripts and reading what they print
# --------------------------------------------------------------------------

@dataclass
class Run:
    script: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [ln for ln in self.stdout.splitlines() if ln.strip()]

    @property
    def symptom(self) -> str:
        assert self.lines, f"{self.script} printed nothing; stderr:\n{self.stderr}"
        last = self.lines[-1]
        assert last.startswith("SYMPTOM:"), f"{self.script}: last line is {last!r}"
        assert sum(ln.startswith("SYMPTOM:") for ln in self.lines) == 1
        return last

    def steps(self) -> list[dict[str, str]]:
        """The ``step=...`` lines as key -> value."""
        out = [kv(ln) for ln in self.lines if ln.startswith("step=")]
        assert out, f"{self.script} printed no step lines:\n{self.stdout}"
        return out

    def summary(self, key: str) -> dict[str, str]:
        """The first line that has ``key=``, as key -> value."""
        for ln in self.lines:
            d = kv(ln)
            if key in d:
                return d
        raise AssertionError(f"{self.script}: no line with {key}=\n{self.stdout}")

    def value(self, key: str) -> float:
        return float(self.summary(key)[key])


def kv(line: str) -> dict[str, str]:
    return dict(re.findall(r"([\w.]+)=(\S+)", line))


def fvals(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows]


def run_script(script: str) -> Run:
    # One intra-op thread each: two scripts share the two cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(SAMPLES / script)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    return Run(script, p.returncode, p.stdout, p.stderr)


def run_in_process(script: str) -> Run:
    """``main([])`` of a freshly loaded script, with what python would print and return.

    As ``python x.py`` does, an uncaught exception becomes its traceback on stderr and
    exit status 1; ``main``'s return value is the exit status (``sys.exit(main())``).
    """
    out, err = io.StringIO(), io.StringIO()
    mod = load(script)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = mod.main([])
        except Exception:
            traceback.print_exc()
            code = 1
    return Run(script, code, out.getvalue(), err.getvalue())


_PENDING: dict[str, Future[Run]] = {}


@pytest.fixture(scope="session", autouse=True)
def _start_plain_runs(request: pytest.FixtureRequest) -> Iterator[None]:
    """Start the selected scripts in the background as soon as this module's
    first test runs, so the in-process tests (which come first in this file)
    overlap with them. Two at a time: the machine may have two cores."""
    wanted = [str(item.callspec.params["script"]) for item in request.session.items
              if isinstance(item, pytest.Function)
              and item.originalname == "test_plain_run_shows_symptom"
              and not item.callspec.params["in_process"]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        for script in wanted:
            _PENDING[script] = pool.submit(run_script, script)
        yield
        for fut in _PENDING.values():
            fut.cancel()


@pytest.fixture
def runs() -> dict[str, Future[Run]]:
    return _PENDING


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """In-process tests use one intra-op thread while two scripts run beside
    them: oversubscribed OpenMP threads spin and slow everything down."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------
# Part 1: the plain symptom of each script
# --------------------------------------------------------------------------

def check_healthy(r: Run, symptom: str = "SYMPTOM: none (healthy)") -> None:
    assert r.returncode == 0, r.stderr
    assert r.symptom == symptom
    rows = r.steps()
    assert all(math.isfinite(v) for v in fvals(rows, "loss"))
    assert r.value("final_scale") >= r.value("init_scale")
    assert r.value("final_loss") < 0.7 * r.value("first_loss"), "the model should learn"


def check_grad_accumulation(r: Run) -> None:
    check_healthy(r)
    norms = fvals(r.steps(), "grad_norm")
    # clip_grad_norm_ after unscale_ sees the real, O(1) norm.
    assert all(0 < n < 100 for n in norms), norms


def check_bf16_with_scaler(r: Run) -> None:
    check_healthy(
        r, "SYMPTOM: none visible (trains fine; the GradScaler is unneeded with bfloat16)")
    assert r.value("final_scale") == r.value("init_scale") == 65536.0


def check_nan_loss_and_backoff(r: Run, bad: str) -> None:
    assert r.returncode == 0, r.stderr
    rows = r.steps()
    losses = fvals(rows, "loss")
    if bad == "nan":
        assert all(math.isnan(v) for v in losses), losses
    else:
        assert all(v == math.inf for v in losses), losses
    init, final = r.value("init_scale"), r.value("final_scale")
    # Every step backs off: 12 steps halve 65536 twelve times.
    assert final == init / 2**12 == 16.0
    assert r.symptom.startswith(f"SYMPTOM: loss is {bad} from step 0")


def check_fp16_activation_overflow(r: Run) -> None:
    check_nan_loss_and_backoff(r, "nan")


def check_log_of_underflowed_softmax(r: Run) -> None:
    check_nan_loss_and_backoff(r, "inf")
    rows = r.steps()
    assert all(row["log_probs_dtype"] == "float16" for row in rows)
    assert all(float(row["neg_inf_frac"]) > 0.1 for row in rows)


def check_eps_underflow(r: Run) -> None:
    check_nan_loss_and_backoff(r, "nan")
    rows = r.steps()
    assert all(row["norm_dtype"] == "float16" for row in rows)
    # 4 dead channels of 32 are NaN, the others finite.
    assert all(float(row["norm_nan_frac"]) == 4 / 32 for row in rows)


def check_hidden_op_overflow(r: Run) -> None:
    assert r.returncode == 0, r.stderr
    rows = r.steps()
    assert all(math.isfinite(v) for v in fvals(rows, "loss"))
    assert all(row["out_finite"] == "True" for row in rows)
    assert all(row["grads_finite"] == "False" for row in rows)
    bad = [kv(ln)["nonfinite_grads"] for ln in r.lines if "nonfinite_grads=" in ln]
    # Only the layer upstream of the activation gets NaN gradients.
    assert bad and all(b == "mlp.fc1.weight,mlp.fc1.bias" for b in bad), bad
    assert r.value("final_scale") == r.value("init_scale") / 2**12
    assert r.symptom.startswith("SYMPTOM: forward/loss finite but gradients non-finite")


def check_gradient_underflow(r: Run, scale: float | None) -> None:
    assert r.returncode == 0, r.stderr
    rows = r.steps()
    assert all(math.isfinite(v) for v in fvals(rows, "loss"))
    # The line with the zero fractions has "zero_grad_frac body.0=..." pairs.
    fp16 = [kv(ln) for ln in r.lines if "zero_grad_frac " in ln and ln.startswith("step=")]
    assert all(float(d["body.0"]) > 0.95 and float(d["body.2"]) > 0.9 for d in fp16), fp16
    ref = kv(next(ln for ln in r.lines if ln.startswith("fp32_zero_grad_frac_step0")))
    assert all(float(v) == 0.0 for v in ref.values()), ref
    if scale is not None:
        assert all(float(row["scale"]) == scale for row in rows)
    assert r.symptom.startswith("SYMPTOM: 100% of body.0 weight gradients are zero")


def check_clip_before_unscale(r: Run) -> None:
    assert r.returncode == 0, r.stderr
    rows = r.steps()
    assert all(v > 1e3 for v in fvals(rows, "clip_total_norm"))
    assert all(v < 10 for v in fvals(rows, "true_grad_norm"))
    assert all(v > 1e3 for v in fvals(rows, "update_shrink"))
    assert abs(r.value("rel_loss_change")) < 1e-3
    assert r.symptom.startswith("SYMPTOM: clip_grad_norm_ saw scaled gradients")


def check_scale_collapse(r: Run) -> None:
    assert r.returncode == 0, r.stderr
    rows = r.steps()
    assert all(math.isfinite(v) for v in fvals(rows, "loss"))
    scales = fvals(rows, "scale")
    assert all(b == a / 2 for a, b in zip(scales, scales[1:], strict=False)), scales
    assert r.value("final_scale") < 1.0
    assert r.summary("final_scale")["skipped"] == "20/20"
    assert r.symptom.startswith("SYMPTOM: scale collapsed from 65536 to 0.0625")


def check_half_params(r: Run) -> None:
    assert r.returncode == 1
    assert r.symptom == f"SYMPTOM: ValueError: {UNSCALE_FP16_MSG}"
    assert f"ValueError: {UNSCALE_FP16_MSG}" in r.stderr
    row = r.steps()[0]
    assert row["grad_dtype"] == "torch.float16" and math.isfinite(float(row["loss"]))


def check_activation_underflow(r: Run) -> None:
    assert r.returncode == 0, r.stderr
    rows = r.steps()
    assert all(math.isfinite(v) for v in fvals(rows, "loss"))
    assert all(row["ls_dtype"] == "float16" for row in rows)
    assert float(rows[0]["below_normal_frac"]) == 1.0
    assert r.value("mean_below_normal_frac") > 0.9
    assert r.value("step0_zero_frac") > 0.05
    assert r.value("step0_rel_err") > 0.05
    assert r.value("final_scale") == r.value("init_scale")
    assert re.match(r"SYMPTOM: \d+% of blocks\.0\.ls float16 outputs were below", r.symptom)


CHECKS: dict[str, Callable[[Run], None]] = {
    "healthy_cnn.py": check_healthy,
    "healthy_transformer.py": check_healthy,
    "grad_accumulation.py": check_grad_accumulation,
    "bf16_with_scaler.py": check_bf16_with_scaler,
    "fp16_activation_overflow.py": check_fp16_activation_overflow,
    "hidden_op_overflow.py": check_hidden_op_overflow,
    "gradient_underflow_no_scaler.py": lambda r: check_gradient_underflow(r, None),
    "gradient_underflow_low_init_scale.py": lambda r: check_gradient_underflow(r, 1.0),
    "activation_underflow.py": check_activation_underflow,
    "log_of_underflowed_softmax.py": check_log_of_underflowed_softmax,
    "eps_underflow.py": check_eps_underflow,
    "clip_before_unscale.py": check_clip_before_unscale,
    "scale_collapse.py": check_scale_collapse,
    "half_params_with_scaler.py": check_half_params,
}


def test_every_script_is_checked_and_in_the_table() -> None:
    expected = load("expected.py")
    # A sample is a script that prints a SYMPTOM line.
    on_disk = {p.name for p in SAMPLES.glob("*.py") if "SYMPTOM:" in p.read_text()}
    assert on_disk == set(SCRIPTS)
    assert set(CHECKS) == set(SCRIPTS)
    for findings in expected.EXPECTED.values():
        for kind, module, op in findings:
            assert kind in expected.KINDS
            assert module is None or isinstance(module, str)
            assert op is None or op.startswith("aten.")


# --------------------------------------------------------------------------
# Part 2: why it happens, in-process
# --------------------------------------------------------------------------

CPU = torch.device("cpu")


def nonfinite(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and \
        not bool(torch.isfinite(t).all())


class FirstNonfinite(TorchDispatchMode):
    """Records, in order, the (module, aten op) pairs whose output is inf/NaN
    although all their inputs were finite: where a non-finite value is born."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.origins: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins = tree_leaves((args, kwargs or {}))
        if any(nonfinite(t) for t in tree_leaves(out)) and not any(nonfinite(t) for t in ins):
            name = func.overloadpacket.__name__
            self.origins.append((self.stack[-1] if self.stack else "", f"aten.{name}"))
        return out


@contextmanager
def watch_origins(model: torch.nn.Module) -> Iterator[FirstNonfinite]:
    names = {id(m): n for n, m in model.named_modules()}
    mode = FirstNonfinite()

    def enter(mod: torch.nn.Module, _inp: Any) -> None:
        mode.stack.append(names[id(mod)])

    def leave(_mod: torch.nn.Module, _inp: Any, _out: Any) -> None:
        mode.stack.pop()  # a forward hook must return None, or it replaces the output

    hooks = []
    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(enter))
        hooks.append(m.register_forward_hook(leave))
    try:
        with mode:
            yield mode
    finally:
        for h in hooks:
            h.remove()


def outputs_by_module(model: torch.nn.Module, fn: Callable[[], Any]) -> dict[str, torch.Tensor]:
    outs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(
        lambda _mod, _inp, out, n=n: outs.__setitem__(n, out.detach().clone()))
        for n, m in model.named_modules() if n]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return outs


def fp16(enabled: bool = True, dtype: torch.dtype = torch.float16) -> Any:
    return torch.autocast("cpu", dtype=dtype, enabled=enabled)


def test_fp16_activation_overflow_is_proj() -> None:
    mod = load("fp16_activation_overflow.py")
    torch.manual_seed(0)
    model = mod.SensorRegressor()
    x, _ = mod.make_batch(CPU, 64)

    def fwd(dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        def run() -> None:
            with fp16(dtype is not None, dtype or torch.float16):
                model(x)
        return outputs_by_module(model, run)

    half, bf16, full = fwd(torch.float16), fwd(torch.bfloat16), fwd(None)
    # Before proj everything is finite; proj's float16 output has inf.
    assert torch.isfinite(half["inp"]).all() and torch.isfinite(half["act"]).all()
    assert half["proj"].dtype == torch.float16 and torch.isinf(half["proj"]).any()
    assert torch.isnan(half["head"]).any()
    # float32 and bfloat16: the same values are finite, and beyond float16's max.
    assert torch.isfinite(full["proj"]).all() and full["proj"].abs().max() > 2 * FP16_MAX
    assert torch.isfinite(bf16["proj"]).all() and torch.isfinite(bf16["head"]).all()
    # The op that overflows is proj's matmul.
    with watch_origins(model) as w, fp16():
        model(x)
    assert w.origins[0] == ("proj", "aten.addmm")


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.filterwarnings("ignore:Error detected in PowBackward0")
def test_hidden_op_overflow_internals() -> None:
    mod = load("hidden_op_overflow.py")
    torch.manual_seed(0)
    model = mod.OutlierNet()
    x, y = mod.make_batch(CPU, 64)
    act_in: list[torch.Tensor] = []
    h = model.mlp.act.register_forward_pre_hook(lambda _m, inp: act_in.append(inp[0].detach()))
    with watch_origins(model) as w, fp16():
        pred = model(x)
        loss = torch.nn.functional.mse_loss(pred, y)
    h.remove()
    # The module gets float16, x**3 overflows inside it, its output is finite.
    assert act_in[0].dtype == torch.float16
    assert torch.isinf(torch.pow(act_in[0], 3.0)).any()
    outs = outputs_by_module(model, lambda: _fwd_fp16(model, x))
    assert torch.isfinite(outs["mlp.act"]).all() and torch.isfinite(pred).all()
    assert w.origins and w.origins[0] == ("mlp.act", "aten.pow")
    assert all(m == "mlp.act" for m, _ in w.origins)
    # Backward: the NaN is born in pow's backward (0 * inf), only fc1 is hit.
    (loss * 65536.0).backward()
    bad = {n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()}
    assert bad == {"mlp.fc1.weight", "mlp.fc1.bias"}
    model.zero_grad()
    with fp16():
        loss = torch.nn.functional.mse_loss(model(x), y)
    with pytest.raises(RuntimeError, match="PowBackward0"), torch.autograd.detect_anomaly():
        loss.backward()


def _fwd_fp16(model: torch.nn.Module, x: torch.Tensor) -> None:
    with fp16():
        model(x)


def test_log_of_underflowed_softmax_origin_is_log() -> None:
    mod = load("log_of_underflowed_softmax.py")
    torch.manual_seed(0)
    model = mod.PrototypeClassifier()
    x, _ = mod.make_batch(CPU, 64)
    with watch_origins(model) as w, fp16():
        out = model(x)
    # CPU autocast keeps softmax in float16: its zeros are the underflow, log makes -inf.
    assert out.dtype == torch.float16 and torch.isneginf(out).any()
    assert w.origins[0] == ("head", "aten.log")
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()  # float32: finite


def test_eps_underflow_origin_is_div() -> None:
    mod = load("eps_underflow.py")
    torch.manual_seed(0)
    model = mod.DeadUnitNet()
    x, _ = mod.make_batch(CPU, 64)
    with watch_origins(model) as w, fp16():
        out = model(x)
    assert torch.isnan(out).all()
    assert w.origins[0] == ("norm", "aten.div")
    # The eps really vanishes in float16.
    assert (torch.zeros(1, dtype=torch.float16) + mod.EPS).item() == 0.0
    outs = outputs_by_module(model, lambda: _fwd_fp16(model, x))
    nan_cols = torch.isnan(outs["norm"]).all(dim=0)
    assert nan_cols[: mod.N_DEAD].all() and not nan_cols[mod.N_DEAD:].any()


def test_scale_collapse_culprit_is_head() -> None:
    mod = load("scale_collapse.py")
    torch.manual_seed(0)
    model = mod.PriceRegressor()
    x, y = mod.make_batch(CPU, 64)
    with fp16():
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
    assert math.isfinite(loss.item())
    # At the run's final scale only head's gradients still overflow.
    (loss * 0.0625).backward()
    bad = {n.split(".")[0] for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()}
    assert bad == {"head"}


def test_activation_underflow_in_both_blocks() -> None:
    mod = load("activation_underflow.py")
    torch.manual_seed(0)
    model = mod.ResMLP()
    x, _ = mod.make_batch(CPU, 64)
    outs = outputs_by_module(model, lambda: _fwd_fp16(model, x))
    tiny = torch.finfo(torch.float16).tiny
    for name in ("blocks.0.ls", "blocks.1.ls"):
        assert outs[name].dtype == torch.float16
        assert (outs[name].abs() < tiny).float().mean() == 1.0
    # Out of place, x * gamma promotes to float32: no underflow.
    torch.manual_seed(0)
    model = mod.ResMLP(inplace=False)
    outs = outputs_by_module(model, lambda: _fwd_fp16(model, x))
    assert outs["blocks.0.ls"].dtype == torch.float32


@pytest.mark.parametrize(("script", "args"), [
    ("fp16_activation_overflow.py", ["--dtype", "bfloat16", "--steps", "3"]),
    ("fp16_activation_overflow.py", ["--dtype", "float32", "--steps", "3"]),
    ("hidden_op_overflow.py", ["--dtype", "bfloat16", "--steps", "3"]),
    ("log_of_underflowed_softmax.py", ["--dtype", "bfloat16", "--steps", "3"]),
    ("eps_underflow.py", ["--dtype", "float32", "--steps", "3"]),
    ("eps_underflow.py", ["--dtype", "bfloat16", "--steps", "3"]),
    ("scale_collapse.py", ["--dtype", "bfloat16", "--steps", "3"]),
    ("clip_before_unscale.py", ["--fixed", "--steps", "10"]),
    ("gradient_underflow_low_init_scale.py", ["--init-scale", "65536", "--steps", "3"]),
    ("activation_underflow.py", ["--no-inplace", "--steps", "3"]),
    ("healthy_transformer.py", ["--dtype", "bfloat16", "--steps", "3"]),
])
def test_the_documented_fix_removes_the_symptom(
        script: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert load(script).main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("SYMPTOM: none"), lines[-1]


def test_healthy_exports_for_benchmarks() -> None:
    for script in ("healthy_cnn.py", "healthy_transformer.py"):
        mod = load(script)
        model = mod.make_model(CPU)
        x, y = mod.make_batch(CPU, 4)
        with fp16():
            loss = mod.loss_fn(model(x), y)
        assert loss.dim() == 0 and math.isfinite(loss.item())


# --------------------------------------------------------------------------
# Last in the file, so that the in-process tests above run while the
# scripts run in the background.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("in_process", [
    pytest.param(True, id="in-process"),
    pytest.param(False, id="subprocess", marks=pytest.mark.slow)])
@pytest.mark.parametrize("script", SCRIPTS)
def test_plain_run_shows_symptom(script: str, in_process: bool,
                                 runs: dict[str, Future[Run]]) -> None:
    CHECKS[script](run_in_process(script) if in_process else runs[script].result(timeout=300))
