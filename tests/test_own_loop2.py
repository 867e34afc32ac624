"""A newcomer's own training loops, round 2: step functions written as training loops are
written (a zero_grad at the top, ``set_to_none=False``, a scheduler stepped each call, a
GradScaler, an EMA copy of the model, a dict of metrics returned), a checkpointing lever naming
a ModuleList, and errors raised in the user's own code. Each figure is checked against a truth
computed without memlab (the parameters' ``nbytes``, gradients computed by the test), and the
user's model, optimizer, scheduler and scaler are compared with what they were.
"""

from __future__ import annotations

import copy
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from kernel_harness import Kernel
from test_restores import changes, snapshot
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import memlab
from memlab.estimate import estimate
from memlab.graphs.retained import find_retained
from memlab.step.config import WhatIfError

MEMLAB = str(Path(memlab.__file__).parent)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for the same size (the truth below recomputes it)."""
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def loss_only(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(b[0]), b[1])


def param_bytes(*models: nn.Module) -> int:
    return sum(p.nbytes for m in models for p in m.parameters())


def made() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def stepped() -> Iterator[list[list[torch.Tensor]]]:
    """The gradients the test's first optimizer step saw (a run's warm-up: outside the
    measured region, so the copies are not in its figures)."""
    seen: list[list[torch.Tensor]] = []

    def record(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not seen:
            seen.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])

    handle = register_optimizer_step_pre_hook(record)
    yield seen
    handle.remove()


# -- zero_grad inside step_fn ------------------------------------------------------------------
def zeroing(model: nn.Module, how: str) -> Callable[..., Any]:
    """A step that zeroes the gradients first, as every training loop starts."""
    own = torch.optim.SGD(model.parameters(), lr=0.1)

    def model_zero_grad(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        m.zero_grad()
        return F.cross_entropy(m(b[0]), b[1])

    def own_backward(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> float:
        own.zero_grad()  # the user's own optimizer's zero_grad: allowed
        loss = F.cross_entropy(m(b[0]), b[1]) / 2  # the user divides by their accumulation
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
        return loss.item()

    return model_zero_grad if how == "model" else own_backward


@pytest.mark.parametrize("how", ["model", "optimizer and own backward"])
def test_accumulation_keeps_every_micro_batch_when_step_fn_zeroes_the_gradients(
    how: str, stepped: list[list[torch.Tensor]]
) -> None:
    model = made()
    truth = copy.deepcopy(model)
    x, y = batch(4)  # each of the 2 micro-batches of 8 is batch(4)
    F.cross_entropy(truth(x), y).backward()  # 2 micro-batches × loss / 2 = this gradient
    before = snapshot(model)
    step_fn = zeroing(model, how)
    r = memlab.whatif.run(
        lambda: model, batch, step_fn=step_fn, batch_size=8, accumulation=2, optimizer="sgd"
    )
    assert not changes(before, snapshot(model))
    first = stepped[0]  # the warm-up's step, from the model's own weights
    for got, p in zip(first, truth.parameters(), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(got, p.grad)
    plain = memlab.whatif.run(
        lambda: model, batch, step_fn=loss_only, batch_size=8, accumulation=2, optimizer="sgd"
    )
    assert abs(r.peak - plain.peak) <= 1024  # clip_grad_norm_'s norms at most
    assert any("once per optimizer step" in n for n in r.report.notes)


def test_zero_grad_set_to_none_false_keeps_the_gradients_between_steps() -> None:
    def kept(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        return F.cross_entropy(model(b[0]), b[1])

    model = made()
    params = param_bytes(model)
    before = snapshot(model)
    r = memlab.whatif.run(lambda: model, batch, step_fn=kept, batch_size=16, optimizer="sgd")
    plain = memlab.whatif.run(
        lambda: model, batch, step_fn=loss_only, batch_size=16, optimizer="sgd"
    )
    assert not changes(before, snapshot(model))
    assert r.report is not None and plain.report is not None
    ends = r.report.to_dict()["categories"]["at_end"]
    assert ends["gradient"] == params  # zeroed, still allocated, as that loop keeps them
    assert plain.report.to_dict()["categories"]["at_end"]["gradient"] == 0
    # the step starts with the gradients allocated, so it holds them through the forward too
    assert r.report.allocated_before - plain.report.allocated_before == params
    assert any("set_to_none=False" in n for n in r.report.notes)


# -- a scheduler, a scaler ------------------------------------------------------------------------
def schedulers(o: torch.optim.Optimizer) -> dict[str, Any]:
    lr = torch.optim.lr_scheduler
    return {
        "StepLR": lr.StepLR(o, step_size=1, gamma=0.5),
        "OneCycleLR": lr.OneCycleLR(o, max_lr=1.0, total_steps=100),
        "ReduceLROnPlateau": lr.ReduceLROnPlateau(o, patience=0),
        "SequentialLR": lr.SequentialLR(
            o, [lr.LinearLR(o, 0.1, total_iters=2), lr.ExponentialLR(o, 0.9)], milestones=[2]
        ),
    }


@pytest.mark.parametrize("kind", ["StepLR", "OneCycleLR", "ReduceLROnPlateau", "SequentialLR"])
def test_a_scheduler_stepped_in_step_fn_is_put_back(kind: str) -> None:
    model = made()
    own = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = schedulers(own)[kind]

    def step_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = F.cross_entropy(m(b[0]), b[1])
        if kind == "ReduceLROnPlateau":
            sched.step(1.0)  # a metric that never improves: the learning rate falls
        else:
            sched.step()
        return loss

    state, groups = copy.deepcopy(sched.state_dict()), copy.deepcopy(own.state_dict())
    lrs = [g["lr"] for g in own.param_groups]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        r = memlab.whatif.run(lambda: model, batch, step_fn=step_fn, batch_size=8)
    # (torch's "lr_scheduler.step() before optimizer.step()" would blame the program's order:
    # the run steps its own optimizer, never the one the scheduler was made for)
    assert not [w for w in said if "lr_scheduler" in str(w.message)], [str(w.message) for w in said]
    assert [g["lr"] for g in own.param_groups] == lrs
    assert sched.state_dict() == state
    assert own.state_dict() == groups and not own.state
    assert "_opt_called" not in vars(own)  # (what kept PyTorch's warning quiet, gone again)
    assert any("learning-rate scheduler" in n for n in r.report.notes)
    plain = memlab.whatif.run(lambda: model, batch, step_fn=loss_only, batch_size=8)
    assert r.peak == plain.peak


def test_a_grad_scaler_loop_is_refused_before_it_unscales_the_users_optimizer() -> None:
    model = made()
    own = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")

    def step_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> float:
        own.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(b[0]), b[1])
        scaler.scale(loss).backward()
        scaler.unscale_(own)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(own)
        scaler.update()
        return loss.item()

    before = snapshot(model)
    with pytest.raises(WhatIfError, match=r"GradScaler\.unscale_\(SGD\).*memlab\.track") as e:
        memlab.whatif.run(lambda: model, batch, step_fn=step_fn, batch_size=8)
    assert "scaler.unscale_(own)" in "".join(traceback.format_tb(e.value.__traceback__))
    assert not changes(before, snapshot(model))
    assert not own.state
    step_fn(model, batch(8))  # the user's loop still runs: the scaler has no unscale on record
    assert own.state


# -- an EMA copy, a dict of metrics -------------------------------------------------------------
def test_an_ema_copy_of_the_model_counts_as_parameters_and_is_put_back() -> None:
    model = made()
    ema = copy.deepcopy(model).requires_grad_(False)
    averaged = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99)
    )
    flat = torch.zeros(2, 3)  # a running total, and a log written through views of one tensor
    seen = torch.zeros(())

    def step_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = F.cross_entropy(m(b[0]), b[1])
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(m.parameters()), 0.01)
            averaged.update_parameters(m)
            seen.add_(loss)
            flat[0].add_(1)
            flat[:, 1].mul_(2).add_(3)
        return loss

    values = [t.clone() for t in (*ema.state_dict().values(), *averaged.state_dict().values())]
    before = snapshot(model)
    r = memlab.whatif.run(lambda: model, batch, step_fn=step_fn, batch_size=8, optimizer="sgd")
    assert r.report is not None
    highest = r.report.to_dict()["categories"]["highest"]
    assert highest["parameter"] == param_bytes(model, ema, averaged)
    after = [*ema.state_dict().values(), *averaged.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(values, after, strict=True))
    assert not seen.item() and not flat.any()
    assert not changes(before, snapshot(model))
    assert any("put back as they were" in n for n in r.report.notes)
    x, y = batch(8)
    with memlab.track(breakdown=True) as t:  # the loop as written, the EMA after the step
        F.cross_entropy(model(x), y).backward()
        averaged.update_parameters(model)
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.01)
    at_end = t.report.to_dict()["categories"]["at_end"]
    assert at_end["parameter"] == param_bytes(model, ema, averaged)
    assert at_end["input"] == x.nbytes + y.nbytes + averaged.n_averaged.nbytes  # a buffer


def test_a_step_fn_that_returns_metrics() -> None:
    model = made()

    def metrics(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = m(b[0])
        loss = F.cross_entropy(logits, b[1])
        return {"loss": loss, "accuracy": (logits.argmax(-1) == b[1]).float().mean()}

    def pair(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        return F.cross_entropy(m(b[0]), b[1]), None

    plain = memlab.whatif.run(lambda: model, batch, step_fn=loss_only, batch_size=8)
    for fn in (metrics, pair):
        r = memlab.whatif.run(lambda: model, batch, step_fn=fn, batch_size=8)
        assert r.error is None and r.report is not None
        assert r.report.to_dict()["categories"]["highest"]["gradient"] == param_bytes(model)
        assert abs(r.peak - plain.peak) <= 64  # the accuracy's scalars at most
    with pytest.raises(WhatIfError, match=r"not float \(a number, such as loss\.item\(\)"):
        memlab.whatif.run(
            lambda: model, batch, step_fn=lambda m, b: loss_only(m, b).item(), batch_size=8
        )


# -- checkpointing a ModuleList by name -----------------------------------------------------------
class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:  # the ModuleList itself is never called
            x = x + block(x)
        return self.head(x)


class Direct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra[1](self.extra[0](x))


def test_checkpointing_a_module_list_by_name_checkpoints_its_blocks() -> None:
    model = Blocks()

    def step(spec: Any) -> int:
        r = memlab.whatif.run(
            lambda: model,
            lambda n: torch.randn(n, 64),
            loss_fn=lambda o: o.square().mean(),
            batch_size=64,
            checkpoint=spec,
        )
        assert r.report is not None
        return int(r.report.to_dict()["categories"]["highest"]["activation"])

    each = step(("blocks.0", "blocks.1", "blocks.2"))
    assert step(("blocks",)) == each < step("off")
    # a module whose layers its parent calls directly: named, but never called itself
    r = memlab.whatif.run(lambda: Direct(), lambda n: torch.randn(n, 8), checkpoint=("extra",))
    assert r.report is not None and any("'extra', whose forward" in n for n in r.report.notes)


# -- errors in the user's own code ---------------------------------------------------------------
def wrong_targets(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b[0]), b[1][:3])  # the user's bug


def memlab_frames(e: BaseException) -> list[str]:
    found = []
    while e is not None:
        found += [f.filename for f in traceback.extract_tb(e.__traceback__)]
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return [f for f in found if f.startswith(MEMLAB)]


@pytest.mark.parametrize("front", ["run", "estimate"])
def test_an_error_in_the_users_step_has_no_memlab_frames(front: str) -> None:
    call = memlab.whatif.run if front == "run" else estimate
    with pytest.raises(ValueError, match="batch_size") as e:
        call(made, batch, step_fn=wrong_targets, batch_size=8)  # type: ignore[operator]
    assert not memlab_frames(e.value), memlab_frames(e.value)
    assert "b[1][:3]" in "".join(traceback.format_tb(e.value.__traceback__))

    def broken_inputs(n: int) -> torch.Tensor:
        return torch.randn(n, 32)[:, :, None].squeeze(3)

    with pytest.raises(WhatIfError, match="input_fn raised IndexError") as w:
        call(made, broken_inputs, batch_size=8)  # type: ignore[operator]
    assert not memlab_frames(w.value)
    assert ".squeeze(3)" in "".join(traceback.format_tb(w.value.__cause__.__traceback__))


def test_an_estimate_that_meets_state_made_before_it_says_so() -> None:
    ema = made().requires_grad_(False)  # on the CPU, made before the estimate

    def step_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            for e, p in zip(ema.parameters(), m.parameters(), strict=True):
                e.lerp_(p, 0.01)
        return loss_only(m, b)

    with pytest.raises(WhatIfError, match=r"already exists on a real device at .*e\.lerp_") as e:
        estimate(Net, batch, step_fn=step_fn, batch_size=8)
    assert "needs a tensor's values" not in str(e.value)


# -- a loop's log of detached tensors -------------------------------------------------------------
LOOP = """
import torch, torch.nn as nn, torch.nn.functional as F, memlab
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 100))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
history, rows = [], []

def compute_loss(logits, y):
    loss = F.cross_entropy(logits, y)
    history.append({"loss": loss.detach(), "logits": logits.detach()})  # kept for metrics
    rows.append(logits.detach()[0])  # one row of each batch's logits
    return loss

for step in range(5):
    x, y = torch.randn(32, 16), torch.randint(0, 100, (32,))
    opt.zero_grad()
    compute_loss(model(x), y).backward()
    opt.step()
"""


def test_a_log_of_detached_tensors_is_named_with_what_it_holds() -> None:
    space: dict[str, Any] = {}
    exec(LOOP, space)  # the user's notebook, as a namespace
    history, rows = space["history"], space["rows"]
    logits = 32 * 100 * 4  # what each step's logits take
    report = find_retained(space)
    held = {h["name"]: h for h in report.to_dict()["tensors_held"]}
    assert held["history"]["tensors"] == 10
    assert held["history"]["bytes"] == 5 * logits + 5 * 4  # the logits and the loss, per step
    assert held["rows"]["bytes"] == 5 * logits  # each row keeps its whole batch's storage
    assert held["rows"]["viewed"] == sum(r.nbytes for r in rows) == 5 * 100 * 4
    assert "history" in str(report) and ".clone()" in str(report)
    assert len(history) == 5


def test_in_a_real_kernel_the_traceback_is_the_users(tmp_path: Path) -> None:
    setup = (
        "import torch, torch.nn.functional as F, memlab\n"
        "def batch(n):\n    return torch.randn(n, 8), torch.randint(0, 4, (n,))\n"
    )
    kernel = Kernel(str(tmp_path), setup="%load_ext memlab\n" + setup)
    try:
        assert kernel.run(LOOP).status == "ok"
        leaks = "\n".join(kernel.run("%gpumem_leaks").reports)
        assert "history: 10 tensor(s) in it hold 62.5 KiB" in leaks, leaks  # 5 × 12,804 B
        for front in ("memlab.whatif.run", "memlab.estimate.estimate"):
            out = kernel.run(
                f"r = {front}(lambda: torch.nn.Linear(8, 4), batch, batch_size=4,\n"
                "    step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1][:3]))"
            )
            assert out.status == "error" and out.ename == "ValueError", out.describe()
            assert not out.memlab_frames(), out.tb
            assert "b[1][:3]" in out.tb
    finally:
        kernel.shutdown()
