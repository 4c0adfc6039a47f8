"""The acceptance table: what amp-doctor must find in each sample script.

``EXPECTED`` maps a script's file name (in ``sample_models/``) to a tuple of
findings, each ``(kind, module, op)``:

* ``kind``: one of ``KINDS``.
* ``module``: the qualified name as given by ``model.named_modules()`` of the
  model the script trains (relative to that model, no prefix), or ``None``
  when the finding is not about a module or the module is not asserted.
* ``op``: the aten op name (``"aten.log"``, overload dropped) for op-level
  findings, which need amp-doctor's anomaly/op mode; ``None`` otherwise.

Semantics: every listed finding must be reported. Other warnings and infos
are allowed (e.g. ``missing_scaler`` also on ``body.4``), but not other
errors: every finding of severity error must match a listed finding, and
each listed finding accounts for at most one error (one error per root
cause; follow-on effects belong in the origin's finding). A script mapped to
``()`` is healthy: amp-doctor must report no finding of severity warning or
error for it.

Each sample's docstring explains the pathology and what it prints when run
plainly; ``tests/test_samples_plain.py`` checks that the pathology happens.
"""

from __future__ import annotations

KINDS: tuple[str, ...] = (
    "activation_overflow",
    "activation_underflow",
    "gradient_underflow",
    "nonfinite_forward",
    "nonfinite_backward",
    "scaler_backoff",
    "scale_collapse",
    "clip_before_unscale",
    "scaler_with_bf16",
    "fp16_params",
    "missing_scaler",
)

Finding = tuple[str, str | None, str | None]

EXPECTED: dict[str, tuple[Finding, ...]] = {
    # Textbook float16 CNN recipe; scale stays 65536.
    "healthy_cnn.py": (),
    # 2-layer causal transformer LM, -inf causal mask, float16 + GradScaler.
    "healthy_transformer.py": (),
    # loss / accum, scale every micro-step, unscale_ before clipping.
    "grad_accumulation.py": (),
    "fp16_activation_overflow.py": (
        # proj's float16 output: ~28% of values beyond 65504 -> inf (fp32 max ~3e5).
        ("activation_overflow", "proj", None),
        # NaN loss every step -> every layer's grads are NaN; culprit not asserted.
        ("scaler_backoff", None, None),
        # 12 backoffs in a row: 65536 -> 16.
        ("scale_collapse", None, None),
    ),
    "hidden_op_overflow.py": (
        # Op mode: torch.pow(x, 3.0) is inf inside TanhGELU; the module's output is finite.
        ("activation_overflow", "mlp.act", "aten.pow"),
        # Anomaly mode: PowBackward0 computes 0 * inf = NaN inside mlp.act.
        ("nonfinite_backward", "mlp.act", None),
        # Only mlp.fc1's parameter grads are NaN; every step backs off.
        ("scaler_backoff", None, None),
        # 12 backoffs in a row: 65536 -> 16.
        ("scale_collapse", None, None),
    ),
    "gradient_underflow_no_scaler.py": (
        # The error: the gradient underflows in head's backward (99% of its output gradient
        # below float16's smallest normal) and reaches body.0 as exact zeros in every step:
        # body.0 does not train. One cause, one error, at head, listing body.0.
        ("missing_scaler", "head", None),
        # 100% of body.0's weight-grad entries are exactly 0 in float16 (0% in float32).
        ("missing_scaler", "body.0", None),
        # Same for body.2 (~98-100%).
        ("missing_scaler", "body.2", None),
    ),
    "gradient_underflow_low_init_scale.py": (
        # GradScaler(init_scale=1.0) lifts nothing: the same flush, the same error at head.
        ("gradient_underflow", "head", None),
        # body.0's grads still 100% zero; scale stays 1.
        ("gradient_underflow", "body.0", None),
        # Same for body.2.
        ("gradient_underflow", "body.2", None),
    ),
    "activation_underflow.py": (
        # In-place LayerScale(1e-6): ~99% of float16 outputs below 6.1e-5, some flushed to 0.
        ("activation_underflow", "blocks.0.ls", None),
        # Same in the second block.
        ("activation_underflow", "blocks.1.ls", None),
    ),
    "log_of_underflowed_softmax.py": (
        # Op mode: float16 softmax probs underflow to 0, torch.log gives -inf (not an overflow).
        ("nonfinite_forward", "head", "aten.log"),
        # inf loss, NaN grads every step.
        ("scaler_backoff", None, None),
        # 12 backoffs in a row: 65536 -> 16.
        ("scale_collapse", None, None),
    ),
    "eps_underflow.py": (
        # Op mode: var + 1e-8 == 0 in float16 for dead channels, then 0 / 0 = NaN.
        ("nonfinite_forward", "norm", "aten.div"),
        # NaN loss every step.
        ("scaler_backoff", None, None),
        # 12 backoffs in a row: 65536 -> 16.
        ("scale_collapse", None, None),
    ),
    "clip_before_unscale.py": (
        # clip_grad_norm_ right after scaler.scale(loss).backward(), no unscale_.
        ("clip_before_unscale", None, None),
    ),
    "scale_collapse.py": (
        # 20 backoffs in a row, final scale 0.0625 < 1; head's grads are inf at every scale.
        ("scale_collapse", "head", None),
        # First culprit in backward order: head.
        ("scaler_backoff", "head", None),
    ),
    "bf16_with_scaler.py": (
        # Enabled GradScaler under bfloat16 autocast (info).
        ("scaler_with_bf16", None, None),
    ),
    "half_params_with_scaler.py": (
        # model.half() + GradScaler: scaler.step raises "Attempting to unscale FP16 gradients.".
        ("fp16_params", None, None),
    ),
}
