"""Anomaly mode's events: one per step an origin showed up in, counted, and bounded.

Also the one-line message of the ``NonFiniteError`` raised in
``on_nonfinite="raise"`` mode.
"""

from __future__ import annotations

from amp_doctor.records import Event

__all__ = ["EventLog", "one_line", "MAX_EVENTS_PER_KEY"]

# Events kept per (kind, module, op); later ones are only counted.
MAX_EVENTS_PER_KEY = 50

_Key = tuple[str, str | None, str | None]


class EventLog:
    """Events keyed by (kind, module, op), plus the first internal error, if any."""

    def __init__(self) -> None:
        self._events: dict[_Key, list[Event]] = {}
        self._counts: dict[_Key, int] = {}
        self._internal_error: str | None = None

    def store(self, ev: Event, steps: list[int]) -> None:
        """Keep one event per step an origin showed up in, and count them all."""
        key = (ev.kind, ev.module, ev.op)
        es = self._events.setdefault(key, [])
        seen = {e.step for e in es}
        new = [s for s in steps if s not in seen]
        self._counts[key] = self._counts.get(key, 0) + len(new)
        for s in new:
            if len(es) >= MAX_EVENTS_PER_KEY:
                break
            es.append(ev if s == ev.step else Event(
                kind=ev.kind, step=s, module=ev.module, op=ev.op, frame=ev.frame,
                data=ev.data))

    def note_internal(self, e: Exception) -> None:
        """amp-doctor's own bookkeeping failed: the first error is reported, the run goes on."""
        if self._internal_error is None:
            self._internal_error = f"{type(e).__name__}: {e}"

    def mark_first_seen(self, first: int) -> None:
        """An origin was named: each origin event not yet marked says when the
        non-finite values were first seen (possibly before the searched step)."""
        for es in self._events.values():
            for e in es:
                if e.kind != "nonfinite_input" and "first_seen_step" not in e.data:
                    e.data["first_seen_step"] = min(first, e.step)

    def events(self) -> list[Event]:
        out: list[Event] = []
        for key, es in self._events.items():
            n = self._counts[key]
            first = es[0]
            out.append(Event(kind=first.kind, step=first.step, module=first.module, op=first.op,
                             frame=first.frame, data={**first.data, "occurrences": n}))
            out.extend(es[1:])
        if self._internal_error:
            out.append(Event(kind="internal_error", step=0,
                             data={"error": self._internal_error, "where": "anomaly"}))
        return out


def one_line(ev: Event) -> str:
    """The ``NonFiniteError`` message: where, what, and analysis's fix for it."""
    from amp_doctor.analysis.analyze import event_advice  # analysis sits above anomaly in the flow
    from amp_doctor.analysis.messages import any_input_inf, cast_overflow

    d = ev.data
    held_inf = any_input_inf(d)
    where = f"module {ev.module!r}" if ev.module else "code outside the watched model"
    what = "NaN" if d.get("nan") else ("+inf" if d.get("pos_inf") else "-inf")
    at = f" at {ev.frame}" if ev.frame else ""
    if ev.kind == "nonfinite_input":
        head = f"the batch passed to {ev.module!r} holds {what} at step {ev.step}{at}"
    elif ev.kind == "nonfinite_backward":
        head = (f"{ev.op} in the backward of {d.get('forward_op')} ({d.get('node')}, {where}) "
                f"produced {what} from "
                + ("inputs without NaN" if held_inf else "finite inputs")
                + f" at step {ev.step}{at}")
    elif (cast := cast_overflow(ev.op, d)) is not None:
        head = f"{ev.op} in {where} produced {what} at step {ev.step}{at}: it {cast}"
    else:
        dtype = d.get("dtype")
        inputs = f"{dtype} inputs without NaN" if held_inf else f"finite {dtype} inputs"
        head = f"{ev.op} in {where} produced {what} from {inputs} at step {ev.step}{at}"
    # An op that ran in bfloat16 is in a bfloat16 run: not told to use bfloat16.
    run_dtype = "bfloat16" if d.get("dtype") == "bfloat16" else None
    return f"{head}. Fix: {' '.join(event_advice(ev, run_dtype).split())}"
