"""A newcomer's own model and training loop, through every front end (not code shaped to memlab).

A small ResNet-like CNN (BatchNorm, a residual add, 32×32 inputs), a DataLoader over a
TensorDataset, gradient accumulation with a GradScaler and bf16 autocast on the CPU,
clip_grad_norm_, an LR scheduler, the ``losses.append(loss)`` habit, a validation loop without
``no_grad``, a GAN's two models and two optimizers, models that return a dict or a tuple. Each
figure is checked against a truth computed without memlab (the parameters' ``nbytes``, the
tensors autograd saves, seen through ``saved_tensors_hooks``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from kernel_harness import Kernel
from torch import nn

import memlab
from memlab.estimate import estimate
from memlab.graphs.args import GraphArgumentError
from memlab.graphs.retained import find_retained
from memlab.step.config import WhatIfError

USER_CODE = r'''
import torch, torch.nn as nn, torch.nn.functional as F
import memlab
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class TinyResNet(nn.Module):
    def __init__(self, c=8, n=10):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.block = Block(c)
        self.fc = nn.Linear(c, n)

    def forward(self, x):
        x = self.block(F.relu(self.bn(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def saved_bytes(fn):
    """Bytes of the storages autograd saves while fn() runs, parameters and buffers left out
    (they exist anyway), each storage once."""
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen = {}
    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


torch.manual_seed(0)
model = TinyResNet()
X, Y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
loader = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
scaler = torch.amp.GradScaler("cpu")
param_bytes = sum(p.nbytes for p in model.parameters())
'''

TRAIN = """%%gpumem -b -o r training loop
accum = 2
losses = []
model.train()
for i, (xb, yb) in enumerate(loader):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(xb)
        loss = F.cross_entropy(out, yb)
    scaler.scale(loss / accum).backward()
    losses.append(loss)
    if (i + 1) % accum == 0:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
sched.step()
len(losses)
"""

VALIDATE = """%%gpumem validation
model.eval()
val_losses = []
for xb, yb in loader:
    val_losses.append(F.cross_entropy(model(xb), yb))
model.train()
len(val_losses)
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    k = Kernel(str(tmp_path_factory.mktemp("ipython")), setup="%load_ext memlab\n" + USER_CODE)
    yield k
    k.shutdown()


def _num(kernel: Kernel, expr: str) -> int:
    return int(kernel.value(expr))


def test_training_loop_report_against_the_parameters(kernel: Kernel) -> None:
    out = kernel.run(TRAIN)
    assert out.status == "ok" and out.value == "4", out.describe()
    assert out.reports and "training loop" in out.reports[0], out.describe()
    params = _num(kernel, "param_bytes")
    at_end = "r.to_dict()['categories']['at_end']"
    assert _num(kernel, f"{at_end}['parameter']") == params
    # SGD with momentum: one buffer per parameter, made in the loop
    assert _num(kernel, f"{at_end}['optimizer_state']") == params
    assert _num(kernel, f"{at_end}['gradient']") == 0  # zero_grad() set them to None
    # the last batch and its output are still bound: the change holds at least the batch
    assert _num(kernel, "r.to_dict()['allocated_delta']") >= _num(kernel, "xb.nbytes")

    # losses kept graphs whose saved tensors backward freed: named, with nothing to charge
    leaks = kernel.run("%gpumem_leaks")
    text = "\n".join(leaks.reports)
    assert "losses: 4 tensor(s) still carry autograd graphs" in text, leaks.describe()
    assert "backward already freed" in text and "loss.item()" in text


def test_validation_without_no_grad_is_charged_its_saved_tensors(kernel: Kernel) -> None:
    out = kernel.run(VALIDATE)
    assert out.status == "ok" and out.value == "4", out.describe()
    # the truth: what one step's forward and loss save (the batch included), times 4 steps,
    # less the last batch (inputs and targets), which the variables xb and yb hold anyway
    per_step = _num(
        kernel, "model.eval(); s = saved_bytes(lambda: F.cross_entropy(model(xb), yb)); s"
    )
    truth = 4 * per_step - _num(kernel, "xb.nbytes + yb.nbytes")
    kernel.run("model.train()")
    leaks = kernel.run("%gpumem_leaks")
    text = "\n".join(leaks.reports)
    assert re.search(r"val_losses: [\d.]+ [KM]iB in 4 tensor\(s\) with a graph", text), text
    found = kernel.value(
        "_r = memlab.graphs.retained.find_retained(globals()); "
        "{v['name']: v['bytes'] for v in _r.to_dict()['variables']}"
    )
    charged = eval(found)  # {"name": bytes}
    assert "exit" not in charged and "quit" not in charged, found  # IPython's own objects
    # the last step's graph is shared with `out`, which may be charged first
    got = charged["val_losses"] + charged.get("out", 0)
    assert got == truth, (got, truth, found)


def test_auto_timeline_and_history(kernel: Kernel) -> None:
    t = kernel.run("%%gpumem --timeline -l timeline\nfor xb, yb in loader:\n    pass\nxb.shape")
    assert t.status == "ok" and t.value == "torch.Size([8, 3, 32, 32])", t.describe()
    assert any("image/png" in d for d in t.displays), t.describe()
    assert kernel.run("%gpumem_auto on").status == "ok"
    try:
        big = kernel.run("big = torch.zeros(256, 1024)")  # 1 MiB, kept
        freed = kernel.run("del big")
    finally:
        kernel.run("%gpumem_auto off")
    assert "(+1.00 MiB)" in big.reports[0], big.describe()
    assert "(-1.00 MiB)" in freed.reports[0], freed.describe()
    history = "\n".join(kernel.run("%gpumem_history").reports)
    assert "timeline" in history and "+1.00 MiB" in history and "-1.00 MiB" in history


def test_an_error_in_the_loop_reaches_the_user(kernel: Kernel) -> None:
    code = (
        "%%gpumem -b\nkept = 41\nfor xb, yb in loader:\n"
        "    loss = F.cross_entropy(model(xb), yb[:3])\n"
    )
    out = kernel.run(code)
    assert out.status == "error" and out.ename == "ValueError", out.describe()
    assert "raised ValueError" in out.reports[0]
    assert not out.memlab_frames(), out.tb
    assert "yb[:3]" in out.tb  # the user's own line
    assert kernel.value("kept") == "41"


# -- the what-if step with the user's own step logic ------------------------------------------
class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)) + x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.block, self.fc = nn.Conv2d(3, 8, 3, padding=1), Block(8), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.block(F.relu(self.stem(x))), 1).flatten(1))


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))


def loss_only(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(b[0]), b[1])


def own_backward(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    loss = F.cross_entropy(model(b[0]), b[1]) / 2
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return loss.detach()


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


@pytest.mark.parametrize(
    "levers",
    [{}, {"accumulation": 2}, {"amp": "fp16"}, {"optimizer_in_backward": True}],
    ids=["plain", "accumulation", "fp16-scaler", "optimizer-in-backward"],
)
def test_step_fn_with_its_own_backward_and_clipping(levers: dict[str, object]) -> None:
    model = Net()
    before = _state(model)
    plain = memlab.whatif.run(lambda: model, batch, batch_size=8, step_fn=loss_only, **levers)
    own = memlab.whatif.run(lambda: model, batch, batch_size=8, step_fn=own_backward, **levers)
    if "amp" in levers:  # backward inside autocast keeps the weights' casts: said, and more
        assert any("inside the run's autocast" in n for n in own.report.notes)
        assert own.peak >= plain.peak
    else:  # the same step: the peak differs only by clip_grad_norm_'s norms (a few scalars)
        assert abs(own.peak - plain.peak) <= 1024, (own.peak, plain.peak)
        assert not any("autocast" in n for n in own.report.notes)
    ends = own.report.to_dict()["categories"]["at_end"]
    assert ends["parameter"] == sum(p.nbytes for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))
    assert all(p.grad is None for p in model.parameters())
    if levers:
        return
    e_own = estimate(Net, batch, batch_size=8, step_fn=own_backward)
    e_plain = estimate(Net, batch, batch_size=8, step_fn=loss_only)
    assert abs(e_own.peak_allocated - e_plain.peak_allocated) <= 1024


def test_step_fn_that_steps_its_own_optimizer_is_refused_before_it_steps() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = _state(model)

    def full_step(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> float:
        opt.zero_grad()
        loss = F.cross_entropy(m(b[0]), b[1])
        loss.backward()
        opt.step()
        return loss.item()

    with pytest.raises(WhatIfError) as e:
        memlab.whatif.run(lambda: model, batch, batch_size=4, step_fn=full_step)
    message = str(e.value)
    assert "step_fn called SGD.step()" in message and "memlab.track" in message
    assert "loss.backward() and clip_grad_norm_ may stay" in message
    assert not opt.state  # refused before the user's optimizer made its momentum
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))


class Gen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3 * 8 * 8))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z).view(-1, 3, 8, 8)


def gan_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 8, 8), torch.randn(n, 16)


def test_a_gan_two_models() -> None:
    g = Gen()
    d = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    with pytest.raises(WhatIfError, match=r"not a tuple of 2 .*nn\.ModuleDict.*memlab\.track"):
        memlab.whatif.run(lambda: (g, d), gan_batch, batch_size=4)

    def step(models: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        real, z = b
        fake = models["g"](z)
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        bce = F.binary_cross_entropy_with_logits
        d_loss = bce(models["d"](real), ones) + bce(models["d"](fake.detach()), zeros)
        return d_loss + bce(models["d"](fake), ones)

    both = nn.ModuleDict({"g": g, "d": d})
    r = memlab.whatif.run(lambda: both, gan_batch, batch_size=4, optimizer="adam", step_fn=step)
    at_end = r.report.to_dict()["categories"]["at_end"]
    params = sum(p.nbytes for p in [*g.parameters(), *d.parameters()])
    assert at_end["parameter"] == params
    assert r.report.to_dict()["categories"]["highest"]["optimizer_state"] >= 2 * params


def test_models_that_return_a_dict_or_a_tuple() -> None:
    class Dict(Net):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
            logits = super().forward(x)
            return {"logits": logits, "probs": logits.softmax(-1)}

    class Tuple(Net):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
            logits = super().forward(x)
            return logits, logits.softmax(-1)

    peaks = []
    for cls, pick in ((Dict, lambda o: o["logits"]), (Tuple, lambda o: o[0])):
        r = memlab.whatif.run(
            cls, batch, batch_size=4, step_fn=lambda m, b, p=pick: F.cross_entropy(p(m(b[0])), b[1])
        )
        peaks.append(r.peak)
    assert peaks[0] == peaks[1]


# -- graphs --------------------------------------------------------------------------------------
def _saved_truth(model: nn.Module, fn: object) -> int:
    """Bytes of the storages autograd saves while fn() runs, parameters and buffers left out
    (they exist anyway), each storage once (seen through saved_tensors_hooks, not memlab)."""
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # type: ignore[operator]
    return sum(seen.values())


def test_graph_of_the_cnn_and_of_a_losses_list() -> None:
    model, x = Net(), torch.randn(4, 3, 32, 32)
    g = memlab.graph(model, x)
    out_truth = _saved_truth(model, lambda: model(x))
    assert g.activation_bytes == out_truth - x.nbytes  # the input is listed apart
    losses: list[torch.Tensor] = []
    y = torch.zeros(4, dtype=torch.long)
    # graph_of has no model: the running statistics BatchNorm saved are counted (once)
    bn = sum(b.nbytes for b in model.buffers() if b.is_floating_point())
    truth = _saved_truth(model, lambda: losses.extend(F.cross_entropy(model(x), y) for _ in "abc"))
    assert memlab.graph_of(losses).activation_bytes == truth + bn
    assert "saved" in memlab.make_dot(losses).source  # a list, as graph_of takes
    with pytest.raises(GraphArgumentError, match=r"graph_of"):
        memlab.graph(losses)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, 0, 0, 0]))
    with pytest.raises(GraphArgumentError, match=r"input 1, a list of 2 item.*x, y = next"):
        memlab.graph(model, next(iter(loader)))
    with pytest.raises(GraphArgumentError, match=r"the DataLoader itself"):
        memlab.graph(model, loader)


def test_find_retained_reaches_a_list_first_met_deep_inside_another_variable() -> None:
    model, x = Net(), torch.randn(2, 3, 32, 32)
    kept = [model(x).sum()]

    class Holder:
        pass

    deep = Holder()
    deep.a = Holder()  # type: ignore[attr-defined]
    deep.a.b = {"kept": kept}  # type: ignore[attr-defined]  # at the scan's depth limit
    report = find_retained({"deep": deep, "kept": kept, "model": model})
    assert [i.name for i in report.items] == ["kept"], report
    assert report.items[0].bytes == _saved_truth(model, lambda: model(x).sum())  # x included
