"""amp-doctor as a PyTorch Lightning callback.

    from amp_doctor.integrations.lightning import AmpDoctor
    trainer = L.Trainer(precision="16-mixed", callbacks=[AmpDoctor(every=10)])

At ``on_train_start`` it watches the ``LightningModule`` with the precision plugin's
GradScaler (``precision="16-mixed"``; ``"bf16-mixed"`` has none) and the trainer's
optimizers. It writes ``amp_doctor.json``, ``report.txt`` and the TensorBoard logs to
``<logger's log_dir or default_root_dir>/amp_doctor/`` (``rank<k>/`` below it in
multi-process runs), and prints a one-line summary on rank 0 at ``on_train_end``. A run
that raises is closed in ``on_exception`` (report written, ``outcome="exception"``).

Works with ``import lightning`` and with the older ``import pytorch_lightning``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from amp_doctor.integrations._common import SUBDIR, WatchOwner, missing_framework, one_line
from amp_doctor.records import Session
from amp_doctor.watch import DEFAULT_EVERY, Watch

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities import rank_zero_info
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning import Callback  # type: ignore[no-redef,assignment]
        from pytorch_lightning.utilities import rank_zero_info  # type: ignore[no-redef]
    except ImportError as e:
        raise missing_framework("lightning", "lightning") from e

__all__ = ["AmpDoctor"]


def _precision_plugin(trainer: Any) -> Any:
    plugin = getattr(trainer, "precision_plugin", None)
    if plugin is None:
        plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    return plugin


def _logdir(trainer: Any) -> Path:
    # trainer.log_dir is the first logger's log_dir, or default_root_dir without a logger.
    base = getattr(trainer, "log_dir", None) or getattr(trainer, "default_root_dir", None) or "."
    out = Path(base) / SUBDIR
    if int(getattr(trainer, "world_size", 1) or 1) > 1:
        out = out / f"rank{int(getattr(trainer, 'global_rank', 0))}"
    return out


class AmpDoctor(Callback):  # type: ignore[misc]
    """Watch a Lightning ``Trainer.fit`` with amp-doctor.

    ``every`` records one step in N (skips and backoffs are tracked on every step); other
    keyword arguments go to :func:`amp_doctor.watch` (``anomaly=True``, ``max_steps=``,
    ``logdir=`` to write somewhere else, ...). After ``fit``, :attr:`session` holds the
    report's data and :attr:`summary` the one-line summary.
    """

    def __init__(self, every: int = DEFAULT_EVERY, **watch_kwargs: Any) -> None:
        super().__init__()
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

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        found: dict[str, Any] = {}
        scaler = getattr(_precision_plugin(trainer), "scaler", None)
        if scaler is not None:
            found["scaler"] = scaler
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        # LightningOptimizer wraps the torch optimizer in ``_optimizer``.
        optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
        if optimizers:
            found["optimizer"] = optimizers
        logdir = Path(self._logdir_override) if self._logdir_override else _logdir(trainer)
        self._owner.start(self, pl_module, logdir.absolute(), **found)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        session = self.close()
        if session is not None:
            self.summary = one_line(session, self._owner.logdir)
            rank_zero_info(self.summary)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        outcome = "interrupted" if isinstance(exception, KeyboardInterrupt) else "exception"
        self._owner.close(outcome=outcome, error=f"{type(exception).__name__}: {exception}")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # The last event of every fit, also when on_train_end never came.
        self.close()

    def close(self) -> Session | None:
        """Stop watching now (idempotent); returns the session, or None if never started.
        (A fit that raised was closed by :meth:`on_exception` already.)"""
        return self._owner.close(outcome="completed")
