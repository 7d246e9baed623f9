"""Time one GRPO step on the embedded model (rollout + scoring + update + weight sync), with breakdown.

    .venv/bin/python benchmarks/grpo_step.py [--steps 10] [--regions rope ...] [--precision bf16|fp32] [--no-save]
    .venv/bin/python benchmarks/grpo_step.py --steps 2 --prompts 2 --group-size 2 --max-tokens 8 --no-save   # quickest, starts vLLM

Prints the median over steps after the first (warm-up) step, the tokens the training side sees
(real and padded) and the training process's peak resident memory (the embedded model's engine runs in that process
and is counted in it; a real-shape model's runs in vLLM's own processes, not counted).
It also prints a floor for this machine: the rollout as the engine ran it (real vLLM's own kernels, not the trainer's
to change) plus the training side's linear-layer arithmetic on the real tokens alone (no padding, no attention or
pointwise ops) at the best rate its GEMM reaches at the model's layer shapes here. A step with the same numerics,
engine and GEMM kernel cannot take less. A tighter bound for these numerics: the rollout plus the time the step spends
in the kernels whose arithmetic the training bits (and the committed GRPO histories) depend on, as they ran: its GEMMs
and attention (torch's profiler, over one more step after the timed ones) and its optimizer (gradient clip + AdamW).
The targets are multiples of that floor (`tools/readme_speed.FLOOR_LIMITS`). At real shape (`make real-shape`):
    .venv/bin/python benchmarks/grpo_step.py --model .cache/real-shape/qwen3-0.6b-shape --steps 12 --prompts 2 --group-size 4 --rewards coin
There the first few steps also grow the processes' heaps to the size the steps reuse from then on (each growth faults
its pages in): the median over 11 steps is the steady step.
The real shape's weights are random: it earns no reward, every advantage is 0 and so is every gradient, and the step
is not one that learns (torch's sqrt, in AdamW, is several times slower on the zero second moments that follow).
`--rewards coin` gives each sample a seeded 0/1 reward instead. `--allocator default` measures the step with glibc
giving freed memory back at once, as it does outside `grpo.run` (`rla_lib.memory.reuse_freed_memory`).
"""

import argparse
import contextlib
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rla_lib import grpo, native, task
from rla_lib.bf16_matmul import use_bf16_matmul
from rla_lib.machine import capped_name
from rla_lib.memory import GLIBC_DEFAULTS, malloc_environment
from rla_lib.models import resolve_model
from rla_lib.paths import slug
from rla_lib.report import save_table


def linear_layers(model: str, minibatches: int) -> tuple[float, set[tuple[int, int]], float]:
    """GFLOP of the training side's linear layers per real token of a step (the update's forward and backward,
    6 per weight; the no-grad scoring of the minibatches after the first, 2 per weight), their (in, out) shapes, and
    the GB of the model's BF16 weights (each tensor once: a tied head is the embedding), the size of a push."""
    with torch.device("meta"):  # shapes only, no memory
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model(model).path))
    linears = [m for m in skeleton.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(m.weight.numel() for m in linears)
    pushed_gb = sum(p.numel() for p in skeleton.parameters()) * 2 / 1e9  # parameters() yields a tied tensor once
    return (weights * (6 + 2 * (minibatches - 1) / minibatches) / 1e9, {(m.in_features, m.out_features) for m in linears},
            pushed_gb)


def coin_rewards(rollout):
    """`grpo.rollout` with each sample's reward a fair coin's, seeded by the step: advantages that are not all 0 for a
    model that cannot do the task (a real shape's random weights)."""
    def rollout_with_coin_rewards(cfg, step, engine, exclude):
        samples, _ = rollout(cfg, step, engine, exclude)
        return samples, np.random.default_rng([cfg.seed, step]).integers(0, 2, len(samples)).astype(float)
    return rollout_with_coin_rewards


class KernelTimes:
    """The training side's time in the kernels the committed histories' bits depend on, per step: its GEMMs and
    attention (self time under torch's profiler, over the scoring and update of the `profiled` step, one after the
    timed ones: the profiler slows the other ops) and its optimizer (gradient clip + AdamW, `Policy.step` less its
    backward, every timed step). The profile is read after the run: read at once, or kept while another step runs,
    its allocations split the freed blocks the next step's large tensors would reuse, and every step after faults
    their pages in again. So one step is profiled, the last: three in a row (collection paused over the rollouts
    between) gave the study step's BF16 GEMMs 14.8 s a step against 7.7 s for one, on this Zen 4. One step's bound
    varies between runs as the whole step does (the tiny step's GEMMs 0.156-0.206 s in three runs, 2 threads): compare
    a step with the bound of the same run. `peak_kb` is the process's peak before the profiled step."""

    GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "torch_dot_linear"}

    def __init__(self, profiled: int):
        self.profiled, self.step, self.profiler, self.peak_kb = profiled, None, None, None
        self.rows = {}  # step -> {"optimizer": s, "backward": s}

    def install(self) -> None:
        rollout, policy_step, backward = grpo.rollout, grpo.Policy.step, torch.Tensor.backward
        weights = grpo.Policy.rollout_weights

        def rollout_then_profile(cfg, step_number, engine, exclude):
            out = rollout(cfg, step_number, engine, exclude)
            self.step = step_number
            self.rows[step_number] = dict(optimizer=0.0, backward=0.0)
            if step_number == self.profiled:
                self.peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profiler.start()
            return out

        def timed(method, key):
            def run(this, *args, **kwargs):
                start = time.perf_counter()
                out = method(this, *args, **kwargs)
                self.rows[self.step][key] += time.perf_counter() - start
                return out
            return run

        def stop_profile_then_weights(policy):
            if self.step == self.profiled:
                self.profiler.stop()
            return weights(policy)

        def seen_by_the_profiler(kernel):  # a C kernel called through ctypes (the BF16 forward without BF16 instructions)
            def run(*args):
                with torch.profiler.record_function(kernel.__name__):
                    return kernel(*args)
            return run

        grpo.rollout, grpo.Policy.rollout_weights = rollout_then_profile, stop_profile_then_weights
        native.torch_dot_linear = seen_by_the_profiler(native.torch_dot_linear)
        grpo.Policy.step, torch.Tensor.backward = timed(policy_step, "optimizer"), timed(backward, "backward")

    def per_step(self) -> pd.Series:
        """Seconds per step: GEMMs and attention in the profiled step, the optimizer's median over the timed ones."""
        events = self.profiler.key_averages()
        seconds = lambda keep: sum(e.self_cpu_time_total for e in events if keep(e.key)) / 1e6
        t = pd.DataFrame.from_dict(self.rows, orient="index")
        optimizer = (t["optimizer"] - t["backward"])[(t.index > 1) & (t.index != self.profiled)].median()
        return pd.Series(dict(gemm_s=seconds(lambda name: name in self.GEMMS),
                              attention_s=seconds(lambda name: "scaled_dot_product" in name), optimizer_s=optimizer))


def gemm_gflops(shape: tuple[int, int], rows: int, dtype, repeats: int = 10) -> float:
    """The training side's GEMM rate at one layer shape: forward+backward of a linear layer with the kernel
    `load_model` gives it on this machine (rla_lib.machine), median of `repeats`."""
    layer = torch.nn.Linear(*shape, bias=False).to(dtype)
    use_bf16_matmul(layer)
    x = torch.randn(rows, shape[0]).to(dtype).requires_grad_()
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        layer(x).sum().backward()
        seconds.append(time.perf_counter() - start)
    return 6 * rows * shape[0] * shape[1] / statistics.median(seconds[1:]) / 1e9


if __name__ == "__main__":  # vLLM may spawn its engine core (a large model's): the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--regions", nargs="*", default=[])
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--task", default="sums", choices=sorted(task.TASKS),
                        help="the task's variant; the collapse study's long answers: --task steps --max-tokens 112")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rewards", default="task", choices=["task", "coin"])
    parser.add_argument("--allocator", default="keep", choices=["keep", "default"])
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                        help="write tables/bench_grpo_step_<precision>[_<regions>][_<model>].csv")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first is the warm-up, the median is over the others)")
    if args.rewards == "coin":
        grpo.rollout = coin_rewards(grpo.rollout)
    profiled = args.steps + 1  # after the timed steps, not among them
    kernel_times = KernelTimes(profiled)
    kernel_times.install()
    if args.allocator == "default":
        grpo.reuse_freed_memory = contextlib.nullcontext
        os.environ.update(malloc_environment(GLIBC_DEFAULTS) | {"GLIBC_TUNABLES": ""})  # the engine's processes too
    cfg = grpo.GRPOConfig(model=args.model, regions=tuple(args.regions), precision=args.precision, steps=args.steps + 1,
                          prompts_per_step=args.prompts, group_size=args.group_size, max_tokens=args.max_tokens,
                          task=args.task, temperature=args.temperature, eval_every=10**9, checkpoint_every=10**9)
    with tempfile.TemporaryDirectory() as out:
        h = grpo.run(cfg, out, progress=False)
    parts = ["t_rollout", "t_score", "t_update", "t_sync"]
    h = h[(h["step"] > 1) & (h["step"] != profiled)]  # step 0 is the held-out accuracy before training, 1 the warm-up
    med = h[parts].median()
    if (h["grad_norm"] == 0).all():
        print("Every gradient was 0 (no group had two different rewards): not a step that learns. For a model that "
              "cannot do the task, pass --rewards coin.")
    print(f"GRPO step, {args.model} ({args.task} task, T {args.temperature:g}), {args.precision}, regions={args.regions or 'none'}, "
          f"{args.prompts} prompts x {args.group_size} samples, median of {len(h)} steps after warm-up:")
    for p in parts:
        print(f"  {p[2:]:>8}: {med[p]:.3f} s")
    tokens = dict(real_tokens=h["real_tokens"].median(), padded_tokens=h["padded_tokens"].median())
    padding = 1 - tokens["real_tokens"] / tokens["padded_tokens"]
    print(f"  {'total':>8}: {med.sum():.3f} s   (mean response length {h['response_len'].mean():.1f} tokens; "
          f"{tokens['real_tokens']:.0f} real tokens per step, padded to {tokens['padded_tokens']:.0f}: {padding:.0%} padding)")
    peak_gb = kernel_times.peak_kb / 2**20  # KiB on Linux
    per_token, shapes, pushed_gb = linear_layers(args.model, cfg.minibatches)
    print(f"  peak resident memory of the training process: {peak_gb:.2f} GB, of which {pushed_gb:.2f} GB the pushed "
          "weights' file, mapped (RAM-backed: in memory whether mapped or not)")
    # the best rate over the model's layer shapes at a minibatch's rows: the arithmetic cannot go faster than that
    rate = max(gemm_gflops(shape, int(tokens["padded_tokens"] / cfg.minibatches), cfg.dtype) for shape in shapes)
    training_floor = tokens["real_tokens"] * per_token / rate
    floor = med["t_rollout"] + training_floor
    print(f"  floor on this machine: {floor:.3f} s = rollout {med['t_rollout']:.3f} (the engine's) + "
          f"{training_floor:.3f} training arithmetic ({tokens['real_tokens'] * per_token:.1f} GFLOP of linear layers "
          f"on the real tokens at {rate:.0f} GFLOP/s, the training side's best GEMM rate here)")
    kernels = kernel_times.per_step()
    kernel_floor = med["t_rollout"] + kernels.sum()
    print(f"  the kernels the training bits depend on, per step: GEMMs {kernels['gemm_s']:.3f} s and attention "
          f"{kernels['attention_s']:.3f} s (profiled, one step), optimizer {kernels['optimizer_s']:.3f} s; "
          f"with the rollout {kernel_floor:.3f} s = {kernel_floor / floor:.2f}x the floor: the least this step can take "
          "without other kernels, and so other training bits")
    row = {p[2:]: med[p] for p in parts} | dict(total=med.sum(), steps=len(h), response_len=h["response_len"].mean(),
                                               **tokens, padding_fraction=padding, peak_gb=peak_gb,
                                               pushed_gb=pushed_gb, gemm_gflops=rate, training_floor=training_floor,
                                               floor=floor, **kernels, kernel_floor=kernel_floor)
    name = capped_name(f"bench_grpo_step_{args.precision}" + ("_" + "+".join(args.regions) if args.regions else "")
                       + ("" if args.model == "qwen3-tiny" else "_" + slug(Path(args.model).name)))
    if args.save:
        # the machine's 1-minute load at the end: the study's runs share a machine one per core, so its step is timed
        # both ways, alone and beside other runs, and the table says which
        save_table(pd.DataFrame([row]), name, vars(args) | {"threads": torch.get_num_threads(),
                                                            "load_average": round(os.getloadavg()[0], 1)})
