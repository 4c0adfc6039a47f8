"""amp-doctor as a Hugging Face ``Trainer`` callback.

    from amp_doctor.integrations.transformers import AmpDoctorCallback
    trainer = Trainer(..., callbacks=[AmpDoctorCallback(every=10)])

At ``on_train_begin`` it watches the Trainer's model (unwrapped from DDP / compile
wrappers), with Accelerate's GradScaler (``fp16=True`` on a GPU) and the optimizer. It
writes ``amp_doctor.json``, ``report.txt`` and the TensorBoard logs to
``<logging_dir or output_dir>/amp_doctor/`` (``rank<k>/`` below it in multi-process runs),
and at ``on_train_end`` puts a one-line summary into ``trainer.state.log_history`` (as
``{"amp_doctor": "...", "step": N}``, just before the final training metrics, so that
``log_history[-1]`` stays what it was) and on the transformers logger.

transformers has no event for a training run that raised. The watch is then closed (hooks
removed, report written with ``outcome="exception"``) when the callback is garbage-collected
or at interpreter exit, whichever comes first; call :meth:`AmpDoctorCallback.close` in your
own ``except``/``finally`` to close it at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from amp_doctor.integrations._common import SUBDIR, WatchOwner, missing_framework, one_line
from amp_doctor.records import Session
from amp_doctor.watch import DEFAULT_EVERY, Watch

try:
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
except ImportError as e:  # pragma: no cover - exercised by test_integrations in a subprocess
    raise missing_framework("transformers", "transformers") from e

__all__ = ["AmpDoctorCallback"]

logger = hf_logging.get_logger(__name__)
LOG_KEY = "amp_doctor"


def _logdir(args: Any) -> Path:
    # transformers < 5 has ``logging_dir`` (default under output_dir); 5 dropped it.
    base = getattr(args, "logging_dir", None) or getattr(args, "output_dir", None) or "."
    out = Path(base) / SUBDIR
    world = int(getattr(args, "world_size", 1) or 1)
    if world > 1:
        out = out / f"rank{int(getattr(args, 'process_index', 0))}"
    return out


def _scaler_and_optimizer(optimizer: Any) -> tuple[Any, Any]:
    """Accelerate's ``AcceleratedOptimizer`` carries the GradScaler and wraps the real one."""
    if optimizer is None:
        return None, None
    scaler = getattr(optimizer, "scaler", None)
    inner = getattr(optimizer, "optimizer", None)
    return scaler, inner if inner is not None else optimizer


class AmpDoctorCallback(TrainerCallback):  # type: ignore[misc]
    """Watch a ``transformers.Trainer`` run with amp-doctor.

    ``every`` records one step in N (skips and backoffs are tracked on every step); other
    keyword arguments go to :func:`amp_doctor.watch` (``anomaly=True``, ``max_steps=``,
    ``logdir=`` to write somewhere else, ...). After training, :attr:`session` holds the
    report's data and :attr:`summary` the one-line summary.
    """

    def __init__(self, every: int = DEFAULT_EVERY, **watch_kwargs: Any) -> None:
        self._logdir_override = watch_kwargs.pop("logdir", None)
        self._owner = WatchOwner(every, watch_kwargs)
        self.summary: str | None = None

    @property
    def watch(self) -> Watch | None:
        return self._owner.watch

    @property
    def session(self) -> Session | None:
        return self._owner.session

    @property
    def logdir(self) -> Path | None:
        return self._owner.logdir

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if model is None:
            logger.warning("amp-doctor: the Trainer passed no model to on_train_begin; "
                           "nothing is watched.")
            return
        scaler, opt = _scaler_and_optimizer(optimizer)
        found: dict[str, Any] = {}
        if scaler is not None:
            found["scaler"] = scaler
        if opt is not None:
            found["optimizer"] = opt
        logdir = Path(self._logdir_override) if self._logdir_override else _logdir(args)
        self._owner.start(self, model, logdir.absolute(), **found)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self._owner.close(outcome="completed")
        if session is None:
            return
        self.summary = one_line(session, self._owner.logdir)
        entry = {LOG_KEY: self.summary, "step": int(getattr(state, "global_step", 0))}
        history = getattr(state, "log_history", None)
        if isinstance(history, list):
            # Keep the Trainer's final metrics last: scripts read log_history[-1].
            at = len(history) - 1 if history and "train_runtime" in history[-1] else len(history)
            history.insert(at, entry)
        if getattr(state, "is_world_process_zero", True):
            logger.warning(self.summary)

    def close(self) -> Session | None:
        """Stop watching now (idempotent); returns the session, or None if never started.
        Called in an ``except`` block, the report says how training ended: the exception
        being handled."""
        session = self._owner.close()
        if session is not None and self.summary is None:
            self.summary = one_line(session, self._owner.logdir)
        return session
