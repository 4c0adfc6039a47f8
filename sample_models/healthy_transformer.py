"""Healthy baseline: a tiny causal transformer language model trained with AMP.

What goes wrong: nothing. A GPT-style model (token + position embeddings, two
pre-LayerNorm blocks of causal self-attention and a GELU MLP, a final
LayerNorm and an LM head) is trained on synthetic arithmetic sequences
(``x[t+1] = (x[t] + k) % vocab`` with a per-sequence stride ``k`` the model
has to infer from the context). The causal mask is applied the usual way,
``scores.masked_fill(mask, float("-inf"))`` before the softmax; the diagonal
is never masked, so no row is all ``-inf`` and the softmax stays finite even
in float16.

Default: float16 autocast with a GradScaler. ``--dtype bfloat16`` runs
bfloat16 autocast with the scaler constructed ``enabled=False`` (bfloat16 has
float32's exponent range and needs no loss scaling); ``--dtype float32``
disables autocast.

Symptom when run plainly: none. The loss falls and stays finite, and the
scale stays at 65536 (no backoff, no skipped step).

Expected amp-doctor finding: nothing (an empty list of findings).

Module names (``model.named_modules()``): ``tok_emb``, ``pos_emb``,
``blocks.0.ln1``, ``blocks.0.attn``, ``blocks.0.attn.qkv``,
``blocks.0.attn.proj``, ``blocks.0.ln2``, ``blocks.0.mlp``,
``blocks.0.mlp.fc1``, ``blocks.0.mlp.act``, ``blocks.0.mlp.fc2``, the same
under ``blocks.1``, ``ln_f`` and ``head``.

``make_model``, ``make_batch`` and ``loss_fn`` are importable so a benchmark can
time the same model with and without amp-doctor attached.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 16
SEQ_LEN = 12
D_MODEL = 32
N_HEADS = 2
N_LAYERS = 2

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


class CausalSelfAttention(nn.Module):
    mask: torch.Tensor

    def __init__(self, d_model: int, n_heads: int, max_len: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        # True above the diagonal: position t must not see t+1, t+2, ...
        mask = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q = q.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        k = k.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.n_heads)
        scores = scores.masked_fill(self.mask[:t, :t], float("-inf"))
        att = torch.softmax(scores, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, max_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, max_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(
        self,
        vocab: int = VOCAB,
        d_model: int = D_MODEL,
        n_heads: int = N_HEADS,
        n_layers: int = N_LAYERS,
        max_len: int = SEQ_LEN,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, max_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(device: torch.device | str) -> nn.Module:
    """The model, float32 parameters on ``device`` (autocast casts per op)."""
    return TinyLM().to(device)


def make_batch(device: torch.device | str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences ``(start + k*t) % VOCAB``; targets are inputs shifted by one."""
    start = torch.randint(0, VOCAB, (batch_size, 1))
    stride = torch.randint(1, 4, (batch_size, 1))
    seq = (start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over all positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                   help="autocast dtype (float32 disables autocast)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    use_amp = dtype != torch.float32

    model = make_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # Loss scaling is only needed for float16's narrow exponent range.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    init_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"device={device.type} dtype={args.dtype} scaler={scaler.is_enabled()} "
          f"init_scale={init_scale:.1f}")

    first_loss = math.nan
    loss_value = math.nan
    bad_step: int | None = None
    model.train()
    for step in range(args.steps):
        x, y = make_batch(device, args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=use_amp):
            logits = model(x)
            loss = loss_fn(logits, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

        loss_value = loss.item()
        if step == 0:
            first_loss = loss_value
        if bad_step is None and not math.isfinite(loss_value):
            bad_step = step
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss_value:.4f} scale={scale:.1f}")

    final_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    print(f"first_loss={first_loss:.4f} final_loss={loss_value:.4f} "
          f"init_scale={init_scale:.1f} final_scale={final_scale:.1f}")
    if bad_step is not None:
        print(f"SYMPTOM: loss is non-finite at step {bad_step}")
    elif final_scale < init_scale:
        print(f"SYMPTOM: scale fell from {init_scale:g} to {final_scale:g}")
    else:
        print("SYMPTOM: none (healthy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
