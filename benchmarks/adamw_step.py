"""Time the GRPO update's optimizer step alone: torch's AdamW over a model's FP32 master weights, as `grpo.Policy` runs
it (foreach: one call per op for all tensors) and as its for-loop over tensors. Checks the two give the same bits.

    .venv/bin/python benchmarks/adamw_step.py [--models qwen3-tiny qwen3-0.6b-shape] [--steps 5]

The model is built from its config (random weights, random gradients: the step's time and bits do not depend on the
values), the embedded qwen3-tiny or a real shape of `rla_lib.real_shape` (Qwen3-0.6B: 0.6 B parameters, 7 GB of FP32
weights and optimizer state, 15 GB at the peak here). Prints the median time of `--steps` steps after one warm-up
step for each and writes tables/bench_adamw_step.csv, one row per model (its sidecar names the machine).
"""

import argparse
import statistics
import time

import pandas as pd
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rla_lib import real_shape
from rla_lib.machine import capped_name
from rla_lib.models import resolve_model
from rla_lib.report import save_table


def master_weights(model: str) -> list[torch.nn.Parameter]:
    config = real_shape.make_config(model) if model in real_shape.SHAPES else AutoConfig.from_pretrained(resolve_model(model).path)
    torch.manual_seed(0)
    return list(AutoModelForCausalLM.from_config(config, dtype=torch.float32).parameters())


def timed_steps(params: list[torch.nn.Parameter], foreach: bool, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """Seconds per AdamW step (grpo.Policy's settings) after a warm-up, and the parameters after the last step."""
    params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0, betas=(0.9, 0.999), foreach=foreach)
    generator = torch.Generator().manual_seed(1)
    times = []
    for step in range(steps + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-2
        start = time.perf_counter()
        opt.step()
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - start)
    return times, [p.detach() for p in params]


def measure(model: str, steps: int) -> dict:
    params = master_weights(model)
    loop, loop_params = timed_steps(params, foreach=False, steps=steps)
    fast, fast_params = timed_steps(params, foreach=True, steps=steps)
    same = all(torch.equal(a, b) for a, b in zip(loop_params, fast_params))
    row = dict(model=model, parameters=sum(p.numel() for p in params), steps=steps, for_loop_s=statistics.median(loop),
               foreach_s=statistics.median(fast), same_bits=same, threads=torch.get_num_threads())
    row["speedup"] = row["for_loop_s"] / row["foreach_s"]
    print(f"AdamW step, {model} ({row['parameters'] / 1e6:.0f} M parameters), median of {steps}: for-loop "
          f"{row['for_loop_s']:.3f} s, foreach {row['foreach_s']:.3f} s ({row['speedup']:.2f}x); same bits: {same}")
    if not same:
        raise SystemExit("foreach and the for-loop differ: grpo.Policy's histories would not reproduce")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-tiny", "qwen3-0.6b-shape"],
                        help="real shapes of rla_lib.real_shape or model names")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = [measure(model, args.steps) for model in args.models]
    save_table(pd.DataFrame(rows).set_index("model"), capped_name("bench_adamw_step"), vars(args))


if __name__ == "__main__":
    main()
