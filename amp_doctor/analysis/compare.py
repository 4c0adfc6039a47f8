"""Compare two saved runs: what a fix (or another format) changed.

``amp-doctor compare RUN_A RUN_B`` reads two sessions and shows, from A to B:
findings resolved, new and unchanged; the two scale timelines and skipped
steps side by side; per-layer headroom and underflow deltas, largest changes
first; and the loss, when it was seen. Works on saved JSON only, so it needs
no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tabulate import tabulate

from amp_doctor import format as F
from amp_doctor.analysis.detect_layers import all_nonfinite, shown_grad_underflow
from amp_doctor.records import SEVERITIES, Finding, LayerSummary, ScalerTimeline, Session

__all__ = ["Comparison", "FindingDelta", "LayerDelta", "RunSide", "compare", "render"]

# Headroom is +/-inf for a layer that was all zeros or non-finite: clip it so that a
# delta stays a number. 64 bits is beyond every format's range.
HEADROOM_CLIP = 64.0
# Rows shown per table in text/markdown (everything is in the JSON).
MAX_ROWS = 20
# A layer change smaller than this (bits of headroom, or percentage points) is noise.
MIN_CHANGE = 0.05
# The score of a layer whose outputs went from some inf/NaN steps to none, or back: as
# large as a full overflow share's change, so that it is listed among the first.
NONFINITE_CHANGE = 100.0


@dataclass(frozen=True)
class FindingDelta:
    # resolved: gone in B, or down to info from a warning/error; new: the reverse;
    # came true: A's what-if for B's format, gone in B because B has the real problem.
    status: str  # resolved | new | unchanged | came true
    kind: str
    severity: str  # the worse of the two
    severity_a: str | None
    severity_b: str | None
    module: str | None
    op: str | None
    count_a: int
    count_b: int
    message: str


@dataclass(frozen=True)
class LayerDelta:
    name: str
    headroom_a: float | None
    headroom_b: float | None
    overflow_a: float | None
    overflow_b: float | None
    underflow_a: float | None
    underflow_b: float | None
    grad_underflow_a: float | None
    grad_underflow_b: float | None
    score: float  # size of the change, for ordering
    # The side's overflow/underflow figures are a what-if (a float32 layer against the
    # low-precision format), marked * as in the report.
    what_if_a: bool = False
    what_if_b: bool = False
    # Recorded steps with inf/NaN in the output, and recorded steps (None: not seen):
    # a NaN-carrying layer keeps a finite headroom (that of its finite values).
    nonfinite_a: tuple[int, int] | None = None
    nonfinite_b: tuple[int, int] | None = None


@dataclass(frozen=True)
class RunSide:
    label: str
    dtype: str | None
    scaler: bool
    steps: int
    recorded_steps: int
    outcome: str
    fp32_modules: list[str]
    errors: int
    warnings: int
    init_scale: float | None = None
    final_scale: float | None = None
    min_scale: float | None = None
    backoffs: int = 0
    growths: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    scale_points: list[tuple[int, float]] = field(default_factory=list)
    loss_first: float | None = None
    loss_last: float | None = None
    loss_min: float | None = None
    loss_nonfinite: int = 0
    loss_seen: int = 0
    # Steps whose loss the device checked (every step, recorded or not), and how many
    # of them had a NaN/inf loss: the recorded steps alone missed an unrecorded one.
    loss_checked: int = 0
    loss_bad: int = 0
    # The run's other GradScalers (a GAN with one per network): name -> its summary.
    other_scalers: dict[str, str] = field(default_factory=dict)


def scaler_summary(sc: ScalerTimeline) -> str:
    """'65536 -> 32768 (min 16384); 24 backoffs / 9 growths; 24 skipped'."""
    scales = [v for _, v in sc.scale]
    final, low = (scales[-1], min(scales)) if scales else (None, None)
    return (f"{F.scale(sc.init_scale)} -> {F.scale(final)} (min {F.scale(low)}); "
            f"{F.counted(len(sc.backoff_steps), 'backoff')} / "
            f"{F.counted(len(sc.growth_steps), 'growth')}; "
            f"{len(sc.skipped_steps)} skipped")


@dataclass(frozen=True)
class Comparison:
    a: RunSide
    b: RunSide
    findings: list[FindingDelta]
    layers: list[LayerDelta]
    # Both runs have layers, and no layer name in common, or half or more of the names
    # they share are of different types (a Linear "0" against a Conv2d "0"): two
    # different models, not one model before and after a change.
    different_models: bool = False
    # Same-named layers of different types: "0 (Linear -> Conv2d)".
    retyped: list[str] = field(default_factory=list)
    # The scripts the runs came from, when they differ (python a.py, python b.py).
    scripts: tuple[str, str] | None = None

    @property
    def resolved(self) -> list[FindingDelta]:
        return [d for d in self.findings if d.status == "resolved"]

    @property
    def new(self) -> list[FindingDelta]:
        return [d for d in self.findings if d.status == "new"]

    @property
    def unchanged(self) -> list[FindingDelta]:
        return [d for d in self.findings if d.status == "unchanged"]


_Key = tuple[str, str | None, str | None, str]


def _key(f: Finding) -> _Key:
    # Another GradScaler's finding is its own: not the first scaler's of the same layer.
    return (f.kind, f.module, f.op, str(f.data.get("scaler", "")))


def _side(label: str, s: Session) -> RunSide:
    losses = [r.loss for r in s.history if r.loss is not None]
    finite = [x for x in losses if math.isfinite(x)]
    sc = s.scaler if s.scaler is not None and s.scaler.enabled else None
    scales = [v for _, v in sc.scale] if sc else []
    ev = next((e for e in s.events if e.kind == "nonfinite_loss"), None)
    if ev is not None:
        loss_bad = int(ev.data.get("steps_bad") or 0)
        loss_checked = int(ev.data.get("checked") or s.steps)
    else:
        loss_bad, loss_checked = 0, s.steps if losses else 0
    return RunSide(
        label=label,
        dtype=s.amp.dtype,
        scaler=s.amp.scaler,
        steps=s.steps,
        recorded_steps=s.recorded_steps,
        outcome=s.run.outcome,
        fp32_modules=list(s.run.fp32_modules),
        errors=sum(f.severity == "error" for f in s.findings),
        warnings=sum(f.severity == "warning" for f in s.findings),
        init_scale=sc.init_scale if sc else None,
        final_scale=scales[-1] if scales else None,
        min_scale=min(scales) if scales else None,
        backoffs=len(sc.backoff_steps) if sc else 0,
        growths=len(sc.growth_steps) if sc else 0,
        skipped_steps=list(sc.skipped_steps) if sc else [],
        scale_points=[(int(k), float(v)) for k, v in sc.scale] if sc else [],
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        loss_min=min(finite) if finite else None,
        loss_nonfinite=len(losses) - len(finite),
        loss_seen=len(losses),
        loss_checked=loss_checked,
        loss_bad=loss_bad,
        other_scalers={o.name: scaler_summary(o) for o in s.other_scalers if o.enabled},
    )


def _clip(x: float | None) -> float | None:
    if x is None or math.isnan(x):
        return x if x is None else 0.0
    return max(-HEADROOM_CLIP, min(HEADROOM_CLIP, x))


def _diff(a: float | None, b: float | None, scale: float = 1.0) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return math.inf  # a layer that appeared or vanished is a change worth showing
    return abs(b - a) * scale


def _headroom(lay: LayerSummary | None) -> float | None:
    """The layer's headroom as the report reads it: -inf for a layer whose outputs were
    nothing but inf/NaN (its record's absmax 0 is no measurement), None if none was seen."""
    if lay is None or not lay.output_dtypes:
        return None
    return -math.inf if all_nonfinite(lay) else lay.headroom


def _nonfinite(lay: LayerSummary | None) -> tuple[int, int] | None:
    if lay is None or not lay.output_dtypes:
        return None
    return lay.nonfinite_steps, lay.recorded_steps


def _layer_deltas(a: Session, b: Session) -> list[LayerDelta]:
    la = {x.name: x for x in a.layers}
    lb = {x.name: x for x in b.layers}
    out = []
    for name in [*la, *(n for n in lb if n not in la)]:
        x, y = la.get(name), lb.get(name)
        ha, hb = _headroom(x), _headroom(y)
        oa, ob = (x.overflow_frac if x else None), (y.overflow_frac if y else None)
        ua, ub = (x.underflow_frac if x else None), (y.underflow_frac if y else None)
        ga = shown_grad_underflow(x) if x else None
        gb = shown_grad_underflow(y) if y else None
        na, nb = _nonfinite(x), _nonfinite(y)
        score = max(_diff(_clip(ha), _clip(hb)), _diff(oa, ob, 100.0), _diff(ua, ub, 100.0),
                    _diff(ga, gb, 100.0) if ga is not None or gb is not None else 0.0,
                    # From some steps with inf/NaN to none (or back) is a change.
                    NONFINITE_CHANGE if bool(na and na[0]) != bool(nb and nb[0]) else 0.0)
        if score < MIN_CHANGE:
            continue
        out.append(LayerDelta(name, ha, hb, oa, ob, ua, ub, ga, gb, score,
                              bool(x and x.what_if), bool(y and y.what_if), na, nb))
    # Largest change first; ties (e.g. appeared/vanished) in model order.
    order = {n: i for i, n in enumerate([*la, *lb])}
    out.sort(key=lambda d: (-d.score, order.get(d.name, 0)))
    return out


# Findings about the whole run, whose module only names where they showed first: one
# in each run is the same problem, moved (review 52a: a scale collapse blamed on the
# head, then, with the head in float32, on the layer before it, read as "1 resolved, 1
# new").
RUN_LEVEL_KINDS = ("scale_collapse", "nonfinite_loss", "nonfinite_unlocated", "fp8_readiness")


def _moved(fa: dict[_Key, Finding], fb: dict[_Key, Finding]) -> dict[_Key, _Key]:
    """A's key -> B's, for a run-level finding each run has once, under another module."""
    out: dict[_Key, _Key] = {}
    for kind in RUN_LEVEL_KINDS:
        only_a = [k for k in fa if k[0] == kind and k not in fb]
        only_b = [k for k in fb if k[0] == kind and k not in fa]
        if (len(only_a) == len(only_b) == 1 and only_a[0][3] == only_b[0][3]
                and sum(k[0] == kind for k in fa) == sum(k[0] == kind for k in fb) == 1):
            out[only_a[0]] = only_b[0]
    return out


# A what-if finding of run A, and the format it predicts for.
_WHATIF_FORMAT = {"whatif_float16": "float16"}


def _came_true(x: Finding, b: Session) -> bool:
    """A's what-if (float16's range, say, seen from a bfloat16 run) is gone in B because
    B runs that format and has the errors it predicted: not resolved (review 52a: "resolved
    whatif_float16" beside "new error" of the same layer)."""
    fmt = _WHATIF_FORMAT.get(x.kind)
    return (fmt is not None and b.amp.dtype == fmt
            and any(f.severity == "error" for f in b.findings))


def compare(a: Session, b: Session, label_a: str = "A", label_b: str = "B") -> Comparison:
    """What changed from run A to run B."""
    fa: dict[_Key, Finding] = {}
    fb: dict[_Key, Finding] = {}
    for f in a.findings:
        fa.setdefault(_key(f), f)
    for f in b.findings:
        fb.setdefault(_key(f), f)
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    moved = _moved(fa, fb)
    deltas = []
    for k in [*fa, *(k for k in fb if k not in fa)]:
        if k in moved.values():
            continue  # B's side of a run-level finding that moved: said with A's
        x, y = fa.get(k), fb.get(k)
        if k in moved:
            y = fb[moved[k]]
        sa, sb = (x.severity if x else None), (y.severity if y else None)
        if x and y:
            # A problem that is now only a note is resolved; the reverse is new.
            status = ("resolved" if sb == "info" and sa != "info" else
                      "new" if sa == "info" and sb != "info" else "unchanged")
        else:
            status = "resolved" if x else "new"
            if x is not None and _came_true(x, b):
                status = "came true"
        worst = min((v for v in (sa, sb) if v is not None), key=lambda v: rank.get(v, 9))
        g = y if y is not None else x
        assert g is not None
        module = g.module
        if x and y and x.module != y.module:
            module = f"{x.module or '-'} -> {y.module or '-'}"
        deltas.append(FindingDelta(
            status=status, kind=g.kind, severity=worst, severity_a=sa, severity_b=sb,
            module=module, op=g.op, count_a=x.count if x else 0,
            count_b=y.count if y else 0, message=g.message))
    status_rank = {"resolved": 0, "new": 1, "came true": 2, "unchanged": 3}
    deltas.sort(key=lambda d: (status_rank[d.status], rank.get(d.severity, 9)))
    type_a, type_b = {x.name: x.type for x in a.layers}, {x.name: x.type for x in b.layers}
    common = [n for n in type_a if n in type_b]
    retyped = [f"{n} ({type_a[n]} -> {type_b[n]})" for n in common if type_a[n] != type_b[n]]
    different = bool(type_a and type_b and (not common or 2 * len(retyped) >= len(common)))
    script_a, script_b = _script(a), _script(b)
    return Comparison(_side(label_a, a), _side(label_b, b), deltas, _layer_deltas(a, b),
                      different_models=different, retyped=retyped,
                      # A run watched in code records no command: nothing to tell apart
                      # (review 56c: "different scripts (; python loop.py)").
                      scripts=(script_a, script_b)
                      if script_a and script_b and script_a != script_b else None)


def _script(s: Session) -> str:
    """The script (or ``-m`` module) a run came from, without its arguments: a run before
    and after a change (--fp32, a fix) runs the same one."""
    cmd = list(s.run.command or [])
    if len(cmd) >= 3 and cmd[1] == "-m":
        return " ".join(cmd[:3])
    return " ".join(cmd[:2])


# -- rendering -----------------------------------------------------------------
def _run_rows(c: Comparison) -> list[list[str]]:
    def row(name: str, fn: Any) -> list[str]:
        return [name, fn(c.a), fn(c.b)]

    return [
        row("format", lambda s: (s.dtype or "float32") + (" + GradScaler" if s.scaler else "")),
        row("float32 modules", lambda s: ", ".join(s.fp32_modules) or "-"),
        row("steps (recorded)", lambda s: f"{s.steps} ({s.recorded_steps})"),
        row("outcome", lambda s: s.outcome),
        row("errors / warnings", lambda s: f"{s.errors} / {s.warnings}"),
        row("scale: init -> final (min)", lambda s: "-" if s.final_scale is None else
            f"{F.scale(s.init_scale)} -> {F.scale(s.final_scale)} ({F.scale(s.min_scale)})"),
        row("backoffs / growths", lambda s: f"{s.backoffs} / {s.growths}"),
        row("skipped steps", lambda s: _steps(s.skipped_steps)),
        row("loss, recorded steps: first -> last (min)", lambda s: "not seen"
            if not s.loss_seen else
            f"{F.num(s.loss_first, 4)} -> {F.num(s.loss_last, 4)} ({F.num(s.loss_min, 4)})"),
        row("non-finite losses (steps checked)", lambda s: f"{s.loss_bad} of {s.loss_checked}"
            if s.loss_checked else "-"),
        *[row(f"GradScaler of {name}", lambda s, n=name: s.other_scalers.get(n, "-"))
          for name in dict.fromkeys([*c.a.other_scalers, *c.b.other_scalers])],
    ]


def _steps(steps: list[int]) -> str:
    return F.steps_list(steps) if steps else "none"


def _scale_rows(c: Comparison) -> list[list[str]]:
    a, b = dict(c.a.scale_points), dict(c.b.scale_points)
    steps = sorted(set(a) | set(b))

    def value(d: dict[int, float], step: int) -> float | None:
        known = [k for k in d if k <= step]
        return d[max(known)] if known else None

    def at(d: dict[int, float], step: int) -> str:
        v = value(d, step)
        return F.scale(v) if v is not None else "-"

    if len(steps) > MAX_ROWS:
        # The steps where either scale changed first (a lone backoff is the news), then
        # the ends and an even spread between, up to MAX_ROWS.
        changed = [st for i, st in enumerate(steps) if i == 0 or any(
            value(d, st) != value(d, steps[i - 1]) for d in (a, b))]
        keep = set(changed[:MAX_ROWS])
        stride = len(steps) / (MAX_ROWS - 1)
        for i in range(MAX_ROWS):
            if len(keep) >= MAX_ROWS:
                break
            keep.add(steps[min(len(steps) - 1, round(i * stride))])
        steps = sorted(keep)

    return [[str(s), at(a, s), at(b, s)] for s in steps]


def _finding_rows(c: Comparison) -> list[list[str]]:
    def sev(d: FindingDelta) -> str:
        if d.severity_a and d.severity_b and d.severity_a != d.severity_b:
            return f"{d.severity_a} -> {d.severity_b}"
        return d.severity_b or d.severity_a or ""

    return [[d.status, sev(d), d.kind, d.module or "-", d.op or "-",
             f"{d.count_a} -> {d.count_b}"] for d in c.findings]


def _layer_rows(c: Comparison) -> list[list[str]]:
    def star(on: bool) -> str:
        return "*" if on else ""

    return [[d.name, f"{F.num(d.headroom_a, 3)} -> {F.num(d.headroom_b, 3)}",
             f"{F.pct(d.overflow_a)}{star(d.what_if_a)} -> {F.pct(d.overflow_b)}"
             f"{star(d.what_if_b)}",
             f"{F.pct(d.underflow_a)}{star(d.what_if_a)} -> {F.pct(d.underflow_b)}"
             f"{star(d.what_if_b)}",
             f"{F.pct(d.grad_underflow_a)} -> {F.pct(d.grad_underflow_b)}",
             f"{_steps_bad(d.nonfinite_a)} -> {_steps_bad(d.nonfinite_b)}"]
            for d in c.layers[:MAX_ROWS]]


def _steps_bad(n: tuple[int, int] | None) -> str:
    return "-" if n is None else f"{n[0]}/{n[1]}"


def _verdict(c: Comparison) -> str:
    res = [d for d in c.resolved if d.severity == "error"]
    new = [d for d in c.new if d.severity == "error"]
    left = [d for d in c.unchanged if d.severity == "error"]
    parts = [f"{len(res)} error(s) resolved", f"{len(new)} new", f"{len(left)} unchanged"]
    return f"From {c.a.label} to {c.b.label}: " + ", ".join(parts) + "."


def render(c: Comparison, fmt: str = "text") -> str:
    """``fmt`` is ``text``, ``markdown`` or ``json``."""
    if fmt == "json":
        return json.dumps(_jsonable(asdict(c)), indent=1, allow_nan=False)
    table = "github" if fmt == "markdown" else "simple"
    h = (lambda t: f"### {t}") if fmt == "markdown" else (lambda t: t)
    out = [f"**{_verdict(c)}**" if fmt == "markdown" else _verdict(c), ""]
    if c.different_models:
        why = "have no layer name in common"
        if c.retyped:
            shown = ", ".join(c.retyped[:3]) + (", ..." if len(c.retyped) > 3 else "")
            why = (f"name {F.counted(len(c.retyped), 'layer')} alike that are of different "
                   f"types ({shown})")
        out += [f"Note: {c.a.label} and {c.b.label} {why}: they are different models, so "
                "this compares their totals, not one model before and after a change; "
                "layers are matched by name only.", ""]
    elif c.retyped:
        out += ["Note: layers of the same name and different types are matched by name: "
                + ", ".join(c.retyped[:3]) + (", ..." if len(c.retyped) > 3 else "") + ".",
                ""]
    if c.scripts is not None:
        out += [f"Note: the runs come from different scripts ({c.scripts[0]}; "
                f"{c.scripts[1]}).", ""]
    out += [h("Runs"), tabulate(_run_rows(c), headers=["", c.a.label, c.b.label],
                                tablefmt=table, disable_numparse=True), ""]
    out.append(h("Findings"))
    if c.findings:
        out.append(tabulate(_finding_rows(c), headers=["status", "severity", "kind", "module",
                                                       "op", f"count {c.a.label} -> {c.b.label}"],
                            tablefmt=table, disable_numparse=True))
    else:
        out.append("No findings in either run.")
    out.append("")
    if c.a.scale_points or c.b.scale_points:
        out += [h("Loss scale (after each update)"),
                tabulate(_scale_rows(c), headers=["step", c.a.label, c.b.label],
                         tablefmt=table, disable_numparse=True), ""]
    out.append(h("Layers that changed, largest change first (headroom in bits, of the "
                 "finite outputs, -inf: inf/NaN outputs only; shares of values beyond max / "
                 "below smallest normal, * = what-if for a float32 layer; grad underflow as "
                 "in the report; inf/NaN: recorded steps with inf/NaN outputs / recorded "
                 "steps)"))
    if c.layers:
        out.append(tabulate(_layer_rows(c), headers=["layer", "headroom", "overflow",
                                                     "underflow", "grad underflow",
                                                     "inf/NaN"],
                            tablefmt=table, disable_numparse=True))
        if len(c.layers) > MAX_ROWS:
            out.append(f"... {len(c.layers) - MAX_ROWS} more in --format json")
    else:
        out.append("No layer changed.")
    return "\n".join(out) + "\n"


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
