"""The same measurement at every instruction-set level this CPU can run: how the kernels move the gap.

BF16 matmuls, vLLM's CPU attention and inductor's vectorised reductions take different kernel paths by
instruction set, and each path rounds in its own places. So the stock gap, and whether the paper's three
regions cut it, can change with the CPU. For each level in `rla_lib.machine.ISA_LEVELS` this CPU supports,
a process capped to that level reads the engine's rounding schedule (notebook 03a's reader, on that level's
compiled code and eager trace) and measures the exact KL of stock Transformers, the paper's three regions
and the read schedule against compiled and eager vLLM on the same prompts (`mismatch.STANDARD`), and how exact the
engine-aligned side is there: the read schedule completed as `align_to_engine` completes it at that level (the
attention kernel of the vLLM library the level loads, its eager rotary rounding), with the share of tokens bitwise.

    table = spread.measure(["qwen2-tiny"], levels=["avx512_bf16", "avx2"])
    python -m rla_lib.studies.spread qwen2-tiny --level avx2    # one level, prints the rows
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

from .. import bf16_matmul, graphs, machine, mismatch, sides
from ..align import REGIONS
from ..align.schedule import schedule_to_align_kwargs
from ..engine_probes import vllm_linear
from ..engine_align import attention_section, kernel_numerics, with_attention, with_rope_rounding
from ..models import concurrent_processes, side_by_side
from ..paths import RESULTS_DIR, atomic_write, slug
from ..report import prose
from ..settings import setting

MODES = ("compiled", "eager")
PAPER = sides.config_name(REGIONS)
SIDES = {"stock": sides.STOCK, "paper": sides.training(PAPER), "schedule": sides.training("schedule_{mode}")}
ENGINE_ALIGNED = sides.training("engine_{mode}")  # the schedule + this level's attention kernel and rotary rounding
SPREAD_DIR = RESULTS_DIR / "spread"


def measure_here(model: str, n_prompts: int = mismatch.STANDARD["n_prompts"], n_samples: int = mismatch.STANDARD["n_samples"],
                 max_tokens: int = mismatch.STANDARD["max_tokens"], seed: int = 0, n_boot: int = 2000,
                 progress: bool | None = None) -> tuple[pd.DataFrame, dict]:
    """At this process's level: one row per vLLM mode (stock, paper and schedule exact KL with CIs, and the paired
    changes stock -> paper, stock -> schedule, paper -> schedule), and the rounding points read per engine side."""
    sampling = dict(n_prompts=n_prompts, n_samples=n_samples, max_tokens=max_tokens, seed=seed, progress=progress)
    # Two engine starts, not four: the engines' samples and scores (cached), each fresh engine also making its mode's
    # capture (mismatch.measure); the training sides follow, once the schedules are read from the captures. An engine
    # not started (its samples and scores cached) leaves its capture to read_sides.
    mismatch.measure(model, MODES, training_configs={}, fp32_reference=False, **sampling)
    points, _ = graphs.read_sides(model, tuple(sides.engine(mode) for mode in MODES), progress=progress)
    attention = kernel_numerics()  # the attention of the vLLM library an engine started at this level loads
    configs = {"none": ((), {}), PAPER: (REGIONS, {})}
    for mode in MODES:
        sched = graphs.schedule(points[sides.engine(mode)])
        configs[f"schedule_{mode}"] = schedule_to_align_kwargs(sched)
        if attention:  # None off x86 CPUs: no kernel to reproduce
            configs[f"engine_{mode}"] = schedule_to_align_kwargs(  # as align_to_engine completes it, unprobed
                with_attention(with_rope_rounding(sched, mode), **attention_section({})))
    run = mismatch.measure(model, MODES, training_configs=configs, fp32_reference=False, **sampling)
    m = machine.machine()
    rows = []
    for mode in MODES:
        compared = {name: side.format(mode=mode) for name, side in SIDES.items()}
        kl = mismatch.table(run, sides.engine(mode), list(compared.values()), ("exact",), n_boot=n_boot, seed=seed)
        row = dict(model=model, level=m["isa_level"], mode=mode, cpu_capability=m["cpu_capability"],
                   bf16_matmul=m["bf16_matmul"], prompts=int(kl["prompts"].iloc[0]), tokens=int(kl["tokens"].iloc[0]))
        for name, side in compared.items():
            row |= {name: kl.loc[side, "exact"], f"{name} ci_low": kl.loc[side, "exact ci_low"],
                    f"{name} ci_high": kl.loc[side, "exact ci_high"]}
        for a, b in [("stock", "paper"), ("stock", "schedule"), ("paper", "schedule")]:
            d = run.difference(sides.engine(mode), compared[a], compared[b], "exact", n_boot=n_boot, seed=seed)
            row |= {f"{a}->{b}": d.relative, f"{a}->{b} ci_low": d.rel_ci_low, f"{a}->{b} ci_high": d.rel_ci_high,
                    f"{a}->{b} separated": d.separated}
        rows.append(row | (engine_aligned_exactness(run, mode, attention, n_boot, seed) if attention else {}))
    return pd.DataFrame(rows), {side: p.to_json() for side, p in points.items()}


def engine_aligned_exactness(run, mode: str, attention: str, n_boot: int, seed: int) -> dict:
    """The engine-aligned side at this level: its attention numerics, exact KL (CI over prompts) and the share of
    tokens whose logprob is bitwise the engine's (where all are, the CI has zero width: `report.share_cell` shows the
    exact bound on the prompt share instead)."""
    side = ENGINE_ALIGNED.format(mode=mode)
    kl = mismatch.table(run, sides.engine(mode), [side], ("exact",), n_boot=n_boot, seed=seed).loc[side]
    bitwise = run.bitwise_share(sides.engine(mode), side, n_boot=n_boot, seed=seed)
    return {"engine attention": attention, "engine-aligned": kl["exact"], "engine-aligned ci_low": kl["exact ci_low"],
            "engine-aligned ci_high": kl["exact ci_high"], "engine-aligned bitwise": bitwise.value,
            "engine-aligned bitwise ci_low": bitwise.ci_low, "engine-aligned bitwise ci_high": bitwise.ci_high}


def engine_aligned_exact(table: pd.DataFrame) -> pd.Series:
    """Per row of a `measure` table that is an instruction-set level (not the matmul control, which multiplies otherwise
    on purpose): whether the engine-aligned side scored every token bitwise the engine's, KL 0."""
    levels = table[~table["level"].str.endswith("+fp32 matmul")]
    return (levels["engine-aligned bitwise"] == 1) & (levels["engine-aligned"] == 0)


def kernel_probe() -> dict:
    """Which kernels this process's level selects, probed directly: inductor's vector ISA, torch's kernel
    capability, vLLM's kernel library and BF16 linear, and how often the engine's BF16 linear equals the
    training side's on the same operands (a random (512 x 256) @ (256 x 768) product)."""
    from torch._inductor import cpu_vec_isa  # 1.5 s to import: only here, in a level's worker

    library = ("_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512") if torch.cpu._is_avx512_supported() else "_C_AVX2"
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(512, 256, generator=g).bfloat16(), (torch.randn(768, 256, generator=g) / 16).bfloat16()
    engine_linear, engine_fn = vllm_linear(w)
    engine_out = engine_fn(x)
    layer = torch.nn.Linear(256, 768, bias=False, dtype=torch.bfloat16)
    layer.weight.data.copy_(w)
    bf16_matmul.use_bf16_matmul(layer)
    with torch.no_grad():
        training_out = layer(x)
    return dict(inductor_vec_isa=str(cpu_vec_isa.pick_vec_isa()) or "none",
                torch_capability=torch.backends.cpu.get_cpu_capability(), vllm_library=library,
                vllm_bf16_linear=engine_linear, vllm_attention=machine.vllm_cpu_attention_kernel(),
                training_bf16_matmul=machine.bf16_matmul_mode(),
                linear_outputs_equal=(engine_out == training_out).float().mean().item())


def _worker_output(model, label: str) -> Path:
    return SPREAD_DIR / slug(label) / f"{Path(str(model)).name}.json"


def measure(models, levels=None, matmul_control: bool = False, progress: bool | None = None, **params) -> pd.DataFrame:
    """`measure_here` for each model at each level (default: every level this CPU supports), each level in its own
    capped process (the uncapped one too, so every row is made the same way). Rows of all levels, one table.
    `levels`: names in `machine.ISA_LEVELS`, "native" for this CPU's own level; None: every level it can run.

    matmul_control: also the first level with the training side's BF16 linear layers computed as FP32 products
    (`bf16_matmul.use_bf16_matmul`, what the lower levels use), labelled "<level>+fp32 matmul": whether a change between
    levels comes from the engine's kernels or from the training side's matmul. Left out where this CPU's own level
    already runs FP32 products (a CPU without BF16 instructions): it would repeat that level."""
    levels = machine.resolve_levels(levels)
    processes = concurrent_processes(models)

    def run(job, slot_env) -> pd.DataFrame:
        model, level, label, extra_env = job
        out = _worker_output(model, label)
        cmd = [sys.executable, "-m", "rla_lib.studies.spread", str(model), "--level", level, "--out", str(out),
               "--params", json.dumps(params), "--threads", str(max(1, torch.get_num_threads() // processes))]
        env = (os.environ | machine.isa_environment(level) | extra_env | slot_env
               | ({"RLA_PROCESSES": "1"} if processes > 1 else {}))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"the {label} run of {model} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return pd.DataFrame(json.loads(out.read_text())["rows"]).assign(level=label)

    # Levels are independent processes, run side by side (`models.concurrent_processes`), each training side on its
    # share of the cores (the thread count changes no bit of it; oversubscribed threads would wait on each other). The
    # control comes after them: it reuses the first level's engine captures, samples and scores.
    jobs = [[(model, level, level, {}) for level in levels for model in models]]
    # where the first level's training side multiplies as FP32 products already (no BF16 instructions at that level,
    # as machine.native_bf16 decides, or RLA_BF16_MATMUL=fp32), the control would repeat it
    repeats = levels[0] not in machine.BF16_LEVELS or setting("RLA_BF16_MATMUL") == "fp32"
    if matmul_control and not repeats:
        jobs.append([(model, levels[0], f"{levels[0]}+fp32 matmul", {"RLA_BF16_MATMUL": "fp32"}) for model in models])
    frames = [frame for phase in jobs for frame in side_by_side(run, phase, processes)]
    return pd.concat(frames, ignore_index=True)


def load_points(model, level: str) -> dict:
    """The rounding points the `level` run read per engine side (graphs.Points), to compare levels."""
    d = json.loads(_worker_output(model, level).read_text())
    return {side: graphs.Points.from_json(p) for side, p in d["points"].items()}


def kernels(models, levels) -> pd.DataFrame:
    """`kernel_probe` of each level's run (the same for every model), one row per level."""
    rows = {}
    for level in levels:
        d = json.loads(_worker_output(models[0], level).read_text())
        rows[level] = d["kernels"]
    return pd.DataFrame(rows).T.rename_axis("level")


def effect(row, a: str, b: str) -> str:
    """The paired change from side a to side b in one word: "cut", "rise", or "none" (the CI includes zero)."""
    if not row[f"{a}->{b} separated"]:
        return "none"
    return "cut" if row[f"{a}->{b}"] < 0 else "rise"


@prose
def verdict(row) -> str:
    """In words, from the paired CIs: does the paper help at this level, and does the read schedule beat it?"""
    def change(a, b):
        word = effect(row, a, b)
        return "no distinguishable change" if word == "none" else f"a {word} of {abs(row[f'{a}->{b}']):.0%}"

    versus = {"cut": "beats the paper's regions", "rise": "is worse than the paper's regions",
              "none": "is indistinguishable from the paper's regions"}[effect(row, "paper", "schedule")]
    return f"paper's regions: {change('stock', 'paper')}; read schedule: {change('stock', 'schedule')}, and it {versus}"


def main(argv=None):
    parser = argparse.ArgumentParser(description="One model at one instruction-set level (run capped by `measure`).")
    parser.add_argument("model")
    parser.add_argument("--level", required=True, choices=list(machine.ISA_LEVELS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--params", default="{}", help="JSON keyword arguments of measure_here")
    parser.add_argument("--threads", type=int, default=None, help="the training side's torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # the engine's processes keep their own
    if machine.isa_level() != args.level:
        raise SystemExit(f"this process runs at {machine.isa_level()}, not {args.level}: start it with "
                         f"rla_lib.machine.isa_environment({args.level!r}) (spread.measure does)")
    rows, points = measure_here(args.model, progress=False, **json.loads(args.params))
    print(rows.to_string())
    if args.out:
        payload = dict(machine=machine.machine(), kernels=kernel_probe(), rows=rows.to_dict("records"), points=points)
        atomic_write(args.out, lambda tmp: tmp.write_text(json.dumps(payload, default=str)))


if __name__ == "__main__":
    main()
