"""The whole-step tensor forms of a recorded step (StepTable) and of the run-long
per-layer aggregates (LayerAggregates) against the per-layer Python they replace:
the same rankings and the same figures, bit for bit, on steps with absent tensors,
NaN headrooms, inf extremes and non-finite values."""

from __future__ import annotations

import gc
import heapq
import math
import pickle
import random
from collections.abc import Callable

from amp_doctor.records import LayerStep, StepRecord, TensorStats
from amp_doctor.steps.aggregates import LayerAggregates
from amp_doctor.steps.history import History
from amp_doctor.steps.table import ACT, GRAD, SLOTS, StepTable


def _ts(rng: random.Random) -> TensorStats | None:
    if rng.random() < 0.2:
        return None
    absmax = rng.choice([0.0, rng.uniform(1e-3, 1e5), math.inf, math.nan])
    head = (math.nan if math.isnan(absmax) else math.inf if absmax == 0
            else -math.inf if absmax == math.inf else math.log2(65504 / absmax))
    return TensorStats(
        numel=rng.randint(1, 10_000), min=rng.choice([-absmax, -1.0, math.nan]),
        max=rng.choice([absmax, 2.0, math.nan]), absmax=absmax,
        zero_frac=rng.random(), nonfinite_frac=rng.choice([0.0, 0.0, 0.25]),
        overflow_frac=rng.choice([0.0, 0.0, rng.random() / 10]),
        underflow_frac=rng.random(), headroom=head)


def _steps(seed: int, n_steps: int = 6, n_layers: int = 60) -> list[dict[str, LayerStep]]:
    rng = random.Random(seed)
    names = [f"blocks.{i}.fc" for i in range(n_layers)]
    out = []
    for _ in range(n_steps):
        # Layers come and go (a branch not taken, a second model joining).
        present = [n for n in names if rng.random() < 0.8]
        out.append({n: LayerStep(*(_ts(rng) for _ in SLOTS)) for n in present})
        out[-1] = {n: ls for n, ls in out[-1].items() if any(getattr(ls, f) for f in SLOTS)}
        # A layer with no output of its own (a loss module's input gradient only).
        out[-1]["loss_fn"] = LayerStep(grad=_ts(rng) or _ts(random.Random(1)))
    return out


def _reference_risk_key(ls: LayerStep) -> tuple[float, float, float, float]:
    nonfinite = over = under = 0.0
    head = math.inf
    for t in (ls.act, ls.grad, ls.param_grad_unscaled or ls.param_grad):
        if t is None:
            continue
        nonfinite = max(nonfinite, t.nonfinite_frac)
        over = max(over, t.overflow_frac)
        under = max(under, t.underflow_frac)
        if not math.isnan(t.headroom):
            head = min(head, t.headroom)
    return (-float(nonfinite > 0), -over, head, -under)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def test_a_table_reads_back_the_records_it_was_made_of_and_ranks_them_as_python_does() -> None:
    for seed in range(5):
        for layers in _steps(seed):
            table = StepTable.from_layers(layers)
            assert list(table) == list(layers) and len(table) == len(layers)
            for name, ls in layers.items():
                got = table[name]
                for f in SLOTS:
                    a, b = getattr(got, f), getattr(ls, f)
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert all(_same(x, y) for x, y in zip(
                            a.__dict__.values(), b.__dict__.values(), strict=True))
            for limit in (1, 7, 32, 100):
                want = heapq.nsmallest(limit, layers.items(),
                                       key=lambda kv: _reference_risk_key(kv[1]))
                assert [table.names[i] for i in table.worst(limit)] == \
                    [n for n in layers if n in {k for k, _ in want}]
            flagged = [n for n, ls in layers.items() if any(
                t is not None and (t.nonfinite_frac > 0 or t.overflow_frac > 0)
                for t in (ls.act, ls.grad))]
            assert table.where(table.flagged((ACT, GRAD))) == flagged


def _same_layer(got: LayerStep, want: LayerStep) -> bool:
    for f in SLOTS:
        a, b = getattr(got, f), getattr(want, f)
        if (a is None) != (b is None):
            return False
        if a is not None and not all(_same(x, y) for x, y in zip(
                a.__dict__.values(), b.__dict__.values(), strict=True)):
            return False
    return True


def test_kept_layers_read_back_as_the_records_they_were_made_of() -> None:
    for seed in range(3):
        for layers in _steps(seed):
            table = StepTable.from_layers(layers)
            rows = table.worst(7)
            kept = table.keep(rows)
            names = [table.names[i] for i in rows]
            assert list(kept) == names and len(kept) == len(names)
            assert all(n in kept for n in names) and "nope" not in kept
            for n in names:
                assert _same_layer(kept[n], layers[n])
                assert kept[n] is kept[n]  # made once
            again = pickle.loads(pickle.dumps(kept))
            assert list(again) == names and all(_same_layer(again[n], layers[n]) for n in names)


def test_a_full_history_holds_no_records_until_read() -> None:
    """512 rows of 32 layers as records were about 77,000 objects for every full
    garbage collection to sweep; packed, a row is a few."""
    steps = _steps(7, n_steps=2, n_layers=60)
    gc.collect()
    before = len(gc.get_objects())
    h = History()
    for i in range(600):
        h.add(StepRecord(step=i, loss=1.0, scale=None, skipped=False,
                         layers=StepTable.from_layers(steps[i % 2])))
    gc.collect()
    assert len(h.records) <= 512
    assert len(gc.get_objects()) - before < 10 * len(h.records)
    row = h.records[-1]
    want = steps[row.step % 2]
    assert row.dropped_layers == len(want) - 32 and len(row.layers) == 32
    for n, ls in row.layers.items():
        assert _same_layer(ls, want[n])


def _reference_summary(steps: list[dict[str, LayerStep]], name: str) -> dict[str, object]:
    """The per-layer figures as documented in records.LayerSummary, one step at a time."""
    seen = [s[name] for s in steps if name in s]

    def vals(get: object) -> list[float]:
        out = []
        for ls in seen:
            v = get(ls)  # type: ignore[operator]
            if v is not None and not math.isnan(v):
                out.append(v)
        return out

    def mean(get: object) -> float | None:
        total, n = 0.0, 0
        for v in vals(get):
            total += v
            n += 1
        return total / n if n else None

    def pu(ls: LayerStep) -> TensorStats | None:
        return ls.param_grad_unscaled or ls.param_grad

    def gu(ls: LayerStep) -> TensorStats | None:
        return ls.grad_unscaled or ls.grad

    def fld(slot: object, f: str) -> object:
        return lambda ls: None if slot(ls) is None else getattr(slot(ls), f)  # type: ignore

    act, grad, pg = (lambda ls: ls.act), (lambda ls: ls.grad), (lambda ls: ls.param_grad)
    def held_nan(ls: LayerStep, slot: object) -> bool:
        # Its absmax and headroom are the histogram's bound, not exact (aminmax gave NaN).
        t = slot(ls)  # type: ignore[operator]
        return t is not None and (math.isnan(t.min) or math.isnan(t.max))

    def exact_first(get: object, slot: object,
                    keep: Callable[[float], bool] = lambda v: True) -> list[float]:
        """The values of the steps whose tensor held no NaN, or, if none has one, all."""
        def ok(v: float | None) -> bool:
            return v is not None and not math.isnan(v) and keep(v)
        values = [(get(ls), held_nan(ls, slot)) for ls in seen]  # type: ignore[operator]
        exact = [v for v, bound in values if not bound and ok(v)]
        return exact or [v for v, _ in values if ok(v)]

    g_abs = exact_first(fld(grad, "absmax"), grad, lambda v: math.isfinite(v) and v > 0)
    g_abs = g_abs or [v for v in vals(fld(grad, "absmax")) if math.isfinite(v)]
    p_abs = [v for v in vals(fld(pu, "absmax")) if math.isfinite(v)]
    g_head = exact_first(fld(grad, "headroom"), grad, lambda v: v != math.inf)
    g_head = g_head or vals(fld(grad, "headroom"))
    a_abs = exact_first(fld(act, "absmax"), act, lambda v: v > 0)
    a_head = exact_first(fld(act, "headroom"), act, lambda v: v != math.inf)
    # The steps it ran in (had an output); a layer that never had one: every step it is in.
    ran = sum(1 for ls in seen if ls.act is not None)
    return dict(
        recorded_steps=ran or len(seen),
        absmax=max([0.0, *a_abs]),
        min=min([math.inf, *vals(fld(act, "min"))]),
        max=max([-math.inf, *vals(fld(act, "max"))]),
        headroom=min([math.inf, *a_head]),
        zero_frac=mean(fld(act, "zero_frac")) or 0.0,
        overflow_frac=max([0.0, *vals(fld(act, "overflow_frac"))]),
        underflow_frac=mean(fld(act, "underflow_frac")) or 0.0,
        nonfinite_steps=sum(1 for ls in seen if ls.act and ls.act.nonfinite_frac > 0),
        grad_absmax=max(g_abs + [0.0]) if g_abs else None,
        grad_headroom=min(g_head) if g_head else None,
        grad_zero_frac=mean(fld(grad, "zero_frac")),
        grad_underflow_frac=mean(fld(grad, "underflow_frac")),
        grad_underflow_frac_unscaled=mean(fld(gu, "underflow_frac")),
        grad_nonfinite_steps=sum(1 for ls in seen if ls.grad and ls.grad.nonfinite_frac > 0),
        param_grad_absmax=max(p_abs + [0.0]) if p_abs else None,
        param_grad_zero_frac=mean(fld(pg, "zero_frac")),
        param_grad_underflow_frac=mean(fld(pg, "underflow_frac")),
        param_grad_underflow_frac_unscaled=mean(fld(pu, "underflow_frac")),
        param_grad_nonfinite_steps=sum(
            1 for ls in seen if ls.param_grad and ls.param_grad.nonfinite_frac > 0),
    )


def test_run_long_aggregates_equal_the_per_layer_figures_step_by_step() -> None:
    for seed in range(4):
        steps = _steps(seed, n_steps=8)
        agg = LayerAggregates()
        for layers in steps:
            agg.add(StepTable.from_layers(layers))
        agg.note_origin("blocks.3.fc")
        agg.note_origin("blocks.3.fc")
        names = {n for s in steps for n in s}
        assert len(agg) == len(names)
        for name in sorted(names):
            s = agg.summary(name, "Linear", 0, 1, set(), {"float16"}, set(), {}, ([], []))
            want = _reference_summary(steps, name)
            for k, v in want.items():
                assert _same(getattr(s, k), v), (seed, name, k, getattr(s, k), v)
            assert s.overflow_origin_steps == (2 if name == "blocks.3.fc" else 0)
        never = agg.summary("never.ran", "Linear", 0, 1, set(), set(), set(), {}, ([], []))
        assert never.recorded_steps == 0 and math.isnan(never.min) and never.grad_absmax is None
