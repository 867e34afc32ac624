"""Building memlab's native libraries (the record, `record.cpp`; the breakdown's hooks in C,
`pack.cpp`): where each lives in the cache, and the one compile step both go through."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from memlab.core._torch_record import cxx11_abi


def torch_dirs() -> tuple[Path, Path]:
    """PyTorch's C++ headers and its libraries."""
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def compiler() -> str | None:
    cxx = os.environ.get("CXX")
    return shutil.which(cxx) if cxx else shutil.which("c++") or shutil.which("g++")


_PATHS: dict[tuple[Path, str], Path] = {}


def library_path(cache: Path, stem: str, source: Path, *also: str) -> Path:
    """Where the build of ``source`` for this PyTorch (and whatever else ``also`` names that
    the build depends on) lives in ``cache``: ``{stem}-{key}.so``."""
    found = _PATHS.get((cache, stem))
    if found is None:
        parts = [
            source.read_bytes(),
            torch.__version__.encode(),
            str(torch_dirs()[0]).encode(),
            bytes([int(cxx11_abi())]),
            *(a.encode() for a in also),
        ]
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
        found = _PATHS[(cache, stem)] = cache / f"{stem}-{key}.so"
    return found


def compile_library(
    source: Path, target: Path, flags: list[str], libs: list[str], what: str
) -> Path:
    """Compiles ``source`` into ``target`` against PyTorch's headers and libraries (``libs``:
    the ones it links beside them), through a temporary file beside it, so that a reader
    never finds a half-written library. RuntimeError naming ``what`` where it fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++, or set CXX)")
    include, lib = torch_dirs()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [
        cxx,
        "-O2",
        "-DNDEBUG",  # as PyTorch is built: some of its classes have debug-only fields
        "-shared",
        "-fPIC",
        "-std=c++17",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi())}",
        f"-I{include}",
        *flags,
        str(source),
        "-o",
        tmp,
        f"-L{lib}",
        *(f"-l{name}" for name in libs),
        f"-Wl,-rpath,{lib}",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"compiling {what} failed: {' / '.join(tail)}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
