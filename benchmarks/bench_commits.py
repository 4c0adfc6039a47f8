"""What each technique buys: the same benchmark run at the commits that added them.

``python benchmarks/bench_commits.py --commits A:label,B:label,... [--models gpt]``

Each commit's ``amp_doctor`` package is checked out into a temporary git worktree
and measured by *this* checkout's harness (``benchmarks/run.py --variants
default,every1``, peak memory included) in a fresh process, with the worktree first
on ``sys.path``: only the library changes from row to row, never the measuring.
Every figure is a ratio to plain AMP measured in that same process, so the
commits are compared by ratios, never by raw times taken at different moments.
The difference between consecutive rows is what the later commit's technique
bought. ``--markdown PATH`` appends the table to PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

REPO = Path(__file__).resolve().parent.parent


def _measure(commit: str, models: str, rounds: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ampd-commit-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree),
                        commit], check=True, capture_output=True)
        try:
            out = Path(tmp) / "results.json"
            env = {**os.environ, "PYTHONPATH": str(tree)}
            where = subprocess.run(
                [sys.executable, "-c", "import amp_doctor; print(amp_doctor.__file__)"],
                cwd=REPO / "benchmarks", env=env, check=True, capture_output=True,
                text=True).stdout
            if not where.startswith(str(tree)):
                raise RuntimeError(f"{commit}: amp_doctor imported from {where.strip()}, "
                                   f"not from the worktree {tree}")
            subprocess.run(
                [sys.executable, str(REPO / "benchmarks" / "run.py"), "--models", models,
                 "--dtypes", "float16", "--variants", "default,every1", "--rounds", str(rounds),
                 "--threads", str(threads), "--json", str(out)],
                cwd=REPO / "benchmarks", env=env, check=True, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            data: dict[str, Any] = json.loads(out.read_text())
            return data
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                           check=False, capture_output=True)


def _row(label: str, commit: str, cell: dict[str, Any]) -> list[Any]:
    v = cell["variants"]
    plain_peak = v["plain"]["memory"]["tensor_peak"] if v["plain"].get("memory") else None

    def mem(key: str) -> str:
        m = v[key].get("memory")
        if not m or not plain_peak:
            return "-"
        extra = m["tensor_peak"] - plain_peak
        return f"+{extra / 1e6:.1f} MB (+{100 * extra / plain_peak:.0f}%)"

    return [label, commit[:7], cell["model"], f"{v['default']['ratio']:.2f}x",
            f"{v['every1']['ratio']:.2f}x", mem("default"), mem("every1")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commits", required=True,
                   help="comma-separated commit[:label] pairs, oldest first")
    p.add_argument("--models", default="gpt")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)
    rows: list[list[Any]] = []
    for item in args.commits.split(","):
        commit, _, label = item.partition(":")
        data = _measure(commit, args.models, args.rounds, args.threads)
        for cell in data["cells"]:
            rows.append(_row(label or commit, commit, cell))
        print(tabulate(rows, tablefmt="plain"), flush=True)
    headers = ["technique (cumulative)", "commit", "model", "default x plain",
               "every=1 x plain", "peak mem, default", "peak mem, every=1"]
    table = tabulate(rows, headers=headers, tablefmt="github")
    print(table)
    if args.markdown is not None:
        with args.markdown.open("a") as f:
            f.write("\n## What each technique buys (`benchmarks/bench_commits.py`)\n\n"
                    "Each row is the benchmark run at the commit that added the technique "
                    "(float16, one thread, ratios to plain AMP in the same process); the step "
                    "from the row above is what the technique bought.\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
