"""`watch()` checks its arguments at the call, each with one line that names the fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import amp_doctor
from amp_doctor.errors import UsageError
from amp_doctor.steps.scaler import patches_installed
from tests.helpers import MLP


def opt_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: amp_doctor.watch(None), "got None instead of a model"),
        (lambda m: amp_doctor.watch([]), "got an empty list: nothing to watch"),
        (lambda m: amp_doctor.watch({}), "got an empty dict: nothing to watch"),
        (lambda m: amp_doctor.watch(m, optimizer="adam"),
         "optimizer= must be a torch.optim.Optimizer (or a list of them), got str 'adam'"),
        (lambda m: amp_doctor.watch(m, optimizer=[opt_for(m), "adam"]),
         "optimizer= item 1 is a str"),
        # Today's `TypeError: 'SGD' object is not iterable`: the optimizer as the model.
        (lambda m: amp_doctor.watch(opt_for(m)), "got a SGD, not a torch.nn.Module. That is the "
                                                 "optimizer: pass the model first"),
        (lambda m: amp_doctor.watch(m.parameters()), "got a Parameter for item 0"),
        (lambda m: amp_doctor.watch({"a": m, "b": 3}), "got a int for 'b'"),
        (lambda m: amp_doctor.watch(m, scaler=opt_for(m)),
         "scaler= must be a torch.amp.GradScaler"),
        (lambda m: amp_doctor.watch(m, every=0), "every must be a positive integer, got int 0"),
        (lambda m: amp_doctor.watch(m, every=True), "every must be a positive integer, got bool"),
        (lambda m: amp_doctor.watch(m, every=2.5), "every must be a positive integer, got float"),
        (lambda m: amp_doctor.watch(m, max_steps=0), "max_steps must be a positive integer"),
        (lambda m: amp_doctor.watch(m, top_k=-1), "top_k must be a >= 0 integer"),
        (lambda m: amp_doctor.watch(m, logdir=3), "logdir= must be a folder path"),
        (lambda m: amp_doctor.watch(m, on_nonfinite="stop"), "on_nonfinite must be 'record'"),
        (lambda m: amp_doctor.watch(m, evry=2), "has no option 'evry'; did you mean every=?"),
    ],
)
def test_bad_argument_is_one_line_naming_the_fix(call, message: str) -> None:
    model = MLP()
    with pytest.raises(UsageError) as e:
        call(model)
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    assert not patches_installed()  # refused before anything was installed


@pytest.mark.parametrize("every", [np.int64(2), np.int32(2), 2], ids=["int64", "int32", "int"])
def test_any_integral_number_is_accepted(every) -> None:
    model = MLP()
    opt = opt_for(model)
    scaler = torch.amp.GradScaler("cpu")
    with amp_doctor.watch(model, every=every, max_steps=np.int64(5), top_k=np.int16(4),
                          optimizer=(o for o in [opt])) as doctor:
        assert doctor.every == 2 and type(doctor.every) is int
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    s = doctor.session
    assert s.run.every == 2 and s.steps == 4 and s.recorded_steps == 2


def test_models_from_a_generator_and_an_empty_container_module() -> None:
    a, b = MLP(), MLP()
    with amp_doctor.watch(m for m in (a, b)) as doctor:
        pass
    assert sorted(doctor.models) == ["MLP0", "MLP1"]
    empty = nn.Sequential()  # falsy (len 0) but still a model the user asked for
    with amp_doctor.watch(empty) as doctor:
        pass
    assert doctor.models == {"": empty}


def test_a_logdir_that_cannot_take_files_is_one_usage_error(tmp_path: Path) -> None:
    # It was a traceback from inside tensorboard's makedirs (FileExistsError).
    a_file = tmp_path / "report.txt"
    a_file.write_text("")
    model = MLP()
    for bad, why in ((a_file, "File exists"), (a_file / "sub", "Not a directory")):
        with pytest.raises(UsageError) as e:
            amp_doctor.watch(model, logdir=bad)
        assert str(e.value) == (f"cannot write to logdir {str(bad)!r} ({why}); pass a "
                                "writable directory, e.g. logdir='runs/amp'.")
        assert not patches_installed()
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
