"""The estimator against a real GPU: six models from torch.nn (and four from torchvision and
transformers configurations, where those are installed) in seven configurations each: the cases
of `memlab.examples.cases`.

On a machine with CUDA, each case runs twice: measured by `memlab.whatif.run` on the GPU, in a
fresh process so the allocator starts empty (a warm-up step, then the measured step, whose peak
allocated and peak reserved are the allocator's own counters), and predicted by
`memlab.estimate.estimate` for the same GPU. The table gives both and the errors, with three
reference points where they apply: the "4 × the model's size" rule of thumb for Adam training
(accelerate's estimate), PyTorch's MemTracker under FakeTensorMode (a private API: blank where it
cannot run a case), and torchinfo's "Estimated Total Size" (when torchinfo is installed).

    python benchmarks/validate_estimator.py --out benchmarks/results/estimator-gpu.md \
        --json benchmarks/results/estimator-gpu.jsonl --jobs 4 --traces /tmp/traces

Each case is a process of its own (``--jobs`` of them at once): measured on the GPU first, with
the allocator empty, then predicted. ``--json`` gets a line per case as it finishes, so a run cut
short keeps what it did (``--table-from`` makes the table from it); ``--traces`` keeps each
measured run's allocator trace, to see offline where a prediction parts from the GPU
(`memlab.estimate.trace.diff`).

Without CUDA, ``--dry-run`` prints the predictions only (a test runs it that way, to keep the
script working on machines without a GPU), and ``--repredict FILE`` predicts again every case of a
GPU run's ``--json`` file, keeping its measured figures: after a change to the estimator, the table
is brought up to date on a CPU. A case whose model is not installed here keeps the prediction made
on the GPU machine, marked † in the table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import emit, header

import memlab  # noqa: F401  (the estimator's package)
from memlab.core import _torch
from memlab.estimate import GPU, estimate
from memlab.estimate.gpus import matching
from memlab.estimate.redirect import redirected
from memlab.estimate.trace import compact, recorded
from memlab.examples.cases import CONFIGS, REBUILT, Case, case_file, installed
from memlab.examples.cases import MODELS as TORCH_NN_MODELS
from memlab.step import RunConfig, StepHooks, run
from memlab.step.model import optimizer
from memlab.step.user import loss_of

MiB = 2**20


#: The cases (memlab.examples.cases): the torch.nn models, with torchvision's and transformers'
#: added in main() where those are installed (the child process of a torch.nn case skips them).
MODELS: dict[str, Case] = dict(TORCH_NN_MODELS)

#: Models whose predictions rest in part on a rule read from their own recorded runs alone,
#: so that their rows check that rule less than the others' do: marked ¶ in the table.
OWN_EVIDENCE = {
    "resnet-50 (torchvision)": (
        "its stride-1 1×1 convolutions' cuDNN workspaces follow a rule read from its own "
        "recorded runs alone: no other recorded network has such convolutions "
        '(docs/estimator.md, "cuDNN convolution workspaces")'
    ),
}


def config(model: str, name: str) -> RunConfig | None:
    """The case's configuration, or None where it does not apply (checkpointing an LSTM)."""
    return MODELS[model].config(name)


def this_gpu() -> GPU:
    props = torch.cuda.get_device_properties(0)
    return matching(props.name, props.total_memory, props.major)


def measure(model: str, name: str, trace: Path | None = None) -> dict[str, Any]:
    """One case on the GPU, in this (fresh) process; with ``trace``, the allocator's events of
    the whole run are saved there (gzipped JSON, no stack frames), to compare offline."""
    model_fn, input_fn, _, _ = MODELS[model]
    case = config(model, name)
    assert case is not None

    def on_gpu() -> nn.Module:
        return model_fn().cuda()

    moments: dict[str, int] = {}

    def mark(moment: str) -> None:
        if trace is not None:  # where the measured step lies in the trace
            moments[moment] = recorded()

    if trace is not None:
        _torch.record_memory_history(max_entries=2_000_000)
    r = run(on_gpu, input_fn, None, case.with_(device="cuda"), hooks=StepHooks(on_measure=mark))
    if r.report is None:
        return {"error": r.error}
    got = {"peak_allocated": r.report.peak_allocated, "peak_reserved": r.report.peak_reserved}
    if trace is not None:
        snapshot = _torch.memory_snapshot()
        _torch.record_memory_history(False)
        kept = {
            "model": model,
            "config": name,
            "stats": {**got, "measured_from": moments["start"], "measured_to": moments["end"]},
            "device_traces": compact(snapshot)["device_traces"],
        }
        trace.write_bytes(gzip.compress(json.dumps(kept, separators=(",", ":")).encode(), mtime=0))
    return got


def one(model: str, name: str, dry: bool, traces: Path | None) -> dict[str, Any]:
    """One case, in a fresh process: measured first (the allocator starts empty), then
    predicted for this GPU, with the reference estimates."""
    real: dict[str, Any] = {}
    if not dry:
        trace = None if traces is None else traces / f"{case_file(model, name)}.json.gz"
        real = measure(model, name, trace)
    gpu: GPU | str = "H100 80GB" if dry else this_gpu()
    predicted = predict(model, name, gpu)
    predicted["memtracker"] = memtracker(model, name, "cpu" if dry else "cuda")
    predicted["torchinfo"] = torchinfo_total(model, name)
    return {"model": model, "config": name, "real": real, "predicted": predicted}


def predict(model: str, name: str, gpu: GPU | str) -> dict[str, Any]:
    model_fn, input_fn, _, _ = MODELS[model]
    case = config(model, name)
    assert case is not None
    try:
        e = estimate(model_fn, input_fn, None, case, gpu=gpu)
    except Exception as exc:  # a case the estimator cannot run is a row, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "peak_allocated": e.peak_allocated,
        "peak_reserved": e.peak_reserved,
        "bounds": {name: list(pair) for name, pair in e.bounds.items()},
        "causes": sorted({c.cause for c in e.causes}),
    }


def memtracker(model: str, name: str, device: str) -> int | None:
    """PyTorch's MemTracker (a private API) under FakeTensorMode: the peak of two steps of the
    case, by its own accounting, on ``device`` ("cuda" on a GPU machine; "cpu" in a dry run)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:
        return None
    case = config(model, name)
    assert case is not None
    if case.checkpoint != "off" or case.retention != "off":
        return None  # the runner's wrappers are not reproduced here
    model_fn, input_fn, batch, _ = MODELS[model]
    amp = case.amp.dtype
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), redirected(device):
            net = model_fn()
            train = case.mode == "train"
            opt = optimizer(net, case, foreach=True) if train else None  # the runner's
            tracker = MemTracker()
            tracker.track_external(net, *([opt] if opt else []))
            with tracker:
                for i in range(2):  # a warm-up step, then the step (as the runner does)
                    if i:
                        tracker.reset_mod_stats()
                    with torch.autocast(device, dtype=amp, enabled=amp is not None):
                        if train:
                            loss = loss_of(None, net(input_fn(batch)))  # the runner's default
                        else:
                            with torch.no_grad():
                                net(input_fn(batch))
                    if train and opt is not None:
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
            peak = tracker.get_tracker_snapshot("peak")
    except Exception:  # a private API: a case it cannot run is a blank, not a crash
        return None
    return int(sum(d.get("Total", 0) for d in peak.values()))


def torchinfo_total(model: str, name: str) -> int | None:
    """torchinfo's "Estimated Total Size": inputs, twice the layers' outputs, parameters."""
    try:
        import torchinfo
    except ImportError:
        return None
    model_fn, input_fn, batch, _ = MODELS[model]
    try:
        with redirected("meta"):
            net, data = model_fn(), input_fn(batch)
        stats = torchinfo.summary(net, input_data=[data], verbose=0, device="meta")
    except Exception:
        return None
    return int(stats.total_input + stats.total_output_bytes + stats.total_param_bytes)


def rule_of_thumb(model: str, name: str) -> int | None:
    """accelerate's training estimate: 4 × the fp32 model's bytes for Adam (weights, gradients,
    two moments); the model's bytes for inference. None for a model not installed here."""
    if model not in MODELS:
        return None
    with torch.device("meta"):
        size = sum(p.numel() * p.element_size() for p in MODELS[model][0]().parameters())
    if "adam" in name:
        return 4 * size
    return size if CONFIGS[name].get("mode") == "no_grad" else None


def error(predicted: int | None, real: int | None) -> float | None:
    if predicted is None or not real:
        return None
    return (predicted - real) / real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the Markdown table here")
    parser.add_argument("--json", help="write every case's figures here, one JSON line each")
    parser.add_argument("--dry-run", action="store_true", help="predictions only (no GPU needed)")
    parser.add_argument("--models", nargs="*", help="(default: every model installed)")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once, each a process")
    parser.add_argument("--traces", help="folder for each measured run's allocator trace")
    parser.add_argument("--table-from", help="only write the table, from a --json file")
    parser.add_argument(
        "--repredict", help="predict again the cases of a --json file (no GPU needed)"
    )
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--gpu", help=argparse.SUPPRESS)  # --one --repredict: the GPU's name
    args = parser.parse_args()
    if not args.one or args.one[0] not in MODELS:
        MODELS.update(installed())
    if args.repredict or (args.one and args.gpu):  # where the library is missing: the rebuild
        for name, rebuilt in REBUILT.items():
            MODELS.setdefault(name, rebuilt)
    traces = Path(args.traces) if args.traces else None
    if args.one and args.gpu:  # the child process of one case predicted again
        print(json.dumps(predict(*args.one, args.gpu)))
        return
    if args.one:  # the child process of one case
        print(json.dumps(one(*args.one, args.dry_run, traces)))
        return
    if args.repredict:
        repredict(Path(args.repredict), args.jobs, args.out, args.json)
        return
    if args.table_from:
        rows = [json.loads(line) for line in Path(args.table_from).read_text().splitlines()]
        emit(table(_in_order(rows), rows[0].get("gpu", "?"), not rows[0]["real"]), args.out)
        return
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no GPU here: use --dry-run for the predictions alone")
    gpu: GPU | str = this_gpu() if not args.dry_run else "H100 80GB"
    if traces is not None:
        traces.mkdir(parents=True, exist_ok=True)
    models = args.models or list(MODELS)
    cases = [(m, n) for m in models for n in args.configs if config(m, n) is not None]
    log = Path(args.json) if args.json else None
    if log is not None:
        log.write_text("")

    def child(case: tuple[str, str]) -> dict[str, Any]:
        command = [sys.executable, __file__, "--one", *case]
        command += ["--dry-run"] if args.dry_run else []
        command += ["--traces", str(traces)] if traces is not None else []
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = done.stdout.strip().splitlines()
        try:
            row: dict[str, Any] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            error = {"error": done.stderr.strip().splitlines()[-1:] or ["no output"]}
            row = {"model": case[0], "config": case[1], "real": error, "predicted": error}
        row["gpu"] = gpu if isinstance(gpu, str) else gpu.describe()
        return row

    # Each case is a process of its own: the GPU's allocator counters are per process, so cases
    # measured side by side do not disturb each other (the GPU has room for several).
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {pool.submit(child, case): case for case in cases}
        for future in concurrent.futures.as_completed(futures):
            row = rows[futures[future]] = future.result()
            print(row["model"], row["config"], row["real"], row["predicted"], flush=True)
            if log is not None:
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    emit(table([rows[c] for c in cases], gpu, args.dry_run), args.out)


def _in_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = {(m, n): i for i, (m, n) in enumerate(itertools.product(MODELS, CONFIGS))}
    return sorted(rows, key=lambda r: order.get((r["model"], r["config"]), len(order)))


def repredict(path: Path, jobs: int, out: str | None, log: str | None) -> None:
    """Predict again, here, every case of a GPU run's JSON lines; the measured figures and the
    reference columns stay as they were measured."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def again(row: dict[str, Any]) -> dict[str, Any]:
        if row["model"] not in MODELS:  # not installed here: the GPU machine's prediction
            return {**row, "stored": True}
        rebuilt = MODELS[row["model"]] is REBUILT.get(row["model"])
        gpu = row.get("gpu", "H100 80GB").split(" (")[0]
        command = [sys.executable, __file__, "--one", row["model"], row["config"], "--gpu", gpu]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        try:
            fresh = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            fresh = {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
        kept = {k: v for k, v in row["predicted"].items() if k in ("memtracker", "torchinfo")}
        return {**row, "predicted": {**fresh, **kept}, **({"rebuilt": True} if rebuilt else {})}

    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        rows = list(pool.map(again, rows))
    if log is not None:
        Path(log).write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = table(_in_order(rows), rows[0].get("gpu", "?"), False)
    where = (
        f"The real figures were measured on the GPU and read from `{path.name}`; the predictions "
        "were made again on the machine named above."
    )
    emit([*lines[:4], where, "", *lines[4:]], out)


def table(rows: list[dict[str, Any]], gpu: GPU | str, dry: bool) -> list[str]:
    name = gpu if isinstance(gpu, str) else gpu.describe()
    lines = header(f"The estimator against {'nothing (dry run)' if dry else name}")
    lines += [
        "| model | config | real peak alloc | predicted | error | range | real peak reserved | "
        "predicted | error | range | 4× rule error | MemTracker | error | torchinfo | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |",
    ]
    alloc_errors, reserved_errors = [], []

    def mib(n: int | None) -> str:
        return "" if n is None else f"{n / MiB:,.1f} MiB"

    def pct(x: float | None) -> str:
        return "" if x is None else f"{x:+.1%}"

    for r in rows:
        real, pred = r["real"], r["predicted"]
        ea = error(pred.get("peak_allocated"), real.get("peak_allocated"))
        er = error(pred.get("peak_reserved"), real.get("peak_reserved"))
        rule = error(rule_of_thumb(r["model"], r["config"]), real.get("peak_allocated"))
        if ea is not None:
            alloc_errors.append(abs(ea))
        if er is not None:
            reserved_errors.append(abs(er))
        mark = " †" if r.get("stored") else " ‡" if r.get("rebuilt") else ""
        mark += " ¶" if r["model"] in OWN_EVIDENCE else ""
        ra, rr = (span(pred, real, k) for k in ("peak_allocated", "peak_reserved"))
        lines.append(
            f"| {r['model']}{mark} | {r['config']} | {mib(real.get('peak_allocated'))} | "
            f"{mib(pred.get('peak_allocated')) or pred.get('error', '')} | {pct(ea)} | {ra} | "
            f"{mib(real.get('peak_reserved'))} | {mib(pred.get('peak_reserved'))} | {pct(er)} | "
            f"{rr} | "
            f"{pct(rule)} | {mib(pred.get('memtracker'))} | "
            f"{pct(error(pred.get('memtracker'), real.get('peak_allocated')))} | "
            f"{mib(pred.get('torchinfo'))} | "
            f"{pct(error(pred.get('torchinfo'), real.get('peak_allocated')))} |"
        )
    if alloc_errors:
        lines += [
            "",
            f"Peak allocated: median error {statistics.median(alloc_errors):.1%}, worst "
            f"{max(alloc_errors):.1%} (targets: 3 %, 10 %). Peak reserved: median "
            f"{statistics.median(reserved_errors):.1%} (target: 8 %).",
        ]
    lines += families(rows)
    if any(r.get("stored") for r in rows):
        lines += [
            "",
            "† predicted on the GPU machine: the model is not installed where the "
            "others were predicted again.",
        ]
    if any(r.get("rebuilt") for r in rows):
        lines += [
            "",
            "‡ predicted again with the model rebuilt from torch.nn "
            "(`memlab.examples.cases.REBUILT`): its library does not import here.",
        ]
    for model in dict.fromkeys(r["model"] for r in rows if r["model"] in OWN_EVIDENCE):
        lines += ["", f"¶ {model}: {OWN_EVIDENCE[model]}."]
    return lines


def span(pred: dict[str, Any], real: dict[str, Any], figure: str) -> str:
    """The predicted range of ``figure`` as errors against the real value ("" where exact), "✓"
    where it contains the real value."""
    bounds, truth = pred.get("bounds", {}).get(figure), real.get(figure)
    if not bounds or truth is None or bounds[0] == bounds[1]:
        return ""
    low, high = (error(b, truth) or 0.0 for b in bounds)
    inside = " ✓" if bounds[0] <= truth <= bounds[1] else ""
    return f"{low:+.1%} to {high:+.1%}{inside}"


def within(pred: dict[str, Any], real: dict[str, Any], figure: str, target: float) -> bool:
    """The prediction is within ``target`` of the real figure, or its range contains it."""
    e, truth = error(pred.get(figure), real.get(figure)), real.get(figure)
    bounds = pred.get("bounds", {}).get(figure)
    inside = bounds is not None and truth is not None and bounds[0] <= truth <= bounds[1]
    return e is not None and (abs(e) <= target or inside)


def families(rows: list[dict[str, Any]]) -> list[str]:
    """Per model: the median and worst error of each figure, and the cases that miss the
    targets (5 % allocated, 10 % reserved) outside their stated range."""
    lines = [
        "",
        "| model | cases | peak alloc median | worst | peak reserved median | worst | "
        "missed (outside 5 % / 10 % and the range) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and "peak_allocated" in r["predicted"]]
        if not mine:
            continue
        figures = []
        for figure in ("peak_allocated", "peak_reserved"):
            errs = [error(r["predicted"].get(figure), r["real"].get(figure)) for r in mine]
            found = [abs(e) for e in errs if e is not None]
            if not found:  # a dry run: nothing measured to compare with
                figures += ["—", "—"]
                continue
            figures += [f"{statistics.median(found):.1%}", f"{max(found):.1%}"]
        missed = [
            r["config"]
            for r in mine
            if r["real"].get("peak_allocated") is not None
            and (
                not within(r["predicted"], r["real"], "peak_allocated", 0.05)
                or not within(r["predicted"], r["real"], "peak_reserved", 0.10)
            )
        ]
        lines.append(
            f"| {model} | {len(mine)} | {' | '.join(figures)} | {', '.join(missed) or 'none'} |"
        )
    return lines


if __name__ == "__main__":
    main()
