"""Hostile inputs, round 6: every public function of memlab given a wrong argument (an error
that names it, with none of memlab's frames), a user's own ``BaseException`` (``GeneratorExit``,
``SystemExit``, a class of their own) raised through the what-if run, the graph and the
estimator, and through the panel's worker thread."""

from __future__ import annotations

import enum
import importlib
import inspect
import math
import re
import traceback
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import memlab
from memlab.estimate import estimate

#: A frame of memlab's own code, whichever part of it.
MEMLAB = re.compile(r"memlab[/\\](?!tests)[a-z_]+(?:[/\\][a-z_]+)*\.py")
WRONG = [5, None, "x", math.nan, -1]
#: What each public callable is not given (it starts a process or a notebook extension).
LEFT_OUT = {"launch", "load_ipython_extension", "unload_ipython_extension"}


def memlab_frames(e: BaseException) -> list[str]:
    here = __file__.rsplit("/", 1)[-1]
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    return [line for line in lines if MEMLAB.search(line) and here not in line]


def public_callables() -> list[tuple[str, Any]]:
    found = []
    for name in (
        "memlab",
        "memlab.estimate",
        "memlab.whatif",
        "memlab.snapshot",
        "memlab.distributed",
    ):
        mod = importlib.import_module(name)
        for attr in getattr(mod, "__all__", ()):
            f = getattr(mod, attr)
            if attr in LEFT_OUT or not callable(f):
                continue
            if inspect.isclass(f) and (
                issubclass(f, (BaseException, tuple, dict, enum.Enum))
                or hasattr(f, "__dataclass_fields__")
            ):
                continue  # (an error, a result's record: made by memlab, not called by users)
            found.append((f"{name}.{attr}", f))
    return found


@pytest.mark.parametrize(
    ("name", "f"), public_callables(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_wrong_argument_to_any_public_function_names_it_without_memlabs_frames(
    name: str, f: Any
) -> None:
    try:
        required = [
            p
            for p in inspect.signature(f).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    refused = 0
    warnings.simplefilter("ignore", memlab.MemlabDeprecationWarning)  # (kept for one release)
    for wrong in WRONG:
        try:
            made = f(*[wrong] * max(1, len(required)))
            if hasattr(made, "__enter__"):
                with made:
                    pass
        except (TypeError, ValueError, OSError, LookupError) as e:
            refused += 1
            assert not isinstance(e, (KeyError, IndexError)), (name, wrong, e)  # (a raw lookup)
            assert not memlab_frames(e), (name, wrong, memlab_frames(e))
            said = r"pass|use|leave|give|must be|takes"  # (what it takes instead)
            assert re.search(said, str(e), re.I), (name, wrong, str(e))
    assert refused >= 3, name  # (most of these are refused)


def test_wrong_arguments_to_a_graphs_methods_and_the_estimators_gpu() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    g = memlab.graph(model, torch.randn(2, 8))
    calls = [
        lambda: g.view(depth=math.nan),
        lambda: g.dot(limit=-1),
        lambda: g.dot(limit="5"),
        lambda: g.heaviest(k="3"),
        lambda: estimate(lambda: model, lambda b: torch.randn(b, 8), batch_size=2, gpu=math.nan),
        lambda: estimate(lambda: model, lambda b: torch.randn(b, 8), batch_size=2, gpu="Z80"),
        lambda: memlab.estimate.fit_generation(lambda: model, gpu="T4", context=math.nan),
    ]
    for call in calls:
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        assert not memlab_frames(info.value), memlab_frames(info.value)


class UsersOwn(BaseException):
    """A user's own kind of error that is not an Exception."""


@pytest.mark.parametrize("kind", [UsersOwn, GeneratorExit, SystemExit])
def test_a_users_base_exception_keeps_the_users_frames_alone(kind: type[BaseException]) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise kind("the user's own")

    calls = [
        lambda: memlab.whatif.run(Net, lambda n: torch.randn(n, 4), device="cpu", batch_size=2),
        lambda: memlab.graph(Net(), torch.randn(2, 4)),
        lambda: estimate(Net, lambda n: torch.randn(n, 4), batch_size=2, gpu="T4"),
    ]
    for call in calls:
        with pytest.raises(kind) as info:
            call()
        assert not memlab_frames(info.value), memlab_frames(info.value)
        assert any("forward" in line for line in traceback.format_tb(info.value.__traceback__))


@pytest.mark.parametrize("kind", [UsersOwn, GeneratorExit])
def test_the_panel_says_what_a_step_raising_a_base_exception_raised(kind: type) -> None:
    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        raise kind("loss refused")

    ex = memlab.Explorer(lambda: nn.Linear(4, 4), lambda b: torch.randn(b, 4), loss_fn=loss_fn)
    ex.run_button.click()
    ex.wait(60)
    assert kind.__name__ in ex.message and "loss refused" in ex.message, ex.message
    assert not ex.run_button.disabled  # (usable again)


def test_the_panel_says_an_error_whose_message_cannot_be_read() -> None:
    class UnprintableError(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        raise UnprintableError

    ex = memlab.Explorer(lambda: nn.Linear(4, 4), lambda b: torch.randn(b, 4), loss_fn=loss_fn)
    ex.run_button.click()
    ex.wait(60)
    assert "UnprintableError" in ex.message and "could not be read" in ex.message, ex.message


def test_a_bug_of_memlabs_converted_to_a_refusal_keeps_memlabs_frames(monkeypatch: Any) -> None:
    import memlab.snapshot.load as load

    where = load.__file__.replace("load.py", "a_bug.py")  # (code in memlab's own folder)
    scope: dict[str, Any] = {}
    exec(compile("def largest(trace):\n    return {}['no such key']\n", where, "exec"), scope)
    monkeypatch.setattr(load, "largest", scope["largest"])
    segment = {"device": 0, "address": 0, "total_size": 512, "blocks": []}
    with pytest.raises(memlab.snapshot.SnapshotError) as info:
        load.from_dict({"segments": [segment]}, "x")
    assert memlab_frames(info.value)  # to be reported: the KeyError was memlab's own


def test_a_base_exception_in_a_panel_run_on_the_main_thread_propagates() -> None:
    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        raise UsersOwn("a test's own outcome")

    ex = memlab.Explorer(lambda: nn.Linear(4, 4), lambda b: torch.randn(b, 4), loss_fn=loss_fn)
    with pytest.raises(UsersOwn):
        ex.run()  # (on the caller's thread: the caller's own exception, not a status line)


def test_a_region_used_out_of_order_is_refused_without_memlabs_frames() -> None:
    def refused(call: Any, said: str) -> None:
        with pytest.raises(RuntimeError, match=said) as caught:
            call()
        assert memlab_frames(caught.value) == [], memlab_frames(caught.value)

    region = memlab.track("cpu")
    refused(lambda: region.report, "still open: read .report after")
    refused(lambda: region.__exit__(None, None, None), "__exit__ without __enter__")
    refused(lambda: region.mark(torch.ones(2), memlab.Category.INPUT), "inside the region")
    with region:
        x = torch.ones(4)
        with pytest.raises(RuntimeError, match="measures one region") as caught, region:
            pass
        assert memlab_frames(caught.value) == []
        refused(lambda: region.report, "still open")
    assert region.report.allocated_after >= x.nelement() * 4
    refused(region.__enter__, "measures one region")
