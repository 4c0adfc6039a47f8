"""The JSON form of amp-doctor's records: strict JSON out, checked records back in.

:func:`to_jsonable` turns a record (a dataclass of :mod:`amp_doctor.records`, or any
nesting of them in lists and dicts) into plain JSON data; :func:`from_jsonable`
rebuilds a record of a given type from that data, checking it against the type
hints as it goes, so a damaged or foreign file raises :class:`ReportFormatError`
naming the field (``findings[2].severity``) and the problem. Non-finite floats are
written as the strings ``"inf"``, ``"-inf"`` and ``"nan"``, so the files are
strict JSON. :func:`check_report_version` refuses another major version.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, Union

from amp_doctor._version import __version__
from amp_doctor.errors import ReportFormatError

__all__ = ["to_jsonable", "from_jsonable", "check_report_version"]


def _float_out(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def to_jsonable(obj: Any) -> Any:
    """Plain JSON data for a record (dataclasses, lists, dicts, floats; nested)."""
    t = type(obj)
    if t is float:
        return obj if math.isfinite(obj) else _float_out(obj)
    if t in _SCALARS:
        return obj
    if t is list or t is tuple:
        kinds = set(map(type, obj))
        # Whole lists of plain values (the exponent histograms: most of a report's
        # values) are checked in C rather than converted one call per value.
        if kinds <= _SCALARS or (kinds <= _NUMBERS and _all_finite(obj)):
            return list(obj)
        return [to_jsonable(v) for v in obj]
    names = _FIELD_NAMES.get(t)
    if names is None:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            names = _FIELD_NAMES[t] = tuple(f.name for f in dataclasses.fields(obj))
        elif isinstance(obj, float):
            return _float_out(obj)
        elif isinstance(obj, Mapping):
            return {str(k): to_jsonable(v) for k, v in obj.items()}
        elif isinstance(obj, (list, tuple)):
            return [to_jsonable(v) for v in obj]
        else:
            return obj
    return {n: to_jsonable(getattr(obj, n)) for n in names}


# Types written as they are, and the field names of each dataclass seen: a report holds
# hundreds of thousands of values, and dataclasses.fields() per record was most of the
# time of writing one.
_SCALARS: frozenset[type] = frozenset({int, str, bool, type(None)})
_NUMBERS: frozenset[type] = frozenset({int, float})
_INT: frozenset[type] = frozenset({int})


def _all_finite(values: Any) -> bool:
    try:
        return all(map(math.isfinite, values))
    except OverflowError:  # an int beyond float range: not a non-finite float
        return False
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


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
            # Whole lists of exact ints or of numbers are checked in C (the exponent
            # histograms, a million values in a 2,000-layer report).
            if item_tp is int or item_tp is float:
                kinds = set(map(type, data))
                if item_tp is int and kinds <= _INT:
                    return list(data)
                if item_tp is float and kinds <= _NUMBERS:
                    return list(map(float, data))
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
    if origin in (dict, Mapping):
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

        required = frozenset(name for name, _, req in fields if req)
        pairs = [(name, conv) for name, conv, _ in fields]

        def record(data: Any) -> Any:
            if type(data) is not dict:
                raise _Bad(f"is {_shown(data)}, expected an object")
            if not required <= data.keys():
                missing = next(name for name, _, req in fields if req and name not in data)
                raise _Bad("is missing").under(missing)
            # A field a newer minor version added is absent: its default applies.
            try:
                return cls(**{name: conv(data[name]) for name, conv in pairs if name in data})
            except _Bad:
                pass
            for name, conv in pairs:  # the slow path, only to say which field was bad
                if name in data:
                    try:
                        conv(data[name])
                    except _Bad as e:
                        raise e.under(name) from None
            raise _Bad("is damaged")  # pragma: no cover - conv failed on the fast path only

        return record
    return lambda data: data


def _expected(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_expected(m) for m in members)
    if origin in (list, tuple):
        return "a list"
    if origin in (dict, Mapping) or dataclasses.is_dataclass(tp):
        return "an object"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    names = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}
    return names.get(tp, str(tp))
