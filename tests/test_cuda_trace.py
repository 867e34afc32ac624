"""The breakdown read from the CUDA allocator's log (`memlab.core.cuda_trace`), on the CPU:
settled from logs recorded on a GPU (tests/data/gpu-breakdown-*.json.gz, written by
benchmarks/bench_gpu_trace_route.py on an H200, torch 2.11) against the allocator's own
counters and the dispatch mode's breakdown of the same step, and from small logs made here."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pytest
from cuda_stand_in import replayed, stand_in

from memlab.core.categories import Category
from memlab.core.cuda_claim import ENV, why_not
from memlab.core.cuda_log import for_region
from memlab.core.cuda_settle import settle
from memlab.core.cuda_trace import active_blocks, rounded
from memlab.core.devices import resolve

DATA = Path(__file__).parent / "data"
CASES = ["resnet18", "mlp", "gpt2"]


def recorded(case: str) -> dict[str, Any]:
    with gzip.open(DATA / f"gpu-breakdown-{case}.json.gz", "rt") as f:
        return json.load(f)  # type: ignore[no-any-return]


def settled(d: dict[str, Any]) -> Any:
    named = [(a, w, Category(c)) for a, w, c in d["named"]]
    return settle(d["events"], d["before"], [tuple(b) for b in d["active_at_end"]], named)


@pytest.mark.parametrize("case", CASES)
def test_a_recorded_log_ends_at_the_allocators_figure_and_peaks_just_under_it(case: str) -> None:
    d = recorded(case)
    s = settled(d)
    truth = d["allocator"]  # max_memory_allocated() and memory_allocated() around the step
    assert s.end == truth["end"] == sum(s.at_end.values())
    # the log gives requested sizes: a large block the allocator kept whole holds a little more
    assert truth["peak"] * 0.995 <= s.peak <= truth["peak"]
    assert sum(s.at_peak.values()) == s.peak
    assert s.unplaced <= len(d["named"]) // 20


@pytest.mark.parametrize("case", CASES)
def test_saved_tensors_and_gradients_match_the_dispatch_modes_breakdown(case: str) -> None:
    d = recorded(case)
    s = settled(d)
    other = {Category(k): v for k, v in d["dispatch_mode"]["at_peak"].items()}
    blocks = s.blocks
    # the dispatch mode counts tensor bytes; the log counts blocks, each at most 511 B more
    saved = other[Category.ACTIVATION] + other[Category.KV_CACHE]  # (a cache is saved too)
    assert 0 <= s.at_peak.get(Category.ACTIVATION, 0) - saved <= 511 * blocks
    grads = other[Category.GRADIENT]
    assert 0 <= s.at_peak.get(Category.GRADIENT, 0) - grads <= 511 * blocks
    assert s.at_peak.get(Category.INPUT, 0) == other[Category.INPUT]
    # nothing of the step's is left at its end but what lasts (zero_grad freed the gradients)
    assert set(s.at_end) <= {
        Category.PARAMETER,
        Category.BUFFER,
        Category.OPTIMIZER_STATE,
        Category.INPUT,
        Category.OTHER,
    }


def test_a_loop_of_steps_logged_on_a_gpu_settles_to_the_allocator_and_the_models_shapes() -> None:
    # %%gpumem -b's benchmark cell (benchmarks/bench_cuda_log_parts.py --dump, an H200): 17
    # steps of Linear(2048, 8192) -> GELU -> Linear(8192, 2048), batch 256, SGD; each step's
    # blocks come back at the same addresses, so each address has 17 lifetimes to tell apart
    d = recorded("loop")
    s = settle(
        d["events"],
        d["before"],
        [tuple(b) for b in d["active_at_end"]],
        [(a, w, Category(c)) for a, w, c in d["named"]],
        args=[tuple(a) for a in d["args"]],
        unsaved=[tuple(u) for u in d["unsaved"]],
    )
    assert s.complete and s.unplaced == 0
    assert s.end == d["allocator"]["end"] == sum(s.at_end.values())
    assert s.peak == d["allocator"]["peak"] == sum(s.at_peak.values())
    f32, batch = 4, 256
    weights = (2048 * 8192 + 8192 + 8192 * 2048 + 2048) * f32  # (each block a multiple of 512)
    assert s.at_end[Category.PARAMETER] == s.at_peak[Category.PARAMETER] == weights
    assert s.at_peak[Category.GRADIENT] == weights  # (the peak: every gradient made, none freed)
    assert Category.GRADIENT not in s.at_end  # zero_grad(set_to_none=True)
    # saved for backward: the first Linear's output (GELU's input), GELU's output (the second
    # Linear's input) and the second Linear's output (square's input); the batch is an input
    assert s.highest[Category.ACTIVATION] == (2 * batch * 8192 + batch * 2048) * f32
    assert s.at_end[Category.INPUT] == batch * 2048 * f32


def test_the_resnet_log_names_what_the_dispatch_mode_leaves_unattributed() -> None:
    d = recorded("resnet18")
    s = settled(d)
    other = {Category(k): v for k, v in d["dispatch_mode"]["at_peak"].items()}
    # cuDNN's and cuBLAS's workspaces come through the caching allocator: the log sees them
    # (temporary while the step runs, other for the workspace kept from before)
    assert other[Category.UNATTRIBUTED] > 100 * 2**20
    named = s.at_peak[Category.TEMPORARY] + s.at_peak[Category.OTHER]
    assert named > other[Category.TEMPORARY] + 0.9 * other[Category.UNATTRIBUTED]


def ev(action: str, addr: int, size: int, t: float) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "time_us": t}


def test_roles_by_moment_priority_and_what_is_left() -> None:
    events = [
        ev("alloc", 100, 512, 10),  # a temporary
        ev("alloc", 200, 1000, 20),  # saved for backward (rounded to 1024)
        ev("free_requested", 100, 512, 30),
        ev("alloc", 100, 512, 40),  # the same address again: a gradient
        ev("free_requested", 200, 1000, 50),
        ev("alloc", 300, 4096, 60),  # named twice: the stronger role wins
    ]
    named = [
        (200, 25.0, Category.ACTIVATION),
        (100, 45.0, Category.GRADIENT),
        (300, 61.0, Category.ACTIVATION),
        (300, None, Category.PARAMETER),
        (999, 70.0, Category.INPUT),  # no block there: not placed
    ]
    s = settle(events, 2048, [(900, 2048), (100, 512), (300, 4096)], named)
    assert s.unplaced == 1 and s.blocks == 4
    at_end = {Category.OTHER: 2048, Category.GRADIENT: 512, Category.PARAMETER: 4096}
    assert s.at_end == s.at_peak == at_end and s.end == s.peak == 6656
    assert s.highest[Category.TEMPORARY] == 512 and s.highest[Category.ACTIVATION] == 1024


def test_an_older_block_kept_whole_is_freed_at_its_full_size() -> None:
    # before: a block of 2048 B handed out for 1000 B (kept whole), and 512 B that stay
    events = [ev("free_requested", 500, 1000, 10), ev("alloc", 600, 100, 20)]
    s = settle(events, 2560, [(700, 512), (600, 512)], [(700, None, Category.PARAMETER)])
    # (what the region made and kept, unnamed, is "other", as the dispatch mode says)
    assert s.end == 1024 and s.at_end == {Category.PARAMETER: 512, Category.OTHER: 512}
    assert s.peak == 2560  # the start: the freed block counted at its full 2048 B


def test_clocks_a_little_apart_still_place_a_name() -> None:
    events = [ev("alloc", 100, 512, 1000.0), ev("free_requested", 100, 512, 2000.0)]
    early = settle(events, 0, [], [(100, 995.0, Category.ACTIVATION)])  # 5 µs before its alloc
    assert early.unplaced == 0 and early.highest[Category.ACTIVATION] == 512
    late = settle(events, 0, [], [(100, 2100.0, Category.ACTIVATION)])  # well after its free
    assert late.unplaced == 1


def test_rounding_and_active_blocks() -> None:
    assert [rounded(n) for n in (0, 1, 512, 513, 1024)] == [512, 512, 512, 1024, 1024]
    snapshot = {
        "segments": [
            {
                "device": 0,
                "address": 4096,
                "blocks": [
                    {"size": 1024, "state": "active_allocated"},
                    {"size": 512, "state": "inactive"},
                    {"size": 2048, "state": "active_allocated"},
                ],
            },
            {
                "device": 1,
                "address": 1 << 20,
                "blocks": [{"size": 512, "state": "active_allocated"}],
            },
        ]
    }
    assert active_blocks(snapshot, 0) == [(4096, 1024), (4096 + 1536, 2048)]


def test_the_log_is_not_used_without_a_gpu_or_when_turned_off(monkeypatch: Any) -> None:
    from memlab.core import cuda_claim

    assert for_region(resolve("cpu"), True, tuple, tuple) is None
    monkeypatch.setattr(cuda_claim.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda_claim.torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert why_not() == "the cudaMallocAsync allocator keeps no history of its own"
    monkeypatch.setenv(ENV, "0")
    assert why_not() == f"{ENV}=0"


def test_only_the_call_at_the_top_goes_through_a_global_module_hook() -> None:
    import torch
    from torch.nn.modules import module as nn_module

    from memlab.core.cuda_names import Names

    seen_inside: list[int] = []

    class Probe(torch.nn.Module):
        fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen_inside.append(len(nn_module._global_forward_pre_hooks))
            if self.fail:
                raise ValueError("never")
            return x * 2

    probe = Probe()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), probe)
    before = len(nn_module._global_forward_pre_hooks)
    names = Names()
    names.arm()
    model(torch.randn(2, 4))
    model(torch.randn(2, 4))
    # inside the model's forward no global hook is in force (the fast path), and it is back after
    assert seen_inside == [before, before]
    assert len(nn_module._global_forward_pre_hooks) == before + 1
    probe.fail = True
    with pytest.raises(ValueError, match="never"):
        model(torch.randn(2, 4))
    assert len(nn_module._global_forward_pre_hooks) == before + 1  # put back after a raise too
    names.disarm()
    assert len(nn_module._global_forward_pre_hooks) == before
    assert not model._forward_hooks
    names.at_end([])
    assert names.named == []  # (CPU tensors name no CUDA block)


def test_a_module_argument_is_an_input_only_where_it_is_from_before_the_region() -> None:
    # 100: from before (an input); 200: made in the region and passed on (a checkpointed
    # block's input recomputed in backward): it keeps what it is
    events = [ev("alloc", 200, 1024, 10), ev("free_requested", 200, 1024, 50)]
    s = settle(
        events,
        512,
        [(100, 512)],
        [(200, 15.0, Category.ACTIVATION)],
        args=[(100, 12.0), (200, 20.0)],
    )
    assert s.at_peak == {Category.INPUT: 512, Category.ACTIVATION: 1024}


def test_a_graph_from_before_keeps_its_saved_blocks_activations_until_freed() -> None:
    # 100 and 300: saved by a graph built before the region; backward frees 100 at 30
    events = [ev("alloc", 200, 512, 10), ev("free_requested", 100, 1024, 30)]
    named = [(300, 5.0, Category.ACTIVATION)]  # saved again in the region: still activation
    s = settle(events, 2048, [(300, 1024), (200, 512)], named, saved_before=[100, 300])
    assert s.at_peak == {Category.ACTIVATION: 2048, Category.OTHER: 512}
    assert s.at_end == {Category.ACTIVATION: 1024, Category.OTHER: 512}


def test_a_saved_block_is_an_activation_until_its_last_saving_ends() -> None:
    # 100: saved twice, both savings over at 40 and 60 (backward), kept by the program after;
    # 200: saved once, its saving over at 35, freed at 70; 300: saved, never released
    events = [
        ev("alloc", 100, 512, 10),
        ev("alloc", 200, 512, 11),
        ev("alloc", 300, 512, 12),
        ev("alloc", 400, 4096, 50),  # a peak between the two ends of 100's savings
        ev("free_requested", 400, 4096, 55),
        ev("free_requested", 200, 512, 70),
    ]
    named = [(a, 13.0 + i, Category.ACTIVATION) for i, a in enumerate((100, 100, 200, 300))]
    unsaved = [(100, 13.0, 40.0), (200, 15.0, 35.0), (100, 14.0, 60.0)]
    s = settle(events, 0, [(100, 512), (300, 512)], named, unsaved=unsaved)
    # at the peak 100 is still saved (one saving left), 200 no longer (a temporary now)
    assert s.at_peak == {
        Category.ACTIVATION: 1024,
        Category.TEMPORARY: 4096 + 512,
    }
    assert s.at_end == {Category.ACTIVATION: 512, Category.OTHER: 512}
    assert s.highest[Category.ACTIVATION] == 1536


def test_a_log_that_lost_its_start_never_adds_up_above_the_allocator() -> None:
    # 1 GiB from before freed in the part of the log that was dropped, then 1 GiB for a while
    gib = 2**30
    events = [ev("alloc", 500, gib, 10), ev("free_requested", 500, gib, 20)]
    s = settle(events, gib, [], [], complete=False)
    assert s.peak == gib and s.end == 0
    whole = settle(events, gib, [], [])  # (had the log been whole, the start would count)
    assert whole.peak == 2 * gib


def test_a_block_freed_between_the_logs_read_and_the_ends_is_left_out_of_the_end() -> None:
    # the log says 100 is alive at the end; the allocator no longer holds it (another thread
    # freed it between the two reads)
    s = settle([ev("alloc", 100, 512, 10)], 0, [], [])
    assert s.end == 0 and s.at_end == {} and s.peak == 512


def test_a_log_with_more_from_before_than_there_was_is_read_as_cut() -> None:
    # frees of 2 KiB from before the region, where the allocator held 1 KiB at its start: the
    # log's start is not the region's (other code restarted the history inside it)
    events = [ev("free_requested", 100, 2048, 10), ev("alloc", 300, 512, 20)]
    named = [(100, -100.0, Category.GRADIENT), (300, 21.0, Category.ACTIVATION)]
    s = settle(events, 1024, [(300, 512)], named)
    assert not s.complete
    assert s.at_end == {Category.ACTIVATION: 512}
    assert s.highest.get(Category.GRADIENT) is None  # a name from before the log: dropped


def test_a_saving_over_moves_its_bytes_and_raises_the_highest() -> None:
    events = [ev("alloc", 100, 4096, 10), ev("alloc", 200, 512, 30)]
    s = settle(
        events,
        0,
        [(100, 4096), (200, 512)],
        [(100, 11.0, Category.ACTIVATION)],
        unsaved=[(100, 11.0, 20.0)],
    )
    assert s.at_end == {Category.OTHER: 4608}
    assert s.highest[Category.OTHER] == 4608  # (never under what the end holds)


def test_a_saving_ends_on_the_block_it_named_even_after_the_address_was_reused() -> None:
    # 100 saved at 11, freed at 40; the address handed out again at 41 and saved there, kept
    # to the end; the first saving's end is told at 39.5 on a clock a little behind
    events = [
        ev("alloc", 100, 512, 10),
        ev("free_requested", 100, 512, 40),
        ev("alloc", 100, 1024, 41),
    ]
    named = [(100, 11.0, Category.ACTIVATION), (100, 42.0, Category.ACTIVATION)]
    s = settle(events, 0, [(100, 1024)], named, unsaved=[(100, 11.0, 39.5)])
    assert s.at_end == {Category.ACTIVATION: 1024}


def test_a_graph_from_before_released_in_the_region_is_no_longer_an_activation_at_the_end() -> None:
    # 100: saved by an older graph, released by backward, still held (the program's input)
    s = settle([], 1024, [(100, 1024)], [], saved_before=[100], released={100})
    assert s.at_peak == {Category.ACTIVATION: 1024} and s.at_end == {Category.OTHER: 1024}


def test_a_weight_an_older_graph_saved_is_still_a_parameter_once_that_graph_is_released() -> None:
    # 100: a weight the forward of an earlier cell saved; this cell's backward released it
    named = [(100, None, Category.PARAMETER), (200, None, Category.ACTIVATION)]
    s = settle(
        [], 1536, [(100, 1024), (200, 512)], named, saved_before=[100, 200], released={100, 200}
    )
    assert s.at_end == {Category.PARAMETER: 1024, Category.OTHER: 512}
    assert s.at_peak == {Category.PARAMETER: 1024, Category.ACTIVATION: 512}


def random_region(rng: random.Random) -> tuple[list[Any], int, list[Any], dict[str, Any]]:
    """A random, consistent log: blocks from before (some freed), blocks handed out and freed
    at addresses used again, names at moments near the events, savings that end."""
    addresses = [4096 * (i + 1) for i in range(rng.randint(1, 24))]
    older = {a: rng.choice([512, 1024, 70144]) for a in rng.sample(addresses, len(addresses) // 3)}
    before = sum(older.values())
    free = [a for a in addresses if a not in older]
    live: dict[int, int] = {}
    events: list[Any] = []
    t = 1e15
    for _ in range(rng.randint(0, 50)):
        t += rng.choice([1, 7, 40])
        if free and rng.random() < 0.55:
            a = free.pop(rng.randrange(len(free)))
            live[a] = rng.choice([1, 511, 513, 2048, 1 << 20])
            events.append(ev("alloc", a, live[a], t))
        elif live or older:
            a = rng.choice([*live, *older])
            size = live.pop(a) if a in live else older.pop(a)
            events.append(ev("free_requested", a, size, t))
            free.append(a)
    alive = [(a, rounded(size)) for a, size in live.items()] + list(older.items())
    moments = [e["time_us"] + rng.choice([0, 0, -3, 5, 30]) for e in events] or [t]
    kinds = [c for c in Category if c is not Category.UNATTRIBUTED] + [Category.ACTIVATION] * 6
    named = [
        (rng.choice(addresses), rng.choice([None, *moments]), rng.choice(kinds))
        for _ in range(rng.randint(0, 40))
    ]
    unsaved = [
        (a, when, when + rng.choice([1, 60, 900]))
        for a, when, c in named
        if c is Category.ACTIVATION and when is not None and rng.random() < 0.7
    ]
    # savings whose names were let go (`Names` trims its lists apart), on any block
    unsaved += [(rng.choice(addresses), m, m + 5) for m in moments if rng.random() < 0.1]
    saved = rng.sample(addresses, min(3, len(addresses)))
    extra = {
        "args": [(rng.choice(addresses), rng.choice(moments)) for _ in range(3)],
        "saved_before": saved,
        "released": set(saved[:1]),
        "unsaved": unsaved,
    }
    return events, before, alive, {"named": named, **extra}


@pytest.mark.parametrize("seed", range(4))
def test_random_logs_add_up_at_the_peak_and_end_and_peak_where_the_totals_do(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(150):
        events, before, alive, kw = random_region(rng)
        s = settle(events, before, alive, kw.pop("named"), **kw)
        totals, sizes = [before], {}
        for e in events:  # the running total, from the log alone
            if e["action"] == "alloc":
                sizes[e["addr"]] = rounded(e["size"])
                totals.append(totals[-1] + sizes[e["addr"]])
            else:
                totals.append(totals[-1] - sizes.pop(e["addr"], rounded(e["size"])))
        assert s.complete and s.peak == max(totals) and s.end == totals[-1]
        assert sum(s.at_peak.values()) == s.peak and sum(s.at_end.values()) == s.end
        assert s.end == sum(size for _, size in alive)
        for c, v in s.highest.items():
            assert v >= s.at_peak.get(c, 0) and v >= s.at_end.get(c, 0)
        assert set(s.at_peak) | set(s.at_end) <= set(s.highest)


def test_a_saving_without_its_name_on_a_block_from_before_is_counted_once() -> None:
    # a block alive throughout, untouched by the log and unnamed, met only by a saving's end
    s = settle([], 1024, [(4096, 1024)], [], unsaved=[(4096, 0.0, 1.0)])
    assert s.end == sum(s.at_end.values()) == 1024 and s.at_end == {Category.OTHER: 1024}
    assert s.peak == sum(s.at_peak.values()) == 1024


def test_the_lifetime_that_holds_the_moment_wins_over_one_begun_just_after() -> None:
    # 100 is freed at 100 and handed out again at 110: a name at 95 is the first block's
    events = [
        ev("alloc", 100, 512, 0),
        ev("free_requested", 100, 512, 100),
        ev("alloc", 100, 1024, 110),
        ev("free_requested", 100, 1024, 500),
    ]
    s = settle(events, 0, [], [(100, 95.0, Category.GRADIENT)])
    assert s.highest.get(Category.GRADIENT) == 512
    assert s.highest.get(Category.TEMPORARY) == 1024


class FakeAllocator:
    """The seam's CUDA calls, answered as a GPU would, for the log's plumbing on a CPU."""

    def __init__(self, monkeypatch: Any, events: list[dict[str, Any]], alive: list[Any]) -> None:
        self.on = False
        self.events, self.alive = events, alive
        self.reads = 0
        stand_in(monkeypatch, self)

    def start(self, n: int) -> None:
        self.on = True

    def record(self, on: bool = True, max_entries: int = 0) -> None:
        self.on = on

    def snapshot(self) -> dict[str, Any]:
        self.reads += 1
        blocks = [{"size": size, "state": "active_allocated"} for _, size in self.alive]
        segments = [
            {"device": 0, "address": addr, "blocks": [b]}
            for (addr, _), b in zip(self.alive, blocks, strict=True)
        ]
        return {"device_traces": [self.events], "segments": segments}


class Target:
    index, name = 0, "cuda:0"


class Counters:
    class start:  # noqa: N801
        allocated = 0


def opened(monkeypatch: Any, events: list[Any], alive: list[Any]) -> tuple[Any, FakeAllocator]:
    fake = FakeAllocator(monkeypatch, events, alive)
    log = for_region([Target()], True, tuple, tuple)
    assert log is not None
    log.counters = Counters()
    log.start()
    return log, fake


def test_the_log_is_claimed_once_and_given_back_after_an_interrupted_close(
    monkeypatch: Any,
) -> None:
    from memlab.core import cuda_claim

    events = [ev("alloc", 100, 512, 1e18), ev("alloc", 200, 1024, 1e18 + 1)]
    log, fake = opened(monkeypatch, events, [(100, 512), (200, 1024)])
    assert fake.on and for_region([Target()], True, tuple, tuple) is None  # one at a time
    assert cuda_claim.why_not() == "the program records the allocator's history itself"
    calls = {"n": 0}
    real = log.names.at_end

    def interrupted(watched: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        real(watched)

    monkeypatch.setattr(log.names, "at_end", interrupted)
    with pytest.raises(KeyboardInterrupt):
        log.stop()
    assert not fake.on and not cuda_claim._OPEN  # history off and the log given back
    log.stop()  # tried again: the naming goes on, the log is not read twice
    assert calls["n"] == 2 and fake.reads == 1
    t = replayed(log.tally(True))
    assert t.at_end is not None and t.at_end[Category.OTHER] == 1536


def test_a_history_the_program_sets_inside_the_region_is_left_on(monkeypatch: Any) -> None:
    import torch

    from memlab.core import cuda_claim

    programs: list[Any] = []

    def programs_own(enabled: Any = "all", **kwargs: Any) -> None:
        programs.append(enabled)

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", programs_own)
    log, fake = opened(monkeypatch, [ev("alloc", 100, 512, 1e18)], [(100, 512)])
    torch.cuda.memory._record_memory_history(max_entries=10)  # the program's own, in the cell
    log.stop()
    assert programs == ["all"] and fake.on  # called through, and never turned off by memlab
    assert torch.cuda.memory._record_memory_history is programs_own  # (memlab's watch is gone)
    assert any("left as the program set it" in n for n in log.notes)
    tally = log.tally(True)
    t = replayed(tally)
    assert t.at_end is not None and t.at_end[Category.OTHER] == 512
    _, said = tally.later()  # (the replay's notes)
    assert any("may miss what came before" in n for n in said)  # (it may have been cut)
    assert not cuda_claim._OPEN
    log2, fake2 = opened(monkeypatch, [], [])  # a region without it: its own history goes off
    log2.stop()
    assert not fake2.on and torch.cuda.memory._record_memory_history is programs_own


def test_a_program_call_that_failed_or_a_wrapper_left_behind_takes_nothing(
    monkeypatch: Any,
) -> None:
    import gc
    import weakref

    import torch

    def programs_own(enabled: Any = "all", **kwargs: Any) -> None:
        if "bogus" in kwargs:
            raise TypeError("unexpected keyword argument 'bogus'")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", programs_own)
    log, fake = opened(monkeypatch, [ev("alloc", 100, 512, 1e18)], [(100, 512)])
    with pytest.raises(TypeError):
        torch.cuda.memory._record_memory_history(bogus=1)  # refused: nothing was set
    watching = torch.cuda.memory._record_memory_history
    torch.cuda.memory._record_memory_history = lambda *a, **k: watching(*a, **k)  # a tool's
    log.stop()
    assert not fake.on and replayed(log.tally(True)).at_end is not None  # memlab's own, turned off
    gone = weakref.ref(log)
    del log
    gc.collect()
    assert gone() is None  # (the wrapper the tool keeps holds nothing of the region's)
    watching()  # and passes calls on
    torch.cuda.memory._record_memory_history = programs_own


def test_a_log_restarted_inside_the_region_says_so(monkeypatch: Any) -> None:
    # a free of 2 KiB from before the region, where the allocator held nothing at its start
    log, _ = opened(monkeypatch, [ev("free_requested", 100, 2048, 1e18)], [])
    log.stop()
    tally = log.tally(True)
    t, said = tally.later()
    assert t.at_peak is not None and any("holds only the region's last" in n for n in said)


def test_a_log_that_cannot_be_read_never_reaches_the_users_cell(monkeypatch: Any) -> None:
    from memlab.core import _torch

    log, fake = opened(monkeypatch, [], [])

    def broken() -> dict[str, Any]:
        raise RuntimeError("the allocator said no")

    monkeypatch.setattr(_torch, "memory_snapshot", broken)
    log.stop()
    assert not fake.on and replayed(log.tally(True)).at_peak is None
    assert any("could not be read (the allocator said no)" in n for n in log.notes)


def test_a_child_forked_while_the_log_is_open_leaves_it_alone(monkeypatch: Any) -> None:
    from memlab.core import cuda_claim

    log, fake = opened(monkeypatch, [], [])
    cuda_claim._in_child()  # (what os.fork's handler runs in the child)
    assert not cuda_claim._OPEN
    log.stop()  # no CUDA call in the child
    assert fake.reads == 0


def test_the_hooks_name_savings_their_ends_parameters_gradients_and_arguments() -> None:
    import torch

    from memlab.core import _torch
    from memlab.core.cuda_names import Names
    from memlab.core.older_graphs import unpack

    names = Names()
    names.any_device = True  # (CPU tensors stand in for a GPU's here)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    names.arm()
    from torch.optim import optimizer as optim_module

    handle = optim_module.register_optimizer_step_pre_hook(names.optimizer_pre)
    _torch.push_saved_tensors_hooks(names.pack, unpack)
    try:
        y = model(x).sigmoid()  # sigmoid saves its output; linear its input and weight
        y.sum().backward()
        opt.step()
    finally:
        _torch.remove_saved_tensors_hooks(names.pack)
        handle.remove()
        names.disarm()
    ptr = y.untyped_storage().data_ptr()
    named = {(a, c) for a, _, c in names.named}
    assert (ptr, Category.ACTIVATION) in named
    assert (x.untyped_storage().data_ptr(), Category.ACTIVATION) in named  # (an input here)
    assert (model.weight.grad.untyped_storage().data_ptr(), Category.GRADIENT) in named
    assert [a for a, _ in names.args] == [x.untyped_storage().data_ptr()]
    # backward let the savings go: each saving's end is told, after its start
    saved_at = max(w for a, w, c in names.named if a == ptr and c is Category.ACTIVATION)
    ends = [w for a, _, w in names.unsaved if a == ptr]
    assert ends and min(ends) >= saved_at
    names.at_end([])  # the module called at the top and the optimizer that stepped
    for p in (model.weight, model.bias):
        assert (p.untyped_storage().data_ptr(), None, Category.PARAMETER) in names.named


def test_the_hooks_keep_no_model_or_optimizer_the_program_drops() -> None:
    """A model called at the top and an optimizer that stepped, dropped inside the region: the
    hooks hold them weakly, so that their memory is freed there (the allocator's "after"
    counts what is alive), and the end names only what is still alive."""
    import gc
    import weakref

    import torch
    from torch.optim import optimizer as optim_module

    from memlab.core.cuda_names import Names

    names = Names()
    names.any_device = True  # (CPU tensors stand in for a GPU's here)
    kept = torch.nn.Linear(4, 4)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names.arm()
    handle = optim_module.register_optimizer_step_pre_hook(names.optimizer_pre)
    try:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        names.arm()
        kept(torch.randn(2, 4))
    finally:
        handle.remove()
        names.disarm()
    gone = [weakref.ref(model), weakref.ref(opt), weakref.ref(model.weight)]
    del model, opt
    gc.collect()
    assert [r() for r in gone] == [None, None, None]
    names.named.clear()
    names.at_end([])
    assert {c for _, _, c in names.named} == {Category.PARAMETER}
    assert {a for a, _, _ in names.named} == {
        p.untyped_storage().data_ptr() for p in kept.parameters()
    }


def test_a_graph_built_under_the_log_is_walked_by_a_later_region() -> None:
    import torch

    from memlab.core import _torch, older_graphs
    from memlab.core.cuda_names import Names, log_unpack
    from memlab.core.ledger import Ledger

    if not older_graphs.raw_saved_readable():
        pytest.skip("reading a graph's saved tensors without its hooks needs PyTorch 2.11")
    names = Names()
    names.any_device = True
    x = torch.randn(64, 64, requires_grad=True)
    _torch.push_saved_tensors_hooks(names.pack, log_unpack)
    try:
        y = x.sigmoid()  # (a cell's forward under the log; its backward comes in a later cell)
    finally:
        _torch.remove_saved_tensors_hooks(names.pack)
    older_graphs.saved_by_older_graphs([y], Ledger())
    found = older_graphs.storages_saved_by([y])
    assert y.untyped_storage().data_ptr() in [s.data_ptr() for s in found]


def test_a_log_that_cannot_be_settled_leaves_the_totals_and_says_why(monkeypatch: Any) -> None:
    from memlab.core import cuda_later

    log, _ = opened(monkeypatch, [ev("alloc", 100, 512, 1e18)], [(100, 512)])
    log.stop()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("an event memlab has never seen")

    monkeypatch.setattr(cuda_later, "settle", broken)
    tally = log.tally(True)
    made, said = tally.later()
    assert made is None and replayed(tally).at_peak is None
    assert any("could not be settled" in n for n in said)
