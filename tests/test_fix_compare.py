"""Closing the loop: ``fix`` finds the smallest float32 set, ``compare`` shows the change,
and the format what-ifs predict another format from the recorded histograms."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_doctor
from amp_doctor.analysis.compare import compare, render
from amp_doctor.analysis.next_steps import next_steps
from amp_doctor.analysis.whatif import FORMATS, _shares, fp8_rows, whatif_findings
from amp_doctor.fix import find_fix, render_fix, snippet
from amp_doctor.records import Session
from tests.helpers import MLP, console_script, train, train_gan_two_scalers

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"


def _sample(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(sample: str, model_cls: str, fp32: tuple[str, ...] = (), steps: int = 10,
         dtype: torch.dtype = torch.float16, anomaly: bool = False,
         target_dtype: str | None = None) -> Session:
    """A sample's training loop, in process, under watch(every=1)."""
    s = _sample(sample)
    torch.manual_seed(0)
    model = getattr(s, model_cls)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    with amp_doctor.watch(model, every=1, fp32=fp32, anomaly=anomaly,
                          target_dtype=target_dtype) as doctor:
        for _ in range(steps):
            x, y = s.make_batch(torch.device("cpu"), 64)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_compare_shows_the_fix_resolving_the_errors() -> None:
    before = _run("fp16_activation_overflow", "SensorRegressor")
    after = _run("fp16_activation_overflow", "SensorRegressor", fp32=("proj",))
    c = compare(before, after, "before", "after")
    resolved = {(d.kind, d.severity_a) for d in c.resolved}
    # The one error (the overflow at proj; the collapse is folded into it) is resolved.
    assert ("activation_overflow", "error") in resolved
    assert c.a.errors >= 1 and c.b.errors == 0
    assert not [d for d in c.new if d.severity == "error"]
    assert c.a.backoffs == 10 and c.b.backoffs < c.a.backoffs
    assert c.a.loss_nonfinite == 10 and c.b.loss_nonfinite == 0
    assert c.b.fp32_modules == ["proj"]
    # proj now runs in float32: its headroom went from -inf (an inf in its output) to finite.
    proj = next(d for d in c.layers if d.name == "proj")
    assert proj.headroom_a == -math.inf and proj.headroom_b is not None
    assert math.isfinite(proj.headroom_b)
    # Its figures after are a what-if (float32 outputs judged against float16), marked as
    # the report marks them; its grad underflow is the report's column (review 36).
    assert (proj.what_if_a, proj.what_if_b) == (False, True)
    lay_b = after.layer("proj")
    assert proj.grad_underflow_b == lay_b.param_grad_underflow_frac
    # A layer that put out nothing but inf/NaN before reads -inf, not "inf" (absmax 0).
    for d in c.layers:
        lay_a = before.layer(d.name)
        if lay_a.nonfinite_steps and lay_a.absmax == 0:
            assert d.headroom_a == -math.inf
    text = render(c)
    assert text.startswith("From before to after: ")
    assert "error(s) resolved" in text and "proj" in text
    md = render(c, "markdown")
    assert "| resolved" in md
    data = json.loads(render(c, "json"))
    assert data["b"]["fp32_modules"] == ["proj"]
    assert {d["status"] for d in data["findings"]} >= {"resolved"}


def test_compare_says_when_the_runs_are_of_different_models_or_scripts() -> None:
    # A Linear "0" against a Conv2d "0" was paired by name without a word, and two
    # unrelated runs read "1 error(s) resolved" (review 38).
    import dataclasses

    from torch import nn

    def run(model: nn.Module, script: str, x: torch.Tensor) -> Session:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        s = doctor.session
        return dataclasses.replace(s, run=dataclasses.replace(s.run,
                                                              command=["python", script]))

    torch.manual_seed(0)
    a = run(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), "mlp.py",
            torch.randn(4, 8))
    b = run(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten()), "cnn.py",
            torch.randn(4, 1, 5, 5))
    c = compare(a, b, "mlp", "cnn")
    assert c.different_models and c.retyped == ["0 (Linear -> Conv2d)", "2 (Linear -> Flatten)"]
    text = render(c)
    assert "mlp and cnn name 2 layers alike that are of different types (0 (Linear -> " \
           "Conv2d), 2 (Linear -> Flatten)): they are different models" in " ".join(text.split())
    assert "the runs come from different scripts (python mlp.py; python cnn.py)" in text
    same = compare(a, a, "x", "y")
    assert not same.different_models and same.scripts is None and not same.retyped
    assert "Note:" not in render(same)


def test_compare_follows_a_second_gradscaler() -> None:
    # A GAN with a GradScaler per network, run with the generator's overflow and without
    # it. Before, compare read the first scaler alone: "no change", and the generator
    # scaler's backoff finding merged with the discriminator's (review 36).
    def run(boost_at: int) -> Session:
        torch.manual_seed(0)
        gen, disc = MLP(16, 32, 4), MLP(4, 32, 1)
        with amp_doctor.watch({"gen": gen, "disc": disc}, every=5, tensorboard=False) as w:
            train_gan_two_scalers(gen, disc, iters=10, boost_at=boost_at)
        return w.session

    c = compare(run(6), run(-1), "spike", "none")
    (other,) = c.a.other_scalers
    assert c.a.other_scalers[other].startswith("65536 -> 32768 (min 32768); 1 backoff / 0 growths")
    assert c.b.other_scalers[other].startswith("65536 -> 65536 (min 65536); 0 backoffs")
    (gone,) = c.resolved
    assert gone.kind == "scaler_backoff" and f"GradScaler of {other}" in gone.message
    assert [d.kind for d in c.unchanged] == ["scaler_backoff"]  # the first's, at step 0
    assert f"GradScaler of {other}" in render(c)


def test_fix_search_with_anomaly_mode_takes_the_op_level_origin() -> None:
    calls: list[tuple[str, ...]] = []

    def run(fp32: tuple[str, ...]) -> tuple[Session | None, int]:
        calls.append(fp32)
        return _run("hidden_op_overflow", "OutlierNet", fp32=fp32, steps=6, anomaly=True), 0

    result = find_fix(run, max_trials=10)
    assert result.deterministic
    assert calls == [(), (), ("mlp.act",)]  # baseline, its repeat, the named origin
    assert result.best is not None and result.best.fp32 == ("mlp.act",)
    text = render_fix(result)
    assert "Smallest fix found: keep mlp.act in float32" in text
    assert "0 of the model's 3 matmul/convolution layers" in text
    assert "keep_in_float32(model.get_submodule(name))" in text


def test_fix_search_without_anomaly_mode_takes_the_named_culprit() -> None:
    """Without anomaly mode the errors name mlp.fc1, whose weights get the NaN gradients.
    Forcing it is a real fix too: its float32 output keeps mlp.act's pow in float32."""
    def run(fp32: tuple[str, ...]) -> tuple[Session | None, int]:
        return _run("hidden_op_overflow", "OutlierNet", fp32=fp32, steps=6), 0

    result = find_fix(run, max_trials=10)
    assert result.baseline.errors and not result.baseline.ok
    assert result.best is not None and result.best.fp32 == ("mlp.fc1",)
    assert result.best.skipped == 0 and result.best.final_loss is not None
    assert "1 of the model's 3 matmul/convolution layers" in render_fix(result)


def test_fix_snippet_applies_the_same_fix_in_plain_torch() -> None:
    code = snippet(["proj"], "cpu", ["SensorRegressor"])
    s = _sample("fp16_activation_overflow")
    torch.manual_seed(0)
    model = s.SensorRegressor()
    exec(code, {"model": model})  # noqa: S102 - the snippet is ours, the point is to run it
    x, _ = s.make_batch(torch.device("cpu"), 64)
    with torch.autocast("cpu", dtype=torch.float16):
        h = model.proj(model.act(model.inp(x)))
        out = model(x)
    assert h.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.slow
def test_fix_cli_on_the_overflow_sample(tmp_path: Path) -> None:
    out = tmp_path / "fix.json"
    proc = subprocess.run(
        [console_script(), "fix", "--json", str(out), "--stop-after", "6", "--trials", "4",
         str(SAMPLES / "fp16_activation_overflow.py")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Smallest fix found: keep proj in float32" in proc.stdout
    # The commands to check it are complete (not "compare BEFORE AFTER"; review 36).
    sample = SAMPLES / "fp16_activation_overflow.py"
    assert f"amp-doctor diagnose --logdir runs/after --fp32 proj {sample}" in proc.stdout
    assert "amp-doctor compare runs/before runs/after" in proc.stdout
    result = json.loads(out.read_text())
    assert result["best"] == ["proj"] and result["deterministic"]
    assert result["baseline"]["errors"] and result["trials"][-1]["ok"]


def test_diagnose_points_to_the_next_step_and_a_fp32_run_is_not_told_to_keep_it(
        tmp_path: Path) -> None:
    # The report never named --fp32, fix or --anomaly; and under --fp32 proj, proj's own
    # finding still advised wrapping it in float32 (review 38).
    sample = SAMPLES / "fp16_activation_overflow.py"
    proc = subprocess.run([console_script(), "diagnose", "--logdir",
                           str(tmp_path / "a"), str(sample)],
                          capture_output=True, text=True, timeout=300)
    nexts = [ln for ln in proc.stderr.splitlines() if ln.startswith("amp-doctor: next:")]
    assert nexts == [
        f"amp-doctor: next: try proj in float32 without editing the code: amp-doctor "
        f"diagnose --fp32 proj {sample}",
        f"amp-doctor: next: or search the smallest such set of layers: amp-doctor fix "
        f"{sample}",
        "amp-doctor: next: to name the op and the line that made the first inf/NaN: "
        f"amp-doctor diagnose --anomaly {sample}"]
    # The report file ends with them too (review 52b: on the terminal only, they scrolled
    # away), and `amp-doctor report` renders that file again from the JSON.
    text = (tmp_path / "a" / "report.txt").read_text()
    assert text.endswith("\nNext:\n" + "".join(
        "- " + ln.removeprefix("amp-doctor: next: ") + "\n" for ln in nexts))
    again = subprocess.run([console_script(), "report", str(tmp_path / "a")],
                           capture_output=True, text=True, timeout=300)
    assert again.stdout == text
    # And TensorBoard's TEXT tab, below the findings, each command set in code.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "a"))
    acc.Reload()
    (md,) = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("findings/text_summary")]
    assert "**Next**" in md and (
        f"- try proj in float32 without editing the code: `amp-doctor diagnose --fp32 proj "
        f"{sample}`") in md, md
    fixed = subprocess.run([console_script(), "diagnose", "--no-tensorboard", "--logdir",
                            str(tmp_path / "b"), "--fp32", "proj", str(sample)],
                           capture_output=True, text=True, timeout=300)
    # Not told to keep it, nor to try it again: what it changed (review 52a: a --fp32 run
    # that removed the errors said nothing more).
    # The run it came from is named: the newest other run of the same command beside it,
    # without --fp32, with errors (run a).
    nexts = [ln for ln in fixed.stderr.splitlines() if ln.startswith("amp-doctor: next:")]
    assert nexts == ["amp-doctor: next: no errors with proj in float32; to see what that "
                     "changed against the run before it: amp-doctor compare "
                     f"{tmp_path / 'a'} {tmp_path / 'b'}"]
    again = subprocess.run([console_script(), "report", str(tmp_path / "b")],
                           capture_output=True, text=True, timeout=300)
    assert again.stdout == (tmp_path / "b" / "report.txt").read_text()
    # Without the folders (TensorBoard's card), placeholders say what goes there.
    assert next_steps(Session.load(tmp_path / "b" / "amp_doctor.json")) == [
        "amp-doctor: next: no errors with proj in float32; to see what that changed against "
        "the run before it: amp-doctor compare <the folder of the run before> "
        "<this run's folder>"]
    # This run known, the one before it not found beside it (run with a --logdir of its
    # own): the placeholder says which folder goes there (review 57g).
    (alone,) = next_steps(Session.load(tmp_path / "b" / "amp_doctor.json"),
                          here=str(tmp_path / "b"))
    assert alone.endswith(f"compare <the folder of the run before> {tmp_path / 'b'} (no "
                          "earlier run of this command was found beside this one: give the "
                          "folder it was written to, its --logdir)")
    assert (tmp_path / "b" / "report.txt").read_text().endswith(
        "\nNext:\n- " + nexts[0].removeprefix("amp-doctor: next: ") + "\n")
    compared = subprocess.run([console_script(), "compare", str(tmp_path / "a"),
                               str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0
    assert compared.stdout.startswith("From a to b: 1 error(s) resolved, 0 new"), compared.stdout
    (f,) = [f for f in Session.load(tmp_path / "b" / "amp_doctor.json").findings
            if f.module == "proj" and f.kind == "activation_overflow"]
    assert f.severity == "info" and "ran in float32 by --fp32" in f.message
    assert f.advice.startswith("It ran in float32 here only because --fp32")


def test_fix_on_a_healthy_script_that_fails_on_its_own_says_so_and_searches_nothing(
        tmp_path: Path) -> None:
    # Before: any non-zero exit was taken for an AMP error: a search over every layer,
    # "No set of float32 layers removed every error" with bfloat16 advice, and the
    # script's own error was never shown.
    script = tmp_path / "evals.py"
    script.write_text(
        "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "scaler = torch.amp.GradScaler('cpu')\n"
        "for _ in range(3):\n"
        "    with torch.autocast('cpu', dtype=torch.float16):\n"
        "        loss = model(torch.randn(4, 8)).float().pow(2).mean()\n"
        "    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()\n"
        "raise FileNotFoundError('val.csv: evaluation data missing')\n")
    proc = subprocess.run([console_script(), "fix", str(script)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1
    assert ("The baseline has no AMP error finding, but the script itself failed (exit code 1: "
            "FileNotFoundError: val.csv: evaluation data missing)") in proc.stdout
    assert "No set of float32 layers" not in proc.stdout
    assert proc.stderr.count("amp-doctor fix: float32 [") == 1  # the baseline alone


def test_fix_trials_leave_the_users_files_alone_and_name_the_warnings(tmp_path: Path) -> None:
    # Each trial is a real run of the script: before, in the user's folder, so a trial
    # overwrote their checkpoint and appended to their log (review 36). The trials now
    # run in a copy of the folder. A run whose problems are warnings (here gradients
    # underflowing a GradScaler started at 1, partly: no layer starved of every gradient)
    # was "nothing to fix".
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("16\n")  # read by a relative path
    (tmp_path / "ckpt.pt").write_bytes(b"the user's 60-step checkpoint")
    (tmp_path / "train.log").write_text("run 1\n")
    (tmp_path / "train.py").write_text(
        "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "d = int(open('data/x.txt').read())\n"
        "model = nn.Sequential(nn.Linear(d, 64), nn.Tanh(), nn.Linear(64, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "scaler = torch.amp.GradScaler('cpu', init_scale=1.0, growth_interval=10**6)\n"
        "for _ in range(3):  # within a trial's --stop-after: it saves and logs\n"
        "    with torch.autocast('cpu', dtype=torch.float16):\n"
        "        loss = model(torch.randn(32, d)).float().pow(2).mean() * 1e-4\n"
        "    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()\n"
        "torch.save(model.state_dict(), 'ckpt.pt')\n"
        "open('train.log', 'a').write('done\\n')\n")
    proc = subprocess.run([console_script(), "fix", "--max-steps", "4", "train.py"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ckpt.pt").read_bytes() == b"the user's 60-step checkpoint"
    assert (tmp_path / "train.log").read_text() == "run 1\n"
    assert f"the trials run in a copy of {tmp_path}" in " ".join(proc.stderr.split())
    trials = Path(proc.stderr.split("trial runs are in ")[-1].split()[0])
    assert (trials / "trial01" / "amp_doctor.json").exists()
    assert not (trials / "cwd").exists()  # the copy is removed at the end
    out = " ".join(proc.stdout.split())
    assert "nothing to fix" not in out
    assert "no float32 layer is searched for (fix removes errors). It has" in out
    assert "gradient_underflow" in out and "init_scale" in out


def test_a_trial_finds_the_script_from_the_copy_of_the_folder(tmp_path: Path) -> None:
    from amp_doctor.fix import in_scratch

    src, dst = tmp_path / "work", tmp_path / "copy"
    assert in_scratch([str(src / "a" / "train.py"), "--x"], src, dst) == [
        str(dst / "a" / "train.py"), "--x"]
    # Outside the folder: by its absolute path, which still leads there from the copy.
    outside = src / ".." / "other" / "train.py"
    assert in_scratch([str(outside)], src, dst) == [str(tmp_path / "other" / "train.py")]


def test_compare_cli_reads_two_saved_runs(tmp_path: Path) -> None:
    before = _run("fp16_activation_overflow", "SensorRegressor", steps=4)
    after = _run("fp16_activation_overflow", "SensorRegressor", fp32=("proj",), steps=4)
    before.save(tmp_path / "before" / "amp_doctor.json")
    after.save(tmp_path / "after" / "amp_doctor.json")
    proc = subprocess.run([console_script(), "compare", str(tmp_path / "before"),
                           str(tmp_path / "after"), "--format", "json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["a"]["label"] == "before" and data["b"]["label"] == "after"
    assert data["a"]["loss_nonfinite"] == 4 and data["b"]["loss_nonfinite"] == 0


def test_shares_of_a_hand_made_histogram() -> None:
    hist = [0] * 256
    hist[127 + 17] = 10  # [2**17, 2**18): beyond float16's max
    hist[127 - 20] = 30  # [2**-20, 2**-19): float16 subnormal
    hist[127 - 30] = 60  # [2**-30, 2**-29): flushed to zero in float16
    zero, sub, over = _shares(hist, FORMATS["float16"])
    assert (zero, sub, over) == (0.6, 0.3, 0.1)
    # Scaled up by 2**16 (a GradScaler), only the beyond-max values change bins.
    zero, sub, over = _shares(hist, FORMATS["float16"], 16)
    assert (zero, sub, over) == (0.0, 0.0, 0.1)


def test_bfloat16_run_predicts_the_float16_overflow() -> None:
    s = _run("fp16_activation_overflow", "SensorRegressor", dtype=torch.bfloat16, steps=6)
    (f,) = [f for f in s.findings if f.kind == "whatif_float16"]
    assert f.severity == "info" and f.module == "proj"
    row = next(r for r in f.data["rows"] if r["layer"] == "proj" and r["tensor"] == "activation")
    # The float16 run measures 28.5% of proj's outputs beyond 65504.
    assert 0.2 < row["overflow_share"] < 0.4
    # Asking for float16 as the target makes it a warning, judged from the same session.
    warned = whatif_findings(s, target="float16")
    assert [x.severity for x in warned if x.kind == "whatif_float16"] == ["warning"]
    # The advice survives the rule that a bfloat16 run is never told to use bfloat16.
    assert f.advice.startswith("Stay on bfloat16")
    # Every low-precision layer gets FP8 rows with shares in range.
    rows = fp8_rows(s)
    assert {r.layer for r in rows} >= {"proj", "head"}
    assert all(0.0 <= r.zero_share <= 1.0 and r.format in ("e4m3", "e5m2") for r in rows)


def test_compare_says_a_float16_what_if_came_true_in_the_float16_run() -> None:
    # A bfloat16 run predicts proj's overflow in float16; the float16 run has it. The
    # what-if is not "resolved" beside the new error (review 52a).
    bf16 = _run("fp16_activation_overflow", "SensorRegressor", dtype=torch.bfloat16, steps=6)
    fp16 = _run("fp16_activation_overflow", "SensorRegressor", steps=6)
    c = compare(bf16, fp16, "bf16", "fp16")
    (d,) = [d for d in c.findings if d.kind == "whatif_float16"]
    assert (d.status, d.module, d.count_a, d.count_b) == ("came true", "proj", 1, 0)
    assert not c.resolved
    assert [(d.kind, d.module) for d in c.new if d.severity == "error"] == [
        ("activation_overflow", "proj")]
    assert "came true  info" in render(c)
    # Back the other way, or beside a float16 run without errors, it is what it was.
    back = compare(fp16, bf16)
    assert [d.status for d in back.findings if d.kind == "whatif_float16"] == ["new"]
    fixed = _run("fp16_activation_overflow", "SensorRegressor", fp32=("proj",), steps=6)
    assert not [f for f in fixed.findings if f.severity == "error"]
    assert [d.status for d in compare(bf16, fixed).findings
            if d.kind == "whatif_float16"] == ["resolved"]


def _bf16_whatif_run(scaler: bool) -> Session:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", enabled=scaler)
    g = torch.Generator().manual_seed(0)
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 4, generator=g)).pow(2).mean()
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    assert doctor.session is not None
    return doctor.session


def test_the_float16_whatif_counts_a_running_scaler_once() -> None:
    # The recorded gradients already carry the run's scale (2**16 here): shifting them by
    # a float16 GradScaler's 2**16 again put all of them beyond 65504.
    plain, scaled = _bf16_whatif_run(False), _bf16_whatif_run(True)
    assert scaled.scaler is not None and scaled.scaler.enabled
    assert not [f for f in plain.findings if f.kind == "whatif_float16"]
    assert not [f for f in scaled.findings if f.kind == "whatif_float16"]
    assert whatif_findings(scaled, target="float16") == whatif_findings(plain, target="float16")


def test_healthy_bfloat16_run_has_no_whatif_finding(tmp_path: Path) -> None:
    proc = subprocess.run(
        [console_script(), "diagnose", "--quiet", "--no-tensorboard", "--every", "1",
         "--stop-after", "12", "--logdir", str(tmp_path / "run"),
         str(SAMPLES / "healthy_transformer.py"), "--dtype", "bfloat16"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    s = Session.load(tmp_path / "run" / "amp_doctor.json")
    assert s.amp.dtype == "bfloat16" and s.steps == 12  # --stop-after ended it at 12
    assert s.run.outcome == "stopped"  # by --stop-after, not by the script
    assert not [f for f in s.findings if f.kind in ("whatif_float16", "fp8_readiness")]
    assert fp8_rows(s)  # the table is there for the report, with nothing to flag


def _run_lm(fp32: tuple[str, ...], steps: int = 6) -> Session:
    s = _sample("log_of_underflowed_softmax")
    torch.manual_seed(0)
    model = s.PrototypeClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=1, fp32=fp32, anomaly=True) as doctor:
        for _ in range(steps):
            x, y = s.make_batch(torch.device("cpu"), 64)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.nll_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.session


def test_fix_prefers_a_child_that_works_over_its_parent() -> None:
    """log(softmax) in ``head``: forcing head works, and so does forcing only head.fc
    (its float32 logits keep the softmax and log in float32): the narrower one wins."""
    def run(fp32: tuple[str, ...]) -> tuple[Session | None, int]:
        return _run_lm(fp32), 0

    result = find_fix(run, max_trials=6)
    assert result.best is not None
    assert [t.fp32 for t in result.trials if t.ok][:2] == [("head",), ("head.fc",)]
    assert result.best.fp32 == ("head.fc",)


def test_compare_of_two_different_models_says_so() -> None:
    # Before: every layer listed as appeared/vanished, with no word that the runs are of
    # two different models.
    a = _run("fp16_activation_overflow", "SensorRegressor", steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    with amp_doctor.watch(model, every=1, tensorboard=False) as doctor:
        train(model, steps=2)
    c = compare(a, doctor.session, "A", "B")
    assert c.different_models and not compare(a, a).different_models
    text = render(c)
    assert "Note: A and B have no layer name in common: they are different models" in text
    assert "loss, recorded steps: first -> last (min)" in text


def test_what_if_lists_name_each_layer_apart_from_its_figures() -> None:
    # Review 40: a Sequential's layers are "0", "1", ...: "0 gradients (e5m2: ...)" read as
    # a count of gradients. Each entry is now "layer (tensors: figures)".
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        m[0].weight.mul_(3e4)  # gradients that a float16 GradScaler at 2^16 overflows
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with amp_doctor.watch(m, every=1) as doctor:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(torch.randn(16, 8)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    by_kind = {f.kind: f for f in doctor.session.findings}
    assert ("beyond float16's max (65504): layer 0 (gradients: 100%)"
            in by_kind["whatif_float16"].message)
    fp8 = by_kind["fp8_readiness"].message
    # Only the loss that applies: none to zero here, so no "0% to zero" beside it.
    assert ("tensors would lose values (to zero, or beyond the format's max in steps whose "
            "amax outran the delayed scale): layer 0 (gradients, e5m2: beyond the max in 1 "
            "step)") in fp8


def test_fix_with_one_trial_tries_one_float32_set_not_only_the_baseline_again() -> None:
    """Review 52a: `fix --trials 1` spent its one trial on the baseline's repeat, tried no
    set, and said none removed the errors "within the trial budget"."""
    calls: list[tuple[str, ...]] = []

    def run(fp32: tuple[str, ...]) -> tuple[Session | None, int]:
        calls.append(fp32)
        return _run("hidden_op_overflow", "OutlierNet", fp32=fp32, steps=6, anomaly=True), 0

    result = find_fix(run, max_trials=1)
    assert calls == [(), (), ("mlp.act",)]  # baseline, its repeat, one set
    assert result.best is not None and result.best.fp32 == ("mlp.act",)
    assert "mixed precision is off" not in render_fix(result)  # one layer of three


def test_fix_that_keeps_every_matmul_in_float32_says_mixed_precision_is_off() -> None:
    """Review 52a: a regression head's raw targets "fixed" by the whole net in float32
    read as the smallest fix, with no word that autocast no longer does anything."""
    from amp_doctor.fix import FixResult, Trial

    base = Trial((), "baseline", ("scale_collapse@net.head",), 0, 20, 1e9, 12)
    best = Trial(("net",), "parent", (), 0, 20, 0.5, 0)
    types = {"net": "Sequential", "net.fc1": "Linear", "net.act": "ReLU", "net.head": "Linear"}
    text = " ".join(render_fix(FixResult(base, [best], best, layer_types=types,
                                         models=["net"], device_type="cpu")).split())
    assert "Smallest fix found: keep net in float32" in text
    assert "2 of the model's 2 matmul/convolution layers" in text
    assert "mixed precision is off for the whole model" in text
    assert "Try the fix the diagnosis gives for the error first" in text


def test_compare_keeps_a_scale_collapse_that_moved_to_another_layer_unchanged() -> None:
    """Review 52a: with the blamed head in float32 the collapse remained, blamed on the
    layer before it: compare said "1 error(s) resolved, 1 new" (matched by module)."""
    import dataclasses

    a = _run("scale_collapse", "PriceRegressor", steps=30)
    (ca,) = a.findings_of("scale_collapse")
    assert ca.severity == "error"
    b = dataclasses.replace(a, findings=[
        dataclasses.replace(f, module="elsewhere") if f.kind == "scale_collapse" else f
        for f in a.findings])
    c = compare(a, b, "before", "after")
    (d,) = [x for x in c.findings if x.kind == "scale_collapse"]
    assert d.status == "unchanged" and d.module == f"{ca.module} -> elsewhere"
    assert "0 error(s) resolved, 0 new, 1 unchanged" in render(c)
    # A layer's own finding that moved is another layer's problem: resolved and new.
    b2 = dataclasses.replace(a, findings=[
        *a.findings, dataclasses.replace(ca, kind="activation_overflow", module="x")])
    assert [x.status for x in compare(a, b2).findings if x.kind == "activation_overflow"
            ] == ["new"]


def test_fp8_readiness_with_nothing_lost_has_no_remedy_for_losses() -> None:
    """Review 52a: the all-fine FP8 note ("keep at least 99.9% of their values") still
    advised finer scales and shorter amax windows for losses it had none of."""
    from amp_doctor.analysis.whatif import AFFECTED_SHARE

    torch.manual_seed(0)
    model = MLP()
    with amp_doctor.watch(model, every=1, tensorboard=False, target_dtype="float8") as w:
        train(model, steps=6)
    (f,) = w.session.findings_of("fp8_readiness")
    rows = f.data["rows"]
    assert rows and not any(r["zero_share"] >= AFFECTED_SHARE or r["steps_amax_beyond_scale"]
                            for r in rows)  # the all-fine case
    assert f.severity == "info" and "keep at least" in f.message
    assert f.advice.startswith("Nothing to fix for FP8 in the recorded steps")
    assert "finer scale" not in f.advice
