"""Hostile inputs, round 5: a thread importing PyTorch's compiler while the first region warms
up, ``-o __builtins__``, an exception whose message raises under ``%gpumem_auto``, a model
of PyTorch's layers given the wrong shape, torch.compile's warning about memlab's global hooks,
``memlab.graph``'s traceback, and arguments checked up front."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback
import warnings
from typing import Any

import pytest
import torch
from conftest import run
from IPython.core.error import UsageError

import memlab
from memlab.estimate import estimate
from memlab.estimate.distributed import strategies
from memlab.step import WhatIfError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _memlab_lines(e: BaseException) -> list[str]:
    here = os.path.basename(__file__)
    return [
        line
        for line in traceback.format_exception(e)
        if f"{os.sep}memlab{os.sep}" in line and here not in line
    ]


def test_a_thread_importing_the_compiler_while_the_first_region_warms_up() -> None:
    """The user's thread builds an optimizer (which imports torch._dynamo, ~2 s) as the first
    region opens: both imports at once used to leave the thread with an ImportError and
    torch.compile broken for the rest of the process."""
    script = textwrap.dedent(
        """
        import threading, torch, memlab
        errors = []
        def user():
            try:
                torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
            except BaseException as e:
                errors.append(repr(e))
        bg = threading.Thread(target=user)
        bg.start()
        with memlab.track("cpu"):
            x = torch.ones(3)
        bg.join()
        out = torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.ones(3))
        assert not errors, errors
        assert torch.allclose(out, torch.ones(3).sin() + 1)
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize(
    "line",
    [
        ("cell", "gpumem", "-o __builtins__"),
        ("line", "gpumem", "-o __builtins__ x = 1"),
        ("line", "gpumem_history", "-o __builtins__"),
        ("line", "gpumem_leaks", "-o __name__"),
    ],
    ids=["cell", "line", "history", "leaks"],
)
def test_o_refuses_python_s_own_dunder_names(ip: Any, line: tuple[str, str, str]) -> None:
    kind, magic, args = line
    with pytest.raises(UsageError, match=r"-o __\w+__ would replace Python's"):
        if kind == "cell":
            ip.run_cell_magic(magic, args, "1")
        else:
            ip.run_line_magic(magic, args)
    assert run(ip, "z = len([1])").success and ip.user_ns["z"] == 1


def test_an_exception_whose_message_raises_keeps_auto_s_handler(ip: Any) -> None:
    assert run(ip, "%gpumem_auto on -d cpu").success
    try:
        handler = ip.custom_exceptions
        assert handler
        cell = (
            "class E(Exception):\n"
            "    def __str__(self):\n"
            "        raise RuntimeError('str refuses')\n"
            "raise E()\n"
        )
        r = run(ip, cell)
        assert not r.success
        assert ip.custom_exceptions == handler  # still memlab's: not unregistered
        assert run(ip, "w = 2").success and ip.user_ns["w"] == 2
    finally:
        run(ip, "%gpumem_auto off")


@pytest.mark.parametrize(
    "call",
    [
        lambda: memlab.whatif.run(lambda: torch.nn.Linear(4, 2), lambda n: torch.randn(n, 5)),
        lambda: estimate(
            lambda: torch.nn.Linear(4, 2), lambda n: torch.randn(n, 5), batch_size=8, gpu="T4"
        ),
        lambda: memlab.whatif.run(
            lambda: torch.nn.Linear(4, 2), lambda n: torch.randn(n, 4, dtype=torch.float64)
        ),
    ],
    ids=["shape", "shape-estimate", "dtype"],
)
def test_a_model_of_torch_layers_refusing_the_input_names_input_fn(call: Any) -> None:
    with pytest.raises(WhatIfError, match=r"on what input_fn\(8\) returned \(1 tensor") as info:
        call()
    assert _memlab_lines(info.value) == []


def test_a_user_s_own_layer_raising_keeps_its_own_error() -> None:
    class Boom(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("user boom")

    with pytest.raises(ValueError, match="user boom") as info:
        memlab.whatif.run(lambda: Boom(4, 2), lambda n: torch.randn(n, 4))
    assert _memlab_lines(info.value) == []


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("flags", [{"breakdown": True}, {"timeline": True}])
def test_torch_compile_of_a_module_shows_no_warning_about_memlab_s_hooks(
    monkeypatch: pytest.MonkeyPatch, native: str, flags: dict[str, bool]
) -> None:
    monkeypatch.setenv("MEMLAB_NATIVE", native)
    m = torch.compile(torch.nn.Linear(8, 8), backend="eager")
    x = torch.randn(2, 8)
    m(x)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with memlab.track("cpu", **flags):
            m(x).sum().backward()
    assert [str(w.message) for w in said if "global hooks" in str(w.message)] == []
    assert warnings.filters == before  # the filter memlab put in is out again
    # the user's own hook still warns as PyTorch does
    from torch.nn.modules import module as nn_module

    handle = nn_module.register_module_forward_pre_hook(lambda mod, args: None)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            m(x)
        assert any("global hooks" in str(w.message) for w in said)
    finally:
        handle.remove()


def test_graph_shows_the_user_s_frames_alone() -> None:
    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("user boom")

    with pytest.raises(ValueError, match="user boom") as info:
        memlab.graph(Boom(), torch.ones(2, 3))
    assert _memlab_lines(info.value) == []
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as shape:
        memlab.graph(torch.nn.Linear(3, 2), torch.ones(2, 4))
    assert _memlab_lines(shape.value) == []


def test_arguments_checked_up_front() -> None:
    with pytest.raises(TypeError, match=r"estimate got int 5: pass what memlab.estimate"):
        strategies(5, 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"since must be a ledger serial.*got str 'x'"):
        memlab.track(breakdown=True, since="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"since must be a ledger serial.*got bool True"):
        memlab.track(since=True)
    t = memlab.track()
    with pytest.raises(RuntimeError, match=r"__exit__ without __enter__"):
        t.__exit__(None, None, None)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("native", ["1", "0"])
def test_a_child_forked_in_a_region_runs_without_memlab_s_dispatch_mode(
    monkeypatch: pytest.MonkeyPatch, native: str
) -> None:
    """A DataLoader's workers are forked inside the user's region: they must not carry the
    region's accounting into every op they run."""
    from memlab.core._torch import dispatch_mode_stack

    monkeypatch.setenv("MEMLAB_NATIVE", native)
    with memlab.track("cpu", breakdown=True):
        inside = len(dispatch_mode_stack())
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, and leave without running pytest's exit
            try:
                y = torch.ones(3) * 2
                os.write(w, f"{len(dispatch_mode_stack())} {y.sum().item()}".encode())
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        got = os.read(r, 100).decode()
        os.close(r)
        os.close(w)
    assert inside == (1 if native == "0" else 0)
    assert got == "0 6.0"


@pytest.mark.skipif(
    not hasattr(torch._C._autograd.SavedTensor, "unpack_hook"),  # (2.11 on)
    reason="this PyTorch cannot tell a saved tensor's unpack hook without running it",
)
def test_reading_a_graph_never_runs_the_program_s_unpack_hooks() -> None:
    """Reading what a graph saved through ``_saved_x`` unpacks it: a checkpointed forward is
    recomputed, an offloaded activation copied back. memlab's graphs and the retained-graph
    finder read what was packed instead."""
    from torch.utils.checkpoint import checkpoint

    from memlab.graphs.retained import find_retained

    calls = [0]

    class Counted(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return super().forward(x).relu()

    layer = Counted(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    out = checkpoint(layer, x, use_reentrant=False)
    assert calls == [1]
    g = memlab.graph_of(out)
    found = find_retained({"out": out})
    assert calls == [1]  # never recomputed
    assert g.activation_bytes == 0 and found is not None  # checkpointing saved no activation
    unpacked = [0]

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        kept = torch.nn.Linear(16, 16)(x).relu()
    g = memlab.graph_of(kept)
    assert unpacked == [0]
    # what the hook packed is what the graph holds: the ReLU's output (x, a leaf, is listed
    # apart; the weight is a parameter)
    assert g.activation_bytes == kept.untyped_storage().nbytes() > 0
