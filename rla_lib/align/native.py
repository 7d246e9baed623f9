"""The aligned layer's kernel-order loops in C (kernels.c): `vector_sums.square_sum`'s Σx² and
`attention.vllm_cpu_attention`'s vLLM-CPU attention, for speed: the torch-op versions take a Python loop of small tensor
ops per element of the sum (+400% on a forward+backward at 8 layers, `benchmarks/align_overhead.py`). Same operations in
the same order, so the same bits (tests/test_native.py). `build` compiles a C file of rla's (this one, and the lab's
`rla_lib.native_kernels.c`).

Compiled once per machine with the system C compiler into `.cache/native/` (about a second). Where there is none or
the build fails (a warning says so), or with `RLA_NATIVE=0`, `library()` is None and the callers run their torch-op
loops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..paths import ROOT
from ..settings import setting

SOURCE = Path(__file__).with_name("kernels.c")
HEADER = Path(__file__).with_name("vector.h")  # what every C file of rla's includes
CACHE_DIR = ROOT / ".cache" / "native"
# No contraction of a·b + c into a fused multiply-add unless the source writes fmaf, no reassociation: the order the
# source spells is the order the bits come from. -march=native makes fmaf one instruction (else a libm call);
# no traps or errno (flags only, never values) lets floorf vectorise.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fno-math-errno",
         "-std=c11", "-shared", "-fPIC"]


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()




def build(source: Path, include: Path) -> ctypes.CDLL | None:
    """`source` compiled (with `include` on the header path), or None: no C compiler or a failed build (with a warning
    saying so), or RLA_NATIVE=0."""
    if setting("RLA_NATIVE") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        warnings.warn("rla_lib: no C compiler (cc): the kernel-order loops run as torch ops, the same bits, several "
                      "times slower. Install gcc (apt-get install gcc) for the fast path.", stacklevel=3)
        return None
    text = "\0".join([source.read_text(), HEADER.read_text(), compiler, *FLAGS, _cpu_id()])
    path = CACHE_DIR / f"{source.stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
    if not path.exists():  # built under a name of its own, then renamed: test workers or threads may build at once
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.so")
        try:
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            subprocess.run([compiler, *FLAGS, f"-I{include}", str(source), "-o", str(tmp), "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(tmp, path)
        except (OSError, subprocess.CalledProcessError) as error:
            warnings.warn(f"rla_lib: building {source.name} into {CACHE_DIR} failed, the torch-op loops run instead "
                          f"(same bits, slower):\n{getattr(error, 'stderr', None) or error}", stacklevel=3)
            return None
        finally:
            tmp.unlink(missing_ok=True)
    return ctypes.CDLL(str(path))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels of the aligned layer, or None (`build`)."""
    lib = build(SOURCE, SOURCE.parent)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.square_sum.argtypes = [ptr, i64, i64, i64, i64, ptr]
    lib.square_sum.restype = None
    lib.attention_spans.argtypes = [ptr, i64, i64, ptr]
    lib.attention_spans.restype = None
    lib.vllm_cpu_attention.argtypes = [ptr] * 7 + [i64] * 9 + [ctypes.c_float] + [ptr] * 3
    lib.vllm_cpu_attention.restype = ctypes.c_int
    return lib


@functools.cache
def pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="rla-native")


def parallel(n: int, run, grain: int = 1) -> None:
    """run(begin, end) over [0, n) split across torch's thread count, at least `grain` items a thread (ctypes releases
    the GIL during the call)."""
    threads = max(1, min(torch.get_num_threads(), n // grain))
    if threads == 1:
        return run(0, n)
    bounds = [n * i // threads for i in range(threads + 1)]
    list(pool(threads).map(run, bounds[:-1], bounds[1:]))


def square_sum(x: torch.Tensor, registers: int, width: int) -> torch.Tensor:
    """`vector_sums.square_sum` of an FP32 tensor over its last dim, in C (one thread: a single pass over memory)."""
    rows = x.detach().float().contiguous().view(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], dtype=torch.float32)
    library().square_sum(rows.data_ptr(), rows.shape[0], rows.shape[1], registers, width, out.data_ptr())
    return out.view(x.shape[:-1])



VLLM_CPU_LOOPS = ("avx512", "avx2", "amx")  # the loops of vLLM-CPU's attention kernels (kernels.c)


def vllm_cpu_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attended: torch.Tensor, scale: float,
                       weights: bool = False, loops: str = "avx512", tiles: torch.Tensor | None = None):
    """`attention._vllm_cpu_forward`'s loops in C: FP32 q (B, H, T, D), the softmax `scale`, FP32 k/v (B, KV, S, D) (KV
    divides H), `attended` (B, 1|H, T, S) bool, `loops` the vLLM-CPU kernel's (`VLLM_CPU_LOOPS`), `tiles` (B, T) the KV
    tile size of each query row (`attention.kv_tiles`; 0 or None: all keys in one tile). Returns the FP32 output before
    rounding, each row's log-sum-exp (+inf where it attends to nothing) and, with `weights`, p/Σp (B, H, T, S) (else
    None: writing it costs as much as the rest; for rows over several tiles each tile's p is relative to its own max,
    not rescaled)."""
    batch, heads, length, dim = q.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
    mask = attended.contiguous()  # bool: one byte, 0 or 1
    span = torch.empty(mask.shape[:-1] + (2,), dtype=torch.int64)
    library().attention_spans(mask.data_ptr(), mask.numel() // keys, keys, span.data_ptr())
    # the row sum's 16 lanes count from the sequence's first position (its first slot in the KV cache)
    start = span[..., 0].flatten(1).amin(1).contiguous()
    out = torch.empty(batch, heads, length, dim, dtype=torch.float32)
    logsumexp = torch.empty(batch, heads, length, dtype=torch.float32)
    p = torch.empty(batch, heads, length, keys, dtype=torch.float32) if weights else None
    tiles = None if tiles is None else tiles.to(torch.int64).expand(batch, length).contiguous()

    def run(begin, end):
        failed = library().vllm_cpu_attention(
            q.data_ptr(), key.data_ptr(), value.data_ptr(), mask.data_ptr(), span.data_ptr(), start.data_ptr(),
            None if tiles is None else tiles.data_ptr(), heads,
            kv_heads, mask.shape[1], length, keys, dim, begin, end, VLLM_CPU_LOOPS.index(loops), scale, out.data_ptr(),
            logsumexp.data_ptr(),
            None if p is None else p.data_ptr())
        if failed:
            raise MemoryError("rla_lib.align.native.vllm_cpu_attention: out of memory for its buffers")

    parallel(batch * heads, run)
    return out, logsumexp, p

