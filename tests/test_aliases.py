"""Names that moved keep working for one release, and say where they went."""

from __future__ import annotations

import importlib
import sys

import pytest

import memlab
from memlab.core.warn import MemlabDeprecationWarning

MOVED = [
    ("memlab.whatif.config", "RunConfig", "memlab.step.config"),
    ("memlab.whatif.runner", "run", "memlab.step.run"),
    ("memlab.whatif.runner", "blocks", "memlab.step.model"),
    ("memlab.whatif.panel", "Explorer", "memlab.panel.explorer"),
    ("memlab.estimate.step", "estimate", "memlab.estimate.predict"),
    ("memlab.estimate.step", "Estimate", "memlab.estimate.result"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_a_moved_module_still_gives_the_same_object_and_warns(
    old: str, name: str, new: str
) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(MemlabDeprecationWarning, match=f"{old} is kept for one release"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_the_public_names_did_not_move() -> None:
    from memlab.estimate import Estimate, estimate
    from memlab.whatif import RunConfig, RunResult, WhatIfError, run

    assert memlab.whatif.run is run and run.__module__ == "memlab.step.run"
    assert {RunConfig.__module__, RunResult.__module__, WhatIfError.__module__} == {
        "memlab.step.config",
        "memlab.step.result",
    }
    assert estimate.__module__ == "memlab.estimate.predict"
    assert Estimate.__module__ == "memlab.estimate.result"
    assert memlab.Explorer.__module__ == "memlab.panel.explorer"
    assert callable(memlab.track) and memlab.track.__name__ == "track"


def test_string_choices_are_enums_that_accept_their_strings() -> None:
    from memlab.step import Amp, Mode, Optimizer, Retention, RunConfig, WhatIfError

    a = RunConfig(amp="bf16", mode="train", optimizer="sgd", retention="off")
    b = RunConfig(amp=Amp.BF16, mode=Mode.TRAIN, optimizer=Optimizer.SGD, retention=Retention.OFF)
    assert a == b and a.amp is Amp.BF16 and a.amp == "bf16" and f"{a.amp}" == "bf16"
    assert a.amp.dtype is not None and Amp.OFF.dtype is None
    assert a.describe() == "train, amp bf16, batch 8, sgd"
    with pytest.raises(WhatIfError, match=r"amp='fp8' is not one of 'off', 'fp16', 'bf16'"):
        RunConfig(amp="fp8")
    import json

    assert json.loads(json.dumps(a.to_dict()))["amp"] == "bf16"


def test_renamed_functions_still_work_and_warn() -> None:
    from memlab.estimate.trace import compare, diff, synthetic

    real = synthetic([("alloc", 1, 512), ("free_completed", 1, 512)])
    with pytest.warns(MemlabDeprecationWarning, match="use memlab.estimate.trace.diff"):
        kept = compare(real, real)
    assert kept == diff(real, real)
