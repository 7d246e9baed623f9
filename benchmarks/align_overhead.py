"""Cost of rounding-location alignment: forward+backward time and activation memory, stock vs aligned.

    .venv/bin/python benchmarks/align_overhead.py                    # both shapes
    .venv/bin/python benchmarks/align_overhead.py --shape large --configs "all 3 fused;engine schedule fused" --no-save
    .venv/bin/python benchmarks/align_overhead.py --shape small --rounds 4 --settle 0 --no-save --no-engine --configs "stock (A/A);all three;all 3 fused"   # quickest
    .venv/bin/python benchmarks/align_overhead.py --shape small --rounds 4 --settle 0 --no-save --configs "engine schedule fused"  # quickest, starts vLLM (slow: make test-bench)

Configurations: stock, each region alone and all three (eager), and with `fused=True` (compiled rotary
and SwiGLU kernels; the residual norms have no fused form); and the engine-aligned configuration: the
compiled engine's schedule for the embedded Qwen3 with its attention numerics (`rla_lib.engine_align`;
kept on this machine by notebook 03b or an earlier run, else read and probed here: one engine start), eager and fused.

Time: one training step's forward+backward (cross-entropy on the inputs as labels, BF16 weights) per
configuration. Every round runs each configuration once. Rounds come in pairs: the first in an order shuffled
afresh (seeded), the second in the reverse order (a fold-over design), so every configuration's mean position in
a pair is the same and a drift of the machine's speed within the rounds cancels; no configuration always follows
the same one. After a switch, `--settle` untimed steps run first, so what the previous configuration left
(allocator, caches) and the switch itself land outside the timed step. Two earlier designs biased the A/A control:
a fixed rotating order (`--order rotate`, stock always after the same configuration) -2.8% [-5.3%, -0.7%] in 20
rounds, and a fresh shuffle every round without the reversal +1.4% [+0.0%, +2.8%], where the CPU time drifted
by 8% over the run and stock sat earlier in its rounds than A/A on average (positions 4.1 and 6.1 of 0-10).

Reported per configuration: median wall time and median CPU time of this process (less sensitive to being
descheduled by other processes), each with the median over rounds of the ratio to stock in the same round; and
the best (minimum) CPU time with its ratio to stock's best, the least disturbed estimate on a shared machine.
"stock (A/A)" is stock measured again as if it were a separate configuration: its ratios show the noise floor of
the comparison. The CPU-time ratio also gets a 95% CI: the geometric mean over rounds of the per-round ratio,
pairs of rounds resampled (a bootstrap; a pair is the unit, its two rounds share the drift that cancels), so
"below a target" is shown by the CI's upper end, not assumed from a median. The A/A control's CI covering zero is
the check that the design itself adds no bias. Each timed step goes to results/align_overhead_rounds.csv (round,
position in the round, configuration, wall and CPU seconds), unless `--no-save`.

Memory: on CPU, bytes of the tensors autograd saves for backward over one step (unique storages,
parameters excluded), taken with `torch.autograd.graph.saved_tensors_hooks`. That is the activation
memory an alignment adds; it is not a process peak (transient buffers are not counted). On CUDA:
`torch.cuda.max_memory_allocated` over one step instead (a real peak).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np
import pandas as pd
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from rla_lib import align as rla
from rla_lib.align.schedule import schedule_to_align_kwargs
from rla_lib.sides import align_config
from rla_lib.align.vector_sums import rms_sum_layouts
from rla_lib.bf16_matmul import use_bf16_matmul
from rla_lib.engine_align import engine_schedule_for
from rla_lib.kl import bootstrap_indices
from rla_lib.machine import capped_name
from rla_lib.paths import MODELS_DIR, RESULTS_DIR, atomic_write
from rla_lib.report import save_table


ROUNDS_LOG = RESULTS_DIR / "align_overhead_rounds.csv"

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
    """Geometric mean of the per-round ratios times/stock and its 95% bootstrap CI (pairs of rounds resampled: a
    round and its reversal, `round_order`; an odd last round is its own unit). One unit has no interval (NaN)."""
    logs = np.log(np.asarray(times) / np.asarray(stock))
    logs = np.array([logs[i : i + 2].mean() for i in range(0, len(logs), 2)])
    if len(logs) < 2:
        return float(np.exp(logs.mean())), math.nan, math.nan
    low, high = np.quantile(logs[bootstrap_indices(len(logs), n_boot, seed)].mean(1), [0.025, 0.975])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


def use_config(model: torch.nn.Module, config) -> None:
    """Switch as a user would: undo the current alignment, then align to the next (none: stay stock)."""
    rla.unalign(model)
    if config is not None:
        regions, options = config
        align_config(model, regions, options)


def round_order(configs: list[str], r: int, order: str) -> list[str]:
    """The configurations of round r: "foldover", shuffled (seeded by the pair r // 2) in even rounds and that
    order reversed in odd ones; "random", shuffled afresh every round; "rotate", the fixed list rotated by r."""
    if order == "rotate":
        return configs[r % len(configs) :] + configs[: r % len(configs)]
    shuffled = [configs[i] for i in np.random.default_rng(r // 2 if order == "foldover" else r).permutation(len(configs))]
    return shuffled[::-1] if order == "foldover" and r % 2 else shuffled


def save_rounds(shape: str, timed: list[dict]) -> None:
    """The shape's timed steps into the rounds log, replacing that shape's earlier ones."""
    old = pd.read_csv(ROUNDS_LOG) if ROUNDS_LOG.exists() else pd.DataFrame()
    keep = old[old["shape"] != shape] if len(old) else old
    atomic_write(ROUNDS_LOG, lambda tmp: pd.concat([keep, pd.DataFrame(timed)]).to_csv(tmp, index=False))


def bench_shape(name: str, rounds: int, warmup: int, device: str, order: str = "foldover", settle: int = 1,
                save: bool = True) -> pd.DataFrame:
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

    timed = []
    for r in range(rounds):
        for position, config in enumerate(round_order(list(CONFIGS), r, order)):
            use_config(model, CONFIGS[config])
            for _ in range(settle):
                step(model, input_ids)
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            step(model, input_ids)
            wall[config].append(time.perf_counter() - start_wall)
            cpu[config].append(time.process_time() - start_cpu)
            timed.append(dict(shape=name, round=r, position=position, config=config, wall_s=wall[config][-1], cpu_s=cpu[config][-1]))
        print(f"  {name}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    rla.unalign(model)
    if save:
        save_rounds(name, timed)

    def pct(ratio: float) -> str:
        return f"{100 * (ratio - 1):+.2f}%"

    threads = f"{torch.get_num_threads()} threads" if device == "cpu" else device
    print(f"\n{name}: {label}, batch {batch}x{seq} tokens, BF16, {threads}, {rounds} rounds ({order} order, {settle} settle step(s))")
    header = ["config", "wall", "vs stock", "CPU", "vs stock", "CPU 95% CI (gmean)", "CPU best", "vs stock", "memory", "vs stock"]
    line = f"{{:<{max(map(len, CONFIGS)) + 2}}}" + "{:>10}{:>10}{:>10}{:>10}{:>22}{:>10}{:>10}{:>11}{:>10}"
    print(line.format(*header))
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
        # stock against itself is 1 by definition, not a measured interval; one pair of rounds gives none
        row += ["reference" if config == "stock" else f"[{pct(low)}, {pct(high)}]" if low == low else "one pair: none"]
        row += [f"{min(cpu[config]) * 1e3:.0f} ms", pct(min(cpu[config]) / min(cpu["stock"]))]
        row += [f"{memory[config] / 2**20:.1f} MiB", pct(memory[config] / memory["stock"])]
        print(line.format(*row))
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--no-fused", action="store_true", help="skip the fused=True configurations")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine-aligned configurations")
    parser.add_argument("--configs", default=None,
                        help="configurations to run, separated by ';' (stock always runs), e.g. 'all 3 fused;engine schedule fused'")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (pairs under --order foldover: an even number)")
    parser.add_argument("--warmup", type=int, default=0, help="extra untimed steps per configuration before the rounds")
    parser.add_argument("--settle", type=int, default=1, help="untimed steps after each switch of configuration")
    parser.add_argument("--order", choices=["foldover", "random", "rotate"], default="foldover",
                        help="each round's order: pairs of a shuffle and its reverse (default), a shuffle every "
                        "round, or the fixed list rotated")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--table", default="bench_align_overhead",
                        help="the table to write; the README's speed targets read bench_align_overhead_targets first, "
                        "a run of the target configurations alone (--shape large --configs 'all 3 fused;engine schedule "
                        "fused;stock (A/A)' --rounds 40)")
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                        help="write tables/bench_align_overhead.csv (the README's overhead table reads it; a run capped "
                        "with `python -m rla_lib.machine --level avx2 ...` writes bench_align_overhead_avx2.csv) and "
                        "results/align_overhead_rounds.csv; --no-save writes neither")
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
    table = pd.concat([bench_shape(name, args.rounds, args.warmup, args.device, args.order, args.settle, args.save)
                       for name in shapes])
    if args.save:
        save_table(table.set_index(["shape", "config"]), capped_name(args.table), vars(args) | {"threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
