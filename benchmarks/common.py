"""Shared by the benchmarks: the machine's description and a Markdown writer."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def machine() -> str:
    if torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
    else:
        dev = f"CPU only, {os.cpu_count()} cores"
    return f"{dev}; Python {platform.python_version()}; torch {torch.__version__}"


def header(title: str) -> list[str]:
    return [f"## {title}", "", f"{datetime.date.today().isoformat()} · {machine()}", ""]


def median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def under(make: Callable[[], Any], step: Callable[[], None]) -> None:
    """One step under the context ``make`` makes (None: the bare step); the making is timed
    with the step, as a user's ``with memlab.track(...):`` pays it."""
    ctx = make()
    if ctx is None:
        step()
    else:
        with ctx:
            step()


def emit(lines: list[str], out: str | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).write_text(text)
