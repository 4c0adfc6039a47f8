"""Session 55: a GradScaler updated after each of two optimizers (two backoffs in one
step), and the culprits of a step whose skip two optimizers report."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import amp_doctor
from amp_doctor.jsoncodec import from_jsonable, to_jsonable
from amp_doctor.records import Session
from amp_doctor.sinks.text import render_text
from tests.test_tensorboard import _load, _scalars


def _two_optimizers(update_each: bool, logdir: Path | None = None) -> Session:
    """Body and head with an optimizer each, one GradScaler; every gradient overflows in
    step 3 (the loss times 1e30). ``update_each``: ``scaler.update()`` after each
    ``scaler.step`` (the misuse), else once per iteration (the recipe)."""
    torch.manual_seed(0)
    body, head = nn.Linear(4, 4), nn.Linear(4, 2)
    model = nn.Sequential(body, head)
    opt_b = torch.optim.SGD(body.parameters(), lr=0.0)
    opt_h = torch.optim.SGD(head.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    with amp_doctor.watch(model, tensorboard=logdir is not None,
                          logdir=str(logdir) if logdir else None) as doctor:
        for step in range(6):
            x = torch.randn(8, 4)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = (out.float() * (1e30 if step == 3 else 1.0)).sum()
            opt_b.zero_grad()
            opt_h.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt_b)
            if update_each:
                scaler.update()
            scaler.step(opt_h)
            scaler.update()
    assert doctor.session is not None
    return doctor.session


def test_two_backoffs_in_one_step_are_counted_as_two(tmp_path: Path) -> None:
    # Review 54: with update() after each optimizer the scale halved twice in one
    # iteration (1024 -> 256), yet the report said "1 backoff", "each skipped one optimizer
    # step" and "1 skipped optimizer step", where both optimizers skipped.
    s = _two_optimizers(True, tmp_path)
    sc = s.scaler
    assert sc is not None
    assert sc.backoff_steps == [3]
    assert [(e.step, e.kind, e.count) for e in sc.events] == [(3, "backoff", 2)]
    assert sc.scale[-1] == (3, 256.0)
    assert sc.skipped_by_optimizer == {"SGD#0": [3], "SGD#1": [3]}
    text = " ".join(render_text(s).split())
    assert ("Scaler: scale 1024 -> 256; 2 backoffs in 1 step (step 3); 0 growths; "
            "2 skipped optimizer steps in 1 step (SGD#0 1, SGD#1 1).") in text
    (f,) = [f for f in s.findings if f.kind == "scaler_backoff"]
    assert f.message.startswith("GradScaler backed off 2x in 1 step at step 3: the scale fell "
                                "from 1024 to 256")
    assert f.data["backoffs"] == 2
    # The count survives the JSON report (``amp-doctor report`` renders it again).
    saved = json.loads(json.dumps(to_jsonable(s)))  # as the JSON report holds it
    assert [e["count"] for e in saved["scaler"]["events"]] == [2]
    again = from_jsonable(Session, saved)
    assert render_text(again) == render_text(s)
    assert [f.kind for f in s.findings if f.severity == "warning"][0] == "update_between_steps"
    # The dashboard's cumulative count, as the step happened.
    assert [v for st, v in _scalars(_load(tmp_path), "scaler/backoffs") if st >= 3][0] == 2.0


def test_one_update_per_iteration_backs_off_once_and_names_both_optimizers_skips() -> None:
    s = _two_optimizers(False)
    sc = s.scaler
    assert sc is not None
    assert [(e.step, e.count) for e in sc.events] == [(3, 1)]
    assert sc.scale[-1] == (3, 512.0)
    text = " ".join(render_text(s).split())
    assert ("1 backoff (step 3); 0 growths; 2 skipped optimizer steps in 1 step "
            "(SGD#0 1, SGD#1 1).") in text
    (f,) = [f for f in s.findings if f.kind == "scaler_backoff"]
    assert f.severity == "info"
    assert "GradScaler backed off 1x as designed" in f.message
    # Not "Each skipped one optimizer step": each optimizer skipped one.
    assert "Each skipped one optimizer step" not in f.message
    assert "2 optimizer step(s) were skipped (skipped per optimizer: SGD#0 1, SGD#1 1)" \
        in " ".join(f.message.split())


def test_culprits_of_two_optimizers_skips_are_in_backward_order() -> None:
    # The body's optimizer skips first, so its layer was named first ("in backward order:
    # 0, 1"); the head's gradients come first in backward.
    s = _two_optimizers(False)
    sc = s.scaler
    assert sc is not None
    assert sc.events[0].culprits == ["1", "0"]
    (f,) = [f for f in s.findings if f.kind == "scaler_backoff"]
    assert "in backward order: 1, 0." in " ".join(f.message.split())
