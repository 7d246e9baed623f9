"""Cost of rounding-location alignment: forward+backward time and activation memory, stock vs aligned.

    python benchmarks/align_overhead.py                              # both shapes
    python benchmarks/align_overhead.py --shape small --rounds 3     # quick look
    python benchmarks/align_overhead.py --shape large --configs "all 3 fused;engine schedule fused" --no-save

Configurations: stock, each region alone and all three (eager), and with `fused=True` (compiled rotary
and SwiGLU kernels; the residual norms have no fused form); and the engine-aligned configuration: the
compiled engine's schedule for the embedded Qwen3 with its attention numerics (`rla_lib.engine_align`;
kept on this machine by notebook 02, else read and probed here: one engine start), eager and fused.

Time: one training step's forward+backward (cross-entropy on the inputs as labels, BF16 weights) per
configuration. Configurations run round-robin (the order rotates every round), so load from other
processes falls on all of them alike. Reported per configuration: median wall time and median CPU time
of this process (less sensitive to being descheduled by other processes), each with the median over
rounds of the ratio to stock in the same round; and the best (minimum) CPU time with its ratio to
stock's best, the least disturbed estimate on a shared machine. "stock (A/A)" is stock measured again
as if it were a separate configuration: its ratios show the noise floor of the comparison. The CPU-time
ratio also gets a 95% CI: the geometric mean over rounds of the per-round ratio, rounds resampled (a
bootstrap), so "below a target" is shown by the CI's upper end, not assumed from a median.

Memory: on CPU, bytes of the tensors autograd saves for backward over one step (unique storages,
parameters excluded), taken with `torch.autograd.graph.saved_tensors_hooks`. That is the activation
memory an alignment adds; it is not a process peak (transient buffers are not counted). On CUDA:
`torch.cuda.max_memory_allocated` over one step instead (a real peak).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import pandas as pd
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from rla_lib import align as rla
from rla_lib.engine_align import engine_schedule_for
from rla_lib.graphs import schedule_to_align_kwargs
from rla_lib.kl import bootstrap_indices
from rla_lib.machine import use_bf16_matmul
from rla_lib.paths import MODELS_DIR
from rla_lib.report import save_table
from rla_lib.vector_sums import rms_sum_layouts


# name: (regions, options), or None for stock
CONFIGS = {
    "stock": None,
    "rope": (("rope",), {}),
    "swiglu": (("swiglu",), {}),
    "residual_norm": (("residual_norm",), {}),
    "all three": (rla.REGIONS, {}),
    "rope fused": (("rope",), {"fused": True}),
    "swiglu fused": (("swiglu",), {"fused": True}),
    "all 3 fused": (rla.REGIONS, {"fused": True}),
    "stock (A/A)": None,
}


def add_engine_schedule() -> None:
    """The engine-aligned configurations (schedule + attention), eager and fused."""
    regions, options = schedule_to_align_kwargs(engine_schedule_for("qwen3-tiny", "compiled"))
    if "rms_sum" in options:  # per layer for the embedded model's 4 layers; the large shape has 8: its most common layout
        layouts = [x for kind in rms_sum_layouts(options["rms_sum"], 4).values() for x in kind]
        options = options | {"rms_sum": max(set(layouts), key=layouts.count)}
    CONFIGS["engine schedule"] = (regions, options)
    CONFIGS["engine schedule fused"] = (regions, options | {"fused": True})


def small_model(device: str) -> tuple[str, torch.nn.Module]:
    path = MODELS_DIR / "qwen3-tiny"
    if (path / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        return f"embedded {path.name}", model.to(device)
    config = Qwen3Config(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=768, vocab_size=16, max_position_embeddings=512,
    )  # fmt: skip
    return "Qwen3 h256 L4 (config)", AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)


def large_model(device: str) -> tuple[str, torch.nn.Module]:
    config = Qwen3Config(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
        intermediate_size=3072, vocab_size=4096, max_position_embeddings=1024,
    )  # fmt: skip
    return "Qwen3 h1024 L8 (config)", AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)


SHAPES = {"small": (small_model, 64, 40), "large": (large_model, 4, 512)}


def step(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    if input_ids.is_cuda:
        torch.cuda.synchronize()


def step_memory(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    """One (untimed) step; returns its activation memory as described in the module docstring."""
    if input_ids.is_cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(model, input_ids)
        return torch.cuda.max_memory_allocated() - before

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def ratio_ci(times: list[float], stock: list[float], n_boot: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of the per-round ratios times/stock and its 95% bootstrap CI (rounds resampled)."""
    logs = np.log(np.asarray(times) / np.asarray(stock))
    low, high = np.quantile(logs[bootstrap_indices(len(logs), n_boot, seed)].mean(1), [0.025, 0.975])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


def use_config(model: torch.nn.Module, config) -> None:
    if config is None:
        rla.unalign(model)
    else:
        regions, options = config
        rla.align(model, regions, **options)


def bench_shape(name: str, rounds: int, warmup: int, device: str) -> pd.DataFrame:
    build, batch, seq = SHAPES[name]
    torch.manual_seed(0)
    label, model = build(device)
    use_bf16_matmul(model)  # the training side's GEMM on this CPU (rla_lib.machine), as load_model does
    model.train()
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)

    wall = {config: [] for config in CONFIGS}
    cpu = {config: [] for config in CONFIGS}
    memory = {}
    for config in CONFIGS:
        use_config(model, CONFIGS[config])
        memory[config] = step_memory(model, input_ids)  # also the first, untimed step (and compiles)
        for _ in range(warmup):
            step(model, input_ids)

    order = list(CONFIGS)
    for r in range(rounds):
        for config in order[r % len(order) :] + order[: r % len(order)]:
            use_config(model, CONFIGS[config])
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            step(model, input_ids)
            wall[config].append(time.perf_counter() - start_wall)
            cpu[config].append(time.process_time() - start_cpu)
        print(f"  {name}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    rla.unalign(model)

    def pct(ratio: float) -> str:
        return f"{100 * (ratio - 1):+.2f}%"

    threads = f"{torch.get_num_threads()} threads" if device == "cpu" else device
    print(f"\n{name}: {label}, batch {batch}x{seq} tokens, BF16, {threads}, {rounds} rounds")
    header = ["config", "wall", "vs stock", "CPU", "vs stock", "CPU 95% CI (gmean)", "CPU best", "vs stock", "memory", "vs stock"]
    print("{:<14}{:>10}{:>10}{:>10}{:>10}{:>22}{:>10}{:>10}{:>11}{:>10}".format(*header))
    rows = []
    for config in CONFIGS:
        rows.append(dict(shape=name, model=label, tokens=f"{batch}x{seq}", config=config, rounds=rounds,
                         wall_ms=1e3 * statistics.median(wall[config]),
                         wall_ratio=statistics.median(a / b for a, b in zip(wall[config], wall["stock"])),
                         cpu_ms=1e3 * statistics.median(cpu[config]),
                         cpu_ratio=statistics.median(a / b for a, b in zip(cpu[config], cpu["stock"])),
                         cpu_best_ratio=min(cpu[config]) / min(cpu["stock"]),
                         **dict(zip(["cpu_gmean_ratio", "cpu_ratio_ci_low", "cpu_ratio_ci_high"], ratio_ci(cpu[config], cpu["stock"]))),
                         memory_mib=memory[config] / 2**20, memory_ratio=memory[config] / memory["stock"]))
        row = [config]
        for times in (wall, cpu):
            row += [f"{statistics.median(times[config]) * 1e3:.0f} ms"]
            row += [pct(statistics.median(a / b for a, b in zip(times[config], times["stock"])))]
        _, low, high = ratio_ci(cpu[config], cpu["stock"])
        row += [f"[{pct(low)}, {pct(high)}]"]
        row += [f"{min(cpu[config]) * 1e3:.0f} ms", pct(min(cpu[config]) / min(cpu["stock"]))]
        row += [f"{memory[config] / 2**20:.1f} MiB", pct(memory[config] / memory["stock"])]
        print("{:<14}{:>10}{:>10}{:>10}{:>10}{:>22}{:>10}{:>10}{:>11}{:>10}".format(*row))
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--no-fused", action="store_true", help="skip the fused=True configurations")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine-aligned configurations")
    parser.add_argument("--configs", default=None,
                        help="configurations to run, separated by ';' (stock always runs), e.g. 'all 3 fused;engine schedule fused'")
    parser.add_argument("--rounds", type=int, default=7, help="timed round-robin rounds")
    parser.add_argument("--warmup", type=int, default=0, help="extra untimed steps per configuration")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                        help="write tables/bench_align_overhead.csv (the README's overhead table reads it)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.no_engine:
        add_engine_schedule()
    if args.no_fused:
        for name in [name for name, config in CONFIGS.items() if config and config[1].get("fused")]:
            del CONFIGS[name]
    if args.configs:
        keep = {"stock", *args.configs.split(";")}
        if keep - set(CONFIGS):
            parser.error(f"unknown configuration(s) {sorted(keep - set(CONFIGS))}; choose from {list(CONFIGS)}")
        for name in set(CONFIGS) - keep:
            del CONFIGS[name]
    shapes = list(SHAPES) if args.shape == "both" else [args.shape]
    table = pd.concat([bench_shape(name, args.rounds, args.warmup, args.device) for name in shapes])
    if args.save:
        save_table(table.set_index(["shape", "config"]), "bench_align_overhead", vars(args) | {"threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
