"""TRL's GRPOTrainer on the embedded model with real vLLM rollouts: the logged mismatch, stock vs aligned.

    .venv/bin/python experiments/trl_grpo.py              # 5 arms x 8 steps, about 3 minutes on 2 cores
    .venv/bin/python experiments/trl_grpo.py --steps 2 --arms stock "engine schedule"

Every arm is the same `rla_lib.trl_grpo.EngineGRPOTrainer` run (same prompts, seeds and initial weights, one
compiled Engine) with a different training side: stock Transformers, the paper's three regions
(`rla_lib.align.align`), or the engine's own rounding schedule (`rla_lib.engine_align.align_to_engine`); and
with the trainer's positions counted as the engine counts them (default) or as TRL numbers left-padded rows.
Step 1 samples the same tokens in every arm (the engine holds the same weights, and the seeds are equal), so
its rows compare the training sides on identical tokens; later steps sample from each arm's own updated
weights (`same_rollout_as_stock` says which steps still match the stock arm's tokens).

Writes tables/trl_mismatch.csv (one row per arm and step: TRL's `sampling/*` metrics, the `mismatch/*` ones
of `rla_lib.align.monitor`, the reward) and its provenance sidecar, atomically (`rla_lib.report.save_table`).
"""

import argparse
import shutil
import tempfile
from importlib.metadata import version

import pandas as pd
from transformers import PrinterCallback

from rla_lib.align import align, current
from rla_lib.engine import Engine
from rla_lib.engine_align import align_to_engine
from rla_lib.models import load_model
from rla_lib.report import save_table
from rla_lib.trl_grpo import EngineGRPOTrainer, GRPOConfig, task_dataset, task_reward

# arm -> (training side, positions)
ARMS = {
    "stock": ("stock", "engine"),
    "paper": ("paper", "engine"),
    "engine schedule": ("engine schedule", "engine"),
    "stock, TRL positions": ("stock", "trl"),
    "engine schedule, TRL positions": ("engine schedule", "trl"),
}
MISMATCH = ["mismatch/k1", "mismatch/k3", "mismatch/exact_kl", "mismatch/abs_diff_mean", "mismatch/abs_diff_max",
            "mismatch/tokens"]
SAMPLING = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max"]


def training_side(name: str, engine: Engine):
    model = load_model(engine.spec.path)
    if name == "paper":
        align(model)
    elif name == "engine schedule":
        align_to_engine(model, engine)
    return model


def run_arm(arm: str, engine: Engine, opts, out_dir: str) -> tuple[pd.DataFrame, list]:
    side, positions = ARMS[arm]
    model = training_side(side, engine)
    args = GRPOConfig(output_dir=out_dir, max_steps=opts.steps, per_device_train_batch_size=opts.prompts * opts.group,
                      num_generations=opts.group, max_completion_length=opts.max_tokens, learning_rate=opts.lr,
                      seed=opts.seed, bf16=False, use_cpu=True, gradient_checkpointing=False, logging_steps=1,
                      save_strategy="no", report_to="none", disable_tqdm=True, log_level="warning")
    trainer = EngineGRPOTrainer(model, engine, task_reward, args, task_dataset(opts.prompts * opts.steps),
                                positions=positions)
    trainer.remove_callback(PrinterCallback)  # the logs go to the table, not to the terminal
    trainer.train()
    rows = [h for h in trainer.state.log_history if "mismatch/k1" in h]
    alignment = current(model)
    df = pd.DataFrame({"arm": arm, "training side": side, "positions": positions,
                       "regions": "+".join(alignment.schedule.regions()) if alignment else "none", "step": [h["step"] for h in rows],
                       **{k: [h.get(k) for h in rows] for k in MISMATCH + SAMPLING + ["reward"]}})
    return df, [digest for _, digest in trainer.rollout_digests]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="responses per prompt (TRL's num_generations)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    opts = parser.parse_args(argv)
    out_dir = tempfile.mkdtemp(prefix="rla-trl-")  # TRL's output_dir: nothing is saved there (save_strategy="no")
    tables, digests = [], {}
    try:
        with Engine("qwen3-tiny", mode=opts.mode) as engine:
            for arm in opts.arms:
                df, digests[arm] = run_arm(arm, engine, opts, out_dir)
                tables.append(df)
                first = df.iloc[0]
                print(f"{arm}: step 1 k3 {first['mismatch/k3']:.3g}, exact KL {first['mismatch/exact_kl']:.3g}", flush=True)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    reference = digests.get("stock", next(iter(digests.values())))  # without a stock arm: the first arm run
    for df in tables:
        arm_digests = digests[df["arm"].iloc[0]]
        df.insert(5, "same_rollout_as_stock", [a == b for a, b in zip(arm_digests, reference)])
    table = pd.concat(tables, ignore_index=True)
    params = dict(vars(opts), trl=version("trl"), model="qwen3-tiny", engine=f"vllm:{opts.mode}",
                  note="mismatch/* in nats per token (rla_lib.align.monitor); step 1 samples the same tokens in every arm")
    print(save_table(table, "trl_mismatch", params=params))
    print(table[["arm", "step", "same_rollout_as_stock", "mismatch/k1", "mismatch/k3", "mismatch/exact_kl",
                 "sampling/sampling_logp_difference/mean", "reward"]].to_string(index=False))


if __name__ == "__main__":
    main()
