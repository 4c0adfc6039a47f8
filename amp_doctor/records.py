"""Plain dataclasses for everything amp-doctor records, and their JSON form.

Collection builds these; analysis reads them; sinks render them. A
:class:`Session` is immutable once built and round-trips through JSON
exactly (never pickle), which is what ``amp-doctor report`` relies on.
Non-finite floats are written as the strings ``"inf"``, ``"-inf"`` and
``"nan"`` so that the files are strict JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

__all__ = [
    "TensorStats",
    "LayerStep",
    "StepRecord",
    "LayerSummary",
    "ScalerEvent",
    "ScalerTimeline",
    "Event",
    "Finding",
    "AmpConfig",
    "RunInfo",
    "Session",
    "SEVERITIES",
    "Severity",
    "to_jsonable",
    "from_jsonable",
]

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")


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
    layers: dict[str, LayerStep]


@dataclass(frozen=True)
class LayerSummary:
    """Per-layer aggregate over all recorded steps."""

    name: str
    type: str
    order: int  # first-call order in the forward pass
    calls: int
    recorded_steps: int
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
    # Multi-process runs: the rank whose figures these are (the worst one).
    worst_rank: int | None = None
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


@dataclass(frozen=True)
class RunInfo:
    torch_version: str
    started: str
    duration_s: float
    every: int
    models: list[str]
    command: list[str] | None = None
    exit_code: int | None = None
    outcome: str = "completed"  # completed | exception | interrupted | exit
    error: str | None = None
    rank: int | None = None
    world_size: int | None = None
    # Modules run in float32 under autocast by --fp32 / watch(fp32=...).
    fp32_modules: list[str] = field(default_factory=list)
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
    history: list[StepRecord]  # bounded; evenly thinned in long runs
    events: list[Event]
    findings: list[Finding]
    run: RunInfo

    def to_json(self) -> str:
        return json.dumps(to_jsonable(self), indent=1, allow_nan=False)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json())
        return p

    @classmethod
    def from_json(cls, text: str) -> Session:
        return from_jsonable(cls, json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> Session:
        return cls.from_json(Path(path).read_text())

    def layer(self, name: str) -> LayerSummary:
        for lay in self.layers:
            if lay.name == name:
                return lay
        raise KeyError(f"no layer named {name!r}; layers: {[x.name for x in self.layers][:20]}")

    def findings_of(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]


def _float_out(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, float):
        return _float_out(obj)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


T = TypeVar("T")
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _any_in(data: Any) -> Any:
    # Free-form values (Event.data, Finding.data) come back with the
    # non-finite floats that to_jsonable wrote as strings.
    if isinstance(data, str):
        return _NONFINITE.get(data, data)
    if isinstance(data, list):
        return [_any_in(v) for v in data]
    if isinstance(data, dict):
        return {k: _any_in(v) for k, v in data.items()}
    return data


def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` (a dataclass or typing form) from JSON data."""
    if data is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return from_jsonable(members[0], data) if len(members) == 1 else data
    if origin is Literal:
        return data
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        return [from_jsonable(item_tp, v) for v in data]
    if tp is Any or tp == "Any":
        return _any_in(data)
    if origin is tuple:
        args = typing.get_args(tp)
        return tuple(from_jsonable(a, v) for a, v in zip(args, data, strict=True))
    if origin is dict:
        _, varg = typing.get_args(tp)
        return {k: from_jsonable(varg, v) for k, v in data.items()}
    if tp is float:
        return float(data)  # float("inf") parses the strings written above
    if tp is Any:
        return _any_in(data)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        kwargs = {
            f.name: from_jsonable(hints[f.name], data[f.name])
            for f in dataclasses.fields(tp)
            if f.name in data
        }
        return tp(**kwargs)  # type: ignore[operator]
    return data
