"""What to do about each kind of finding: the advice table, and the fix for one event.

``ADVICE`` maps a finding's kind to its fix, as flop_counter maps an op to its
formula; ``ADVICE_BF16`` overrides it for runs that already train in bfloat16
(they are never told to "use bfloat16"), and ``OP_ADVICE`` names the fix for the
op anomaly mode found. Detectors look their advice up here instead of carrying it.
"""

from __future__ import annotations

import re
from dataclasses import replace

from amp_doctor import format as F
from amp_doctor.analysis.messages import (
    SOFTMAX_OPS,
    denominator_dtype,
    dropped_cause,
    inputs_held_inf,
    scalar_beyond,
    zero_denominator,
)
from amp_doctor.analysis.thresholds import DIVERGED_INPUT_ABSMAX, F16_SMALLEST_NORMAL
from amp_doctor.opnames import DIVISION_OPS
from amp_doctor.records import Event, Finding

__all__ = ["ADVICE", "ADVICE_BF16", "OP_ADVICE", "advice_for", "event_advice", "bf16_advice",
           "unlocated_advice"]

ADVICE: dict[str, str] = {
    "activation_overflow": (
        "Keep this layer in float32: wrap its call in "
        "`with torch.autocast(device_type, enabled=False): out = layer(x.float())`, "
        "or train with `dtype=torch.bfloat16`, which has float32's range. If the "
        "weights grew large, add weight decay or normalisation before it."
    ),
    "activation_overflow_own_code": (
        "The op is in the model's own forward code, not in one of its layers: find it "
        "with anomaly mode (`amp-doctor diagnose --anomaly`, or `watch(model, "
        "anomaly=True)`), then compute it in float32 (`with torch.autocast(device_type, "
        "enabled=False):` around it, its inputs `.float()`) or bound what grows (clamp a "
        "learned scale or temperature, as CLIP clamps its logit scale at 100), or train "
        "with `dtype=torch.bfloat16`."
    ),
    "activation_overflow_output": (
        "This layer returns the model's output. A regression's prediction beyond float16's "
        "max means targets that large (prices, counts, raw sensor units). Standardise the "
        "targets, `y = (y - mean) / std`, and un-scale the predictions; that also keeps the "
        "loss and its gradients, times the scale, within float16. Logits that large (a "
        "classifier's or a language model's head) mean the hidden states it takes grew: "
        "normalise them before the head (a final LayerNorm) and look at what made them grow. "
        "Or keep this layer and the loss in float32 (`with torch.autocast(device_type, "
        "enabled=False): out = layer(x.float())`), or train with `dtype=torch.bfloat16`."
    ),
    "nonfinite_loss_finite_grads": (
        "Compute the loss's terms in float32: `term.float()` before the square, exp or sum "
        "(a router z-loss `logsumexp(logits) ** 2` on float16 logits overflows), or clamp "
        "the term. Training went on, since the gradients were finite, but the logged loss "
        "is inf and hides how training goes."
    ),
    "nonfinite_loss_finite_grads_nan": (
        "Guard the division that can be 0/0: `term.sum() / num.clamp_min(1)`, or leave the "
        "term out when its count is 0 (a box loss over a batch with no positive anchors). "
        "It is NaN in float32 too. Training went on, since the gradients were finite, but "
        "the logged loss is NaN and hides how training goes."
    ),
    "nonfinite_loss_finite_grads_either": (
        "Find the term: an inf is a float16 overflow (compute it in float32, `term.float()` "
        "before the square, exp or sum), a NaN a 0/0 (guard the division, "
        "`term.sum() / num.clamp_min(1)`). `amp-doctor diagnose --on-nonfinite raise` stops "
        "at the op with its line. Training went on, since the gradients were finite, but "
        "the logged loss hides how training goes."
    ),
    "nonfinite_loss_neg_inf": (
        "Take the log where it cannot meet 0: `F.log_softmax(x, dim)` instead of "
        "`softmax(x).log()`, `F.logsigmoid(x)` instead of `sigmoid(x).log()`, or "
        "`torch.log(p.clamp_min(eps))` with `eps` above the format's smallest normal "
        "(`torch.finfo(p.dtype).tiny`); then compute the loss in float32. If it is a mask, "
        "mask with the format's lowest finite value (`torch.finfo(x.dtype).min`) so that "
        "no -inf reaches the loss."
    ),
    "fp32_kept": (
        "It ran in float32 here only because --fp32 (watch(fp32=...)) asked: to keep that "
        "without amp-doctor, wrap its call in `with torch.autocast(device_type, "
        "enabled=False): out = layer(x.float())` (`amp-doctor fix` prints a snippet for "
        "the set of layers that removes every error)."
    ),
    "neg_inf_mask": (
        "Nothing to do for the mask. Check that no row is masked whole: softmax of a row "
        "of -inf is NaN (mask with the format's lowest finite value, "
        "`torch.finfo(x.dtype).min`, if that can happen)."
    ),
    "activation_nonfinite": (
        "Find the op that made inf/NaN with anomaly mode (`amp-doctor diagnose --anomaly` or "
        "`watch(model, anomaly=True)`) and keep it in float32 with `torch.autocast(device_type, "
        "enabled=False)` and `.float()` inputs: for log(softmax) use `torch.log_softmax`, for "
        "divisions add an epsilon float16 can hold (>= 1e-5) or clamp the denominator."
    ),
    "input_beyond_format": (
        "Normalise or clip the data before the model (a value beyond the format's max is "
        "inf once autocast casts it). Float32 for the first layer (`with "
        "torch.autocast(device_type, enabled=False): out = layer(x.float())`) helps only "
        "when that layer brings the values back in range (a normalisation): values it "
        "passes on large overflow further on."
    ),
    "activation_headroom": (
        "Values are within 2x of the format's max: rescale the input (normalise it), "
        "or run this layer in float32 with `torch.autocast(device_type, enabled=False)`."
    ),
    "activation_underflow": (
        "Small values flush to zero in this format: use `dtype=torch.bfloat16` (same range "
        "as float32), or compute this layer in float32 with "
        "`torch.autocast(device_type, enabled=False)`; avoid tiny constants such as eps=1e-8 "
        "(use >= 1e-5 in float16)."
    ),
    "gradient_underflow": (
        "Gradients flush to zero in float16: use `torch.amp.GradScaler(device_type)` and "
        "call `scaler.scale(loss).backward()`; if a scaler is in use, raise `init_scale` "
        "or lower `growth_interval` so the scale can grow; or switch to bfloat16."
    ),
    # The same, where the loss itself is tiny (analysis.thresholds.TINY_LOSS).
    "gradient_underflow_tiny_loss": (
        "Bring the loss to order 1 first: check how it is normalised (a mean over the batch, "
        "not a sum divided by the dataset's size) and drop tiny weights on it. A GradScaler "
        "can make up for a small loss only slowly (it doubles the scale once per "
        "`growth_interval` clean steps, 2000 by default): a higher `init_scale` helps, or "
        "bfloat16, whose range needs no scaling."
    ),
    # The scale backs off beside a large loss (analysis.thresholds.LARGE_LOSS).
    "scale_collapse_large_loss": (
        "Average the loss instead of summing it: `reduction=\"mean\"` (the default of "
        "`F.cross_entropy`), or divide a sum by the number of tokens or samples it adds up, "
        "so that it is of order 1; scale targets to unit size for a regression. A "
        "GradScaler then keeps a useful scale, and no layer needs float32 for it."
    ),
    # Anomaly mode's first backward op overflowed a scaled gradient that arrived near the
    # format's max (analysis.thresholds.SCALED_GRAD_NEAR_MAX): the loss times the scale.
    # The large-loss fix first, as the default mode gives it, then the scale's own.
    "scaled_grad_near_max": (
        "Average the loss instead of summing it: `reduction=\"mean\"` (the default of "
        "`F.cross_entropy`), or divide a sum by the number of tokens or samples it adds up, "
        "so that it is of order 1. If the sum is meant, start the scale lower instead: "
        "`torch.amp.GradScaler(device_type, init_scale=...)` at the scale the run settled at "
        "(the report's Scaler line), so that no step is skipped backing off. A GradScaler "
        "then keeps a useful scale, and no layer needs float32 for it."
    ),
    "missing_scaler": (
        "float16 autocast without a GradScaler lets small gradients flush to zero. Create "
        "`scaler = torch.amp.GradScaler(device_type)` and use `scaler.scale(loss).backward()`, "
        "`scaler.step(optimizer)`, `scaler.update()`; or use `dtype=torch.bfloat16`."
    ),
    # The same, for a loop whose GradScaler is there but disabled (review 61a: "Create
    # `scaler = ...`" to a script that had one).
    "missing_scaler_disabled": (
        "float16 autocast with a disabled GradScaler lets small gradients flush to zero. "
        "Enable it: `torch.amp.GradScaler(device_type, enabled=True)` for the device the "
        "model trains on (`torch.cuda.amp.GradScaler()` disables itself without CUDA); the "
        "loop's `scaler.scale(loss).backward()`, `scaler.step(optimizer)` and "
        "`scaler.update()` then work as they are. Or use `dtype=torch.bfloat16`."
    ),
    # The same, for float16 weights (`model.half()`): a GradScaler refuses their gradients.
    "missing_scaler_half_params": (
        "Small gradients flush to zero in float16, and a GradScaler cannot help while the "
        "weights themselves are float16: it refuses to unscale float16 gradients (`ValueError: "
        "Attempting to unscale FP16 gradients.`). Keep the weights in float32 first (remove "
        "`model.half()` and run the forward under `torch.autocast(device_type, "
        "dtype=torch.float16)`), then add `scaler = torch.amp.GradScaler(device_type)`; or use "
        "bfloat16."
    ),
    "autocast_inactive": (
        "Autocast did not run. Wrap the forward pass and loss in "
        "`with torch.autocast(device_type='cuda' or 'cpu', dtype=torch.float16):` and check "
        "that `enabled=` is True and the device_type matches where the model lives "
        "(`torch.cuda.amp.autocast()` on a machine without CUDA disables itself: use "
        "`torch.autocast(device_type, ...)`). With the Hugging Face Trainer, `fp16=True` "
        "needs a GPU: on a CPU set `bf16=True`; with Lightning, `precision=\"bf16-mixed\"`."
    ),
    "autocast_float64": (
        "Autocast casts only float32 tensors, so a float64 model or input runs in float64 "
        "under it. Train in float32: drop `torch.set_default_dtype(torch.float64)` and "
        "`.double()`, call `model.float()` and pass float32 inputs; autocast then runs the "
        "eligible ops (linear, conv, matmul) in low precision."
    ),
    "autocast_no_low_ops": (
        "Autocast runs only some ops in low precision (linear, conv, matmul, ...), and "
        "none of this model's did. Check that autocast wraps the forward pass where those "
        "ops run, and that `device_type` matches the device the model lives on."
    ),
    "scaler_backoff": (
        "Each backoff is a skipped optimizer step caused by inf/NaN gradients. Look at the "
        "first culprit layer: keep it in float32 with `torch.autocast(device_type, "
        "enabled=False)`, add normalisation, lower the learning rate, or use bfloat16."
    ),
    "scale_collapse": (
        "The loss scale keeps falling because gradients keep becoming inf/NaN (an overflow, "
        "or a NaN such as a 0/0 the scale cannot prevent); the optimizer is skipping steps. "
        "Fix the culprit layer named in the backoffs (run it in float32 or "
        "use bfloat16); do not just lower `init_scale`. If the model was trained in bf16, "
        "fine-tune it in bf16 (`dtype=torch.bfloat16`) rather than float16."
    ),
    "scaler_recreated": (
        "Create the GradScaler once, outside the epoch loop (not inside "
        "`train_one_epoch()`), and pass it in as you do the optimizer: it keeps the scale "
        "it calibrated and grows it as training allows. Where a new one must be built (a "
        "restarted loop, a resumed checkpoint), carry the state over: "
        "`new.load_state_dict(old.state_dict())`, and save `scaler.state_dict()` in the "
        "checkpoint beside the optimizer's. A lower `init_scale` only shortens each "
        "recalibration."
    ),
    "scale_collapse_loss_gradient": (
        "Keep the loss O(1): normalise the data and targets to unit scale, take a mean rather "
        "than a sum over elements, or divide the loss by its typical size before "
        "`scaler.scale(loss)`; and compute the code between the model's output and the loss "
        "in float32 (`logits = z1.float() @ z2.float().T / temperature`; `F.normalize` a "
        "contrastive loss's embeddings). Running the output layer in float32 only moves the "
        "overflow to the layer before it: every gradient the model gets is the loss's."
    ),
    "scale_collapse_loss_code": (
        "Compute the code between the model's output and the loss in float32, in the stable "
        "fused forms: `F.binary_cross_entropy_with_logits(logits.float(), y)` instead of "
        "`F.binary_cross_entropy(torch.sigmoid(logits), y)` (whose backward divides by "
        "p * (1 - p)), `F.cross_entropy` or `log_softmax` instead of `log(softmax)`, a "
        "temperature applied to float32 logits. Running the output layer in float32 only "
        "moves the overflow to the layer before it: every gradient the model gets is the "
        "loss's."
    ),
    "scale_stuck": (
        "The scale cannot grow because some scaled gradient keeps reaching float16's max. "
        "Look at the layer named in the message (least gradient headroom, or first culprit): "
        "run it in float32 with `with torch.autocast(device_type, enabled=False): "
        "y = layer(x.float())`, normalise its input, or train in bfloat16 "
        "(`dtype=torch.bfloat16`). Harmless if no gradient underflows at the current scale."
    ),
    "clip_before_unscale": (
        "Call `scaler.unscale_(optimizer)` before `torch.nn.utils.clip_grad_norm_(...)`: "
        "clipping scaled gradients clips at max_norm * scale, so the clip does nothing "
        "(or everything)."
    ),
    "missing_update": (
        "Call `scaler.update()` once per iteration, after `scaler.step(optimizer)` for every "
        "optimizer (with gradient accumulation: after the last micro-step's `scaler.step`). "
        "Without it the scale never adapts and the next `scaler.step` raises."
    ),
    "scaled_backward_probe": (
        "Nothing to fix: at a GradScaler's first steps and after each growth, the scaled "
        "gradients overflowing somewhere in the backward pass is how it finds the largest "
        "scale that fits; it skipped those steps (see its backoff finding)."
    ),
    "update_without_step": (
        "Call `scaler.update()` right after `scaler.step(optimizer)`, once per optimizer step: "
        "with gradient accumulation, only on the last micro-step, "
        "`if (i + 1) % accum == 0: scaler.step(opt); scaler.update(); opt.zero_grad()`."
    ),
    "scaler_with_bf16": (
        "bfloat16 has float32's exponent range, so a GradScaler is not needed: remove it, or "
        "construct it with `enabled=False` (`torch.amp.GradScaler(device_type, enabled=False)`)."
    ),
    "fp16_params": (
        "Keep parameters in float32 and let autocast cast them: remove `model.half()` (or "
        "`.to(torch.float16)`; use `model.float()`), keep `torch.autocast(device_type, "
        "dtype=torch.float16)` around the forward pass and the GradScaler as is. GradScaler's "
        "`unscale_` refuses float16 gradients ('Attempting to unscale FP16 gradients') because "
        "unscaling in float16 would itself underflow/overflow. For pure-float16 weights keep a "
        "float32 master copy, or use bfloat16 without a scaler."
    ),
    "scheduler_on_skipped_step": (
        "Step the scheduler only when the optimizer stepped: `scale = scaler.get_scale(); "
        "scaler.update(); if scaler.get_scale() >= scale: scheduler.step()`. Usually harmless "
        "for a few skips during calibration; a warmup the skips ate (a high `init_scale` "
        "skips its first steps) needs it, or a lower `init_scale`."
    ),
    "loss_not_scaled": (
        "Call `scaler.scale(loss).backward()`, not `loss.backward()`, while a GradScaler is "
        "enabled; otherwise `scaler.step` unscales gradients that were never scaled and "
        "divides them by the scale."
    ),
    "backward_in_autocast": (
        "Call backward outside the autocast block: `with torch.autocast(device_type, "
        "dtype=...): loss = loss_fn(model(x), y)` and then, dedented, "
        "`scaler.scale(loss).backward()`. Autocast should wrap only the forward pass and the "
        "loss; backward ops already run in the dtype their forward used."
    ),
    "nonfinite_forward": (
        "Keep this op in float32: wrap it in `with torch.autocast(device_type, "
        "enabled=False):` and cast its input with `.float()`; or use bfloat16. For "
        "log(softmax) use `torch.log_softmax`; for divisions add an epsilon representable "
        "in float16 (>= 1e-5) or clamp the denominator."
    ),
    "nonfinite_backward": (
        "The backward of this op produced NaN/Inf: run the forward op in float32 with "
        "`torch.autocast(device_type, enabled=False)`, clamp its input, or use bfloat16."
    ),
    "nonfinite_discarded": (
        "Nothing to do while the gradients stay finite. The backward of such an op can "
        "make NaN where its values are dropped (the gradient of log at 0 is 0 * inf): make "
        "its input safe before the op, `torch.log(torch.where(z > 0, z, 1))`, rather than "
        "dropping its output after."
    ),
    "nonfinite_output_dropped": (
        "Find the layer: re-run with `amp-doctor diagnose --anomaly script.py` (it names the "
        "first module, op and line that made the NaN/inf), or with `--every 1` to record "
        "every step; in your own loop, `amp_doctor.watch(model, anomaly=True)`."
    ),
    "nonfinite_input": (
        "The batch itself contains NaN/Inf: check the data pipeline "
        "(`torch.isfinite(x).all()` on each batch) before blaming the model."
    ),
    "nonfinite_loss_poisoned_weights": (
        "Without a GradScaler, skip an update whose gradient norm is not finite "
        "(`clip_grad_norm_` returns it), so that one bad step does not poison the weights."
    ),
    "scaled_grads_stepped": (
        "Let the scaler step the optimizer: `scaler.scale(loss).backward(); "
        "scaler.step(optimizer); scaler.update()`. If you need the gradients first (clipping), "
        "call `scaler.unscale_(optimizer)` before using them. `optimizer.step()` on scaled "
        "gradients makes every update `scale` times too large and never skips inf/NaN steps."
    ),
    "step_after_unscale": (
        "Step through the scaler after clipping: `scaler.unscale_(optimizer); "
        "clip_grad_norm_(...); scaler.step(optimizer); scaler.update()`. scaler.step knows the "
        "gradients are unscaled already, and skips the step when they hold inf/NaN."
    ),
    "update_between_steps": (
        "Call `scaler.update()` once per iteration, after `scaler.step` of every optimizer: "
        "`scaler.scale(loss).backward(); scaler.step(opt1); scaler.step(opt2); "
        "scaler.update()`."
    ),
    "stepped_twice": (
        "Remove the extra `optimizer.step()`: `scaler.step(optimizer)` steps the optimizer "
        "itself, or skips the step when the gradients hold inf/NaN."
    ),
    "nonfinite_loss": (
        "A NaN/inf loss poisons every gradient. Look where it first appeared: a layer's "
        "output (run it in float32 with `torch.autocast(device_type, enabled=False)`), or the "
        "loss computation itself (a fully masked attention row or an all-ignored batch gives "
        "0/0: mask with a large negative number instead of -inf, or skip empty batches; "
        "compute the loss in float32 with `loss_fn(out.float(), y)`)."
    ),
    "nonfinite_loss_float32": (
        "A NaN/inf loss poisons every gradient. The loss reached backward in float32 (it "
        "ran in float32 already here), so its last ops did not overflow, but what fed them "
        "may have: a layer's output (run it in float32 with `torch.autocast(device_type, "
        "enabled=False)`), or loss code that ran under autocast before them (a similarity "
        "`z @ z.t() / temperature` can overflow float16: normalise first, or compute it on "
        "`.float()` inputs). Or it is NaN in any format: a fully masked attention row or an "
        "all-ignored batch gives 0/0 (mask with a large negative number instead of -inf, or "
        "skip empty batches), or a division by a count that can be 0. `amp-doctor diagnose "
        "--anomaly` names the op and its line."
    ),
    "model_not_run": (
        "Watch the module your loop calls: `amp_doctor.watch(model)` on the same object "
        "whose forward runs (or a wrapper of it), not a copy: `copy.deepcopy`, or a model "
        "re-built or re-loaded after the watch began."
    ),
    "model_stopped": (
        "Watch the module your loop trains from then on: start `amp_doctor.watch(...)` on "
        "it once it is built or loaded, or run the script under `amp-doctor diagnose`, "
        "which watches whatever model the loop trains."
    ),
    "model_not_run_compiled": (
        "Watch the module your loop calls (the same object whose forward runs, not a copy). "
        "If it is, torch.compile reused a graph it compiled before the watch began (for an "
        "earlier model of the same class): run `torch._dynamo.reset()` before "
        "`amp_doctor.watch(model)`. For per-layer figures, watch a few steps without "
        "torch.compile."
    ),
    "no_step_boundary": (
        "amp-doctor ends a step at `scaler.update()`, at `optimizer.step()`, or at the next "
        "forward after a backward once the weights changed. None of these happened: call "
        "`doctor.step()` at the end of each iteration (with `doctor = amp_doctor.watch(model)`)."
    ),
    "no_step_boundary_foreign": (
        "Name the optimizer and scaler that train the model: "
        "`amp_doctor.watch(model, optimizer=opt, scaler=scaler)` (or `doctor.step()` at the "
        "end of each iteration)."
    ),
    "steps_from_backward": (
        "No optimizer or GradScaler was seen, so each step was taken to end when the loop "
        "updated the weights (or reset the gradients) after a backward. If your loop differs, "
        "call `doctor.step()` at the end of each iteration."
    ),
    "activation_underflow_transient": (
        "Nothing to fix: the share fell below 5% as the layer trained. If the first steps "
        "matter, a larger initial gain (LayerScale's `init_values`) or bfloat16 keeps them."
    ),
    "scaler_backoff_unskipped": (
        "These backoffs skipped no step: the optimizer stepped outside `scaler.step` on "
        "gradients the scaler had found inf/NaN, and the weights took them. Step through the "
        "scaler: `scaler.unscale_(optimizer); clip_grad_norm_(...); scaler.step(optimizer); "
        "scaler.update()`; then fix what makes the gradients inf/NaN."
    ),
    "zeroed_output": (
        "Find the op that overflowed inside the layer with `amp-doctor diagnose --anomaly` and "
        "compute it in float32 (`x.float().pow(2).mean()` in a hand-written norm), or run the "
        "layer in float32: try it with `amp-doctor diagnose --fp32 <layer>`, then in code "
        "`with torch.autocast(device_type, enabled=False): y = layer(x.float())`."
    ),
    "zeroed_output_partly": (
        "Compute the norm's statistic in float32 and cast back: `var = x.float().pow(2)"
        ".mean(-1, keepdim=True); y = (x.float() * torch.rsqrt(var + eps)).type_as(x) * "
        "weight` (as LLaMA's RMSNorm does), or run the layer in float32: try it with "
        "`amp-doctor diagnose --fp32 <layer>`. `amp-doctor diagnose --anomaly` names the op "
        "and its line. bfloat16 also keeps such squares finite."
    ),
    "output_resolution": (
        "Run the output layer in float32: try it with `amp-doctor diagnose --fp32 <layer>`, "
        "then in code `with torch.autocast(device_type, enabled=False): y = head(h.float())`; "
        "or take the offset out of what the model predicts (normalise the targets: subtract "
        "their mean and divide by their std, and undo it on the predictions)."
    ),
    "clip_error_if_nonfinite": (
        "Drop `error_if_nonfinite=True` (False is the default) and keep the recipe "
        "`scaler.unscale_(optimizer); clip_grad_norm_(params, max_norm); "
        "scaler.step(optimizer); scaler.update()`: scaler.step skips the step whose "
        "gradients are inf/NaN and lowers the scale. To stop on NaN that the scaler does "
        "not explain, run `amp-doctor diagnose --anomaly`."
    ),
    "clip_error_real_nonfinite": (
        "Find the op that made the inf/NaN and stop there, with its line: `amp-doctor "
        "diagnose --on-nonfinite raise` (or `--anomaly`). Keep `error_if_nonfinite=True` if "
        "you want the run to stop on such steps; with it False, scaler.step would skip them."
    ),
    "lowp_updates_lost": (
        "Keep float32 master weights: remove `model.half()` / `.to(torch.float16)`, keep the "
        "model in float32 and run the forward under `torch.autocast(device_type, "
        "dtype=torch.float16)` with a `torch.amp.GradScaler`; the optimizer then updates the "
        "float32 weights, where small updates are not rounded away."
    ),
    "lowp_update_nonfinite": (
        "Keep the parameters in float32: remove `.half()` / `.to(torch.float16)` and let "
        "autocast cast them in the forward (`torch.autocast(device_type, dtype=...)`), so "
        "the optimizer and its state work in float32. If they must stay low precision, "
        "give the optimizer an eps the format holds (`eps=1e-4` for float16) or keep a "
        "float32 master copy."
    ),
    "nonfinite_grads_applied": (
        "Train float16 with a GradScaler: `scaler = torch.amp.GradScaler(device_type)`, "
        "`scaler.scale(loss).backward()`, `scaler.step(optimizer)`, `scaler.update()`; it "
        "skips a step whose gradients are NaN/inf and lowers the scale until they fit. "
        "Keep the loss O(1) (a mean, not a sum; normalised targets), and find the op with "
        "anomaly mode (`--anomaly`). Without a scaler, skip an update whose gradient norm is "
        "not finite: `norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, "
        "then step only `if torch.isfinite(norm)`."
    ),
    "nonfinite_grads_after_unscale": (
        "Keep what the loop does to `.grad` between `scaler.unscale_(optimizer)` and "
        "`scaler.step(optimizer)` finite (the noise's scale, a clip coefficient from a norm "
        "that can be 0 or inf), or make the scaler see it: change the gradients first, "
        "then call unscale_ (it checks what it unscales), or skip the update yourself when "
        "`not torch.isfinite(torch.nn.utils.clip_grad_norm_(params, float('inf')))`."
    ),
    "constant_overflow": (
        "Write a value the format holds: `torch.finfo(scores.dtype).min` instead of -1e9 "
        "(it is float16's -65504 under autocast and float32's in float32, so the mask "
        "works in both), or mask in float32: `scores.float().masked_fill(mask, -1e9)`. "
        "A row masked whole still gives NaN with -inf: keep at least one position."
    ),
    "run_ended_early": (
        "Fix the error that stopped the script (see the outcome above), then run again: "
        "amp-doctor judges training steps, and none finished."
    ),
    "run_ended_early_interrupted": (
        "The run was stopped (Ctrl-C or SIGTERM) before a training step finished: let it "
        "train at least one step (`--stop-after N` ends it cleanly after N steps), then "
        "amp-doctor has steps to judge."
    ),
}

# The same advice for a run that already trains in bfloat16: never "use bfloat16".
ADVICE_BF16: dict[str, str] = {
    "nonfinite_grads_applied": (
        "bfloat16 gradients do not overflow below float32's range: a backward op made NaN/inf "
        "(the gradient of sqrt or a norm at 0, of log or a division near 0), or the loss's "
        "gradient grew without bound. Find the op with anomaly mode (`--anomaly`), and skip "
        "an update whose gradient norm is not finite: `norm = "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, then step only "
        "`if torch.isfinite(norm)`."
    ),
    "activation_overflow": (
        "bfloat16 has float32's range, so this is not the format overflowing: an op made "
        "inf/NaN (log(0), x/0, exp of a large value) or the weights diverged. Find the op "
        "with anomaly mode (`amp-doctor diagnose --anomaly` or `watch(model, anomaly=True)`) "
        "and keep it in float32 with `torch.autocast(device_type, enabled=False)`; lower the "
        "learning rate or add weight decay if the weights grew."
    ),
    "activation_underflow": (
        "Compute this layer in float32 with `torch.autocast(device_type, enabled=False)`, "
        "and avoid constants below bfloat16's resolution."
    ),
    "scaler_backoff": (
        "Each backoff is a skipped optimizer step caused by inf/NaN gradients. Look at the "
        "first culprit layer: keep it in float32 with `torch.autocast(device_type, "
        "enabled=False)`, add normalisation, or lower the learning rate."
    ),
    "scale_collapse": (
        "The loss scale keeps falling because gradients keep becoming inf/NaN; the optimizer "
        "is skipping steps. Fix the culprit layer named in the backoffs (run it in float32); "
        "under bfloat16 the GradScaler itself is not needed."
    ),
    "scale_stuck": (
        "The scale cannot grow because some scaled gradient keeps becoming inf/NaN; under "
        "bfloat16 the GradScaler is not needed (`GradScaler(device_type, enabled=False)`)."
    ),
    "nonfinite_forward": (
        "Keep this op in float32: wrap it in `with torch.autocast(device_type, "
        "enabled=False):` and cast its input with `.float()`. For log(softmax) use "
        "`torch.log_softmax`; for divisions add an epsilon or clamp the denominator."
    ),
    "nonfinite_backward": (
        "The backward of this op produced NaN/Inf: run the forward op in float32 with "
        "`torch.autocast(device_type, enabled=False)` or clamp its input."
    ),
    "lowp_updates_lost": (
        "Keep float32 master weights: remove `.to(torch.bfloat16)` / `.bfloat16()`, keep the "
        "model in float32 and run the forward under `torch.autocast(device_type, "
        "dtype=torch.bfloat16)` (no GradScaler needed); the optimizer then updates the "
        "float32 weights, where small updates are not rounded away."
    ),
}


# Formats a precision change cannot widen (complex64 holds two float32s).
WIDE_FORMATS = ("float32", "float64", "complex64", "complex128")
# The CTC loss's ops (autocast runs them in float32).
CTC_OPS = frozenset({"aten._ctc_loss", "aten.ctc_loss", "aten._use_cudnn_ctc_loss",
                     "aten._cudnn_ctc_loss"})
# Formats with float32's range, at least: values beyond it are no format's fault.
WIDE_RANGE_FORMATS = (*WIDE_FORMATS, "bfloat16")

# Op-specific fixes for an op that produced NaN/Inf in the forward pass.
OP_ADVICE: dict[str, str] = {
    "aten.log": "use `torch.log_softmax` instead of `log(softmax(x))`, or "
                "`torch.log(p.float().clamp_min(1e-12))`",
    "aten.div": "add an epsilon that float16 can hold (>= 1e-5; 1e-8 rounds to 0) or compute "
                "the denominator in float32: `x / torch.sqrt(var.float() + eps)`",
    "aten.rsqrt": "add an epsilon that float16 can hold (>= 1e-5) before rsqrt, or compute it "
                  "in float32",
    "aten.pow": "compute the power in float32: `torch.pow(x.float(), p)` inside "
                "`with torch.autocast(device_type, enabled=False):`",
    "aten.exp": "compute it in float32 (`torch.exp(x.float())`; float16's exp overflows "
                "past x = 11.1); an exp of a log-variance (a VAE's KL term) also wants its "
                "input clamped (`logvar.clamp(max=...)`), a softmax-like one the max "
                "subtracted (`torch.softmax`, `torch.logsumexp`)",
    # Reductions: a float16 accumulator overflows at 65504.
    **dict.fromkeys(("aten.sum", "aten.mean", "aten.cumsum", "aten.prod"),
                    "accumulate in float32: `x.sum(dtype=torch.float32)` or `x.float().sum()`"
                    " (float16 holds no sum beyond 65504), or keep the values summed small"),
    # Products: each output sums many products of the inputs.
    **dict.fromkeys(("aten.mm", "aten.bmm", "aten.matmul", "aten.addmm", "aten.baddbmm",
                     "aten.mv", "aten.einsum"),
                    "scale an input down before the product (attention: `q * d**-0.5` before "
                    "`q @ k.transpose(-2, -1)`, or `F.scaled_dot_product_attention`; a "
                    "similarity matrix: `F.normalize` the embeddings first)"),
    # Scatter-style accumulation into a buffer: the sums land in the buffer's dtype, so a
    # float32 source alone would only fail on a dtype mismatch (review 48b).
    **dict.fromkeys(("aten.index_add", "aten.index_add_", "aten.scatter_add",
                     "aten.scatter_add_", "aten.scatter_reduce", "aten.scatter_reduce_",
                     "aten.index_put", "aten.index_put_"),
                    "accumulate in float32, into a float32 buffer: `out = torch.zeros(n, d, "
                    "dtype=torch.float32).index_add_(0, idx, src.float())`, then cast the "
                    "result back (float16 holds no sum beyond 65504), or scale the values "
                    "down first (a mean instead of a sum over the neighbours)"),
    # autocast's cast of a float32 input: the values were beyond the format before it.
    "aten._to_copy": "the values it cast were beyond the format's max already: normalise or "
                     "clip them where they are made (the data, if this is the model's first "
                     "layer)",
}


# A std or var whose reduced dimension holds no more values than its correction.
SPREAD_OPS = frozenset({"aten.std", "aten.var", "aten.std_mean", "aten.var_mean"})
SPREAD_NAN_ADVICE = (
    "A std or var over a dimension with no more values than its correction is NaN in any "
    "precision (the unbiased std of one sample divides by n - 1 = 0): drop the short last "
    "batch (`DataLoader(..., drop_last=True)`) or skip batches of one, or pass "
    "`correction=0`. Only if the dimension is long, compute it in float32 "
    "(`x.float().std(...)`)."
)


def _nan_only(d: dict[str, object]) -> bool:
    """The op made NaN and no inf: from finite inputs, an input outside its domain."""
    return bool(d.get("nan")) and not d.get("pos_inf") and not d.get("neg_inf")


def spread_nan(op: str | None, d: dict[str, object]) -> bool:
    """A std or var made NaN and no inf: a dimension too short for its correction."""
    return op in SPREAD_OPS and _nan_only(d)


# ln(float32's max): exp of anything larger is inf in float32 and bfloat16 alike.
EXP_FLOAT32_LIMIT = 88.72


def advice_for(kind: str, dtype: str | None = None) -> str:
    """The fix for a finding of ``kind`` in a run whose low-precision format is ``dtype``."""
    if dtype == "bfloat16" and kind in ADVICE_BF16:
        return ADVICE_BF16[kind]
    return ADVICE.get(kind, "")




def _quotient_overflow(d: dict[str, object]) -> bool:
    """A division that made +-inf and no NaN from finite inputs, none of its divisors
    near 0: the quotient itself grew past the format (a divisor given as a number is
    not among the recorded inputs, so a single recorded input is the numerator)."""
    if d.get("nan") or not (d.get("pos_inf") or d.get("neg_inf")) or inputs_held_inf(d):
        return False
    ranges = d.get("input_ranges")
    if isinstance(ranges, list) and len(ranges) > 1:
        lo, hi = ranges[1]
        # A divisor at least float16's smallest normal is no "epsilon that rounds to 0"
        # (a subnormal one loses its precision, and 1e-8 flushes to 0).
        return bool(lo >= F16_SMALLEST_NORMAL or hi <= -F16_SMALLEST_NORMAL)
    dtypes = d.get("input_dtypes")
    return isinstance(dtypes, list) and len(dtypes) == 1


def event_advice(e: Event, dtype: str | None = None) -> str:
    """The fix for one run-time event (also used for anomaly mode's exception).

    ``dtype`` is the run's low-precision format: a bfloat16 run is never told
    to train in bfloat16.
    """
    op_fix = OP_ADVICE.get(e.op or "")
    bf16 = dtype == "bfloat16"
    if e.kind == "nonfinite_grads_applied" and e.data.get("after_unscale"):
        # The loop's code did it, in any format: not "add a GradScaler" to a loop with one.
        return ADVICE["nonfinite_grads_after_unscale"]
    top = e.data.get("input_max")
    if (e.kind == "nonfinite_forward" and e.op == "aten.exp" and isinstance(top, (int, float))
            and top > EXP_FLOAT32_LIMIT):
        # Past float32's (and bfloat16's) own limit: no format change helps (review 61c:
        # "compute it in float32" to an exp of 276 in a bfloat16 run).
        return ("exp overflows past x = 88.7 in float32 too, and this input reached "
                f"{top:.3g}: no format holds its exp. Subtract the row's max first "
                "(`torch.softmax` and `torch.logsumexp` do), or clamp the input "
                "(`x.clamp(max=...)`, as for a log-variance).")
    if e.kind == "nonfinite_forward" and inputs_held_inf(e.data):
        # Not a precision problem: float32 or bfloat16 make the same NaN of an inf.
        if e.op in SOFTMAX_OPS:
            return ("Keep at least one position unmasked in every row, or fill the mask with "
                    "the format's lowest finite value instead of -inf: `scores.masked_fill("
                    "mask, torch.finfo(scores.dtype).min)` (a fully masked row then gives a "
                    "uniform row, not NaN).")
        return ("Find where the inf it received was made (a -inf mask, or an op before it) "
                "and keep it out of this op: fill masks with `torch.finfo(x.dtype).min` "
                "instead of -inf, or `torch.nan_to_num` / clamp the input first.")
    big = e.data.get("input_absmax")
    if (e.kind == "nonfinite_forward" and e.data.get("dtype") in WIDE_FORMATS
            and _nan_only(e.data) and isinstance(big, (int, float))
            and big < DIVERGED_INPUT_ABSMAX):
        # NaN from finite, moderate float32 inputs is a domain error, not a range one.
        if e.op in DIVISION_OPS and big == 0:
            # Every input 0: a sum over no elements divided by a count of 0 (review 55).
            return (f"{e.op} computed 0/0, which is NaN in any format: guard the count, "
                    "`term.sum() / num.clamp_min(1)`, or leave the term out when its count "
                    "is 0 (a box loss over a batch with no positive anchors).")
        return (f"{e.op} made NaN from finite {e.data.get('dtype')} inputs: the input was "
                "outside the op's domain (the square root or log of a negative number, "
                "0/0), which no format change fixes. Guard the input, e.g. "
                "`x.clamp_min(eps)` before the op; a `torch.where(mask, f(x), 0)` on the "
                "output still gives NaN gradients, so mask the input instead: "
                "`f(torch.where(mask, x, 1.0))`.")
    if e.kind == "nonfinite_loss" and e.data.get("loss_dtypes") == ["float32"]:
        # Not "compute the loss in float32" to a loop that does (review 55b).
        return ADVICE["nonfinite_loss_float32"]
    if (e.kind == "nonfinite_forward" and e.data.get("dtype") in WIDE_FORMATS
            and e.op in CTC_OPS):
        # Review 55: "keep this op in float32" for a CTC loss that ran in float32 and was
        # inf for targets longer than their inputs, in any precision.
        return (f"{e.op} ran in float32 already: no format change helps. A CTC loss is inf "
                "where a target has no alignment to its input (a target longer than the "
                "input's length, after the model's downsampling, plus its repeated labels): "
                "pass `zero_infinity=True` to `F.ctc_loss` / `nn.CTCLoss`, or drop those "
                "samples (`target_lengths <= input_lengths`).")
    if e.kind == "nonfinite_forward" and scalar_beyond(e.data) is not None:
        return ("Bound the scale that grew: clamp it where it is used (CLIP: "
                "`logit_scale.exp().clamp(max=100)`) or clamp the parameter after each "
                "optimizer step; or compute this product in float32 (`with "
                "torch.autocast(device_type, enabled=False):`, inputs `.float()`).")
    if e.kind == "nonfinite_forward" and spread_nan(e.op, e.data):
        return SPREAD_NAN_ADVICE
    if e.kind == "nonfinite_input" and (e.data.get("dropped_only") or (
            e.data.get("harmful") == 0 and e.data.get("outputs_dropped"))):
        return ("Training is safe from it, but the data holds NaN/inf: check the data "
                "pipeline (`torch.isfinite(x).all()` on each batch). If that forward was an "
                "evaluation, run it under `torch.no_grad()` (and `model.eval()`).")
    if (e.kind == "nonfinite_input" and e.data.get("harmful") == 0
            and not e.data.get("unrecorded_steps")):
        return ("Nothing to fix while the model handles them. If those values are not meant "
                "to be there, check the data pipeline (`torch.isfinite(x).all()` on each "
                "batch).")
    if e.kind == "nonfinite_output_dropped" and dropped_cause(e.data) == "loss":
        return ("Guard the loss against empty batches: skip a batch whose labels are all "
                "`ignore_index` (-100) or whose mask is empty, and compute the loss in "
                "float32 (`loss_fn(logits.float(), labels)`).")
    if (e.kind == "nonfinite_output_dropped" and e.data.get("every") == 1
            and not e.data.get("anomaly")):
        return ("Find the op: re-run with `amp-doctor diagnose --anomaly script.py` (it "
                "names the first module, op and line that made the NaN/inf); in your own "
                "loop, `amp_doctor.watch(model, anomaly=True)`.")
    if e.kind == "nonfinite_output_dropped" and e.data.get("anomaly"):
        return ("Anomaly mode searched the steps after it and did not see it recur: record "
                "every step (`--every 1`) so that the failing step's layer figures name the "
                "layer, or check every op and stop at the first non-finite one with its line "
                "(`--anomaly --on-nonfinite raise`).")
    if e.kind == "nonfinite_forward" and e.op == "aten._to_copy" and e.data.get(
            "casts_parameter"):
        where = F.layer(e.module) if e.module else "the layer"
        return (f"A parameter of {where} holds values beyond the format's max. A bias that "
                "large is often learned (or initialised) to fit targets of that size: "
                "standardise the targets (`(y - mean) / std`, the predictions scaled back "
                "for reporting) so the layer's parameters stay small. Or keep the layer in "
                f"float32 (try it: `amp-doctor diagnose --fp32 {e.module or 'LAYER'} "
                "script.py`); bfloat16 holds such values.")
    if e.kind == "nonfinite_discarded" and e.data.get("off_graph"):
        return ("Nothing to do: these values are dropped and no gradient passes through "
                "them. If the run has a NaN/inf loss or skipped steps, the other findings "
                "name where those began.")
    if e.kind == "nonfinite_discarded" and e.data.get("grads_nonfinite"):
        # The gradients did go non-finite: "nothing to do" would not be true (review 54).
        where = f" in {F.layer(e.module)}" if e.module else ""
        return (f"Make the input of {e.op}{where} safe before the op rather than masking "
                "its output after: an epsilon the format holds (>= 1e-5 in float16), "
                "`x.clamp_min(eps)`, or the op in float32 (`with torch.autocast(device_type, "
                "enabled=False):` and `.float()`); a masked NaN still gives NaN gradients.")
    if e.kind == "lowp_updates_lost":
        # The weights' own format decides: bfloat16 weights are not told to move to float16.
        weights = e.data.get("dtypes") or []
        return (ADVICE_BF16 if weights == ["bfloat16"] else ADVICE)["lowp_updates_lost"]
    if (e.kind in ("nonfinite_forward", "activation_overflow") and e.op in DIVISION_OPS
            and _quotient_overflow(e.data)):
        # Not "add an epsilon" to a division by a constant the format holds (review 56a:
        # a contrastive loss's similarities over a temperature of 0.01).
        where = f" in {F.layer(e.module)}" if e.module else ""
        return (f"{e.op}{where} made inf from finite inputs, no divisor near 0: the "
                "quotient grew past the format's max (a large numerator over a small "
                "divisor, such as a temperature of 0.01). Make the numerator small first "
                "(`F.normalize` the embeddings before their similarities), or compute the "
                "division in float32 (`a.float() / t`, or `z.float() @ z.float().t() / t`)"
                + ("." if bf16 else ", or train with `dtype=torch.bfloat16`."))
    if (e.kind in ("nonfinite_forward", "activation_overflow") and e.op and op_fix
            and e.data.get("dtype") not in WIDE_FORMATS):
        where = f" in {F.layer(e.module)}" if e.module else ""
        f32 = ("" if "autocast" in op_fix or "in float32" in op_fix else " Or keep the op in "
               "float32 with `with torch.autocast(device_type, enabled=False):` around it and "
               "`.float()` inputs.")
        return (f"For {e.op}{where}: {op_fix}.{f32}"
                + ("" if bf16 else " Or train with `dtype=torch.bfloat16`."))
    if (e.kind in ("nonfinite_forward", "nonfinite_backward") and not op_fix
            and e.data.get("dtype") in WIDE_RANGE_FORMATS and isinstance(big, (int, float))
            and big >= DIVERGED_INPUT_ABSMAX):
        if e.step == 0:
            # Before any update: nothing has diverged yet.
            return (f"{e.op} went non-finite on {e.data.get('dtype')} values up to "
                    f"{big:.3g} at the first step, before any update: the data, a buffer or "
                    "the initialisation holds values that large, which no precision change "
                    "fixes. Find where they come from and scale or clamp them.")
        return (f"{e.op} went non-finite on {e.data.get('dtype')} values up to {big:.3g}, "
                "in a format with float32's range: the run diverged (weights or activations "
                "grew without bound), which no precision change fixes. Lower the learning "
                "rate or lengthen its warmup, clip gradients "
                "(`torch.nn.utils.clip_grad_norm_`), and skip an update whose gradient "
                "norm is not finite.")
    if (e.kind == "nonfinite_forward" and e.data.get("dtype") in WIDE_FORMATS
            and not inputs_held_inf(e.data)):
        # Made inf from finite inputs in float32: bfloat16 has the same range, float32 is
        # what it ran in; only bounding its inputs helps.
        return (f"{e.op} ran in float32 already, so neither float32 nor bfloat16 helps: its "
                "finite inputs make it non-finite in any precision. Bound them before the "
                "op (clamp the input of an exp, guard a division's denominator), or check "
                "the data that reaches it.")
    if e.kind == "nonfinite_backward" and zero_denominator(e.op, e.data):
        node = str(e.data.get("node") or "")
        fwd = e.data.get("forward_op")
        if denominator_dtype(e.data) == "float16":
            # The 0 may be float16's own: a value below its smallest subnormal (6e-8), such
            # as a softmax probability or an epsilon of 1e-12, is 0 there.
            log = (", use `torch.log_softmax` instead of `softmax(...).log()`"
                   if str(fwd).startswith("aten.log") else "")
            return (f"A division by exactly 0 in float16 in the backward of {fwd}: the "
                    "denominator is the forward op's input, and in float16 it may be a value "
                    "that underflowed to 0 (a float16 softmax's small probabilities, an "
                    "epsilon such as 1e-12, which float16 rounds to 0). Compute that input and "
                    "the op in float32 (`with torch.autocast(device_type, enabled=False):` "
                    f"and `.float()`){log}, or use an epsilon float16 holds (>= 1e-5) and "
                    "clamp the input away from 0 (`x.clamp_min(eps)`); bfloat16 keeps such "
                    "small values too.")
        what = ("the gradient of sqrt at 0 is infinite: take `torch.sqrt(x + eps)` or "
                "`x.clamp_min(eps).sqrt()`" if node.startswith("Sqrt") else
                "add an epsilon to the denominator, or clamp it away from 0, before the op")
        return (f"A division by exactly 0 in the backward of {fwd}: {what}. A wider "
                "format does not help here: the 0 is not an underflow of a narrow one.")
    if e.kind == "nonfinite_backward" and not e.module:
        return ("The gradient went non-finite where the loss is computed, outside the model: "
                "keep the loss O(1) (a mean rather than a sum reduction, targets normalised "
                "to unit scale), compute it in float32 (`loss_fn(out.float(), y.float())`), "
                "or start the GradScaler lower (`init_scale=...`).")
    if e.kind == "activation_overflow" and e.data.get("hidden"):
        return (f"Compute {e.op} in float32: wrap it in `with torch.autocast(device_type, "
                "enabled=False):` and cast its input with `.float()`"
                + (", or train with `dtype=torch.bfloat16`." if not bf16 else "."))
    if e.kind == "model_not_run" and e.data.get("compiled"):
        return advice_for("model_not_run_compiled", dtype)
    if e.kind == "clip_before_unscale" and e.data.get("measured_only"):
        return ("Nothing to fix in training. For the true gradient norm, call "
                "`scaler.unscale_(optimizer)` before measuring it, or divide the norm by "
                "`scaler.get_scale()`.")
    if e.kind == "no_step_boundary" and e.data.get("foreign_optimizers"):
        return advice_for("no_step_boundary_foreign", dtype)
    return advice_for(e.kind, dtype)


def unlocated_advice(every: int, cli: bool, raised: bool, scaler: bool) -> str:
    """How to locate a NaN/Inf that was seen but not located, in the way the run was
    started (``diagnose`` or ``watch()``), leaving out what it already did."""
    ways = []
    if every != 1:
        ways.append("record every step (" + ("`--every 1`" if cli else "`watch(model, every=1)`")
                    + ") so that the failing step's layer figures name the layer")
    if not raised:
        ways.append("check every op and stop at the one that made NaN/inf, with its line ("
                    + ("`--anomaly --on-nonfinite raise`" if cli else
                       "`watch(model, anomaly=True, on_nonfinite='raise')`") + ")")
    locate = " or ".join(ways)
    out = [locate[:1].upper() + locate[1:] + "."] if ways else []
    if not scaler:
        out.append(ADVICE["nonfinite_loss_poisoned_weights"])
    return " ".join(out) or ("Run the failing step again without torch.compile, so that "
                             "every op is checked one by one.")


def bf16_advice(f: Finding) -> Finding:
    """A bfloat16 run is never told to train in bfloat16 (but may be told to stay on it:
    the float16 what-if, which only a bfloat16 run gets)."""
    if "bfloat16" not in f.advice or f.kind in ("scaler_with_bf16", "whatif_float16"):
        return f
    adv = ADVICE_BF16.get(f.kind)
    if adv is None or f.op:
        # Op-specific advice: drop the sentence that proposes bfloat16.
        adv = " ".join(x for x in re.split(r"(?<=[.])\s+", f.advice)
                       if "bfloat16" not in x) or (adv or "")
    return replace(f, advice=adv)
