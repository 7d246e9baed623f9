"""Time the GRPO update's optimizer step alone: AdamW over a model's FP32 master weights as `grpo.Policy` runs it
(`rla_lib.native.AdamW`: torch's for-loop arithmetic in three passes over memory), against torch's for-loop and
foreach implementations. Checks all three give the same bits.

    .venv/bin/python benchmarks/adamw_step.py [--models qwen3-tiny qwen3-0.6b-shape] [--steps 5] [--no-save]
    .venv/bin/python benchmarks/adamw_step.py --models qwen3-tiny --steps 1 --no-save   # quickest

The model is built from its config (random weights, random gradients: the step's time and bits do not depend on the
values), the embedded qwen3-tiny or a real shape of `rla_lib.real_shape` (Qwen3-0.6B: 0.6 B parameters, 7 GB of FP32
weights and optimizer state, 15 GB at the peak here). Prints the median time of `--steps` steps after one warm-up
step for each and writes tables/bench_adamw_step.csv, one row per model (its sidecar names the machine; not with
`--no-save`).
"""

import argparse
import statistics
import time

import pandas as pd
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rla_lib import native, real_shape
from rla_lib.machine import capped_name
from rla_lib.models import resolve_model
from rla_lib.report import save_table


def master_weights(model: str) -> list[torch.nn.Parameter]:
    config = real_shape.make_config(model) if model in real_shape.SHAPES else AutoConfig.from_pretrained(resolve_model(model).path)
    torch.manual_seed(0)
    return list(AutoModelForCausalLM.from_config(config, dtype=torch.float32).parameters())


IMPLEMENTATIONS = {"for_loop": lambda params, **o: torch.optim.AdamW(params, foreach=False, **o),
                   "foreach": lambda params, **o: torch.optim.AdamW(params, foreach=True, **o),
                   "native": native.AdamW}


def timed_steps(params: list[torch.nn.Parameter], make, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """Seconds per AdamW step (grpo.Policy's settings) after a warm-up, and the parameters after the last step."""
    params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = make(params, lr=3e-4, weight_decay=0.0, betas=(0.9, 0.999))
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
    row = dict(model=model, parameters=sum(p.numel() for p in params), steps=steps, threads=torch.get_num_threads())
    finals = {}
    for name, make in IMPLEMENTATIONS.items():
        times, finals[name] = timed_steps(params, make, steps)
        row[f"{name}_s"] = statistics.median(times)
    row["same_bits"] = all(torch.equal(a, b) for other in ("foreach", "native")
                           for a, b in zip(finals["for_loop"], finals[other]))
    row["speedup"] = row["for_loop_s"] / row["native_s"]
    print(f"AdamW step, {model} ({row['parameters'] / 1e6:.0f} M parameters), median of {steps}: torch for-loop "
          f"{row['for_loop_s']:.3f} s, foreach {row['foreach_s']:.3f} s, rla_lib.native {row['native_s']:.3f} s "
          f"({row['speedup']:.2f}x the for-loop's speed); same bits: {row['same_bits']}")
    if not row["same_bits"]:
        raise SystemExit("the implementations differ: grpo.Policy's histories would not reproduce")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-tiny", "qwen3-0.6b-shape"],
                        help="real shapes of rla_lib.real_shape or model names")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    rows = [measure(model, args.steps) for model in args.models]
    if args.save:
        save_table(pd.DataFrame(rows).set_index("model"), capped_name("bench_adamw_step"), vars(args))


if __name__ == "__main__":
    main()
