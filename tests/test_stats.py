"""The on-device summary against figures computed directly from the tensor."""

from __future__ import annotations

import math

import pytest
import torch

from amp_doctor.device import stats as S
from amp_doctor.dtypes import limits

F16 = limits(torch.float16)
BF16 = limits(torch.bfloat16)


def _reference(x: torch.Tensor, fmt_max: float, normal: float) -> dict[str, float]:
    """Fractions straight from the values, in float64 on the host."""
    v = x.detach().double().reshape(-1)
    a = v.abs()
    n = v.numel()
    finite = torch.isfinite(v)
    return {
        "zero": float((v == 0).sum()) / n,
        "nonfinite": float((~finite).sum()) / n,
        "over": float((a > fmt_max).sum() - torch.isnan(v).sum()) / n,
        "under": float(((a > 0) & (a < normal)).sum()) / n,
        "min": float(v.min()),
        "max": float(v.max()),
    }


def _decoded(x: torch.Tensor, fmt: S.FormatLimits) -> S.Decoded:  # type: ignore[name-defined]
    return S.decode(S.summary_row(x).tolist(), fmt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_small_tensors_are_summarised_exactly(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 50, generator=g) * torch.logspace(-9, 5, 50)).to(dtype)
    x[0, :7] = 0
    x[1, 3] = 2e-7 if dtype != torch.bfloat16 else 1e-10
    assert x.numel() <= S.SAMPLE_LIMIT
    for fmt in (F16, BF16):
        d = _decoded(x, fmt)
        ref = _reference(x, fmt.max, fmt.smallest_normal)
        assert d.numel == x.numel()
        assert d.zero_frac == ref["zero"]
        assert d.overflow_frac == ref["over"]
        assert d.underflow_frac == ref["under"]
        assert (d.min, d.max) == (ref["min"], ref["max"])
        assert d.nonfinite_frac == ref["nonfinite"]


def test_large_tensors_are_sampled_but_extremes_and_nonfinite_presence_are_exact() -> None:
    g = torch.Generator().manual_seed(1)
    # Channel-dependent magnitudes: a sample that aliased with the channel
    # dimension would see only some of them.
    x = torch.randn(64, 32, 24, 24, generator=g) * torch.logspace(-10, 2, 32).view(1, 32, 1, 1)
    x = x.to(torch.bfloat16)
    lone_nan = x.clone()
    lone_nan[17, 5, 3, 9] = math.nan
    lone_inf = x.clone()
    lone_inf[63, 31, 23, 22] = -math.inf
    assert x.numel() > 50 * S.SAMPLE_LIMIT
    d = _decoded(x, F16)
    ref = _reference(x, F16.max, F16.smallest_normal)
    assert d.numel == x.numel()
    assert (d.min, d.max) == (ref["min"], ref["max"])
    assert ref["under"] > 0.1
    # Standard error of a sampled fraction is at most 0.4 points: allow 4 of them.
    assert abs(d.underflow_frac - ref["under"]) < 0.016
    assert abs(sum(_summary_hist(x)) - x.numel()) < 1e-6 * x.numel()

    dn = _decoded(lone_nan, F16)
    assert dn.nan_count >= 1 and dn.nonfinite_frac > 0 and dn.inf_count == 0
    di = _decoded(lone_inf, F16)
    assert di.inf_count >= 1 and di.overflow_frac > 0 and di.absmax == math.inf


def _summary_hist(x: torch.Tensor) -> list[float]:
    return S.summary_row(x)[S.HIST:].tolist()


def test_sample_stride_is_a_prime_that_divides_no_dimension() -> None:
    assert S.sample_stride(1000, (10, 100)) == 1
    for shape in [(128, 16, 16, 16), (64, 3, 224, 224), (4096, 1024), (77, 13, 1000)]:
        n = math.prod(shape)
        p = S.sample_stride(n, shape)
        assert all(p % k for k in range(2, p)) and p > 1
        assert all(s % p for s in shape)
        assert -(-n // p) <= S.SAMPLE_LIMIT


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced"])
def test_non_contiguous_layouts_give_the_contiguous_answer(layout: str) -> None:
    g = torch.Generator().manual_seed(2)
    # Whole-sampled: a larger tensor is sampled in memory order, whatever its layout.
    x = torch.randn(8, 6, 8, 8, generator=g) * 1e-6
    assert x.numel() <= S.SAMPLE_LIMIT
    if layout == "channels_last":
        y = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        y = x.transpose(1, 3)
    else:
        y = x[:, ::2]
    ref = y.contiguous()
    assert not y.is_contiguous()
    assert torch.equal(S.summary_row(y), S.summary_row(ref))


def test_an_all_nan_tensor_and_an_overflowing_float16_tensor() -> None:
    nan = torch.full((100,), math.nan)
    d = _decoded(nan, F16)
    assert d.nonfinite_frac == 1 and d.nan_count == 100 and d.inf_count == 0
    big = torch.tensor([1.0, 65504.0, 70000.0, math.inf])
    d = _decoded(big, F16)
    assert d.overflow_frac == 0.5  # 70000 and inf; the max itself fits
    assert _decoded(big, BF16).overflow_frac == 0.25  # only inf


def test_the_absmax_of_nan_and_zeros_is_zero_not_the_smallest_bin() -> None:
    # A NaN gradient's absmax falls back to the top populated finite bin; bin 0 holds the
    # zeros too, which made it 2**-126 (and 142 bits of headroom) for NaN and zeros.
    d = _decoded(torch.tensor([math.nan, 0.0, 0.0, -0.0]), F16)
    assert d.absmax == 0.0 and d.headroom == math.inf
    assert _decoded(torch.tensor([math.nan, 0.0, 1e-40]), F16).absmax == 2.0 ** -126
    assert _decoded(torch.tensor([math.nan, 0.0, 0.5]), F16).absmax == 1.0


@pytest.mark.parametrize("n", [12_301, 100_000, 1_000_003])
def test_a_sampled_tensor_of_nan_and_zeros_has_no_absmax_and_no_underflow(n: int) -> None:
    """Review 54: a sampled gradient of zeros and NaN read absmax 2**-126 and 142 bits of
    headroom (and an FP8 amax spread of 132 bits): its zero count is rounded to a whole
    number, bin 0 (the zeros, scaled) was not, and the difference read as a subnormal."""
    x = torch.zeros(n, dtype=torch.float16)
    x[::4] = math.nan
    d = _decoded(x, F16)
    assert d.absmax == 0.0 and d.headroom == math.inf
    assert d.underflow_frac == 0.0 and 0.74 < d.zero_frac < 0.76
    # A sampled tensor with real subnormals still has them.
    y = torch.zeros(n)
    y[::3] = 1e-40
    y[1] = math.nan
    dy = _decoded(y, F16)
    assert dy.absmax == 2.0 ** -126 and dy.underflow_frac > 0.3


def test_the_torch_free_format_names_and_maxima_agree_with_torch() -> None:
    from amp_doctor import dtypes

    assert dtypes.LOW_PRECISION_NAMES == {dtypes.dtype_name(d)
                                          for d in dtypes.LOW_PRECISION_DTYPES}
    for name, fmax in dtypes.FORMAT_MAX.items():
        assert fmax == torch.finfo(dtypes.parse_dtype(name)).max
