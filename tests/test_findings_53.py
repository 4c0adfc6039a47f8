"""Session 53: what a report says of a run whose scale fell in interleaved episodes."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import amp_doctor
from amp_doctor import format as fmt


def _house_prices(steps: int) -> amp_doctor.Session:
    """Review 52a (s2): a price regressor on raw targets (1e5..6e5 dollars) in float16.
    The head's output passes 65504; the scale falls in episodes whose gradients went
    non-finite in every layer, and between them in the head's alone."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n = 4096
    sqft = torch.empty(n).uniform_(500, 4500, generator=g)
    rooms = torch.randint(1, 7, (n,), generator=g).float()
    age = torch.empty(n).uniform_(0, 80, generator=g)
    dist = torch.empty(n).exponential_(0.2, generator=g)
    price = (40_000 + 110 * sqft + 12_000 * rooms - 900 * age - 6_000 * dist
             + 15_000 * torch.randn(n, generator=g))
    x = torch.stack([sqft, rooms, age, dist], dim=1)
    x = (x - x.mean(0)) / x.std(0)
    y = price.clamp(min=50_000).unsqueeze(1)
    model = nn.Sequential(nn.Linear(4, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(),
                          nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    with amp_doctor.watch(model, tensorboard=False) as doctor:
        for step in range(steps):
            idx = order[(step * 128) % n:][:128]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x[idx]).float(), y[idx])
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert doctor.session is not None
    return doctor.session


def test_backoffs_folded_into_one_error_are_one_fall_of_the_scale() -> None:
    # Two backoff findings (told apart by the layers whose gradients went non-finite)
    # folded into the head's error read as two overlapping falls: "142x (65536 ->
    # 2^-134)" beside "8x (0.0625 -> 2^-12)". One GradScaler, one fall.
    s = _house_prices(192)
    backoffs = [f for f in s.findings if f.kind == "scaler_backoff"]
    assert len(backoffs) == 2 and {f.data.get("follow_on_of") for f in backoffs} == {"4"}
    (err,) = [f for f in s.findings if f.severity == "error"]
    assert (err.kind, err.module) == ("activation_overflow", "4")
    said = [c for c in err.data["consequences"] if c.startswith("GradScaler backed off")]
    total = sum(int(f.data["backoffs"]) for f in backoffs)
    assert s.scaler is not None and total == len(s.scaler.backoff_steps)
    lowest = min(float(f.data["scale_after"]) for f in backoffs)
    assert said == [f"GradScaler backed off {total}x and skipped that many optimizer steps "
                    f"(scale 65536 -> {fmt.scale(lowest)})"]


def test_a_sampled_tensor_without_zeros_has_a_zero_share_of_exactly_zero() -> None:
    # Its sample's zero count (0), scaled by n / sampled, left 1e-12 of a value behind:
    # charts of "share of outputs that are exactly zero" had an axis of 1e-16 (review 53).
    from amp_doctor.device import stats as S
    from amp_doctor.dtypes import limits

    torch.manual_seed(0)
    for shape in [(12301,), (12322,), (128, 67)]:  # n - k * (n / k) != 0 for the first two
        x = torch.randn(shape).half() + 8.0  # no zero
        row = S.summary_row(x)
        assert row[S.NUMEL].item() > S.SAMPLE_LIMIT and row[S.ZEROS].item() == 0.0
        assert S.decode(row.tolist(), limits(torch.float16)).zero_frac == 0.0
