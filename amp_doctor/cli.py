"""The ``amp-doctor`` command: the click group and the console entry point, ``main``.

The CLI only arranges things: it runs the user's script faithfully
(:mod:`amp_doctor.runner`) under a :class:`~amp_doctor.watch.Watch` that
discovers models, scalers and optimizers by itself, then renders the same
session. It has no analysis of its own. Each subcommand is its own module in
:mod:`amp_doctor.commands`.

Nothing here imports torch at module level: ``--help``, argument errors,
``report`` and ``compare`` start in a fraction of a second. Commands that run
a model import what they need inside the command.
"""

from __future__ import annotations

import sys

import click

from amp_doctor._version import __version__
from amp_doctor.commands.common import OWNS_PROCESS, EndAsKeyboardInterrupt, fail
from amp_doctor.commands.diagnose import diagnose
from amp_doctor.commands.fixing import fix
from amp_doctor.commands.saved import compare, report
from amp_doctor.commands.view import view
from amp_doctor.errors import AmpDoctorError

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="amp-doctor")
def cli() -> None:
    """Find out why mixed-precision (AMP) training misbehaves, and where."""


for _command in (diagnose, report, fix, compare, view):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """The console entry point; ``argv`` None: this process's command line (the process is
    amp-doctor's: ``diagnose`` then leaves the script's ``__main__``, ``sys.argv`` and
    ``sys.path`` in place for its ``atexit`` handlers, as python would)."""
    try:
        cli.main(args=argv, prog_name="amp-doctor", standalone_mode=True,
                 obj={OWNS_PROCESS: argv is None})
    except AmpDoctorError as e:
        fail(str(e))
    except EndAsKeyboardInterrupt:
        # The user's traceback is printed already: the interpreter's own printing of this
        # KeyboardInterrupt is silenced, the rest of its exit is python's.
        sys.excepthook = lambda *args: None
        raise KeyboardInterrupt from None
