"""``amp-doctor report`` and ``compare``: saved runs, rendered from their JSON alone.

Both load only the report modules (no torch), so they answer in a fraction of a second.
"""

from __future__ import annotations

from pathlib import Path

import click

from amp_doctor.commands.common import load_session
from amp_doctor.runfiles import JSON_NAME, SUBDIR

__all__ = ["compare", "report"]


@click.command(short_help="Render a saved run again.")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text",
              show_default=True)
def report(run: Path, fmt: str) -> None:
    """Render RUN (a run directory or its amp_doctor.json) from the JSON alone."""
    from amp_doctor.commands.publish import render_report
    from amp_doctor.sinks.text import render_markdown

    session = load_session(run)
    if fmt == "json":
        click.echo(session.to_json())
    elif fmt == "markdown":
        click.echo(render_markdown(session), nl=False)
    else:
        folder = run.parent if run.is_file() else run
        click.echo(render_report(session, folder), nl=False)  # as its report.txt holds it


@click.command(short_help="Compare two saved runs (e.g. before and after a fix).")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json"]), default="text",
              show_default=True)
def compare(run_a: Path, run_b: Path, fmt: str) -> None:
    """Show what changed from RUN_A to RUN_B: findings resolved, new and unchanged, the
    scale timelines, per-layer headroom and underflow, and the loss."""
    from amp_doctor.analysis.compare import compare as compare_runs
    from amp_doctor.analysis.compare import render

    a, b = load_session(run_a), load_session(run_b)
    la, lb = _run_label(run_a), _run_label(run_b)
    if la == lb:
        la, lb = f"A:{la}", f"B:{lb}"
    click.echo(render(compare_runs(a, b, la, lb), fmt), nl=False)


def _run_label(path: Path) -> str:
    p = path.absolute()
    folder = p.parent if p.name == JSON_NAME else p
    if folder.name == SUBDIR and folder.parent.name:
        # A trainer callback's folder inside the trainer's output_dir: named by the latter
        # (review 56c: "From amp_doctor to hf_diag").
        return f"{folder.parent.name}/{folder.name}"
    return folder.name or str(path)
