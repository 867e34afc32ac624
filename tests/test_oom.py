"""An out-of-memory explained, and ``%%gpumem --gpu`` (pre-flight on a GPU one does not have).

The explanation's figures are checked against recorded allocator state (tests/data: segments
and ``memory_stats`` of real H100 runs, and their event streams) and against tensors the tests
make; pre-flight runs in a real in-process IPython shell.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run
from IPython.core.error import UsageError

from memlab.estimate.allocator import CachingAllocator, SimulatedOutOfMemoryError, segment_size
from memlab.estimate.gpus import GPUS, parse
from memlab.estimate.oom import expandable_peak, explain, stream_levers
from memlab.estimate.trace import events_of, read
from memlab.reports.oom import LiveTensor
from memlab.reports.units import fmt_bytes

MiB, GiB = 2**20, 2**30
DATA = Path(__file__).parent / "data"
RECORDED = sorted(p for p in glob.glob(str(DATA / "trace-*.json.gz")) if "rules" not in p)


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from memlab.core import devices

    monkeypatch.setattr(devices, "_cuda_count", lambda: 0)


# -- the explanation, from recorded allocator state -------------------------------------------
@pytest.mark.parametrize("path", RECORDED, ids=lambda p: Path(p).name.split(".")[0])
def test_figures_of_a_recorded_cache_match_its_memory_stats(path: str) -> None:
    snap = read(path)
    segments, stats = snap["segments"], snap["stats"]
    e = explain(where="cuda:0", requested=64 * MiB, capacity=None, segments=segments)
    # the allocator's own counters, read on the GPU when the snapshot was taken
    assert e.allocated == stats["final_allocated"]
    assert e.reserved == stats["final_reserved"]
    blocks = [(s["segment_type"], b) for s in segments for b in s["blocks"]]
    inactive = [b["size"] for _, b in blocks if b["state"] == "inactive"]
    large = [b["size"] for kind, b in blocks if b["state"] == "inactive" and kind == "large"]
    assert e.pool == "large" and e.largest_free == max(large)
    assert e.free_in_cache == sum(inactive) == e.reserved - e.allocated
    assert e.fragmentation == pytest.approx(1 - max(large) / sum(large))


def _replay_until_oom(events: list[dict[str, Any]], capacity: int) -> tuple[int, Any]:
    model, handles, at = CachingAllocator(capacity), {}, None  # the driver's segment address
    for i, e in enumerate(events):
        try:
            if e["action"] == "segment_alloc":
                at = e["addr"]
            elif e["action"] == "alloc":
                handles[e["addr"]] = model.malloc(e["size"], e.get("stream", 0), at)
                at = None
        except SimulatedOutOfMemoryError:
            return i, model
        if e["action"] == "free_completed" and e["addr"] in handles:
            model.free(handles.pop(e["addr"]))
        elif e["action"] == "segment_free":
            model.empty_cache()
    raise AssertionError("no out-of-memory")


@pytest.mark.parametrize("name", ["trace-cnn-adam", "trace-gpt-adam", "trace-mlp-no-grad"])
def test_a_recorded_step_on_a_smaller_gpu_fails_where_the_real_allocator_grew(name: str) -> None:
    """A GPU 1 B short of the real peak reserved: the model fails at the allocation for which
    the real allocator reserved the segment that reached its peak, with the real allocator's
    reserved bytes (from the trace's own segment events) in the cache."""
    snap = read(DATA / f"{name}.json.gz")
    events = events_of(snap)
    capacity = snap["stats"]["peak_reserved"] - 1
    real, pending, truth = 0, 0, None
    for i, e in enumerate(events):
        if e["action"] == "segment_alloc":
            pending, real = e["size"], real + e["size"]
        elif e["action"] == "segment_free":
            real -= e["size"]
        elif e["action"] == "alloc":
            if pending and real > capacity:
                truth = (i, real - pending)
                break
            pending = 0
    assert truth is not None
    at, model = _replay_until_oom(events, capacity)
    e = explain(
        where="H100", requested=events[at]["size"], capacity=capacity, segments=model.segments()
    )
    assert at == truth[0]
    assert e.reserved == truth[1] == model.stats.reserved
    assert e.allocated == model.stats.allocated
    assert e.reserved + segment_size(e.requested) > capacity  # why it failed
    assert e.largest_free < e.requested  # no cached block of its pool would do
    assert e.pool == ("small" if e.requested <= MiB else "large")
    assert "requested" in e.text() and e.to_dict()["reserved"] == truth[1]


def test_fragmentation_is_named_and_expandable_segments_offered() -> None:
    """Three 6 MiB blocks per 20 MiB segment, the outer two freed: 14 MiB free per segment, in
    pieces of 6 and 8 MiB; a 9 MiB request needs a new 20 MiB segment that does not fit."""
    capacity = 100 * MiB
    model = CachingAllocator(capacity)
    stream, handles = [], []
    for serial in range(15):  # 5 segments of 20 MiB
        handles.append(model.malloc(6 * MiB))
        stream.append((serial, 6 * MiB))
    for serial in range(15):
        if serial % 3 != 1:
            model.free(handles[serial])
            stream.append((serial, -6 * MiB))
    with pytest.raises(SimulatedOutOfMemoryError):
        model.malloc(9 * MiB)
    stream.append((15, 9 * MiB))
    e = explain(where="sim", requested=9 * MiB, capacity=capacity, segments=model.segments())
    assert (e.allocated, e.reserved, e.largest_free) == (30 * MiB, 100 * MiB, 8 * MiB)
    assert e.fragmented and e.cause.startswith("fragmentation")
    assert e.fragmentation == pytest.approx(1 - 8 / 70)
    levers = stream_levers(stream, {}, capacity, fragmented=True)
    assert [lv.name for lv in levers] == ["expandable_segments"]
    # 90 MiB allocated at the peak: five 20 MiB pages; the rest never needs more
    assert levers[0].peak_reserved == expandable_peak(stream) == 100 * MiB and levers[0].fits


def test_live_tensors_are_summed_by_category_and_by_variable() -> None:
    live = [
        LiveTensor(4 * MiB, "parameter"),
        LiveTensor(3 * MiB, "activation", ("h",), 3, "h = layer(x)"),
        LiveTensor(1 * MiB, "other", ("x", "y")),
    ]
    e = explain(where="cpu", requested=MiB, capacity=None, segments=[], live=live)
    assert e.by_category == (("parameter", 4 * MiB), ("activation", 3 * MiB), ("other", MiB))
    assert e.by_name == (("h", 3 * MiB), ("x", MiB), ("y", MiB))
    assert e.biggest[0].nbytes == 4 * MiB and "line 3: h = layer(x)" in e.text()


def test_bad_gpu_specs_name_the_option_what_it_got_and_the_presets() -> None:
    assert parse("t4") is GPUS["T4"] and parse("a100 80gb") is GPUS["A100 80GB"]
    assert parse("24GiB").memory == 24 * GiB and parse("16 GB").memory == 16 * GiB
    with pytest.raises(ValueError, match=r"--gpu got 'X4': pass one of T4, L4, .*24GiB"):
        parse("X4", "--gpu")
    with pytest.raises(ValueError, match="leaves nothing after the CUDA context"):
        parse("100MiB", "--gpu")


# -- %%gpumem --gpu ----------------------------------------------------------------------------
def _preflight_text(ip: Any) -> str:
    texts = [d["text/plain"] for _, d in ip.rec.items if "pre-flight on" in d["text/plain"]]
    assert len(texts) == 1, ip.rec.items
    html = [h for h in ip.rec.html() if "memlab-preflight" in h]
    assert len(html) == 1
    return str(texts[0])


def test_a_cell_that_fits(ip: Any) -> None:
    cell = "%%gpumem --gpu T4\nx = torch.empty(3 * 2**20)\ny = x * 2\n"
    assert run(ip, cell).success
    text = _preflight_text(ip)
    assert text.startswith("pre-flight on T4 (16 GiB): fits")
    peak = re.search(r"peak reserved ([\d.]+) MiB", text)
    assert peak is not None and float(peak.group(1)) >= 24  # x and y: 12 MiB each, two segments
    assert ip.rec.kinds()[-1] == "display" and ip.rec.reports()  # the cell's report still shown


def test_a_cell_that_does_not_fit_names_the_line_and_what_holds_the_memory(ip: Any) -> None:
    cell = (
        "%%gpumem --gpu 1GiB -o pf\n"
        "a = torch.empty(200 * 2**20 // 4)\n"
        "b = torch.empty(200 * 2**20 // 4)\n"
        "c = torch.empty(200 * 2**20 // 4)\n"
        "d = 1\n"
    )
    r = run(ip, cell)
    assert r.success and ip.user_ns["d"] == 1  # the cell ran to its end on the CPU
    text = _preflight_text(ip)
    assert "would run OUT OF MEMORY at line 4" in text
    assert "line 4: c = torch.empty(200 * 2**20 // 4)" in text
    a, b = (ip.user_ns[n].untyped_storage().nbytes() for n in "ab")
    assert re.search(rf"\n  a +{a // MiB} MiB\n  b +{b // MiB} MiB\n", text)
    assert "line 2: a = torch.empty" in text and "line 3: b = torch.empty" in text
    assert "del a" in text and "once it is no longer needed, before line 4" in text
    oom = ip.user_ns["pf"].oom  # -o keeps the pre-flight
    assert not ip.user_ns["pf"].fits and oom.line == 4
    assert oom.requested == ip.user_ns["c"].untyped_storage().nbytes()
    assert dict(oom.by_name) == {"a": a, "b": b}
    assert oom.allocated >= a + b and oom.allocated + oom.requested > oom.capacity
    # the next cell runs, and memlab installed nothing that stayed
    assert run(ip, "%%gpumem -q\nz = 1").success


def test_fragmentation_in_a_cell(ip: Any) -> None:
    cell = (
        "%%gpumem --gpu 1GiB\n"
        "blocks = [torch.empty(6 * 2**20 // 4) for _ in range(75)]\n"
        "keep = blocks[1::3]\n"
        "del blocks\n"
        "big = torch.empty(9 * 2**20 // 4)\n"
    )
    assert run(ip, cell).success
    text = _preflight_text(ip)
    assert "would run OUT OF MEMORY at line 5" in text
    assert "why: fragmentation" in text and re.search(r"largest free \(large\) +8\.00 MiB", text)
    assert re.search(r"expandable_segments +\d+ MiB fits", text)


def test_a_training_step_that_does_not_fit_gets_amp_and_accumulation(ip: Any) -> None:
    cell = (
        "%%gpumem --gpu 0.75GiB\n"
        "net = torch.nn.Sequential(*[torch.nn.Linear(16, 16), torch.nn.ReLU()] * 2)\n"
        "x = torch.randn(2**20, 16)\n"
        "net(x).sum().backward()\n"
    )
    assert run(ip, cell).success
    text = _preflight_text(ip)
    assert "would run OUT OF MEMORY at line 4" in text
    assert re.search(r"activation +\d+", text) and re.search(r"parameter +1\.06 KiB", text)
    amp = re.search(r"AMP \(bf16\) +([\d.]+) MiB fits", text)
    acc = re.search(r"batch ÷ 4, accumulate 4 +([\d.]+) MiB fits", text)
    assert amp and acc and float(acc.group(1)) < float(amp.group(1))
    assert "del x" not in text  # x is saved for backward: not the user's to drop


def test_a_lost_op_withholds_the_verdict(ip: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the bookkeeping fail on one of the cell's ops (a bug of memlab's own, simulated
    by a replay that raises on the first allocation it is told of), the replay misses that
    allocation: the pre-flight says it has no verdict, never "fits"."""
    from memlab.estimate.preflight import Flight

    told = Flight.on_alloc
    calls = []

    def fails_once(self: Any, serial: int, delta: int, when: float) -> None:
        calls.append(delta)
        if len(calls) == 1:
            raise RuntimeError("the replay's own bug")
        told(self, serial, delta, when)

    monkeypatch.setattr(Flight, "on_alloc", fails_once)
    cell = "%%gpumem --gpu 1GiB -o pf\nbig = torch.empty(900 * 2**20 // 4)\nd = 1\n"
    r = run(ip, cell)
    assert r.success and ip.user_ns["d"] == 1  # the cell's own outcome is untouched
    pf = ip.user_ns["pf"]
    assert pf.lost == 1 and not pf.fits and pf.to_dict()["lost"] == 1
    text = _preflight_text(ip)
    assert "NO VERDICT: memlab lost track of 1 of this cell" in text and ": fits" not in text
    assert any(
        "the replay&#x27;s own bug" in h or "the replay's own bug" in h for h in ip.rec.reports()
    )
    monkeypatch.undo()
    assert run(ip, cell).success and ip.user_ns["pf"].lost == 0  # followed again: a verdict
    assert ip.user_ns["pf"].oom is not None  # 900 MiB on a card with 512 MiB usable


def test_bad_gpu_option_is_a_usage_error(ip: Any) -> None:
    with pytest.raises(UsageError, match=r"%gpumem --gpu got 'X4': pass one of T4"):
        ip.run_cell_magic("gpumem", "--gpu X4", "1")
    with pytest.raises(UsageError, match=r"--gpu tracks the cell on the CPU: drop -d meta"):
        ip.run_cell_magic("gpumem", "--gpu T4 -d meta", "1")


# -- an out-of-memory met in a cell -------------------------------------------------------------
def test_an_out_of_memory_in_a_cell_is_explained_before_its_traceback(
    ip: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """No GPU here: the cell raises PyTorch's error itself, and the allocator's state is a real
    H100's (recorded segments); what was live and by which variable is the tensors the cell
    made."""
    from memlab.core import cuda

    snap = read(DATA / "trace-gpt-adam.json.gz")
    capacity = snap["stats"]["final_reserved"] + 4 * MiB  # the driver has 4 MiB left
    monkeypatch.setattr(cuda, "cache_state", lambda index: (snap["segments"], capacity))
    cell = (
        "%%gpumem -b\n"
        "import weakref\n"
        "kept = torch.empty(2**20)\n"
        "def forward():\n"
        "    global probe\n"
        "    hidden = torch.empty(2**21)\n"
        "    probe = weakref.ref(hidden)\n"
        "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 40.00 MiB.')\n"
        "forward()\n"
    )
    r = run(ip, cell)
    assert isinstance(r.error_in_exec, torch.OutOfMemoryError)
    kinds = [("memlab-oom" in h, "memlab-report" in h) for h in ip.rec.html()]
    assert kinds == [(True, False), (False, True)]  # the explanation first, then the report
    text = next(d["text/plain"] for _, d in ip.rec.items if "out of memory on" in d["text/plain"])
    stats = snap["stats"]
    assert _figure(text, "allocated") == fmt_bytes(stats["final_allocated"])
    assert _figure(text, "reserved") == fmt_bytes(stats["final_reserved"])
    assert _figure(text, "kept") == fmt_bytes(ip.user_ns["kept"].untyped_storage().nbytes())
    assert "40.0 MiB requested" in text and "why: fragmentation" in text
    assert re.search(r"largest free \(large\) +20\.0 MiB", text)
    assert re.search(r"expandable_segments +\d+ MiB fits", text)
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert "raise torch.OutOfMemoryError" in out and "memlab" not in out.split("Traceback")[-1]
    assert ip.user_ns["probe"]() is None  # the failed frame's tensor is released
    assert ip.user_ns["kept"].numel() == 2**20  # the user's own variables are not
    assert run(ip, "%%gpumem -q\nafter = torch.ones(3)").success


def _figure(text: str, label: str) -> str:
    m = re.search(rf"\n  {re.escape(label)} +(\S+ \S+)", text)
    assert m is not None, f"{label} not in {text}"
    return m.group(1)


# -- a what-if run ---------------------------------------------------------------------------------
def test_a_what_if_run_that_runs_out_of_memory_explains_itself_with_the_config_levers() -> None:
    """The measured step raises PyTorch's error (no GPU here); the cache is a real H100's
    (recorded); the levers are the estimator's predictions of the changed configurations."""
    from torch import nn

    from memlab.estimate import estimate
    from memlab.estimate.levers import run_levers
    from memlab.step import RunConfig, StepHooks, run

    snap = read(DATA / "trace-mlp-sgd.json.gz")
    state = (snap["segments"], snap["stats"]["final_reserved"])  # nothing left to reserve

    def model_fn() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    def input_fn(batch: int) -> torch.Tensor:
        return torch.randn(batch, 64)

    calls = []

    def step_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if batch.device.type == "cpu":  # the estimator's predictions run on meta
            calls.append(batch.shape[0])
            if len(calls) == 2:  # the measured step, after the warm-up
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 MiB.")
        return model(batch).square().mean()

    hooks = StepHooks(on_oom=run_levers(model_fn, input_fn, step_fn=step_fn, gpu="T4", state=state))
    config = RunConfig(device="cpu", batch_size=64, optimizer="sgd")
    r = run(model_fn, input_fn, config=config, step_fn=step_fn, hooks=hooks)
    assert r.oom and r.explanation is not None and "Tried to allocate 40.00 MiB" in str(r.error)
    e = r.explanation
    assert e.allocated == snap["stats"]["final_allocated"]
    assert e.reserved == snap["stats"]["final_reserved"] and e.requested == 40 * MiB
    assert e.cause.startswith("fragmentation")  # 40 MiB free in 20 MiB pieces, none to reserve
    levers = {lv.name: lv for lv in e.levers}
    assert {"AMP (bf16)", "accumulate 2", "batch 32"} <= set(levers)
    for name, changed in (
        ("AMP (bf16)", config.with_(amp="bf16")),
        ("batch 32", config.with_(batch_size=32)),
    ):
        truth = estimate(model_fn, input_fn, None, changed, step_fn=step_fn, gpu="T4")
        assert levers[name].peak_reserved == truth.peak_reserved and levers[name].fits
    assert "out of memory on cpu: 40.0 MiB requested" in str(r)
    assert r._repr_html_().count("font-family") == 1  # the explanation inside the run's frame
    assert r.to_dict()["explanation"]["levers"][0]["name"] == e.levers[0].name


def test_a_state_with_a_fitting_free_block_says_the_cache_has_changed() -> None:
    segments = [{"total_size": 20 * MiB, "blocks": [{"size": 20 * MiB, "state": "inactive"}]}]
    e = explain(where="cuda:0", requested=20 * MiB, capacity=20 * MiB, segments=segments)
    assert e.cause.startswith("none in this state") and not e.fragmented


def test_a_long_cell_leaves_the_levers_out_and_says_so(
    ip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memlab.estimate import preflight

    monkeypatch.setattr(preflight, "MAX_LEVER_EVENTS", 10)
    cell = "%%gpumem --gpu 1GiB -q -o pf\nxs = [torch.empty(2**20) for _ in range(140)]\n"
    assert run(ip, cell).success
    oom = ip.user_ns["pf"].oom
    assert oom is not None and oom.levers == () and oom.line == 2
    assert any("levers left out: the cell made" in n for n in oom.notes)


def test_a_cell_that_raises_gets_a_verdict_up_to_there(ip: Any) -> None:
    r = run(ip, "%%gpumem --gpu T4 -o pf\nx = torch.empty(2**20)\nraise KeyboardInterrupt")
    assert isinstance(r.error_in_exec, KeyboardInterrupt)
    assert ip.user_ns["pf"].raised == "KeyboardInterrupt"
    assert "fits up to where it raised KeyboardInterrupt" in _preflight_text(ip)


def test_code_written_for_cuda_runs_on_the_cpu_under_pre_flight(ip: Any) -> None:
    cell = (
        "%%gpumem --gpu 1GiB -q -o pf\n"
        "a = torch.empty(100 * 2**20 // 4, device='cuda')\n"
        "b = torch.empty(100 * 2**20 // 4).cuda()\n"
        "c = torch.empty(400 * 2**20 // 4).to('cuda')\n"
    )
    assert run(ip, cell).success
    assert {ip.user_ns[n].device.type for n in "abc"} == {"cpu"}
    assert ip.user_ns["pf"].oom.line == 4 and dict(ip.user_ns["pf"].oom.by_name) == {
        "a": 100 * MiB,
        "b": 100 * MiB,
    }
    # the redirection ended with the cell
    assert torch.empty(1, device="meta").device.type == "meta"
    assert run(ip, "%%gpumem --gpu T4 -q\nraise ValueError('x')").error_in_exec is not None
    assert torch.empty(1, device="meta").device.type == "meta"
