"""A mismatch monitor any trainer can call: per-token logprobs as torch tensors in, plain floats out.

RL trainers hold the two sides' logprobs of the sampled tokens as (B, T) tensors with a response mask:
TRL `sampling_per_token_logps` (inference) and `old_per_token_logps` (training) with `completion_mask`;
verl `rollout_log_probs` and `old_log_probs` with `response_mask`; OpenRLHF the same shape. Give them to
`mismatch_metrics` (one batch) or to a `MismatchMeter` (collects steps between two logs), or let the
`MismatchCallback` add the metrics to a `transformers.Trainer`'s logs. Padding (mask 0) is ignored, whatever
it holds (NaN included); every tensor is converted to float64 first, so BF16 logprobs lose nothing to the
arithmetic. The formulas live in `kl.mismatch_summary`, shared with `kl.MismatchMonitor`.

Metrics, with d = logp_inf - logp_train per response token and rho = exp(-d) = p_train / p_inf. Units: nats
per token (not the 1e-4 units of `kl`'s tables and `MismatchMonitor`), nats per response for the
`_per_sequence` keys; ratios and fractions have none. Token statistics pool every token of the batch.

    mismatch/k1                      mean d: the paper's KL(inference || training) estimator (unbiased, noisy)
    mismatch/k3                      mean(rho - 1 - log rho): unbiased too, never negative, less noisy
    mismatch/exact_kl                mean over positions of the full-vocabulary KL(p_inf || p_train); only when
                                     both sides' (B, T, V) log-probs are given (small vocabularies)
    mismatch/exact_kl_per_sequence   mean over responses of the exact KL summed over the response (with the above)
    mismatch/abs_diff_mean, _max     mean and max |d|
    mismatch/k1_per_sequence         mean over responses of sum_t d = log(p_inf(y) / p_train(y)): what a
                                     sequence-level importance ratio sees (it grows with length)
    mismatch/k3_per_sequence         mean over responses of the summed k3 terms
    mismatch/is_ratio_mean, _min, _max   of rho per token, untruncated (E[rho] is 1 when no mass is missing)
    mismatch/tis_weight_mean         mean min(rho, tis_cap): the token weight truncated importance sampling applies
    mismatch/is_ratio_above_cap      fraction of tokens with rho > tis_cap (the weights TIS truncates)
    mismatch/seq_is_ratio_above_cap  fraction of responses with prod_t rho > tis_cap (what sequence-level IS
                                     clips or masks: TRL's default `sequence_mask`)
    mismatch/tokens, mismatch/sequences  tokens and non-empty responses measured
    mismatch/nonfinite               response tokens left out because a side's token logprob there is NaN or
                                     infinite (or a full distribution holds a NaN): counted, not averaged into NaN

`tis_cap` defaults to 2.0 (verl's `rollout_is_threshold`); TRL's `vllm_importance_sampling_clip_max` is 3.0.

Next to TRL's own keys (logged when `vllm_importance_sampling_correction` is on):
`sampling/sampling_logp_difference/mean` and `/max` are mismatch/abs_diff_mean and _max (TRL averages
per-process values across processes);
`sampling/importance_sampling_ratio/{min,mean,max}` are taken after TRL's clip or mask (default: sequence-level
ratios, masked above 3), so they equal ours only in `token_truncate` mode with no lower clip, where
TRL's mean is mismatch/tis_weight_mean with tis_cap = clip_max.

verl's `rollout_corr/*` metrics (`verl/trainer/ppo/rollout_corr_helper.py`, `compute_offpolicy_metrics` and
`compute_is_metrics`; its `old_log_prob` is our training side, `rollout_log_prob` our inference side, and its
log_ratio is -d). Equal means equal by definition on the same masked tokens; verl computes in the input dtype.

    verl                                 ours                          relation
    rollout_corr/kl                      mismatch/k1                   equal: token mean of d
    rollout_corr/k3_kl                   mismatch/k3                   equal: token mean of rho - log rho - 1
    rollout_corr/log_ppl_diff            (mismatch/k1)                 differs: mean over responses of each
                                                                       response's mean d (one vote per response);
                                                                       equals k1 only if all lengths are equal
    rollout_corr/log_ppl_abs_diff        (mismatch/abs_diff_mean)      differs: mean over responses of |mean d|,
                                                                       ours is the token mean of |d| (never smaller
                                                                       at equal lengths)
    rollout_corr/log_ppl_diff_max, _min  -                             max / min over responses of their mean d
    rollout_corr/ppl_ratio               -                             mean over responses of exp(mean d)
    rollout_corr/training_ppl, _log_ppl, rollout_ppl, rollout_log_ppl   -   each side's perplexity, not a gap
    rollout_corr/chi2_token              -                             token mean of rho^2, minus 1
    rollout_corr/chi2_seq                -                             mean over responses of prod rho^2, minus 1
    rollout_corr/rollout_is_mean         mismatch/is_ratio_mean        equal with rollout_is="token" (verl clamps
                                                                       log rho to [-20, 20] first); with "sequence"
                                                                       verl averages sequence weights: differs
    rollout_corr/rollout_is_max, _min    mismatch/is_ratio_max, _min   equal with rollout_is="token" (same clamp)
    rollout_corr/rollout_is_ratio_fraction_high   mismatch/is_ratio_above_cap (rollout_is="token") or
                                         mismatch/seq_is_ratio_above_cap ("sequence"): equal with
                                         tis_cap = rollout_is_threshold
    rollout_corr/rollout_is_ratio_fraction_low, _std, _eff_sample_size, _seq_*   -   not computed here
    -                                    mismatch/exact_kl, k1_per_sequence, k3_per_sequence, abs_diff_max,
                                         tis_weight_mean   (verl has no counterpart)
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import TrainerCallback

from .kl import TIS_CAP, mismatch_summary

PREFIX = "mismatch/"
_COUNTS = ("tokens", "sequences", "nonfinite")


def _masked_rows(x: torch.Tensor, keep: torch.Tensor) -> list[np.ndarray]:
    """The kept entries of each row of a (B, T) or (B, T, V) tensor, as float64 arrays."""
    return [row[k].detach().to("cpu", torch.float64).numpy() for row, k in zip(x, keep)]


def _without_nan(full: torch.Tensor) -> torch.Tensor:
    """(B, T): whether each position's (V,) log-distribution holds no NaN (-inf is a zero probability), one row of
    the batch at a time (memory T * V)."""
    return torch.stack([~torch.isnan(row.detach()).any(-1).cpu() for row in full])


def mismatch_metrics(inference_logprobs: torch.Tensor, training_logprobs: torch.Tensor, mask: torch.Tensor,
                     inference_full: torch.Tensor | None = None, training_full: torch.Tensor | None = None,
                     tis_cap: float = TIS_CAP) -> dict[str, float]:
    """The mismatch metrics of one batch (keys and units in the module docstring).

    inference_logprobs, training_logprobs, mask: (B, T), the logprob of each sampled token on each side and
    which positions are response tokens (bool or 0/1). inference_full, training_full: optional (B, T, V)
    log-probabilities over the vocabulary from both sides, for mismatch/exact_kl; they are converted one
    response at a time, so memory grows with T * V, not B * T * V.
    """
    if not (inference_logprobs.shape == training_logprobs.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(f"logprobs and mask must share one (B, T) shape: {tuple(inference_logprobs.shape)}, "
                         f"{tuple(training_logprobs.shape)}, {tuple(mask.shape)}")
    keep = mask.detach().cpu() != 0
    finite = torch.isfinite(inference_logprobs.detach().cpu()) & torch.isfinite(training_logprobs.detach().cpu())
    full = None
    if (inference_full is None) != (training_full is None):
        raise ValueError("the exact KL needs both sides' full distributions")
    if inference_full is not None:
        if inference_full.shape != training_full.shape or inference_full.shape[:2] != mask.shape:
            raise ValueError(f"full distributions must be (B, T, V) on both sides: {tuple(inference_full.shape)}, "
                             f"{tuple(training_full.shape)} for a mask of {tuple(mask.shape)}")
        finite &= _without_nan(inference_full) & _without_nan(training_full)
    nonfinite = int((keep & ~finite).sum())
    keep &= finite
    if inference_full is not None:
        full = _masked_rows(inference_full, keep), _masked_rows(training_full, keep)
    summary = mismatch_summary(_masked_rows(inference_logprobs, keep), _masked_rows(training_logprobs, keep),
                               *(full or (None, None)), tis_cap=tis_cap)
    return {PREFIX + k: float(v) for k, v in summary.items()} | {PREFIX + "nonfinite": float(nonfinite)}


def combine(records: list[dict[str, float]]) -> dict[str, float]:
    """Several steps' metrics as one: counts summed, `_max` / `_min` keys by max / min, the rest averaged
    over steps (each step one vote, as TRL averages its own metrics between logs). Steps without tokens
    are left out."""
    records = [r for r in records if r.get(PREFIX + "tokens", 0) > 0]
    out = {}
    for key in dict.fromkeys(k for r in records for k in r):
        values = [r[key] for r in records if key in r]
        reduce = (sum if key.removeprefix(PREFIX) in _COUNTS else max if key.endswith("_max")
                  else min if key.endswith("_min") else np.mean)
        out[key] = float(reduce(values))
    return out


class MismatchMeter:
    """Collects the metrics of each step until the next log, for any training loop:

        meter = MismatchMeter()
        meter.record(rollout_log_probs, old_log_probs, response_mask)   # every step; returns that step's metrics
        logger.log(meter.flush())                                       # every logging step: combined, then reset
    """

    def __init__(self, tis_cap: float = TIS_CAP):
        self.tis_cap = tis_cap
        self.pending: list[dict[str, float]] = []

    def record(self, inference_logprobs, training_logprobs, mask, inference_full=None, training_full=None) -> dict:
        metrics = mismatch_metrics(inference_logprobs, training_logprobs, mask, inference_full, training_full,
                                   self.tis_cap)
        self.pending.append(metrics)
        return metrics

    def flush(self) -> dict[str, float]:
        """The steps recorded since the last flush, combined (`combine`); empty if none had tokens."""
        out, self.pending = combine(self.pending), []
        return out


class MismatchCallback(MismatchMeter, TrainerCallback):
    """A `transformers.TrainerCallback` that adds the recorded mismatch metrics to the Trainer's logs.

    The training loop calls `callback.record(...)` wherever it holds both sides' logprobs (with TRL: after
    `GRPOTrainer._generate_and_score_completions`, with its `sampling_per_token_logps`, `old_per_token_logps`
    and `completion_mask`). At each log the steps recorded since the previous one are combined into `logs`
    and into the entry the Trainer has just appended to `state.log_history`.

    The Trainer calls its reporting callbacks (wandb, tensorboard, ...) before the ones passed as
    `callbacks=[...]`, and they would log before these keys are added: `callback.attach(trainer)` puts
    this callback first instead.
    """

    def attach(self, trainer) -> MismatchCallback:
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or any(k.startswith("eval_") for k in logs):
            return  # an evaluation's log: the training steps' metrics wait for the next training log
        metrics = self.flush()
        if not metrics:
            return
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)
