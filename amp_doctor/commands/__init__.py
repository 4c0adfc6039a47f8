"""The ``amp-doctor`` subcommands, one module each, and what they share.

:mod:`amp_doctor.cli` assembles them into the click group. Nothing in this package
imports torch at module level: ``--help``, argument errors, ``report`` and ``compare``
stay fast; the commands that run a model import it inside the command.

* :mod:`.common`: the exit codes, the one-line usage error, loading a saved report.
* :mod:`.terminal`: amp-doctor's own handle on the terminal, the live status line,
  the Ctrl-C shield while the report is written.
* :mod:`.paths`: the run folder and the checks that output paths are writable.
* :mod:`.diagnose`: ``diagnose`` (run a script under a watch, finish it on every exit).
* :mod:`.launch`: ``diagnose --nproc-per-node``: torchrun, then the rank merge.
* :mod:`.publish`: write the report files, then print; the ``--fail-on`` gate.
* :mod:`.saved`: ``report`` and ``compare`` on saved runs.
* :mod:`.fixing`: ``fix``. :mod:`.view`: ``view`` (TensorBoard).
"""

__all__: list[str] = []
