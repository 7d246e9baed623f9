"""Clipped GRPO with real vLLM rollouts, readable top to bottom (cleanrl style).

One step:
  1. rollout   the engine (vLLM, compiled by default) samples `group_size` responses per prompt;
               the task's checker gives each a 0/1 reward
  2. score     the training side (Transformers, BF16 compute, optionally aligned) recomputes the
               "old" logprobs of the sampled tokens (those of the first minibatch come from its own
               update forward, which no update precedes: the same bits); the mismatch monitor compares
               them with the engine's own logprobs
  3. update    group-normalised advantages, clipped surrogate (clip 0.2, no KL penalty, no mismatch
               correction unless `tis_cap` is set), AdamW on FP32 master weights
  4. sync      the new weights are loaded into the running engine (no restart), prefix cache reset

Mixed precision as trainers do it: FP32 master weights and optimizer state; a BF16 copy computes the
forward and backward; its gradients are accumulated into the FP32 master. The zero-mismatch control
(`precision="fp32"`) runs both sides in FP32.

Sampling temperature: the engine samples softmax(logits / T) and returns that distribution's
logprobs; the training side scores the same distribution (`Policy.logprobs` divides its FP32 logits
by T, as vLLM does), so at T != 1 the ratio compares like with like. Held-out accuracy is always
measured at T=1.

Results go to `out_dir`: `history.csv` (one row per step), `checkpoint.pt` every `checkpoint_every`
steps (weights, optimizer, step); a run started again with the same `out_dir` resumes from it and
gives the same results as an uninterrupted run. Every file is written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from . import task
from .align import REGIONS, align
from .kl import MismatchMonitor
from .models import load_model
from .machine import machine
from .paths import atomic_write
from .progress import bar
from .rounding import round_mantissa
from .scoring import log_softmax_at, pad_batch


@dataclass
class GRPOConfig:
    model: str = "qwen3-tiny"
    regions: tuple[str, ...] = ()  # training-side alignment; () is the default BF16 stack
    align_options: dict = field(default_factory=dict)
    precision: str = "bf16"  # "bf16", or "fp32": the zero-mismatch control (both sides FP32)
    engine_mode: str = "compiled"
    steps: int = 50
    prompts_per_step: int = 16
    group_size: int = 8
    max_tokens: int = 32
    temperature: float = 1.0
    lr: float = 2e-5
    weight_decay: float = 0.0
    clip: float = 0.2
    minibatches: int = 2  # updates per rollout batch; >1 makes the clip matter
    max_grad_norm: float = 1.0
    tis_cap: float | None = None  # truncated importance sampling weight cap (e.g. 2.0); None = no correction
    rollout_mantissa_bits: int | None = None  # engine gets weights rounded to this many mantissa bits (< 7):
    # a controlled, larger mismatch (lower-precision rollouts, e.g. FP8 E4M3 keeps 3); None = plain BF16
    eval_every: int = 10
    eval_prompts: int = 128
    checkpoint_every: int = 10
    seed: int = 0

    def __post_init__(self):
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"precision must be 'bf16' or 'fp32' (the zero-mismatch control), got {self.precision!r}")
        if self.precision == "fp32" and self.regions:
            raise ValueError("alignment changes nothing in FP32: use regions=() with precision='fp32'")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (GRPO needs the sampling distribution's logprobs), got {self.temperature}")
        if self.rollout_mantissa_bits is not None and not (self.precision == "bf16" and 0 <= self.rollout_mantissa_bits < 7):
            raise ValueError("rollout_mantissa_bits must be in [0, 6] (BF16 keeps 7) with precision='bf16'; "
                             f"got {self.rollout_mantissa_bits} with precision={self.precision!r}")
        self.regions = tuple(self.regions)

    @property
    def dtype(self):
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    @property
    def engine_dtype(self) -> str:
        return "bfloat16" if self.precision == "bf16" else "float32"


# The configurations compared in notebook 06 and the settings search, by name.
CONFIGURATIONS = {
    "default BF16": dict(),
    "rope": dict(regions=("rope",)),
    "all three": dict(regions=REGIONS),
    "FP32 control": dict(precision="fp32"),
    "default BF16 + TIS": dict(tis_cap=2.0),
    "default BF16, 3-bit rollouts": dict(rollout_mantissa_bits=3),  # a deliberately larger mismatch
}


# ---- the objective ---------------------------------------------------------------------------
def group_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """(r - mean of its group) / (std of its group + eps); groups are consecutive blocks."""
    r = rewards.reshape(-1, group_size)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + eps)).reshape(-1)


def clipped_loss(new_lp, old_lp, advantages, mask, clip: float, tis_weight=None):
    """Token-mean of the clipped surrogate -min(ratio * A, clip(ratio) * A), over tokens where mask=1.

    Returns (loss, clip fraction). `tis_weight`, if given, multiplies each token's term
    (truncated importance sampling towards the inference policy; no gradient through it).
    """
    ratio = torch.exp(new_lp - old_lp)
    adv = advantages[:, None].expand_as(new_lp)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    if tis_weight is not None:
        surrogate = surrogate * tis_weight
    n = mask.sum().clamp(min=1)
    loss = -(surrogate * mask).sum() / n
    clipped = ((ratio - 1).abs() > clip).float()
    return loss, ((clipped * mask).sum() / n).item()


# ---- the two sides -------------------------------------------------------------------------
class Policy:
    """FP32 master weights + AdamW; a compute copy in the run's precision (aligned if asked)."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.master = load_model(cfg.model, dtype="float32")
        self.master.train()
        self.compute = load_model(cfg.model, dtype=cfg.dtype) if cfg.precision == "bf16" else self.master
        self.compute.train()
        if cfg.regions:
            align(self.compute, cfg.regions, **cfg.align_options)
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))

    def refresh_compute(self):
        if self.compute is not self.master:
            with torch.no_grad():  # round the FP32 master to BF16, all tensors in one call
                torch._foreach_copy_(list(self.compute.parameters()), list(self.master.parameters()))

    def rollout_weights(self):
        """What the engine gets: the FP32 master (the engine rounds it to its dtype), or coarser if asked."""
        bits = self.cfg.rollout_mantissa_bits
        if bits is None:
            return self.master
        return {k: round_mantissa(v.detach(), bits) for k, v in self.master.state_dict().items()}

    def logprobs(self, ids, mask, grad: bool):
        """Per-token logprobs (B, T-1) of ids[:, 1:], and the policy entropy per position.

        Both of the distribution the engine samples from: softmax(logits / cfg.temperature).
        """
        with torch.set_grad_enabled(grad):
            logits = self.compute(input_ids=ids, attention_mask=mask).logits[:, :-1]
            logp = log_softmax_at(logits, self.cfg.temperature)
            lp = logp.gather(-1, ids[:, 1:, None])[..., 0]
            entropy = -(logp.exp() * logp).sum(-1).detach()
        return lp, entropy

    def step(self, loss) -> float:
        self.opt.zero_grad(set_to_none=True)
        if self.compute is not self.master:
            self.compute.zero_grad(set_to_none=True)
        loss.backward()
        if self.compute is not self.master:
            for c, m in zip(self.compute.parameters(), self.master.parameters()):
                m.grad = c.grad.float() if c.grad is not None else None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.cfg.max_grad_norm).item()
        self.opt.step()
        self.refresh_compute()
        return grad_norm


# ---- the loop ------------------------------------------------------------------------------
def training_prompts(step: int, n: int, seed: int, exclude: set[str]) -> list[task.Problem]:
    """Prompts for one step, a pure function of (seed, step) so a resumed run sees the same ones."""
    rng = random.Random(f"{seed}-{step}")
    out = []
    while len(out) < n:
        p = task.sample_problem(rng)
        if p.prompt not in exclude:
            out.append(p)
    return out


def save_checkpoint(path: Path, policy: Policy, step: int, history: list[dict]) -> None:
    state = dict(step=step, master=policy.master.state_dict(), opt=policy.opt.state_dict(), history=history)
    atomic_write(path, lambda p: torch.save(state, p))


def evaluate(engine, problems, seed: int, max_tokens: int) -> float:
    groups = engine.sample([p.prompt for p in problems], n=1, max_tokens=max_tokens, temperature=1.0, seed=seed,
                           progress=False)  # the step bar of `run` is the progress
    return float(np.mean([task.reward(p, g[0].text) for p, g in zip(problems, groups)]))


def evaluate_run(cfg: GRPOConfig, policy: Policy, engine, eval_split) -> dict:
    """Held-out accuracy of the engine's copy (`eval_accuracy`) and of the trained policy (`eval_accuracy_policy`).

    They differ only with coarse rollouts, where the engine holds a rounded copy: the plain weights are
    pushed for the second evaluation (same seed: a paired comparison) and the coarse ones pushed back
    (a push is ~20 ms here). Otherwise the engine holds the policy and one evaluation serves both.
    """
    def accuracy():
        return evaluate(engine, eval_split, seed=cfg.seed + 7, max_tokens=cfg.max_tokens)

    engine_acc = accuracy()
    if cfg.rollout_mantissa_bits is None:
        return dict(eval_accuracy=engine_acc, eval_accuracy_policy=engine_acc)
    engine.load_weights(policy.master)  # the engine rounds the FP32 master to BF16, as in a plain run
    try:
        policy_acc = accuracy()
    finally:
        engine.load_weights(policy.rollout_weights())
    return dict(eval_accuracy=engine_acc, eval_accuracy_policy=policy_acc)


def record_machine(path: Path) -> None:
    """Append this start's machine to the run's list: a run resumed elsewhere says so (BF16 kernels differ by CPU)."""
    starts = json.loads(path.read_text()) if path.exists() else []
    starts.append(dict(started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), machine=machine()))
    atomic_write(path, lambda p: p.write_text(json.dumps(starts, indent=1)))


def run(cfg: GRPOConfig, out_dir: Path, engine=None, progress: bool | None = None) -> pd.DataFrame:
    """Train, log, checkpoint; resume from `out_dir/checkpoint.pt` if it exists. Returns the history.

    progress: a bar over the steps (None: only in a Jupyter kernel, see `rla_lib.progress`).

    Pass an open `Engine` (in the run's precision) to reuse it across runs: its weights are reset
    to the run's starting weights first.
    """
    from .engine import Engine

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.json"
    settings = dataclasses.asdict(cfg) | {"regions": list(cfg.regions)}
    if config_path.exists():  # resuming (or extending with more steps) needs the same settings otherwise
        saved = json.loads(config_path.read_text())
        changed = sorted(k for k in settings if k != "steps" and saved.get(k) != settings[k])
        if changed:
            raise ValueError(f"{out_dir} holds a run with different settings ({', '.join(changed)}); "
                             "use another out_dir, or delete it to start over")
    atomic_write(config_path, lambda p: p.write_text(json.dumps(settings, indent=1, sort_keys=True)))
    record_machine(out_dir / "machine.json")

    torch.manual_seed(cfg.seed)
    policy = Policy(cfg)
    history, start = [], 1
    ckpt = out_dir / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        policy.master.load_state_dict(state["master"])
        policy.opt.load_state_dict(state["opt"])
        policy.refresh_compute()
        history, start = state["history"], state["step"] + 1
    own_engine = engine is None
    if own_engine:
        engine = Engine(cfg.model, mode=cfg.engine_mode, dtype=cfg.engine_dtype, seed=cfg.seed)
    engine.load_weights(policy.rollout_weights())

    eval_split = task.load_split()[: cfg.eval_prompts]
    exclude = {p.prompt for p in task.load_split()}
    monitor = MismatchMonitor()
    if not history:  # step 0: the held-out accuracy before any update, the start of every curve
        history.append(dict(step=0, eval_prompts=len(eval_split), **evaluate_run(cfg, policy, engine, eval_split)))
    for row in history[1:]:
        monitor.rows.append({k: row[k] for k in ("step", "tokens", "sampled_kl", "k3", "mean_abs_diff", "max_abs_diff")})
    try:
        for step in bar(range(start, cfg.steps + 1), progress, initial=start - 1, total=cfg.steps, desc=out_dir.name):
            history.append(train_step(cfg, step, policy, engine, monitor, eval_split, exclude))
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save_checkpoint(ckpt, policy, step, history)
                atomic_write(out_dir / "history.csv", lambda p: pd.DataFrame(history).to_csv(p, index=False))
    finally:
        if own_engine:
            engine.close()
    return pd.DataFrame(history)


def run_many(runs, progress: bool | None = None):
    """Run `[(cfg, out_dir), ...]` in order, one engine per (model, mode, dtype) shared by the runs that need it.

    Yields `(cfg, out_dir, history)` as each run finishes. Engines are closed at the end.
    """
    from .engine import Engine

    engines = {}
    try:
        for cfg, out_dir in runs:
            key = (cfg.model, cfg.engine_mode, cfg.engine_dtype)
            if key not in engines:
                engines[key] = Engine(cfg.model, mode=cfg.engine_mode, dtype=cfg.engine_dtype, seed=cfg.seed)
            yield cfg, out_dir, run(cfg, out_dir, engine=engines[key], progress=progress)
    finally:
        for engine in engines.values():
            engine.close()


def minibatch_rows(cfg, step: int, n: int) -> list[torch.Tensor]:
    """The rows of each minibatch: a shuffle of the n samples, a pure function of (seed, step)."""
    order = np.random.default_rng(cfg.seed * 7919 + step).permutation(n)
    return [torch.from_numpy(mb) for mb in np.array_split(order, cfg.minibatches)]


def score_rows(policy, ids, attn, rows, old_lp, entropy) -> None:
    """Fill old_lp and entropy at `rows` (no grad), cut to those rows' longest sequence.

    Each row's logprobs depend on neither the other rows nor the padding after it (right padding,
    causal attention), bit for bit: tests/test_grpo_speed.py checks it. Entries past the cut stay 0;
    they are padding, masked everywhere they are used.
    """
    if len(rows) == 0:
        return
    width = int(attn[rows].sum(1).max())
    with torch.no_grad():
        lp, ent = policy.logprobs(ids[rows, :width], attn[rows, :width], grad=False)
    old_lp[rows, : width - 1], entropy[rows, : width - 1] = lp, ent


def rollout(cfg, step: int, engine, exclude) -> tuple[list, np.ndarray]:
    """The step's samples (`group_size` per training prompt, seeded by step) and their 0/1 rewards."""
    problems = training_prompts(step, cfg.prompts_per_step, cfg.seed, exclude)
    groups = engine.sample([p.prompt for p in problems], n=cfg.group_size, max_tokens=cfg.max_tokens,
                           temperature=cfg.temperature, seed=cfg.seed * 1_000_003 + step * 1009, progress=False)
    samples = [s for g in groups for s in g]
    return samples, np.array([task.reward(p, s.text) for p, g in zip(problems, groups) for s in g])


def response_batch(samples):
    """(ids, attention mask, response mask over positions t -> token t+1, the engine's logprobs there)."""
    ids, attn = pad_batch([s.ids for s in samples])
    resp = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    inf_lp = torch.zeros_like(resp)
    for i, s in enumerate(samples):
        a, b = len(s.prompt_ids) - 1, len(s.ids) - 1
        resp[i, a:b] = 1
        inf_lp[i, a:b] = torch.from_numpy(s.logprobs)
    return ids, attn, resp, inf_lp


def train_step(cfg, step, policy, engine, monitor, eval_split, exclude) -> dict:
    t0 = time.perf_counter()
    samples, rewards = rollout(cfg, step, engine, exclude)
    t_rollout = time.perf_counter()

    # Old logprobs from the training side; response tokens only (mask over positions t -> token t+1).
    # The first minibatch's are those of its own update forward (no update has happened yet: the same
    # bits as a no-grad pass, tested), so only the later minibatches' rows get a no-grad pass here.
    ids, attn, resp, inf_lp = response_batch(samples)
    minibatches = minibatch_rows(cfg, step, len(samples))
    old_lp, entropy = torch.zeros_like(resp), torch.zeros_like(resp)
    score_rows(policy, ids, attn, torch.cat(minibatches)[len(minibatches[0]) :], old_lp, entropy)
    lengths = resp.sum(1).long()
    t_score = time.perf_counter()

    adv = torch.from_numpy(group_advantages(rewards, cfg.group_size)).float()
    grad_norms, clip_fracs = [], []
    for i, mb in enumerate(minibatches):
        new_lp, new_entropy = policy.logprobs(ids[mb], attn[mb], grad=True)
        if i == 0:
            old_lp[mb], entropy[mb] = new_lp.detach(), new_entropy
        tis = torch.clamp(torch.exp(old_lp[mb] - inf_lp[mb]), max=cfg.tis_cap) if cfg.tis_cap else None
        loss, clip_frac = clipped_loss(new_lp, old_lp[mb], adv[mb], resp[mb], cfg.clip, tis)
        grad_norms.append(policy.step(loss))
        clip_fracs.append(clip_frac)
    monitor.update(step, [s.logprobs for s in samples],
                   [old_lp[i, len(s.prompt_ids) - 1 : len(s.ids) - 1].numpy() for i, s in enumerate(samples)])
    t_update = time.perf_counter()
    engine.load_weights(policy.rollout_weights())
    t_sync = time.perf_counter()

    m = monitor.rows[-1]
    row = dict(step=step, reward=rewards.mean(), tokens=m["tokens"], sampled_kl=m["sampled_kl"], k3=m["k3"],
               mean_abs_diff=m["mean_abs_diff"], max_abs_diff=m["max_abs_diff"],
               entropy=(entropy * resp).sum().item() / resp.sum().item(), grad_norm=float(np.mean(grad_norms)),
               clip_frac=float(np.mean(clip_fracs)), response_len=lengths.float().mean().item(),
               padded_tokens=ids.numel(), real_tokens=int(attn.sum()),
               t_rollout=t_rollout - t0, t_score=t_score - t_rollout, t_update=t_update - t_score, t_sync=t_sync - t_update,
               eval_prompts=len(eval_split), eval_accuracy=np.nan, eval_accuracy_policy=np.nan)
    if step % cfg.eval_every == 0:
        row.update(evaluate_run(cfg, policy, engine, eval_split))
    return row


# ---- reading the results -------------------------------------------------------------------
# A held-out accuracy is a binomial proportion over `n` problems: standard error sqrt(p (1 - p) / n),
# about 3 points at n = 256. A drop counts only beyond NOISE_Z combined standard errors of the two
# evaluations compared. Two, not one: the peak is the maximum over several noisy evaluations, so it is
# biased upwards (by about one SE with a handful of evaluations); one SE would flag flat runs.
NOISE_Z = 2.0


def binomial_se(p, n: int):
    """Standard error of an accuracy p measured on n problems."""
    return np.sqrt(np.asarray(p) * (1 - np.asarray(p)) / n)


def accuracy_verdict(steps, accuracies, n: int) -> dict:
    """Did a run degrade (rose, then fell beyond noise) or diverge at once (never improved, fell beyond noise)?

    `steps`, `accuracies`: the evaluations in order (step 0 = before training); `n`: problems per evaluation.
    degraded: the peak comes after step 0 and the last evaluation is below it by more than the margin.
    diverged: the best evaluation is step 0 and the last is below it by more than the margin.
    margin = NOISE_Z * sqrt(se(peak)^2 + se(last)^2).
    """
    steps, acc = np.asarray(steps), np.asarray(accuracies, dtype=float)
    if len(acc) == 0:
        return dict(degraded=False, diverged=False, margin=float("nan"), peak_step=float("nan"))
    i = int(np.argmax(acc))  # the first maximum: a tie with step 0 counts as never improved
    peak, last = acc[i], acc[-1]
    margin = float(NOISE_Z * np.hypot(binomial_se(peak, n), binomial_se(last, n)))
    fell = bool(peak - last > margin)
    return dict(degraded=fell and bool(steps[i] > 0), diverged=fell and bool(steps[i] == 0), margin=margin,
                peak_step=int(steps[i]))


def eval_problems(history: pd.DataFrame, eval_prompts: int | None = None) -> int:
    """Problems per held-out evaluation: the argument if given, else the history's `eval_prompts` column."""
    if eval_prompts is not None:
        return int(eval_prompts)
    if "eval_prompts" in history and history["eval_prompts"].notna().any():
        values = history["eval_prompts"].dropna().unique()
        if len(values) == 1:
            return int(values[0])
    raise ValueError("the history does not say how many problems each evaluation used (no single `eval_prompts` "
                     "value): pass eval_prompts= (the settings search used 256, recorded in its sidecar JSON)")


def _accuracy_columns(ev: pd.DataFrame, column: str, label: str) -> dict:
    acc = ev[column]
    return {f"{label} first": acc.iloc[0], f"{label} peak": acc.max(), f"{label} last": acc.iloc[-1]}


def summarize(history: pd.DataFrame, eval_prompts: int | None = None) -> pd.Series:
    """One run in a row: reward and held-out accuracy early/peak/late, whether it degraded or diverged
    (`accuracy_verdict`, with the margin used), mismatch, clip fraction, step time.

    "eval acc first" is the accuracy before training (step 0). With coarse rollouts, "eval acc policy ..."
    is the trained BF16 policy's own accuracy (the engine's coarse copy is "eval acc ...").
    `eval_prompts`: problems per evaluation; default from the history's `eval_prompts` column.
    """
    n = eval_problems(history, eval_prompts)
    ev = history.dropna(subset=["eval_accuracy"])
    h = history[history["step"] > 0]
    k = max(1, len(h) // 5)
    nan = float("nan")
    accuracy = _accuracy_columns(ev, "eval_accuracy", "eval acc") if len(ev) else dict.fromkeys(
        ["eval acc first", "eval acc peak", "eval acc last"], nan)
    out = pd.Series({
        "reward first 20%": h["reward"].head(k).mean(), "reward last 20%": h["reward"].tail(k).mean(), **accuracy,
        "k3 mean (1e-4)": h["k3"].mean(), "k3 first 20% (1e-4)": h["k3"].head(k).mean(),
        "k3 last 20% (1e-4)": h["k3"].tail(k).mean(),
        "sampled KL mean (1e-4)": h["sampled_kl"].mean(), "entropy last 20%": h["entropy"].tail(k).mean(),
        "clip frac": h["clip_frac"].mean(),
        "step seconds": h[["t_rollout", "t_score", "t_update", "t_sync"]].sum(1).median(),
    })
    if "eval_accuracy_policy" in history and history["eval_accuracy_policy"].notna().any():
        out = pd.concat([out, pd.Series(_accuracy_columns(history.dropna(subset=["eval_accuracy_policy"]),
                                                          "eval_accuracy_policy", "eval acc policy"))])
    verdict = accuracy_verdict(ev["step"], ev["eval_accuracy"], n)
    out["drop from peak"] = out["eval acc peak"] - out["eval acc last"]
    out["noise margin"] = verdict["margin"]
    out["eval problems"] = n
    out["degraded"], out["diverged"] = verdict["degraded"], verdict["diverged"]
    return out


FLAGS = ("degraded", "diverged")


def compare_seeds(histories: pd.DataFrame, by=("config",), eval_prompts: int | None = None) -> pd.DataFrame:
    """Runs that differ only by seed, side by side: mean and standard error over seeds of each summary.

    `histories` stacks run histories with a `run` column naming each run and the `by` columns labelling
    its settings. Returns one row per setting, columns (metric, "mean" | "se"), plus `seeds`, `degraded`
    and `diverged` (how many of the seeds did). `eval_prompts` as in `summarize`.
    """
    by = list(by)
    runs = histories.groupby("run", sort=False)  # settings keep the order they first appear in
    per_run = pd.DataFrame({run: summarize(h, eval_prompts).rename(None) for run, h in runs}).T
    labels = runs[by].first()
    per_run = per_run.join(labels)
    metrics = [c for c in per_run.columns if c not in by and c not in FLAGS]
    per_run[metrics] = per_run[metrics].astype(float)
    g = per_run.groupby(by, sort=False)
    table = pd.concat({"mean": g[metrics].mean(), "se": g[metrics].sem()}, axis=1).swaplevel(axis=1)
    table = table[[(m, s) for m in metrics for s in ("mean", "se")]]
    table[("seeds", "")] = g.size()
    for flag in FLAGS:
        table[(flag, "")] = g[flag].apply(lambda c: int(c.astype(bool).sum()))
    return table


def seed_difference(table: pd.DataFrame, a, b, metric: str = "eval acc last", metric_b: str | None = None) -> tuple[float, float]:
    """Difference of seed means a - b of `metric` in a `compare_seeds` table, and its standard error.

    `metric_b` (default: `metric`) is b's metric, e.g. the 3-bit arm's trained-policy accuracy against a plain
    run's accuracy (which is its policy's: the engine holds the policy's own weights there)."""
    metric_b = metric_b or metric
    (ma, sa), (mb, sb) = table.loc[a, [(metric, "mean"), (metric, "se")]], table.loc[b, [(metric_b, "mean"), (metric_b, "se")]]
    return float(ma - mb), float(np.hypot(sa, sb))


# ---- the settings search's shipped histories ------------------------------------------------
def sweep_sidecar_path(histories_path) -> Path:
    """`histories.csv.gz` -> `histories.json`: where the search records when and from what it was collected."""
    path = Path(histories_path)
    return path.with_name(path.name.split(".")[0] + ".json")


def load_sweep(histories_path) -> tuple[pd.DataFrame, dict]:
    """The stacked per-step histories of a settings search and its sidecar ({} if it has none)."""
    sidecar = sweep_sidecar_path(histories_path)
    meta = json.loads(sidecar.read_text()) if sidecar.exists() else {}
    return pd.read_csv(histories_path), meta
