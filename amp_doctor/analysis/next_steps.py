"""What to run next, after a report with errors: the ``next:`` commands.

The terminal prints them last, the report file ends with them (its *Next:* section), and
TensorBoard's findings card shows them under its verdict: one owner for all three. Each is a
command line to copy: ``--fp32`` on the culprit (the fix without editing code), ``fix``
(the search of the smallest such set), ``--anomaly`` (the op and the line).
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from typing import TYPE_CHECKING

from amp_doctor import format as F

if TYPE_CHECKING:
    from amp_doctor.records import Finding, Session

__all__ = ["NEXT_PREFIX", "next_section", "next_steps", "next_commands"]


# The layers at most one `next:` line puts in float32.
MAX_NEXT_FP32 = 4
# What each line of :func:`next_steps` starts with on the terminal.
NEXT_PREFIX = "amp-doctor: next: "


# How many steps past the first error's step a suggested `fix` trial runs.
FIX_STEPS_PAST_FIRST_ERROR = 10


def _fp32_target(session: Session, f: Finding) -> str:
    """The layer to put in float32 for an error: its own, or its parent, whose float32
    covers the parent's own code and the layer, when the inf may have come in with the
    layer's input, made by that code (attention scores before the output projection, a
    reparameterisation before a decoder): a NaN loss first seen in a layer whose output
    never overflowed, or a layer without an op named whose inputs were not all watched
    layers' outputs."""
    from amp_doctor.analysis.detect_layers import code_before

    assert f.module is not None
    maybe_input = (not f.data.get("made_here") if f.kind == "nonfinite_loss"
                   else _input_unseen(session, f))
    before = code_before(session, f.module)
    if maybe_input and before != "the model's":
        return before[:-2]  # "x's" -> "x"
    return f.module


def _same_code(session: Session, f: Finding) -> str | None:
    """For an op anomaly mode found in a layer whose class has numbered siblings
    (``blocks.0.attn``, ``blocks.1.attn``, ...): the ``--fp32`` pattern of them all, as the
    op's line is their code too. Float32 for the one searched moved the error to the next
    (review 56b: a hand-written ``exp`` in every block's attention)."""
    if not (f.op and f.module and f.kind in ("nonfinite_forward", "activation_overflow")):
        return None
    return _siblings(session, f.module)


def _siblings(session: Session, module: str) -> str | None:
    """The ``--fp32`` pattern of ``module`` and its numbered siblings of the same class
    (``h.*.mlp``), which run the same code; None when it has none."""
    by_name = {lay.name: lay for lay in session.layers}
    lay = by_name.get(module)
    pattern = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", module)
    if lay is None or pattern == module:
        return None
    alike = [x for x in session.layers if fnmatch.fnmatchcase(x.name, pattern)]
    if len(alike) < 2 or any(x.type != lay.type for x in alike):
        return None
    return pattern


def _parent_code(session: Session, f: Finding) -> str | None:
    """For backoffs whose first culprit's gradient went non-finite in its parent's own
    forward code (:func:`~amp_doctor.analysis.detect_scaler.made_in_parent`): that parent,
    or the pattern of it and its numbered siblings, whose code is the same (review 57g:
    a hand-written GELU in every block's MLP; `--fp32 h.1.mlp` left h.0.mlp's cube)."""
    from amp_doctor.analysis.detect_scaler import made_in_parent

    if f.op is not None or f.kind not in ("scaler_backoff", "scale_collapse") or not f.module:
        return None
    parent = made_in_parent(session, f.module)
    if parent is None:
        return None
    return _siblings(session, parent) or parent


def next_steps(session: Session, here: str | None = None,
               before: str | None = None) -> list[str]:
    """What to run next when the report has an error: try the fix on the culprit without
    editing code (--fp32), have amp-doctor search the smallest one (fix), and, when no
    finding names an op yet, find the op and the line (--anomaly). ``here``: this run's
    folder; ``before``: the run a successful --fp32 try came from, when known."""
    from amp_doctor.analysis.advice import WIDE_FORMATS, spread_nan
    from amp_doctor.analysis.detect_scaler import made_in_parent
    from amp_doctor.analysis.folding import steps_of
    from amp_doctor.analysis.messages import inputs_held_inf
    from amp_doctor.fix import DEFAULT_MAX_STEPS, ERROR_KINDS_FIXED_BY_FP32

    cmd = list(session.run.command or [])
    errors = [f for f in session.findings if f.severity == "error"]
    if len(cmd) < 2:
        return []
    if not errors and session.run.fp32_modules and session.run.outcome == "completed":
        # The --fp32 try worked: what it changed, beside the run it was suggested by
        # (review 52a: a run that removed the errors said nothing more).
        forced = F.and_list(session.run.fp32_modules)
        # Placeholders a shell would not take for a path (review 56b: RUN_BEFORE read as
        # a literal folder name).
        this = shlex.quote(here) if here else "<this run's folder>"
        that = shlex.quote(before) if before else "<the folder of the run before>"
        # (A run found here but none before it: it ran with a --logdir of its own, which
        # is not beside this one; review 57g.)
        where = (" (no earlier run of this command was found beside this one: give the "
                 "folder it was written to, its --logdir)" if here and not before else "")
        return [f"amp-doctor: next: no errors with {forced} in float32; to see what that "
                f"changed against the run before it: amp-doctor compare {that} {this}{where}"]
    if not errors:
        return []
    script = shlex.join(cmd[1:])  # the command without its "python"
    out = []
    if session.run.fp32_modules:
        # A --fp32 try that left errors: not the same try again, but the search, and the
        # op's line when no finding names one.
        forced = ", ".join(session.run.fp32_modules)
        out.append(f"amp-doctor: next: errors remain with {forced} in float32; to search a "
                   f"set of float32 layers that removes them: amp-doctor fix {script}")
        if not any(f.op for f in session.findings):
            out.append("amp-doctor: next: to name the op and the line that made the first "
                       f"inf/NaN: amp-doctor diagnose --anomaly {script}")
        return out
    # An op that made NaN of an inf it received (a softmax over a row masked whole) makes
    # it in float32 too.
    # Nor does float32 help an op that ran in float32 already, nor a std of one sample;
    # and a whole model in float32 is no mixed precision left to try.
    roots = set(session.run.models)
    layers = list(dict.fromkeys(
        # (A zeroed norm's other instances, which share its code, with it.)
        name for f in errors
        if f.kind in ERROR_KINDS_FIXED_BY_FP32 and f.module and f.module not in roots
        and not f.data.get("loss_too_large")
        # A batch beyond the format, cast to inf before the layer: float32 for it lets the
        # large values through to overflow further on (review 54: `--fp32 stem` left the
        # same steps skipped, then called "as designed").
        and not _batch_beyond_format(f)
        and not (f.kind == "nonfinite_forward" and inputs_held_inf(f.data))
        and not (f.kind in ("nonfinite_forward", "nonfinite_backward")
                 and f.data.get("dtype") in WIDE_FORMATS)
        and not (f.kind == "nonfinite_forward" and spread_nan(f.op, f.data))
        for name in (_parent_code(session, f) or _same_code(session, f)
                     or _fp32_target(session, f), *map(str, f.data.get("also") or ()))))
    # Where a culprit's parent took its place, why: float32 for the culprit itself would
    # leave the code that made the inf as it is.
    moved = {p: (f.module, str(made_in_parent(session, f.module))) for f in errors
             if f.module and (p := _parent_code(session, f))}
    # Each error is an independent cause (follow-ons were folded): try them together.
    layers = [n for n in layers if not any(n.startswith(m + ".") for m in layers)]
    layers = layers[:MAX_NEXT_FP32]
    if layers:
        names = F.and_list(layers)
        flags = " ".join(f"--fp32 {shlex.quote(n)}" for n in layers)
        why = "".join(
            f" ({moved[n][0]}'s output stayed finite: its gradient went non-finite in the "
            f"backward of {moved[n][1]}'s own code after it, which float32 for {moved[n][1]} "
            "runs in float32 whatever it casts"
            + ("" if n == moved[n][1] else f"; every {n} runs the same code") + ")"
            for n in layers if n in moved)
        out.append(f"amp-doctor: next: try {names} in float32 without editing the code{why}: "
                   f"amp-doctor diagnose {flags} {script}")
        # The trials stop after DEFAULT_MAX_STEPS steps: a problem that begins later
        # needs longer ones, or the baseline shows no error to fix.
        # (An overflow error spans its recorded steps; the NaN loss it led to says when.)
        first = min((st for f in errors for st in steps_of(f)), default=None)
        if first is None:
            first = min((st for f in session.findings if f.kind == "nonfinite_loss"
                         for st in steps_of(f)), default=0)
        longer = (f"--stop-after {first + FIX_STEPS_PAST_FIRST_ERROR} "
                  if first + 1 > DEFAULT_MAX_STEPS else "")
        out.append(f"amp-doctor: next: or search the smallest such set of layers: "
                   f"amp-doctor fix {longer}{script}")
    if not any(f.op for f in session.findings) and any(
            f.kind in ERROR_KINDS_FIXED_BY_FP32 and not f.data.get("loss_too_large")
            and f.kind != "output_resolution"  # no inf/NaN: no op to name
            # The op is autocast's cast of the batch, which the finding names.
            and f.kind != "input_beyond_format" and not _batch_beyond_format(f)
            for f in errors):
        searched = any(f.kind == "nonfinite_unlocated" or (
            f.kind == "nonfinite_loss" and f.data.get("anomaly")) for f in session.findings)
        if searched:
            # Anomaly mode ran and its search, armed after the fact, missed a one-off:
            # the same command would miss it again; checking every op stops at it.
            out.append("amp-doctor: next: the op search ran after the NaN and did not see it "
                       "again; to check every op and stop at the one that made it, with its "
                       f"line: amp-doctor diagnose --on-nonfinite raise {script}")
        else:
            line = ("amp-doctor: next: to name the op and the line that made the first "
                    f"inf/NaN: amp-doctor diagnose --anomaly {script}")
            unseen = [f.module for f in errors if f.module in layers
                      and _input_unseen(session, f)]
            if unseen and len(unseen) == len(layers):
                # The inf may have come in with the layer's input, made by the model's own
                # code before it (a VAE's exp(0.5 * logvar) before its decoder): float32
                # for the layer would not touch it (review 48b). The op's name first.
                out.insert(0, f"amp-doctor: next: first find where the inf began ("
                           f"{F.and_list(unseen)}'s input was made by code amp-doctor does "
                           "not see, and may have brought it): amp-doctor diagnose "
                           f"--anomaly {script}")
            else:
                out.append(line)
    if not out and any(f.kind == "input_beyond_format" and f.module in roots for f in errors):
        # Seen by the check of every step's batch, in steps nobody recorded: the layer it
        # broke is not known (review 52a: an error with nothing to run next).
        # Float32 layers are no fix for it: past the first, the next cast is inf again.
        out.append("amp-doctor: next: the fix is in the data (normalise or clip it, see the "
                   "error); to see which layers the batch broke: "
                   f"amp-doctor diagnose --every 1 {script}")
    elif not out and any(_batch_beyond_format(f) for f in errors):
        # The layers it broke were recorded: nothing more to run, but where the fix is.
        out.append("amp-doctor: next: the fix is in the data: normalise or clip it before "
                   f"the model (see the error), then run again: amp-doctor diagnose {script}")
    if any(f.data.get("attn_mask_given") for f in errors) and out:
        # A row the -inf mask covers whole is NaN in float32 too: the op first (review 51:
        # `--fp32` on the attention left the NaN). The one step is caught as it happens.
        out = [line for line in out if "--anomaly" not in line and "--on-nonfinite" not in line]
        out.insert(0, "amp-doctor: next: first check whether a row the -inf mask covers whole "
                      "made it (float32 would not help then), at the op and its line: "
                      f"amp-doctor diagnose --anomaly --on-nonfinite raise {script}")
    return out


def _input_unseen(session: Session, f: Finding) -> bool:
    """An error about a layer (no op named) whose inputs were not all watched layers'
    outputs: what made its inf may be the code before it."""
    if f.kind == "input_beyond_format" or f.data.get("input_absmax") is not None:
        return False  # it came in with the batch, which the finding names (review 52a)
    lay = next((x for x in session.layers if x.name == f.module), None)
    return f.op is None and f.kind != "nonfinite_loss" and lay is not None and \
        not lay.inputs_known


def next_section(session: Session, here: str | None = None,
                 before: str | None = None) -> str:
    """The `next:` commands as the report file's last section ("" when there are none)."""
    lines = next_commands(session, here, before)
    return "\nNext:\n" + "".join(f"- {x}\n" for x in lines) if lines else ""


def next_commands(session: Session, here: str | None = None,
                  before: str | None = None) -> list[str]:
    """:func:`next_steps` without the terminal's prefix: what each line says to run."""
    return [x.removeprefix(NEXT_PREFIX) for x in next_steps(session, here, before)]


def _batch_beyond_format(f: Finding) -> bool:
    """An error of a batch beyond the format, cast to inf before the layer: the fix is in
    the data. Not an op's own input range (anomaly mode's ``input_absmax``), nor a zeroed
    norm's input (review 55: "the fix is in the data" for an attention's overflow)."""
    return ((f.op is None or bool(f.data.get("batch_cast")))
            and f.kind in ("activation_overflow", "input_beyond_format")
            and f.data.get("input_absmax") is not None)
