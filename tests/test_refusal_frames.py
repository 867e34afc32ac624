"""A setting refused by the what-if run or by `RunConfig` itself is said at the user's line:
no frame of memlab's, nor of the ``__init__`` a dataclass generates for memlab's class (its code
is made from a string, so its file is ``<string>``, not one of memlab's)."""

from __future__ import annotations

import dataclasses
import inspect
import traceback
from typing import Any

import pytest
import torch
from torch import nn

import memlab
from memlab.step.config import WhatIfError

BAD = [{"batch_size": 0}, {"amp": "fp8"}, {"optimizer": "lion"}, {"accumulation": -1}]


def frames(e: BaseException) -> list[str]:
    """The traceback's frame lines, this file's left out."""
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    return [x for x in lines if x.lstrip().startswith("File ") and __file__ not in x]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: next(iter(b)))
def test_the_run_refuses_a_setting_at_the_users_line(bad: dict[str, Any]) -> None:
    with pytest.raises(WhatIfError, match=next(iter(bad))) as caught:
        memlab.whatif.run(lambda: nn.Linear(8, 8), lambda n: torch.randn(n, 8), **bad)
    assert frames(caught.value) == []


@pytest.mark.parametrize("bad", BAD, ids=lambda b: next(iter(b)))
def test_the_config_refuses_a_setting_at_the_users_line(bad: dict[str, Any]) -> None:
    with pytest.raises(WhatIfError, match=next(iter(bad))) as caught:
        memlab.whatif.RunConfig(**bad)
    assert frames(caught.value) == []


def test_a_config_still_builds_and_is_replaced_as_a_dataclass() -> None:
    c = memlab.whatif.RunConfig(batch_size=4)
    assert dataclasses.replace(c, batch_size=8).batch_size == 8
    with pytest.raises(WhatIfError, match="batch_size"):
        dataclasses.replace(c, batch_size=-2)
    assert "batch_size" in str(inspect.signature(memlab.whatif.RunConfig))


def test_an_op_refused_in_the_users_step_shows_the_frames_a_plain_run_shows() -> None:
    """The op memlab's dispatch mode calls on (torch's ``_ops.py``) is not shown: the user's
    line is the last frame, as without memlab."""
    model = nn.Linear(8, 8)

    def step(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch) @ torch.ones(3, 3)

    with pytest.raises(RuntimeError, match="cannot be multiplied") as plain:
        step(model, torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="cannot be multiplied") as under:
        memlab.whatif.run(lambda: model, lambda n: torch.randn(n, 8), step_fn=step, batch_size=2)
    shown = traceback.format_exception(under.type, under.value, under.value.__traceback__)
    files = [x.strip().splitlines()[0] for x in shown if x.lstrip().startswith("File ")]
    assert files[-1].endswith("in step") and not [
        f for f in files if "torch" in f or "memlab/" in f
    ]
    ran = traceback.format_exception(plain.type, plain.value, plain.value.__traceback__)
    assert [x for x in ran if x.lstrip().startswith("File ")][-1].strip().splitlines()[0] == files[
        -1
    ]
