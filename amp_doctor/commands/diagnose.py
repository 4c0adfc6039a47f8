"""``amp-doctor diagnose``: run a script as python would under a watch that finds the
models, scalers and optimizers by itself, then finish the run on every exit path.

The script runs faithfully (:mod:`amp_doctor.runner`); how it ended (falling off the
end, ``sys.exit``, an exception, Ctrl-C) becomes the run's outcome and exit code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from amp_doctor import format as F
from amp_doctor._version import __version__
from amp_doctor.commands.aftertorch import after_torch_import
from amp_doctor.commands.common import (
    EXIT_USAGE,
    LAUNCHER_ENV,
    EndAsKeyboardInterrupt,
    RunsAScript,
    fail,
    fail_unknown_option,
    owns_process,
)
from amp_doctor.commands.launch import launch
from amp_doctor.commands.paths import (
    DEFAULT_RUNS_DIR,
    check_output_file,
    check_outputs_apart,
    check_tensorboard_path,
    check_writable,
    default_logdir,
    logdir_option,
    output_file_option,
)
from amp_doctor.commands.publish import print_user_exit, publish, render_report, write_or_warn
from amp_doctor.commands.terminal import (
    Console,
    Progress,
    die_by_signal,
    restore_std_streams,
    sigint_shield,
    sigterm_unwinds,
)
from amp_doctor.errors import AmpDoctorError, Terminated, UsageError
from amp_doctor.runfiles import (
    JSON_NAME,
    TEXT_NAME,
    check_run_dir_free,
    claim_run_dir,
    relocated_run_dir,
    text_report_path,
)

if TYPE_CHECKING:
    from amp_doctor import runner
    from amp_doctor.records import Session

__all__ = ["diagnose"]


@click.command(
    cls=RunsAScript,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Run a training script under amp-doctor.",
)
@click.option("-m", "module", metavar="MODULE", help="Run a module, as `python -m MODULE`.")
@click.option("--logdir", type=click.Path(), default=None, callback=logdir_option,
              help="Where the JSON and TensorBoard logs go "
                   "[default: a new runs/amp-doctor/<script>-<timestamp> per run].")
@click.option("--every", type=click.IntRange(min=1), default=None,
              help="Record one training step in N [default: 10].")
@click.option("--anomaly", is_flag=True,
              help="Find the first op that produced NaN/Inf (slower).")
@click.option("--on-nonfinite", type=click.Choice(["record", "raise"]), default="record",
              show_default=True,
              help="With --anomaly: 'raise' checks every op of every step and stops the "
                   "script at the first one that makes NaN/Inf (much slower; implies "
                   "--anomaly).")
@click.option("--json", "json_path", type=click.Path(), default=None,
              callback=output_file_option,
              help="Also write the JSON report to this file.")
@click.option("--report", "report_path", type=click.Path(), default=None,
              callback=output_file_option,
              help="Also write the text report to this file.")
@click.option("--fail-on", type=click.Choice(["never", "warning", "error"]), default="never",
              show_default=True, help="Exit 1 when findings reach this severity.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Record only the first N recorded steps; training runs on untouched.")
@click.option("--fp32", "fp32", multiple=True, metavar="PATTERN",
              help="Run the layers matching PATTERN (a layer name as the report prints it; "
                   "* and ? are wildcards) in float32 under autocast. Repeatable.")
@click.option("--target-dtype", type=click.Choice(["float16", "float8"]), default=None,
              help="The format you plan to move to: its simulated what-ifs become warnings.")
@click.option("--stop-after", type=click.IntRange(min=1), default=None, metavar="N",
              help="End the script after N training steps (a quick trial).")
@click.option("--quiet", "-q", is_flag=True, help="No progress line; print only the report.")
@click.option("--no-tensorboard", is_flag=True, help="Write no TensorBoard event files.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Launch N processes with torch.distributed.run (torchrun), each under "
                   "amp-doctor; logs go to <logdir>/rank<k>/ and one merged report.")
@click.argument("script_and_args", nargs=-1, type=click.UNPROCESSED)
def diagnose(
    module: str | None,
    logdir: Path | None,
    every: int | None,
    anomaly: bool,
    on_nonfinite: str,
    json_path: Path | None,
    report_path: Path | None,
    fail_on: str,
    max_steps: int | None,
    fp32: tuple[str, ...],
    target_dtype: str | None,
    stop_after: int | None,
    quiet: bool,
    no_tensorboard: bool,
    nproc_per_node: int | None,
    script_and_args: tuple[str, ...],
) -> None:
    """Run SCRIPT [ARGS]... (or -m MODULE [ARGS]...) as python would, and diagnose its AMP.

    Everything after the script or module belongs to it:

        amp-doctor diagnose --every 1 train.py --epochs 3
    """
    from amp_doctor import runner

    anomaly = anomaly or on_nonfinite == "raise"
    if module is not None:
        target = runner.Target("module", module, tuple(script_and_args))
    elif script_and_args:
        target = runner.Target("path", script_and_args[0], tuple(script_and_args[1:]))
    else:
        fail("no script given; usage: amp-doctor diagnose [OPTIONS] SCRIPT [ARGS]... "
             "or -m MODULE [ARGS]...")
    if target.kind == "path" and target.name == "-":
        fail("a script read from standard input (`-`) cannot be diagnosed: save it to a "
             "file and pass its path, e.g. amp-doctor diagnose train.py.")
    if target.kind == "path" and target.name.startswith("-") and not Path(target.name).exists():
        fail_unknown_option(target.name)
    if target.kind == "path" and target.name.endswith(".ipynb"):
        stem = shlex.quote(target.name[: -len(".ipynb")])
        fail(f"{target.name!r} is a Jupyter notebook, not a Python script: convert it with "
             f"`jupyter nbconvert --to script {shlex.quote(target.name)}`, then run "
             f"amp-doctor diagnose {stem}.py (or use amp_doctor.watch(model) in the notebook).")
    try:
        resolved = runner.resolve(target)
    except (runner.ScriptNotFound, runner.ModuleNotFound) as e:
        fail(str(e), e.exit_code)
    except BaseException as e:
        # A SyntaxError in the script, or whatever `-m pkg.mod` raised while
        # importing pkg: python reports these before anything runs, and so do we.
        sys.exit(runner.report_exit(e))
    # Every output path is checked before the script runs: a report that cannot be
    # written must fail now, not after hours of training. Absolute: the script may chdir.
    json_out = json_path.absolute() if json_path else None
    report_out = report_path.absolute() if report_path else None
    if json_out is not None:
        check_output_file(json_out, "--json", JSON_NAME)
    if report_out is not None:
        check_output_file(report_out, "--report", TEXT_NAME)
    check_outputs_apart([(o, p, n) for o, p, n in (("--json", json_out, JSON_NAME),
                                                    ("--report", report_out, TEXT_NAME))
                         if p is not None], resolved.file)
    throwaway = logdir is None and json_path is None and report_path is None
    # Folders this run makes, to remove again if it leaves nothing in them (a
    # script's --help): its own, and runs/amp-doctor and runs if they are new.
    made = [d.absolute() for d in (DEFAULT_RUNS_DIR, DEFAULT_RUNS_DIR.parent)
            if throwaway and not d.exists()]
    logdir = (logdir or default_logdir(target)).absolute()
    made = [logdir, *made] if throwaway else []
    check_writable(logdir)
    if not no_tensorboard:
        check_tensorboard_path(logdir)
    if nproc_per_node is not None and nproc_per_node > 1:
        forwarded = [*(["--every", str(every)] if every else []),
                     *(["--anomaly"] if anomaly else []),
                     *(["--on-nonfinite", on_nonfinite] if on_nonfinite != "record" else []),
                     *(["--max-steps", str(max_steps)] if max_steps else []),
                     *[a for p in fp32 for a in ("--fp32", p)],
                     *(["--stop-after", str(stop_after)] if stop_after else []),
                     *(["--target-dtype", target_dtype] if target_dtype else []),
                     *(["--no-tensorboard"] if no_tensorboard else [])]
        release = _claim_logdir(logdir)  # for every rank, and the merge
        code: int | None = None
        signum: int | None = None
        try:
            try:
                code, signum = launch(nproc_per_node, target, logdir, forwarded, json_out,
                                      report_out, fail_on, not no_tensorboard)
            finally:
                release()
        except KeyboardInterrupt:
            if code is None:
                raise
            signum = signal.SIGINT  # after the merged report is out: see below
        if signum is not None:
            die_by_signal(signum)  # the merged report is out: end as python would have
        sys.exit(code)
    # Claimed now, before the script runs, for the watch that starts at its `import torch`:
    # a second run started at the same moment fails here, not after its training.
    from amp_doctor.merge import rank_env

    claimed: Callable[[], None] | None = None
    if rank_env() is None:
        claimed = _claim_logdir(logdir, for_a_watch=True)
    elif not os.environ.get(LAUNCHER_ENV):  # under the launcher, it holds the logdir
        # A rank claims its own folder as its watch starts; the merge writes here.
        try:
            check_run_dir_free(logdir)
        except UsageError as e:
            fail(str(e))
    code = signum = None
    script: list[Any] = []  # the script's runner.ScriptState, once it ran
    try:
        try:
            console = Console()
            try:
                def end_now(signum: int) -> None:
                    # A SIGTERM the script swallowed: its report is out; what the
                    # finally blocks below do, then the end python's would have been.
                    console.close()
                    if claimed is not None:
                        claimed()
                    _remove_if_empty(made)
                    die_by_signal(signum)

                code, signum = _diagnose(resolved, target, logdir, every, anomaly, json_out,
                                         report_out, fail_on, max_steps, quiet,
                                         not no_tensorboard, console, fp32, stop_after,
                                         target_dtype, on_nonfinite, script, throwaway,
                                         end_now)
            finally:
                console.close()
        finally:
            if claimed is not None:
                claimed()
            _remove_if_empty(made)
    except KeyboardInterrupt:
        if code is None:
            raise
        # A Ctrl-C after the report is out (a user pressing it again and again while it
        # was written, the last one after): the run is over, and python ends a script
        # Ctrl-C'd at its very end by SIGINT, not by click's "Aborted!" and exit 1.
        signum = signal.SIGINT
    if script and owns_process():
        # The report is out and the process ends: the script's atexit handlers (a last
        # checkpoint of a class defined in the script) see its state, as under python.
        script[0].enter()
    if signum == signal.SIGINT and owns_process():
        raise EndAsKeyboardInterrupt  # python runs the atexit handlers before SIGINT
    if signum is not None:
        die_by_signal(signum)  # the report is out: end as python would have
    sys.exit(code)


def _claim_logdir(logdir: Path, *, for_a_watch: bool = False) -> Callable[[], None]:
    """``runfiles.claim_run_dir``, its refusal as the CLI's one-line error."""
    try:
        return claim_run_dir(logdir, "--logdir", for_a_watch=for_a_watch)
    except UsageError as e:
        fail(str(e))


def _diagnose(
    resolved: Any, target: runner.Target, logdir: Path, every: int | None, anomaly: bool,
    json_out: Path | None, report_out: Path | None, fail_on: str, max_steps: int | None,
    quiet: bool, tensorboard: bool, console: Console, fp32: tuple[str, ...] = (),
    stop_after: int | None = None, target_dtype: str | None = None,
    on_nonfinite: str = "record", script: list[Any] | None = None, throwaway: bool = False,
    end_now: Callable[[int], None] | None = None,
) -> tuple[int, int | None]:
    """The exit code, and the signal that ended the script (then the process must end by
    it, once every file is written: :func:`die_by_signal`). ``end_now(signum)``: the
    caller's last words before that end, for a SIGTERM the script swallowed and trained
    on after (the report is written first, here)."""
    from amp_doctor import runner
    from amp_doctor.merge import rank_dir, rank_env

    ranks = rank_env()
    under_launcher = bool(os.environ.get(LAUNCHER_ENV))
    run_dir = rank_dir(logdir, ranks[0]) if ranks else logdir
    speaks = ranks is None or (ranks[0] == 0 and not under_launcher)
    # TERM=dumb (an Emacs shell, some CI log viewers) shows the line's escapes raw.
    progress = Progress(enabled=speaks and not quiet and console.isatty()
                        and os.environ.get("TERM") != "dumb", console=console)
    command = ["python", *(["-m", target.name] if target.kind == "module" else [target.name]),
               *target.args]
    finished: list[int] = []
    hook: list[Any] = []  # the finder that starts the watch at the script's `import torch`
    ended: list[BaseException | None] = []  # how the run ended, as its report says
    watching: list[Any] = []

    def start() -> None:
        # Once torch is imported (by the script: what it set before, OMP_NUM_THREADS,
        # took effect as under python), and before any of its code uses it.
        from amp_doctor.watch import DEFAULT_EVERY, Watch

        doctor = Watch(None, every=every or DEFAULT_EVERY, logdir=run_dir, anomaly=anomaly,
                       on_nonfinite=on_nonfinite, max_steps=max_steps, discover=True,
                       tensorboard=tensorboard, fp32=fp32,
                       stop_after=stop_after, target_dtype=target_dtype)
        before = set(threading.enumerate())
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            doctor.start()
        _echo_own_warnings(said, console)  # TensorBoard could not start: one line
        doctor.add_listener(progress)
        if fp32:
            doctor.add_listener(_Fp32Early(doctor, progress, console))
        watching.append(doctor)
        # Started while the script runs: not the script's threads, never waited for.
        threads_before.update(set(threading.enumerate()) - before)

    def finish(exc: BaseException | None) -> int:
        # A Ctrl-C in the instant before the shield is up only means "interrupted": nothing
        # is written yet, so take it as the outcome and finish again, shielded.
        while not finished:
            try:
                # (Ignored on the way out only where the process is amp-doctor's to end.)
                with sigint_shield(console, isinstance(exc, KeyboardInterrupt)
                                   and owns_process()):
                    progress.unwrap_std_streams()
                    progress.clear()
                    failed = hook[0].import_failed if hook else None
                    # Nothing asked for, nothing to say: a report of nothing in a folder
                    # nobody named is litter (`diagnose train.py --help`).
                    litter = throwaway and ranks is None and runner.exit_code(exc) == 0
                    if not watching and failed is not None:
                        finished.append(_finish_unwatched(
                            exc, command, ranks, run_dir, json_out, report_out, fail_on,
                            console, f"amp-doctor: the script's `import torch` did not "
                            f"finish ({type(failed).__name__}), so nothing was watched; the "
                            "report only says how the run ended."))
                    elif not watching:
                        # Importing torch now, only to report nothing, took seconds and
                        # left empty TensorBoard logs.
                        why = ("amp-doctor: the script never imported torch, so there was "
                               "nothing to watch. If it starts the training in another "
                               "process (subprocess, a launcher), run amp-doctor on that "
                               "script instead.")
                        if litter:
                            console.echo(why[:-1] + "; no report was written.")
                            finished.append(0)
                        else:
                            finished.append(_finish_unwatched(
                                exc, command, ranks, run_dir, json_out, report_out,
                                fail_on, console, why))
                    elif (litter and HELP_FLAGS.intersection(target.args)
                          and not watching[0].models and watching[0].step_index == 0):
                        # The script imported torch, then printed its help and exited.
                        watching[0]._discard()
                        console.echo("amp-doctor: the script printed its help and trained "
                                     "nothing; no report was written.")
                        finished.append(0)
                    else:
                        finished.append(_finish(watching[0], exc, command, ranks, speaks,
                                                run_dir, logdir, json_out, report_out,
                                                fail_on, tensorboard, console))
                    ended.append(exc)
            except KeyboardInterrupt as late:
                exc = exc if exc is not None else late
        return finished[0]

    def before_exec(call: str) -> None:
        console.echo(f"amp-doctor: the script replaced itself ({call}): the new process runs "
                     "without amp-doctor, and this report covers what ran before; to "
                     "diagnose it, start amp-doctor with the environment the script sets.")
        finish(None)

    progress.wrap_std_streams()
    pid = os.getpid()
    threads_before = set(threading.enumerate())
    state = runner.ScriptState(resolved)
    if script is not None:
        script.append(state)  # for the caller to put back before the process exits
    # Through the wait for the script's threads:
    with _stop_quietly_in_threads(), sigterm_unwinds() as term:

        def swallowed(signum: int) -> None:
            # The script caught the Terminated (a bare except) and its training went on:
            # python would have died at the signal. The report, then that end.
            try:
                finish(Terminated(signum))
            finally:
                (end_now or die_by_signal)(signum)  # the caller's ends by die_by_signal too

        term.end_run = swallowed

        def start_watching() -> None:
            start()
            term.arm()  # once the watch is on: see SigtermUnwinds.arm

        try:  # the script's state stays in place through the wait for its threads
            try:
                with _report_before_exec(before_exec), \
                        after_torch_import(start_watching) as started:
                    hook.append(started)
                    exc = _run_script(state)
                    started.keep_torch()
            except (KeyboardInterrupt, Terminated) as again:  # as the script's exit unwound
                exc = again
            if os.getpid() != pid:
                return _child_exit(exc), None
            if finished:  # an exec that failed (OSError): the report is out already
                return runner.exit_code(exc), None
            if isinstance(started.error, AmpDoctorError):
                # The watch refused to start at the script's `import torch` (which went
                # on): the script ran unwatched; say why, as a failure to start before it
                # would.
                progress.unwrap_std_streams()
                restore_std_streams(console)
                raise started.error
            if started.error is not None:
                # It failed to start (no space left, a broken install): the report says
                # how the run ended, with the script's own exit code, and one line why.
                failed = started.error
                state.leave()
                progress.unwrap_std_streams()
                finished.append(_finish_unwatched(
                    exc, command, ranks, run_dir, json_out, report_out, fail_on, console,
                    f"amp-doctor: could not start watching at the script's `import torch` "
                    f"({F.error_line(failed)}), so the script ran unwatched; the report "
                    "only says how the run ended."))
                return finished[0], _signal_of(exc)
            # Under python, a SIGTERM ends the process, its other threads with it.
            late = _join_script_threads(threads_before) if term.received is None else None
        finally:
            state.leave()
    if term.received is not None and not isinstance(exc, Terminated):
        # The script swallowed it (a bare except), or an error it caused replaced it as
        # it unwound (DataLoader workers the same signal ended): python would have died.
        exc = Terminated(term.received)
    code = finish(exc if exc is not None else late)
    if term.received is not None:
        return code, term.received
    return code, _signal_of(ended[0])


def _signal_of(exc: BaseException | None) -> int | None:
    """The signal a run that ended with ``exc`` must end by: SIGINT for a Ctrl-C the script
    did not catch. Python dies by it there, not by ``exit(130)``: a shell script that
    loops over runs (a sweep) stops at a Ctrl-C only when its command died by SIGINT, and
    goes on to the next run when it exited 130."""
    if isinstance(exc, KeyboardInterrupt) and os.name == "posix":
        return signal.SIGINT
    return None


@contextlib.contextmanager
def _report_before_exec(before: Callable[[str], None]) -> Iterator[None]:
    """While the script runs: an ``os.execv``/``os.execve`` of its own process (a script
    that re-executes itself to set its environment; ``os.execl`` and the others call
    these) first finishes the run, since no Python code runs after an exec. A forked
    child's exec is its own business."""
    pid = os.getpid()
    saved = {name: getattr(os, name) for name in ("execv", "execve")}

    def wrap(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def exec_(*args: Any, **kwargs: Any) -> Any:
            if os.getpid() == pid:
                before(f"os.{name}")
            return orig(*args, **kwargs)

        return exec_

    for name, orig in saved.items():
        setattr(os, name, wrap(name, orig))
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(os, name, orig)


@contextlib.contextmanager
def _stop_quietly_in_threads() -> Iterator[None]:
    """--stop-after reached in a thread the script trains in: that thread ends, as the
    main thread's run would, without amp-doctor's StopRun traceback in the output."""
    from amp_doctor.errors import StopRun

    prev = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not isinstance(args.exc_value, StopRun):
            prev(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        if threading.excepthook is hook:
            threading.excepthook = prev


def _join_script_threads(before: set[threading.Thread]) -> BaseException | None:
    """Python runs a script's non-daemon threads to their end before it exits (a server
    or GUI app whose training thread outlives the main code): so does diagnose, before it
    closes the watch, for the threads the script started (not ``before``). A thread pool's
    workers are left out: python stops them at exit (an atexit hook) before it waits, and
    they would wait for work forever. A Ctrl-C or a SIGTERM ends the wait, as it does
    under python."""
    from concurrent.futures import thread as pool_threads

    try:
        for t in threading.enumerate():
            if (t not in before and not t.daemon and t is not threading.current_thread()
                    and getattr(t, "_target", None) is not pool_threads._worker):
                t.join()
    except (KeyboardInterrupt, Terminated) as e:
        return e
    return None


def _child_exit(exc: BaseException | None) -> int:
    """A child the script forked (``os.fork``) came back out of the script: it exits as it
    would under python, with no report (its watch let go at the fork; the run is the
    parent's)."""
    from amp_doctor import runner

    if exc is not None and not isinstance(exc, SystemExit | KeyboardInterrupt):
        sys.stderr.write(runner.user_traceback(exc))
        sys.stderr.flush()
    return runner.exit_code(exc)


def _run_script(state: Any) -> BaseException | None:
    """Run the user's script in its ``runner.ScriptState``, left in place for the wait for
    its threads (the caller takes it back); how it ended (None for falling off the end)."""
    from amp_doctor.errors import StopRun

    state.enter()
    try:
        state.exec()
    except StopRun:
        pass  # --stop-after: a normal end of a shortened run
    except BaseException as e:  # the user's exit path, whatever it is, is ours to report
        return e
    return None


@contextlib.contextmanager
def _workers_ending_quietly() -> Iterator[None]:
    """While the run is finished: a DataLoader's SIGCHLD handler (it raises "DataLoader
    worker ... is killed by signal" in whatever code runs) is not called. Its workers end
    with the script (a SIGTERM to the process group ended them too); that is the script's
    business, not an error of amp-doctor's closing."""
    sigchld = getattr(signal, "SIGCHLD", None)
    if sigchld is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(sigchld, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(sigchld, previous)


def _finish(doctor: Any, exc: BaseException | None, command: list[str],
            ranks: tuple[int, int] | None, speaks: bool, run_dir: Path, logdir: Path,
            json_out: Path | None, report_out: Path | None, fail_on: str, tensorboard: bool,
            console: Console) -> int:
    """Close the watch, write every file, then print; the exit code."""
    from amp_doctor import runner
    from amp_doctor.merge import merge_run_dir
    from amp_doctor.sinks.jsonfile import write_text_atomic

    restore_std_streams(console)
    code = runner.exit_code(exc)
    meta = _run_meta(exc, code, command, ranks, console)
    if meta["outcome"] == "completed" and doctor.stopped_at is not None:
        meta["outcome"] = "stopped"  # by --stop-after: the script did not end on its own
    doctor.set_run_meta(**meta)
    try:
        moved = relocated_run_dir(run_dir) if ranks is None else None
    except OSError:
        moved = None
    if moved is not None:
        # Review 61b: three lines, one of them "internal error ... report this bug".
        console.echo(f"amp-doctor: note: {run_dir} (or a folder above it) was replaced by a "
                     f"file while the script ran (a cleanup of old logs?): the reports are "
                     f"written to {moved} instead"
                     + ("; the run's TensorBoard events are lost." if tensorboard else "."))
        doctor.logdir = run_dir = logdir = moved
    try:
        with warnings.catch_warnings(record=True) as said, _workers_ending_quietly():
            warnings.simplefilter("always")
            try:
                session = doctor.close()
            finally:
                _echo_own_warnings(said, console)
    except OSError as e:
        console.echo(f"amp-doctor: error: could not write the logs in {run_dir} ({e}); "
                     "check free space and permissions.")
        session = doctor.session
    except Exception as e:  # amp-doctor's own bug: still write what was gathered
        console.echo(f"amp-doctor: internal error while finishing the run "
                     f"({type(e).__name__}: {e}); the report holds what was recorded before "
                     "it. Please report this bug.")
        session = _salvage(doctor, run_dir, console, meta)
    if ranks is not None:
        rank_text = text_report_path(run_dir)
        write_or_warn(lambda: write_text_atomic(rank_text, render_report(session)),
                      rank_text, console)
        if not speaks:
            print_user_exit(exc, console)
            return code
        # Direct `torchrun -m amp_doctor diagnose`: rank 0 merges what the others wrote.
        merged = merge_run_dir(logdir, ranks[1])
        session = merged or session
    unmatched: AmpDoctorError | None = None
    if doctor.fp32_islands is not None:
        try:
            doctor.fp32_islands.check(ended=True)
        except AmpDoctorError as e:  # after the report: what ran is still worth reading
            unmatched = e
            if session is not None:
                session = _fp32_not_run(session, e)
                saved = run_dir / JSON_NAME  # written at close, before this was known
                if saved.is_file():
                    from amp_doctor.sinks.jsonfile import write_json

                    write_or_warn(lambda: write_json(session, saved), saved, console)
    code = publish(session, logdir, json_out, report_out, fail_on, tensorboard, code,
                   console, exc=exc)
    if unmatched is not None:
        console.echo(f"amp-doctor: error: {unmatched}")
        return EXIT_USAGE
    return code


def _fp32_not_run(session: Any, error: AmpDoctorError) -> Any:
    """The session of a run whose --fp32 pattern matched no layer, or only layers that
    never ran (review 56b): an error finding first and the exit code the command ends
    with, so that its saved report (and ``compare``) does not read as a clean float32
    trial (review 55)."""
    import dataclasses

    from amp_doctor.hooks.fp32 import Fp32NotRun
    from amp_doctor.records import Finding

    finding = Finding(
        kind="fp32_not_run" if isinstance(error, Fp32NotRun) else "fp32_unmatched",
        severity="error", module=None, op=None, step=None,
        message=(f"This run is not the float32 trial it was asked to be: {error} "
                 + (f"Only {', '.join(session.run.fp32_modules)} ran in float32."
                    if session.run.fp32_modules else "Every layer ran as without --fp32.")),
        advice=("Run it again with a pattern that matches: the layer names are the first "
                "column of the layer table below."))
    return dataclasses.replace(
        session, findings=[finding, *session.findings],
        run=dataclasses.replace(session.run, exit_code=EXIT_USAGE))


class _Fp32Early:
    """After the first recorded step, when every model of a training step is known: a
    --fp32 pattern that matches no layer is said at once, not only after the whole run
    trained without it (the run goes on: a layer may still appear later, and the end
    of the run says the error again if it never does)."""

    def __init__(self, doctor: Any, progress: Progress, console: Console) -> None:
        self._doctor, self._progress, self._console = doctor, progress, console
        self._done = False

    def __call__(self, rec: Any, hs: Any) -> None:
        islands = self._doctor.fp32_islands
        if self._done or islands is None:
            return
        self._done = True
        try:
            islands.check()
        except AmpDoctorError as e:
            self._progress.before_user_write("")
            # Exit 2 at the end whatever the script's code: the experiment asked for did
            # not happen, and `diagnose --fp32 X && ...` must not read as if it had.
            self._console.echo(f"amp-doctor: warning: {e} The run goes on without it and will "
                               "end with exit code 2 unless a layer matches later (Ctrl-C to "
                               "stop it and fix the pattern).")


def _run_meta(exc: BaseException | None, code: int, command: list[str],
              ranks: tuple[int, int] | None, console: Console) -> dict[str, Any]:
    """How the run ended, for its report (``Watch.set_run_meta``'s fields)."""
    outcome = "completed"
    error = error_at = None
    if isinstance(exc, KeyboardInterrupt):
        outcome = "interrupted"
    elif isinstance(exc, Terminated):
        outcome = "interrupted"
        error = f"SIGTERM (signal {exc.signum})"
        console.echo("amp-doctor: the script was stopped by SIGTERM; the report holds what "
                     "ran before it.")
    elif isinstance(exc, SystemExit):
        # sys.exit(0) / sys.exit(None), as in `sys.exit(main())`, is a normal end.
        outcome = "exit" if code != 0 else "completed"
        if isinstance(exc.code, str):
            # sys.exit("fatal: config wrong"): python prints it and exits 1; the report
            # keeps why (review 61b: `error: null`).
            error = f"SystemExit: {exc.code}"
    elif exc is not None:
        outcome = "exception"
        error = F.error_line(exc)
        if "torch" in sys.modules:  # else nothing was watched, and torch stays unimported
            from amp_doctor.anomaly.userframes import raised_at

            error_at = raised_at(exc)
    return dict(command=command, exit_code=code, outcome=outcome, error=error, error_at=error_at,
                rank=ranks[0] if ranks else None, world_size=ranks[1] if ranks else None)


# A script's own help options: asked for them, a user wants the help, not a report.
HELP_FLAGS = frozenset({"-h", "--help"})


def _remove_if_empty(made: list[Path]) -> None:
    """The folders this run made, deepest first, while nothing was written in them."""
    for d in made:
        try:
            d.rmdir()  # only succeeds on an empty folder
        except OSError:
            return


def _finish_unwatched(exc: BaseException | None, command: list[str],
                      ranks: tuple[int, int] | None, run_dir: Path, json_out: Path | None,
                      report_out: Path | None, fail_on: str, console: Console,
                      why: str) -> int:
    """Nothing was watched: the script's ``import torch`` itself failed (a Ctrl-C while
    torch imported, a broken install: torch is half-imported, and importing it again
    would fail), or the watch could not start there. The report says how the run ended,
    ``why`` says why that is all; no TensorBoard logs. The exit code, the script's."""
    from amp_doctor import runner
    from amp_doctor.sinks.jsonfile import write_json

    restore_std_streams(console)
    code = runner.exit_code(exc)
    meta = _run_meta(exc, code, command, ranks, console)
    session = _empty_session(meta)
    write_or_warn(lambda: write_json(session, run_dir / JSON_NAME), run_dir / JSON_NAME,
                  console)
    console.echo(why)
    return publish(session, run_dir, json_out, report_out, fail_on, False, code, console,
                   exc=exc)


def _empty_session(meta: dict[str, Any], steps: int = 0, recorded: int = 0,
                   every: int = 0) -> Session:
    """A report with no recorded data that still says how the run ended."""
    from amp_doctor.records import AmpConfig, RunInfo, Session

    torch_version = str(getattr(sys.modules.get("torch"), "__version__", "?"))
    return Session(
        version=__version__, amp=AmpConfig(device_type=None, dtype=None, scaler=False),
        steps=steps, recorded_steps=recorded, layers=[], scaler=None, history=[], events=[],
        findings=[],
        run=RunInfo(torch_version=torch_version, started="", duration_s=0.0, every=every,
                    models=[], command=meta.get("command"), exit_code=meta.get("exit_code"),
                    outcome=meta["outcome"], error=meta["error"], rank=meta["rank"],
                    world_size=meta["world_size"]))


def _echo_own_warnings(said: list[warnings.WarningMessage], console: Console) -> None:
    """amp-doctor's warnings from closing the watch (TensorBoard could not write) as one
    line each, like its other messages; anything else as python would show it."""
    for w in said:
        text = str(w.message)
        if text.startswith("amp-doctor:"):
            console.echo(text)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _salvage(doctor: Any, run_dir: Path, console: Console, meta: dict[str, Any]) -> Session:
    """The session as far as it can be built after ``close()`` failed, written to disk."""
    from amp_doctor.sinks.jsonfile import write_json

    try:
        session: Session = doctor.session
    except Exception:
        # Not even a snapshot: an empty report that still says how the run ended.
        session = _empty_session(meta, int(getattr(doctor, "step_index", 0)),
                                 int(getattr(doctor, "recorded", 0)),
                                 int(getattr(doctor, "every", 0)))
    write_or_warn(lambda: write_json(session, run_dir / JSON_NAME), run_dir / JSON_NAME,
                  console)
    return session
