"""Per-cell cost of %%gpumem, and how well each tool sees a short peak.

Each cell runs in a real Jupyter kernel (ipykernel, started by this script), bare and under the
tool, many times; the overhead is the difference of the medians. Targets: ≤ 0.5 ms per cell on a
GPU without --breakdown, and within noise on a cell running a ~20 ms training step. Where
installed, the same cells run under ipyexperiments' cell logger and pytorch-memlab's %%mlrun
(CUDA only).
    python benchmarks/bench_magic.py [--repeat 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from typing import Any

import torch
from common import emit, header
from IPython.core.interactiveshell import InteractiveShell

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SETUP = f"""
import torch
device = {DEVICE!r}
torch.manual_seed(0)
width = 2048 if device == "cuda" else 256
model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                            torch.nn.Linear(4 * width, width)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batch = torch.randn(256 if device == "cuda" else 64, width, device=device)
def step(n):
    for _ in range(n):
        model(batch).square().mean().backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
"""
TRANSIENT = (
    "big = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)\nbig.fill_(1)\ndel big\n"
    "small = torch.empty(32 * 2**20, dtype=torch.uint8, device=device)\nsmall.fill_(1);"
)


def timed(shell: Any, cell: str, repeat: int, read: bool = False) -> float:
    return statistics.median(timings(shell, {"": (cell, read)}, repeat)[""])


def timings(shell: Any, ways: dict[str, tuple[str, bool]], repeat: int) -> dict[str, list[float]]:
    """Wall times of each way's cell, the ways taking turns; a way that reads runs its cell
    with ``-o _memlab_r`` and reads the report's breakdown after it, inside the time."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeat):
        for name, (cell, read) in ways.items():
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                shell.run_cell(cell, store_history=True)
                if read:
                    shell.user_ns["_memlab_r"].breakdown  # noqa: B018
            times[name].append(time.perf_counter() - t0)
    return times


def calibrate_step(shell: Any) -> int:
    """How many iterations make a ~20 ms step on this machine."""
    shell.run_cell("step(3)")
    t0 = time.perf_counter()
    shell.run_cell("step(5)")
    per = (time.perf_counter() - t0) / 5
    return max(1, round(0.020 / per))


def in_kernel(argv: list[str], script: str = __file__) -> None:
    """Run ``script`` (this one by default) inside a fresh ipykernel and relay what it prints."""
    from pathlib import Path

    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        here = Path(script).resolve().parent
        code = f"import os; os.chdir({str(here)!r})\n%run {Path(script).name} --inner " + " ".join(
            argv
        )
        reply = kc.execute_interactive(
            code, timeout=1800, output_hook=lambda m: _relay(m), allow_stdin=False
        )
        if reply["content"]["status"] != "ok":
            raise SystemExit(
                f"the benchmark failed in the kernel: {reply['content'].get('evalue')}"
            )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _relay(msg: dict[str, Any]) -> None:
    if msg["msg_type"] == "stream":
        print(msg["content"]["text"], end="")
    elif msg["msg_type"] == "error":
        print("\n".join(msg["content"]["traceback"]))


def main() -> None:
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--out")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.inner:
        in_kernel([a for a in sys.argv[1:]])
        return
    shell = InteractiveShell.instance()
    shell.run_cell(SETUP)
    n = calibrate_step(shell)
    cells = {"`a = 1`": "a = 1", f"training step (`step({n})`, ~20 ms)": f"step({n})"}
    reps = {
        "`a = 1`": args.repeat,
        f"training step (`step({n})`, ~20 ms)": max(20, args.repeat // 5),
    }
    if "memlab" not in shell.extension_manager.loaded:
        shell.run_line_magic("load_ext", "memlab")
    modes = {
        "bare": ("", False),
        "%%gpumem -q": ("%%gpumem -q\n", False),
        "%%gpumem -q -b": ("%%gpumem -q -b\n", False),
        # the breakdown read after the cell: its replay waits for the first read
        "%%gpumem -q -b, breakdown read": ("%%gpumem -q -b -o _memlab_r\n", True),
    }
    results: dict[str, dict[str, float]] = {}
    for cname, cell in cells.items():
        ways = {m: (prefix + cell, read) for m, (prefix, read) in modes.items()}
        timings(shell, ways, 5)
        for m, ts in timings(shell, ways, reps[cname]).items():
            results.setdefault(cname, {})[m] = statistics.median(ts)

    # how each tool sees a 128 MiB transient (truth: peak 128 MiB above the start, 32 MiB left)
    shell.run_cell("%%gpumem -q -o r\n" + TRANSIENT)
    r = shell.user_ns["r"]
    peaks = [("memlab %%gpumem", r.peak_delta, r.allocated_delta, r.source)]
    anchors = ["pytorch-memlab %%mlrun: " + anchor_mlrun(shell)]
    ipx = anchor_ipyexperiments(shell, cells, reps, results)
    if isinstance(ipx, str):
        anchors.append("ipyexperiments: " + ipx)
    else:
        peaks.append(ipx)

    lines = header(f"%%gpumem per-cell overhead ({DEVICE})")
    names = list(next(iter(results.values())))
    lines += [
        "Median wall time of `run_cell` inside a real ipykernel; overhead is the difference "
        "from the bare cell.",
        "",
        "| cell | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    for cname, row in results.items():
        bare = row["bare"]
        cells_txt = [f"{bare * 1e3:.2f} ms"] + [
            f"{row[m] * 1e3:.2f} ms (+{(row[m] - bare) * 1e3:.2f})" for m in names[1:]
        ]
        lines.append(f"| {cname} | " + " | ".join(cells_txt) + " |")
    lines += [
        "",
        "A 128 MiB transient (allocate, touch, free, then keep 32 MiB): truth is a peak 128 MiB "
        "above the start and 32 MiB left.",
        "",
        "| tool | peak above start | left | source |",
        "| --- | ---: | ---: | --- |",
    ]
    lines += [f"| {t} | {p / 2**20:.1f} MiB | {a / 2**20:.1f} MiB | {s} |" for t, p, a, s in peaks]
    lines += ["", *(f"- {a}" for a in anchors)]
    emit(lines, args.out)


def anchor_mlrun(shell: Any) -> str:
    try:
        import pytorch_memlab  # noqa: F401
    except ImportError:
        return "not installed (pip install pytorch-memlab)"
    if not torch.cuda.is_available():
        return "measures CUDA memory only; no GPU here"
    # %%mlrun is a line profiler: it reports the memory of each line of the functions it is given
    # (-f), not a cell's peak, so it has no row in the table above
    return "profiles the lines of named functions, not a cell's peak: no row above"


def anchor_ipyexperiments(
    shell: Any, cells: dict[str, str], reps: dict[str, int], results: dict[str, dict[str, float]]
) -> tuple[str, int, int, str] | str:
    try:
        import ipyexperiments  # noqa: F401
    except ImportError:
        return "not installed (pip install ipyexperiments)"
    kind = "IPyExperimentsPytorch" if DEVICE == "cuda" else "IPyExperimentsCPU"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        shell.run_cell(f"from ipyexperiments import {kind}\nexp = {kind}()")
        for cname, cell in cells.items():
            timed(shell, cell, 5)
            results[cname]["ipyexperiments cell logger"] = timed(shell, cell, reps[cname])
        shell.run_cell(TRANSIENT)
        data = shell.user_ns["exp"].cl.data
        shell.run_cell("exp.cl.stop(); del exp")
    mem = data.gpu if DEVICE == "cuda" else data.cpu
    # its "peaked" is the excess over the cell's net growth; convert to peak above the start
    peak = mem.peaked_delta + max(0, mem.used_delta)
    src = "process RSS (psutil), polling thread" if DEVICE == "cpu" else "NVML, polling thread"
    return ("ipyexperiments cell logger", int(peak), int(mem.used_delta), src)


if __name__ == "__main__":
    main()
