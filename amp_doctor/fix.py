"""``amp-doctor fix``: find the smallest set of float32 modules that removes every error.

Each trial is a real run of the user's script under ``amp-doctor diagnose
--every 1 --stop-after N --fp32 ...`` in a subprocess, so a trial is exactly
what the user would get by applying the fix. The search, within a budget of
trials:

1. a baseline (twice: the search relies on the script being deterministic for
   the steps it runs, and says so when it is not);
2. the culprits the baseline's error findings name; when a trial moves an error to
   a layer outside its set (the same overflow in the next block), that layer is added,
   or the next block's copy of the member it is inside;
3. their origin chain: each culprit's enclosing modules, innermost first (a container
   that is never called, a ``ModuleList``, stands for its members);
4. bisection over the model's blocks (the list of numbered siblings that holds the
   most layers);
5. once a set works, a smaller one: each member's children in its place (not the
   children of another block's copy of a member whose children did not do), and each
   member dropped in turn.

It stops at the smallest set found, prints a table of the trials, the cost
(how many layers and matmul/conv layers now run in float32) and a snippet
that applies the fix in code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

from amp_doctor.records import Finding, Session
from amp_doctor.runfiles import JSON_NAME

__all__ = ["Trial", "FixResult", "find_fix", "render_fix", "ERROR_KINDS_FIXED_BY_FP32"]

# Enough steps for a GradScaler to show a storm or a collapse (the scale falls
# 2x per skipped step) while a trial stays short.
DEFAULT_MAX_STEPS = 20
DEFAULT_TRIALS = 12
# Layers whose forward is a matmul or convolution: the expensive part of running in float32.
MATMUL_TYPES = frozenset({
    "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
    "ConvTranspose3d", "MultiheadAttention", "LSTM", "GRU", "RNN", "Conv1D",
})
# Findings a float32 island can remove; a trial succeeds when none of these is an error.
WHATIF_KINDS = frozenset({"whatif_float16", "fp8_readiness"})
ERROR_KINDS_FIXED_BY_FP32 = frozenset({
    "activation_overflow", "nonfinite_forward", "nonfinite_backward", "scaler_backoff",
    "scale_collapse", "nan_loss", "nonfinite_loss", "output_resolution", "zeroed_output",
})


@dataclass(frozen=True)
class Trial:
    fp32: tuple[str, ...]
    why: str
    errors: tuple[str, ...]  # "kind@module" of each error finding
    exit_code: int
    steps: int
    final_loss: float | None
    skipped: int
    # Why a trial without errors is still no fix (its loss ended far worse), or "".
    rejected: str = ""

    @property
    def ok(self) -> bool:
        return not self.errors and self.exit_code == 0 and not self.rejected


@dataclass
class FixResult:
    baseline: Trial
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None
    deterministic: bool = True
    budget_exhausted: bool = False
    layer_types: dict[str, str] = field(default_factory=dict)
    device_type: str = "cuda"
    models: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)  # the user's script and arguments
    # The format whose what-if warnings the search removes too (--target-dtype), or None.
    target_dtype: str | None = None
    # No float32 layer could remove the errors, so none was tried (the notes say why).
    not_searched: bool = False


Runner = Callable[[tuple[str, ...]], tuple[Session | None, int]]


def _blocking(f: Finding) -> bool:
    """An error, or a what-if warning for the format the user targets (--target-dtype)."""
    return f.severity == "error" or (f.kind in WHATIF_KINDS and f.severity == "warning")


def _ran_wide(f: Finding) -> bool:
    """An op-level error whose op ran in float32 (or wider): no float32 layer changes it."""
    from amp_doctor.analysis.advice import WIDE_FORMATS

    return (f.kind in ("nonfinite_forward", "nonfinite_backward") and f.op is not None
            and f.data.get("dtype") in WIDE_FORMATS)


# Op-level findings: the op they name ran in the model's code or, without a module, in the
# loop's own code (a loss computed outside the model).
OP_KINDS = frozenset({"nonfinite_forward", "nonfinite_backward", "activation_overflow"})


def _outside(f: Finding) -> bool:
    """An op-level error in an op outside every module of the model (the training loop's
    own code): --fp32 changes what runs inside modules only, so no float32 layer set
    reaches it (review 56b: a contrastive loss's division, searched over backbone.*)."""
    return f.kind in OP_KINDS and f.module is None and f.op is not None


def _loss_made(f: Finding) -> bool:
    """An error the loss's size made (a summed loss, the loss gradient times the scale past
    the format's max), not a layer: its finding's fix is in the loss, and a float32 set
    that removes it turns mixed precision off where the overflow passes (review 57g)."""
    return bool(f.data.get("loss_too_large"))


def _error_keys(s: Session | None) -> tuple[str, ...]:
    if s is None:
        return ("no_report",)
    return tuple(sorted(f"{f.kind}@{f.module or '-'}" for f in s.findings if _blocking(f)))


def _trial(fp32: tuple[str, ...], why: str, run: Runner) -> tuple[Trial, Session | None]:
    s, code = run(fp32)
    losses = [r.loss for r in s.history if r.loss is not None] if s else []
    return Trial(
        fp32=fp32, why=why, errors=_error_keys(s), exit_code=code,
        steps=s.steps if s else 0, final_loss=losses[-1] if losses else None,
        skipped=len(s.scaler.skipped_steps) if s and s.scaler else 0,
    ), s


def _not_searched_notes(errors: Sequence[Finding]) -> list[str]:
    """Why no float32 layer set is tried for errors no such set can change, with the line
    and the fix of each kind of them."""
    notes: list[str] = []
    wide = [f for f in errors if _ran_wide(f)]
    loss = [f for f in errors if not _ran_wide(f) and _loss_made(f)]
    outside = [f for f in errors if not _ran_wide(f) and not _loss_made(f)]
    if wide:
        ops = ", ".join(dict.fromkeys(str(f.op) for f in wide))
        notes.append(
            f"The baseline's errors are in ops that ran in float32 already ({ops}): float32 "
            f"layers cannot fix them, so none is searched for. Their fix: {wide[0].advice}")
    if loss:
        kinds = ", ".join(dict.fromkeys(f"{f.kind}" + (f" ({f.module})" if f.module else "")
                                        for f in loss))
        notes.append(
            f"The baseline's {'errors' if len(loss) > 1 else 'error'} ({kinds}) "
            f"{'come' if len(loss) > 1 else 'comes'} from the loss's size, not from a layer: "
            "the loss's gradient times the loss scale passes the format's max in whatever "
            "layer it reaches first, so no set of float32 layers is searched for (one that "
            "removed it would run every layer it passes through in float32). Fix the loss: "
            f"{loss[0].advice}")
    if outside:
        where = ", ".join(dict.fromkeys(
            f"{f.op}" + (f" at {f.frame}" if f.frame else "") for f in outside))
        notes.append(
            f"The baseline's {'errors are' if len(outside) > 1 else 'error is'} in "
            f"{'ops' if len(outside) > 1 else 'an op'} outside every module of the model, in "
            f"the training loop's own code ({where}): --fp32 runs modules in float32, so no "
            "set of float32 layers reaches it, and none is searched for. Fix it in that "
            f"code: {outside[0].advice}")
    return notes


def _parent(name: str) -> str | None:
    return name.rsplit(".", 1)[0] if "." in name else None


def _culprits(s: Session) -> list[str]:
    """Layers the error findings name, origins first, in model order."""
    names = {lay.name for lay in s.layers}
    order = {lay.name: lay.order for lay in s.layers}
    found: list[str] = []
    errors = [f for f in s.findings if _blocking(f)]
    # Op-level and forward origins before the layers a backoff lists.
    errors.sort(key=lambda f: (f.kind in ("scaler_backoff", "scale_collapse"), f.step or 0))
    for f in errors:
        cands = [f.module] if f.module else []
        for key in ("origin", "forward_origin", "culprits", "layers"):
            v = f.data.get(key)
            if isinstance(v, str):
                cands.append(v)
            elif isinstance(v, list):
                cands.extend(x for x in v if isinstance(x, str))
        rows = f.data.get("rows")
        if f.kind in WHATIF_KINDS and isinstance(rows, list):
            cands.extend(r["layer"] for r in rows if isinstance(r, dict) and "layer" in r)
        for c in cands:
            # A whole model in float32 is AMP off, not a fix (and its snippet would look
            # it up as a submodule of itself).
            if c in names and c not in found and c not in s.run.models:
                found.append(c)
    return sorted(found[:4], key=lambda n: order.get(n, 0))


def _children(s: Session, name: str) -> list[str]:
    pre = name + "."
    return [lay.name for lay in s.layers
            if lay.name.startswith(pre) and "." not in lay.name[len(pre):]]


def _blocks(s: Session) -> list[str]:
    """The model's blocks, bisected when no culprit's set removed the errors."""
    return _block_group(s)[1]


def _block_group(s: Session) -> tuple[str, list[str]]:
    """The model's blocks, and what to call them in a trial's label: the numbered siblings
    (``h.0``, ``h.1``...) that hold the most layers between them, else the root's
    children. By layers held, not by count: review 56b's two transformer blocks lost to
    the three layers of one block's MLP ``Sequential``, and the "bisection" never left it."""
    groups: dict[str, list[str]] = {}
    for lay in s.layers:
        parent, _, last = lay.name.rpartition(".")
        if last.isdigit():
            groups.setdefault(parent, []).append(lay.name)
    names = [lay.name for lay in s.layers]

    def held(members: list[str]) -> int:
        return sum(1 for n in names for m in members if n == m or n.startswith(m + "."))

    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    if groups:
        parent = max(groups, key=lambda k: (held(groups[k]), len(groups[k])))
        return parent or "the model's layers", groups[parent]
    return "the model's top-level layers", [
        lay.name for lay in s.layers if "." not in lay.name and lay.order >= 0
        and lay.name not in s.run.models]


def _span(names: Sequence[str]) -> str:
    """A trial's members in a label: one name, or the first and last of a run."""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def _inside(name: str, members: Iterable[str]) -> bool:
    """``name`` is one of ``members`` or inside one: already in float32 in that trial."""
    return any(name == m or name.startswith(m + ".") for m in members)


def _merged(current: Iterable[str], new: Iterable[str]) -> list[str]:
    """``current`` and ``new`` as one set, without members inside another member."""
    union = list(dict.fromkeys([*current, *new]))
    return [n for n in union if not _inside(n, [m for m in union if m != n])]


def _shape(name: str) -> str:
    """``name`` with its numbered parts as ``*``: the same place in every block."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _moved_to(s: Session | None, fp32: Sequence[str]) -> list[str]:
    """The culprits a trial's errors name outside its float32 set: where the error went
    once the set removed it from its members (the next block's copy of the same op). A
    culprit inside the next block's copy of a member is that copy (review 59a: with
    ``blocks.0.attn`` in float32 the error moved to ``blocks.1.attn.proj``, whose own
    float32 left it there: the op is in ``blocks.1.attn``'s own code, as it was in
    ``blocks.0.attn``'s)."""
    if s is None:
        return []
    shapes = {_shape(m) for m in fp32 if _shape(m) != m}
    out: list[str] = []
    for c in _culprits(s):
        if _inside(c, fp32):
            continue
        parts = c.split(".")
        copies = [a for a in (".".join(parts[:i]) for i in range(1, len(parts)))
                  if _shape(a) in shapes]
        out.append(copies[-1] if copies else c)
    return list(dict.fromkeys(out))


def _enclosing(s: Session, level: Sequence[str]) -> list[str]:
    """The modules enclosing ``level``'s members, one level up. A parent that is no layer
    of the report never ran a forward of its own (a ``ModuleList`` is iterated, not
    called): its members, the layers that ran, stand in for it, so that a trial's float32
    column says what really ran (review 56b: "blocks" read as forced, and forced nothing)."""
    names = {lay.name for lay in s.layers}
    up: list[str] = []
    for n in level:
        p = _parent(n)
        if p is None or p in s.run.models:
            up.append(n)  # the top: a whole model in float32 is AMP off, not a fix
        elif p in names:
            up.append(p)
        else:
            up.extend(_children(s, p) or [n])
    return sorted(_merged([], up), key=_order_key(s))


def find_fix(run: Runner, max_trials: int = DEFAULT_TRIALS,
             log: Callable[[Trial], None] | None = None) -> FixResult:
    """Search float32 module sets with ``run(fp32_patterns) -> (session, exit code)``."""
    base, bs = _trial((), "baseline", run)
    result = FixResult(baseline=base)
    if log:
        log(base)
    if bs is None:
        result.notes.append("The baseline run wrote no report; see its errors above.")
        return result
    result.layer_types = {lay.name: lay.type for lay in bs.layers}
    result.device_type = bs.amp.device_type or "cuda"
    result.models = list(bs.run.models)
    if bs.steps == 0:
        ended = (f"it ended with {bs.run.error}" if bs.run.error
                 else f"it exited with code {base.exit_code}" if base.exit_code
                 else "it ran to its end")
        result.notes.append(
            f"The baseline run finished no training step ({ended}): there is nothing to "
            "search. Make the script train, or run `amp-doctor diagnose` on it to see "
            "its output and why.")
        return result
    if base.ok:
        warned = [f for f in bs.findings if f.severity == "warning"]
        # Trials stop after --stop-after steps: what begins later is not in them.
        within = (f" in its {base.steps} steps (each trial stops there: a problem that "
                  "begins later needs a larger `--stop-after`)")
        if not warned:
            result.notes.append(f"The baseline has no error finding{within}: nothing to fix.")
            return result
        kinds = sorted({f"{f.kind}" + (f" ({f.module})" if f.module else "") for f in warned})
        result.notes.append(
            f"The baseline has no error finding{within}, so no float32 layer is searched for (fix "
            f"removes errors). It has {len(warned)} warning(s): {', '.join(kinds[:6])}"
            + (" ..." if len(kinds) > 6 else "") + ". Their fix is not a float32 layer: "
            f"{warned[0].advice} Run `amp-doctor diagnose` on the script for the whole report.")
        return result
    if not base.errors:
        # Healthy AMP, and a script that fails for its own reasons (missing eval data, a
        # metric gate): no float32 layer changes that, so no search.
        why = f": {bs.run.error}" if bs.run.error else ""
        result.notes.append(
            f"The baseline has no AMP error finding, but the script itself failed (exit code "
            f"{base.exit_code}{why}). Float32 layers cannot fix that: fix the script, and "
            "run `amp-doctor fix` again if AMP errors remain.")
        return result
    errors = [f for f in bs.findings if _blocking(f)]
    if errors and all(_ran_wide(f) or _outside(f) or _loss_made(f) for f in errors):
        # Review 55b: a CTC loss inf for targets longer than their input was "searched" with
        # every float32 layer set, none of which could change an op that ran in float32.
        # Review 56b: an op in the loop's own code (outside every module) likewise; and
        # an error the loss's size made (a summed loss: review 57g, "keep proj, head in
        # float32", every matmul of the model).
        result.notes.extend(_not_searched_notes(errors))
        result.not_searched = True
        return result
    again, _ = _trial((), "baseline, repeated", run)
    if log:
        log(again)
    result.trials.append(again)
    if again.errors != base.errors or not _same_loss(again.final_loss, base.final_loss):
        result.deterministic = False
        result.notes.append(
            "The script is not deterministic for the steps it runs (the baseline gave "
            "different errors or losses twice): trials may disagree by chance. Seed it "
            "(torch.manual_seed) and disable nondeterministic data order to trust the result.")
    tried: set[frozenset[str]] = set()
    # The report of each trial run, for where its errors went.
    reports: dict[tuple[str, ...], Session | None] = {}

    def attempt(cand: Iterable[str], why: str) -> Trial | None:
        key = frozenset(cand)
        if not key or key in tried:
            return None
        # The budget is for float32 sets: the baseline's repeat, a check of the baseline,
        # is not one (with --trials 1 it used the budget up, and no set was tried).
        if sum(1 for x in result.trials if x.fp32) >= max_trials:
            result.budget_exhausted = True
            return None
        tried.add(key)
        t, ts = _trial(tuple(sorted(key, key=_order_key(bs))), why, run)
        reports[t.fp32] = ts
        if not t.errors and t.exit_code == 0 and _loss_worse(t.final_loss, base.final_loss):
            # Errors gone, and training with them: float32 let a corrupt batch that the
            # GradScaler had skipped update the weights (review 45c).
            t = dataclasses.replace(t, rejected=(
                f"loss ended at {t.final_loss:.4g} against {base.final_loss:.4g} before"))
        result.trials.append(t)
        if log:
            log(t)
        if t.ok and (result.best is None or _size(t.fp32) < _size(result.best.fp32)):
            result.best = t
        return t

    def _size(names: Sequence[str]) -> tuple[int, int]:
        """Fewer members first, then fewer layers inside them (a child beats its parent)."""
        return len(names), _cost(names, result.layer_types)[0]

    def follow(t: Trial | None, level: list[str]) -> list[str]:
        """Review 56b: the same overflow in every block. Forcing the first moved the error
        to the next, and the search went on without it. Each move adds the layer the error
        moved to, until the set removes it or stops moving it; returns the set reached."""
        while t is not None and not t.ok and t.errors != base.errors:
            moved = _moved_to(reports.get(t.fp32), t.fp32)
            if not moved:
                break
            level = _merged(level, moved)
            t = attempt(level, f"add {', '.join(moved)}: the error moved there")
        return level

    culprits = _culprits(bs)
    level = culprits
    if culprits:
        level = follow(attempt(culprits, "the culprits the errors name"), level)
    # The origin chain: enclosing modules, innermost first.
    while result.best is None and level:
        up = _enclosing(bs, level)
        if up == level:
            break
        level = follow(attempt(up, "their enclosing modules"), up)
    # Bisection over the blocks.
    group, blocks = _block_group(bs)
    while result.best is None and len(blocks) >= 2 and not result.budget_exhausted:
        half = len(blocks) // 2
        first, second = blocks[:half], blocks[half:]
        t = attempt(first, f"bisect {group}: first half, {_span(first)}")
        if t is not None and t.ok:
            blocks = first
            continue
        t = attempt(second, f"bisect {group}: second half, {_span(second)}")
        if t is not None and t.ok:
            blocks = second
            continue
        attempt(blocks, f"all of {group} bisected, {_span(blocks)}")
        break
    # Smaller: a member's children instead of it, then each member dropped. Another
    # block's copy of a member whose children did not do (the same code) is not narrowed.
    improved = True
    not_narrowed: set[str] = set()
    while result.best is not None and improved and not result.budget_exhausted:
        improved = False
        current = list(result.best.fp32)
        for m in current:
            kids = _children(bs, m) if _shape(m) not in not_narrowed else []
            rest = [x for x in current if x != m]
            for kid in kids:
                t = attempt([*rest, kid], f"narrow {m} to {kid}")
                if t is not None and t.ok:
                    improved = True
                    break
            if improved:
                break
            if kids and _shape(m) != m:
                not_narrowed.add(_shape(m))
            if len(current) > 1:
                t = attempt(rest, f"drop {m}")
                if t is not None and t.ok:
                    improved = True
                    break
    return result


# A trial whose last loss is more than this many times the baseline's (a finite, positive
# one) traded the errors for a run that no longer trains: it is no fix.
LOSS_WORSE_FACTOR = 4.0


def _loss_worse(trial: float | None, base: float | None) -> bool:
    if trial is None or base is None or not math.isfinite(base) or base <= 0:
        return False
    return not math.isfinite(trial) or trial > LOSS_WORSE_FACTOR * base


def _same_loss(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or a == b


def _order_key(s: Session) -> Callable[[str], tuple[int, str]]:
    order = {lay.name: lay.order for lay in s.layers}
    return lambda n: (order.get(n, 1 << 30), n)


# -- running trials --------------------------------------------------------------
# The working folder is copied for the trials when it holds at most this many bytes
# (folders below are left out); a larger one is used in place, with a warning.
SCRATCH_COPY_LIMIT = 256 * 2**20
SCRATCH_COPY_FILES = 20_000
_NOT_COPIED = frozenset({".git", ".hg", ".svn", ".venv", "venv", "__pycache__",
                         "node_modules", ".mypy_cache", ".pytest_cache", ".ruff_cache"})


def scratch_copy(src: Path, into: Path) -> Path | None:
    """A copy of the working folder ``src`` in ``into``, for trials that must not write
    over the user's files (a checkpoint, a log the script appends to); None when ``src``
    is too large to copy (more than :data:`SCRATCH_COPY_LIMIT` bytes or
    :data:`SCRATCH_COPY_FILES` files, version control and virtual envs left out).
    Symlinks are copied as links: what they point to is read, and written, in place."""
    total = files = 0
    for root, dirs, names in os.walk(src):
        dirs[:] = [d for d in dirs if d not in _NOT_COPIED]
        for n in names:
            files += 1
            try:
                total += (Path(root) / n).lstat().st_size
            except OSError:
                continue
            if total > SCRATCH_COPY_LIMIT or files > SCRATCH_COPY_FILES:
                return None
    dst = into / "cwd"
    try:
        shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(*_NOT_COPIED))
    except (OSError, shutil.Error):
        shutil.rmtree(dst, ignore_errors=True)
        return None
    return dst


def in_scratch(script: Sequence[str], src: Path, dst: Path) -> list[str]:
    """``script`` (a path, then its arguments) pointing into the copy ``dst`` of ``src``
    when the script lies inside ``src``, else by its absolute path (the trials run in
    ``dst``, where a relative path to it no longer leads)."""
    if not script:
        return list(script)
    path = Path(os.path.abspath(script[0]))
    try:
        rel = path.relative_to(src)
    except ValueError:  # outside the folder: the same script, by a path valid from the copy
        return [str(path), *script[1:]]
    return [str(dst / rel), *script[1:]]


def subprocess_runner(script: Sequence[str], module: str | None, max_steps: int,
                      anomaly: bool, workdir: Path, echo: Callable[[str], None],
                      target_dtype: str | None = None, cwd: Path | None = None) -> Runner:
    """Trials as real ``amp-doctor diagnose`` runs of the user's script (in ``cwd``, a
    scratch copy of the user's folder, when given)."""
    counter = [0]

    def run(fp32: tuple[str, ...]) -> tuple[Session | None, int]:
        counter[0] += 1
        logdir = workdir / f"trial{counter[0]:02d}"
        cmd = [sys.executable, "-m", "amp_doctor", "diagnose", "--quiet", "--no-tensorboard",
               "--every", "1", "--stop-after", str(max_steps), "--logdir", str(logdir),
               *(["--anomaly"] if anomaly else []),
               *(["--target-dtype", target_dtype] if target_dtype else []),
               *[a for p in fp32 for a in ("--fp32", p)],
               *(["-m", module] if module else []), *script]
        echo("amp-doctor fix: " + " ".join(shlex.quote(c) for c in cmd[1:]))
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "AMP_DOCTOR_FIX_TRIAL": "1"},
                              cwd=cwd)
        path = logdir / JSON_NAME
        try:
            session = Session.load(path)
        except (OSError, ValueError, KeyError, TypeError):
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            echo("amp-doctor fix: the trial wrote no report: " + " | ".join(tail))
            session = None
        return session, proc.returncode

    return run


def default_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="amp-doctor-fix-"))


# -- rendering ------------------------------------------------------------------
def _cost(names: Sequence[str], types: dict[str, str]) -> tuple[int, int, int]:
    """(layers now in float32, matmul/conv layers among them, matmul/conv layers in all)."""
    inside = [n for n in types if any(n == m or n.startswith(m + ".") for m in names)]
    mm = [n for n in inside if types[n] in MATMUL_TYPES]
    total = sum(t in MATMUL_TYPES for t in types.values())
    return len(inside), len(mm), total


def snippet(names: Sequence[str], device_type: str, models: Sequence[str]) -> str:
    """Code that applies the fix without amp-doctor."""
    by_model: dict[str, list[str]] = {}
    for n in names:
        head, _, rest = n.partition(".")
        if len(models) > 1 and head in models and rest:
            by_model.setdefault(head, []).append(rest)
        else:
            by_model.setdefault("model", []).append(n)
    lines = [
        "import functools",
        "import torch",
        "",
        "",
        f'def keep_in_float32(module: torch.nn.Module, device_type: str = "{device_type}") '
        "-> None:",
        '    """Run `module` in float32 under autocast; its output stays float32."""',
        "    forward = module.forward",
        "",
        "    def up(x):",
        "        return x.float() if torch.is_tensor(x) and x.is_floating_point() else x",
        "",
        "    @functools.wraps(forward)",
        "    def fp32_forward(*args, **kwargs):",
        "        with torch.autocast(device_type, enabled=False):",
        "            return forward(*[up(a) for a in args], **{k: up(v) for k, v in "
        "kwargs.items()})",
        "",
        "    module.forward = fp32_forward",
        "",
        "",
    ]
    for model, quals in by_model.items():
        lines.append(f"for name in {quals!r}:")
        lines.append(f"    keep_in_float32({model}.get_submodule(name))")
    return "\n".join(lines)


def render_fix(r: FixResult) -> str:
    def row(i: int, t: Trial) -> list[str]:
        loss = "-" if t.final_loss is None else f"{t.final_loss:.4g}"
        return [str(i), ", ".join(t.fp32) or "(none)", t.why, str(t.steps), str(t.skipped),
                loss, "ok" if t.ok else (t.rejected or ", ".join(t.errors)
                                         or f"exit {t.exit_code}")]

    # Numbered as the trials' folders are (trial01 is the baseline), in the order they ran
    # (review 54: rows from 0 beside folders from 1).
    rows = [row(i, t) for i, t in enumerate([r.baseline, *r.trials], start=1)]
    out = ["Trials (each a real run of the script; float32 = layers forced with --fp32; its "
           "report in the folder trialNN):",
           tabulate(rows, headers=["trial", "float32", "why", "steps", "skipped", "last loss",
                                   "errors left"], tablefmt="simple", disable_numparse=True),
           ""]
    out.extend(r.notes)
    if r.notes:
        out.append("")
    gone = ("Every error finding" + (f" and {r.target_dtype} what-if warning"
                                      if r.target_dtype else ""))
    if r.best is not None:
        n, mm, total = _cost(r.best.fp32, r.layer_types)
        order = {name: i for i, name in enumerate(r.layer_types)}
        best = sorted(r.best.fp32, key=lambda x: order.get(x, len(order)))  # model order
        out.append(f"Smallest fix found: keep {', '.join(best)} in float32. {gone} is gone in "
                   "that run.")
        out.append(f"Cost: {n} layer(s) now run in float32, {mm} of the model's {total} "
                   "matmul/convolution layers.")
        if total and mm == total:
            # Review 52a: a regression head's un-normalised targets, "fixed" by turning
            # autocast off for the whole model.
            out.append("That is every matmul/convolution layer: mixed precision is off for "
                       "the whole model, and with it autocast's speed and memory gains. "
                       "Try the fix the diagnosis gives for the error first (its `fix:` "
                       "line in `amp-doctor diagnose`: normalised targets or inputs, a scale "
                       "in the model's own code); keep this one as the fallback.")
        script = " ".join(shlex.quote(c) for c in r.command) or "SCRIPT [ARGS]"
        forced = " ".join(f"--fp32 {shlex.quote(x)}" for x in best)
        target = f"--target-dtype {r.target_dtype} " if r.target_dtype else ""
        out.append("Check it on the full run, then compare it with the run before:")
        out.append(f"  amp-doctor diagnose --logdir runs/before {target}{script}")
        out.append(f"  amp-doctor diagnose --logdir runs/after {target}{forced} {script}")
        out.append("  amp-doctor compare runs/before runs/after")
        out.append("")
        out.append("Apply it in code, after building the model:")
        out.append("")
        out.extend("    " + line if line else "" for line in
                   snippet(r.best.fp32, r.device_type, r.models).splitlines())
    elif (r.baseline.errors and r.baseline.errors != ("no_report",) and r.baseline.steps > 0
          and not r.not_searched):
        budget = " within the trial budget (--trials)" if r.budget_exhausted else ""
        what = "every error" + (f" and {r.target_dtype} what-if warning"
                                if r.target_dtype else "")
        out.append(f"No set of float32 layers removed {what}{budget}. Next things to try:")
        if any(t.rejected for t in r.trials):
            out.append("  - some trials removed them, but their loss ended far worse than "
                       "before: in float32 the weights took a step the GradScaler had "
                       "skipped (a corrupt batch, values beyond float16 in the data). Look "
                       "at the data of the step the errors name, not at a layer;")
        out.append("  - if the NaN is not an overflow (a softmax over a row masked whole, "
                   "log(0), 0/0 are NaN in every format): `amp-doctor diagnose --anomaly` "
                   "names the op and its line;")
        out.append("  - bfloat16 autocast (`torch.autocast(device_type, dtype=torch.bfloat16)`): "
                   "it has float32's range, so nothing overflows;")
        out.append("  - loss scaling: `GradScaler(init_scale=..., growth_interval=...)`, or "
                   "unscale_ before clipping;")
        out.append("  - normalisation: normalise the inputs, add a LayerNorm before the layer "
                   "the errors name, or weight decay if its weights grew large.")
    return "\n".join(out) + "\n"


def to_json(r: FixResult) -> str:
    def t(x: Trial) -> dict[str, object]:
        return {"fp32": list(x.fp32), "why": x.why, "errors": list(x.errors),
                "exit_code": x.exit_code, "steps": x.steps, "skipped": x.skipped,
                "final_loss": None if x.final_loss is None or not math.isfinite(x.final_loss)
                else x.final_loss, "ok": x.ok}

    return json.dumps({"baseline": t(r.baseline), "trials": [t(x) for x in r.trials],
                       "best": list(r.best.fp32) if r.best else None,
                       "deterministic": r.deterministic,
                       "budget_exhausted": r.budget_exhausted, "notes": r.notes}, indent=1)
