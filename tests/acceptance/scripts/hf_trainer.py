"""A Hugging Face ``Trainer`` run, for amp-doctor's acceptance suite.

A causal LM fine-tune as the transformers examples write it (``run_clm.py`` style): a
``GPT2Config`` built in code (tiny, nothing downloaded), a dataset of random token ids,
``TrainingArguments`` with ``bf16=True`` or ``fp16=True`` on the CPU. For bfloat16 Accelerate
enters autocast inside the model's forward; ``fp16=True`` on a CPU (Accelerate 1.x) runs in
float32, with no autocast and no GradScaler, which amp-doctor reports as autocast_inactive
(on a GPU, Accelerate's optimizer wrapper owns a GradScaler).

    python hf_trainer.py --steps 12 --precision bf16 [--out_dir out-hf] [--callback]

``--callback`` adds ``amp_doctor.integrations.transformers.AmpDoctorCallback``; it prints
each step's loss as ``step N: loss X`` and, at the end, the Trainer's final log line.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class RandomTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PrintLoss(TrainerCallback):
    """Print every step's loss with full precision (the Trainer's logs round them)."""

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            print(f"step {state.global_step}: loss {logs['loss']!r}", flush=True)


def main(argv: list[str] | None = None, callbacks: Sequence[TrainerCallback] = ()) -> Trainer:
    """Train; ``callbacks`` are added to the Trainer's (the integration tests call this)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--out_dir", default="out-hf")
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--callback", action="store_true",
                    help="use amp-doctor's Trainer callback (instead of amp-doctor diagnose)")
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)

    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    train = RandomTokens(64, 16, config.vocab_size, seed=1)
    targs = TrainingArguments(
        output_dir=args.out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=args.precision == "bf16",
        fp16=args.precision == "fp16",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    cbs: list[TrainerCallback] = [PrintLoss(), *callbacks]
    if args.callback:
        from amp_doctor.integrations.transformers import AmpDoctorCallback

        cbs.append(AmpDoctorCallback(every=args.every))
    trainer = Trainer(model=model, args=targs, train_dataset=train, callbacks=cbs)
    trainer.train()
    print(f"final log: {trainer.state.log_history[-1]}")
    return trainer


if __name__ == "__main__":
    main()
