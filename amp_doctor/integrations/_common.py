"""What both framework callbacks share: where they write, how they close, what they print.

A callback starts a :class:`~amp_doctor.watch.Watch` when training starts and closes it
when training ends. Frameworks do not always tell a callback that training died
(transformers has no exception event), so every callback also holds a
:class:`weakref.finalize` that closes its watch when the callback is garbage-collected or
the interpreter exits: the hooks never outlive the run, and a report is written with what
was gathered.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

from torch import nn

from amp_doctor import format as F
from amp_doctor.records import Session
from amp_doctor.runfiles import SUBDIR, text_report_path
from amp_doctor.watch import Watch, run_ending, uncaught_exception

__all__ = ["SUBDIR", "WatchOwner", "one_line", "unwrap_model", "missing_framework"]



def missing_framework(module: str, package: str) -> ImportError:
    """The one-line error for an integration imported without its framework."""
    return ImportError(
        f"amp_doctor.integrations.{module} needs the {package!r} package, which is not "
        f"installed; install it with: pip install {package}"
    )


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / ``torch.compile`` / Accelerate wrappers."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        for attr in ("module", "_orig_mod"):
            inner = getattr(model, attr, None)
            if isinstance(inner, nn.Module) and type(model).__name__ in (
                    "DistributedDataParallel", "DataParallel", "OptimizedModule",
                    "FullyShardedDataParallel"):
                model = inner
                break
    return model


def _write_report(logdir: Path | None, session: Session) -> None:
    """The text report beside the JSON one, as the CLI writes it."""
    if logdir is not None:
        from amp_doctor.sinks.text import render_text

        text_report_path(logdir).write_text(render_text(session))


def _close_quietly(watch: Watch, logdir: Path | None, reason: str) -> None:
    """The finalizer: close a watch its callback never closed (training raised), and write
    what it gathered, as a closed one (review 56c: no report.txt, no summary)."""
    if watch.closed:
        return
    exc = uncaught_exception()
    error = F.error_line(exc) if exc is not None else reason
    watch.set_run_meta(outcome="exception", error=error)
    try:
        session = watch.close()
        _write_report(logdir, session)
        print(one_line(session, logdir), file=sys.stderr)
    except Exception:  # pragma: no cover - at interpreter exit, never raise
        pass


def _outcome_now() -> tuple[str, str | None]:
    """How training ended when a callback is closed by hand: in an ``except`` block, by
    the exception being handled (review 56c: ``callback.close()`` in ``except`` recorded a
    crashed ``train()`` as completed); else completed."""
    exc = sys.exc_info()[1]
    if exc is None:
        return "completed", None
    outcome, error, _ = run_ending(exc)
    return outcome, error


def one_line(session: Session, where: Path | None) -> str:
    """``amp-doctor 0.1.0: cpu | bfloat16 autocast | ... | 0 errors, 1 warning (kind) | path``."""
    from amp_doctor.sinks.text import summary_line

    errors = [f for f in session.findings if f.severity == "error"]
    warnings = [f for f in session.findings if f.severity == "warning"]
    kinds = sorted({f.kind for f in errors + warnings})
    verdict = f"{len(errors)} error(s), {len(warnings)} warning(s)"
    if kinds:
        verdict += f" ({', '.join(kinds)})"
    elif session.recorded_steps == 0:
        verdict += " (nothing recorded)"
    line = f"{summary_line(session)} | {verdict}"
    if where is not None:
        line += f" | report: {text_report_path(where)}"
    return line


class WatchOwner:
    """Starts, closes and finalizes one watch for a callback; writes ``report.txt`` too."""

    def __init__(self, every: int, watch_kwargs: dict[str, Any]) -> None:
        self.every = every
        self.watch_kwargs = watch_kwargs
        self.watch: Watch | None = None
        self.session: Session | None = None
        self.logdir: Path | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def start(self, owner: object, model: nn.Module, logdir: Path | None,
              **found: Any) -> Watch:
        if self.watch is not None:
            # A second fit/train with the same callback: the first watch is finished.
            self.close(outcome="completed")
        self.logdir = logdir
        kwargs = {**found, **self.watch_kwargs}  # the user's explicit options win
        kwargs.setdefault("every", self.every)
        self.watch = Watch(unwrap_model(model), logdir=logdir, **kwargs)
        self.watch.owner_closes = True  # its finalizer writes report.txt too
        self.watch.start()
        self.session = None
        # Holds the watch, not the callback: collecting the callback runs it.
        self._finalizer = weakref.finalize(
            owner, _close_quietly, self.watch, logdir,
            "training ended without the framework's end-of-training event")
        return self.watch

    def close(self, outcome: str | None = None, error: str | None = None) -> Session | None:
        """Close the watch and write its reports. ``outcome`` None: from the exception
        being handled, if any (see :func:`_outcome_now`)."""
        watch = self.watch
        if watch is None:
            return self.session
        if outcome is None:
            outcome, seen = _outcome_now()
            error = error if error is not None else seen
        self.watch = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        meta: dict[str, Any] = {"outcome": outcome}
        if error is not None:
            meta["error"] = error
        watch.set_run_meta(**meta)
        self.session = watch.close()
        _write_report(self.logdir, self.session)
        return self.session
