"""The native record with a breakdown and a timeline (`memlab.core.native`: record.cpp, region.py,
roles.py, breakdown.py): ``memlab.track("cpu", breakdown=True, timeline=True)`` must give the
dispatch mode's figures (``MEMLAB_NATIVE=0``) to the byte: before, after, peak, the breakdown
at the peak, at the end and each category's highest, and the timeline's running totals.

Each comparison runs the same program twice on fresh objects built the same way (same seed),
each run on a fresh process ledger of its own (neither run's storages or roles are known to the
other's ledger): first as the dispatch mode measures it, then natively.

The timelines: the phases are compared where the total went up (an allocation) only; a free is
stamped with the phase it happens in by the native record, with the phase the dispatch mode next
hears of it by the dispatch mode. Where a workload's points come in another order on the two
paths, and why, is said in `REORDERED` (then the timelines are compared run by run: the same
allocations between the same frees, see `runs`); where the dispatch mode changes what the program
allocates, in `PERTURBED_HERE`. Every other workload's timeline must be equal point for point.

Tests marked xfail(strict=True) are bugs found here: each reason says what is wrong.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import subprocess
import sys
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from test_native_record import NOT_FOLLOWED, ROUTES, WORKLOADS, hf_gpt2_step
from torch import nn

import memlab
from memlab.core import _torch, native
from memlab.core import ledger as ledger_module
from memlab.core.categories import Category
from memlab.core.ledger import default_ledger

pytestmark = pytest.mark.skipif(
    native.unavailable() is not None, reason="needs the native record (a C++ compiler)"
)

HAS_KEY = native.unavailable() is None and native.has_mode_key(native._torch_dirs()[0])


@pytest.fixture(scope="module", autouse=True)
def self_checked() -> None:
    """The record's self-check (once a process, at the first native region) has run, with
    gradients on (see test_a_first_region_under_no_grad_keeps_the_native_record): some tests
    here open their regions under torch.no_grad()."""
    with torch.enable_grad(), memlab.track("cpu"):
        pass
    assert native.unavailable() is None


# -- figures of one region, measured one way or the other ----------------------------------------


@dataclass(frozen=True)
class Figures:
    before: int
    after: int
    peak: int
    at_peak: dict[Category, int]
    at_end: dict[Category, int]
    highest: dict[Category, int]
    allocated: tuple[int, ...]
    phases: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def totals(self) -> tuple[int, int, int]:
        return (self.before, self.after, self.peak)

    def steps(self) -> list[tuple[int, str]]:
        """(bytes, phase) of each timeline point: what the total moved by, and when."""
        out, last = [], self.before
        for v, p in zip(self.allocated, self.phases, strict=True):
            out.append((v - last, p))
            last = v
        return out

    def up_phases(self) -> list[tuple[int, str]]:
        """(index, phase) of each point where the total went up (an allocation)."""
        return [(i, p) for i, (d, p) in enumerate(self.steps()) if d > 0]

    def runs(self) -> list[tuple[str, list[Any]]]:
        """The timeline as runs: each maximal run of allocations (their sizes and phases,
        sorted) and of frees (their sizes, sorted), points that moved nothing left out. Two
        timelines with the same runs have the same totals between runs, the same peak, and the
        same allocations in the same phases; only the order inside a run may differ."""
        out: list[tuple[str, list[Any]]] = []
        for d, p in self.steps():
            if d == 0:
                continue
            kind = "alloc" if d > 0 else "free"
            item = (d, p) if d > 0 else d
            if out and out[-1][0] == kind:
                out[-1][1].append(item)
            else:
                out.append((kind, [item]))
        return [(kind, sorted(items)) for kind, items in out]

    def phase_order(self) -> list[str]:
        """The phases allocations happened in, in order, repeats collapsed."""
        out: list[str] = []
        for d, p in self.steps():
            if d > 0 and (not out or out[-1] != p):
                out.append(p)
        return out


def figures_of(t: memlab.track) -> Figures:
    r = t.report
    b, tl = r.breakdown, r.timeline
    assert b is not None and tl is not None
    return Figures(
        r.allocated_before,
        r.allocated_after,
        r.peak_allocated,
        dict(b.at_peak),
        dict(b.at_end),
        dict(b.highest),
        tuple(tl.allocated),
        tuple(tl.phases),
        tuple(r.notes),
    )


def use(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next regions measure natively or with the dispatch mode, on a fresh process ledger
    (as conftest's `fresh_ledger` gives each test), from the same random numbers."""
    monkeypatch.setenv("MEMLAB_NATIVE", "1" if native_on else "0")
    gc.collect()  # the other run's objects are gone
    monkeypatch.setattr(ledger_module, "_DEFAULT", ledger_module.Ledger())
    torch.manual_seed(0)


def track(**kw: Any) -> memlab.track:
    return memlab.track("cpu", breakdown=True, timeline=True, **kw)


def check_path(t: memlab.track, native_on: bool, route: str = "dispatch key") -> None:
    """The region was measured the way asked: natively with the record's own role hooks (on
    the dispatch key's route where this PyTorch has the key), or with the dispatch mode."""
    region = t._native
    assert (region is not None) == native_on
    if region is not None:
        assert region.roles is not None  # the breakdown was the native record's
        if HAS_KEY or route != "dispatch key":
            assert native.route() == route


def sizes_of(model: nn.Module, opt: torch.optim.Optimizer, *inputs: torch.Tensor) -> dict[str, int]:
    """Bytes of the model's parameters, of the optimizer's state, and of the inputs."""
    return {
        "params": nbytes(model.parameters()),
        "state": nbytes(state_tensors(opt)),
        "x": sum(t.nbytes for t in inputs),
    }


def readable(d: dict[Category, int]) -> dict[str, int]:
    return {str(c): v for c, v in d.items()}


def assert_totals(fast: Figures, slow: Figures, what: str) -> None:
    assert fast.totals == slow.totals, f"{what}: native {fast.totals} vs dispatch {slow.totals}"


def assert_breakdown(fast: Figures, slow: Figures, what: str, perturbed: bool = False) -> None:
    """Equal categories; where the dispatch mode makes the program allocate more (`perturbed`:
    extra temporaries that come and go), the highest temporary bytes may be higher under it,
    and never lower."""
    for name in ("at_peak", "at_end", "highest"):
        a, b = dict(getattr(fast, name)), dict(getattr(slow, name))
        if perturbed and name == "highest":
            a_t, b_t = a.pop(Category.TEMPORARY, 0), b.pop(Category.TEMPORARY, 0)
            assert a_t <= b_t, f"{what}: highest temporary {a_t} natively, {b_t} otherwise"
        assert a == b, f"{what} {name}: native {readable(a)} vs dispatch mode {readable(b)}"


def assert_timeline(fast: Figures, slow: Figures, what: str, reordered: bool = False) -> None:
    assert fast.runs() == slow.runs(), f"{what}: the timelines' runs differ"
    if not reordered:
        assert fast.allocated == slow.allocated, f"{what}: the timelines differ"
        assert fast.up_phases() == slow.up_phases(), f"{what}: the allocations' phases differ"


def assert_same(fast: Figures, slow: Figures, what: str = "", reordered: bool = False) -> None:
    """The native figures equal the dispatch mode's (the timeline: see the module's doc)."""
    assert_totals(fast, slow, what)
    assert_timeline(fast, slow, what, reordered)
    assert_breakdown(fast, slow, what)


# -- 1. every workload of test_native_record ----------------------------------------------------

#: Workloads whose timeline points come in another order on the two paths (the same runs of
#: allocations between the same frees: the peak and every total between runs are the same).
#: Each reason was checked against PyTorch's own allocation record (the profiler's memory
#: events) of the same step: the native order is the allocator's.
REORDERED = {
    "lstm": "the LSTM's backward op (mkldnn_rnn_layer_backward) returns several gradients at "
    "once: the native record has them in the order the allocator made them, the dispatch mode "
    "in the order the op returns them",
    "cnn-sgd": "convolution_backward and native_batch_norm_backward return several gradients "
    "at once (the allocator's order vs the op's); and an empty tensor the step makes "
    "(aten.empty([0]): 0 bytes) is two points of the dispatch mode's timeline that move nothing "
    "(its making and its free), none of the native one's (no allocation)",
    "autocast-bf16": "autocast frees its cache of casts at exit in the order of a hash map "
    "keyed by address: the order of those frees changes from run to run, whichever path "
    "measures (and the profiler's record of two plain runs differs the same way)",
    "raising": "under a dispatch mode the failed op's two arguments are freed in the other "
    "order (the profiler's record shows it under a dispatch mode that does nothing too): the "
    "dispatch mode changes the program's order of frees",
}

#: Workloads whose program allocates more under the dispatch mode (see test_native_record's
#: PERTURBED, and `test_a_dispatch_mode_changes_what_gpt2_allocates` here): the dispatch
#: mode's timeline has extra pairs of an allocation and its free (the peak does not change here,
#: the step being warmed up), so the timelines are compared by their ends, their peaks and the
#: order of their phases.
PERTURBED_HERE = {"transformer-layer", "hf-gpt2-step"}

#: Known bugs, by workload: the test fails there (strictly: a fix makes it say so).
BUGS: dict[str, Any] = {}

#: Workloads that are not idempotent: measured on their first call (no warm-up step).
NO_WARM_UP = {"frees-of-older"}


def workload_figures(
    name: str, native_on: bool, monkeypatch: pytest.MonkeyPatch, route: str = "dispatch key"
) -> Figures:
    use(native_on, monkeypatch)
    body = WORKLOADS[name]()
    if name not in NO_WARM_UP:
        body()  # a step before: lazy state (an optimizer's moments, caches) exists already
    kept: list[Any] = []
    with track() as t:
        kept.append(body())
    check_path(t, native_on, route)
    return figures_of(t)


def _workload_params() -> list[Any]:
    return [pytest.param(n, marks=BUGS[n]) if n in BUGS else n for n in sorted(WORKLOADS)]


def _route_params() -> list[Any]:
    skip = pytest.mark.skipif(not HAS_KEY, reason="this PyTorch has no dispatch key for it")
    return [pytest.param(r, marks=skip) if r == "dispatch key" else r for r in ROUTES]


@pytest.mark.parametrize("route", _route_params(), indirect=True)
@pytest.mark.parametrize("name", _workload_params())
def test_every_workloads_breakdown_and_timeline_equal_the_dispatch_modes(
    name: str, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = workload_figures(name, False, monkeypatch)
    fast = workload_figures(name, True, monkeypatch, route)
    if name in NOT_FOLLOWED.get(route, ()):  # said instead (test_native_record's test of it)
        assert any("torch.func" in n and "MEMLAB_NATIVE=0" in n for n in fast.notes), fast
        return
    assert fast.peak > fast.before and fast.allocated  # the region allocated something
    assert_totals(fast, slow, name)
    if name in PERTURBED_HERE:
        for f in (fast, slow):
            assert max(f.allocated) == f.peak and f.allocated[-1] == f.after
        assert fast.phase_order() == slow.phase_order(), name
        assert len(fast.runs()) < len(slow.runs())  # the dispatch mode's extra pairs
    else:
        assert_timeline(fast, slow, name, reordered=name in REORDERED)
    assert_breakdown(fast, slow, name, perturbed=name in PERTURBED_HERE)


def test_a_dispatch_mode_changes_what_gpt2_allocates() -> None:
    """The evidence for hf-gpt2-step in PERTURBED_HERE: PyTorch's own allocation record of the
    same (warmed-up) step, plain and under a dispatch mode that does nothing: more allocations
    of the model's own sizes under the mode (not only 8-byte scalars), the same peak."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memlab.core.allocations import AllocationRecord

    class Nothing(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return func(*args, **(kwargs or {}))

    found = []
    for mode in (None, Nothing):
        torch.manual_seed(0)
        step = hf_gpt2_step()
        step()
        with mode() if mode else contextlib.nullcontext(), AllocationRecord() as rec:
            step()
        assert rec.result is not None
        sizes = Counter(s for _, s, _ in rec.result.events if s > 8)
        found.append((sizes, rec.result.peak))
    (plain, peak), (moded, moded_peak) = found
    extra = moded - plain
    assert extra and not (plain - moded), extra  # only more, never fewer
    assert peak == moded_peak


# -- 2. roles that cross regions ------------------------------------------------------------------


def mlp() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, torch.randn(16, 32), torch.randint(0, 4, (16,))


def nbytes(tensors: Any) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def forward_backward_step_in_three_regions(
    native_on: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Figures], dict[str, int]]:
    use(native_on, monkeypatch)
    model, opt, x, y = mlp()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # the moments exist before the regions
    opt.zero_grad(set_to_none=True)
    regions = []
    with track() as t:
        loss = nn.functional.cross_entropy(model(x), y)  # the graph stays alive
    regions.append(t)
    with track() as t:
        loss.backward()
    regions.append(t)
    with track() as t:
        opt.step()
        opt.zero_grad(set_to_none=True)
    regions.append(t)
    for t in regions:
        check_path(t, native_on)
    sizes = sizes_of(model, opt, x, y)
    return [figures_of(t) for t in regions], sizes


def test_forward_backward_and_step_in_three_regions_equal_the_dispatch_modes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow, sizes = forward_backward_step_in_three_regions(False, monkeypatch)
    fast, _ = forward_backward_step_in_three_regions(True, monkeypatch)
    for i, (f, s) in enumerate(zip(fast, slow, strict=True)):
        assert_same(f, s, f"region {i + 1}")
    forward, backward, step = fast
    # what each region must show, whichever way it is measured
    assert forward.at_end[Category.PARAMETER] == sizes["params"]
    assert forward.at_end[Category.ACTIVATION] > 0  # the graph's saved tensors, kept
    # (the moments, made before the regions, are unknown to the ledger until a region reads
    # them: the step's)
    assert Category.OPTIMIZER_STATE not in forward.at_end
    assert Category.GRADIENT not in forward.at_end
    assert backward.at_end[Category.GRADIENT] == sizes["params"]
    assert Category.ACTIVATION not in backward.at_end  # the graph was let go
    assert step.at_peak[Category.GRADIENT] == sizes["params"]
    assert Category.GRADIENT not in step.at_end  # zero_grad(set_to_none=True)
    assert step.at_end[Category.OPTIMIZER_STATE] == sizes["state"]
    assert {p for d, p in step.steps() if d > 0} == {"optimizer"}


# -- 3. a model born inside the region ------------------------------------------------------------


def model_born_in_a_region(
    native_on: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Figures], dict[str, int]]:
    use(native_on, monkeypatch)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    held: dict[str, Any] = {}

    def step() -> None:
        model, opt = held["model"], held["opt"]
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    regions = []
    with track() as t:
        torch.manual_seed(1)
        held["model"] = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        held["opt"] = torch.optim.Adam(held["model"].parameters())
        step()  # the moments are born here too
    regions.append(t)
    with track() as t:  # the same storages, touched again
        step()
    regions.append(t)
    with track() as t:  # never touched: their roles come from the ledger
        torch.ones(100).sum()
    regions.append(t)
    with torch.no_grad(), track() as t:  # read by plain ops, no module, no optimizer
        sum(v.sum() for v in [*held["model"].parameters(), *state_tensors(held["opt"])])
    regions.append(t)
    for t in regions:
        check_path(t, native_on)
    sizes = sizes_of(held["model"], held["opt"], x, y)
    return [figures_of(t) for t in regions], sizes


def test_a_model_born_in_a_region_keeps_its_roles_in_the_next_regions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow, sizes = model_born_in_a_region(False, monkeypatch)
    fast, _ = model_born_in_a_region(True, monkeypatch)
    for i, (f, s) in enumerate(zip(fast, slow, strict=True)):
        assert_same(f, s, f"region {i + 1}")
    born, again, untouched, read = fast
    assert born.before == sizes["x"]  # (found when read: the model is new memory)
    for f in fast:
        assert f.at_end[Category.PARAMETER] == sizes["params"]
        assert f.at_end[Category.OPTIMIZER_STATE] == sizes["state"]
    for f in (born, again):
        assert f.at_peak.get(Category.GRADIENT) == sizes["params"]
        assert Category.GRADIENT not in f.at_end
    assert untouched.before == untouched.after == again.after
    assert Category.INPUT not in read.at_peak  # read, but a parameter or a moment still


# -- 4. inputs, marks, phase labels, watch -------------------------------------------------------


def inputs_marks_phases_watch(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> Figures:
    use(native_on, monkeypatch)
    model = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 24))
    unused = nn.Linear(40, 40)  # watched, never called: its parameters are still parameters
    x = torch.randn(8, 24)
    with torch.no_grad(), track(inputs=[x], watch=[model, unused]) as t:
        with t.phase("prefill"):
            out = model(x)
        made = torch.randn(8, 24)  # made in the region, told to be an input
        t.mark(made, Category.INPUT)
        with t.phase("decode"):
            out = model(made + out)
    check_path(t, native_on)
    return figures_of(t)


def test_inputs_marks_phase_labels_and_watch_equal_the_dispatch_modes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = inputs_marks_phases_watch(False, monkeypatch)
    fast = inputs_marks_phases_watch(True, monkeypatch)
    assert_same(fast, slow)
    assert fast.at_end[Category.INPUT] == 8 * 24 * 4 * 2  # x and made
    params = 4 * (24 * 48 + 48 + 48 * 24 + 24 + 40 * 40 + 40)  # model's and unused's
    assert fast.at_end[Category.PARAMETER] == params
    # prefill: two linears and a relu; the mark's tensor; decode: the sum and the model again
    assert [p for _, p in fast.up_phases()] == ["prefill"] * 3 + ["other"] + ["decode"] * 4


def input_never_read(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> Figures:
    use(native_on, monkeypatch)
    x = torch.randn(300)
    with track(inputs=[x]) as t:
        torch.ones(10).sum()
    check_path(t, native_on)
    return figures_of(t)


def test_an_input_the_region_never_reads_is_an_input_on_both_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = input_never_read(False, monkeypatch)
    fast = input_never_read(True, monkeypatch)
    assert fast.at_end.get(Category.INPUT) == 1200
    assert_same(fast, slow)


# -- 5. gradient accumulation ---------------------------------------------------------------------


def accumulated(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Figures, int]:
    use(native_on, monkeypatch)
    model, opt, x, y = mlp()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with track() as t:
        for half in (x[:8], x[8:]):
            nn.functional.cross_entropy(model(half), y[:8]).backward()  # accumulates
        opt.step()
        opt.zero_grad(set_to_none=True)
    check_path(t, native_on)
    return figures_of(t), nbytes(model.parameters())


def test_gradients_accumulated_over_two_backwards_equal_the_dispatch_modes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow, params = accumulated(False, monkeypatch)
    fast, _ = accumulated(True, monkeypatch)
    assert_same(fast, slow)
    assert fast.at_peak.get(Category.GRADIENT) == slow.at_peak.get(Category.GRADIENT)
    assert fast.highest[Category.GRADIENT] == params  # one set of gradients, added into
    assert Category.GRADIENT not in fast.at_end


# -- 6. the program's own saved_tensors_hooks ----------------------------------------------------

NOT_TAGGED = "activations not tagged: the program's own saved_tensors_hooks are in force"


def with_save_on_cpu(native_on: bool, monkeypatch: pytest.MonkeyPatch, around: bool) -> Figures:
    use(native_on, monkeypatch)
    model, opt, x, y = mlp()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    hooks = torch.autograd.graph.save_on_cpu
    with hooks() if around else contextlib.nullcontext(), track() as t:
        with contextlib.nullcontext() if around else hooks():
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    check_path(t, native_on)
    return figures_of(t)


def test_the_programs_own_saved_tensor_hooks_around_the_region_are_said_on_both_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = with_save_on_cpu(False, monkeypatch, around=True)
    fast = with_save_on_cpu(True, monkeypatch, around=True)
    assert NOT_TAGGED in slow.notes and NOT_TAGGED in fast.notes, (fast.notes, slow.notes)
    assert_same(fast, slow)
    assert Category.ACTIVATION not in fast.highest  # (not tagged)


def test_the_programs_own_saved_tensor_hooks_inside_the_region_give_the_same_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """save_on_cpu entered inside the body: its hooks sit above memlab's, so the step's saved
    tensors go through the program's hooks; both paths must agree on what that means."""
    slow = with_save_on_cpu(False, monkeypatch, around=False)
    fast = with_save_on_cpu(True, monkeypatch, around=False)
    assert_same(fast, slow)
    assert fast.notes == slow.notes


# -- 7. nothing left installed --------------------------------------------------------------------


def installed(*models: nn.Module) -> dict[str, Any]:
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return {
        "models' own forward hooks": sum(
            len(k._forward_hooks) + len(k._forward_hooks_always_called)
            for model in models
            for k in model.modules()
        ),
        "forward pre-hooks": len(m._global_forward_pre_hooks),
        "forward hooks": len(m._global_forward_hooks),
        "always called": len(getattr(m, "_global_forward_hooks_always_called", {})),
        "optimizer pre-hooks": len(o._global_optimizer_pre_hooks),
        "optimizer post-hooks": len(o._global_optimizer_post_hooks),
        "saved-tensor hooks": None if top is None else top(True),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "key on": "Fake" in str(torch._C._dispatch_tls_local_include_set()),
        "phase": int(ctypes_phase()),
    }


def ctypes_phase() -> int:
    import ctypes

    lib = native.library()
    assert lib is not None
    return ctypes.c_int.in_dll(lib, "mn_py_phase").value


@pytest.mark.parametrize("ending", ["returns", "raises", "interrupted"])
def test_nothing_stays_installed_after_a_native_breakdown_region(ending: str) -> None:
    model, opt, x, y = mlp()
    before = installed(model)
    assert before["saved-tensor hooks"] is None and not before["key on"]
    seen: dict[str, Any] = {}
    exc: type[BaseException] | None = {
        "returns": None, "raises": ValueError, "interrupted": KeyboardInterrupt
    }[ending]  # fmt: skip
    t = track()
    with pytest.raises(exc) if exc else contextlib.nullcontext(), t:
        seen["inside"] = installed()
        with t.phase("prefill"):
            loss = nn.functional.cross_entropy(model(x), y)
            if exc is not None:
                raise exc("in the body")
        loss.backward()
        opt.step()
    assert t._native is not None and t._native.roles is not None
    inside = seen["inside"]
    assert inside["forward pre-hooks"] == before["forward pre-hooks"] + 1  # (it was installed)
    assert inside["optimizer post-hooks"] == before["optimizer post-hooks"] + 1
    assert inside["saved-tensor hooks"] is not None and inside["key on"] == HAS_KEY
    assert installed(model) == before
    assert t.report.breakdown is not None  # and the region still reports
    # and the next region measures natively, from a clean start
    with track() as again:
        nn.functional.cross_entropy(model(x), y).backward()
    assert again._native is not None and installed(model) == before
    assert again.report.breakdown is not None
    assert again.report.breakdown.at_end.get(Category.GRADIENT) == nbytes(model.parameters())


# -- 8. saved tensors held past their region, let go before the next -----------------------------


def graph_dropped_between(
    native_on: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Figures], dict[str, int]]:
    use(native_on, monkeypatch)
    model, opt, x, y = mlp()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with track() as first:
        loss = nn.functional.cross_entropy(model(x), y)  # its saved tensors outlive the region
    del loss  # the graph, and what it saved, let go between the regions
    with track() as second:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    check_path(first, native_on)
    check_path(second, native_on)
    sizes = sizes_of(model, opt, x, y)
    return [figures_of(first), figures_of(second)], sizes


def test_saved_tensors_let_go_between_regions_leave_the_next_regions_figures_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow, sizes = graph_dropped_between(False, monkeypatch)
    fast, _ = graph_dropped_between(True, monkeypatch)
    assert_same(fast[0], slow[0], "region 1")
    assert_same(fast[1], slow[1], "region 2")
    first, second = fast
    assert first.at_end[Category.ACTIVATION] > 0
    # the graph's memory is gone before the second region: it starts with only what is alive
    # (the parameters, the moments it reads, x and y), none of the graph
    assert second.before == sizes["params"] + sizes["state"] + sizes["x"]
    assert Category.ACTIVATION not in second.at_end


# -- other roles -------------------------------------------------------------------------------


def attention(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Figures, int]:
    use(native_on, monkeypatch)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    q = torch.randn(2, 5, 16)
    with track() as t:
        _out, _ = mha(q, q, q, need_weights=False)
    check_path(t, native_on)
    return figures_of(t), nbytes(mha.parameters())


def test_parameters_of_a_module_used_without_its_forward_are_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(Only the totals and the end are compared: the attention's in-projection makes one more
    temporary under a dispatch mode, as in PERTURBED_HERE's transformer layer, so the two paths'
    peaks, the same bytes, come at different moments, made of different categories.)"""
    slow, params = attention(False, monkeypatch)
    fast, _ = attention(True, monkeypatch)
    assert slow.at_end[Category.PARAMETER] == params  # the reference: every one of them
    assert_totals(fast, slow, "attention")
    assert fast.at_end == slow.at_end, (readable(fast.at_end), readable(slow.at_end))
    assert fast.highest[Category.PARAMETER] == slow.highest[Category.PARAMETER]


def ema_update(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Figures, int]:
    """An EMA copy of a model, updated in place: its frozen parameters are read by ops, its
    module never runs."""
    use(native_on, monkeypatch)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    ema = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)).requires_grad_(False)
    with torch.no_grad(), track() as t:
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.lerp_(p, 0.1)
    check_path(t, native_on)
    return figures_of(t), nbytes(ema.parameters())


def test_frozen_parameters_read_without_their_module_are_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow, _ = ema_update(False, monkeypatch)
    fast, _ = ema_update(True, monkeypatch)
    assert_same(fast, slow)


def test_a_first_region_under_no_grad_keeps_the_native_record() -> None:
    code = (
        "import torch, memlab\n"
        "from memlab.core import native\n"
        "with torch.no_grad(), memlab.track('cpu', breakdown=True) as t:\n"
        "    y = torch.ones(100) * 2\n"
        "with memlab.track('cpu', breakdown=True) as t2:\n"
        "    z = torch.ones(100) * 2\n"
        "print(native.unavailable())\n"
        "print(t._native is not None, t2._native is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    why, used = out.stdout.strip().splitlines()[-2:]
    assert why == "None" and used == "True True", why


@pytest.mark.parametrize("native_on", [True, False])
def test_a_breakdown_lets_torch_func_grad_run(
    native_on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.func.grad (vjp, jacrev, hessian) refuses to run under any saved-tensor hooks:
    memlab's step aside for its length (`memlab.core.transforms`), the note says what was not
    tagged, and PyTorch's context manager is its own again after the region."""
    from torch.func import grad, jacrev, vmap

    monkeypatch.setenv("MEMLAB_NATIVE", "1" if native_on else "0")
    original = torch.autograd.graph.disable_saved_tensors_hooks
    w = torch.randn(8, 8)
    with track() as t:
        g = grad(lambda v: (v @ w).relu().sum())(torch.randn(8))
        per_sample = vmap(grad(lambda v: (v @ w).relu().sum()))(torch.randn(4, 8))
        j = jacrev(lambda v: (v @ w).tanh())(torch.randn(8))
        assert torch.autograd.graph.disable_saved_tensors_hooks is not original
    assert g.shape == (8,) and per_sample.shape == (4, 8) and j.shape == (8, 8)
    assert (t._native is not None) == native_on
    assert any("torch.func transforms" in n for n in t.report.notes), t.report.notes
    assert torch.autograd.graph.disable_saved_tensors_hooks is original
    assert _torch.saved_tensors_hooks_on() is None
    # regions nested: both pairs step aside (one left in force would still refuse)
    with track() as outer, track() as inner:
        grad(lambda v: (v @ w).sum())(torch.randn(8))
    for region in (outer, inner):
        assert any("torch.func transforms" in n for n in region.report.notes)
    assert _torch.saved_tensors_hooks_on() is None
    # the program's own hooks in force: PyTorch's own error, as without memlab
    own = torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)
    with track(), own, pytest.raises(RuntimeError, match="saved tensor hooks"):
        grad(lambda v: v.sum())(torch.randn(3))


def nested(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> list[Figures]:
    """A region inside a native breakdown region: the inner one is measured by the dispatch
    mode (the record is the outer one's), from a ledger the outer one hands its storages to."""
    use(native_on, monkeypatch)
    model, opt, x, y = mlp()
    with track() as outer:
        loss = nn.functional.cross_entropy(model(x), y)
        with track() as inner:
            loss.backward()
        opt.step()
    check_path(outer, native_on)
    assert inner._native is None
    return [figures_of(outer), figures_of(inner)]


def test_a_region_nested_in_a_native_breakdown_region_sees_its_activations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow_outer, slow_inner = nested(False, monkeypatch)
    fast_outer, fast_inner = nested(True, monkeypatch)
    assert_same(fast_outer, slow_outer, "outer")
    assert fast_inner.notes == slow_inner.notes
    assert_same(fast_inner, slow_inner, "inner")


# -- 9. what a review of the record found ---------------------------------------------------------


def resized_parameter(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> Figures:
    use(native_on, monkeypatch)
    m = nn.Linear(256, 256)
    x = torch.randn(4, 256)
    with torch.no_grad():
        m(x)  # its parameters named, and known to the ledger
    with torch.no_grad(), track() as t:
        y = m(x)
        m.weight.untyped_storage().resize_(0)  # as FSDP frees a parameter between uses
    check_path(t, native_on)
    del y
    return figures_of(t)


def test_a_parameter_resized_in_place_keeps_its_role(monkeypatch: pytest.MonkeyPatch) -> None:
    fast, slow = resized_parameter(True, monkeypatch), resized_parameter(False, monkeypatch)
    assert_same(fast, slow)
    assert sum(fast.at_end.values()) == fast.after  # the rows add up to the total
    assert fast.at_peak[Category.PARAMETER] == 256 * 256 * 4 + 256 * 4


def backward_of_an_older_graph(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> Figures:
    use(native_on, monkeypatch)
    m = nn.Linear(128, 128)
    loss = m(torch.randn(8, 128)).sum()  # the forward outside any region
    other = torch.randn(16, requires_grad=True)
    with track() as t:
        (other * 2).sum()  # an op that reads a leaf of its own first
        loss.backward()
    check_path(t, native_on)
    return figures_of(t)


def test_a_backward_of_an_older_graph_names_its_gradients_after_another_leaf_was_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = backward_of_an_older_graph(True, monkeypatch)
    slow = backward_of_an_older_graph(False, monkeypatch)
    assert_same(fast, slow)
    assert fast.at_end[Category.GRADIENT] == 128 * 128 * 4 + 128 * 4


def test_a_region_nested_in_a_native_breakdown_region_counts_each_saving_once() -> None:
    x = torch.randn(64, 256)
    w = torch.randn(256, requires_grad=True)
    with track() as outer:
        with track() as inner:  # measured by the dispatch mode: the record is the outer's
            y = x * w  # saves x (and w) with the record's op
        z = y.sum()
    assert outer._native is not None and inner._native is None
    counts = [e.saved for e in default_ledger()._special.values() if e.saved]
    assert counts and max(counts) == 1, counts  # each saving once in the ledger
    assert outer.report.breakdown is not None
    assert Category.INPUT in outer.report.breakdown.at_end  # x, read, saved during the region
    del z, y


def test_saved_aliases_held_by_garbage_cycles_are_handed_over_while_the_collector_runs() -> None:
    """The aliases the record hands Python at the region's end each come with a reference of
    their own: a collection between two of them (here at every allocation) frees none."""

    class Holder:
        pass

    x = torch.randn(1000, requires_grad=True)
    threshold = gc.get_threshold()
    try:
        gc.disable()
        with track() as t:
            for _ in range(20):  # graphs held only by garbage cycles
                h = Holder()
                h.me, h.out = h, x.exp().sin()
                del h
            gc.set_threshold(1)
            gc.enable()
        assert t._native is not None
        assert (
            t.report.breakdown is not None and t.report.allocated_after >= t.report.allocated_before
        )
    finally:
        gc.set_threshold(*threshold)
        gc.enable()
    gc.collect()


def test_a_ledger_let_go_is_freed_with_its_roles() -> None:
    from memlab.core.native.roles import roles_for

    lib = native.library()
    assert lib is not None
    ledger = ledger_module.Ledger()
    roles_for(ledger, lib)
    gone = weakref.ref(ledger)
    del ledger
    gc.collect()
    assert gone() is None


def model_rebuilt_in_a_watched_region(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    use(native_on, monkeypatch)
    held = {"model": nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))}
    # as %%gpumem watches the namespace: the old model is named at the start, never read, and
    # freed in the region when its name is bound to the new one
    with track(watch=lambda: [held["model"]]) as t:
        held["model"] = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    check_path(t, native_on)
    return figures_of(t), nbytes(held["model"].parameters())


def test_a_model_rebuilt_in_a_watched_region_counts_the_old_one_until_it_is_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast, params = model_rebuilt_in_a_watched_region(True, monkeypatch)
    slow, _ = model_rebuilt_in_a_watched_region(False, monkeypatch)
    assert_same(fast, slow)
    assert fast.before == fast.after == params  # the old model, then the new one
    assert fast.at_end == {Category.PARAMETER: params}
    assert fast.peak == 2 * params  # both alive while the new one is built


# -- the breakdown's saved-tensor hooks: in C, or the op they replace ---------------------------


@pytest.mark.parametrize(
    "name", ["mlp-adamw", "checkpoint", "lists-views-inplace", "sparse", "transformer-layer"]
)
def test_the_hooks_in_c_give_the_figures_of_the_op_they_replace(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pack hook written in C (memlab.core.native.pack) and the call of memlab::saved that
    stands in until it is built tag the same savings: equal figures, the same program run the
    same way (each on a fresh ledger, so each makes its own hooks)."""
    from memlab.core import _torch
    from memlab.core.native import pack
    from memlab.core.native.roles import native_pack

    if native.unavailable() is not None or pack.wait() is not None:
        pytest.skip(f"no native record or no hooks in C here: {native.unavailable()}")

    def measured(in_c: bool) -> tuple[Figures, Any]:
        with monkeypatch.context() as m:
            if not in_c:
                m.setattr(pack, "hooks", lambda: None)
            use(True, m)
            body = WORKLOADS[name]()
            if name not in NO_WARM_UP:
                body()
            seen: list[Any] = []
            with track() as t:
                seen.append(_torch.saved_tensors_hooks_on())
                seen.append(body())
            check_path(t, True)
            return figures_of(t), seen[0]

    op, op_hooks = measured(False)
    c, c_hooks = measured(True)
    assert op_hooks is not None and c_hooks is not None
    assert getattr(op_hooks[0], "__name__", "") != "memlab_pack"  # the op's binding
    assert c_hooks[0] is pack.hooks()[0] is native_pack()  # the C function, in force
    assert_same(c, op, name)
    assert sum(c.highest.values()) > 0


def test_the_pack_hook_in_c_answers_a_wrong_argument_with_a_type_error() -> None:
    from memlab.core.native import pack

    if native.unavailable() is not None or pack.wait() is not None:
        pytest.skip("no hooks in C here")
    pack_hook, unpack_hook = pack.hooks()
    with pytest.raises(TypeError, match="takes a tensor, got str"):
        pack_hook("not a tensor")
    x = torch.ones(3)
    assert unpack_hook(x) is x
    alias = pack_hook(x)  # (outside a region: an alias, nothing logged)
    assert alias.data_ptr() == x.data_ptr() and alias is not x and not alias.requires_grad


# -- the forward phase: the outermost module's own hook says when it ends ------------------------


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if y.sum() > -1e30:  # (always)
            raise ValueError("from the model's forward")
        return y


class OddHooks(nn.Linear):
    """A module whose forward-hook dicts are not PyTorch's own type (a plain dict)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self._forward_hooks = dict(self._forward_hooks)  # type: ignore[assignment]


def phases_of(native_on: bool, monkeypatch: pytest.MonkeyPatch, make: Any) -> list[Any]:
    use(native_on, monkeypatch)
    model = make()
    x = torch.randn(3, 4, requires_grad=True)
    out: list[Any] = []
    with track() as t:
        try:
            model(x)
        except ValueError as e:
            out.append(str(e))
        after = x * 3  # outside every module: "other"
        out.append(installed(model)["models' own forward hooks"])
        after.sum().backward()
    check_path(t, native_on)
    out.append(installed(model)["models' own forward hooks"])
    fig = figures_of(t)
    out.append(fig.up_phases())
    out.append(fig.totals)
    return out


@pytest.mark.parametrize("make", [Raises, OddHooks, lambda: nn.Sequential(nn.Linear(4, 4))])
def test_the_forward_phase_ends_where_the_outermost_module_returns_or_raises(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = phases_of(False, monkeypatch, make)
    fast = phases_of(True, monkeypatch, make)
    assert fast == slow
    assert fast[-2] and {p for _, p in fast[-2]} >= {"forward", "other"}
    assert fast[-3] == 0  # no hook of ours left on the model after the region,
    assert fast[-4] == 0  # nor inside it once the forward returned or raised


def test_a_model_deep_copied_in_a_region_after_its_forward_raised_copies_no_hook_of_ours() -> None:
    model = Raises()
    with track() as t:
        with pytest.raises(ValueError):
            model(torch.randn(2, 4))
        twin = copy.deepcopy(model)  # (a hook of ours would drag memlab's objects along)
    assert t._native is not None
    assert installed(model, twin)["models' own forward hooks"] == 0


class OwnHook(nn.Module):
    """A model with a forward hook of its own that runs ops (after any global hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.register_forward_hook(lambda m, a, out: (out * 2).sum())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class CopiesItself(nn.Linear):
    """Deep-copies and pickles itself in its own forward (the hook of ours on it then)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.copies: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.copies:
            self.copies.append(copy.deepcopy(self))
            buf = io.BytesIO()
            torch.save(self, buf)
            self.copies.append(buf.getvalue())
        return super().forward(x)


class DropsHooks(nn.Linear):
    """Replaces its forward-hook dict during its forward (as a helper stripping hooks does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._forward_hooks = OrderedDict()
        return super().forward(x)


@pytest.mark.parametrize("make", [OwnHook, CopiesItself])
def test_phases_equal_the_dispatch_modes_with_a_models_own_hooks_and_copies(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = phases_of(False, monkeypatch, make)
    fast = phases_of(True, monkeypatch, make)
    assert fast == slow


def test_a_copy_taken_during_the_outermost_call_carries_nothing_of_memlabs() -> None:
    model = CopiesItself()
    with track() as t:
        model(torch.randn(2, 4))
    assert t._native is not None and installed(model)["models' own forward hooks"] == 0
    twin, pickled = model.copies
    loaded = torch.load(io.BytesIO(pickled), weights_only=False)
    for other in (twin, loaded):  # a hook that does nothing, not memlab's objects
        hooks = list(other._forward_hooks.values())
        assert all(getattr(h, "__module__", "") == "memlab.core.native.outer" for h in hooks)
        assert all(h(other, (), None) is None for h in hooks)
        other(torch.randn(2, 4))  # runs, untracked and tracked
        with track():
            other(torch.randn(2, 4))


def test_a_forward_that_replaces_its_hook_dict_does_not_leave_the_region_in_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def run(native_on: bool) -> list[tuple[int, str]]:
        use(native_on, monkeypatch)
        first, second = DropsHooks(4, 4), nn.Linear(4, 4)
        x = torch.randn(3, 4)
        with track() as t:
            first(x)
            second(x)  # the next outermost call: from here the phases are right again
            y = x * 5  # outside every module
        check_path(t, native_on)
        del y
        return figures_of(t).up_phases()

    fast = run(True)
    assert fast[-1][1] == "other" and run(False)[-1][1] == "other"


def test_a_build_of_the_hooks_in_c_under_way_never_holds_a_region_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """While the compiler runs (here a build that takes 2 s, then fails), breakdown regions
    measure with the op at once; a failed build leaves the op for good, with the reason."""
    import time

    from memlab.core.native import pack

    if native.unavailable() is not None:
        pytest.skip(f"no native record here: {native.unavailable()}")

    def slow_build() -> Any:
        time.sleep(2.0)
        raise RuntimeError("compiling the C hooks failed: (a test's)")

    fresh = {"_hooks": None, "_changed": None, "_why": None, "_tried": False, "_builder": []}
    for name, value in fresh.items():
        monkeypatch.setattr(pack, name, value)
    monkeypatch.setattr(pack, "_target", lambda: tmp_path / "not-built.so")
    monkeypatch.setattr(pack, "_build", slow_build)
    use(True, monkeypatch)
    model, _, x, y = mlp()
    took = []
    for _ in range(3):
        t0 = time.perf_counter()
        with track() as t:
            nn.functional.cross_entropy(model(x), y).backward()
        took.append(time.perf_counter() - t0)
        check_path(t, True)
        assert t.report.breakdown is not None
    assert max(took) < 1.0, took  # none waited for the 2-second build
    assert pack.hooks() is None
    assert pack.wait() == "RuntimeError: compiling the C hooks failed: (a test's)"
    assert pack.hooks() is None  # the op from here on
    with track() as t:
        nn.functional.cross_entropy(model(x), y).backward()
    assert t.report.breakdown is not None and t.report.breakdown.at_end
