"""GRPO under FSDP2 on 2 CPU processes against the single-process trainer, stock and aligned (issue 14).

    torchrun --standalone --nproc_per_node 2 experiments/fsdp_grpo.py     # ~40 s; writes tables/fsdp_equivalence.csv

Every rank builds the same fixed batch (no engine: the comparison isolates the training math): task prompts,
each with `group_size` responses that are its correct running sums or the same with a wrong last digit, so
every group has rewards 1 and 0 and nonzero group-normalised advantages. Each arm (stock, aligned with the
paper's three regions) then runs `steps` clipped-GRPO updates of that one batch (the old logprobs are the
first step's own, as in `grpo.train_step`), three ways from the same FP32 weights:

- fsdp: `rla_lib.distributed` on `world_size` processes (gloo), each updating on its rows of the batch;
- global: `grpo.Policy` in one process, one backward over the whole batch (the single-process trainer);
- accumulated: `grpo.Policy`'s models in one process, the batch split into the ranks' rows, one backward per
  block, the BF16 weight gradients summed in FP32: what FSDP2 computes, without the processes.

All of it twice: with the trainer's gradient clip (max_grad_norm 1.0, it binds here) and with none (inf). The
FSDP weights compared are those of its checkpoint (`results/fsdp_grpo/<arm>_clip_<max_grad_norm>/checkpoint.pt`,
gathered on rank 0: step, weights and optimizer state, tensors and plain containers that `weights_only=True` loads).
Rank 0 writes the table after every run has finished (atomically: a failed run leaves none).

Against the engine (`--engine`, a plain process: vLLM starts its own distributed group, so it never runs inside the
torchrun launch): the engine's schedule is read from compiled vLLM on this machine (cached); under torchrun, the
training side, stock and aligned to it (`align_to_engine`), runs `steps` FSDP updates, and rank 0 keeps, per step, the sharded
forward's logprobs of the whole batch and the weights that forward used; then one engine gets each step's weights in
turn (`Engine.load_weights`, in place, as a trainer pushes them after each update) and scores the same sequences.
Per step, the response tokens whose logprob is bitwise the engine's and the largest |difference| go to
tables/fsdp_engine.csv.

    .venv/bin/python experiments/fsdp_grpo.py --engine     # ~1-2 min: schedule, torchrun of 2 processes, engine
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from rla_lib import distributed, grpo, task
from rla_lib.align import REGIONS, align_to_engine
from rla_lib.engine_align import engine_schedule_for, engine_schedule_path
from rla_lib.sides import align_config
from rla_lib.grpo import GRPOConfig, Policy
from rla_lib.models import load_model, load_tokenizer
from rla_lib.paths import RESULTS_DIR, ROOT, atomic_write
from rla_lib.report import save_table
from rla_lib.scoring import pad_batch

ARMS = {"stock": (), "aligned": REGIONS}


def fixed_batch(model: str, prompts: int, group_size: int, seed: int) -> dict:
    """ids, attn, resp (response mask over positions t -> token t+1) and adv of a seeded batch."""
    rng = random.Random(seed)
    tokenizer = load_tokenizer(model)
    sequences, starts, rewards = [], [], []
    for problem in grpo.training_prompts(step=0, n=prompts, seed=seed, exclude=set()):
        correct = set(rng.sample(range(group_size), rng.randint(1, group_size - 1)))
        for i in range(group_size):
            wrong = problem.solution[:-1] + str((int(problem.solution[-1]) + rng.randint(1, 9)) % 10)
            response = problem.solution if i in correct else wrong
            prompt_ids = tokenizer.encode(problem.prompt)
            sequences.append(prompt_ids + tokenizer.encode(response) + [tokenizer.eos_token_id])
            starts.append(len(prompt_ids) - 1)
            rewards.append(task.reward(problem, response))
    ids, attn = pad_batch(sequences)
    resp = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i, (sequence, start) in enumerate(zip(sequences, starts)):
        resp[i, start : len(sequence) - 1] = 1
    adv = torch.from_numpy(grpo.group_advantages(np.array(rewards), group_size)).float()
    return dict(ids=ids, attn=attn, resp=resp, adv=adv)


def rows(batch: dict, block: slice) -> dict:
    return {k: v[block] for k, v in batch.items()}


def sharded(cfg: GRPOConfig, batch: dict, rank: int, world_size: int, align) -> tuple:
    """The FP32 model, aligned by `align(model)` before FSDP2 wraps it, its AdamW, this rank's rows of the batch and the
    global response-token count: what every FSDP run starts from."""
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model, dtype="float32")
    model.train()
    align(model)
    distributed.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    mine = rows(batch, distributed.local_rows(len(batch["ids"]), rank, world_size))
    return model, opt, mine, int(batch["resp"].sum())


def run_fsdp(cfg: GRPOConfig, batch: dict, rank: int, world_size: int) -> dict:
    """`cfg.steps` updates on this rank's rows: the per-step global losses, the first forward's logprobs of the
    whole batch (gathered from the ranks) and the gathered weights and optimizer state (rank 0)."""
    def align(model):
        if cfg.regions:
            align_config(model, cfg.regions, cfg.align_options)

    model, opt, mine, global_tokens = sharded(cfg, batch, rank, world_size, align)
    losses, old_lp = [], None
    for _ in range(cfg.steps):
        loss, _, new_lp = distributed.grpo_step(model, opt, mine, old_lp, cfg.clip, cfg.max_grad_norm, global_tokens)
        old_lp = new_lp if old_lp is None else old_lp
        losses.append(loss)
    first_logprobs = [torch.empty_like(old_lp) for _ in range(world_size)]
    dist.all_gather(first_logprobs, old_lp)
    return dict(losses=losses, logprobs=torch.cat(first_logprobs), **distributed.full_state(model, opt))


def run_global(cfg: GRPOConfig, batch: dict) -> dict:
    """The single-process trainer: `grpo.Policy`, one backward over the whole batch per step."""
    torch.manual_seed(cfg.seed)
    policy = Policy(cfg)
    losses, old_lp = [], None
    for _ in range(cfg.steps):
        new_lp, _ = policy.logprobs(batch["ids"], batch["attn"], grad=True)
        old_lp = new_lp.detach() if old_lp is None else old_lp
        loss, _ = grpo.clipped_loss(new_lp, old_lp, batch["adv"], batch["resp"], cfg.clip)
        policy.step(loss)
        losses.append(loss.item())
    return dict(losses=losses, logprobs=old_lp, master=dict(policy.master.named_parameters()))


def run_accumulated(cfg: GRPOConfig, batch: dict, world_size: int) -> dict:
    """`grpo.Policy`'s models and optimizer, the gradient summed in FP32 over the ranks' blocks of rows."""
    torch.manual_seed(cfg.seed)
    policy = Policy(cfg)
    blocks = [rows(batch, distributed.local_rows(len(batch["ids"]), r, world_size)) for r in range(world_size)]
    global_tokens = int(batch["resp"].sum())
    losses, old_lps = [], [None] * world_size
    for _ in range(cfg.steps):
        policy.opt.zero_grad(set_to_none=True)
        shares = []
        for r, block in enumerate(blocks):
            policy.compute.zero_grad(set_to_none=True)
            new_lp, _ = policy.logprobs(block["ids"], block["attn"], grad=True)
            old_lps[r] = new_lp.detach() if old_lps[r] is None else old_lps[r]
            share = distributed.loss_share(new_lp, old_lps[r], block["adv"], block["resp"], cfg.clip, global_tokens)
            share.backward()
            shares.append(share.detach())
            for c, m in zip(policy.compute.parameters(), policy.master.parameters()):
                m.grad = c.grad.float() if m.grad is None else m.grad + c.grad.float()
        torch.nn.utils.clip_grad_norm_(policy.master.parameters(), cfg.max_grad_norm)
        policy.opt.step()
        policy.refresh_compute()
        losses.append(torch.stack(shares).sum().item())
    return dict(losses=losses, logprobs=torch.cat(old_lps), master=dict(policy.master.named_parameters()))


def run_fsdp_engine_steps(cfg: GRPOConfig, batch: dict, rank: int, world_size: int, schedule: Path | None) -> list[dict]:
    """`cfg.steps` FSDP updates of the training side aligned to `schedule` (None: stock); on rank 0, per step, the
    forward's logprobs of the whole batch (gathered) and the FP32 weights it ran with (their BF16 rounding is what FSDP's
    mixed precision computed in, and what the engine loads). Every rank takes part in the gathers."""
    def align(model):
        if schedule is not None:
            align_to_engine(model, schedule)

    model, opt, mine, global_tokens = sharded(cfg, batch, rank, world_size, align)
    steps, old_lp = [], None
    for step in range(1, cfg.steps + 1):
        weights = distributed.full_state(model, opt)["master"]  # before the update: what this step's forward reads
        _, _, new_lp = distributed.grpo_step(model, opt, mine, old_lp, cfg.clip, cfg.max_grad_norm, global_tokens)
        old_lp = new_lp if old_lp is None else old_lp
        gathered = [torch.empty_like(new_lp) for _ in range(world_size)]
        dist.all_gather(gathered, new_lp)
        if rank == 0:
            steps.append(dict(step=step, logprobs=torch.cat(gathered), master=weights))
    return steps


def compare_with_engine(path: Path, table: Path, model: str) -> pd.DataFrame:
    """Each saved step's weights into one running engine, its scoring of the batch against the sharded forward's."""
    from rla_lib.engine import Engine
    from rla_lib.machine import describe

    saved = torch.load(path, weights_only=True)
    ids, attn, resp = saved["batch"]["ids"], saved["batch"]["attn"], saved["batch"]["resp"].bool()
    sequences = [row[: int(n)].tolist() for row, n in zip(ids, attn.sum(1))]
    out = []
    with Engine(model, mode="compiled", seed=0) as engine:
        for arm, step in ((arm, step) for arm, steps in saved["arms"].items() for step in steps):
            engine.load_weights(step["master"])
            scores = engine.score(sequences, progress=False)
            engine_lp = torch.zeros_like(step["logprobs"])
            for i, s in enumerate(scores):
                engine_lp[i, : len(s.token_logprobs)] = torch.from_numpy(s.token_logprobs)
            training = step["logprobs"][resp]
            out.append(dict(arm=arm, step=step["step"], world_size=saved["world_size"], rows=len(sequences),
                            response_tokens=int(resp.sum()),
                            bitwise=float((engine_lp[resp] == training).float().mean()),
                            max_abs_diff=float((engine_lp[resp] - training).abs().max()), cpu=describe()))
    result = pd.DataFrame(out)
    save_table(result, table.stem, dict(model=model, schedule=saved["schedule"], torch=torch.__version__), table.parent)
    return result


def adamw_bound(steps: int, betas=(0.9, 0.999)) -> float:
    """Largest |update| / lr AdamW can make in `steps` steps, whatever the gradients (no weight decay, eps -> 0):
    by Cauchy-Schwarz |m_hat / sqrt(v_hat)| <= (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2) * sum_k<t (b1^2/b2)^k)."""
    b1, b2 = betas
    return sum((1 - b1) / (1 - b1**t) * np.sqrt((1 - b2**t) / (1 - b2) * sum((b1**2 / b2) ** k for k in range(t)))
               for t in range(1, steps + 1))


def differences(run: dict, other: dict, initial: dict, mask) -> dict:
    """How far `run` is from `other`: first forward, losses, final weights (the largest difference, and the norm
    of the weight difference over the norm of `other`'s whole update)."""
    names = list(initial)
    a = torch.cat([run["master"][n].detach().flatten() for n in names])
    b = torch.cat([other["master"][n].detach().flatten() for n in names])
    start = torch.cat([initial[n].detach().flatten() for n in names])
    return dict(
        max_abs_logprob_diff=((run["logprobs"] - other["logprobs"]) * mask).abs().max().item(),
        step1_abs_loss_diff=abs(run["losses"][0] - other["losses"][0]),
        max_abs_loss_diff=max(abs(x - y) for x, y in zip(run["losses"], other["losses"])),
        max_abs_param_diff=(a - b).abs().max().item(),
        relative_update_diff=((a - b).norm() / (b - start).norm()).item(),
    )


def compare(cfg: GRPOConfig, batch: dict, fsdp: dict, world_size: int) -> pd.DataFrame:
    """Rank 0: each arm's FSDP run against its single-process references, and aligned against stock.

    Tolerances (per row, what the compared quantity can do):
    - the first forward's logprobs: 0 (bitwise): the BF16 weights are the same bits and each row's logprobs
      do not depend on the other rows of its batch (tests/test_grpo_speed.py);
    - the first loss: vs accumulated 0 (the same two shares, and a + b = b + a); vs global twice the FP32
      summation bound 2^-24 * sum|A| (the terms are the advantages, ratio 1; one sum of all tokens against
      two partial sums added, each within the bound);
    - the weights (and later losses) vs accumulated: 0 (bitwise) when the clip does not bind (max_grad_norm
      inf). A binding clip scales by the gradient norm, the one quantity summed in another order (per shard,
      then across ranks): AdamW is nearly scale-invariant, so the updates then differ by about an FP32 ulp of
      the update, and no tolerance is claimed (the table shows the figures);
    - the weights vs global: AdamW's largest possible move (`adamw_bound`) twice: one backward over all the
      rows rounds each weight gradient to BF16 once, FSDP once per rank, and AdamW divides each element by its
      own magnitude, so an element whose gradient is near zero can move the other way. Only a bound.
    """
    initial = dict(load_model(cfg.model, dtype="float32").named_parameters())
    mask = batch["resp"]
    tokens = int(mask.sum())
    sum_abs_adv = (batch["adv"][:, None].abs() * mask).sum().item() / tokens  # the first loss's terms A / tokens
    common = dict(steps=cfg.steps, world_size=world_size, rows=len(batch["ids"]), tokens=tokens, lr=cfg.lr,
                  max_grad_norm=cfg.max_grad_norm)
    out = []
    for arm, run in fsdp.items():
        arm_cfg = GRPOConfig(**{**vars(cfg), "regions": ARMS[arm]})
        regions = "+".join(ARMS[arm]) or "none"
        references = dict(global_batch=run_global(arm_cfg, batch), accumulated=run_accumulated(arm_cfg, batch, world_size))
        for name, reference in references.items():
            exact = name == "accumulated"
            tolerances = dict(step1_loss_tolerance=0.0 if exact else 2 * 2.0**-24 * sum_abs_adv,
                              param_tolerance=(0.0 if np.isinf(cfg.max_grad_norm) else np.nan) if exact
                              else 2 * cfg.lr * adamw_bound(cfg.steps))
            out.append(dict(regions=regions, compared_with=name, **common,
                            **differences(run, reference, initial, mask), **tolerances))
    out.append(dict(regions="+".join(REGIONS), compared_with="stock", **common,
                    **differences(fsdp["aligned"], fsdp["stock"], initial, mask)))
    return pd.DataFrame(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes this run expects (torchrun's --nproc_per_node)")
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-grad-norm", type=float, nargs="+", default=[GRPOConfig.max_grad_norm, np.inf],
                        help="gradient clips to run (inf: never binds; then FSDP equals the accumulated reference bitwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table", default=str(ROOT / "tables" / "fsdp_equivalence.csv"))
    parser.add_argument("--checkpoints", default=str(RESULTS_DIR / "fsdp_grpo"))
    parser.add_argument("--engine", action="store_true",
                        help="the engine-aligned arm against the engine at every step (a plain process: it launches torchrun)")
    parser.add_argument("--engine-steps", action="store_true", help=argparse.SUPPRESS)  # --engine's torchrun part
    parser.add_argument("--engine-table", default=str(ROOT / "tables" / "fsdp_engine.csv"))
    args = parser.parse_args(argv)
    steps_file = Path(args.checkpoints) / "engine_steps.pt"
    if args.engine:
        engine_schedule_for(args.model, "compiled")  # read from the engine once per machine, here and not under torchrun
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.world_size),
                  __file__, *[a for a in (argv if argv is not None else sys.argv[1:]) if a != "--engine"], "--engine-steps"]
        subprocess.run(launch, check=True)
        print(compare_with_engine(steps_file, Path(args.engine_table), args.model).to_string(index=False))
        return

    rank, world_size = distributed.init_process_group(args.world_size, args.prompts * args.group_size)
    try:
        torch.set_num_threads(1)  # one core per process; the single-process references run with the same
        batch = fixed_batch(args.model, args.prompts, args.group_size, args.seed)
        if args.engine_steps:
            run_engine_steps(args, batch, rank, world_size, steps_file)
            return
        tables = []
        for max_grad_norm in args.max_grad_norm:
            cfg = GRPOConfig(model=args.model, steps=args.steps, lr=args.lr, seed=args.seed, max_grad_norm=max_grad_norm,
                             prompts_per_step=args.prompts, group_size=args.group_size)
            fsdp = {}
            for arm, regions in ARMS.items():
                fsdp[arm] = run_fsdp(GRPOConfig(**{**vars(cfg), "regions": regions}), batch, rank, world_size)
                if rank == 0:
                    checkpoint = dict(step=args.steps, master=fsdp[arm]["master"], opt=fsdp[arm]["opt"])
                    path = f"{args.checkpoints}/{arm}_clip_{max_grad_norm:g}/checkpoint.pt"
                    atomic_write(path, lambda p: torch.save(checkpoint, p))
            if rank == 0:
                tables.append(compare(cfg, batch, fsdp, world_size))
        if rank == 0:
            table = pd.concat(tables, ignore_index=True)
            save_table(table, Path(args.table).stem, vars(args) | {"torch": torch.__version__}, Path(args.table).parent)
            print(table.to_string(index=False))
        # Tear down together, so that no rank leaves (closing its connections) while rank 0 still computes the
        # references; how a rank leaves is at the end of this file.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_engine_steps(args, batch: dict, rank: int, world_size: int, steps_file: Path) -> None:
    """The engine-aligned FSDP run (`run_fsdp_engine_steps`), its steps kept by rank 0 for `--engine-compare`."""
    schedule = engine_schedule_path(args.model, "compiled")
    if not schedule.exists():
        raise SystemExit(f"{schedule} is missing: run experiments/fsdp_grpo.py --engine (it reads the schedule first)")
    cfg = GRPOConfig(model=args.model, steps=args.steps, lr=args.lr, seed=args.seed, max_grad_norm=args.max_grad_norm[0],
                     prompts_per_step=args.prompts, group_size=args.group_size)
    arms = {arm: run_fsdp_engine_steps(cfg, batch, rank, world_size, source)
            for arm, source in (("stock", None), ("engine-aligned", schedule))}
    if rank == 0:
        kept = dict(arms=arms, batch=batch, world_size=world_size, schedule=str(schedule))
        atomic_write(steps_file, lambda p: torch.save(kept, p))
    dist.barrier()


if __name__ == "__main__":
    main()
    # Leave without interpreter finalization. Under load a rank aborted after the run, its results written and the
    # group destroyed ("terminate called without an active exception", no Python frame on any thread: torch's C++
    # teardown of the FSDP objects and gloo threads at finalization), in both FSDP tests, several times. Nothing is
    # left to release: the tables and checkpoints are written atomically and closed, the group is destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
