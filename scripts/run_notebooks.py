"""Execute notebooks top to bottom in fresh kernels, several at once, and save them with outputs.

    python scripts/run_notebooks.py --in-place                 # refresh the committed outputs
    python scripts/run_notebooks.py --out /tmp/run 01 02       # chapters 1 and 2, run into /tmp/run

Names are matched against the start of each file name in notebooks/ (none: every notebook). Each
notebook runs in its own kernel, in an empty temporary folder; a failed one is saved too,
with the traceback in its outputs. The script prints a line per notebook (seconds, and the
error's last line when it failed) and exits with 1 when any failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def execute(path: Path, out: Path, timeout: int) -> tuple[float, str | None]:
    """Run one notebook; save it to ``out``. (seconds, None) or (seconds, the error)."""
    nb = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    error = None
    try:
        with tempfile.TemporaryDirectory() as cwd:
            where = {"metadata": {"path": cwd}}
            NotebookClient(nb, timeout=timeout, kernel_name="python3", resources=where).execute()
    except CellExecutionError as e:
        error = str(e).strip().splitlines()[-1]
    except Exception as e:  # a dead kernel, a timeout: still a line of the report
        error = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return seconds, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebooks whose file name starts so")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--in-place", action="store_true", help="overwrite notebooks/*.ipynb")
    where.add_argument("--out", help="save the executed copies in this folder")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks run at once")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may take")
    args = parser.parse_args()
    paths = [
        p
        for p in sorted(NOTEBOOKS.glob("*.ipynb"))
        if not args.names or any(p.name.startswith(n) for n in args.names)
    ]
    if not paths:
        parser.error(f"no notebook in {NOTEBOOKS} starts with {' or '.join(args.names)}")
    target = NOTEBOOKS if args.in_place else Path(args.out)
    # kernels load memlab where the notebook says so, as a reader's do (see ipython_config.py)
    os.environ["MEMLAB_NO_AUTOLOAD"] = "1"
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = {pool.submit(execute, p, target / p.name, args.timeout): p for p in paths}
        for run in concurrent.futures.as_completed(runs):
            seconds, error = run.result()
            failed += error is not None
            status = "ok" if error is None else f"FAILED: {error}"
            print(f"{runs[run].name:45} {seconds:7.1f} s  {status}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
