"""A ``torch.compile``d model in an AMP loop, for amp-doctor's acceptance suite.

The usual recipe from the PyTorch AMP and compile tutorials: compile the model, run the
forward under autocast, a GradScaler around backward and step. Dropout is on, so any change
to the random stream (an extra graph, a recompile) shows in the losses.

Prints one ``step N: loss X`` line per step, then one JSON line with dynamo's counters
(graph breaks, unique graphs, recompiles), which a tool that watches the model must leave
exactly as they are in a plain run.

    python compiled_mlp.py --steps 8 --dtype float16 [--backend inductor] [--compile_first]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
from torch._dynamo.utils import counters


class Net(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 64, classes: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.fc1(x)))
        h = self.norm(h + self.act(self.fc2(h)))
        return self.head(h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--compile_first", action="store_true",
                    help="call the compiled model once (eval, no grad) before the training loop")
    args = ap.parse_args()

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = Net()
    compiled = torch.compile(model, backend=args.backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    if args.compile_first:
        compiled.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            compiled(torch.randn(16, 32, generator=g))
        compiled.train()
    for step in range(args.steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 8, (16,), generator=g)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(compiled(x).float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"step {step}: loss {loss.item()!r}")
    print(json.dumps({
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(v for k, v in counters["recompiles"].items()),
        "calls_captured": counters["stats"]["calls_captured"],
    }))


if __name__ == "__main__":
    main()
