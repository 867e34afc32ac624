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


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("flags", [{}, {"breakdown": True}, {"timeline": True}])
def test_a_warning_the_program_shows_once_per_line_is_not_shown_again_after_each_region(
    monkeypatch: pytest.MonkeyPatch, native: str, flags: dict[str, bool]
) -> None:
    # (the filter memlab puts in for its own hooks once reset every module's record of the
    # warnings shown, so such a warning came back at every step of a tracked loop)
    monkeypatch.setenv("MEMLAB_NATIVE", native)
    m = torch.nn.Linear(3, 3)

    def users_step() -> None:
        m(torch.randn(2, 3)).sum().backward()
        warnings.warn("the program's own warning", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        for _ in range(4):
            with memlab.track("cpu", **flags):
                users_step()
    assert [str(w.message) for w in said if "own warning" in str(w.message)] == [
        "the program's own warning"
    ]


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


# -- round 6 -------------------------------------------------------------------------------------


def test_cpu_0_is_the_cpu(ip: Any) -> None:
    import memlab

    with memlab.track("cpu:0") as t:
        x = torch.ones(1000)
    assert t.report.device == "cpu" and t.report.peak_delta == x.nbytes
    assert run(ip, "%%gpumem -q -d cpu:0 -o r\ny = torch.ones(10)").success
    assert ip.user_ns["r"].peak_delta == 40


def test_the_shell_s_ast_transformers_and_capture_apply_under_the_magic(ip: Any) -> None:
    import ast as ast_module

    class Double(ast_module.NodeTransformer):
        def visit_Constant(self, node: Any) -> Any:
            if isinstance(node.value, int) and not isinstance(node.value, bool):
                return ast_module.copy_location(ast_module.Constant(node.value * 2), node)
            return node

    ip.ast_transformers.append(Double())
    try:
        assert run(ip, "%%gpumem -q\nn = 21").success and ip.user_ns["n"] == 42
    finally:
        ip.ast_transformers.pop()
    assert run(ip, "%%capture cap\n%%gpumem -q\ntorch.ones(3).sum()").success
    outputs = ip.user_ns["cap"].outputs  # the value, captured with the report
    assert any("tensor(3.)" in str(o.data.get("text/plain", "")) for o in outputs), outputs


def test_a_snapshot_without_events_shows_the_device_its_segments_are_on(tmp_path: Any) -> None:
    import pickle

    import memlab

    seg = {"device": 1, "address": 0, "total_size": 2**20, "allocated_size": 2**20,
           "active_size": 2**20, "requested_size": 2**20, "stream": 0, "segment_type": "large",
           "blocks": [{"address": 0, "size": 2**20, "requested_size": 2**20,
                       "state": "active_allocated", "frames": []}]}  # fmt: skip
    path = tmp_path / "dev1.pickle"
    path.write_bytes(pickle.dumps({"segments": [seg], "device_traces": [[], []]}))
    s = memlab.load_snapshot(str(path))
    assert s.device == 1 and s.allocated == 2**20
    with pytest.raises(ValueError, match="device_traces is int 5"):
        from memlab.snapshot.load import from_dict

        from_dict({"segments": [], "device_traces": 5}, "n")
    with pytest.raises(ValueError, match="device='0' is a str: pass a CUDA device's index"):
        memlab.load_snapshot(str(path), device="0")  # type: ignore[arg-type]


def test_input_fn_returning_none_is_named() -> None:
    import memlab
    from memlab.step import WhatIfError

    with pytest.raises(WhatIfError, match="input_fn returned None: return the model's input"):
        memlab.whatif.run(lambda: torch.nn.Linear(4, 4), lambda n: None, device="cpu")


def test_the_panel_says_what_a_step_that_exits_raised() -> None:
    import memlab

    def exits(out: Any) -> Any:
        raise SystemExit("loss exits")

    ex = memlab.Explorer(lambda: torch.nn.Linear(4, 4), lambda b: torch.randn(b, 4), loss_fn=exits)
    ex.run_button.click()
    ex._work.wait(60)
    assert "SystemExit: loss exits" in ex.message and not ex._work.running


def test_a_region_beside_another_thread_s_says_its_figures_hold_that_work() -> None:
    import threading

    from memlab.region.overlap import NOTE

    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        with memlab.track("cpu"):
            inside.set()
            done.wait(30)

    worker = threading.Thread(target=other)
    worker.start()
    inside.wait(30)
    with memlab.track("cpu") as mine:
        torch.ones(10)
    done.set()
    worker.join(30)
    assert NOTE in mine.report.notes
    with memlab.track("cpu") as alone:
        torch.ones(10)
    assert NOTE not in alone.report.notes


def test_the_panel_refuses_a_config_its_controls_cannot_hold() -> None:
    from memlab.step import RunConfig

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))

    data = lambda b: torch.randn(b, 4)  # noqa: E731
    with pytest.raises(WhatIfError, match=r"cannot hold checkpoint=\('0',\) \(the panel shows"):
        memlab.Explorer(model, data, config=RunConfig(checkpoint=("0",)))
    with pytest.raises(WhatIfError, match=r"cannot hold compile='max-autotune'"):
        memlab.Explorer(model, data, config=RunConfig(compile="max-autotune"))
    ok = memlab.Explorer(model, data, config=RunConfig(batch_size=8, amp="bf16"))
    assert ok.config.batch_size == 8 and ok.config.amp == "bf16"


def _child_before(queue: Any) -> None:
    with memlab.track("cpu") as t:
        torch.ones(10)
    queue.put((t.report.allocated_before, t.report.peak_delta))


def test_a_forked_child_measures_from_an_empty_ledger() -> None:
    import multiprocessing

    with memlab.track("cpu"):
        held = torch.ones(1_000_000)  # the parent's, in its ledger from here
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_before, args=(queue,))
    child.start()
    before, delta = queue.get(timeout=60)
    child.join(60)
    assert before < held.nbytes and delta == 40  # the parent's tensors are not the child's


def test_the_first_region_under_a_low_recursion_limit_runs() -> None:
    code = textwrap.dedent(
        """
        import sys, torch, memlab
        m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(30)])
        sys.setrecursionlimit(200)
        with memlab.track("cpu", breakdown=True) as t:
            m(torch.randn(2, 8)).sum().backward()
        print("limit", sys.getrecursionlimit(), "peak", t.report.peak_delta > 0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "limit 200 peak True" in out.stdout and "Exception in thread" not in out.stderr


def test_own_autocast_blocks_on_two_threads_leave_the_class_as_it_was() -> None:
    import threading

    from memlab.estimate.autocast import own_autocast

    cls = torch.amp.autocast_mode.autocast
    before = (cls.__init__, cls.__enter__, cls.__exit__)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def second() -> None:
        with own_autocast([]):
            b_in.set()
            a_out.wait(30)  # the first block ends while this one is open

    with own_autocast([]):
        worker = threading.Thread(target=second)
        worker.start()
        a_in.set()
        b_in.wait(30)
    a_out.set()
    worker.join(30)
    assert (cls.__init__, cls.__enter__, cls.__exit__) == before
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_a_region_whose_end_raises_is_no_longer_counted_open() -> None:
    from memlab.region import overlap

    state = {"ok": True}

    def watched() -> list[Any]:
        if not state["ok"]:
            raise NameError("name 'model' is not defined")
        return []

    with pytest.raises(NameError), memlab.track("cpu", breakdown=True, watch=watched):
        state["ok"] = False
    assert not overlap._OPEN


def test_the_panel_keeps_a_budget_given_in_bytes() -> None:
    from memlab.step import RunConfig

    for budget in (int(8e9), 1_500_000, 16 * 2**30):
        ex = memlab.Explorer(
            lambda: torch.nn.Linear(4, 4),
            lambda b: torch.randn(b, 4),
            config=RunConfig(budget=budget),
        )
        assert ex.config.budget == budget
        ex.budget.value = 2.0  # typed by the user: MiB
        assert ex.config.budget == 2 * 2**20
