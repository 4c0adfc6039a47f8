"""``diagnose --nproc-per-node N``: every rank under amp-doctor through PyTorch's own
launcher (torchrun), then one merged report from the ranks' files."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amp_doctor.commands.common import EXIT_INTERRUPTED, LAUNCHER_ENV, fail
from amp_doctor.commands.publish import publish
from amp_doctor.commands.terminal import (
    Console,
    give_back_sigterm,
    sigint_shield,
    take_sigterm,
)

if TYPE_CHECKING:
    from amp_doctor import runner

__all__ = ["launch"]

# The ranks have all exited when torchrun returns: their files are there or never will be.
MERGE_WAIT_S = 5.0


def launch(nproc: int, target: runner.Target, logdir: Path, forwarded: list[str],
           json_out: Path | None, report_out: Path | None, fail_on: str,
           tensorboard: bool) -> tuple[int, int | None]:
    """Run every rank under amp-doctor with PyTorch's own launcher, then merge the ranks.

    The exit code, and the signal that ended the run (SIGTERM: passed on to torchrun,
    which ends the ranks with it; SIGINT: a Ctrl-C, which the ranks have too; each rank
    writes its report; the caller ends by the signal once the merged one is out, see
    :func:`~amp_doctor.commands.terminal.die_by_signal`)."""
    import subprocess

    from amp_doctor.merge import merge_run_dir

    what = ["-m", target.name] if target.kind == "module" else [target.name]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "amp_doctor", "diagnose", "--quiet",
           "--logdir", str(logdir), *forwarded, *what, *target.args]
    env = {**os.environ, LAUNCHER_ENV: "1"}
    proc = subprocess.Popen(cmd, env=env)
    with _sigterm_passed_on(proc) as received:
        try:
            rc = proc.wait()
        except KeyboardInterrupt:  # torchrun, in the same process group, has it too
            rc = EXIT_INTERRUPTED
            if os.name == "posix":
                received.append(signal.SIGINT)
            with contextlib.suppress(KeyboardInterrupt):
                proc.wait()
    console = Console()
    try:
        with sigint_shield(console):
            merged = merge_run_dir(logdir, nproc, timeout=MERGE_WAIT_S)
            if merged is None:
                fail(f"no rank wrote a report in {logdir}; see the errors above.", code=rc or 1)
            code = merged.run.exit_code or rc
            return publish(merged, logdir, json_out, report_out, fail_on, tensorboard, code,
                           console), (received[0] if received else None)
    finally:
        console.close()


@contextlib.contextmanager
def _sigterm_passed_on(proc: Any) -> Iterator[list[int]]:
    """While torchrun runs, a SIGTERM to this process (a scheduler's, ``kill``) is passed
    on to it instead of ending this process at once, which left torchrun and the ranks
    training as orphans, with no merged report. Yields the signals received."""
    received: list[int] = []

    def pass_on(signum: int, frame: Any) -> None:
        del frame
        received.append(signum)
        with contextlib.suppress(OSError):
            proc.send_signal(signum)

    taken = take_sigterm(pass_on)
    try:
        yield received
    finally:
        if taken:
            give_back_sigterm(pass_on)
