"""A PyTorch Lightning run, for amp-doctor's acceptance suite.

A ``LightningModule`` as the Lightning docs write one (``training_step`` returns the loss,
``configure_optimizers``, a validation step under Lightning's own ``no_grad``), trained with
``precision="16-mixed"`` or ``"bf16-mixed"`` on the CPU. Tiny model, random data, nothing
downloaded.

On the CPU, ``Trainer(precision="16-mixed")`` warns and trains in bfloat16 (Lightning's
accelerator connector swaps it). ``--precision 16-mixed-plugin`` gets real float16 AMP on the
CPU the way Lightning allows it: ``plugins=[MixedPrecision("16-mixed", "cpu")]``, whose
plugin owns a ``torch.amp.GradScaler("cpu")``.

    python lightning_train.py --steps 12 --precision 16-mixed [--root out-pl] [--callback]

``--callback`` adds ``amp_doctor.integrations.lightning.AmpDoctor``. Prints each step's loss
as ``step N: loss X``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self, d: int = 32, hidden: int = 64, classes: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                     nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
                      ) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        print(f"step {self.global_step}: loss {loss.item()!r}", flush=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    y = torch.randint(0, 8, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def main(argv: list[str] | None = None, callbacks: Sequence[L.Callback] = ()) -> L.Trainer:
    """Fit; ``callbacks`` are added to the Trainer's (the integration tests call this)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--precision", default="16-mixed",
                    choices=["16-mixed", "16-mixed-plugin", "bf16-mixed", "32"])
    ap.add_argument("--root", default="out-pl")
    ap.add_argument("--callback", action="store_true")
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)

    L.seed_everything(0, verbose=False)
    model = Classifier()
    cbs = list(callbacks)
    if args.callback:
        from amp_doctor.integrations.lightning import AmpDoctor

        cbs.append(AmpDoctor(every=args.every))
    if args.precision == "16-mixed-plugin":
        from lightning.pytorch.plugins import MixedPrecision

        precision: dict[str, object] = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    else:
        precision = {"precision": args.precision}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        **precision,  # type: ignore[arg-type]
        max_steps=args.steps,
        val_check_interval=5,
        limit_val_batches=2,
        default_root_dir=args.root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=cbs,
    )
    trainer.fit(model, loader(256, 1), loader(32, 2))
    return trainer


if __name__ == "__main__":
    main()
