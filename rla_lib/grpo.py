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

Mismatch columns of the history: `sampled_kl`, `k3` and `exact_kl` per token (1e-4; exact = the full-vocabulary
KL(inference || training), logged where the vocabulary is small enough for the engine to return whole sampling
distributions), `seq_k3` and `seq_exact_kl` per response (nats: each response's sum, averaged), `tis_weight` (mean
min(rho, cap)) and `seq_is_above_cap` (share of responses whose sequence-level ratio exceeds the cap).

Results go to `out_dir`: `history.csv` (one row per step) and, every `checkpoint_every` steps, `checkpoint.pt`
(weights, optimizer state, step: tensors and plain containers) with `checkpoint.json` beside it (step, history); a
run started again with the same `out_dir` resumes from them and gives the same results as an uninterrupted run.
Every file is written atomically. The .pt is loaded with `weights_only=True`: run folders are shared (sweeps, copied
results), and a checkpoint holding anything but data is refused rather than unpickled (`load_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import pickle
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from . import native, task
from .sides import align_config
from .align.monitor import TIS_CAP, MismatchMeter, mismatch_summary
from .engine import Engine
from .kl import UNIT
from .bf16_matmul import use_fp32_row_blocks
from .machine import machine
from .memory import reuse_freed_memory, trim_freed_memory
from .models import check_memory, load_model, resolve_model
from .paths import atomic_write
from .progress import bar
from .rounding import round_mantissa
from .scoring import log_softmax_at, pad_batch


# ---- the configuration -----------------------------------------------------------------------
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
    rollout_logit_noise: float = 0.0  # a second kind of dose: the engine samples from logits + N(0, sigma^2)
    # per vocabulary entry (rla_lib.logit_noise); held-out accuracy is measured without it
    task: str = "sums"  # the task variant (rla_lib.task.TASKS): "steps" has 45-100-token answers (qwen3-tiny-steps)
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
        if self.task not in task.TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose from {list(task.TASKS)}")
        if not self.rollout_logit_noise >= 0:
            raise ValueError(f"rollout_logit_noise is a standard deviation (>= 0), got {self.rollout_logit_noise}")
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


# Memory a GRPO run needs: FP32 master weights 4 + AdamW state 8 + BF16 copy and its gradients 4 + the engine's copy 2
# (the master takes the BF16 gradients as they are: no FP32 copies)
BYTES_PER_PARAMETER = 18


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


def clip_coefficient(grads, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(total norm, clip coefficient) of torch.nn.utils.clip_grad_norm_ for the FP32 values of `grads`, bit for bit: each
    tensor's 2-norm accumulated in FP32 (vector_norm of a BF16 tensor with dtype=float32 gives the bits of its FP32
    copy's, tested; native.bf16_norms gives them without the copy), the norm of those norms, then
    min(max_norm / (norm + 1e-6), 1)."""
    grads = [g for g in grads if g is not None]
    norms = native.bf16_norms(grads)
    if norms is None:
        norms = torch.stack([torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads])
    total = torch.linalg.vector_norm(norms, 2)
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)


# ---- the two sides -------------------------------------------------------------------------
class Policy:
    """FP32 master weights + AdamW; a compute copy in the run's precision (aligned if asked)."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.master = load_model(cfg.model, dtype="float32")
        self.master.train()
        self.compute = load_model(cfg.model, dtype=cfg.dtype) if cfg.precision == "bf16" else self.master
        if self.compute is self.master:
            use_fp32_row_blocks(self.master)  # a row's bits independent of its batch, as the fast step needs
        self.compute.train()
        if cfg.regions:
            align_config(self.compute, cfg.regions, cfg.align_options)
        # torch's for-loop AdamW's bits in fewer passes over memory (benchmarks/adamw_step.py)
        self.opt = native.AdamW(self.master.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))

    def refresh_compute(self):
        if self.compute is not self.master:
            with torch.no_grad():  # round the FP32 master to BF16, all tensors in one call
                torch._foreach_copy_(list(self.compute.parameters()), list(self.master.parameters()))

    def rollout_weights(self):
        """What the engine gets: the BF16 compute copy (the master rounded as the engine would round it itself: one
        rounding to nearest even), the FP32 master in an FP32 run, or coarser weights if asked."""
        bits = self.cfg.rollout_mantissa_bits
        if bits is None:
            return self.compute
        return {k: round_mantissa(v.detach(), bits) for k, v in self.master.state_dict().items()}

    def logprobs(self, ids, mask, grad: bool, full: bool = False, entropy: bool = True):
        """Per-token logprobs (B, T-1) of ids[:, 1:], and the policy entropy per position (None if not `entropy`).

        Both of the distribution the engine samples from: softmax(logits / cfg.temperature).
        full=True also returns the whole log-distribution (B, T-1, V), detached (small vocabularies).
        """
        with torch.set_grad_enabled(grad):
            logits = self.compute(input_ids=ids, attention_mask=mask).logits[:, :-1]
            logp = log_softmax_at(logits, self.cfg.temperature)
            lp = logp.gather(-1, ids[:, 1:, None])[..., 0]
        with torch.no_grad():  # a statistic: three passes over the vocabulary, no graph for them
            ent = -(logp.exp() * logp).sum(-1) if entropy else None
        return (lp, ent, logp.detach()) if full else (lp, ent)

    def step(self, loss) -> float:
        """Backward, clip the gradient's norm, AdamW on the master; returns the norm before clipping."""
        if self.compute is self.master:
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.cfg.max_grad_norm)
            self.opt.step()
            return grad_norm.item()
        self.compute.zero_grad(set_to_none=True)
        loss.backward()
        # The master takes the BF16 gradients as they are (FP32 copies of them would hold the same values):
        # torch's clip_grad_norm_ and AdamW arithmetic on those values, without the copies (native.AdamW), and the
        # BF16 copy is refreshed in the same pass (the bits of refresh_compute)
        compute = list(self.compute.parameters())
        grads = [c.grad for c in compute]
        grad_norm, clip = clip_coefficient(grads, self.cfg.max_grad_norm)
        self.opt.step_with_grads(grads, clip, copies=compute)
        return grad_norm.item()


# ---- one step ------------------------------------------------------------------------------
def training_prompts(step: int, n: int, seed: int, exclude: set[str], task_name: str = "sums") -> list[task.Problem]:
    """Prompts for one step, a pure function of (seed, step) so a resumed run sees the same ones."""
    rng = random.Random(f"{seed}-{step}")
    out = []
    while len(out) < n:
        p = task.sample_problem(rng, task.TASKS[task_name])
        if p.prompt not in exclude:
            out.append(p)
    return out


def rollout(cfg, step: int, engine, exclude) -> tuple[list, np.ndarray]:
    """The step's samples (`group_size` per training prompt, seeded by step) and their 0/1 rewards."""
    problems = training_prompts(step, cfg.prompts_per_step, cfg.seed, exclude, cfg.task)
    groups = engine.sample([p.prompt for p in problems], n=cfg.group_size, max_tokens=cfg.max_tokens,
                           temperature=cfg.temperature, seed=cfg.seed * 1_000_003 + step * 1009, progress=False,
                           logit_noise=cfg.rollout_logit_noise, full=engine.spec.small_vocab)
    samples = [s for g in groups for s in g]
    return samples, np.array([task.reward(p, s.text) for p, g in zip(problems, groups) for s in g])


def response_batch(samples):
    """(ids, attention mask, response mask over positions t -> token t+1, the engine's logprobs there)."""
    ids, attn = pad_batch([s.ids for s in samples])
    resp = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    inf_lp = torch.zeros_like(resp)
    for i, s in enumerate(samples):
        response = slice(s.response_start, len(s.ids) - 1)
        resp[i, response] = 1
        inf_lp[i, response] = torch.from_numpy(s.logprobs)
    return ids, attn, resp, inf_lp


def minibatch_rows(cfg, step: int, n: int) -> list[torch.Tensor]:
    """The rows of each minibatch: a shuffle of the n samples, a pure function of (seed, step)."""
    order = np.random.default_rng(cfg.seed * 7919 + step).permutation(n)
    return [torch.from_numpy(mb) for mb in np.array_split(order, cfg.minibatches)]


def score_rows(policy, ids, attn, rows, old_lp, entropy, old_full=None) -> None:
    """Fill old_lp and entropy (and old_full, the whole distributions, if given) at `rows` (no grad), cut to
    those rows' longest sequence.

    A row's logprobs do not depend on the other rows, bit for bit; the padding the cut removes changes none of its
    bits with the engine's attention kernel (the engine-aligned arms), but can with PyTorch's SDPA on CPU (its vector
    blocks over the keys run to the padded width), where the cut is then part of the step's bits
    (tests/test_grpo_speed.py). Entries past the cut stay 0; they are padding, masked everywhere they are used.
    """
    if len(rows) == 0:
        return
    width = int(attn[rows].sum(1).max())
    with torch.no_grad():
        lp, ent, *full = policy.logprobs(ids[rows, :width], attn[rows, :width], grad=False, full=old_full is not None)
    old_lp[rows, : width - 1], entropy[rows, : width - 1] = lp, ent
    if old_full is not None:
        old_full[rows, : width - 1] = full[0]


def train_step(cfg, step, policy, engine, meter, eval_split, exclude) -> dict:
    t0 = time.perf_counter()
    samples, rewards = rollout(cfg, step, engine, exclude)
    t_rollout = time.perf_counter()

    # Old logprobs from the training side; response tokens only (mask over positions t -> token t+1).
    # The first minibatch's are those of its own update forward (no update has happened yet: the same
    # bits as a no-grad pass, tested), so only the later minibatches' rows get a no-grad pass here.
    ids, attn, resp, inf_lp = response_batch(samples)
    minibatches = minibatch_rows(cfg, step, len(samples))
    old_lp, entropy = torch.zeros_like(resp), torch.zeros_like(resp)
    exact = samples[0].full is not None  # whole distributions on both sides: the exact KL (small vocabularies)
    old_full = torch.zeros(*resp.shape, samples[0].full.shape[1]) if exact else None
    score_rows(policy, ids, attn, torch.cat(minibatches)[len(minibatches[0]) :], old_lp, entropy, old_full)
    lengths = resp.sum(1).long()
    t_score = time.perf_counter()

    adv = torch.from_numpy(group_advantages(rewards, cfg.group_size)).float()
    grad_norms, clip_fracs = [], []
    for i, mb in enumerate(minibatches):
        new_lp, new_entropy, *full = policy.logprobs(ids[mb], attn[mb], grad=True, full=exact, entropy=i == 0)
        if i == 0:
            old_lp[mb], entropy[mb] = new_lp.detach(), new_entropy
            if exact:
                old_full[mb] = full[0]
        tis = torch.clamp(torch.exp(old_lp[mb] - inf_lp[mb]), max=cfg.tis_cap) if cfg.tis_cap else None
        loss, clip_frac = clipped_loss(new_lp, old_lp[mb], adv[mb], resp[mb], cfg.clip, tis)
        grad_norms.append(policy.step(loss))
        clip_fracs.append(clip_frac)
    train_lp = [old_lp[i][resp[i] > 0].numpy() for i in range(len(samples))]
    mismatch = mismatch_summary([s.logprobs for s in samples], train_lp, *(
        ([s.full for s in samples], [old_full[i][resp[i] > 0].numpy() for i in range(len(samples))]) if exact else ()),
        tis_cap=cfg.tis_cap or TIS_CAP)
    meter.watch(mismatch["k3"])
    t_update = time.perf_counter()
    engine.load_weights(policy.rollout_weights())
    t_sync = time.perf_counter()

    row = dict(step=step, reward=rewards.mean(), tokens=mismatch["tokens"], sampled_kl=mismatch["k1"] / UNIT,
               k3=mismatch["k3"] / UNIT, mean_abs_diff=mismatch["abs_diff_mean"], max_abs_diff=mismatch["abs_diff_max"],
               exact_kl=mismatch.get("exact_kl", np.nan) / UNIT, seq_k3=mismatch["k3_per_sequence"],
               seq_exact_kl=mismatch.get("exact_kl_per_sequence", np.nan), tis_weight=mismatch["tis_weight_mean"],
               seq_is_above_cap=mismatch["seq_is_ratio_above_cap"],
               entropy=(entropy * resp).sum().item() / resp.sum().item(), grad_norm=float(np.mean(grad_norms)),
               clip_frac=float(np.mean(clip_fracs)), response_len=lengths.float().mean().item(),
               padded_tokens=ids.numel(), real_tokens=int(attn.sum()),
               t_rollout=t_rollout - t0, t_score=t_score - t_rollout, t_update=t_update - t_score, t_sync=t_sync - t_update,
               eval_prompts=len(eval_split), eval_accuracy=np.nan, eval_accuracy_policy=np.nan)
    if step % cfg.eval_every == 0:
        row.update(evaluate_run(cfg, policy, engine, eval_split))
    return row


# ---- held-out accuracy, checkpoints ----------------------------------------------------------
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


CHECKPOINT, CHECKPOINT_HISTORY = "checkpoint.pt", "checkpoint.json"
# A checkpoint written before checkpoint.json kept the history in the .pt, its numbers numpy scalars. A scalar is
# rebuilt from its dtype and raw bytes (data only, no code): allowing these few numpy names lets `weights_only` load it.
LEGACY_NUMPY = [np._core.multiarray.scalar, np.dtype,
                *(type(np.dtype(kind)) for kind in ("float64", "float32", "int64", "int32", "bool"))]


class CheckpointError(ValueError):
    """A run folder's checkpoint that `train` will not resume from (unsafe to load, or its two files disagree)."""


def save_checkpoint(out_dir: Path, policy: Policy, step: int, history: list[dict]) -> None:
    """`checkpoint.pt` (weights, optimizer state, step: tensors and plain containers) and `checkpoint.json` (step and
    history), each atomically. The JSON goes first: a crash between the two leaves it ahead of the .pt, and cut at the
    .pt's step its history is the one the .pt went with (rows are only ever appended)."""
    record = json.dumps(dict(step=step, history=history), default=json_number)
    atomic_write(out_dir / CHECKPOINT_HISTORY, lambda p: p.write_text(record))
    state = dict(step=step, master=policy.master.state_dict(), opt=policy.opt.state_dict())
    atomic_write(out_dir / CHECKPOINT, lambda p: torch.save(state, p))


def json_number(value):
    """A numpy scalar of a history row as a Python number (np.float64 needs nothing: it is a float, JSON keeps its
    repr, which reads back to the same bits)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"a history row holds a {type(value).__name__}, not a number")


def load_checkpoint(out_dir: Path) -> tuple[dict, list[dict]] | None:
    """The state and history `save_checkpoint` left in `out_dir` (None: no checkpoint yet).

    `checkpoint.pt` is loaded with `weights_only=True`: tensors and plain containers only. A file holding anything
    else (a checkpoint dropped into a shared run folder can hold code that unpickling runs) is refused before any of
    it is built; the message says how to start the run over."""
    path = out_dir / CHECKPOINT
    if not path.exists():
        return None
    try:
        with torch.serialization.safe_globals(LEGACY_NUMPY):
            state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds more than tensors and plain containers ({refusal_reason(e)}); "
            "rla_lib never writes such a checkpoint, and loading it could run code, so it was not loaded. "
            f"Delete it (and {CHECKPOINT_HISTORY} beside it) to start the run over from step 0.") from None
    if not isinstance(state, dict) or not {"step", "master", "opt"} <= state.keys():
        raise CheckpointError(f"{path} is not a GRPO checkpoint (no step, master and opt): delete it to start over")
    if "history" in state:  # written before checkpoint.json: the history was kept in the .pt
        return state, list(state["history"])
    return state, history_at(out_dir / CHECKPOINT_HISTORY, state["step"])


def refusal_reason(error: Exception) -> str:
    """torch's reason for refusing a file under weights_only, without its advice (which offers loading it unsafely)."""
    lines = (line.strip().removeprefix("WeightsUnpickler error:").strip() for line in str(error).splitlines()[1:])
    advice = ("Please", "Check the documentation", "(1)", "(2)")
    return next((line.split(". Please")[0].rstrip(".") for line in lines if line and not line.startswith(advice)),
                "not loadable safely")


def history_at(path: Path, step: int) -> list[dict]:
    """`checkpoint.json`'s history through `step`, the .pt's (the JSON may be ahead: a crash between the writes)."""
    saved = json.loads(path.read_text()) if path.exists() else dict(step=None, history=[])
    history = [row for row in saved["history"] if row["step"] <= step]
    if not history or history[-1]["step"] != step:
        raise CheckpointError(f"{path.parent}: {CHECKPOINT} is at step {step} but {CHECKPOINT_HISTORY} "
                              f"{'is missing' if saved['step'] is None else 'stops at step ' + str(saved['step'])}: "
                              f"the run's history is lost; delete both files to start the run over from step 0")
    return history


def record_machine(path: Path) -> None:
    """Append this start's machine to the run's list: a run resumed elsewhere says so (BF16 kernels differ by CPU)."""
    starts = json.loads(path.read_text()) if path.exists() else []
    starts.append(dict(started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), machine=machine()))
    atomic_write(path, lambda p: p.write_text(json.dumps(starts, indent=1)))


# ---- the loop ------------------------------------------------------------------------------
def run(cfg: GRPOConfig, out_dir: Path, engine=None, progress: bool | None = None) -> pd.DataFrame:
    """Train, log, checkpoint; resume from the checkpoint in `out_dir` if any (`load_checkpoint`). Returns the history.

    progress: a bar over the steps (None: only in a Jupyter kernel, see `rla_lib.progress`).

    Pass an open `Engine` (in the run's precision) to reuse it across runs: its weights are reset
    to the run's starting weights first.
    """
    check_memory(resolve_model(cfg.model), BYTES_PER_PARAMETER, f"GRPO on {cfg.model}",
                 "Pass a smaller checkpoint as `model` (e.g. a narrower `rla_lib.real_shape` one) or use a larger machine.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.json"
    settings = dataclasses.asdict(cfg) | {"regions": list(cfg.regions)}
    if config_path.exists():  # resuming (or extending with more steps) needs the same settings otherwise
        saved = json.loads(config_path.read_text())
        # a setting added after the run was started is absent from its config.json: it ran with that setting's default
        defaults = dataclasses.asdict(GRPOConfig()) | {"regions": []}
        changed = sorted(k for k in settings if k != "steps" and saved.get(k, defaults[k]) != settings[k])
        if changed:
            raise ValueError(f"{out_dir} holds a run with different settings ({', '.join(changed)}); "
                             "use another out_dir, or delete it to start over")
    atomic_write(config_path, lambda p: p.write_text(json.dumps(settings, indent=1, sort_keys=True)))
    record_machine(out_dir / "machine.json")
    with reuse_freed_memory():  # each step's large tensors take the last step's memory, not freshly faulted pages
        return train(cfg, out_dir, engine, progress)


def train(cfg: GRPOConfig, out_dir: Path, engine, progress) -> pd.DataFrame:
    """`run`'s loop, in a folder it has checked."""
    torch.manual_seed(cfg.seed)
    policy = Policy(cfg)
    history, start = [], 1
    if loaded := load_checkpoint(out_dir):  # before the engine starts: a refused checkpoint costs nothing
        state, history = loaded
        policy.master.load_state_dict(state["master"])
        policy.opt.load_state_dict(state["opt"])
        policy.refresh_compute()
        start = state["step"] + 1
    own_engine = engine is None
    if own_engine:
        engine = Engine(cfg.model, mode=cfg.engine_mode, dtype=cfg.engine_dtype, seed=cfg.seed)
    engine.load_weights(policy.rollout_weights())

    held_out = task.load_split(task.eval_split_path(cfg.task))
    eval_split, exclude = held_out[: cfg.eval_prompts], {p.prompt for p in held_out}
    meter = MismatchMeter()  # warns where the mismatch rises
    if not history:  # step 0: the held-out accuracy before any update, the start of every curve
        history.append(dict(step=0, eval_prompts=len(eval_split), **evaluate_run(cfg, policy, engine, eval_split)))
    for row in history[1:]:
        meter.watch(row["k3"] * UNIT)
    # what exists now (torch, Transformers, vLLM and their modules: close to a million objects) lasts the run: a full
    # collection walked all of it, half a second now and then; frozen until the run ends, it walks the steps' own
    # (left alone where the caller has frozen objects already: unfreezing would undo theirs)
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        for step in bar(range(start, cfg.steps + 1), progress, initial=start - 1, total=cfg.steps, desc=out_dir.name):
            history.append(train_step(cfg, step, policy, engine, meter, eval_split, exclude))
            trim_freed_memory()  # what reuse_freed_memory keeps for the next step, bounded
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save_checkpoint(out_dir, policy, step, history)
                atomic_write(out_dir / "history.csv", lambda p: pd.DataFrame(history).to_csv(p, index=False))
    finally:
        if freeze:
            gc.unfreeze()
        if own_engine:
            engine.close()
    return pd.DataFrame(history)
