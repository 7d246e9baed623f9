"""The allocator's tuning for long runs (glibc malloc): freed memory kept for the next step's large tensors instead of
returned and faulted in again (`reuse_freed_memory`, `trim_freed_memory`), and given back when asked (`release_memory`);
the environment that tunes an engine's processes alike (`KEEP_FREED_ENVIRONMENT`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import sys


# glibc's mallopt parameters (malloc.h) and their defaults
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
GLIBC_DEFAULTS = {M_TRIM_THRESHOLD: 128 * 1024, M_MMAP_MAX: 65536}
KEEP_FREED = {M_TRIM_THRESHOLD: 2**31 - 1, M_MMAP_MAX: 0}  # trim only above 2 GB free; no block on its own pages


def malloc_environment(settings: dict[int, int]) -> dict[str, str]:
    """mallopt `settings` as the variables glibc reads at a process's first malloc (for processes started later)."""
    names = {M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_", M_MMAP_MAX: "MALLOC_MMAP_MAX_"}
    return {names[parameter]: str(value) for parameter, value in settings.items()}


# vLLM's engine processes': freed memory kept, and their heap backed by transparent huge pages where the kernel gives
# them on request (THP "madvise"; glibc.malloc.hugetlb asks). A weight push's repacked layers then fault in 2 MB at a
# time, not 4 KB: a push whose new layers did not fit in the kept memory took twice as long in small pages.
KEEP_FREED_ENVIRONMENT = malloc_environment(KEEP_FREED) | {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}

FREED_MEMORY_KEPT = 0.5  # freed memory kept for reuse at most, as a share of the memory in use (`trim_freed_memory`)
HEAP_GROWTH = 1.25  # the heap may grow by this factor between two trims (`trim_freed_memory`)
_heap_base: int | None = None  # bytes glibc held from the system when the heap was last checked against its bound


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _glibc():
    """glibc, where it has what `reuse_freed_memory` needs (mallopt, malloc_trim, mallinfo2: 2.33 or later), else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    if not all(hasattr(libc, name) for name in ("mallopt", "malloc_trim", "mallinfo2")):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return libc


@contextlib.contextmanager
def reuse_freed_memory():
    """Inside, glibc keeps the memory a process frees and hands it out again, as a GPU caching allocator does (call
    `trim_freed_memory` between steps to bound what it keeps); on leaving, glibc's defaults again and the kept memory
    goes back to the system (`release_memory`; a block later allocated and freed inside the heap the run grew waits
    for the next `release_memory`).

    A training step frees and allocates the same large tensors each time (the tied embedding's vocabulary-sized
    gradients, the log-softmax over the vocabulary). By default glibc gives each one back to the system when it is
    freed, and the next step faults its pages in again, zeroed, page by page (slow in a VM). The arithmetic, and so
    every bit, is unchanged; `benchmarks/grpo_step.py --allocator default` measures the difference. Elsewhere than
    glibc 2.33 or later, nothing changes."""
    global _heap_base
    libc = _glibc()
    if libc is None:
        yield
        return
    for parameter, value in KEEP_FREED.items():
        libc.mallopt(parameter, value)
    try:
        yield
    finally:
        for parameter, value in GLIBC_DEFAULTS.items():
            libc.mallopt(parameter, value)
        release_memory()
        _heap_base = None  # the heap given back: the next run's first step sets the bound afresh


def trim_freed_memory(keep: float = FREED_MEMORY_KEPT) -> None:
    """Give the freed memory glibc keeps back to the system once it is more than `keep` times the memory in use, at the
    first call and then each time the heap has grown by `HEAP_GROWTH` since the last trim. glibc before 2.38 does not
    hand a freed block to an aligned allocation (torch's) of the same size, so what `reuse_freed_memory` keeps can grow
    step after step without this bound; a GRPO step at the real shape leaves about a quarter of its memory freed,
    which the next step takes again.

    A trim between steps that found what they needed in the kept memory would undo the reuse: glibc's trim discards
    every free page, not only the heap's top, and the next step faults all of them in again (the collapse study's
    step, trimmed after every step: its whole working set, each step)."""
    global _heap_base
    libc = _glibc()
    if libc is None:
        return
    info = libc.mallinfo2()
    if _heap_base is None or info.arena > HEAP_GROWTH * _heap_base:
        if info.fordblks > keep * info.uordblks:
            libc.malloc_trim(0)
        _heap_base = libc.mallinfo2().arena


def release_memory() -> None:
    """Give freed memory back to the system between large jobs in one process: collect reference cycles, then have
    glibc return its free heap pages (a second GRPO run at the real shape otherwise found the first one's memory
    still held by the process, and was refused)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).malloc_trim(0)
