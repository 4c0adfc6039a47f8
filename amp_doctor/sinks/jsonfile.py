"""The JSON report: the Session itself, strict JSON, loadable by ``Session.load``."""

from __future__ import annotations

from pathlib import Path

from ..records import Session

__all__ = ["write_json"]


def write_json(session: Session, path: str | Path) -> Path:
    return session.save(path)
