"""``amp-doctor fix``: search the smallest set of float32 layers that removes the errors
(the search itself is :mod:`amp_doctor.fix`)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import click

from amp_doctor.commands.common import EXIT_INTERRUPTED, RunsAScript, fail, fail_unknown_option
from amp_doctor.commands.paths import check_writable, output_file_option
from amp_doctor.commands.terminal import die_by_signal

__all__ = ["fix"]


@click.command(
    cls=RunsAScript,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Find the smallest set of float32 layers that removes every error.",
)
@click.option("-m", "module", metavar="MODULE", help="Run a module, as `python -m MODULE`.")
@click.option("--stop-after", "stop_after", type=click.IntRange(min=1), default=None,
              metavar="N", help="End each trial after N training steps [default: 20].")
# Its first name, kept working: it meant what --stop-after says, while diagnose's
# --max-steps keeps training (it only stops recording).
@click.option("--max-steps", "old_max_steps", type=click.IntRange(min=1), default=None,
              hidden=True)
@click.option("--trials", type=click.IntRange(min=1), default=None,
              help="Most float32 layer sets to try [default: 12].")
@click.option("--anomaly/--no-anomaly", default=True, show_default=True,
              help="Name op-level origins in every trial (slower, more precise culprits).")
@click.option("--target-dtype", type=click.Choice(["float16", "float8"]), default=None,
              help="Also remove the simulated what-if warnings for this format.")
@click.option("--json", "json_path", type=click.Path(), default=None,
              callback=output_file_option,
              help="Also write the trials and the result as JSON here.")
@click.argument("script_and_args", nargs=-1, type=click.UNPROCESSED)
def fix(module: str | None, stop_after: int | None, old_max_steps: int | None,
        trials: int | None, anomaly: bool, target_dtype: str | None, json_path: Path | None,
        script_and_args: tuple[str, ...]) -> None:
    """Rerun SCRIPT [ARGS]... with candidate layers in float32 (--fp32) until its errors are
    gone, and print the smallest such set with a snippet that applies it.

    Each trial is a real, shortened run of the script; it must be deterministic
    for the steps it runs (fix checks that with a repeated baseline).
    """
    from amp_doctor import fix as fixing
    from amp_doctor import runner

    if module is None and not script_and_args:
        fail("no script given; usage: amp-doctor fix [OPTIONS] SCRIPT [ARGS]...")
    target = (runner.Target("module", module, tuple(script_and_args)) if module is not None
              else runner.Target("path", script_and_args[0], tuple(script_and_args[1:])))
    if target.kind == "path" and target.name.startswith("-") and not Path(target.name).exists():
        fail_unknown_option(target.name)
    try:
        runner.resolve(target)
    except (runner.ScriptNotFound, runner.ModuleNotFound) as e:
        fail(str(e), e.exit_code)
    except BaseException as e:
        # A SyntaxError in the script, or what `-m pkg.mod` raised importing pkg: as
        # python (and diagnose) report it, before any trial runs.
        sys.exit(runner.report_exit(e))
    if json_path is not None:
        check_writable(json_path.absolute().parent, "--json")
    workdir = fixing.default_workdir()
    here = Path.cwd()
    scratch = fixing.scratch_copy(here, workdir)
    if scratch is None:
        click.echo(f"amp-doctor fix: warning: {here} is too large to copy (over "
                   f"{fixing.SCRATCH_COPY_LIMIT // 2**20} MB or "
                   f"{fixing.SCRATCH_COPY_FILES} files), so the trials run the script in it: "
                   "files the script writes there (checkpoints, logs) are written by each "
                   "trial. Run fix from a smaller folder to keep them.", err=True)
        trial_script = list(script_and_args)
    else:
        click.echo(f"amp-doctor fix: the trials run in a copy of {here} ({scratch}): files "
                   "the script writes there do not touch yours.", err=True)
        trial_script = [] if module is not None else fixing.in_scratch(
            script_and_args[:1], here, scratch)
        trial_script += list(script_and_args[1:] if module is None else script_and_args)
    run = fixing.subprocess_runner(
        trial_script, module, stop_after or old_max_steps or fixing.DEFAULT_MAX_STEPS,
        anomaly, workdir,
        lambda line: click.echo(line, err=True), target_dtype, cwd=scratch)

    def log(t: fixing.Trial) -> None:
        verdict = "ok" if t.ok else f"{len(t.errors)} error(s)"
        click.echo(f"amp-doctor fix: float32 [{', '.join(t.fp32) or 'none'}]: {verdict}",
                   err=True)

    result: fixing.FixResult | None = None
    try:
        result = fixing.find_fix(run, max_trials=trials or fixing.DEFAULT_TRIALS, log=log)
    except KeyboardInterrupt:
        pass  # below, once the copy is removed
    finally:
        if scratch is not None:  # the copy of the user's folder; the trials' reports stay
            shutil.rmtree(scratch, ignore_errors=True)
    if result is None:
        # Ctrl-C: said, with where the trials that ran are, and the process ends by
        # SIGINT as diagnose's does (click would print "Aborted!" and exit 1).
        click.echo(f"\namp-doctor fix: interrupted; the trials that ran are in {workdir}",
                   err=True)
        if os.name == "posix":
            die_by_signal(signal.SIGINT)
        sys.exit(EXIT_INTERRUPTED)
    if scratch is not None:
        # A note's `file:line` was the trials' copy, removed above: name the user's file.
        result.notes = [n.replace(str(scratch), str(here)) for n in result.notes]
    result.command = [*(["-m", module] if module else []), *script_and_args]
    result.target_dtype = target_dtype
    click.echo("\n" + fixing.render_fix(result), nl=False)
    click.echo(f"amp-doctor fix: trial runs are in {workdir}", err=True)
    if json_path is not None:
        json_path.write_text(fixing.to_json(result))
    sys.exit(0 if result.best is not None
             or (result.baseline.ok and result.baseline.steps > 0) else 1)
