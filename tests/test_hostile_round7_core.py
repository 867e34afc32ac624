"""Hostile inputs, round 7 (the core and the estimator): fake tensors left in a notebook after
their mode ended hold no memory; GPU sizes and workspaces out of range are refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run
from torch._subclasses.fake_tensor import FakeTensorMode

import memlab
from memlab.core.categories import Category

GiB = 1024**3


def test_a_fake_tensor_counted_under_its_mode_is_dropped_once_the_mode_ends() -> None:
    with FakeTensorMode(), memlab.track("cpu") as t:
        x = torch.empty(100_000, 10_000)
    assert t.report.allocated_delta == 4_000_000_000  # modelled, under its mode
    for breakdown in (False, True):
        with memlab.track("cpu", breakdown=breakdown) as later:
            z = torch.ones(3)
        assert later.report.allocated_before == 0 and later.report.allocated_after == 12
        del z
    del x


def test_a_subclass_whose_getattr_raises_is_still_counted() -> None:
    from memlab.core.storages import storage_of

    class Refusing(torch.Tensor):
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"no attribute {name}")

    w = torch.ones(1000).as_subclass(Refusing)
    st = storage_of(w)
    assert st is not None and st.nbytes() == 4000


def test_a_fake_tensor_left_after_its_mode_holds_no_memory() -> None:
    with FakeTensorMode():
        ff = torch.empty(100_000, 10_000)  # 4 GB on paper, nothing in memory
    with memlab.track("cpu", breakdown=True, watch=[ff]) as t:
        z = torch.ones(3)
    assert t.report.allocated_before == 0
    assert t.report.allocated_after == z.untyped_storage().nbytes() == 12


def test_under_its_mode_a_fake_tensor_still_models_the_memory() -> None:
    with FakeTensorMode(), memlab.track("cpu") as t:
        x = torch.empty(1000, 1000)
        y = x @ x
    assert t.report.allocated_delta == 2 * 4_000_000
    del x, y


def test_the_magic_does_not_count_a_notebooks_fake_tensor(ip: Any) -> None:
    run(ip, "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n    ff = torch.empty(100_000, 10_000)")  # fmt: skip
    run(ip, "%%gpumem -q -b -d cpu -o r\nx = torch.ones(3)")
    report = ip.user_ns["r"]
    assert report.allocated_before == 0 and report.allocated_after == 12


def _frames(e: BaseException) -> list[str]:
    import traceback

    return [f.filename for f in traceback.extract_tb(e.__traceback__) if "/memlab/" in f.filename]


@pytest.mark.parametrize(
    ("kwargs", "kind", "words"),
    [
        ({"gpu": "1" * 400 + "GiB"}, ValueError, "gpu got '1111"),
        ({"gpu": 10**400}, ValueError, "gpu got 100000... (401 digits) B"),
        ({"gpu": 2 * 1024**5}, ValueError, "more than any GPU holds"),
        ({"gpu": "T4", "workspace": "1GiB"}, TypeError, "workspace takes the cuBLAS workspace"),
        ({"gpu": "T4", "workspace": -1}, ValueError, "workspace got -1"),
        ({"gpu": "T4", "workspace": 10**30}, ValueError, "workspace got 100000..."),
        ({"gpu": "T4", "workspace": True}, TypeError, "not True"),
    ],
)
def test_gpu_sizes_and_workspaces_out_of_range_are_refused_by_name(
    kwargs: dict[str, Any], kind: type[Exception], words: str
) -> None:
    from memlab.estimate import estimate

    with pytest.raises(kind) as caught:
        estimate(lambda: torch.nn.Linear(8, 8), lambda b: torch.randn(b, 8), **kwargs)
    assert words in str(caught.value) and len(str(caught.value)) < 400
    assert _frames(caught.value) == []


def test_the_magics_gpu_option_refuses_a_size_past_any_gpu(ip: Any) -> None:
    result = run(ip, "%%gpumem --gpu " + "9" * 30 + "TiB\nx = torch.ones(3)")
    assert result.error_in_exec is not None or result.error_before_exec is not None
    error = result.error_in_exec or result.error_before_exec
    assert "--gpu got" in str(error) and "more than any GPU holds" in str(error)
    assert "x" not in ip.user_ns  # refused before the cell ran


def test_a_gpu_estimates_rows_add_up_per_rank_and_on_one_gpu() -> None:
    """Every category a rank holds is a row (the KV cache a causal LM returns in training
    too), the cuBLAS workspaces included: the rows add up to the total, and a DDP rank (the
    whole step and its buckets) needs more than the one GPU does."""
    transformers = pytest.importorskip("transformers")
    from memlab.core.categories import Category
    from memlab.estimate import estimate, strategies

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 100, (n, 16))
        return {"input_ids": ids, "labels": ids}

    e = estimate(lambda: transformers.GPT2LMHeadModel(cfg), batch, batch_size=2, gpu="A100 80GB")
    assert e.workspace > 0
    breakdown = e.report.breakdown
    assert breakdown is not None
    assert sum(breakdown.at_peak.values()) == e.peak_allocated
    assert sum(breakdown.at_end.values()) == e.report.allocated_after
    table = strategies(e, 8)
    for row in table.rows:
        shown = sum(row.by_category.get(c, 0) for c in table.categories)
        assert shown + row.extra == row.total
        assert row.by_category[Category.UNATTRIBUTED] == e.workspace
    assert Category.KV_CACHE in table.categories and "kv_cache" in str(table)
    assert table.rows[0].strategy == "ddp" and table.rows[0].total > e.peak_allocated
    assert str(table).count("cuBLAS workspaces") == 1  # said once, not per strategy


def test_the_pre_flights_amp_lever_predicts_the_cell_under_autocast(ip: Any) -> None:
    """A causal LM's loss: bfloat16 logits and their float32 copy need more than the float32
    logits alone. The lever replays the cell as autocast types each op, so its figure is the
    pre-flight of the same cell under autocast, not every activation halved."""
    pytest.importorskip("transformers")
    run(ip, "from transformers import GPT2Config, GPT2LMHeadModel\n"
            "cfg = GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=8000, n_positions=128)\n"
            "ids = torch.randint(0, 8000, (4, 128))")  # fmt: skip
    step = (
        "model = GPT2LMHeadModel(cfg).to('cuda')\n{}loss = model(input_ids=ids, labels=ids).loss\n"
    )
    run(ip, "%%gpumem --gpu 0.53GiB -q -o plain\n" + step.format(""))
    plain = ip.user_ns["plain"]
    assert plain.oom is not None  # (the levers come with an out-of-memory)
    (amp,) = [lever for lever in plain.oom.levers if lever.name == "AMP (bf16)"]
    run(ip, "del model, loss")
    cast = "with torch.autocast('cuda', dtype=torch.bfloat16):\n    "
    run(ip, "%%gpumem --gpu 0.53GiB -q -o under\n" + step.format(cast))
    under = ip.user_ns["under"]
    assert under.peak_reserved > plain.peak_reserved  # the logits' float32 copy
    assert amp.peak_reserved == under.peak_reserved
    assert amp.fits is False


def test_a_ledger_from_an_earlier_import_is_named_as_such() -> None:
    stale = type("Ledger", (), {"__module__": "memlab.core.ledger"})()  # as a re-import leaves
    with pytest.raises(TypeError, match="a Ledger from an earlier import of memlab"):
        memlab.track("cpu", ledger=stale)


def test_a_namespace_of_very_many_tensors_is_looked_at_over_several_cells(
    ip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each cell registers at most MAX_FRESH of the notebook's new tensors (here 100 of 250),
    says how many names wait, and the next cells take the rest: no first cell held for
    seconds by a namespace of 200,000 tensors, and in the end every tensor is counted."""
    from memlab.magic import namespace

    monkeypatch.setattr(namespace, "MAX_FRESH", 100)
    run(ip, "for i in range(250): globals()[f'many{i}'] = torch.ones(1)")
    befores, waiting = [], []
    for _ in range(4):
        run(ip, "%%gpumem -d cpu -q -o r\nx = torch.ones(3)")
        r = ip.user_ns["r"]
        befores.append(r.allocated_before)
        waiting.append(any("not looked at yet" in n for n in r.notes))
    assert befores[0] <= 100 * 4 + 12 < befores[1] and befores[-1] == 250 * 4 + 12
    assert waiting[:2] == [True, True] and waiting[-1] is False


def test_a_pre_flight_answers_torch_cudas_everyday_calls_from_the_simulated_gpu(ip: Any) -> None:
    originals = {n: getattr(torch.cuda, n) for n in ("synchronize", "memory_allocated")}
    result = run(
        ip,
        "%%gpumem --gpu T4 -q -o pf\n"
        "x = torch.randn(1024, 1024, device='cuda')\n"
        "torch.cuda.synchronize(); torch.cuda.empty_cache()\n"
        "seen = (torch.cuda.memory_allocated(), torch.cuda.max_memory_reserved(),"
        " torch.cuda.mem_get_info())",
    )
    assert result.error_in_exec is None
    allocated, reserved, (free, total) = ip.user_ns["seen"]
    assert allocated == 1024 * 1024 * 4  # x, as the simulated T4 holds it
    assert reserved == ip.user_ns["pf"].peak_reserved and total == 16 * GiB
    assert free == total - 512 * 1024**2 - reserved  # (less the CUDA context's allowance)
    assert {n: getattr(torch.cuda, n) for n in originals} == originals  # put back


MLP = (
    "def block():\n    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),"
    " torch.nn.Linear(64, 16))\n"
    "net = torch.nn.Sequential(block(), block(), block()){}\nx = torch.randn(2**16, 16{})"
)
STEP = "%%gpumem --gpu {} -q -o {}\n{}loss = net.to('cuda')(x).sum()\nloss.backward()\ndel loss"


def test_the_amp_lever_through_a_backward_equals_the_step_under_autocast(ip: Any) -> None:
    run(ip, MLP.format("", ""))
    run(ip, STEP.format("600MiB", "plain", ""))
    plain = ip.user_ns["plain"]
    assert plain.oom is not None
    (amp,) = [lever for lever in plain.oom.levers if lever.name == "AMP (bf16)"]
    run(ip, "net.zero_grad(set_to_none=True)")
    cast = "with torch.autocast('cuda', dtype=torch.bfloat16):\n    "
    run(ip, STEP.format("600MiB", "under", cast))
    under = ip.user_ns["under"]
    assert under.peak_reserved < plain.peak_reserved  # here AMP helps: activations dominate
    assert amp.peak_reserved == under.peak_reserved and amp.fits is True


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float64"])
def test_no_amp_lever_where_autocast_would_change_nothing(ip: Any, dtype: str) -> None:
    """A model in bfloat16 already, or in float64 (autocast casts only float32): no lever."""
    run(ip, MLP.format(f".to({dtype})", f", dtype={dtype}"))
    run(ip, STEP.format("540MiB", "plain", ""))
    plain = ip.user_ns["plain"]
    assert plain.oom is not None
    assert "AMP (bf16)" not in [lever.name for lever in plain.oom.levers]


def test_a_what_if_run_leaves_out_the_tensors_a_notebook_holds(ip: Any) -> None:
    """Tensors memlab learned of in earlier cells (a dataset a %%gpumem cell watched) existed
    before the run: its figures are those of the same run with none of them around."""
    from memlab import whatif

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())

    def run_once() -> Any:
        r = whatif.run(make, lambda b: torch.randn(b, 64), device="cpu", batch_size=4)
        assert r.report is not None
        return r.report

    before = run_once()
    run(ip, "data = torch.randn(1000, 1000)")
    run(ip, "%%gpumem -d cpu -q\ny = data.sum()")  # the watch registers `data`: 4 MB
    after = run_once()
    assert (after.peak_allocated, after.allocated_before) == (
        before.peak_allocated,
        before.allocated_before,
    )
    params = sum(p.nbytes for p in make().parameters())
    assert before.breakdown is not None and after.breakdown is not None
    assert after.breakdown.at_peak[Category.PARAMETER] == params


def test_the_amp_stream_frees_an_ops_copies_after_its_output() -> None:
    """Two inputs of a float32 op cast up: both copies live until the op's output is made."""
    from memlab.core.ledger import Ledger
    from memlab.estimate.amp import _AFTER, AmpStream

    amp = AmpStream(Ledger())
    amp.events = [(1, 100, True), (2, 100, True), (-1, 200, None), (-1, -200, _AFTER)]
    amp.events += [(-2, 200, None), (-2, -200, _AFTER), (3, 50, False), (4, 8, True)]
    roles = {1: "activation", 2: "activation", 4: "temporary"}
    assert amp.stream(roles) == [
        (1, 50), (2, 50), (-1, 200), (-2, 200), (3, 50), (-1, -200), (-2, -200), (4, 4),
    ]  # fmt: skip


def test_the_amp_lever_reads_the_names_it_needs_off_memlabs_dispatch_frames() -> None:
    """The lever reads the op being dispatched from accounting's frames: a rename there must
    fail here, not leave the lever quietly wrong."""
    from memlab.estimate import amp

    assert {"func", "args", "kwargs", "started"} <= set(amp._DISPATCH.co_varnames)
    assert "t" in amp._OUTPUTS.co_varnames
