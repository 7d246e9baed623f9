"""The settings search behind notebook 06: does default BF16 GRPO degrade where aligned training does not?

    make grpo-sweep                                  # everything below, about 80 min on 2 CPU cores
    .venv/bin/python experiments/grpo_sweep.py --only lr3e-4 --seeds 0   # a slice

Each run is a `grpo.run` in `results/grpo_sweep/<run>/` (checkpointed: stop and start again, it resumes).
When all are done, one file collects the per-step histories of every run,
`data/grpo_sweep/histories.csv.gz` (shipped, so notebook 06 can show the search without re-running it),
written atomically. The runs are ordered so that an interrupted search has whole seeds done first.

The grid, for the embedded qwen3-tiny (16 prompts x 8 samples, 32 tokens, 2 minibatches, clip 0.2):
- lr 3e-4 (15x the notebook's default), 300 steps, seeds 0-2: default BF16, all three aligned,
  FP32 control, and default BF16 with rollout weights rounded to 3 mantissa bits (a deliberately larger
  mismatch, as lower-precision rollouts give: is there a mismatch size at which this model degrades?)
- lr 4e-4 and 6e-4, 150 steps, seeds 0-2: the same four (added after lr 1e-3 sent every configuration,
  the FP32 control included, to zero accuracy: between stable and always-collapsing is where a small
  mismatch could tip a run over)
- lr 1e-3, 150 steps, seeds 0-2: default BF16, all three aligned, FP32 control
"""

import argparse

from rla_lib.grpo import CONFIGURATIONS
from rla_lib.paths import DATA_DIR, RESULTS_DIR, ROOT, atomic_write

OUT = RESULTS_DIR / "grpo_sweep"
SHIPPED = DATA_DIR / "grpo_sweep" / "histories.csv.gz"
CONFIGS = ["default BF16", "all three", "FP32 control", "default BF16, 3-bit rollouts"]
COMMON = dict(model="qwen3-tiny", prompts_per_step=16, group_size=8, max_tokens=32, eval_every=25, eval_prompts=256,
              checkpoint_every=25)
GRID = [  # (tag, settings, seeds, configs)
    ("lr3e-4", dict(lr=3e-4, steps=300), (0, 1, 2), CONFIGS),
    ("lr4e-4", dict(lr=4e-4, steps=150), (0, 1, 2), CONFIGS),
    ("lr6e-4", dict(lr=6e-4, steps=150), (0, 1, 2), CONFIGS),
    ("lr1e-3", dict(lr=1e-3, steps=150), (0, 1, 2), ["default BF16", "all three", "FP32 control"]),
]


def planned_runs(only=None, seeds=None, configs=None):
    for tag, settings, tag_seeds, names in GRID:
        if only and tag not in only:
            continue
        for seed in tag_seeds:
            if seeds is not None and seed not in seeds:
                continue
            for name in names:
                if configs and name not in configs:
                    continue
                run_id = f"{tag}-s{seed}-{name.replace(' ', '_').replace(',', '')}"
                yield run_id, dict(sweep=tag, config=name, seed=seed), dict(COMMON, **settings, **CONFIGURATIONS[name], seed=seed)


def collect(runs) -> "pd.DataFrame":
    import pandas as pd

    frames = [pd.read_csv(OUT / run_id / "history.csv").assign(run=run_id, **labels)
              for run_id, labels, _ in runs if (OUT / run_id / "history.csv").exists()]
    return pd.concat(frames, ignore_index=True)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="sweep tags to run (default: all)")
    parser.add_argument("--seeds", nargs="*", type=int, help="seeds to run (default: each tag's own)")
    parser.add_argument("--configs", nargs="*", help=f"configurations to run (default: each tag's own; from {CONFIGS})")
    parser.add_argument("--shard", default="0/1", help="K/N: run every N-th planned run starting at K (parallel processes)")
    parser.add_argument("--collect-only", action="store_true", help="just rebuild the shipped file from finished runs")
    args = parser.parse_args()

    from rla_lib import grpo

    k, n = map(int, args.shard.split("/"))
    if args.configs and set(args.configs) - set(CONFIGS):
        parser.error(f"unknown configuration(s) {sorted(set(args.configs) - set(CONFIGS))}; choose from {CONFIGS}")
    runs = list(planned_runs(args.only, set(args.seeds) if args.seeds else None, args.configs))[k::n]
    todo = [] if args.collect_only else [(grpo.GRPOConfig(**settings), OUT / run_id) for run_id, _, settings in runs]
    for i, (cfg, out, h) in enumerate(grpo.run_many(todo, progress=False), 1):  # engines shared across runs
        s = grpo.summarize(h)
        print(f"[{i}/{len(todo)}] {out.name}: eval acc {s['eval acc first']:.3f} -> peak {s['eval acc peak']:.3f} -> last "
              f"{s['eval acc last']:.3f}   k3 {s['k3 mean (1e-4)']:.3g} x 1e-4   {s['step seconds']:.2f} s/step", flush=True)

    every = list(planned_runs())
    data = collect(every)
    atomic_write(SHIPPED, lambda tmp: data.to_csv(tmp, index=False, float_format="%.6g", compression="gzip"))
    print(f"{data['run'].nunique()} of {len(every)} runs collected in {SHIPPED.relative_to(ROOT)}")
