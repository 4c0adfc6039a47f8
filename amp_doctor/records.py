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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from ._version import __version__
from .errors import ReportFormatError

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
    "check_report_version",
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
    # Layers recorded in this step but left out of this history row (only the
    # worst ``recorder.HISTORY_LAYERS`` are kept; every layer is in the aggregates).
    dropped_layers: int = 0


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
    # The step's loss was already NaN/inf (the trouble began in the forward pass), when
    # known: read in the same host copy that names the culprits.
    loss_nonfinite: bool | None = None


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
    # Bounded in rows and layers per row: evenly thinned in long runs, worst layers per step.
    history: list[StepRecord]
    events: list[Event]
    findings: list[Finding]
    run: RunInfo

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


def check_report_version(data: Any) -> None:
    """Refuse a report that is not a JSON object or has another major version than ours.

    Minor versions only add fields with defaults, which older readers ignore and newer
    readers fill in, so they load both ways; a major version may change meanings.
    """
    if not isinstance(data, dict):
        raise ReportFormatError(f"the top level is {_json_kind(data)}, expected an object "
                                "with 'version', 'amp', 'layers', ...")
    version = data.get("version")
    if not isinstance(version, str) or not version.split(".")[0].isdigit():
        raise ReportFormatError(f"'version' is {_shown(version)}, expected a version string "
                                f"like {__version__!r}; this is not an amp-doctor report")
    theirs, ours = version.split(".")[0], __version__.split(".")[0]
    if theirs != ours:
        raise ReportFormatError(
            f"written by amp-doctor {version}, another major version than this amp-doctor "
            f"({__version__}); read it with amp-doctor {theirs}.x")


class _Bad(Exception):
    """A problem found deep in the data; each level on the way up adds its name."""

    def __init__(self, problem: str, where: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.where = where

    def under(self, part: str) -> _Bad:
        sep = "" if not self.where or self.where.startswith("[") else "."
        self.where = f"{part}{sep}{self.where}"
        return self


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    return "a list" if isinstance(v, list) else "an object" if isinstance(v, dict) else "?"


def _shown(v: Any) -> str:
    if v is None or isinstance(v, (dict, list)):
        return _json_kind(v)
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` (a dataclass or typing form) from JSON data.

    The data is checked against the types as it is rebuilt: a damaged or foreign file
    raises :class:`ReportFormatError` naming the field (``findings[2].severity``) and
    the problem, instead of an ``AttributeError`` somewhere in a renderer later.
    """
    try:
        return _converter(tp)(data)
    except _Bad as e:
        raise ReportFormatError(f"{e.where or 'the report'} {e.problem}") from None


# One converter per type, built once from its hints: a report holds many thousands of
# records of a handful of types, and inspecting the types per value was most of the
# load time.
_CONVERTERS: dict[Any, Callable[[Any], Any]] = {}


def _converter(tp: Any) -> Callable[[Any], Any]:
    conv = _CONVERTERS.get(tp)
    if conv is None:
        conv = _make_converter(tp)
        _CONVERTERS[tp] = conv
    return conv


def _bad_value(data: Any, tp: Any) -> _Bad:
    return _Bad(f"is {_shown(data)}, expected {_expected(tp)}")


def _find_bad(items: Iterable[tuple[str, Any]], conv: Callable[[Any], Any]) -> _Bad:
    # The slow path, taken only once a container held a bad value: which one.
    for part, v in items:
        try:
            conv(v)
        except _Bad as e:
            return e.under(part)
    return _Bad("is damaged")  # pragma: no cover - conv failed on the fast path only


def _make_converter(tp: Any) -> Callable[[Any], Any]:
    origin = typing.get_origin(tp)
    if tp is Any or tp == "Any":
        return _any_in
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(members) < len(typing.get_args(tp))
        convs = [_converter(m) for m in members]

        def union(data: Any) -> Any:
            if data is None:
                if optional:
                    return None
                raise _bad_value(data, tp)
            for conv in convs:
                try:
                    return conv(data)
                except _Bad as e:
                    if len(convs) == 1:
                        raise e
            raise _bad_value(data, tp)

        return union
    if origin is Literal:
        allowed = typing.get_args(tp)

        def literal(data: Any) -> Any:
            if data not in allowed or isinstance(data, bool) != any(
                    isinstance(a, bool) for a in allowed):
                raise _Bad(f"is {_shown(data)}, expected one of "
                           + ", ".join(repr(a) for a in allowed))
            return data

        return literal
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item = _converter(item_tp)

        def list_(data: Any) -> Any:
            if type(data) is not list:
                raise _Bad(f"is {_json_kind(data)}, expected a list")
            try:
                return [item(v) for v in data]
            except _Bad:
                raise _find_bad(((f"[{i}]", v) for i, v in enumerate(data)), item) from None

        return list_
    if origin is tuple:
        convs = [_converter(a) for a in typing.get_args(tp)]

        def tuple_(data: Any) -> Any:
            if type(data) is not list or len(data) != len(convs):
                raise _Bad(f"is {_shown(data)}, expected a list of {len(convs)} values")
            out = []
            for i, (conv, v) in enumerate(zip(convs, data, strict=True)):
                try:
                    out.append(conv(v))
                except _Bad as e:
                    raise e.under(f"[{i}]") from None
            return tuple(out)

        return tuple_
    if origin is dict:
        _, value_tp = typing.get_args(tp)
        value = _converter(value_tp)

        def dict_(data: Any) -> Any:
            if type(data) is not dict:
                raise _Bad(f"is {_json_kind(data)}, expected an object")
            try:
                return {k: value(v) for k, v in data.items()}
            except _Bad:
                raise _find_bad(((f"[{k!r}]", v) for k, v in data.items()), value) from None

        return dict_
    if tp is float:
        def float_(data: Any) -> float:
            t = type(data)
            if t is float:
                return data  # type: ignore[no-any-return]
            if t is int:
                return float(data)
            if t is str and data in _NONFINITE:
                return _NONFINITE[data]  # the strings to_jsonable writes for inf/nan
            raise _Bad(f"is {_shown(data)}, expected a number")

        return float_
    if tp in (int, str, bool):
        def exact(data: Any) -> Any:
            if type(data) is not tp:  # bool is not an int here: JSON tells them apart
                raise _bad_value(data, tp)
            return data

        return exact
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = [(f.name, _converter(hints[f.name]),
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                  for f in dataclasses.fields(tp)]
        cls: Any = tp

        def record(data: Any) -> Any:
            if type(data) is not dict:
                raise _Bad(f"is {_shown(data)}, expected an object")
            kwargs = {}
            for name, conv, required in fields:
                if name in data:
                    try:
                        kwargs[name] = conv(data[name])
                    except _Bad as e:
                        raise e.under(name) from None
                elif required:
                    raise _Bad("is missing").under(name)
                # else: a field a newer minor version added; its default applies
            return cls(**kwargs)

        return record
    return lambda data: data


def _expected(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_expected(m) for m in members)
    if origin in (list, tuple):
        return "a list"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "an object"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    names = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}
    return names.get(tp, str(tp))
