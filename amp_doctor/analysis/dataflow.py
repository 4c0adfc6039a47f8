"""The recorded data flow between layers: which layer fed which (``consumers``)."""

from __future__ import annotations

from amp_doctor.records import LayerSummary, Session

__all__ = ["producers", "layers_before", "layers_after"]


def producers(session: Session, lay: LayerSummary) -> list[LayerSummary]:
    """The layers whose output ``lay`` took as input (containers that only returned a
    child's output left out)."""
    return [p for p in session.layers if lay.name in p.consumers and not p.passthrough]


def _closure(session: Session, start: LayerSummary, up: bool) -> list[LayerSummary]:
    by_name = {lay.name: lay for lay in session.layers}
    seen: dict[str, LayerSummary] = {}
    todo = [start]
    while todo:
        cur = todo.pop()
        nxt = producers(session, cur) if up else [
            by_name[c] for c in cur.consumers if c in by_name]
        for n in nxt:
            if n.name not in seen and n.name != start.name:
                seen[n.name] = n
                todo.append(n)
    return sorted(seen.values(), key=lambda x: x.order)


def layers_before(session: Session, lay: LayerSummary) -> list[LayerSummary]:
    """Every layer whose output reached ``lay``'s input, in forward order."""
    return _closure(session, lay, up=True)


def layers_after(session: Session, lay: LayerSummary) -> list[LayerSummary]:
    """Every layer that ``lay``'s output reached, in forward order."""
    return _closure(session, lay, up=False)
