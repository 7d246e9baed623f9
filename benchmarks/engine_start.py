"""What an engine start and stop cost, and what rla_lib does about it (the README's engine section reads the table).

    .venv/bin/python benchmarks/engine_start.py [--model qwen3-tiny] [--no-save]
    .venv/bin/python benchmarks/engine_start.py --quick --no-save   # quickest, starts vLLM

Each engine runs in a fresh Python process, as a notebook or a test process starts one, and reports how long
`Engine(...)` took to be ready, one sampling call (16 prompts x 8 samples, 32 tokens) and `close()`:

- in that process (vLLM's engine core and worker in-process, the default for a small model on CPU): eager, compiled
  with empty compile caches and warm;
- in vLLM's own processes (`in_process=False`, what a large model, CUDA or a second engine get), below;
- eager, alone;
- two eager engines started side by side, with vLLM-CPU's own binding (`VLLM_CPU_OMP_THREADS_BIND=auto`, which puts
  every one-worker engine's compute thread on the first core) and with a core each (`machine.engine_core_environment`);
- compiled, with empty compile caches; warm (the same caches again); and with empty caches a graph capture of the
  same model compiled in first (`graphs.capture`: it compiles in the engines' cache, which it leaves warm);
- close: waiting for vLLM's teardown (`close(wait=True)`) and handing it to a thread (`close()` on a small model).

Prints and writes tables/bench_engine_start.csv (one row per engine process; not with `--no-save`). `--quick`: the
first row only (an eager engine in this process), a check that the script runs (with `--no-save`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from rla_lib.graphs import capture
from rla_lib.machine import engine_core_environment
from rla_lib.paths import ROOT
from rla_lib.report import save_table

CHILD = """
import json, sys, time
if __name__ == "__main__":
    from rla_lib.engine import Engine, wait_for_closed_engines
    from rla_lib.engine_process import import_vllm
    import_vllm()  # the import is the process's, not the start's: a notebook has imported rla_lib before
    model, mode, wait, here = sys.argv[1], sys.argv[2], sys.argv[3] == "wait", sys.argv[4] == "here"
    t0 = time.perf_counter()
    engine = Engine(model, mode=mode, in_process=None if here else False)
    assert engine._in_process == here
    t1 = time.perf_counter()
    engine.sample(["12+34=", "5+6+7="] * 8, n=8, max_tokens=32)
    t2 = time.perf_counter()
    engine.close(wait=True if wait else None)
    t3 = time.perf_counter()
    wait_for_closed_engines()
    print(json.dumps(dict(start_s=t1 - t0, sample_s=t2 - t1, close_s=t3 - t2, teardown_s=time.perf_counter() - t2)))
"""


def launch(model: str, mode: str, env: dict, close: str = "wait", where: str = "apart") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, model, mode, close, where], cwd=ROOT, env=os.environ | env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"an engine process failed (exit {proc.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def in_this_process(model: str, add, quick: bool) -> None:
    """Engines in the process that asks for them: eager; compiled with empty caches, then warm (not `quick`)."""
    with tempfile.TemporaryDirectory(prefix="rla-engine-start-") as tmp:
        cold = dict(TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"), VLLM_CACHE_ROOT=str(Path(tmp) / "vllm"))
        scenarios = [("alone", "eager", {}), ("empty compile caches", "compiled", cold),
                     ("same caches again (warm)", "compiled", cold)]
        for scenario, mode, env in scenarios[:1] if quick else scenarios:
            add(scenario, mode, result(launch(model, mode, env, where="here")), where="this process")


def side_by_side(model: str, add) -> None:
    for label, envs in [("two side by side, vLLM's binding (both on the first core)", [{}, {}]),
                        ("two side by side, a core each", [engine_core_environment(0), engine_core_environment(1)])]:
        for measured in [result(p) for p in [launch(model, "eager", env) for env in envs]]:
            add(label, "eager", measured, engines=2)


def compiled_apart(model: str, add) -> None:
    """Compiled engines in their own processes: empty caches, warm, and empty caches a capture compiled in first."""
    with tempfile.TemporaryDirectory(prefix="rla-engine-start-") as tmp:
        tmp = Path(tmp)
        cold = dict(TORCHINDUCTOR_CACHE_DIR=str(tmp / "cold" / "inductor"), VLLM_CACHE_ROOT=str(tmp / "cold" / "vllm"))
        add("empty compile caches", "compiled", result(launch(model, "compiled", cold)))
        add("same caches again (warm)", "compiled", result(launch(model, "compiled", cold)))
        captured = dict(TORCHINDUCTOR_CACHE_DIR=str(tmp / "captured" / "inductor"),
                        VLLM_CACHE_ROOT=str(tmp / "captured" / "vllm"))
        capture(model, "compiled", out_dir=tmp / "capture", env=captured)
        add("empty caches a capture of the model compiled in", "compiled", result(launch(model, "compiled", captured)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--quick", action="store_true",
                        help="the first row only: one eager engine in this process (a check that the script runs)")
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    if args.quick and args.save:
        parser.error("--quick makes one of the table's rows: pass --no-save with it")
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        if name in os.environ:
            raise SystemExit(f"unset {name}: this benchmark sets it per engine")
    rows = []

    def add(scenario: str, mode: str, measured: dict, engines: int = 1, where: str = "own processes") -> None:
        rows.append(dict(scenario=scenario, mode=mode, engine=where, engines_at_once=engines,
                         **{k: round(v, 2) for k, v in measured.items()}))
        print(f"{scenario:<58} {mode:<8} start {measured['start_s']:5.1f} s  sample {measured['sample_s']:5.2f} s  "
              f"close {measured['close_s']:4.1f} s", flush=True)

    in_this_process(args.model, add, args.quick)
    if not args.quick:
        add("alone", "eager", result(launch(args.model, "eager", {})))
        side_by_side(args.model, add)
        compiled_apart(args.model, add)
        add("alone, close() hands vLLM's teardown to a thread", "eager",
            result(launch(args.model, "eager", {}, close="background")))
    if args.save:
        save_table(pd.DataFrame(rows).set_index(["scenario", "mode"]), "bench_engine_start", vars(args))


if __name__ == "__main__":
    main()
