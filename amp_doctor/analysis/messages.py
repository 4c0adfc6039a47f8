"""What a run-time event says: one message function per event kind, in a registry.

Hooks and patches record :class:`~amp_doctor.records.Event` objects (clip before
unscale, a NaN loss, the op anomaly mode found); :func:`event_message` turns one
into the sentence a finding carries, with the numbers. Each kind registers its own
function with :func:`message_for`, as flop_counter registers one formula per op,
so a new kind is one decorated function, not one more branch of a long chain.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from amp_doctor import format as F
from amp_doctor.dtypes import FORMAT_MAX
from amp_doctor.opnames import DIVISION_OPS
from amp_doctor.records import Event

__all__ = ["MESSAGES", "MessageArgs", "event_message", "loss_origin_named", "message_for",
           "nonfinite_what"]


class MessageArgs(NamedTuple):
    """What every message function gets: the first event of its group and the group's size."""

    event: Event
    # How many times it happened (the group's size, or the event's own count).
    n: int
    # "at step 3", or "first at step 3" for a group.
    at: str
    # Every step it happened at (may be empty).
    steps: list[int]


# A message function may return None: the event then falls back to its own text.
MessageFn = Callable[[MessageArgs], "str | None"]
MESSAGES: dict[str, MessageFn] = {}


def message_for(*kinds: str) -> Callable[[MessageFn], MessageFn]:
    """Register the decorated function as the message of these event kinds."""

    def register(fn: MessageFn) -> MessageFn:
        for kind in kinds:
            MESSAGES[kind] = fn
        return fn

    return register


def event_message(e: Event, n: int, steps: list[int] | None = None) -> str:
    """The message of a group of ``n`` events of one kind, ``e`` the first of them."""
    at = f"first at step {e.step}" if n > 1 else f"at step {e.step}"
    fn = MESSAGES.get(e.kind)
    text = fn(MessageArgs(e, n, at, steps or [])) if fn else None
    if text is not None:
        return text
    own = e.data.get("message")
    if own:
        return str(own) + (f" ({n - 1} more like it)" if n > 1 else "")
    return f"{e.kind} at step {e.step}"


def _scale(x: object) -> str:
    return F.scale(x if isinstance(x, (int, float)) else None, unknown="?")


def nonfinite_what(d: dict[str, object]) -> str:
    """``NaN/+inf``: which non-finite values an event saw."""
    parts = [w for w, k in (("NaN", "nan"), ("+inf", "pos_inf"), ("-inf", "neg_inf"),
                            ("inf", "inf")) if d.get(k)]
    return "/".join(parts) or "non-finite values"


# -- GradScaler misuse -----------------------------------------------------------------------

@message_for("clip_before_unscale")
def _clip_before_unscale(a: MessageArgs) -> str:
    d = a.event.data
    func = d.get("func", "clip_grad_norm_")
    scale = d.get("scale")
    opts = [str(o) for o in d.get("optimizers") or []]
    # Some optimizers were unscaled, not these: name them (review 46b).
    missing = (F.and_list([f"scaler.unscale_({o})" for o in opts])
               if opts and d.get("others_unscaled") else "scaler.unscale_(optimizer)")
    msg = (f"{func} ran on gradients still multiplied by the loss scale "
           f"({_scale(scale)}): {F.times(a.n)}, {a.at}, with no {missing} before it"
           + (" (it clipped those parameters too, with the unscaled ones of the other "
              "optimizers)" if opts and d.get("others_unscaled") else "") + ".")
    mx, tn, cv = d.get("max_norm"), d.get("total_norm"), d.get("clip_value")
    if d.get("measured_only"):
        norm = (f": {F.num(tn)} here, {F.num(tn / scale)} unscaled"
                if isinstance(tn, (int, float)) and math.isfinite(tn)
                and isinstance(scale, (int, float)) and scale else "")
        return (f"{func} ran with no limit (max_norm=inf) on gradients still multiplied by "
                f"the loss scale ({_scale(scale)}), {F.times(a.n)}, {a.at}: it clipped "
                "nothing, but the norm it returned (the Hugging Face Trainer logs it as "
                f"`grad_norm`) is the scaled gradients' norm{norm}.")
    if not isinstance(scale, (int, float)) or not scale:
        return msg
    if isinstance(mx, (int, float)) and isinstance(tn, (int, float)) and math.isfinite(tn):
        msg += (f" The total norm it saw was {F.num(tn)} (scaled; {F.num(tn / scale)} "
                f"unscaled) against max_norm={F.num(mx)}")
        msg += (f", so the gradients were cut to norm {F.num(mx / scale)} instead of "
                f"{F.num(mx)}." if tn > mx else
                f": clipping would start only at an unscaled norm of {F.num(mx / scale)}.")
    elif isinstance(mx, (int, float)):
        msg += (f" max_norm={F.num(mx)} applied to scaled gradients means an unscaled "
                f"max_norm of {F.num(mx / scale)}.")
    elif isinstance(cv, (int, float)):
        msg += (f" clip_value={F.num(cv)} applied to scaled gradients means the unscaled "
                f"gradients were clipped at {F.num(cv / scale)}.")
    return msg


@message_for("scaler_with_bf16")
def _scaler_with_bf16(a: MessageArgs) -> str:
    return (f"A GradScaler (scale {_scale(a.event.data.get('scale'))}) is enabled while "
            "autocast runs in bfloat16, whose range equals float32's: the scaler only costs a "
            "host sync per step.")


@message_for("fp16_params")
def _fp16_params(a: MessageArgs) -> str:
    d = a.event.data
    numel = d.get("numel")
    size = f" ({numel:,} values)" if isinstance(numel, int) else ""
    return (f"{d.get('count', '?')} of the {d.get('total', '?')} parameters of "
            f"{d.get('optimizer', 'the optimizer')}{size} have float16 gradients (the "
            "parameters are float16, e.g. after model.half()) while a GradScaler is "
            "enabled: scaler.unscale_ (which scaler.step calls) raises 'Attempting to "
            f"unscale FP16 gradients.' ({a.at}). GradScaler refuses them because unscaling "
            "in float16 would underflow or overflow, and float16 weights lose the small "
            "updates anyway.")


@message_for("scheduler_on_skipped_step")
def _scheduler_on_skipped_step(a: MessageArgs) -> str:
    d = a.event.data
    scale = ""
    if d.get("scale_before") is not None:
        scale = f" (scale {_scale(d.get('scale_before'))}"
        scale += (f" -> {_scale(d.get('scale_after'))})" if d.get("scale_after")
                  is not None else ")")
    return (f"{d.get('scheduler', 'LR scheduler')}.step() ran for "
            f"{d.get('optimizer', 'the optimizer')} after GradScaler skipped its optimizer "
            f"step: {F.times(a.n)}, first for the skipped step {d.get('skipped_step')}{scale}. "
            "The learning-rate schedule advanced although the parameters did not change"
            + (f": the LR rose from {F.num(d['lr_first'])} to {F.num(d['lr_max'])} over "
               "those skipped steps, so the warmup ran while nothing trained and the first "
               f"updates came at up to {F.num(d['lr_max'])}"
               if isinstance(d.get("lr_max"), float) else "") + ".")


@message_for("loss_not_scaled")
def _loss_not_scaled(a: MessageArgs) -> str:
    d = a.event.data
    scale = _scale(d.get("scale"))
    return (f"backward() ran on a loss that did not go through scaler.scale() while "
            f"GradScaler was enabled (scale {scale}): in {a.n} step(s), {a.at}. "
            f"scaler.step then divides those gradients by {scale}, so the "
            "update is that many times too small"
            + (" (the step mixed scaled and unscaled gradients)" if d.get("scaled_too")
               else "") + ".")


@message_for("backward_in_autocast")
def _backward_in_autocast(a: MessageArgs) -> str:
    d = a.event.data
    return (f"backward() was called inside an enabled torch.autocast region "
            f"(device {d.get('device')}, dtype {d.get('dtype')}) in {a.n} step(s), {a.at}.")


@message_for("missing_update")
def _missing_update(a: MessageArgs) -> str:
    e, d = a.event, a.event.data
    reason = d.get("reason")
    opt = d.get("optimizer", "the optimizer")
    if reason == "never updated":
        return (f"scaler.step() ran {d.get('steps_total')} time(s) but scaler.update() "
                f"never ran: the scale stayed at {_scale(d.get('scale'))} and never "
                "adapted; the next scaler.step would raise 'step() has already been called "
                "since the last update()'.")
    if reason == "step twice":
        return (f"scaler.step({opt}) was called again at step {e.step} without "
                "scaler.update() since the previous scaler.step: torch raises 'step() has "
                "already been called since the last update()'"
                + (f" ({a.n} times)" if a.n > 1 else "") + ".")
    if reason == "unscale_ after step":
        return (f"scaler.unscale_({opt}) was called at step {e.step} after "
                "scaler.step() without scaler.update() in between: torch raises "
                "'unscale_() is being called after step()'.")
    return (f"scaler.unscale_({opt}) was called twice at step {e.step} without "
            "scaler.update() in between (e.g. in every micro-step of gradient "
            "accumulation): torch raises 'unscale_() has already been called on this "
            "optimizer since the last update()'. Call unscale_ once, right before "
            "clipping and scaler.step.")


@message_for("update_without_step")
def _update_without_step(a: MessageArgs) -> str:
    d = a.event.data
    return (f"scaler.update() was called at step {a.event.step} with no scaler.step() since "
            f"the previous update ({d.get('steps_total')} scaler.step call(s) and "
            f"{d.get('updates')} update(s) before it): torch raises 'No inf checks were "
            "recorded prior to update', as in an update on every micro-step of gradient "
            "accumulation.")


def _optimizers(d: dict[str, Any]) -> list[str]:
    """The optimizers a group of optimizer-misuse events names, the first one's first."""
    return list(d.get("optimizers") or [d.get("optimizer") or "the optimizer"])


def _calls(names: list[str], call: str) -> str:
    """``SGD#0.step()``, or ``SGD#0.step() and SGD#1.step()``."""
    return F.and_list([f"{n}.{call}" for n in names])


@message_for("scaled_grads_stepped")
def _scaled_grads_stepped(a: MessageArgs) -> str:
    d = a.event.data
    scale = _scale(d.get("scale"))
    opts = _optimizers(d)
    return (f"{_calls(opts, 'step()')} ran on gradients still multiplied by the loss scale "
            f"({scale}): scaler.scale(loss).backward() was followed by optimizer.step() with "
            f"neither scaler.unscale_ nor scaler.step for {'it' if len(opts) == 1 else 'them'} "
            f"({F.times(a.n)}, {a.at}). Every update is {scale} times too large, steps with "
            "inf/NaN gradients are not skipped, and the scale never adapts.")


@message_for("step_after_unscale")
def _step_after_unscale(a: MessageArgs) -> str:
    opts = _optimizers(a.event.data)
    one = len(opts) == 1
    return (f"{_calls(opts, 'step()')} {'was' if one else 'were'} called directly after "
            + (f"scaler.unscale_({opts[0]}), not through scaler.step({opts[0]})" if one
               else "their scaler.unscale_, not through scaler.step")
            + f", in {F.counted(a.n, 'step')} whose gradients held inf/NaN ({a.at}): "
            "scaler.step skips such a step; this one wrote the inf/NaN into the weights, "
            "while the scaler backed off as if it had been skipped.")


@message_for("stepped_twice")
def _stepped_twice(a: MessageArgs) -> str:
    opts = _optimizers(a.event.data)
    one = len(opts) == 1
    return (f"{_calls(opts, 'step()')} {'was' if one else 'were'} called again after "
            + (f"scaler.step({opts[0]})" if one else "their scaler.step")
            + f" in the same step ({F.times(a.n)}, {a.at}): every update was applied twice, "
            "and a step the scaler skipped for inf/NaN gradients was applied anyway "
            "(scaler.step had left them unscaled but not zeroed).")


@message_for("update_between_steps")
def _update_between_steps(a: MessageArgs) -> str:
    opts = _optimizers(a.event.data)
    return (f"{F.and_list([f'scaler.step({n})' for n in opts])} ran after a scaler.update() "
            f"with no scaled backward pass since ({F.times(a.n)}, {a.at}): "
            + ("its" if len(opts) == 1 else "their") + " gradients were scaled by the scale "
            "before that update and unscaled by the one after it, wrong by the update's "
            "factor whenever the scale changed, and the scale moves once per update, more "
            "than once per iteration.")


# -- the loop and the weights ------------------------------------------------------------------

@message_for("nonfinite_loss")
def _nonfinite_loss(a: MessageArgs) -> str:
    e, d = a.event, a.event.data
    shown = d.get("shown_in")
    showed = (f"{F.layer(shown)}'s output, the first watched layer to go non-finite on "
              f"recorded step {d.get('recorded_at')}, is only where it showed"
              if shown else f"recorded step {d.get('recorded_at')} only shows it")
    if d.get("after_grads_applied") is not None:
        where = (f"It began before: step {d['after_grads_applied']}'s update took NaN/inf "
                 "gradients (see that finding), which make the weights non-finite, and "
                 f"from then on every step's forward with them: {showed}, not where it began")
    elif d.get("began_unrecorded"):
        last = d.get("last_recorded_before")
        where = (f"It began before the first recorded step that shows it: the loss was "
                 f"already NaN/inf in {d['began_unrecorded']} step(s) "
                 + (f"after recorded step {last} " if last is not None else "")
                 + "that were neither recorded nor skipped by a GradScaler. Their updates "
                 "took its NaN/inf gradients, which make the weights non-finite, and from "
                 f"then on every step's forward with them: {showed}, which may not be where "
                 "it began. Record every step (`--every 1`) to see the step it began in"
                 + ("" if d.get("anomaly") else ", or use anomaly mode (`--anomaly`)"))
    elif e.module:
        where = (f"It first appeared in {F.layer(e.module)}'s output, the first watched "
                 f"layer to go non-finite (seen on recorded step {d.get('recorded_at')})")
        if d.get("inputs_watched") and not d.get("anomaly"):
            where += (": its inputs were watched layers' outputs, finite then, so an op in "
                      "its own forward code made it; anomaly mode (`--anomaly`) names the op "
                      "and its line")
        if d.get("neg_inf_only"):
            # Read as a mask by the figures alone, but it reached the loss.
            where += (f". That output held -inf and never +inf or NaN: a log of values "
                      f"that underflowed to 0 (the log of a {d['neg_inf_only']} "
                      "softmax or sigmoid), or a -inf mask that reached the loss")
        if not d.get("anomaly") and not d.get("made_here") and not d.get("neg_inf_only"):
            # Only outputs are watched: an op in the parent's own code between its children
            # (attention's q @ k^T without the 1/sqrt(d) scale) shows first in the next
            # child's output (review 34).
            if d.get("root"):
                # The whole model: none of its layers' outputs went non-finite before.
                code = (f"in {F.layer(e.module)}'s own forward code, between its layers or on its "
                        "parameters (a matmul, a softmax, a division, the exp of a "
                        "parameter)")
            else:
                parent = d.get("code_before") or (
                    f"{e.module.rsplit('.', 1)[0]}'s" if "." in e.module else "the model's")
                code = (f"in {parent} own forward code before {F.layer(e.module)} (a matmul, a "
                        "softmax, a division)")
            where += (f". Its input is not checked: if it was non-finite already, the op "
                      f"that made it is {code}; anomaly mode (`--anomaly`, or "
                      "`watch(..., anomaly=True)`) names the op and its line")
            if d.get("attn_mask_given"):
                # Float32 does not help a softmax over a row masked whole (review 51: a
                # fully padded sample; `--fp32` on the attention left the NaN).
                where += (". The model was given an additive attention mask holding -inf in "
                          "that step: if it covers a row whole (a sample that is all "
                          "padding), that row's softmax is 0/0, NaN in float32 too; leave "
                          "every row a position, or mask with `torch.finfo(dtype).min`")
    elif d.get("input_bad"):
        where = (f"The batch given to the model already held NaN/inf on recorded step "
                 f"{d.get('recorded_at')}: it came from the data, not from a layer")
    elif d.get("recorded_at") is not None:
        where = ("Every watched layer's output was finite when it was NaN/inf (recorded "
                 f"step {d.get('recorded_at')}): it appeared outside the watched layers' "
                 "outputs, in the loss computation, in code between the model and the loss, "
                 "in a value a module computed aside and added to the loss (an auxiliary "
                 "loss kept on the module, a router z-loss), or in a call of the model under "
                 "torch.no_grad before its training forward (a target computed first), "
                 "which is not watched")
    elif isinstance(made := d.get("made_output"), dict):
        where = (f"It began in {F.layer(made.get('module'))}'s output at step "
                 f"{made.get('step')} (not a recorded step): a watched model called under "
                 "torch.no_grad in the training step (a frozen backbone, a teacher) returned "
                 "NaN/inf from a finite batch, and what was made from it reached the loss. "
                 "Which of its layers made it is not known: record every step (`every=1`) "
                 "to see it")
    else:
        where = (f"{WHERE_UNKNOWN} (record every step with `every=1`"
                 + ("" if d.get("anomaly") else ", or use anomaly mode") + ")")
    unskipped = d.get("unskipped")
    # What the recorded steps' losses were: a NaN is no square of a large value (review
    # 55: a box loss divided by a count of positives that was 0).
    seen = d.get("loss_values")
    term = {"inf": ("the inf is in a term whose gradient is finite, the square of a large "
                    "value", "inf"),
            "nan": ("the NaN is in a term whose gradient is finite, a 0/0 such as a sum over "
                    "no elements divided by a count of 0", "NaN")}.get(
        str(seen), ("a term whose gradient is finite: the square of a large value is inf, a "
                    "sum over no elements divided by a count of 0 is NaN", "NaN/inf"))
    tail = (f" The GradScaler did not skip {unskipped} of these steps: their gradients "
            f"stayed finite ({term[0]}), so the optimizer stepped on them, but the loss you "
            f"see is {term[1]}." if unskipped else "")
    if d.get("every_step"):
        first = (f"first seen at step {e.step}" if d.get("first_known", True) else
                 "none of them a recorded or skipped step, so which ones is not known")
        return (f"The loss was NaN/inf in {d.get('steps_bad')} of the {d.get('checked')} "
                f"steps with a loss ({d.get('steps')} steps in all), {first}. {where}.{tail}")
    return (f"The loss was NaN/inf in {d.get('steps_bad')} of the {d.get('checked')} "
            f"step(s) whose loss was checked (recorded or skipped steps; "
            f"{d.get('steps')} steps in all), first at step {e.step}. {where}.{tail}")


@message_for("no_step_boundary")
def _no_step_boundary(a: MessageArgs) -> str:
    foreign = a.event.data.get("foreign_optimizers") or []
    if foreign:
        return (f"No training step was seen to end: {', '.join(foreign)} stepped, but "
                "none of the watched model's parameters (the optimizer holds other tensors: "
                "a parameter dict given to torch.func.functional_call, or a copy of the "
                "model), so neither it nor its GradScaler ends the watched model's steps. "
                "The figures below cover everything as one unfinished step.")
    return ("No training step was seen to end: no optimizer.step(), no scaler.update(), "
            "no doctor.step()" + (", although backward ran" if a.event.data.get("backward")
                                  else "")
            + ". The figures below cover everything as one unfinished step.")


@message_for("model_not_run")
def _model_not_run(a: MessageArgs) -> str:
    d = a.event.data
    steps = int(d.get("steps") or 0)
    trained = (f"{steps} training step{'' if steps == 1 else 's'} ran" if steps
               else "backward ran")
    other = "the loop trains another module than the one watched"
    why = (f" Either {other}, or torch.compile reused a graph made before the watch began "
           "(it compiled in this process), which runs without the watched model's hooks."
           if d.get("compiled") else f" Most likely {other}.")
    return (f"The watched model never ran a forward that amp-doctor saw, although {trained}: "
            f"no layer was recorded, so nothing can be said of its precision.{why}")


@message_for("model_stopped")
def _model_stopped(a: MessageArgs) -> str:
    d = a.event.data
    first, n = a.event.step, int(d.get("steps") or 0)
    last = first + n - 1
    total = int(d.get("total") or 0)
    looked = (" No module of its class and architecture was called after it (a reloaded or "
              "copied model would have been followed)." if d.get("searched") else "")
    if d.get("uncounted"):
        return (f"The watched model ran no training forward from step {first} on, while "
                f"backward went on ({n} backward passes): none of its layers was recorded "
                f"there, and no step was counted after step {first} either (the optimizer "
                "and the GradScaler the loop used from then on step no watched parameter). "
                f"Most likely the loop trains another module from step {first} on: a model "
                f"rebuilt with another architecture, or a different model.{looked}")
    end = f"at step {first - 1}" if first else "before the first step"
    return (f"The watched model ran no training forward in the run's last {n} steps "
            f"(steps {first}-{last} of {total}), while backward and the optimizer steps went "
            f"on: none of its layers was recorded there, so the figures below end {end}. "
            f"Most likely the loop trains another module from step {first} on: a model "
            f"rebuilt with another architecture, or a different model.{looked}")


@message_for("steps_from_backward")
def _steps_from_backward(a: MessageArgs) -> str:
    return (f"No optimizer or GradScaler was seen: {a.event.data.get('steps')} step(s) were "
            "counted from the loop itself (a backward reaching the watched parameters, then "
            "the weights updated or the gradients reset before the next forward).")


@message_for("lowp_updates_lost")
def _lowp_updates_lost(a: MessageArgs) -> str:
    d = a.event.data
    dtypes = d.get("dtypes")
    dts = "/".join(dtypes if isinstance(dtypes, list) and dtypes else ["float16"])
    frac = d.get("frac")
    return (f"The weights are {dts} and the optimizer updates them in place: "
            f"{F.pct(frac if isinstance(frac, (int, float)) else None)} of the sampled weight "
            f"values with a non-zero gradient did not change at all in the recorded optimizer "
            f"steps ({d.get('unchanged')} of {d.get('sampled')}). The updates are below "
            f"{dts}'s resolution next to the weights, so most of the model does not train.")


@message_for("lowp_update_nonfinite")
def _lowp_update_nonfinite(a: MessageArgs) -> str:
    e, d = a.event, a.event.data
    dtype = d.get("dtype") or "low-precision"
    whose = f"{F.layer(e.module)}'s weights ({dtype})" if e.module else f"{dtype} weights"
    return (f"The optimizer's update at step {e.step} made {whose} NaN/inf from finite "
            f"weights and finite gradients ({d.get('count')} of the sampled values): the "
            f"optimizer's state is {dtype} too, and Adam's eps (1e-8) is 0 in float16 while "
            "its running average of squared gradients underflows to 0, so the update is "
            "0/0. Every NaN after it (outputs, loss, gradients) follows from these weights.")


def _between_searches(d: dict[str, Any]) -> list[int]:
    """The listed non-finite steps after the last searched step: the value came back,
    between searches, rather than not at all."""
    searched = [s for s in d.get("searched_steps") or [] if isinstance(s, int)]
    steps = [s for s in d.get("steps") or [] if isinstance(s, int)]
    return [s for s in steps if searched and s > max(searched)]


@message_for("nonfinite_unlocated")
def _nonfinite_unlocated(a: MessageArgs) -> str:
    d = a.event.data
    if d.get("scaler_skipped_only") and d.get("loss_nonfinite"):
        later = _between_searches(d)
        if later:
            return (f"The GradScaler skipped steps whose loss was already NaN/inf (first at "
                    f"step {a.event.step}; see the NaN/inf loss): the forward pass made it. "
                    "Anomaly mode's op-level search ran at steps "
                    f"{F.steps_list(d.get('searched_steps') or [])}, which stayed finite, and "
                    f"the value came back at steps {F.steps_list(later)}, between its searches "
                    "(each waits longer than the last, so that a value on every step costs "
                    "few searched steps), so no op is named. Checking every op of every step "
                    "(`--on-nonfinite raise`) stops at the first one.")
        return (f"The GradScaler skipped steps whose loss was already NaN/inf (first at step "
                f"{a.event.step}; see the NaN/inf loss): the forward pass made it. Anomaly "
                "mode's op-level search ran in the steps after them and saw no op make "
                "NaN/Inf: it did not recur there (a layer that runs only in some steps, an "
                "unusual batch), so no op is named.")
    if d.get("scaler_skipped_only"):
        # Its count would be the steps the rate-limited search looked at, not the skips.
        return (f"The GradScaler skipped steps whose gradients held inf/NaN (first at step "
                f"{a.event.step}); anomaly mode's op-level search ran after them and saw no "
                "op make NaN/Inf, so it names none. Scaled gradients beyond float16's max "
                "are what a GradScaler skips, also at each higher scale it tries: its "
                "findings and timeline say whether these backoffs are a problem.")
    seen = max(int(d.get("count") or 0), a.n)  # one event a detection, or its count
    return (f"NaN/Inf was seen in {seen} step(s) (first at step "
            f"{a.event.step}) but anomaly mode could not locate the op that produced it: "
            f"{d.get('reason')}.")


# -- where NaN/Inf began (anomaly mode, or the recorded batch) --------------------------------

# An op's inputs whose ranges a message lists one by one, at most.
_RANGES_SAID = 4


def inputs_held_inf(d: dict[str, object]) -> bool:
    """An origin's inputs held an inf it made NaN of (a softmax over a row that a -inf
    mask covers whole), rather than being finite. Not an op that made +inf of the finite
    values beside a mask's -inf (see :func:`overflowed_past_mask`): that inf is its own."""
    return any_input_inf(d) and not overflowed_past_mask(d)


def any_input_inf(d: dict[str, object]) -> bool:
    """An op's recorded inputs held an inf (so they were not all finite)."""
    ranges = d.get("input_ranges")
    values = ([v for r in ranges for v in r] if isinstance(ranges, list)
              else [d.get("input_min"), d.get("input_max")])
    return any(isinstance(v, (int, float)) and math.isinf(v) for v in values)


def overflowed_past_mask(d: dict[str, object]) -> bool:
    """An op made +inf and no NaN while its inputs' only non-finite values were -inf (an
    exp of masked attention scores): the +inf came from the finite values, an overflow
    of the op itself (review 61a)."""
    if not d.get("pos_inf") or d.get("nan"):
        return False
    ranges = d.get("input_ranges")
    pairs = (ranges if isinstance(ranges, list)
             else [[d.get("input_min"), d.get("input_max")]])
    values = [v for r in pairs for v in r if isinstance(v, (int, float))]
    return (any(v == -math.inf for v in values)
            and not any(v == math.inf or math.isnan(v) for v in values))




def denominator_dtype(d: dict[str, object]) -> object:
    """A division's denominator's dtype (the op's output's when its inputs' are unknown)."""
    dtypes = d.get("input_dtypes")
    return dtypes[1] if isinstance(dtypes, list) and len(dtypes) > 1 else d.get("dtype")


def zero_denominator(op: str | None, d: dict[str, object]) -> bool:
    """A division whose denominator held an exact 0 (its min or max is 0): the inf it
    made is x/0, not a value grown past the format's max. The backward of ``sqrt`` at
    0 is such a division (``grad / (2 * sqrt(x))``)."""
    ranges = d.get("input_ranges")
    if op not in DIVISION_OPS or not isinstance(ranges, list) or len(ranges) < 2:
        return False
    return 0.0 in ranges[1]


def _op_range(d: dict[str, object]) -> str:
    if d.get("input_absmax") is None:
        return ""
    finite = "inputs without NaN" if any_input_inf(d) else "finite inputs"
    ranges = d.get("input_ranges")
    if isinstance(ranges, list) and len(ranges) > 1:
        # Several inputs: each its own range (a float16 denominator of exactly 0 beside a
        # float32 numerator), and no dtype: the one recorded is the op's output's.
        said = "; ".join(f"[{_num(lo)}, {_num(hi)}]" for lo, hi in ranges[:_RANGES_SAID])
        return f" from {finite} ({said}{'; ...' if len(ranges) > _RANGES_SAID else ''})"
    # The dtype recorded is the output's: an input beyond its max was another (a cast's
    # float32 input, an inf-making backward cast of a float32 gradient).
    dtype, big = d.get("dtype"), d.get("input_absmax")
    beyond = (isinstance(dtype, str) and dtype in FORMAT_MAX and isinstance(big, (int, float))
              and FORMAT_MAX[dtype] < big < math.inf)
    kind = finite if beyond else finite.replace("inputs", f"{dtype} inputs")
    return (f" from {kind} (min {_num(d.get('input_min'))}, "
            f"max {_num(d.get('input_max'))}, absmax {_num(d.get('input_absmax'))})")


# Softmax ops: a row of -inf only is NaN in them.
SOFTMAX_OPS = ("aten._softmax", "aten.softmax", "aten._log_softmax", "aten.log_softmax",
               "aten._safe_softmax")
# Ops that only convert: an inf they make from finite inputs is a value beyond the
# target format's max (autocast casting a float32 input to float16).
CAST_OPS = ("aten._to_copy", "aten.copy_")


def cast_overflow(op: str | None, d: dict[str, object]) -> str | None:
    """"cast values up to X to float16, beyond its max 65504", when ``op`` converted
    finite values beyond its output format's max; else None."""
    top, dtype = d.get("input_absmax"), d.get("dtype")
    limit = FORMAT_MAX.get(dtype) if isinstance(dtype, str) else None
    if op not in CAST_OPS or not isinstance(top, (int, float)) or limit is None or top <= limit:
        return None
    return f"cast values up to {_num(top)} to {dtype}, beyond its max {limit:g}"


def scalar_beyond(d: dict[str, Any]) -> float | None:
    """The value of an op's input that is one number (its min equals its max) beyond the
    max of the op's output format, finite: a 0-dim float32 tensor (a learned scale, the
    exp of a parameter) times a float16 tensor is float16 by type promotion, and inf
    there (review 51: CLIP's ``logit_scale.exp() * img``). None otherwise."""
    dtype, ranges = d.get("dtype"), d.get("input_ranges")
    limit = FORMAT_MAX.get(dtype) if isinstance(dtype, str) else None
    if limit is None or not isinstance(ranges, list):
        return None
    for r in ranges:
        if (isinstance(r, list) and len(r) == 2 and all(isinstance(v, (int, float)) for v in r)
                and r[0] == r[1] and limit < abs(r[0]) < math.inf):
            return float(r[0])
    return None


# Logarithms: -inf at an input of exactly 0, which is no overflow.
LOG_OPS = ("aten.log", "aten.log_", "aten.log2", "aten.log10")


def log_of_zero(op: str | None, d: dict[str, object]) -> bool:
    """A logarithm that made -inf from an input whose least value was exactly 0."""
    return op in LOG_OPS and bool(d.get("neg_inf")) and d.get("input_min") == 0.0


def _num(x: object) -> str:
    return F.num(x if isinstance(x, (int, float)) else None)


def _where(e: Event) -> str:
    if e.module:
        return f"in {F.layer(e.module)}"
    # "file:line in func": code of a function, maybe a method of the model the loop calls
    # (review 60b: ``exp`` in ``AC.actor`` was "in the training loop").
    func = (e.frame or "").rsplit(" in ", 1)[-1] if e.frame and " in " in e.frame else ""
    if func and func != "<module>":
        return f"in {func} (code outside every watched layer's forward)"
    return "outside the watched model (in the training loop)"


def _op_steps(a: MessageArgs) -> str:
    first = a.event.data.get("first_seen_step")
    # The op-level search runs after the per-step check saw the values: say when. Of
    # this origin's run of non-finite steps, not of the run's (an earlier origin may
    # have its own finding): "armed by", not "first saw" (review 52a).
    armed = (f"it was armed by the NaN/Inf the per-step check saw at step {first}"
             if isinstance(first, int) and first < a.event.step else "")
    if a.n > 1:
        # It looks only at the steps it is armed for: "in 2 step(s)" of an op that failed
        # in all 40 read as a frequency (review 54).
        return (f"in {a.n} step(s) the op-level search looked at, {a.at}"
                + (f" ({armed})" if armed else ""))
    return a.at + (f" (the step the op-level search looked at; {armed})" if armed else "")


# What a NaN loss's message says when no recorded step showed where it began.
WHERE_UNKNOWN = "No recorded step had it, so where it appeared is unknown"
_WHERE_UNKNOWN_CLAUSE = re.compile(re.escape(WHERE_UNKNOWN) + r" \([^)]*\)")


# The "it began in steps nobody recorded" clause of a NaN loss's message (see above).
_BEGAN_UNRECORDED_CLAUSE = re.compile(
    r"It began before the first recorded step that shows it: .*?to see the step it began in"
    r"(, or use anomaly mode \(`--anomaly`\))?")


def loss_origin_named(message: str, at: str) -> str:
    """A NaN loss's message, its "where it appeared is unknown" clause (and that clause's
    hint in parentheses) replaced by ``at``, the origin another finding named; the
    message unchanged if it had no such clause. A loss that began in unrecorded steps
    (the weights poisoned by their updates) says where it began instead of how to see it."""
    named = _WHERE_UNKNOWN_CLAUSE.sub(f"It began at {at} (see that finding)", message)
    return _BEGAN_UNRECORDED_CLAUSE.sub(
        f"It began at {at} (see that finding): the updates after it took its NaN/inf "
        "gradients, which make the weights non-finite, and every step's forward with them",
        named)


@message_for("nonfinite_discarded")
def _nonfinite_discarded(a: MessageArgs) -> str:
    e, d = a.event, a.event.data
    if d.get("made") == "nonfinite_backward":
        return (f"In the backward pass, {e.op} {_where(e)} made {nonfinite_what(d)}"
                f"{_op_range(d)}, {_op_steps(a)}, but every gradient an optimizer step took "
                "was finite: those values went into gradients that no optimizer used (a "
                "GAN's discriminator gradients from the generator's backward, which the "
                "next `zero_grad()` drops). Training is not affected.")
    if d.get("off_graph"):
        # Review 55: T5's relative-position buckets take the log of integer distances,
        # -inf at distance 0, then cast it to integers: no gradient passes through it.
        return (f"{e.op} {_where(e)} made {nonfinite_what(d)}{_op_range(d)}, {_op_steps(a)}, "
                "from inputs that need no gradient (positions, a mask, constants), and its "
                "module's output stayed finite: a later op dropped those values (a cast to "
                "integers, a `torch.where`), as T5's relative-position buckets do with the "
                "log of distance 0. No gradient flows back through it, so it harms neither "
                "the loss nor the gradients.")
    if d.get("grads_nonfinite"):
        # Review 54: NaN in padded positions whose labels were ignored kept the loss
        # finite, yet reached the gradients (0 x NaN in cross-entropy's backward): the
        # backward's own origin does not show that these values played no part.
        return (f"{e.op} {_where(e)} made {nonfinite_what(d)}{_op_range(d)}, "
                f"{_op_steps(a)}, but the step's loss stayed finite: a later op kept those "
                "values out of it (a mask, an ignored label, a `torch.where`). The step's "
                "gradients went non-finite all the same, first in a backward op (see the "
                "nonfinite_backward finding); these values may have fed it, since a masked "
                "NaN still gives NaN in backward (0 x NaN), so fix this op too if that "
                "finding does not explain them.")
    return (f"{e.op} {_where(e)} made {nonfinite_what(d)}{_op_range(d)}, {_op_steps(a)}, "
            "but the step's loss stayed finite and no gradient took them on: a later op "
            "dropped those values (a `torch.where`, a mask, a cast to integers), as "
            "`torch.where(z > 0, torch.log(z), 0)` does. Training is not affected.")


_DROPPED_SKIP = ("no backward reached those forwards' outputs: the loop dropped them (`if "
                 "not torch.isfinite(loss): continue` skips the iteration before backward; a "
                 "NaN loss swapped for a zero one), or they ran outside training with grad "
                 "on (an evaluation without `torch.no_grad()`), so no GradScaler backoff, "
                 "skipped step or loss check saw them")


def _in_steps(n: int, first: object, unrecorded: bool = True) -> str:
    """"at step 7" or "in 3 steps (first at step 7)", of steps no recording saw."""
    if n == 1:
        return f"at step {first}" + (" (not a recorded step)" if unrecorded else "")
    return (f"in {n} steps (first at step {first}" + (", none of them recorded" if unrecorded
                                                       else "") + ")")


def _which_input(d: dict[str, object]) -> str:
    """Which of a model's floating inputs held it, when it was given several."""
    at, n = d.get("input"), d.get("inputs")
    if not isinstance(at, str) or not isinstance(n, int) or n < 2:
        return ""
    return f" (in its {at}, one of {n} floating inputs)"


def _unrecorded_also(d: dict[str, object]) -> str:
    """The unrecorded steps' part of a batch finding that recorded steps made (see
    ``steps/batches.py``: every step's batch is checked)."""
    n = int(d.get("unrecorded_steps") or 0)  # type: ignore[call-overload]
    said = ""
    if n:
        dropped = d.get("unrecorded_dropped")
        said = (f" It held {nonfinite_what(d)} "
                + _in_steps(n, d.get("unrecorded_first"), False)
                + " that no recording saw too, and "
                + ("the model's output was NaN/inf with it: " + _DROPPED_SKIP + "."
                   if dropped == n else "the loss or the gradients went NaN/inf with it"
                   + (f" ({dropped} of them the loop dropped before backward)." if dropped
                      else ".")))
    m = int(d.get("unrecorded_harmless") or 0)  # type: ignore[call-overload]
    if m and (d.get("harmful") or n):
        said += (f" In {m} other step(s) no recording saw, the loss stayed finite with such "
                 "a batch.")
    elif m:
        said += f" It held such values in {m} step(s) no recording saw too."
    return said


def _unrecorded_input(e_module: str | None, d: dict[str, object], step: int | None) -> str:
    """A batch finding of unrecorded steps only (every step's batch is checked)."""
    n = int(d.get("unrecorded_steps") or 0)  # type: ignore[call-overload]
    if not n:
        m = int(d.get("unrecorded_harmless") or 0)  # type: ignore[call-overload]
        return (f"The batch given to {F.layer(e_module)} held {nonfinite_what(d)}"
                f"{_which_input(d)} {_in_steps(m, step)}, but the loss stayed finite: the "
                "model handles such values (missing data encoded as NaN, replaced or masked in "
                "its forward).")
    dropped = d.get("unrecorded_dropped")
    if dropped == n:
        return (f"The batch given to {F.layer(e_module)} held {nonfinite_what(d)}"
                f"{_which_input(d)} {_in_steps(n, step)}, and the model's output with it: "
                f"{_DROPPED_SKIP}. The data was non-finite before any layer ran"
                + ("; training took none of it (no step's loss went NaN/inf)."
                   if d.get("dropped_only") else "."))
    return (f"The batch given to {F.layer(e_module)} already held {nonfinite_what(d)}"
            f"{_which_input(d)} {_in_steps(n, step)}, and the loss or the gradients went "
            "NaN/inf with it"
            + (f" ({dropped} of them the loop dropped before backward)" if dropped else "")
            + ": the data was non-finite before any layer ran, so what went NaN/inf after "
            "it only carried it on.")


def batch_poisoned_weights(module: str | None, d: dict[str, object], step: int,
                           seen: int) -> str:
    """A batch that held NaN in a step whose loss stayed finite, and a loss NaN for good
    from the steps after it on, without a GradScaler (see ``folding.py``)."""
    return (f"The batch given to {F.layer(module)} held {nonfinite_what(d)}{_which_input(d)} "
            f"at step {step} (not a recorded step). The loss stayed finite in that step, but "
            f"from the steps after it on it was NaN/inf (first seen at recorded step {seen}): "
            f"with no GradScaler to skip it, step {step}'s update took that batch's "
            "gradients, and a NaN the loss leaves out still makes NaN gradients in the "
            "backward (0 * NaN), which poison the weights.")


@message_for("nonfinite_input")
def _nonfinite_input(a: MessageArgs) -> str:
    e, d = a.event, a.event.data
    if d.get("detected") == "unrecorded step":
        return _unrecorded_input(e.module, d, e.step)
    if d.get("detected") == "recorded step" and not d.get("harmful") and not d.get(
            "unrecorded_steps") and d.get("outputs_dropped"):
        return (f"The batch given to {F.layer(e.module)} held {nonfinite_what(d)} ({a.at}"
                + (f", in {a.n} recorded steps" if a.n > 1 else "") + "), and the model's "
                "output with it, but the loss and every gradient stayed finite: "
                f"{_DROPPED_SKIP}. The data was non-finite before any layer ran; training "
                "took none of it." + _unrecorded_also(d))
    if d.get("detected") == "recorded step" and not d.get("harmful") and not d.get(
            "unrecorded_steps"):
        beside = int(d.get("beside") or 0)  # type: ignore[call-overload]
        calm = ("every layer's output and the loss stayed finite" if not beside else
                f"in {a.n - beside} of them every layer's output and the loss stayed finite")
        return (f"The batch given to {F.layer(e.module)} held {nonfinite_what(d)} ({a.at}"
                + (f", in {a.n} recorded steps" if a.n > 1 else "") + f"), but {calm}: the "
                "model handles such values (missing data encoded as NaN, replaced or masked "
                "in its forward)"
                + (f"; the other {beside} step(s) went wrong for another reason (see the "
                   "other findings)." if beside else ".")
                + _unrecorded_also(d))
    if d.get("detected") == "recorded step" and "recorded_first" in d:
        # The first harmful step was an unrecorded one: the finding is at it.
        n = int(d.get("unrecorded_steps") or 0)  # type: ignore[call-overload]
        m = int(d.get("harmful") or 0)  # type: ignore[call-overload]
        return (f"The batch given to {F.layer(e.module)} already held {nonfinite_what(d)} in "
                f"{n + m} steps (first at step {e.step}; recorded step {d['recorded_first']} "
                + (f"and {m - 1} more recorded step(s) show" if m > 1 else "shows")
                + " it), and the loss or the gradients went NaN/inf with it: the data was "
                "non-finite before any "
                "layer ran, so the layers' NaN/inf outputs only carried it on."
                + _unrecorded_also({**d, "unrecorded_steps": 0}))
    if d.get("detected") == "recorded step":
        # The steps it did harm in (a.n counts those the model took in its stride too).
        n = min(a.n, int(d.get("harmful") or a.n))  # type: ignore[call-overload]
        return (f"The batch given to {F.layer(e.module)} already held {nonfinite_what(d)}"
                f"{_which_input(d)} ({a.at}" + (f", in {n} recorded steps" if n > 1 else "")
                + "): the data was non-finite before any layer ran, so the layers' NaN/inf "
                "outputs only carried it on." + _unrecorded_also(d))
    if d.get("handled"):
        n = int(d["handled"])  # type: ignore[call-overload]
        beside = int(d.get("beside") or 0)  # type: ignore[call-overload]
        calm = ("the loss and every gradient stayed finite" if not beside else
                f"in {n} of them the loss and every gradient stayed finite")
        return (f"The batch passed to {F.layer(e.module)} held {nonfinite_what(d)} "
                + (f"in {n + beside} steps (first at step {e.step})" if n + beside > 1
                   else f"at step {e.step}")
                + f", but {calm}: the model handles such values (missing data encoded as "
                "NaN, replaced or masked in its forward), or that forward's output reached no "
                "backward (an evaluation with grad on)"
                + (f"; the other {beside} step(s) went wrong for another reason (see the "
                   "other findings)." if beside else "."))
    if d.get("dropped_only"):
        n = int(d.get("occurrences") or 1)  # type: ignore[call-overload]
        return (f"The batch passed to {F.layer(e.module)} held {nonfinite_what(d)}"
                f"{_which_input(d)} " + (f"in {n} steps (first at step {e.step})" if n > 1
                                         else f"at step {e.step}")
                + f", and the model's output with it: {_DROPPED_SKIP}. The data was "
                "non-finite before any layer ran; training took none of it (no step's loss "
                "went NaN/inf).")
    return (f"The batch passed to {F.layer(e.module)} already holds {nonfinite_what(d)}"
            f"{_which_input(d)} ({_op_steps(a)}): it came from the data, not from a layer.")


def dropped_cause(d: dict[str, object]) -> str:
    """What made a dropped forward's NaN/inf: "loss" (a loss the model returns, beside
    finite outputs), or "model"."""
    n = int(d.get("steps_bad") or 1)  # type: ignore[call-overload]
    return "loss" if d.get("loss_only") == n else "model"


@message_for("nonfinite_output_dropped")
def _nonfinite_output_dropped(a: MessageArgs) -> str:
    e, d = a.event, a.event.data
    n = int(d.get("steps_bad") or 1)
    skip = f"{_DROPPED_SKIP[0].upper()}{_DROPPED_SKIP[1:]}."
    cause = dropped_cause(d)
    if cause == "loss":
        return (f"The loss {F.layer(e.module)} returns was NaN/inf in {n} step(s) (first at "
                f"step {e.step}) while its other outputs were finite: the loss computation "
                "made it, not a layer (a cross-entropy over a batch whose labels are all "
                f"ignored is 0/0). {skip}")
    handled = d.get("batch_nan_handled_at")
    batch = ("from a finite batch" if handled is None else
             "from a batch that held NaN/inf, as the model's batches do (at step "
             f"{handled} the loss stayed finite with one: it handles them)")
    return (f"The output of {F.layer(e.module)} was NaN/inf in {n} step(s) "
            f"(first at step {e.step}), {batch}: a layer or an op made it in the "
            f"forward pass. {skip} Skipping such iterations hides the cause; it does not "
            "remove it, and each skip loses a batch.")


@message_for("nonfinite_grads_applied")
def _nonfinite_grads_applied(a: MessageArgs) -> str:
    e, d = a.event, a.event.data
    culprits = [c for c in d.get("culprits") or [] if c != e.module]
    loss = d.get("loss")
    again = int(d.get("occurrences") or 1) - 1
    if d.get("after_unscale"):
        n = int(d.get("grads_bad") or 0)
        which = (f"{n} parameter gradient(s) went NaN/inf" + (
            f" after the loop's `scaler.unscale_(optimizer)` and before "
            f"`scaler.step(optimizer)`, first {F.layer(e.module)}'s" if e.module else ""))
        if d.get("unrecorded"):
            which = ("the gradients went NaN/inf after the loop's "
                     "`scaler.unscale_(optimizer)` and before `scaler.step(optimizer)` (a "
                     "step not recorded: which layers' is not known; `--every 1` records "
                     "every step)")
        return (f"At step {e.step}, {which}, while the backward pass gave finite ones. "
                "GradScaler checks the gradients for NaN/inf inside unscale_ only: it found "
                "none, so its step did not skip this update, and the update took them (the "
                "weights they touched are NaN/inf from here on). The code between the two "
                "calls made them: noise added to `.grad`, a custom clip or rescale, or one "
                "`clip_grad_norm_` over several optimizers' parameters while one of them had "
                "inf gradients (its NaN total norm scales every other gradient to NaN)."
                + (f" It happened in {again} later recorded step(s) too." if again else ""))
    went = (f"The gradients went NaN/inf in the backward pass of step {e.step}, first in "
            f"{F.layer(e.module)}'s gradients (in backward order"
            + (f"; then {', '.join(culprits[:6])}" if culprits else "") + ")")
    where = ("A layer's output gradient is made by the backward of the layer that uses "
             "its output, so the op that made it is there or in the loss's gradient.")
    if d.get("weights_only"):
        went = (f"At step {e.step} the weights' gradients of {F.layer(e.module)}"
                + (f" (then {', '.join(culprits[:6])})" if culprits else "")
                + " were NaN/inf when the optimizer stepped, every layer's output gradient "
                "finite")
        where = ("A weight-gradient op of the backward pass made them (the input times an "
                 "output gradient), or the loop's own code between backward and the step: "
                 "noise added to `.grad`, a custom clip.")
    return (went + ", while "
            + ("the loss" + (f" ({F.num(loss)})" if isinstance(loss, float) else "")
               + " was finite (the forward pass that made these gradients ran under "
               "torch.func, vmap or grad, whose values amp-doctor cannot read: an "
               "overflow there is possible)" if d.get("forward_unseen") else
               "the forward pass and the loss"
               + (f" ({F.num(loss)})" if isinstance(loss, float) else "") + " were finite")
            + ". Nothing skipped that step (no GradScaler is on): its update "
            "took them, which makes the weights it touched NaN/inf unless the loop drops "
            f"such gradients itself. {where}"
            + (f" It happened in {again} later recorded step(s) too." if again else ""))


@message_for("nonfinite_backward")
def _nonfinite_backward(a: MessageArgs) -> str:
    e, d = a.event, a.event.data
    of = (f"the backward of {d.get('forward_op')} {_where(e)}" if d.get("forward_op")
          else f"a backward {_where(e)}")
    zero = ""
    if zero_denominator(e.op, d):
        zero = (" Its denominator was exactly 0 in float16: a value that may have underflowed "
                "to 0 there (float16 holds nothing below 6e-8), not an overflow."
                if denominator_dtype(d) == "float16" else
                " Its denominator was exactly 0: a division by zero, which float32 or "
                "bfloat16 would make inf too, not an overflow.")
    return (f"In the backward pass, {e.op} (part of {d.get('node')}, {of}) produced "
            f"{nonfinite_what(d)}{_op_range(d)}, "
            f"{_op_steps(a)}. This is the first backward op to go non-finite; the layers "
            f"before it in backward order only passed it on.{zero}")


@message_for("activation_overflow")
def _hidden_overflow(a: MessageArgs) -> str | None:
    e, d = a.event, a.event.data
    if not d.get("hidden"):
        return None
    cast = cast_overflow(e.op, d)
    zero = log_of_zero(e.op, d)
    made = (f"overflowed to {nonfinite_what(d)}: it {cast}" if cast is not None
            else f"made -inf{_op_range(d)}: the log of exactly 0 (a {d.get('dtype')} "
            "probability that underflowed to 0), not an overflow" if zero
            else f"overflowed to {nonfinite_what(d)}{_op_range(d)}")
    nxt = ("0 * log(0), as in an entropy p * log(p), is NaN at once, and the backward of "
           "log at 0 is inf" if zero else
           "The backward of this op is where NaN usually appears next")
    return (f"{e.op} {_where(e)} {made}, "
            f"{_op_steps(a)}, while {F.layer(e.module)}'s output stayed finite: a later op in it "
            "saturated the inf (a clamp, a softmax, a masked fill), or it was kept aside (an "
            f"auxiliary loss on the module), so module-level stats miss it. {nxt[0].upper()}"
            f"{nxt[1:]}.")


@message_for("nonfinite_forward")
def _nonfinite_forward(a: MessageArgs) -> str:
    e, d = a.event, a.event.data
    tail = f" {F.layer(e.module)}'s output stayed finite." if d.get("module_output_finite") else ""
    cast = cast_overflow(e.op, d)
    if cast is not None and d.get("casts_parameter"):
        # Review 54: an output bias of 2.5e5 (a regression on raw targets) is the layer's
        # own value, which autocast casts at every use: not the data's.
        return (f"{e.op} {_where(e)} was the first op to produce {nonfinite_what(d)}: it "
                f"{cast}, {_op_steps(a)}. Those values are a parameter of "
                f"{F.layer(e.module) if e.module else 'the model'} (a weight or bias, in "
                f"float32), which autocast casts to {d.get('dtype')} at every use: every op "
                f"after it only passed them on.{tail}")
    if cast is not None:
        return (f"{e.op} {_where(e)} was the first op to produce {nonfinite_what(d)}: it "
                f"{cast}, {_op_steps(a)}. Those values were beyond the format before any "
                f"layer's arithmetic: every op after it only passed them on.{tail}")
    if inputs_held_inf(d) and e.op in SOFTMAX_OPS:
        tail = (" Its input held -inf: a row that the -inf mask covers whole, whose "
                "softmax is 0/0." + tail)
    elif inputs_held_inf(d):
        tail = (" An inf came in (a -inf mask, or an inf passed on), and this op made "
                "NaN of it (inf - inf, 0 * inf)." + tail)
    elif overflowed_past_mask(d):
        tail = (" Its input held -inf too (a mask), but the +inf came from its finite "
                "values: the op itself overflowed the format." + tail)
    if (big := scalar_beyond(d)) is not None:
        tail = (f" One of its inputs is a single value, {_num(big)}, beyond {d.get('dtype')}'s "
                f"max: a 0-dim tensor (a learned scale or temperature, the exp of a "
                f"parameter) whose product with a {d.get('dtype')} tensor is {d.get('dtype')}."
                + tail)
    own = d.get("later_origins") or []
    after = ("every op after it only passed it on" if not own else
             "later in that step an op in " + ", ".join(F.layer(m) for m in own)
             + " made NaN/inf from finite inputs too (a separate origin)")
    return (f"{e.op} {_where(e)} was the first op to produce {nonfinite_what(d)}"
            f"{_op_range(d)}, {_op_steps(a)}; {after}.{tail}")
