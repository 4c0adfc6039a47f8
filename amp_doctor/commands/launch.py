"""``diagnose --nproc-per-node N``: every rank under amp-doctor through PyTorch's own
launcher (torchrun), then one merged report from the ranks' files."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from amp_doctor.commands.common import EXIT_INTERRUPTED, LAUNCHER_ENV, fail
from amp_doctor.commands.publish import publish
from amp_doctor.commands.terminal import Console, sigint_shield

if TYPE_CHECKING:
    from amp_doctor import runner

__all__ = ["launch"]

# The ranks have all exited when torchrun returns: their files are there or never will be.
MERGE_WAIT_S = 5.0


def launch(nproc: int, target: runner.Target, logdir: Path, forwarded: list[str],
           json_out: Path | None, report_out: Path | None, fail_on: str,
           tensorboard: bool) -> int:
    """Run every rank under amp-doctor with PyTorch's own launcher, then merge the ranks."""
    import subprocess

    from amp_doctor.merge import merge_run_dir

    what = ["-m", target.name] if target.kind == "module" else [target.name]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "amp_doctor", "diagnose", "--quiet",
           "--logdir", str(logdir), *forwarded, *what, *target.args]
    env = {**os.environ, LAUNCHER_ENV: "1"}
    try:
        rc = subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        rc = EXIT_INTERRUPTED
    console = Console()
    try:
        with sigint_shield(console):
            merged = merge_run_dir(logdir, nproc, timeout=MERGE_WAIT_S)
            if merged is None:
                fail(f"no rank wrote a report in {logdir}; see the errors above.", code=rc or 1)
            code = merged.run.exit_code or rc
            return publish(merged, logdir, json_out, report_out, fail_on, tensorboard, code,
                           console)
    finally:
        console.close()
