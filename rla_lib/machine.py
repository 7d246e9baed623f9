"""The machine a number came from: what it is, and the instruction-set level it runs as.

BF16 results depend on the CPU. torch, oneDNN, inductor's generated C++ and vLLM's own kernels each pick
code by instruction set (native BF16 dot products on AVX512-BF16 or AMX, emulation on AVX2), and each
path rounds in its own places: the same commit gives different gaps on different CPUs. So

- `machine()` says what a run used (CPU, the ISA flags that matter for BF16, the capability torch
  dispatched to, library versions); every table and cache records it (`report`, `mismatch`, `graphs`);
- `ISA_LEVELS` / `isa_environment` cap a subprocess to a lower instruction set, to study that spread on
  one machine (torch's aten kernels, inductor's code, oneDNN and vLLM's kernel library all follow);
- `python -m rla_lib.machine --level LEVEL COMMAND` runs a command so capped.

The training side's BF16 matmul is `rla_lib.bf16_matmul`'s; the allocator's tuning `rla_lib.memory`'s.
"""

from __future__ import annotations

import argparse
import functools
import getpass
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

import torch

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


BF16_MATMUL_MODES = ("auto", "native", "fp32")


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
