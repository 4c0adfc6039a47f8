"""The wide-and-deep benchmark model (issue 15): a GPT of 40 blocks, 524 leaf modules.

Real models have hundreds to thousands of modules, and amp-doctor's cost per
recorded step grows with the number of watched tensors, so ``make bench``
includes one such model. A pre-LayerNorm causal GPT: token and position
embeddings, ``N_BLOCKS`` blocks, a final LayerNorm and an LM head. Each block
has 13 leaf modules, spelled out as modules (not functional calls) the way
GPT-2-style code does it, so each is watched: ``ln1``, separate ``q``/``k``/``v``
projections, ``nn.Softmax``, attention dropout, output projection, residual
dropout, ``ln2``, ``fc1``, ``GELU``, ``fc2`` and MLP dropout (dropout 0: the
modules run but change nothing, as in most fine-tuning configs). Narrow
(width 32, sequence 16) so that a plain CPU step stays in the tens of
milliseconds and per-module costs dominate, as on a GPU.

``make_model``, ``make_batch`` and ``loss_fn`` follow the sample models' interface.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
SEQ_LEN = 16
WIDTH = 32
HEADS = 4
N_BLOCKS = 40
LEAVES_PER_BLOCK = 13
# embeddings (2), final LayerNorm and head
LEAF_MODULES = N_BLOCKS * LEAVES_PER_BLOCK + 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH)
        self.v = nn.Linear(WIDTH, WIDTH)
        self.softmax = nn.Softmax(dim=-1)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mask", torch.ones(SEQ_LEN, SEQ_LEN).triu(1).bool(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // HEADS

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, HEADS, hd).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        scores = scores.masked_fill(self.mask[:t, :t], float("-inf"))
        att = self.attn_drop(self.softmax(scores))
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.resid_drop = nn.Dropout(0.0)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)
        self.mlp_drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_drop(self.attn(self.ln1(x)))
        return x + self.mlp_drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, WIDTH)
        self.pos_emb = nn.Embedding(SEQ_LEN, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(device: torch.device | str) -> nn.Module:
    return GPT().to(device)


def make_batch(device: torch.device | str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences ``(start + k*t) % VOCAB``; targets are inputs shifted by one."""
    start = torch.randint(0, VOCAB, (batch_size, 1))
    stride = torch.randint(1, 4, (batch_size, 1))
    seq = (start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
