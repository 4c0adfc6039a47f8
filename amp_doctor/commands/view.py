"""``amp-doctor view``: TensorBoard on one or more runs, each named after its folder."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import click

from amp_doctor.commands.common import DASHBOARD_FRAGMENT, OUTLIERS_HINT, fail
from amp_doctor.runfiles import JSON_NAME

__all__ = ["view"]

# How long `view` waits for TensorBoard to print its URL before giving up.
TENSORBOARD_START_TIMEOUT_S = 120.0


def _run_names(runs: list[Path]) -> list[str]:
    """Short distinct names: each folder's own name, with parents only to tell them apart."""
    parts = [r.absolute().parts for r in runs]
    depth = 1
    while True:
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names) or depth >= max(len(p) for p in parts):
            return names
        depth += 1


def _port_in_use(host: str, port: int) -> bool:
    import socket

    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False  # TensorBoard will report the bad host itself
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As TensorBoard's server does: a port in TIME_WAIT is free to take.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError:
            return True
    return False


@click.command(short_help="Open runs' dashboards in TensorBoard.")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--port", type=click.IntRange(0, 65535), default=6006, show_default=True,
              help="0 picks a free port.")
@click.option("--host", default="127.0.0.1", show_default=True)
def view(runs: tuple[Path, ...], port: int, host: str) -> None:
    """Start TensorBoard on one or more RUNS and print its URL; Ctrl-C stops it.

    Each run shows under its own folder's name, so several runs (before and after a
    fix, float16 and bfloat16) compare side by side: amp-doctor view RUN_A RUN_B
    """
    import importlib.util
    import shutil
    import tempfile

    from amp_doctor.commands.terminal import die_by_signal, sigterm_unwinds
    from amp_doctor.errors import Terminated

    if importlib.util.find_spec("tensorboard") is None:
        fail(f"tensorboard is not installed in this environment ({sys.executable}): "
             "pip install tensorboard, then run amp-doctor view again.", code=1)
    # A run's JSON report names its run, as `report` takes it.
    runs = tuple(r.parent if r.is_file() and r.name == JSON_NAME else r for r in runs)
    for run in runs:
        if not run.is_dir():
            fail(f"no run directory at {str(run)!r}; pass the --logdir of a diagnose run "
                 "(default runs/amp-doctor/<script>-<timestamp>).")
    if _port_in_use(host, port):
        fail(f"port {port} on {host} is in use (another TensorBoard?); pass a free port "
             f"with --port {port + 1 if port < 65535 else 6006}, or --port 0 for any free one.",
             code=1)
    # TensorBoard names a run by its folder relative to --logdir: pointed at the run
    # itself, the run is called ".". A folder of symlinks named after the runs gives each
    # its name (TensorBoard's own advice instead of --logdir_spec).
    tree = Path(tempfile.mkdtemp(prefix="amp-doctor-view-"))
    # SIGTERM (kill, a supervisor's or an IDE's stop button) ends it as Ctrl-C does: the
    # server stopped, the folder removed, then the process ends by the signal.
    with sigterm_unwinds() as term:
        term.arm()
        try:
            for run, name in zip(runs, _run_names(list(runs)), strict=True):
                link = tree / name
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(run.absolute(), target_is_directory=True)
            code = _serve_tensorboard(tree, host, port, ", ".join(_run_names(list(runs))))
        except Terminated:
            code = 0
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    if term.received is not None:
        die_by_signal(term.received)
    if code:
        sys.exit(code)


def _serve_tensorboard(logdir: Path, host: str, port: int, names: str) -> int:
    import contextlib
    import subprocess

    from amp_doctor.errors import Terminated

    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", host,
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def drain() -> None:
        # Read TensorBoard's stderr to the end, so it never blocks on a full pipe.
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip())
            if not url and "http://" in line:
                url.append(line[line.index("http://"):].split()[0])
                ready.set()
        ready.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        ready.wait(TENSORBOARD_START_TIMEOUT_S)
        if not url:  # its stderr ended (or the wait did): has it exited?
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
        if url or proc.poll() is None:  # still starting after the wait: say where it will be
            at = (url[0] if url else f"http://{host}:{port}/").rstrip("/") + "/"
            click.echo(f"amp-doctor: TensorBoard at {at}{DASHBOARD_FRAGMENT}  (runs: {names}; "
                       "Ctrl-C to stop)")
            click.echo(f"amp-doctor: {OUTLIERS_HINT}.")
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        return 0
    except Terminated:  # the caller ends the process by the signal
        proc.terminate()
        proc.wait()
        raise
    reader.join(timeout=5)
    if proc.returncode:
        said = [ln for ln in lines if ln.strip() and not ln.startswith(("NOTE", "    "))]
        last = said[-1].strip() if said else "no message"
        click.echo(f"amp-doctor: error: tensorboard exited with {proc.returncode}: {last}",
                   err=True)
        return 1
    return 0
