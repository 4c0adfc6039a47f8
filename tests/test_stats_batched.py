"""Batched summaries (stats.Batch) against one-tensor-at-a-time summaries and raw values."""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from amp_doctor.device import stats as S
from amp_doctor.device.recorder import StepBuffer, to_host
from amp_doctor.devicework import OWN_MODE_FLAG, own_ops


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out: list[torch.Tensor] = []
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    # Enough rows and samples to need several staging passes.
    for i in range(40):
        n = [7, 300, 5000, 40_000, 3 * S.SAMPLE_LIMIT + 11][i % 5]
        x = torch.randn(n, generator=g) * 10.0 ** ((i % 9) - 6)
        x[: n // 10] = 0
        out.append(x.to(dtypes[i % 4]))
    out[3][5] = math.nan
    out[6][1] = math.inf
    out[6][2] = -math.inf
    out[9][0] = -math.nan
    return out


def _one_by_one(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([S.summary_row(t) for t in ts])


def _assert_raw_figures(rows: torch.Tensor, ts: list[torch.Tensor]) -> None:
    """Each host row's extremes against the tensor's own, and its zeros against the
    tensor's where the sample is the whole tensor (the batched reductions are not
    checked against themselves only)."""
    for row, t in zip(rows.tolist(), ts, strict=True):
        v = t.double().reshape(-1)
        assert row[S.NUMEL] == v.numel()
        if v.isnan().any():
            assert math.isnan(row[S.MIN]) and math.isnan(row[S.MAX])
        else:
            assert (row[S.MIN], row[S.MAX]) == (v.min().item(), v.max().item())
        if v.numel() <= S.SAMPLE_LIMIT:
            assert row[S.ZEROS] == (v == 0).sum().item()
            # A signalling NaN is counted with the infs (see the module's docstring).
            quiet = v.isnan() & ((t.reshape(-1).view(torch.int32) & 0x400000) != 0
                                 if t.dtype == torch.float32 else True)
            assert row[S.NANS] == quiet.sum().item()


def test_a_batch_over_several_passes_equals_one_tensor_at_a_time() -> None:
    ts = _tensors()
    buf = StepBuffer(0)
    idx = [buf.add(t) for t in ts]
    assert idx == list(range(len(ts)))
    hs = buf.flush()
    total = sum(min(t.numel(), S.SAMPLE_LIMIT) for t in ts)
    assert total > 3 * S.STAGE_MIN  # really several passes
    torch.testing.assert_close(hs.matrix, _one_by_one(ts), rtol=0, atol=0, equal_nan=True)


def test_both_ways_of_offsetting_rows_and_a_released_stage_give_the_same_rows() -> None:
    # 60 tiny rows of alternating lengths make a pass of many short runs (summed
    # row-start steps), the long ones passes of few runs (one add per run, a run of
    # equal rows through a 2-D view); release() mid-step counts what is staged and
    # frees the stage, as before an optimizer step.
    ts = ([torch.full((5 + i % 2,), float(i) - 30.0) for i in range(60)] + _tensors()
          + [torch.randn(5000) * i for i in range(4)])
    b = S.Batch()
    for i, t in enumerate(ts):
        b.add(t)
        if i in (59, 70):
            b.release()
            assert b._stage is None
    rows = S.host_rows(b.finish(), b.numel, b.sampled)
    assert 60 * S._ROW_OP_NS > S._STEPS_FIXED_NS + 300 * S._STEPS_NS_PER_VALUE
    assert 3 * S._ROW_OP_NS < S._STEPS_FIXED_NS + 3 * S.SAMPLE_LIMIT * S._STEPS_NS_PER_VALUE
    torch.testing.assert_close(rows, _one_by_one(ts), rtol=0, atol=0, equal_nan=True)
    _assert_raw_figures(rows, ts)


def test_filing_many_at_once_equals_filing_one_at_a_time() -> None:
    # The parameters' gradients are filed together: small whole-sampled tensors by
    # one cat per pass and segment reductions, the rest one by one, in order, over
    # several passes and more rows than a pass holds, between single adds.
    g = torch.Generator().manual_seed(5)
    small = [torch.randn(n, generator=g).to(dt) for n, dt in zip(
        [1, 32, 1024, S.SAMPLE_LIMIT, 7, 96] * 100,
        [torch.float32, torch.float16, torch.bfloat16] * 200, strict=True)]
    small[4][:] = 0
    small[7][3] = math.nan
    small[8][0] = -math.inf
    small[9][1] = 1e-40  # a float32 subnormal: non-zero, in the histogram's bin 0
    odd = torch.randn(40, 6, generator=g)[:, ::2]  # not contiguous
    ts = _tensors()[:10] + small + [odd, torch.randn(4, dtype=torch.float64)] + small[:50]
    one = S.Batch()
    for t in ts:
        one.add(t)
    many = S.Batch()
    many.add(ts[0])
    rows = many.add_many(ts[1:-5])
    # Filed by size (each size's rows reduced as the lines of one 2-D view): every
    # row once, whatever order.
    assert sorted(rows) == list(range(1, len(ts) - 5))
    order = [0, *rows, *(many.add(t) for t in ts[-5:])]
    assert len(ts) > S.ROWS_PER_PASS
    assert [many.numel[r] for r in order] == one.numel
    assert [many.sampled[r] for r in order] == one.sampled
    a = S.host_rows(one.finish(), one.numel, one.sampled)
    b = S.host_rows(many.finish(), many.numel, many.sampled)[order]
    torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(b, _one_by_one(ts), rtol=0, atol=0, equal_nan=True)
    assert b[10 + 9, S.ZEROS].item() == 0 and b[10 + 4, S.ZEROS].item() == 7  # exact zeros
    _assert_raw_figures(b, ts)

    buf = StepBuffer(0)
    assert buf.add(ts[0]) == 0
    rows = buf.add_many(ts[1:4])
    assert sorted(rows) == [1, 2, 3]
    assert buf.add(ts[4]) == 4
    torch.testing.assert_close(buf.flush().matrix[[0, *rows, 4]], _one_by_one(ts[:5]),
                               rtol=0, atol=0, equal_nan=True)


def test_gradients_of_every_shape_and_layout_filed_at_once_give_their_own_rows() -> None:
    # add_many joins the gradients of one shape and dtype by one cat along their first
    # dimension, with no view per tensor: each tensor must still be one line of the
    # stage. Conv weights' gradients of a channels_last model (the join is channels_last
    # too), transposed ones, 0-d ones (a scalar parameter: stacked, cat needs a
    # dimension), 2-D ones, a gradient that requires grad (create_graph=True), float16
    # and bfloat16 ones beside float32 ones of the same shape.
    g = torch.Generator().manual_seed(9)
    conv = [torch.randn(8, 3, 3, 3, generator=g).to(memory_format=torch.channels_last)
            for _ in range(5)]
    conv[2][0, 1, 2, 0] = 0.0
    conv[3][7, 2, 0, 1] = math.nan
    plain = [torch.randn(8, 3, 3, 3, generator=g) for _ in range(3)]  # joined with conv
    mats = [torch.randn(6, 10, generator=g) * 10.0 ** i for i in range(4)]
    mats.append(torch.randn(10, 6, generator=g).t())  # shape (6, 10), not contiguous
    scalars = [torch.tensor(v) for v in (0.0, -2.5, 3e-8, math.inf)]
    low = [torch.randn(6, 10, generator=g).to(dt) for dt in
           (torch.float16, torch.bfloat16, torch.float16)]
    with torch.enable_grad():
        w = torch.randn(6, 10, generator=g, requires_grad=True)
        graphed = torch.autograd.grad((w * w).sum(), w, create_graph=True)[0]
    assert graphed.requires_grad
    ts = conv + plain + mats + scalars + low + [graphed] + conv[:2]
    many = S.Batch()
    rows = many.add_many(ts)
    assert sorted(rows) == list(range(len(ts)))
    assert [many.numel[r] for r in rows] == [t.numel() for t in ts]
    got = S.host_rows(many.finish(), many.numel, many.sampled)[rows]
    expected = _one_by_one([t.detach() for t in ts])
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    _assert_raw_figures(got, [t.detach() for t in ts])
    assert got[3, S.NANS].item() == 1 and got[2, S.ZEROS].item() == 1


def test_passes_of_mixed_lengths_and_formats_give_the_raw_figures() -> None:
    # Lengths sharing a divisor (a transformer's), runs of equal rows, many short rows of
    # two lengths; float16, float32 and bfloat16 rows in turn, a float32 subnormal, a
    # float64 value below float32's range, a signalling NaN: each row's extremes, zeros
    # and NaNs against the tensor's own.
    g = torch.Generator().manual_seed(11)
    for lengths in ([64, 128, 64, 192, 64] * 3, [300, 300, 7, 7, 7, 301], [5, 6] * 40):
        ts = []
        for i, n in enumerate(lengths):
            x = torch.randn(n, generator=g) * 10.0 ** (i % 7 - 3)
            x[i % n] = 0
            ts.append(x.to([torch.float16, torch.float32, torch.bfloat16][i % 3]))
        ts[1][2] = 1e-40  # float32 subnormal: non-zero, in code 0
        ts[2][0] = math.nan
        ts[3] = ts[3].double()
        ts[3][1] = 1e-300  # below float32's range: 0 in the stage, yet not a zero
        ts[4][1] = -math.inf
        ts[4].view(torch.int32)[0] = 0x7F800001  # a signalling NaN (float32): not a zero
        b = S.Batch()
        for t in ts:
            b.add(t)
        rows = S.host_rows(b.finish(), b.numel, b.sampled)
        _assert_raw_figures(rows, ts)
        torch.testing.assert_close(rows, _one_by_one(ts), rtol=0, atol=0, equal_nan=True)


def test_many_tiny_tensors_need_more_than_one_pass_of_rows() -> None:
    ts = [torch.full((3,), float(i)) for i in range(S.ROWS_PER_PASS + 5)]
    b = S.Batch()
    for t in ts:
        b.add(t)
    rows = b.finish()
    assert rows.shape == (len(ts), S.SUMMARY_LEN)
    assert rows[:, S.MIN].tolist() == [float(i) for i in range(len(ts))]
    assert rows[:, S.ZEROS].tolist() == [0.0] + [3.0] * (len(ts) - 1)  # non-zeros (sampled)


def test_the_device_histogram_path_gives_the_cpu_answer() -> None:
    # histc (CUDA: no host sync) and bincount (CPU) must count the same codes.
    ts = _tensors()
    a = S.stack_rows(ts, device_path=False)[0]
    b = S.stack_rows(ts, device_path=True)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    codes = torch.randint(0, 5000, (10_000,), dtype=torch.int32)
    assert torch.equal(S.exp_histogram(codes, 5000, device_path=True),
                       S.exp_histogram(codes, 5000, device_path=False))


def test_the_device_histogram_path_under_deterministic_algorithms() -> None:
    # A user's torch.use_deterministic_algorithms(True) makes CUDA's histc raise inside
    # the user's step; the device path then counts with index_add, to the same rows.
    ts = _tensors()
    expected = S.stack_rows(ts, device_path=False)[0]
    codes = torch.randint(0, 5000, (10_000,), dtype=torch.int32)
    was, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = S.stack_rows(ts, device_path=True)[0]
        counted = S.exp_histogram(codes, 5000, device_path=True)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(counted, torch.bincount(codes, minlength=5000))


def test_the_stage_is_a_share_of_what_the_step_has_filed() -> None:
    # A fixed 256 KB stage was +18% of a small model's whole peak memory.
    assert S.stage_size(0) == S.STAGE_MIN >= 4 * S.SAMPLE_LIMIT  # four samples at least
    assert S.stage_size(10 * 2**20) == S.STAGE_LIMIT
    mid = int(S.STAGE_MIN * 2 * 4 / S.STAGE_SHARE)
    assert S.stage_size(mid) == 2 * S.STAGE_MIN
    small = S.Batch()
    for _ in range(20):
        small.add(torch.randn(2000, dtype=torch.float16))
    assert small._stage is not None and small._stage.numel() == S.STAGE_MIN
    big = S.Batch()
    for t in _tensors() * 3:  # 9 MB: the stage grows, a pass at a time, as they are filed
        big.add(t)
    assert big._stage is not None and big._stage.numel() == S.STAGE_LIMIT



def test_a_recorded_step_starts_its_stage_at_the_size_the_last_one_reached() -> None:
    # A large model's stage used to start at one sample every step and reach its
    # full size only after about fifty early passes.
    filed: dict[torch.device, int] = {}
    first = StepBuffer(0, filed)
    for t in _tensors() * 12:  # 26 MB filed
        first.add(t)
    first.flush()
    assert filed[torch.device("cpu")] == sum(t.numel() * t.element_size()
                                             for t in _tensors() * 12) > 2**24
    second = StepBuffer(1, filed)
    second.add(torch.randn(100))
    stage = second._batches[torch.device("cpu")]._stage
    assert stage is not None and stage.numel() == S.STAGE_LIMIT
    # A small model's stage stays at its least size: its peak memory is the constraint.
    small: dict[torch.device, int] = {}
    for step in range(2):
        buf = StepBuffer(step, small)
        for _ in range(20):
            buf.add(torch.randn(2000, dtype=torch.float16))
        stage = buf._batches[torch.device("cpu")]._stage
        assert stage is not None and stage.numel() == S.STAGE_MIN
        buf.flush()
    assert small[torch.device("cpu")] == 20 * 2000 * 2

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_and_inf_counts_are_exact_for_small_tensors(dtype: torch.dtype) -> None:
    x = torch.tensor([1.0, math.nan, -math.nan, math.inf, -math.inf, -math.inf, 0.0, -0.0, 3e-5])
    row = S.summary_row(x.to(dtype))
    from amp_doctor.dtypes import limits

    d = S.decode(row.tolist(), limits(torch.float16))
    assert d.nan_count == 2 and d.inf_count == 3
    assert d.zero_frac == 2 / 9
    assert row[S.HIST:].sum().item() == 9
    assert row[S.HIST + 255].item() == 5  # inf and NaN share the top exponent bin


def test_mixed_dtypes_over_several_compacted_chunks_equal_one_tensor_at_a_time() -> None:
    # float16, bfloat16, float32 and float64 rows in every chunk of per-tensor results,
    # so each chunk and their concatenation promote dtypes as one stack would.
    ts = _tensors() * 4
    assert len(ts) > 2 * S.COMPACT_ROWS
    b = S.Batch()
    for t in ts:
        b.add(t)
    rows = S.host_rows(b.finish(), b.numel, b.sampled)
    torch.testing.assert_close(rows, _one_by_one(ts), rtol=0, atol=0, equal_nan=True)


def _live_tensors() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor)


def test_a_batch_holds_a_few_tensor_objects_not_one_per_row() -> None:
    # Per-row results kept as thousands of tensor objects through a step would survive
    # Python's young-generation collections and trigger full-heap collections.
    ts = [torch.full((4,), float(i), dtype=torch.float16) for i in range(1000)]
    gc.collect()
    before = _live_tensors()
    b = S.Batch()
    for t in ts:
        b.add(t)
    held = _live_tensors() - before
    assert held <= 3 * S.COMPACT_ROWS + 3 * (1000 // S.COMPACT_ROWS + 1) + 10, held
    rows = b.finish()
    assert rows[:, S.MAX].tolist() == [float(i) for i in range(1000)]


def test_whole_rows_of_alternating_lengths_hold_a_few_tensor_objects_too() -> None:
    # Their extremes come from the passes, a run of equal rows at a time: rows of
    # alternating lengths are a run each, and each pass keeps one tensor of them.
    ts = [torch.full((4 + 4 * (i % 2),), float(i), dtype=torch.float16) for i in range(1000)]
    gc.collect()
    before = _live_tensors()
    b = S.Batch()
    for t in ts:
        b.add(t)
    held = _live_tensors() - before
    assert held <= 3 * S.COMPACT_ROWS + 3 * (1000 // S.COMPACT_ROWS + 1) + 10, held
    rows = b.finish()
    assert rows[:, S.MIN].tolist() == rows[:, S.MAX].tolist() == [float(i) for i in range(1000)]


def test_a_summary_keeps_no_reference_to_the_tensor_once_added() -> None:
    buf = StepBuffer(0)
    x = torch.randn(64, 64).to(torch.bfloat16)
    ref = weakref.ref(x)
    buf.add(x)
    del x
    gc.collect()
    assert ref() is None
    hs = buf.flush()
    assert hs.matrix.shape == (1, S.SUMMARY_LEN) and hs.matrix[0, S.NUMEL].item() == 4096


def test_scalars_ride_along_in_the_single_copy() -> None:
    buf = StepBuffer(0)
    buf.add(torch.ones(5))
    buf.put_scalar("loss", torch.tensor(2.5))
    buf.put_scalar("scale", torch.tensor([65536.0]))
    hs = buf.flush()
    assert hs.scalars == {"loss": 2.5, "scale": 65536.0}
    empty = StepBuffer(1).flush()
    assert empty.matrix.shape == (0, S.SUMMARY_LEN) and empty.scalars == {}


def test_to_host_keeps_a_cpu_tensor() -> None:
    t = torch.arange(4, dtype=torch.float64)
    assert to_host(t) is t


def test_decoding_many_rows_with_mixed_shifts_equals_one_row_at_a_time() -> None:
    """decode_table groups rows by their shift (one band sum per shift); values unchanged."""
    from amp_doctor.dtypes import limits

    ts = _tensors() * 3
    rows = S.host_rows(*S.stack_rows(ts))
    shifts = [(0, 3, 16)[i % 3] for i in range(len(ts))]
    for fmt in (limits(torch.float16), limits(torch.bfloat16)):
        whole = S.decode_table(rows, fmt, shifts)
        single = torch.cat([S.decode_table(rows[i : i + 1], fmt, shifts[i : i + 1])
                            for i in range(len(ts))])
        assert whole.shape == (len(ts), len(S.DECODED_FIELDS))
        # Band sums are dot products: equal up to the order of float64 additions.
        torch.testing.assert_close(whole, single, rtol=1e-12, atol=0, equal_nan=True)
        # The shifted rows really decode differently (the grouping is exercised).
        assert not torch.equal(whole[1].nan_to_num(), S.decode_table(
            rows[1:2], fmt, [0]).nan_to_num()[0])


def test_a_step_split_over_devices_comes_back_in_insertion_order() -> None:
    """The multi-device path of flush/unpack_host (a model split over GPUs), run on CPU:
    ``cpu`` and ``cpu:0`` are distinct batch keys, as ``cuda:0`` and ``cuda:1`` would be."""
    ts = _tensors()[:12]
    one = StepBuffer(0)
    for t in ts:
        one.add(t)
    one.put_scalar("loss", torch.tensor(1.5))
    expected = one.flush()
    split = StepBuffer(0)
    for i, t in enumerate(ts):
        dev = torch.device("cpu") if i % 3 else torch.device("cpu", 0)
        split._batches.setdefault(dev, S.Batch()).add(t)
        split._where.append(dev)
    split.put_scalar("loss", torch.tensor(1.5))
    got = split.flush()
    assert len(split._batches) == 0 and got.scalars == {"loss": 1.5}
    torch.testing.assert_close(got.matrix, expected.matrix, rtol=0, atol=0, equal_nan=True)


def test_merged_rows_are_the_summary_of_the_tensors_together() -> None:
    """A layer's parameter gradients (or repeated calls) file one row each; the merged
    row equals the summary of the concatenated tensors, NaN propagated."""
    from amp_doctor.device.recorder import merge_rows

    g = torch.Generator().manual_seed(1)
    a = torch.randn(300, generator=g) * 1e-3
    a[:30] = 0
    b = torch.randn(40, generator=g) * 5.0
    c = torch.tensor([1.0, math.nan, -7.0])
    rows = S.host_rows(*S.stack_rows([a, b, c]))
    merged = merge_rows(rows, [[0, 1], [1, 2], [2]])
    torch.testing.assert_close(merged[0], S.summary_row(torch.cat([a, b])), rtol=1e-12, atol=0)
    assert merged[1, S.MIN].isnan() and merged[1, S.MAX].isnan()
    assert merged[1, S.NUMEL].item() == 43 and merged[1, S.NANS].item() == 1
    torch.testing.assert_close(merged[2], rows[2], rtol=0, atol=0, equal_nan=True)


class _Sub(torch.Tensor):
    pass


class _NoOpFn(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _NoOpDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_a_plain_tensor_is_filed_outside_own_ops_and_the_rest_inside(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # own_ops costs a few microseconds a call, a third of filing a small tensor: a
    # plain tensor's own ops (aminmax) skip it while nothing of the user's could see
    # them; the pass, the new stage and the compaction (which make tensors, and would
    # meet autocast's promotions) are inside.
    x = torch.randn(8)
    assert not own_ops.needed_for(x)
    assert own_ops.needed_for(x.as_subclass(_Sub))
    with _NoOpFn():
        assert own_ops.needed_for(x)
    with _NoOpDispatch():
        assert own_ops.needed_for(x)
    with torch.device("meta"):  # a default device is a function mode
        assert own_ops.needed_for(x)

    entered: list[int] = []
    real_enter = type(own_ops).__enter__

    def counting_enter(self: Any) -> None:
        entered.append(1)
        real_enter(self)

    monkeypatch.setattr(type(own_ops), "__enter__", counting_enter)
    b = S.Batch()
    n = S.COMPACT_ROWS * 2 + 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(n):
            b.add(torch.full((64,), float(i)))
    assert 0 < len(entered) < n // 8  # the stage, a compaction per COMPACT_ROWS, the pass
    assert b.finish()[:, S.MAX].tolist() == [float(i) for i in range(n)]


def test_the_users_modes_see_none_of_filing_and_amp_doctors_own_sees_it_inside_own_ops(
        ) -> None:
    # Anomaly mode's dispatch mode tells amp-doctor's ops from the user's by own_ops;
    # a mode of the user's (a FLOP counter) must not see them at all.
    flags: list[bool] = []
    users: list[str] = []

    class Ours(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            flags.append(own_ops.active())
            return func(*args, **(kwargs or {}))

    setattr(Ours, OWN_MODE_FLAG, True)

    class Users(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            users.append(str(func))
            return func(*args, **(kwargs or {}))

    b = S.Batch()
    x = torch.randn(100)
    with Ours(), Users():
        b.add(x)
        b.add(x * 2)
    assert users == ["aten.mul.Tensor"]
    assert len(flags) > 2 and flags.count(False) == 1  # only x * 2
    assert torch._C._len_torch_dispatch_stack() == 0


def _aten_counts(fn: Any) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


def test_a_whole_sampled_tensor_gets_its_exact_extremes_from_its_pass_not_its_own_op() -> None:
    # Issue 15: ops per tensor are kernel launches on a GPU. A tensor the stage holds
    # whole (at most SAMPLE_LIMIT values, exact in float32) has its min and max taken
    # there, by one amin and one amax per run of rows of one length in each pass. A
    # sampled tensor, and a float64 one (its stage copy is clamped), keep their own
    # aminmax, also beside whole ones of the same length in one run.
    g = torch.Generator().manual_seed(5)
    whole = [torch.randn(S.SAMPLE_LIMIT, generator=g).to(torch.float16) * (i + 1)
             for i in range(60)]
    whole[7][11] = math.nan
    whole[9][0] = -math.inf
    sampled = [torch.randn(5 * S.SAMPLE_LIMIT, generator=g) for _ in range(6)]
    wide = [torch.randn(S.SAMPLE_LIMIT, generator=g, dtype=torch.float64) * 1e300
            for _ in range(4)]
    ts = whole[:20] + sampled[:3] + whole[20:40] + wide + whole[40:] + sampled[3:]
    batch = S.Batch()
    counts = _aten_counts(lambda: [batch.add(t) for t in ts])
    rows = batch.finish()
    assert counts.get("aten::aminmax", 0) == len(sampled) + len(wide)
    assert counts["aten::amin"] == counts["aten::amax"] <= counts["aten::bincount"] + 4
    assert counts["aten::amin"] < len(whole) // 2
    _assert_raw_figures(S.host_rows(rows, batch.numel, batch.sampled), ts)
    assert math.isnan(rows[7, S.MIN].item()) and rows[9, S.MIN].item() == -math.inf
    assert rows[43, S.MAX].item() == wide[0].max().item()  # beside whole rows of its length
