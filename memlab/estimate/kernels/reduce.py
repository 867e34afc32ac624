"""The staging buffer of CUDA's reduction kernel (``aten/src/ATen/native/cuda/Reduce.cuh``).

A sum over the leading dimensions of a tensor whose outputs lie along its last, contiguous ones
(a bias gradient: ``grad.sum(0)`` of a ``(rows, outputs)`` gradient) splits each output's rows
across several thread blocks when there are many rows and few outputs; the blocks' partial sums
go to a float32 buffer in global memory, with one 4-byte semaphore per block column, both for the
call only. Their sizes follow the kernel's launch configuration (``setReduceConfig``), which
depends on the card's number of multiprocessors. The traces agree with this rule at every such
reduction: the LSTM's head (10,000 outputs over 4,096 rows: 138,240,000 B and 316 B on an H100)
and GPT-2's biases (768, 2,304 and 3,072 outputs over 2,048 rows: 12, 36 and 48 MiB).
"""

from __future__ import annotations

import math

#: Launch constants of the kernel (Reduce.cuh): threads a block may have, the warp, the vector
#: width of the outputs, the values a thread should sum (at least, at most), threads per SM.
MAX_THREADS = 512
WARP = 32
VECTOR = 4
MIN_VALUES, MAX_VALUES = 16, 256
THREADS_PER_SM = 2048
#: Multiprocessors of the cards `memlab.estimate.GPUS` names, by the start of their name.
SMS = {"H100": 132, "H200": 132, "A100": 108, "A10": 72, "L4": 58, "T4": 40, "V100": 80}
DEFAULT_SMS = 132


def sms_of(gpu_name: str | None) -> int:
    """The multiprocessors of the card ``gpu_name`` ("H100 80GB"), or an H100's."""
    for prefix, count in SMS.items():
        if gpu_name and gpu_name.startswith(prefix):
            return count
    return DEFAULT_SMS


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def staging(rows: int, outputs: int, sms: int) -> tuple[int, int]:
    """(buffer bytes, semaphore bytes) of a float32-accumulated sum of ``rows`` rows into
    ``outputs`` contiguous outputs; (0, 0) where the kernel needs no staging."""
    if rows <= 1 or outputs <= 0:
        return 0, 0
    vec = VECTOR if outputs % VECTOR == 0 else 1
    lanes = outputs // vec
    max_threads = MAX_THREADS // vec
    width = min(_pow2_floor(lanes) if lanes < max_threads else max_threads, WARP)
    height = min(_pow2_floor(rows) if rows < max_threads else max_threads, max_threads // width)
    width = min(_pow2_floor(lanes) if lanes < max_threads else max_threads, max_threads // height)
    values = math.ceil(rows / height) if height > 1 else rows
    grid = math.ceil(lanes / width)
    target = sms * (THREADS_PER_SM // (width * height))
    if values < MAX_VALUES or grid > target:
        return 0, 0
    ctas = max(
        min(math.ceil(target / grid), math.ceil(values / MIN_VALUES)),
        math.ceil(values / MAX_VALUES),
    )
    if ctas <= 1:
        return 0, 0
    return 4 * outputs * ctas * width * vec, 4 * grid
