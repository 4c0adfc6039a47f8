"""The named thresholds analysis judges a run by: every "too much" in one place.

Each constant says why it has its value. The detectors (``detect_*.py``), the
follow-on folding and the layer order read them from here.
"""

from __future__ import annotations

__all__ = [
    "ALL_ZERO_SHOWN",
    "LOSS_NOT_LARGE",
    "OUTPUT_LEVELS_ERROR",
    "OUTPUT_LEVELS_WARN",
    "OUTPUT_SPACING_MIN",
    "WARMUP_EATEN_OF_PEAK",
    "WARMUP_EATEN_RATIO",
    "OVERFLOW_FRAC_ERROR",
    "HEADROOM_WARN_BITS",
    "ACT_UNDERFLOW_WARN",
    "DIVERGED_LOSS_RISE",
    "STARVED_ZERO_FRAC",
    "PARTLY_ZEROED_FRAC",
    "ZEROS_OF_INPUT_RATIO",
    "SHRUNK_GRAD_BITS",
    "TREND_MIN_STEPS",
    "WHOLLY_NONFINITE_FRAC",
    "GRAD_RELEVANT_BITS",
    "ACT_RELEVANT_BITS",
    "GRAD_UNDERFLOW_WARN",
    "TINY_LOSS",
    "LARGE_LOSS",
    "GRAD_FLUSHED_WARN",
    "GRAD_ZEROS_SAID",
    "SCALE_COLLAPSE_MIN",
    "BACKOFF_SHARE_COLLAPSE",
    "BACKOFF_RUN_COLLAPSE",
    "SETTLING_BACKOFFS",
    "CALIBRATION_START",
    "CALIBRATED_MIN",
    "CALIBRATION_STEPS",
    "STUCK_INTERVALS",
    "SCALED_GRAD_OVERFLOW_INFO_STEPS",
    "MAX_PER_KIND",
    "RISK_HEADROOM_BITS",
    "LOWP_UNCHANGED_WARN",
    "MADE_INF_HEADROOM_BITS",
    "SCALED_GRAD_NEAR_MAX",
    "DIVERGED_INPUT_ABSMAX",
    "F16_SMALLEST_NORMAL",
    "DEFAULT_INIT_SCALE",
    "DEFAULT_GROWTH_INTERVAL",
]

# Any value beyond the format's max in a layer that ran in low precision is
# an inf in the user's forward pass.
OVERFLOW_FRAC_ERROR = 0.0
# Less than one bit of exponent left: the next larger batch can overflow.
HEADROOM_WARN_BITS = 1.0
# Share of an activation's values that flush to zero / lose precision.
ACT_UNDERFLOW_WARN = 0.05
# Share of a layer's gradient values that flush to zero in the low-precision format.
GRAD_UNDERFLOW_WARN = 0.10
# A loss whose median |value| over the recorded steps is below this, beside underflowing
# gradients, is named as their likely cause: every gradient starts from the loss, and a
# loss averaged over a dataset's size or weighted by 1e-8 starts them all that small.
TINY_LOSS = 1e-5
# ... and above this, beside the scale backing off: a loss summed over tokens or a batch
# instead of averaged (a mean cross-entropy is a few units) makes every gradient that many
# times larger, and the loss scale multiplies them further.
LARGE_LOSS = 100.0
# A layer whose outputs underflow (a LayerScale at 1e-6) shrinks the gradient on its way
# back by the same gain: the gradients of the layers before it at least this many bits
# below its own are its doing, and their underflow is its finding's consequence.
SHRUNK_GRAD_BITS = 8
# Recorded steps in each third of a run that tell whether a layer's underflow lasted or
# went as it trained (an adapter growing out of its zero initialisation).
TREND_MIN_STEPS = 2
# A layer whose weight gradients were at least this share exact zeros, flushed on their
# way back from a later layer, gets no update: it does not train (an error, not a warning).
STARVED_ZERO_FRAC = 0.999
# A layer with weights whose float16 output holds at least this share of exact zeros,
# from inputs with at most ZEROS_OF_INPUT_RATIO times as many, is partly zeroed (an op
# inside it overflowed and was divided by, row by row): an error (zeroed.py).
PARTLY_ZEROED_FRAC = 0.10
ZEROS_OF_INPUT_RATIO = 0.1
# The recorded loss rising more than this many times above its running minimum before
# its first non-finite value is a run diverging (a learning rate too high): its overflow
# is the divergence's end, not its cause (see analysis.divergence).
DIVERGED_LOSS_RISE = 10.0
# A layer whose output was at least this share non-finite in every step it went
# non-finite in: its finite values (of other steps) say nothing of the failing step's.
WHOLLY_NONFINITE_FRAC = 0.99
# An output gradient's float16 subnormals count toward its underflow only within this
# many bits of its largest value: backward sums each element into products with the
# others (a matmul), and a value 2**-24 below the largest term of a float32 sum is below
# its resolution. A confident classifier's wrong-class logit gradients (p < 1e-7) are
# such values: flushing every one of them changes nothing the optimizer sees. A
# parameter's gradient is the update of its own element and always counts.
GRAD_RELEVANT_BITS = 24
# A float16 output's subnormals count toward activation underflow only within this many
# bits of its largest |value|: the next op's result is rounded to float16 (11 significant
# bits), and a term more than 2**-11 below the largest cannot move it; 5 bits more of
# margin for sums of many such terms. GELU's negative tail (|x| < 6e-5 beside a max of
# 20) is such: flushing all of it changed the next layer's output 170x less than float16
# rounding does. A tensor that is small as a whole keeps every subnormal counted.
ACT_RELEVANT_BITS = 16
# Share of exact zeros in the output gradient of a layer that runs before (in
# forward order) one whose gradients underflow: they arrived flushed to zero.
GRAD_FLUSHED_WARN = 0.90
# A gradient underflow message also says the share of exact zeros from this much on.
GRAD_ZEROS_SAID = 0.01
# The scale has no business below 1: the loss is then scaled *down*.
SCALE_COLLAPSE_MIN = 1.0
# Backoffs in more than this share of steps (after calibration) is a collapse.
BACKOFF_SHARE_COLLAPSE = 0.2
# Or this many backoffs in a row.
BACKOFF_RUN_COLLAPSE = 5
# GradScaler starts at 2**16 and backs off until the scale fits: a short run of
# backoffs that starts in the first few steps is normal calibration, not a problem.
CALIBRATION_START = 3
# A first run of backoffs that ends above this scale is calibration however long it
# is: a high init_scale (Megatron-LM's 2**32) halves many times before it fits. It is
# where the default 2**16 ends after BACKOFF_RUN_COLLAPSE halvings.
CALIBRATED_MIN = 2.0 ** 16 / 2 ** BACKOFF_RUN_COLLAPSE
# GradScaler finds the largest scale the gradients allow by backing off: an episode of at
# most this many backoffs in a row that leaves the scale high (at or above
# CALIBRATED_MIN, or half the run's init_scale if that is lower) is the scale settling,
# after a noisy batch or a growth, not a problem. Values that needed more halvings in a
# row were far beyond float16's range; a scale that low leaves small gradients to
# underflow.
SETTLING_BACKOFFS = 2
# Backoffs in the first steps are not counted in the share of backoffs below.
CALIBRATION_STEPS = 20
# No growth across this many growth intervals means the scale is stuck.
STUCK_INTERVALS = 3
# Anomaly mode: a backward op whose float16 output overflowed to inf (no NaN)
# while a GradScaler was on is the scaler's own business, as long as it
# happens in at most this many steps (calibration); more is a warning.
SCALED_GRAD_OVERFLOW_INFO_STEPS = 3
# The model's output spans fewer than this many steps of its low-precision format (its
# range over its spacing, when it keeps one sign): fewer than 3 bits of resolution.
OUTPUT_LEVELS_WARN = 8.0
# Fewer than this: its values are rounded to one or two, and the model cannot learn what
# it must predict (an error, which `fix` and the next: lines act on).
OUTPUT_LEVELS_ERROR = 2.0
# ...and only where the format's spacing at the output is at least this: a finer rounding
# step is below what a normalised target asks of a prediction (review 56b: a deep MLP's
# output at initialisation, all near 0.09 where float16's spacing is 6e-5, is the model's
# collapse, not the format's rounding; its targets spread over 0.5).
OUTPUT_SPACING_MIN = 2.0**-7
# An LR schedule that rose by this factor over the steps the GradScaler skipped at the
# run's start ran its warmup while nothing trained, the first update coming at the raised
# LR (a warning, not info): a linear warmup's first 4 steps, or more. Not when the LR of
# the skips after it (growth probes) shows the schedule had far further to climb.
WARMUP_EATEN_RATIO = 4.0
# ... that is, when the start's highest LR is below this share of the later skips' LR.
WARMUP_EATEN_OF_PEAK = 0.5
# At most this many findings of one kind are itemised; the rest are counted.
MAX_PER_KIND = 8
# "Worst first": a layer within this many bits of the format's max ranks by its
# headroom, ahead of every layer that only has some underflow.
RISK_HEADROOM_BITS = 8.0
# Pure float16/bfloat16 training: when more than this share of the sampled weight
# elements that had a non-zero gradient did not change in the optimizer step, the
# updates are below the format's resolution.
LOWP_UNCHANGED_WARN = 0.5
# A float16 output with inf in it whose finite values all stay this many bits below the
# max did not overflow: values do not jump from 256x below the max to beyond it in one
# tensor. An op made the inf (log(0), x/0, exp of a large value).
MADE_INF_HEADROOM_BITS = 8.0
# Anomaly mode: a backward op that overflowed while the gradient it was given (its layer's
# scaled output gradient) was already within this factor of the format's max did not make
# the overflow: a matmul's backward adds up one term per token or sample, and more than 4
# same-signed terms this large pass the max whatever the layer's weights are (a summed
# cross-entropy at the default scale 2**16 sends ~3.2e4, within 2x). The scaled loss
# gradient is too large; two halvings of the scale are what such a gradient lacks to leave
# room for a sum. An op that turns a gradient 2**8 or more below the max into inf (huge
# weights, 1/x near 0) is the origin, as before.
SCALED_GRAD_NEAR_MAX = 4.0

# An op that ran in float32 and went non-finite on inputs this large: the values grew
# out of any sane range (diverging weights), which no precision change fixes.
DIVERGED_INPUT_ABSMAX = 1e15

# float16's smallest normal, 2**-14: below it a gradient loses precision or flushes.
F16_SMALLEST_NORMAL = 2.0 ** -14
# torch.amp.GradScaler's defaults, for a saved timeline that lacks them.
DEFAULT_INIT_SCALE = 65536.0
DEFAULT_GROWTH_INTERVAL = 2000
# A loss whose |value| stayed at most this in the recorded steps that backed off is no
# loss "too large for float16": its code's backward made the large gradient (binary
# cross-entropy of probabilities divides by p(1 - p)), not its size.
LOSS_NOT_LARGE = 10.0
# A layer whose gradient values were at least this share exact zeros is shown as flushed
# whole ("N% zero" in the text table's 'grad underflow' column, the top of the gradient
# underflow heatmap): no subnormal is left to count.
ALL_ZERO_SHOWN = 0.99
