"""Plain dataclasses for everything amp-doctor records, and the report's shared names.

Collection builds these; analysis reads them; sinks render them. A
:class:`Session` is immutable once built and round-trips through JSON
exactly (never pickle), which is what ``amp-doctor report`` relies on; the
JSON form itself is :mod:`amp_doctor.jsoncodec`. The constants every reader
and writer of a report shares are defined here once: the severities in order
(:data:`SEVERITIES`) and the ways a run ends (:data:`OUTCOMES`). The run folder's
file names are :mod:`amp_doctor.runfiles`'.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from amp_doctor.errors import ReportFormatError

# The codec's names stay importable from here, where they always were.
from amp_doctor.jsoncodec import check_report_version, from_jsonable, to_jsonable

__all__ = [
    "FP8_AMAX_WINDOW",
    "AMAX_OUTRUN_FACTOR",
    "TensorStats",
    "LayerStep",
    "StepRecord",
    "LayerSummary",
    "ScalerEvent",
    "ScalerReset",
    "ScalerTimeline",
    "LayerHeatmaps",
    "HEATMAP_FIGURES",
    "Event",
    "Finding",
    "AmpConfig",
    "RunInfo",
    "Session",
    "SEVERITIES",
    "SEVERITY_RANK",
    "Severity",
    "Outcome",
    "OUTCOMES",
    "to_jsonable",
    "from_jsonable",
    "check_report_version",
]

Severity = Literal["error", "warning", "info"]
# Worst first: the order findings are listed and ``--fail-on`` thresholds compare in.
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")
SEVERITY_RANK: dict[str, int] = {s: i for i, s in enumerate(SEVERITIES)}

# How a run ended: ``running`` while a watch is open (a session read before close),
# ``exit`` for sys.exit() with a code.
# "stopped": amp-doctor ended a run it was told to shorten (--stop-after, stop_after=).
Outcome = Literal["completed", "stopped", "exception", "interrupted", "exit", "running"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "stopped", "exception", "interrupted", "exit",
                                 "running")


# The FP8 figures of a LayerSummary, as TransformerEngine's per-tensor delayed scaling
# would follow them: training steps of amax history behind each delayed scale (its
# amax_history_len is longer), of which the recorded ones are known; and the factor by
# which a step's amax must exceed the window's to count as having "outrun the scale"
# (delayed scaling saturates the values above the window's amax).
FP8_AMAX_WINDOW = 16
AMAX_OUTRUN_FACTOR = 2.0


@dataclass(frozen=True)
class TensorStats:
    """One tensor (or the union of several) judged against the run's format.

    For a tensor held in float32, ``overflow_frac`` and ``underflow_frac``
    are "what-if" figures: what a cast to the low-precision format would do.
    """

    numel: int
    min: float
    max: float
    absmax: float
    zero_frac: float
    nonfinite_frac: float
    overflow_frac: float
    underflow_frac: float
    headroom: float


@dataclass(frozen=True)
class LayerStep:
    """One layer in one recorded step.

    Gradient fields hold the values as autograd produced them (``scaled``
    when a GradScaler was active) and, in the ``*_unscaled`` fields, the
    same values divided by the scale: what they would be without the scaler.
    """

    act: TensorStats | None = None
    grad: TensorStats | None = None
    grad_unscaled: TensorStats | None = None
    param_grad: TensorStats | None = None
    param_grad_unscaled: TensorStats | None = None


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float | None
    scale: float | None
    skipped: bool
    # Plain records; a step's decoded table (steps.table.StepTable) until the
    # history keeps the step, then its kept layers packed (steps.table.KeptLayers).
    layers: Mapping[str, LayerStep]
    # Layers recorded in this step but left out of this history row (only the
    # worst ``history.HISTORY_LAYERS`` are kept; every layer is in the aggregates).
    dropped_layers: int = 0


@dataclass(frozen=True)
class LayerSummary:
    """Per-layer aggregate over all recorded steps."""

    name: str
    type: str
    order: int  # first-call order in the forward pass
    calls: int
    recorded_steps: int  # recorded steps it ran in (had an output; else any figure)
    input_dtypes: list[str]
    output_dtypes: list[str]
    param_dtypes: list[str]
    ran_low_precision: bool  # some floating output was float16/bfloat16
    what_if: bool  # outputs stayed float32; overflow/underflow are what-if figures
    absmax: float  # worst over steps
    min: float
    max: float
    headroom: float  # log2(format max / absmax), worst step
    zero_frac: float  # mean over recorded steps
    overflow_frac: float  # worst step
    underflow_frac: float  # mean over recorded steps
    nonfinite_steps: int  # recorded steps whose output had NaN/Inf
    # Recorded steps in which this layer was the first (in completion order) whose output
    # overflowed or went non-finite: the origin, not a layer that passed it on.
    overflow_origin_steps: int
    grad_absmax: float | None
    grad_headroom: float | None  # log2(format max / max |scaled grad|)
    grad_zero_frac: float | None
    grad_underflow_frac: float | None  # mean, as scaled (what ran)
    grad_underflow_frac_unscaled: float | None  # mean, as if unscaled
    grad_nonfinite_steps: int
    param_grad_absmax: float | None
    # Exact zeros in the parameters' gradients: values that flushed all the way.
    param_grad_zero_frac: float | None
    param_grad_underflow_frac: float | None
    param_grad_underflow_frac_unscaled: float | None
    param_grad_nonfinite_steps: int
    # Its output was always the same tensor a sublayer returned (e.g. a Sequential).
    passthrough: bool = False
    # Recorded steps whose output's only non-finite values were -inf (min -inf, max neither
    # +inf nor NaN): what a mask written with masked_fill(-inf) looks like.
    neg_inf_steps: int = 0
    # Multi-process runs: the rank whose figures these are (the worst one).
    worst_rank: int | None = None
    # Its output was (part of) the watched model's output, so its output gradient is the
    # loss's gradient (times the GradScaler's scale).
    model_output: bool = False
    # The layers that took its output as input (their backward makes its output gradient).
    consumers: list[str] = field(default_factory=list)
    # Every floating input it took (in recorded training calls) was a watched layer's
    # output, as that layer returned it: none came from the batch or the parent's code.
    inputs_known: bool = False
    # Mean over recorded steps of its output's (max - min) / absmax, when the output kept
    # one sign in every one of them (None otherwise): the share of its size it spans.
    range_rel: float | None = None
    # The first recorded step whose output held values beyond its format's max or NaN/inf
    # (None: none did, or a report written before this was kept).
    first_overflow_step: int | None = None
    # FP8 delayed scaling's view of its amaxes (steps.amaxes), over the recorded steps
    # whose tensor was finite, of every layer (None: a report written before they were).
    # Its outputs': steps with a non-zero amax, the largest, its spread in bits (None: fewer
    # than two), steps whose amax outran the window's scale by more than 2x, of those
    # compared (a recorded step right after another). Its output gradients' likewise, as
    # if unscaled (the largest: as scaled, as the step ran).
    fp8_act_amax_steps: int | None = None
    fp8_act_amax_max: float | None = None
    fp8_act_amax_spread_bits: float | None = None
    fp8_act_amax_beyond: int = 0
    fp8_act_amax_compared: int = 0
    fp8_grad_amax_steps: int | None = None
    fp8_grad_amax_max: float | None = None  # as scaled, as the step ran
    fp8_grad_amax_spread_bits: float | None = None
    fp8_grad_amax_beyond: int = 0
    fp8_grad_amax_compared: int = 0
    ops: dict[str, dict[str, int]] = field(default_factory=dict)  # op -> dtype -> count
    act_exp_hist: list[int] = field(default_factory=list)  # summed float32-exponent bins
    grad_exp_hist: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ScalerEvent:
    step: int
    kind: Literal["backoff", "growth"]
    scale_before: float
    scale_after: float
    culprits: list[str] = field(default_factory=list)  # backward order; first = likely origin
    # The first layer whose forward output overflowed in that step, when it was recorded:
    # then the non-finite gradients started in the forward pass.
    forward_origin: str | None = None
    # The step's loss was already NaN/inf (the trouble began in the forward pass), when
    # known: read in the same host copy that names the culprits.
    loss_nonfinite: bool | None = None
    # A recorded step: its culprits are every layer with non-finite gradients in the order
    # they arrived. An unrecorded one's are the layers with parameters, in reverse forward
    # order (their gradients' flags, read once at the skip).
    recorded: bool = False
    # How many of the step's ``update()`` calls backed off: more than one only where the loop
    # updates the scaler more than once per iteration (after each of two optimizers).
    count: int = 1


@dataclass(frozen=True)
class ScalerReset:
    """A new GradScaler took over from the previous one (the old one never updated
    again): the scale jumped from the old scaler's last to the new one's start, which is
    no growth. A scaler built inside ``train_one_epoch()`` does this every epoch."""

    step: int  # the first step the new scaler ran
    scale_before: float  # the old scaler's scale, in force after the step before (nan: unknown)
    scale_after: float  # the new scaler's start: its init_scale, or a loaded state's scale


@dataclass(frozen=True)
class ScalerTimeline:
    scale: list[tuple[int, float]]  # (step, scale after update) at changes and recorded steps
    backoff_steps: list[int]
    growth_steps: list[int]
    skipped_steps: list[int]
    skipped_by_optimizer: dict[str, list[int]]
    events: list[ScalerEvent]
    init_scale: float | None = None
    growth_interval: int | None = None
    growth_factor: float | None = None
    backoff_factor: float | None = None
    enabled: bool = True
    # The optimizers this scaler steps ("Adam#0, SGD#1"), as the report names them.
    name: str = ""
    # Where their parameters sit: the layers' common prefix ("g.net"), else the top-level
    # names ("g, d"); "" when unknown. Shown beside the name when a run has several scalers.
    stepping: str = ""
    # Where a new scaler replaced the previous one, in step order.
    resets: list[ScalerReset] = field(default_factory=list)
    # The last finished step a GradScaler worked in (scaled, unscaled, stepped or updated),
    # recorded or not: where a loop that dropped its scaler stopped using it. None in a
    # report written before it was kept (the recorded steps' scales tell it then).
    last_step: int | None = None

    @property
    def label(self) -> str:
        """The name with what it steps, "Adam#1 (params of g)", for a reader to tell a
        run's scalers apart (``name`` stays the key tags and ``compare`` match on)."""
        return f"{self.name} (params of {self.stepping})" if self.stepping else self.name


# The figures of a heatmap cell (:class:`LayerHeatmaps`), in their byte order: the output's
# headroom (bits to the format's max) and underflow share, its gradient's (as scaled), and
# the gradient's share of exact zeros (a gradient flushed whole shows as all underflow).
HEATMAP_FIGURES = ("headroom", "underflow", "grad_headroom", "grad_underflow", "grad_zero")


@dataclass(frozen=True)
class LayerHeatmaps:
    """Every layer's heatmap cells over the run (``steps.heatmaps``); the history keeps
    only each step's worst layers, and a 500-layer model's heatmaps were grey holes.

    Column ``c`` holds the worst of up to ``span`` consecutive recorded steps from
    ``steps[c]`` on (least headroom, most underflow, any inf/NaN or overflow): at most
    ``steps.heatmaps.HEATMAP_COLUMNS`` columns, halved as the run grows. ``cells`` is
    base64 of ``len(layers) x len(steps) x (len(HEATMAP_FIGURES) + 1)`` bytes, row-major:
    per figure a byte (255: no such tensor in those steps), headroom in quarter bits (254:
    +inf, an all-zero tensor), shares in units of 1/250; then a flag byte (1: the output
    held inf/NaN, 2: beyond the max; 4 and 8: the same for its gradient).
    """

    layers: list[str]
    steps: list[int]
    span: int
    cells: str


@dataclass(frozen=True)
class Event:
    """Something observed at run time that analysis turns into a finding.

    ``kind`` is the finding kind it supports (e.g. ``clip_before_unscale``,
    ``nonfinite_forward``); ``data`` holds the numbers for the message.
    """

    kind: str
    step: int
    module: str | None = None
    op: str | None = None
    frame: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """One diagnosis: what is wrong, where, and what to do about it."""

    kind: str
    severity: Severity
    module: str | None
    op: str | None
    step: int | None
    message: str
    advice: str
    frame: str | None = None
    count: int = 1
    steps: list[int] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    # In a multi-process run: the rank it was first seen on, and every rank that saw it.
    rank: int | None = None
    ranks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class AmpConfig:
    device_type: str | None  # "cpu" / "cuda"
    dtype: str | None  # the low-precision dtype autocast used
    scaler: bool  # an enabled GradScaler was in use
    autocast_seen: bool = False
    # Other low-precision dtypes autocast also ran under (a run switching format midway).
    other_dtypes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunInfo:
    torch_version: str
    started: str
    duration_s: float
    every: int
    models: list[str]
    command: list[str] | None = None
    exit_code: int | None = None
    outcome: Outcome = "completed"
    error: str | None = None
    # The user's line that raised ``error`` ("file:line in function"), when known.
    error_at: str | None = None
    rank: int | None = None
    world_size: int | None = None
    # Modules run in float32 under autocast by --fp32 / watch(fp32=...): those that ran.
    fp32_modules: list[str] = field(default_factory=list)
    # Modules --fp32 forced whose forward never ran: nothing changed for them.
    fp32_not_run: list[str] = field(default_factory=list)
    # A matched container that is never called (ModuleList) -> its members, forced instead.
    fp32_containers: dict[str, list[str]] = field(default_factory=dict)
    # --target-dtype: the format the user plans to move to; its what-ifs become warnings.
    target_dtype: str | None = None


@dataclass(frozen=True)
class Session:
    """Everything one watched run produced. Immutable; render it any number of times."""

    version: str
    amp: AmpConfig
    steps: int  # training steps seen
    recorded_steps: int
    layers: list[LayerSummary]
    scaler: ScalerTimeline | None
    # Bounded in rows and layers per row: evenly thinned in long runs, worst layers per step.
    history: list[StepRecord]
    events: list[Event]
    findings: list[Finding]
    run: RunInfo
    # Further enabled GradScalers of the watched models (a GAN with one per network):
    # ``scaler`` is the first seen, whose updates end the steps.
    other_scalers: list[ScalerTimeline] = field(default_factory=list)
    # Every layer x recorded step, for the heatmaps (None: a report from before them).
    heatmaps: LayerHeatmaps | None = None

    def to_json(self) -> str:
        # Compact separators: indentation was ~40% of the bytes of a large report.
        return json.dumps(to_jsonable(self), separators=(",", ":"), allow_nan=False)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json())
        return p

    @classmethod
    def from_json(cls, text: str) -> Session:
        """Parse and check a JSON report; :class:`ReportFormatError` names any problem."""
        try:
            data = json.loads(text)
        except ValueError as e:  # JSONDecodeError, or a number too large to parse
            raise ReportFormatError(f"not valid JSON ({e})") from None
        check_report_version(data)
        session: Session = from_jsonable(cls, data)
        return session

    @classmethod
    def load(cls, path: str | Path) -> Session:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ReportFormatError(f"not a UTF-8 text file ({e.reason})") from None
        return cls.from_json(text)

    def layer(self, name: str) -> LayerSummary:
        for lay in self.layers:
            if lay.name == name:
                return lay
        raise KeyError(f"no layer named {name!r}; layers: {[x.name for x in self.layers][:20]}")

    def findings_of(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]
